//! The kube source against a real kube-apiserver: ServiceImports and MCS EndpointSlices of two
//! clusters drive the controller; restarts of the apiserver neither lose nor reprogram state;
//! the agent works under exactly the ClusterRole of deploy/kustomize/base/rbac.yaml, and nothing more is
//! granted.

mod common;

use std::time::Duration;

use common::{fe, start};
use k8s_openapi::api::{
    authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec},
    core::v1::Secret,
    discovery::v1::EndpointSlice,
    rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use mcs_api::ServiceImport;
use mcs_model::{NodeConfig, Protocol};
use mcs_sync::source::kube::SliceEncoding;
use mcs_test_support::apiserver::{self, ApiServer, User};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(30);

fn import(ns: &str, name: &str, vip: &str) -> ServiceImport {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1",
        "kind": "ServiceImport",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "type": "ClusterSetIP", "ips": [vip], "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] }
    }))
    .unwrap()
}

fn slice(ns: &str, svc: &str, cluster: &str, addrs: &[(&str, bool)]) -> EndpointSlice {
    let eps: Vec<serde_json::Value> = addrs
        .iter()
        .map(|(a, ready)| serde_json::json!({ "addresses": [a], "conditions": { "ready": ready } }))
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("{svc}-{cluster}"),
            "namespace": ns,
            "labels": {
                "multicluster.kubernetes.io/service-name": svc,
                "multicluster.kubernetes.io/source-cluster": cluster,
                "endpointslice.kubernetes.io/managed-by": "mcs-controller.example.com"
            }
        },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": eps
    }))
    .unwrap()
}

fn run_kube_source(client: Client, cluster_id: Option<&str>) -> common::Running {
    run_kube_source_with(client, cluster_id, SliceEncoding::default())
}

fn run_kube_source_with(
    client: Client,
    cluster_id: Option<&str>,
    slices: SliceEncoding,
) -> common::Running {
    let (tx, rx) = mpsc::channel(1024);
    let node = NodeConfig {
        cluster_id: cluster_id.unwrap_or_default().into(),
        zone: None,
        ..Default::default()
    };
    tokio::spawn(mcs_sync::source::kube::run(
        client,
        tx,
        mcs_sync::source::kube::Options {
            watch_cluster_id: cluster_id.is_none(),
            slices,
            ..Default::default()
        },
    ));
    start(node, cluster_id.is_some(), rx)
}

/// Slices in protobuf (the default, which every kube-apiserver serves).
#[tokio::test]
async fn diffs_follow_imports_and_slices_of_two_clusters() {
    two_clusters(SliceEncoding::Protobuf, "two-clusters", 50).await;
}

/// The same with slices read as JSON (the fallback for a server without protobuf).
#[tokio::test]
async fn diffs_follow_imports_and_slices_of_two_clusters_in_json() {
    two_clusters(SliceEncoding::Json, "two-clusters-json", 70).await;
}

/// `net`: the third octet of the VIP (`198.18.net.10`); endpoints in the two after it.
async fn two_clusters(encoding: SliceEncoding, name: &str, net: u8) {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace(name).await;
    let client = api.client().await;
    let run = run_kube_source_with(client.clone(), Some("c1"), encoding);
    let dp = run.dataplane.clone();
    let vip = format!("198.18.{net}.10");
    let (e1, e2) = (
        format!("198.18.{}.2", net + 1),
        format!("198.18.{}.2", net + 2),
    );
    let (b1, b2) = (format!("{e1}:8080@c1"), format!("{e2}:8080@c2"));
    let f = fe(&vip, 80, Protocol::Tcp);

    let imports: Api<ServiceImport> = Api::namespaced(client.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    imports
        .create(&PostParams::default(), &import(&ns, "web", &vip))
        .await
        .unwrap();
    dp.wait_for("frontend without backends", WAIT, |s| {
        s.table.frontends.contains_key(&f)
    })
    .await;
    assert!(run.health.is_ready());

    slices
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c1", &[(&e1, true)]),
        )
        .await
        .unwrap();
    slices
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c2", &[(&e2, true)]),
        )
        .await
        .unwrap();
    dp.wait_for("c1 selected, c2 known", WAIT, |s| {
        common::selected_in(s, &f) == [b1.as_str()] && s.table.frontends[&f].backends.len() == 2
    })
    .await;

    // Local endpoint not ready → remote cluster.
    slices
        .replace("web-c1", &PostParams::default(), &{
            let mut s = slice(&ns, "web", "c1", &[(&e1, false)]);
            s.metadata.resource_version = slices
                .get("web-c1")
                .await
                .unwrap()
                .metadata
                .resource_version;
            s
        })
        .await
        .unwrap();
    dp.wait_for("failover to c2", WAIT, |s| {
        common::selected_in(s, &f) == [b2.as_str()]
    })
    .await;

    // Slice of c2 deleted → no usable backend; import deleted → frontend removed.
    slices
        .delete("web-c2", &DeleteParams::default())
        .await
        .unwrap();
    dp.wait_for("no selected backend", WAIT, |s| {
        common::selected_in(s, &f).is_empty()
    })
    .await;
    imports
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    dp.wait_for("frontend removed", WAIT, |s| {
        !s.table.frontends.contains_key(&f)
    })
    .await;
    let _ = run.stop.send(true);
}

#[tokio::test]
async fn cluster_id_comes_from_the_cluster_property() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("cluster-id").await;
    let client = api.client().await;
    let props: Api<mcs_api::ClusterProperty> = Api::all(client.clone());
    let cp = mcs_api::ClusterProperty::new(
        mcs_api::CLUSTER_ID_PROPERTY,
        mcs_api::ClusterPropertySpec { value: "c2".into() },
    );
    props
        .patch(
            mcs_api::CLUSTER_ID_PROPERTY,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&cp),
        )
        .await
        .unwrap();
    let run = run_kube_source(client.clone(), None);
    let f = fe("198.18.53.10", 80, Protocol::Tcp);
    Api::<ServiceImport>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &import(&ns, "web", "198.18.53.10"))
        .await
        .unwrap();
    let slices: Api<EndpointSlice> = Api::namespaced(client, &ns);
    slices
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c1", &[("198.18.54.2", true)]),
        )
        .await
        .unwrap();
    slices
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c2", &[("198.18.55.2", true)]),
        )
        .await
        .unwrap();
    // This node is in c2 (from the ClusterProperty): c2's endpoint is the local one.
    run.dataplane
        .wait_for("c2 is local", WAIT, |s| {
            common::selected_in(s, &f) == ["198.18.55.2:8080@c2"]
        })
        .await;
    let _ = run.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_restart_loses_nothing_and_reprograms_nothing() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    // A dedicated apiserver: restarting the shared one would disturb the other tests.
    let mut api = ApiServer::start().expect("start apiserver");
    let ns = api.fresh_namespace("restart").await;
    let client = api.client().await;
    let run = run_kube_source(client.clone(), Some("c1"));
    let dp = run.dataplane.clone();
    let steady = fe("198.18.56.10", 80, Protocol::Tcp);
    Api::<ServiceImport>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &import(&ns, "steady", "198.18.56.10"),
        )
        .await
        .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &slice(&ns, "steady", "c1", &[("198.18.57.2", true)]),
        )
        .await
        .unwrap();
    dp.wait_for("steady programmed", WAIT, |s| {
        common::selected_in(s, &steady) == ["198.18.57.2:8080@c1"]
    })
    .await;
    let before = dp.upserts_of(&steady);

    // Restart the apiserver (etcd keeps the data); the watches break and re-list.
    tokio::task::block_in_place(|| api.restart()).expect("restart apiserver");

    // A change made after the restart arrives: the watches recovered.
    let client = api.client().await;
    let after = fe("198.18.58.10", 80, Protocol::Tcp);
    Api::<ServiceImport>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &import(&ns, "after", "198.18.58.10"),
        )
        .await
        .unwrap();
    dp.wait_for("change after restart", WAIT, |s| {
        s.table.frontends.contains_key(&after)
    })
    .await;
    assert_eq!(dp.selected(&steady), ["198.18.57.2:8080@c1"], "state kept");
    assert_eq!(
        dp.upserts_of(&steady),
        before,
        "unchanged frontend reprogrammed after re-list"
    );
    let _ = run.stop.send(true);
}

/// Applies deploy/kustomize/base/rbac.yaml (ServiceAccount, ClusterRole, ClusterRoleBinding,
/// Role, RoleBinding) as admin.
async fn apply_rbac(admin: Client) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../deploy/kustomize/base/rbac.yaml"
    ))
    .unwrap();
    let pp = PatchParams::apply("mcs-test").force();
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({ "metadata": { "name": "mcs-system" } }))
            .unwrap();
    Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
        .patch("mcs-system", &pp, &Patch::Apply(&ns))
        .await
        .unwrap();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
        match v["kind"].as_str().unwrap() {
            "ClusterRole" => {
                let r: ClusterRole = serde_json::from_value(v).unwrap();
                let name = r.metadata.name.clone().unwrap();
                Api::<ClusterRole>::all(admin.clone())
                    .patch(&name, &pp, &Patch::Apply(&r))
                    .await
                    .unwrap();
            }
            "ClusterRoleBinding" => {
                let r: ClusterRoleBinding = serde_json::from_value(v).unwrap();
                let name = r.metadata.name.clone().unwrap();
                Api::<ClusterRoleBinding>::all(admin.clone())
                    .patch(&name, &pp, &Patch::Apply(&r))
                    .await
                    .unwrap();
            }
            "ServiceAccount" => {
                let r: k8s_openapi::api::core::v1::ServiceAccount =
                    serde_json::from_value(v).unwrap();
                let name = r.metadata.name.clone().unwrap();
                Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(
                    admin.clone(),
                    "mcs-system",
                )
                .patch(&name, &pp, &Patch::Apply(&r))
                .await
                .unwrap();
            }
            "Role" => {
                let r: Role = serde_json::from_value(v).unwrap();
                let name = r.metadata.name.clone().unwrap();
                Api::<Role>::namespaced(admin.clone(), "mcs-system")
                    .patch(&name, &pp, &Patch::Apply(&r))
                    .await
                    .unwrap();
            }
            "RoleBinding" => {
                let r: RoleBinding = serde_json::from_value(v).unwrap();
                let name = r.metadata.name.clone().unwrap();
                Api::<RoleBinding>::namespaced(admin.clone(), "mcs-system")
                    .patch(&name, &pp, &Patch::Apply(&r))
                    .await
                    .unwrap();
            }
            other => panic!("unexpected kind {other} in deploy/kustomize/base/rbac.yaml"),
        }
    }
}

async fn allowed(
    client: &Client,
    ns: Option<&str>,
    group: &str,
    resource: &str,
    verb: &str,
) -> bool {
    allowed_named(client, ns, group, resource, verb, None).await
}

/// [`allowed`], of the object `name` (for list and watch: with the field selector
/// `metadata.name`, as the API server authorizes them).
async fn allowed_named(
    client: &Client,
    ns: Option<&str>,
    group: &str,
    resource: &str,
    verb: &str,
    name: Option<&str>,
) -> bool {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some(group.into()),
                resource: Some(resource.into()),
                verb: Some(verb.into()),
                namespace: ns.map(Into::into),
                name: name.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let out = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap();
    out.status.unwrap().allowed
}

#[tokio::test]
async fn agent_works_under_exactly_the_deployed_cluster_role() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let admin = api.client().await;
    let agent = api.client_as(User::Agent).await;
    let ns = api.fresh_namespace("rbac").await;
    apply_rbac(admin.clone()).await;

    // What the role grants.
    for (group, resource) in [
        ("multicluster.x-k8s.io", "serviceimports"),
        ("discovery.k8s.io", "endpointslices"),
        ("about.k8s.io", "clusterproperties"),
    ] {
        for verb in ["get", "list", "watch"] {
            assert!(
                allowed(&agent, None, group, resource, verb).await,
                "{verb} {resource}"
            );
        }
        for verb in ["create", "update", "patch", "delete"] {
            assert!(
                !allowed(&agent, Some(&ns), group, resource, verb).await,
                "{verb} {resource} must be denied"
            );
        }
    }
    assert!(allowed(&agent, Some(&ns), "events.k8s.io", "events", "create").await);
    assert!(allowed(&agent, Some(&ns), "events.k8s.io", "events", "patch").await);
    // Its own DaemonSet, read only (uninstall or restart: mcs_sync::owner), no other.
    for verb in ["get", "list", "watch"] {
        let own = Some("mcs-agent");
        assert!(allowed_named(&agent, Some("mcs-system"), "apps", "daemonsets", verb, own).await);
        assert!(
            !allowed_named(&agent, Some(&ns), "apps", "daemonsets", verb, own).await,
            "{verb} daemonsets elsewhere must be denied"
        );
        for other in [None, Some("someone-else")] {
            assert!(
                !allowed_named(
                    &agent,
                    Some("mcs-system"),
                    "apps",
                    "daemonsets",
                    verb,
                    other
                )
                .await,
                "{verb} daemonsets {other:?} must be denied"
            );
        }
    }
    for verb in ["create", "update", "patch", "delete"] {
        assert!(
            !allowed(&agent, Some("mcs-system"), "apps", "daemonsets", verb).await,
            "{verb} daemonsets must be denied"
        );
    }
    // Nothing more.
    for (group, resource, verb) in [
        ("", "secrets", "get"),
        ("", "secrets", "list"),
        ("", "services", "list"),
        ("", "pods", "list"),
        ("", "configmaps", "get"),
        ("", "nodes", "list"),
        ("events.k8s.io", "events", "delete"),
        ("events.k8s.io", "events", "list"),
        ("multicluster.x-k8s.io", "serviceexports", "list"),
        ("rbac.authorization.k8s.io", "clusterroles", "get"),
    ] {
        assert!(
            !allowed(&agent, Some(&ns), group, resource, verb).await,
            "{verb} {group}/{resource} must be denied"
        );
    }
    let denied = Api::<Secret>::namespaced(agent.clone(), &ns)
        .list(&Default::default())
        .await;
    assert!(
        matches!(denied, Err(kube::Error::Api(ref e)) if e.code == 403),
        "{denied:?}"
    );

    // The controller works under that identity: objects written by the admin are programmed.
    let run = run_kube_source(agent.clone(), Some("c1"));
    let f = fe("198.18.59.10", 80, Protocol::Tcp);
    Api::<ServiceImport>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &import(&ns, "web", "198.18.59.10"))
        .await
        .unwrap();
    Api::<EndpointSlice>::namespaced(admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c1", &[("198.18.60.2", true)]),
        )
        .await
        .unwrap();
    run.dataplane
        .wait_for("programmed as the agent", WAIT, |s| {
            common::selected_in(s, &f) == ["198.18.60.2:8080@c1"]
        })
        .await;
    let _ = run.stop.send(true);

    // And a rejected object gets a Kubernetes Event, written as the agent.
    // Three nodes' agents reject the same slice alike: one Event, not three.
    let bad = mcs_model::Rejection {
        object: format!("EndpointSlice {ns}/web-c1"),
        reason: mcs_model::Reason::HostileEndpoint,
        message: "address 127.0.0.1 is loopback".into(),
    };
    let mut sinks: Vec<_> = ["node-a", "node-b", "node-c"]
        .into_iter()
        .map(|n| mcs_sync::events::EventSink::new(agent.clone(), n))
        .collect();
    // A rejection only node-c makes (its own address) is its own Event.
    let own = mcs_model::Rejection {
        object: format!("EndpointSlice {ns}/web-c1"),
        reason: mcs_model::Reason::ProtectedAddress,
        message: "address 198.18.60.9 is an address this node depends on".into(),
    };
    for s in &mut sinks {
        s.publish(std::slice::from_ref(&bad));
    }
    sinks[2].publish(&[own]);
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin, &ns);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let list = events.list(&Default::default()).await.unwrap();
        let rejected: Vec<_> = list
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("Rejected"))
            .collect();
        let hostile = rejected
            .iter()
            .filter(|e| e.note.as_deref().unwrap_or("").contains("hostile_endpoint"))
            .count();
        let protected = rejected
            .iter()
            .filter(|e| {
                e.note
                    .as_deref()
                    .unwrap_or("")
                    .contains("protected_address")
            })
            .count();
        if hostile >= 1 && protected >= 1 {
            assert_eq!(
                hostile, 1,
                "one Event per rejection, whatever the number of nodes"
            );
            assert_eq!(protected, 1);
            for e in &rejected {
                assert_eq!(
                    e.regarding.as_ref().unwrap().name.as_deref(),
                    Some("web-c1")
                );
                assert_eq!(e.reporting_controller.as_deref(), Some("mcs-agent"));
            }
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Events not recorded: {rejected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A watch that resumes after its history was compacted gets `410 Gone` and re-lists; an
/// object deleted meanwhile (here behind the apiserver's back, in etcd) is then removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_gone_relist_drops_what_vanished_while_the_watch_was_down() {
    if !mcs_test_support::require(mcs_test_support::prereq::all([
        apiserver::prerequisites(),
        mcs_test_support::prereq::program("etcdctl"),
    ])) {
        return;
    }
    let mut api = ApiServer::start().expect("start apiserver");
    let ns = api.fresh_namespace("gone").await;
    let client = api.client().await;
    let run = run_kube_source(client.clone(), Some("c1"));
    let dp = run.dataplane.clone();
    let f = fe("198.18.61.10", 80, Protocol::Tcp);
    Api::<ServiceImport>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &import(&ns, "web", "198.18.61.10"))
        .await
        .unwrap();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    slices
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c1", &[("198.18.62.2", true)]),
        )
        .await
        .unwrap();
    slices
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c2", &[("198.18.63.2", true)]),
        )
        .await
        .unwrap();
    dp.wait_for("both clusters known", WAIT, |s| {
        s.table
            .frontends
            .get(&f)
            .is_some_and(|svc| svc.backends.len() == 2)
    })
    .await;

    tokio::task::block_in_place(|| -> anyhow::Result<()> {
        api.stop_apiserver();
        let key = format!("/registry/endpointslices/{ns}/web-c1");
        let deleted = api.etcdctl(&["del", &key])?;
        anyhow::ensure!(deleted.trim() == "1", "etcdctl del {key}: {deleted}");
        let status: serde_json::Value =
            serde_json::from_str(&api.etcdctl(&["endpoint", "status", "-w", "json"])?)?;
        let rev = status[0]["Status"]["header"]["revision"]
            .as_i64()
            .expect("revision");
        api.etcdctl(&["compact", &rev.to_string()])?;
        api.restart()
    })
    .expect("stop, delete in etcd, compact, restart");

    dp.wait_for(
        "c1's slice gone after the re-list; c2 takes over",
        WAIT,
        |s| {
            common::selected_in(s, &f) == ["198.18.63.2:8080@c2"]
                && s.table.frontends[&f].backends.len() == 1
        },
    )
    .await;
    let _ = run.stop.send(true);
}

/// A cluster whose MCS controller installed only `v1alpha1` ServiceImports (the CRD shape of
/// Submariner Lighthouse and the AWS Cloud Map controller): the source discovers the version,
/// watches it, and becomes ready; its CRD then upgraded in place and v1alpha1 no longer
/// served, it watches v1beta1 and loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1alpha1_only_cluster_is_served() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let api = tokio::task::block_in_place(ApiServer::start).expect("start apiserver");
    let client = api.client().await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = "serviceimports.multicluster.x-k8s.io";
    crds.delete(name, &DeleteParams::default()).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while crds.get_opt(name).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "CRD {name} not deleted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // One version, v1alpha1, served and stored; the schema open, as Lighthouse's CRD is.
    let crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": name },
        "spec": {
            "group": "multicluster.x-k8s.io",
            "scope": "Namespaced",
            "names": { "plural": "serviceimports", "singular": "serviceimport", "kind": "ServiceImport", "shortNames": ["svcim"] },
            "versions": [{
                "name": "v1alpha1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } },
                "subresources": { "status": {} }
            }]
        }
    }))
    .unwrap();
    crds.create(&PostParams::default(), &crd).await.unwrap();
    apiserver::wait_established(&crds, name).await.unwrap();
    let ns = api.fresh_namespace("alpha").await;
    let imports: Api<mcs_api::v1alpha1::ServiceImport> = Api::namespaced(client.clone(), &ns);
    let si: mcs_api::v1alpha1::ServiceImport = serde_json::from_value(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1alpha1",
        "kind": "ServiceImport",
        "metadata": { "name": "web", "namespace": ns },
        "spec": { "type": "ClusterSetIP", "ips": ["198.18.58.10"], "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] }
    }))
    .unwrap();
    imports.create(&PostParams::default(), &si).await.unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &slice(&ns, "web", "c1", &[("198.18.59.2", true)]),
        )
        .await
        .unwrap();

    assert_eq!(
        mcs_sync::source::kube::discover_import_version(&client).await,
        Ok("v1alpha1")
    );
    let run = run_kube_source(client.clone(), Some("c1"));
    let f = fe("198.18.58.10", 80, Protocol::Tcp);
    run.dataplane
        .wait_for("the v1alpha1 import programmed", WAIT, |s| {
            common::selected_in(s, &f) == ["198.18.59.2:8080@c1"]
        })
        .await;
    // Ready is set right after the dataplane saw the table: poll for it.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !run.health.is_ready() {
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The CRD upgraded in place to ours (v1beta1 stored), then v1alpha1 no longer served:
    // the source watches v1beta1 from then on, keeps web programmed (not even written
    // again) and programs an import made in v1beta1.
    let web_upserts = run.dataplane.upserts_of(&f);
    apiserver::apply_crds(api.kubeconfig(User::Admin), apiserver::project_crds())
        .await
        .unwrap();
    apiserver::set_served(&crds, name, "v1alpha1", false)
        .await
        .unwrap();
    Api::<ServiceImport>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &import(&ns, "cart", "198.18.58.11"))
        .await
        .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &slice(&ns, "cart", "c1", &[("198.18.59.3", true)]),
        )
        .await
        .unwrap();
    let cart = fe("198.18.58.11", 80, Protocol::Tcp);
    run.dataplane
        .wait_for(
            "the v1beta1 import programmed after v1alpha1 stopped being served",
            WAIT,
            |s| common::selected_in(s, &cart) == ["198.18.59.3:8080@c1"],
        )
        .await;
    assert_eq!(
        run.dataplane.selected(&f),
        ["198.18.59.2:8080@c1"],
        "web kept across the CRD upgrade"
    );
    assert_eq!(
        run.dataplane.upserts_of(&f),
        web_upserts,
        "web not programmed again by the switch to v1beta1"
    );
    drop(api);
}

/// What the protobuf decoder reads from a real API server is exactly what the JSON path reads,
/// for slices with every field the agent uses and some it skips, over list pages and watch
/// events (a change and a deletion).
#[tokio::test]
async fn protobuf_and_json_read_the_same_slices() {
    use futures::StreamExt as _;
    use kube::{api::ListParams, runtime::watcher::Event};
    use mcs_sync::{
        convert::{self, LeanSlice},
        source::slice_watch,
    };

    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("protobuf-json").await;
    let client = api.client().await;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let selector = format!("multicluster.kubernetes.io/service-name=full-{ns}");
    let labels = |cluster: &str| {
        serde_json::json!({
            "multicluster.kubernetes.io/service-name": format!("full-{ns}"),
            "multicluster.kubernetes.io/source-cluster": cluster,
            "endpointslice.kubernetes.io/managed-by": "mcs-controller.example.com"
        })
    };
    let full: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "full-c1", "namespace": ns, "labels": labels("c1"),
                      "annotations": { "skipped": "yes" } },
        "addressType": "IPv4",
        "endpoints": [
            { "addresses": ["198.18.73.2"],
              "conditions": { "ready": true, "serving": true, "terminating": false },
              "hostname": "full-0", "nodeName": "node-a", "zone": "z1",
              "targetRef": { "kind": "Pod", "name": "full-0", "namespace": ns },
              "hints": { "forZones": [{ "name": "z1" }] } },
            { "addresses": ["198.18.73.3"],
              "conditions": { "ready": false, "serving": false, "terminating": true } },
            { "addresses": ["198.18.73.4"] }
        ],
        "ports": [
            { "name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http" },
            { "name": "dns", "protocol": "UDP", "port": 53 }
        ]
    }))
    .unwrap();
    slices.create(&PostParams::default(), &full).await.unwrap();
    for (cluster, addr) in [("c2", "2001:2::73:2"), ("c3", "2001:2::73:3")] {
        let s: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": { "name": format!("full-{cluster}"), "namespace": ns, "labels": labels(cluster) },
            "addressType": "IPv6",
            "endpoints": [{ "addresses": [addr], "conditions": { "ready": true } }],
            "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }]
        }))
        .unwrap();
        slices.create(&PostParams::default(), &s).await.unwrap();
    }
    assert!(
        slice_watch::serves_protobuf(&client, &selector)
            .await
            .unwrap(),
        "kube-apiserver serves EndpointSlices in protobuf"
    );

    // JSON, as kube-rs reads it.
    let json_items = Api::<LeanSlice>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap()
        .items;
    let mut json: Vec<_> = json_items.into_iter().map(convert::slice).collect();
    json.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(json.len(), 3);

    // Protobuf, in pages of 2 (the continue token is followed).
    let mut stream = slice_watch::slices(
        client.clone(),
        selector.clone(),
        slice_watch::ListFrom::Etcd { page_size: 2 },
    )
    .boxed();
    let mut next = async || {
        tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("an event in time")
            .expect("the stream goes on")
            .expect("no error")
    };
    assert!(matches!(next().await, Event::Init));
    let mut listed = Vec::new();
    loop {
        match next().await {
            Event::InitApply(s) => listed.push(convert::slice(s)),
            Event::InitDone => break,
            other => panic!("unexpected during the list: {other:?}"),
        }
    }
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(listed, json, "the list reads the same");

    // From the watch cache, in one response: the same (polled: the cache may lag etcd a
    // moment after the writes).
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut cached = slice_watch::slices(
            client.clone(),
            selector.clone(),
            slice_watch::ListFrom::Cache,
        )
        .boxed();
        let mut got = Vec::new();
        while let Some(ev) = tokio::time::timeout(WAIT, cached.next()).await.unwrap() {
            match ev.expect("no error") {
                Event::Init => {}
                Event::InitApply(s) => got.push(convert::slice(s)),
                Event::InitDone => break,
                other => panic!("unexpected during the list: {other:?}"),
            }
        }
        got.sort_by(|a, b| a.name.cmp(&b.name));
        if got == json {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cached list never read the same: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A change and a deletion arrive as watch events, read the same as JSON reads them.
    let mut changed = slices.get("full-c1").await.unwrap();
    let first = &mut changed.endpoints.as_mut().unwrap()[0];
    first.conditions.as_mut().unwrap().ready = Some(false);
    first.zone = Some("z2".into());
    slices
        .replace("full-c1", &PostParams::default(), &changed)
        .await
        .unwrap();
    let json_changed = convert::slice(
        Api::<LeanSlice>::namespaced(client.clone(), &ns)
            .get("full-c1")
            .await
            .unwrap(),
    );
    match next().await {
        Event::Apply(s) => assert_eq!(convert::slice(s), json_changed),
        other => panic!("expected the change, got {other:?}"),
    }
    slices
        .delete("full-c2", &DeleteParams::default())
        .await
        .unwrap();
    match next().await {
        Event::Delete(s) => {
            assert_eq!(s.metadata.name.as_deref(), Some("full-c2"));
            assert_eq!(s.metadata.namespace.as_deref(), Some(ns.as_str()));
        }
        other => panic!("expected the deletion, got {other:?}"),
    }
}

/// Polls `f` (every 20 ms) until it holds; fails after [`WAIT`].
async fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn daemonset(name: &str) -> k8s_openapi::api::apps::v1::DaemonSet {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": "mcs-system" },
        "spec": {
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": { "containers": [{ "name": "agent", "image": "mcs-dataplane/mcs-agent:test" }] }
            }
        }
    }))
    .unwrap()
}

/// Under the deployed role, the agent sees its DaemonSet deleted (an uninstall) and created
/// again (a restart after all), and whether it rolls with maxSurge (the next agent starts
/// beside this one); a name that never existed is never taken for an uninstall.
#[tokio::test]
async fn the_agent_tells_its_daemonset_deleted_from_present() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let admin = api.client().await;
    let agent = api.client_as(User::Agent).await;
    apply_rbac(admin.clone()).await;
    let ds = Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(admin.clone(), "mcs-system");
    // The one name the deployed role lets the agent read.
    let name = "mcs-agent";
    let _ = ds.delete(name, &DeleteParams::default()).await;
    ds.create(&PostParams::default(), &daemonset(name))
        .await
        .unwrap();
    let owner = mcs_sync::owner::watch(agent.clone(), "mcs-system", name);
    let wrong = mcs_sync::owner::watch(agent.clone(), "mcs-system", "no-such-daemonset");
    until("the DaemonSet seen", || owner.seen()).await;
    assert!(!owner.removed(), "present: a stop is a restart");
    // The API server's default strategy (maxSurge 0) does not surge; the chart's userspace
    // one (maxSurge 1, maxUnavailable 0) does, and a percentage above 0 % does too.
    assert!(!owner.surges(), "the default strategy does not surge");
    let strategy = |surge: serde_json::Value, unavailable: serde_json::Value| {
        kube::api::Patch::Merge(serde_json::json!({"spec": {"updateStrategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}}}))
    };
    let pp = kube::api::PatchParams::default();
    ds.patch(name, &pp, &strategy(1.into(), 0.into()))
        .await
        .unwrap();
    until("maxSurge 1 seen", || owner.surges()).await;
    ds.patch(name, &pp, &strategy(0.into(), 1.into()))
        .await
        .unwrap();
    until("maxSurge 0 seen", || !owner.surges()).await;
    ds.patch(name, &pp, &strategy("10%".into(), 0.into()))
        .await
        .unwrap();
    until("maxSurge 10% seen", || owner.surges()).await;
    ds.delete(name, &DeleteParams::default()).await.unwrap();
    until("the delete seen", || owner.removed()).await;
    ds.create(&PostParams::default(), &daemonset(name))
        .await
        .unwrap();
    until("the DaemonSet seen again", || !owner.removed()).await;
    assert!(
        !wrong.removed(),
        "a DaemonSet that never existed is not an uninstall"
    );
    ds.delete(name, &DeleteParams::default()).await.unwrap();
}

/// Issue 52: an API server refusing every list (the agent's account not bound to its role
/// yet) is asked at most once per backoff step by each watcher — kube's watcher yields `Init`
/// before every list attempt, which used to reset the backoff (~13 lists a second per
/// watcher) — and the source syncs within one backoff step of being allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_refusing_lists_is_asked_once_per_backoff_step() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    // A dedicated apiserver: its request counts are this test's alone.
    let api = ApiServer::start().expect("start apiserver");
    let admin = api.client().await;
    let agent = api.client_as(User::Agent).await;
    let t0 = std::time::Instant::now();
    // The shipped default retry cap (20 s).
    let run = run_kube_source(agent, Some("c1"));
    tokio::time::sleep(Duration::from_secs(60)).await;
    let lists = api.refused_reads();
    eprintln!("LISTs and WATCHes refused in {:?}: {lists:?}", t0.elapsed());
    // The ServiceImport watcher lists; the EndpointSlice watcher's first list (asking whether
    // slices come in protobuf) is retried the same way.
    for resource in ["serviceimports", "endpointslices"] {
        let n = lists.get(resource).copied().unwrap_or(0);
        assert!(n >= 1, "{resource}: no refused list counted ({lists:?})");
        assert!(
            n <= 15,
            "{resource}: {n} lists and watches in a minute ({lists:?})"
        );
    }
    assert!(!run.health.is_ready());
    // Allowed now: ready within one backoff step (20 s) and a list.
    apply_rbac(admin.clone()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    while !run.health.is_ready() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not synced within 45 s of the binding"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = run.stop.send(true);
}
