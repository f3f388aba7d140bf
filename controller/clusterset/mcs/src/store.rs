//! The controller's in-memory copies of one kind of object ([`Store`]), which service each
//! belongs to, and what changed since the last pass ([`Changes`]); [`Sink`] is what a
//! watcher writes into: a store, or what stands before one.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicBool, Ordering},
    },
};

use crate::budget::Admission;
use crate::objects::ObjKey;

/// The objects of one kind, and which service each belongs to.
#[derive(Debug)]
pub struct Objects<K> {
    /// By (namespace, name).
    pub map: HashMap<ObjKey, Arc<K>>,
    /// (namespace, service) → the keys of its objects, for kinds with more than one object
    /// per service (EndpointSlices, by their service-name label).
    pub by_service: HashMap<ObjKey, BTreeSet<ObjKey>>,
    /// How many times it changed (an object stored or removed, a list replaced): what is
    /// derived from all of its objects is computed again only when this moved.
    pub generation: u64,
}

impl<K> Default for Objects<K> {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            by_service: HashMap::new(),
            generation: 0,
        }
    }
}

/// Which service an object belongs to, for the reconciler's dirty set.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Touch {
    /// (namespace, service).
    Service(ObjKey),
    /// Every service of a namespace (a Namespace object).
    Namespace(String),
}

/// A watched copy of one kind.
#[derive(Debug)]
pub struct Store<K> {
    objects: RwLock<Objects<K>>,
    /// What may be kept of each object (`None`: all of it).
    admission: Option<Arc<dyn Admission<K>>>,
    /// Set once its watcher has completed a first list.
    listed: AtomicBool,
    /// The service an object (under its key) belongs to (`None`: its own key is the
    /// service's).
    service_of: Option<fn(&ObjKey, &K) -> Option<ObjKey>>,
    /// Where each change is recorded for the next pass.
    changes: Arc<Changes>,
}

impl<K> Store<K> {
    /// An empty store whose objects belong to the service of their own key (exports,
    /// Services, imports; a cluster-scoped key, a Namespace, stands for all of its services),
    /// or to `service_of` (slices by label).
    pub fn new(
        changes: Arc<Changes>,
        service_of: Option<fn(&ObjKey, &K) -> Option<ObjKey>>,
    ) -> Self {
        Self {
            objects: RwLock::new(Objects::default()),
            admission: None,
            listed: AtomicBool::new(false),
            service_of,
            changes,
        }
    }

    /// The same store, keeping of each object what `a` admits.
    pub fn with_admission(mut self, a: Arc<dyn Admission<K>>) -> Self {
        self.admission = Some(a);
        self
    }

    /// Whether its watcher has listed once.
    pub fn listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
    }

    /// Every object now (a copy of the map).
    pub fn snapshot(&self) -> HashMap<ObjKey, Arc<K>> {
        self.read().map.clone()
    }

    /// The objects, read-locked.
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Objects<K>> {
        self.objects.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Objects<K>> {
        self.objects.write().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self, key: &ObjKey, o: &K) -> Option<Touch> {
        match self.service_of {
            None if key.0.is_empty() => Some(Touch::Namespace(key.1.clone())),
            None => Some(Touch::Service(key.clone())),
            Some(f) => f(key, o).map(Touch::Service),
        }
    }

    /// Stores `o` under `key`; the services it leaves and joins are marked changed.
    pub fn apply(&self, key: ObjKey, o: Arc<K>) {
        let mut w = self.write();
        let o = match &self.admission {
            Some(a) => a.admit(&key, o),
            None => o,
        };
        w.generation += 1;
        let (leaves, joins) = self.insert(&mut w, key, o);
        drop(w);
        self.changes.mark(leaves);
        self.changes.mark(joins);
    }

    /// Puts `o` under `key` in `w`, keeping the service index: (the service it left, the
    /// one it joined).
    fn insert(&self, w: &mut Objects<K>, key: ObjKey, o: Arc<K>) -> (Option<Touch>, Option<Touch>) {
        let joins = self.touch(&key, &o);
        let old = w.map.insert(key.clone(), o);
        let leaves = old.as_ref().and_then(|old| self.touch(&key, old));
        if leaves != joins {
            if let Some(Touch::Service(svc)) = &leaves {
                unindex(&mut w.by_service, svc, &key);
            }
            if let (Some(Touch::Service(svc)), Some(_)) = (&joins, self.service_of) {
                w.by_service.entry(svc.clone()).or_default().insert(key);
            }
        }
        (leaves, joins)
    }

    /// Removes `key`; its service is marked changed.
    pub fn remove(&self, key: &ObjKey) {
        let mut w = self.write();
        let Some(old) = w.map.remove(key) else { return };
        w.generation += 1;
        if let Some(a) = &self.admission {
            a.release(key);
        }
        let leaves = self.touch(key, &old);
        if let Some(Touch::Service(svc)) = &leaves {
            unindex(&mut w.by_service, svc, key);
        }
        drop(w);
        self.changes.mark(leaves);
    }

    /// Replaces the objects for which `in_part` holds with `fresh` (a completed list of one
    /// part of the kind: the slices of some services, the Services wanted); only the services
    /// they leave and join are marked changed. Sets the store listed.
    pub fn replace_part(
        &self,
        in_part: impl Fn(&ObjKey, &K) -> bool,
        fresh: HashMap<ObjKey, Arc<K>>,
    ) {
        let mut w = self.write();
        let gone: Vec<ObjKey> = w
            .map
            .iter()
            .filter(|(k, o)| in_part(k, o) && !fresh.contains_key(*k))
            .map(|(k, _)| k.clone())
            .collect();
        let mut touched = Vec::with_capacity(gone.len() + fresh.len());
        for k in gone {
            if let Some(old) = w.map.remove(&k) {
                let leaves = self.touch(&k, &old);
                if let Some(Touch::Service(svc)) = &leaves {
                    unindex(&mut w.by_service, svc, &k);
                }
                touched.push(leaves);
            }
        }
        for (k, o) in fresh {
            let (leaves, joins) = self.insert(&mut w, k, o);
            touched.push(leaves);
            touched.push(joins);
        }
        w.generation += 1;
        drop(w);
        for t in touched {
            self.changes.mark(t);
        }
        self.listed.store(true, Ordering::Release);
    }

    /// Whether it holds `key`.
    pub fn contains(&self, key: &ObjKey) -> bool {
        self.read().map.contains_key(key)
    }

    /// Replaces every object (a completed list); the next pass is a full one.
    pub fn replace(&self, mut fresh: HashMap<ObjKey, Arc<K>>) {
        let mut w = self.write();
        if let Some(a) = &self.admission {
            a.reset();
            let mut order: Vec<(i64, ObjKey)> =
                fresh.iter().map(|(k, o)| (a.rank(o), k.clone())).collect();
            order.sort_unstable();
            for (_, k) in order {
                if let Some(o) = fresh.remove(&k) {
                    let kept = a.admit(&k, o);
                    fresh.insert(k, kept);
                }
            }
        }
        let mut by_service: HashMap<ObjKey, BTreeSet<ObjKey>> = HashMap::new();
        if let Some(f) = self.service_of {
            for (k, o) in &fresh {
                if let Some(svc) = f(k, o) {
                    by_service.entry(svc).or_default().insert(k.clone());
                }
            }
        }
        *w = Objects {
            map: fresh,
            by_service,
            generation: w.generation + 1,
        };
        drop(w);
        self.changes.all();
        self.listed.store(true, Ordering::Release);
    }
}

/// Where a watcher puts what it reads: a [`Store`], or what stands before one (the
/// [`crate::selection`] that keeps only what is exported).
pub trait Sink<V>: Send + Sync {
    /// A list starts.
    fn begin(&self) {}
    /// Whether an object of the list is worth holding until the list completes.
    fn keep(&self, _key: &ObjKey, _o: &V) -> bool {
        true
    }
    /// An object was created or changed.
    fn apply(&self, key: ObjKey, o: Arc<V>);
    /// An object was deleted.
    fn remove(&self, key: &ObjKey);
    /// A list completed with these objects.
    fn replace(&self, fresh: HashMap<ObjKey, Arc<V>>);
}

impl<V: Send + Sync> Sink<V> for Store<V> {
    fn apply(&self, key: ObjKey, o: Arc<V>) {
        Store::apply(self, key, o);
    }
    fn remove(&self, key: &ObjKey) {
        Store::remove(self, key);
    }
    fn replace(&self, fresh: HashMap<ObjKey, Arc<V>>) {
        Store::replace(self, fresh);
    }
}

fn unindex(by_service: &mut HashMap<ObjKey, BTreeSet<ObjKey>>, svc: &ObjKey, key: &ObjKey) {
    if let Some(set) = by_service.get_mut(svc) {
        set.remove(key);
        if set.is_empty() {
            by_service.remove(svc);
        }
    }
}

/// What changed since the last pass: the services to compute again, or everything.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dirty {
    /// Everything (a re-list, a member coming or going, a resync).
    pub all: bool,
    /// Services and namespaces whose objects changed.
    pub touched: BTreeSet<Touch>,
}

/// Where the watchers record what changed; the reconciler takes it at each pass.
#[derive(Debug, Default)]
pub struct Changes(Mutex<Dirty>);

impl Changes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Dirty> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `t` changed.
    pub fn mark(&self, t: Option<Touch>) {
        if let Some(t) = t {
            let mut d = self.lock();
            if !d.all {
                d.touched.insert(t);
            }
        }
    }

    /// Records that everything is to be computed again.
    pub fn all(&self) {
        let mut d = self.lock();
        d.all = true;
        d.touched.clear();
    }

    /// What changed since the last call.
    pub fn take(&self) -> Dirty {
        std::mem::take(&mut *self.lock())
    }
}
