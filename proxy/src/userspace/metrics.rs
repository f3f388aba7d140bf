//! Metrics of the userspace forwarder, per frontend and backend. Counters of a route's
//! backends are looked up once, when the route is built, so a connection touches only atomics.
//!
//! # Memory
//!
//! A node with 100k frontends of 10 backends has a million backend series. Held as
//! `prometheus_client` families (one per counter, each with its own label set of two
//! `String`s and a counter allocation) they took ~600 bytes a backend, more than the index
//! holds for it. Here each backend of a frontend is one allocation of its four counters, kept
//! in the frontend's map under a label `Arc<str>` that the route shares, and the families are
//! written from that store at scrape time ([`Collector`]): about a fifth of the memory, and
//! the same exposition (`mcs_proxy_connections_total{frontend=…,backend=…}`, …).

use std::{
    collections::HashMap,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

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

/// The counters of one frontend.
#[derive(Debug, Default)]
pub struct FrontendCells {
    /// `retries`: connections retried on another backend.
    pub retries: Count,
    /// `refused`: no route, no backend, or over the connection cap.
    pub refused: Count,
}

/// Counters of a backend, shared by the routes that use it and the store.
pub type BackendCounters = Arc<BackendCells>;
/// Counters of a frontend.
pub type FrontendCounters = Arc<FrontendCells>;

/// A frontend's series: its counters and its backends' (label → counters).
#[derive(Debug, Default)]
struct FrontendSeries {
    cells: FrontendCounters,
    backends: HashMap<Arc<str>, BackendCounters>,
}

/// Every series, by frontend label (`VIP:port/PROTO`).
#[derive(Debug, Default)]
struct Store(RwLock<HashMap<Arc<str>, FrontendSeries>>);

/// A route's series: its frontend label and counters, and each backend's label and counters.
pub type RouteSeries = (Arc<str>, FrontendCounters, Vec<(Arc<str>, BackendCounters)>);

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
}

/// A family written from the store: name, help, which counter of the cells.
type FamilyOf<C> = (&'static str, &'static str, fn(&C) -> &Count);

/// The per-backend counter families.
const BACKEND_FAMILIES: [FamilyOf<BackendCells>; 4] = [
    (
        "connections",
        "Connections/sessions forwarded, per frontend and backend",
        |c| &c.connections,
    ),
    ("bytes_tx", "Bytes client to backend", |c| &c.bytes_tx),
    ("bytes_rx", "Bytes backend to client", |c| &c.bytes_rx),
    ("connect_failures", "Failed connects to a backend", |c| {
        &c.connect_failures
    }),
];

/// The per-frontend counter families.
const FRONTEND_FAMILIES: [FamilyOf<FrontendCells>; 2] = [
    ("retries", "Connections retried on another backend", |c| {
        &c.retries
    }),
    (
        "refused",
        "Connections refused (no route, no backend, cap)",
        |c| &c.refused,
    ),
];

impl Collector for Store {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // A poisoned lock only means a writer panicked mid-update; the counters are atomics.
        let map = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (name, help, count) in BACKEND_FAMILIES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (frontend, series) in map.iter() {
                for (backend, cells) in &series.backends {
                    let labels = [("frontend", &**frontend), ("backend", &**backend)];
                    family
                        .encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&count(cells).get(), None)?;
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
        Ok(())
    }
}

impl ProxyMetrics {
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
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<Arc<str>, FrontendSeries>> {
        self.series
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The counters of a frontend and of each of `backends` (labels `addr:port`), created
    /// when new, with the labels as the store holds them (the route keeps these, so a label
    /// is one allocation however many routes and series name it).
    pub fn route(&self, frontend: &str, backends: impl IntoIterator<Item = String>) -> RouteSeries {
        let mut map = self.write();
        let label: Arc<str> = match map.get_key_value(frontend) {
            Some((k, _)) => k.clone(),
            None => Arc::from(frontend),
        };
        let series = map.entry(label.clone()).or_default();
        let backends = backends
            .into_iter()
            .map(|b| match series.backends.get_key_value(b.as_str()) {
                Some((k, c)) => (k.clone(), c.clone()),
                None => {
                    let k: Arc<str> = Arc::from(b);
                    let c = BackendCounters::default();
                    series.backends.insert(k.clone(), c.clone());
                    (k, c)
                }
            })
            .collect();
        (label, series.cells.clone(), backends)
    }

    /// Drops the series of backends of `frontend` that left its route, so that backend churn
    /// does not grow the store without bound.
    pub fn forget_backends<'a>(&self, frontend: &str, backends: impl IntoIterator<Item = &'a str>) {
        let mut map = self.write();
        if let Some(series) = map.get_mut(frontend) {
            for b in backends {
                series.backends.remove(b);
            }
        }
    }

    /// Drops the series of a frontend that is gone, with its backends'.
    pub fn forget_frontend(&self, frontend: &str) {
        self.write().remove(frontend);
    }
}
