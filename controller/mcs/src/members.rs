//! What the controller knows of each member cluster: in-memory copies of its ServiceExports,
//! Services and Service EndpointSlices (and, in its own cluster, of namespaces, ServiceImports
//! and the MCS EndpointSlices it wrote), kept by watchers, and whether the cluster answers.
//!
//! Each watcher re-lists into a fresh map and swaps it in when the list is complete, so a
//! re-list never shows a half-filled store; every change wakes the reconciler.

use std::{
    collections::HashMap,
    fmt::Debug,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use k8s_openapi::api::{
    core::v1::{Namespace, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Resource, ResourceExt as _,
    runtime::{utils::Backoff as _, watcher},
};
use mcs_api::{ServiceExport, ServiceImport};
use mcs_sync::source::kube::WatchRetry;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;

/// (namespace, name).
pub type ObjKey = (String, String);

/// A watched copy of one kind.
#[derive(Debug)]
pub struct Store<K> {
    map: RwLock<HashMap<ObjKey, Arc<K>>>,
    /// Set once its watcher has completed a first list.
    listed: AtomicBool,
}

impl<K> Default for Store<K> {
    fn default() -> Self {
        Self {
            map: RwLock::new(HashMap::new()),
            listed: AtomicBool::new(false),
        }
    }
}

impl<K> Store<K> {
    /// Whether its watcher has listed once.
    pub fn listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
    }

    /// Every object now.
    pub fn snapshot(&self) -> HashMap<ObjKey, Arc<K>> {
        self.map.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<ObjKey, Arc<K>>> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a member answers.
#[derive(Debug, Default)]
struct Health {
    /// When the first of the current run of failures happened (none: healthy).
    failing_since: Option<Instant>,
    /// The last error, for logs and status.
    last_error: Option<String>,
}

/// One member cluster.
#[derive(Debug)]
pub struct Member {
    /// Its cluster id (the kubeconfig context's name).
    pub id: String,
    /// ServiceExports.
    pub exports: Arc<Store<ServiceExport>>,
    /// Services.
    pub services: Arc<Store<Service>>,
    /// EndpointSlices of Services (label `kubernetes.io/service-name`).
    pub slices: Arc<Store<EndpointSlice>>,
    health: Mutex<Health>,
    started: Instant,
}

/// The local cluster's extra stores.
#[derive(Debug, Default)]
pub struct Local {
    /// Namespaces.
    pub namespaces: Arc<Store<Namespace>>,
    /// ServiceImports (all; ours carry [`crate::MANAGED_LABEL`]).
    pub imports: Arc<Store<ServiceImport>>,
    /// MCS EndpointSlices this controller wrote (`managed-by` = ours).
    pub slices: Arc<Store<EndpointSlice>>,
}

impl Local {
    /// Whether every local watcher has listed.
    pub fn listed(&self) -> bool {
        self.namespaces.listed() && self.imports.listed() && self.slices.listed()
    }
}

/// How a member is doing, for the reconciler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberState {
    /// Every watcher listed and none is failing.
    Up,
    /// Not listed yet or failing, for less than the member timeout: its last known objects
    /// count.
    Unsure(String),
    /// Failing (or never listed) for longer than the member timeout: its endpoints are
    /// withdrawn.
    Gone(String),
}

impl Member {
    fn new(id: String) -> Self {
        Self {
            id,
            exports: Arc::default(),
            services: Arc::default(),
            slices: Arc::default(),
            health: Mutex::new(Health::default()),
            started: Instant::now(),
        }
    }

    /// Its state given the member timeout.
    pub fn state(&self, timeout: Duration) -> MemberState {
        let h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let error = h
            .last_error
            .clone()
            .unwrap_or_else(|| "not listed yet".into());
        match h.failing_since {
            Some(t) if t.elapsed() > timeout => MemberState::Gone(error),
            Some(_) => MemberState::Unsure(error),
            None if !self.listed() => {
                if self.started.elapsed() > timeout {
                    MemberState::Gone(error)
                } else {
                    MemberState::Unsure(error)
                }
            }
            None => MemberState::Up,
        }
    }

    /// Whether every watcher has listed once.
    pub fn listed(&self) -> bool {
        self.exports.listed() && self.services.listed() && self.slices.listed()
    }

    fn ok(&self) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        if h.failing_since.take().is_some() {
            tracing::info!(cluster = %self.id, "member cluster answers again");
        }
    }

    fn failed(&self, e: &str) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        if h.failing_since.is_none() {
            tracing::warn!(cluster = %self.id, error = e, "member cluster does not answer");
            h.failing_since = Some(Instant::now());
        }
        h.last_error = Some(e.to_string());
    }
}

/// Starts the watchers of member `id` (and, with `local`, the local cluster's extra ones);
/// every change notifies `wake`.
pub fn start(
    id: String,
    client: Client,
    local: Option<Arc<Local>>,
    wake: Arc<Notify>,
    retry_max: Duration,
) -> Arc<Member> {
    let m = Arc::new(Member::new(id));
    let ctx = || Ctx {
        member: m.clone(),
        wake: wake.clone(),
        retry_max,
    };
    let all = watcher::Config::default;
    tokio::spawn(watch(
        Api::<ServiceExport>::all(client.clone()),
        all(),
        ctx(),
        m.exports.clone(),
    ));
    tokio::spawn(watch(
        Api::<Service>::all(client.clone()),
        all(),
        ctx(),
        m.services.clone(),
    ));
    tokio::spawn(watch(
        Api::<EndpointSlice>::all(client.clone()),
        all().labels(crate::desired::LABEL_K8S_SERVICE_NAME),
        ctx(),
        m.slices.clone(),
    ));
    if let Some(local) = local {
        tokio::spawn(watch(
            Api::<Namespace>::all(client.clone()),
            all(),
            ctx(),
            local.namespaces.clone(),
        ));
        tokio::spawn(watch(
            Api::<ServiceImport>::all(client.clone()),
            all(),
            ctx(),
            local.imports.clone(),
        ));
        let ours = format!("{}={}", mcs_api::LABEL_MANAGED_BY, crate::MANAGER);
        tokio::spawn(watch(
            Api::<EndpointSlice>::all(client),
            all().labels(&ours),
            ctx(),
            local.slices.clone(),
        ));
    }
    m
}

struct Ctx {
    member: Arc<Member>,
    wake: Arc<Notify>,
    retry_max: Duration,
}

/// Keeps `store` equal to the cluster's objects of kind `K`.
async fn watch<K>(api: Api<K>, config: watcher::Config, ctx: Ctx, store: Arc<Store<K>>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let mut retry = WatchRetry::new(ctx.retry_max);
    let mut stream = watcher(api, config).boxed();
    let mut pending: Option<HashMap<ObjKey, Arc<K>>> = None;
    while let Some(item) = stream.next().await {
        let ev = match item {
            Ok(ev) => {
                retry.reset();
                ctx.member.ok();
                ev
            }
            Err(watcher::Error::WatchError(s)) if s.code == 410 => continue,
            Err(e) => {
                let msg = format!("{kind}: {e}");
                ctx.member.failed(&msg);
                // The reconciler keeps time while a member fails (its timeout may pass
                // without any event).
                ctx.wake.notify_one();
                let delay = retry.next().unwrap_or(ctx.retry_max);
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        let key = |o: &K| (o.namespace().unwrap_or_default(), o.name_any());
        match ev {
            watcher::Event::Init => pending = Some(HashMap::new()),
            watcher::Event::InitApply(o) => {
                if let Some(p) = pending.as_mut() {
                    p.insert(key(&o), Arc::new(o));
                }
            }
            watcher::Event::InitDone => {
                let fresh = pending.take().unwrap_or_default();
                let objects = fresh.len();
                *store.write() = fresh;
                if !store.listed.swap(true, Ordering::AcqRel) {
                    tracing::info!(cluster = %ctx.member.id, kind, objects, "listed");
                }
                ctx.wake.notify_one();
            }
            watcher::Event::Apply(o) => {
                store.write().insert(key(&o), Arc::new(o));
                ctx.wake.notify_one();
            }
            watcher::Event::Delete(o) => {
                store.write().remove(&key(&o));
                ctx.wake.notify_one();
            }
        }
    }
}
