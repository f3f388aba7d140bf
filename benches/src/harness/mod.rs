//! The side-by-side harness behind `mcs-bench`: one topology, every mode set up at once on
//! its own addresses, workloads run interleaved (A B C A B C ...), reported as medians with
//! min–max and ratios to `direct` of the same run.

pub mod agent;
pub mod bed;
pub mod load;
pub mod procs;
pub mod report;
pub mod stats;
pub mod svg;
pub mod tools;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

use bed::{Bed, Mode, ModeState, have};
use load::{LoadConfig, Workload};
use report::{Cell, Meta, ModeReport, Report, ScaleCell};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Modes, in report order.
    pub modes: Vec<Mode>,
    /// Workloads.
    pub workloads: Vec<Workload>,
    /// Interleaved repetitions.
    pub repetitions: usize,
    /// Service counts of the scaling workload (empty: skip it).
    pub scales: Vec<usize>,
    /// Load settings.
    pub load: LoadConfig,
    /// The mcs-agent binary.
    pub agent: PathBuf,
    /// The agent and flags of `mcs-userspace-b` (A/B runs).
    pub agent_b: Option<bed::AgentB>,
    /// Output directory.
    pub out: PathBuf,
    /// Install missing peers with apt-get.
    pub install: bool,
    /// `web` has a backend in each cluster (else one).
    pub spread: bool,
    /// How the client is attached to the node (`--client-net`).
    pub client_net: mcs_sandbox::topology::ClientNet,
    /// The command line, for the record.
    pub command: String,
}

/// Debian packages of the peers and load generators, by the program they provide.
const PEERS: [(&str, &str); 8] = [
    ("haproxy", "haproxy"),
    ("nginx", "nginx-light"),
    ("wrk", "wrk"),
    ("iptables-restore", "iptables"),
    ("nft", "nftables"),
    ("ipvsadm", "ipvsadm"),
    ("conntrack", "conntrack"),
    ("setpriv", "util-linux"),
];
const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// Installs the missing peers from Debian (idempotent).
pub fn install_peers() -> anyhow::Result<()> {
    let mut missing: Vec<&str> = PEERS
        .iter()
        .filter(|(prog, _)| !have(prog))
        .map(|(_, pkg)| *pkg)
        .collect();
    if !Path::new(STREAM_MODULE).exists() {
        missing.push("libnginx-mod-stream");
    }
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("mcs-bench: installing {} from Debian", missing.join(" "));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
    };
    if !install()?.success() {
        Command::new("apt-get").args(["update", "-qq"]).status()?;
        if !install()?.success() {
            bail!("apt-get install {} failed", missing.join(" "));
        }
    }
    Ok(())
}

fn version(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
}

fn versions() -> Vec<(String, String)> {
    [
        ("haproxy", &["-v"][..]),
        ("nginx", &["-v"]),
        ("wrk", &["-v"]),
        ("iptables", &["-V"]),
        ("nft", &["--version"]),
    ]
    .into_iter()
    .filter_map(|(p, a)| Some((p.to_string(), version(p, a)?)))
    .collect()
}

/// Runs everything and writes the report into `opts.out`.
pub fn run(opts: &Options) -> anyhow::Result<Report> {
    if !nix::unistd::geteuid().is_root() {
        bail!("mcs-bench needs root (network namespaces, nftables, eBPF, cgroups)");
    }
    if !opts.agent.is_file() {
        bail!(
            "no mcs-agent binary at {} (build it: cargo build --release -p mcs-agent, or pass --agent)",
            opts.agent.display()
        );
    }
    procs::catch_signals()?;
    if opts.install {
        install_peers()?;
    }
    // Absolute: servers (nginx) resolve relative paths against their own prefix.
    let out = std::path::absolute(&opts.out)
        .with_context(|| format!("resolving {}", opts.out.display()))?;
    let work = out.join("run");
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clearing {}", work.display()))?;
    }
    std::fs::create_dir_all(&work)?;
    let date = version("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_default();
    let meta = Meta {
        date,
        kernel: version("uname", &["-r"]).unwrap_or_default(),
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        repetitions: opts.repetitions,
        load: opts.load.clone(),
        versions: versions(),
        command: opts.command.clone(),
        agent: opts.agent.display().to_string(),
        web_backends: if opts.spread { 2 } else { 1 },
        client_net: opts.client_net.name(),
    };
    eprintln!("mcs-bench: setting up {} modes", opts.modes.len());
    let mut bed = Bed::build(
        &opts.modes,
        &opts.agent,
        opts.agent_b.clone(),
        &work,
        opts.spread,
        opts.client_net,
    )?;
    let modes = bed
        .modes
        .iter()
        .map(|(mode, state)| match state {
            ModeState::Ready(_) => ModeReport {
                mode: *mode,
                status: "ok",
                reason: None,
            },
            ModeState::Unavailable(why) => ModeReport {
                mode: *mode,
                status: "unavailable",
                reason: Some(why.clone()),
            },
            ModeState::Failed(why) => ModeReport {
                mode: *mode,
                status: "failed",
                reason: Some(why.clone()),
            },
        })
        .collect::<Vec<_>>();
    for m in &modes {
        eprintln!(
            "mcs-bench: {:<14} {}{}",
            m.mode.name(),
            m.status,
            m.reason
                .as_ref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
    }
    let ready = bed.ready();
    // A mode that does not forward a request within 10 s is a failure, found before
    // measuring (polled: a first UDP datagram may be lost while a session is set up).
    let exe = std::env::current_exe()?;
    let mut broken = vec![];
    for (mode, target) in &ready {
        let check = || {
            let mut cmd = bed.client(target, &exe.to_string_lossy());
            cmd.args(["check", "--http", &target.web[0].to_string()]);
            if let Some(udp) = &target.udp {
                cmd.args(["--udp", &udp[0].to_string()]);
            }
            procs::run_ok(&mut cmd).map(|_| true)
        };
        let what = format!("{} to forward a check request", mode.name());
        if let Err(e) = procs::wait_for(&what, std::time::Duration::from_secs(10), check) {
            procs::interrupted()?;
            broken.push((*mode, format!("{e:#}")));
        }
    }
    let mut report = Report {
        meta,
        modes,
        results: vec![],
        scaling: vec![],
    };
    for (mode, why) in &broken {
        if let Some(m) = report.modes.iter_mut().find(|m| m.mode == *mode) {
            m.status = "failed";
            m.reason = Some(format!("does not forward: {why}"));
        }
    }
    let ready: Vec<_> = ready
        .into_iter()
        .filter(|(m, _)| !broken.iter().any(|(b, _)| b == m))
        .collect();

    // The workloads, interleaved: for each repetition, each workload, every mode in turn.
    let mut runs: Vec<(Workload, Mode, Vec<load::Run>, Vec<String>)> = vec![];
    for w in &opts.workloads {
        for (m, t) in &ready {
            if load::applies(t, *w) {
                runs.push((*w, *m, vec![], vec![]));
            }
        }
    }
    for rep in 0..opts.repetitions {
        for w in &opts.workloads {
            for (mode, target) in &ready {
                let Some(slot) = runs.iter_mut().find(|r| r.0 == *w && r.1 == *mode) else {
                    continue;
                };
                procs::interrupted()?;
                let tag = format!("rep{rep}");
                match load::run(&bed, *mode, target, *w, &opts.load, &tag) {
                    Ok(r) => {
                        eprintln!(
                            "mcs-bench: rep {} {:<7} {:<14} {:>12.1} {}{}",
                            rep + 1,
                            w.name(),
                            mode.name(),
                            r.value,
                            w.unit(),
                            if r.errors > 0 {
                                format!(" ({} {})", r.errors, w.error_word())
                            } else {
                                String::new()
                            }
                        );
                        slot.2.push(r);
                    }
                    Err(e) => {
                        eprintln!("mcs-bench: {} {} failed: {e:#}", w.name(), mode.name());
                        slot.3.push(format!("{e:#}"));
                    }
                }
            }
        }
        bed.check_alive()?;
    }
    report.results = runs
        .into_iter()
        .map(|(w, m, r, f)| Cell::new(w, m, r, f))
        .collect();

    // Scaling: new connections with N services installed in every scalable mode.
    let scaled: Vec<_> = ready
        .iter()
        .filter(|(m, _)| m.scales() || *m == Mode::Direct)
        .cloned()
        .collect();
    if scaled.iter().any(|(m, _)| m.scales()) {
        for &n in &opts.scales {
            eprintln!("mcs-bench: installing {n} services per scalable mode");
            bed.set_services(n)?;
            let mut cells: Vec<(Mode, Vec<f64>, Vec<String>)> =
                scaled.iter().map(|(m, _)| (*m, vec![], vec![])).collect();
            for rep in 0..opts.repetitions {
                for ((mode, target), cell) in scaled.iter().zip(&mut cells) {
                    procs::interrupted()?;
                    let tag = format!("scale{n}-rep{rep}");
                    match load::run(&bed, *mode, target, Workload::Crr, &opts.load, &tag) {
                        Ok(r) => {
                            eprintln!(
                                "mcs-bench: rep {} {n:>6} services {:<14} {:>10.1} conn/s",
                                rep + 1,
                                mode.name(),
                                r.value
                            );
                            cell.1.push(r.value);
                        }
                        Err(e) => cell.2.push(format!("{e:#}")),
                    }
                }
            }
            for (mode, runs, failures) in cells {
                report.scaling.push(ScaleCell {
                    agent_rss_mib: bed.agent_rss_mib(mode),
                    mode,
                    services: bed.services,
                    value: stats::Spread::of(&runs),
                    runs,
                    failures,
                    ratio_to_direct: None,
                });
            }
        }
    }
    drop(bed);
    report.compute_ratios();
    report.write(&out)?;
    Ok(report)
}
