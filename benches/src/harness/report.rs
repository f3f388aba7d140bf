//! The report: JSON (everything, every run), a markdown table, SVG plots.

use std::{fmt::Write as _, path::Path};

use serde::Serialize;

use super::{
    bed::Mode,
    load::{LoadConfig, Run, Workload},
    stats::Spread,
    svg::{Chart, Scale, Series, short},
};

/// How the run was made.
#[derive(Debug, Clone, Serialize)]
pub struct Meta {
    /// UTC time of the start.
    pub date: String,
    /// `uname -r`.
    pub kernel: String,
    /// CPUs online.
    pub cpus: usize,
    /// Interleaved repetitions.
    pub repetitions: usize,
    /// Load generator settings.
    pub load: LoadConfig,
    /// Versions of the peers and tools.
    pub versions: Vec<(String, String)>,
    /// The command line.
    pub command: String,
    /// The mcs-agent binary used.
    pub agent: String,
    /// Backends of the measured HTTP and UDP service.
    pub web_backends: usize,
    /// How the client is attached to the node: routed, bridge, bridge-nf.
    pub client_net: &'static str,
}

/// A mode's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// The mode.
    pub mode: Mode,
    /// `ok`, `unavailable` (the machine cannot run it) or `failed`.
    pub status: &'static str,
    /// Why, when not ok.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One workload × mode.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// The workload.
    pub workload: Workload,
    /// The mode.
    pub mode: Mode,
    /// Every repetition, in order.
    pub runs: Vec<Run>,
    /// Errors of failed repetitions.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<String>,
    /// Median and range of the figure.
    pub value: Option<Spread>,
    /// Median of this mode / median of `direct`.
    pub ratio_to_direct: Option<f64>,
    /// Median load-balancer CPU (% of a core).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lb_cpu_pct: Option<f64>,
    /// Median over the repetitions of the load balancer's CPU seconds per unit of the figure
    /// (per connection for `crr`, per Gbit for bulk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lb_cpu_per_unit: Option<f64>,
    /// Latency percentiles of the repetition with the median figure.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub latency_us: Vec<(f64, f64)>,
}

/// New connections/s of one mode with `services` services installed.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleCell {
    /// The mode.
    pub mode: Mode,
    /// Services installed (the measured one included).
    pub services: usize,
    /// conn/s of every repetition.
    pub runs: Vec<f64>,
    /// Errors of failed repetitions.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<String>,
    /// Median and range.
    pub value: Option<Spread>,
    /// Median / median of `direct` at the same step.
    pub ratio_to_direct: Option<f64>,
    /// Resident memory of the mode's agent with these services programmed (mcs modes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_rss_mib: Option<f64>,
}

/// Everything measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// How.
    pub meta: Meta,
    /// Per mode: ran, unavailable or failed.
    pub modes: Vec<ModeReport>,
    /// The workloads.
    pub results: Vec<Cell>,
    /// The scaling workload.
    pub scaling: Vec<ScaleCell>,
}

impl Cell {
    /// Builds the summary of `runs`.
    pub fn new(workload: Workload, mode: Mode, runs: Vec<Run>, failures: Vec<String>) -> Self {
        let values: Vec<f64> = runs.iter().map(|r| r.value).collect();
        let value = Spread::of(&values);
        let median_run = value.and_then(|s| runs.iter().find(|r| r.value == s.median));
        let cpus: Vec<f64> = runs.iter().filter_map(|r| r.lb_cpu_pct).collect();
        let per_unit: Vec<f64> = runs
            .iter()
            .filter_map(|r| Some(r.lb_cpu_pct? / 100.0 / r.value))
            .filter(|v| v.is_finite())
            .collect();
        Self {
            lb_cpu_per_unit: Spread::of(&per_unit).map(|s| s.median),
            workload,
            mode,
            latency_us: median_run.map(|r| r.latency_us.clone()).unwrap_or_default(),
            lb_cpu_pct: Spread::of(&cpus).map(|s| s.median),
            runs,
            failures,
            value,
            ratio_to_direct: None,
        }
    }
}

impl Report {
    /// Fills the ratios to `direct`.
    pub fn compute_ratios(&mut self) {
        let direct = |w: Workload, cells: &[Cell]| {
            cells
                .iter()
                .find(|c| c.workload == w && c.mode == Mode::Direct)
                .and_then(|c| c.value)
                .map(|s| s.median)
        };
        let refs: Vec<Option<f64>> = self
            .results
            .iter()
            .map(|c| direct(c.workload, &self.results))
            .collect();
        for (c, d) in self.results.iter_mut().zip(refs) {
            c.ratio_to_direct = ratio(c.value, d);
        }
        let refs: Vec<Option<f64>> = self
            .scaling
            .iter()
            .map(|c| {
                self.scaling
                    .iter()
                    .find(|d| d.mode == Mode::Direct && d.services == c.services)
                    .and_then(|d| d.value)
                    .map(|s| s.median)
            })
            .collect();
        for (c, d) in self.scaling.iter_mut().zip(refs) {
            c.ratio_to_direct = ratio(c.value, d);
        }
    }

    /// Every failure, as lines.
    pub fn failures(&self) -> Vec<String> {
        let mut out = vec![];
        for m in &self.modes {
            if m.status == "failed" {
                out.push(format!(
                    "{}: set-up failed: {}",
                    m.mode.name(),
                    m.reason.clone().unwrap_or_default()
                ));
            }
        }
        for c in &self.results {
            for f in &c.failures {
                out.push(format!("{} {}: {f}", c.mode.name(), c.workload.name()));
            }
        }
        for c in &self.scaling {
            for f in &c.failures {
                out.push(format!("{} at {} services: {f}", c.mode.name(), c.services));
            }
        }
        out
    }

    fn cell(&self, mode: Mode, w: Workload) -> Option<&Cell> {
        self.results
            .iter()
            .find(|c| c.mode == mode && c.workload == w)
    }

    /// The markdown report.
    pub fn markdown(&self) -> String {
        let m = &self.meta;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Measured {} on {} CPUs, kernel {}; {} s per run, {} interleaved repetitions; \
             wrk -t{} -c{}, tcp-bulk (a thread a stream), UDP {} flows; {}; the client {}. Cells: median (ratio to `direct`) [min–max].\n",
            m.date,
            m.cpus,
            m.kernel,
            m.load.seconds,
            m.repetitions,
            m.load.threads,
            m.load.connections,
            m.load.udp_flows,
            if m.web_backends > 1 {
                format!(
                    "the service has {} backends, one per cluster (`direct` splits its connections evenly over them)",
                    m.web_backends
                )
            } else {
                "the service has one backend".to_string()
            },
            match m.client_net {
                "bridge" => "on a Linux bridge (br_netfilter off)",
                "bridge-nf" => "on a Linux bridge with br_netfilter on",
                _ => "on a routed veth",
            }
        );
        let cols: Vec<Workload> = Workload::ALL
            .into_iter()
            .filter(|w| self.results.iter().any(|c| c.workload == *w))
            .collect();
        let mut head = vec!["mode".to_string()];
        for w in &cols {
            head.push(match w {
                Workload::Crr => "new conn/s".into(),
                Workload::Rr => "keep-alive req/s".into(),
                Workload::Bulk1 => "bulk 1 stream Gbit/s".into(),
                Workload::BulkN => format!("bulk {} streams Gbit/s", m.load.bulk_streams),
                Workload::UdpRr => "UDP req/s".into(),
            });
            if matches!(w, Workload::Rr | Workload::UdpRr) {
                head.push(format!(
                    "{} p50 / p99 / p99.9 µs",
                    if *w == Workload::Rr { "TCP" } else { "UDP" }
                ));
            }
        }
        head.push("LB CPU % of a core (CRR)".into());
        head.push("LB CPU µs per conn (CRR)".into());
        head.push("LB CPU s per GB (bulk 1)".into());
        let _ = writeln!(s, "| {} |", head.join(" | "));
        let _ = writeln!(s, "|{}", "---|".repeat(head.len()));
        for mr in self.modes.iter().filter(|m| m.status == "ok") {
            let mode = mr.mode;
            let mut row = vec![mode.name().to_string()];
            for w in &cols {
                let c = self.cell(mode, *w);
                row.push(match c {
                    None => "n/a".into(),
                    Some(c) => figure(c.value, c.ratio_to_direct, !c.failures.is_empty()),
                });
                if matches!(w, Workload::Rr | Workload::UdpRr) {
                    row.push(c.map(|c| latency(&c.latency_us)).unwrap_or("n/a".into()));
                }
            }
            let crr = self.cell(mode, Workload::Crr);
            row.push(
                crr.and_then(|c| c.lb_cpu_pct)
                    .map(|p| format!("{p:.0}"))
                    .unwrap_or_else(|| {
                        match mode {
                            _ if crr.is_none() => "n/a (no crr run)",
                            Mode::Direct => "–",
                            Mode::McsEbpf => "– (in the client's connect)",
                            _ => "– (kernel, softirq)",
                        }
                        .into()
                    }),
            );
            let per_unit = |w: Workload, scale: f64, digits: usize| {
                self.cell(mode, w)
                    .and_then(|c| c.lb_cpu_per_unit)
                    .map(|v| format!("{:.digits$}", v * scale))
                    .unwrap_or_else(|| "–".into())
            };
            row.push(per_unit(Workload::Crr, 1e6, 0));
            // Per Gbit × 8: per GB.
            row.push(per_unit(Workload::Bulk1, 8.0, 2));
            let _ = writeln!(s, "| {} |", row.join(" | "));
        }
        for mr in self.modes.iter().filter(|m| m.status != "ok") {
            let _ = writeln!(
                s,
                "\n`{}`: {} — {}",
                mr.mode.name(),
                mr.status,
                one_line(mr.reason.as_deref().unwrap_or_default())
            );
        }
        if !self.scaling.is_empty() {
            let mut steps: Vec<usize> = self.scaling.iter().map(|c| c.services).collect();
            steps.dedup();
            let _ = writeln!(
                s,
                "\nNew connections/s with N services installed (the measured one last; median (ratio to `direct` at the same step) [min–max]):\n"
            );
            let _ = writeln!(
                s,
                "| mode | {} |",
                steps
                    .iter()
                    .map(|n| format!(
                        "{} service{}",
                        short(*n as f64),
                        if *n == 1 { "" } else { "s" }
                    ))
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
            let _ = writeln!(s, "|{}", "---|".repeat(steps.len() + 1));
            let mut modes: Vec<Mode> = self.scaling.iter().map(|c| c.mode).collect();
            modes.sort();
            modes.dedup();
            for mode in modes {
                let cells: Vec<String> = steps
                    .iter()
                    .map(|n| {
                        self.scaling
                            .iter()
                            .find(|c| c.mode == mode && c.services == *n)
                            .map(|c| figure(c.value, c.ratio_to_direct, !c.failures.is_empty()))
                            .unwrap_or("n/a".into())
                    })
                    .collect();
                let _ = writeln!(s, "| {} | {} |", mode.name(), cells.join(" | "));
            }
            let rss: Vec<String> = self
                .scaling
                .iter()
                .filter_map(|c| {
                    Some(format!(
                        "{} at {} service{} {:.0} MiB",
                        c.mode.name(),
                        short(c.services as f64),
                        if c.services == 1 { "" } else { "s" },
                        c.agent_rss_mib?
                    ))
                })
                .collect();
            if !rss.is_empty() {
                let _ = writeln!(
                    s,
                    "\nAgent resident memory (each filler service: 1 port, 2 endpoints): {}.",
                    rss.join(", ")
                );
            }
        }
        let failures = self.failures();
        if !failures.is_empty() {
            let _ = writeln!(s, "\nFailures (marked † above):\n");
            for f in failures {
                let _ = writeln!(s, "- {}", one_line(&f));
            }
        }
        let _ = writeln!(
            s,
            "\nVersions: {}.",
            m.versions
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        s
    }

    /// Writes results.json, results.md and the plots into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(self)?,
        )?;
        std::fs::write(dir.join("results.md"), self.markdown())?;
        for (w, file, what) in [
            (
                Workload::Rr,
                "latency-tcp.svg",
                "TCP request/response (keep-alive)",
            ),
            (Workload::UdpRr, "latency-udp.svg", "UDP request/response"),
        ] {
            let series: Vec<Series> = self
                .results
                .iter()
                .filter(|c| c.workload == w && !c.latency_us.is_empty())
                .map(|c| Series {
                    name: c.mode.name().into(),
                    points: c.latency_us.clone(),
                })
                .collect();
            if series.is_empty() {
                continue;
            }
            let chart = Chart {
                title: format!("Latency by percentile: {what}"),
                x_label: "percentile".into(),
                y_label: "latency (µs)".into(),
                x_scale: Scale::Nines,
                y_scale: Scale::Log,
                series,
            };
            std::fs::write(dir.join(file), chart.render())?;
        }
        let mut modes: Vec<Mode> = self.scaling.iter().map(|c| c.mode).collect();
        modes.sort();
        modes.dedup();
        if !modes.is_empty() {
            let series = modes
                .into_iter()
                .map(|mode| Series {
                    name: mode.name().into(),
                    points: self
                        .scaling
                        .iter()
                        .filter(|c| c.mode == mode)
                        .filter_map(|c| Some((c.services as f64, c.ratio_to_direct?)))
                        .collect(),
                })
                .collect();
            let chart = Chart {
                title: "New connections/s vs services installed".into(),
                x_label: "services installed (the measured one last)".into(),
                y_label: "new conn/s, ratio to direct at the same step".into(),
                x_scale: Scale::Log,
                y_scale: Scale::Linear,
                series,
            };
            std::fs::write(dir.join("scaling.svg"), chart.render())?;
        }
        Ok(())
    }
}

/// A message on one line, at most 400 characters (the JSON has it whole).
fn one_line(s: &str) -> String {
    let flat = s.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(400) {
        Some((i, _)) => format!("{}…", &flat[..i]),
        None => flat,
    }
}

fn ratio(v: Option<Spread>, d: Option<f64>) -> Option<f64> {
    let d = d?;
    (d > 0.0).then(|| v.map(|s| s.median / d)).flatten()
}

fn figure(v: Option<Spread>, ratio: Option<f64>, failed: bool) -> String {
    let mark = if failed { " †" } else { "" };
    match v {
        None => format!("failed{mark}"),
        Some(s) => {
            let num = |x: f64| {
                if x < 100.0 {
                    format!("{x:.1}")
                } else {
                    short(x)
                }
            };
            let r = ratio.map(|r| format!(" ({r:.2})")).unwrap_or_default();
            format!("{}{r} [{}–{}]{mark}", num(s.median), num(s.min), num(s.max))
        }
    }
}

fn latency(l: &[(f64, f64)]) -> String {
    let at = |p: f64| {
        l.iter()
            .find(|(q, _)| (q - p).abs() < 1e-9)
            .map(|(_, us)| format!("{us:.0}"))
            .unwrap_or("?".into())
    };
    if l.is_empty() {
        return "n/a".into();
    }
    format!("{} / {} / {}", at(50.0), at(99.0), at(99.9))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(v: f64) -> Run {
        Run {
            value: v,
            latency_us: vec![(50.0, v / 100.0), (99.0, v / 10.0), (99.9, v)],
            ..Run::default()
        }
    }

    #[test]
    fn ratios_and_table() {
        let mut r = Report {
            meta: Meta {
                date: "d".into(),
                kernel: "k".into(),
                cpus: 2,
                repetitions: 3,
                load: LoadConfig {
                    seconds: 1,
                    threads: 2,
                    connections: 50,
                    bulk_streams: 8,
                    udp_flows: 8,
                },
                versions: vec![("wrk".into(), "4.1".into())],
                command: "mcs-bench".into(),
                agent: "a".into(),
                web_backends: 1,
                client_net: "routed",
            },
            modes: vec![
                ModeReport {
                    mode: Mode::Direct,
                    status: "ok",
                    reason: None,
                },
                ModeReport {
                    mode: Mode::Haproxy,
                    status: "ok",
                    reason: None,
                },
                ModeReport {
                    mode: Mode::Ipvs,
                    status: "unavailable",
                    reason: Some("no IPVS".into()),
                },
            ],
            results: vec![
                Cell::new(
                    Workload::Crr,
                    Mode::Direct,
                    vec![run(1000.0), run(3000.0), run(2000.0)],
                    vec![],
                ),
                Cell::new(
                    Workload::Crr,
                    Mode::Haproxy,
                    vec![run(1000.0)],
                    vec!["boom".into()],
                ),
            ],
            scaling: vec![],
        };
        r.compute_ratios();
        assert_eq!(r.results[0].value.unwrap().median, 2000.0);
        assert_eq!(r.results[1].ratio_to_direct, Some(0.5));
        assert_eq!(r.results[0].latency_us[2], (99.9, 2000.0));
        let md = r.markdown();
        assert!(md.contains("| haproxy | 1k (0.50) [1k–1k] † |"), "{md}");
        assert!(md.contains("`ipvs`: unavailable — no IPVS"));
        assert_eq!(r.failures(), vec!["haproxy crr: boom".to_string()]);
    }
}
