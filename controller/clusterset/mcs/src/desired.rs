//! From what the members hold to what the local cluster should hold: the ServiceImports (with
//! their ClusterSetIPs), the MCS EndpointSlices and the conditions of the local
//! ServiceExports. A function of its inputs (including "now" for condition times), so it is
//! tested without a cluster; the merge itself is `mcs-merge`'s.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::Arc,
};

use k8s_openapi::{
    api::{
        core::v1::Namespace,
        discovery::v1::{Endpoint, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time},
};
use mcs_api::{
    ClientIpConfig, ClusterStatus, DEFAULT_SLICE_CONTROLLER, LABEL_MANAGED_BY, LABEL_SERVICE_NAME,
    LABEL_SOURCE_CLUSTER, LABEL_SOURCE_MANAGED_BY, ServiceImport, ServiceImportSpec,
    ServiceImportStatus, ServiceImportType, ServicePort, SessionAffinityConfig,
};
use mcs_merge::{
    ClusterSetExports, Export, ExportConditions, ImportShape, ServiceKey, ServiceShape,
    alloc::Allocator, meta::Refusal,
};

use crate::objects::{LABEL_K8S_SERVICE_NAME, LeanExport};
use crate::{MANAGED_LABEL, MANAGER, objects::ObjKey};

/// One member's objects, as the reconciler sees them.
#[derive(Debug, Default)]
pub struct MemberView {
    /// Its cluster id.
    pub id: String,
    /// False when it has been unreachable past the member timeout: its endpoints are
    /// withdrawn (its exports still count, from their last known state).
    pub endpoints_count: bool,
    /// ServiceExports.
    pub exports: HashMap<ObjKey, Arc<LeanExport>>,
    /// Services.
    pub services: HashMap<ObjKey, Arc<ServiceShape>>,
    /// Service EndpointSlices.
    pub slices: HashMap<ObjKey, Arc<EndpointSlice>>,
}

/// Everything the reconciler reads.
#[derive(Debug)]
pub struct Snapshot {
    /// This cluster's id.
    pub local: String,
    /// Every member, this cluster included.
    pub members: Vec<MemberView>,
    /// Local namespaces.
    pub namespaces: HashMap<ObjKey, Arc<Namespace>>,
    /// Local ServiceImports (all, ours and others').
    pub imports: HashMap<ObjKey, Arc<ServiceImport>>,
    /// Now, for condition transition times.
    pub now: Time,
    /// Namespaces whose exports are refused (not merged, never imported).
    pub refused_namespaces: std::collections::BTreeSet<String>,
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
pub fn refusal(
    ns: &str,
    name: &str,
    refused_namespaces: &std::collections::BTreeSet<String>,
) -> Option<Refusal> {
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
/// and name), each namespace keeps at most `s.exports_per_namespace` and the member at most
/// `s.exports_per_member`. Exports refused for their namespace or Service do not count.
fn over_limits(m: &MemberView, s: &Snapshot) -> HashMap<ObjKey, Refusal> {
    let mut over = HashMap::new();
    if s.exports_per_namespace.is_none() && s.exports_per_member.is_none() {
        return over;
    }
    let mut live: Vec<(i64, &ObjKey)> = m
        .exports
        .iter()
        .filter(|((ns, name), se)| {
            !se.deleting && refusal(ns, name, &s.refused_namespaces).is_none()
        })
        .map(|(k, se)| (se.created, k))
        .collect();
    if s.exports_per_namespace.is_none_or(|n| live.len() <= n)
        && s.exports_per_member.is_none_or(|n| live.len() <= n)
    {
        return over;
    }
    live.sort_unstable();
    let (mut total, mut per_ns) = (0usize, HashMap::<&str, usize>::new());
    for (_, k) in live {
        let in_ns = per_ns.entry(k.0.as_str()).or_default();
        let why = if s.exports_per_namespace.is_some_and(|n| *in_ns >= n) {
            format!(
                "namespace {} of cluster {} already exports {} older services (mcs-controller --exports-per-namespace)",
                k.0, m.id, *in_ns
            )
        } else if s.exports_per_member.is_some_and(|n| total >= n) {
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
#[derive(Debug, Default)]
pub struct Desired {
    /// ServiceImports by (namespace, name), with status.
    pub imports: BTreeMap<ObjKey, ServiceImport>,
    /// MCS EndpointSlices by (namespace, name).
    pub slices: BTreeMap<ObjKey, EndpointSlice>,
    /// Conditions of the local ServiceExports.
    pub export_conditions: BTreeMap<ObjKey, Vec<Condition>>,
    /// Why something is not as asked (logged by the reconciler).
    pub problems: Vec<String>,
    /// Source slices not exported because no selector computed them.
    pub withheld: usize,
}

/// Computes the desired local state; `alloc`: a fresh allocator over the ClusterSetIP ranges.
pub fn desired(s: &Snapshot, mut alloc: Allocator) -> Desired {
    let mut out = Desired::default();
    let mut all: ClusterSetExports = BTreeMap::new();
    for m in &s.members {
        let over = over_limits(m, s);
        for ((ns, name), se) in &m.exports {
            if se.deleting {
                continue;
            }
            let limit = over.get(&(ns.clone(), name.clone())).cloned();
            let service = m
                .services
                .get(&(ns.clone(), name.clone()))
                .map(|svc| (**svc).clone());
            all.entry(ServiceKey {
                namespace: ns.clone(),
                name: name.clone(),
            })
            .or_default()
            .insert(
                m.id.clone(),
                Export {
                    created: se.created,
                    service,
                    labels: se.labels.clone(),
                    annotations: se.annotations.clone(),
                    refused: refusal(ns, name, &s.refused_namespaces)
                        .or(limit)
                        .or_else(|| se.refused.clone()),
                },
            );
        }
    }
    let merged = mcs_merge::merge_all(&all);

    // Imports where the namespace exists (and is not going away).
    let wanted: Vec<(&ServiceKey, &ImportShape)> = merged
        .iter()
        .filter_map(|(k, m)| m.import.as_ref().map(|i| (k, i)))
        .filter(|(k, _)| {
            s.namespaces
                .get(&(String::new(), k.namespace.clone()))
                .is_some_and(|n| n.metadata.deletion_timestamp.is_none())
        })
        .collect();

    // ClusterSetIPs: reserve what imports hold (ours kept if still valid), then allocate.
    let mut keep: HashMap<ObjKey, Vec<String>> = HashMap::new();
    let mut existing: Vec<(&ObjKey, &Arc<ServiceImport>)> = s.imports.iter().collect();
    existing.sort_by(|a, b| a.0.cmp(b.0));
    for (_, si) in &existing {
        if !ours(si) {
            for ip in si.spec.ips.iter().filter_map(|i| i.parse::<IpAddr>().ok()) {
                alloc.reserve(ip);
            }
        }
    }
    for (k, si) in &existing {
        if !ours(si) {
            continue;
        }
        let key = ServiceKey {
            namespace: k.0.clone(),
            name: k.1.clone(),
        };
        let Some(shape) = merged.get(&key).and_then(|m| m.import.as_ref()) else {
            // Going away in this pass: its addresses stay reserved until it is gone, so no
            // new import gets one while the old one still holds it.
            for ip in si.spec.ips.iter().filter_map(|i| i.parse::<IpAddr>().ok()) {
                alloc.reserve(ip);
            }
            continue;
        };
        if shape.headless {
            continue;
        }
        let ips: Vec<IpAddr> = si.spec.ips.iter().filter_map(|i| i.parse().ok()).collect();
        let fits = ips.len() == si.spec.ips.len()
            && ips.len() == shape.ip_families.len()
            && ips
                .iter()
                .zip(&shape.ip_families)
                .all(|(ip, f)| family(*ip) == f && alloc.allowed(*ip));
        if fits && ips.iter().all(|ip| alloc.reserve(*ip)) {
            keep.insert((*k).clone(), si.spec.ips.clone());
        }
    }

    // Each member's Service slices by (namespace, service), once per pass.
    let mut by_service: HashMap<&str, HashMap<ObjKey, Vec<&EndpointSlice>>> = HashMap::new();
    for m in &s.members {
        let idx = by_service.entry(m.id.as_str()).or_default();
        for es in m.slices.values() {
            let labels = es.metadata.labels.as_ref();
            let Some(svc) = labels.and_then(|l| l.get(LABEL_K8S_SERVICE_NAME)) else {
                continue;
            };
            if labels
                .and_then(|l| l.get(LABEL_MANAGED_BY))
                .is_some_and(|v| v == MANAGER)
            {
                continue;
            }
            idx.entry((
                es.metadata.namespace.clone().unwrap_or_default(),
                svc.clone(),
            ))
            .or_default()
            .push(es);
        }
    }

    // ClusterSetIPs held per namespace (ours kept), for the quota.
    let mut held: HashMap<&str, usize> = HashMap::new();
    for (k, ips) in &keep {
        *held.entry(k.0.as_str()).or_default() += ips.len();
    }
    // Imports of the local exports that got no ClusterSetIP, and why.
    let mut no_ip: HashMap<ObjKey, String> = HashMap::new();
    // Local exports of selectorless Services whose slices are withheld.
    let mut selectorless: std::collections::HashSet<ObjKey> = Default::default();
    for (key, shape) in wanted {
        let k: ObjKey = (key.namespace.clone(), key.name.clone());
        if let Some(si) = s.imports.get(&k)
            && !ours(si)
        {
            out.problems.push(format!(
                "ServiceImport {key} exists and is not managed by {MANAGER}; leaving it alone"
            ));
            continue;
        }
        let mut over_quota = false;
        let (ips, families) = if shape.headless {
            // No ClusterSetIP, but the families of the exported Services: clients (and the
            // conformance suite) read them to know which address records to ask for.
            (Vec::new(), shape.ip_families.clone())
        } else if let Some(ips) = keep.get(&k) {
            (ips.clone(), shape.ip_families.clone())
        } else if let Some(q) = s.ip_quota
            && held.get(key.namespace.as_str()).copied().unwrap_or(0) + shape.ip_families.len() > q
        {
            out.problems.push(format!(
                "no ClusterSetIP for {key}: namespace {} holds its quota of {q} (--clusterset-ips-per-namespace)",
                key.namespace
            ));
            over_quota = true;
            (Vec::new(), Vec::new())
        } else {
            let mut ips = Vec::new();
            let mut families = Vec::new();
            for f in &shape.ip_families {
                match alloc.allocate(f, &key.to_string()) {
                    Some(ip) => {
                        ips.push(ip.to_string());
                        families.push(f.clone());
                    }
                    None => out.problems.push(format!(
                        "no free {f} ClusterSetIP for {key} (none of --clusterset-ip-cidr is {f}, or it is full)"
                    )),
                }
            }
            *held.entry(key.namespace.as_str()).or_default() += ips.len();
            (ips, families)
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
            no_ip.insert(k.clone(), format!("has no ClusterSetIP: {}", ready.2));
        }
        let mut si = import(key, shape, ips, families);
        let since = s
            .imports
            .get(&k)
            .and_then(|old| old.status.as_ref())
            .and_then(|st| {
                st.conditions
                    .iter()
                    .find(|c| c.type_ == "Ready" && c.status == ready.0)
            })
            .map_or_else(|| s.now.clone(), |c| c.last_transition_time.clone());
        if let Some(st) = si.status.as_mut() {
            st.conditions = vec![Condition {
                type_: "Ready".into(),
                status: ready.0.into(),
                reason: ready.1.into(),
                message: ready.2,
                last_transition_time: since,
                observed_generation: None,
            }];
        }
        out.imports.insert(k.clone(), si);

        // Slices from every exporting cluster whose endpoints count.
        for m in s
            .members
            .iter()
            .filter(|m| m.endpoints_count && shape.clusters.contains(&m.id))
        {
            let svc = m.services.get(&k);
            // This cluster's ports that the import carries as it defines them (a port it
            // defines differently gets no traffic from here), once per service.
            let served: Vec<String> = svc
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
            let Some(of_service) = by_service.get(m.id.as_str()).and_then(|b| b.get(&k)) else {
                continue;
            };
            for es in of_service {
                let source = source_manager(es);
                let computed = selector && source == DEFAULT_SLICE_CONTROLLER;
                if !computed && !s.export_selectorless {
                    out.withheld += 1;
                    out.problems.push(format!(
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
                        selectorless.insert(k.clone());
                    }
                    continue;
                }
                if let Some(mcs) = mcs_slice(key, &m.id, es, &served, computed) {
                    out.slices.insert(
                        (
                            key.namespace.clone(),
                            mcs.metadata.name.clone().unwrap_or_default(),
                        ),
                        mcs,
                    );
                }
            }
        }
    }
    // Local export conditions; an export whose import here got no ClusterSetIP is not
    // Ready.
    if let Some(me) = s.members.iter().find(|m| m.id == s.local) {
        for (k, se) in &me.exports {
            if se.deleting {
                continue;
            }
            let key = ServiceKey {
                namespace: k.0.clone(),
                name: k.1.clone(),
            };
            if let Some(c) = merged.get(&key).and_then(|m| m.exports.get(&s.local)) {
                let mut c = c.clone();
                if let Some(why) = no_ip.get(k)
                    && c.ready.status
                {
                    c.ready = mcs_merge::Condition {
                        status: false,
                        reason: NO_CLUSTERSET_IP.into(),
                        message: format!("the ServiceImport in cluster {} {why}", s.local),
                    };
                } else if selectorless.contains(k) && c.ready.status {
                    c.ready = mcs_merge::Condition {
                        status: false,
                        reason: SELECTORLESS_SERVICE.into(),
                        message: "the Service has no selector: its EndpointSlices (mirrored from Endpoints, or written by hand) are not exported unless every cluster's mcs-controller runs with --export-selectorless-slices".into(),
                    };
                }
                out.export_conditions
                    .insert(k.clone(), conditions(&c, se, &s.now));
            }
        }
    }
    out
}

/// Whether this controller manages `si`.
pub fn ours(si: &ServiceImport) -> bool {
    si.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(MANAGED_LABEL))
        .is_some_and(|v| v == MANAGER)
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
    si.status = Some(ServiceImportStatus {
        clusters: shape
            .clusters
            .iter()
            .map(|c| ClusterStatus { cluster: c.clone() })
            .collect(),
        conditions: Vec::new(),
    });
    si
}

/// Who manages a member's slice (`endpointslice.kubernetes.io/managed-by`; `none` without
/// one). Only `DEFAULT_SLICE_CONTROLLER` computes endpoints from a selector; a value that is
/// not a valid label value (it came from a label, so it is) would be `none` too.
fn source_manager(es: &EndpointSlice) -> &str {
    es.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_MANAGED_BY))
        .map(String::as_str)
        .filter(|m| !m.is_empty() && m.len() <= 63)
        .unwrap_or("none")
}

/// What the MCS copy of a slice that no selector computed says in `LABEL_SOURCE_MANAGED_BY`:
/// its manager, but never `DEFAULT_SLICE_CONTROLLER` (a slice of a selectorless Service that
/// claims it was written by someone else), so agents can always tell.
fn selectorless_source(es: &EndpointSlice) -> &str {
    match source_manager(es) {
        DEFAULT_SLICE_CONTROLLER => "none",
        m => m,
    }
}

/// The MCS slice for `es` of cluster `cluster`: its endpoints, and the ports the import has
/// for that cluster (a port this cluster defines differently from the import is left out, so
/// the conflicting definition gets no traffic); `computed`: Kubernetes' EndpointSlice
/// controller computed `es` from the Service's selector. `None` when no port is left.
fn mcs_slice(
    key: &ServiceKey,
    cluster: &str,
    es: &EndpointSlice,
    served: &[String],
    computed: bool,
) -> Option<EndpointSlice> {
    let src_ports = es.ports.as_deref().unwrap_or_default();
    let ports: Vec<EndpointPort> = src_ports
        .iter()
        .filter(|p| served.contains(&p.name.clone().unwrap_or_default()))
        .cloned()
        .collect();
    if ports.is_empty() && !src_ports.is_empty() {
        return None;
    }
    let src = es.metadata.name.clone().unwrap_or_default();
    let hash = mcs_merge::alloc::fnv1a(format!("{cluster}/{src}").as_bytes());
    let name = format!(
        "{}-{}-{hash:08x}",
        trim(&key.name, 40),
        trim(cluster, 40),
        hash = hash as u32
    );
    let labels = BTreeMap::from([
        (LABEL_SERVICE_NAME.to_string(), key.name.clone()),
        (LABEL_SOURCE_CLUSTER.to_string(), cluster.to_string()),
        (LABEL_MANAGED_BY.to_string(), MANAGER.to_string()),
        (
            LABEL_SOURCE_MANAGED_BY.to_string(),
            if computed {
                DEFAULT_SLICE_CONTROLLER
            } else {
                selectorless_source(es)
            }
            .to_string(),
        ),
    ]);
    Some(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(key.namespace.clone()),
            labels: Some(labels),
            ..Default::default()
        },
        address_type: es.address_type.clone(),
        endpoints: es.endpoints.as_ref().map(|eps| {
            eps.iter()
                .map(|e| Endpoint {
                    addresses: e.addresses.clone(),
                    conditions: e.conditions.clone(),
                    hostname: e.hostname.clone(),
                    node_name: e.node_name.clone(),
                    zone: e.zone.clone(),
                    hints: e.hints.clone(),
                    ..Default::default()
                })
                .collect()
        }),
        ports: Some(ports),
    })
}

/// At most `n` bytes of a DNS label or subdomain as part of one DNS label: dots become
/// dashes (a cluster id may hold dots; cut at one, it would end the name's label with a dot),
/// no trailing dash.
fn trim(s: &str, n: usize) -> String {
    let mut end = s.len().min(n);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].replace('.', "-").trim_end_matches('-').to_string()
}

/// The conditions of a local export, keeping each one's transition time while its status
/// stays.
fn conditions(c: &ExportConditions, se: &LeanExport, now: &Time) -> Vec<Condition> {
    let old = &se.conditions;
    let make = |type_: &str, m: &mcs_merge::Condition| {
        let status = if m.status { "True" } else { "False" };
        let since = old
            .iter()
            .find(|o| o.type_ == type_ && o.status == status)
            .map_or_else(|| now.clone(), |o| o.last_transition_time.clone());
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
