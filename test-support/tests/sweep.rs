//! `mcs_sandbox::sweep_stale` removes a bpffs pin directory whose process is gone (a test or
//! bench killed before its guard ran) and keeps one of a live process.

use mcs_test_support::{prereq, require};

#[test]
fn stale_pin_directories_of_dead_processes_are_swept_and_live_ones_kept() {
    if !require(prereq::root()) {
        return;
    }
    if !require(
        std::fs::metadata("/sys/fs/bpf")
            .map(|_| ())
            .map_err(|e| format!("no bpffs at /sys/fs/bpf: {e}")),
    ) {
        return;
    }
    // No process has this pid (above the kernel's pid_max limit of 2^22).
    let dead = std::path::Path::new("/sys/fs/bpf/mcst4194305sweeptest");
    let live = std::path::Path::new("/sys/fs/bpf").join(mcs_sandbox::unique_name("sweeptest"));
    std::fs::create_dir(dead).unwrap();
    std::fs::create_dir(&live).unwrap();
    mcs_sandbox::sweep_stale();
    let dead_left = dead.exists();
    let live_kept = live.exists();
    let _ = std::fs::remove_dir(dead);
    let _ = std::fs::remove_dir(&live);
    assert!(!dead_left, "{} was not swept", dead.display());
    assert!(live_kept, "{} (this process's) was swept", live.display());
}
