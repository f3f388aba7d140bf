//! Builds the kernel-side programs (`ebpf/programs`) for `bpfel-unknown-none` with the pinned
//! nightly (aya-build) and leaves the object in `OUT_DIR/mcs-ebpf`, which `src/ebpf.rs`
//! embeds. Needs the nightly with rust-src and `bpf-linker` on PATH: `scripts/setup.sh`
//! installs both.
use anyhow::{Context as _, anyhow};

/// Keep in step with `MCS_NIGHTLY` in scripts/env.sh.
const NIGHTLY: &str = "nightly-2026-06-01";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=PATH");
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("bpf-linker").is_file()))
        .unwrap_or(false);
    if !found {
        return Err(anyhow!(
            "bpf-linker is not on PATH. Run `bash scripts/setup.sh` and `. scripts/env.sh` \
             (it installs bpf-linker 0.13 for LLVM 22 and the {NIGHTLY} toolchain)"
        ));
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ebpf/programs");
    let root = root.canonicalize().context("ebpf/programs not found")?;
    let root = root.to_str().context("non-UTF-8 path")?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "mcs-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom(NIGHTLY),
    )
    .with_context(|| format!("building the eBPF programs with {NIGHTLY} (run scripts/setup.sh?)"))
}
