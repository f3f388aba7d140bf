//! Prometheus metrics of the agent's sync loop (prometheus-client), served on `/metrics`.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// Label set `{reason="..."}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `Reason::label()`.
    pub reason: String,
}

/// Label set `{kind="..."}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `ServiceImport` or `EndpointSlice`.
    pub kind: String,
}

/// The sync loop's metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Objects held by the index, by kind.
    pub objects: Family<KindLabel, Gauge>,
    /// Frontends programmed.
    pub frontends: Gauge,
    /// Backends programmed (all, selected or not).
    pub backends: Gauge,
    /// Rejections currently in force, by reason.
    pub rejected: Family<ReasonLabel, Gauge>,
    /// Rejections seen, by reason (counts each new rejection once).
    pub rejections_total: Family<ReasonLabel, Counter>,
    /// Seconds from the first event of a batch to its diff applied to the dataplane.
    pub sync_latency_seconds: Histogram,
    /// Diffs applied.
    pub diffs_applied_total: Counter,
    /// Diffs the dataplane failed to apply.
    pub dataplane_errors_total: Counter,
    /// 1 once the first full table is programmed (`/readyz`), else 0.
    pub ready: Gauge,
}

impl Metrics {
    /// New metrics, registered in `registry` under the prefix `mcs_`.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            objects: Family::default(),
            frontends: Gauge::default(),
            backends: Gauge::default(),
            rejected: Family::default(),
            rejections_total: Family::default(),
            // 0.5 ms .. ~16 s
            sync_latency_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 16),
            ),
            diffs_applied_total: Counter::default(),
            dataplane_errors_total: Counter::default(),
            ready: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("mcs");
        r.register(
            "objects",
            "Objects held by the index, by kind",
            m.objects.clone(),
        );
        r.register(
            "frontends",
            "Frontends (VIP:port/protocol) programmed",
            m.frontends.clone(),
        );
        r.register(
            "backends",
            "Backends of all frontends programmed",
            m.backends.clone(),
        );
        r.register(
            "rejected",
            "Rejections in force, by reason",
            m.rejected.clone(),
        );
        r.register(
            "rejections",
            "New rejections seen, by reason",
            m.rejections_total.clone(),
        );
        r.register(
            "sync_latency_seconds",
            "Seconds from a source event to its diff applied to the dataplane",
            m.sync_latency_seconds.clone(),
        );
        r.register(
            "diffs_applied",
            "Diffs applied to the dataplane",
            m.diffs_applied_total.clone(),
        );
        r.register(
            "dataplane_errors",
            "Diffs the dataplane failed to apply",
            m.dataplane_errors_total.clone(),
        );
        r.register(
            "ready",
            "1 once the first full table is programmed (as /readyz), else 0",
            m.ready.clone(),
        );
        m
    }
}
