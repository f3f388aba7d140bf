//! Kubernetes API types of the Multi-Cluster Services API as mcs-dataplane reads them.
//!
//! # Layout
//!
//! - [`ServiceImportSpec`] and friends: one definition of the schema, served under two
//!   versions ([`v1alpha1::ServiceImport`], [`v1beta1::ServiceImport`]; v1beta1 is the storage
//!   version). The schemas are identical, so the CRD uses conversion strategy `None`, as
//!   upstream (kubernetes-sigs/mcs-api) does.
//! - [`v1alpha1::ServiceExport`], [`v1beta1::ServiceExport`]: for clusters that lack the CRD.
//! - [`ClusterProperty`] (`about.k8s.io`, cluster-scoped): the cluster's id lives in the one
//!   named [`CLUSTER_ID_PROPERTY`].
//! - [`crds`]: the CRDs written to `deploy/crds/` by the `crdgen` binary.
//! - [`labels`]: every label name the crates share.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt as _};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub mod labels;

/// Labels of MCS EndpointSlices (all labels: [`labels`]).
pub use labels::{
    DEFAULT_SLICE_CONTROLLER, LABEL_MANAGED_BY, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER,
    LABEL_SOURCE_MANAGED_BY,
};
/// Name of the ClusterProperty holding this cluster's id (KEP-2149).
pub const CLUSTER_ID_PROPERTY: &str = "cluster.clusterset.k8s.io";
/// Name of the ClusterProperty holding the ClusterSet's id (KEP-2149).
pub const CLUSTERSET_ID_PROPERTY: &str = "clusterset.k8s.io";

/// The approval of the `about.k8s.io` API (KEP-2149), required on CRDs of protected groups.
pub const ABOUT_API_APPROVAL: &str = "https://github.com/kubernetes/enhancements/pull/3084";

/// Labels of the generated CRDs.
const CRD_LABELS: [(&str, &str); 1] = [(labels::LABEL_PART_OF, "mcs-dataplane")];
/// The upstream mcs-api release whose ServiceImport and ServiceExport schemas ours match
/// field for field (stricter only where docs/safety.md says why), with its schema revision:
/// the labels upstream puts on its CRDs so that installers never downgrade them.
pub const UPSTREAM_CRD_LABELS: [(&str, &str); 2] = [
    ("multicluster.x-k8s.io/release-version", "v0.5.2"),
    ("multicluster.x-k8s.io/crd-schema-revision", "0"),
];

/// The most ports a ServiceImport holds (the agents' `ports_per_import`; the CRD's
/// `maxItems`).
pub const MAX_IMPORT_PORTS: usize = 100;
/// A label value (Kubernetes' `IsValidLabelValue`): empty, or at most 63 letters, digits,
/// `-`, `_` and `.`, starting and ending alphanumeric.
pub const LABEL_VALUE_PATTERN: &str = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";
/// The most bytes of an object's annotations (Kubernetes' `TotalAnnotationSizeLimitB`),
/// also the bound of each exported annotation's value in the schema.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;

/// A qualified name (a label or annotation key): an optional DNS-subdomain-like prefix of at
/// most 253 bytes and `/`, then a name part of at most 63 (Kubernetes' `IsQualifiedName`;
/// the controller checks the prefix's labels exactly).
pub const QUALIFIED_NAME_PATTERN: &str =
    "^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";
/// The most entries of `exportedLabels` and of `exportedAnnotations` (a bound the API
/// server's CEL cost estimate needs; far more than a ServiceImport's labels hold).
pub const MAX_EXPORTED_ENTRIES: usize = 256;

/// The CEL rule that every key of a map is a qualified name.
fn qualified_keys(what: &str) -> serde_json::Value {
    serde_json::json!([{
        "rule": format!("self.all(k, k.matches('{QUALIFIED_NAME_PATTERN}'))"),
        "message": format!("every {what} key must be a qualified name ([prefix/]name, as label keys are)"),
    }])
}

/// The schema of `exportedLabels`: keys are qualified names, values are label values.
fn exported_labels_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "maxProperties": MAX_EXPORTED_ENTRIES,
        "additionalProperties": {
            "type": "string",
            "maxLength": 63,
            "pattern": LABEL_VALUE_PATTERN,
        },
        "x-kubernetes-validations": qualified_keys("exportedLabels"),
    })
}

/// The schema of `exportedAnnotations`: keys are qualified names, no value longer than all
/// annotations may be.
fn exported_annotations_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "maxProperties": MAX_EXPORTED_ENTRIES,
        "additionalProperties": { "type": "string", "maxLength": MAX_ANNOTATION_BYTES },
        "x-kubernetes-validations": qualified_keys("exportedAnnotations"),
    })
}

/// ServiceImport type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ServiceImportType {
    /// The service has ClusterSetIPs (VIPs).
    #[default]
    ClusterSetIP,
    /// No VIP: DNS answers with the endpoints.
    Headless,
}

/// A port of a ServiceImport. There is no targetPort: the EndpointSlice ports carry it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    /// Port name; matches the EndpointSlice port of the same name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// Application protocol hint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    /// The port on the ClusterSetIP.
    pub port: i32,
}

/// Session affinity settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionAffinityConfig {
    /// ClientIP affinity settings.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "clientIP")]
    pub client_ip: Option<ClientIpConfig>,
}

/// ClientIP affinity settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientIpConfig {
    /// Affinity timeout, 1..=86400 seconds; default 10800.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<i32>,
}

/// Whether the implementation that wrote a ServiceImport publishes its endpoints as MCS
/// EndpointSlice objects (`status.endpointSliceObjects`, KEP-1645; upstream mcs-api v0.5.2).
/// Consumers such as Gateway API implementations read the slices when `Present` and only the
/// import's IPs when `Absent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum EndpointSliceObjects {
    /// MCS EndpointSlices carry this import's endpoints (what mcs-controller always writes).
    Present,
    /// No EndpointSlice objects: only the import's IPs (another implementation's choice).
    Absent,
    /// A value this version does not know (a newer writer's): read, never written, so one
    /// such import cannot fail a whole list.
    #[serde(other)]
    #[schemars(skip)]
    Unknown,
}

/// Status of a ServiceImport.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceImportStatus {
    /// Whether imported EndpointSlice objects are present for this ServiceImport.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_slice_objects: Option<EndpointSliceObjects>,
    /// Clusters that export the service.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<ClusterStatus>,
    /// Conditions (`Ready`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
}

/// A cluster that exports a service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ClusterStatus {
    /// Cluster id.
    pub cluster: String,
}

/// Status of a ServiceExport.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServiceExportStatus {
    /// Conditions (`Valid`, `Ready`, `Conflict`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
}

// One definition of each spec, stamped out per served version (the schemas are identical, as
// upstream; kube's derive needs a literal version string, hence the macro).
macro_rules! mcs_version {
    ($version:ident, $name:literal) => {
        /// The kinds of `multicluster.x-k8s.io/
        #[doc = $name]
        /// `.
        pub mod $version {
            use super::*;

            /// Spec of a ServiceImport.
            #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema, CustomResource)]
            #[kube(
                group = "multicluster.x-k8s.io",
                version = $name,
                kind = "ServiceImport",
                namespaced,
                status = "ServiceImportStatus",
                category = "multicluster",
                shortname = "svcim",
                shortname = "svcimport",
                printcolumn = r#"{"name":"Type","type":"string","jsonPath":".spec.type"}"#,
                printcolumn = r#"{"name":"IP","type":"string","jsonPath":".spec.ips"}"#,
                printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
            )]
            #[serde(rename_all = "camelCase")]
            pub struct ServiceImportSpec {
                /// The ports of the service. Each names its own protocol. At most 100
                /// (`MAX_IMPORT_PORTS`): the agents refuse an import with more.
                #[schemars(extend("x-kubernetes-list-type" = "atomic"), length(max = 100))]
                pub ports: Vec<ServicePort>,
                /// ClusterSetIPs (VIPs), in `ipFamilies` order; empty for Headless.
                #[serde(default, skip_serializing_if = "Vec::is_empty")]
                #[schemars(length(max = 2))]
                pub ips: Vec<String>,
                /// `ClusterSetIP` or `Headless`.
                #[serde(rename = "type")]
                pub type_: ServiceImportType,
                /// `None` (default) or `ClientIP`.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub session_affinity: Option<String>,
                /// Session affinity settings.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub session_affinity_config: Option<SessionAffinityConfig>,
                /// IP families of `ips`, in order (`IPv4`, `IPv6`).
                #[serde(default, skip_serializing_if = "Vec::is_empty")]
                #[schemars(length(max = 2))]
                pub ip_families: Vec<String>,
                /// `Cluster` or `Local`, as for Services.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub internal_traffic_policy: Option<String>,
                /// e.g. `PreferClose`: prefer endpoints in the client's zone.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub traffic_distribution: Option<String>,
            }

            impl ServiceImport {
                /// The same object in the storage version's type (the schemas are identical),
                /// so the agent reads whichever version a cluster serves.
                pub fn to_v1beta1(&self) -> super::v1beta1::ServiceImport {
                    let s = &self.spec;
                    super::v1beta1::ServiceImport {
                        metadata: self.metadata.clone(),
                        spec: super::v1beta1::ServiceImportSpec {
                            ports: s.ports.clone(),
                            ips: s.ips.clone(),
                            type_: s.type_,
                            session_affinity: s.session_affinity.clone(),
                            session_affinity_config: s.session_affinity_config.clone(),
                            ip_families: s.ip_families.clone(),
                            internal_traffic_policy: s.internal_traffic_policy.clone(),
                            traffic_distribution: s.traffic_distribution.clone(),
                        },
                        status: self.status.clone(),
                    }
                }
            }

            /// Spec of a ServiceExport.
            #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema, CustomResource)]
            #[kube(
                group = "multicluster.x-k8s.io",
                version = $name,
                kind = "ServiceExport",
                namespaced,
                status = "ServiceExportStatus",
                category = "multicluster",
                shortname = "svcex",
                shortname = "svcexport",
                printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
            )]
            #[serde(rename_all = "camelCase")]
            pub struct ServiceExportSpec {
                /// Labels to put on the derived ServiceImport. Each must be a valid label
                /// (the schema checks values and key formats, at most 256 entries; the
                /// controller refuses the export, `Valid=False`, past 64 KiB in all).
                #[serde(default, skip_serializing_if = "Option::is_none")]
                #[schemars(schema_with = "exported_labels_schema")]
                pub exported_labels: Option<BTreeMap<String, String>>,
                /// Annotations to put on the derived ServiceImport. At most 256 KiB in all
                /// (the schema checks key formats and bounds each value, at most 256
                /// entries; the controller refuses the export, `Valid=False`, past the total).
                #[serde(default, skip_serializing_if = "Option::is_none")]
                #[schemars(schema_with = "exported_annotations_schema")]
                pub exported_annotations: Option<BTreeMap<String, String>>,
            }
        }
    };
}
mcs_version!(v1alpha1, "v1alpha1");
mcs_version!(v1beta1, "v1beta1");

/// The storage version, which is what the agent watches (the apiserver serves every object
/// in it, whatever version it was written in).
pub use v1beta1::{ServiceExport, ServiceExportSpec, ServiceImport, ServiceImportSpec};

/// Spec of a ClusterProperty.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema, CustomResource,
)]
#[kube(
    group = "about.k8s.io",
    version = "v1beta1",
    kind = "ClusterProperty",
    status = "ClusterPropertyStatus",
    category = "multicluster",
    printcolumn = r#"{"name":"value","type":"string","jsonPath":".spec.value"}"#,
    printcolumn = r#"{"name":"age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct ClusterPropertySpec {
    /// The property's value (for `cluster.clusterset.k8s.io`: the cluster id, a DNS label).
    #[schemars(length(min = 1, max = 128000))]
    pub value: String,
}

/// Status of a ClusterProperty (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ClusterPropertyStatus {}

/// The CRDs that `deploy/crds/` holds, in file order: `(file name, CRD)`.
///
/// Each multi-version CRD serves `v1alpha1` and `v1beta1` with `v1beta1` as storage.
/// ClusterProperty's `v1alpha1` is derived from the same schema.
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    let service_imports = kube::core::crd::merge_crds(
        vec![
            v1alpha1::ServiceImport::crd(),
            v1beta1::ServiceImport::crd(),
        ],
        "v1beta1",
    )
    .expect("ServiceImport versions merge");
    let mut service_exports = kube::core::crd::merge_crds(
        vec![
            v1alpha1::ServiceExport::crd(),
            v1beta1::ServiceExport::crd(),
        ],
        "v1beta1",
    )
    .expect("ServiceExport versions merge");
    // A ServiceExport may be metadata only, as the KEP and upstream write it: `spec` is not
    // required, and the API server fills in `{}` (so every reader finds one).
    for v in &mut service_exports.spec.versions {
        let Some(root) = v
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        if let Some(r) = root.required.as_mut() {
            r.retain(|f| f != "spec");
        }
        root.required.take_if(|r| r.is_empty());
        if let Some(spec) = root.properties.as_mut().and_then(|p| p.get_mut("spec")) {
            spec.default = Some(
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON(
                    serde_json::json!({}),
                ),
            );
        }
    }
    let mut cluster_properties = ClusterProperty::crd();
    let mut alpha = cluster_properties.spec.versions[0].clone();
    alpha.name = "v1alpha1".into();
    alpha.storage = false;
    cluster_properties.spec.versions.insert(0, alpha);
    // `*.k8s.io` groups are protected: the apiserver wants the KEP that approved the API.
    cluster_properties.metadata.annotations = Some(
        [(
            "api-approved.kubernetes.io".to_string(),
            ABOUT_API_APPROVAL.to_string(),
        )]
        .into(),
    );
    let mut out = vec![
        ("multicluster.x-k8s.io_serviceimports.yaml", service_imports),
        ("multicluster.x-k8s.io_serviceexports.yaml", service_exports),
        ("about.k8s.io_clusterproperties.yaml", cluster_properties),
    ];
    for (_, crd) in &mut out {
        crd.spec.versions.sort_by(|a, b| a.name.cmp(&b.name));
        let labels = crd.metadata.labels.get_or_insert_with(Default::default);
        for (k, v) in CRD_LABELS {
            labels.insert(k.into(), v.into());
        }
        if crd.spec.group == "multicluster.x-k8s.io" {
            for (k, v) in UPSTREAM_CRD_LABELS {
                labels.insert(k.into(), v.into());
            }
        }
    }
    out
}

/// The YAML text of a CRD as written to `deploy/crds/`.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> String {
    let body = serde_yaml::to_string(crd).expect("CRD serializes");
    format!("# Generated by `cargo run -p mcs-api --bin crdgen`; do not edit.\n{body}")
}

#[cfg(test)]
mod tests;
