//! Prerequisites of tests: skip with a reason on a laptop, fail in CI (`CI=true`).

/// Whether we run in CI (`CI=true`): there, a missing prerequisite is a failure.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Checks a prerequisite. `Ok(())` → `true`. `Err(reason)` → in CI this panics (the test fails
/// with the reason); elsewhere it prints `SKIP <test>: <reason>` and returns `false`, and the
/// test returns early.
///
/// ```no_run
/// # fn a_test() {
/// if !mcs_test_support::require(mcs_test_support::prereq::root()) { return; }
/// # }
/// ```
#[track_caller]
pub fn require(check: Result<(), String>) -> bool {
    match check {
        Ok(()) => true,
        Err(reason) => {
            let test = std::thread::current().name().unwrap_or("?").to_string();
            if in_ci() {
                panic!("prerequisite missing in CI (CI=true), failing {test}: {reason}");
            }
            eprintln!("SKIP {test}: {reason}");
            false
        }
    }
}

/// Effective uid 0.
pub fn root() -> Result<(), String> {
    if nix::unistd::geteuid().is_root() {
        Ok(())
    } else {
        Err("needs root (network namespaces, cgroups, eBPF, nftables)".into())
    }
}

/// A program on PATH.
pub fn program(name: &str) -> Result<(), String> {
    find_program(name).map(|_| ()).ok_or_else(|| {
        format!("`{name}` not found on PATH (run `bash scripts/setup.sh` and `. scripts/env.sh`)")
    })
}

/// Finds a program on PATH.
pub fn find_program(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// All of several checks.
pub fn all(checks: impl IntoIterator<Item = Result<(), String>>) -> Result<(), String> {
    let missing: Vec<String> = checks.into_iter().filter_map(Result::err).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing.join("; "))
    }
}

/// bpffs mounted at `/sys/fs/bpf`.
pub fn bpffs() -> Result<(), String> {
    if std::path::Path::new("/sys/fs/bpf").is_dir() {
        Ok(())
    } else {
        Err("bpffs not mounted at /sys/fs/bpf".into())
    }
}

/// What a test of the eBPF socket LB needs: root, cgroup v2, `ip`, bpffs.
pub fn socket_lb() -> Result<(), String> {
    all([
        root(),
        crate::cgroup::prerequisite(),
        program("ip"),
        bpffs(),
    ])
}
