//! The agent's sync loop: source events in, diffs out to the dataplane.
//!
//! Events are applied to the index as they come. A batch ends when the sources have been
//! quiet for [`SyncConfig::quiet`] or the batch is [`SyncConfig::max_delay`] old;
//! then the index is flushed and the diff applied. So a single change is applied after
//! `quiet` (10 ms by default) and a burst of hundreds of changes becomes a few diffs.
//! Nothing is flushed before the source's first full sync; `/readyz` turns ready after that
//! first full table is programmed.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant},
};

use mcs_model::{
    Dataplane, DataplaneError, Index, NodeConfig, TableDiff, input::escaped, validate::Rejection,
};
use tokio::sync::{mpsc, watch};

use crate::{
    events::EventSink,
    http::Health,
    metrics::{KindLabel, Metrics, ReasonLabel},
    source::SourceEvent,
    status::{self, StatusRequest},
};
use mcs_model::status::NodeStatus;

/// Rejections logged one by one per flush; past these, one line says how many more (a full
/// table that does not fit would otherwise log a line per frontend, ~90k at 100k imports).
const LOGGED_PER_FLUSH: usize = 20;

/// Tuning of the loop.
#[derive(Clone, Debug)]
pub struct SyncConfig {
    /// A batch ends after this much quiet.
    pub quiet: Duration,
    /// A batch ends at this age, however busy the sources are.
    pub max_delay: Duration,
    /// The cluster id was given on the command line: ClusterProperty updates are ignored.
    pub cluster_id_fixed: bool,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            quiet: Duration::from_millis(10),
            max_delay: Duration::from_millis(200),
            cluster_id_fixed: false,
        }
    }
}

/// The agent's sync loop. See the module docs.
#[derive(Debug)]
pub struct SyncLoop<D> {
    index: Index,
    dataplane: D,
    config: SyncConfig,
    metrics: Arc<Metrics>,
    health: Health,
    events: Option<EventSink>,
    unreadable: BTreeMap<String, Rejection>,
    /// `unreadable` changed since the rejections were last gathered.
    unreadable_changed: bool,
    rejected: BTreeSet<Rejection>,
    /// What the rejections were gathered from: the index's rejection version and the
    /// dataplane's unprogrammed frontends. Unchanged (and `unreadable` too): nothing to do.
    rejected_from: Option<(u64, Unprogrammed)>,
    pending_retry: Option<TableDiff>,
    /// The `clusterset.local` zone kept up to date at every flush, when DNS is served.
    zone: Option<Arc<mcs_model::dns::Zone>>,
    /// `/status` questions, answered between batches.
    status_rx: Option<mpsc::Receiver<StatusRequest>>,
}

/// The dataplane's unprogrammed frontends as last seen: its version when it keeps one, else
/// the list itself.
#[derive(Debug, PartialEq, Eq)]
enum Unprogrammed {
    Version(u64),
    List(Vec<Rejection>),
}

impl<D: Dataplane> SyncLoop<D> {
    /// Also keeps `zone` equal to the index's DNS records (updated per changed service at
    /// every flush).
    pub fn with_dns_zone(mut self, zone: Arc<mcs_model::dns::Zone>) -> Self {
        self.index.track_dns();
        self.zone = Some(zone);
        self
    }

    /// A sync loop for a node.
    pub fn new(
        node: NodeConfig,
        dataplane: D,
        config: SyncConfig,
        metrics: Arc<Metrics>,
        health: Health,
        events: Option<EventSink>,
    ) -> Self {
        Self {
            index: Index::new(node),
            dataplane,
            config,
            metrics,
            health,
            events,
            unreadable: BTreeMap::new(),
            unreadable_changed: false,
            rejected: BTreeSet::new(),
            rejected_from: None,
            pending_retry: None,
            zone: None,
            status_rx: None,
        }
    }

    /// Also answers the questions sent on `rx` (the agent's `/status`), between batches.
    pub fn with_status_requests(mut self, rx: mpsc::Receiver<StatusRequest>) -> Self {
        self.status_rx = Some(rx);
        self
    }

    /// The answer to a `/status` question.
    pub fn status(&self, service: Option<(String, String)>) -> NodeStatus {
        status::build(
            &self.index,
            &self.dataplane,
            self.health.is_ready(),
            &self.rejected,
            service,
        )
    }

    /// The index (for status and tests).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The dataplane.
    pub fn dataplane(&self) -> &D {
        &self.dataplane
    }

    /// Gives the dataplane back (to shut it down).
    pub fn into_dataplane(self) -> D {
        self.dataplane
    }

    /// Runs until the sources close their channel or `shutdown` turns true. Returns the
    /// dataplane so the caller can tear it down.
    pub async fn run(
        mut self,
        mut rx: mpsc::Receiver<SourceEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Self {
        let mut synced = false;
        let mut status_rx = self.status_rx.take();
        loop {
            let first = tokio::select! {
                ev = rx.recv() => ev,
                Some(req) = next_request(&mut status_rx) => {
                    let _ = req.reply.send(self.status(req.service));
                    continue;
                }
                _ = shutdown.wait_for(|s| *s) => None,
            };
            let Some(first) = first else { break };
            let started = Instant::now();
            synced |= self.handle(first);
            let deadline = started + self.config.max_delay;
            let mut closed = false;
            loop {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                let wait = self.config.quiet.min(deadline - now);
                match tokio::time::timeout(wait, rx.recv()).await {
                    Ok(Some(ev)) => synced |= self.handle(ev),
                    Ok(None) => {
                        closed = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if synced {
                self.flush(started);
            }
            if closed {
                break;
            }
        }
        self
    }

    /// Applies one event to the index; true when it is the first full sync.
    fn handle(&mut self, ev: SourceEvent) -> bool {
        self.unreadable_changed |=
            matches!(ev, SourceEvent::Unreadable(_) | SourceEvent::Readable(_));
        crate::source::apply(
            &mut self.index,
            &mut self.unreadable,
            ev,
            self.config.cluster_id_fixed,
        )
    }

    /// Flushes the index, applies the diff, updates metrics, logs and Events.
    fn flush(&mut self, started: Instant) {
        let mut diff = self.index.flush();
        if let Some(mut retry) = self.pending_retry.take() {
            // Merge: the newer diff wins per frontend.
            for f in &diff.remove {
                retry.upsert.remove(f);
            }
            for f in diff.upsert.keys() {
                retry.remove.retain(|r| r != f);
            }
            retry.upsert.append(&mut diff.upsert);
            retry.remove.append(&mut diff.remove);
            retry.remove.sort();
            retry.remove.dedup();
            diff = retry;
        }
        if !diff.is_empty() {
            match self.dataplane.apply(&diff) {
                Ok(()) => {
                    self.metrics.diffs_applied_total.inc();
                    self.metrics
                        .sync_latency_seconds
                        .observe(started.elapsed().as_secs_f64());
                    tracing::info!(
                        upserted = diff.upsert.len(),
                        removed = diff.remove.len(),
                        dataplane = self.dataplane.name(),
                        latency_ms = started.elapsed().as_secs_f64() * 1e3,
                        "applied diff"
                    );
                }
                Err(DataplaneError { message }) => {
                    self.metrics.dataplane_errors_total.inc();
                    tracing::error!(error = %message, "dataplane failed to apply a diff; will retry");
                    self.pending_retry = Some(diff);
                }
            }
        }
        // DNS after the dataplane: a name resolves once its address is programmed.
        if let Some(zone) = &self.zone {
            for (svc, records) in self.index.take_dns_changes() {
                zone.set(&svc, records);
            }
        }
        // Rejections and gauges first: once ready, /metrics describes the table.
        self.update_rejections();
        self.update_gauges();
        if !self.health.is_ready() && self.pending_retry.is_none() {
            let t = self.index.table();
            tracing::info!(
                frontends = t.frontends.len(),
                "first full table programmed; ready"
            );
            self.health.set_ready();
            self.metrics.ready.set(1);
        }
    }

    /// Logs, counts and publishes what is newly rejected. O(1) when nothing that holds
    /// rejections changed; otherwise a walk over everything rejected.
    fn update_rejections(&mut self) {
        let from = (
            self.index.rejections_version(),
            match self.dataplane.unprogrammed_version() {
                Some(v) => Unprogrammed::Version(v),
                None => Unprogrammed::List(self.dataplane.unprogrammed()),
            },
        );
        if !std::mem::take(&mut self.unreadable_changed)
            && self.rejected_from.as_ref() == Some(&from)
        {
            return;
        }
        let unprogrammed = match &from.1 {
            Unprogrammed::Version(_) => self.dataplane.unprogrammed(),
            Unprogrammed::List(l) => l.clone(),
        };
        let now: BTreeSet<Rejection> = self
            .index
            .rejections()
            .into_iter()
            .chain(self.unreadable.values().cloned())
            .chain(unprogrammed)
            .collect();
        self.rejected_from = Some(from);
        let new: Vec<Rejection> = now.difference(&self.rejected).cloned().collect();
        for (i, r) in new.iter().enumerate() {
            if i < LOGGED_PER_FLUSH {
                tracing::warn!(object = %escaped(&r.object), reason = r.reason.label(), "rejected: {}", escaped(&r.message));
            }
            self.metrics
                .rejections_total
                .get_or_create(&ReasonLabel {
                    reason: r.reason.label().into(),
                })
                .inc();
        }
        if new.len() > LOGGED_PER_FLUSH {
            tracing::warn!(
                more = new.len() - LOGGED_PER_FLUSH,
                "more objects rejected than logged one by one; `mcs-agent table`, the mcs_rejected metric and Events list them"
            );
        }
        let gone: Vec<&Rejection> = self.rejected.difference(&now).collect();
        for r in gone.iter().take(LOGGED_PER_FLUSH) {
            tracing::info!(object = %escaped(&r.object), reason = r.reason.label(), "no longer rejected");
        }
        if gone.len() > LOGGED_PER_FLUSH {
            tracing::info!(
                more = gone.len() - LOGGED_PER_FLUSH,
                "more objects no longer rejected than logged one by one"
            );
        }
        let mut by_reason: BTreeMap<&str, i64> = BTreeMap::new();
        for r in &self.rejected {
            by_reason.entry(r.reason.label()).or_insert(0);
        }
        for r in &now {
            *by_reason.entry(r.reason.label()).or_insert(0) += 1;
        }
        for (reason, n) in by_reason {
            self.metrics
                .rejected
                .get_or_create(&ReasonLabel {
                    reason: reason.into(),
                })
                .set(n);
        }
        if let Some(events) = self.events.as_mut()
            && !new.is_empty()
        {
            events.publish(&new);
        }
        self.rejected = now;
    }

    fn update_gauges(&self) {
        let t = self.index.table();
        let (imports, slices) = self.index.object_counts();
        let set = |kind: &str, n: usize| {
            self.metrics
                .objects
                .get_or_create(&KindLabel { kind: kind.into() })
                .set(n as i64);
        };
        set("ServiceImport", imports);
        set("EndpointSlice", slices);
        self.metrics.frontends.set(t.frontends.len() as i64);
        self.metrics
            .backends
            .set(self.index.table_backends() as i64);
    }
}

/// The next `/status` question; never, without a channel (or once it is closed).
async fn next_request(rx: &mut Option<mpsc::Receiver<StatusRequest>>) -> Option<StatusRequest> {
    match rx {
        Some(rx) => match rx.recv().await {
            Some(r) => Some(r),
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}
