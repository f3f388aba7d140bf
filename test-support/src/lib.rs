//! Real parts for the integration tests of mcs-dataplane (a dev-dependency only).
//!
//! # Layout
//!
//! - [`prereq`]: what a test needs (root, binaries, kernel features). On a laptop a missing
//!   prerequisite skips the test with a printed reason; with `CI=true` it fails the test.
//! - [`apiserver`]: a real etcd + kube-apiserver on loopback, started once per test binary
//!   ([`apiserver::shared`]) or per test ([`apiserver::ApiServer::start`]), with an admin
//!   kubeconfig, non-admin test identities, the project's CRDs applied, a fresh namespace per
//!   test, and teardown when the test process exits, also on panic or kill.
//! - [`netns`]: network namespaces, veth pairs, addresses and routes (198.18.0.0/15 and
//!   2001:2::/48 only), run a closure or a command inside; removed on drop.
//! - [`cgroup`]: a test cgroup under the cgroup v2 root and commands started inside it.
//! - [`probe`]: a client that runs as a child process (inside a netns and a cgroup) and
//!   reports what the kernel did with its connect().
//!
//! Every resource a helper creates carries the test process id in its name
//! (`mcst<pid>-...`); [`sweep_stale`] removes those left by a test process that was killed.
#![forbid(unsafe_code)]

pub mod apiserver;
pub mod cgroup;
pub mod netns;
pub mod prereq;
pub mod probe;
mod supervise;

pub use prereq::{in_ci, require};

/// Prefix of every resource (netns, cgroup, veth) a test creates: `mcst<pid>`.
pub fn resource_prefix() -> String {
    format!("mcst{}", std::process::id())
}

/// A short unique name `mcst<pid>-<tag><n>` (n counts per process). Interface names must fit
/// in 15 bytes, so tags should be short.
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

/// Removes network namespaces and test cgroups left by test processes that no longer run.
/// Called by the helpers before they create anything; cheap and idempotent.
pub fn sweep_stale() {
    netns::sweep_stale();
    cgroup::sweep_stale();
}

/// Whether process `pid` is alive.
pub(crate) fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Parses `mcst<pid>...` names.
pub(crate) fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("mcst")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}
