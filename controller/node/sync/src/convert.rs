//! Kubernetes objects → the index's plain input (field-by-field copies; validation happens in
//! `mcs_model::validate`).
//!
//! The sources read ServiceImports and EndpointSlices as [`LeanImport`] and [`LeanSlice`]: the
//! fields the agent uses and nothing else. `metadata.managedFields`, annotations, owner
//! references, `targetRef`s and hints are skipped while parsing, never allocated: they were
//! most of each object's bytes and allocations (a first list of 1M endpoints is ~230 MB of
//! JSON), and the agent reads none of them.

use std::{borrow::Cow, collections::BTreeMap};

use k8s_openapi::{
    NamespaceResourceScope,
    api::discovery::v1::{EndpointConditions, EndpointPort},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};
use kube::Resource;
use mcs_api::{ServiceImport, v1beta1::ServiceImportSpec};
use mcs_model::input::{EndpointInput, ImportInput, ImportPortInput, SliceInput, SlicePortInput};
use serde::{Deserialize, Deserializer};

/// The metadata fields the agent reads (the watcher needs `resourceVersion` too).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    labels: Option<BTreeMap<String, String>>,
}

fn lean_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = LeanMeta::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        creation_timestamp: m.creation_timestamp,
        labels: m.labels,
        ..Default::default()
    })
}

/// A `multicluster.x-k8s.io/v1beta1` ServiceImport as the agent reads it: metadata trimmed,
/// the spec whole, of the status only `endpointSliceObjects`.
#[derive(Clone, Debug, Deserialize)]
pub struct LeanImport {
    /// Name, namespace, uid, resourceVersion, creationTimestamp, labels.
    #[serde(deserialize_with = "lean_meta")]
    pub metadata: ObjectMeta,
    /// The spec.
    pub spec: ServiceImportSpec,
    /// `status.endpointSliceObjects`.
    #[serde(default)]
    pub status: Option<LeanImportStatus>,
}

/// What the agent reads of a ServiceImport's status.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeanImportStatus {
    /// `Present`, `Absent` or unset. Read as text: an unknown value (a newer writer's) is
    /// not an unparsable import; only `Absent` changes what the agent does.
    #[serde(default)]
    pub endpoint_slice_objects: Option<String>,
}

/// A `discovery.k8s.io/v1` EndpointSlice as the agent reads it.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeanSlice {
    /// Name, namespace, uid, resourceVersion, creationTimestamp, labels.
    #[serde(deserialize_with = "lean_meta")]
    pub metadata: ObjectMeta,
    /// `IPv4`, `IPv6` or `FQDN`.
    pub address_type: String,
    /// The endpoints.
    #[serde(default)]
    pub endpoints: Option<Vec<LeanEndpoint>>,
    /// The ports.
    #[serde(default)]
    pub ports: Option<Vec<EndpointPort>>,
}

/// An endpoint of a [`LeanSlice`] (no `targetRef`, hints or deprecated topology).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeanEndpoint {
    /// Addresses.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Conditions.
    pub conditions: Option<EndpointConditions>,
    /// Zone.
    pub zone: Option<String>,
    /// Node name.
    pub node_name: Option<String>,
    /// Hostname.
    pub hostname: Option<String>,
}

macro_rules! lean_resource {
    ($t:ty, $kind:literal, $group:literal, $version:literal, $plural:literal) => {
        impl Resource for $t {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;
            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($group)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($version)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
lean_resource!(
    LeanImport,
    "ServiceImport",
    "multicluster.x-k8s.io",
    "v1beta1",
    "serviceimports"
);
lean_resource!(
    LeanSlice,
    "EndpointSlice",
    "discovery.k8s.io",
    "v1",
    "endpointslices"
);

/// Namespace of an object, `default` when unset (files may omit it).
pub fn namespace(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.namespace.clone().unwrap_or_else(|| "default".into())
}

/// A ServiceImport as index input.
pub fn import(si: &ServiceImport) -> ImportInput {
    let absent = si
        .status
        .as_ref()
        .and_then(|s| s.endpoint_slice_objects)
        .is_some_and(|o| o == mcs_api::EndpointSliceObjects::Absent);
    import_parts(&si.metadata, &si.spec, absent)
}

/// A [`LeanImport`] as index input.
pub fn lean_import(si: &LeanImport) -> ImportInput {
    let absent = si
        .status
        .as_ref()
        .and_then(|s| s.endpoint_slice_objects.as_deref())
        == Some("Absent");
    import_parts(&si.metadata, &si.spec, absent)
}

fn import_parts(meta: &ObjectMeta, spec: &ServiceImportSpec, absent: bool) -> ImportInput {
    ImportInput {
        namespace: namespace(meta),
        name: meta.name.clone().unwrap_or_default(),
        created: meta.creation_timestamp.as_ref().map(|t| t.0.to_string()),
        uid: meta.uid.clone(),
        type_: match spec.type_ {
            mcs_api::ServiceImportType::ClusterSetIP => "ClusterSetIP".into(),
            mcs_api::ServiceImportType::Headless => "Headless".into(),
        },
        ips: spec.ips.clone(),
        ip_families: spec.ip_families.clone(),
        ports: spec
            .ports
            .iter()
            .map(|p| ImportPortInput {
                name: p.name.clone(),
                protocol: p.protocol.clone(),
                port: i64::from(p.port),
            })
            .collect(),
        session_affinity: spec.session_affinity.clone(),
        affinity_timeout_seconds: spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .map(i64::from),
        traffic_distribution: spec.traffic_distribution.clone(),
        internal_traffic_policy: spec.internal_traffic_policy.clone(),
        endpoint_slices_absent: absent,
    }
}

/// An EndpointSlice as index input. Takes the object: its strings move, none is copied (a
/// full sync converts a million endpoints).
pub fn slice(es: LeanSlice) -> SliceInput {
    let meta = es.metadata;
    SliceInput {
        namespace: meta.namespace.unwrap_or_else(|| "default".into()),
        name: meta.name.unwrap_or_default(),
        labels: meta.labels.unwrap_or_default(),
        address_type: es.address_type,
        ports: es
            .ports
            .into_iter()
            .flatten()
            .map(|p| SlicePortInput {
                name: p.name,
                protocol: p.protocol,
                port: p.port.map(i64::from),
            })
            .collect(),
        endpoints: es
            .endpoints
            .into_iter()
            .flatten()
            .map(|e| {
                let c = e.conditions.as_ref();
                EndpointInput {
                    ready: c.and_then(|c| c.ready),
                    serving: c.and_then(|c| c.serving),
                    terminating: c.and_then(|c| c.terminating),
                    addresses: e.addresses,
                    zone: e.zone,
                    node_name: e.node_name,
                    hostname: e.hostname,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the API server sends, with the fields the agent skips (managedFields, targetRef,
    /// hints, annotations, ownerReferences): the same input as a minimal object gives.
    #[test]
    fn lean_objects_read_the_fields_the_agent_uses_and_skip_the_rest() {
        let full = serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "name": "web-c1", "namespace": "ns", "uid": "u1", "resourceVersion": "42",
                "labels": { "multicluster.kubernetes.io/service-name": "web",
                            "multicluster.kubernetes.io/source-cluster": "c1" },
                "annotations": { "a": "b" },
                "ownerReferences": [{ "apiVersion": "v1", "kind": "X", "name": "x", "uid": "o" }],
                "managedFields": [{ "manager": "m", "operation": "Apply", "apiVersion": "v1",
                    "fieldsType": "FieldsV1", "fieldsV1": { "f:endpoints": {}, "f:ports": {} } }]
            },
            "addressType": "IPv4",
            "endpoints": [{
                "addresses": ["198.18.1.2"],
                "conditions": { "ready": false, "serving": true, "terminating": true },
                "zone": "z1", "nodeName": "n1", "hostname": "h1",
                "targetRef": { "kind": "Pod", "name": "p", "namespace": "ns" },
                "hints": { "forZones": [{ "name": "z1" }] },
                "deprecatedTopology": { "k": "v" }
            }],
            "ports": [{ "name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "h2c" }]
        });
        let lean: LeanSlice = serde_json::from_value(full).unwrap();
        assert_eq!(lean.metadata.resource_version.as_deref(), Some("42"));
        assert!(lean.metadata.managed_fields.is_none());
        assert!(lean.metadata.annotations.is_none());
        let input = slice(lean);
        assert_eq!(input.namespace, "ns");
        assert_eq!(input.name, "web-c1");
        assert_eq!(input.labels.len(), 2);
        assert_eq!(input.address_type, "IPv4");
        assert_eq!(
            input.ports,
            vec![SlicePortInput {
                name: Some("http".into()),
                protocol: Some("TCP".into()),
                port: Some(8080),
            }]
        );
        assert_eq!(
            input.endpoints,
            vec![EndpointInput {
                addresses: vec!["198.18.1.2".into()],
                ready: Some(false),
                serving: Some(true),
                terminating: Some(true),
                zone: Some("z1".into()),
                node_name: Some("n1".into()),
                hostname: Some("h1".into()),
            }]
        );
        // `endpoints: null` (a slice scaled to zero) is no endpoints.
        let empty: LeanSlice = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "e" }, "addressType": "IPv4", "endpoints": null
        }))
        .unwrap();
        assert!(slice(empty).endpoints.is_empty());

        let import: LeanImport = serde_json::from_value(serde_json::json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
            "metadata": { "name": "web", "namespace": "ns", "uid": "u2",
                          "creationTimestamp": "2026-12-01T00:00:00Z",
                          "managedFields": [{ "manager": "m", "fieldsV1": { "f:spec": {} } }] },
            "spec": { "type": "ClusterSetIP", "ips": ["198.18.0.10"],
                      "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] },
            "status": { "clusters": [{ "cluster": "c1" }] }
        }))
        .unwrap();
        let input = lean_import(&import);
        assert_eq!(
            (input.namespace.as_str(), input.name.as_str()),
            ("ns", "web")
        );
        assert_eq!(input.uid.as_deref(), Some("u2"));
        assert!(input.created.is_some());
        assert_eq!(input.type_, "ClusterSetIP");
        assert_eq!(input.ips, vec!["198.18.0.10".to_string()]);
        assert_eq!(input.ports.len(), 1);
        assert!(
            !input.endpoint_slices_absent,
            "no endpointSliceObjects: slices are read"
        );
    }

    #[test]
    fn endpoint_slice_objects_absent_is_read_and_any_other_value_is_not_absent() {
        let with = |status: serde_json::Value| -> ImportInput {
            let import: LeanImport = serde_json::from_value(serde_json::json!({
                "metadata": { "name": "web", "namespace": "ns" },
                "spec": { "type": "ClusterSetIP", "ips": ["198.18.0.10"],
                          "ports": [{ "port": 80 }] },
                "status": status
            }))
            .unwrap();
            lean_import(&import)
        };
        use serde_json::json;
        assert!(with(json!({ "endpointSliceObjects": "Absent" })).endpoint_slices_absent);
        for status in [
            json!({ "endpointSliceObjects": "Present" }),
            json!({ "endpointSliceObjects": "SomethingNewer" }),
            json!({}),
            json!(null),
        ] {
            assert!(!with(status.clone()).endpoint_slices_absent, "{status}");
        }
        // The typed import (file source) reads it the same way.
        let mut si = ServiceImport::new("web", ServiceImportSpec::default());
        si.metadata.namespace = Some("ns".into());
        si.status = Some(mcs_api::ServiceImportStatus {
            endpoint_slice_objects: Some(mcs_api::EndpointSliceObjects::Absent),
            ..Default::default()
        });
        assert!(import(&si).endpoint_slices_absent);
    }
}
