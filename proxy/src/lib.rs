//! The dataplanes of mcs-dataplane.
//!
//! # Layout
//!
//! - [`ebpf`]: loader of the eBPF socket load balancer. `build.rs` compiles the kernel-side
//!   programs (`ebpf/programs`) with aya-build and this crate embeds the object; the loader
//!   loads it, attaches the cgroup hooks and writes the maps (types from `mcs-ebpf-common`).
//! - [`userspace`]: the transparent L4 forwarder (nftables TPROXY, splice, Maglev).
#![deny(unsafe_code)]

pub mod ebpf;
pub mod userspace;
