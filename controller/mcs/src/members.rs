//! What the controller knows of each member cluster: in-memory copies of its ServiceExports,
//! Services and Service EndpointSlices (and, in its own cluster, of namespaces, ServiceImports
//! and the MCS EndpointSlices it wrote), kept by watchers, and whether the cluster answers.
//!
//! Each watcher re-lists into a fresh map and swaps it in when the list is complete, so a
//! re-list never shows a half-filled store; every change wakes the reconciler.

use std::{
    collections::HashMap,
    fmt::Debug,
    sync::{Arc, Mutex, RwLock},
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
}

impl<K> Default for Store<K> {
    fn default() -> Self {
        Self {
            map: RwLock::new(HashMap::new()),
        }
    }
}

impl<K> Store<K> {
    /// Every object now.
    pub fn snapshot(&self) -> HashMap<ObjKey, Arc<K>> {
        self.map.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One object.
    pub fn get(&self, ns: &str, name: &str) -> Option<Arc<K>> {
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<ObjKey, Arc<K>>> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a member answers.
#[derive(Debug, Default)]
struct Health {
    /// Watchers that have completed their first list.
    listed: usize,
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
    pub exports: Store<ServiceExport>,
    /// Services.
    pub services: Store<Service>,
    /// EndpointSlices of Services (label `kubernetes.io/service-name`).
    pub slices: Store<EndpointSlice>,
    health: Mutex<Health>,
    watchers: usize,
    started: Instant,
}

/// The local cluster's extra stores.
#[derive(Debug, Default)]
pub struct Local {
    /// Namespaces.
    pub namespaces: Store<Namespace>,
    /// ServiceImports (all; ours carry [`crate::MANAGED_LABEL`]).
    pub imports: Store<ServiceImport>,
    /// MCS EndpointSlices this controller wrote (`managed-by` = ours).
    pub slices: Store<EndpointSlice>,
    listed: Mutex<usize>,
}

impl Local {
    /// Whether every local watcher has listed.
    pub fn listed(&self) -> bool {
        *self.listed.lock().unwrap_or_else(|p| p.into_inner()) >= 3
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
            exports: Store::default(),
            services: Store::default(),
            slices: Store::default(),
            health: Mutex::new(Health::default()),
            watchers: 3,
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
            None if h.listed < self.watchers => {
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
        self.health.lock().unwrap_or_else(|p| p.into_inner()).listed >= self.watchers
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

    fn first_list(&self) {
        self.health.lock().unwrap_or_else(|p| p.into_inner()).listed += 1;
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
    let listed = {
        let m = m.clone();
        move || m.first_list()
    };
    let ctx = |m: &Arc<Member>| Ctx {
        member: m.clone(),
        wake: wake.clone(),
        retry_max,
    };
    {
        let (c, m2) = (ctx(&m), m.clone());
        let l = listed.clone();
        tokio::spawn(watch(
            Api::<ServiceExport>::all(client.clone()),
            watcher::Config::default(),
            c,
            move |f| f(&m2.exports),
            l,
        ));
    }
    {
        let (c, m2) = (ctx(&m), m.clone());
        let l = listed.clone();
        tokio::spawn(watch(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
            c,
            move |f| f(&m2.services),
            l,
        ));
    }
    {
        let (c, m2) = (ctx(&m), m.clone());
        tokio::spawn(watch(
            Api::<EndpointSlice>::all(client.clone()),
            watcher::Config::default().labels("kubernetes.io/service-name"),
            c,
            move |f| f(&m2.slices),
            listed,
        ));
    }
    if let Some(local) = local {
        let count = |l: &Arc<Local>| {
            let l = l.clone();
            move || *l.listed.lock().unwrap_or_else(|p| p.into_inner()) += 1
        };
        let l2 = local.clone();
        tokio::spawn(watch(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
            ctx(&m),
            move |f| f(&l2.namespaces),
            count(&local),
        ));
        let l2 = local.clone();
        tokio::spawn(watch(
            Api::<ServiceImport>::all(client.clone()),
            watcher::Config::default(),
            ctx(&m),
            move |f| f(&l2.imports),
            count(&local),
        ));
        let l2 = local.clone();
        tokio::spawn(watch(
            Api::<EndpointSlice>::all(client),
            watcher::Config::default().labels(&format!(
                "{}={}",
                mcs_api::LABEL_MANAGED_BY,
                crate::MANAGER
            )),
            ctx(&m),
            move |f| f(&l2.slices),
            count(&local),
        ));
    }
    m
}

struct Ctx {
    member: Arc<Member>,
    wake: Arc<Notify>,
    retry_max: Duration,
}

/// Keeps `store` (reached through `with`) equal to the cluster's objects.
async fn watch<K, W>(
    api: Api<K>,
    config: watcher::Config,
    ctx: Ctx,
    with: W,
    first_list: impl Fn() + Send + 'static,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default,
    W: Fn(&dyn Fn(&Store<K>)) + Send + 'static,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let mut retry = WatchRetry::new(ctx.retry_max);
    let mut stream = watcher(api, config).boxed();
    let mut pending: Option<HashMap<ObjKey, Arc<K>>> = None;
    let mut listed = false;
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
                with(&|s: &Store<K>| *s.write() = fresh.clone());
                if !listed {
                    listed = true;
                    first_list();
                    tracing::info!(cluster = %ctx.member.id, kind, objects = fresh.len(), "listed");
                }
                ctx.wake.notify_one();
            }
            watcher::Event::Apply(o) => {
                let k = key(&o);
                let o = Arc::new(o);
                with(&|s: &Store<K>| {
                    s.write().insert(k.clone(), o.clone());
                });
                ctx.wake.notify_one();
            }
            watcher::Event::Delete(o) => {
                let k = key(&o);
                with(&|s: &Store<K>| {
                    s.write().remove(&k);
                });
                ctx.wake.notify_one();
            }
        }
    }
}
