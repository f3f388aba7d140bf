//! Kernel-side programs of the socket load balancer.
//!
//! # Layout
//!
//! Each program is a thin entry point (`#[cgroup_sock_addr]`) around a `try_*` function that
//! returns `Result`; map types come from `mcs-ebpf-common`.
//!
//! - `connect4/6` (TCP, connected UDP) and `sendmsg4/6` (unconnected UDP): a destination that
//!   is a frontend `vip:port` is rewritten to one of its backends, and the reverse-NAT map
//!   remembers (socket cookie, backend) → VIP.
//! - `recvmsg4/6` (UDP source address) and `getpeername4/6`: a backend address of this socket
//!   is shown as the VIP the application asked for.
//!
//! - `sock_ops` (TCP sockets the connect hooks translated): passive health. A connect that
//!   fails (SYN answered by a reset or unreachable, or unanswered for one retransmission
//!   timeout) marks its backend failed for the client's pod; the connect hooks send that pod's
//!   new TCP connections to another selected backend, else to a fallback one, while the mark
//!   holds (see `mcs-ebpf-common`'s failed map).
//!
//! Anything that is not a frontend is left untouched. Every program returns 1 (proceed): the
//! load balancer never refuses a syscall.
#![no_std]
// `atomic_xadd`: BPF's atomic add (the skip counters, shared by every CPU).
#![feature(core_intrinsics)]
#![no_main]
// eBPF programs read the context and maps through raw pointers: the kernel verifier, not
// rustc, checks those accesses. `unsafe` is confined to context access, helpers and map reads.
#![allow(unsafe_code)]

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        BPF_TCP_CLOSE, BPF_TCP_SYN_SENT, bpf_sock_addr,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::{cgroup_sock_addr, map, sock_ops},
    maps::{HashMap, LruHashMap},
    programs::{SockAddrContext, SockOpsContext},
};
use mcs_ebpf_common::{
    AFFINITY_MAP_MAX_ENTRIES, AffinityKey, AffinityValue, BE_MAP_MAX_ENTRIES, Backend4, Backend6,
    REVNAT_MAP_MAX_ENTRIES, RevNat4Key, RevNat4Value, RevNat6Key, RevNat6Value, SVC_FLAG_AFFINITY,
    SVC_MAP_MAX_ENTRIES, Svc4Key, Svc6Key, SvcValue, proto,
};
use mcs_ebpf_common::{
    FAILED_MAP_MAX_ENTRIES, FALLBACK_SLOT_BASE, FailedKey, FailedValue, MAX_BACKENDS_PER_SVC,
    PROBE_LEASE_NS, REPICKS_PER_STAGE, failed_for_ns,
};
use mcs_ebpf_common::{FrontendKey, SKIPS_MAP_MAX_ENTRIES, SkipCounts};
use mcs_ebpf_common::{MAGLEV_MAP_MAX_ENTRIES, MAGLEV_TABLE_SIZE, MaglevKey, SVC_FLAG_MAGLEV};
use mcs_ebpf_common::{
    MEMBER_MAP_MAX_ENTRIES, MemberKey, SIZED_MAP_FLAGS, UDP_STICKY_MAP_MAX_ENTRIES,
};
use mcs_ebpf_common::{
    NETNS_QUOTA_PER_WINDOW, NETNS_QUOTA_WINDOW_NS, NetnsQuota, QUOTA_MAP_MAX_ENTRIES,
};

#[map(name = "MCS_SVC4_V1")]
static MCS_SVC4_V1: HashMap<Svc4Key, SvcValue> =
    HashMap::pinned(SVC_MAP_MAX_ENTRIES, SIZED_MAP_FLAGS);
#[map(name = "MCS_BE4_V1")]
static MCS_BE4_V1: HashMap<u32, Backend4> = HashMap::pinned(BE_MAP_MAX_ENTRIES, SIZED_MAP_FLAGS);
#[map(name = "MCS_SVC6_V1")]
static MCS_SVC6_V1: HashMap<Svc6Key, SvcValue> =
    HashMap::pinned(SVC_MAP_MAX_ENTRIES, SIZED_MAP_FLAGS);
#[map(name = "MCS_BE6_V1")]
static MCS_BE6_V1: HashMap<u32, Backend6> = HashMap::pinned(BE_MAP_MAX_ENTRIES, SIZED_MAP_FLAGS);
#[map(name = "MCS_REVNAT4_V1")]
static MCS_REVNAT4_V1: LruHashMap<RevNat4Key, RevNat4Value> =
    LruHashMap::pinned(REVNAT_MAP_MAX_ENTRIES, 0);
#[map(name = "MCS_REVNAT6_V1")]
static MCS_REVNAT6_V1: LruHashMap<RevNat6Key, RevNat6Value> =
    LruHashMap::pinned(REVNAT_MAP_MAX_ENTRIES, 0);

#[map(name = "MCS_AFFINITY_V1")]
static MCS_AFFINITY_V1: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(AFFINITY_MAP_MAX_ENTRIES, 0);

#[map(name = "MCS_MAGLEV_V1")]
static MCS_MAGLEV_V1: HashMap<MaglevKey, u32> =
    HashMap::pinned(MAGLEV_MAP_MAX_ENTRIES, SIZED_MAP_FLAGS);

#[map(name = "MCS_UDP_STICKY_V1")]
static MCS_UDP_STICKY_V1: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(UDP_STICKY_MAP_MAX_ENTRIES, 0);

#[map(name = "MCS_MEMBER_V1")]
static MCS_MEMBER_V1: HashMap<MemberKey, u32> =
    HashMap::pinned(MEMBER_MAP_MAX_ENTRIES, SIZED_MAP_FLAGS);

#[map(name = "MCS_NETNS_QUOTA_V1")]
static MCS_NETNS_QUOTA_V1: LruHashMap<u64, NetnsQuota> =
    LruHashMap::pinned(QUOTA_MAP_MAX_ENTRIES, 0);

#[map(name = "MCS_FAILED_V1")]
static MCS_FAILED_V1: LruHashMap<FailedKey, FailedValue> =
    LruHashMap::pinned(FAILED_MAP_MAX_ENTRIES, 0);

#[map(name = "MCS_SKIPS_V1")]
static MCS_SKIPS_V1: LruHashMap<FrontendKey, SkipCounts> =
    LruHashMap::pinned(SKIPS_MAP_MAX_ENTRIES, 0);

/// Counts a connect to the frontend `key` whose first choice was skipped, taken by a
/// `fallback` backend or a selected one (atomic adds: one entry for every CPU, skips are
/// rare). Not inlined: the callers are near the verifier's stack limit.
#[inline(never)]
fn count_skip(key: &FrontendKey, fallback: bool) {
    use core::intrinsics::{AtomicOrdering::Relaxed, atomic_xadd};
    match MCS_SKIPS_V1.get_ptr_mut(key) {
        Some(c) => {
            // SAFETY: a valid, 8-byte aligned pointer into the map's value, which lives as long
            // as the program runs (an entry evicted meanwhile is freed after an RCU grace
            // period); the adds are atomic (BPF's atomic add: the target has no `AtomicU64`
            // read-modify-write), as other CPUs add to the same value.
            unsafe {
                atomic_xadd::<u64, u64, { Relaxed }>(&raw mut (*c).skipped, 1);
                if fallback {
                    atomic_xadd::<u64, u64, { Relaxed }>(&raw mut (*c).fallback, 1);
                }
            }
        }
        None => {
            let first = SkipCounts {
                skipped: 1,
                fallback: u64::from(fallback),
            };
            let _ = MCS_SKIPS_V1.insert(key, &first, 0);
        }
    }
}

/// Whether this socket's pod may create one more entry in the shared LRU maps now (see
/// [`new_entry_allowed_in`]).
fn new_entry_allowed(ctx: &SockAddrContext) -> bool {
    new_entry_allowed_in(netns_cookie(ctx))
}

/// Whether the pod of network namespace `ns` may create one more entry in the shared LRU maps
/// now: at most `NETNS_QUOTA_PER_WINDOW` per window and network namespace (approximate across
/// CPUs). A pod over its quota is still translated; only its new reverse, stickiness and
/// failed-connect entries are skipped.
fn new_entry_allowed_in(ns: u64) -> bool {
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    match MCS_NETNS_QUOTA_V1.get_ptr_mut(&ns) {
        Some(q) => {
            // SAFETY: a valid pointer into the map value, used at once.
            let q = unsafe { &mut *q };
            if now.saturating_sub(q.window_start_ns) > NETNS_QUOTA_WINDOW_NS {
                q.window_start_ns = now;
                q.used = 1;
                true
            } else if q.used < NETNS_QUOTA_PER_WINDOW {
                q.used += 1;
                true
            } else {
                false
            }
        }
        None => {
            let q = NetnsQuota {
                window_start_ns: now,
                used: 1,
                _pad0: 0,
            };
            let _ = MCS_NETNS_QUOTA_V1.insert(&ns, &q, 0);
            true
        }
    }
}

/// Notes `key → value` in the IPv4 reverse map unless it holds it already (no write, no
/// quota for a datagram of a known flow); a new entry needs the pod's quota.
fn note_revnat4(ctx: &SockAddrContext, key: &RevNat4Key, value: &RevNat4Value) {
    // SAFETY: values copied out.
    if let Some(v) = unsafe { MCS_REVNAT4_V1.get(key) } {
        if v.vip == value.vip && v.port == value.port {
            return;
        }
    }
    if new_entry_allowed(ctx) {
        let _ = MCS_REVNAT4_V1.insert(key, value, 0);
    }
}

/// As [`note_revnat4`], IPv6.
fn note_revnat6(ctx: &SockAddrContext, key: &RevNat6Key, value: &RevNat6Value) {
    // SAFETY: values copied out.
    if let Some(v) = unsafe { MCS_REVNAT6_V1.get(key) } {
        if v.vip == value.vip && v.port == value.port {
            return;
        }
    }
    if new_entry_allowed(ctx) {
        let _ = MCS_REVNAT6_V1.insert(key, value, 0);
    }
}

/// Notes the socket's UDP backend unless already noted; a new entry needs the pod's quota.
fn note_sticky(ctx: &SockAddrContext, key: &AffinityKey, value: &AffinityValue) {
    // SAFETY: values copied out.
    if let Some(v) = unsafe { MCS_UDP_STICKY_V1.get(key) } {
        if v.backend_id == value.backend_id {
            return;
        }
    }
    if new_entry_allowed(ctx) {
        let _ = MCS_UDP_STICKY_V1.insert(key, value, 0);
    }
}

/// Whether backend `id` is selected for the frontend `svc_id` now.
fn is_member(svc_id: u32, id: u32) -> bool {
    // SAFETY: presence only.
    unsafe {
        MCS_MEMBER_V1
            .get(&MemberKey {
                svc_id,
                backend_id: id,
            })
            .is_some()
    }
}

/// Let the syscall go on.
const SYSCALL_PROCEED: i32 = 1;
const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;

/// Why a socket address was left alone.
enum Skip {
    NotFrontend,
    NoBackend,
}

fn l4(sa: &bpf_sock_addr) -> Result<u8, Skip> {
    match sa.type_ {
        SOCK_STREAM => Ok(proto::TCP),
        SOCK_DGRAM => Ok(proto::UDP),
        _ => Err(Skip::NotFrontend),
    }
}

fn cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: the helper takes the program's context.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

fn netns_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: the helper takes the program's context.
    unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
}

/// The backend slot or id for a new connection: the Maglev table (consistent per client
/// network namespace) when the frontend has one, else a random slot.
enum Choice {
    Slot(u16),
    Id(u32),
}

fn choose(ctx: &SockAddrContext, count: u16, flags: u8, svc_id: u32) -> Choice {
    if flags & SVC_FLAG_MAGLEV != 0 {
        let h = netns_cookie(ctx).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let key = MaglevKey {
            svc_id,
            index: ((h >> 32) % u64::from(MAGLEV_TABLE_SIZE)) as u32,
        };
        // SAFETY: value copied out.
        if let Some(id) = unsafe { MCS_MAGLEV_V1.get(&key) } {
            return Choice::Id(*id);
        }
    }
    Choice::Slot(pick(count))
}

fn pick(count: u16) -> u16 {
    // SAFETY: helper without arguments.
    (unsafe { bpf_get_prandom_u32() } % u32::from(count)) as u16 + 1
}

/// The failed map's key of backend `addr:port` for the pod of network namespace `ns`.
fn failed_key(ns: u64, addr: [u32; 4], port: u16, family: u8) -> FailedKey {
    FailedKey {
        netns_cookie: ns,
        addr,
        port,
        family,
        _pad0: [0; 5],
    }
}

/// Whether this pod's connects to the backend of `key` failed lately (its mark holds). An
/// ended mark is lent to this connect as a probe: the pod's other connects skip the backend
/// until the probe's outcome (or `PROBE_LEASE_NS`).
fn skipped(key: &FailedKey, now: u64) -> bool {
    let Some(v) = MCS_FAILED_V1.get_ptr_mut(key) else {
        return false;
    };
    // SAFETY: a valid pointer into the map value, used at once.
    let v = unsafe { &mut *v };
    if now < v.until_ns {
        return true;
    }
    v.until_ns = now + PROBE_LEASE_NS;
    v.probing = 1;
    false
}

/// Another backend of the IPv4 frontend of `k` (the client pod's affinity key: its network
/// namespace and the frontend) among slots `first..first+slots` (one
/// stage: the selected ones, or the fallback ones) that this pod did not fail on lately: up to
/// `REPICKS_PER_STAGE` slots from a random one, so the flows of a failed backend spread.
#[inline(never)]
fn repick4(k: &AffinityKey, now: u64, first: u16, slots: u16) -> Option<(u32, u32, u16)> {
    let (vip, port, p, ns) = (k.vip[0], k.port, k.proto, k.netns_cookie);
    if slots == 0 {
        return None;
    }
    let n = u32::from(slots);
    // SAFETY: helper without arguments.
    let start = unsafe { bpf_get_prandom_u32() } % n;
    let mut i = 0;
    while i < REPICKS_PER_STAGE && i < n {
        let slot = first + ((start + i) % n) as u16;
        // SAFETY: values copied out before the next map call.
        if let Some(s) = unsafe { MCS_SVC4_V1.get(&Svc4Key::new(vip, port, p, slot)) } {
            let id = s.backend_id;
            if let Some(be) = unsafe { MCS_BE4_V1.get(&id) } {
                let (addr, bport) = (be.addr, be.port);
                if !skipped(&failed_key(ns, [addr, 0, 0, 0], bport, 4), now) {
                    return Some((id, addr, bport));
                }
            }
        }
        i += 1;
    }
    None
}

/// As [`repick4`], IPv6.
#[inline(never)]
fn repick6(k: &AffinityKey, now: u64, first: u16, slots: u16) -> Option<(u32, [u32; 4], u16)> {
    let (vip, port, p, ns) = (k.vip, k.port, k.proto, k.netns_cookie);
    if slots == 0 {
        return None;
    }
    let n = u32::from(slots);
    // SAFETY: helper without arguments.
    let start = unsafe { bpf_get_prandom_u32() } % n;
    let mut i = 0;
    while i < REPICKS_PER_STAGE && i < n {
        let slot = first + ((start + i) % n) as u16;
        // SAFETY: values copied out before the next map call.
        if let Some(s) = unsafe { MCS_SVC6_V1.get(&Svc6Key::new(vip, port, p, slot)) } {
            let id = s.backend_id;
            if let Some(be) = unsafe { MCS_BE6_V1.get(&id) } {
                let (addr, bport) = (be.addr, be.port);
                if !skipped(&failed_key(ns, addr, bport, 6), now) {
                    return Some((id, addr, bport));
                }
            }
        }
        i += 1;
    }
    None
}

/// The number of fallback slots of a frontend, bounded so that slot numbers stay in `u16`.
fn fallback_slots(svc: &SvcValue) -> u16 {
    let n = svc.fallback_count();
    if n > u32::from(MAX_BACKENDS_PER_SVC) {
        MAX_BACKENDS_PER_SVC
    } else {
        n as u16
    }
}

/// The IPv4 backend (address, port; network byte order) of frontend `vip:port`/`p` for this
/// connection: the client's affinity entry while it holds, else a Maglev or random choice.
#[inline(never)]
fn select4(ctx: &SockAddrContext, p: u8, vip: u32, port: u16) -> Result<(u32, u16), Skip> {
    // SAFETY: values are copied out before any other map call.
    let svc =
        unsafe { MCS_SVC4_V1.get(&Svc4Key::new(vip, port, p, 0)) }.ok_or(Skip::NotFrontend)?;
    let (count, flags, timeout_s, svc_id) =
        (svc.count, svc.flags, svc.affinity_timeout_s, svc.rev_nat_id);
    if count == 0 {
        return Err(Skip::NoBackend);
    }
    let affinity = flags & SVC_FLAG_AFFINITY != 0;
    let akey = AffinityKey {
        netns_cookie: netns_cookie(ctx),
        vip: [vip, 0, 0, 0],
        port,
        proto: p,
        family: 4,
        _pad0: [0; 4],
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let mut chosen: Option<(u32, u32, u16)> = None;
    if affinity {
        // SAFETY: as above; values copied out.
        if let Some(a) = unsafe { MCS_AFFINITY_V1.get(&akey) } {
            let (id, aaddr, aport, last) = (a.backend_id, a.addr[0], a.port, a.last_used_ns);
            // Follow it only while that backend is selected (not a fallback one a failure sent
            // the client to) and the id still names it (ids are reused).
            if now.saturating_sub(last) < u64::from(timeout_s) * 1_000_000_000
                && is_member(svc_id, id)
            {
                if let Some(be) = unsafe { MCS_BE4_V1.get(&id) } {
                    if be.addr == aaddr && be.port == aport {
                        chosen = Some((id, aaddr, aport));
                    }
                }
            }
        }
    }
    // An unconnected UDP socket keeps its backend while it is selected (QUIC, DNS).
    let skey = AffinityKey {
        netns_cookie: cookie(ctx),
        ..akey
    };
    let udp = p == proto::UDP;
    if chosen.is_none() && udp {
        // SAFETY: values copied out.
        if let Some(s) = unsafe { MCS_UDP_STICKY_V1.get(&skey) } {
            let (id, saddr, sport) = (s.backend_id, s.addr[0], s.port);
            if is_member(svc_id, id) {
                if let Some(be) = unsafe { MCS_BE4_V1.get(&id) } {
                    if be.addr == saddr && be.port == sport {
                        chosen = Some((id, saddr, sport));
                    }
                }
            }
        }
    }
    let (id, addr, bport) = match chosen {
        Some(c) => c,
        None => {
            let id = match choose(ctx, count, flags, svc_id) {
                Choice::Id(id) => id,
                Choice::Slot(slot) => {
                    unsafe { MCS_SVC4_V1.get(&Svc4Key::new(vip, port, p, slot)) }
                        .ok_or(Skip::NoBackend)?
                        .backend_id
                }
            };
            let be = unsafe { MCS_BE4_V1.get(&id) }.ok_or(Skip::NoBackend)?;
            (id, be.addr, be.port)
        }
    };
    let v = AffinityValue {
        last_used_ns: now,
        backend_id: id,
        port: bport,
        _pad0: [0; 2],
        addr: [addr, 0, 0, 0],
    };
    if affinity {
        let _ = MCS_AFFINITY_V1.insert(&akey, &v, 0);
    }
    if udp {
        note_sticky(ctx, &skey, &v);
    }
    Ok((addr, bport))
}

/// Passive health (TCP): if this pod failed on the backend `chosen` lately, another selected
/// backend of the IPv4 frontend `vip:port`/`p` takes the connect, else a fallback one (and
/// the client's affinity follows); if every one tried failed lately, `chosen` stands. Not
/// inlined, beside the selection rather than in it, for the verifier's 512-byte stack.
#[inline(never)]
fn healthy4(ctx: &SockAddrContext, p: u8, vip: u32, port: u16, chosen: &mut (u32, u16)) {
    if p != proto::TCP {
        return;
    }
    let ns = netns_cookie(ctx);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if !skipped(&failed_key(ns, [chosen.0, 0, 0, 0], chosen.1, 4), now) {
        return;
    }
    // SAFETY: values copied out.
    let Some(svc) = (unsafe { MCS_SVC4_V1.get(&Svc4Key::new(vip, port, p, 0)) }) else {
        return;
    };
    let (count, flags, fallback) = (svc.count, svc.flags, fallback_slots(svc));
    let akey = AffinityKey {
        netns_cookie: ns,
        vip: [vip, 0, 0, 0],
        port,
        proto: p,
        family: 4,
        _pad0: [0; 4],
    };
    // Another selected backend (the client's affinity follows it), else a fallback one (the
    // affinity stays: it follows selected backends only).
    let (id, addr, bport, selected) = match repick4(&akey, now, 1, count) {
        Some((id, addr, bport)) => (id, addr, bport, true),
        None => match repick4(&akey, now, FALLBACK_SLOT_BASE, fallback) {
            Some((id, addr, bport)) => (id, addr, bport, false),
            None => return,
        },
    };
    if selected && flags & SVC_FLAG_AFFINITY != 0 {
        let v = AffinityValue {
            last_used_ns: now,
            backend_id: id,
            port: bport,
            _pad0: [0; 2],
            addr: [addr, 0, 0, 0],
        };
        let _ = MCS_AFFINITY_V1.insert(&akey, &v, 0);
    }
    let fkey = FrontendKey {
        addr: [vip, 0, 0, 0],
        port,
        proto: p,
        family: 4,
    };
    count_skip(&fkey, !selected);
    *chosen = (addr, bport);
}

/// As [`healthy4`], IPv6.
#[inline(never)]
fn healthy6(ctx: &SockAddrContext, p: u8, vip: &[u32; 4], port: u16, chosen: &mut ([u32; 4], u16)) {
    if p != proto::TCP {
        return;
    }
    let ns = netns_cookie(ctx);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if !skipped(&failed_key(ns, chosen.0, chosen.1, 6), now) {
        return;
    }
    // SAFETY: values copied out.
    let Some(svc) = (unsafe { MCS_SVC6_V1.get(&Svc6Key::new(*vip, port, p, 0)) }) else {
        return;
    };
    let (count, flags, fallback) = (svc.count, svc.flags, fallback_slots(svc));
    let akey = AffinityKey {
        netns_cookie: ns,
        vip: *vip,
        port,
        proto: p,
        family: 6,
        _pad0: [0; 4],
    };
    // Another selected backend (the client's affinity follows it), else a fallback one (the
    // affinity stays: it follows selected backends only).
    let (id, addr, bport, selected) = match repick6(&akey, now, 1, count) {
        Some((id, addr, bport)) => (id, addr, bport, true),
        None => match repick6(&akey, now, FALLBACK_SLOT_BASE, fallback) {
            Some((id, addr, bport)) => (id, addr, bport, false),
            None => return,
        },
    };
    if selected && flags & SVC_FLAG_AFFINITY != 0 {
        let v = AffinityValue {
            last_used_ns: now,
            backend_id: id,
            port: bport,
            _pad0: [0; 2],
            addr,
        };
        let _ = MCS_AFFINITY_V1.insert(&akey, &v, 0);
    }
    let fkey = FrontendKey {
        addr: *vip,
        port,
        proto: p,
        family: 6,
    };
    count_skip(&fkey, !selected);
    *chosen = (addr, bport);
}

fn translate4(ctx: &SockAddrContext) -> Result<(), Skip> {
    // SAFETY: `sock_addr` is the kernel's context for this call; the verifier checks accesses.
    let sa = unsafe { &mut *ctx.sock_addr };
    let p = l4(sa)?;
    let (vip, port) = (sa.user_ip4, sa.user_port as u16);
    let mut chosen = select4(ctx, p, vip, port)?;
    healthy4(ctx, p, vip, port, &mut chosen);
    let (addr, bport) = chosen;
    let key = RevNat4Key {
        cookie: cookie(ctx),
        addr,
        port: bport,
        _pad0: [0; 2],
    };
    let value = RevNat4Value {
        vip,
        port,
        _pad0: [0; 2],
    };
    note_revnat4(ctx, &key, &value);
    sa.user_ip4 = addr;
    sa.user_port = u32::from(bport);
    Ok(())
}

fn reverse4(ctx: &SockAddrContext) -> Result<(), Skip> {
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = RevNat4Key {
        cookie: cookie(ctx),
        addr: sa.user_ip4,
        port: sa.user_port as u16,
        _pad0: [0; 2],
    };
    let v = unsafe { MCS_REVNAT4_V1.get(&key) }.ok_or(Skip::NotFrontend)?;
    let (vip, port) = (v.vip, v.port);
    sa.user_ip4 = vip;
    sa.user_port = u32::from(port);
    Ok(())
}

fn ip6(sa: &bpf_sock_addr) -> [u32; 4] {
    [
        sa.user_ip6[0],
        sa.user_ip6[1],
        sa.user_ip6[2],
        sa.user_ip6[3],
    ]
}

fn set_ip6(sa: &mut bpf_sock_addr, a: [u32; 4]) {
    sa.user_ip6[0] = a[0];
    sa.user_ip6[1] = a[1];
    sa.user_ip6[2] = a[2];
    sa.user_ip6[3] = a[3];
}

/// The third word of an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), as the context holds it
/// (bytes 0, 0, 0xff, 0xff in network order).
const V4_MAPPED_WORD2: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

fn translate6(ctx: &SockAddrContext) -> Result<(), Skip> {
    let sa = unsafe { &mut *ctx.sock_addr };
    let p = l4(sa)?;
    let (vip, port) = (ip6(sa), sa.user_port as u16);
    let (addr, bport) = if vip[0] == 0 && vip[1] == 0 && vip[2] == V4_MAPPED_WORD2 {
        // A dual-stack socket to an IPv4 ClusterSetIP written as ::ffff:a.b.c.d: translated
        // through the IPv4 maps (one owner, one affinity with IPv4 sockets) to the mapped
        // backend; getpeername/recvmsg6 turn it back through the IPv6 reverse map.
        let mut chosen = select4(ctx, p, vip[3], port)?;
        healthy4(ctx, p, vip[3], port, &mut chosen);
        ([0, 0, V4_MAPPED_WORD2, chosen.0], chosen.1)
    } else {
        let mut chosen = select6(ctx, p, vip, port)?;
        healthy6(ctx, p, &vip, port, &mut chosen);
        chosen
    };
    let key = RevNat6Key {
        cookie: cookie(ctx),
        addr,
        port: bport,
        _pad0: [0; 6],
    };
    let value = RevNat6Value {
        vip,
        port,
        _pad0: [0; 2],
    };
    note_revnat6(ctx, &key, &value);
    set_ip6(sa, addr);
    sa.user_port = u32::from(bport);
    Ok(())
}

/// The IPv6 backend (address, port; network byte order) of frontend `vip:port`/`p`, as
/// [`select4`]. Not inlined, as `select4`, so that the connect hook's stack stays within the
/// verifier's 512 bytes.
#[inline(never)]
fn select6(
    ctx: &SockAddrContext,
    p: u8,
    vip: [u32; 4],
    port: u16,
) -> Result<([u32; 4], u16), Skip> {
    let svc =
        unsafe { MCS_SVC6_V1.get(&Svc6Key::new(vip, port, p, 0)) }.ok_or(Skip::NotFrontend)?;
    let (count, flags, timeout_s, svc_id) =
        (svc.count, svc.flags, svc.affinity_timeout_s, svc.rev_nat_id);
    if count == 0 {
        return Err(Skip::NoBackend);
    }
    let affinity = flags & SVC_FLAG_AFFINITY != 0;
    let akey = AffinityKey {
        netns_cookie: netns_cookie(ctx),
        vip,
        port,
        proto: p,
        family: 6,
        _pad0: [0; 4],
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let mut chosen: Option<(u32, [u32; 4], u16)> = None;
    if affinity {
        // SAFETY: as above; values copied out.
        if let Some(a) = unsafe { MCS_AFFINITY_V1.get(&akey) } {
            let (id, aaddr, aport, last) = (a.backend_id, a.addr, a.port, a.last_used_ns);
            if now.saturating_sub(last) < u64::from(timeout_s) * 1_000_000_000
                && is_member(svc_id, id)
            {
                if let Some(be) = unsafe { MCS_BE6_V1.get(&id) } {
                    if be.addr == aaddr && be.port == aport {
                        chosen = Some((id, aaddr, aport));
                    }
                }
            }
        }
    }
    let skey = AffinityKey {
        netns_cookie: cookie(ctx),
        ..akey
    };
    let udp = p == proto::UDP;
    if chosen.is_none() && udp {
        // SAFETY: values copied out.
        if let Some(s) = unsafe { MCS_UDP_STICKY_V1.get(&skey) } {
            let (id, saddr, sport) = (s.backend_id, s.addr, s.port);
            if is_member(svc_id, id) {
                if let Some(be) = unsafe { MCS_BE6_V1.get(&id) } {
                    if be.addr == saddr && be.port == sport {
                        chosen = Some((id, saddr, sport));
                    }
                }
            }
        }
    }
    let (id, addr, bport) = match chosen {
        Some(c) => c,
        None => {
            let id = match choose(ctx, count, flags, svc_id) {
                Choice::Id(id) => id,
                Choice::Slot(slot) => {
                    unsafe { MCS_SVC6_V1.get(&Svc6Key::new(vip, port, p, slot)) }
                        .ok_or(Skip::NoBackend)?
                        .backend_id
                }
            };
            let be = unsafe { MCS_BE6_V1.get(&id) }.ok_or(Skip::NoBackend)?;
            (id, be.addr, be.port)
        }
    };
    let v = AffinityValue {
        last_used_ns: now,
        backend_id: id,
        port: bport,
        _pad0: [0; 2],
        addr,
    };
    if affinity {
        let _ = MCS_AFFINITY_V1.insert(&akey, &v, 0);
    }
    if udp {
        note_sticky(ctx, &skey, &v);
    }
    Ok((addr, bport))
}

fn reverse6(ctx: &SockAddrContext) -> Result<(), Skip> {
    let sa = unsafe { &mut *ctx.sock_addr };
    let addr = ip6(sa);
    let key = RevNat6Key {
        cookie: cookie(ctx),
        addr,
        port: sa.user_port as u16,
        _pad0: [0; 6],
    };
    if let Some(v) = unsafe { MCS_REVNAT6_V1.get(&key) } {
        let (vip, port) = (v.vip, v.port);
        set_ip6(sa, vip);
        sa.user_port = u32::from(port);
        return Ok(());
    }
    if addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_WORD2 {
        // A dual-stack socket's unconnected UDP to a mapped VIP is sent through udp_sendmsg,
        // so sendmsg4 translated it and noted it in the IPv4 reverse map.
        let key4 = RevNat4Key {
            cookie: key.cookie,
            addr: addr[3],
            port: key.port,
            _pad0: [0; 2],
        };
        let v = unsafe { MCS_REVNAT4_V1.get(&key4) }.ok_or(Skip::NotFrontend)?;
        let (vip, port) = (v.vip, v.port);
        set_ip6(sa, [0, 0, V4_MAPPED_WORD2, vip]);
        sa.user_port = u32::from(port);
        return Ok(());
    }
    Err(Skip::NotFrontend)
}

macro_rules! hook {
    ($name:ident, $attach:ident, $f:ident) => {
        #[cgroup_sock_addr($attach)]
        pub fn $name(ctx: SockAddrContext) -> i32 {
            // Whatever happens inside, the syscall proceeds: at worst untranslated.
            let _ = $f(&ctx);
            SYSCALL_PROCEED
        }
    };
}

hook!(mcs_connect4, connect4, translate4);
hook!(mcs_sendmsg4, sendmsg4, translate4);
hook!(mcs_recvmsg4, recvmsg4, reverse4);
hook!(mcs_getpeername4, getpeername4, reverse4);
hook!(mcs_connect6, connect6, translate6);
hook!(mcs_sendmsg6, sendmsg6, translate6);
hook!(mcs_recvmsg6, recvmsg6, reverse6);
hook!(mcs_getpeername6, getpeername6, reverse6);

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// The socket's peer address (IPv6), word by word: the verifier allows only 32-bit reads of
/// the context's address fields.
fn remote_ip6(ctx: &SockOpsContext) -> [u32; 4] {
    // SAFETY: the kernel's context for this call; each read is one aligned 32-bit field.
    unsafe {
        let a = &(*ctx.ops).remote_ip6;
        [
            core::ptr::read_volatile(&a[0]),
            core::ptr::read_volatile(&a[1]),
            core::ptr::read_volatile(&a[2]),
            core::ptr::read_volatile(&a[3]),
        ]
    }
}

/// The failed map's key of this socket's peer (an IPv4-mapped IPv6 peer keyed as IPv4, as the
/// connect hooks key it).
fn peer_key(ctx: &SockOpsContext) -> Option<FailedKey> {
    // The kernel gives the peer's port in network order in the upper 16 bits.
    let port = (ctx.remote_port() >> 16) as u16;
    // SAFETY: the helper takes the program's context.
    let ns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    match ctx.family() {
        AF_INET => Some(failed_key(ns, [ctx.remote_ip4(), 0, 0, 0], port, 4)),
        AF_INET6 => {
            let a = remote_ip6(ctx);
            if a[0] == 0 && a[1] == 0 && a[2] == V4_MAPPED_WORD2 {
                Some(failed_key(ns, [a[3], 0, 0, 0], port, 4))
            } else {
                Some(failed_key(ns, a, port, 6))
            }
        }
        _ => None,
    }
}

/// Whether a connect hook translated this socket to its peer (the reverse map knows it).
fn translated(ctx: &SockOpsContext) -> bool {
    // SAFETY: the helper takes the program's context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let port = (ctx.remote_port() >> 16) as u16;
    // SAFETY: presence only.
    unsafe {
        match ctx.family() {
            AF_INET => MCS_REVNAT4_V1
                .get(&RevNat4Key {
                    cookie,
                    addr: ctx.remote_ip4(),
                    port,
                    _pad0: [0; 2],
                })
                .is_some(),
            AF_INET6 => MCS_REVNAT6_V1
                .get(&RevNat6Key {
                    cookie,
                    addr: remote_ip6(ctx),
                    port,
                    _pad0: [0; 6],
                })
                .is_some(),
            _ => false,
        }
    }
}

/// A connect to the peer failed: marked for `failed_for_ns(failures in a row)`. Failures while
/// the mark holds (connects already under way) are not counted; a failed probe is.
fn connect_failed(ctx: &SockOpsContext) {
    let Some(key) = peer_key(ctx) else {
        return;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    match MCS_FAILED_V1.get_ptr_mut(&key) {
        Some(v) => {
            // SAFETY: a valid pointer into the map value, used at once.
            let v = unsafe { &mut *v };
            if v.probing != 0 || now >= v.until_ns {
                v.failures = v.failures.saturating_add(1);
                v.until_ns = now + failed_for_ns(v.failures);
                v.probing = 0;
            }
        }
        None => {
            if new_entry_allowed_in(key.netns_cookie) {
                let v = FailedValue {
                    until_ns: now + failed_for_ns(1),
                    failures: 1,
                    probing: 0,
                };
                let _ = MCS_FAILED_V1.insert(&key, &v, 0);
            }
        }
    }
}

fn passive_health(ctx: &SockOpsContext) {
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            // Callbacks for translated connects (added to what other programs asked for, never
            // taken from them); every callback checks again that its socket is translated, so
            // a socket connected again elsewhere (after `connect(AF_UNSPEC)`) marks nothing.
            if translated(ctx) {
                let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
                if flags != ctx.cb_flags() {
                    let _ = ctx.set_cb_flags(flags as i32);
                }
            }
        }
        BPF_SOCK_OPS_STATE_CB => {
            if ctx.arg(0) == BPF_TCP_SYN_SENT && ctx.arg(1) == BPF_TCP_CLOSE && translated(ctx) {
                connect_failed(ctx);
            }
        }
        BPF_SOCK_OPS_RTO_CB => {
            // SAFETY: the kernel's context for this call.
            if unsafe { (*ctx.ops).state } == BPF_TCP_SYN_SENT && translated(ctx) {
                connect_failed(ctx);
            }
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            if ctx.cb_flags() & BPF_SOCK_OPS_STATE_CB_FLAG != 0 && translated(ctx) {
                if let Some(key) = peer_key(ctx) {
                    let _ = MCS_FAILED_V1.remove(&key);
                }
            }
        }
        _ => {}
    }
}

/// Passive health of translated TCP connects (see the module's docs).
#[sock_ops]
pub fn mcs_sock_ops(ctx: SockOpsContext) -> u32 {
    passive_health(&ctx);
    1
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

/// The kernel only lets GPL-compatible programs call some helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
