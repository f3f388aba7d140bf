//! The subcommands.

use std::{process::ExitCode, sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use mcs_model::{Dataplane, Index, NodeConfig, render};
use mcs_proxy::ebpf::{MapSizes, SocketLb, read_pinned};
use mcs_proxy::userspace::{
    TcpEngine, Userspace, UserspaceConfig, metrics::ProxyMetrics, nft::InterceptConfig,
};
use mcs_sync::{
    LogDataplane, SourceEvent, SyncConfig, SyncLoop,
    events::EventSink,
    http::{self, Health},
    metrics::Metrics,
    source::{
        self, SourceSpec,
        file::{FileLimits, FileSource},
    },
};
use tokio::sync::{mpsc, watch};

use crate::cli::{
    Cli, Command, DataplaneKind, DnsQueryArgs, Format, ProxyArgs, RunArgs, SourceArgs, StatusArgs,
    TableArgs, TcpEngineArg,
};

/// Capacity of the source → controller channel.
const SOURCE_CHANNEL: usize = 4096;

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Table(args) => runtime()?.block_on(table(args)),
        Command::Dns(args) => runtime()?.block_on(dns_query(args)),
        Command::Run(args) => runtime()?.block_on(agent(*args)),
        Command::Status(args) => status(&args),
        Command::Uninstall(args) => {
            let n = SocketLb::uninstall(&args.bpf_pin_dir)?;
            println!(
                "removed {n} pinned objects from {} (programs detached)",
                args.bpf_pin_dir.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => crate::demo::run(&args),
    }
}

/// The table of a directory source as text (for the demo).
pub fn table_text(
    dir: &std::path::Path,
    cluster_id: &str,
    guard: mcs_model::Guard,
) -> anyhow::Result<String> {
    let mut src = FileSource::new(dir);
    let mut index = Index::new(NodeConfig {
        cluster_id: cluster_id.into(),
        guard,
        ..Default::default()
    });
    let mut unreadable = std::collections::BTreeMap::new();
    for ev in src.scan()? {
        source::apply(&mut index, &mut unreadable, ev, true);
    }
    index.flush();
    Ok(render::text(index.table(), &index.rejections()))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// The node's settings for the index, with the guard built from the flags and the node.
fn node_config(
    args: &SourceArgs,
    node_name: Option<&str>,
    apiserver: &[std::net::IpAddr],
) -> anyhow::Result<NodeConfig> {
    Ok(NodeConfig {
        cluster_id: args.cluster_id.clone().unwrap_or_default(),
        zone: args.zone.clone(),
        node_name: node_name.map(str::to_string),
        guard: crate::guard::build(&args.guard, apiserver)?,
    })
}

/// A client for `--source kube`, and the addresses of its API server (protected).
async fn kube_client(args: &SourceArgs) -> anyhow::Result<(kube::Client, Vec<std::net::IpAddr>)> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig or in-cluster config")?,
    };
    let apiserver = crate::guard::apiserver_addresses(&config.cluster_url).await;
    Ok((kube::Client::try_from(config)?, apiserver))
}

/// The source of `args`: its client (kube) and the node config, ready to start.
struct Prepared {
    client: Option<kube::Client>,
    node: NodeConfig,
}

/// Checks the source and builds the node config (before anything is started or touched).
async fn prepare(args: &SourceArgs, node_name: Option<&str>) -> anyhow::Result<Prepared> {
    match &args.source {
        SourceSpec::File(dir) => {
            if !dir.is_dir() {
                bail!(
                    "source directory {} does not exist or is not a directory",
                    dir.display()
                );
            }
            Ok(Prepared {
                client: None,
                node: node_config(args, node_name, &[])?,
            })
        }
        SourceSpec::Kube => {
            let (client, apiserver) = kube_client(args).await?;
            Ok(Prepared {
                client: Some(client),
                node: node_config(args, node_name, &apiserver)?,
            })
        }
    }
}

/// Starts the source of `args` as a task sending into `tx` (`client`: from [`prepare`]).
fn spawn_source(
    args: &SourceArgs,
    client: Option<kube::Client>,
    tx: mpsc::Sender<SourceEvent>,
    poll: Duration,
) {
    match &args.source {
        SourceSpec::File(dir) => {
            let limits = FileLimits {
                max_file_bytes: args.guard.max_file_bytes,
                ..FileLimits::default()
            };
            tokio::spawn(FileSource::with_limits(dir, limits).run(tx, poll));
        }
        SourceSpec::Kube => {
            if let Some(client) = client {
                let options = mcs_sync::source::kube::Options {
                    watch_cluster_id: args.cluster_id.is_none(),
                    retry_max: Duration::from_millis(args.watch_retry_max_ms),
                    ..Default::default()
                };
                tokio::spawn(mcs_sync::source::kube::run(client, tx, options));
            }
        }
    }
}

/// The index after the source's first full sync (or its end), and what it could not read.
async fn first_sync(
    args: &SourceArgs,
    timeout_s: u64,
    track_dns: bool,
) -> anyhow::Result<(Index, Vec<mcs_model::Rejection>)> {
    let prepared = prepare(args, None).await?;
    let (tx, mut rx) = mpsc::channel(SOURCE_CHANNEL);
    spawn_source(args, prepared.client, tx, Duration::from_secs(3600));
    let mut index = Index::new(prepared.node);
    if track_dns {
        index.track_dns();
    }
    let mut unreadable = std::collections::BTreeMap::new();
    let fixed = args.cluster_id.is_some();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
    loop {
        let ev = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .context("timed out waiting for the source's first full sync")?;
        // Stop at the first full sync (or if the source ended).
        let Some(ev) = ev else { break };
        if source::apply(&mut index, &mut unreadable, ev, fixed) {
            break;
        }
    }
    index.flush();
    Ok((index, unreadable.into_values().collect()))
}

async fn table(args: TableArgs) -> anyhow::Result<ExitCode> {
    let (index, unreadable) = first_sync(&args.source, args.timeout_s, false).await?;
    let mut rejected = index.rejections();
    rejected.extend(unreadable);
    rejected.sort();
    let out = match args.format {
        Format::Json => render::json(index.table(), &rejected),
        Format::Text => render::text(index.table(), &rejected),
    };
    print_out(out.trim_end())?;
    Ok(ExitCode::SUCCESS)
}

/// `mcs-agent dns`: the answer, printed as a DNS response (dig-like sections). Exit 0 for
/// NOERROR (answers or NODATA), 1 otherwise.
async fn dns_query(args: DnsQueryArgs) -> anyhow::Result<ExitCode> {
    use hickory_proto::{
        op::{Message, Query, ResponseCode},
        rr::{Name, RecordType},
    };
    let mut text = args.name.trim().to_string();
    if !text.ends_with('.') {
        text.push('.');
    }
    let name =
        Name::from_ascii(&text).with_context(|| format!("{:?} is not a DNS name", args.name))?;
    let qtype: RecordType = args
        .record_type
        .to_ascii_uppercase()
        .parse()
        .with_context(|| format!("{:?} is not a DNS record type", args.record_type))?;
    let (mut index, _) = first_sync(&args.source, args.timeout_s, true).await?;
    let zone = Arc::new(mcs_model::dns::Zone::new());
    for (svc, records) in index.take_dns_changes() {
        zone.set(&svc, records);
    }
    let answerer = mcs_dns::Answerer::new(zone, args.answers.ttl);
    let mut q = Message::query();
    q.add_query(Query::query(name, qtype));
    let resp = answerer.respond(&q);
    print_out(resp.to_string().trim_end())?;
    Ok(if resp.metadata.response_code == ResponseCode::NoError {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn userspace_config(p: &ProxyArgs) -> UserspaceConfig {
    UserspaceConfig {
        intercept: InterceptConfig {
            table: p.nft_table.clone(),
            mark: p.fwmark,
            route_table: p.fwmark,
            port: p.proxy_port,
            ..Default::default()
        },
        connect_timeout: Duration::from_millis(p.connect_timeout_ms),
        connect_attempts: p.connect_attempts.max(1),
        idle_timeout: Duration::from_secs(p.idle_timeout_s),
        drain_timeout: Duration::from_secs(p.drain_timeout_s),
        max_connections: p.max_connections.max(1),
        max_connections_per_client: p.max_connections_per_client.max(1),
        udp_idle_timeout: Duration::from_secs(p.udp_idle_timeout_s),
        max_udp_sessions: p.max_udp_sessions.max(1),
        max_udp_sessions_per_client: p.max_udp_sessions_per_client.max(1),
        splice: !p.no_splice,
        tcp_workers: usize::from(p.tcp_workers),
        tcp_engine: match p.tcp_engine {
            TcpEngineArg::Auto => TcpEngine::Auto,
            TcpEngineArg::IoUring => TcpEngine::IoUring,
            TcpEngineArg::Epoll => TcpEngine::Epoll,
        },
        ..Default::default()
    }
}

fn status(args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let dir = &args.pins.bpf_pin_dir;
    if !dir.exists() {
        bail!(
            "no pinned maps at {}: is an agent running with --dataplane ebpf (and this --bpf-pin-dir)?",
            dir.display()
        );
    }
    let p = read_pinned(dir)
        .with_context(|| format!("reading the pinned maps in {}", dir.display()))?;
    match args.format {
        Format::Json => print_out(&serde_json::to_string_pretty(&p)?)?,
        Format::Text => {
            use std::fmt::Write as _;
            let mut out = format!(
                "eBPF socket LB, maps pinned in {}: {} frontends\n",
                dir.display(),
                p.frontends.len()
            );
            // How full the maps sized from the caps are (a full one leaves frontends
            // unprogrammable; `uninstall` and a restart make them at the caps' size).
            let fill: Vec<String> = p
                .maps
                .iter()
                .map(|(name, f)| format!("{name} {}/{}", f.entries, f.max_entries))
                .collect();
            let _ = writeln!(out, "map entries: {}", fill.join(", "));
            for (f, backends) in &p.frontends {
                let _ = writeln!(out, "{f}  ({} backends)", backends.len());
                for b in backends {
                    let _ = writeln!(out, "  {b}");
                }
            }
            print_out(out.trim_end())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `text` and a newline to stdout. A reader that went away (`mcs-agent status | head`)
/// ends the output quietly instead of a panic in `println!`.
fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.write_all(b"\n"))
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Loads and attaches the eBPF dataplane.
fn start_ebpf(args: &RunArgs) -> anyhow::Result<SocketLb> {
    let maglev = args.ebpf_selection == crate::cli::Selection::Maglev;
    let caps = &args.source.guard;
    let sizes = MapSizes::for_caps(caps.max_frontends, caps.max_backends, maglev);
    let mut lb = SocketLb::open_sized(&args.pins.bpf_pin_dir, sizes).with_context(|| {
        format!(
            "loading the eBPF programs (pins in {})",
            args.pins.bpf_pin_dir.display()
        )
    })?;
    lb.set_maglev(maglev);
    lb.attach(&args.cgroup_root)
        .with_context(|| format!("attaching to cgroup {}", args.cgroup_root.display()))?;
    Ok(lb)
}

async fn agent(args: RunArgs) -> anyhow::Result<ExitCode> {
    // Flags and source first: a bad value fails before anything is attached or listening.
    let prepared = prepare(&args.source, Some(&args.node_name)).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let start_userspace =
        |registry: &mut prometheus_client::registry::Registry| -> anyhow::Result<AgentDataplane> {
            // An eBPF socket LB a previous agent left pinned (the dataplane was switched)
            // would keep translating ClusterSetIPs in the kernel with a table nobody
            // updates, ahead of the forwarder: remove it first.
            let pins = &args.pins.bpf_pin_dir;
            match SocketLb::uninstall(pins) {
                Ok(0) => {}
                Ok(n) => tracing::warn!(
                    pin_dir = %pins.display(),
                    removed = n,
                    "removed the eBPF socket LB a previous agent left pinned: this agent runs the userspace forwarder"
                ),
                Err(e) => tracing::warn!(
                    pin_dir = %pins.display(),
                    error = %e,
                    "could not remove the eBPF socket LB a previous agent left pinned; it may still translate ClusterSetIPs (mcs-agent uninstall)"
                ),
            }
            let proxy_metrics = ProxyMetrics::default();
            proxy_metrics.register(registry);
            Ok(AgentDataplane::Userspace(
                Userspace::start(userspace_config(&args.proxy), proxy_metrics)
                    .context("starting the userspace forwarder")?,
            ))
        };
    let dataplane = match args.dataplane {
        DataplaneKind::Userspace => start_userspace(&mut registry)?,
        DataplaneKind::Ebpf => AgentDataplane::Ebpf(Box::new(start_ebpf(&args)?)),
        DataplaneKind::Auto => match start_ebpf(&args) {
            Ok(lb) => {
                tracing::info!(
                    "--dataplane auto: the kernel accepted the eBPF socket LB; using it"
                );
                AgentDataplane::Ebpf(Box::new(lb))
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "--dataplane auto: eBPF socket LB unavailable; using the userspace forwarder");
                start_userspace(&mut registry)?
            }
        },
        DataplaneKind::Log => AgentDataplane::Log(LogDataplane::default()),
        DataplaneKind::Both => bail!("--dataplane both is for `mcs-agent demo` only"),
    };
    let health = Health::default();
    let zone = Arc::new(mcs_model::dns::Zone::new());
    let dns = if args.dns.listen.is_empty() {
        None
    } else {
        let fd_limit = crate::dns::raise_fd_limit();
        let config = crate::dns::DnsConfig {
            listen: args.dns.listen.clone(),
            ttl: args.dns.answers.ttl,
            rate_limit: args.dns.rate_limit,
            tcp: crate::dns::fit_to_fd_limit(
                crate::dns::TcpLimits {
                    connections: args.dns.tcp_connections,
                    per_client: args.dns.tcp_connections_per_client,
                    idle: Duration::from_secs(args.dns.tcp_idle_s),
                    lifetime: Duration::from_secs(args.dns.tcp_lifetime_s),
                },
                fd_limit,
            ),
        };
        let server =
            crate::dns::DnsServer::start(zone.clone(), &config, &mut registry, health.clone())
                .await?;
        tracing::info!(addrs = ?server.addrs, ttl = config.ttl, rate_limit = config.rate_limit, tcp_connections = config.tcp.connections, tcp_connections_per_client = config.tcp.per_client, fd_limit, "serving clusterset.local DNS (UDP and TCP)");
        Some(server)
    };
    let addr = http::spawn(args.metrics_addr, Arc::new(registry), health.clone())
        .await
        .with_context(|| format!("binding the metrics address {}", args.metrics_addr))?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");

    let (tx, rx) = mpsc::channel(SOURCE_CHANNEL);
    let events = prepared
        .client
        .clone()
        .map(|c| EventSink::new(c, &args.node_name));
    spawn_source(
        &args.source,
        prepared.client,
        tx,
        Duration::from_millis(args.file_poll_ms),
    );
    let config = SyncConfig {
        cluster_id_fixed: args.source.cluster_id.is_some(),
        ..Default::default()
    };
    let mut controller = SyncLoop::new(prepared.node, dataplane, config, metrics, health, events);
    if dns.is_some() {
        controller = controller.with_dns_zone(zone);
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    tracing::info!(source = ?args.source.source, dataplane = ?args.dataplane, "mcs-agent running");
    let controller = controller.run(rx, stop_rx).await;
    if let Some(dns) = dns {
        dns.shutdown().await;
    }
    match controller.into_dataplane() {
        AgentDataplane::Userspace(u) => u.shutdown().await,
        AgentDataplane::Ebpf(_) => tracing::warn!(
            cgroup = %args.cgroup_root.display(),
            pins = %args.pins.bpf_pin_dir.display(),
            "the eBPF programs stay attached to {} and keep rewriting connects to the ClusterSetIPs (so traffic survives restarts); to remove them: mcs-agent uninstall --bpf-pin-dir {}",
            args.cgroup_root.display(),
            args.pins.bpf_pin_dir.display()
        ),
        AgentDataplane::Log(_) => {}
    }
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// The dataplanes `run` can drive.
#[derive(Debug)]
enum AgentDataplane {
    Log(LogDataplane),
    Userspace(Userspace),
    Ebpf(Box<SocketLb>),
}

impl Dataplane for AgentDataplane {
    fn name(&self) -> &'static str {
        match self {
            AgentDataplane::Log(d) => d.name(),
            AgentDataplane::Userspace(d) => d.name(),
            AgentDataplane::Ebpf(d) => d.name(),
        }
    }

    fn apply(&mut self, diff: &mcs_model::TableDiff) -> Result<(), mcs_model::DataplaneError> {
        match self {
            AgentDataplane::Log(d) => d.apply(diff),
            AgentDataplane::Userspace(d) => tokio::task::block_in_place(|| d.apply(diff)),
            AgentDataplane::Ebpf(d) => d.apply(diff),
        }
    }

    fn unprogrammed(&self) -> Vec<mcs_model::Rejection> {
        match self {
            AgentDataplane::Log(d) => d.unprogrammed(),
            AgentDataplane::Userspace(d) => d.unprogrammed(),
            AgentDataplane::Ebpf(d) => d.unprogrammed(),
        }
    }

    fn unprogrammed_version(&self) -> Option<u64> {
        match self {
            AgentDataplane::Log(d) => d.unprogrammed_version(),
            AgentDataplane::Userspace(d) => d.unprogrammed_version(),
            AgentDataplane::Ebpf(d) => d.unprogrammed_version(),
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
