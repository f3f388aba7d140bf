//! `kubectl mcs explain NAME -n NS`: why a service is (not) reachable. Per member: the
//! export and its conditions, the Service's ports, the import, the endpoints per source
//! cluster; per node: what the agent programmed (or why it rejected it) and what its DNS
//! listener answers. Each finding says what to fix.

use std::collections::{BTreeMap, BTreeSet};

use futures::future::join_all;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{Api, Client, api::ListParams};
use mcs_api::{LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER, ServiceExport, ServiceImport};
use mcs_model::{
    Backend,
    status::{AgentStatus, NodeStatus},
};
use serde_json::{Value, json};

use crate::{
    member::{Member, agent_statuses, chart_pods, short},
    report::{Level, Report, Section},
};

/// A port as (name, port, protocol) (for comparing exports with the import).
type Port = (String, i32, String);

fn port(name: Option<&String>, port: i32, protocol: Option<&String>) -> Port {
    (
        name.cloned().unwrap_or_default(),
        port,
        protocol.cloned().unwrap_or_else(|| "TCP".into()),
    )
}

/// The import's ports.
fn import_ports(i: &ServiceImport) -> BTreeSet<Port> {
    i.spec
        .ports
        .iter()
        .map(|p| port(p.name.as_ref(), p.port, p.protocol.as_ref()))
        .collect()
}

/// What one member holds of the service.
#[derive(Default)]
struct Found {
    reachable: bool,
    exported: bool,
    service_ports: Option<BTreeSet<Port>>,
    import: Option<ServiceImport>,
}

/// The whole report.
pub async fn explain(members: &[Member], mcs_ns: &str, ns: &str, name: &str) -> Report {
    let results = join_all(members.iter().map(|m| member(m, mcs_ns, ns, name))).await;
    let mut data = serde_json::Map::new();
    let mut sections = Vec::new();
    let mut found = Vec::new();
    for (m, (section, f, agents)) in members.iter().zip(results) {
        data.insert(m.context.clone(), json!({ "agents": agents }));
        sections.push(section);
        found.push((m.context.clone(), f));
    }
    sections.insert(0, summary(&found, ns, name));
    Report::new(
        format!("explain {ns}/{name}"),
        sections,
        Value::Object(data),
    )
}

/// Across members: who exports it, and whether their ports agree with the import's.
fn summary(found: &[(String, Found)], ns: &str, name: &str) -> Section {
    let mut s = Section::new(format!("service {ns}/{name} in the ClusterSet"));
    let exporters: Vec<&str> = found
        .iter()
        .filter(|(_, f)| f.exported)
        .map(|(c, _)| c.as_str())
        .collect();
    let unreachable: Vec<&str> = found
        .iter()
        .filter(|(_, f)| !f.reachable)
        .map(|(c, _)| c.as_str())
        .collect();
    s.verdict(
        !exporters.is_empty(),
        Level::Fail,
        "exported by",
        if exporters.is_empty() {
            format!(
                "no member exports it{}",
                if unreachable.is_empty() {
                    String::new()
                } else {
                    format!(" (unreachable, not known: {})", unreachable.join(", "))
                }
            )
        } else {
            exporters.join(", ")
        },
        &format!(
            "create a ServiceExport named {name} in namespace {ns} of the cluster(s) whose Service {ns}/{name} should serve it"
        ),
    );
    // The import's ports (the oldest export's): compare every exporter's Service with them.
    let import_ports: Option<BTreeSet<Port>> = found
        .iter()
        .find_map(|(_, f)| f.import.as_ref())
        .map(import_ports);
    if let Some(want) = &import_ports {
        for (c, f) in found.iter().filter(|(_, f)| f.exported) {
            let Some(have) = &f.service_ports else {
                continue;
            };
            if have != want {
                s.push_fix(
                    Level::Fail,
                    format!("ports of {c}"),
                    format!(
                        "{c} exports {}, the import uses {}",
                        ports(have),
                        ports(want)
                    ),
                    format!(
                        "make Service {ns}/{name}'s ports (name, port, protocol) the same in every exporting cluster: until then the import carries the oldest export's ports (PortConflict) and {c}'s endpoints are left out of the ports that differ (the endpoints lines show which clusters serve)"
                    ),
                );
            }
        }
    }
    s
}

fn ports(p: &BTreeSet<Port>) -> String {
    if p.is_empty() {
        return "no ports".into();
    }
    p.iter()
        .map(|(n, port, proto)| {
            if n.is_empty() {
                format!("{port}/{proto}")
            } else {
                format!("port {port}/{proto} named {n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn member(m: &Member, mcs_ns: &str, ns: &str, name: &str) -> (Section, Found, Value) {
    let mut s = Section::new(format!("cluster {} ({})", m.context, m.server));
    let mut f = Found::default();
    let client = match &m.client {
        Ok(c) => c.clone(),
        Err(e) => {
            s.push(Level::Fail, "reachable", format!("no client: {e}"));
            return (s, f, Value::Null);
        }
    };
    if let Err(e) = client.apiserver_version().await {
        s.push_fix(
            Level::Fail,
            "reachable",
            format!("API server unreachable: {}", short(&e)),
            "kubectl mcs status says more",
        );
        return (s, f, Value::Null);
    }
    f.reachable = true;
    export(&client, ns, name, &mut s, &mut f).await;
    import(&client, ns, name, &mut s, &mut f).await;
    endpoints(&client, ns, name, &mut s, f.import.is_some()).await;
    let agents = nodes(&client, mcs_ns, ns, name, &mut s, f.import.as_ref()).await;
    (s, f, agents)
}

async fn export(client: &Client, ns: &str, name: &str, s: &mut Section, f: &mut Found) {
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await;
    let svc = s
        .read(svc.map_err(|e| short(&e)), "Service", "reading it")
        .flatten();
    f.service_ports = svc.as_ref().map(|svc| {
        svc.spec
            .as_ref()
            .and_then(|sp| sp.ports.as_ref())
            .map(|ps| {
                ps.iter()
                    .map(|p| port(p.name.as_ref(), p.port, p.protocol.as_ref()))
                    .collect()
            })
            .unwrap_or_default()
    });
    let ex = Api::<ServiceExport>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| short(&e));
    let Some(ex) = s.read(ex, "export", "reading the ServiceExport") else {
        return;
    };
    let Some(ex) = ex else {
        s.push(
            Level::Ok,
            "export",
            match &f.service_ports {
                Some(p) => format!("not exported from here (Service with {})", ports(p)),
                None => "not exported from here (no Service here)".into(),
            },
        );
        return;
    };
    f.exported = true;
    match &f.service_ports {
        Some(p) => s.push(Level::Ok, "Service", ports(p)),
        None => s.push_fix(
            Level::Fail,
            "Service",
            format!("exported, but there is no Service {ns}/{name} here"),
            format!("create Service {ns}/{name} in this cluster, or delete its ServiceExport"),
        ),
    }
    let conditions = ex.status.map(|st| st.conditions).unwrap_or_default();
    if conditions.is_empty() {
        s.push_fix(
            Level::Fail,
            "export",
            "no conditions yet: no controller has looked at it",
            "is this cluster's mcs-controller running? (kubectl mcs status)",
        );
    }
    for c in conditions {
        let what = format!("export {}", c.type_);
        let detail = format!("{} {}: {}", c.status, c.reason, c.message);
        match (c.type_.as_str(), c.status.as_str()) {
            ("Valid", "True") | ("Ready", "True") | ("Conflict", "False") => {
                s.push(Level::Ok, what, detail)
            }
            ("Conflict", "True") => s.push_fix(Level::Fail, what, detail, conflict_fix(&c.reason)),
            ("Valid", _) => s.push_fix(
                Level::Fail,
                what,
                detail,
                match c.reason.as_str() {
                    "NoService" => format!(
                        "create Service {ns}/{name} in this cluster, or delete its ServiceExport"
                    ),
                    "InvalidServiceType" => {
                        "export a ClusterIP or headless Service: ExternalName cannot be".into()
                    }
                    _ => {
                        "the message says what is refused; change the export or its Service".into()
                    }
                },
            ),
            _ => s.push(Level::Warn, what, detail),
        }
    }
}

/// What to do about a `Conflict` reason (or several, comma-separated).
fn conflict_fix(reasons: &str) -> String {
    let fixes: Vec<&str> = reasons
        .split(',')
        .map(|r| match r.trim() {
            "PortConflict" => "make the Service's ports (name, port, protocol) the same in every exporting cluster",
            "TypeConflict" => "make the Service headless (clusterIP: None) in every exporting cluster, or in none",
            "SessionAffinityConflict" | "SessionAffinityConfigConflict" => {
                "use the same sessionAffinity (and its timeout) in every exporting cluster"
            }
            "InternalTrafficPolicyConflict" => {
                "use the same internalTrafficPolicy in every exporting cluster"
            }
            "TrafficDistributionConflict" => {
                "use the same trafficDistribution in every exporting cluster"
            }
            "IPFamilyConflict" => "use the same ipFamilies in every exporting cluster",
            "LabelsConflict" | "AnnotationsConflict" => {
                "export the same labels and annotations (ServiceExport exportedLabels/exportedAnnotations) from every cluster"
            }
            _ => "make that field the same in every exporting cluster",
        })
        .collect();
    format!(
        "{}; until then the oldest export's value is used",
        fixes.join("; ")
    )
}

async fn import(client: &Client, ns: &str, name: &str, s: &mut Section, f: &mut Found) {
    match Api::<ServiceImport>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
    {
        Ok(Some(i)) => {
            let ports = import_ports(&i);
            let clusters: Vec<&str> = i
                .status
                .as_ref()
                .map(|st| st.clusters.iter().map(|c| c.cluster.as_str()).collect())
                .unwrap_or_default();
            let headless = i.spec.type_ == mcs_api::ServiceImportType::Headless;
            let detail = format!(
                "{:?} {}, {}; from {}",
                i.spec.type_,
                if i.spec.ips.is_empty() {
                    "(no IPs)".to_string()
                } else {
                    i.spec.ips.join(", ")
                },
                self::ports(&ports),
                if clusters.is_empty() {
                    "no cluster".to_string()
                } else {
                    clusters.join(", ")
                }
            );
            s.verdict(
                headless || !i.spec.ips.is_empty(),
                Level::Fail,
                "import",
                detail,
                "no ClusterSetIP allocated: see this cluster's controller log (its --clusterset-ip-cidr may be full)",
            );
            f.import = Some(i);
        }
        Ok(None) => s.push_fix(
            Level::Fail,
            "import",
            "no ServiceImport here",
            "if a member exports it, this cluster's controller has not imported it: kubectl mcs status (is it the leader, does it reach the exporting clusters?)",
        ),
        Err(e) => s.push(Level::Fail, "import", format!("reading it: {}", short(&e))),
    }
}

async fn endpoints(client: &Client, ns: &str, name: &str, s: &mut Section, imported: bool) {
    if !imported {
        return;
    }
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{LABEL_SERVICE_NAME}={name}")))
        .await;
    let Some(slices) = s.read(
        slices.map(|l| l.items).map_err(|e| short(&e)),
        "endpoints",
        "listing MCS EndpointSlices",
    ) else {
        return;
    };
    let mut by_cluster: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for sl in &slices {
        let cluster = sl
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SOURCE_CLUSTER))
            .cloned()
            .unwrap_or_else(|| "?".into());
        let e = by_cluster.entry(cluster).or_default();
        for ep in sl.endpoints.iter().flatten() {
            e.1 += 1;
            if ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true) {
                e.0 += 1;
            }
        }
    }
    let ready: usize = by_cluster.values().map(|v| v.0).sum();
    s.verdict(
        ready > 0,
        Level::Fail,
        "endpoints",
        if by_cluster.is_empty() {
            "no MCS EndpointSlice".to_string()
        } else {
            by_cluster
                .iter()
                .map(|(c, (r, t))| format!("{c}: {r}/{t} ready"))
                .collect::<Vec<_>>()
                .join(", ")
        },
        "no ready endpoint anywhere: the pods behind the exported Services are not ready (or select nothing)",
    );
}

/// Each agent's view of the service, and its DNS answers.
async fn nodes(
    client: &Client,
    mcs_ns: &str,
    ns: &str,
    name: &str,
    s: &mut Section,
    import: Option<&ServiceImport>,
) -> Value {
    let pods = chart_pods(client, mcs_ns, "mcs-agent")
        .await
        .map_err(|e| short(&e));
    let Some(pods) = s.read(pods, "agents", "listing the agent pods") else {
        return Value::Null;
    };
    let pods: Vec<_> = pods.into_iter().filter(|p| !p.terminating).collect();
    let mut raw = serde_json::Map::new();
    for (pod, r) in agent_statuses(client, mcs_ns, &pods, &format!("?service={ns}/{name}")).await {
        let what = format!("node {}", pod.node);
        let answer = match r {
            Ok(a) => a,
            Err(e) => {
                s.push_fix(
                    Level::Fail,
                    what,
                    format!("its agent {} did not answer: {e}", pod.name),
                    "see that agent's log",
                );
                continue;
            }
        };
        match answer.node() {
            Ok(node) => node_checks(s, &what, node, import),
            Err(e) => s.push_fix(
                Level::Fail,
                what.clone(),
                format!("its agent {} did not answer for its table: {e}", pod.name),
                "see that agent's log",
            ),
        }
        if let Ok(status) = &answer.status {
            dns_checks(s, &what, status, import);
        }
        raw.insert(pod.node.clone(), answer.raw);
    }
    Value::Object(raw)
}

/// One agent's view: frontends programmed with selected backends, rejections.
fn node_checks(s: &mut Section, what: &str, st: &NodeStatus, import: Option<&ServiceImport>) {
    let dp = &st.dataplane;
    let frontends = st
        .service
        .as_ref()
        .map_or(&[][..], |svc| svc.frontends.as_slice());
    for r in &st.rejected {
        s.push_fix(
            Level::Fail,
            what,
            format!(
                "its agent ({dp}) rejects {}: {}: {}",
                r.object, r.reason, r.message
            ),
            rejection_fix(&r.reason),
        );
    }
    let headless = is_headless(import);
    if frontends.is_empty() {
        if import.is_some() && !headless && st.rejected.is_empty() {
            s.push_fix(
                Level::Fail,
                what,
                format!("its agent ({dp}) has no frontend for it"),
                "the agent may not have seen the import yet (or its ports): look again, then at the agent's log",
            );
        } else if headless {
            s.push(
                Level::Ok,
                what,
                "headless: no frontend (DNS answers the endpoints)",
            );
        }
    }
    for f in frontends {
        let selected: Vec<String> = f
            .backends
            .iter()
            .filter(|b| b.selected)
            .map(backend)
            .collect();
        // An agent lists at most 1,000 backends per answer; its counts are whole (an older
        // agent gives only the list, and no counts).
        let count = |counted: usize, listed: usize| if counted > 0 { counted } else { listed };
        let fallback = count(f.fallback, f.backends.iter().filter(|b| b.fallback).count());
        let selected_total = count(f.selected, selected.len());
        let detail = format!(
            "{} ({dp}{}): {} selected{}{}",
            f.frontend,
            if f.programmed { "" } else { ", NOT programmed" },
            selected_total,
            if selected.is_empty() {
                String::new()
            } else if selected.len() < selected_total {
                format!(
                    " [{}, and {} more]",
                    selected.join(", "),
                    selected_total - selected.len()
                )
            } else {
                format!(" [{}]", selected.join(", "))
            },
            if fallback > 0 {
                format!(", {fallback} fallback")
            } else {
                String::new()
            }
        );
        let fix = if f.programmed {
            "no backend selected: no ready endpoint reaches this node (all not ready, or internalTrafficPolicy Local with none on this node)"
        } else {
            "the dataplane could not program it: see the agent's unprogrammable rejection and its map sizes (mcs-agent status, docs/install.md Sizing)"
        };
        s.verdict(
            f.programmed && selected_total > 0,
            Level::Fail,
            what,
            detail,
            fix,
        );
        // Backends this node skips after failed connects (passive health): the others
        // take their connections until they answer again.
        if !f.skipped.is_empty() {
            let listed: Vec<String> = f
                .skipped
                .iter()
                .map(|b| {
                    format!(
                        "{} ({} failed connects in a row, tried again in {:.1} s)",
                        std::net::SocketAddr::new(b.address, b.port),
                        b.failures,
                        b.for_ms as f64 / 1000.0
                    )
                })
                .collect();
            s.push_fix(
                Level::Warn,
                what,
                format!(
                    "{}: skipped on this node after failed connects: {}",
                    f.frontend,
                    listed.join(", ")
                ),
                "those backends refuse or do not answer (a pod gone while its EndpointSlice still says ready, or its node or cluster unreachable); the others take the connections meanwhile",
            );
        }
    }
}

fn is_headless(import: Option<&ServiceImport>) -> bool {
    import.is_some_and(|i| i.spec.type_ == mcs_api::ServiceImportType::Headless)
}

/// `cluster addr:port` of a backend (`[addr]:port` for IPv6).
fn backend(b: &Backend) -> String {
    format!(
        "{} {}",
        b.cluster,
        std::net::SocketAddr::new(b.address, b.port)
    )
}

fn rejection_fix(reason: &str) -> String {
    match reason {
        "vip_not_allowed" | "hostile_vip" => "the import's ClusterSetIP is one this agent may not program: outside its --clusterset-ip-cidr (chart clustersetIPCIDRs), or an address of the node; the controller's and every agent's ranges must be the same".into(),
        "endpoint_slices_absent" => "the import's writer says its endpoints are not EndpointSlices (status.endpointSliceObjects: Absent): another MCS implementation serves this ClusterSetIP; if this agent should, the controller that writes the import must publish MCS EndpointSlices".into(),
        "unprogrammable" => "the dataplane's maps are full or the frontend cannot be intercepted: see docs/install.md Sizing".into(),
        _ => "the message says what is refused; the object's writer must change it (the agent keeps serving everything else)".into(),
    }
}

/// What the agent's DNS listener answers for the service, against the import's IPs.
fn dns_checks(s: &mut Section, what: &str, st: &AgentStatus, import: Option<&ServiceImport>) {
    let headless = is_headless(import);
    let Some(dns) = &st.dns else {
        return;
    };
    for c in dns
        .checks
        .iter()
        .filter(|c| c.qtype == "A" || c.qtype == "AAAA")
    {
        let (qtype, qname) = (c.qtype.as_str(), c.name.as_str());
        if let Some(e) = &c.error {
            s.push_fix(
                Level::Fail,
                what,
                format!("DNS {qname} {qtype}: {e}"),
                "the agent's DNS listener does not answer: see its log",
            );
            continue;
        }
        let mut got = c.answers.clone();
        got.sort();
        let v6 = qtype == "AAAA";
        let mut want: Vec<String> = import
            .filter(|_| !headless)
            .map(|i| {
                i.spec
                    .ips
                    .iter()
                    .filter(|ip| ip.contains(':') == v6)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        want.sort();
        let rcode = c.rcode.as_deref().unwrap_or("?");
        let detail = format!(
            "DNS {qname} {qtype}: {rcode} {}",
            if got.is_empty() {
                "(no answer)".to_string()
            } else {
                got.join(", ")
            }
        );
        if headless {
            s.push(Level::Ok, what, detail);
        } else {
            s.verdict(
                got == want,
                Level::Fail,
                what,
                detail,
                &format!(
                    "DNS should answer the import's {} ({}): the agent has not seen the import, or rejected it (above)",
                    if v6 { "IPv6 ClusterSetIP" } else { "IPv4 ClusterSetIP" },
                    if want.is_empty() { "none".to_string() } else { want.join(", ") }
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_conflict_names_both_sides_and_the_fix() {
        let import: ServiceImport = serde_json::from_value(json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
            "metadata": {"name": "clash", "namespace": "shop"},
            "spec": {"type": "ClusterSetIP", "ips": ["198.18.56.4"], "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
        }))
        .unwrap();
        let p = |port| BTreeSet::from([("http".to_string(), port, "TCP".to_string())]);
        let found = vec![
            (
                "c1".to_string(),
                Found {
                    reachable: true,
                    exported: true,
                    service_ports: Some(p(80)),
                    import: Some(import.clone()),
                },
            ),
            (
                "c2".to_string(),
                Found {
                    reachable: true,
                    exported: true,
                    service_ports: Some(p(8080)),
                    import: Some(import),
                },
            ),
        ];
        let s = summary(&found, "shop", "clash");
        assert_eq!(s.checks[0].detail, "c1, c2");
        assert_eq!(s.checks.len(), 2, "{s:?}");
        let c = &s.checks[1];
        assert_eq!(c.level, Level::Fail);
        assert_eq!(
            c.detail,
            "c2 exports port 8080/TCP named http, the import uses port 80/TCP named http"
        );
        assert!(c.fix.as_deref().unwrap().contains("PortConflict"));
    }

    #[test]
    fn an_unexported_service_says_how_to_export_it() {
        let s = summary(
            &[(
                "c1".to_string(),
                Found {
                    reachable: true,
                    ..Found::default()
                },
            )],
            "shop",
            "web",
        );
        assert_eq!(s.checks[0].level, Level::Fail);
        assert!(
            s.checks[0]
                .fix
                .as_deref()
                .unwrap()
                .contains("ServiceExport named web in namespace shop")
        );
    }

    /// What `explain` checks of one agent's answer, read as `kubectl mcs` reads it.
    fn agent_checks(s: &mut Section, answer: Value, import: Option<&ServiceImport>) {
        let a = crate::member::AgentAnswer::parse(&answer.to_string()).unwrap();
        node_checks(s, "node n1", a.node().unwrap(), import);
        dns_checks(s, "node n1", a.status.as_ref().unwrap(), import);
    }

    #[test]
    fn a_rejected_import_names_the_reason_and_the_range() {
        let st = json!({"dataplane": "ebpf", "service": {"frontends": []},
            "rejected": [{"object": "ServiceImport shop/stray", "reason": "vip_not_allowed", "message": "ClusterSetIP 198.18.250.1 is outside every --clusterset-ip-cidr"}],
            "dns": {"checks": []}});
        let mut s = Section::new("x");
        agent_checks(&mut s, st, None);
        assert_eq!(s.checks.len(), 1);
        assert_eq!(s.checks[0].level, Level::Fail);
        assert!(s.checks[0].detail.contains("vip_not_allowed"));
        assert!(
            s.checks[0]
                .fix
                .as_deref()
                .unwrap()
                .contains("--clusterset-ip-cidr")
        );
    }

    #[test]
    fn a_served_frontend_and_matching_dns_are_ok() {
        let import: ServiceImport = serde_json::from_value(json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"type": "ClusterSetIP", "ips": ["198.18.56.4", "2001:2:0:56::4"], "ports": [{"port": 80}]}
        }))
        .unwrap();
        let st = json!({"dataplane": "ebpf", "rejected": [],
            "service": {"frontends": [{"frontend": "198.18.56.4:80/TCP", "programmed": true,
                "backends": [{"address": "198.19.33.5", "port": 8080, "cluster": "c1", "selected": true, "fallback": false},
                             {"address": "198.19.34.5", "port": 8080, "cluster": "c2", "selected": false, "fallback": true}]}]},
            "dns": {"checks": [
                {"name": "web.shop.svc.clusterset.local.", "qtype": "A", "rcode": "NoError", "answers": ["198.18.56.4"]},
                {"name": "web.shop.svc.clusterset.local.", "qtype": "AAAA", "rcode": "NoError", "answers": ["2001:2:0:56::4"]}]}});
        let mut s = Section::new("x");
        agent_checks(&mut s, st, Some(&import));
        assert!(s.checks.iter().all(|c| c.level == Level::Ok), "{s:?}");
        assert_eq!(
            s.checks[0].detail,
            "198.18.56.4:80/TCP (ebpf): 1 selected [c1 198.19.33.5:8080], 1 fallback"
        );
    }

    #[test]
    fn backends_skipped_after_failed_connects_are_a_warning_naming_them() {
        let st = json!({"dataplane": "userspace", "rejected": [],
            "service": {"frontends": [{"frontend": "198.18.56.4:80/TCP", "programmed": true,
                "backends": [{"address": "198.19.33.5", "port": 8080, "cluster": "c1", "selected": true, "fallback": false},
                             {"address": "198.19.33.6", "port": 8080, "cluster": "c1", "selected": true, "fallback": false}],
                "skipped": [{"address": "198.19.33.6", "port": 8080, "failures": 2, "for_ms": 1500}]}]},
            "dns": {"checks": []}});
        let mut s = Section::new("x");
        agent_checks(&mut s, st, None);
        let warn: Vec<_> = s.checks.iter().filter(|c| c.level == Level::Warn).collect();
        assert_eq!(warn.len(), 1, "{s:?}");
        assert_eq!(
            warn[0].detail,
            "198.18.56.4:80/TCP: skipped on this node after failed connects: 198.19.33.6:8080 (2 failed connects in a row, tried again in 1.5 s)"
        );
    }
}
