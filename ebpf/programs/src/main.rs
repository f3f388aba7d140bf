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
//! Anything that is not a frontend is left untouched. Every program returns 1 (proceed): the
//! load balancer never refuses a syscall.
#![no_std]
#![no_main]
// eBPF programs read the context and maps through raw pointers: the kernel verifier, not
// rustc, checks those accesses. `unsafe` is confined to context access, helpers and map reads.
#![allow(unsafe_code)]

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::{cgroup_sock_addr, map},
    maps::{HashMap, LruHashMap},
    programs::SockAddrContext,
};
use mcs_ebpf_common::{
    AFFINITY_MAP_MAX_ENTRIES, AffinityKey, AffinityValue, BE_MAP_MAX_ENTRIES, Backend4, Backend6,
    REVNAT_MAP_MAX_ENTRIES, RevNat4Key, RevNat4Value, RevNat6Key, RevNat6Value, SVC_FLAG_AFFINITY,
    SVC_MAP_MAX_ENTRIES, Svc4Key, Svc6Key, SvcValue, proto,
};
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

/// Whether this socket's pod may create one more entry in the shared LRU maps now: at most
/// `NETNS_QUOTA_PER_WINDOW` per window and network namespace (approximate across CPUs). A pod
/// over its quota is still translated; only its new reverse/stickiness entries are skipped.
fn new_entry_allowed(ctx: &SockAddrContext) -> bool {
    let ns = netns_cookie(ctx);
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

/// The IPv4 backend (address, port; network byte order) of frontend `vip:port`/`p` for this
/// connection: the client's affinity entry while it holds, else a Maglev or random choice.
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
            if now.saturating_sub(last) < u64::from(timeout_s) * 1_000_000_000 {
                // Follow it only if the id still names that backend (ids are reused).
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

fn translate4(ctx: &SockAddrContext) -> Result<(), Skip> {
    // SAFETY: `sock_addr` is the kernel's context for this call; the verifier checks accesses.
    let sa = unsafe { &mut *ctx.sock_addr };
    let p = l4(sa)?;
    let (vip, port) = (sa.user_ip4, sa.user_port as u16);
    let (addr, bport) = select4(ctx, p, vip, port)?;
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
    if vip[0] == 0 && vip[1] == 0 && vip[2] == V4_MAPPED_WORD2 {
        // A dual-stack socket to an IPv4 ClusterSetIP written as ::ffff:a.b.c.d: translated
        // through the IPv4 maps (one owner, one affinity with IPv4 sockets) to the mapped
        // backend; getpeername/recvmsg6 turn it back through the IPv6 reverse map.
        let (addr, bport) = select4(ctx, p, vip[3], port)?;
        let backend = [0, 0, V4_MAPPED_WORD2, addr];
        let key = RevNat6Key {
            cookie: cookie(ctx),
            addr: backend,
            port: bport,
            _pad0: [0; 6],
        };
        let value = RevNat6Value {
            vip,
            port,
            _pad0: [0; 2],
        };
        note_revnat6(ctx, &key, &value);
        set_ip6(sa, backend);
        sa.user_port = u32::from(bport);
        return Ok(());
    }
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
            if now.saturating_sub(last) < u64::from(timeout_s) * 1_000_000_000 {
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

/// The kernel only lets GPL-compatible programs call some helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
