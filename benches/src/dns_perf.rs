//! `mcs-bench dns`: queries per second and latency of the agent's `clusterset.local` DNS and,
//! in the same run, of CoreDNS serving the same names from its `file` plugin (its best case:
//! a static zone in memory), measured with dnsperf (Debian).
//!
//! Each server runs pinned to CPU 1 (`taskset`), dnsperf to CPU 0; the two servers take turns
//! (interleaved rounds, medians). Per size, the agent reads N ServiceImports from a file
//! source (`--dataplane log`: DNS is what is measured) and CoreDNS a zone file with the same N
//! names and addresses; the query file asks every name in a shuffled order. Reported: queries
//! per second, the same per CPU-second the server used (so "per core" holds even if the
//! server did not saturate its core), latency average / p50 / p99 (from dnsperf's per-query
//! lines), lost queries and every response code seen. A response code other than NOERROR is
//! a wrong answer and fails the run; in `--smoke` (CI) a lost query fails it too (the rate is
//! capped there).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde::Serialize;

use crate::harness::{
    procs::{Proc, cpu_seconds, interrupted},
    stats::Spread,
    tools::resolve_a,
};

/// The ClusterSetIP range of the bench's services (room for 32k).
const RANGE: &str = "198.18.128.0/17";
/// Queries in flight per dnsperf run.
const OUTSTANDING: &str = "256";

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Service counts.
    pub sizes: Vec<usize>,
    /// Seconds per dnsperf run.
    pub seconds: f64,
    /// Interleaved rounds per server and size.
    pub rounds: usize,
    /// CI: capped rate, lost queries fail.
    pub smoke: bool,
    /// The mcs-agent binary.
    pub agent: PathBuf,
    /// The coredns binary.
    pub coredns: PathBuf,
}

/// One dnsperf run.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// `mcs-agent` or `coredns`.
    pub server: String,
    /// Services in the zone.
    pub services: usize,
    /// Queries sent.
    pub sent: u64,
    /// Queries answered.
    pub completed: u64,
    /// Queries lost (no answer in time).
    pub lost: u64,
    /// Response codes and their counts.
    pub rcodes: BTreeMap<String, u64>,
    /// Answered queries per second.
    pub qps: f64,
    /// Answered queries per CPU-second of the server.
    pub qps_per_cpu_second: f64,
    /// Latency, microseconds.
    pub avg_us: f64,
    /// Median latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile latency, microseconds.
    pub p99_us: f64,
}

/// The medians of a server at a size.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Server.
    pub server: String,
    /// Services.
    pub services: usize,
    /// Median queries per second.
    pub qps: f64,
    /// Median queries per CPU-second.
    pub qps_per_cpu_second: f64,
    /// Median p50 (µs).
    pub p50_us: f64,
    /// Median p99 (µs).
    pub p99_us: f64,
    /// Lost queries, all rounds.
    pub lost: u64,
    /// Answered queries, all rounds.
    pub completed: u64,
}

/// The whole result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Every run, in order.
    pub runs: Vec<Run>,
    /// Medians per server and size.
    pub rows: Vec<Row>,
    /// Problems (a non-empty list fails the command).
    pub problems: Vec<String>,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(mcs_test_support::ports::unused_port()?)
}

/// The address of service `i`.
fn ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 128, 1)) + i as u32)
}

/// Writes the agent's objects, CoreDNS's zone and the query file for `n` services.
fn write_inputs(dir: &Path, n: usize) -> anyhow::Result<()> {
    let objects = dir.join("objects");
    std::fs::create_dir_all(&objects)?;
    let mut yaml = String::new();
    let mut zone = String::from(
        "$ORIGIN clusterset.local.\n$TTL 5\n@ IN SOA ns.dns.clusterset.local. hostmaster.clusterset.local. 1 7200 1800 86400 5\n@ IN NS ns.dns.clusterset.local.\nns.dns IN A 198.18.127.1\ndns-version IN TXT \"1.0.0\"\n",
    );
    for i in 0..n {
        let _ = write!(
            yaml,
            "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {{ name: svc-{i}, namespace: bench, creationTimestamp: \"2026-11-01T10:00:00Z\" }}\nspec: {{ type: ClusterSetIP, ips: [\"{}\"], ports: [{{ name: http, protocol: TCP, port: 80 }}] }}\n---\n",
            ip(i)
        );
        let _ = writeln!(zone, "svc-{i}.bench.svc IN A {}", ip(i));
    }
    std::fs::write(objects.join("imports.yaml"), yaml)?;
    std::fs::write(dir.join("zone"), zone)?;
    // Every name once, shuffled (a fixed xorshift: the same order every run).
    let mut order: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let queries: String = order
        .iter()
        .map(|i| format!("svc-{i}.bench.svc.clusterset.local A\n"))
        .collect();
    std::fs::write(dir.join("queries"), queries)?;
    Ok(())
}

/// Asks `name` A of `server` until the answer is `want` (the server is up and has the zone).
fn wait_answer(server: SocketAddr, name: &str, want: Ipv4Addr, p: &mut Proc) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        interrupted()?;
        p.check_alive()?;
        if resolve_a(server, name, Duration::from_millis(200))
            .is_ok_and(|(_, ips)| ips.contains(&std::net::IpAddr::V4(want)))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{server} never answered {name} with {want}");
        }
    }
}

/// What one dnsperf run printed, and the server's CPU time meanwhile.
struct Perf {
    sent: u64,
    completed: u64,
    lost: u64,
    rcodes: BTreeMap<String, u64>,
    qps: f64,
    cpu: f64,
    /// Per-query latencies, µs.
    latencies: Vec<f64>,
}

/// One dnsperf run against `server` (pinned to CPU 0); `pid`: the server's, for its CPU use.
fn dnsperf(dir: &Path, server: SocketAddr, pid: u32, cfg: &Config) -> anyhow::Result<Perf> {
    let out_file = dir.join("dnsperf.out");
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", "0", "dnsperf", "-s"])
        .arg(server.ip().to_string())
        .args(["-p", &server.port().to_string()])
        .arg("-d")
        .arg(dir.join("queries"))
        .args(["-l", &format!("{}", cfg.seconds)])
        .args(["-q", OUTSTANDING, "-c", "4", "-t", "2", "-v"]);
    if cfg.smoke {
        cmd.args(["-Q", "2000"]);
    }
    let cpu_before = cpu_seconds(pid);
    let status = cmd
        .stdout(std::fs::File::create(&out_file)?)
        .stderr(Stdio::null())
        .status()
        .context("running dnsperf (Debian dnsperf; scripts/setup.sh installs it)")?;
    let cpu = cpu_seconds(pid) - cpu_before;
    if !status.success() {
        bail!("dnsperf exited with {status}");
    }
    let text = std::fs::read_to_string(&out_file)?;
    let stat = |key: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    let sent = stat("Queries sent:").context("dnsperf printed no statistics")? as u64;
    let completed = stat("Queries completed:").unwrap_or(0.0) as u64;
    let lost = stat("Queries lost:").unwrap_or(0.0) as u64;
    let qps = stat("Queries per second:").unwrap_or(0.0);
    let mut rcodes = BTreeMap::new();
    let mut latencies = Vec::new();
    for l in text.lines() {
        // "> NOERROR name A 0.000123"; "> T name A" is a query that timed out (counted in
        // "Queries lost").
        if let Some(rest) = l.strip_prefix("> ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let [rcode, .., lat] = f.as_slice()
                && *rcode != "T"
            {
                *rcodes.entry((*rcode).to_string()).or_insert(0) += 1;
                if let Ok(s) = lat.parse::<f64>() {
                    latencies.push(s * 1e6);
                }
            }
        }
    }
    let _ = std::fs::remove_file(&out_file);
    Ok(Perf {
        sent,
        completed,
        lost,
        rcodes,
        qps,
        cpu,
        latencies,
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Runs the bench.
pub fn run(cfg: &Config) -> anyhow::Result<Report> {
    let mut runs = Vec::new();
    let mut problems = Vec::new();
    for &n in &cfg.sizes {
        let dir = tempfile::tempdir()?;
        write_inputs(dir.path(), n)?;
        let (agent_port, metrics_port, coredns_port) = (free_port()?, free_port()?, free_port()?);
        let agent_addr = SocketAddr::from(([127, 0, 0, 1], agent_port));
        let coredns_addr = SocketAddr::from(([127, 0, 0, 1], coredns_port));
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "1"])
            .arg(&cfg.agent)
            .args(["run", "--dataplane", "log", "--cluster-id", "c1"])
            .args(["--clusterset-ip-cidr", RANGE])
            .args(["--max-frontends", "1000000", "--max-backends", "1000000"])
            .args([
                "--dns-listen",
                &agent_addr.to_string(),
                "--dns-rate-limit",
                "0",
            ])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--log-level", "warn"])
            .arg("--source")
            .arg(format!("file:{}", dir.path().join("objects").display()));
        let mut agent = Proc::spawn("mcs-agent", cmd, &dir.path().join("agent.log"))?;
        std::fs::write(
            dir.path().join("Corefile"),
            format!(
                "clusterset.local:{coredns_port} {{\n    bind 127.0.0.1\n    file {} clusterset.local\n}}\n",
                dir.path().join("zone").display()
            ),
        )?;
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "1"])
            .arg(&cfg.coredns)
            .arg("-conf")
            .arg(dir.path().join("Corefile"));
        let mut coredns = Proc::spawn("coredns", cmd, &dir.path().join("coredns.log"))?;
        let last = format!("svc-{}.bench.svc.clusterset.local.", n - 1);
        wait_answer(agent_addr, &last, ip(n - 1), &mut agent)?;
        wait_answer(coredns_addr, &last, ip(n - 1), &mut coredns)?;
        for _ in 0..cfg.rounds {
            for (name, addr, pid) in [
                ("mcs-agent", agent_addr, agent.pid()),
                ("coredns", coredns_addr, coredns.pid()),
            ] {
                interrupted()?;
                let Perf {
                    sent,
                    completed,
                    lost,
                    rcodes,
                    qps,
                    cpu,
                    latencies: mut lat,
                } = dnsperf(dir.path(), addr, pid, cfg)?;
                lat.sort_by(f64::total_cmp);
                let avg = if lat.is_empty() {
                    0.0
                } else {
                    lat.iter().sum::<f64>() / lat.len() as f64
                };
                let wrong: u64 = rcodes
                    .iter()
                    .filter(|(k, _)| k.as_str() != "NOERROR")
                    .map(|(_, v)| v)
                    .sum();
                if wrong > 0 {
                    problems.push(format!("{name} at {n} services: wrong answers {rcodes:?}"));
                }
                if completed == 0 {
                    problems.push(format!("{name} at {n} services answered nothing"));
                }
                if cfg.smoke && lost > 0 {
                    problems.push(format!(
                        "{name} at {n} services lost {lost} of {sent} queries at a capped rate"
                    ));
                }
                runs.push(Run {
                    server: name.into(),
                    services: n,
                    sent,
                    completed,
                    lost,
                    rcodes,
                    qps,
                    qps_per_cpu_second: if cpu > 0.0 {
                        completed as f64 / cpu
                    } else {
                        0.0
                    },
                    avg_us: avg,
                    p50_us: percentile(&lat, 0.5),
                    p99_us: percentile(&lat, 0.99),
                });
            }
        }
        agent.check_alive()?;
        coredns.check_alive()?;
    }
    let mut rows = Vec::new();
    for &n in &cfg.sizes {
        for server in ["mcs-agent", "coredns"] {
            let mine: Vec<&Run> = runs
                .iter()
                .filter(|r| r.services == n && r.server == server)
                .collect();
            let med = |f: fn(&Run) -> f64| {
                Spread::of(&mine.iter().map(|r| f(r)).collect::<Vec<f64>>())
                    .map_or(0.0, |s| s.median)
            };
            rows.push(Row {
                server: server.into(),
                services: n,
                qps: med(|r| r.qps),
                qps_per_cpu_second: med(|r| r.qps_per_cpu_second),
                p50_us: med(|r| r.p50_us),
                p99_us: med(|r| r.p99_us),
                lost: mine.iter().map(|r| r.lost).sum(),
                completed: mine.iter().map(|r| r.completed).sum(),
            });
        }
    }
    Ok(Report {
        runs,
        rows,
        problems,
    })
}

/// The report as a Markdown table (with the agent / CoreDNS ratios).
pub fn markdown(r: &Report, cfg: &Config) -> String {
    let mut s = format!(
        "DNS: dnsperf ({} s per run, {} outstanding, {} rounds interleaved, medians); each server on CPU 1, dnsperf on CPU 0\n\n| services | server | QPS | QPS per CPU-second | p50 µs | p99 µs | lost / answered |\n|---|---|---|---|---|---|---|\n",
        cfg.seconds, OUTSTANDING, cfg.rounds
    );
    for row in &r.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} / {} |",
            row.services,
            row.server,
            row.qps,
            row.qps_per_cpu_second,
            row.p50_us,
            row.p99_us,
            row.lost,
            row.completed
        );
    }
    for &n in &cfg.sizes {
        let get = |server: &str| {
            r.rows
                .iter()
                .find(|x| x.services == n && x.server == server)
        };
        if let (Some(a), Some(c)) = (get("mcs-agent"), get("coredns"))
            && c.qps > 0.0
            && c.qps_per_cpu_second > 0.0
        {
            let _ = writeln!(
                s,
                "\n{n} services: mcs-agent / CoreDNS = {:.2}× QPS, {:.2}× QPS per CPU-second, p99 {:.0} vs {:.0} µs",
                a.qps / c.qps,
                a.qps_per_cpu_second / c.qps_per_cpu_second,
                a.p99_us,
                c.p99_us
            );
        }
    }
    for p in &r.problems {
        let _ = writeln!(s, "\nPROBLEM: {p}");
    }
    s
}
