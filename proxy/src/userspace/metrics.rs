//! Metrics of the userspace forwarder, per frontend, and per backend when asked
//! (`--metrics-per-backend`). A route holds its backends' counters, so a connection touches
//! only atomics.
//!
//! # Series
//!
//! By default each frontend has seven series (`connections`, `bytes_tx`, `bytes_rx`,
//! `connect_failures`, summed over its backends, and `retries`, `refused`,
//! `fallback_connections`; and `skipped_connections` once it skipped a failed backend), so a
//! scrape grows with the imports and not with the endpoints:
//! at 100k frontends, 700k series (tested against that budget). Per backend the first four
//! become one series each per backend of each frontend: at 1M endpoints, 4M series, more
//! than a Prometheus should take from every node; for a look at one node's balance.
//!
//! # Memory
//!
//! A node with 100k frontends of 10 backends has a million backend series. Held as
//! `prometheus_client` families (one per counter, each with its own label set of two
//! `String`s and a counter allocation) they took ~600 bytes a backend, more than the index
//! holds for it. Here a frontend's backends are a [`Backends`] slab, which the route uses as
//! its backend list too: the addresses (20 bytes a backend) and the four counters of each
//! (32 bytes), the counters allocated at the route's first count — on such a node most
//! routes never carry a connection from it (allocating them lazily took the agent with the
//! file source at 1M endpoints from 565 to 547 MiB). Labels are formatted at scrape time
//! ([`Collector`]), with the same exposition (`mcs_proxy_connections_total{frontend=…,
//! backend=…}`, …); a backend not counted yet shows 0.
//!
//! # Counting across route changes
//!
//! A route whose backends change gets a new slab (a route whose backends stay keeps its
//! slab), but connections of the old route keep counting into the old one. So the store
//! keeps each frontend's earlier slabs that something still uses ("retired"), and a series'
//! value is the sum over the current slab and the retired ones. A retired slab that only the
//! store still holds has its final values added into the current slab and is dropped, after
//! each route swap for the frontends it changed (a slab a connection still held then goes at
//! the frontend's next swap). Counters stay monotonic and nothing counted is lost for a
//! backend that stays; a backend that leaves has its series dropped, as before.

use std::{
    collections::HashMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, OnceLock, RwLock,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Instant,
};

use mcs_model::health::{Health, may_mark_first};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, NoLabelSet},
    metrics::{MetricType, counter::Counter, gauge::Gauge},
    registry::Registry,
};

/// A counter the forwarder's tasks add to (relaxed atomics; read at scrape time).
#[derive(Debug, Default)]
pub struct Count(AtomicU64);

impl Count {
    /// Adds one.
    #[inline]
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n`.
    #[inline]
    pub fn inc_by(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The value now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The counters of one backend of one frontend.
#[derive(Debug, Default)]
pub struct BackendCells {
    /// See [`ProxyMetrics`]: `connections`.
    pub connections: Count,
    /// `bytes_tx`: client to backend.
    pub bytes_tx: Count,
    /// `bytes_rx`: backend to client.
    pub bytes_rx: Count,
    /// `connect_failures`.
    pub connect_failures: Count,
}

impl BackendCells {
    fn values(&self) -> [u64; 4] {
        BACKEND_FAMILIES.map(|(_, _, count)| count(self).get())
    }

    fn add(&self, v: [u64; 4]) {
        for ((_, _, count), n) in BACKEND_FAMILIES.iter().zip(v) {
            count(self).inc_by(n);
        }
    }
}

/// What this node has seen of one backend's connects ([`mcs_model::health::Health`] in
/// atomics: two threads failing the same backend at once may count one failure, which only
/// delays its mark by one connect).
#[derive(Debug, Default)]
pub struct HealthCell {
    failures: AtomicU32,
    until_ms: AtomicU64,
}

impl HealthCell {
    fn get(&self) -> Health {
        Health {
            failures: self.failures.load(Ordering::Relaxed),
            until_ms: self.until_ms.load(Ordering::Relaxed),
        }
    }

    fn set(&self, h: Health) {
        self.failures.store(h.failures, Ordering::Relaxed);
        self.until_ms.store(h.until_ms, Ordering::Relaxed);
    }
}

/// Milliseconds of this process's monotonic clock, from 1 (0 is "never" in [`Health`]).
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// A route's selected backends, in the route's order, and their counters.
#[derive(Debug)]
pub struct Slab {
    /// Address and port of each backend: 20 bytes, where a `SocketAddr` takes 32.
    addrs: Box<[(IpAddr, u16)]>,
    /// One per address, allocated at the first count.
    cells: OnceLock<Box<[BackendCells]>>,
    /// Passive health, one per address, allocated at the first failed connect: a route
    /// whose connects all succeed never pays for it.
    health: OnceLock<Box<[HealthCell]>>,
}

impl Slab {
    fn new(addrs: &[SocketAddr]) -> Self {
        Self {
            addrs: addrs.iter().map(|a| (a.ip(), a.port())).collect(),
            cells: OnceLock::new(),
            health: OnceLock::new(),
        }
    }

    fn health_cells(&self) -> &[HealthCell] {
        self.health.get_or_init(|| {
            std::iter::repeat_with(HealthCell::default)
                .take(self.addrs.len())
                .collect()
        })
    }

    /// A connect to backend `i` failed (refused, or no answer in time): this node skips it
    /// for a while ([`mcs_model::health`]). The route's first `selected` backends are one
    /// stage, the rest (fallback) another. Returns whether it is skipped now.
    pub fn connect_failed(&self, i: usize, selected: usize) -> bool {
        let now = now_ms();
        let cells = self.health_cells();
        let stage = if i < selected {
            &cells[..selected.min(cells.len())]
        } else {
            &cells[selected.min(cells.len())..]
        };
        let mut h = cells[i].get();
        let may_mark = h.failures == 0 && {
            let skipped = stage.iter().filter(|c| c.get().skipped(now)).count();
            may_mark_first(stage.len(), skipped)
        };
        let marked = h.failed(now, may_mark);
        cells[i].set(h);
        marked
    }

    /// A connect to backend `i` succeeded: it is healthy (one load when it was).
    #[inline]
    pub fn connected(&self, i: usize) {
        if let Some(cells) = self.health.get()
            && cells[i].get() != Health::default()
        {
            cells[i].set(Health::default());
        }
    }

    /// Whether new connections skip backend `i` at `now` (ms of [`now_ms`]).
    #[inline]
    pub fn skipped(&self, i: usize, now: u64) -> bool {
        self.health
            .get()
            .is_some_and(|cells| cells[i].get().skipped(now))
    }

    /// The backends skipped now, at most `limit` (for `/status`).
    pub fn skipped_now(&self, limit: usize) -> Vec<mcs_model::health::SkippedBackend> {
        let Some(cells) = self.health.get() else {
            return Vec::new();
        };
        let now = now_ms();
        cells
            .iter()
            .zip(self.addrs.iter())
            .map(|(c, a)| (c.get(), a))
            .filter(|(h, _)| h.skipped(now))
            .take(limit)
            .map(|(h, &(address, port))| mcs_model::health::SkippedBackend {
                address,
                port,
                failures: h.failures,
                for_ms: h.until_ms - now,
            })
            .collect()
    }

    /// Whether any backend ever failed a connect here (else none is skipped).
    #[inline]
    pub fn has_health(&self) -> bool {
        self.health.get().is_some()
    }

    /// Takes over what `old` (the slab this one replaces) saw of the backends both have.
    fn inherit_health(&self, old: &Slab) {
        let Some(old_cells) = old.health.get() else {
            return;
        };
        // Only what differs from healthy is carried: usually a few of many.
        let seen: HashMap<(IpAddr, u16), Health> = old
            .addrs
            .iter()
            .zip(old_cells.iter())
            .map(|(a, c)| (*a, c.get()))
            .filter(|(_, h)| *h != Health::default())
            .collect();
        if seen.is_empty() {
            return;
        }
        for (i, a) in self.addrs.iter().enumerate() {
            if let Some(&h) = seen.get(a) {
                self.health_cells()[i].set(h);
            }
        }
    }

    /// Number of backends.
    #[inline]
    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    /// No backends.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty()
    }

    /// The addresses, in order.
    #[inline]
    pub fn addrs(&self) -> impl ExactSizeIterator<Item = SocketAddr> + '_ {
        self.addrs
            .iter()
            .map(|&(ip, port)| SocketAddr::new(ip, port))
    }

    /// Where backend `i` is (panics past the end, as indexing does).
    #[inline]
    pub fn addr(&self, i: usize) -> SocketAddr {
        let (ip, port) = self.addrs[i];
        SocketAddr::new(ip, port)
    }

    /// The counters of backend `i` (the slab's counters are allocated now if this is its
    /// first count; panics past the end).
    #[inline]
    pub fn cells(&self, i: usize) -> &BackendCells {
        &self.cells.get_or_init(|| {
            std::iter::repeat_with(BackendCells::default)
                .take(self.addrs.len())
                .collect()
        })[i]
    }

    /// Whether anything was counted into this slab (its counters exist).
    pub(crate) fn counted(&self) -> bool {
        self.cells.get().is_some()
    }

    /// The values of backend `i` (zeros before the first count).
    fn values(&self, i: usize) -> [u64; 4] {
        self.cells.get().map_or([0; 4], |c| c[i].values())
    }
}

/// A route's backends with their counters: one slab, shared by the route, the connections
/// and sessions that use it, and the store.
pub type Backends = Arc<Slab>;

/// The counters of one frontend.
#[derive(Debug, Default)]
pub struct FrontendCells {
    /// `retries`: connections retried on another backend.
    pub retries: Count,
    /// `refused`: no route, no backend, or over the connection cap.
    pub refused: Count,
    /// `fallback_connections`: connections a fallback backend (another cluster's or zone's)
    /// took because every selected backend refused or is skipped after failed connects.
    pub fallbacks: Count,
    /// `skipped_connections`: connections whose first choice was skipped, because a connect
    /// to it failed lately, and that another backend took (written only when not zero).
    pub skipped: Count,
}

/// Counters of a frontend.
pub type FrontendCounters = Arc<FrontendCells>;

/// A frontend's series.
#[derive(Debug)]
struct FrontendSeries {
    cells: FrontendCounters,
    /// The slab of the frontend's route now.
    current: Backends,
    /// Earlier slabs still held by a connection, a session or an old route (see the module
    /// documentation).
    retired: Vec<Backends>,
    /// What backends that left the route had counted (folded from retired slabs), so the
    /// per-frontend sums never go down.
    departed: [u64; 4],
}

impl FrontendSeries {
    /// Adds the final values of retired slabs that nothing else holds any more into the
    /// current slab and drops them.
    fn fold_retired(&mut self) {
        if self.retired.is_empty() {
            return;
        }
        let mut done = Vec::new();
        self.retired.retain(|r| {
            let only_here = Arc::strong_count(r) == 1;
            // A slab never counted into adds nothing: it is only dropped.
            if only_here && r.counted() {
                done.push(r.clone());
            }
            !only_here
        });
        if done.is_empty() {
            return;
        }
        let at: HashMap<SocketAddr, usize> = self
            .current
            .addrs()
            .enumerate()
            .map(|(i, a)| (a, i))
            .collect();
        for r in done {
            for (j, addr) in r.addrs().enumerate() {
                match at.get(&addr) {
                    Some(&i) => self.current.cells(i).add(r.values(j)),
                    None => {
                        for (d, v) in self.departed.iter_mut().zip(r.values(j)) {
                            *d += v;
                        }
                    }
                }
            }
        }
    }

    /// The frontend's totals of the four backend counters: every backend of the current
    /// slab and of the retired ones, and those that left.
    fn totals(&self) -> [u64; 4] {
        let mut t = self.departed;
        for slab in std::iter::once(&self.current).chain(self.retired.iter()) {
            if !slab.counted() {
                continue;
            }
            for i in 0..slab.len() {
                for (t, v) in t.iter_mut().zip(slab.values(i)) {
                    *t += v;
                }
            }
        }
        t
    }

    /// What the retired slabs still add to each backend of the current one.
    fn retired_sums(&self) -> HashMap<SocketAddr, [u64; 4]> {
        let mut sums: HashMap<SocketAddr, [u64; 4]> = HashMap::new();
        for r in self.retired.iter().filter(|r| r.counted()) {
            for (j, addr) in r.addrs().enumerate() {
                let s = sums.entry(addr).or_default();
                for (s, v) in s.iter_mut().zip(r.values(j)) {
                    *s += v;
                }
            }
        }
        sums
    }
}

/// Every series, by frontend label (`VIP:port/PROTO`), and whether the backend counters are
/// written per backend (else summed per frontend).
#[derive(Debug, Default)]
struct Store(
    RwLock<HashMap<Arc<str>, FrontendSeries>>,
    std::sync::atomic::AtomicBool,
);

/// A route's series: its frontend label, the frontend's counters, and its backends.
pub type RouteSeries = (Arc<str>, FrontendCounters, Backends);

/// All forwarder metrics.
#[derive(Clone, Debug, Default)]
pub struct ProxyMetrics {
    series: Arc<Store>,
    /// Open TCP connections.
    pub active_connections: Gauge,
    /// Live UDP sessions.
    pub udp_sessions: Gauge,
    /// Connections closed because their backend was removed and the drain bound passed.
    pub drained: Counter,
    /// TCP workers running on io_uring (`--tcp-engine`; the others use epoll).
    pub io_uring_workers: Gauge,
    /// Most open TCP connections (`--max-connections`): past it new ones are refused.
    pub connection_limit: Gauge,
    /// Frontends whose listening sockets could not be opened (so they are not intercepted).
    pub listen_failures: Counter,
    /// Frontends with listening sockets open now.
    pub listening_frontends: Gauge,
}

/// A family written from the store: name, help, which counter of the cells.
type FamilyOf<C> = (&'static str, &'static str, fn(&C) -> &Count);

/// The per-backend counter families.
const BACKEND_FAMILIES: [FamilyOf<BackendCells>; 4] = [
    (
        "connections",
        "Connections/sessions forwarded, per frontend (and backend with --metrics-per-backend)",
        |c| &c.connections,
    ),
    ("bytes_tx", "Bytes client to backend", |c| &c.bytes_tx),
    ("bytes_rx", "Bytes backend to client", |c| &c.bytes_rx),
    ("connect_failures", "Failed connects to a backend", |c| {
        &c.connect_failures
    }),
];

/// The family of connections that skipped a backend after failed connects, per frontend (both
/// dataplanes write it, only for frontends where it is not zero).
pub const SKIPPED_CONNECTIONS: (&str, &str) = (
    "skipped_connections",
    "Connections whose first choice was skipped because a connect to it failed lately (on this node; per client pod with eBPF), taken by another backend",
);

/// The per-frontend counter families.
const FRONTEND_FAMILIES: [FamilyOf<FrontendCells>; 3] = [
    ("retries", "Connections retried on another backend", |c| {
        &c.retries
    }),
    (
        "refused",
        "Connections refused (no route, no backend, cap)",
        |c| &c.refused,
    ),
    (
        "fallback_connections",
        "Connections taken by a fallback backend (another cluster's or zone's) because every selected backend refused or is skipped after failed connects",
        |c| &c.fallbacks,
    ),
];

impl Collector for Store {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // A poisoned lock only means a writer panicked mid-update; the counters are atomics.
        let map = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // What retired slabs add, per frontend that has any (nearly always none).
        let retired: HashMap<&str, HashMap<SocketAddr, [u64; 4]>> = map
            .iter()
            .filter(|(_, s)| !s.retired.is_empty())
            .map(|(f, s)| (&**f, s.retired_sums()))
            .collect();
        let per_backend = self.1.load(Ordering::Relaxed);
        if !per_backend {
            // Per frontend: each backend counter summed over the frontend's backends.
            let totals: Vec<(&str, [u64; 4])> =
                map.iter().map(|(f, s)| (&**f, s.totals())).collect();
            for (k, (name, help, _)) in BACKEND_FAMILIES.into_iter().enumerate() {
                let mut family =
                    encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
                for (frontend, t) in &totals {
                    family
                        .encode_family(&[("frontend", *frontend)])?
                        .encode_counter::<NoLabelSet, _, u64>(&t[k], None)?;
                }
            }
        }
        let mut label = String::new();
        for (k, (name, help, count)) in BACKEND_FAMILIES
            .into_iter()
            .enumerate()
            .filter(|_| per_backend)
        {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (frontend, series) in map.iter() {
                let extra = retired.get(&**frontend);
                let cells = series.current.cells.get();
                for (i, addr) in series.current.addrs().enumerate() {
                    label.clear();
                    write!(label, "{addr}")?;
                    let value = cells.map_or(0, |c| count(&c[i]).get())
                        + extra.and_then(|e| e.get(&addr)).map_or(0, |v| v[k]);
                    let labels = [("frontend", &**frontend), ("backend", label.as_str())];
                    family
                        .encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
                }
            }
        }
        for (name, help, count) in FRONTEND_FAMILIES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (frontend, series) in map.iter() {
                let labels = [("frontend", &**frontend)];
                family
                    .encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&count(&series.cells).get(), None)?;
            }
        }
        // Only the frontends that skipped a backend (a scrape keeps its seven series per
        // frontend on a node where nothing failed).
        let (name, help) = SKIPPED_CONNECTIONS;
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (frontend, series) in map.iter() {
            let skipped = series.cells.skipped.get();
            if skipped > 0 {
                family
                    .encode_family(&[("frontend", &**frontend)])?
                    .encode_counter::<NoLabelSet, _, u64>(&skipped, None)?;
            }
        }
        Ok(())
    }
}

impl ProxyMetrics {
    /// Writes the backend counters per backend of each frontend (`--metrics-per-backend`: four
    /// series per backend) instead of summed per frontend (the default).
    pub fn set_per_backend(&self, on: bool) {
        self.series.1.store(on, Ordering::Relaxed);
    }

    /// Registers under `mcs_proxy_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("mcs_proxy");
        r.register_collector(Box::new(self.series.clone()));
        r.register(
            "active_connections",
            "Open TCP connections",
            self.active_connections.clone(),
        );
        r.register(
            "udp_sessions",
            "Live UDP sessions",
            self.udp_sessions.clone(),
        );
        r.register(
            "drained",
            "Connections closed after their backend was removed",
            self.drained.clone(),
        );
        r.register(
            "tcp_io_uring_workers",
            "TCP workers running on io_uring (the others use epoll)",
            self.io_uring_workers.clone(),
        );
        r.register(
            "connection_limit",
            "Most open TCP connections (--max-connections); past it new ones are refused",
            self.connection_limit.clone(),
        );
        r.register(
            "listen_failures",
            "Frontends whose listening sockets could not be opened (not intercepted)",
            self.listen_failures.clone(),
        );
        r.register(
            "listening_frontends",
            "Frontends with a listening socket bound to their ClusterSetIP and port",
            self.listening_frontends.clone(),
        );
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<Arc<str>, FrontendSeries>> {
        self.series
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The counters of a frontend and the slab of `backends` (in this order), with the label
    /// as the store holds it (the route keeps it: one allocation however often it is named).
    /// The frontend's slab is reused when its backends are the same; otherwise a new one
    /// starts at zero and the old one is retired (see the module documentation).
    pub fn route(&self, frontend: &str, backends: &[SocketAddr]) -> RouteSeries {
        let fresh = || -> Backends { Arc::new(Slab::new(backends)) };
        let mut map = self.write();
        let known = map.get_key_value(frontend).map(|(k, _)| k.clone());
        if let Some(label) = known
            && let Some(series) = map.get_mut(frontend)
        {
            let same = series.current.addrs().eq(backends.iter().copied());
            if !same {
                let old = std::mem::replace(&mut series.current, fresh());
                series.current.inherit_health(&old);
                series.retired.push(old);
            }
            return (label, series.cells.clone(), series.current.clone());
        }
        let label: Arc<str> = Arc::from(frontend);
        let series = FrontendSeries {
            cells: FrontendCounters::default(),
            current: fresh(),
            retired: Vec::new(),
            departed: [0; 4],
        };
        let out = (label.clone(), series.cells.clone(), series.current.clone());
        map.insert(label, series);
        out
    }

    /// Folds the retired slabs of these frontends that nothing but the store holds any more
    /// (called after a route swap, once the old routes are dropped).
    pub fn settle<'a>(&self, frontends: impl IntoIterator<Item = &'a str>) {
        let mut map = self.write();
        for f in frontends {
            if let Some(series) = map.get_mut(f) {
                series.fold_retired();
            }
        }
    }

    /// How many retired slabs `frontend` has (for tests).
    #[cfg(test)]
    pub(crate) fn retired_slabs(&self, frontend: &str) -> usize {
        self.write().get(frontend).map_or(0, |s| s.retired.len())
    }

    /// Drops the series of a frontend that is gone, with its backends'.
    pub fn forget_frontend(&self, frontend: &str) {
        self.write().remove(frontend);
    }
}
