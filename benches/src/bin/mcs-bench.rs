//! `mcs-bench`: measures the mcs-dataplane dataplanes side by side with a direct connection,
//! the kube-proxy analogs, HAProxy and nginx, on one topology of network namespaces.
#![forbid(unsafe_code)]

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use mcs_bench::harness::{self, bed::Mode, load::LoadConfig, load::Workload};

/// Side-by-side benchmark of the mcs-dataplane dataplanes (as root).
///
/// Builds network namespaces (client, node, backends of two clusters; 198.18.0.0/15 only),
/// sets up every mode on the node at once, each on its own addresses, and runs the
/// workloads interleaved (A B C … A B C …). Writes results.json, results.md and SVG plots
/// into --out, and prints the markdown. Everything it creates is removed when it ends.
/// Exits 1 if a mode that the machine can run failed; a mode the machine cannot run
/// (no IPVS in the kernel) is reported as unavailable.
#[derive(Parser, Debug)]
#[command(name = "mcs-bench", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    tool: Option<Tool>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Modes, comma-separated: direct, mcs-ebpf, mcs-userspace, mcs-userspace-b, iptables,
    /// ipvs, nftables, haproxy, haproxy-tproxy, nginx (default: all; mcs-userspace-b only
    /// with --agent-b or --agent-b-args).
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Workloads, comma-separated: crr (new connections), rr (keep-alive requests with
    /// latency), bulk-1, bulk-n (tcp-bulk), udp-rr (default: all).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Seconds per run.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Interleaved repetitions of every run.
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Services installed for the scaling workload, comma-separated (0 or empty: skip).
    #[arg(long, value_delimiter = ',', default_value = "1,1000,10000")]
    scales: Vec<usize>,
    /// wrk threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// wrk connections.
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Streams of bulk-n (a thread each).
    #[arg(long, default_value_t = 8)]
    bulk_streams: usize,
    /// UDP flows (one datagram in flight each).
    #[arg(long, default_value_t = 8)]
    udp_flows: usize,
    /// The mcs-agent binary (default: next to this one).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// A/B runs: the mcs-agent binary of mode `mcs-userspace-b` (default: --agent's), e.g. a
    /// build of the previous commit, measured interleaved with `mcs-userspace`.
    #[arg(long)]
    agent_b: Option<PathBuf>,
    /// A/B runs: flags added to `mcs-userspace-b`'s `mcs-agent run`, space-separated (e.g.
    /// "--tcp-delayed-ack").
    #[arg(long, allow_hyphen_values = true)]
    agent_b_args: Option<String>,
    /// Output directory.
    #[arg(long, default_value = "target/mcs-bench")]
    out: PathBuf,
    /// Do not install missing peers (haproxy, nginx, wrk, iptables, ipvsadm) with apt-get.
    #[arg(long)]
    no_install: bool,
    /// Give the measured service a backend in each cluster instead of one. Balanced modes
    /// then also pay for uneven placement of connections on the two single-worker
    /// backends, which `direct` (threads split evenly) does not.
    #[arg(long)]
    spread: bool,
    /// How the client pod is attached to the node: routed (a veth, as ptp or Calico), bridge
    /// (a port of a Linux bridge) or bridge-nf (a bridge with br_netfilter on, as kubeadm
    /// requires).
    #[arg(long, default_value = "routed", value_parser = mcs_sandbox::topology::ClientNet::parse)]
    client_net: mcs_sandbox::topology::ClientNet,
    /// Smoke mode for CI: 1 s runs, 1 repetition, scaling to 100 services. Proves that every
    /// mode and workload works; the figures mean nothing.
    #[arg(long)]
    smoke: bool,
}

#[derive(Subcommand, Debug)]
enum Tool {
    /// The fault suite: steady load to a ClusterSetIP while a fault is injected, counting
    /// the connections the client saw fail or cut and the longest gap (as root).
    Faults {
        /// Scenarios, comma-separated: agent-kill, backend-kill, flap, burst, apiserver-down
        /// (default: all; apiserver-down runs on ebpf only).
        #[arg(long, value_delimiter = ',')]
        scenarios: Vec<String>,
        /// Dataplanes, comma-separated: ebpf, userspace (default: both).
        #[arg(long, value_delimiter = ',')]
        dataplanes: Vec<String>,
        /// Seconds of load per scenario.
        #[arg(long, default_value_t = 30.0)]
        seconds: f64,
        /// Seconds the API server stays down in apiserver-down (the load runs this much
        /// longer).
        #[arg(long, default_value_t = 60.0)]
        apiserver_down_seconds: f64,
        /// CI: 3 s per scenario (2 s of API server down); exits 1 if any reply was cut or
        /// nothing was served.
        #[arg(long)]
        smoke: bool,
        /// The mcs-agent binary (default: next to this one).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// Output directory (faults.md, faults.json).
        #[arg(long, default_value = "target/mcs-bench")]
        out: PathBuf,
    },
    /// The export story: a Service exported in cluster c2 reaches a client pod of cluster c1
    /// through the ClusterSetIP our mcs-controller allocated and our mcs-agent programmed
    /// (two real API servers, eBPF socket LB; as root). Exits 1 if a step fails.
    ExportDemo {
        /// The mcs-agent binary (default: next to this one).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// The mcs-controller binary (default: next to this one).
        #[arg(long)]
        controller: Option<PathBuf>,
    },
    /// The MCS controller at scale: N real clusters, mcs-controller in each, `--exports`
    /// services exported across them; time to converge, export and endpoint-change latency
    /// (p50/p99), controller RSS. Writes controller-scale.md/.json to --out.
    ControllerScale {
        /// Clusters.
        #[arg(long, default_value_t = 3)]
        clusters: usize,
        /// Exported services (spread over the clusters).
        #[arg(long, default_value_t = 1000)]
        exports: usize,
        /// One-at-a-time samples of each latency.
        #[arg(long, default_value_t = 50)]
        samples: usize,
        /// The mcs-controller binary (default: next to this one).
        #[arg(long)]
        controller: Option<PathBuf>,
        /// The longest wait for convergence (from the first write) and for each sample.
        #[arg(long, default_value_t = 600)]
        wait_secs: u64,
        /// Run the same writes with no controller (the baseline of the write time and of
        /// the API servers' load).
        #[arg(long)]
        no_controller: bool,
        /// Services nobody exports in each cluster (one EndpointSlice of ten endpoints
        /// each), written before the controllers start.
        #[arg(long, default_value_t = 0)]
        unexported: usize,
        /// Changes per second to those unexported slices, after the latencies (with
        /// --churn-secs; the bench reports the rate the API servers took).
        #[arg(long, default_value_t = 0)]
        churn_per_s: usize,
        /// How long the churn of unexported slices lasts.
        #[arg(long, default_value_t = 10)]
        churn_secs: u64,
        /// Output directory.
        #[arg(long, default_value = "target/mcs-bench")]
        out: PathBuf,
    },
    /// clusterset.local DNS: dnsperf against the agent and, in the same run, against
    /// CoreDNS serving the same names from its `file` plugin; queries/s, per CPU-second,
    /// p50/p99. Writes dns.md/.json to --out. Exits 1 on a wrong answer (and, with --smoke,
    /// on a lost query).
    Dns {
        /// Service counts, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "10,10000")]
        services: Vec<usize>,
        /// Seconds per dnsperf run.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Interleaved rounds per server and size.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// CI: 10 services, 1 s, one round, at most 2,000 queries/s; lost queries fail.
        #[arg(long)]
        smoke: bool,
        /// The mcs-agent binary (default: next to this one).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// The coredns binary (default: MCS_COREDNS_BIN_DIR/coredns, else PATH).
        #[arg(long)]
        coredns: Option<PathBuf>,
        /// Output directory.
        #[arg(long, default_value = "target/mcs-bench")]
        out: PathBuf,
    },
    /// (internal) New-connection request loop; prints one JSON line.
    #[command(hide = true)]
    CrrLoop {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        #[arg(long, default_value_t = 2_000_000)]
        max: u64,
    },
    /// (internal) The lifecycle suite's load, inside a pod: new TCP connections, UDP
    /// requests on one flow and `clusterset.local` DNS queries at a fixed rate, until
    /// --stop-file exists; prints one JSON line.
    #[command(hide = true)]
    Probe {
        #[arg(long)]
        tcp: Option<SocketAddr>,
        #[arg(long)]
        udp: Option<SocketAddr>,
        /// An agent's DNS address: asked `dns-version.clusterset.local` TXT over UDP.
        #[arg(long)]
        dns: Option<SocketAddr>,
        /// Requests per second, each of TCP, UDP and DNS.
        #[arg(long, default_value_t = 50.0)]
        rate: f64,
        #[arg(long)]
        stop_file: Option<PathBuf>,
        #[arg(long, default_value_t = 600.0)]
        max_seconds: f64,
    },
    /// (internal) The lifecycle suite's backend, inside a pod: answers each TCP connection
    /// and UDP datagram on --listen with `backend NAME <request>`.
    #[command(hide = true)]
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
    /// (internal) UDP echo server.
    #[command(hide = true)]
    UdpEcho {
        #[arg(long)]
        listen: SocketAddr,
    },
    /// (internal) UDP request/response load; prints one JSON line.
    #[command(hide = true)]
    UdpRr {
        #[arg(long, required = true)]
        target: Vec<SocketAddr>,
        #[arg(long, default_value_t = 8)]
        flows: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        #[arg(long, default_value_t = 64)]
        size: usize,
    },
    /// (internal) TCP sink: reads each connection to its end, answers the byte count.
    #[command(hide = true)]
    TcpSink {
        #[arg(long)]
        listen: SocketAddr,
    },
    /// (internal) TCP bulk streams into a sink; prints one JSON line.
    #[command(hide = true)]
    TcpBulk {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 1)]
        streams: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
    },
    /// (internal) One HTTP GET and one UDP echo through a target.
    #[command(hide = true)]
    Check {
        #[arg(long)]
        http: SocketAddr,
        #[arg(long)]
        udp: Option<SocketAddr>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.tool {
        Some(Tool::UdpEcho { listen }) => harness::tools::udp_echo(listen),
        Some(Tool::UdpRr {
            target,
            flows,
            seconds,
            size,
        }) => harness::tools::udp_rr(&target, flows, seconds, size).and_then(|r| {
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }),
        Some(Tool::TcpSink { listen }) => harness::tools::tcp_sink(listen),
        Some(Tool::TcpBulk {
            target,
            streams,
            seconds,
        }) => harness::tools::tcp_bulk(target, streams, seconds).and_then(|r| {
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }),
        Some(Tool::Check { http, udp }) => harness::tools::check(http, udp),
        Some(Tool::ControllerScale {
            clusters,
            exports,
            samples,
            controller,
            no_controller,
            wait_secs,
            unexported,
            churn_per_s,
            churn_secs,
            out,
        }) => mcs_bench::controller_scale::run(mcs_bench::controller_scale::Params {
            clusters,
            exports,
            samples,
            controller,
            with_controllers: !no_controller,
            wait: std::time::Duration::from_secs(wait_secs),
            unexported,
            churn_per_s,
            churn_secs,
        })
        .and_then(|r| {
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let md = mcs_bench::controller_scale::markdown(&r, &command);
            println!("{md}");
            std::fs::create_dir_all(&out)?;
            std::fs::write(out.join("controller-scale.md"), &md)?;
            std::fs::write(
                out.join("controller-scale.json"),
                serde_json::to_string_pretty(&r)?,
            )?;
            Ok(())
        }),
        Some(Tool::Dns {
            services,
            seconds,
            rounds,
            smoke,
            agent,
            coredns,
            out,
        }) => {
            let coredns = coredns
                .or_else(|| {
                    std::env::var_os("MCS_COREDNS_BIN_DIR")
                        .map(|d| PathBuf::from(d).join("coredns"))
                        .filter(|p| p.is_file())
                })
                .unwrap_or_else(|| PathBuf::from("coredns"));
            let cfg = mcs_bench::dns_perf::Config {
                sizes: if smoke { vec![10] } else { services },
                seconds: if smoke { 1.0 } else { seconds },
                rounds: if smoke { 1 } else { rounds },
                smoke,
                agent: agent.unwrap_or_else(|| mcs_bench::harness::procs::sibling("mcs-agent")),
                coredns,
            };
            (|| {
                mcs_bench::harness::procs::catch_signals()?;
                let r = mcs_bench::dns_perf::run(&cfg)?;
                let md = mcs_bench::dns_perf::markdown(&r, &cfg);
                println!("{md}");
                std::fs::create_dir_all(&out)?;
                std::fs::write(out.join("dns.md"), &md)?;
                std::fs::write(out.join("dns.json"), serde_json::to_string_pretty(&r)?)?;
                if !r.problems.is_empty() {
                    anyhow::bail!("{} problems: {}", r.problems.len(), r.problems.join("; "));
                }
                Ok(())
            })()
        }
        Some(Tool::ExportDemo { agent, controller }) => {
            mcs_bench::export_demo::run(agent, controller)
        }
        Some(Tool::Probe {
            tcp,
            udp,
            dns,
            rate,
            stop_file,
            max_seconds,
        }) => mcs_bench::lifecycle::Probe {
            tcp,
            udp,
            dns,
            rate,
            stop_file,
            max_seconds,
        }
        .run()
        .and_then(|r| {
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }),
        Some(Tool::Serve { listen, name }) => (|| -> anyhow::Result<()> {
            let _backend = mcs_sandbox::backend::Backend::start_here(
                listen,
                format!("backend {name} "),
                true,
                std::time::Duration::from_secs(2),
            )?;
            eprintln!("serving TCP and UDP on {listen} as {name}");
            loop {
                std::thread::park();
            }
        })(),
        Some(Tool::CrrLoop { to, seconds, max }) => {
            let r = mcs_bench::faults::crr_loop(to, seconds, max);
            serde_json::to_string(&r)
                .map(|l| println!("{l}"))
                .map_err(anyhow::Error::from)
        }
        Some(Tool::Faults {
            scenarios,
            dataplanes,
            seconds,
            apiserver_down_seconds,
            smoke,
            agent,
            out,
        }) => {
            return faults(
                &scenarios,
                &dataplanes,
                seconds,
                apiserver_down_seconds,
                smoke,
                agent,
                &out,
            );
        }
        None => return bench(cli.run),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mcs-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn faults(
    scenarios: &[String],
    dataplanes: &[String],
    seconds: f64,
    apiserver_down: f64,
    smoke: bool,
    agent: Option<PathBuf>,
    out: &std::path::Path,
) -> ExitCode {
    use mcs_bench::faults::{self, Dataplane, Scenario, Sizes};
    let scenarios: Result<Vec<Scenario>, String> = if scenarios.is_empty() {
        Ok(Scenario::ALL.to_vec())
    } else {
        scenarios
            .iter()
            .map(|s| Scenario::parse(s).ok_or_else(|| format!("unknown scenario {s:?}")))
            .collect()
    };
    let dataplanes: Result<Vec<Dataplane>, String> = if dataplanes.is_empty() {
        Ok(vec![Dataplane::Ebpf, Dataplane::Userspace])
    } else {
        dataplanes
            .iter()
            .map(|d| match d.as_str() {
                "ebpf" => Ok(Dataplane::Ebpf),
                "userspace" => Ok(Dataplane::Userspace),
                _ => Err(format!("unknown dataplane {d:?}")),
            })
            .collect()
    };
    let (scenarios, dataplanes) = match (scenarios, dataplanes) {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("mcs-bench faults: {e} (see --help)");
            return ExitCode::from(2);
        }
    };
    let seconds = if smoke { 3.0 } else { seconds.max(1.0) };
    let agent = agent.unwrap_or_else(|| mcs_bench::harness::procs::sibling("mcs-agent"));
    let mut outcomes = Vec::new();
    let mut bad = Vec::new();
    let sizes = Sizes {
        seconds,
        burst: if smoke {
            faults::BURST_SERVICES / 10
        } else {
            faults::BURST_SERVICES
        },
        apiserver_down: if smoke { 2.0 } else { apiserver_down.max(1.0) },
    };
    for s in &scenarios {
        for d in &dataplanes {
            if !s.runs_on(*d) {
                eprintln!(
                    "mcs-bench faults: {} does not run on {d:?} (the agent must reach the test \
                     API server on the host's loopback)",
                    s.name()
                );
                continue;
            }
            eprintln!("mcs-bench faults: {} on {:?} for {seconds} s", s.name(), d);
            match faults::run(*s, *d, sizes, &agent) {
                Ok(o) => {
                    if o.load.incomplete > 0 {
                        bad.push(format!(
                            "{} {}: {} cut replies",
                            o.scenario, o.dataplane, o.load.incomplete
                        ));
                    }
                    if o.load.ok == 0 {
                        bad.push(format!("{} {}: nothing served", o.scenario, o.dataplane));
                    }
                    outcomes.push(o);
                }
                Err(e) => bad.push(format!("{} {d:?}: {e:#}", s.name())),
            }
        }
    }
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let md = faults::markdown(&outcomes, &command);
    println!("{md}");
    let _ = std::fs::create_dir_all(out);
    let _ = std::fs::write(out.join("faults.md"), &md);
    if let Ok(json) = serde_json::to_string_pretty(&outcomes) {
        let _ = std::fs::write(out.join("faults.json"), json);
    }
    if bad.is_empty() {
        ExitCode::SUCCESS
    } else {
        for b in &bad {
            eprintln!("mcs-bench faults: {b}");
        }
        ExitCode::from(1)
    }
}

fn bench(mut a: RunArgs) -> ExitCode {
    if a.smoke {
        a.seconds = 1;
        a.repetitions = 1;
        a.scales = vec![1, 100];
    }
    let ab = a.agent_b.is_some() || a.agent_b_args.is_some();
    let modes: Result<Vec<Mode>, String> = if a.modes.is_empty() {
        Ok(Mode::ALL
            .into_iter()
            .filter(|m| ab || *m != Mode::McsUserspaceB)
            .collect())
    } else {
        a.modes
            .iter()
            .map(|m| Mode::parse(m).ok_or_else(|| format!("unknown mode {m:?}")))
            .collect()
    };
    let workloads: Result<Vec<Workload>, String> = if a.workloads.is_empty() {
        Ok(Workload::ALL.to_vec())
    } else {
        a.workloads
            .iter()
            .map(|w| Workload::parse(w).ok_or_else(|| format!("unknown workload {w:?}")))
            .collect()
    };
    let (modes, workloads) = match (modes, workloads) {
        (Ok(m), Ok(w)) => (m, w),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("mcs-bench: {e} (see --help)");
            return ExitCode::from(2);
        }
    };
    if a.seconds == 0 || a.repetitions == 0 || a.threads == 0 || a.connections < a.threads {
        eprintln!(
            "mcs-bench: --seconds, --repetitions, --threads must be > 0 and --connections >= --threads"
        );
        return ExitCode::from(2);
    }
    if let Some(n) = a.scales.iter().find(|n| **n > harness::bed::MAX_SERVICES) {
        eprintln!(
            "mcs-bench: at most {} services per mode (asked {n})",
            harness::bed::MAX_SERVICES
        );
        return ExitCode::from(2);
    }
    let agent = a
        .agent
        .unwrap_or_else(|| mcs_bench::harness::procs::sibling("mcs-agent"));
    let agent_b = modes
        .contains(&Mode::McsUserspaceB)
        .then(|| harness::bed::AgentB {
            agent: a.agent_b.clone().unwrap_or_else(|| agent.clone()),
            args: a
                .agent_b_args
                .as_deref()
                .unwrap_or_default()
                .split_whitespace()
                .map(String::from)
                .collect(),
        });
    let opts = harness::Options {
        agent_b,
        modes,
        workloads,
        repetitions: a.repetitions,
        scales: a.scales.into_iter().filter(|n| *n > 0).collect(),
        load: LoadConfig {
            seconds: a.seconds,
            threads: a.threads,
            connections: a.connections,
            bulk_streams: a.bulk_streams,
            udp_flows: a.udp_flows,
        },
        agent,
        out: a.out,
        install: !a.no_install,
        spread: a.spread,
        client_net: a.client_net,
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    match harness::run(&opts) {
        Ok(report) => {
            println!("{}", report.markdown());
            eprintln!("mcs-bench: results in {}", opts.out.display());
            let failures = report.failures();
            if failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                eprintln!("mcs-bench: {} failure(s):", failures.len());
                for f in failures {
                    eprintln!("  {f}");
                }
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("mcs-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}
