//! Metrics of the userspace forwarder, per frontend and backend. Counters of a route's
//! backends are looked up once, when the route is built, so a connection touches only atomics.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// `{frontend, backend}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    /// `VIP:port/PROTO`.
    pub frontend: String,
    /// `addr:port`.
    pub backend: String,
}

/// `{frontend}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FrontendLabels {
    /// `VIP:port/PROTO`.
    pub frontend: String,
}

/// All forwarder metrics.
#[derive(Clone, Debug, Default)]
pub struct ProxyMetrics {
    /// Connections (TCP) or sessions (UDP) forwarded to a backend.
    pub connections: Family<BackendLabels, Counter>,
    /// Bytes from clients to the backend.
    pub bytes_tx: Family<BackendLabels, Counter>,
    /// Bytes from the backend to clients.
    pub bytes_rx: Family<BackendLabels, Counter>,
    /// Failed connects to a backend (refused, timed out).
    pub connect_failures: Family<BackendLabels, Counter>,
    /// Connections retried on another backend.
    pub retries: Family<FrontendLabels, Counter>,
    /// Connections refused: no route, no backend, or over the connection cap.
    pub refused: Family<FrontendLabels, Counter>,
    /// Open TCP connections.
    pub active_connections: Gauge,
    /// Live UDP sessions.
    pub udp_sessions: Gauge,
    /// Connections closed because their backend was removed and the drain bound passed.
    pub drained: Counter,
}

impl ProxyMetrics {
    /// Registers under `mcs_proxy_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("mcs_proxy");
        r.register(
            "connections",
            "Connections/sessions forwarded, per frontend and backend",
            self.connections.clone(),
        );
        r.register("bytes_tx", "Bytes client to backend", self.bytes_tx.clone());
        r.register("bytes_rx", "Bytes backend to client", self.bytes_rx.clone());
        r.register(
            "connect_failures",
            "Failed connects to a backend",
            self.connect_failures.clone(),
        );
        r.register(
            "retries",
            "Connections retried on another backend",
            self.retries.clone(),
        );
        r.register(
            "refused",
            "Connections refused (no route, no backend, cap)",
            self.refused.clone(),
        );
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

    /// The counters of one backend of one frontend.
    pub fn backend(&self, frontend: &str, backend: &str) -> BackendCounters {
        let l = BackendLabels {
            frontend: frontend.into(),
            backend: backend.into(),
        };
        BackendCounters {
            connections: self.connections.get_or_create(&l).clone(),
            bytes_tx: self.bytes_tx.get_or_create(&l).clone(),
            bytes_rx: self.bytes_rx.get_or_create(&l).clone(),
            connect_failures: self.connect_failures.get_or_create(&l).clone(),
        }
    }

    /// Drops the label sets of one backend of one frontend (it left the route), so that
    /// backend churn does not grow the registry without bound.
    pub fn forget_backend(&self, frontend: &str, backend: &str) {
        let l = BackendLabels {
            frontend: frontend.into(),
            backend: backend.into(),
        };
        self.connections.remove(&l);
        self.bytes_tx.remove(&l);
        self.bytes_rx.remove(&l);
        self.connect_failures.remove(&l);
    }

    /// Drops the label sets of a frontend that is gone.
    pub fn forget_frontend(&self, frontend: &str) {
        let l = FrontendLabels {
            frontend: frontend.into(),
        };
        self.retries.remove(&l);
        self.refused.remove(&l);
    }

    /// The counters of one frontend.
    pub fn frontend(&self, frontend: &str) -> FrontendCounters {
        let l = FrontendLabels {
            frontend: frontend.into(),
        };
        FrontendCounters {
            retries: self.retries.get_or_create(&l).clone(),
            refused: self.refused.get_or_create(&l).clone(),
        }
    }
}

/// Counters of a backend (atomics shared with the registry).
#[derive(Clone, Debug, Default)]
pub struct BackendCounters {
    /// See [`ProxyMetrics::connections`].
    pub connections: Counter,
    /// See [`ProxyMetrics::bytes_tx`].
    pub bytes_tx: Counter,
    /// See [`ProxyMetrics::bytes_rx`].
    pub bytes_rx: Counter,
    /// See [`ProxyMetrics::connect_failures`].
    pub connect_failures: Counter,
}

/// Counters of a frontend.
#[derive(Clone, Debug, Default)]
pub struct FrontendCounters {
    /// See [`ProxyMetrics::retries`].
    pub retries: Counter,
    /// See [`ProxyMetrics::refused`].
    pub refused: Counter,
}
