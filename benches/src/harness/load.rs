//! The workloads and the load generators that measure them.
//!
//! - TCP (new connections, persistent request/response): `wrk`, the generator the anchor
//!   figures in BENCHMARKS.md were taken with, so our ratios compare with them. Its latency
//!   percentiles are exact (its own HdrHistogram) but closed-loop: a stalled connection
//!   sends nothing while it waits, so the tail is understated under overload (coordinated
//!   omission) — the same for every mode.
//! - Bulk: our own [`super::tools::tcp_bulk`] (one stream, and `--bulk-streams` streams, a
//!   thread each) into [`super::tools::tcp_sink`]; iperf3 3.12 runs every stream on one
//!   thread, which was the limit of the many-streams figure (see the tools module).
//! - UDP request/response: our own generator ([`super::tools::udp_rr`]).

use std::{net::SocketAddr, path::Path, time::Duration};

use anyhow::{Context, bail};
use serde::Serialize;

use super::{
    bed::{Bed, Mode, Target},
    procs::run_bounded,
    stats::PERCENTILES,
    tools::{BulkReport, UdpReport},
};

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// New connection per request (connect, small request, small response, close).
    Crr,
    /// Requests on persistent connections, with latency percentiles.
    Rr,
    /// Bulk throughput, one stream.
    Bulk1,
    /// Bulk throughput, many streams.
    BulkN,
    /// UDP request/response.
    UdpRr,
}

impl Workload {
    /// All, in report order.
    pub const ALL: [Workload; 5] = [
        Workload::Crr,
        Workload::Rr,
        Workload::Bulk1,
        Workload::BulkN,
        Workload::UdpRr,
    ];

    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Crr => "crr",
            Workload::Rr => "rr",
            Workload::Bulk1 => "bulk-1",
            Workload::BulkN => "bulk-n",
            Workload::UdpRr => "udp-rr",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.name() == s)
    }

    /// What [`Run::errors`] counts for it.
    pub fn error_word(self) -> &'static str {
        match self {
            Workload::Crr | Workload::Rr => "socket errors",
            Workload::Bulk1 | Workload::BulkN => "TCP retransmits",
            Workload::UdpRr => "lost",
        }
    }

    /// Unit of its figure.
    pub fn unit(self) -> &'static str {
        match self {
            Workload::Crr => "conn/s",
            Workload::Rr | Workload::UdpRr => "req/s",
            Workload::Bulk1 | Workload::BulkN => "Gbit/s",
        }
    }
}

/// Settings of the load generators.
#[derive(Debug, Clone, Serialize)]
pub struct LoadConfig {
    /// Seconds per run.
    pub seconds: u64,
    /// wrk threads.
    pub threads: usize,
    /// wrk connections.
    pub connections: usize,
    /// Streams of the many-streams bulk run.
    pub bulk_streams: usize,
    /// UDP flows.
    pub udp_flows: usize,
}

/// One run's result.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Run {
    /// The figure (see [`Workload::unit`]).
    pub value: f64,
    /// Latency (percentile, µs), for request/response workloads.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub latency_us: Vec<(f64, f64)>,
    /// Socket errors (wrk), lost datagrams (UDP) or retransmits (bulk).
    pub errors: u64,
    /// CPU time of the load balancer's processes in % of one core, when it has processes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lb_cpu_pct: Option<f64>,
}

/// Whether `workload` applies to `target` (HAProxy has no UDP).
pub fn applies(target: &Target, workload: Workload) -> bool {
    workload != Workload::UdpRr || target.udp.is_some()
}

/// Runs `workload` against `target` once.
pub fn run(
    bed: &Bed,
    mode: Mode,
    target: &Target,
    workload: Workload,
    cfg: &LoadConfig,
    tag: &str,
) -> anyhow::Result<Run> {
    let base = bed
        .work
        .join(format!("{tag}-{}-{}", mode.name(), workload.name()));
    bed.reset_conntrack()?;
    let cpu0 = cpu_usec(target);
    let t0 = std::time::Instant::now();
    let mut run = match workload {
        Workload::Crr => wrk(bed, target, cfg, true, &base)?,
        Workload::Rr => wrk(bed, target, cfg, false, &base)?,
        Workload::Bulk1 => bulk(bed, target, cfg, 1, &base)?,
        Workload::BulkN => bulk(bed, target, cfg, cfg.bulk_streams, &base)?,
        Workload::UdpRr => udp(bed, target, cfg, &base)?,
    };
    let wall = t0.elapsed().as_micros() as f64;
    if let (Some(a), Some(b)) = (cpu0, cpu_usec(target)) {
        run.lb_cpu_pct = Some((b - a) as f64 / wall * 100.0);
    }
    if run.value <= 0.0 || !run.value.is_finite() {
        bail!(
            "{} {}: nothing got through (figure {}, {} errors); outputs in {}.*",
            mode.name(),
            workload.name(),
            run.value,
            run.errors,
            base.display()
        );
    }
    Ok(run)
}

fn cpu_usec(target: &Target) -> Option<u64> {
    let text = std::fs::read_to_string(target.cpu_cgroup.as_ref()?.join("cpu.stat")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok())
}

fn limit(cfg: &LoadConfig) -> Duration {
    Duration::from_secs(cfg.seconds + 30)
}

/// The wrk script: spreads threads over the targets (for `direct`), prints a summary line.
fn wrk_script(targets: &[SocketAddr]) -> String {
    let list: Vec<String> = targets
        .iter()
        .map(|a| format!("wrk.lookup(\"{}\", \"{}\")[1]", a.ip(), a.port()))
        .collect();
    let pcts: Vec<String> = PERCENTILES.iter().map(|p| p.to_string()).collect();
    format!(
        r#"local targets = nil
local n = 0
function setup(thread)
  if targets == nil then targets = {{ {list} }} end
  thread.addr = targets[(n % #targets) + 1]
  n = n + 1
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("MCSBENCH %d %d %d\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.status + e.timeout))
  for _, p in ipairs({{ {pcts} }}) do
    io.write(string.format("MCSLAT %s %d\n", p, latency:percentile(p)))
  end
end
"#,
        list = list.join(", "),
        pcts = pcts.join(", ")
    )
}

fn wrk(
    bed: &Bed,
    target: &Target,
    cfg: &LoadConfig,
    close: bool,
    base: &Path,
) -> anyhow::Result<Run> {
    let script = base.with_extension("lua");
    std::fs::write(&script, wrk_script(&target.web))?;
    let mut cmd = bed.client(target, "wrk");
    cmd.arg(format!("-t{}", cfg.threads))
        .arg(format!("-c{}", cfg.connections))
        .arg(format!("-d{}s", cfg.seconds))
        .arg("-s")
        .arg(&script);
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(format!("http://{}/", target.web[0]));
    let out = run_bounded(cmd, base, limit(cfg))?;
    parse_wrk(&out).with_context(|| format!("parsing wrk output in {}", base.display()))
}

/// Parses the lines our wrk script prints.
pub fn parse_wrk(out: &str) -> anyhow::Result<Run> {
    let mut run = Run::default();
    let mut seen = false;
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["MCSBENCH", req, dur, err] => {
                let req: f64 = req.parse()?;
                let dur: f64 = dur.parse()?;
                run.value = if dur > 0.0 { req / (dur / 1e6) } else { 0.0 };
                run.errors = err.parse()?;
                seen = true;
            }
            ["MCSLAT", p, us] => run.latency_us.push((p.parse()?, us.parse()?)),
            _ => {}
        }
    }
    if !seen {
        bail!("no summary line in wrk's output");
    }
    Ok(run)
}

fn bulk(
    bed: &Bed,
    target: &Target,
    cfg: &LoadConfig,
    streams: usize,
    base: &Path,
) -> anyhow::Result<Run> {
    let exe = std::env::current_exe()?;
    let mut cmd = bed.client(target, &exe.to_string_lossy());
    cmd.args([
        "tcp-bulk",
        "--target",
        &target.bulk.to_string(),
        "--streams",
        &streams.to_string(),
        "--seconds",
        &cfg.seconds.to_string(),
    ]);
    let out = run_bounded(cmd, base, limit(cfg))?;
    parse_bulk(&out).with_context(|| format!("parsing tcp-bulk output in {}", base.display()))
}

/// Gbit/s received and retransmits from `tcp-bulk`'s JSON line.
pub fn parse_bulk(out: &str) -> anyhow::Result<Run> {
    let r: BulkReport = serde_json::from_str(out.trim())?;
    Ok(Run {
        value: r.bytes as f64 * 8.0 / r.seconds.max(1e-9) / 1e9,
        errors: r.retransmits,
        ..Run::default()
    })
}

fn udp(bed: &Bed, target: &Target, cfg: &LoadConfig, base: &Path) -> anyhow::Result<Run> {
    let exe = std::env::current_exe()?;
    let mut cmd = bed.client(target, &exe.to_string_lossy());
    cmd.arg("udp-rr");
    for t in target.udp.as_deref().unwrap_or_default() {
        cmd.args(["--target", &t.to_string()]);
    }
    cmd.args([
        "--flows",
        &cfg.udp_flows.to_string(),
        "--seconds",
        &cfg.seconds.to_string(),
    ]);
    let out = run_bounded(cmd, base, limit(cfg))?;
    let r: UdpReport = serde_json::from_str(out.trim())
        .with_context(|| format!("parsing udp-rr output in {}", base.display()))?;
    Ok(Run {
        value: r.requests as f64 / r.seconds.max(1e-9),
        latency_us: r.percentiles,
        errors: r.lost,
        lb_cpu_pct: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_summary_is_parsed() {
        let out = "Running 1s test @ http://x/\nMCSBENCH 20000 2000000 3\nMCSLAT 50 120\nMCSLAT 99.9 900\n";
        let r = parse_wrk(out).unwrap();
        assert_eq!(r.value, 10_000.0);
        assert_eq!(r.errors, 3);
        assert_eq!(r.latency_us, vec![(50.0, 120.0), (99.9, 900.0)]);
        assert!(parse_wrk("Running 1s test\n").is_err());
    }

    #[test]
    fn bulk_report_is_parsed() {
        let r = parse_bulk(r#"{"streams":8,"bytes":5000000000,"seconds":4.0,"retransmits":7}"#)
            .unwrap();
        assert_eq!((r.value, r.errors), (10.0, 7));
        assert!(parse_bulk("tcp-bulk: error").is_err());
    }

    #[test]
    fn wrk_script_spreads_threads_over_targets() {
        let s = wrk_script(&[
            "198.18.1.2:8080".parse().unwrap(),
            "198.18.2.2:8080".parse().unwrap(),
        ]);
        assert!(s.contains(
            r#"wrk.lookup("198.18.1.2", "8080")[1], wrk.lookup("198.18.2.2", "8080")[1]"#
        ));
        assert!(s.contains("99.9"));
    }
}
