//! Sandboxes of network namespaces and cgroups, for `mcs-agent demo` and the tests.
//!
//! # Layout
//!
//! - [`backend`]: a request/reply backend (one request per connection, TCP and UDP) that
//!   stops when dropped.
//! - [`netns`]: network namespaces, veth pairs, addresses and routes (198.18.0.0/15 and
//!   2001:2::/48 only), run a closure or a command inside; removed on drop.
//! - [`cgroup`]: a cgroup under the cgroup v2 root and commands started inside it.
//! - [`topology`]: the two-cluster topology (client pod, node, clusters c1 and c2).
//!
//! Every resource carries the creating process id in its name (`mcst<pid>-...`);
//! [`sweep_stale`] removes those whose process is gone (killed before it could clean up), and
//! pin directories of the same name under /sys/fs/bpf.
#![forbid(unsafe_code)]

pub mod backend;
pub mod cgroup;
pub mod netns;
pub mod topology;

/// Prefix of every resource (netns, cgroup) this process creates: `mcst<pid>`.
pub fn resource_prefix() -> String {
    format!("mcst{}", std::process::id())
}

/// A short unique name `mcst<pid>-<tag><n>` (n counts per process).
pub fn unique_name(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}{}{}",
        resource_prefix(),
        tag,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes network namespaces, cgroups and bpffs pin directories left by processes that no
/// longer run.
pub fn sweep_stale() {
    netns::sweep_stale();
    cgroup::sweep_stale();
    sweep_stale_pins();
}

/// Pin directories `/sys/fs/bpf/mcst<pid>...` (the eBPF agent's maps and links of a test or
/// bench) whose process is gone: removing a pinned link detaches its program once nothing
/// else holds it.
fn sweep_stale_pins() {
    let Ok(dir) = std::fs::read_dir("/sys/fs/bpf") else {
        return;
    };
    for entry in dir.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        if owner_pid(&name).is_some_and(|p| !pid_alive(p)) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether process `pid` is alive (a zombie, killed but not yet reaped, is not).
pub fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // "pid (comm) S ...": the state follows the last ')' (comm may hold anything).
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Parses `mcst<pid>...` names.
pub(crate) fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("mcst")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn pid_alive_sees_this_process_and_not_a_reaped_or_zombie_child() {
        assert!(super::pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited but not reaped: a zombie (polled, with a deadline).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z"))
        {
            assert!(std::time::Instant::now() < deadline, "child never exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!super::pid_alive(pid));
        child.wait().unwrap();
        assert!(!super::pid_alive(pid));
    }
}
