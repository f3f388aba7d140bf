//! A stand-in for a cluster's scheduler and kubelet, for clusters that have a control plane
//! (kube-apiserver and kube-controller-manager) but no node: [`keep_pods_running`] registers a
//! Node object and gives every Pending pod that node (a Binding, as the scheduler writes it),
//! phase Running, a pod IP and the Ready condition (as a kubelet reports them), and finishes
//! the deletion of its pods (as a kubelet does once their containers stopped). No container
//! runs; what the EndpointSlice controller and the MCS controller see is what they would see
//! of running pods.
//!
//! Pod IPs come from `198.18.(64 + 4·index + k).0/24`, k < 4: a cluster's first 1,000 pods get
//! distinct addresses, and clusters with indices below 16 never share one.

use std::collections::HashMap;

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{
    Api, Client, ResourceExt as _,
    api::{Patch, PatchParams, PostParams},
    runtime::{WatchStreamExt as _, watcher},
};

/// The Node object of the stand-in (`<name>`, zone `<name>-zone`).
fn node(name: &str) -> anyhow::Result<Node> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": format!("{name}-zone"),
            }
        }
    }))?)
}

/// The address of the `n`th pod (from 0) of cluster `index`.
pub fn pod_ip(index: u8, n: u32) -> std::net::Ipv4Addr {
    let k = (n / 250) % 4;
    std::net::Ipv4Addr::new(
        198,
        18,
        64 + 4 * (index % 16) + k as u8,
        2 + (n % 250) as u8,
    )
}

/// Registers Node `node_name` (if absent) and keeps every Pending pod of the cluster running
/// on it, until the future is dropped: unscheduled pods are bound to the node; pods bound to
/// it get phase Running, an address ([`pod_ip`] of `index`) and `Ready=True`; its pods being
/// deleted are removed (grace period 0). Pods bound to another node are left alone. Watch
/// errors are retried (printed); only failing to register the node is an error.
pub async fn keep_pods_running(client: Client, node_name: &str, index: u8) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    match nodes
        .create(&PostParams::default(), &node(node_name)?)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e).with_context(|| format!("registering Node {node_name}")),
    }
    futures::future::join(
        run_pending(client.clone(), node_name, index),
        finish_deletions(client, node_name),
    )
    .await;
    Ok(())
}

/// The cluster's pods that match field selector `fields`, as they are listed and as they
/// change (deletions are not passed on); watch errors are printed and retried with backoff.
fn pods(
    client: &Client,
    fields: &str,
    node_name: &str,
) -> futures::stream::BoxStream<'static, Pod> {
    let node_name = node_name.to_string();
    watcher(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields(fields),
    )
    .default_backoff()
    .filter_map(move |ev| {
        let r = match ev {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => Some(p),
            Ok(_) => None,
            Err(e) => {
                eprintln!("mcs-test-support: pod watch of node {node_name}: {e}");
                None
            }
        };
        std::future::ready(r)
    })
    .boxed()
}

/// Removes the pods of `node_name` that are being deleted (what a kubelet does once their
/// containers stopped; here none ran).
async fn finish_deletions(client: Client, node_name: &str) {
    let mut stream = pods(&client, &format!("spec.nodeName={node_name}"), node_name);
    while let Some(pod) = stream.next().await {
        if pod.metadata.deletion_timestamp.is_none() {
            continue;
        }
        let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
        let dp = kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: pod.uid().map(|uid| kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(&pod.name_any(), &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => eprintln!("mcs-test-support: removing pod {}: {e}", pod.name_any()),
        }
    }
}

/// Binds the cluster's Pending pods to `node_name` and reports its pods Running.
async fn run_pending(client: Client, node_name: &str, index: u8) {
    // Pods already given an address (by uid): a pod's later events while still Pending must
    // not move it to another address.
    let mut done: HashMap<String, std::net::Ipv4Addr> = HashMap::new();
    let mut n: u32 = 0;
    let mut stream = pods(&client, "status.phase=Pending", node_name);
    while let Some(pod) = stream.next().await {
        let uid = pod.uid().unwrap_or_default();
        if done.contains_key(&uid) {
            continue;
        }
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(other) if other != node_name => continue,
            Some(_) => {}
            None => {
                let binding = serde_json::json!({
                    "apiVersion": "v1", "kind": "Binding",
                    "metadata": { "name": name, "namespace": ns },
                    "target": { "apiVersion": "v1", "kind": "Node", "name": node_name }
                });
                if let Err(e) = api
                    .create_subresource::<_, serde_json::Value>(
                        "binding",
                        &name,
                        &PostParams::default(),
                        &binding,
                    )
                    .await
                {
                    eprintln!("mcs-test-support: binding {ns}/{name} to {node_name}: {e}");
                    continue;
                }
            }
        }
        let ip = pod_ip(index, n);
        n += 1;
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = serde_json::json!({
            "status": {
                "phase": "Running",
                "podIP": ip.to_string(), "podIPs": [{ "ip": ip.to_string() }],
                "startTime": now,
                "conditions": [
                    { "type": "PodScheduled", "status": "True", "lastTransitionTime": now },
                    { "type": "Initialized", "status": "True", "lastTransitionTime": now },
                    { "type": "ContainersReady", "status": "True", "lastTransitionTime": now },
                    { "type": "Ready", "status": "True", "lastTransitionTime": now }
                ]
            }
        });
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
        {
            Ok(_) => {
                done.insert(uid, ip);
            }
            Err(e) => eprintln!("mcs-test-support: marking {ns}/{name} Running: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pod_ips_are_distinct_per_cluster_for_a_thousand_pods_and_stay_in_the_test_range() {
        let mut seen = std::collections::HashSet::new();
        for index in 0..16u8 {
            for n in 0..1000 {
                let ip = super::pod_ip(index, n);
                assert!(seen.insert(ip), "{ip} twice");
                let o = ip.octets();
                assert_eq!((o[0], o[1]), (198, 18));
                assert!(
                    (64..128).contains(&o[2]) && (2..252).contains(&o[3]),
                    "{ip}"
                );
            }
        }
    }
}
