//! A dataplane that records what it was given, and helpers to wait for it.
#![allow(dead_code)]

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use mcs_model::{Dataplane, DataplaneError, ForwardingTable, Frontend, NodeConfig, TableDiff};
use mcs_sync::{SourceEvent, SyncConfig, SyncLoop, http::Health, metrics::Metrics};
use tokio::sync::{Notify, mpsc, watch};

/// What the recording dataplane saw.
#[derive(Debug, Default)]
pub struct Seen {
    pub table: ForwardingTable,
    pub upserts: HashMap<Frontend, usize>,
    pub diffs: usize,
}

/// A dataplane that keeps the table and counts upserts per frontend.
#[derive(Clone, Debug, Default)]
pub struct Recording {
    pub seen: Arc<Mutex<Seen>>,
    pub changed: Arc<Notify>,
}

impl Dataplane for Recording {
    fn name(&self) -> &'static str {
        "recording"
    }

    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError> {
        let mut s = self.seen.lock().unwrap();
        s.table.apply(diff);
        s.diffs += 1;
        for f in diff.upsert.keys() {
            *s.upserts.entry(*f).or_default() += 1;
        }
        drop(s);
        self.changed.notify_waiters();
        Ok(())
    }
}

impl Recording {
    /// Waits (up to `timeout`) until `pred` holds for what was seen; panics with `what` if not.
    pub async fn wait_for(&self, what: &str, timeout: Duration, pred: impl Fn(&Seen) -> bool) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if pred(&self.seen.lock().unwrap()) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let s = self.seen.lock().unwrap();
                panic!(
                    "timed out after {timeout:?} waiting for {what}; table now: {:#?}",
                    s.table
                );
            }
        }
    }

    pub fn upserts_of(&self, f: &Frontend) -> usize {
        self.seen
            .lock()
            .unwrap()
            .upserts
            .get(f)
            .copied()
            .unwrap_or(0)
    }

    /// Selected backends of `f` as `addr:port@cluster`.
    pub fn selected(&self, f: &Frontend) -> Vec<String> {
        selected_in(&self.seen.lock().unwrap(), f)
    }
}

pub fn selected_in(s: &Seen, f: &Frontend) -> Vec<String> {
    s.table
        .frontends
        .get(f)
        .map(|svc| {
            svc.selected()
                .map(|b| format!("{}:{}@{}", b.address, b.port, b.cluster))
                .collect()
        })
        .unwrap_or_default()
}

/// A running controller with a recording dataplane.
pub struct Running {
    pub dataplane: Recording,
    pub health: Health,
    pub metrics: Arc<Metrics>,
    pub registry: Arc<prometheus_client::registry::Registry>,
    pub stop: watch::Sender<bool>,
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts a controller fed by `rx`.
pub fn start(node: NodeConfig, cluster_id_fixed: bool, rx: mpsc::Receiver<SourceEvent>) -> Running {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let health = Health::default();
    let dataplane = Recording::default();
    let controller = SyncLoop::new(
        node,
        dataplane.clone(),
        SyncConfig {
            cluster_id_fixed,
            ..Default::default()
        },
        metrics.clone(),
        health.clone(),
        None,
    );
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        controller.run(rx, stop_rx).await;
    });
    Running {
        dataplane,
        health,
        metrics,
        registry: Arc::new(registry),
        stop,
        task,
    }
}

pub fn fe(vip: &str, port: u16, proto: mcs_model::Protocol) -> Frontend {
    Frontend {
        vip: vip.parse().unwrap(),
        port,
        protocol: proto,
    }
}
