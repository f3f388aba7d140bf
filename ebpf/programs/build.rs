//! Rebuild the programs when bpf-linker changes (it is the linker of the bpf target).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
