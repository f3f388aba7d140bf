//! The selection policy: which backends of a frontend get new connections.
//!
//! 1. Readiness, over all clusters: `ready` endpoints; only when none is ready anywhere,
//!    endpoints that are `serving` and `terminating` (as kube-proxy does); others never.
//! 2. Locality: endpoints of the local cluster when it has a usable one; else every cluster.
//! 3. Zone: with `trafficDistribution: PreferClose`, endpoints in the node's zone when there is
//!    one among those left; else all of them.
//! 4. Fallback: the usable endpoints that 2 and 3 left out (other clusters', other zones')
//!    are marked `fallback`: a dataplane that sees a refusal (the userspace forwarder) tries
//!    them when every selected endpoint refuses, rather than resetting the client while the
//!    local cluster's EndpointSlices still say ready. None with `internalTrafficPolicy:
//!    Local` (traffic stays on the node, as kube-proxy keeps it).

use std::{collections::BTreeSet, net::IpAddr};

use crate::{Backend, node::NodeConfig};

/// Sets `selected` on every backend by the policy above. With `node_local`
/// (`internalTrafficPolicy: Local`), only the usable backends in that set (address, port) of
/// endpoints on this node are selected, and none elsewhere, as kube-proxy does.
pub fn mark_selected(
    backends: &mut [Backend],
    node: &NodeConfig,
    prefer_close: bool,
    node_local: Option<&BTreeSet<(IpAddr, u16)>>,
) {
    let any_ready = backends.iter().any(|b| b.ready);
    let usable = |b: &Backend| {
        if any_ready {
            b.ready
        } else {
            b.serving && b.terminating
        }
    };
    let local = node.cluster_id.as_str();
    let any_local = !local.is_empty() && backends.iter().any(|b| usable(b) && &*b.cluster == local);
    let in_scope = |b: &Backend| usable(b) && (!any_local || &*b.cluster == local);
    let zone = node.zone.as_deref();
    let zone_pref = prefer_close
        && zone.is_some()
        && backends
            .iter()
            .any(|b| in_scope(b) && b.zone.as_deref() == zone);
    if let Some(on_node) = node_local {
        for b in backends.iter_mut() {
            b.selected = usable(b) && on_node.contains(&(b.address, b.port));
            b.fallback = false;
        }
        return;
    }
    for b in backends.iter_mut() {
        b.selected = in_scope(b) && (!zone_pref || b.zone.as_deref() == zone);
        b.fallback = usable(b) && !b.selected;
    }
}
