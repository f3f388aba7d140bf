//! From what the members hold to what the local cluster should hold: the ServiceImports (with
//! their ClusterSetIPs), the MCS EndpointSlices and the conditions of the local
//! ServiceExports. A function of its inputs (including "now" for condition times), so it is
//! tested without a cluster; the merge itself is `mcs-merge`'s.
//!
//! The [`Reconciler`] keeps the desired state of every service between passes, and the
//! ClusterSetIP allocator with it: a pass computes again only the services whose objects
//! changed ([`Dirty`]), so its cost follows the change, not the ClusterSet. A full pass
//! ([`Dirty::all`]) starts from nothing; [`desired`] is one, and the property test in
//! `tests` checks that any sequence of changes leaves the same state as a full pass over the
//! same objects.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use k8s_openapi::{
    api::{core::v1::Namespace, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use mcs_api::{
    ClientIpConfig, ClusterStatus, DEFAULT_SLICE_CONTROLLER, EndpointSliceObjects, ServiceImport,
    ServiceImportSpec, ServiceImportStatus, ServiceImportType, ServicePort, SessionAffinityConfig,
};
use mcs_merge::{
    Export, ExportConditions, ImportShape, Merged, ServiceKey, ServiceShape, alloc::Allocator,
    meta::Refusal,
};
use mcs_model::guard::IpCidr;

mod slices;

pub use slices::WantSlice;
use slices::source_manager;

use crate::held::HeldImport;
use crate::objects::LeanExport;
use crate::store::{Dirty, Objects, Touch};
use crate::{MANAGED_LABEL, MANAGER, objects::ObjKey};

/// One member's objects, as the reconciler sees them.
#[derive(Debug)]
pub struct MemberView<'a> {
    /// Its cluster id.
    pub id: String,
    /// Whether it answers; past the member timeout ([`Reach::Gone`]) its endpoints are
    /// withdrawn (its exports still count, from their last known state).
    pub reach: Reach,
    /// ServiceExports.
    pub exports: &'a HashMap<ObjKey, Arc<LeanExport>>,
    /// Their store's generation ([`Objects::generation`]).
    pub exports_generation: u64,
    /// Services.
    pub services: &'a HashMap<ObjKey, Arc<ServiceShape>>,
    /// Service EndpointSlices, indexed by service.
    pub slices: &'a Objects<EndpointSlice>,
}

/// How a member answers, as the reconciler sees it (and the imports' [`CLUSTERS_REACHABLE`]
/// condition tells).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reach {
    /// It answers (or has failed for less than the controller's short grace).
    #[default]
    Up,
    /// It fails, within the member timeout: its last known endpoints still count.
    /// `unauthorized`: it refuses our credentials (HTTP 401/403).
    Failing {
        /// It refuses our credentials.
        unauthorized: bool,
    },
    /// It has failed past the member timeout: its endpoints are withdrawn.
    Gone {
        /// It refuses our credentials.
        unauthorized: bool,
    },
}

impl MemberView<'_> {
    /// Whether its endpoints are imported (it has not failed past the member timeout).
    pub fn endpoints_count(&self) -> bool {
        !matches!(self.reach, Reach::Gone { .. })
    }
}

/// The ServiceImport condition that says whether every cluster exporting the service answers
/// this controller (`True`, reason `Reachable`), or which do not and what became of their
/// endpoints (`False`, [`CLUSTER_UNAUTHORIZED`] when one of them refuses our credentials,
/// else [`CLUSTER_UNREACHABLE`]).
pub const CLUSTERS_REACHABLE: &str = "ClustersReachable";
/// `ClustersReachable=False`: an exporting cluster refuses this controller's credentials.
pub const CLUSTER_UNAUTHORIZED: &str = "ClusterUnauthorized";
/// `ClustersReachable=False`: an exporting cluster does not answer.
pub const CLUSTER_UNREACHABLE: &str = "ClusterUnreachable";

/// What the controller is told to refuse or bound (the same in every pass).
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// Namespaces whose exports are refused (not merged, never imported).
    pub refused_namespaces: BTreeSet<String>,
    /// The most ClusterSetIPs the imports of one namespace hold (`None`: no bound). Imports
    /// that already have theirs keep them; new ones past it get none.
    pub ip_quota: Option<usize>,
    /// The most exports one namespace of one member has merged, oldest first (`None`: no
    /// bound); the younger ones are refused.
    pub exports_per_namespace: Option<usize>,
    /// The most exports one member has merged, oldest first (`None`: no bound).
    pub exports_per_member: Option<usize>,
    /// Export slices that Kubernetes' EndpointSlice controller did not compute from a
    /// Service's selector (mirrored from Endpoints, written by hand). Off: they are withheld
    /// and reported.
    pub export_selectorless: bool,
}

/// Everything the reconciler reads.
#[derive(Debug)]
pub struct Snapshot<'a> {
    /// This cluster's id.
    pub local: String,
    /// Every member, this cluster included.
    pub members: Vec<MemberView<'a>>,
    /// Local namespaces.
    pub namespaces: &'a HashMap<ObjKey, Arc<Namespace>>,
    /// Local ServiceImports (all, ours and others').
    pub imports: &'a HashMap<ObjKey, Arc<HeldImport>>,
    /// Now, for condition transition times.
    pub now: Time,
    /// What to refuse or bound.
    pub policy: &'a Policy,
}

/// The `Ready=False` reason of an import that got no ClusterSetIP because its namespace holds
/// its quota.
pub const QUOTA_EXCEEDED: &str = "ClusterSetIPQuotaExceeded";
/// The `Ready=False` reason of a local export whose import here got no ClusterSetIP.
pub const NO_CLUSTERSET_IP: &str = "NoClusterSetIP";

/// The `Ready=False` reason of a local export of a Service without a selector whose
/// EndpointSlices are withheld (`--export-selectorless-slices` not given).
pub const SELECTORLESS_SERVICE: &str = "SelectorlessService";

/// The `Valid=False` reason of an export from a refused namespace.
pub const NAMESPACE_NOT_ALLOWED: &str = "NamespaceNotAllowed";
/// The `Valid=False` reason of an export of a Service that is never exported
/// (`default/kubernetes`, the API server's own).
pub const SERVICE_NOT_ALLOWED: &str = "ServiceNotAllowed";

/// Why an export of `ns/name` is refused whatever it holds, if it is: its namespace is
/// refused, or it is `default/kubernetes` (whose endpoints are a member's API servers).
pub fn refusal(ns: &str, name: &str, refused_namespaces: &BTreeSet<String>) -> Option<Refusal> {
    if refused_namespaces.contains(ns) {
        Some(Refusal::new(
            NAMESPACE_NOT_ALLOWED,
            format!(
                "exports from namespace {ns} are refused (mcs-controller --refuse-export-namespaces)"
            ),
        ))
    } else if (ns, name) == ("default", "kubernetes") {
        Some(Refusal::new(
            SERVICE_NOT_ALLOWED,
            "default/kubernetes is the API server's own Service; it is never exported",
        ))
    } else {
        None
    }
}

/// The `Valid=False` reason of an export past `--exports-per-namespace` or
/// `--exports-per-member`.
pub const EXPORT_LIMIT_EXCEEDED: &str = "ExportLimitExceeded";

/// The exports of `m` past the limits, and why: oldest first (by creation, then namespace
/// and name), each namespace keeps at most `exports_per_namespace` and the member at most
/// `exports_per_member`. Exports refused for their namespace or Service do not count. Costs
/// nothing while the member holds fewer exports than the smaller limit.
fn over_limits(m: &MemberView<'_>, p: &Policy) -> HashMap<ObjKey, Refusal> {
    let mut over = HashMap::new();
    let smallest = match (p.exports_per_namespace, p.exports_per_member) {
        (None, None) => return over,
        (a, b) => a.unwrap_or(usize::MAX).min(b.unwrap_or(usize::MAX)),
    };
    if m.exports.len() <= smallest {
        return over;
    }
    let mut live: Vec<(i64, &ObjKey)> = m
        .exports
        .iter()
        .filter(|((ns, name), se)| {
            !se.deleting && refusal(ns, name, &p.refused_namespaces).is_none()
        })
        .map(|(k, se)| (se.created, k))
        .collect();
    if p.exports_per_namespace.is_none_or(|n| live.len() <= n)
        && p.exports_per_member.is_none_or(|n| live.len() <= n)
    {
        return over;
    }
    live.sort_unstable();
    let (mut total, mut per_ns) = (0usize, HashMap::<&str, usize>::new());
    for (_, k) in live {
        let in_ns = per_ns.entry(k.0.as_str()).or_default();
        let why = if p.exports_per_namespace.is_some_and(|n| *in_ns >= n) {
            format!(
                "namespace {} of cluster {} already exports {} older services (mcs-controller --exports-per-namespace)",
                k.0, m.id, *in_ns
            )
        } else if p.exports_per_member.is_some_and(|n| total >= n) {
            format!(
                "cluster {} already exports {total} older services (mcs-controller --exports-per-member)",
                m.id
            )
        } else {
            *in_ns += 1;
            total += 1;
            continue;
        };
        over.insert(k.clone(), Refusal::new(EXPORT_LIMIT_EXCEEDED, why));
    }
    over
}

/// What the local cluster should hold.
#[derive(Debug, Default, Clone)]
pub struct Desired {
    /// ServiceImports by (namespace, name), with status. Boxed: a B-tree node holds its
    /// values inline, and these are large structs in nodes that are often part empty.
    pub imports: BTreeMap<ObjKey, Box<ServiceImport>>,
    /// MCS EndpointSlices by (namespace, name), as made when written ([`WantSlice`]).
    pub slices: BTreeMap<ObjKey, WantSlice>,
    /// Conditions of the local ServiceExports.
    pub export_conditions: BTreeMap<ObjKey, Vec<Condition>>,
    /// Why something is not as asked, per service (logged by the reconciler when the
    /// service is computed).
    pub problems: BTreeMap<ObjKey, Vec<String>>,
    /// Source slices not exported because no selector computed them, per service.
    pub withheld: BTreeMap<ObjKey, usize>,
    /// The MCS slices of each service (keys into `slices`).
    pub slices_of: BTreeMap<ObjKey, BTreeSet<ObjKey>>,
    /// The sums of `problems`, `withheld` and the `Valid=False` export conditions, kept as
    /// they change (a pass over one service does not count every service's).
    counts: Counts,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Counts {
    problems: usize,
    withheld: usize,
    invalid_exports: usize,
}

/// Whether conditions say `Valid=False`.
fn invalid(c: &[Condition]) -> bool {
    c.iter().any(|c| c.type_ == "Valid" && c.status == "False")
}

impl Desired {
    /// How many problems there are.
    pub fn problem_count(&self) -> usize {
        self.counts.problems
    }

    /// How many source slices are withheld.
    pub fn withheld_count(&self) -> usize {
        self.counts.withheld
    }

    /// How many local exports are `Valid=False`.
    pub fn invalid_export_count(&self) -> usize {
        self.counts.invalid_exports
    }

    /// Forgets what was wanted for service `k`.
    fn clear(&mut self, k: &ObjKey) {
        self.imports.remove(k);
        if let Some(c) = self.export_conditions.remove(k) {
            self.counts.invalid_exports -= usize::from(invalid(&c));
        }
        if let Some(p) = self.problems.remove(k) {
            self.counts.problems -= p.len();
        }
        if let Some(n) = self.withheld.remove(k) {
            self.counts.withheld -= n;
        }
        for sk in self.slices_of.remove(k).into_iter().flatten() {
            self.slices.remove(&sk);
        }
    }

    fn problem(&mut self, k: &ObjKey, p: String) {
        self.problems.entry(k.clone()).or_default().push(p);
        self.counts.problems += 1;
    }

    /// `k` withholds `n` source slices (after [`Self::clear`]).
    fn withhold(&mut self, k: &ObjKey, n: usize) {
        self.withheld.insert(k.clone(), n);
        self.counts.withheld += n;
    }

    /// The conditions of the local export of `k` (after [`Self::clear`]).
    fn export_conditions(&mut self, k: &ObjKey, c: Vec<Condition>) {
        self.counts.invalid_exports += usize::from(invalid(&c));
        self.export_conditions.insert(k.clone(), c);
    }
}

/// What a service holds in the allocator.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hold {
    ips: Vec<IpAddr>,
    /// Ours and counted in its namespace's quota (kept or allocated); false: another
    /// manager's import, or ours going away.
    ours: bool,
}

/// The desired state of every service and the ClusterSetIPs held, kept between passes.
#[derive(Debug)]
pub struct Reconciler {
    ranges: Vec<IpCidr>,
    alloc: Allocator,
    /// What each service holds in `alloc`.
    holds: HashMap<ObjKey, Hold>,
    /// How many services hold each address (another manager's imports may share one).
    holders: HashMap<IpAddr, u32>,
    /// The service whose import of ours holds each address.
    owner: HashMap<IpAddr, ObjKey>,
    /// ClusterSetIPs held by our imports per namespace (the quota).
    per_namespace: HashMap<String, usize>,
    /// Services wanting a ClusterSetIP that got none (a full range, a quota): computed again
    /// when an address is freed.
    starved: BTreeSet<ObjKey>,
    /// Each member's exports past the limits.
    over: HashMap<String, HashMap<ObjKey, Refusal>>,
    /// The generation of each member's exports `over` was computed from.
    over_from: HashMap<String, u64>,
    /// The desired state.
    pub want: Desired,
}

/// Computes the desired local state in one full pass over `s`.
pub fn desired(s: &Snapshot<'_>, ranges: Vec<IpCidr>) -> Desired {
    let mut r = Reconciler::new(ranges);
    r.pass(
        s,
        &Dirty {
            all: true,
            ..Dirty::default()
        },
    );
    r.want
}

/// The services a pass computed: every one, or these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Computed {
    /// A full pass.
    All,
    /// These services.
    Some(BTreeSet<ObjKey>),
}

impl Reconciler {
    /// Nothing wanted, nothing held, allocating from `ranges`.
    pub fn new(ranges: Vec<IpCidr>) -> Self {
        Self {
            alloc: Allocator::new(ranges.clone()),
            ranges,
            holds: HashMap::new(),
            holders: HashMap::new(),
            owner: HashMap::new(),
            per_namespace: HashMap::new(),
            starved: BTreeSet::new(),
            over: HashMap::new(),
            over_from: HashMap::new(),
            want: Desired::default(),
        }
    }

    /// Computes again the services `dirty` names (every one when `dirty.all`: the state is
    /// rebuilt from nothing); returns which it computed.
    pub fn pass(&mut self, s: &Snapshot<'_>, dirty: &Dirty) -> Computed {
        let mut keys: BTreeSet<ObjKey> = BTreeSet::new();
        if dirty.all {
            *self = Self::new(std::mem::take(&mut self.ranges));
            for m in &s.members {
                keys.extend(m.exports.keys().cloned());
            }
            keys.extend(s.imports.keys().cloned());
        } else {
            for t in &dirty.touched {
                match t {
                    Touch::Service(k) => {
                        keys.insert(k.clone());
                    }
                    Touch::Namespace(ns) => self.namespace_keys(s, ns, &mut keys),
                }
            }
        }
        // Exports past the limits: a change of who is past them changes those services
        // (computed again only when the member's exports changed).
        for m in &s.members {
            if self.over_from.insert(m.id.clone(), m.exports_generation)
                == Some(m.exports_generation)
            {
                continue;
            }
            let over = over_limits(m, s.policy);
            let old = self.over.remove(&m.id).unwrap_or_default();
            for (k, r) in &over {
                if old.get(k) != Some(r) {
                    keys.insert(k.clone());
                }
            }
            keys.extend(old.into_keys().filter(|k| !over.contains_key(k)));
            if !over.is_empty() {
                self.over.insert(m.id.clone(), over);
            }
        }
        // A foreign import in the batch that claims an address of ours takes it from that
        // service, which is computed again.
        let contested: Vec<ObjKey> = keys
            .iter()
            .filter_map(|k| s.imports.get(k).filter(|si| !si.ours))
            .flat_map(|si| si.ips.iter().filter_map(|i| i.parse::<IpAddr>().ok()))
            .filter_map(|ip| self.owner.get(&ip))
            .filter(|o| !keys.contains(*o))
            .cloned()
            .collect();
        keys.extend(contested);
        // A service of the batch that holds addresses may free some: those starved for one
        // are computed again too.
        if !self.starved.is_empty() && keys.iter().any(|k| self.holds.contains_key(k)) {
            keys.extend(std::mem::take(&mut self.starved));
        }
        let merged: BTreeMap<ObjKey, Merged> =
            keys.iter().map(|k| (k.clone(), self.merge(s, k))).collect();

        // Addresses: what the services' imports hold now; another manager's first (an address
        // it claims is not ours to keep), then ours.
        for k in &keys {
            self.release(k);
        }
        for k in &keys {
            if let Some(si) = s.imports.get(k).filter(|si| !si.ours) {
                self.hold_theirs(k, parsed(si));
            }
        }
        let mut keep: HashMap<ObjKey, Vec<String>> = HashMap::new();
        for k in &keys {
            let Some(si) = s.imports.get(k).filter(|si| si.ours) else {
                continue;
            };
            let ips = parsed(si);
            let Some(shape) = merged[k].import.as_ref() else {
                // Going away: its addresses stay held until it is gone, so no new import gets
                // one while the old one still holds it.
                self.hold_theirs(k, ips);
                continue;
            };
            if shape.headless {
                continue;
            }
            let fits = ips.len() == si.ips.len()
                && ips.len() == shape.ip_families.len()
                && ips
                    .iter()
                    .zip(&shape.ip_families)
                    .all(|(ip, f)| family(*ip) == f && self.alloc.allowed(*ip))
                && ips.iter().all(|ip| !self.holders.contains_key(ip))
                && distinct(&ips);
            if fits {
                self.hold_ours(k, ips);
                keep.insert(k.clone(), si.ips.clone());
            }
        }

        let local = s.members.iter().find(|m| m.id == s.local);
        for k in &keys {
            self.want.clear(k);
            self.starved.remove(k);
            let m = &merged[k];
            let here = self.compute(s, k, m, keep.get(k));
            if let Some(me) = local {
                self.export_conditions(s, me, k, m, &here);
            }
        }
        if dirty.all {
            Computed::All
        } else {
            Computed::Some(keys)
        }
    }

    /// Every service of namespace `ns` that may want something.
    fn namespace_keys(&self, s: &Snapshot<'_>, ns: &str, keys: &mut BTreeSet<ObjKey>) {
        for m in &s.members {
            keys.extend(m.exports.keys().filter(|k| k.0 == ns).cloned());
        }
        keys.extend(s.imports.keys().filter(|k| k.0 == ns).cloned());
        keys.extend(self.want.imports.keys().filter(|k| k.0 == ns).cloned());
    }

    /// The merge of service `k`'s exports in every member.
    fn merge(&self, s: &Snapshot<'_>, k: &ObjKey) -> Merged {
        let mut exports = BTreeMap::new();
        for m in &s.members {
            let Some(se) = m.exports.get(k).filter(|se| !se.deleting) else {
                continue;
            };
            let limit = self.over.get(&m.id).and_then(|o| o.get(k)).cloned();
            exports.insert(
                m.id.clone(),
                Export {
                    created: se.created,
                    service: m.services.get(k).map(|svc| (**svc).clone()),
                    labels: se.labels.clone(),
                    annotations: se.annotations.clone(),
                    refused: refusal(&k.0, &k.1, &s.policy.refused_namespaces)
                        .or(limit)
                        .or_else(|| se.refused.clone()),
                    metadata_dropped: se.metadata_dropped.clone(),
                },
            );
        }
        let key = ServiceKey {
            namespace: k.0.clone(),
            name: k.1.clone(),
        };
        mcs_merge::merge(&key, &exports)
    }

    fn hold_ip(&mut self, ip: IpAddr) {
        let n = self.holders.entry(ip).or_default();
        if *n == 0 {
            self.alloc.reserve(ip);
        }
        *n += 1;
    }

    /// `k` holds `ips` outside its namespace's quota: another manager's import, or ours
    /// going away.
    fn hold_theirs(&mut self, k: &ObjKey, ips: Vec<IpAddr>) {
        for ip in &ips {
            self.hold_ip(*ip);
        }
        self.holds.insert(k.clone(), Hold { ips, ours: false });
    }

    /// `k`'s import of ours holds `ips` (kept, or just allocated: `hold_ip` then finds them
    /// in use already), counted in its namespace's quota.
    fn hold_ours(&mut self, k: &ObjKey, ips: Vec<IpAddr>) {
        for ip in &ips {
            self.hold_ip(*ip);
            self.owner.insert(*ip, k.clone());
        }
        *self.per_namespace.entry(k.0.clone()).or_default() += ips.len();
        self.holds.insert(k.clone(), Hold { ips, ours: true });
    }

    /// Lets go of what `k` holds.
    fn release(&mut self, k: &ObjKey) {
        let Some(h) = self.holds.remove(k) else {
            return;
        };
        for ip in &h.ips {
            if h.ours {
                self.owner.remove(ip);
            }
            if let Some(n) = self.holders.get_mut(ip) {
                *n -= 1;
                if *n == 0 {
                    self.holders.remove(ip);
                    self.alloc.release(*ip);
                }
            }
        }
        if h.ours
            && let Some(n) = self.per_namespace.get_mut(&k.0)
        {
            *n = n.saturating_sub(h.ips.len());
        }
    }

    /// The import and slices of service `k`, given its merge and the addresses it keeps.
    fn compute(
        &mut self,
        s: &Snapshot<'_>,
        k: &ObjKey,
        merged: &Merged,
        keep: Option<&Vec<String>>,
    ) -> Here {
        let mut here = Here::default();
        let Some(shape) = merged.import.as_ref() else {
            return here;
        };
        // Imports where the namespace exists (and is not going away).
        let namespace = s.namespaces.get(&(String::new(), k.0.clone()));
        if namespace.is_none_or(|n| n.metadata.deletion_timestamp.is_some()) {
            return here;
        }
        let key = ServiceKey {
            namespace: k.0.clone(),
            name: k.1.clone(),
        };
        if let Some(si) = s.imports.get(k)
            && !si.ours
        {
            self.want.problem(
                k,
                format!(
                    "ServiceImport {key} exists and is not managed by {MANAGER}; leaving it alone"
                ),
            );
            return here;
        }
        let mut over_quota = false;
        let (ips, families) = if shape.headless {
            // No ClusterSetIP, but the families of the exported Services: clients (and the
            // conformance suite) read them to know which address records to ask for.
            (Vec::new(), shape.ip_families.clone())
        } else if let Some(ips) = keep {
            (ips.clone(), shape.ip_families.clone())
        } else if let Some(q) = s.policy.ip_quota
            && self.per_namespace.get(&k.0).copied().unwrap_or(0) + shape.ip_families.len() > q
        {
            self.want.problem(
                k,
                format!(
                    "no ClusterSetIP for {key}: namespace {} holds its quota of {q} (--clusterset-ips-per-namespace)",
                    key.namespace
                ),
            );
            over_quota = true;
            self.starved.insert(k.clone());
            (Vec::new(), Vec::new())
        } else {
            let mut ips = Vec::new();
            let mut families = Vec::new();
            for f in &shape.ip_families {
                match self.alloc.allocate(f, &key.to_string()) {
                    Some(ip) => {
                        ips.push(ip);
                        families.push(f.clone());
                    }
                    None => {
                        self.starved.insert(k.clone());
                        self.want.problem(
                            k,
                            format!(
                                "no free {f} ClusterSetIP for {key} (none of --clusterset-ip-cidr is {f}, or it is full)"
                            ),
                        );
                    }
                }
            }
            let text = ips.iter().map(ToString::to_string).collect();
            self.hold_ours(k, ips);
            (text, families)
        };
        let missing: Vec<&String> = shape
            .ip_families
            .iter()
            .filter(|f| !families.contains(f))
            .collect();
        let ready = if over_quota {
            (
                "False",
                QUOTA_EXCEEDED,
                format!(
                    "namespace {} holds its quota of ClusterSetIPs (--clusterset-ips-per-namespace)",
                    key.namespace
                ),
            )
        } else if missing.is_empty() {
            (
                "True",
                "Ready",
                "the import's ClusterSetIPs are allocated".to_string(),
            )
        } else {
            (
                "False",
                "IPFamilyNotSupported",
                format!(
                    "no ClusterSetIP of family {missing:?} could be allocated (no --clusterset-ip-cidr of that family, or it is full)"
                ),
            )
        };
        if !shape.headless && ips.is_empty() {
            here.no_ip = Some(format!("has no ClusterSetIP: {}", ready.2));
        }
        let mut si = import(&key, shape, ips, families);
        let reach = reach_condition(s, &shape.clusters);
        let old = s.imports.get(k).map(|old| &old.conditions);
        let condition = |(type_, (status, reason, message)): (&str, (&str, &str, String))| {
            let since = old
                .and_then(|c| c.since(type_, status))
                .map_or_else(|| s.now.clone(), Clone::clone);
            Condition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.into(),
                message,
                last_transition_time: since,
                observed_generation: None,
            }
        };
        if let Some(st) = si.status.as_mut() {
            st.conditions = [("Ready", ready), (CLUSTERS_REACHABLE, reach)]
                .into_iter()
                .map(condition)
                .collect();
        }
        self.want.imports.insert(k.clone(), Box::new(si));

        // Slices from every exporting cluster whose endpoints count.
        let mut withheld = 0;
        let mut slices = BTreeSet::new();
        for m in s
            .members
            .iter()
            .filter(|m| m.endpoints_count() && shape.clusters.contains(&m.id))
        {
            let svc = m.services.get(k);
            // This cluster's ports that the import carries as it defines them (a port it
            // defines differently gets no traffic from here), once per service.
            let served: Arc<[String]> = svc
                .map_or(&[][..], |svc| &svc.ports)
                .iter()
                .filter(|sp| {
                    shape.ports.iter().any(|ip| {
                        ip.name == sp.name && ip.protocol == sp.protocol && ip.port == sp.port
                    })
                })
                .map(|sp| sp.name.clone())
                .collect();
            let selector = svc.is_some_and(|svc| svc.selector);
            let Some(of_service) = m.slices.by_service.get(k) else {
                continue;
            };
            for es in of_service.iter().filter_map(|sk| m.slices.map.get(sk)) {
                let source = source_manager(es);
                let computed = selector && source == DEFAULT_SLICE_CONTROLLER;
                if !computed && !s.policy.export_selectorless {
                    withheld += 1;
                    self.want.problem(k, format!(
                        "EndpointSlice {}/{} of cluster {} is not exported: {}; such slices are exported only with --export-selectorless-slices",
                        key.namespace,
                        es.metadata.name.as_deref().unwrap_or_default(),
                        m.id,
                        if selector {
                            format!("it is managed by {source:?}, not computed from the Service's selector by Kubernetes' EndpointSlice controller")
                        } else {
                            "its Service has no selector (the slice is mirrored from Endpoints or written by hand)".to_string()
                        }
                    ));
                    if m.id == s.local && !selector {
                        here.selectorless = true;
                    }
                    continue;
                }
                if let Some(mcs) = WantSlice::new(&key, &m.id, es, &served, computed) {
                    let sk = (key.namespace.clone(), mcs.name.clone());
                    self.want.slices.insert(sk.clone(), mcs);
                    slices.insert(sk);
                }
            }
        }
        if withheld > 0 {
            self.want.withhold(k, withheld);
        }
        if !slices.is_empty() {
            self.want.slices_of.insert(k.clone(), slices);
        }
        here
    }

    /// The conditions of the local export of `k`, if there is one; an export whose import
    /// here got no ClusterSetIP is not Ready, nor one of a selectorless Service whose slices
    /// are withheld.
    fn export_conditions(
        &mut self,
        s: &Snapshot<'_>,
        me: &MemberView<'_>,
        k: &ObjKey,
        merged: &Merged,
        here: &Here,
    ) {
        let Some(se) = me.exports.get(k).filter(|se| !se.deleting) else {
            return;
        };
        let Some(c) = merged.exports.get(&s.local) else {
            return;
        };
        let mut c = c.clone();
        if let Some(why) = &here.no_ip
            && c.ready.status
        {
            c.ready = mcs_merge::Condition {
                status: false,
                reason: NO_CLUSTERSET_IP.into(),
                message: format!("the ServiceImport in cluster {} {why}", s.local),
            };
        } else if here.selectorless && c.ready.status {
            c.ready = mcs_merge::Condition {
                status: false,
                reason: SELECTORLESS_SERVICE.into(),
                message: "the Service has no selector: its EndpointSlices (mirrored from Endpoints, or written by hand) are not exported unless every cluster's mcs-controller runs with --export-selectorless-slices".into(),
            };
        }
        self.want.export_conditions(k, conditions(&c, se, &s.now));
    }
}

/// The [`CLUSTERS_REACHABLE`] condition of an import exported by `clusters`: status, reason,
/// message (which clusters do not answer and what became of their endpoints; no times, so
/// it changes only when their state does).
fn reach_condition<'m>(s: &Snapshot<'_>, clusters: &[String]) -> (&'m str, &'m str, String) {
    let mut unauthorized = false;
    let troubles: Vec<String> = s
        .members
        .iter()
        .filter(|m| clusters.contains(&m.id))
        .filter_map(|m| {
            let (refuses, gone) = match m.reach {
                Reach::Up => return None,
                Reach::Failing { unauthorized } => (unauthorized, false),
                Reach::Gone { unauthorized } => (unauthorized, true),
            };
            unauthorized |= refuses;
            let what = if refuses {
                "refuses this controller's credentials (HTTP 401/403)"
            } else {
                "does not answer"
            };
            let endpoints = if gone {
                "its endpoints are withdrawn (member timeout passed)"
            } else {
                "its last known endpoints are kept until the member timeout"
            };
            Some(format!("cluster {} {what}: {endpoints}", m.id))
        })
        .collect();
    if troubles.is_empty() {
        (
            "True",
            "Reachable",
            "every exporting cluster answers".to_string(),
        )
    } else if unauthorized {
        ("False", CLUSTER_UNAUTHORIZED, troubles.join("; "))
    } else {
        ("False", CLUSTER_UNREACHABLE, troubles.join("; "))
    }
}

/// What computing a service found that its local export's conditions say.
#[derive(Debug, Default)]
struct Here {
    /// Its import here got no ClusterSetIP, and why.
    no_ip: Option<String>,
    /// Its local Service has no selector and its slices are withheld.
    selectorless: bool,
}

fn parsed(si: &HeldImport) -> Vec<IpAddr> {
    si.ips.iter().filter_map(|i| i.parse().ok()).collect()
}

fn distinct(ips: &[IpAddr]) -> bool {
    ips.iter().enumerate().all(|(i, ip)| !ips[..i].contains(ip))
}

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
}

fn import(
    key: &ServiceKey,
    shape: &ImportShape,
    ips: Vec<String>,
    ip_families: Vec<String>,
) -> ServiceImport {
    let mut labels = shape.labels.clone();
    labels.insert(MANAGED_LABEL.into(), MANAGER.into());
    let mut si = ServiceImport::new(
        &key.name,
        ServiceImportSpec {
            ports: shape
                .ports
                .iter()
                .map(|p| ServicePort {
                    name: (!p.name.is_empty()).then(|| p.name.clone()),
                    protocol: Some(p.protocol.clone()),
                    app_protocol: p.app_protocol.clone(),
                    port: p.port,
                })
                .collect(),
            ips,
            type_: if shape.headless {
                ServiceImportType::Headless
            } else {
                ServiceImportType::ClusterSetIP
            },
            session_affinity: shape.session_affinity.clone(),
            session_affinity_config: shape.session_affinity_timeout.map(|t| {
                SessionAffinityConfig {
                    client_ip: Some(ClientIpConfig { timeout_seconds: t }),
                }
            }),
            ip_families,
            internal_traffic_policy: shape.internal_traffic_policy.clone(),
            traffic_distribution: shape.traffic_distribution.clone(),
        },
    );
    si.metadata.namespace = Some(key.namespace.clone());
    si.metadata.labels = Some(labels);
    if !shape.annotations.is_empty() {
        si.metadata.annotations = Some(shape.annotations.clone());
    }
    // Always Present: the endpoints of every import this controller writes are MCS
    // EndpointSlices (none while no exporting cluster has a slice of the Service).
    si.status = Some(ServiceImportStatus {
        endpoint_slice_objects: Some(EndpointSliceObjects::Present),
        clusters: shape
            .clusters
            .iter()
            .map(|c| ClusterStatus { cluster: c.clone() })
            .collect(),
        conditions: Vec::new(),
    });
    si
}

/// The conditions of a local export, keeping each one's transition time while its status
/// stays.
fn conditions(c: &ExportConditions, se: &LeanExport, now: &Time) -> Vec<Condition> {
    let make = |type_: &str, m: &mcs_merge::Condition| {
        let status = if m.status { "True" } else { "False" };
        let since = se
            .conditions
            .since(type_, status)
            .map_or_else(|| now.clone(), Clone::clone);
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: m.reason.clone(),
            message: m.message.clone(),
            last_transition_time: since,
            observed_generation: se.generation,
        }
    };
    let mut v = vec![make("Valid", &c.valid), make("Ready", &c.ready)];
    if let Some(k) = &c.conflict {
        v.push(make("Conflict", k));
    }
    v
}

#[cfg(test)]
mod tests;
