//! Whether the agent's DaemonSet is being removed: an uninstall, not a restart.
//!
//! The eBPF programs and their pinned maps outlive the agent on purpose, so a restart or an
//! upgrade does not drop a connection. An uninstall (`helm uninstall`, `kubectl delete -k`)
//! must not leave them behind. The difference is the DaemonSet: it is deleted (or has a
//! deletion timestamp) on an uninstall and stays on a restart, an upgrade or a pod deleted
//! by hand. The agent watches its own DaemonSet from the start, so it learns of the delete
//! before its pod is stopped, while it can still read (an uninstall also deletes its RBAC).
//! [`Owner::removed`] is then read at shutdown.
//!
//! The same watch tells whether the DaemonSet rolls with `maxSurge` (the chart's userspace
//! dataplane): then a stopping agent's next one starts beside it, and the userspace forwarder
//! waits for it to listen before closing its own sockets ([`Owner::surges`]).
//!
//! On a watch error nothing changes: an agent that cannot tell keeps its programs (the
//! restart behaviour), and says so.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};

/// What the agent knows of its DaemonSet.
#[derive(Debug, Clone)]
pub struct Owner {
    namespace: String,
    name: String,
    removed: Arc<AtomicBool>,
    seen: Arc<AtomicBool>,
    surges: Arc<AtomicBool>,
}

impl Owner {
    /// `namespace/name` of the DaemonSet.
    pub fn describe(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether the DaemonSet is deleted or being deleted (as last seen).
    pub fn removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// Whether the DaemonSet rolls with a `maxSurge` above 0 (as last seen): a pod's
    /// successor on its node starts before it stops.
    pub fn surges(&self) -> bool {
        self.surges.load(Ordering::Acquire)
    }

    /// Whether the watch has listed once (before that, [`Self::removed`] is false).
    pub fn seen(&self) -> bool {
        self.seen.load(Ordering::Acquire)
    }

    fn set(&self, removed: bool) {
        let was = self.removed.swap(removed, Ordering::AcqRel);
        self.seen.store(true, Ordering::Release);
        if was != removed {
            if removed {
                tracing::warn!(daemonset = %self.describe(), "the agent's DaemonSet is deleted: at shutdown this agent removes what it installed on the node (an uninstall, not a restart)");
            } else {
                tracing::info!(daemonset = %self.describe(), "the agent's DaemonSet exists again: at shutdown this agent keeps its programs (a restart)");
            }
        }
    }
}

/// Whether `ds` rolls with a `maxSurge` above 0 (a number, or a percentage: any above 0%
/// surges at least one pod).
fn surges(ds: &DaemonSet) -> bool {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let surge = ds
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .filter(|u| u.type_.as_deref().unwrap_or("RollingUpdate") == "RollingUpdate")
        .and_then(|u| u.rolling_update.as_ref())
        .and_then(|r| r.max_surge.as_ref());
    match surge {
        Some(IntOrString::Int(n)) => *n > 0,
        Some(IntOrString::String(p)) => p.trim_end_matches('%').parse::<u32>().is_ok_and(|n| n > 0),
        None => false,
    }
}

/// Watches DaemonSet `namespace/name` in the background (needs get, list and watch on
/// daemonsets in that namespace).
pub fn watch(client: Client, namespace: &str, name: &str) -> Owner {
    let owner = Owner {
        namespace: namespace.to_string(),
        name: name.to_string(),
        removed: Arc::new(AtomicBool::new(false)),
        seen: Arc::new(AtomicBool::new(false)),
        surges: Arc::new(AtomicBool::new(false)),
    };
    let api: Api<DaemonSet> = Api::namespaced(client, namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let o = owner.clone();
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        // Whether the list in progress has shown the DaemonSet.
        let mut listed = false;
        // Whether it was ever seen: a name that never existed (a wrong name) is not taken
        // for an uninstall, which would remove the programs at every restart.
        let mut existed = false;
        let mut failing = false;
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(ev) => {
                    failing = false;
                    match ev {
                        watcher::Event::Init => listed = false,
                        watcher::Event::InitApply(ds) | watcher::Event::Apply(ds) => {
                            listed = true;
                            existed = true;
                            o.surges.store(surges(&ds), Ordering::Release);
                            o.set(ds.metadata.deletion_timestamp.is_some());
                        }
                        watcher::Event::InitDone if !listed && existed => o.set(true),
                        watcher::Event::InitDone if !listed => {
                            tracing::warn!(daemonset = %o.describe(), "the agent's DaemonSet is not found (MCS_OWNER_DAEMONSET names another?): a stop keeps the programs (restart behaviour); `mcs-agent uninstall` removes them")
                        }
                        watcher::Event::InitDone => {}
                        watcher::Event::Delete(_) => o.set(true),
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(daemonset = %o.describe(), error = %e, "cannot watch the agent's DaemonSet; until it answers, a stop keeps the programs (restart behaviour)");
                    }
                    failing = true;
                }
            }
        }
    });
    owner
}
