//! Kubernetes objects → the index's plain input (field-by-field copies; validation happens in
//! `mcs_model::validate`).

use k8s_openapi::api::discovery::v1::EndpointSlice;
use mcs_api::ServiceImport;
use mcs_model::input::{EndpointInput, ImportInput, ImportPortInput, SliceInput, SlicePortInput};

/// Namespace of an object, `default` when unset (files may omit it).
pub fn namespace(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.namespace.clone().unwrap_or_else(|| "default".into())
}

/// A ServiceImport as index input.
pub fn import(si: &ServiceImport) -> ImportInput {
    let spec = &si.spec;
    ImportInput {
        namespace: namespace(&si.metadata),
        name: si.metadata.name.clone().unwrap_or_default(),
        created: si
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string()),
        uid: si.metadata.uid.clone(),
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
    }
}

/// An EndpointSlice as index input.
pub fn slice(es: &EndpointSlice) -> SliceInput {
    SliceInput {
        namespace: namespace(&es.metadata),
        name: es.metadata.name.clone().unwrap_or_default(),
        labels: es.metadata.labels.clone().unwrap_or_default(),
        address_type: es.address_type.clone(),
        ports: es
            .ports
            .iter()
            .flatten()
            .map(|p| SlicePortInput {
                name: p.name.clone(),
                protocol: p.protocol.clone(),
                port: p.port.map(i64::from),
            })
            .collect(),
        endpoints: es
            .endpoints
            .iter()
            .flatten()
            .map(|e| {
                let c = e.conditions.as_ref();
                EndpointInput {
                    addresses: e.addresses.clone(),
                    ready: c.and_then(|c| c.ready),
                    serving: c.and_then(|c| c.serving),
                    terminating: c.and_then(|c| c.terminating),
                    zone: e.zone.clone(),
                    node_name: e.node_name.clone(),
                    hostname: e.hostname.clone(),
                }
            })
            .collect(),
    }
}
