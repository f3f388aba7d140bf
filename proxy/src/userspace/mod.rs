//! The userspace transparent L4 forwarder: the dataplane for nodes where eBPF is unavailable.
//!
//! # Layout
//!
//! - [`nft`]: the agent's nftables table (frontend sets, marks) and policy routing.
//! - [`listen`]: the sockets bound to each frontend's ClusterSetIP and port.
//! - [`routes`]: the route table (ArcSwap; readers never lock) built from diffs.
//! - [`tcp`]: accept, pick, connect with retries, relay (copy, splice for bulk), idle,
//!   drain, cap (the epoll worker).
//! - [`conn`]: what both TCP workers share (per-client counts, resets, pooled pipes and
//!   buffers).
//! - [`uring`]: the same TCP worker on io_uring (`--tcp-engine`, by default where available).
//! - [`udp`]: per-flow sessions with VIP-sourced replies.
//! - [`metrics`]: per frontend and backend counters.
//!
//! [`Userspace`] ties them together and implements [`mcs_model::Dataplane`]: a diff updates
//! the routes first and the interception set second when frontends appear, and the other way
//! round when they go, so an intercepted packet always finds a route.

pub mod conn;
pub mod listen;
pub mod metrics;
pub mod nft;
pub mod routes;
pub mod tcp;
pub mod udp;
pub mod uring;

use std::{collections::BTreeSet, net::SocketAddr, sync::Arc, time::Duration};

use mcs_model::{Dataplane, DataplaneError, Frontend, Protocol, TableDiff};
use tokio::sync::{Semaphore, watch};

use self::{
    listen::{FeedRx, FrontendSockets},
    metrics::ProxyMetrics,
    nft::{InterceptConfig, Interception, SetElement},
    routes::SharedRoutes,
};

/// Settings of the forwarder.
#[derive(Clone, Debug)]
pub struct UserspaceConfig {
    /// Interception (nftables table, mark, routing table).
    pub intercept: InterceptConfig,
    /// Connect timeout per backend attempt.
    pub connect_timeout: Duration,
    /// Backends tried per connection (first pick plus retries).
    pub connect_attempts: usize,
    /// Close TCP connections idle this long.
    pub idle_timeout: Duration,
    /// A connection to a removed backend, or open at shutdown, lives at most this long.
    pub drain_timeout: Duration,
    /// Most open TCP connections; more are refused with a reset.
    pub max_connections: usize,
    /// Most open TCP connections of one client address (one pod cannot take them all).
    pub max_connections_per_client: usize,
    /// Expire UDP sessions idle this long.
    pub udp_idle_timeout: Duration,
    /// Most UDP sessions.
    pub max_udp_sessions: usize,
    /// Most UDP sessions of one client address (one pod cannot take the whole table).
    pub max_udp_sessions_per_client: usize,
    /// Largest Maglev table per frontend (a prime); each table is sized to its backends.
    pub maglev_table_size: usize,
    /// Bulk transfers switch to zero-copy splice(2) (else everything is copied).
    pub splice: bool,
    /// TCP worker threads, each with its own single-threaded runtime and SO_REUSEPORT
    /// listener (shared nothing but the route table and counters). 0: one per CPU.
    pub tcp_workers: usize,
    /// What the TCP workers run on.
    pub tcp_engine: TcpEngine,
}

/// What the TCP workers run on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcpEngine {
    /// io_uring where a ring can be made, else epoll (with a warning).
    #[default]
    Auto,
    /// io_uring, or the forwarder does not start.
    IoUring,
    /// epoll (tokio).
    Epoll,
}

impl Default for UserspaceConfig {
    fn default() -> Self {
        Self {
            intercept: InterceptConfig::default(),
            connect_timeout: Duration::from_secs(2),
            connect_attempts: 3,
            idle_timeout: Duration::from_secs(3600),
            drain_timeout: Duration::from_secs(30),
            max_connections: 65_536,
            udp_idle_timeout: Duration::from_secs(30),
            max_udp_sessions: 65_536,
            max_udp_sessions_per_client: 4_096,
            max_connections_per_client: 16_384,
            maglev_table_size: crate::maglev::DEFAULT_TABLE_SIZE,
            splice: true,
            tcp_workers: 0,
            tcp_engine: TcpEngine::Auto,
        }
    }
}

/// Errors starting the forwarder.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Sockets could not be made (no CAP_NET_ADMIN for IP_TRANSPARENT, no eventfd, no
    /// thread).
    #[error("{what}: {source} (transparent sockets need CAP_NET_ADMIN)")]
    Listen {
        /// What failed.
        what: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `--tcp-engine io-uring`, and no ring could be made.
    #[error(
        "io_uring is unavailable (kernel.io_uring_disabled, seccomp or an old kernel; --tcp-engine auto falls back to epoll)"
    )]
    IoUring(#[source] std::io::Error),
    /// nftables or policy routing failed.
    #[error("installing interception: {0}")]
    Intercept(#[from] nft::NftError),
}

/// State shared by the forwarder's tasks.
#[derive(Debug)]
pub struct Shared {
    routes: SharedRoutes,
    config: UserspaceConfig,
    metrics: ProxyMetrics,
    shutdown: watch::Receiver<bool>,
    /// Open TCP connections per client, counted in buckets by a hash of the client address
    /// (lock-free; clients that share a bucket share its cap).
    per_client: conn::ClientCounts,
}

/// The running forwarder.
#[derive(Debug)]
pub struct Userspace {
    shared: Arc<Shared>,
    intercept: Interception,
    programmed: BTreeSet<SetElement>,
    /// Elements a previous run left in the table (kept intercepted), until the first table:
    /// those it does not have are removed then.
    leftover: Option<BTreeSet<SetElement>>,
    /// The listening sockets of the frontends in `programmed`.
    sockets: Box<FrontendSockets>,
    shutdown: watch::Sender<bool>,
    /// The TCP worker threads: each ends once its connections are done after shutdown.
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Userspace {
    /// Opens the listeners, installs the interception (replacing a table a crash left) and
    /// starts accepting. Must run inside a tokio runtime.
    pub fn start(config: UserspaceConfig, metrics: ProxyMetrics) -> Result<Self, StartError> {
        listen::can_open_transparent().map_err(|source| StartError::Listen {
            what: "opening a transparent socket",
            source,
        })?;
        if let Some(port) = listen::privileged_ports_below() {
            tracing::warn!(
                port,
                "no CAP_NET_BIND_SERVICE: frontends on ports below {port} cannot be intercepted (the DaemonSet grants it)"
            );
        }
        migrate_queued_connections();
        let (shutdown, shutdown_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            routes: SharedRoutes::new(),
            config: config.clone(),
            metrics,
            shutdown: shutdown_rx,
            per_client: conn::ClientCounts::new(
                config.max_connections_per_client,
                config.max_connections,
            ),
        });
        let cap = Arc::new(Semaphore::new(config.max_connections));
        shared
            .metrics
            .connection_limit
            .set(i64::try_from(config.max_connections).unwrap_or(i64::MAX));
        let sessions = Arc::new(udp::Sessions::default());
        // Probed once here (each worker makes its own ring on its thread).
        let io_uring = match config.tcp_engine {
            TcpEngine::Epoll => false,
            engine => match uring::ring() {
                Ok(_) => true,
                Err(e) if engine == TcpEngine::IoUring => return Err(StartError::IoUring(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable; the TCP workers use epoll");
                    false
                }
            },
        };
        let workers = match config.tcp_workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let mut feeds = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers);
        for i in 0..workers {
            let (tx, rx) = listen::feed().map_err(|source| StartError::Listen {
                what: "making a TCP worker's eventfd",
                source,
            })?;
            threads.push(
                spawn_worker(i, rx, io_uring, shared.clone(), cap.clone()).map_err(|source| {
                    StartError::Listen {
                        what: "starting a TCP worker",
                        source,
                    }
                })?,
            );
            feeds.push(tx);
        }
        let mut sockets = Box::new(FrontendSockets::new(
            feeds,
            shared.clone(),
            sessions,
            tokio::runtime::Handle::current(),
        ));
        if Interception::exists(&config.intercept.table) {
            tracing::warn!(table = %config.intercept.table, "found an interception table left by a previous run; replacing it");
        }
        let intercept = Interception::install(config.intercept.clone())?;
        let leftover: BTreeSet<SetElement> = sockets
            .open_all(intercept.kept().iter().copied())
            .into_iter()
            .collect();
        let unopened: Vec<SetElement> = intercept
            .kept()
            .iter()
            .filter(|e| !leftover.contains(e))
            .copied()
            .collect();
        if !unopened.is_empty() {
            intercept.update(&[], &unopened)?;
        }
        if !leftover.is_empty() {
            tracing::info!(
                frontends = leftover.len(),
                "kept the previous run's frontends intercepted; connections wait for the first table"
            );
        }
        tracing::info!(
            splice = config.splice,
            tcp_workers = workers,
            tcp_engine = if io_uring { "io_uring" } else { "epoll" },
            "userspace forwarder started: it listens on each frontend's ClusterSetIP and port"
        );
        Ok(Self {
            shared,
            intercept,
            programmed: leftover.clone(),
            leftover: Some(leftover),
            sockets,
            shutdown,
            workers: threads,
        })
    }

    /// Number of routes (frontends) now.
    pub fn routes(&self) -> usize {
        self.shared.routes.load().len()
    }

    /// Stops: with [`Stop::successor_wait`], first waits (at most that long) until another
    /// process — the node's next agent, started beside this one — waits on every frontend
    /// too; then stops accepting (the listeners close: new connections go to the next
    /// agent's sockets, and with `net.ipv4.tcp_migrate_req` those queued on a closing
    /// listener too; with no next agent they are refused), waits up to the drain bound for
    /// open connections to finish, and then removes the interception unless
    /// [`Stop::keep_interception`]. The interception stays while they drain: without it
    /// their packets no longer reach the forwarder's sockets, and the kernel answers them
    /// with resets.
    pub async fn shutdown(self, stop: Stop) {
        if !stop.successor_wait.is_zero() {
            let t0 = std::time::Instant::now();
            loop {
                let (taken, all) = self.sockets.taken_over();
                if taken == all {
                    tracing::info!(
                        frontends = all,
                        waited_ms = t0.elapsed().as_millis() as u64,
                        "the next agent waits on every frontend too; closing this one's sockets"
                    );
                    break;
                }
                if t0.elapsed() >= stop.successor_wait {
                    tracing::warn!(
                        frontends = all,
                        without_next_agent = all - taken,
                        waited_s = stop.successor_wait.as_secs(),
                        "no next agent on every frontend in time; closing this one's sockets (connections to the rest are refused until one listens)"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let _ = self.shutdown.send(true);
        // Until every worker has ended: not merely until no connection is open, since a
        // worker may still hold connections the kernel accepted for it as its listeners
        // closed, which would be closed unserved with the process.
        let workers = self.workers;
        let joined = tokio::time::timeout(
            self.shared.config.drain_timeout + Duration::from_secs(1),
            tokio::task::spawn_blocking(move || {
                for w in workers {
                    let _ = w.join();
                }
            }),
        )
        .await;
        if joined.is_err() {
            tracing::warn!("connections still open after the drain bound; closing");
        }
        drop(self.sockets);
        if stop.keep_interception {
            tracing::info!(
                table = %self.intercept.config().table,
                "interception kept for the node's next agent (a restart, not an uninstall)"
            );
        } else if let Err(e) = self.intercept.uninstall() {
            tracing::warn!(error = %e, "removing interception");
        }
    }
}

/// Whether a failed connect (its errno) says the backend is not there: refused, no answer
/// (timed out, or cancelled by the forwarder's own connect deadline), or unreachable. Not the
/// node's own failures (no descriptor, no ephemeral port, no buffer), which must not make
/// every backend look dead to it.
pub(crate) fn backend_failed(errno: Option<i32>) -> bool {
    matches!(
        errno,
        Some(
            libc::ECONNREFUSED
                | libc::ETIMEDOUT
                | libc::ECANCELED
                | libc::EHOSTUNREACH
                | libc::ENETUNREACH
                | libc::ECONNRESET
        )
    )
}

/// How [`Userspace::shutdown`] stops.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stop {
    /// Leave the nftables table and the policy routing for the next agent (a restart or an
    /// upgrade: it installs over them without a gap, keeping their frontends intercepted).
    pub keep_interception: bool,
    /// Before closing, wait at most this long for the next agent to wait on every frontend
    /// (a DaemonSet rolling with maxSurge starts it beside this one). Zero: close at once.
    pub successor_wait: Duration,
}

/// `net.ipv4.tcp_migrate_req` (IPv4 and IPv6): a closing listener's queued connections
/// move to another listener of its SO_REUSEPORT group (the next agent's) instead of
/// being reset. Set when off; a failure is logged (then those few are reset at a handover).
fn migrate_queued_connections() {
    const KEY: &str = "/proc/sys/net/ipv4/tcp_migrate_req";
    match std::fs::read_to_string(KEY) {
        Ok(v) if v.trim() == "1" => {}
        Ok(_) => match std::fs::write(KEY, "1") {
            Ok(()) => tracing::info!(
                "set net.ipv4.tcp_migrate_req=1: connections queued on a closing listener move to the next agent's"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot set net.ipv4.tcp_migrate_req=1 (in a container /proc/sys is read-only: set it on the node, docs/install.md#upgrades); at a handover to the next agent, connections queued on this one's listeners are reset")
            }
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot read net.ipv4.tcp_migrate_req (a kernel before 5.14?); at a handover to the next agent, connections queued on this one's listeners are reset")
        }
    }
}

/// A TCP worker: a thread with a single-threaded runtime accepting on its own listener of
/// each frontend (handed over through `feed`); its connections stay on that thread (no
/// cross-thread wake-ups). It ends at shutdown, after its connections drained.
fn spawn_worker(
    i: usize,
    feed: FeedRx,
    io_uring: bool,
    shared: Arc<Shared>,
    cap: Arc<Semaphore>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(format!("mcs-tcp-{i}"))
        .spawn(move || {
            if io_uring {
                // The ring is made on the thread that uses it (SINGLE_ISSUER).
                match uring::ring() {
                    Ok(ring) => {
                        uring::run(ring, feed, &shared, cap);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring unavailable; this TCP worker uses epoll");
                    }
                }
            }
            rt.block_on(async move {
                let signals = tcp::WorkerSignals::start(&shared);
                tcp::accept_feed(feed, shared.clone(), cap, signals).await;
                // Let this thread's connections finish within the drain bound. Wait a little
                // longer than it: at the bound each connection cuts itself with resets, while
                // one dropped with the runtime would end with a FIN and look complete.
                let deadline = tokio::time::Instant::now()
                    + shared.config.drain_timeout
                    + Duration::from_millis(500);
                while tokio::time::Instant::now() < deadline
                    && shared.metrics.active_connections.get() > 0
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        })
}

/// Resolves once `rx` says stop (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

fn element(f: &mcs_model::Frontend) -> Option<SetElement> {
    matches!(f.protocol, Protocol::Tcp | Protocol::Udp).then_some(SetElement {
        vip: f.vip,
        protocol: f.protocol,
        port: f.port,
    })
}

impl Dataplane for Userspace {
    fn name(&self) -> &'static str {
        "userspace"
    }

    fn skipped(&self, f: &Frontend, limit: usize) -> Vec<mcs_model::health::SkippedBackend> {
        let routes = self.shared.routes.load();
        routes
            .get(SocketAddr::new(f.vip, f.port), f.protocol)
            .map(|r| r.backends.skipped_now(limit))
            .unwrap_or_default()
    }

    fn report(&self) -> Vec<(&'static str, String)> {
        let m = &self.shared.metrics;
        let (tcp, udp, open, budget) = self.sockets.counts();
        vec![
            ("frontends intercepted", self.programmed.len().to_string()),
            ("TCP frontends listening", tcp.to_string()),
            ("UDP frontends listening", udp.to_string()),
            ("listening sockets", format!("{open} of at most {budget}")),
            (
                "TCP connections open",
                format!(
                    "{} of at most {}",
                    m.active_connections.get(),
                    self.shared.config.max_connections
                ),
            ),
            ("UDP sessions", m.udp_sessions.get().to_string()),
            (
                "TCP workers on io_uring",
                m.io_uring_workers.get().to_string(),
            ),
            (
                "nftables table",
                format!("inet {}", self.shared.config.intercept.table),
            ),
        ]
    }

    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError> {
        for f in diff.upsert.keys().filter(|f| f.protocol == Protocol::Sctp) {
            tracing::warn!(frontend = %f, "SCTP is not forwarded by the userspace dataplane");
        }
        let add: Vec<SetElement> = diff
            .upsert
            .keys()
            .filter_map(element)
            .filter(|e| !self.programmed.contains(e))
            .collect();
        let mut remove: Vec<SetElement> = diff
            .remove
            .iter()
            .filter_map(element)
            .filter(|e| self.programmed.contains(e))
            .collect();
        // The first diff is the whole table: what a previous run left beyond it goes.
        let leftover = self.leftover.take();
        if let Some(left) = &leftover {
            let wanted: BTreeSet<SetElement> = diff.upsert.keys().filter_map(element).collect();
            let stale: Vec<SetElement> = left
                .difference(&wanted)
                .filter(|e| !remove.contains(e))
                .copied()
                .collect();
            remove.extend(stale);
        }
        // Routes and sockets first, then the interception set: a new frontend's packets find
        // a socket and a route; a removed frontend stops being intercepted before its route
        // and sockets go.
        if !remove.is_empty() {
            if let Err(e) = self.intercept.update(&[], &remove) {
                self.leftover = leftover;
                return Err(DataplaneError {
                    message: e.to_string(),
                });
            }
            for e in &remove {
                self.programmed.remove(e);
                self.sockets.close(e);
            }
        }
        self.shared.routes.apply(
            diff,
            self.shared.config.maglev_table_size,
            &self.shared.metrics,
        );
        // A frontend without sockets is not intercepted: its packets go where they would
        // without us.
        let add = self.sockets.open_all(add);
        if !add.is_empty() {
            if let Err(e) = self.intercept.update(&add, &[]) {
                for e in &add {
                    self.sockets.close(e);
                }
                return Err(DataplaneError {
                    message: e.to_string(),
                });
            }
            if self.programmed.is_empty() {
                // Built at once (full nodes), not element by element.
                self.programmed = add.into_iter().collect();
            } else {
                self.programmed.extend(add);
            }
        }
        Ok(())
    }
}
