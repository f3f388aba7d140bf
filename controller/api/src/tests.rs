use super::*;

#[test]
fn service_import_round_trips_upstream_shape() {
    let yaml = r#"
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: web, namespace: shop }
spec:
  type: ClusterSetIP
  ips: ["198.18.0.10"]
  ports:
  - { name: http, protocol: TCP, port: 80 }
  sessionAffinity: ClientIP
  sessionAffinityConfig: { clientIP: { timeoutSeconds: 60 } }
  trafficDistribution: PreferClose
status:
  clusters: [{ cluster: c1 }]
"#;
    let si: ServiceImport = serde_yaml::from_str(yaml).unwrap();
    assert_eq!(si.spec.ips, vec!["198.18.0.10"]);
    assert_eq!(si.spec.type_, ServiceImportType::ClusterSetIP);
    assert_eq!(si.spec.ports[0].port, 80);
    let cfg = si.spec.session_affinity_config.as_ref().unwrap();
    assert_eq!(cfg.client_ip.as_ref().unwrap().timeout_seconds, Some(60));
    let back = serde_json::to_value(&si).unwrap();
    assert_eq!(
        back["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"],
        60
    );
    assert_eq!(back["spec"]["type"], "ClusterSetIP");
}

#[test]
fn crds_serve_two_versions_and_store_v1beta1() {
    for (file, crd) in crds() {
        let versions: Vec<(&str, bool, bool)> = crd
            .spec
            .versions
            .iter()
            .map(|v| (v.name.as_str(), v.served, v.storage))
            .collect();
        assert_eq!(
            versions,
            vec![("v1alpha1", true, false), ("v1beta1", true, true)],
            "{file}"
        );
        assert!(
            crd.spec.conversion.is_none(),
            "{file}: same schema, no conversion webhook"
        );
    }
}

#[test]
fn cluster_property_is_cluster_scoped() {
    let crds = crds();
    let (_, cp) = crds.iter().find(|(f, _)| f.starts_with("about")).unwrap();
    assert_eq!(cp.spec.scope, "Cluster");
    assert_eq!(cp.spec.group, "about.k8s.io");
}

#[test]
fn service_export_spec_is_optional_and_defaulted_and_bounds_are_in_the_schema() {
    let crds = crds();
    let schema = |file: &str| {
        let (_, crd) = crds.iter().find(|(f, _)| *f == file).unwrap();
        crd.spec
            .versions
            .iter()
            .map(|v| serde_json::to_value(v.schema.as_ref().unwrap()).unwrap())
            .collect::<Vec<_>>()
    };
    for v in schema("multicluster.x-k8s.io_serviceexports.yaml") {
        let root = &v["openAPIV3Schema"];
        let required = root["required"].as_array().cloned().unwrap_or_default();
        assert!(!required.contains(&"spec".into()), "{root}");
        let spec = &root["properties"]["spec"];
        assert_eq!(spec["default"], serde_json::json!({}));
        let labels = &spec["properties"]["exportedLabels"];
        assert_eq!(labels["additionalProperties"]["maxLength"], 63);
        assert_eq!(
            labels["additionalProperties"]["pattern"],
            LABEL_VALUE_PATTERN
        );
        assert_eq!(labels["nullable"], true);
        assert!(labels["description"].is_string());
        let annotations = &spec["properties"]["exportedAnnotations"];
        assert_eq!(
            annotations["additionalProperties"]["maxLength"],
            MAX_ANNOTATION_BYTES
        );
    }
    for v in schema("multicluster.x-k8s.io_serviceimports.yaml") {
        let ports = &v["openAPIV3Schema"]["properties"]["spec"]["properties"]["ports"];
        assert_eq!(ports["maxItems"], MAX_IMPORT_PORTS, "{ports}");
    }
    assert_eq!(
        MAX_IMPORT_PORTS,
        mcs_model::guard::Limits::default().ports_per_import
    );
}

#[test]
fn endpoint_slice_objects_reads_any_value_and_the_schema_allows_only_upstreams() {
    let status = |v: &str| -> ServiceImportStatus {
        serde_json::from_value(serde_json::json!({ "endpointSliceObjects": v })).unwrap()
    };
    assert_eq!(
        status("Present").endpoint_slice_objects,
        Some(EndpointSliceObjects::Present)
    );
    assert_eq!(
        status("Absent").endpoint_slice_objects,
        Some(EndpointSliceObjects::Absent)
    );
    assert_eq!(
        status("SomethingNewer").endpoint_slice_objects,
        Some(EndpointSliceObjects::Unknown)
    );
    let crds = crds();
    let si = serde_json::to_value(&crds[0].1).unwrap();
    for v in si["spec"]["versions"].as_array().unwrap() {
        assert_eq!(
            v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["endpointSliceObjects"]
                ["enum"],
            serde_json::json!(["Present", "Absent"])
        );
    }
}
