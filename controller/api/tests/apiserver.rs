//! The generated CRDs against a real kube-apiserver: they are accepted and established, a
//! ServiceImport and an MCS EndpointSlice round-trip through kube-rs, and both served versions
//! of ServiceImport read the same object.

use std::collections::BTreeMap;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams},
};
use mcs_api::{
    ClusterProperty, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER, ServiceExport, ServiceImport,
    ServiceImportType,
};
use mcs_test_support::apiserver;

fn service_import(ns: &str) -> ServiceImport {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1",
        "kind": "ServiceImport",
        "metadata": { "name": "web", "namespace": ns },
        "spec": {
            "type": "ClusterSetIP",
            "ips": ["198.18.0.10"],
            "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": { "clientIP": { "timeoutSeconds": 60 } }
        }
    }))
    .unwrap()
}

fn endpoint_slice(ns: &str, cluster: &str) -> EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("web-{cluster}"),
            "namespace": ns,
            "labels": {
                LABEL_SERVICE_NAME: "web",
                LABEL_SOURCE_CLUSTER: cluster,
                "endpointslice.kubernetes.io/managed-by": "mcs-controller.example"
            }
        },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": [
            { "addresses": ["198.18.1.2"], "conditions": { "ready": true }, "zone": "z1" },
            { "addresses": ["198.18.1.3"], "conditions": { "ready": false, "serving": true, "terminating": true } }
        ]
    }))
    .unwrap()
}

#[tokio::test]
async fn service_import_and_mcs_endpoint_slice_round_trip() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("roundtrip").await;
    let client = api.client().await;

    let imports: Api<ServiceImport> = Api::namespaced(client.clone(), &ns);
    imports
        .create(&PostParams::default(), &service_import(&ns))
        .await
        .expect("create import");
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    for cluster in ["c1", "c2"] {
        slices
            .create(&PostParams::default(), &endpoint_slice(&ns, cluster))
            .await
            .expect("slice");
    }

    let got = imports.get("web").await.expect("read import back");
    assert_eq!(got.spec.type_, ServiceImportType::ClusterSetIP);
    assert_eq!(got.spec.ips, vec!["198.18.0.10"]);
    assert_eq!(got.spec.ports[0].name.as_deref(), Some("http"));
    assert_eq!(got.spec.ports[0].port, 80);
    let timeout = got
        .spec
        .session_affinity_config
        .and_then(|c| c.client_ip)
        .unwrap();
    assert_eq!(timeout.timeout_seconds, Some(60));

    // The agent selects MCS slices by the service-name label.
    let lp = ListParams::default().labels(&format!("{LABEL_SERVICE_NAME}=web"));
    let mut listed = slices.list(&lp).await.expect("list slices");
    listed.items.sort_by_key(|s| s.metadata.name.clone());
    let clusters: Vec<String> = listed
        .items
        .iter()
        .map(|s| s.metadata.labels.as_ref().unwrap()[LABEL_SOURCE_CLUSTER].clone())
        .collect();
    assert_eq!(clusters, vec!["c1", "c2"]);
    let eps = listed.items[0].endpoints.as_ref().expect("endpoints");
    assert_eq!(eps[0].addresses, vec!["198.18.1.2"]);
    assert_eq!(eps[0].zone.as_deref(), Some("z1"));
    assert_eq!(eps[1].conditions.as_ref().unwrap().terminating, Some(true));
}

#[tokio::test]
async fn v1alpha1_objects_are_served_as_v1beta1() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("versions").await;
    let client = api.client().await;
    let gvk = GroupVersionKind::gvk("multicluster.x-k8s.io", "v1alpha1", "ServiceImport");
    let ar = ApiResource::from_gvk(&gvk);
    let alpha: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    let mut obj = DynamicObject::new("db", &ar).within(&ns);
    obj.data = serde_json::json!({
        "spec": { "type": "ClusterSetIP", "ips": ["198.18.0.11"], "ports": [{ "port": 5432 }] }
    });
    alpha
        .create(&PostParams::default(), &obj)
        .await
        .expect("create v1alpha1 import");

    let beta: Api<ServiceImport> = Api::namespaced(client, &ns);
    let got = beta.get("db").await.expect("read as v1beta1");
    assert_eq!(got.spec.ips, vec!["198.18.0.11"]);
    assert_eq!(got.spec.ports[0].port, 5432);
}

#[tokio::test]
async fn invalid_service_import_is_rejected_by_the_schema() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("schema").await;
    let (imports, ar) = dynamic(api.client().await, &ns, "ServiceImport");
    let mut obj = DynamicObject::new("bad", &ar).within(&ns);
    // Three ips (max 2) and a type outside the enum.
    obj.data = serde_json::json!({
        "spec": {
            "type": "LoadBalancer",
            "ips": ["198.18.0.1", "198.18.0.2", "198.18.0.3"],
            "ports": [{ "port": 80 }]
        }
    });
    let err = imports
        .create(&PostParams::default(), &obj)
        .await
        .expect_err("must be rejected");
    let msg = err.to_string();
    assert!(
        msg.contains("spec.ips") && msg.contains("spec.type"),
        "{msg}"
    );
}

/// A v1beta1 `kind` of ours in `ns`, untyped.
fn dynamic(client: kube::Client, ns: &str, kind: &str) -> (Api<DynamicObject>, ApiResource) {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "multicluster.x-k8s.io",
        "v1beta1",
        kind,
    ));
    (Api::namespaced_with(client, ns, &ar), ar)
}

#[tokio::test]
async fn metadata_only_service_export_and_minimal_service_import_are_accepted() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("minimal").await;
    let client = api.client().await;

    // The canonical ServiceExport of the KEP and upstream: metadata only.
    let (exports, ar) = dynamic(client.clone(), &ns, "ServiceExport");
    exports
        .create(
            &PostParams::default(),
            &DynamicObject::new("web", &ar).within(&ns),
        )
        .await
        .expect("a metadata-only ServiceExport is accepted");
    // The API server fills in `spec: {}`, so the typed readers find one.
    let typed: Api<ServiceExport> = Api::namespaced(client.clone(), &ns);
    let got = typed
        .get("web")
        .await
        .expect("read as a typed ServiceExport");
    assert_eq!(got.spec, mcs_api::ServiceExportSpec::default());
    let listed = typed
        .list(&ListParams::default())
        .await
        .expect("list typed");
    assert_eq!(listed.items.len(), 1);

    // A minimal ServiceImport: a type and one port, nothing else.
    let (imports, ar) = dynamic(client.clone(), &ns, "ServiceImport");
    let mut si = DynamicObject::new("web", &ar).within(&ns);
    si.data = serde_json::json!({ "spec": { "type": "ClusterSetIP", "ports": [{ "port": 80 }] } });
    imports
        .create(&PostParams::default(), &si)
        .await
        .expect("a minimal ServiceImport is accepted");
    let got = Api::<ServiceImport>::namespaced(client, &ns)
        .get("web")
        .await
        .expect("read back");
    assert_eq!(got.spec.ports[0].port, 80);
    assert!(got.spec.ips.is_empty());
}

#[tokio::test]
async fn the_schema_bounds_what_the_dataplane_cannot_carry() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let ns = api.fresh_namespace("bounds").await;
    let client = api.client().await;
    let refused = |err: kube::Error, field: &str| {
        let msg = err.to_string();
        assert!(msg.contains(field), "{msg}");
    };

    // 101 ports: more than any agent takes.
    let (imports, ar) = dynamic(client.clone(), &ns, "ServiceImport");
    let ports: Vec<serde_json::Value> = (0..101)
        .map(|i| serde_json::json!({ "name": format!("p{i}"), "port": 1000 + i }))
        .collect();
    let mut si = DynamicObject::new("wide", &ar).within(&ns);
    si.data = serde_json::json!({ "spec": { "type": "ClusterSetIP", "ports": ports[..100] } });
    imports
        .create(&PostParams::default(), &si)
        .await
        .expect("100 ports fit");
    si.metadata.name = Some("wider".into());
    si.data = serde_json::json!({ "spec": { "type": "ClusterSetIP", "ports": ports } });
    refused(
        imports
            .create(&PostParams::default(), &si)
            .await
            .expect_err("101 ports"),
        "spec.ports",
    );

    // An exported label value no label may have, an annotation value over 256 KiB, keys that
    // are not qualified names; good keys with a prefix pass.
    let (exports, ar) = dynamic(client, &ns, "ServiceExport");
    for (name, spec, field) in [
        (
            "long-label",
            serde_json::json!({ "exportedLabels": { "team": "x".repeat(64) } }),
            "spec.exportedLabels",
        ),
        (
            "bad-label",
            serde_json::json!({ "exportedLabels": { "team": "not a value!" } }),
            "spec.exportedLabels",
        ),
        (
            "big-annotation",
            serde_json::json!({ "exportedAnnotations": { "a": "v".repeat(256 * 1024 + 1) } }),
            "spec.exportedAnnotations",
        ),
        // Keys no label or annotation may have (once accepted, then refused by the
        // controller at every pass).
        (
            "bad-label-key",
            serde_json::json!({ "exportedLabels": { "bad key!": "x" } }),
            "spec.exportedLabels",
        ),
        (
            "bad-annotation-key",
            serde_json::json!({ "exportedAnnotations": { "-a/b": "x" } }),
            "spec.exportedAnnotations",
        ),
    ] {
        let mut se = DynamicObject::new(name, &ar).within(&ns);
        se.data = serde_json::json!({ "spec": spec });
        refused(
            exports
                .create(&PostParams::default(), &se)
                .await
                .expect_err(name),
            field,
        );
    }
    let mut se = DynamicObject::new("good-keys", &ar).within(&ns);
    se.data = serde_json::json!({ "spec": {
        "exportedLabels": { "app.kubernetes.io/part-of": "shop", "team": "" },
        "exportedAnnotations": { "example.com/owner": "a b c", "note": "x" } } });
    exports
        .create(&PostParams::default(), &se)
        .await
        .expect("qualified keys are accepted");
}

#[tokio::test]
async fn cluster_property_holds_the_cluster_id() {
    let Some(api) = apiserver::shared() else {
        return;
    };
    let client = api.client().await;
    let props: Api<ClusterProperty> = Api::all(client);
    let mut cp = ClusterProperty::new(
        mcs_api::CLUSTER_ID_PROPERTY,
        mcs_api::ClusterPropertySpec { value: "c1".into() },
    );
    cp.metadata.labels = Some(BTreeMap::from([("test".to_string(), "yes".to_string())]));
    match props.create(&PostParams::default(), &cp).await {
        Ok(_) => {}
        // Cluster-scoped and shared by the tests of this binary: another test may have made it.
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create ClusterProperty: {e}"),
    }
    let got = props.get(mcs_api::CLUSTER_ID_PROPERTY).await.unwrap();
    assert_eq!(got.spec.value, "c1");
}
