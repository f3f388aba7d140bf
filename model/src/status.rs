//! The agent's `/status` answer as types: the agent writes them, `kubectl mcs` reads them,
//! so a field renamed on one side fails to compile on the other instead of printing "?".
//! The sync loop fills [`NodeStatus`] (`mcs_sync::status`); the agent adds its version, heap
//! and DNS answers ([`AgentStatus`]).
//!
//! Readers take answers of older and newer agents alike: a field an older agent does not
//! write takes its default (`#[serde(default)]`), one a newer agent adds is ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Backend, Rejection, health::SkippedBackend};

/// The whole `/status` answer of an agent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentStatus {
    /// The agent's version.
    pub version: String,
    /// The node as the sync loop sees it (all zero when it did not answer: see `error`).
    #[serde(flatten)]
    pub node: NodeStatus,
    /// Set when the sync loop did not answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The allocator's view of the process's memory.
    pub heap: Option<HeapInfo>,
    /// What the agent's DNS listener answers (absent: the agent serves no DNS).
    pub dns: Option<DnsStatus>,
}

/// The node as the sync loop sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeStatus {
    /// This node (`--node-name`).
    pub node: String,
    /// This cluster's id, as the agent uses it (empty: not known yet).
    pub cluster_id: String,
    /// `ebpf`, `userspace` or `log`.
    pub dataplane: String,
    /// The first full table is programmed (`/readyz`).
    pub ready: bool,
    /// ServiceImports the agent holds.
    pub service_imports: usize,
    /// MCS EndpointSlices the agent holds.
    pub endpoint_slices: usize,
    /// Frontends (ClusterSetIP × port) in the table.
    pub frontends: usize,
    /// Backends over every frontend.
    pub backends: usize,
    /// Every object rejected now (by the guard, validation, or the dataplane).
    pub rejected_total: usize,
    /// The rejections: the asked service's, or the first ones.
    pub rejected: Vec<RejectionStatus>,
    /// The dataplane's own figures (`Dataplane::report`), by name.
    pub dataplane_report: BTreeMap<String, String>,
    /// The asked service, when one was.
    pub service: Option<ServiceStatus>,
}

/// One rejection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RejectionStatus {
    /// `Kind namespace/name`.
    pub object: String,
    /// The reason's metric label.
    pub reason: String,
    /// What exactly.
    pub message: String,
}

impl From<&Rejection> for RejectionStatus {
    fn from(r: &Rejection) -> Self {
        Self {
            object: r.object.clone(),
            reason: r.reason.label().to_string(),
            message: r.message.clone(),
        }
    }
}

/// One service on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServiceStatus {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Its frontends in the table (none: not imported here, or rejected: see `rejected`).
    pub frontends: Vec<FrontendStatus>,
    /// Some backends are not listed (each frontend's `backends_total`, `selected` and
    /// `fallback` count them all).
    pub truncated: bool,
}

/// One frontend as programmed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FrontendStatus {
    /// `vip:port/PROTO`.
    pub frontend: String,
    /// The dataplane programmed it (false: see the `unprogrammable` rejection).
    pub programmed: bool,
    /// ClientIP affinity timeout, when asked.
    pub affinity_timeout_seconds: Option<u32>,
    /// Its backends, with whether new connections go to it (`selected`) or it is tried
    /// when every selected one fails (`fallback`): all of them unless the service's answer
    /// is `truncated`.
    pub backends: Vec<Backend>,
    /// Backends in all.
    pub backends_total: usize,
    /// Selected backends in all.
    pub selected: usize,
    /// Fallback backends in all.
    pub fallback: usize,
    /// Backends this node's dataplane skips now after failed connects (passive health; the
    /// eBPF socket LB: some client pod of the node skips them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedBackend>,
}

/// The allocator's view of the agent's memory, and the kernel's side of the heap.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HeapInfo {
    /// Committed by the allocator now.
    pub committed_bytes: usize,
    /// The most it ever had committed.
    pub peak_committed_bytes: usize,
    /// The process's resident set as the allocator reads it.
    pub rss_bytes: usize,
    /// Whether the process is kept off transparent huge pages (`PR_GET_THP_DISABLE`).
    pub thp_disabled: bool,
    /// Anonymous memory the kernel backs with huge pages now (`AnonHugePages` of
    /// `/proc/self/smaps_rollup`; absent where that file is not readable).
    pub anon_huge_pages_bytes: Option<u64>,
}

/// What the agent's DNS listener answers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DnsStatus {
    /// The addresses it listens on.
    pub listen: Vec<String>,
    /// The one asked.
    pub asked: String,
    /// Each question and its answer.
    pub checks: Vec<DnsCheck>,
}

/// One question to the agent's DNS listener and its answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DnsCheck {
    /// The name asked.
    pub name: String,
    /// `A`, `AAAA`, `TXT`, ...
    pub qtype: String,
    /// The response code (`NoError`, `NXDomain`, ...), absent when no answer came.
    pub rcode: Option<String>,
    /// The answers' data as text.
    pub answers: Vec<String>,
    /// Why no answer came.
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_reads_back_as_written_and_an_older_agents_answer_reads() {
        let st = AgentStatus {
            version: "1.2.3".into(),
            node: NodeStatus {
                node: "n1".into(),
                dataplane: "ebpf".into(),
                ready: true,
                frontends: 2,
                ..Default::default()
            },
            heap: Some(HeapInfo::default()),
            ..Default::default()
        };
        let text = serde_json::to_string(&st).unwrap();
        assert!(text.contains("\"dataplane\":\"ebpf\""), "flattened: {text}");
        let back: AgentStatus = serde_json::from_str(&text).unwrap();
        assert_eq!(back, st);
        // An older agent: no heap, no dns, no rejected list.
        let old: AgentStatus = serde_json::from_str(
            r#"{"version":"0.9","node":"n1","dataplane":"userspace","ready":true}"#,
        )
        .unwrap();
        let node = &old.node;
        assert_eq!((node.dataplane.as_str(), node.ready), ("userspace", true));
        assert!(node.rejected.is_empty() && old.heap.is_none() && old.dns.is_none());
        // A field of the wrong type is an error, not a silently empty table.
        assert!(serde_json::from_str::<AgentStatus>(r#"{"ready":"yes"}"#).is_err());
    }
}
