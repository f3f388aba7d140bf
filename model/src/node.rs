//! What the index knows of the node it runs for.

use crate::guard::Guard;

/// Node-level settings of the index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// This cluster's id (local endpoints are preferred). Empty: no preference.
    pub cluster_id: String,
    /// This node's zone (for `trafficDistribution: PreferClose`).
    pub zone: Option<String>,
    /// This node's name (for `internalTrafficPolicy: Local`).
    pub node_name: Option<String>,
    /// What may be programmed at all.
    pub guard: Guard,
}
