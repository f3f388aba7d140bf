//! What the agent's `/status` says about its node: the sync loop answers [`StatusRequest`]s
//! between batches (so the view is one consistent table, and nothing is copied per flush),
//! with the whole picture in counts, the rejections, and, when asked for one service, its
//! frontends with their backends as programmed. The answer's types are
//! [`mcs_model::status`]'s, which `kubectl mcs` reads.

use std::sync::Arc;

use mcs_model::{
    Dataplane, Index, Rejection,
    status::{FrontendStatus, NodeStatus, RejectionStatus, ServiceStatus},
};
use tokio::sync::oneshot;

/// Rejections listed in one answer (the count is always whole).
pub const REJECTIONS_LISTED: usize = 100;

/// Backends listed in one answer, over all of the asked service's frontends (each frontend's
/// counts are always whole): an answer stays under ~300 KB however large the service.
pub const BACKENDS_LISTED: usize = 1_000;

/// The most skipped backends `/status` lists per frontend (a service has at most 100 ports
/// × 2 families × 2 protocols of frontends: the answer stays bounded).
pub const SKIPPED_LISTED: usize = 16;

/// A question to the sync loop.
#[derive(Debug)]
pub struct StatusRequest {
    /// One service (`namespace`, `name`), or none for the node's summary.
    pub service: Option<(String, String)>,
    /// Where the answer goes.
    pub reply: oneshot::Sender<NodeStatus>,
}

/// Builds the answer from the sync loop's state.
pub(crate) fn build<D: Dataplane>(
    index: &Index,
    dataplane: &D,
    ready: bool,
    rejected: &std::collections::BTreeSet<Rejection>,
    service: Option<(String, String)>,
) -> NodeStatus {
    let node = index.node();
    let table = index.table();
    let (imports, slices) = index.object_counts();
    let listed: Vec<RejectionStatus> = match &service {
        Some((ns, name)) => rejected
            .iter()
            .filter(|r| concerns(&r.object, ns, name))
            .take(REJECTIONS_LISTED)
            .map(RejectionStatus::from)
            .collect(),
        None => rejected
            .iter()
            .take(REJECTIONS_LISTED)
            .map(RejectionStatus::from)
            .collect(),
    };
    let service = service.map(|(namespace, name)| {
        let key = format!("{namespace}/{name}");
        let mut room = BACKENDS_LISTED;
        let mut truncated = false;
        let frontends = table
            .frontends
            .iter()
            .filter(|(_, s)| s.service == key)
            .map(|(f, s): (_, &Arc<mcs_model::Service>)| {
                let listed = s.backends.len().min(room);
                room -= listed;
                truncated |= listed < s.backends.len();
                FrontendStatus {
                    frontend: f.to_string(),
                    programmed: dataplane.programmed(f),
                    affinity_timeout_seconds: s.affinity.map(|a| a.timeout_seconds),
                    backends: s.backends[..listed].to_vec(),
                    backends_total: s.backends.len(),
                    selected: s.backends.iter().filter(|b| b.selected).count(),
                    fallback: s.backends.iter().filter(|b| b.fallback).count(),
                    skipped: dataplane.skipped(f, SKIPPED_LISTED),
                }
            })
            .collect();
        ServiceStatus {
            namespace,
            name,
            frontends,
            truncated,
        }
    });
    NodeStatus {
        node: node.node_name.clone().unwrap_or_default(),
        cluster_id: node.cluster_id.clone(),
        dataplane: dataplane.name().to_string(),
        ready,
        service_imports: imports,
        endpoint_slices: slices,
        frontends: table.frontends.len(),
        backends: index.table_backends(),
        rejected_total: rejected.len(),
        rejected: listed,
        dataplane_report: dataplane
            .report()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        service,
    }
}

/// Whether a rejected object (`Kind ns/name`) is the service's: its ServiceImport, or an
/// EndpointSlice of it (MCS slices are named after the service: `name-…`).
fn concerns(object: &str, ns: &str, name: &str) -> bool {
    let Some((kind, rest)) = object.split_once(' ') else {
        return false;
    };
    let Some((ons, oname)) = rest.split_once('/') else {
        return false;
    };
    ons == ns
        && match kind {
            "ServiceImport" => oname == name,
            "EndpointSlice" => oname.strip_prefix(name).is_some_and(|r| r.starts_with('-')),
            _ => false,
        }
}

#[cfg(test)]
mod tests {
    use super::concerns;

    #[test]
    fn a_rejection_concerns_its_import_and_its_slices_only() {
        assert!(concerns("ServiceImport shop/web", "shop", "web"));
        assert!(concerns("EndpointSlice shop/web-c2-x7k2p", "shop", "web"));
        assert!(!concerns(
            "EndpointSlice shop/webber-c2-x7k2p",
            "shop",
            "web"
        ));
        assert!(!concerns("ServiceImport shop/webber", "shop", "web"));
        assert!(!concerns("ServiceImport other/web", "shop", "web"));
        assert!(!concerns("garbage", "shop", "web"));
    }
}
