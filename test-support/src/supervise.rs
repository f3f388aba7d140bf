//! Child processes that die with the test process.
//!
//! A server (etcd, kube-apiserver) is started under a small `sh` supervisor whose stdin is a
//! pipe held by the test process. When the test process ends, however it ends (normal exit,
//! panic, SIGKILL), the kernel closes the pipe, the supervisor's `cat` sees EOF and it stops
//! the server (TERM, then KILL after a bounded wait) and removes the server's directory.
//! No polling and no `unsafe` pre-exec hook.

use std::{
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
};

const SUPERVISOR: &str = r#"
log="$1"; cleanup="$2"; shift 2
"$@" >>"$log" 2>&1 &
child=$!
echo "$child" > "$log.pid"
stop() {
  kill -TERM "$child" 2>/dev/null
  i=0
  while kill -0 "$child" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
  kill -KILL "$child" 2>/dev/null
  wait "$child" 2>/dev/null
  [ -n "$cleanup" ] && rm -rf "$cleanup"
  exit 0
}
# A stop signal to the supervisor itself (Ctrl-C, or `timeout` signalling the whole process
# group) stops the server too, instead of leaving it running without its supervisor.
trap stop TERM INT HUP
# Block until the test process closes our stdin (it exited or dropped the handle). `cat` runs
# in the background (its stdin given explicitly: a background job's is /dev/null otherwise)
# so that `wait` returns as soon as a trapped signal arrives.
exec 3<&0
cat <&3 >/dev/null &
wait $!
stop
"#;

/// A supervised server process.
#[derive(Debug)]
pub(crate) struct Supervised {
    pub(crate) name: String,
    pub(crate) log: PathBuf,
    supervisor: Child,
    stdin: Option<ChildStdin>,
}

impl Supervised {
    /// Starts `program args..` with output appended to `log`. `cleanup` (may be empty) is
    /// removed after the server stopped.
    pub(crate) fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        cleanup: Option<&Path>,
    ) -> std::io::Result<Self> {
        // Append (a restarted server keeps one log); forget the previous process's pid.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let _ = std::fs::remove_file(log.with_extension("log.pid"));
        let mut supervisor = Command::new("sh")
            .arg("-c")
            .arg(SUPERVISOR)
            .arg("mcs-supervise")
            .arg(log)
            .arg(cleanup.map(Path::as_os_str).unwrap_or_default())
            .arg(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = supervisor.stdin.take();
        Ok(Self {
            name: name.to_string(),
            log: log.to_path_buf(),
            supervisor,
            stdin,
        })
    }

    /// The server's pid once the supervisor started it.
    pub(crate) fn pid(&self) -> Option<i32> {
        let p = self.log.with_extension("log.pid");
        std::fs::read_to_string(p).ok()?.trim().parse().ok()
    }

    /// Whether the supervisor (and so the server, as far as we know) still runs.
    pub(crate) fn running(&mut self) -> bool {
        matches!(self.supervisor.try_wait(), Ok(None))
    }

    /// The last `n` lines of the server's log, for error messages.
    pub(crate) fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(n)..].join("\n");
        format!("[{} log {}]\n{tail}", self.name, self.log.display())
    }

    /// Stops the server now and waits for the supervisor (bounded by its own timeout).
    pub(crate) fn stop(&mut self) {
        drop(self.stdin.take());
        let _ = self.supervisor.wait();
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
    }
}
