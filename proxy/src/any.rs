//! One of the dataplanes, chosen at start (`mcs-agent run --dataplane`): what the agent's sync
//! loop hands its diffs to.

use mcs_model::{Dataplane, DataplaneError, Frontend, Rejection, TableDiff};

use crate::{ebpf::SocketLb, log::LogDataplane, userspace::Userspace};

/// The dataplane an agent runs.
#[derive(Debug)]
pub enum AnyDataplane {
    /// Programs nothing, logs what it would.
    Log(LogDataplane),
    /// The userspace forwarder.
    Userspace(Userspace),
    /// The eBPF socket load balancer.
    Ebpf(Box<SocketLb>),
}

impl Dataplane for AnyDataplane {
    fn name(&self) -> &'static str {
        match self {
            Self::Log(d) => d.name(),
            Self::Userspace(d) => d.name(),
            Self::Ebpf(d) => d.name(),
        }
    }

    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError> {
        match self {
            Self::Log(d) => d.apply(diff),
            // The forwarder updates its nftables interception set with blocking calls.
            Self::Userspace(d) => tokio::task::block_in_place(|| d.apply(diff)),
            Self::Ebpf(d) => d.apply(diff),
        }
    }

    fn unprogrammed(&self) -> Vec<Rejection> {
        match self {
            Self::Log(d) => d.unprogrammed(),
            Self::Userspace(d) => d.unprogrammed(),
            Self::Ebpf(d) => d.unprogrammed(),
        }
    }

    fn programmed(&self, frontend: &Frontend) -> bool {
        match self {
            Self::Log(d) => d.programmed(frontend),
            Self::Userspace(d) => d.programmed(frontend),
            Self::Ebpf(d) => d.programmed(frontend),
        }
    }

    fn skipped(&self, frontend: &Frontend, limit: usize) -> Vec<mcs_model::health::SkippedBackend> {
        match self {
            Self::Log(d) => d.skipped(frontend, limit),
            Self::Userspace(d) => d.skipped(frontend, limit),
            Self::Ebpf(d) => d.skipped(frontend, limit),
        }
    }

    fn report(&self) -> Vec<(&'static str, String)> {
        match self {
            Self::Log(d) => d.report(),
            Self::Userspace(d) => d.report(),
            Self::Ebpf(d) => d.report(),
        }
    }

    fn unprogrammed_version(&self) -> Option<u64> {
        match self {
            Self::Log(d) => d.unprogrammed_version(),
            Self::Userspace(d) => d.unprogrammed_version(),
            Self::Ebpf(d) => d.unprogrammed_version(),
        }
    }
}
