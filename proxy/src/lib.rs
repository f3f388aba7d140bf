//! The dataplanes of mcs-dataplane.
//!
//! # Layout
//!
//! - [`ebpf`]: loader of the eBPF socket load balancer. `build.rs` compiles the kernel-side
//!   programs (`ebpf/programs`) with aya-build and this crate embeds the object; the loader
//!   loads it, attaches the cgroup hooks and writes the maps (types from `mcs-ebpf-common`).
//! - [`userspace`]: the transparent L4 forwarder (nftables TPROXY, splice, Maglev).
//! - [`maglev`]: consistent hashing of flows onto backends (both dataplanes use it).
//! - [`log`]: the `log` dataplane, which programs nothing.
//! - [`any`]: [`AnyDataplane`], the one an agent runs, chosen at start.
#![deny(unsafe_code)]

pub mod any;
pub mod ebpf;
pub mod log;
pub mod maglev;
pub mod userspace;

pub use any::AnyDataplane;
