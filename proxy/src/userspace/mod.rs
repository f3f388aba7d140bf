//! The userspace transparent L4 forwarder: the dataplane for nodes where eBPF is unavailable.
//!
//! # Layout
//!
//! - [`nft`]: the agent's nftables table (frontend sets, TPROXY) and policy routing.
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
pub mod metrics;
pub mod nft;
pub mod routes;
pub mod tcp;
pub mod udp;
pub mod uring;

use std::{collections::BTreeSet, net::SocketAddr, sync::Arc, time::Duration};

use mcs_model::{Dataplane, DataplaneError, Protocol, TableDiff};
use socket2::{Domain, Socket, Type};
use tokio::sync::{Semaphore, watch};

use self::{
    metrics::ProxyMetrics,
    nft::{InterceptConfig, Interception, SetElement},
    routes::SharedRoutes,
};

/// Settings of the forwarder.
#[derive(Clone, Debug)]
pub struct UserspaceConfig {
    /// Interception (nftables table, mark, port).
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
    /// A listener could not be opened.
    #[error(
        "opening the {what} listener on port {port}: {source} (needs CAP_NET_ADMIN for IP_TRANSPARENT)"
    )]
    Listen {
        /// `tcp4`, `udp6`, ...
        what: &'static str,
        /// Port.
        port: u16,
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
    shutdown: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    cap: Arc<Semaphore>,
}

impl Userspace {
    /// Opens the listeners, installs the interception (replacing a table a crash left) and
    /// starts accepting. Must run inside a tokio runtime.
    pub fn start(config: UserspaceConfig, metrics: ProxyMetrics) -> Result<Self, StartError> {
        let port = config.intercept.port;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            routes: SharedRoutes::new(),
            config: config.clone(),
            metrics,
            shutdown: shutdown_rx,
            per_client: conn::ClientCounts::new(config.max_connections_per_client),
        });
        let cap = Arc::new(Semaphore::new(config.max_connections));
        let mut tasks = Vec::new();
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
        for v6 in [false, true] {
            match listeners(port, v6, workers) {
                Ok((tcp, udp_sock)) => {
                    for (i, l) in tcp.into_iter().enumerate() {
                        spawn_worker(i, v6, l, io_uring, shared.clone(), cap.clone()).map_err(
                            |source| StartError::Listen {
                                what: "tcp worker",
                                port,
                                source,
                            },
                        )?;
                    }
                    tasks.push(tokio::spawn(udp::listen_loop(
                        udp_sock,
                        shared.clone(),
                        sessions.clone(),
                    )));
                }
                Err((what, source))
                    if v6 && source.kind() == std::io::ErrorKind::AddrNotAvailable =>
                {
                    tracing::warn!(what, error = %source, "IPv6 unavailable; forwarding IPv4 only");
                }
                Err((what, source)) => return Err(StartError::Listen { what, port, source }),
            }
        }
        if Interception::exists(&config.intercept.table) {
            tracing::warn!(table = %config.intercept.table, "found an interception table left by a previous run; replacing it");
        }
        let intercept = Interception::install(config.intercept.clone())?;
        let leftover: BTreeSet<SetElement> = intercept.kept().iter().copied().collect();
        if !leftover.is_empty() {
            tracing::info!(
                frontends = leftover.len(),
                "kept the previous run's frontends intercepted; connections wait for the first table"
            );
        }
        tracing::info!(
            port,
            splice = config.splice,
            tcp_workers = if io_uring { "io_uring" } else { "epoll" },
            "userspace forwarder listening"
        );
        Ok(Self {
            shared,
            intercept,
            programmed: leftover.clone(),
            leftover: Some(leftover),
            shutdown,
            tasks,
            cap,
        })
    }

    /// Number of routes (frontends) now.
    pub fn routes(&self) -> usize {
        self.shared.routes.load().len()
    }

    /// Stops accepting (the listeners close, so new connections are refused at once), waits
    /// up to the drain bound for open connections to finish, then removes the interception.
    /// The interception stays while they drain: without it their packets no longer reach
    /// the forwarder's sockets, and the kernel answers them with resets.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let max = self.shared.config.max_connections as u32;
        let drained = tokio::time::timeout(
            self.shared.config.drain_timeout + Duration::from_secs(1),
            self.cap.acquire_many(max),
        )
        .await;
        if drained.is_err() {
            tracing::warn!("connections still open after the drain bound; closing");
        }
        for t in self.tasks {
            t.abort();
        }
        if let Err(e) = self.intercept.uninstall() {
            tracing::warn!(error = %e, "removing interception");
        }
    }
}

/// A TCP worker: a thread with a single-threaded runtime accepting on its own listener; its
/// connections stay on that thread (no cross-thread wake-ups). It ends at shutdown, after its
/// connections drained.
fn spawn_worker(
    i: usize,
    v6: bool,
    listener: std::net::TcpListener,
    io_uring: bool,
    shared: Arc<Shared>,
    cap: Arc<Semaphore>,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(format!("mcs-tcp{}-{i}", if v6 { 6 } else { 4 }))
        .spawn(move || {
            if io_uring {
                // The ring is made on the thread that uses it (SINGLE_ISSUER).
                match uring::ring() {
                    Ok(ring) => {
                        uring::run(ring, listener, &shared, cap);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring unavailable; this TCP worker uses epoll");
                    }
                }
            }
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let mut stop = shared.shutdown.clone();
                let signals = tcp::WorkerSignals::start(&shared);
                let accept = tokio::spawn(tcp::accept_loop(listener, shared.clone(), cap, signals));
                stopped(&mut stop).await;
                let _ = accept.await;
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
        })?;
    Ok(())
}

type Listeners = (Vec<std::net::TcpListener>, tokio::net::UdpSocket);

fn listeners(
    port: u16,
    v6: bool,
    workers: usize,
) -> Result<Listeners, (&'static str, std::io::Error)> {
    let addr: SocketAddr = if v6 {
        ([0u16; 8], port).into()
    } else {
        ([0u8; 4], port).into()
    };
    let domain = if v6 { Domain::IPV6 } else { Domain::IPV4 };
    let transparent = |s: &Socket| {
        if v6 {
            s.set_ip_transparent_v6(true)
        } else {
            s.set_ip_transparent_v4(true)
        }
    };
    let tcp = (0..workers.max(1))
        .map(|_| {
            let s = Socket::new(domain, Type::STREAM, None)?;
            if v6 {
                s.set_only_v6(true)?;
            }
            transparent(&s)?;
            // Accepted sockets inherit it: no setsockopt per connection.
            s.set_tcp_nodelay(true)?;
            s.set_reuse_address(true)?;
            s.set_reuse_port(true)?;
            s.set_nonblocking(true)?;
            s.bind(&addr.into())?;
            s.listen(4096)?;
            Ok(s.into())
        })
        .collect::<std::io::Result<Vec<std::net::TcpListener>>>()
        .map_err(|e| (if v6 { "tcp6" } else { "tcp4" }, e))?;
    let udp_sock = (|| {
        let s = Socket::new(domain, Type::DGRAM, None)?;
        if v6 {
            s.set_only_v6(true)?;
            nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv6OrigDstAddr, &true)?;
        } else {
            nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv4OrigDstAddr, &true)?;
        }
        transparent(&s)?;
        s.set_reuse_address(true)?;
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        tokio::net::UdpSocket::from_std(s.into())
    })()
    .map_err(|e| (if v6 { "udp6" } else { "udp4" }, e))?;
    Ok((tcp, udp_sock))
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
        // Routes first, then the interception set: a new frontend's packets find a route; a
        // removed frontend stops being intercepted before its route goes.
        if !remove.is_empty() {
            if let Err(e) = self.intercept.update(&[], &remove) {
                self.leftover = leftover;
                return Err(DataplaneError {
                    message: e.to_string(),
                });
            }
            for e in &remove {
                self.programmed.remove(e);
            }
        }
        self.shared.routes.apply(
            diff,
            self.shared.config.maglev_table_size,
            &self.shared.metrics,
        );
        if !add.is_empty() {
            self.intercept
                .update(&add, &[])
                .map_err(|e| DataplaneError {
                    message: e.to_string(),
                })?;
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
