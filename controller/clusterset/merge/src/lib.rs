//! The ClusterSet merge of the MCS controller, pure: what every member cluster exports (its
//! ServiceExports and the Services behind them) in, the ServiceImport each service gets and the
//! conditions of every export out. No kube, no tokio, no clock: every cluster's controller
//! computes the same answer from the same exports, whatever order they arrive in.
//!
//! # Rules (KEP-1645, mcs-api v1beta1)
//!
//! - An export is **valid** when it is not refused by the caller ([`Export::refused`]), its
//!   exported labels and annotations can be put on a ServiceImport ([`meta`]) and its Service
//!   exists and is not `ExternalName` (`Valid=False`, reasons the caller's,
//!   `InvalidExportedLabels`, `InvalidExportedAnnotations`, `NoService`,
//!   `InvalidServiceType`); invalid exports take no part. An export the caller kept without
//!   its labels and annotations ([`Export::metadata_dropped`]) is valid, says so in its
//!   `Valid` condition's reason and message, and its metadata is no conflict.
//! - Among valid exports, **precedence** is the ServiceExport's creationTimestamp (oldest
//!   first), ties broken by cluster id. The first is the *winner*: its type (headless or not),
//!   session affinity (and config), internal traffic policy, traffic distribution, IP families
//!   and exported labels/annotations are the import's.
//! - **Ports** are the union by name, then by protocol+port, in precedence order: a port whose
//!   name is taken with another protocol or number, or whose protocol+port is taken under
//!   another name, loses to the older one. The import carries at most [`MAX_PORTS`] (what
//!   the agents accept): the ports past it, from the youngest exports, are left out and are
//!   a `PortConflict` of the exports they come from.
//! - Any difference from the winner (including a different port set) is a **conflict**:
//!   `Conflict=True` on every valid export of the service, with the reasons comma-joined
//!   (`PortConflict`, `TypeConflict`, …) and a message naming the clusters; otherwise
//!   `Conflict=False`, `NoConflicts`.
//! - The import lists the valid exporting clusters; with none, there is no import.
#![forbid(unsafe_code)]

pub mod alloc;
pub mod meta;

use std::collections::{BTreeMap, BTreeSet};

/// A member cluster's id.
pub type ClusterId = String;

/// A service by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The `type` of a Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServiceKind {
    /// `ClusterIP` (also `clusterIP: None`, headless).
    ClusterIp,
    /// `NodePort`: exported as ClusterSetIP.
    NodePort,
    /// `LoadBalancer`: exported as ClusterSetIP.
    LoadBalancer,
    /// `ExternalName`: cannot be exported.
    ExternalName,
}

/// A Service port as the import carries it (no target port: the slices have it).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Port {
    /// Name (may be empty for a single-port service).
    pub name: String,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// Port number.
    pub port: i32,
    /// `appProtocol`, if set.
    pub app_protocol: Option<String>,
}

/// The parts of an exported Service that the import is made of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceShape {
    /// The Service's type.
    pub kind: Option<ServiceKind>,
    /// `clusterIP: None`.
    pub headless: bool,
    /// Ports.
    pub ports: Vec<Port>,
    /// `sessionAffinity` (`None` or `ClientIP`).
    pub session_affinity: Option<String>,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`, when the config is present (the inner
    /// `None`: present without a timeout).
    pub session_affinity_timeout: Option<Option<i32>>,
    /// `internalTrafficPolicy`.
    pub internal_traffic_policy: Option<String>,
    /// `trafficDistribution`.
    pub traffic_distribution: Option<String>,
    /// `ipFamilies`, in order.
    pub ip_families: Vec<String>,
    /// It has a `spec.selector`, so Kubernetes' EndpointSlice controller computes its
    /// EndpointSlices. Not merged: it decides which of a cluster's slices are exported.
    pub selector: bool,
}

/// One cluster's export of a service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Export {
    /// The ServiceExport's creationTimestamp, in seconds since the epoch.
    pub created: i64,
    /// The Service behind it, if it exists in that cluster.
    pub service: Option<ServiceShape>,
    /// `spec.exportedLabels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.exportedAnnotations`.
    pub annotations: BTreeMap<String, String>,
    /// Set when the caller refuses the export (a namespace or service that may not be
    /// exported, metadata it cannot carry): it is invalid with this reason.
    pub refused: Option<meta::Refusal>,
    /// Set when the caller kept the export without its exported labels and annotations (its
    /// member's budget for them is spent): the export is valid and imported, its `Valid`
    /// condition says why its metadata is not carried, and its (unknown) metadata is no
    /// conflict.
    pub metadata_dropped: Option<meta::Refusal>,
}

/// The most ports an import carries: the agents refuse an import with more
/// (`mcs_model::guard::Limits::ports_per_import`).
pub const MAX_PORTS: usize = 100;

/// The ServiceImport a service gets (without its ClusterSetIPs, which each cluster allocates).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportShape {
    /// `Headless` (true) or `ClusterSetIP`.
    pub headless: bool,
    /// The merged ports, sorted by name then protocol and port.
    pub ports: Vec<Port>,
    /// From the winner.
    pub session_affinity: Option<String>,
    /// From the winner.
    pub session_affinity_timeout: Option<Option<i32>>,
    /// From the winner.
    pub internal_traffic_policy: Option<String>,
    /// From the winner.
    pub traffic_distribution: Option<String>,
    /// From the winner (empty for headless imports).
    pub ip_families: Vec<String>,
    /// From the winner's export.
    pub labels: BTreeMap<String, String>,
    /// From the winner's export.
    pub annotations: BTreeMap<String, String>,
    /// Valid exporting clusters, sorted.
    pub clusters: Vec<ClusterId>,
}

/// A condition of a ServiceExport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// `True` or `False`.
    pub status: bool,
    /// The reason (upstream constants; comma-joined for several conflicts).
    pub reason: String,
    /// For a person.
    pub message: String,
}

impl Condition {
    fn new(status: bool, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// The conditions of one ServiceExport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportConditions {
    /// `Valid`.
    pub valid: Condition,
    /// `Conflict` (absent for invalid exports).
    pub conflict: Option<Condition>,
    /// `Ready`.
    pub ready: Condition,
}

/// The merge of one service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Merged {
    /// The import, when at least one export is valid.
    pub import: Option<ImportShape>,
    /// Conditions of every export, by cluster.
    pub exports: BTreeMap<ClusterId, ExportConditions>,
}

/// Condition reasons (mcs-api v1beta1 constants).
pub mod reason {
    /// Valid=True.
    pub const VALID: &str = "Valid";
    /// No Service of that name.
    pub const NO_SERVICE: &str = "NoService";
    /// ExternalName Services cannot be exported.
    pub const INVALID_SERVICE_TYPE: &str = "InvalidServiceType";
    /// Ready=True.
    pub const EXPORTED: &str = "Exported";
    /// Ready=False.
    pub const FAILED: &str = "Failed";
    /// Conflict=False.
    pub const NO_CONFLICTS: &str = "NoConflicts";
    /// Ports differ.
    pub const PORT: &str = "PortConflict";
    /// Headlessness differs.
    pub const TYPE: &str = "TypeConflict";
    /// sessionAffinity differs.
    pub const SESSION_AFFINITY: &str = "SessionAffinityConflict";
    /// sessionAffinityConfig differs.
    pub const SESSION_AFFINITY_CONFIG: &str = "SessionAffinityConfigConflict";
    /// exportedLabels differ.
    pub const LABELS: &str = "LabelsConflict";
    /// exportedAnnotations differ.
    pub const ANNOTATIONS: &str = "AnnotationsConflict";
    /// internalTrafficPolicy differs.
    pub const INTERNAL_TRAFFIC_POLICY: &str = "InternalTrafficPolicyConflict";
    /// trafficDistribution differs.
    pub const TRAFFIC_DISTRIBUTION: &str = "TrafficDistributionConflict";
    /// ipFamilies differ.
    pub const IP_FAMILY: &str = "IPFamilyConflict";
}

/// Merges the exports of one service (`exports`: by cluster).
pub fn merge(key: &ServiceKey, exports: &BTreeMap<ClusterId, Export>) -> Merged {
    let mut conditions = BTreeMap::new();
    let mut valid: Vec<(&ClusterId, &Export, &ServiceShape)> = Vec::new();
    for (cluster, e) in exports {
        let refused = match &e.refused {
            Some(r) => Some(r.clone()),
            None => meta::check_labels(&e.labels)
                .and_then(|()| meta::check_annotations(&e.annotations))
                .err(),
        };
        if let Some(r) = refused {
            conditions.insert(cluster.clone(), invalid(&r.reason, r.message));
            continue;
        }
        match &e.service {
            None => {
                conditions.insert(
                    cluster.clone(),
                    invalid(
                        reason::NO_SERVICE,
                        format!("no Service {key} in cluster {cluster}"),
                    ),
                );
            }
            Some(s) if s.kind == Some(ServiceKind::ExternalName) => {
                conditions.insert(
                    cluster.clone(),
                    invalid(
                        reason::INVALID_SERVICE_TYPE,
                        format!("Service {key} in cluster {cluster} is of type ExternalName, which cannot be exported"),
                    ),
                );
            }
            Some(s) => valid.push((cluster, e, s)),
        }
    }
    valid.sort_by(|a, b| (a.1.created, a.0).cmp(&(b.1.created, b.0)));
    let Some(&(winner_cluster, winner, w)) = valid.first() else {
        return Merged {
            import: None,
            exports: conditions,
        };
    };

    // Ports: union in precedence order.
    let mut ports: Vec<Port> = Vec::new();
    let mut reasons: BTreeSet<&'static str> = BTreeSet::new();
    let mut conflicting: BTreeSet<&ClusterId> = BTreeSet::new();
    // Clusters with ports left out for want of room, and how many.
    let mut over: BTreeMap<&ClusterId, usize> = BTreeMap::new();
    for &(cluster, _, s) in &valid {
        for p in &s.ports {
            let same_name = ports.iter().find(|q| q.name == p.name);
            let same_number = ports
                .iter()
                .find(|q| q.protocol == p.protocol && q.port == p.port);
            match (same_name, same_number) {
                (Some(q), _) if q.protocol == p.protocol && q.port == p.port => {}
                (None, None) if ports.len() < MAX_PORTS => ports.push(p.clone()),
                (None, None) => {
                    *over.entry(cluster).or_default() += 1;
                    reasons.insert(reason::PORT);
                    conflicting.insert(cluster);
                }
                _ => {
                    reasons.insert(reason::PORT);
                    conflicting.insert(cluster);
                }
            }
        }
    }
    let winner_ports: BTreeSet<(&str, &str, i32)> = port_set(w);
    for &(cluster, e, s) in valid.iter().skip(1) {
        let mut differs = |cond: bool, r: &'static str| {
            if cond {
                reasons.insert(r);
                conflicting.insert(cluster);
            }
        };
        differs(port_set(s) != winner_ports, reason::PORT);
        differs(s.headless != w.headless, reason::TYPE);
        differs(
            norm_affinity(&s.session_affinity) != norm_affinity(&w.session_affinity),
            reason::SESSION_AFFINITY,
        );
        differs(
            s.session_affinity_timeout != w.session_affinity_timeout,
            reason::SESSION_AFFINITY_CONFIG,
        );
        differs(
            s.internal_traffic_policy != w.internal_traffic_policy,
            reason::INTERNAL_TRAFFIC_POLICY,
        );
        differs(
            s.traffic_distribution != w.traffic_distribution,
            reason::TRAFFIC_DISTRIBUTION,
        );
        differs(
            !s.headless && !w.headless && s.ip_families != w.ip_families,
            reason::IP_FAMILY,
        );
        // Metadata not kept (over a budget) is unknown, not different.
        let known = e.metadata_dropped.is_none() && winner.metadata_dropped.is_none();
        differs(known && e.labels != winner.labels, reason::LABELS);
        differs(
            known && e.annotations != winner.annotations,
            reason::ANNOTATIONS,
        );
    }
    ports.sort();

    let conflict = if reasons.is_empty() {
        Condition::new(false, reason::NO_CONFLICTS, "no conflicts")
    } else {
        let r: Vec<&str> = reasons.iter().copied().collect();
        let others: Vec<&str> = conflicting.iter().map(|c| c.as_str()).collect();
        let mut message = format!(
            "the exports of {key} in clusters {} differ from the oldest, in cluster {winner_cluster} ({}), which takes precedence",
            others.join(", "),
            r.join(", ")
        );
        if !over.is_empty() {
            let left: Vec<String> = over.iter().map(|(c, n)| format!("{n} of {c}")).collect();
            message.push_str(&format!(
                "; the import carries at most {MAX_PORTS} ports, so these are left out: {}",
                left.join(", ")
            ));
        }
        Condition::new(true, r.join(","), message)
    };
    for &(cluster, e, _) in &valid {
        let valid = match &e.metadata_dropped {
            None => Condition::new(true, reason::VALID, "the service is exported"),
            Some(r) => Condition::new(
                true,
                &r.reason,
                format!(
                    "the service is exported without its exported labels and annotations: {}",
                    r.message
                ),
            ),
        };
        conditions.insert(
            cluster.clone(),
            ExportConditions {
                valid,
                conflict: Some(conflict.clone()),
                ready: Condition::new(true, reason::EXPORTED, "the service is exported"),
            },
        );
    }
    let mut clusters: Vec<ClusterId> = valid.iter().map(|v| v.0.clone()).collect();
    clusters.sort();
    Merged {
        import: Some(ImportShape {
            headless: w.headless,
            ports,
            session_affinity: w.session_affinity.clone(),
            session_affinity_timeout: w.session_affinity_timeout,
            internal_traffic_policy: w.internal_traffic_policy.clone(),
            traffic_distribution: w.traffic_distribution.clone(),
            // Headless too: there is no ClusterSetIP, but clients (and the conformance suite)
            // read the families to know which address records to ask for.
            ip_families: w.ip_families.clone(),
            labels: winner.labels.clone(),
            annotations: winner.annotations.clone(),
            clusters,
        }),
        exports: conditions,
    }
}

fn invalid(reason: &str, message: String) -> ExportConditions {
    ExportConditions {
        valid: Condition::new(false, reason, message.clone()),
        conflict: None,
        ready: Condition::new(false, reason::FAILED, message),
    }
}

fn port_set(s: &ServiceShape) -> BTreeSet<(&str, &str, i32)> {
    s.ports
        .iter()
        .map(|p| (p.name.as_str(), p.protocol.as_str(), p.port))
        .collect()
}

/// `sessionAffinity` absent means `None`.
fn norm_affinity(a: &Option<String>) -> &str {
    a.as_deref().unwrap_or("None")
}

/// Every service's exports: by service, then by cluster.
pub type ClusterSetExports = BTreeMap<ServiceKey, BTreeMap<ClusterId, Export>>;

/// Merges every service.
pub fn merge_all(all: &ClusterSetExports) -> BTreeMap<ServiceKey, Merged> {
    all.iter().map(|(k, e)| (k.clone(), merge(k, e))).collect()
}

#[cfg(test)]
mod tests;
