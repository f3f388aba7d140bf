//! Which of a member's Services and EndpointSlices the controller reads: those its
//! ServiceExports name, and no others.
//!
//! A member runs thousands of Services nobody exports, and their pods roll all day; the
//! controller's cost per member follows what that member exports:
//!
//! - **ServiceExports** are watched whole (they are what is shared).
//! - **EndpointSlices** (what churns) are watched by label,
//!   `kubernetes.io/service-name in (…)`, naming only exported Services: the API server
//!   sends nothing for a slice of a Service nobody exports. The names are spread over a power
//!   of two of watches ([`plan`]: about [`NAMES_PER_WATCH`] names each, never more than
//!   [`MAX_NAMES_PER_WATCH`], by a hash keyed per process, so no tenant can aim names at one
//!   watch). A watch whose names change is listed again (its slices only) once its last list
//!   completed and [`RESTART_GAP`] passed; one that did not complete its list waits twice as
//!   long each time (also when the number of watches changes), up to [`RESTART_GAP_MAX`], so
//!   churning names cannot keep a list that takes less than that from completing. The number of watches grows when they fill and shrinks only when a quarter
//!   full. The store holds every slice a selector returns: a slice of an unexported Service
//!   that shares an exported one's name in another namespace is read too (never imported:
//!   only an export's own slices are).
//! - **Services** (which seldom change) are watched whole, from the first complete list of
//!   exports on, but only the shape of an exported one is kept; a Service exported after its
//!   watcher listed is read once by name (at most [`GETS_IN_FLIGHT`] reads at a time), and
//!   that read is dropped if the watch said something of the Service meanwhile.
//!
//! Until both its Service and its slices have been read, an export is held back here (the
//! reconciler sees it as not there yet), so no pass computes an export without its Service
//! or endpoints; a member counts as listed once every export of its first complete list has
//! been read so (later ones are held back alone). An export whose name cannot be a
//! Service's (not a DNS-1035 label) is passed on at once: it has no Service and no slices,
//! and never enters a label selector.
//!
//! Each slice watch keeps its own failures in the member's health, so one that answers does
//! not hide another that fails.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    hash::BuildHasher as _,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Api, Client, runtime::utils::Backoff as _};
use mcs_merge::ServiceShape;
use mcs_runtime::retry::WatchRetry;
use tokio::{sync::Notify, task::JoinSet, time::Instant};

use crate::objects::{LABEL_K8S_SERVICE_NAME, LeanExport, ObjKey, shape};
use crate::store::{Sink, Store};

/// About how many Service names one EndpointSlice watch selects.
pub const NAMES_PER_WATCH: usize = 128;

/// The most names one watch selects (the selector travels in the request's URL: 256 names
/// of at most 63 bytes, their commas and the rest, percent-encoded, about 17 KB; the API
/// server takes 1 MiB, but a proxy in front of it with an 8 KiB line limit would refuse
/// the longest).
pub const MAX_NAMES_PER_WATCH: usize = 2 * NAMES_PER_WATCH;

/// The shortest time between two lists of one slice watch whose names changed (a burst of
/// new exports lists each watch a few times, not once per export).
pub const RESTART_GAP: Duration = Duration::from_millis(200);

/// The longest wait before a slice watch that has not completed its list is started again
/// with new names.
pub const RESTART_GAP_MAX: Duration = Duration::from_secs(30);

/// Services read by name at a time (exported after the Service watcher listed).
pub const GETS_IN_FLIGHT: usize = 16;

/// What the reads of Services by name keep their failures under in the member's health.
const GET_HEALTH: &str = "Service (by name)";

/// How many slice watches are needed for `names` distinct names: a power of two.
pub fn buckets(names: usize) -> usize {
    if names == 0 {
        0
    } else {
        names.div_ceil(NAMES_PER_WATCH).next_power_of_two()
    }
}

/// The bucket of `name` among `buckets`, by a hash keyed once per process (a tenant cannot
/// choose names that fall in one bucket).
pub fn bucket_of(name: &str, buckets: usize) -> usize {
    static KEY: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    let h = KEY.get_or_init(Default::default).hash_one(name);
    (h % buckets.max(1) as u64) as usize
}

/// How many slice watches `names` are spread over when `now` are running: grown to what
/// they need, shrunk only when a quarter full (names coming and going at a boundary do not
/// make every watch list again), and doubled while any would select more than
/// [`MAX_NAMES_PER_WATCH`].
pub fn plan(names: &[&str], now: usize) -> usize {
    if names.is_empty() {
        return 0;
    }
    let need = buckets(names.len());
    let mut n = if need > now || names.len() * 4 <= NAMES_PER_WATCH * now {
        need
    } else {
        now
    };
    loop {
        let mut sizes = vec![0usize; n];
        for name in names {
            sizes[bucket_of(name, n)] += 1;
        }
        if sizes.iter().all(|s| *s <= MAX_NAMES_PER_WATCH) || n >= names.len() {
            return n;
        }
        n *= 2;
    }
}

/// The service a member's slice belongs to: its `kubernetes.io/service-name` (none for a
/// slice that says it is ours: it is never copied).
pub fn member_slice_service(key: &ObjKey, es: &EndpointSlice) -> Option<ObjKey> {
    let labels = es.metadata.labels.as_ref()?;
    if labels
        .get(mcs_api::LABEL_MANAGED_BY)
        .is_some_and(|v| v == crate::MANAGER)
    {
        return None;
    }
    let svc = labels.get(LABEL_K8S_SERVICE_NAME)?;
    Some((key.0.clone(), svc.clone()))
}

/// What is kept of a member's Service EndpointSlice: name, namespace, the two labels read
/// (`kubernetes.io/service-name`, `endpointslice.kubernetes.io/managed-by`), address type,
/// ports, and of each endpoint what an MCS slice copies.
pub fn lean_member_slice(es: EndpointSlice) -> EndpointSlice {
    let labels = es.metadata.labels.map(|l| {
        l.into_iter()
            .filter(|(k, _)| k == LABEL_K8S_SERVICE_NAME || k == mcs_api::LABEL_MANAGED_BY)
            .collect()
    });
    EndpointSlice {
        metadata: ObjectMeta {
            name: es.metadata.name,
            namespace: es.metadata.namespace,
            labels,
            ..Default::default()
        },
        address_type: es.address_type,
        endpoints: es.endpoints.map(|eps| {
            eps.into_iter()
                .map(|e| k8s_openapi::api::discovery::v1::Endpoint {
                    target_ref: None,
                    deprecated_topology: None,
                    ..e
                })
                .collect()
        }),
        ports: es.ports,
    }
}

/// Whether `name` can be a Service's name (a DNS-1035 label): only such names enter a
/// label selector.
pub fn selectable(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b[b.len() - 1] != b'-'
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// One export seen by the exports' watcher.
#[derive(Debug)]
struct Want {
    /// When it was first wanted (the selection's epoch then).
    since: u64,
    /// The export, held back until its Service and slices are read.
    pending: Option<Arc<LeanExport>>,
    /// Its Service has been read (found or not).
    service_known: bool,
    /// Its slices have been listed.
    slices_known: bool,
    /// A read of its Service by name is under way.
    fetching: bool,
    /// The Service watch said something of it since that read was sent (the read is then
    /// older, and dropped).
    seen: bool,
}

impl Want {
    fn covered(&self) -> bool {
        self.service_known && self.slices_known
    }
}

#[derive(Debug, Default)]
struct State {
    /// Every export the watcher holds, by key.
    wanted: HashMap<ObjKey, Want>,
    /// Selectable names of wanted exports → how many namespaces export that name.
    names: BTreeMap<String, usize>,
    /// Counts wants.
    epoch: u64,
    /// The epoch when the exports' first list completed.
    first_list: Option<u64>,
    /// The epoch when the Service watcher's list under way began.
    services_begun: Option<u64>,
    /// The names whose slices the store holds as listed (a watch's list completed with them
    /// in its selector; the store keeps every slice of theirs, in every namespace).
    listed_names: HashSet<String>,
    /// How many wants are not covered yet (each holds its export back).
    held: usize,
}

impl State {
    /// Wants `key`; whether it is covered at once (a name no Service can have).
    fn want(&mut self, key: ObjKey, pending: Option<Arc<LeanExport>>) -> bool {
        self.epoch += 1;
        let ok = selectable(&key.1);
        if ok {
            *self.names.entry(key.1.clone()).or_default() += 1;
            self.held += 1;
        }
        let slices_known = !ok || self.listed_names.contains(&key.1);
        self.wanted.insert(
            key,
            Want {
                since: self.epoch,
                pending,
                service_known: !ok,
                slices_known,
                fetching: false,
                seen: false,
            },
        );
        !ok
    }

    /// No longer wants `key`; whether it was wanted. A name nobody exports any more is no
    /// longer counted as listed (exported again, it waits for a list that selects it).
    fn unwant(&mut self, key: &ObjKey) -> bool {
        let Some(w) = self.wanted.remove(key) else {
            return false;
        };
        if !w.covered() {
            self.held = self.held.saturating_sub(1);
        }
        if let Some(n) = self.names.get_mut(&key.1) {
            *n -= 1;
            if *n == 0 {
                self.names.remove(&key.1);
                self.listed_names.remove(&key.1);
            }
        }
        true
    }

    /// Passes on to `exports` the held-back exports of `keys` that are covered now, while
    /// the selection is locked (an unexport then cannot come between: it would find nothing
    /// to remove, and the export would stay); how many.
    fn release(
        &mut self,
        exports: &Store<LeanExport>,
        keys: impl IntoIterator<Item = ObjKey>,
    ) -> usize {
        let mut n = 0;
        for k in keys {
            let Some(w) = self.wanted.get_mut(&k) else {
                continue;
            };
            if !w.covered() {
                continue;
            }
            // Not covered until now (a held-back export is always pending).
            if let Some(e) = w.pending.take() {
                exports.apply(k, e);
                n += 1;
            }
        }
        self.held = self.held.saturating_sub(n);
        n
    }
}

/// What of one member is read: the exports' keys, and which of them have their Service and
/// slices read; the stores it fills.
#[derive(Debug)]
pub struct Selection {
    exports: Arc<Store<LeanExport>>,
    services: Arc<Store<ServiceShape>>,
    slices: Arc<Store<EndpointSlice>>,
    /// Taken before a store's lock, never after.
    state: Mutex<State>,
    /// Wakes the task that keeps the watches in step with the exports.
    changed: Notify,
    /// Wakes the reconciler (an export passed on).
    wake: Arc<Notify>,
    /// Latched once the exports listed and every export of that list was read.
    settled: AtomicBool,
}

impl Selection {
    /// A selection filling these stores.
    pub fn new(
        exports: Arc<Store<LeanExport>>,
        services: Arc<Store<ServiceShape>>,
        slices: Arc<Store<EndpointSlice>>,
        wake: Arc<Notify>,
    ) -> Self {
        Self {
            exports,
            services,
            slices,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            wake,
            settled: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the exports listed and every export of that first list has its Service and
    /// slices read (it stays so: a later export is held back alone until it is read).
    pub fn settled(&self) -> bool {
        if self.settled.load(Ordering::Acquire) {
            return true;
        }
        if !self.exports.listed() || !self.services.listed() {
            return false;
        }
        let st = self.lock();
        let done = st.first_list.is_some_and(|first| {
            st.wanted
                .values()
                .filter(|w| w.since <= first)
                .all(Want::covered)
        });
        drop(st);
        if done {
            self.settled.store(true, Ordering::Release);
        }
        done
    }

    /// How many exports are held back (their Service or slices not read yet).
    pub fn held_back(&self) -> usize {
        self.lock().held
    }

    /// Wakes the reconciler when `passed` exports were passed on.
    fn passed(&self, passed: usize) {
        if passed > 0 {
            self.wake.notify_one();
        }
    }
}

/// The exports' watcher writes here: an export goes on to the store once its Service and
/// slices are read.
impl Sink<LeanExport> for Selection {
    fn apply(&self, key: ObjKey, e: Arc<LeanExport>) {
        let mut st = self.lock();
        let now = match st.wanted.get_mut(&key) {
            Some(w) if w.covered() => true,
            Some(w) => {
                w.pending = Some(e.clone());
                false
            }
            None => {
                let covered = st.want(key.clone(), Some(e.clone()));
                self.changed.notify_one();
                if covered {
                    st.wanted.get_mut(&key).map(|w| w.pending.take());
                }
                covered
            }
        };
        // Under the lock, as every write to the exports' store.
        if now {
            self.exports.apply(key, e);
        }
        drop(st);
    }

    fn remove(&self, key: &ObjKey) {
        let mut st = self.lock();
        let was = st.unwant(key);
        if was {
            // Its slices stay while its name is selected; the next list of its watch drops
            // them.
            self.services.remove(key);
        }
        self.exports.remove(key);
        drop(st);
        if was {
            self.changed.notify_one();
        }
    }

    fn replace(&self, fresh: HashMap<ObjKey, Arc<LeanExport>>) {
        let mut st = self.lock();
        let gone: Vec<ObjKey> = st
            .wanted
            .keys()
            .filter(|k| !fresh.contains_key(*k))
            .cloned()
            .collect();
        for k in &gone {
            st.unwant(k);
            self.services.remove(k);
        }
        let mut covered = HashMap::new();
        for (k, e) in fresh {
            match st.wanted.get_mut(&k) {
                Some(w) if w.covered() => {
                    w.pending = None;
                    covered.insert(k, e);
                }
                Some(w) => w.pending = Some(e),
                None => {
                    if st.want(k.clone(), None) {
                        covered.insert(k, e);
                    } else if let Some(w) = st.wanted.get_mut(&k) {
                        w.pending = Some(e);
                    }
                }
            }
        }
        if st.first_list.is_none() {
            st.first_list = Some(st.epoch);
        }
        self.exports.replace(covered);
        drop(st);
        self.changed.notify_one();
    }
}

/// The Service watcher writes here: the shapes of exported Services only.
struct Services(Arc<Selection>);

impl Sink<ServiceShape> for Services {
    fn begin(&self) {
        let mut st = self.0.lock();
        st.services_begun = Some(st.epoch);
    }

    fn keep(&self, key: &ObjKey, _: &ServiceShape) -> bool {
        self.0.lock().wanted.contains_key(key)
    }

    fn apply(&self, key: ObjKey, o: Arc<ServiceShape>) {
        let mut st = self.0.lock();
        if let Some(w) = st.wanted.get_mut(&key) {
            w.seen = true;
            self.0.services.apply(key, o);
        }
    }

    fn remove(&self, key: &ObjKey) {
        let mut st = self.0.lock();
        if let Some(w) = st.wanted.get_mut(key) {
            w.seen = true;
        }
        self.0.services.remove(key);
    }

    fn replace(&self, fresh: HashMap<ObjKey, Arc<ServiceShape>>) {
        let sel = &self.0;
        let mut st = sel.lock();
        let begun = st.services_begun.take().unwrap_or(st.epoch);
        // Exports wanted after the list began may have had their Service passed over by
        // it: what is held of them stays, and they are read by name.
        let mut later = HashSet::new();
        let mut known = Vec::new();
        for (k, w) in st.wanted.iter_mut() {
            if w.since > begun {
                later.insert(k.clone());
            } else {
                w.seen = true;
                if !w.service_known {
                    w.service_known = true;
                    known.push(k.clone());
                }
            }
        }
        let fresh: HashMap<_, _> = fresh
            .into_iter()
            .filter(|(k, _)| st.wanted.contains_key(k))
            .collect();
        sel.services.replace_part(|k, _| !later.contains(k), fresh);
        let passed = st.release(&sel.exports, known);
        drop(st);
        sel.passed(passed);
        sel.changed.notify_one();
    }
}

/// One slice watch writes here: every slice its selector returns (the slices of its names,
/// in every namespace).
struct Slices {
    selection: Arc<Selection>,
    /// Its names (the selector's).
    names: BTreeSet<String>,
    bucket: usize,
    buckets: usize,
    /// Cleared (under the selection's lock) when the watch is replaced: a list it completes
    /// afterwards is not taken.
    live: Arc<AtomicBool>,
    /// Set when its list completed.
    listed: Arc<AtomicBool>,
    /// When it was started.
    started: Instant,
}

impl Sink<EndpointSlice> for Slices {
    fn apply(&self, key: ObjKey, es: Arc<EndpointSlice>) {
        // A replaced watch may deliver a few more events before it stops: dropped.
        if self.live.load(Ordering::Acquire) {
            self.selection.slices.apply(key, es);
        }
    }

    fn remove(&self, key: &ObjKey) {
        if self.live.load(Ordering::Acquire) {
            self.selection.slices.remove(key);
        }
    }

    fn replace(&self, fresh: HashMap<ObjKey, Arc<EndpointSlice>>) {
        let sel = &self.selection;
        let (bucket, buckets) = (self.bucket, self.buckets);
        let mut st = sel.lock();
        if !self.live.load(Ordering::Acquire) {
            return;
        }
        sel.slices.replace_part(
            |k, es| member_slice_service(k, es).is_none_or(|s| bucket_of(&s.1, buckets) == bucket),
            fresh,
        );
        st.listed_names
            .retain(|name| bucket_of(name, buckets) != bucket);
        // Only names still exported: one dropped meanwhile waits for a list that selects it.
        let names: Vec<String> = self
            .names
            .iter()
            .filter(|n| st.names.contains_key(*n))
            .cloned()
            .collect();
        st.listed_names.extend(names);
        let mut known = Vec::new();
        for (k, w) in st.wanted.iter_mut() {
            if !w.slices_known && self.names.contains(&k.1) {
                w.slices_known = true;
                known.push(k.clone());
            }
        }
        let passed = st.release(&sel.exports, known);
        drop(st);
        let first = !self.listed.swap(true, Ordering::AcqRel);
        tracing::debug!(
            bucket = bucket + 1,
            buckets,
            names = self.names.len(),
            exports = passed,
            ms = self.started.elapsed().as_millis() as u64,
            "slice watch listed"
        );
        sel.passed(passed);
        if first {
            // A restart waiting for this list may go now.
            sel.changed.notify_one();
        }
    }
}

/// A task stopped when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A running slice watch.
struct Bucket {
    names: BTreeSet<String>,
    started: Instant,
    live: Arc<AtomicBool>,
    listed: Arc<AtomicBool>,
    /// Times in a row it was started again before its list completed.
    unlisted_restarts: u32,
    _task: AbortOnDrop,
}

impl Bucket {
    /// When it may be started again with other names: [`RESTART_GAP`] after it started once
    /// its list completed; else twice as long for each restart in a row that came before
    /// one did, up to [`RESTART_GAP_MAX`].
    fn may_restart_at(&self) -> Instant {
        let gap = if self.listed.load(Ordering::Acquire) {
            RESTART_GAP
        } else {
            RESTART_GAP
                .saturating_mul(1 << self.unlisted_restarts.min(8))
                .min(RESTART_GAP_MAX)
        };
        self.started + gap
    }

    /// How many restarts in a row came before its list completed, counting one now.
    fn restarts_after(&self) -> u32 {
        if self.listed.load(Ordering::Acquire) {
            0
        } else {
            self.unlisted_restarts + 1
        }
    }
}

/// The label selector naming `names`.
fn selector(names: &BTreeSet<String>) -> String {
    let list: Vec<&str> = names.iter().map(String::as_str).collect();
    format!("{LABEL_K8S_SERVICE_NAME} in ({})", list.join(","))
}

/// What slice watch `b` of `n` keeps its failures under.
fn bucket_health(b: usize, n: usize) -> String {
    format!("EndpointSlice {}/{n}", b + 1)
}

/// A read of a Service by name under way: its key, and its want's `since`.
type Get = (ObjKey, u64);

/// What the selection needs of its member (`members.rs` gives it): its watches, started
/// into a sink, and its health.
pub trait MemberReads: Send + Sync + 'static {
    /// The member's cluster id.
    fn id(&self) -> &str;
    /// Starts the watch of every Service, into `sink`.
    fn watch_services(&self, sink: Arc<dyn Sink<ServiceShape>>) -> tokio::task::JoinHandle<()>;
    /// Starts a watch of the EndpointSlices `selector` selects, into `sink`, its failures
    /// kept under `health_key`.
    fn watch_slices(
        &self,
        selector: String,
        health_key: String,
        sink: Arc<dyn Sink<EndpointSlice>>,
    ) -> tokio::task::JoinHandle<()>;
    /// Reads kept under `key` answer.
    fn ok(&self, key: &str);
    /// A read kept under `key` failed with `error`; the next one in `retry`.
    fn failed(&self, key: &str, error: &str, retry: Duration);
    /// The reads for which `stopped` holds no longer run: their failures no longer count.
    fn forget(&self, stopped: &dyn Fn(&str) -> bool);
}

/// Keeps member `member`'s Service and slice watches in step with its exports: starts
/// the Service watcher once the exports listed, lists a slice watch again when its names
/// change, and reads by name the Services exported after the Service watcher listed.
pub async fn keep_in_step(
    client: Client,
    sel: Arc<Selection>,
    member: impl MemberReads,
    retry_max: Duration,
) {
    let mut services_watch: Option<AbortOnDrop> = None;
    let mut running: Vec<Option<Bucket>> = Vec::new();
    let mut gets: JoinSet<Result<Option<Service>, kube::Error>> = JoinSet::new();
    let mut in_flight: HashMap<tokio::task::Id, Get> = HashMap::new();
    let mut get_retry = WatchRetry::new(retry_max);
    let mut gets_after: Option<Instant> = None;
    loop {
        let mut due: Option<Instant> = gets_after;
        if services_watch.is_none() && sel.exports.listed() {
            services_watch = Some(AbortOnDrop(
                member.watch_services(Arc::new(Services(sel.clone()))),
            ));
        }

        // Slice watches: the names spread over `n` of them.
        let names: Vec<String> = sel.lock().names.keys().cloned().collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let n = plan(&refs, running.len());
        let mut want: Vec<BTreeSet<String>> = vec![BTreeSet::new(); n];
        for name in &names {
            want[bucket_of(name, n)].insert(name.clone());
        }
        // A watch started in place of one that had not listed waits as long as that one
        // would have (also across a change of their number).
        let mut carried = 0;
        if n != running.len() {
            // Every watch starts again: once each may.
            carried = running
                .iter()
                .flatten()
                .map(Bucket::restarts_after)
                .max()
                .unwrap_or(0);
            let at = running
                .iter()
                .flatten()
                .map(Bucket::may_restart_at)
                .max()
                .unwrap_or_else(Instant::now);
            if at <= Instant::now() {
                tracing::info!(
                    cluster = member.id(),
                    services = names.len(),
                    watches = n,
                    "reading the EndpointSlices of exported Services only"
                );
                let mut st = sel.lock();
                for b in running.iter().flatten() {
                    b.live.store(false, Ordering::Release);
                }
                // The slices of names no longer exported go now (the new watches' lists
                // replace the rest; a watch with no names would never list).
                let exported: HashSet<&str> = refs.iter().copied().collect();
                st.listed_names
                    .retain(|name| exported.contains(name.as_str()));
                sel.slices.replace_part(
                    |k, es| {
                        member_slice_service(k, es).is_none_or(|s| !exported.contains(s.1.as_str()))
                    },
                    HashMap::new(),
                );
                drop(st);
                running = (0..n).map(|_| None).collect();
            } else {
                due = Some(due.map_or(at, |d| d.min(at)));
                want.clear();
            }
        }
        for (b, names) in want.into_iter().enumerate() {
            let mut restarts = carried;
            if let Some(r) = &running[b] {
                if r.names == names {
                    continue;
                }
                let at = r.may_restart_at();
                if at > Instant::now() {
                    due = Some(due.map_or(at, |d| d.min(at)));
                    continue;
                }
                restarts = r.restarts_after();
                let _st = sel.lock();
                r.live.store(false, Ordering::Release);
            }
            if names.is_empty() {
                // None of its names exported any more: its slices go with it.
                if running[b].take().is_some() {
                    let _st = sel.lock();
                    sel.slices.replace_part(
                        |k, es| member_slice_service(k, es).is_none_or(|s| bucket_of(&s.1, n) == b),
                        HashMap::new(),
                    );
                }
                continue;
            }
            let live = Arc::new(AtomicBool::new(true));
            let listed = Arc::new(AtomicBool::new(false));
            let sink = Arc::new(Slices {
                selection: sel.clone(),
                names: names.clone(),
                bucket: b,
                buckets: n,
                live: live.clone(),
                listed: listed.clone(),
                started: Instant::now(),
            });
            let task = member.watch_slices(selector(&names), bucket_health(b, n), sink);
            running[b] = Some(Bucket {
                names,
                started: Instant::now(),
                live,
                listed,
                unlisted_restarts: restarts,
                _task: AbortOnDrop(task),
            });
        }
        // Failures of slice watches that no longer run no longer count.
        let current: HashSet<String> = running
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_some())
            .map(|(b, _)| bucket_health(b, running.len()))
            .collect();
        member.forget(&|k| k.starts_with("EndpointSlice ") && !current.contains(k));

        // Nothing left to read by name (the Service watch may have read what a failed read
        // could not): a failed read no longer counts against the member.
        if gets.is_empty() && sel.lock().wanted.values().all(|w| w.service_known) {
            member.ok(GET_HEALTH);
        }

        // Services exported after the Service watcher listed: read by name.
        if sel.services.listed() && gets_after.is_none_or(|t| t <= Instant::now()) {
            gets_after = None;
            let mut st = sel.lock();
            if st.services_begun.is_none() {
                let room = GETS_IN_FLIGHT.saturating_sub(gets.len());
                let mut todo: Vec<(u64, ObjKey)> = st
                    .wanted
                    .iter()
                    .filter(|(_, w)| !w.service_known && !w.fetching)
                    .map(|(k, w)| (w.since, k.clone()))
                    .collect();
                todo.sort_unstable();
                for (since, k) in todo.into_iter().take(room) {
                    if let Some(w) = st.wanted.get_mut(&k) {
                        w.fetching = true;
                        w.seen = false;
                    }
                    let api = Api::<Service>::namespaced(client.clone(), &k.0);
                    let name = k.1.clone();
                    let cluster = member.id().to_string();
                    let task = gets.spawn(async move {
                        let t = Instant::now();
                        let got = api.get_opt(&name).await;
                        tracing::debug!(%cluster, name, ms = t.elapsed().as_millis() as u64, "read an exported Service by name");
                        got
                    });
                    in_flight.insert(task.id(), (k, since));
                }
            }
        }

        tokio::select! {
            () = sel.changed.notified() => {}
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {}
            Some(done) = gets.join_next_with_id(), if !gets.is_empty() => {
                let (id, got) = match done {
                    Ok((id, got)) => (id, got),
                    Err(e) => (e.id(), Err(kube::Error::Service(e.to_string().into()))),
                };
                let Some((k, since)) = in_flight.remove(&id) else { continue };
                match &got {
                    Ok(_) => {
                        get_retry.reset();
                        member.ok(GET_HEALTH);
                    }
                    Err(e) => {
                        let wait = get_retry.next().unwrap_or(retry_max);
                        tracing::warn!(cluster = member.id(), namespace = %k.0, name = %k.1, error = %e, retry_ms = wait.as_millis() as u64, "reading an exported Service failed; trying again");
                        member.failed(GET_HEALTH, &format!("Service {}/{}: {e}", k.0, k.1), wait);
                        gets_after = Some(Instant::now() + wait);
                    }
                }
                let mut st = sel.lock();
                let Some(w) = st.wanted.get_mut(&k).filter(|w| w.since == since) else {
                    continue;
                };
                w.fetching = false;
                let Ok(svc) = got else { continue };
                // The watch said something of it since the read was sent: the read is older.
                if !w.seen {
                    match svc {
                        Some(svc) => sel.services.apply(k.clone(), Arc::new(shape(&svc))),
                        None => sel.services.remove(&k),
                    }
                }
                w.service_known = true;
                let passed = st.release(&sel.exports, [k]);
                drop(st);
                sel.passed(passed);
            }
        }
    }
}

#[cfg(test)]
mod tests;
