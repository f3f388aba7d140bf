//! Endpoint changes through a real kube-apiserver reach the userspace forwarder: the kube
//! source runs in the test's network namespace (where the apiserver listens on loopback); the
//! controller and the forwarder run on a runtime whose threads are inside the sandbox's node
//! namespace, so sockets, nftables rules and policy routes all land there.

mod common;

use std::{sync::Arc, time::Duration};

use common::*;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use mcs_model::NodeConfig;
use mcs_proxy::userspace::{Stop, Userspace, UserspaceConfig, metrics::ProxyMetrics};
use mcs_sync::{SyncConfig, SyncLoop, http::Health, metrics::Metrics};
use mcs_test_support::apiserver;

fn slice_json(ns: &str, cluster: &str, addrs: &[&str], ready: bool) -> EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("web-{cluster}"),
            "namespace": ns,
            "labels": {
                "multicluster.kubernetes.io/service-name": "web",
                "multicluster.kubernetes.io/source-cluster": cluster,
                "endpointslice.kubernetes.io/managed-by": "mcs-controller.example.com"
            }
        },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": addrs.iter().map(|a| serde_json::json!({ "addresses": [a], "conditions": { "ready": ready } })).collect::<Vec<_>>()
    }))
    .unwrap()
}

#[test]
fn endpoint_changes_through_the_apiserver_reach_the_forwarder() {
    if !prerequisites() || !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let api = apiserver::shared().expect("apiserver");
    let sb = Sandbox::new(&ALL);

    let host = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let node_ns = Arc::new(std::fs::File::open(sb.node.path()).unwrap());
    let node = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || {
            nix::sched::setns(&*node_ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("setns into node");
        })
        .build()
        .unwrap();

    let ns = host.block_on(api.fresh_namespace("userspace-kube"));
    let client = host.block_on(api.client());
    let imports: Api<mcs_api::ServiceImport> = Api::namespaced(client.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let import: mcs_api::ServiceImport = serde_json::from_value(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1",
        "kind": "ServiceImport",
        "metadata": { "name": "web", "namespace": ns },
        "spec": { "type": "ClusterSetIP", "ips": ["198.18.100.10"], "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] }
    }))
    .unwrap();
    host.block_on(async {
        imports
            .create(&PostParams::default(), &import)
            .await
            .unwrap();
        slices
            .create(
                &PostParams::default(),
                &slice_json(&ns, "c1", &["198.18.1.2", "198.18.1.3"], true),
            )
            .await
            .unwrap();
        slices
            .create(
                &PostParams::default(),
                &slice_json(&ns, "c2", &["198.18.2.2"], true),
            )
            .await
            .unwrap();
    });

    // Source on the host side; controller + forwarder inside the node namespace. Only this
    // test's namespace matters: other tests' objects use other VIPs, which are not routed here.
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    host.spawn(mcs_sync::source::kube::run(
        client.clone(),
        tx,
        Default::default(),
    ));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let health = Health::default();
    let h = health.clone();
    let done = node.spawn(async move {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(Metrics::new(&mut registry));
        let dataplane = Userspace::start(UserspaceConfig::default(), ProxyMetrics::default())
            .expect("forwarder");
        let controller = SyncLoop::new(
            NodeConfig {
                cluster_id: "c1".into(),
                zone: None,
                ..Default::default()
            },
            dataplane,
            SyncConfig {
                cluster_id_fixed: true,
                ..Default::default()
            },
            metrics,
            h,
            None,
        );
        controller
            .run(rx, stop_rx)
            .await
            .into_dataplane()
            .shutdown(Stop::default())
            .await;
    });
    wait_until("controller ready", || health.is_ready());
    wait_until("traffic to c1", || {
        sb.tcp("198.18.100.10:80", "a")
            .is_ok_and(|r| r.starts_with("198.18.1."))
    });
    let d = sb.distribution("198.18.100.10:80", 10);
    assert!(d.keys().all(|k| k.starts_with("198.18.1.")), "{d:?}");

    // c1's endpoints go unready in the API: failover to c2.
    host.block_on(async {
        let patch = slice_json(&ns, "c1", &["198.18.1.2", "198.18.1.3"], false);
        slices
            .patch(
                "web-c1",
                &PatchParams::apply("test").force(),
                &Patch::Apply(&patch),
            )
            .await
            .unwrap();
    });
    wait_until("failover to c2", || {
        sb.tcp("198.18.100.10:80", "b")
            .is_ok_and(|r| r.starts_with("198.18.2.2"))
    });

    // The import goes: the VIP is no longer intercepted.
    host.block_on(async {
        imports
            .delete("web", &DeleteParams::default())
            .await
            .unwrap()
    });
    wait_until("frontend removed", || {
        !sb.nft_table()
            .is_some_and(|t| t.contains("198.18.100.10 . tcp . 80"))
    });
    assert!(
        sb.tcp("198.18.100.10:80", "c").is_err(),
        "VIP still served after its import was deleted"
    );

    let _ = stop.send(true);
    node.block_on(done).unwrap();
    assert!(
        sb.nft_table().is_none(),
        "interception not removed at shutdown"
    );
    let _ = Duration::ZERO;
}
