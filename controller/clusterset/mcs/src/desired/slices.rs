//! The MCS EndpointSlices the local cluster should hold: one per member slice of an exported
//! Service ([`WantSlice`]), made into an object only when compared or written, so the desired
//! state holds no copy of any endpoint.

use std::{collections::BTreeMap, sync::Arc};

use k8s_openapi::{
    api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use mcs_api::{
    DEFAULT_SLICE_CONTROLLER, LABEL_MANAGED_BY, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER,
    LABEL_SOURCE_MANAGED_BY,
};
use mcs_merge::ServiceKey;

use crate::MANAGER;

/// Who manages a member's slice (`endpointslice.kubernetes.io/managed-by`; `none` without
/// one). Only `DEFAULT_SLICE_CONTROLLER` computes endpoints from a selector; a value that is
/// not a valid label value (it came from a label, so it is) would be `none` too.
pub(super) fn source_manager(es: &EndpointSlice) -> &str {
    es.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_MANAGED_BY))
        .map(String::as_str)
        .filter(|m| !m.is_empty() && m.len() <= 63)
        .unwrap_or("none")
}

/// What the MCS copy of a slice that no selector computed says in `LABEL_SOURCE_MANAGED_BY`:
/// its manager, but never `DEFAULT_SLICE_CONTROLLER` (a slice of a selectorless Service that
/// claims it was written by someone else), so agents can always tell.
fn selectorless_source(es: &EndpointSlice) -> &str {
    match source_manager(es) {
        DEFAULT_SLICE_CONTROLLER => "none",
        m => m,
    }
}

/// An MCS EndpointSlice wanted: the member's slice it copies (shared with that member's
/// store, not copied) and what is taken of it. The object is made when it is compared or
/// written ([`WantSlice::object`]): the desired state holds no copy of any endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct WantSlice {
    /// Its name.
    pub name: String,
    /// The service's namespace.
    namespace: String,
    /// The service's name.
    service: String,
    /// The exporting cluster.
    cluster: String,
    /// That cluster's slice.
    source: Arc<EndpointSlice>,
    /// The names of the ports the import has for that cluster.
    served: Arc<[String]>,
    /// Kubernetes' EndpointSlice controller computed `source` from the Service's selector.
    computed: bool,
}

impl WantSlice {
    /// The MCS slice for `es` of cluster `cluster`: its endpoints, and the ports the import
    /// has for that cluster (`served`: a port this cluster defines differently from the
    /// import is left out, so the conflicting definition gets no traffic); `computed`:
    /// Kubernetes' EndpointSlice controller computed `es` from the Service's selector. `None`
    /// when no port is left.
    pub(super) fn new(
        key: &ServiceKey,
        cluster: &str,
        es: &Arc<EndpointSlice>,
        served: &Arc<[String]>,
        computed: bool,
    ) -> Option<Self> {
        let src_ports = es.ports.as_deref().unwrap_or_default();
        if !src_ports.is_empty() && !src_ports.iter().any(|p| serves(served, p)) {
            return None;
        }
        let src = es.metadata.name.as_deref().unwrap_or_default();
        let hash = mcs_merge::alloc::fnv1a(format!("{cluster}/{src}").as_bytes());
        Some(Self {
            name: format!(
                "{}-{}-{hash:08x}",
                trim(&key.name, 40),
                trim(cluster, 40),
                hash = hash as u32
            ),
            namespace: key.namespace.clone(),
            service: key.name.clone(),
            cluster: cluster.to_string(),
            source: es.clone(),
            served: served.clone(),
            computed,
        })
    }

    /// The EndpointSlice to write.
    pub fn object(&self) -> EndpointSlice {
        let es = &self.source;
        let ports: Vec<EndpointPort> = es
            .ports
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter(|p| serves(&self.served, p))
            .cloned()
            .collect();
        let labels = BTreeMap::from([
            (LABEL_SERVICE_NAME.to_string(), self.service.clone()),
            (LABEL_SOURCE_CLUSTER.to_string(), self.cluster.clone()),
            (LABEL_MANAGED_BY.to_string(), MANAGER.to_string()),
            (
                LABEL_SOURCE_MANAGED_BY.to_string(),
                if self.computed {
                    DEFAULT_SLICE_CONTROLLER
                } else {
                    selectorless_source(es)
                }
                .to_string(),
            ),
        ]);
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels),
                ..Default::default()
            },
            address_type: es.address_type.clone(),
            endpoints: es.endpoints.as_ref().map(|eps| {
                eps.iter()
                    .map(|e| Endpoint {
                        addresses: e.addresses.clone(),
                        conditions: e.conditions.clone(),
                        hostname: e.hostname.clone(),
                        node_name: e.node_name.clone(),
                        zone: e.zone.clone(),
                        hints: e.hints.clone(),
                        ..Default::default()
                    })
                    .collect()
            }),
            // None for none: the API server returns an empty list as null, and a slice held
            // with null would never compare equal to one wanted with `[]` (written again at
            // every pass of its service).
            ports: (!ports.is_empty()).then_some(ports),
        }
    }
}

/// Whether `p` is one of the `served` ports (by name; unnamed is `""`).
fn serves(served: &[String], p: &EndpointPort) -> bool {
    let name = p.name.as_deref().unwrap_or_default();
    served.iter().any(|s| s == name)
}

/// At most `n` bytes of a DNS label or subdomain as part of one DNS label: dots become
/// dashes (a cluster id may hold dots; cut at one, it would end the name's label with a dot),
/// no trailing dash.
fn trim(s: &str, n: usize) -> String {
    let mut end = s.len().min(n);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].replace('.', "-").trim_end_matches('-').to_string()
}
