//! The index: Kubernetes objects in, forwarding table and minimal diffs out, incrementally.
//!
//! Every change marks the services it touches dirty; [`Index::flush`] recomputes only those
//! (O(size of the change)), re-decides the frontends they claim or claimed, and returns the
//! [`TableDiff`] against the table the dataplane already has. [`compute`] is the stateless
//! form: the same result from scratch.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::{
    Backend, ForwardingTable, Frontend, Service, TableDiff,
    input::{ImportInput, ServiceRef, SliceInput},
    select,
    validate::{self, Reason, Rejection, ValidImport, ValidSlice},
};

/// Node-level settings of the index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// This cluster's id (local endpoints are preferred). Empty: no preference.
    pub cluster_id: String,
    /// This node's zone (for `trafficDistribution: PreferClose`).
    pub zone: Option<String>,
}

type SliceKey = (String, String);
/// An import as given, validated, and what validation said.
type ImportEntry = (ImportInput, Option<ValidImport>, Vec<Rejection>);
/// A slice's service, its validated form, and what validation said.
type SliceEntry = (Option<ServiceRef>, Option<ValidSlice>, Vec<Rejection>);

/// What one service contributes: its frontends with their candidates, and the problems found
/// while matching its slices to its ports.
#[derive(Clone, Debug, Default)]
struct Derived {
    age_key: Option<(String, ServiceRef)>,
    frontends: BTreeMap<Frontend, Service>,
    rejections: Vec<Rejection>,
}

/// The incremental index. See the module docs.
#[derive(Debug, Default)]
pub struct Index {
    node: NodeConfig,
    stale: BTreeSet<String>,
    imports: HashMap<ServiceRef, ImportEntry>,
    slices: HashMap<SliceKey, SliceEntry>,
    slices_by_service: HashMap<ServiceRef, BTreeSet<SliceKey>>,
    derived: HashMap<ServiceRef, Derived>,
    claims: HashMap<Frontend, BTreeSet<(String, ServiceRef)>>,
    conflicts: BTreeMap<Frontend, Vec<Rejection>>,
    table: ForwardingTable,
    dirty: BTreeSet<ServiceRef>,
}

impl Index {
    /// An empty index for a node.
    pub fn new(node: NodeConfig) -> Self {
        Self {
            node,
            ..Default::default()
        }
    }

    /// The node settings.
    pub fn node(&self) -> &NodeConfig {
        &self.node
    }

    /// Changes this cluster's id (e.g. the ClusterProperty changed). Every service is dirty.
    pub fn set_cluster_id(&mut self, id: &str) {
        if self.node.cluster_id != id {
            self.node.cluster_id = id.to_string();
            self.mark_all_dirty();
        }
    }

    /// Adds or replaces a ServiceImport.
    pub fn upsert_import(&mut self, input: ImportInput) {
        let key = input.service_ref();
        if self
            .imports
            .get(&key)
            .is_some_and(|(old, _, _)| old == &input)
        {
            return;
        }
        let mut rejections = Vec::new();
        let valid = validate::import(&input, &mut rejections);
        self.imports.insert(key.clone(), (input, valid, rejections));
        self.dirty.insert(key);
    }

    /// Removes a ServiceImport.
    pub fn delete_import(&mut self, namespace: &str, name: &str) {
        let key = ServiceRef::new(namespace, name);
        if self.imports.remove(&key).is_some() {
            self.dirty.insert(key);
        }
    }

    /// Adds or replaces an EndpointSlice.
    pub fn upsert_slice(&mut self, input: SliceInput) {
        let key = (input.namespace.clone(), input.name.clone());
        let mut rejections = Vec::new();
        let valid = validate::slice(&input, &mut rejections);
        let service = validate::slice_service(&input);
        if let Some((Some(old_service), old_valid, old_rej)) = self.slices.get(&key)
            && Some(old_service) == service.as_ref()
            && old_valid == &valid
            && old_rej == &rejections
        {
            return;
        }
        self.remove_slice_entry(&key);
        if let Some(svc) = &service {
            self.slices_by_service
                .entry(svc.clone())
                .or_default()
                .insert(key.clone());
            self.dirty.insert(svc.clone());
        }
        self.slices.insert(key, (service, valid, rejections));
    }

    /// Removes an EndpointSlice.
    pub fn delete_slice(&mut self, namespace: &str, name: &str) {
        self.remove_slice_entry(&(namespace.to_string(), name.to_string()));
    }

    fn remove_slice_entry(&mut self, key: &SliceKey) {
        if let Some((Some(svc), _, _)) = self.slices.remove(key) {
            if let Some(set) = self.slices_by_service.get_mut(&svc) {
                set.remove(key);
                if set.is_empty() {
                    self.slices_by_service.remove(&svc);
                }
            }
            self.dirty.insert(svc);
        }
    }

    /// Marks a cluster's endpoints stale (dropped from every frontend) or fresh again: the one
    /// call for a cluster whose lease expired.
    pub fn set_cluster_stale(&mut self, cluster: &str, stale: bool) {
        let changed = if stale {
            self.stale.insert(cluster.to_string())
        } else {
            self.stale.remove(cluster)
        };
        if changed {
            let affected: Vec<ServiceRef> = self
                .slices
                .values()
                .filter_map(|(svc, valid, _)| {
                    valid
                        .as_ref()
                        .filter(|v| v.cluster == cluster)
                        .and(svc.clone())
                })
                .collect();
            self.dirty.extend(affected);
        }
    }

    fn mark_all_dirty(&mut self) {
        self.dirty.extend(self.imports.keys().cloned());
    }

    /// Whether changes are waiting for [`Index::flush`].
    pub fn has_pending(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Recomputes what changed since the last flush and returns the minimal diff.
    pub fn flush(&mut self) -> TableDiff {
        let dirty = std::mem::take(&mut self.dirty);
        let mut touched: BTreeSet<Frontend> = BTreeSet::new();
        for svc in dirty {
            let new = self.derive(&svc);
            let old = self.derived.remove(&svc).unwrap_or_default();
            if let Some(age) = &old.age_key {
                for f in old.frontends.keys() {
                    if let Some(set) = self.claims.get_mut(f) {
                        set.remove(age);
                        if set.is_empty() {
                            self.claims.remove(f);
                        }
                    }
                    touched.insert(*f);
                }
            }
            if let Some(age) = &new.age_key {
                for f in new.frontends.keys() {
                    self.claims.entry(*f).or_default().insert(age.clone());
                    touched.insert(*f);
                }
            }
            if new.age_key.is_some() || !new.rejections.is_empty() {
                self.derived.insert(svc, new);
            }
        }
        let mut diff = TableDiff::default();
        for f in touched {
            let winner = self.claims.get(&f).and_then(|set| {
                let mut it = set.iter();
                let first = it.next()?;
                let losers: Vec<Rejection> = it
                    .map(|(_, loser)| Rejection {
                        object: format!("ServiceImport {loser}"),
                        reason: Reason::VipConflict,
                        message: format!(
                            "frontend {f} is claimed by older ServiceImport {}",
                            first.1
                        ),
                    })
                    .collect();
                Some((first.1.clone(), losers))
            });
            match winner {
                Some((svc, losers)) => {
                    if losers.is_empty() {
                        self.conflicts.remove(&f);
                    } else {
                        self.conflicts.insert(f, losers);
                    }
                    let value = self.derived[&svc].frontends[&f].clone();
                    if self.table.frontends.get(&f) != Some(&value) {
                        self.table.frontends.insert(f, value.clone());
                        diff.upsert.insert(f, value);
                    }
                }
                None => {
                    self.conflicts.remove(&f);
                    if self.table.frontends.remove(&f).is_some() {
                        diff.remove.push(f);
                    }
                }
            }
        }
        diff
    }

    /// The service's frontends and candidates from its import and slices.
    fn derive(&self, svc: &ServiceRef) -> Derived {
        let mut out = Derived::default();
        let Some((_, Some(import), _)) = self.imports.get(svc) else {
            return out;
        };
        out.age_key = Some(import.age_key.clone());
        let slices: Vec<&ValidSlice> = self
            .slices_by_service
            .get(svc)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k).and_then(|(_, v, _)| v.as_ref()))
            .filter(|s| !self.stale.contains(&s.cluster))
            .collect();
        let mut unmatched: BTreeSet<(String, String)> = BTreeSet::new();
        for fe in &import.frontends {
            let frontend = Frontend {
                vip: fe.vip,
                port: fe.port,
                protocol: fe.protocol,
            };
            // Best copy of each (address, port): ready, serving, local, then cluster name.
            let mut best: BTreeMap<(std::net::IpAddr, u16), Backend> = BTreeMap::new();
            for s in slices.iter().filter(|s| s.v4 == fe.vip.is_ipv4()) {
                let Some(&(_, _, target)) = s
                    .ports
                    .iter()
                    .find(|(n, p, _)| n == &fe.port_name && *p == fe.protocol)
                else {
                    unmatched.insert((s.cluster.clone(), port_desc(fe)));
                    continue;
                };
                for ep in &s.endpoints {
                    let b = Backend {
                        address: ep.address,
                        port: target,
                        cluster: s.cluster.clone(),
                        zone: ep.zone.clone(),
                        ready: ep.ready,
                        serving: ep.serving,
                        terminating: ep.terminating,
                        selected: false,
                    };
                    let k = (b.address, b.port);
                    let better = match best.get(&k) {
                        None => true,
                        Some(cur) => {
                            rank(&b, &self.node.cluster_id) < rank(cur, &self.node.cluster_id)
                        }
                    };
                    if better {
                        best.insert(k, b);
                    }
                }
            }
            let mut backends: Vec<Backend> = best.into_values().collect();
            select::mark_selected(&mut backends, &self.node, import.prefer_close);
            backends.sort_by(|a, b| {
                (&a.cluster, a.address, a.port).cmp(&(&b.cluster, b.address, b.port))
            });
            out.frontends.insert(
                frontend,
                Service {
                    service: svc.to_string(),
                    affinity: import.affinity,
                    backends,
                },
            );
        }
        // Slices whose ports match none of the import's, said once per slice.
        for key in self.slices_by_service.get(svc).into_iter().flatten() {
            let Some((_, Some(s), _)) = self.slices.get(key) else {
                continue;
            };
            let matched_any = import.frontends.iter().any(|fe| {
                s.v4 == fe.vip.is_ipv4()
                    && s.ports
                        .iter()
                        .any(|(n, p, _)| n == &fe.port_name && *p == fe.protocol)
            });
            let relevant = import.frontends.iter().any(|fe| s.v4 == fe.vip.is_ipv4());
            if relevant && !matched_any && unmatched.iter().any(|(c, _)| c == &s.cluster) {
                out.rejections.push(Rejection {
                    object: format!("EndpointSlice {}/{}", key.0, key.1),
                    reason: Reason::NoMatchingPort,
                    message: format!(
                        "no port matches a port of ServiceImport {svc} by name and protocol ({})",
                        import
                            .frontends
                            .iter()
                            .map(port_desc)
                            .collect::<BTreeSet<_>>()
                            .into_iter()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
        out
    }

    /// The current table (as of the last flush).
    pub fn table(&self) -> &ForwardingTable {
        &self.table
    }

    /// Everything rejected or trimmed, sorted by object then reason.
    pub fn rejections(&self) -> Vec<Rejection> {
        let mut all: Vec<Rejection> = self
            .imports
            .values()
            .flat_map(|(_, _, r)| r.iter().cloned())
            .chain(self.slices.values().flat_map(|(_, _, r)| r.iter().cloned()))
            .chain(
                self.derived
                    .values()
                    .flat_map(|d| d.rejections.iter().cloned()),
            )
            .chain(self.conflicts.values().flatten().cloned())
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// Number of ServiceImports and EndpointSlices held.
    pub fn object_counts(&self) -> (usize, usize) {
        (self.imports.len(), self.slices.len())
    }
}

fn port_desc(fe: &validate::ImportFrontend) -> String {
    format!(
        "{}/{}",
        fe.port_name.as_deref().unwrap_or("<unnamed>"),
        fe.protocol
    )
}

/// Lower is better: ready, serving, local, then cluster name.
fn rank<'a>(b: &'a Backend, local: &str) -> (bool, bool, bool, &'a str) {
    (!b.ready, !b.serving, b.cluster != local, b.cluster.as_str())
}

/// The table and rejections of a set of objects, from scratch.
pub fn compute(
    node: NodeConfig,
    imports: impl IntoIterator<Item = ImportInput>,
    slices: impl IntoIterator<Item = SliceInput>,
) -> (ForwardingTable, Vec<Rejection>) {
    let mut index = Index::new(node);
    for i in imports {
        index.upsert_import(i);
    }
    for s in slices {
        index.upsert_slice(s);
    }
    index.flush();
    (index.table.clone(), index.rejections())
}
