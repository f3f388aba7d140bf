//! Three clusters, each a real etcd + kube-apiserver + kube-controller-manager with a node
//! stand-in (`mcs_test_support::node`: pods are bound to a Node and reported Running), and
//! the MCS controller as a real process in each. Every EndpointSlice here is the
//! EndpointSlice controller's own, of real Deployments' pods:
//!
//! - `web` exported by c2 and c3 (two replicas each) is imported into all three clusters with
//!   both as its clusters, and every cluster holds one MCS slice per exporting cluster with
//!   exactly that cluster's pod addresses;
//! - c2's Deployment scaled to 0: its endpoints leave every cluster's MCS slices, c3's stay;
//! - 1,000 exports from c3: 1,000 imports in c1 and in c2, each Ready with its own
//!   ClusterSetIP from the ranges; unexported, all gone.

mod common;

use std::{
    collections::{BTreeSet, HashSet},
    time::Duration,
};

use common::*;
use futures::StreamExt as _;
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{Pod, Service},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use mcs_api::{ServiceExport, ServiceImport};
use mcs_test_support::apiserver;

/// A second range, for the 1,000 exports (with [`RANGE`]: 2,304 addresses).
const BULK_RANGE: &str = "198.18.104.0/21";
const BULK: usize = 1000;
/// Writes in flight at once while the test creates or deletes the bulk objects.
const IN_FLIGHT: usize = 32;
/// How long the 1,000 imports may take to appear or go (debug-built controllers sharing two
/// cores with three control planes; the speed is the controller bench's to show).
const BULK_WAIT: Duration = Duration::from_secs(300);

fn deployment(name: &str, replicas: i32) -> Deployment {
    obj(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": { "containers": [{ "name": name, "image": "web.invalid/web:1",
                                           "ports": [{ "name": "http", "containerPort": 8080 }] }] }
            }
        }
    }))
}

/// The addresses of the Running pods of `app` in a cluster.
async fn pod_ips(k: &Client, app: &str) -> BTreeSet<String> {
    Api::<Pod>::namespaced(k.clone(), NS)
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.status?.pod_ip)
        .collect()
}

/// The ready endpoint addresses of the MCS slices of `service` from `source` in a cluster.
async fn mcs_ready(k: &Client, service: &str, source: &str) -> BTreeSet<String> {
    mcs_slices(k, NS, service)
        .await
        .into_iter()
        .filter(|s| {
            s.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("multicluster.kubernetes.io/source-cluster"))
                .is_some_and(|c| c == source)
        })
        .flat_map(|s| s.endpoints.unwrap_or_default())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses)
        .collect()
}

/// Our imports named `bulk-*` in a cluster that are Ready, with their addresses.
async fn bulk_imports(k: &Client) -> Vec<ServiceImport> {
    Api::<ServiceImport>::namespaced(k.clone(), NS)
        .list(&ListParams::default().labels(&format!(
            "{}={}",
            mcs_controller::MANAGED_LABEL,
            mcs_controller::MANAGER
        )))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|si| {
            si.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("bulk-"))
        })
        .collect()
}

#[test]
fn three_clusters_real_endpoint_slices_scale_to_zero_and_a_thousand_exports() {
    if !mcs_test_support::require(apiserver::controller_manager_prerequisites()) {
        return;
    }
    let set = ClusterSet::start(&["c1", "c2", "c3"], true);
    let kc = &set.kubeconfig;
    let (k1, k2, k3) = (&set.clients[0], &set.clients[1], &set.clients[2]);
    let ranges = ["--no-leader-election", "--clusterset-ip-cidr", BULK_RANGE];
    let _controllers: Vec<Controller> = ["c1", "c2", "c3"]
        .iter()
        .map(|id| start_controller_with(id, kc, &ranges))
        .collect();
    set.rt.block_on(async {
        // web: two replicas in c2 and in c3, exported by both.
        for k in [k2, k3] {
            create(k, NS, deployment("web", 2)).await;
            create(
                k,
                NS,
                service(
                    "web",
                    serde_json::json!([{ "name": "http", "port": 80, "targetPort": "http" }]),
                ),
            )
            .await;
            create(k, NS, export("web")).await;
        }
        let mut pods = Vec::new();
        for (id, k) in [("c2", k2), ("c3", k3)] {
            let ips = until(&format!("two running web pods in {id}"), || async {
                let ips = pod_ips(k, "web").await;
                (ips.len() == 2).then_some(ips)
            })
            .await;
            pods.push((id, ips));
        }
        assert!(pods[0].1.is_disjoint(&pods[1].1), "{pods:?}");

        // Every cluster imports web from both, with each one's pods as its ready endpoints.
        for (id, k) in [("c1", k1), ("c2", k2), ("c3", k3)] {
            let si = until(
                &format!("web imported into {id} from c2 and c3"),
                || async {
                    get_import(k, NS, "web").await.filter(|si| {
                        si.status.as_ref().is_some_and(|s| s.clusters.len() == 2)
                            && !si.spec.ips.is_empty()
                    })
                },
            )
            .await;
            let clusters: Vec<String> = si
                .status
                .unwrap()
                .clusters
                .into_iter()
                .map(|c| c.cluster)
                .collect();
            assert_eq!(clusters, ["c2", "c3"]);
            for (source, ips) in &pods {
                until(
                    &format!("{source}'s pods as ready endpoints in {id}"),
                    || async { (mcs_ready(k, "web", source).await == *ips).then_some(()) },
                )
                .await;
            }
            // The port is the EndpointSlice controller's resolved target port.
            let ports: HashSet<Option<i32>> = mcs_slices(k, NS, "web")
                .await
                .into_iter()
                .flat_map(|s| s.ports.unwrap_or_default())
                .map(|p| p.port)
                .collect();
            assert_eq!(ports, HashSet::from([Some(8080)]), "in {id}");
        }

        // c2 scaled to 0: its endpoints leave every cluster, c3's stay.
        Api::<Deployment>::namespaced(k2.clone(), NS)
            .patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": { "replicas": 0 } })),
            )
            .await
            .unwrap();
        for (id, k) in [("c1", k1), ("c2", k2), ("c3", k3)] {
            until(&format!("c2's endpoints gone from {id}"), || async {
                mcs_ready(k, "web", "c2").await.is_empty().then_some(())
            })
            .await;
            assert_eq!(mcs_ready(k, "web", "c3").await, pods[1].1, "in {id}");
            assert!(get_import(k, NS, "web").await.is_some());
        }

        // 1,000 exports from c3 (Services without selectors: no slices).
        let names: Vec<String> = (0..BULK).map(|i| format!("bulk-{i:04}")).collect();
        let svcs: Api<Service> = Api::namespaced(k3.clone(), NS);
        let ses: Api<ServiceExport> = Api::namespaced(k3.clone(), NS);
        futures::stream::iter(&names)
            .for_each_concurrent(IN_FLIGHT, |n| {
                let (svcs, ses) = (svcs.clone(), ses.clone());
                async move {
                    let svc: Service = obj(serde_json::json!({
                        "metadata": { "name": n },
                        "spec": { "ports": [{ "name": "tcp", "port": 7000 }] }
                    }));
                    svcs.create(&PostParams::default(), &svc).await.unwrap();
                    ses.create(&PostParams::default(), &export(n))
                        .await
                        .unwrap();
                }
            })
            .await;
        for (id, k) in [("c1", k1), ("c2", k2)] {
            let imports = until_within(
                &format!("{BULK} Ready imports in {id}"),
                BULK_WAIT,
                || async {
                    let v = bulk_imports(k).await;
                    let ready = v
                        .iter()
                        .filter(|si| {
                            !si.spec.ips.is_empty()
                                && si.status.as_ref().is_some_and(|s| {
                                    s.conditions
                                        .iter()
                                        .any(|c| c.type_ == "Ready" && c.status == "True")
                                })
                        })
                        .count();
                    (ready == BULK).then_some(v)
                },
            )
            .await;
            let ips: HashSet<&str> = imports
                .iter()
                .flat_map(|si| si.spec.ips.iter().map(String::as_str))
                .collect();
            assert_eq!(ips.len(), BULK, "ClusterSetIPs shared in {id}");
            let web_ip = get_import(k, NS, "web").await.unwrap().spec.ips;
            assert!(
                !ips.contains(web_ip[0].as_str()),
                "web's address reused in {id}"
            );
            for ip in &ips {
                let ip: std::net::Ipv4Addr = ip.parse().unwrap();
                let o = ip.octets();
                assert!(
                    (o[0], o[1]) == (198, 18) && (o[2] == 100 || (104..112).contains(&o[2])),
                    "{ip} outside the ranges in {id}"
                );
            }
        }

        // Unexported: every bulk import goes, web stays.
        futures::stream::iter(&names)
            .for_each_concurrent(IN_FLIGHT, |n| {
                let ses = ses.clone();
                async move {
                    ses.delete(n, &DeleteParams::default()).await.unwrap();
                }
            })
            .await;
        for (id, k) in [("c1", k1), ("c2", k2), ("c3", k3)] {
            until_within(
                &format!("the bulk imports gone from {id}"),
                BULK_WAIT,
                || async { bulk_imports(k).await.is_empty().then_some(()) },
            )
            .await;
            assert!(get_import(k, NS, "web").await.is_some());
        }
    });
}
