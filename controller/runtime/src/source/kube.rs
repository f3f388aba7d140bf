//! The kube source: watchers (list + watch, with kube-rs's backoff) on ServiceImports,
//! EndpointSlices carrying the MCS service-name label, and the cluster-id ClusterProperty.
//!
//! After a re-list (apiserver restart, `410 Gone`), objects that vanished meanwhile are sent
//! as deletions and everything else as upserts; the index ignores upserts that change nothing,
//! so unchanged state is never reprogrammed.

use std::{
    collections::HashSet,
    fmt::Debug,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use futures::StreamExt as _;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api, Client, Resource, ResourceExt as _,
    runtime::{WatchStreamExt as _, watcher},
};
use mcs_api::{ClusterProperty, LABEL_SERVICE_NAME, ServiceImport};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::SourceEvent;
use crate::convert;

/// Runs the watchers until the receiver is dropped. Sends `Synced` once every watcher has
/// listed. With `watch_cluster_id`, the `cluster.clusterset.k8s.io` ClusterProperty is watched
/// too (skip it when `--cluster-id` is given).
pub async fn run(client: Client, tx: mpsc::Sender<SourceEvent>, watch_cluster_id: bool) {
    let remaining = Arc::new(AtomicUsize::new(if watch_cluster_id { 3 } else { 2 }));
    let imports = watch(
        Api::<ServiceImport>::all(client.clone()),
        watcher::Config::default(),
        tx.clone(),
        remaining.clone(),
        |si| Some(SourceEvent::Import(convert::import(si))),
        |ns, name| Some(SourceEvent::DeleteImport(ns, name)),
    );
    let slices = watch(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(LABEL_SERVICE_NAME),
        tx.clone(),
        remaining.clone(),
        |es| Some(SourceEvent::Slice(convert::slice(es))),
        |ns, name| Some(SourceEvent::DeleteSlice(ns, name)),
    );
    if watch_cluster_id {
        let props = watch(
            Api::<ClusterProperty>::all(client),
            watcher::Config::default()
                .fields(&format!("metadata.name={}", mcs_api::CLUSTER_ID_PROPERTY)),
            tx,
            remaining,
            |cp| Some(SourceEvent::ClusterId(cp.spec.value.clone())),
            |_, _| {
                tracing::warn!(
                    "ClusterProperty {} was deleted; keeping the last cluster id",
                    mcs_api::CLUSTER_ID_PROPERTY
                );
                None
            },
        );
        tokio::join!(imports, slices, props);
    } else {
        tokio::join!(imports, slices);
    }
}

async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    tx: mpsc::Sender<SourceEvent>,
    remaining: Arc<AtomicUsize>,
    upsert: impl Fn(&K) -> Option<SourceEvent>,
    delete: impl Fn(String, String) -> Option<SourceEvent>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let key = |o: &K| (o.namespace().unwrap_or_default(), o.name_any());
    let mut known: HashSet<(String, String)> = HashSet::new();
    let mut relist: Option<HashSet<(String, String)>> = None;
    let mut synced = false;
    let mut stream = watcher(api, config).default_backoff().boxed();
    let send = |ev: Option<SourceEvent>| {
        let tx = tx.clone();
        async move {
            match ev {
                Some(ev) => tx.send(ev).await.is_ok(),
                None => true,
            }
        }
    };
    while let Some(item) = tokio::select! {
        item = stream.next() => item,
        () = tx.closed() => None,
    } {
        let ok = match item {
            Ok(watcher::Event::Apply(o)) => {
                known.insert(key(&o));
                send(upsert(&o)).await
            }
            Ok(watcher::Event::Delete(o)) => {
                let (ns, name) = key(&o);
                known.remove(&(ns.clone(), name.clone()));
                send(delete(ns, name)).await
            }
            Ok(watcher::Event::Init) => {
                relist = Some(HashSet::new());
                true
            }
            Ok(watcher::Event::InitApply(o)) => {
                let k = key(&o);
                if let Some(r) = relist.as_mut() {
                    r.insert(k.clone());
                }
                known.insert(k);
                send(upsert(&o)).await
            }
            Ok(watcher::Event::InitDone) => {
                let listed = relist.take().unwrap_or_default();
                let gone: Vec<_> = known.difference(&listed).cloned().collect();
                let mut ok = true;
                for (ns, name) in gone {
                    ok &= send(delete(ns, name)).await;
                }
                known = listed;
                if !synced {
                    synced = true;
                    tracing::info!(kind, objects = known.len(), "listed");
                    if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                        ok &= send(Some(SourceEvent::Synced)).await;
                    }
                } else {
                    tracing::info!(
                        kind,
                        objects = known.len(),
                        "re-listed after a watch restart"
                    );
                }
                ok
            }
            Err(e) => {
                tracing::warn!(kind, error = %e, "watch failed; retrying with backoff");
                true
            }
        };
        if !ok {
            return;
        }
    }
}
