//! The real agent's memory with the file source, per dataplane: `mcs-agent run --source
//! file:DIR` (release build, next to this bench: `cargo build --release -p mcs-agent`) with
//! `MCS_BENCH_IMPORTS` ServiceImports × 2 clusters × 5 endpoints (default 10,000), the same
//! objects as the control_plane bench, written as JSON lists of 1,000 imports or 2,000 slices
//! a file. For each of `--dataplane log`, `userspace` and `ebpf` it reports the time to
//! `/readyz`, the RSS then and 2 s later (VmRSS), the peak (VmHWM), how many frontends are
//! programmed and, for `ebpf`, the kernel memory of its maps. The caps are set to admit the
//! whole table, so a frontend not programmed (`mcs_frontends` short of the imports, or any
//! `unprogrammable` rejection) fails the bench.
//!
//! - `log`: keeps the table, programs nothing.
//! - `userspace`: inside a network namespace of its own (its nftables rules and listeners go
//!   there), which is removed afterwards.
//! - `ebpf`: the socket LB attached to a cgroup of its own (no process in it), maps pinned in
//!   a directory of its own; `mcs-agent uninstall` removes them afterwards.
//!
//! The last two need root; without it they say so and are not measured (with `CI=true`, a
//! dataplane not measured fails the bench).
//! `MCS_BENCH_DATAPLANES=log,userspace` picks some.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use mcs_sandbox::{cgroup::TestCgroup, netns::Netns};

use mcs_bench::{
    harness::{
        agent::{http_get, metric},
        procs::status_mib,
    },
    scale::{MAX_IMPORTS, VIP_CIDRS, env_count, import_json, slice_json},
};

const PER_FILE: usize = 1000;

fn write_objects(dir: &Path, imports: usize) -> std::io::Result<()> {
    for first in (0..imports).step_by(PER_FILE) {
        let range = first..(first + PER_FILE).min(imports);
        let items: Vec<serde_json::Value> =
            range.clone().map(|i| import_json("bench", i)).collect();
        let list = serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": items });
        std::fs::write(
            dir.join(format!("imports-{first}.json")),
            serde_json::to_vec(&list)?,
        )?;
        let items: Vec<serde_json::Value> = range
            .flat_map(|i| (0..2).map(move |c| (i, c)))
            .map(|(i, c)| slice_json("bench", i, c, None))
            .collect();
        let list = serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": items });
        std::fs::write(
            dir.join(format!("slices-{first}.json")),
            serde_json::to_vec(&list)?,
        )?;
    }
    Ok(())
}

/// `VmRSS` and `VmHWM` of a process, in MiB.
fn memory(pid: u32) -> Option<(f64, f64)> {
    Some((status_mib(pid, "VmRSS")?, status_mib(pid, "VmHWM")?))
}

/// `GET path` from the agent's metrics address (its body; `None` unless 200).
fn get(port: u16, path: &str) -> Option<String> {
    http_get(SocketAddr::from(([127, 0, 0, 1], port)), path).ok()
}

/// Kernel memory of the eBPF maps the process holds open (the `memlock` of each map fd:
/// what the kernel charges for it, buckets and entries), in MiB.
fn map_memory_mib(pid: u32) -> Option<f64> {
    let mut bytes = 0u64;
    for fd in std::fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()? {
        let Ok(text) = std::fs::read_to_string(fd.ok()?.path()) else {
            continue;
        };
        if !text.contains("map_type:") {
            continue;
        }
        bytes += text
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(bytes as f64 / (1024.0 * 1024.0))
}

/// Kills the agent when dropped (also when the bench panics).
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one run measured.
struct Measured {
    /// Seconds from start to `/readyz`.
    secs: f64,
    /// RSS then, RSS 2 s later, peak RSS (MiB).
    rss: f64,
    settled: f64,
    peak: f64,
    /// Frontends programmed (`mcs_frontends`) and rejected as unprogrammable.
    frontends: f64,
    unprogrammable: f64,
    /// Kernel memory of the eBPF maps (MiB), for `ebpf`.
    maps: Option<f64>,
}

/// Runs the agent with one dataplane until ready.
fn measure(
    agent: &Path,
    dataplane: &str,
    objects: &Path,
    scratch: &Path,
    imports: usize,
) -> Result<Measured, String> {
    let root = nix::unistd::geteuid().is_root();
    if dataplane != "log" && !root {
        return Err("needs root".into());
    }
    let port = mcs_test_support::ports::unused_port().map_err(|e| e.to_string())?;
    let netns = (dataplane == "userspace")
        .then(|| Netns::new("agentmem"))
        .transpose()
        .map_err(|e| format!("{e:#}"))?;
    let cgroup = (dataplane == "ebpf")
        .then(|| TestCgroup::new("agentmem"))
        .transpose()
        .map_err(|e| format!("{e:#}"))?;
    let pins = match dataplane {
        "ebpf" => Path::new("/sys/fs/bpf").join(mcs_sandbox::unique_name("agentmem")),
        // The other dataplanes remove an eBPF socket LB pinned in their pin directory: one of
        // their own, so they never touch another agent's.
        _ => scratch.join("no-pins"),
    };
    let mut cmd = match &netns {
        Some(ns) => ns.command(agent.to_str().ok_or("agent path is not UTF-8")?),
        None => Command::new(agent),
    };
    cmd.env("MCS_CLUSTERSET_IP_CIDR", VIP_CIDRS.join(","))
        .args(["run", "--dataplane", dataplane, "--cluster-id", "c0"])
        // Caps that admit the whole table (one port an import, 10 endpoints), as an operator
        // of a node this size would set them; the eBPF maps are sized from them.
        .arg("--max-frontends")
        .arg(imports.max(1).to_string())
        .arg("--max-backends")
        .arg((imports.max(1) * 10).to_string())
        .args(["--log-level", "error"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .arg("--source")
        .arg(format!("file:{}", objects.display()))
        .arg("--bpf-pin-dir")
        .arg(&pins)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(cg) = &cgroup {
        cmd.arg("--cgroup-root").arg(cg.path());
    }
    let started = Instant::now();
    let child = Agent(
        cmd.spawn()
            .map_err(|e| format!("starting the agent: {e}"))?,
    );
    let pid = child.0.id();
    let deadline = started + Duration::from_secs(600);
    let result = loop {
        let up = match &netns {
            Some(ns) => ns.run(|| get(port, "/readyz").is_some()).unwrap_or(false),
            None => get(port, "/readyz").is_some(),
        };
        if up {
            let secs = started.elapsed().as_secs_f64();
            // `ip netns exec` execs the agent: the same pid.
            let Some((rss, _)) = memory(pid) else {
                break Err("no /proc status".into());
            };
            // A measurement interval: what the agent holds once it is idle.
            std::thread::sleep(Duration::from_secs(2));
            let Some((settled, peak)) = memory(pid) else {
                break Err("no /proc status".into());
            };
            let metrics = match &netns {
                Some(ns) => ns.run(|| get(port, "/metrics")).ok().flatten(),
                None => get(port, "/metrics"),
            };
            let Some(metrics) = metrics else {
                break Err("no /metrics".into());
            };
            break Ok(Measured {
                secs,
                rss,
                settled,
                peak,
                frontends: metric(&metrics, "mcs_frontends").unwrap_or(-1.0),
                unprogrammable: metric(&metrics, "mcs_rejected{reason=\"unprogrammable\"}")
                    .unwrap_or(0.0),
                maps: (dataplane == "ebpf").then(|| map_memory_mib(pid)).flatten(),
            });
        }
        if Instant::now() > deadline {
            break Err("not ready within 600 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(child);
    if dataplane == "ebpf" {
        let _ = Command::new(agent)
            .args(["uninstall", "--bpf-pin-dir"])
            .arg(&pins)
            .output();
    }
    result
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let imports = env_count("MCS_BENCH_IMPORTS", 10_000);
    assert!(
        imports <= MAX_IMPORTS,
        "the VIP ranges hold {MAX_IMPORTS} imports"
    );
    let dataplanes =
        std::env::var("MCS_BENCH_DATAPLANES").unwrap_or_else(|_| "log,userspace,ebpf".into());
    let exe = std::env::current_exe().expect("bench path");
    let agent: PathBuf = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("mcs-agent"))
        .filter(|p| p.is_file())
        .expect("no mcs-agent next to the bench: cargo build --release -p mcs-agent");
    let scratch = tempfile::tempdir().expect("temp dir");
    let objects = scratch.path().join("objects");
    std::fs::create_dir(&objects).expect("objects dir");
    let t = Instant::now();
    write_objects(&objects, imports).expect("writing the objects");
    println!(
        "agent memory, file source, {imports} ServiceImports x 2 clusters x 5 endpoints ({} endpoints; written in {:.1} s):",
        imports * 10,
        t.elapsed().as_secs_f64()
    );
    let mut failed: Vec<String> = Vec::new();
    for dp in dataplanes.split(',').map(str::trim) {
        match measure(&agent, dp, &objects, scratch.path(), imports) {
            Ok(m) => {
                let Measured {
                    secs,
                    rss,
                    settled,
                    peak,
                    frontends,
                    unprogrammable,
                    maps,
                } = m;
                let maps = maps.map_or(String::new(), |m| format!(", eBPF maps {m:.1} MiB"));
                println!(
                    "  --dataplane {dp:9}: ready in {secs:6.2} s, RSS {rss:7.1} MiB then, {settled:7.1} MiB 2 s later, peak {peak:7.1} MiB; {frontends} frontends programmed, {unprogrammable} unprogrammable{maps}"
                );
                // The caps admit every import: each must be programmed.
                if frontends != imports as f64 || unprogrammable != 0.0 {
                    failed.push(format!(
                        "--dataplane {dp}: {frontends} of {imports} frontends programmed, {unprogrammable} unprogrammable"
                    ));
                }
            }
            // In CI every prerequisite is there: not measuring is a failure, not a skip.
            Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("--dataplane {dp}: not measured: {e}")
            }
            Err(e) => println!("  --dataplane {dp:9}: not measured: {e}"),
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("; "));
}
