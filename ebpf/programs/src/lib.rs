//! Library target of the kernel-side crate. It exists so that `proxy` can name this crate as
//! a build-dependency (cargo then rebuilds the loader when the programs change); the programs
//! themselves are the `mcs-ebpf` binary (`src/main.rs`), built for `bpfel-unknown-none`.
#![no_std]
