//! The MCS controller of mcs-dataplane (`mcs-controller`): every cluster of the ClusterSet
//! runs one. It **reads** ServiceExports, and the exported Services and their EndpointSlices,
//! in every member cluster and **writes only into its own**: a ServiceImport per exported service whose
//! namespace exists there (ClusterSetIPs allocated from `--clusterset-ip-cidr`), one MCS
//! EndpointSlice per source slice of every exporting cluster, and the conditions of its own
//! cluster's ServiceExports. Pull, not push: no cluster holds credentials to write into
//! another. Every cluster computes the same merge (`mcs-merge`).
//!
//! # Layout
//!
//! - [`objects`]: what is kept of each watched object, and the keys.
//! - [`store`]: a watched copy of one kind, indexed by service, and what changed.
//! - [`selection`]: which of a member's Services and slices are read (only the exported).
//! - [`members`]: each member's watchers and stores, and whether it answers.
//! - [`held`]: what is kept of the objects it wrote (fingerprints of what the writer
//!   compares).
//! - [`desired`]: snapshot → the local cluster's desired imports, slices, conditions.
//! - [`writer`]: writes the difference (server-side apply).
//! - [`lease`]: one leader per cluster.
//! - [`passes`]: the loop, built then run: wake on any change (or every resync), snapshot,
//!   compute, write; [`run`] starts it.
#![forbid(unsafe_code)]

pub mod budget;
pub mod desired;
pub mod held;
pub mod lease;
pub mod members;
pub mod objects;
mod passes;
pub mod selection;
pub mod store;
pub mod writer;

use std::{
    sync::atomic::{AtomicI64, AtomicU64},
    time::Duration,
};

use kube::Client;
use mcs_model::guard::IpCidr;
use mcs_runtime::http::Health;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// `endpointslice.kubernetes.io/managed-by` of our slices, and the value of
/// [`MANAGED_LABEL`] on our imports.
pub const MANAGER: &str = "mcs-controller.mcs-dataplane";
/// The label that marks the ServiceImports we manage.
pub const MANAGED_LABEL: &str = mcs_api::labels::LABEL_APP_MANAGED_BY;

/// How the controller runs.
#[derive(Clone)]
pub struct Config {
    /// This cluster's id.
    pub cluster_id: String,
    /// Every member (this cluster included): id and client.
    pub members: Vec<(String, Client)>,
    /// ClusterSetIP ranges.
    pub ranges: Vec<IpCidr>,
    /// A member unreachable for longer has its endpoints withdrawn.
    pub member_timeout: Duration,
    /// Longest wait between two attempts of a failed watch.
    pub retry_max: Duration,
    /// Leader election (`None`: always lead, for a single replica).
    pub lease: Option<lease::LeaseConfig>,
    /// A full pass at least this often, even without changes.
    pub resync: Duration,
    /// Namespaces whose exports are refused (in every member).
    pub refused_namespaces: std::collections::BTreeSet<String>,
    /// The most ClusterSetIPs of one namespace's imports (`None`: no bound).
    pub ip_quota: Option<usize>,
    /// Export EndpointSlices that no selector computed (mirrored, written by hand).
    pub export_selectorless: bool,
    /// The most exports merged per namespace of a member (`None`: no bound).
    pub exports_per_namespace: Option<usize>,
    /// The most exports merged per member (`None`: no bound).
    pub exports_per_member: Option<usize>,
    /// The most bytes of exported labels and annotations kept per member namespace and per
    /// member.
    pub meta_limits: budget::MetaLimits,
    /// This replica's Pod (namespace, name), if known: member problems (a member refusing
    /// our credentials) are published as Events on it.
    pub pod: Option<(String, String)>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("cluster_id", &self.cluster_id)
            .field(
                "members",
                &self.members.iter().map(|m| &m.0).collect::<Vec<_>>(),
            )
            .field("ranges", &self.ranges)
            .field("member_timeout", &self.member_timeout)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterLabel {
    cluster: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterKindLabel {
    cluster: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterVersionLabel {
    cluster: String,
    version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// The controller's metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    passes: Counter,
    full_passes: Counter,
    services_computed: Counter,
    pass_seconds: Histogram,
    writes: Family<KindLabel, Counter>,
    write_errors: Counter,
    imports: Gauge,
    slices: Gauge,
    member_up: Family<ClusterLabel, Gauge>,
    member_unauthorized: Family<ClusterLabel, Gauge>,
    member_export_version: Family<ClusterVersionLabel, Gauge>,
    exports_over_budget: Family<ClusterLabel, Gauge>,
    member_events: Family<ClusterKindLabel, Counter>,
    member_objects: Family<ClusterKindLabel, Gauge>,
    member_exports_held_back: Family<ClusterLabel, Gauge>,
    leader: Gauge,
    last_pass: Gauge<i64, AtomicI64>,
    problems: Gauge<u64, AtomicU64>,
    retries_waiting: Gauge,
    invalid_exports: Gauge,
    slices_withheld: Gauge,
}

impl Metrics {
    /// The counters of member `id`'s watch objects.
    fn watch_events(&self, id: &str) -> members::WatchEvents {
        let c = |kind| {
            self.member_events
                .get_or_create(&ClusterKindLabel {
                    cluster: id.to_string(),
                    kind,
                })
                .clone()
        };
        members::WatchEvents {
            exports: c("ServiceExport"),
            services: c("Service"),
            slices: c("EndpointSlice"),
        }
    }

    /// Registers under `mcs_controller_`.
    pub fn new(r: &mut Registry) -> Self {
        let m = Self {
            passes: Counter::default(),
            full_passes: Counter::default(),
            services_computed: Counter::default(),
            pass_seconds: Histogram::new([0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0]),
            writes: Family::default(),
            write_errors: Counter::default(),
            imports: Gauge::default(),
            slices: Gauge::default(),
            member_up: Family::default(),
            member_events: Family::default(),
            member_objects: Family::default(),
            member_exports_held_back: Family::default(),
            member_unauthorized: Family::default(),
            member_export_version: Family::default(),
            exports_over_budget: Family::default(),
            leader: Gauge::default(),
            last_pass: Gauge::default(),
            problems: Gauge::default(),
            retries_waiting: Gauge::default(),
            invalid_exports: Gauge::default(),
            slices_withheld: Gauge::default(),
        };
        let r = r.sub_registry_with_prefix("mcs_controller");
        r.register("passes", "Reconcile passes", m.passes.clone());
        r.register(
            "full_passes",
            "Passes that computed every service (the first as leader, a re-list, a member coming or going, the resync)",
            m.full_passes.clone(),
        );
        r.register(
            "services_computed",
            "Services computed again by passes (a pass computes the services whose objects changed)",
            m.services_computed.clone(),
        );
        r.register(
            "pass_seconds",
            "Time of a reconcile pass (snapshot, merge, writes)",
            m.pass_seconds.clone(),
        );
        r.register(
            "writes",
            "Objects written or deleted, by kind",
            m.writes.clone(),
        );
        r.register(
            "write_errors",
            "Writes that failed (retried)",
            m.write_errors.clone(),
        );
        r.register(
            "imports",
            "ServiceImports wanted in this cluster",
            m.imports.clone(),
        );
        r.register(
            "slices",
            "MCS EndpointSlices wanted in this cluster",
            m.slices.clone(),
        );
        r.register(
            "member_up",
            "1 when the member cluster answers and has listed, 0 otherwise",
            m.member_up.clone(),
        );
        r.register(
            "member_unauthorized",
            "1 while the member cluster refuses our credentials (401/403), 0 otherwise",
            m.member_unauthorized.clone(),
        );
        r.register(
            "member_export_version",
            "1 for the ServiceExport version the member is asked in (v1beta1, or v1alpha1 where only that is served; v1beta1 while discovery fails), 0 for the other: a member mid CRD upgrade shows which one (member_up says whether it answers)",
            m.member_export_version.clone(),
        );
        r.register(
            "exports_over_budget",
            "ServiceExports of the member kept and imported without their exported labels and annotations (ExportedMetadataOverBudget): past --exported-metadata-bytes-per-namespace or -per-member",
            m.exports_over_budget.clone(),
        );
        r.register(
            "member_watch_objects",
            "Objects received from the member's watches (each listed or changed object), by kind: a Service or EndpointSlice nobody exports is never sent",
            m.member_events.clone(),
        );
        r.register(
            "member_objects",
            "Objects of the member held in memory, by kind (exported Services, the slices of exported names, exports read)",
            m.member_objects.clone(),
        );
        r.register(
            "member_exports_held_back",
            "Exports of the member seen but not passed on yet: their Service or EndpointSlices not read yet",
            m.member_exports_held_back.clone(),
        );
        r.register("leader", "1 while this replica leads", m.leader.clone());
        r.register(
            "last_pass_timestamp_seconds",
            "When the last pass finished",
            m.last_pass.clone(),
        );
        r.register(
            "problems",
            "Things not done as asked in the last pass (see the log)",
            m.problems.clone(),
        );
        r.register(
            "retries_waiting",
            "Failed writes waiting for their backoff (1 s doubling to 60 s, per object)",
            m.retries_waiting.clone(),
        );
        r.register(
            "invalid_exports",
            "This cluster's ServiceExports with Valid=False in the last pass (reasons in their conditions and Events)",
            m.invalid_exports.clone(),
        );
        r.register(
            "slices_withheld",
            "Members' EndpointSlices not exported in the last pass: not computed from a Service's selector (see the log; --export-selectorless-slices)",
            m.slices_withheld.clone(),
        );
        m
    }
}

/// Runs the controller until the process ends: its members' watchers and the lease are
/// started, then it passes over what changed, each time something does (see [`passes`]).
pub async fn run(cfg: Config, health: Health, metrics: Metrics) -> anyhow::Result<()> {
    passes::Controller::start(cfg, health, metrics)?.run().await
}
