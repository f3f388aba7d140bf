//! What the controller keeps of the objects it watches, and the names it keys them by:
//! shared by the watchers ([`crate::members`]) and the reconciler ([`crate::desired`]).

use std::collections::BTreeMap;

use k8s_openapi::{api::core::v1::Service, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::Resource;
use mcs_api::{ServiceExport, ServiceExportSpec, ServiceExportStatus};
use mcs_merge::{Port, ServiceKind, ServiceShape, meta::Refusal};
use serde::Deserialize;

use crate::held::HeldConditions;

/// (namespace, name).
pub type ObjKey = (String, String);

pub use mcs_api::labels::LABEL_K8S_SERVICE_NAME;

/// A ServiceExport as the watcher reads it: `spec` may be absent (upstream's CRD does not
/// require it, nor default it), so a metadata-only export never fails a list.
#[derive(Clone, Debug, Deserialize)]
pub struct WireExport {
    /// Metadata.
    pub metadata: ObjectMeta,
    /// Spec (`{}` when absent).
    #[serde(default)]
    pub spec: ServiceExportSpec,
    /// Status.
    #[serde(default)]
    pub status: Option<ServiceExportStatus>,
}

/// The ServiceExport version a member is read in: `v1beta1` unless it serves only
/// `v1alpha1` (upstream CRDs before v0.5; the same schema).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExportVersion(pub &'static str);

impl Default for ExportVersion {
    fn default() -> Self {
        Self("v1beta1")
    }
}

impl Resource for WireExport {
    type DynamicType = ExportVersion;
    type Scope = kube::core::DynamicResourceScope;

    fn kind(_: &ExportVersion) -> std::borrow::Cow<'_, str> {
        ServiceExport::kind(&())
    }
    fn group(_: &ExportVersion) -> std::borrow::Cow<'_, str> {
        ServiceExport::group(&())
    }
    fn version(v: &ExportVersion) -> std::borrow::Cow<'_, str> {
        v.0.into()
    }
    fn plural(_: &ExportVersion) -> std::borrow::Cow<'_, str> {
        ServiceExport::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What the controller keeps of a ServiceExport: what the merge and the export's conditions
/// read. Labels and annotations that cannot be carried are not kept, only why.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeanExport {
    /// creationTimestamp in seconds since the epoch (`i64::MAX` when absent).
    pub created: i64,
    /// It has a deletionTimestamp.
    pub deleting: bool,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// `metadata.uid`.
    pub uid: Option<String>,
    /// `status.conditions`: each one's transition time, and a fingerprint of the rest.
    pub conditions: HeldConditions,
    /// `spec.exportedLabels` (empty when refused).
    pub labels: BTreeMap<String, String>,
    /// `spec.exportedAnnotations` (empty when refused).
    pub annotations: BTreeMap<String, String>,
    /// Why its labels or annotations cannot be carried, if they cannot (the export is
    /// invalid).
    pub refused: Option<Refusal>,
    /// Why its labels and annotations were not kept (its member's budget for them is spent):
    /// the export is imported without them.
    pub metadata_dropped: Option<Refusal>,
}

impl LeanExport {
    /// What is kept of `se`: its labels and annotations are checked here, before they are
    /// stored ([`mcs_merge::meta`]).
    pub fn new(se: WireExport) -> Self {
        let labels = se.spec.exported_labels.unwrap_or_default();
        let annotations = se.spec.exported_annotations.unwrap_or_default();
        let refused = mcs_merge::meta::check_labels(&labels)
            .and_then(|()| mcs_merge::meta::check_annotations(&annotations))
            .err();
        let (labels, annotations) = if refused.is_some() {
            Default::default()
        } else {
            (labels, annotations)
        };
        Self {
            created: se
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(i64::MAX, |t| t.0.as_second()),
            deleting: se.metadata.deletion_timestamp.is_some(),
            generation: se.metadata.generation,
            uid: se.metadata.uid,
            conditions: HeldConditions::new(se.status.as_ref().map_or(&[][..], |s| &s.conditions)),
            labels,
            annotations,
            refused,
            metadata_dropped: None,
        }
    }
}

/// The parts of a Service the merge reads.
pub fn shape(svc: &Service) -> ServiceShape {
    let spec = svc.spec.clone().unwrap_or_default();
    ServiceShape {
        kind: Some(match spec.type_.as_deref() {
            Some("NodePort") => ServiceKind::NodePort,
            Some("LoadBalancer") => ServiceKind::LoadBalancer,
            Some("ExternalName") => ServiceKind::ExternalName,
            _ => ServiceKind::ClusterIp,
        }),
        headless: spec.cluster_ip.as_deref() == Some("None"),
        ports: spec
            .ports
            .unwrap_or_default()
            .into_iter()
            .map(|p| Port {
                name: p.name.unwrap_or_default(),
                protocol: p.protocol.unwrap_or_else(|| "TCP".into()),
                port: p.port,
                app_protocol: p.app_protocol,
            })
            .collect(),
        session_affinity: spec.session_affinity,
        session_affinity_timeout: spec
            .session_affinity_config
            .map(|c| c.client_ip.and_then(|c| c.timeout_seconds)),
        internal_traffic_policy: spec.internal_traffic_policy,
        traffic_distribution: spec.traffic_distribution,
        ip_families: spec.ip_families.unwrap_or_default(),
        selector: spec.selector.is_some_and(|s| !s.is_empty()),
    }
}
