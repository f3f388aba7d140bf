//! The forwarding table: what every dataplane programs, and the minimal diff between two
//! tables, which is the contract between the control plane and the dataplanes.
//!
//! # Data flow
//!
//! ```text
//! Kubernetes objects ──index──▶ ForwardingTable ──diff(old, new)──▶ TableDiff ──▶ Dataplane
//! ```
//!
//! Invariant (property-tested): `old.apply(&diff(&old, &new)) == new`, so applying diffs to a
//! dataplane yields the same state as programming the full table from scratch.
//!
//! This crate depends on neither kube, aya nor tokio, so it is unit- and property-tested fast.
//!
//! # Layout
//!
//! - [`guard`]: what a node allows at all (ClusterSetIP ranges, protected addresses, trusted
//!   slice managers, caps).
//! - [`input`]: the fields of ServiceImports and EndpointSlices the table depends on.
//! - [`validate`]: rejects or trims invalid input, each time with a [`validate::Rejection`].
//! - [`intern`]: shared cluster, zone and node names.
//! - [`node`]: what the index knows of its node ([`NodeConfig`]).
//! - [`index`]: the incremental index (objects → table, minimal diffs); [`index::compute`].
//! - [`select`]: which backends get new connections (readiness, locality, zone).
//! - [`health`]: passive health: a backend whose connects fail is skipped on this node for a
//!   while (backoff that only a success resets), and which candidate a connection tries.
//! - [`render`]: `mcs-agent table` output (JSON and text).
//! - [`dns`]: the records `clusterset.local` DNS answers from, and the zone that holds them.
//! - [`status`]: the agent's `/status` answer as types (written by the agent, read by
//!   `kubectl mcs`).
//! - [`Dataplane`]: what the control plane hands diffs to.
#![forbid(unsafe_code)]

pub mod dns;
pub mod guard;
pub mod health;
pub mod index;
pub mod input;
pub mod intern;
pub mod node;
pub mod render;
pub mod select;
pub mod status;
pub mod validate;

pub use guard::{Guard, IpCidr, Limits};
pub use index::{Index, compute};
pub use node::NodeConfig;
pub use validate::{Reason, Rejection};

use std::{collections::BTreeMap, fmt, net::IpAddr, sync::Arc};

use serde::{Deserialize, Serialize};

/// Transport protocol of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// A frontend: one ClusterSetIP × one port of a ServiceImport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Frontend {
    /// The ClusterSetIP.
    pub vip: IpAddr,
    /// The service port.
    pub port: u16,
    /// The protocol.
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.vip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}/{}", self.port, self.protocol),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}/{}", self.port, self.protocol),
        }
    }
}

/// A backend of a frontend: an endpoint address with the target port, and where it lives.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Backend {
    /// Endpoint address (same family as the frontend's VIP).
    pub address: IpAddr,
    /// Target port (from the EndpointSlice port matching the import port's name).
    pub port: u16,
    /// Source cluster id (shared by every backend of that cluster's slice).
    pub cluster: Arc<str>,
    /// Zone, if the slice says (shared likewise).
    #[serde(default)]
    pub zone: Option<Arc<str>>,
    /// `conditions.ready`.
    #[serde(default)]
    pub ready: bool,
    /// `conditions.serving`.
    #[serde(default)]
    pub serving: bool,
    /// `conditions.terminating`.
    #[serde(default)]
    pub terminating: bool,
    /// Whether the selection policy sends new connections here.
    #[serde(default)]
    pub selected: bool,
    /// Usable but not selected (another cluster's or zone's): a dataplane that can retry
    /// tries these when every selected backend refuses ([`select`]).
    #[serde(default)]
    pub fallback: bool,
}

/// ClientIP session affinity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Affinity {
    /// Timeout in seconds.
    pub timeout_seconds: u32,
}

/// What a frontend forwards to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Service {
    /// `namespace/name` of the ServiceImport.
    pub service: String,
    /// ClientIP affinity, if asked.
    pub affinity: Option<Affinity>,
    /// Backends sorted by (cluster, address, port).
    pub backends: Vec<Backend>,
}

impl Service {
    /// The backends the selection policy sends new connections to.
    pub fn selected(&self) -> impl Iterator<Item = &Backend> {
        self.backends.iter().filter(|b| b.selected)
    }

    /// The backends to try when every selected one refuses.
    pub fn fallback(&self) -> impl Iterator<Item = &Backend> {
        self.backends.iter().filter(|b| b.fallback)
    }
}

/// The whole forwarding table of a node. Each frontend's [`Service`] is shared (`Arc`) between
/// the index, the table, its diffs and the dataplanes that keep a copy: one allocation per
/// frontend, however many hold it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardingTable {
    /// Frontends in (vip, port, protocol) order.
    pub frontends: BTreeMap<Frontend, Arc<Service>>,
}

/// The minimal change from one table to another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableDiff {
    /// Frontends that are new or whose service changed, with their new value.
    pub upsert: BTreeMap<Frontend, Arc<Service>>,
    /// Frontends that are gone.
    pub remove: Vec<Frontend>,
}

impl TableDiff {
    /// No change.
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.remove.is_empty()
    }
}

/// The minimal diff that turns `old` into `new`: unchanged frontends are not mentioned.
pub fn diff(old: &ForwardingTable, new: &ForwardingTable) -> TableDiff {
    let upsert = new
        .frontends
        .iter()
        .filter(|(f, s)| old.frontends.get(f) != Some(s))
        .map(|(f, s)| (*f, s.clone()))
        .collect();
    let remove = old
        .frontends
        .keys()
        .filter(|f| !new.frontends.contains_key(f))
        .copied()
        .collect();
    TableDiff { upsert, remove }
}

impl ForwardingTable {
    /// Applies a diff in place.
    pub fn apply(&mut self, diff: &TableDiff) {
        for f in &diff.remove {
            self.frontends.remove(f);
        }
        for (f, s) in &diff.upsert {
            self.frontends.insert(*f, s.clone());
        }
    }
}

/// A dataplane: takes the controller's diffs. Applying a sequence of diffs must leave it in
/// the state that programming the final table from scratch would.
pub trait Dataplane {
    /// Short name for logs and metrics (`ebpf`, `userspace`, `log`).
    fn name(&self) -> &'static str;
    /// Applies a diff. On error the dataplane keeps what it had; the caller retries with the
    /// full table.
    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError>;
    /// Frontends of the applied table this dataplane could not program, each rejected alone
    /// (reason `unprogrammable`) while the rest is programmed. `Ok` from [`Dataplane::apply`]
    /// means everything else is programmed.
    fn unprogrammed(&self) -> Vec<validate::Rejection> {
        Vec::new()
    }
    /// Whether a frontend of the applied table is programmed: false exactly for the ones
    /// [`Dataplane::unprogrammed`] lists.
    fn programmed(&self, _frontend: &Frontend) -> bool {
        true
    }
    /// A number that changes whenever [`Dataplane::unprogrammed`] would answer differently,
    /// so a caller need not build that list after every diff to see whether it changed
    /// (it holds every frontend that did not fit: at scale, tens of thousands). `None`, the
    /// default, when the dataplane does not keep one: the caller then compares the lists.
    fn unprogrammed_version(&self) -> Option<u64> {
        None
    }
    /// What this dataplane holds now, for a person (the agent's `/status`): a few named
    /// figures, e.g. frontends programmed, listeners and open connections.
    fn report(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
    /// Backends of `frontend` this dataplane skips now after failed connects
    /// ([`health`]), at most `limit` of them. None by default (a dataplane without passive
    /// health).
    fn skipped(&self, _frontend: &Frontend, _limit: usize) -> Vec<health::SkippedBackend> {
        Vec::new()
    }
}

/// A dataplane could not apply a diff.
#[derive(Debug)]
pub struct DataplaneError {
    /// What failed, for a person.
    pub message: String,
}

impl fmt::Display for DataplaneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DataplaneError {}

impl ForwardingTable {
    /// The diff that programs this whole table onto an empty dataplane.
    pub fn as_diff(&self) -> TableDiff {
        TableDiff {
            upsert: self.frontends.clone(),
            remove: Vec::new(),
        }
    }
}

#[cfg(test)]
mod index_tests;
#[cfg(test)]
mod safety_tests;
#[cfg(test)]
mod tests;
