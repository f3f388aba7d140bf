//! The export story runs end to end as a user runs it (`mcs-bench export-demo`): two real
//! API servers, our controller in each, our agent's eBPF socket LB, traffic from a client pod
//! of c1 to a Service exported in c2; it checks itself and exits 0 only if every step did
//! what it should.

use mcs_test_support::{apiserver, cgroup, prereq, require};

#[test]
fn the_export_story_runs_and_checks_itself() {
    if !require(prereq::all([
        prereq::root(),
        cgroup::prerequisite(),
        apiserver::prerequisites(),
        if std::path::Path::new("/sys/fs/bpf").is_dir() {
            Ok(())
        } else {
            Err("bpffs not mounted at /sys/fs/bpf".into())
        },
    ])) {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mcs-bench"))
        .arg("export-demo")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "export demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "[5/5]",
        "ClusterSetIP 198.18.100.",
        "Valid=True",
        "0 failed, 0 cut",
        "every step did what it should",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
}
