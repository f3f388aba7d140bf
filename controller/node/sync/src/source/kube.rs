//! The kube source: watchers (list + watch) on ServiceImports, EndpointSlices carrying the MCS
//! service-name label, and the cluster-id ClusterProperty.
//!
//! Every watcher runs through [`ListWatch`] (`mcs-runtime`): a failed list or watch is retried
//! after [`WatchRetry`]'s delays, exponential from 100 ms, capped at [`Options::retry_max`]
//! (default 20 s, jittered down to half), and only a completed list or a watch event starts
//! them over, so an API server failing lists is asked at most ~13 times a minute by each
//! watcher of each agent (kube-runtime's `Init` before every list attempt resets nothing). A
//! first `410 Gone` re-lists at once. The dataplane keeps serving its last table all the
//! while; changes made during an outage arrive within `retry_max` of the API server's return.
//!
//! The ServiceImport version is discovered, not assumed: the group's preferred version when
//! the agent reads it, else the other one it reads (`v1beta1`, `v1alpha1`), so a cluster whose
//! MCS controller installed only `v1alpha1` CRDs (Submariner Lighthouse, the AWS Cloud Map
//! controller) is served as well. Until the group is served at all, discovery is retried.
//! When the version watched answers `404` (a CRD upgrade stopped serving it), discovery is
//! asked again and the other version, if served, is watched from then on; its first list
//! counts as a re-list, so the table keeps every import meanwhile and reprograms nothing
//! unchanged.
//!
//! After a re-list (apiserver restart, `410 Gone`), objects that vanished meanwhile are sent
//! as deletions and everything else as upserts; the index ignores upserts that change nothing,
//! so unchanged state is never reprogrammed.
//!
//! EndpointSlices are read in protobuf when the API server serves it (every kube-apiserver
//! does for built-in kinds; [`super::slice_watch`]), else as JSON. ServiceImports are custom
//! resources, which the API server serves as JSON only.

use std::{
    collections::HashMap,
    fmt::Debug,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::{StreamExt as _, stream::BoxStream};
use kube::{
    Api, Client, Resource, ResourceExt as _,
    runtime::{utils::Backoff as _, watcher},
};
use mcs_api::{ClusterProperty, LABEL_SERVICE_NAME, v1alpha1};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::{SourceEvent, slice_watch};
use crate::convert;

pub use mcs_runtime::discovery::MCS_GROUP;

/// Asks the API server which ServiceImport version to watch
/// ([`mcs_runtime::discovery::mcs_version`]).
pub async fn discover_import_version(client: &Client) -> Result<&'static str, String> {
    mcs_runtime::discovery::mcs_version(client, "ServiceImport").await
}

/// How the kube source runs.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Watch the `cluster.clusterset.k8s.io` ClusterProperty too (skip it when `--cluster-id`
    /// is given).
    pub watch_cluster_id: bool,
    /// The longest wait between two attempts of a failed watch.
    pub retry_max: Duration,
    /// How EndpointSlices are read.
    pub slices: SliceEncoding,
    /// Where the protobuf EndpointSlice watch lists from: by default the watch cache in one
    /// response (at 1M endpoints a full sync took 11.5 s so, 19.0 s in consistent pages with
    /// the next page prefetched, 24.7 s as JSON in pages; docs/performance.md). The JSON watch always lists
    /// consistently in pages of [`SLICE_PAGE_SIZE`].
    pub slice_list: slice_watch::ListFrom,
}

/// How the kube source reads EndpointSlices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SliceEncoding {
    /// Protobuf where the API server serves it (asked once at start), else JSON.
    #[default]
    Protobuf,
    /// JSON always.
    Json,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            watch_cluster_id: false,
            retry_max: Duration::from_secs(20),
            slices: SliceEncoding::default(),
            slice_list: slice_watch::ListFrom::Cache,
        }
    }
}

pub use mcs_runtime::retry::WatchRetry;
use mcs_runtime::watch::{ListWatch, Next};

/// Runs the watchers until the receiver is dropped. Sends `Synced` once every watcher has
/// listed.
pub async fn run(client: Client, tx: mpsc::Sender<SourceEvent>, options: Options) {
    let Options {
        watch_cluster_id,
        retry_max,
        slices: encoding,
        slice_list,
    } = options;
    let mut retry = WatchRetry::new(retry_max);
    let Some(version) = until_ok(&mut retry, &tx, "cannot watch ServiceImports yet", || {
        discover_import_version(&client)
    })
    .await
    else {
        return;
    };
    tracing::info!(version, "watching ServiceImports in {MCS_GROUP}/{version}");
    let remaining = Arc::new(AtomicUsize::new(if watch_cluster_id { 3 } else { 2 }));
    let delete_import = |ns, name| Some(SourceEvent::DeleteImport(ns, name));
    let (import_client, import_tx, import_remaining) =
        (client.clone(), tx.clone(), remaining.clone());
    // One bookkeeping across versions: the new version's first list is a re-list (what it
    // lacks is deleted, the rest upserted; unchanged imports reprogram nothing).
    let imports = async move {
        let mut state = Relister::default();
        let mut version = version;
        let mut switches = WatchRetry::new(retry_max);
        loop {
            let started = tokio::time::Instant::now();
            let switch = Some((&import_client, version));
            let (kept, end) = if version == "v1alpha1" {
                watch(
                    state,
                    watcher(
                        Api::<v1alpha1::ServiceImport>::all(import_client.clone()),
                        import_list_config(),
                    )
                    .boxed(),
                    retry_max,
                    import_tx.clone(),
                    import_remaining.clone(),
                    |si| Some(SourceEvent::Import(convert::import(&si.to_v1beta1()))),
                    delete_import,
                    switch,
                )
                .await
            } else {
                watch(
                    state,
                    watcher(
                        Api::<convert::LeanImport>::all(import_client.clone()),
                        import_list_config(),
                    )
                    .boxed(),
                    retry_max,
                    import_tx.clone(),
                    import_remaining.clone(),
                    |si| Some(SourceEvent::Import(convert::lean_import(&si))),
                    delete_import,
                    switch,
                )
                .await
            };
            state = kept;
            let Ended::OtherVersion(next) = end else {
                return;
            };
            tracing::warn!(
                from = version,
                to = next,
                "ServiceImports are no longer served in {MCS_GROUP}/{version}; watching {next} (the table stays meanwhile)"
            );
            // A version watched for a while switches at once; quicker ends (discovery that
            // flips between versions that each list and then answer 404) wait a backoff
            // step each.
            if started.elapsed() < SWITCH_AT_ONCE_AFTER {
                let delay = switches.next().unwrap_or(retry_max);
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = import_tx.closed() => return,
                }
            } else {
                switches.reset();
            }
            version = next;
        }
    };
    // The ServiceImports' list (the longer one at scale) starts now; the EndpointSlices' first
    // asks whether they come in protobuf.
    let (slice_client, slice_tx, slice_remaining) = (client.clone(), tx.clone(), remaining.clone());
    let slices = async move {
        let protobuf = match encoding {
            SliceEncoding::Json => false,
            SliceEncoding::Protobuf => {
                let mut retry = WatchRetry::new(retry_max);
                let probe = until_ok(
                    &mut retry,
                    &slice_tx,
                    "cannot list EndpointSlices yet",
                    || slice_watch::serves_protobuf(&slice_client, LABEL_SERVICE_NAME),
                );
                let Some(p) = probe.await else { return };
                p
            }
        };
        if encoding == SliceEncoding::Protobuf && !protobuf {
            tracing::warn!(
                "the API server does not answer EndpointSlices in protobuf; reading them as JSON"
            );
        }
        tracing::info!(
            encoding = if protobuf { "protobuf" } else { "json" },
            "watching EndpointSlices"
        );
        let stream = if protobuf {
            slice_watch::slices(slice_client, LABEL_SERVICE_NAME.to_string(), slice_list).boxed()
        } else {
            watcher(
                Api::<convert::LeanSlice>::all(slice_client),
                slice_list_config().labels(LABEL_SERVICE_NAME),
            )
            .boxed()
        };
        watch(
            Relister::default(),
            stream,
            retry_max,
            slice_tx,
            slice_remaining,
            |es| Some(SourceEvent::Slice(convert::slice(es))),
            |ns, name| Some(SourceEvent::DeleteSlice(ns, name)),
            None,
        )
        .await;
    };
    if watch_cluster_id {
        let props = watch(
            Relister::default(),
            watcher(
                Api::<ClusterProperty>::all(client),
                import_list_config()
                    .fields(&format!("metadata.name={}", mcs_api::CLUSTER_ID_PROPERTY)),
            )
            .boxed(),
            retry_max,
            tx,
            remaining,
            |cp| Some(SourceEvent::ClusterId(cp.spec.value)),
            |_, _| {
                tracing::warn!(
                    "ClusterProperty {} was deleted; keeping the last cluster id",
                    mcs_api::CLUSTER_ID_PROPERTY
                );
                None
            },
            None,
        );
        tokio::join!(imports, slices, props);
    } else {
        tokio::join!(imports, slices);
    }
}

/// Objects per page of the EndpointSlice list (kube-rs's default is 500).
///
/// Measured on this machine kind with 100k ServiceImports and 200k EndpointSlices (1M
/// endpoints): each page costs the API server ~0.1 s on top of its objects, so 400 pages of
/// 500 slices took it 45 s and 40 pages of 5,000 10 s. A page of 5,000 slices is ~6 MB of JSON
/// to hold at a time; the list stays a consistent read.
pub const SLICE_PAGE_SIZE: u32 = 5_000;

/// The EndpointSlice watch's list: consistent, in pages of [`SLICE_PAGE_SIZE`].
fn slice_list_config() -> watcher::Config {
    watcher::Config::default().page_size(SLICE_PAGE_SIZE)
}

/// The ServiceImport (and ClusterProperty) watches' list: from the API server's watch cache
/// (`resourceVersion=0`, as client-go's informers list), in one response. Custom resources
/// are slow to serve page by page (100k imports in pages of 5,000: ~35 s; cached, whole: ~6 s)
/// and an import is small (100k are ~60 MB of JSON). The cache may lag etcd a little; the
/// watch that follows brings it up to date.
fn import_list_config() -> watcher::Config {
    let mut config = watcher::Config::default().any_semantic();
    // kube-rs drops `resourceVersion=0` from a list with a page size (the quorum read again).
    config.page_size = None;
    config
}

/// Runs `attempt` until it succeeds, waiting `retry`'s delays between failures and logging each
/// with `what`; `None` when the source's receiver went away meanwhile.
async fn until_ok<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    retry: &mut WatchRetry,
    tx: &mpsc::Sender<SourceEvent>,
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> Option<T> {
    loop {
        match attempt().await {
            Ok(v) => return Some(v),
            Err(e) => {
                let delay = retry.next().unwrap_or(retry.cap());
                tracing::warn!(error = %e, retry_ms = delay.as_millis() as u64, "{what}");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = tx.closed() => return None,
                }
            }
        }
    }
}

/// The bookkeeping of one watcher: which objects exist, and what a (re-)list changes.
/// Pure: fed `watcher::Event`s, it says which upserts and deletions to send.
///
/// Each key is held once, with the number of the list that last saw it (a watch event
/// counts as the list before): a list's end deletes every key the list did not see. (A
/// second set of the keys seen by the list under way would double them at 200k slices.)
#[derive(Debug, Default)]
struct Relister {
    known: HashMap<(String, String), u32>,
    /// Lists ended.
    lists: u32,
}

/// What one watcher event means for the sync loop.
#[derive(Debug, PartialEq)]
enum Step<K> {
    /// Send an upsert of this object.
    Upsert(K),
    /// Send deletions of these (namespace, name).
    Delete(Vec<(String, String)>),
    /// A list finished (the first one: `first`), after these deletions.
    Listed {
        gone: Vec<(String, String)>,
        first: bool,
    },
    /// Nothing to send.
    Nothing,
}

impl Relister {
    fn on<K: Resource>(&mut self, ev: watcher::Event<K>) -> Step<K> {
        let key = |o: &K| (o.namespace().unwrap_or_default(), o.name_any());
        match ev {
            watcher::Event::Apply(o) => {
                self.known.insert(key(&o), self.lists);
                Step::Upsert(o)
            }
            watcher::Event::Delete(o) => {
                let k = key(&o);
                self.known.remove(&k);
                Step::Delete(vec![k])
            }
            watcher::Event::Init => Step::Nothing,
            watcher::Event::InitApply(o) => {
                self.known.insert(key(&o), self.lists + 1);
                Step::Upsert(o)
            }
            watcher::Event::InitDone => {
                self.lists += 1;
                let listed = self.lists;
                let mut gone: Vec<_> = self
                    .known
                    .extract_if(|_, seen| *seen != listed)
                    .map(|(k, _)| k)
                    .collect();
                gone.sort();
                Step::Listed {
                    gone,
                    first: listed == 1,
                }
            }
        }
    }
}

/// How long a ServiceImport version must have been watched for its end (404, another version
/// served) to switch at once.
const SWITCH_AT_ONCE_AFTER: Duration = Duration::from_secs(5);

/// Why [`watch`] returned.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The receiver went away.
    Closed,
    /// The version watched answers `404 Not Found` and discovery names this one.
    OtherVersion(&'static str),
}

/// Sends what `stream`'s events change (upserts, deletions, `Synced` once every watcher
/// listed) until the receiver goes away, keeping its bookkeeping in `state`, which it gives
/// back. With `switch` (the client and the MCS version watched), a `404` makes it ask
/// discovery, and it returns when another version is served.
#[allow(clippy::too_many_arguments)]
async fn watch<K>(
    mut state: Relister,
    stream: BoxStream<'static, watcher::Result<watcher::Event<K>>>,
    retry_max: Duration,
    tx: mpsc::Sender<SourceEvent>,
    remaining: Arc<AtomicUsize>,
    upsert: impl Fn(K) -> Option<SourceEvent>,
    delete: impl Fn(String, String) -> Option<SourceEvent>,
    switch: Option<(&Client, &'static str)>,
) -> (Relister, Ended)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let mut stream = ListWatch::new(stream, retry_max);
    let send = |ev: Option<SourceEvent>| {
        let tx = tx.clone();
        async move {
            match ev {
                Some(ev) => tx.send(ev).await.is_ok(),
                None => true,
            }
        }
    };
    while let Some(next) = tokio::select! {
        next = stream.next() => next,
        () = tx.closed() => None,
    } {
        let step = match next {
            Next::Event { event, .. } => state.on(event),
            Next::Failed(f) => {
                tracing::warn!(
                    kind,
                    error = %f.error,
                    failures = f.streak,
                    retry_ms = f.delay.as_millis() as u64,
                    "watch failed; retrying"
                );
                if let Some((client, watched)) = switch
                    && f.code() == Some(404)
                    && let Ok(served) = mcs_runtime::discovery::mcs_version(client, &kind).await
                    && served != watched
                {
                    return (state, Ended::OtherVersion(served));
                }
                continue;
            }
        };
        let ok = match step {
            Step::Upsert(o) => send(upsert(o)).await,
            Step::Delete(keys) => {
                let mut ok = true;
                for (ns, name) in keys {
                    ok &= send(delete(ns, name)).await;
                }
                ok
            }
            Step::Listed { gone, first } => {
                let mut ok = true;
                for (ns, name) in gone {
                    ok &= send(delete(ns, name)).await;
                }
                let objects = state.known.len();
                if first {
                    tracing::info!(kind, objects, "listed");
                    if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                        ok &= send(Some(SourceEvent::Synced)).await;
                    }
                } else {
                    tracing::info!(kind, objects, "re-listed after a watch restart");
                }
                ok
            }
            Step::Nothing => true,
        };
        if !ok {
            return (state, Ended::Closed);
        }
    }
    (state, Ended::Closed)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::runtime::watcher::Event;

    use super::*;

    fn es(name: &str) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "namespace": "ns" }, "addressType": "IPv4", "endpoints": []
        }))
        .unwrap()
    }

    fn k(name: &str) -> (String, String) {
        ("ns".into(), name.into())
    }

    /// A re-list (after `410 Gone` or a restart) deletes exactly what vanished meanwhile and
    /// re-sends the rest as upserts (which the index ignores when unchanged).
    #[test]
    fn relist_deletes_what_vanished_and_keeps_the_rest() {
        let mut r = Relister::default();
        assert_eq!(r.on(Event::<EndpointSlice>::Init), Step::Nothing);
        assert!(matches!(r.on(Event::InitApply(es("a"))), Step::Upsert(_)));
        assert!(matches!(r.on(Event::InitApply(es("b"))), Step::Upsert(_)));
        assert_eq!(
            r.on(Event::<EndpointSlice>::InitDone),
            Step::Listed {
                gone: vec![],
                first: true
            }
        );
        assert!(matches!(r.on(Event::Apply(es("c"))), Step::Upsert(_)));
        assert_eq!(r.on(Event::Delete(es("a"))), Step::Delete(vec![k("a")]));
        // The watch breaks; "b" and "c" are deleted and "d" created while it was down.
        r.on(Event::<EndpointSlice>::Init);
        r.on(Event::InitApply(es("d")));
        assert_eq!(
            r.on(Event::<EndpointSlice>::InitDone),
            Step::Listed {
                gone: vec![k("b"), k("c")],
                first: false
            }
        );
        assert_eq!(r.known.keys().collect::<Vec<_>>(), [&k("d")]);
    }
}
