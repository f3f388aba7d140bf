//! Cgroups under the cgroup v2 root, for the eBPF socket hooks.
//!
//! The root is `MCS_CGROUP2_ROOT` if set, else the first cgroup2 mount in /proc/mounts (on
//! these machines `/sys/fs/cgroup/unified`, a hybrid layout).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::netns::Netns;

/// The cgroup v2 root to create test cgroups under.
pub fn cgroup2_root() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MCS_CGROUP2_ROOT") {
        return Some(PathBuf::from(p));
    }
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_dev, path, fstype) = (f.next()?, f.next()?, f.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(path))
    })
}

/// Prerequisite: a cgroup v2 hierarchy is mounted.
pub fn prerequisite() -> Result<(), String> {
    cgroup2_root()
        .map(|_| ())
        .ok_or_else(|| "no cgroup2 mount found (set MCS_CGROUP2_ROOT)".into())
}

/// A cgroup `mcst<pid>-<tag><n>` under the cgroup v2 root. On drop its processes are killed
/// and it is removed.
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates the cgroup.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        crate::sweep_stale();
        let root = cgroup2_root().context("no cgroup2 mount")?;
        let path = root.join(crate::unique_name(tag));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    /// Its directory (attach eBPF programs here).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A command that runs `program` inside this cgroup, and inside `netns` if given. The
    /// cgroup is joined first, then the namespace (`ip netns exec` remounts /sys).
    pub fn command(&self, netns: Option<&Netns>, program: &Path) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
            .arg(&self.path);
        if let Some(ns) = netns {
            cmd.args(["ip", "netns", "exec", ns.name()]);
        }
        cmd.arg(program);
        cmd
    }

    /// The pids in the cgroup now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        remove(&self.path);
    }
}

fn remove(path: &Path) {
    // cgroup.kill (Linux 5.14+) kills every process inside; then wait until it is empty.
    let _ = std::fs::write(path.join("cgroup.kill"), "1");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match std::fs::remove_dir(path) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if Instant::now() > deadline => {
                eprintln!("warning: removing cgroup {}: {e}", path.display());
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Removes `mcst<pid>...` cgroups whose test process is gone.
pub(crate) fn sweep_stale() {
    let Some(root) = cgroup2_root() else { return };
    let Ok(dir) = std::fs::read_dir(&root) else {
        return;
    };
    for entry in dir.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        if crate::owner_pid(&name).is_some_and(|p| !crate::pid_alive(p)) {
            remove(&entry.path());
        }
    }
}
