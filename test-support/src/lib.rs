//! Real parts for the integration tests of mcs-dataplane (a dev-dependency only).
//!
//! # Layout
//!
//! - [`prereq`]: what a test needs (root, binaries, kernel features). On a laptop a missing
//!   prerequisite skips the test with a printed reason; with `CI=true` it fails the test.
//! - [`apiserver`]: a real etcd + kube-apiserver on loopback, started once per test binary
//!   ([`apiserver::shared`]) or per test ([`apiserver::ApiServer::start`]), with an admin
//!   kubeconfig, non-admin test identities, the project's CRDs applied, a fresh namespace per
//!   test, and teardown when the test process exits, also on panic or kill.
//! - [`node`]: a node stand-in (a Node object; pods bound to it and reported Running with an
//!   address) for clusters with kube-controller-manager but no kubelet.
//! - [`netns`], [`cgroup`]: re-exported from `mcs-sandbox` (namespaces, veth pairs, addresses
//!   from 198.18.0.0/15 and 2001:2::/48 only, cgroups; removed on drop).
//! - [`probe`]: a client that runs as a child process (inside a netns and a cgroup) and
//!   reports what the kernel did with its connect().
//! - [`socket_lb`]: the eBPF socket LB's fixture (pins, cgroup, namespace, echo backends).
//! - [`ports`]: loopback ports for the servers a test starts, never in the kernel's ephemeral
//!   range (where any outgoing connection could take them before the server binds).
//! - [`kubectl`]: commands with standard input, and `kubectl` against a test API server.
//!
//! Every resource a helper creates carries the test process id in its name
//! (`mcst<pid>-...`); [`sweep_stale`] removes those left by a test process that was killed.
#![forbid(unsafe_code)]

pub mod apiserver;
pub mod kubectl;
pub mod node;
pub mod ports;
pub mod prereq;
pub mod probe;
pub mod socket_lb;
mod supervise;

pub(crate) use mcs_sandbox::pid_alive;
pub use mcs_sandbox::{cgroup, netns, resource_prefix, sweep_stale, topology, unique_name};
pub use prereq::{in_ci, require};

/// The ClusterSetIP ranges of the tests' objects (`--clusterset-ip-cidr`, as
/// `MCS_CLUSTERSET_IP_CIDR`): VIPs live in 198.18.0.0/24, 198.18.100.0/24, 2001:2::/112 and
/// 2001:2::100:0/112; backends and hosts outside them.
pub const CLUSTERSET_CIDRS: &str = "198.18.0.0/24,198.18.100.0/24,2001:2::/112,2001:2::100:0/112";
