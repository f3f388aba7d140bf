//! The index: Kubernetes objects in, forwarding table and minimal diffs out, incrementally.
//!
//! Every change marks the services it touches dirty; [`Index::flush`] recomputes only those
//! (O(size of the change)), re-decides the VIPs they claim or claimed, and returns the
//! [`TableDiff`] against the table the dataplane already has. [`compute`] is the stateless
//! form: the same result from scratch.
//!
//! Ownership: a VIP belongs to one import, with all its ports: the oldest claimant by
//! [`validate::AgeKey`] (creationTimestamp, then uid, then name). Every other claimant loses
//! the whole VIP (`vip_conflict`). Capacity: while the table's totals are within
//! [`Limits`](crate::guard::Limits), every import is admitted; past them, namespaces share the
//! table fairly (dominant-resource fairness over the frontends and backends caps), each one's
//! imports oldest first, and what does not fit is rejected (`over_capacity`) — a walk over all
//! imports, done only while over a cap.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
    sync::Arc,
};

use crate::{
    Backend, ForwardingTable, Frontend, Protocol, Service, TableDiff,
    dns::{DnsEndpoint, DnsPort, ServiceRecords},
    input::{ImportInput, ServiceRef, SliceInput},
    intern::Strings,
    node::NodeConfig,
    select,
    validate::{self, AgeKey, Reason, Rejection, ValidImport, ValidSlice},
};

type SliceKey = (String, String);
/// An import as validated, and what validation said (the input itself is not kept: validation
/// is a function of it and the node's guard, so equal results mean nothing changed).
type ImportEntry = (Option<ValidImport>, Vec<Rejection>);
/// A slice's service, its validated form, and what validation said.
type SliceEntry = (Option<ServiceRef>, Option<ValidSlice>, Vec<Rejection>);

/// What one service contributes: its frontends with their candidates, and the problems found
/// while matching its slices to its ports. Small sorted vectors, not trees: a service has one
/// or two VIPs and a few ports, and a tree node costs hundreds of bytes even when it holds one.
#[derive(Clone, Debug, Default)]
struct Derived {
    age_key: Option<AgeKey>,
    /// The import's VIPs (distinct).
    vips: Vec<IpAddr>,
    /// Sorted by frontend.
    frontends: Vec<(Frontend, Arc<Service>)>,
    /// Backends summed over `frontends`.
    backends: usize,
    rejections: Vec<Rejection>,
}

/// The incremental index. See the module docs.
#[derive(Debug, Default)]
pub struct Index {
    node: NodeConfig,
    stale: BTreeSet<String>,
    imports: HashMap<ServiceRef, ImportEntry>,
    /// Keyed by `(namespace, name)`, shared with `slices_by_service`.
    slices: HashMap<Arc<SliceKey>, SliceEntry>,
    /// The slices naming each service (distinct, sorted; a service has a few per cluster).
    slices_by_service: HashMap<ServiceRef, Vec<Arc<SliceKey>>>,
    derived: HashMap<ServiceRef, Derived>,
    /// Who claims each VIP, oldest first (distinct; almost always one).
    claims: HashMap<IpAddr, Vec<AgeKey>>,
    /// Cluster, zone and node names, one allocation each however many slices name them.
    strings: Strings,
    conflicts: BTreeMap<IpAddr, Vec<Rejection>>,
    /// Frontends and backends over every derived import (admitted or not).
    totals: (usize, usize),
    /// Imports not admitted because the table is full.
    over_capacity: BTreeMap<ServiceRef, Rejection>,
    table: ForwardingTable,
    /// Backends summed over `table` (kept as it changes, for the gauges).
    table_backends: usize,
    /// Bumped whenever what [`Index::rejections`] returns may have changed.
    rejections_version: u64,
    dirty: BTreeSet<ServiceRef>,
    /// Services whose DNS records may have changed since [`Index::take_dns_changes`]
    /// (`None`: DNS is not tracked).
    dns_changed: Option<BTreeSet<ServiceRef>>,
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
        let mut rejections = Vec::new();
        let valid = validate::import(&input, &self.node.guard, &mut rejections);
        if self
            .imports
            .get(&key)
            .is_some_and(|(old_valid, old_rej)| old_valid == &valid && old_rej == &rejections)
        {
            return;
        }
        let new_rejects = !rejections.is_empty();
        let old = self.imports.insert(key.clone(), (valid, rejections));
        if new_rejects || old.is_some_and(|(_, r)| !r.is_empty()) {
            self.rejections_changed();
        }
        self.dirty.insert(key);
    }

    fn rejections_changed(&mut self) {
        self.rejections_version = self.rejections_version.wrapping_add(1);
    }

    /// Removes a ServiceImport.
    pub fn delete_import(&mut self, namespace: &str, name: &str) {
        let key = ServiceRef::new(namespace, name);
        if let Some((_, rejections)) = self.imports.remove(&key) {
            if !rejections.is_empty() {
                self.rejections_changed();
            }
            self.dirty.insert(key);
        }
    }

    /// Adds or replaces an EndpointSlice.
    pub fn upsert_slice(&mut self, input: SliceInput) {
        let key = (input.namespace.clone(), input.name.clone());
        let mut rejections = Vec::new();
        let valid = validate::slice(&input, &self.node.guard, &mut self.strings, &mut rejections);
        let service = validate::slice_service(&input);
        if let Some((old_service, old_valid, old_rej)) = self.slices.get(&key)
            && old_service == &service
            && old_valid == &valid
            && old_rej == &rejections
        {
            return;
        }
        self.remove_slice_entry(&key);
        let key = Arc::new(key);
        if let Some(svc) = &service {
            let keys = self.slices_by_service.entry(svc.clone()).or_default();
            // Most services have a slice or two per cluster: no spare room for those.
            if keys.len() < 4 {
                keys.reserve_exact(1);
            }
            // Kept sorted: what depends on the order of a service's slices (which slice's
            // ports an endpoint listed twice gets in DNS) is the same whatever order they
            // came in, as in a fresh compute.
            let at = keys.binary_search(&key).unwrap_or_else(|at| at);
            keys.insert(at, key.clone());
            self.dirty.insert(svc.clone());
        }
        if !rejections.is_empty() {
            self.rejections_changed();
        }
        self.slices.insert(key, (service, valid, rejections));
    }

    /// Removes an EndpointSlice.
    pub fn delete_slice(&mut self, namespace: &str, name: &str) {
        self.remove_slice_entry(&(namespace.to_string(), name.to_string()));
    }

    fn remove_slice_entry(&mut self, key: &SliceKey) {
        let Some((service, _, rejections)) = self.slices.remove(key) else {
            return;
        };
        if !rejections.is_empty() {
            self.rejections_changed();
        }
        if let Some(svc) = service {
            if let Some(set) = self.slices_by_service.get_mut(&svc) {
                set.retain(|k| **k != *key);
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
                        .filter(|v| &*v.cluster == cluster)
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
        if let Some(d) = self.dns_changed.as_mut() {
            d.extend(dirty.iter().cloned());
        }
        let mut touched: BTreeSet<IpAddr> = BTreeSet::new();
        for svc in dirty {
            let new = self.derive(&svc);
            let old = self.derived.remove(&svc).unwrap_or_default();
            if let Some(age) = &old.age_key {
                for vip in &old.vips {
                    if let Some(set) = self.claims.get_mut(vip) {
                        if let Ok(at) = set.binary_search(age) {
                            set.remove(at);
                        }
                        if set.is_empty() {
                            self.claims.remove(vip);
                        }
                    }
                    touched.insert(*vip);
                }
                self.totals.0 -= old.frontends.len();
                self.totals.1 -= old.backends;
            }
            if let Some(age) = &new.age_key {
                for vip in &new.vips {
                    let set = self.claims.entry(*vip).or_default();
                    if let Err(at) = set.binary_search(age) {
                        set.insert(at, age.clone());
                    }
                    touched.insert(*vip);
                }
                self.totals.0 += new.frontends.len();
                self.totals.1 += new.backends;
            }
            if old.rejections != new.rejections {
                self.rejections_changed();
            }
            if new.age_key.is_some() || !new.rejections.is_empty() {
                self.derived.insert(svc, new);
            }
        }
        let over = self.admission();
        if over != self.over_capacity {
            let changed: BTreeSet<&ServiceRef> = over
                .keys()
                .chain(self.over_capacity.keys())
                .filter(|s| over.contains_key(*s) != self.over_capacity.contains_key(*s))
                .collect();
            for svc in changed {
                if let Some(d) = self.derived.get(svc) {
                    touched.extend(d.vips.iter().copied());
                }
                if let Some(d) = self.dns_changed.as_mut() {
                    d.insert(svc.clone());
                }
            }
            self.over_capacity = over;
            self.rejections_changed();
        }
        // Whoever claims a touched VIP may have won or lost it: its A/AAAA records follow.
        if let Some(d) = self.dns_changed.as_mut() {
            for vip in &touched {
                d.extend(
                    self.claims
                        .get(vip)
                        .into_iter()
                        .flatten()
                        .map(|a| a.2.clone()),
                );
            }
        }
        let mut diff = TableDiff::default();
        for vip in touched {
            self.decide_vip(vip, &mut diff);
        }
        diff
    }

    /// Which imports the caps leave out: none while the totals fit, else those left out by a
    /// fair filling of the table. Namespaces take turns, the one holding the smallest share of
    /// the table (the larger of its fraction of the frontends cap and of the backends cap:
    /// dominant-resource fairness) admitting its next-oldest import while it fits; an import
    /// that does not fit is left out and its namespace goes on with its younger ones. So a
    /// namespace whose imports need no more than an equal share of each cap is never left
    /// out because another namespace holds more (up to the one import by which a namespace
    /// may overshoot its turn), and within a namespace older imports come first. A walk over
    /// every import, done only while over a cap.
    fn admission(&self) -> BTreeMap<ServiceRef, Rejection> {
        use std::{cmp::Reverse, collections::BinaryHeap};
        let limits = &self.node.guard.limits;
        let mut out = BTreeMap::new();
        if self.totals.0 <= limits.frontends && self.totals.1 <= limits.backends {
            return out;
        }
        // Each namespace's imports, youngest first (taken from the end).
        let mut queues: BTreeMap<&str, Vec<(&AgeKey, &ServiceRef, &Derived)>> = BTreeMap::new();
        for (s, d) in &self.derived {
            if let Some(a) = d.age_key.as_ref() {
                queues.entry(&s.namespace).or_default().push((a, s, d));
            }
        }
        for q in queues.values_mut() {
            q.sort_by(|a, b| b.0.cmp(a.0));
        }
        // A namespace's dominant share, exact: max(f / F, b / B) scaled by F * B.
        let (cap_f, cap_b) = (limits.frontends as u128, limits.backends as u128);
        let share = |f: usize, b: usize| (f as u128 * cap_b).max(b as u128 * cap_f);
        let mut used: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        let mut turns: BinaryHeap<Reverse<(u128, &str)>> =
            queues.keys().map(|ns| Reverse((0, *ns))).collect();
        let (mut frontends, mut backends) = (0usize, 0usize);
        while let Some(Reverse((_, ns))) = turns.pop() {
            let Some((_, svc, d)) = queues.get_mut(ns).and_then(Vec::pop) else {
                continue;
            };
            let (f, b) = (frontends + d.frontends.len(), backends + d.backends);
            let mine = used.entry(ns).or_default();
            if f <= limits.frontends && b <= limits.backends {
                (frontends, backends) = (f, b);
                mine.0 += d.frontends.len();
                mine.1 += d.backends;
            } else {
                out.insert(
                    svc.clone(),
                    Rejection {
                        object: format!("ServiceImport {svc}"),
                        reason: Reason::OverCapacity,
                        // No figure that moves with others' imports: the message changes only
                        // when this import or the caps do (a changed rejection is logged,
                        // counted and sent as an Event again).
                        message: format!(
                            "its {} frontends / {} backends do not fit: the table holds at most {} frontends and {} backends; past them namespaces share it fairly (the one holding the least of it admits its next-oldest import, in turns) and within a namespace older imports come first",
                            d.frontends.len(),
                            d.backends,
                            limits.frontends,
                            limits.backends,
                        ),
                    },
                );
            }
            if queues.get(ns).is_some_and(|q| !q.is_empty()) {
                turns.push(Reverse((share(mine.0, mine.1), ns)));
            }
        }
        out
    }

    /// Programs `vip` as its owner (oldest claimant) says: all the owner's frontends on it,
    /// nothing of any other import.
    fn decide_vip(&mut self, vip: IpAddr, diff: &mut TableDiff) {
        let owner = self.claims.get(&vip).and_then(|set| {
            let mut it = set.iter();
            let first = it.next()?;
            let losers: Vec<Rejection> = it
                .map(|loser| Rejection {
                    object: format!("ServiceImport {}", loser.2),
                    reason: Reason::VipConflict,
                    message: format!("VIP {vip} belongs to the older ServiceImport {}", first.2),
                })
                .collect();
            Some((first.2.clone(), losers))
        });
        let mut desired: BTreeMap<Frontend, &Arc<Service>> = BTreeMap::new();
        match owner {
            Some((svc, losers)) => {
                if self.conflicts.get(&vip).map_or(&[][..], Vec::as_slice) != losers.as_slice() {
                    self.rejections_changed();
                }
                if losers.is_empty() {
                    self.conflicts.remove(&vip);
                } else {
                    self.conflicts.insert(vip, losers);
                }
                if !self.over_capacity.contains_key(&svc)
                    && let Some(d) = self.derived.get(&svc)
                {
                    desired.extend(
                        d.frontends
                            .iter()
                            .filter(|(f, _)| f.vip == vip)
                            .map(|(f, s)| (*f, s)),
                    );
                }
            }
            None => {
                if self.conflicts.remove(&vip).is_some() {
                    self.rejections_changed();
                }
            }
        }
        let gone: Vec<Frontend> = self
            .table
            .frontends
            .range(vip_range(vip))
            .map(|(f, _)| *f)
            .filter(|f| !desired.contains_key(f))
            .collect();
        for f in gone {
            if let Some(old) = self.table.frontends.remove(&f) {
                self.table_backends -= old.backends.len();
            }
            diff.remove.push(f);
        }
        for (f, value) in desired {
            if self.table.frontends.get(&f) != Some(value) {
                self.table_backends += value.backends.len();
                if let Some(old) = self.table.frontends.insert(f, value.clone()) {
                    self.table_backends -= old.backends.len();
                }
                diff.upsert.insert(f, value.clone());
            }
        }
    }

    /// The valid slices of a service from clusters that are not stale.
    fn live_slices<'a>(&'a self, svc: &ServiceRef) -> impl Iterator<Item = &'a ValidSlice> + 'a {
        self.slices_by_service
            .get(svc)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k).and_then(|(_, v, _)| v.as_ref()))
            .filter(|s| !self.stale.contains(&*s.cluster))
    }

    /// The service's frontends and candidates from its import and slices.
    fn derive(&self, svc: &ServiceRef) -> Derived {
        let mut out = Derived::default();
        let Some((Some(import), _)) = self.imports.get(svc) else {
            return out;
        };
        out.age_key = Some(import.age_key.clone());
        out.vips = import.vips.clone();
        let limits = self.node.guard.limits;
        if import.headless {
            // No frontend, but every ready endpoint is held (and answered) by DNS: counted as
            // a backend against the caps, at most `backends_per_frontend` of them.
            let n = self.headless_endpoints(svc);
            if n > limits.backends_per_frontend {
                out.rejections.push(Rejection {
                    object: format!("ServiceImport {svc}"),
                    reason: Reason::TooManyBackends,
                    message: format!(
                        "headless service with {n} ready endpoints; DNS keeps {}: this cluster's first, then by cluster and address",
                        limits.backends_per_frontend
                    ),
                });
            }
            out.backends = n.min(limits.backends_per_frontend);
            return out;
        }
        let slices: Vec<&ValidSlice> = self.live_slices(svc).collect();
        let mut unmatched: BTreeSet<(Arc<str>, String)> = BTreeSet::new();
        for fe in &import.frontends {
            let frontend = Frontend {
                vip: fe.vip,
                port: fe.port,
                protocol: fe.protocol,
            };
            // Best copy of each (address, port): ready, serving, local, then cluster name.
            let mut best: BTreeMap<(IpAddr, u16), Backend> = BTreeMap::new();
            // (address, port) of endpoints on this node, for internalTrafficPolicy: Local.
            let mut on_node: BTreeSet<(IpAddr, u16)> = BTreeSet::new();
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
                    if import.node_local
                        && *s.cluster == *self.node.cluster_id
                        && ep.node.is_some()
                        && ep.node.as_deref() == self.node.node_name.as_deref()
                    {
                        on_node.insert((ep.address, target));
                    }
                    let b = Backend {
                        address: ep.address,
                        port: target,
                        cluster: s.cluster.clone(),
                        zone: ep.zone.clone(),
                        ready: ep.ready,
                        serving: ep.serving,
                        terminating: ep.terminating,
                        selected: false,
                        fallback: false,
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
            select::mark_selected(
                &mut backends,
                &self.node,
                import.prefer_close,
                import.node_local.then_some(&on_node),
            );
            if backends.len() > limits.backends_per_frontend {
                // Keep the selected ones first, then the best by rank; the same set always.
                let local = &self.node.cluster_id;
                backends.sort_by(|a, b| {
                    (!a.selected, rank(a, local), a.address, a.port).cmp(&(
                        !b.selected,
                        rank(b, local),
                        b.address,
                        b.port,
                    ))
                });
                out.rejections.push(Rejection {
                    object: format!("ServiceImport {svc}"),
                    reason: Reason::TooManyBackends,
                    message: format!(
                        "frontend {frontend} has {} backends; the {} kept are the selected ones first",
                        backends.len(),
                        limits.backends_per_frontend
                    ),
                });
                backends.truncate(limits.backends_per_frontend);
            }
            backends.sort_by(|a, b| {
                (&a.cluster, a.address, a.port).cmp(&(&b.cluster, b.address, b.port))
            });
            out.backends += backends.len();
            out.frontends.push((
                frontend,
                Arc::new(Service {
                    service: svc.to_string(),
                    affinity: import.affinity,
                    backends,
                }),
            ));
        }
        // Validation leaves one frontend per (VIP, port, protocol); sorted for `decide_vip`.
        out.frontends.sort_by_key(|(f, _)| *f);
        // Slices whose ports match none of the import's, said once per slice. A slice with no
        // endpoints and no ports (a cluster scaled to zero, a slice not yet filled) is empty,
        // not wrong.
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
            let relevant = import.frontends.iter().any(|fe| s.v4 == fe.vip.is_ipv4())
                && !(s.ports.is_empty() && s.endpoints.is_empty());
            if relevant && !matched_any && unmatched.iter().any(|(c, _)| *c == s.cluster) {
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

    /// Backends summed over the table's frontends.
    pub fn table_backends(&self) -> usize {
        self.table_backends
    }

    /// Changes whenever [`Index::rejections`] may return something else: a caller that
    /// keeps its last answer asks again only then (O(1) per flush otherwise).
    pub fn rejections_version(&self) -> u64 {
        self.rejections_version
    }

    /// Everything rejected or trimmed, sorted by object then reason.
    pub fn rejections(&self) -> Vec<Rejection> {
        let mut all: Vec<Rejection> = self
            .imports
            .values()
            .flat_map(|(_, r)| r.iter().cloned())
            .chain(self.slices.values().flat_map(|(_, _, r)| r.iter().cloned()))
            .chain(
                self.derived
                    .values()
                    .flat_map(|d| d.rejections.iter().cloned()),
            )
            .chain(self.conflicts.values().flatten().cloned())
            .chain(self.over_capacity.values().cloned())
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// Starts tracking which services' DNS records change (every import counts as changed
    /// once); see [`Index::take_dns_changes`].
    pub fn track_dns(&mut self) {
        self.dns_changed = Some(self.imports.keys().cloned().collect());
    }

    /// The services whose DNS records may have changed since the last call (as of the last
    /// flush), each with its records now (`None`: no name). Empty unless
    /// [`Index::track_dns`] was called.
    pub fn take_dns_changes(&mut self) -> Vec<(ServiceRef, Option<ServiceRecords>)> {
        let Some(changed) = self.dns_changed.as_mut().map(std::mem::take) else {
            return Vec::new();
        };
        changed
            .into_iter()
            .map(|svc| {
                let r = self.dns_records(&svc);
                (svc, r)
            })
            .collect()
    }

    /// The DNS records of a service, as of the last flush: for a ClusterSetIP import the
    /// VIPs this node programs for it (none: no name), for a headless one its ready
    /// endpoints of clusters that are not stale.
    pub fn dns_records(&self, svc: &ServiceRef) -> Option<ServiceRecords> {
        let (Some(import), _) = self.imports.get(svc)? else {
            return None;
        };
        if self.over_capacity.contains_key(svc) {
            return None;
        }
        let port = |(name, protocol, port): &(Option<String>, Protocol, u16)| DnsPort {
            name: name.clone(),
            protocol: *protocol,
            port: *port,
        };
        let ports: Vec<DnsPort> = import.ports.iter().map(port).collect();
        if !import.headless {
            let ips: Vec<IpAddr> = import
                .vips
                .iter()
                .copied()
                .filter(|vip| {
                    self.claims
                        .get(vip)
                        .and_then(|set| set.iter().next())
                        .is_some_and(|owner| &owner.2 == svc)
                })
                .collect();
            return (!ips.is_empty()).then(|| ServiceRecords::cluster_set_ip(ips, ports));
        }
        let mut endpoints: Vec<DnsEndpoint> = Vec::new();
        for s in self.live_slices(svc) {
            // One copy of the slice's ports, shared by its endpoints.
            let slice_ports: Arc<[DnsPort]> = s.ports.iter().map(port).collect();
            endpoints.extend(s.endpoints.iter().filter(|e| e.ready).map(|e| {
                DnsEndpoint {
                    cluster: s.cluster.clone(),
                    hostname: e
                        .hostname
                        .clone()
                        .unwrap_or_else(|| crate::dns::dashed(e.address).into_boxed_str()),
                    address: e.address,
                    ports: slice_ports.clone(),
                }
            }));
        }
        let cap = self.node.guard.limits.backends_per_frontend;
        if endpoints.len() > cap {
            // The same subset always: this cluster's endpoints first, then by cluster and
            // address (the rejection is said by `derive`).
            let local = &*self.node.cluster_id;
            endpoints.sort_by(|a, b| {
                (&*a.cluster != local, &a.cluster, a.address).cmp(&(
                    &*b.cluster != local,
                    &b.cluster,
                    b.address,
                ))
            });
            endpoints.dedup_by(|a, b| a.cluster == b.cluster && a.address == b.address);
            endpoints.truncate(cap);
        }
        Some(ServiceRecords::headless(ports, endpoints))
    }

    /// Ready endpoints of a headless service's live slices, as its DNS records hold them (at
    /// most `backends_per_frontend`): what it counts against the table's caps.
    fn headless_endpoints(&self, svc: &ServiceRef) -> usize {
        let mut distinct: HashSet<(&str, IpAddr)> = HashSet::new();
        for s in self.live_slices(svc) {
            distinct.extend(
                s.endpoints
                    .iter()
                    .filter(|e| e.ready)
                    .map(|e| (&*s.cluster, e.address)),
            );
        }
        distinct.len()
    }

    /// Number of ServiceImports and EndpointSlices held.
    pub fn object_counts(&self) -> (usize, usize) {
        (self.imports.len(), self.slices.len())
    }
}

/// Every frontend of one VIP, in table order.
fn vip_range(vip: IpAddr) -> std::ops::RangeInclusive<Frontend> {
    Frontend {
        vip,
        port: 0,
        protocol: Protocol::Tcp,
    }..=Frontend {
        vip,
        port: u16::MAX,
        protocol: Protocol::Sctp,
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
    (!b.ready, !b.serving, &*b.cluster != local, &*b.cluster)
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
