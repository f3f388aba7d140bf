//! `mcs-agent run`: the node agent. Wiring only: the source, the dataplane (chosen here,
//! driven through [`mcs_proxy::AnyDataplane`]), the DNS server, metrics and health, the sync
//! loop, and a clean stop on SIGTERM or SIGINT.

use std::{process::ExitCode, sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use mcs_proxy::{
    AnyDataplane,
    ebpf::{MapSizes, SocketLb},
    log::LogDataplane,
    userspace::{
        Stop, TcpEngine, Userspace, UserspaceConfig,
        metrics::ProxyMetrics,
        nft::{InterceptConfig, Interception},
    },
};
use mcs_runtime::handover::Sockets;
use mcs_sync::{
    SyncConfig, SyncLoop,
    events::EventSink,
    http::{self, Health},
    metrics::Metrics,
};
use tokio::sync::{mpsc, watch};

use crate::{
    cli::{DataplaneKind, ProxyArgs, RunArgs, TcpEngineArg},
    source::{SOURCE_CHANNEL, prepare, spawn_source},
};

/// `mcs-agent run`: the agent. Built, then run: the source is prepared (a bad flag or
/// source fails before anything is attached or listening), the dataplane, DNS and the
/// metrics port started, the sync loop run until SIGTERM or SIGINT, then each part stopped.
pub(crate) async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let prepared = prepare(&args.source, Some(&args.node_name)).await?;
    // The node's running agent's sockets, if one serves the handover path.
    let sockets = Arc::new(match args.handover_socket.clone() {
        Some(path) => tokio::task::spawn_blocking(move || Sockets::inherit(&path))
            .await
            .context("taking the running agent's sockets")?,
        None => Sockets::default(),
    });
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let dataplane = start_dataplane(&args, &mut registry)?;
    let health = Health::default();
    let zone = Arc::new(mcs_model::dns::Zone::new());
    let dns = prepare_dns(&args, &zone, &mut registry, &health);
    let with_dns = dns.is_some();
    // `/status`: answered by the sync loop between batches, plus the DNS listener's answers.
    let (status_tx, status_rx) = mpsc::channel(8);
    let status = crate::node_status::handler(status_tx, args.dns.addresses());
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    // The DNS and metrics sockets are bound (or taken from the node's running agent) beside
    // the sync loop, so an address another process holds keeps neither the table nor the
    // forwarder waiting.
    let listeners = tokio::spawn(serve_listeners(
        Listeners {
            dns,
            metrics_addr: args.metrics_addr,
            registry: Arc::new(registry),
            health: health.clone(),
            status,
            sockets,
            handover: args.handover_socket.clone(),
        },
        stop_tx.clone(),
        stop_rx.clone(),
    ));
    let owner = watch_owner(prepared.client.as_ref(), &args);
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
    let mut sync_loop = SyncLoop::new(
        prepared.node,
        dataplane,
        config,
        metrics,
        health.clone(),
        events,
    );
    if with_dns {
        sync_loop = sync_loop.with_dns_zone(zone);
    }
    let sync_loop = sync_loop.with_status_requests(status_rx);
    tokio::spawn(async move {
        mcs_runtime::signals::shutdown().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    if matches!(sync_loop.dataplane(), AnyDataplane::Userspace(_)) {
        retire_pinned_ebpf_when_ready(health.clone(), args.pins.bpf_pin_dir.clone());
    }
    tracing::info!(source = ?args.source.source, dataplane = ?args.dataplane, "mcs-agent running");
    let sync_loop = sync_loop.run(rx, stop_rx).await;
    let listened = listeners
        .await
        .context("the DNS and metrics listeners' task")?;
    stop_dataplane(sync_loop.into_dataplane(), &args, owner.as_ref()).await;
    listened?;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// What [`serve_listeners`] binds and serves.
struct Listeners {
    dns: Option<mcs_dns::server::Unbound>,
    metrics_addr: std::net::SocketAddr,
    registry: Arc<prometheus_client::registry::Registry>,
    health: Health,
    status: mcs_sync::http::StatusFn,
    sockets: Arc<Sockets>,
    handover: Option<std::path::PathBuf>,
}

/// Binds (or takes from the node's running agent) the DNS and metrics sockets and serves
/// them, then the handover path; at a stop, stops DNS (the queries in hand answered) and
/// lets the sockets go. A socket that cannot be had stops the agent (the error is returned).
async fn serve_listeners(
    l: Listeners,
    stop_tx: Arc<watch::Sender<bool>>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // Each waits only for its own addresses.
    let dns = async {
        match l.dns {
            Some(unbound) => {
                let server = unbound.bind(&l.sockets).await?;
                tracing::info!(addrs = ?server.addrs, "serving clusterset.local DNS (UDP and TCP)");
                anyhow::Ok(Some(server))
            }
            None => Ok(None),
        }
    };
    let metrics = async {
        let addr = http::spawn_with_status(
            l.metrics_addr,
            l.registry,
            l.health,
            Some(l.status),
            &l.sockets,
        )
        .await
        .with_context(|| format!("binding the metrics address {}", l.metrics_addr))?;
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz, /status");
        anyhow::Ok(())
    };
    let bound = async { tokio::try_join!(dns, metrics).map(|(dns, ())| dns) };
    let dns = tokio::select! {
        bound = bound => match bound {
            Ok(dns) => dns,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "stopping: a listening socket could not be had");
                let _ = stop_tx.send(true);
                return Err(e);
            }
        },
        _ = stop.wait_for(|s| *s) => return Ok(()),
    };
    l.sockets.close_unused();
    let handover = l.handover.as_deref().and_then(|path| match l.sockets.serve(path) {
        Ok(serving) => Some(serving),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot serve the handover path: the node's next agent will bind afresh, and wait until this one stops");
            None
        }
    });
    let _ = stop.wait_for(|s| *s).await;
    if let Some(dns) = dns {
        dns.shutdown().await;
    }
    // Nothing more to hand over: the sockets this agent no longer serves are let go now,
    // not at its exit (a next agent that could not take them binds them afresh).
    drop(handover);
    l.sockets.let_go();
    Ok(())
}

/// The dataplane `--dataplane` asks for (`auto`: eBPF when the kernel takes it, else the
/// userspace forwarder, whose metrics join `registry`).
fn start_dataplane(
    args: &RunArgs,
    registry: &mut prometheus_client::registry::Registry,
) -> anyhow::Result<AnyDataplane> {
    let start_userspace =
        |registry: &mut prometheus_client::registry::Registry| -> anyhow::Result<AnyDataplane> {
            if let Some(port) = args.proxy.proxy_port {
                tracing::warn!(
                    port,
                    "--proxy-port (MCS_PROXY_PORT) is ignored: the forwarder listens on each frontend's ClusterSetIP and port"
                );
            }
            mcs_runtime::open_files::raise();
            let proxy_metrics = ProxyMetrics::default();
            proxy_metrics.set_per_backend(args.proxy.metrics_per_backend);
            proxy_metrics.register(registry);
            Ok(AnyDataplane::Userspace(
                Userspace::start(userspace_config(&args.proxy), proxy_metrics)
                    .context("starting the userspace forwarder")?,
            ))
        };
    // The socket LB's per-frontend skip counters join the metrics under the forwarder's names.
    let with_metrics = |lb: SocketLb, registry: &mut prometheus_client::registry::Registry| {
        registry
            .sub_registry_with_prefix("mcs_proxy")
            .register_collector(Box::new(lb.skip_metrics()));
        AnyDataplane::Ebpf(Box::new(lb))
    };
    Ok(match args.dataplane {
        DataplaneKind::Userspace => start_userspace(registry)?,
        DataplaneKind::Ebpf => with_metrics(start_ebpf(args)?, registry),
        DataplaneKind::Auto => match start_ebpf(args) {
            Ok(lb) => {
                tracing::info!(
                    "--dataplane auto: the kernel accepted the eBPF socket LB; using it"
                );
                with_metrics(lb, registry)
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "--dataplane auto: eBPF socket LB unavailable; using the userspace forwarder");
                start_userspace(registry)?
            }
        },
        DataplaneKind::Log => AnyDataplane::Log(LogDataplane::default()),
        DataplaneKind::Both => bail!("--dataplane both is for `mcs-agent demo` only"),
    })
}

/// The `clusterset.local` DNS server of `--dns-listen` addresses (none: no DNS), its TCP
/// limits fitted to the open-files limit, its metrics in `registry`; bound by
/// [`serve_listeners`].
fn prepare_dns(
    args: &RunArgs,
    zone: &Arc<mcs_model::dns::Zone>,
    registry: &mut prometheus_client::registry::Registry,
    health: &Health,
) -> Option<mcs_dns::server::Unbound> {
    let dns_addrs = args.dns.addresses();
    if dns_addrs.is_empty() {
        return None;
    }
    let fd_limit = mcs_dns::server::raise_fd_limit();
    let config = mcs_dns::server::DnsConfig {
        listen: dns_addrs,
        ttl: args.dns.answers.ttl,
        rate_limit: args.dns.rate_limit,
        tcp: mcs_dns::server::fit_to_fd_limit(
            mcs_dns::server::TcpLimits {
                connections: args.dns.tcp_connections,
                per_client: args.dns.tcp_connections_per_client,
                idle: Duration::from_secs(args.dns.tcp_idle_s),
                lifetime: Duration::from_secs(args.dns.tcp_lifetime_s),
            },
            fd_limit,
        ),
    };
    tracing::info!(addrs = ?config.listen, ttl = config.ttl, rate_limit = config.rate_limit, tcp_connections = config.tcp.connections, tcp_connections_per_client = config.tcp.per_client, fd_limit, "clusterset.local DNS (UDP and TCP)");
    Some(mcs_dns::server::DnsServer::prepare(
        zone.clone(),
        &config,
        registry,
        health.clone(),
    ))
}

/// Uninstall or restart: told by whether the agent's own DaemonSet is deleted
/// ([`mcs_sync::owner`]); read with `--source kube` only.
fn watch_owner(client: Option<&kube::Client>, args: &RunArgs) -> Option<mcs_sync::owner::Owner> {
    match (client, &args.owner_daemonset, &args.owner_namespace) {
        (Some(client), Some(name), Some(ns)) => {
            Some(mcs_sync::owner::watch(client.clone(), ns, name))
        }
        (None, Some(name), _) => {
            tracing::warn!(
                daemonset = %name,
                "--owner-daemonset is read with --source kube only; ignored"
            );
            None
        }
        _ => None,
    }
}

/// An eBPF socket LB a previous agent left pinned (the dataplane was switched) would keep
/// translating ClusterSetIPs in the kernel with a table nobody updates, ahead of the
/// forwarder: it goes once the forwarder listens on the whole first table, so connections go
/// from one to the other without a gap (the previous agent may still run beside this one:
/// its programs stay attached until it exits).
fn retire_pinned_ebpf_when_ready(ready: Health, pins: std::path::PathBuf) {
    tokio::spawn(async move {
        while !ready.is_ready() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        remove_pinned_ebpf(&pins);
    });
}

/// Stops the dataplane: the forwarder hands over or removes its interception; the eBPF
/// programs are detached and unpinned only when the agent's DaemonSet is deleted (else they
/// keep translating across the restart).
async fn stop_dataplane(
    dataplane: AnyDataplane,
    args: &RunArgs,
    owner: Option<&mcs_sync::owner::Owner>,
) {
    match dataplane {
        AnyDataplane::Userspace(u) => u.shutdown(userspace_stop(args, owner)).await,
        AnyDataplane::Ebpf(lb) => match owner.filter(|o| o.removed()) {
            Some(o) => {
                // Unpinned here, detached when this process closes the links.
                let pins = &args.pins.bpf_pin_dir;
                match SocketLb::uninstall(pins) {
                    Ok(n) => tracing::info!(
                        daemonset = %o.describe(),
                        pins = %pins.display(),
                        removed = n,
                        "uninstall: the agent's DaemonSet is deleted, so the eBPF programs are detached and their pins removed"
                    ),
                    Err(e) => tracing::error!(
                        daemonset = %o.describe(),
                        pins = %pins.display(),
                        error = %e,
                        "uninstall: could not remove the pins; the programs may stay attached (mcs-agent uninstall --bpf-pin-dir)"
                    ),
                }
                drop(lb);
            }
            None => tracing::warn!(
                cgroup = %args.cgroup_root.display(),
                pins = %args.pins.bpf_pin_dir.display(),
                "the eBPF programs stay attached to {} and keep rewriting connects to the ClusterSetIPs (so traffic survives restarts; the agent's DaemonSet is not deleted{}); to remove them: mcs-agent uninstall --bpf-pin-dir {}",
                args.cgroup_root.display(),
                if owner.is_none() { ", or not known: --owner-daemonset" } else { "" },
                args.pins.bpf_pin_dir.display()
            ),
        },
        AnyDataplane::Log(_) => {}
    }
}

/// How the userspace forwarder stops. When a next agent runs beside this one (its DaemonSet
/// rolls with maxSurge, or `--handover-wait-s` says so) and this is not an uninstall, it waits
/// for that agent to listen on every frontend and leaves it the interception. Otherwise it
/// removes the interception: an uninstall, and a restart without surge (the next agent
/// starts after this one is gone; meanwhile a client's SYN is retransmitted and finds it,
/// where a kept table would refuse it).
fn userspace_stop(args: &RunArgs, owner: Option<&mcs_sync::owner::Owner>) -> Stop {
    let removed = owner.is_some_and(|o| o.removed());
    let wait = args
        .handover_wait_s
        .unwrap_or(if owner.is_some_and(|o| o.surges()) {
            DEFAULT_HANDOVER_WAIT_S
        } else {
            0
        });
    let restart = !removed && wait > 0;
    if removed {
        tracing::info!(
            daemonset = %owner.map(|o| o.describe()).unwrap_or_default(),
            "uninstall: the agent's DaemonSet is deleted, so the forwarder removes its interception at stop"
        );
    }
    Stop {
        keep_interception: restart,
        successor_wait: Duration::from_secs(if restart { wait } else { 0 }),
    }
}

/// Removes an eBPF socket LB pinned in `pins` (by a previous agent on the eBPF dataplane).
fn remove_pinned_ebpf(pins: &std::path::Path) {
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
}

/// `--handover-wait-s` when the agent's DaemonSet rolls with maxSurge.
const DEFAULT_HANDOVER_WAIT_S: u64 = 30;

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
    // The userspace forwarder's interception, kept by a previous agent for its next one (the
    // dataplane was switched): nothing listens on it now, so connections the socket LB does
    // not rewrite (the node's own processes) would be refused. It goes.
    let intercept = userspace_config(&args.proxy).intercept;
    if Interception::exists(&intercept.table) {
        match Interception::remove_leftover(&intercept) {
            Ok(_) => tracing::warn!(
                table = %intercept.table,
                "removed the userspace forwarder's interception a previous agent left: this agent runs the eBPF socket LB"
            ),
            Err(e) => tracing::warn!(
                table = %intercept.table,
                error = %e,
                "could not remove the userspace interception a previous agent left (mcs-agent uninstall)"
            ),
        }
    }
    Ok(lb)
}

fn userspace_config(p: &ProxyArgs) -> UserspaceConfig {
    UserspaceConfig {
        intercept: InterceptConfig {
            table: p.nft_table.clone(),
            mark: p.fwmark,
            route_table: p.fwmark,
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
