//! Map key and value types shared by the kernel-side programs (`ebpf/programs`) and the
//! userspace loader (`proxy`). Defined once here so the two sides cannot drift.
//!
//! # Layout rules
//!
//! - Every type is `#[repr(C)]`, `Copy`, and has explicit `_pad*` fields so that there is no
//!   implicit padding (the kernel compares keys byte-wise; uninitialised padding would make
//!   equal keys differ). Padding fields are always written as zero.
//! - No `bool`: flags are `u8`/`u32` bit sets.
//! - Each network field documents its byte order. Addresses and ports are kept in **network
//!   byte order** exactly as the kernel hands them to `cgroup/connect4` (`bpf_sock_addr`
//!   `user_ip4` and the low 16 bits of `user_port`), so the hot path never swaps bytes.
//! - Map names carry a version suffix (`_V1`); a layout change gets a new name, so an agent
//!   never adopts a pinned map of another layout.
//!
//! # Services map (`MCS_SVC4_V1`)
//!
//! Key [`Svc4Key`] `{vip, port, proto, slot}`. Slot 0 is the frontend: its [`SvcValue`] holds
//! the number of backends `count` and flags. Slots `1..=count` hold one backend id each in
//! [`SvcValue::backend_id`]. Writers put new backend slots first and the frontend (with the
//! new count) last, and free stale slots after that, so a concurrent `connect()` never sees a
//! count that points to a missing slot.
//!
//! Slot 0's [`SvcValue::backend_id`] holds the number of **fallback** slots:
//! `FALLBACK_SLOT_BASE..FALLBACK_SLOT_BASE+fallback` name backends (another zone's, another
//! cluster's) that a TCP connect is sent to only when every selected backend it tried failed
//! on its pod lately (see the failed map). They sit apart from the selected slots, so a
//! connect that reads an old count while the frontend is rewritten never takes a fallback
//! backend for a selected one. Programs from before fallback slots read only `1..=count`
//! and never see them.
//!
//! # Backends map (`MCS_BE4_V1`)
//!
//! Backend id (`u32`, never 0) → [`Backend4`].
//!
//! # Failed map (`MCS_FAILED_V1`)
//!
//! Passive health, per client pod: [`FailedKey`] (the client's network namespace and a
//! backend address) → [`FailedValue`]. The `sock_ops` program marks a backend when a
//! translated TCP connect to it fails (its SYN answered by a reset or unreachable, or
//! unanswered for one retransmission timeout); the connect hook then sends that pod's new
//! connections to another backend until the mark ends ([`failed_for_ns`]: 1 s doubling to
//! 30 s). An ended mark is lent to one connect as a probe; a connect that succeeds removes it.
//! Keyed by the pod, so no pod can steer another pod's traffic by failing its own connects.
//!
//! # Skip counters (`MCS_SKIPS_V1`)
//!
//! Per frontend ([`FrontendKey`]): connects whose first choice was skipped for a mark of the
//! failed map and that another backend took ([`SkipCounts`]), and how many of those a
//! fallback backend took, added atomically. An LRU map of [`SKIPS_MAP_MAX_ENTRIES`]: a
//! frontend's entry is made at its first skip (frontends are bounded by the services map, so
//! no pod can flood it) and removed by the agent when the frontend leaves.
#![no_std]
// `unsafe` is denied (workspace lint) and allowed only in the `pod` module below, which says why.

/// Name of the IPv4 services map (frontend at slot 0, backends at 1..=count).
pub const SVC4_MAP: &str = "MCS_SVC4_V1";
/// Name of the IPv4 backends map (backend id → address).
pub const BE4_MAP: &str = "MCS_BE4_V1";
/// Name of the IPv6 services map.
pub const SVC6_MAP: &str = "MCS_SVC6_V1";
/// Name of the IPv6 backends map.
pub const BE6_MAP: &str = "MCS_BE6_V1";
/// Name of the IPv4 reverse-NAT LRU map (socket cookie + backend → VIP).
pub const REVNAT4_MAP: &str = "MCS_REVNAT4_V1";
/// Name of the IPv6 reverse-NAT LRU map.
pub const REVNAT6_MAP: &str = "MCS_REVNAT6_V1";
/// Name of the ClientIP affinity LRU map (client netns + frontend → backend).
pub const AFFINITY_MAP: &str = "MCS_AFFINITY_V1";
/// Entries of the affinity LRU map.
pub const AFFINITY_MAP_MAX_ENTRIES: u32 = 262_144;
/// Name of the Maglev lookup map ((service id, index) → backend id), filled in userspace.
pub const MAGLEV_MAP: &str = "MCS_MAGLEV_V1";
/// Size of each service's Maglev table (a prime).
pub const MAGLEV_TABLE_SIZE: u32 = 251;
/// Entries of the Maglev map in the object: tables of 4096 services. The loader sizes it from
/// the agent's caps when Maglev is selected (see [`SVC_MAP_MAX_ENTRIES`]).
pub const MAGLEV_MAP_MAX_ENTRIES: u32 = MAGLEV_TABLE_SIZE * 4096;
/// Name of the UDP stickiness LRU map (socket cookie + frontend → backend): an unconnected
/// UDP socket keeps its backend for a VIP while that backend is selected. Key and value are
/// [`AffinityKey`] (with the socket cookie in place of the netns cookie) and
/// [`AffinityValue`].
pub const UDP_STICKY_MAP: &str = "MCS_UDP_STICKY_V1";
/// Entries of the UDP stickiness LRU map.
pub const UDP_STICKY_MAP_MAX_ENTRIES: u32 = 262_144;
/// Name of the membership map ((frontend `rev_nat_id`, backend id) → 1): whether a backend is
/// selected for a frontend now, in one lookup. Written by userspace.
pub const MEMBER_MAP: &str = "MCS_MEMBER_V1";
/// Entries of the membership map in the object (every slot of both families); sized by the
/// loader.
pub const MEMBER_MAP_MAX_ENTRIES: u32 = 2 * SVC_MAP_MAX_ENTRIES;
/// Name of the per-network-namespace quota map (netns cookie → [`NetnsQuota`]): how many new
/// entries of the shared LRU maps (reverse NAT, UDP stickiness) one pod may create per
/// window, so that no pod can flush the entries the others depend on.
pub const QUOTA_MAP: &str = "MCS_NETNS_QUOTA_V1";
/// Entries of the quota map (pods on a node).
pub const QUOTA_MAP_MAX_ENTRIES: u32 = 65_536;
/// New shared-LRU entries one network namespace may create per window.
pub const NETNS_QUOTA_PER_WINDOW: u32 = 4_096;
/// The quota window, in nanoseconds.
pub const NETNS_QUOTA_WINDOW_NS: u64 = 1_000_000_000;
/// Name of the failed-connect LRU map (client netns + backend → [`FailedValue`]).
pub const FAILED_MAP: &str = "MCS_FAILED_V1";
/// Entries of the failed-connect LRU map.
pub const FAILED_MAP_MAX_ENTRIES: u32 = 65_536;
/// Name of the per-frontend skip counters (LRU hash: [`FrontendKey`] → [`SkipCounts`]).
pub const SKIPS_MAP: &str = "MCS_SKIPS_V1";
/// Entries of the skip counters map (frontends that skipped a backend).
pub const SKIPS_MAP_MAX_ENTRIES: u32 = 16_384;
/// How long a first failed connect keeps a backend skipped, in nanoseconds.
pub const FAILED_FIRST_NS: u64 = 1_000_000_000;
/// The longest a backend stays skipped after failures in a row, in nanoseconds.
pub const FAILED_MAX_NS: u64 = 30_000_000_000;
/// How long an ended mark is lent to the connect that probes it (the pod's other connects skip
/// the backend meanwhile), in nanoseconds: the probe's outcome ends the lease sooner.
pub const PROBE_LEASE_NS: u64 = 2_000_000_000;
/// Other slots of a stage a connect tries when its first choice is skipped.
pub const REPICKS_PER_STAGE: u32 = 8;

/// How long a backend is skipped after `failures` failed connects in a row (at least 1):
/// 1 s, 2 s, 4 s, 8 s, 16 s, then 30 s.
pub const fn failed_for_ns(failures: u32) -> u64 {
    let doublings = if failures == 0 { 0 } else { failures - 1 };
    let doublings = if doublings > 5 { 5 } else { doublings };
    let ns = FAILED_FIRST_NS << doublings;
    if ns > FAILED_MAX_NS {
        FAILED_MAX_NS
    } else {
        ns
    }
}

/// Every map, for pinning and status.
pub const ALL_MAPS: [&str; 13] = [
    SVC4_MAP,
    BE4_MAP,
    SVC6_MAP,
    BE6_MAP,
    REVNAT4_MAP,
    REVNAT6_MAP,
    AFFINITY_MAP,
    MAGLEV_MAP,
    UDP_STICKY_MAP,
    MEMBER_MAP,
    QUOTA_MAP,
    FAILED_MAP,
    SKIPS_MAP,
];
/// Entries of each reverse-NAT LRU map.
pub const REVNAT_MAP_MAX_ENTRIES: u32 = 262_144;
/// Entries of each services map (frontends + backend slots) in the object. The loader replaces
/// the sizes of the services, backends, membership and Maglev maps with ones computed from the
/// agent's caps (`--max-frontends`, `--max-backends`) when it creates them; a pinned map keeps
/// the size it was created with.
pub const SVC_MAP_MAX_ENTRIES: u32 = 65_536;
/// Entries of each backends map in the object (sized by the loader, as the services map).
pub const BE_MAP_MAX_ENTRIES: u32 = 65_536;
/// Flags of the maps the loader sizes from the caps: `BPF_F_NO_PREALLOC`. Their entries are
/// allocated when written, so a size that fits the largest table the caps admit costs kernel
/// memory only for what is programmed (and the hash buckets, 16 bytes per power-of-two slot).
/// Only userspace writes these maps; the programs only look up.
pub const SIZED_MAP_FLAGS: u32 = 1;
/// Largest number of backends one frontend may have (slots 1..=MAX_BACKENDS_PER_SVC).
pub const MAX_BACKENDS_PER_SVC: u16 = 1024;
/// The first fallback slot of a frontend (its fallback backends are at
/// `FALLBACK_SLOT_BASE..FALLBACK_SLOT_BASE+fallback`, at most [`MAX_BACKENDS_PER_SVC`]).
pub const FALLBACK_SLOT_BASE: u16 = MAX_BACKENDS_PER_SVC + 1;

/// IP protocol numbers as used in [`Svc4Key::proto`] (IANA, same as `IPPROTO_*`).
pub mod proto {
    /// `IPPROTO_TCP`.
    pub const TCP: u8 = 6;
    /// `IPPROTO_UDP`.
    pub const UDP: u8 = 17;
    /// `IPPROTO_SCTP`.
    pub const SCTP: u8 = 132;
}

/// Key of the services map, IPv4.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Svc4Key {
    /// ClusterSetIP, network byte order (as `bpf_sock_addr.user_ip4`).
    pub vip: u32,
    /// Service port, network byte order (low 16 bits of `bpf_sock_addr.user_port`).
    pub port: u16,
    /// IP protocol number, see [`proto`].
    pub proto: u8,
    /// Always 0.
    pub _pad0: u8,
    /// 0 = frontend, `1..=count` = backend slots. Host byte order.
    pub slot: u16,
    /// Always 0.
    pub _pad1: [u8; 2],
}

impl Svc4Key {
    /// Key of slot `slot` of the frontend `vip:port/proto` (both in network byte order).
    pub const fn new(vip_be: u32, port_be: u16, proto: u8, slot: u16) -> Self {
        Self {
            vip: vip_be,
            port: port_be,
            proto,
            _pad0: 0,
            slot,
            _pad1: [0; 2],
        }
    }
}

/// `SvcValue::flags` bit: ClientIP session affinity is on for this frontend.
pub const SVC_FLAG_AFFINITY: u8 = 1;
/// `SvcValue::flags` bit: pick backends from the frontend's Maglev table (keyed by
/// `rev_nat_id`) with the client's network namespace as the hash, instead of at random.
pub const SVC_FLAG_MAGLEV: u8 = 2;

/// Key of the Maglev map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MaglevKey {
    /// The frontend's `rev_nat_id` (slot 0). Host order.
    pub svc_id: u32,
    /// Table index, `0..MAGLEV_TABLE_SIZE`. Host order.
    pub index: u32,
}

/// Value of the quota map: the current window of one network namespace. Host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NetnsQuota {
    /// `bpf_ktime_get_ns()` when the window began.
    pub window_start_ns: u64,
    /// New entries created in the window.
    pub used: u32,
    /// Always 0.
    pub _pad0: u32,
}

/// Key of the membership map: a backend of a frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemberKey {
    /// The frontend's `rev_nat_id` (slot 0). Host order.
    pub svc_id: u32,
    /// Backend id. Host order.
    pub backend_id: u32,
}

/// Value of the services map. Slot 0 uses `count`, `flags`, `affinity_timeout_s`,
/// `rev_nat_id` and holds the number of fallback slots in `backend_id` (see
/// [`SvcValue::fallback_count`]); slots 1.. use `backend_id`. Host byte order throughout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcValue {
    /// Backend id (slots 1..); in slot 0 the number of fallback slots (from
    /// [`FALLBACK_SLOT_BASE`]).
    pub backend_id: u32,
    /// Number of backend slots (slot 0).
    pub count: u16,
    /// `SVC_FLAG_*` bits (slot 0).
    pub flags: u8,
    /// Always 0.
    pub _pad0: u8,
    /// ClientIP affinity timeout in seconds (slot 0).
    pub affinity_timeout_s: u32,
    /// Id that maps a translated socket back to this frontend (slot 0).
    pub rev_nat_id: u32,
}

impl SvcValue {
    /// Slot 0: the number of fallback slots (from [`FALLBACK_SLOT_BASE`]).
    pub const fn fallback_count(&self) -> u32 {
        self.backend_id
    }
}

/// Key of the failed map: a client pod (its network namespace) and a backend it connected to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FailedKey {
    /// `bpf_get_netns_cookie()` of the client socket.
    pub netns_cookie: u64,
    /// Backend address, network byte order (IPv4 in word 0, rest 0; an IPv4-mapped IPv6
    /// backend is keyed as IPv4).
    pub addr: [u32; 4],
    /// Backend port, network byte order.
    pub port: u16,
    /// 4 or 6.
    pub family: u8,
    /// Always 0.
    pub _pad0: [u8; 5],
}

/// Value of the failed map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FailedValue {
    /// `bpf_ktime_get_ns()` until which the backend is skipped (or lent to a probe).
    pub until_ns: u64,
    /// Failed connects in a row (failures while marked are not counted).
    pub failures: u32,
    /// 1 while the mark has ended and one connect probes the backend, else 0.
    pub probing: u32,
}

/// Key of the skip counters: a frontend (ClusterSetIP, port, protocol), either family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FrontendKey {
    /// ClusterSetIP, network byte order (IPv4 in word 0, rest 0).
    pub addr: [u32; 4],
    /// Port, network byte order.
    pub port: u16,
    /// `proto::TCP` or `proto::UDP`.
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
}

/// Value of the skip counters (8-byte aligned: the kernel adds to them atomically).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SkipCounts {
    /// Connects whose first choice was skipped (a mark of the client pod) and that another
    /// backend took.
    pub skipped: u64,
    /// Of those, the ones a fallback backend took (no selected one was left unmarked).
    pub fallback: u64,
}

/// Value of the backends map, IPv4.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend4 {
    /// Backend address, network byte order.
    pub addr: u32,
    /// Backend (target) port, network byte order.
    pub port: u16,
    /// IP protocol number, see [`proto`].
    pub proto: u8,
    /// Always 0.
    pub _pad0: u8,
    /// Small integer naming the backend's source cluster (assigned by the agent). Host order.
    pub cluster_id: u32,
}

/// Key of the services map, IPv6 (same meaning as [`Svc4Key`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Svc6Key {
    /// ClusterSetIP, network byte order, as `bpf_sock_addr.user_ip6` (four 32-bit words).
    pub vip: [u32; 4],
    /// Service port, network byte order.
    pub port: u16,
    /// IP protocol number.
    pub proto: u8,
    /// Always 0.
    pub _pad0: u8,
    /// 0 = frontend, `1..=count` = backend slots. Host byte order.
    pub slot: u16,
    /// Always 0.
    pub _pad1: [u8; 2],
}

impl Svc6Key {
    /// Key of slot `slot` of the frontend `vip:port/proto` (network byte order).
    pub const fn new(vip_be: [u32; 4], port_be: u16, proto: u8, slot: u16) -> Self {
        Self {
            vip: vip_be,
            port: port_be,
            proto,
            _pad0: 0,
            slot,
            _pad1: [0; 2],
        }
    }
}

/// Value of the backends map, IPv6.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend6 {
    /// Backend address, network byte order (four 32-bit words).
    pub addr: [u32; 4],
    /// Backend port, network byte order.
    pub port: u16,
    /// IP protocol number.
    pub proto: u8,
    /// Always 0.
    pub _pad0: u8,
    /// Source cluster number (assigned by the agent). Host order.
    pub cluster_id: u32,
}

/// Key of the IPv4 reverse-NAT map: which backend a socket was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat4Key {
    /// `bpf_get_socket_cookie()` of the socket.
    pub cookie: u64,
    /// Backend address, network byte order.
    pub addr: u32,
    /// Backend port, network byte order.
    pub port: u16,
    /// Always 0.
    pub _pad0: [u8; 2],
}

/// Value of the IPv4 reverse-NAT map: the frontend the application asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat4Value {
    /// VIP, network byte order.
    pub vip: u32,
    /// VIP port, network byte order.
    pub port: u16,
    /// Always 0.
    pub _pad0: [u8; 2],
}

/// Key of the IPv6 reverse-NAT map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat6Key {
    /// `bpf_get_socket_cookie()` of the socket.
    pub cookie: u64,
    /// Backend address, network byte order.
    pub addr: [u32; 4],
    /// Backend port, network byte order.
    pub port: u16,
    /// Always 0.
    pub _pad0: [u8; 6],
}

/// Value of the IPv6 reverse-NAT map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat6Value {
    /// VIP, network byte order.
    pub vip: [u32; 4],
    /// VIP port, network byte order.
    pub port: u16,
    /// Always 0.
    pub _pad0: [u8; 2],
}

/// Key of the affinity map: a client (its network namespace, i.e. its pod, as the socket LB
/// sees clients before they have a source address) and a frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// `bpf_get_netns_cookie()` of the client socket.
    pub netns_cookie: u64,
    /// VIP, network byte order (IPv4 in word 0, rest 0).
    pub vip: [u32; 4],
    /// VIP port, network byte order.
    pub port: u16,
    /// IP protocol number.
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
    /// Always 0.
    pub _pad0: [u8; 4],
}

/// Value of the affinity map: the backend this client was sent to, and when.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns()` of the last use.
    pub last_used_ns: u64,
    /// Backend id.
    pub backend_id: u32,
    /// Backend port, network byte order (checked, so a reused id is not followed).
    pub port: u16,
    /// Always 0.
    pub _pad0: [u8; 2],
    /// Backend address, network byte order (IPv4 in word 0).
    pub addr: [u32; 4],
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY (of the `unsafe impl`s below; the one use of `unsafe` in this crate, allowed
    // here only): every type is `#[repr(C)]`, `Copy`, made of plain integers with explicit
    // padding fields, so any bit pattern is valid and there are no implicit padding bytes.
    #![allow(unsafe_code)]
    unsafe impl aya::Pod for super::Svc4Key {}
    unsafe impl aya::Pod for super::SvcValue {}
    unsafe impl aya::Pod for super::Backend4 {}
    unsafe impl aya::Pod for super::Svc6Key {}
    unsafe impl aya::Pod for super::Backend6 {}
    unsafe impl aya::Pod for super::RevNat4Key {}
    unsafe impl aya::Pod for super::RevNat4Value {}
    unsafe impl aya::Pod for super::RevNat6Key {}
    unsafe impl aya::Pod for super::RevNat6Value {}
    unsafe impl aya::Pod for super::AffinityKey {}
    unsafe impl aya::Pod for super::AffinityValue {}
    unsafe impl aya::Pod for super::MaglevKey {}
    unsafe impl aya::Pod for super::MemberKey {}
    unsafe impl aya::Pod for super::NetnsQuota {}
    unsafe impl aya::Pod for super::FailedKey {}
    unsafe impl aya::Pod for super::FailedValue {}
    unsafe impl aya::Pod for super::FrontendKey {}
    unsafe impl aya::Pod for super::SkipCounts {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    // The layouts are an ABI between kernel and userspace and with pinned maps of a running
    // agent: changing one needs a new map name (version suffix).
    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Svc4Key>(), 4 + 2 + 1 + 1 + 2 + 2);
        assert_eq!(align_of::<Svc4Key>(), 4);
        assert_eq!(size_of::<SvcValue>(), 4 + 2 + 1 + 1 + 4 + 4);
        assert_eq!(size_of::<Backend4>(), 4 + 2 + 1 + 1 + 4);
        assert_eq!(size_of::<Svc6Key>(), 16 + 2 + 1 + 1 + 2 + 2);
        assert_eq!(size_of::<Backend6>(), 16 + 2 + 1 + 1 + 4);
        assert_eq!(size_of::<RevNat4Key>(), 8 + 4 + 2 + 2);
        assert_eq!(size_of::<RevNat4Value>(), 4 + 2 + 2);
        assert_eq!(size_of::<RevNat6Key>(), 8 + 16 + 2 + 6);
        assert_eq!(size_of::<RevNat6Value>(), 16 + 2 + 2);
        assert_eq!(size_of::<AffinityKey>(), 8 + 16 + 2 + 1 + 1 + 4);
        assert_eq!(size_of::<AffinityValue>(), 8 + 4 + 2 + 2 + 16);
        assert_eq!(size_of::<FailedKey>(), 8 + 16 + 2 + 1 + 5);
        assert_eq!(size_of::<FailedValue>(), 8 + 4 + 4);
        assert_eq!(size_of::<FrontendKey>(), 16 + 2 + 1 + 1);
        assert_eq!(size_of::<SkipCounts>(), 8 + 8);
    }

    #[test]
    fn a_backend_is_skipped_longer_after_each_failure_in_a_row_up_to_30_s() {
        let secs: [u64; 8] = core::array::from_fn(|i| failed_for_ns(i as u32) / 1_000_000_000);
        assert_eq!(secs, [1, 1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(failed_for_ns(u32::MAX), FAILED_MAX_NS);
    }

    #[test]
    fn key_constructor_zeroes_padding() {
        let k = Svc4Key::new(0x0a00_12c6, 0x5000, proto::TCP, 3);
        assert_eq!(k._pad0, 0);
        assert_eq!(k._pad1, [0, 0]);
        assert_eq!(k.slot, 3);
    }
}
