//! Which of a member's Services and EndpointSlices the controller reads: those its
//! ServiceExports name, and no others.
//!
//! A member runs thousands of Services nobody exports, and their pods roll all day; the
//! controller's cost per member follows what that member exports:
//!
//! - **ServiceExports** are watched whole (they are what is shared).
//! - **EndpointSlices** (what churns) are watched by label,
//!   `kubernetes.io/service-name in (…)`, naming only exported Services: the API server
//!   sends nothing for a slice of a Service nobody exports. The names are spread over
//!   [`buckets`] watches of about [`NAMES_PER_WATCH`] each, by a fixed hash of the name; a
//!   bucket whose names change is listed again (its slices only), at most once per
//!   [`RESTART_GAP`]. The store holds every slice a selector returns: a slice of an
//!   unexported Service that shares an exported one's name in another namespace is read too
//!   (and never imported: only an export's own slices are).
//! - **Services** (which seldom change) are watched whole, from the first complete list of
//!   exports on, but only the shape of an exported one is kept; a Service exported after its
//!   watcher listed is read once by name (at most [`GETS_IN_FLIGHT`] reads at a time).
//!
//! Until both its Service and its slices have been read, an export is held back here (the
//! reconciler sees it as not there yet), so no pass computes an export without its Service
//! or endpoints — and a member counts as listed only once every export of its first list
//! has been read so. An export whose name cannot be a Service's (not a DNS-1035 label) is
//! passed on at once: it has no Service and no slices, and never enters a label selector.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    hash::{Hash as _, Hasher as _},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    runtime::{utils::Backoff as _, watcher},
};
use mcs_merge::ServiceShape;
use mcs_runtime::retry::WatchRetry;
use tokio::{sync::Notify, task::JoinSet, time::Instant};

use crate::members::{Ctx, Sink, Store, lean_member_slice, member_slice_service, watch};
use crate::objects::{LABEL_K8S_SERVICE_NAME, LeanExport, ObjKey, shape};

/// About how many Service names one EndpointSlice watch selects (the selector travels in
/// the request's URL: 128 names of at most 63 bytes is 8 KiB).
pub const NAMES_PER_WATCH: usize = 128;

/// The shortest time between two lists of one bucket of slices whose names changed (a
/// burst of new exports lists each bucket a few times, not once per export).
pub const RESTART_GAP: Duration = Duration::from_millis(200);

/// Services read by name at a time (exported after the Service watcher listed).
pub const GETS_IN_FLIGHT: usize = 16;

/// How many slice watches `names` distinct names are spread over: a power of two, so that
/// growing it moves each name to one of two buckets.
pub fn buckets(names: usize) -> usize {
    if names == 0 {
        0
    } else {
        names.div_ceil(NAMES_PER_WATCH).next_power_of_two()
    }
}

/// The bucket of `name` among `buckets` (a fixed hash: the same in every process).
pub fn bucket_of(name: &str, buckets: usize) -> usize {
    let mut h = std::hash::DefaultHasher::new();
    name.hash(&mut h);
    (h.finish() % buckets.max(1) as u64) as usize
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
    /// The epoch when the Service watcher's list under way began.
    services_begun: Option<u64>,
    /// The names whose slices the store holds as listed (a bucket's list completed with
    /// them in its selector; the store keeps every slice of theirs, in every namespace).
    listed_names: HashSet<String>,
}

impl State {
    /// Wants `key`; whether it is covered at once (a name no Service can have).
    fn want(&mut self, key: ObjKey, pending: Option<Arc<LeanExport>>) -> bool {
        self.epoch += 1;
        let ok = selectable(&key.1);
        if ok {
            *self.names.entry(key.1.clone()).or_default() += 1;
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
            },
        );
        !ok
    }

    /// No longer wants `key`; whether it was wanted.
    fn unwant(&mut self, key: &ObjKey) -> bool {
        if self.wanted.remove(key).is_none() {
            return false;
        }
        if let Some(n) = self.names.get_mut(&key.1) {
            *n -= 1;
            if *n == 0 {
                self.names.remove(&key.1);
            }
        }
        true
    }

    /// Takes the held-back exports of `keys` that are covered now.
    fn release(
        &mut self,
        keys: impl IntoIterator<Item = ObjKey>,
    ) -> Vec<(ObjKey, Arc<LeanExport>)> {
        keys.into_iter()
            .filter_map(|k| {
                let w = self.wanted.get_mut(&k)?;
                if !w.covered() {
                    return None;
                }
                w.pending.take().map(|e| (k, e))
            })
            .collect()
    }
}

/// What of one member is read: the exports' keys, and which of them have their Service and
/// slices read; the stores it fills.
#[derive(Debug)]
pub struct Selection {
    exports: Arc<Store<LeanExport>>,
    services: Arc<Store<ServiceShape>>,
    slices: Arc<Store<EndpointSlice>>,
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

    /// Whether the exports listed and every one of them has its Service and slices read
    /// (it stays so: a later export is held back alone until it is read).
    pub fn settled(&self) -> bool {
        if self.settled.load(Ordering::Acquire) {
            return true;
        }
        let done = self.exports.listed()
            && self.services.listed()
            && self.lock().wanted.values().all(Want::covered);
        if done {
            self.settled.store(true, Ordering::Release);
        }
        done
    }

    /// How many exports are held back (their Service or slices not read yet).
    pub fn held_back(&self) -> usize {
        self.lock().wanted.values().filter(|w| !w.covered()).count()
    }

    /// Passes on the exports covered now.
    fn pass_on(&self, ready: Vec<(ObjKey, Arc<LeanExport>)>) {
        if ready.is_empty() {
            return;
        }
        for (k, e) in ready {
            self.exports.apply(k, e);
        }
        self.wake.notify_one();
    }

    /// Drops the Service of `key` (no longer exported). Its slices stay while its name is
    /// selected (the store holds all of a selected name's slices); the next list of its
    /// bucket drops them.
    fn forget(&self, key: &ObjKey) {
        self.services.remove(key);
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
        drop(st);
        if now {
            self.exports.apply(key, e);
        }
    }

    fn remove(&self, key: &ObjKey) {
        let was = self.lock().unwant(key);
        self.exports.remove(key);
        if was {
            self.forget(key);
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
        drop(st);
        for k in &gone {
            self.forget(k);
        }
        self.exports.replace(covered);
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
        if self.0.lock().wanted.contains_key(&key) {
            self.0.services.apply(key, o);
        }
    }

    fn remove(&self, key: &ObjKey) {
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
            } else if !w.service_known {
                w.service_known = true;
                known.push(k.clone());
            }
        }
        let fresh: HashMap<_, _> = fresh
            .into_iter()
            .filter(|(k, _)| st.wanted.contains_key(k))
            .collect();
        let ready = st.release(known);
        drop(st);
        sel.services.replace_part(|k, _| !later.contains(k), fresh);
        sel.pass_on(ready);
        sel.changed.notify_one();
    }
}

/// One bucket's slice watcher writes here: every slice its selector returns (the slices of
/// the exported names, in every namespace).
struct Slices {
    selection: Arc<Selection>,
    /// Its names (the selector's).
    names: BTreeSet<String>,
    bucket: usize,
    buckets: usize,
}

impl Sink<EndpointSlice> for Slices {
    fn apply(&self, key: ObjKey, es: Arc<EndpointSlice>) {
        self.selection.slices.apply(key, es);
    }

    fn remove(&self, key: &ObjKey) {
        self.selection.slices.remove(key);
    }

    fn replace(&self, fresh: HashMap<ObjKey, Arc<EndpointSlice>>) {
        let sel = &self.selection;
        let (bucket, buckets) = (self.bucket, self.buckets);
        // The store first, then the names it now answers for.
        sel.slices.replace_part(
            |k, es| member_slice_service(k, es).is_none_or(|s| bucket_of(&s.1, buckets) == bucket),
            fresh,
        );
        let mut st = sel.lock();
        st.listed_names
            .retain(|name| bucket_of(name, buckets) != bucket);
        st.listed_names.extend(self.names.iter().cloned());
        let mut known = Vec::new();
        for (k, w) in st.wanted.iter_mut() {
            if !w.slices_known && self.names.contains(&k.1) {
                w.slices_known = true;
                known.push(k.clone());
            }
        }
        let ready = st.release(known);
        drop(st);
        sel.pass_on(ready);
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
    _task: AbortOnDrop,
    started: Instant,
}

/// The label selector naming `names`.
fn selector(names: &BTreeSet<String>) -> String {
    let list: Vec<&str> = names.iter().map(String::as_str).collect();
    format!("{LABEL_K8S_SERVICE_NAME} in ({})", list.join(","))
}

/// Keeps member `ctx.member`'s Service and slice watches in step with its exports: starts
/// the Service watcher once the exports listed, lists each bucket of slices again when its
/// names change, and reads by name the Services exported after the Service watcher listed.
pub(crate) async fn keep_in_step(client: Client, ctx: Ctx) {
    let sel = ctx.member.selection.clone();
    let mut services_watch: Option<AbortOnDrop> = None;
    let mut running: Vec<Option<Bucket>> = Vec::new();
    let mut gets: JoinSet<(ObjKey, u64, Result<Option<Service>, kube::Error>)> = JoinSet::new();
    let mut get_retry = WatchRetry::new(ctx.retry_max);
    let mut gets_after: Option<Instant> = None;
    let services_api = |ns: &str| Api::<Service>::namespaced(client.clone(), ns);
    loop {
        let mut due: Option<Instant> = gets_after;
        if services_watch.is_none() && sel.exports.listed() {
            services_watch = Some(AbortOnDrop(tokio::spawn({
                let (client, ctx, sink) =
                    (client.clone(), ctx.clone(), Arc::new(Services(sel.clone())));
                async move {
                    watch(
                        "Service",
                        Api::<Service>::all(client),
                        watcher::Config::default(),
                        ctx,
                        sink,
                        |svc| shape(&svc),
                        false,
                    )
                    .await;
                }
            })));
        }

        // Slice watches: one per bucket of names.
        let names: Vec<String> = sel.lock().names.keys().cloned().collect();
        let n = buckets(names.len());
        if n != running.len() {
            if n == 0 {
                // Nothing exported: nothing selected, nothing held.
                ctx.member.forget("EndpointSlice");
                sel.lock().listed_names.clear();
                sel.slices.replace_part(|_, _| true, HashMap::new());
            }
            tracing::info!(cluster = %ctx.member.id, services = names.len(), watches = n, "reading the EndpointSlices of exported Services only");
            running = (0..n).map(|_| None).collect();
        }
        let mut want: Vec<BTreeSet<String>> = vec![BTreeSet::new(); n];
        for name in names {
            want[bucket_of(&name, n)].insert(name);
        }
        for (b, names) in want.into_iter().enumerate() {
            if running[b].as_ref().is_some_and(|r| r.names == names) {
                continue;
            }
            if let Some(r) = &running[b] {
                let at = r.started + RESTART_GAP;
                if at > Instant::now() {
                    due = Some(due.map_or(at, |d| d.min(at)));
                    continue;
                }
            }
            let sink = Arc::new(Slices {
                selection: sel.clone(),
                names: names.clone(),
                bucket: b,
                buckets: n,
            });
            let config = watcher::Config::default().labels(&selector(&names));
            let (client, ctx2) = (client.clone(), ctx.clone());
            running[b] = Some(Bucket {
                names,
                started: Instant::now(),
                _task: AbortOnDrop(tokio::spawn(async move {
                    watch(
                        "EndpointSlice",
                        Api::<EndpointSlice>::all(client),
                        config,
                        ctx2,
                        sink,
                        lean_member_slice,
                        false,
                    )
                    .await;
                })),
            });
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
                    }
                    let api = services_api(&k.0);
                    gets.spawn(async move {
                        let got = api.get_opt(&k.1).await;
                        (k, since, got)
                    });
                }
            }
        }

        tokio::select! {
            () = sel.changed.notified() => {}
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {}
            Some(done) = gets.join_next(), if !gets.is_empty() => {
                let Ok((k, since, got)) = done else { continue };
                let mut st = sel.lock();
                let Some(w) = st.wanted.get_mut(&k).filter(|w| w.since == since) else {
                    continue;
                };
                w.fetching = false;
                match got {
                    Ok(svc) => {
                        get_retry.reset();
                        w.service_known = true;
                        let ready = st.release([k.clone()]);
                        drop(st);
                        if let Some(svc) = svc
                            && !sel.services.contains(&k)
                        {
                            sel.services.apply(k, Arc::new(shape(&svc)));
                        }
                        sel.pass_on(ready);
                    }
                    Err(e) => {
                        drop(st);
                        let wait = get_retry.next().unwrap_or(ctx.retry_max);
                        tracing::warn!(cluster = %ctx.member.id, namespace = %k.0, name = %k.1, error = %e, retry_ms = wait.as_millis() as u64, "reading an exported Service failed; trying again");
                        gets_after = Some(Instant::now() + wait);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::members::Changes;

    fn selection() -> Arc<Selection> {
        let changes = Arc::new(Changes::default());
        Arc::new(Selection::new(
            Arc::new(Store::new(changes.clone(), None)),
            Arc::new(Store::new(changes.clone(), None)),
            Arc::new(Store::new(changes, Some(member_slice_service))),
            Arc::new(Notify::new()),
        ))
    }

    fn key(ns: &str, name: &str) -> ObjKey {
        (ns.into(), name.into())
    }

    fn export() -> Arc<LeanExport> {
        Arc::new(LeanExport::new(
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": "x", "namespace": "shop", "generation": 1,
                              "creationTimestamp": "2026-01-01T00:00:00Z" }
            }))
            .unwrap(),
        ))
    }

    fn slice(ns: &str, name: &str, service: &str) -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": name, "namespace": ns,
                              "labels": { "kubernetes.io/service-name": service } },
                "addressType": "IPv4", "endpoints": []
            }))
            .unwrap(),
        )
    }

    fn slices_sink(sel: &Arc<Selection>, names: &[&str]) -> Slices {
        let names: BTreeSet<String> = names.iter().map(|n| n.to_string()).collect();
        let n = buckets(sel.lock().names.len());
        Slices {
            selection: sel.clone(),
            bucket: bucket_of(names.iter().next().unwrap(), n),
            buckets: n,
            names,
        }
    }

    #[test]
    fn names_spread_over_power_of_two_buckets_and_only_service_names_are_selected() {
        assert_eq!(buckets(0), 0);
        assert_eq!(buckets(1), 1);
        assert_eq!(buckets(NAMES_PER_WATCH), 1);
        assert_eq!(buckets(NAMES_PER_WATCH + 1), 2);
        assert_eq!(buckets(5 * NAMES_PER_WATCH), 8);
        assert_eq!(bucket_of("web", 8), bucket_of("web", 8));
        assert!((0..1000).all(|i| bucket_of(&format!("s{i}"), 8) < 8));
        for ok in ["web", "a", "a-1", &"a".repeat(63)] {
            assert!(selectable(ok), "{ok}");
        }
        for bad in [
            "",
            "Web",
            "1web",
            "web-",
            "web.v2",
            "a,b",
            "a)",
            "web in",
            &"a".repeat(64),
        ] {
            assert!(!selectable(bad), "{bad}");
        }
        let names: BTreeSet<String> = ["a".to_string(), "b".to_string()].into();
        assert_eq!(selector(&names), "kubernetes.io/service-name in (a,b)");
    }

    #[test]
    fn an_export_is_passed_on_once_its_service_and_slices_are_read() {
        let sel = selection();
        let web = key("shop", "web");
        Sink::replace(&*sel, HashMap::from([(web.clone(), export())]));
        assert!(sel.exports.listed() && !sel.exports.contains(&web));
        assert_eq!(sel.held_back(), 1);

        // Services listed (the export was wanted before the list began): known.
        let services = Services(sel.clone());
        services.begin();
        assert!(services.keep(&web, &ServiceShape::default()));
        assert!(!services.keep(&key("shop", "idle"), &ServiceShape::default()));
        services.replace(HashMap::from([
            (web.clone(), Arc::new(ServiceShape::default())),
            (key("shop", "idle"), Arc::new(ServiceShape::default())),
        ]));
        assert!(sel.services.contains(&web) && !sel.services.contains(&key("shop", "idle")));
        assert!(!sel.exports.contains(&web), "its slices are not read yet");
        assert!(!sel.settled());

        // Its bucket listed: passed on, and the member is settled.
        slices_sink(&sel, &["web"]).replace(HashMap::from([(
            key("shop", "web-1"),
            slice("shop", "web-1", "web"),
        )]));
        assert!(sel.exports.contains(&web));
        assert_eq!(sel.held_back(), 0);
        assert!(sel.settled());

        // Another namespace exports the same name: its slices were listed with the name.
        let other = key("other", "web");
        Sink::apply(&*sel, other.clone(), export());
        assert!(sel.lock().wanted[&other].slices_known);
        assert!(!sel.lock().wanted[&other].service_known, "read by name");
        assert!(!sel.exports.contains(&other));

        // Unexported: its Service is dropped, the export gone.
        Sink::remove(&*sel, &web);
        assert!(!sel.exports.contains(&web) && !sel.services.contains(&web));
        assert!(sel.settled(), "settled stays");
    }

    #[test]
    fn a_service_exported_while_services_are_listed_is_left_to_a_read_by_name() {
        let sel = selection();
        Sink::replace(&*sel, HashMap::new());
        let services = Services(sel.clone());
        services.begin();
        let late = key("shop", "late");
        // Wanted after the list began: the list may have passed over its Service.
        Sink::apply(&*sel, late.clone(), export());
        services.replace(HashMap::new());
        assert!(!sel.lock().wanted[&late].service_known);
        assert!(sel.services.listed());
    }

    #[test]
    fn an_export_no_service_can_match_is_passed_on_at_once() {
        let sel = selection();
        Sink::replace(&*sel, HashMap::new());
        let odd = key("shop", "web.v2");
        Sink::apply(&*sel, odd.clone(), export());
        assert!(sel.exports.contains(&odd));
        assert!(sel.lock().names.is_empty(), "never in a selector");
    }
}
