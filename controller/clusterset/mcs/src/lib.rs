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
//! - [`run`]: the loop: wake on any change (or every resync), snapshot, compute, write.
#![forbid(unsafe_code)]

pub mod budget;
pub mod desired;
pub mod held;
pub mod lease;
pub mod members;
pub mod objects;
pub mod selection;
pub mod store;
pub mod writer;

use std::{
    sync::{
        Arc,
        atomic::{AtomicI64, AtomicU64},
    },
    time::{Duration, Instant},
};

use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::Client;
use mcs_model::guard::IpCidr;
use mcs_runtime::http::Health;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio::sync::{Notify, watch};

use crate::{
    desired::{Computed, MemberView, Policy, Reach, Reconciler, Snapshot},
    members::{Local, Member, MemberState},
    store::{Changes, Dirty, Touch},
};

/// `endpointslice.kubernetes.io/managed-by` of our slices, and the value of
/// [`MANAGED_LABEL`] on our imports.
pub const MANAGER: &str = "mcs-controller.mcs-dataplane";
/// The label that marks the ServiceImports we manage.
pub const MANAGED_LABEL: &str = mcs_api::labels::LABEL_APP_MANAGED_BY;

/// Changes arriving within this window are handled in one pass. Under a burst a pass also
/// waits, after the end of the one before, as long as that one computed (at most
/// [`MAX_SETTLE`]), so passes never take all the CPU while objects keep arriving. The wait
/// counts the computation, not the writes (a pass that waits seconds on a loaded API server
/// holds the next one back by its few milliseconds of CPU), and runs from the last pass's
/// end, not from the change (a long pass long ago holds nothing back).
const DEBOUNCE: Duration = Duration::from_millis(20);
/// The longest settle window.
const MAX_SETTLE: Duration = Duration::from_secs(1);

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

/// Runs the controller until the process ends.
pub async fn run(cfg: Config, health: Health, metrics: Metrics) -> anyhow::Result<()> {
    let wake = Arc::new(Notify::new());
    let changes = Arc::new(Changes::default());
    let local = Arc::new(Local::new(&changes));
    let local_client = cfg
        .members
        .iter()
        .find(|(id, _)| *id == cfg.cluster_id)
        .map(|(_, c)| c.clone())
        .ok_or_else(|| anyhow::anyhow!("cluster {} is not a member", cfg.cluster_id))?;
    let members: Vec<Arc<Member>> = cfg
        .members
        .iter()
        .map(|(id, client)| {
            members::start(
                id.clone(),
                client.clone(),
                (*id == cfg.cluster_id).then(|| local.clone()),
                &changes,
                wake.clone(),
                members::Reading {
                    retry_max: cfg.retry_max,
                    limits: cfg.meta_limits,
                    events: metrics.watch_events(id),
                },
            )
        })
        .collect();
    let (lead_tx, mut lead_rx) = watch::channel(cfg.lease.is_none());
    if let Some(l) = cfg.lease.clone() {
        tokio::spawn(lease::run(local_client.clone(), l, lead_tx));
    }
    let me = members
        .iter()
        .find(|m| m.id == cfg.cluster_id)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no local member"))?;
    let mut waiting_logged = false;
    let mut next_wait = cfg.resync;
    let mut last_compute = Duration::ZERO;
    let mut last_end = Instant::now();
    // Whether this replica has written a whole pass since it began to lead (a follower is
    // ready with a complete view, but has written nothing).
    let mut written_once = false;
    let mut backoff = writer::Backoff::default();
    let mut was_unauthorized = vec![false; members.len()];
    let policy = Policy {
        refused_namespaces: cfg.refused_namespaces.clone(),
        ip_quota: cfg.ip_quota,
        export_selectorless: cfg.export_selectorless,
        exports_per_namespace: cfg.exports_per_namespace,
        exports_per_member: cfg.exports_per_member,
    };
    let mut reconciler = Reconciler::new(cfg.ranges.clone());
    // A full pass is due: at the first pass as leader, and at each resync.
    let mut need_full = true;
    let mut last_full = Instant::now();
    // How each member answered in the last pass (a member failing, coming or going changes
    // every service it exports, their endpoints or their conditions: a full pass).
    let mut reached: Vec<Reach> = Vec::new();
    loop {
        tokio::select! {
            () = wake.notified() => {}
            _ = lead_rx.changed() => {}
            () = tokio::time::sleep(next_wait) => {}
        }
        tokio::time::sleep_until(settled(last_end, last_compute, Instant::now()).into()).await;
        let leading = *lead_rx.borrow_and_update();
        metrics.leader.set(i64::from(leading));
        let states: Vec<MemberState> = members
            .iter()
            .map(|m| m.state(cfg.member_timeout))
            .collect();
        // While a member is failing, look again every second: its timeout may pass without
        // any event.
        next_wait = if states.iter().any(|s| matches!(s, MemberState::Unsure(_))) {
            cfg.resync.min(Duration::from_secs(1))
        } else {
            cfg.resync
        };
        for (i, (m, s)) in members.iter().zip(&states).enumerate() {
            let refused = m.unauthorized();
            if refused
                && !was_unauthorized[i]
                && let Some((ns, name)) = &cfg.pod
            {
                writer::warning_event(
                    &local_client,
                    k8s_openapi::api::core::v1::ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        namespace: Some(ns.clone()),
                        name: Some(name.clone()),
                        ..Default::default()
                    },
                    "Watch",
                    &format!("unauthorized/{}", m.id),
                    "MemberUnauthorized",
                    &format!(
                        "member cluster {} refuses our credentials (HTTP 401/403): its user in the clusterset kubeconfig has a wrong, expired or revoked token, or lacks read access; its imports stay until the member timeout",
                        m.id
                    ),
                );
            }
            was_unauthorized[i] = refused;
            metrics
                .member_up
                .get_or_create(&ClusterLabel {
                    cluster: m.id.clone(),
                })
                .set(i64::from(*s == MemberState::Up));
            for (kind, n) in [
                ("ServiceExport", m.exports.read().map.len()),
                ("Service", m.services.read().map.len()),
                ("EndpointSlice", m.slices.read().map.len()),
            ] {
                metrics
                    .member_objects
                    .get_or_create(&ClusterKindLabel {
                        cluster: m.id.clone(),
                        kind,
                    })
                    .set(n as i64);
            }
            metrics
                .member_exports_held_back
                .get_or_create(&ClusterLabel {
                    cluster: m.id.clone(),
                })
                .set(m.selection.held_back() as i64);
            metrics
                .member_unauthorized
                .get_or_create(&ClusterLabel {
                    cluster: m.id.clone(),
                })
                .set(i64::from(refused));
            metrics
                .exports_over_budget
                .get_or_create(&ClusterLabel {
                    cluster: m.id.clone(),
                })
                .set(m.budget.over_count() as i64);
        }
        // Never write from a partial view: the local cluster listed, and every member listed
        // once or given up on.
        let complete = local.listed()
            && members
                .iter()
                .zip(&states)
                .all(|(m, s)| m.listed() || matches!(s, MemberState::Gone(_)));
        if !complete {
            if !waiting_logged {
                tracing::info!("waiting for every member cluster's first list");
                waiting_logged = true;
            }
            continue;
        }
        if !leading {
            // A follower with a complete view is ready to take over.
            if !health.is_ready() {
                tracing::info!("complete view; ready (following: another replica leads)");
            }
            health.set_ready();
            written_once = false;
            need_full = true;
            // What changed is of no use to a follower: it starts with a full pass.
            changes.take();
            continue;
        }
        let started = Instant::now();
        let mut dirty = changes.take();
        let reach: Vec<Reach> = members
            .iter()
            .zip(&states)
            .map(|(m, s)| reach(m, s))
            .collect();
        if need_full || reach != reached || last_full.elapsed() >= cfg.resync {
            dirty = Dirty {
                all: true,
                ..Dirty::default()
            };
        }
        reached = reach;
        if !dirty.all {
            dirty.touched.extend(
                backoff
                    .due(Instant::now())
                    .map(|k| Touch::Service(k.clone())),
            );
        }
        let looked_at = {
            // The stores, read-locked while the pass computes (not across the writes).
            let guards: Vec<_> = members
                .iter()
                .map(|m| (m.exports.read(), m.services.read(), m.slices.read()))
                .collect();
            let namespaces = local.namespaces.read();
            let imports = local.imports.read();
            let snapshot = Snapshot {
                local: cfg.cluster_id.clone(),
                members: members
                    .iter()
                    .zip(&reached)
                    .zip(&guards)
                    .map(|((m, reach), g)| MemberView {
                        id: m.id.clone(),
                        reach: *reach,
                        exports: &g.0.map,
                        exports_generation: g.0.generation,
                        services: &g.1.map,
                        slices: &g.2,
                    })
                    .collect(),
                namespaces: &namespaces.map,
                imports: &imports.map,
                now: Time(Timestamp::now()),
                policy: &policy,
            };
            reconciler.pass(&snapshot, &dirty)
        };
        let want = &reconciler.want;
        let computed = started.elapsed();
        match &looked_at {
            Computed::All => {
                need_full = false;
                last_full = Instant::now();
                metrics.full_passes.inc();
                metrics.services_computed.inc_by(want.imports.len() as u64);
                for p in want.problems.values().flatten() {
                    tracing::warn!("{p}");
                }
            }
            Computed::Some(keys) => {
                metrics.services_computed.inc_by(keys.len() as u64);
                for p in keys.iter().filter_map(|k| want.problems.get(k)).flatten() {
                    tracing::warn!("{p}");
                }
            }
        }
        let w = writer::sync(&local_client, want, &looked_at, &local, &me, &mut backoff).await;
        last_compute = computed;
        last_end = Instant::now();
        metrics.passes.inc();
        metrics
            .pass_seconds
            .observe(started.elapsed().as_secs_f64());
        metrics.imports.set(want.imports.len() as i64);
        metrics.slices.set(want.slices.len() as i64);
        metrics.problems.set(want.problem_count() as u64);
        metrics.slices_withheld.set(want.withheld_count() as i64);
        metrics.retries_waiting.set(backoff.len() as i64);
        metrics
            .invalid_exports
            .set(want.invalid_export_count() as i64);
        for (kind, n) in [
            ("ServiceImport", w.imports + w.imports_deleted),
            ("EndpointSlice", w.slices + w.slices_deleted),
            ("ServiceExportStatus", w.exports),
        ] {
            metrics
                .writes
                .get_or_create(&KindLabel { kind })
                .inc_by(n as u64);
        }
        metrics.write_errors.inc_by(w.errors as u64);
        metrics.last_pass.set(Timestamp::now().as_second());
        let full = matches!(looked_at, Computed::All);
        if w.any() || full {
            tracing::info!(
                full,
                services = if full { want.imports.len() } else { 0 },
                imports = w.imports,
                imports_deleted = w.imports_deleted,
                slices = w.slices,
                slices_deleted = w.slices_deleted,
                exports = w.exports,
                errors = w.errors,
                deferred = w.deferred,
                compute_ms = computed.as_secs_f64() * 1e3,
                ms = started.elapsed().as_secs_f64() * 1e3,
                "pass"
            );
        }
        if let Some(due) = backoff.next_due() {
            // A pass when the first failed write may be tried again (each object keeps its
            // own backoff; the others are not rewritten).
            next_wait = next_wait.min(due.saturating_duration_since(Instant::now()));
        } else if w.errors == 0 && w.deferred == 0 && !written_once {
            written_once = true;
            tracing::info!(
                imports = want.imports.len(),
                slices = want.slices.len(),
                "first pass written as leader; ready"
            );
            health.set_ready();
        }
    }
}

/// When a pass woken at `now` starts: after [`DEBOUNCE`], and not before the last pass,
/// which ended at `last_end` and computed for `last_compute`, is that long (at most
/// [`MAX_SETTLE`]) in the past.
fn settled(last_end: Instant, last_compute: Duration, now: Instant) -> Instant {
    (now + DEBOUNCE).max(last_end + last_compute.min(MAX_SETTLE))
}

/// How long a member fails before its imports say so (`ClustersReachable=False`): a watch
/// that fails once and comes back at once does not rewrite every import it exports twice.
const REACH_GRACE: Duration = Duration::from_secs(10);

/// How member `m` in state `s` answers, for the pass.
fn reach(m: &Member, s: &MemberState) -> Reach {
    let unauthorized = m.unauthorized();
    match s {
        MemberState::Up => Reach::Up,
        MemberState::Unsure(_) if m.failing_for().is_none_or(|d| d < REACH_GRACE) => Reach::Up,
        MemberState::Unsure(_) => Reach::Failing { unauthorized },
        MemberState::Gone(_) => Reach::Gone { unauthorized },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_waits_for_the_last_ones_duration_only_while_it_is_recent() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // A burst: the last pass computed for 400 ms and just ended.
        assert_eq!(settled(t, ms(400), t), t + ms(400));
        // Capped at MAX_SETTLE.
        assert_eq!(settled(t, s(5), t), t + MAX_SETTLE);
        // A change 10 s after a pass that computed for 1 s waits only the debounce window.
        assert_eq!(settled(t, s(1), t + s(10)), t + s(10) + DEBOUNCE);
        // Part-way: 300 ms after a pass that computed for 500 ms, 200 ms more.
        assert_eq!(settled(t, ms(500), t + ms(300)), t + ms(500));
    }
}
