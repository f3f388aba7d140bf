//! Kernel-side programs of the socket load balancer.
//!
//! # Layout
//!
//! Each program is a thin entry point (`#[cgroup_sock_addr]`) around a `try_*` function that
//! returns `Result`; map types come from `mcs-ebpf-common`.
//!
//! - `mcs_connect4` (`cgroup/connect4`): on `connect()` to a frontend `vip:port` (TCP, or UDP
//!   connected sockets), rewrite the destination to one of the frontend's backends. Anything
//!   that is not a frontend is left untouched.
//!
//! Return value 1 lets the syscall proceed (with the rewritten address); the programs never
//! refuse a connect.
#![no_std]
#![no_main]
// eBPF programs read the context and maps through raw pointers: the kernel verifier, not
// rustc, checks those accesses. `unsafe` is confined to the helpers below and the map reads.
#![allow(unsafe_code)]

use aya_ebpf::{
    helpers::bpf_get_prandom_u32,
    macros::{cgroup_sock_addr, map},
    maps::HashMap,
    programs::SockAddrContext,
};
use mcs_ebpf_common::{
    BE_MAP_MAX_ENTRIES, Backend4, SVC_MAP_MAX_ENTRIES, Svc4Key, SvcValue, proto,
};

/// Services: frontend at slot 0, backend ids at slots 1..=count. See `mcs_ebpf_common`.
#[map(name = "MCS_SVC4_V1")]
static MCS_SVC4_V1: HashMap<Svc4Key, SvcValue> = HashMap::with_max_entries(SVC_MAP_MAX_ENTRIES, 0);

/// Backends by id.
#[map(name = "MCS_BE4_V1")]
static MCS_BE4_V1: HashMap<u32, Backend4> = HashMap::with_max_entries(BE_MAP_MAX_ENTRIES, 0);

/// Let the syscall go on.
const SYSCALL_PROCEED: i32 = 1;
const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;

#[cgroup_sock_addr(connect4)]
pub fn mcs_connect4(ctx: SockAddrContext) -> i32 {
    // Whatever happens inside, the connect proceeds: at worst untranslated.
    let _ = try_connect4(&ctx);
    SYSCALL_PROCEED
}

/// Why a connect was not translated (kept for future per-reason counters).
enum Skip {
    NotFrontend,
    NoBackend,
}

fn try_connect4(ctx: &SockAddrContext) -> Result<(), Skip> {
    // SAFETY: `ctx.sock_addr` is the kernel's `bpf_sock_addr` for this call; the verifier
    // checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let l4 = match sa.type_ {
        SOCK_STREAM => proto::TCP,
        SOCK_DGRAM => proto::UDP,
        _ => return Err(Skip::NotFrontend),
    };
    let vip = sa.user_ip4;
    // `user_port` holds the port in network byte order in its low 16 bits.
    let port = sa.user_port as u16;
    let key = Svc4Key::new(vip, port, l4, 0);
    // SAFETY: the map value is only read, and copied out before any other map call.
    let svc = unsafe { MCS_SVC4_V1.get(&key) }.ok_or(Skip::NotFrontend)?;
    let count = svc.count;
    if count == 0 {
        return Err(Skip::NoBackend);
    }
    // SAFETY: helper without arguments.
    let pick = unsafe { bpf_get_prandom_u32() } % u32::from(count);
    let slot_key = Svc4Key::new(vip, port, l4, pick as u16 + 1);
    // SAFETY: as above.
    let slot = unsafe { MCS_SVC4_V1.get(&slot_key) }.ok_or(Skip::NoBackend)?;
    // SAFETY: as above.
    let be = unsafe { MCS_BE4_V1.get(&slot.backend_id) }.ok_or(Skip::NoBackend)?;
    sa.user_ip4 = be.addr;
    sa.user_port = u32::from(be.port);
    Ok(())
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
