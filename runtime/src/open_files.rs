//! The process's open-files limit, raised as far as it may go: the agent's forwarder holds two
//! descriptors per connection, and both binaries' metrics listeners must never be the reason
//! another socket cannot open.

/// The open-files limit goes up to the system's `fs.nr_open` where it may (CAP_SYS_RESOURCE, or a
/// hard limit that high, as containerd gives containers), else its soft limit up to its hard
/// one (as Go programs do by themselves).
pub fn raise() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        tracing::warn!("could not read the open-files limit");
        return;
    };
    let nr_open: u64 = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(hard);
    let want = nr_open.max(hard);
    if soft >= want {
        tracing::debug!(soft, "open-files limit already at its most");
        return;
    }
    let to = if setrlimit(Resource::RLIMIT_NOFILE, want, want).is_ok() {
        want
    } else if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        hard
    } else {
        soft
    };
    tracing::info!(from = soft, to, "open-files limit");
}
