//! `kubectl mcs status`: is the ClusterSet healthy? Per member: its API server, its cluster
//! id, its controller's leader and what that controller reaches, its agents (ready, each
//! one's own `/status`, DNS answering on each), its imports and exports.

use std::collections::BTreeSet;

use futures::future::join_all;
use k8s_openapi::{
    api::{apps::v1::DaemonSet, coordination::v1::Lease, core::v1::Node},
    jiff::Timestamp,
};
use kube::{Api, Client, api::ListParams};
use mcs_api::{CLUSTER_ID_PROPERTY, ClusterProperty, ServiceExport, ServiceImport};
use mcs_model::status::AgentStatus;
use serde_json::{Value, json};

use crate::{
    member::{ChartPod, Member, agent_statuses, chart_pods, pod_get, short},
    report::{Level, Report, Section},
};

/// The controller's leader-election Lease (the chart's default `--lease-name`).
const LEASE: &str = "mcs-controller";

/// The whole report.
pub async fn status(members: &[Member], ns: &str) -> Report {
    let results = join_all(members.iter().map(|m| member_status(m, ns))).await;
    let mut sections = Vec::new();
    let mut data = serde_json::Map::new();
    for (m, (section, agents)) in members.iter().zip(results) {
        sections.push(section);
        data.insert(m.context.clone(), json!({ "agents": agents }));
    }
    Report::new("status".into(), sections, Value::Object(data))
}

async fn member_status(m: &Member, ns: &str) -> (Section, Value) {
    let mut s = Section::new(format!("cluster {} ({})", m.context, m.server));
    let client = match &m.client {
        Ok(c) => c.clone(),
        Err(e) => {
            s.push_fix(
                Level::Fail,
                "reachable",
                format!("no client: {e}"),
                "fix the context in the kubeconfig",
            );
            return (s, Value::Null);
        }
    };
    match client.apiserver_version().await {
        Ok(v) => s.push(
            Level::Ok,
            "reachable",
            format!("kube-apiserver {}", v.git_version),
        ),
        Err(e) => {
            s.push_fix(
                Level::Fail,
                "reachable",
                format!("API server unreachable: {}", short(&e)),
                format!(
                    "start its API server or restore the path to it (kubectl --context {} get --raw /readyz); meanwhile the other members keep its endpoints for their --member-timeout-secs, then withdraw them",
                    m.context
                ),
            );
            return (s, Value::Null);
        }
    }
    controller(&client, ns, &mut s).await;
    let (agents, cluster_ids) = agents(&client, ns, &mut s).await;
    cluster_id(&client, &mut s, &cluster_ids).await;
    objects(&client, &mut s).await;
    (s, agents)
}

/// The cluster id: the ClusterProperty's, else what the agents were given (`used`: each
/// answering agent's); every agent must use the same. Inserted after "reachable".
async fn cluster_id(client: &Client, s: &mut Section, used: &BTreeSet<String>) {
    let used: BTreeSet<&str> = used.iter().map(String::as_str).collect();
    let api: Api<ClusterProperty> = Api::all(client.clone());
    let mut c = Section::new("");
    match api.get_opt(CLUSTER_ID_PROPERTY).await {
        Err(e) => c.push(
            Level::Fail,
            "cluster id",
            format!(
                "reading ClusterProperty {CLUSTER_ID_PROPERTY}: {}",
                short(&e)
            ),
        ),
        Ok(Some(p)) => {
            let others: Vec<&str> = used
                .iter()
                .copied()
                .filter(|u| *u != p.spec.value)
                .collect();
            c.verdict(
                others.is_empty(),
                Level::Fail,
                "cluster id",
                if others.is_empty() {
                    format!("{} (ClusterProperty; every agent uses it)", p.spec.value)
                } else {
                    format!(
                        "ClusterProperty says {}, agents use {}",
                        p.spec.value,
                        others.join(", ")
                    )
                },
                "give the chart the ClusterProperty's id (clusterId), or none: the agents prefer their own cluster's endpoints by it",
            );
        }
        Ok(None) => {
            let ids: Vec<&str> = used.iter().copied().filter(|u| !u.is_empty()).collect();
            c.verdict(
                ids.len() == 1 && !used.contains(""),
                Level::Fail,
                "cluster id",
                match ids.as_slice() {
                    [] => format!("none: no ClusterProperty {CLUSTER_ID_PROPERTY}, and no agent was given one"),
                    [id] => format!("{id} (given to the agents; no ClusterProperty)"),
                    many => format!("agents use different ids: {}", many.join(", ")),
                },
                "create ClusterProperty cluster.clusterset.k8s.io with this cluster's id, or give the chart clusterId (docs/install.md)",
            );
        }
    }
    let at = s.checks.len().min(1);
    s.checks.splice(at..at, c.checks);
}

async fn controller(client: &Client, ns: &str, s: &mut Section) {
    let pods = chart_pods(client, ns, "mcs-controller")
        .await
        .map_err(|e| short(&e));
    let Some(pods) = s.read(pods, "controller", &format!("listing its pods in {ns}")) else {
        return;
    };
    let live: Vec<&ChartPod> = pods.iter().filter(|p| !p.terminating).collect();
    let ready = live.iter().filter(|p| p.ready).count();
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let lease = leases.get_opt(LEASE).await.map_err(|e| short(&e));
    let Some(lease) = s.read(lease, "controller", &format!("reading Lease {ns}/{LEASE}")) else {
        return;
    };
    let Some(spec) = lease.and_then(|l| l.spec) else {
        s.push_fix(
            Level::Fail,
            "controller",
            format!("no leader: no Lease {ns}/{LEASE}; {ready}/{} controller pods ready", live.len()),
            "install the chart with controller.enabled=true (or see the controller's log: kubectl -n mcs-system logs deploy/mcs-controller)",
        );
        return;
    };
    let holder = spec.holder_identity.unwrap_or_default();
    let age = spec
        .renew_time
        .map(|t| Timestamp::now().as_second() - t.0.as_second());
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    // A leader being replaced (its pod terminating) still leads until its successor takes
    // the Lease.
    let leader = pods.iter().find(|p| p.name == holder);
    let fresh = age.is_some_and(|a| a <= duration) && !holder.is_empty();
    let image = match leader {
        Some(p) if p.terminating => format!("{} (terminating)", p.image),
        Some(p) => p.image.clone(),
        None => "? (no such pod)".into(),
    };
    s.verdict(
        fresh && leader.is_some(),
        // A fresh Lease whose pod is gone: a standby takes it within the lease duration.
        if fresh { Level::Warn } else { Level::Fail },
        "controller",
        format!(
            "leader {} (renewed {} s ago, lease {duration} s), image {image}; {ready}/{} pods ready",
            if holder.is_empty() { "none" } else { &holder },
            age.map_or("never".to_string(), |a| a.to_string()),
            live.len()
        ),
        "no live leader (if its pod just went, a standby takes the Lease within its duration): see the controller pods' logs (kubectl -n mcs-system logs -l app.kubernetes.io/name=mcs-controller)",
    );
    let Some(leader) = leader.filter(|_| fresh) else {
        return;
    };
    // What the leader reaches: its own gauges, read through the pod proxy.
    match pod_get(client, ns, leader, "/metrics").await {
        Ok(text) => {
            let mut up = gauge_by_cluster(&text, "mcs_controller_member_up");
            up.sort_by(|a, b| a.0.cmp(&b.0));
            let unauthorized = gauge_by_cluster(&text, "mcs_controller_member_unauthorized");
            if up.is_empty() {
                s.push(
                    Level::Warn,
                    "members",
                    "the leader's metrics list no member (mcs_controller_member_up)",
                );
            }
            for (cluster, v) in up {
                let denied = unauthorized.iter().any(|(c, u)| *c == cluster && *u > 0.0);
                s.verdict(
                    v > 0.0,
                    Level::Fail,
                    &format!("member {cluster}"),
                    if v > 0.0 {
                        "reached by this cluster's controller".to_string()
                    } else if denied {
                        "this cluster's controller is refused by it (401/403)".to_string()
                    } else {
                        "this cluster's controller cannot reach it".to_string()
                    },
                    if denied {
                        "renew the member's token in Secret mcs-clusterset-kubeconfig (read again within about two minutes, no restart)"
                    } else {
                        "check that member's API server and the address in Secret mcs-clusterset-kubeconfig"
                    },
                );
            }
        }
        Err(e) => s.push(
            Level::Warn,
            "members",
            format!("could not read the leader's metrics: {e}"),
        ),
    }
}

/// `name{cluster="X"} V` lines of a Prometheus text page.
fn gauge_by_cluster(text: &str, name: &str) -> Vec<(String, f64)> {
    let prefix = format!("{name}{{");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (labels, value) = rest.split_once("} ")?;
            let cluster = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("cluster=\""))?
                .trim_end_matches('"');
            Some((cluster.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The agents: DaemonSet, and each one's `/status` (as it came, by node) with the cluster ids
/// they use.
async fn agents(client: &Client, ns: &str, s: &mut Section) -> (Value, BTreeSet<String>) {
    let nodes = Api::<Node>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
        .map(|l| l.items.len());
    let ds = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .get_opt("mcs-agent")
        .await;
    let (desired, ready) = match &ds {
        Ok(Some(d)) => d
            .status
            .as_ref()
            .map_or((0, 0), |st| (st.desired_number_scheduled, st.number_ready)),
        Ok(None) => {
            s.push_fix(
                Level::Fail,
                "agents",
                format!("no DaemonSet {ns}/mcs-agent"),
                "install the chart (helm install mcs-dataplane deploy/helm/mcs-dataplane)",
            );
            return (Value::Null, BTreeSet::new());
        }
        Err(e) => {
            s.push(
                Level::Fail,
                "agents",
                format!("reading DaemonSet {ns}/mcs-agent: {}", short(e)),
            );
            return (Value::Null, BTreeSet::new());
        }
    };
    let nodes = nodes.map_or("?".to_string(), |n| n.to_string());
    s.verdict(
        desired > 0 && ready >= desired,
        Level::Fail,
        "agents",
        format!("{ready}/{desired} ready ({nodes} nodes)"),
        "see the agents that are not ready: kubectl -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent, and their logs",
    );
    let pods = chart_pods(client, ns, "mcs-agent")
        .await
        .map_err(|e| short(&e));
    let Some(pods) = s.read(pods, "agents", "listing the agent pods") else {
        return (Value::Null, BTreeSet::new());
    };
    let pods: Vec<ChartPod> = pods.into_iter().filter(|p| !p.terminating).collect();
    let answers = agent_statuses(client, ns, &pods, "").await;
    let mut raw = serde_json::Map::new();
    let (mut dns_ok, mut dns_bad, mut unanswered) = (Vec::new(), Vec::new(), Vec::new());
    let mut dataplanes = std::collections::BTreeMap::<String, usize>::new();
    let mut rejecting = Vec::new();
    let mut frontends = BTreeSet::new();
    let mut cluster_ids = BTreeSet::new();
    for (pod, r) in answers {
        let answer = match r {
            Ok(a) => a,
            Err(e) => {
                unanswered.push(format!("{} ({e})", pod.node));
                continue;
            }
        };
        match answer.status.as_ref().ok().and_then(dns_version) {
            None => {}
            Some(Ok(v)) => dns_ok.push(format!("{} {v}", pod.node)),
            Some(Err(e)) => dns_bad.push(format!("{}: {e}", pod.node)),
        }
        match answer.node() {
            Err(e) => unanswered.push(format!("{} ({e})", pod.node)),
            Ok(st) => {
                *dataplanes.entry(st.dataplane.clone()).or_default() += 1;
                cluster_ids.insert(st.cluster_id.clone());
                frontends.insert(st.frontends);
                if !st.ready {
                    unanswered.push(format!(
                        "{} (not ready: its first table is not programmed)",
                        pod.node
                    ));
                }
                if st.rejected_total > 0 {
                    let first = st.rejected.first().cloned().unwrap_or_default();
                    rejecting.push(format!(
                        "{}: {} (e.g. {} {}: {})",
                        pod.node, st.rejected_total, first.object, first.reason, first.message
                    ));
                }
            }
        }
        raw.insert(pod.node.clone(), answer.raw);
    }
    s.verdict(
        unanswered.is_empty(),
        Level::Fail,
        "agents' tables",
        if unanswered.is_empty() {
            format!(
                "{} agents answered: {}; {} frontends",
                pods.len(),
                dataplanes
                    .iter()
                    .map(|(d, n)| format!("{n} {d}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                frontends
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        } else {
            format!("not answering or not ready: {}", unanswered.join("; "))
        },
        "see that agent's log: kubectl -n mcs-system logs <pod>; /status is on its metrics port",
    );
    if dns_ok.is_empty() && dns_bad.is_empty() {
        s.push(Level::Warn, "DNS", "no agent serves clusterset.local DNS");
    } else {
        s.verdict(
            dns_bad.is_empty(),
            Level::Fail,
            "DNS",
            if dns_bad.is_empty() {
                format!(
                    "{} agents answer dns-version.clusterset.local TXT ({})",
                    dns_ok.len(),
                    dns_ok
                        .first()
                        .and_then(|d| d.split_once(' '))
                        .map_or("", |(_, v)| v)
                )
            } else {
                format!("not answering: {}", dns_bad.join("; "))
            },
            "see the agent's log and its mcs_dns_* metrics",
        );
    }
    if rejecting.is_empty() {
        s.push(Level::Ok, "rejected", "no agent rejects any object");
    } else {
        s.push_fix(
            Level::Warn,
            "rejected",
            rejecting.join("; "),
            "kubectl mcs explain -n NAMESPACE NAME on the service, or the agent's Events",
        );
    }
    (Value::Object(raw), cluster_ids)
}

/// The dns-version answer in an agent's status: `None` when it serves no DNS.
fn dns_version(st: &AgentStatus) -> Option<Result<String, String>> {
    let check = st.dns.as_ref()?.checks.iter().find(|c| c.qtype == "TXT")?;
    if let Some(e) = &check.error {
        return Some(Err(e.clone()));
    }
    let rcode = check.rcode.as_deref().unwrap_or("?");
    Some(if rcode == "NoError" && !check.answers.is_empty() {
        Ok(check.answers.join(" "))
    } else {
        Err(format!("{rcode}, {} answers", check.answers.len()))
    })
}

async fn objects(client: &Client, s: &mut Section) {
    match Api::<ServiceImport>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
    {
        Ok(l) => s.push(
            Level::Ok,
            "imports",
            format!("{} ServiceImports", l.items.len()),
        ),
        Err(e) => s.push(
            Level::Fail,
            "imports",
            format!("listing ServiceImports: {}", short(&e)),
        ),
    }
    match Api::<ServiceExport>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(l) => {
            let cond = |e: &ServiceExport, t: &str, v: &str| {
                e.status
                    .as_ref()
                    .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == t && c.status == v))
            };
            let name = |e: &ServiceExport| {
                format!(
                    "{}/{}",
                    e.metadata.namespace.as_deref().unwrap_or(""),
                    e.metadata.name.as_deref().unwrap_or("")
                )
            };
            let invalid: Vec<String> = l
                .items
                .iter()
                .filter(|e| cond(e, "Valid", "False"))
                .map(name)
                .collect();
            let conflict: Vec<String> = l
                .items
                .iter()
                .filter(|e| cond(e, "Conflict", "True"))
                .map(name)
                .collect();
            let detail = format!(
                "{} ServiceExports, {} invalid, {} in conflict",
                l.items.len(),
                invalid.len(),
                conflict.len()
            );
            if invalid.is_empty() && conflict.is_empty() {
                s.push(Level::Ok, "exports", detail);
            } else {
                let some: Vec<&String> = invalid.iter().chain(&conflict).take(5).collect();
                s.push_fix(
                    Level::Warn,
                    "exports",
                    format!(
                        "{detail}: {}",
                        some.iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    "kubectl mcs explain -n NAMESPACE NAME says what is wrong with each",
                );
            }
        }
        Err(e) => s.push(
            Level::Fail,
            "exports",
            format!("listing ServiceExports: {}", short(&e)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_gauges_are_read_by_cluster() {
        let text = "# HELP mcs_controller_member_up x\nmcs_controller_member_up{cluster=\"c1\"} 1\nmcs_controller_member_up{cluster=\"c2\"} 0\nmcs_controller_member_upx{cluster=\"c3\"} 1\n";
        assert_eq!(
            gauge_by_cluster(text, "mcs_controller_member_up"),
            vec![("c1".to_string(), 1.0), ("c2".to_string(), 0.0)]
        );
    }

    #[test]
    fn the_dns_version_check_needs_an_answer() {
        let st = |v: Value| -> AgentStatus { serde_json::from_value(v).unwrap() };
        let ok = st(
            json!({"dns": {"checks": [{"qtype": "TXT", "rcode": "NoError", "answers": ["1.0.0"]}]}}),
        );
        assert_eq!(dns_version(&ok), Some(Ok("1.0.0".into())));
        let empty =
            st(json!({"dns": {"checks": [{"qtype": "TXT", "rcode": "NoError", "answers": []}]}}));
        assert!(matches!(dns_version(&empty), Some(Err(_))));
        let timeout = st(json!({"dns": {"checks": [{"qtype": "TXT", "error": "no answer"}]}}));
        assert_eq!(dns_version(&timeout), Some(Err("no answer".into())));
        assert_eq!(dns_version(&st(json!({"dns": null}))), None);
    }
}
