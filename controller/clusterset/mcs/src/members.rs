//! What the controller knows of each member cluster: in-memory copies of its ServiceExports,
//! Services and Service EndpointSlices (and, in its own cluster, of namespaces, ServiceImports
//! and the MCS EndpointSlices it wrote), kept by watchers, and whether the cluster answers.
//!
//! Each watcher re-lists into a fresh map and swaps it in when the list is complete, so a
//! re-list never shows a half-filled store; every change wakes the reconciler. Which
//! Services and slices are read at all is the [`crate::selection`]'s: only the exported.
//!
//! Only what the controller reads is kept (a tenant decides how large its objects are): of a
//! ServiceExport its [`LeanExport`] (labels and annotations only when they can be carried,
//! else just the refusal), of a Service its [`ServiceShape`], of an EndpointSlice its
//! endpoints, ports and the labels read; no `managedFields`, annotations or owner references.

use std::{
    collections::{BTreeSet, HashMap},
    fmt::Debug,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    core::v1::{Namespace, Service},
    discovery::v1::EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{
    Api, Client, Resource, ResourceExt as _,
    runtime::{utils::Backoff as _, watcher},
};
use mcs_merge::ServiceShape;
use prometheus_client::metrics::counter::Counter;

use crate::budget::{MetaBudget, MetaLimits};
use crate::held::{HeldImport, HeldSlice};
use crate::objects::{ExportVersion, LeanExport, ObjKey, WireExport, shape};
use crate::selection::{MemberReads, Selection, lean_member_slice, member_slice_service};
use crate::store::{Changes, Sink, Store};
use mcs_runtime::{
    retry::WatchRetry,
    watch::{ListWatch, Next},
};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;

/// Whether a member answers.
#[derive(Debug, Default)]
struct Health {
    /// The member's watchers failing now, by kind: a member is failing while any of them
    /// is (one that fails every list is not made healthy by another's events).
    failing: std::collections::BTreeMap<String, Failing>,
    /// The last error, for logs and status.
    last_error: Option<String>,
}

/// One watcher's run of failures.
#[derive(Debug)]
struct Failing {
    /// When the first of them happened.
    since: Instant,
    /// Whether the member refused our credentials (HTTP 401 or 403) in any of them: it
    /// sticks until that watcher succeeds, so a member answering 401 and 5xx by turns does
    /// not flip between "unauthorized" and "unreachable" on every error.
    refused: bool,
}

impl Health {
    fn failing_since(&self) -> Option<Instant> {
        self.failing.values().map(|f| f.since).min()
    }
}

/// One member cluster.
#[derive(Debug)]
pub struct Member {
    /// Its cluster id (the kubeconfig context's name).
    pub id: String,
    /// ServiceExports, as much as is read of them.
    pub exports: Arc<Store<LeanExport>>,
    /// Services: the parts the merge reads.
    pub services: Arc<Store<ServiceShape>>,
    /// EndpointSlices of Services (label `kubernetes.io/service-name`), lean
    /// ([`lean_member_slice`]).
    pub slices: Arc<Store<EndpointSlice>>,
    /// What its exports' labels and annotations may take.
    pub budget: Arc<MetaBudget>,
    /// Which of its Services and slices are read (those its exports name), and its exports
    /// until they are.
    pub selection: Arc<Selection>,
    /// Objects its watchers received (listed or changed), by watcher: what reading it
    /// costs, and that a Service nobody exports costs nothing.
    pub events: WatchEvents,
    /// The ServiceExport version it is read in (asked of it; `v1beta1` until it answers).
    export_version: Mutex<ExportVersion>,
    health: Mutex<Health>,
    started: Instant,
}

/// Objects a member's watchers received, by watcher (shared with the metrics).
#[derive(Debug, Default, Clone)]
pub struct WatchEvents {
    /// ServiceExports.
    pub exports: Counter,
    /// Services.
    pub services: Counter,
    /// EndpointSlices (every bucket).
    pub slices: Counter,
}

impl WatchEvents {
    fn of(&self, watcher_name: &str) -> Option<&Counter> {
        match watcher_name {
            "ServiceExport" => Some(&self.exports),
            "Service" => Some(&self.services),
            "EndpointSlice" => Some(&self.slices),
            _ => None,
        }
    }
}

/// The local cluster's extra stores.
#[derive(Debug)]
pub struct Local {
    /// Namespaces: name and deletion timestamp.
    pub namespaces: Arc<Store<Namespace>>,
    /// ServiceImports (all; ours carry [`crate::MANAGED_LABEL`]), as [`HeldImport`]s.
    pub imports: Arc<Store<HeldImport>>,
    /// MCS EndpointSlices this controller wrote (`managed-by` = ours), as [`HeldSlice`]s.
    pub slices: Arc<Store<HeldSlice>>,
}

impl Local {
    /// Empty stores recording their changes in `changes`.
    pub fn new(changes: &Arc<Changes>) -> Self {
        Self {
            namespaces: Arc::new(Store::new(changes.clone(), None)),
            imports: Arc::new(Store::new(changes.clone(), None)),
            slices: Arc::new(Store::new(changes.clone(), Some(mcs_slice_service))),
        }
    }

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
    /// A member not listed yet whose stores record their changes in `changes`.
    fn new(
        id: String,
        changes: &Arc<Changes>,
        limits: MetaLimits,
        wake: Arc<Notify>,
        events: WatchEvents,
    ) -> Self {
        let budget = Arc::new(MetaBudget::new(limits));
        let exports = Arc::new(Store::new(changes.clone(), None).with_admission(budget.clone()));
        let services = Arc::new(Store::new(changes.clone(), None));
        let slices = Arc::new(Store::new(changes.clone(), Some(member_slice_service)));
        Self {
            id,
            selection: Arc::new(Selection::new(
                exports.clone(),
                services.clone(),
                slices.clone(),
                wake,
            )),
            exports,
            budget,
            events,
            export_version: Mutex::new(ExportVersion::default()),
            services,
            slices,
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
        match h.failing_since() {
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

    /// Whether its exports have listed once, each with its Service and slices read.
    pub fn listed(&self) -> bool {
        self.selection.settled()
    }

    /// For how long it has failed without a success since (none: it answers): the oldest
    /// run of failures of any of its watchers.
    pub fn failing_for(&self) -> Option<Duration> {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failing_since()
            .map(|t| t.elapsed())
    }

    /// Whether the member refused our credentials (401/403) since one of its failing
    /// watchers last succeeded.
    pub fn unauthorized(&self) -> bool {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failing
            .values()
            .any(|f| f.refused)
    }

    /// The ServiceExport version it is read in.
    pub fn export_version(&self) -> ExportVersion {
        *self
            .export_version
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Watcher `kind` completed a list or saw a watch event.
    pub(crate) fn ok(&self, kind: &str) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        if h.failing.remove(kind).is_some() && h.failing.is_empty() {
            tracing::info!(cluster = %self.id, "member cluster answers again");
        }
    }

    /// The watchers for which `stopped` holds are stopped (nothing left for them to read):
    /// their failures no longer count.
    pub(crate) fn forget(&self, stopped: &dyn Fn(&str) -> bool) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let before = h.failing.len();
        h.failing.retain(|k, _| !stopped(k));
        if before > 0 && h.failing.is_empty() {
            tracing::info!(cluster = %self.id, "member cluster answers again (its failing watcher was stopped)");
        }
    }

    /// Watcher `kind`'s list or watch failed (`streak`: failures in a row, `retry`: its wait
    /// before the next attempt); `refused`: the member answered 401 or 403.
    pub(crate) fn failed(
        &self,
        kind: &str,
        e: &str,
        refused: Option<u16>,
        streak: u32,
        retry: Duration,
    ) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let was_refused = h.failing.values().any(|f| f.refused);
        if let Some(code) = refused
            && !was_refused
        {
            tracing::warn!(
                cluster = %self.id,
                code,
                error = e,
                "member cluster refuses our credentials: its user in --clusterset-kubeconfig has a wrong, expired or revoked token, or lacks read access (docs/install.md); its imports stay until the member timeout. A token file (tokenFile) is read again within a minute"
            );
        }
        if h.failing.is_empty() {
            tracing::warn!(cluster = %self.id, error = e, "member cluster does not answer");
        } else {
            tracing::debug!(cluster = %self.id, error = e, failures = streak, retry_ms = retry.as_millis() as u64, "member cluster still fails");
        }
        let f = h
            .failing
            .entry(kind.to_string())
            .or_insert_with(|| Failing {
                since: Instant::now(),
                refused: false,
            });
        f.refused |= refused.is_some();
        h.last_error = Some(e.to_string());
    }
}

/// How a member is read: its watches' longest retry, its exports' metadata budget, and the
/// counters of what its watches receive.
#[derive(Debug, Clone)]
pub struct Reading {
    /// The longest wait between two attempts of a watch.
    pub retry_max: Duration,
    /// What its exports' labels and annotations may take.
    pub limits: MetaLimits,
    /// Objects its watches receive.
    pub events: WatchEvents,
}

/// Starts the watchers of member `id` (and, with `local`, the local cluster's extra ones),
/// and the task that reads again exports refused for want of budget when room frees; every
/// change notifies `wake`.
pub fn start(
    id: String,
    client: Client,
    local: Option<Arc<Local>>,
    changes: &Arc<Changes>,
    wake: Arc<Notify>,
    reading: Reading,
) -> Arc<Member> {
    let Reading {
        retry_max,
        limits,
        events,
    } = reading;
    let m = Arc::new(Member::new(id, changes, limits, wake.clone(), events));
    tokio::spawn(readmit(client.clone(), m.clone(), wake.clone(), retry_max));
    let ctx = || Ctx {
        member: m.clone(),
        wake: wake.clone(),
        retry_max,
        health_key: None,
    };
    let all = watcher::Config::default;
    tokio::spawn(watch_exports(client.clone(), ctx()));
    tokio::spawn(crate::selection::keep_in_step(
        client.clone(),
        m.selection.clone(),
        Reads {
            client: client.clone(),
            ctx: ctx(),
        },
        retry_max,
    ));
    if let Some(local) = local {
        tokio::spawn(watch(
            "Namespace",
            Api::<Namespace>::all(client.clone()),
            all(),
            ctx(),
            local.namespaces.clone(),
            |ns| Namespace {
                metadata: ObjectMeta {
                    name: ns.metadata.name,
                    deletion_timestamp: ns.metadata.deletion_timestamp,
                    ..Default::default()
                },
                ..Default::default()
            },
            false,
        ));
        tokio::spawn(watch(
            "ServiceImport",
            Api::<mcs_api::ServiceImport>::all(client.clone()),
            all(),
            ctx(),
            local.imports.clone(),
            |si| HeldImport::new(&si),
            false,
        ));
        let ours = format!("{}={}", mcs_api::LABEL_MANAGED_BY, crate::MANAGER);
        tokio::spawn(watch(
            "our EndpointSlice",
            Api::<EndpointSlice>::all(client),
            all().labels(&ours),
            ctx(),
            local.slices.clone(),
            |es| HeldSlice::new(&es),
            false,
        ));
    }
    m
}

/// Reads again, one by one, the exports of `m` that its budget refused and that would fit
/// now ([`MetaBudget::readmit`]), and stores them as a watch event would (unless the store
/// meanwhile holds a newer generation, or none: a delete came first).
async fn readmit(client: Client, m: Arc<Member>, wake: Arc<Notify>, retry_max: Duration) {
    let mut retry = WatchRetry::new(retry_max);
    loop {
        m.budget.wake.notified().await;
        let keys = m.budget.readmit();
        let mut failed = BTreeSet::new();
        for key in keys {
            let api =
                Api::<WireExport>::namespaced_with(client.clone(), &key.0, &m.export_version());
            match api.get_opt(&key.1).await {
                Ok(Some(se)) => {
                    let fresh = LeanExport::new(se);
                    let newer = m
                        .exports
                        .read()
                        .map
                        .get(&key)
                        .is_some_and(|held| held.generation <= fresh.generation);
                    if newer {
                        m.exports.apply(key, Arc::new(fresh));
                        wake.notify_one();
                    }
                }
                // Its delete event removes it.
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(cluster = %m.id, namespace = %key.0, name = %key.1, error = %e, "reading an export again (its metadata fits now) failed; trying again");
                    failed.insert(key);
                }
            }
        }
        if failed.is_empty() {
            retry.reset();
        } else {
            m.budget.requeue(failed);
            tokio::time::sleep(retry.next().unwrap_or(retry_max)).await;
        }
    }
}

#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) member: Arc<Member>,
    pub(crate) wake: Arc<Notify>,
    pub(crate) retry_max: Duration,
    /// What the watcher's failures are kept under in the member's health (default: its
    /// name): each slice bucket its own, so one that succeeds does not hide another failing.
    pub(crate) health_key: Option<Arc<str>>,
}

/// The service one of our MCS slices belongs to: its `multicluster.kubernetes.io/service-name`.
pub fn mcs_slice_service(key: &ObjKey, es: &HeldSlice) -> Option<ObjKey> {
    Some((key.0.clone(), es.service.clone()?))
}

/// A member's watches and health, for its selection.
struct Reads {
    client: Client,
    ctx: Ctx,
}

impl MemberReads for Reads {
    fn id(&self) -> &str {
        &self.ctx.member.id
    }

    fn watch_services(&self, sink: Arc<dyn Sink<ServiceShape>>) -> tokio::task::JoinHandle<()> {
        let (client, ctx) = (self.client.clone(), self.ctx.clone());
        tokio::spawn(async move {
            watch(
                "Service",
                Api::<Service>::all(client),
                // In pages of 500 (every Service of the member: its memory stays a page),
                // so from etcd (kube-rs sends `resourceVersion=0` only without a page
                // size); listed once, then watched.
                watcher::Config::default(),
                ctx,
                sink,
                |svc| shape(&svc),
                false,
            )
            .await;
        })
    }

    fn watch_slices(
        &self,
        selector: String,
        health_key: String,
        sink: Arc<dyn Sink<EndpointSlice>>,
    ) -> tokio::task::JoinHandle<()> {
        let (client, mut ctx) = (self.client.clone(), self.ctx.clone());
        ctx.health_key = Some(health_key.into());
        tokio::spawn(async move {
            watch(
                "EndpointSlice",
                Api::<EndpointSlice>::all(client),
                slices_from_cache(&selector),
                ctx,
                sink,
                lean_member_slice,
                false,
            )
            .await;
        })
    }

    fn ok(&self, key: &str) {
        self.ctx.member.ok(key);
    }

    fn failed(&self, key: &str, error: &str, retry: Duration) {
        self.ctx.member.failed(key, error, None, 1, retry);
    }

    fn forget(&self, stopped: &dyn Fn(&str) -> bool) {
        self.ctx.member.forget(stopped);
    }
}

/// The list+watch of one slice watch's names: its list from the API server's watch cache
/// (`resourceVersion=0`), whole. A consistent list would have etcd read every EndpointSlice
/// of the member to filter them by label, at each new exported name (real ClusterSet, 1,000
/// other exports: export → import p50 / p99 319 / 559 ms so, 217 / 260 ms from the
/// cache); the cache filters in memory, and the watch goes on from
/// the list's version, so whatever an older cache missed comes as an event. kube-rs sends
/// `resourceVersion=0` only when no page size is set; a list of one watch's names is at
/// most [`crate::selection::MAX_NAMES_PER_WATCH`] Services' slices.
fn slices_from_cache(selector: &str) -> watcher::Config {
    let mut config = watcher::Config::default().labels(selector).any_semantic();
    config.page_size = None;
    config
}

/// How long a watcher stays quiet after its retry before it is asked whether the member
/// answers it again.
const QUIET_PROBE: Duration = Duration::from_secs(5);

/// Keeps a member's ServiceExports in its store, read in the version the member serves:
/// asked of it first (v1beta1 when discovery fails: the list then says what is wrong, with
/// its status code), again whenever that version is no longer served (`404`, as when its
/// CRDs are replaced: read at once in the other version when discovery names it, else asked
/// again after a backoff step), and every [`REDISCOVER`] while it is read in v1alpha1 (its CRDs may
/// have been upgraded). Until it serves one, the watcher fails as any other does: the member
/// is not up, and its last known exports stay until the member timeout; they are never
/// taken for "no exports".
async fn watch_exports(client: Client, ctx: Ctx) {
    let mut retry = WatchRetry::new(ctx.retry_max);
    let mut switched_at_once = false;
    loop {
        let version = export_version(&client, &ctx.member.id).await;
        let before = std::mem::replace(
            &mut *ctx
                .member
                .export_version
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
            version,
        );
        if before != version || !ctx.member.exports.listed() {
            tracing::info!(cluster = %ctx.member.id, version = version.0, "reading ServiceExports in {}/{}", mcs_runtime::discovery::MCS_GROUP, version.0);
        }
        let watched = Instant::now();
        let watching = watch(
            "ServiceExport",
            Api::<WireExport>::all_with(client.clone(), &version),
            watcher::Config::default(),
            ctx.clone(),
            ctx.member.selection.clone(),
            LeanExport::new,
            true,
        );
        // Read in an older version than we prefer: asked again now and then, and read in
        // the preferred one as soon as it is served (the store keeps what it holds until
        // that version's first list is complete).
        let upgraded = async {
            loop {
                tokio::time::sleep(REDISCOVER).await;
                if export_version(&client, &ctx.member.id).await != version {
                    return;
                }
            }
        };
        let ended = if version == ExportVersion::default() {
            watching.await
        } else {
            tokio::select! {
                ended = watching => ended,
                () = upgraded => Ended::Upgraded,
            }
        };
        match ended {
            Ended::Stream => return,
            Ended::Upgraded => continue,
            // A version read for a while: its end may switch at once again.
            Ended::NotServed => switched_at_once &= watched.elapsed() < QUIET_PROBE,
        }
        tracing::warn!(cluster = %ctx.member.id, version = version.0, "the member no longer serves ServiceExports in {}; asking which version it serves (its last known exports stay)", version.0);
        if watched.elapsed() > Duration::from_secs(60) {
            retry.reset();
        }
        // A CRD upgrade that stops serving this version serves the other already: read at
        // once, before the member has failed long enough to mark its imports unreachable.
        // Once per backoff step or version read for at least [`QUIET_PROBE`], so a member
        // whose discovery flips between versions that each list and then answer 404 costs
        // at most a list every few seconds.
        if !switched_at_once && export_version(&client, &ctx.member.id).await != version {
            switched_at_once = true;
            continue;
        }
        switched_at_once = false;
        // Discovery may still name the old version for a moment, or none: ask again after a
        // backoff step, which only a watch that lasted resets.
        tokio::time::sleep(retry.next().unwrap_or(ctx.retry_max)).await;
    }
}

/// How often a member read in v1alpha1 is asked whether it serves v1beta1 now.
const REDISCOVER: Duration = Duration::from_secs(300);

/// The ServiceExport version member `id` serves, by discovery; v1beta1 when discovery fails.
async fn export_version(client: &Client, id: &str) -> ExportVersion {
    match mcs_runtime::discovery::mcs_version(client, "ServiceExport").await {
        Ok(v) => ExportVersion(v),
        Err(e) => {
            tracing::debug!(cluster = %id, error = %e, "discovery of the ServiceExport version failed; reading v1beta1");
            ExportVersion::default()
        }
    }
}

/// Why [`watch`] returned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The stream ended (the process stops).
    Stream,
    /// The version watched is not served (`404 Not Found`), with `until_not_served`.
    NotServed,
    /// The member serves the version we prefer now (not [`watch`]'s own answer).
    Upgraded,
}

/// Keeps `store` equal to the cluster's objects of kind `K`, each kept as `lean` makes it;
/// `watcher_name` keys its failures in the member's health. With `until_not_served` it
/// returns when the API server says the kind is not served in that version (`404`).
pub(crate) async fn watch<K, V>(
    watcher_name: &'static str,
    api: Api<K>,
    config: watcher::Config,
    ctx: Ctx,
    store: Arc<dyn Sink<V>>,
    lean: fn(K) -> V,
    until_not_served: bool,
) -> Ended
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default,
    V: Send + Sync + 'static,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    // After a failure kube's watcher opens the watch again, which yields nothing until the
    // next change: a watcher that stays quiet that long after its retry is asked once, with
    // a one-object read, whether the member answers it again.
    let mut probe = kube::api::ListParams::default().limit(1);
    if let Some(l) = &config.label_selector {
        probe = probe.labels(l);
    }
    let probe_api = api.clone();
    let mut probe_at: Option<tokio::time::Instant> = None;
    let mut stream = ListWatch::new(watcher(api, config), ctx.retry_max);
    let mut pending: Option<HashMap<ObjKey, Arc<V>>> = None;
    let mut listed = false;
    let health_key: &str = ctx.health_key.as_deref().unwrap_or(watcher_name);
    let counted = ctx.member.events.of(watcher_name).cloned();
    let counted = counted.as_ref();
    loop {
        let next = tokio::select! {
            next = stream.next() => next,
            () = tokio::time::sleep_until(probe_at.unwrap_or_else(tokio::time::Instant::now)), if probe_at.is_some() => {
                probe_at = None;
                if probe_api.list_metadata(&probe).await.is_ok() {
                    ctx.member.ok(health_key);
                    ctx.wake.notify_one();
                }
                continue;
            }
        };
        let Some(next) = next else {
            return Ended::Stream;
        };
        let ev = match next {
            Next::Event { event, proof } => {
                // Only a completed list or a watch event says the member answers: kube's
                // watcher yields `Init` before every list attempt, failing or not.
                if proof {
                    probe_at = None;
                    ctx.member.ok(health_key);
                }
                event
            }
            Next::Failed(f) => {
                let msg = format!("{kind}: {}", f.error);
                ctx.member
                    .failed(health_key, &msg, f.refused(), f.streak, f.delay);
                // Not served in this version: a list says so; a watch that cannot start says
                // so only if a one-object list agrees (a proxy may refuse watches alone).
                if until_not_served && f.code() == Some(404) {
                    let not_served = match &f.error {
                        watcher::Error::InitialListFailed(_) => true,
                        watcher::Error::WatchStartFailed(_) | watcher::Error::WatchFailed(_) => {
                            matches!(
                                probe_api.list_metadata(&probe).await,
                                Err(kube::Error::Api(s)) if s.code == 404
                            )
                        }
                        _ => false,
                    };
                    if not_served {
                        ctx.wake.notify_one();
                        return Ended::NotServed;
                    }
                }
                probe_at = Some(tokio::time::Instant::now() + f.delay + f.delay.max(QUIET_PROBE));
                // The reconciler keeps time while a member fails (its timeout may pass
                // without any event).
                ctx.wake.notify_one();
                continue;
            }
        };
        let key = |o: &K| (o.namespace().unwrap_or_default(), o.name_any());
        if let Some(c) = counted
            && matches!(
                ev,
                watcher::Event::InitApply(_) | watcher::Event::Apply(_) | watcher::Event::Delete(_)
            )
        {
            c.inc();
        }
        match ev {
            watcher::Event::Init => {
                store.begin();
                pending = Some(HashMap::new());
            }
            watcher::Event::InitApply(o) => {
                if let Some(p) = pending.as_mut() {
                    let k = key(&o);
                    let o = lean(o);
                    if store.keep(&k, &o) {
                        p.insert(k, Arc::new(o));
                    }
                }
            }
            watcher::Event::InitDone => {
                let fresh = pending.take().unwrap_or_default();
                let objects = fresh.len();
                store.replace(fresh);
                if !listed {
                    listed = true;
                    tracing::info!(cluster = %ctx.member.id, kind, watcher = watcher_name, objects, "listed");
                }
                ctx.wake.notify_one();
            }
            watcher::Event::Apply(o) => {
                store.apply(key(&o), Arc::new(lean(o)));
                ctx.wake.notify_one();
            }
            watcher::Event::Delete(o) => {
                store.remove(&key(&o));
                ctx.wake.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_export_without_spec_is_read_and_kept_lean() {
        // As upstream's CRD stores a metadata-only export (it does not default `spec`).
        let se: WireExport = serde_json::from_value(serde_json::json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
            "metadata": { "name": "web", "namespace": "shop", "generation": 2,
                          "creationTimestamp": "2026-01-01T00:00:00Z" }
        }))
        .unwrap();
        let lean = LeanExport::new(se);
        assert_eq!(lean.generation, Some(2));
        assert!(lean.labels.is_empty() && lean.refused.is_none() && !lean.deleting);
        assert_eq!(lean.created, 1_767_225_600);

        let big: WireExport = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "big", "namespace": "shop" },
            "spec": { "exportedAnnotations": { "a": "v".repeat(300 * 1024) } }
        }))
        .unwrap();
        let lean = LeanExport::new(big);
        assert!(lean.annotations.is_empty(), "refused: not kept");
        assert_eq!(
            lean.refused.unwrap().reason,
            mcs_merge::meta::INVALID_ANNOTATIONS
        );
        assert_eq!(lean.created, i64::MAX);
    }
}
