//! Child processes of the harness: long-lived servers (stopped on drop, and killed by the
//! kernel if the harness dies: `setpriv --pdeathsig KILL`) and bounded client runs.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use nix::{sys::signal, unistd::Pid};

/// Set by SIGINT, SIGTERM or SIGHUP: the running client is stopped and the harness cleans up
/// and exits instead of dying with its namespaces, rules and pinned maps left behind.
static STOP: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();

/// Catches SIGINT, SIGTERM and SIGHUP (see [`interrupted`]).
pub fn catch_signals() -> anyhow::Result<()> {
    let flag = STOP.get_or_init(Arc::default).clone();
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, flag.clone())?;
    }
    Ok(())
}

/// Fails if a stop signal arrived.
pub fn interrupted() -> anyhow::Result<()> {
    if STOP.get().is_some_and(|f| f.load(Ordering::Relaxed)) {
        bail!("interrupted by a signal; cleaning up");
    }
    Ok(())
}

/// Wraps `program args` so the process gets SIGKILL when the harness thread that started
/// it exits (a harness killed by SIGKILL leaves no server behind).
pub fn deathsig(program: &str) -> Vec<String> {
    vec![
        "setpriv".into(),
        "--pdeathsig".into(),
        "KILL".into(),
        program.into(),
    ]
}

/// A long-lived child: SIGTERM on drop, SIGKILL after 3 s.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr appended to `log`. Must be called on the main
    /// thread (the parent-death signal follows the starting thread).
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> anyhow::Result<Self> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(Self {
            name: name.into(),
            child,
            log: log.into(),
        })
    }

    /// Fails with the tail of the log if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); its log {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 20)
            );
        }
        Ok(())
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = signal::kill(pid, signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A binary next to this one (`target/<profile>/<name>`), the default place of the agent and
/// controller binaries the benches start.
pub fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// User + system CPU seconds of `pid` so far (0 when it is gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses and may hold spaces).
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// Resident memory of process `pid` (MiB), from `/proc/<pid>/status`.
pub fn rss_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "VmRSS")
}

/// A memory field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`, ...), in MiB.
pub fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// The last `n` lines of a file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs a client to completion within `limit` (killed after it), with its output in files
/// `<base>.out` / `<base>.err`; returns stdout, or an error with the tail of stderr.
pub fn run_bounded(mut cmd: Command, base: &Path, limit: Duration) -> anyhow::Result<String> {
    let out_path = base.with_extension("out");
    let err_path = base.with_extension("err");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(File::create(&out_path)?)
        .stderr(File::create(&err_path)?)
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline || interrupted().is_err() {
            let _ = child.kill();
            let _ = child.wait();
            interrupted()?;
            bail!("{cmd:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    if !status.success() {
        bail!("{cmd:?} failed ({status}): {}", tail(&err_path, 10));
    }
    Ok(out)
}

/// Runs a short set-up command; fails with its stderr.
pub fn run_ok(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `check` every 50 ms until it returns true or `limit` passes.
pub fn wait_for(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    loop {
        interrupted()?;
        match check() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = format!(": {e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}{last}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
