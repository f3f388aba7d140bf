//! The controller's loop, built then run: [`Controller::start`] wires the members' watchers,
//! the lease and the reconciler; each turn of [`Controller::run`] waits for a change (or the
//! resync), lets a burst settle, and takes one step: read how every member answers, publish
//! it, and — with a complete view, as leader — compute the changed services and write the
//! difference.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::Client;
use mcs_runtime::http::Health;
use tokio::sync::{Notify, watch};

use crate::{
    ClusterKindLabel, ClusterLabel, ClusterVersionLabel, Config, KindLabel, Metrics,
    desired::{Computed, MemberView, Policy, Reach, Reconciler, Snapshot},
    lease, members,
    members::{Local, Member, MemberState},
    store::{Changes, Dirty, Touch},
    writer,
};

/// Changes arriving within this window are handled in one pass. Under a burst a pass also
/// waits, after the end of the one before, as long as that one computed (at most
/// [`MAX_SETTLE`]), so passes never take all the CPU while objects keep arriving. The wait
/// counts the computation, not the writes (a pass that waits seconds on a loaded API server
/// holds the next one back by its few milliseconds of CPU), and runs from the last pass's
/// end, not from the change (a long pass long ago holds nothing back).
const DEBOUNCE: Duration = Duration::from_millis(20);
/// The longest settle window.
const MAX_SETTLE: Duration = Duration::from_secs(1);

/// How long a member fails before its imports say so (`ClustersReachable=False`): a watch
/// that fails once and comes back at once does not rewrite every import it exports twice.
const REACH_GRACE: Duration = Duration::from_secs(10);

/// The running controller: its members, the reconciler, and what the loop carries from one
/// step to the next.
pub(crate) struct Controller {
    cfg: Config,
    health: Health,
    metrics: Metrics,
    wake: Arc<Notify>,
    changes: Arc<Changes>,
    local: Arc<Local>,
    local_client: Client,
    members: Vec<Arc<Member>>,
    /// The local cluster's member (its exports' conditions are written).
    me: Arc<Member>,
    lead_rx: watch::Receiver<bool>,
    policy: Policy,
    reconciler: Reconciler,
    backoff: writer::Backoff,
    /// The longest wait for the next step (the resync, or less while a member is unsure or a
    /// failed write is due).
    next_wait: Duration,
    /// How long the last pass computed, and when it ended ([`settled`]).
    last_compute: Duration,
    last_end: Instant,
    waiting_logged: bool,
    /// Whether this replica has written a whole pass since it began to lead (a follower is
    /// ready with a complete view, but has written nothing).
    written_once: bool,
    /// Whether each member refused our credentials at the last step (an Event when it
    /// starts to).
    was_unauthorized: Vec<bool>,
    /// A full pass is due: at the first pass as leader, and at each resync.
    need_full: bool,
    last_full: Instant,
    /// How each member answered in the last pass (a member failing, coming or going changes
    /// every service it exports, their endpoints or their conditions: a full pass).
    reached: Vec<Reach>,
}

impl Controller {
    /// Starts every member's watchers and the lease (when one is configured).
    pub(crate) fn start(cfg: Config, health: Health, metrics: Metrics) -> anyhow::Result<Self> {
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
        let (lead_tx, lead_rx) = watch::channel(cfg.lease.is_none());
        if let Some(l) = cfg.lease.clone() {
            tokio::spawn(lease::run(local_client.clone(), l, lead_tx));
        }
        let me = members
            .iter()
            .find(|m| m.id == cfg.cluster_id)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no local member"))?;
        let policy = Policy {
            refused_namespaces: cfg.refused_namespaces.clone(),
            ip_quota: cfg.ip_quota,
            export_selectorless: cfg.export_selectorless,
            exports_per_namespace: cfg.exports_per_namespace,
            exports_per_member: cfg.exports_per_member,
        };
        Ok(Self {
            reconciler: Reconciler::new(cfg.ranges.clone()),
            next_wait: cfg.resync,
            was_unauthorized: vec![false; members.len()],
            cfg,
            health,
            metrics,
            wake,
            changes,
            local,
            local_client,
            members,
            me,
            lead_rx,
            policy,
            backoff: writer::Backoff::default(),
            last_compute: Duration::ZERO,
            last_end: Instant::now(),
            waiting_logged: false,
            written_once: false,
            need_full: true,
            last_full: Instant::now(),
            reached: Vec::new(),
        })
    }

    /// Steps until the process ends.
    pub(crate) async fn run(mut self) -> anyhow::Result<()> {
        loop {
            self.wait().await;
            self.step().await;
        }
    }

    /// Until a change, a change of leadership, or `next_wait`; then until the burst settles.
    async fn wait(&mut self) {
        tokio::select! {
            () = self.wake.notified() => {}
            _ = self.lead_rx.changed() => {}
            () = tokio::time::sleep(self.next_wait) => {}
        }
        let start = settled(self.last_end, self.last_compute, Instant::now());
        tokio::time::sleep_until(start.into()).await;
    }

    /// One step: how the members answer, then a pass if this replica leads with a complete
    /// view (a follower with one is ready to take over).
    async fn step(&mut self) {
        let leading = *self.lead_rx.borrow_and_update();
        self.metrics.leader.set(i64::from(leading));
        let states: Vec<MemberState> = self
            .members
            .iter()
            .map(|m| m.state(self.cfg.member_timeout))
            .collect();
        // While a member is failing, look again every second: its timeout may pass without
        // any event.
        self.next_wait = if states.iter().any(|s| matches!(s, MemberState::Unsure(_))) {
            self.cfg.resync.min(Duration::from_secs(1))
        } else {
            self.cfg.resync
        };
        self.publish_members(&states);
        if !self.complete(&states) {
            if !self.waiting_logged {
                tracing::info!("waiting for every member cluster's first list");
                self.waiting_logged = true;
            }
            return;
        }
        if leading {
            self.pass(&states).await;
        } else {
            self.follow();
        }
    }

    /// Each member's gauges, and an Event when a member starts refusing our credentials.
    fn publish_members(&mut self, states: &[MemberState]) {
        let m = &self.metrics;
        for (i, (member, s)) in self.members.iter().zip(states).enumerate() {
            let refused = member.unauthorized();
            if refused && !self.was_unauthorized[i] {
                self.unauthorized_event(member);
            }
            self.was_unauthorized[i] = refused;
            let cluster = ClusterLabel {
                cluster: member.id.clone(),
            };
            m.member_up
                .get_or_create(&cluster)
                .set(i64::from(*s == MemberState::Up));
            for (kind, n) in [
                ("ServiceExport", member.exports.read().map.len()),
                ("Service", member.services.read().map.len()),
                ("EndpointSlice", member.slices.read().map.len()),
            ] {
                m.member_objects
                    .get_or_create(&ClusterKindLabel {
                        cluster: member.id.clone(),
                        kind,
                    })
                    .set(n as i64);
            }
            m.member_exports_held_back
                .get_or_create(&cluster)
                .set(member.selection.held_back() as i64);
            m.member_unauthorized
                .get_or_create(&cluster)
                .set(i64::from(refused));
            let read_in = member.export_version().0;
            for version in mcs_runtime::discovery::MCS_VERSIONS {
                m.member_export_version
                    .get_or_create(&ClusterVersionLabel {
                        cluster: member.id.clone(),
                        version,
                    })
                    .set(i64::from(read_in == version));
            }
            m.exports_over_budget
                .get_or_create(&cluster)
                .set(member.budget.over_count() as i64);
        }
    }

    /// A Warning Event on this replica's Pod: member `m` refuses our credentials.
    fn unauthorized_event(&self, m: &Member) {
        let Some((ns, name)) = &self.cfg.pod else {
            return;
        };
        writer::warning_event(
            &self.local_client,
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

    /// Never write from a partial view: the local cluster listed, and every member listed
    /// once or given up on.
    fn complete(&self, states: &[MemberState]) -> bool {
        self.local.listed()
            && self
                .members
                .iter()
                .zip(states)
                .all(|(m, s)| m.listed() || matches!(s, MemberState::Gone(_)))
    }

    /// A follower with a complete view is ready to take over; what changed is of no use to
    /// it: it starts with a full pass.
    fn follow(&mut self) {
        if !self.health.is_ready() {
            tracing::info!("complete view; ready (following: another replica leads)");
        }
        self.health.set_ready();
        self.written_once = false;
        self.need_full = true;
        self.changes.take();
    }

    /// What this pass computes: what changed, failed writes now due; everything at the first
    /// pass as leader, at each resync, and when a member's reach changed.
    fn dirty(&mut self, states: &[MemberState]) -> Dirty {
        let mut dirty = self.changes.take();
        let reach: Vec<Reach> = self
            .members
            .iter()
            .zip(states)
            .map(|(m, s)| reach(m, s))
            .collect();
        if self.need_full || reach != self.reached || self.last_full.elapsed() >= self.cfg.resync {
            dirty = Dirty {
                all: true,
                ..Dirty::default()
            };
        }
        self.reached = reach;
        if !dirty.all {
            dirty.touched.extend(
                self.backoff
                    .due(Instant::now())
                    .map(|k| Touch::Service(k.clone())),
            );
        }
        dirty
    }

    /// The reconciler's pass over a snapshot of the stores, read-locked while it computes
    /// (not across the writes).
    fn compute(&mut self, dirty: &Dirty) -> Computed {
        let guards: Vec<_> = self
            .members
            .iter()
            .map(|m| (m.exports.read(), m.services.read(), m.slices.read()))
            .collect();
        let namespaces = self.local.namespaces.read();
        let imports = self.local.imports.read();
        let snapshot = Snapshot {
            local: self.cfg.cluster_id.clone(),
            members: self
                .members
                .iter()
                .zip(&self.reached)
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
            policy: &self.policy,
        };
        self.reconciler.pass(&snapshot, dirty)
    }

    /// A pass as leader: compute what changed, write the difference, count it.
    async fn pass(&mut self, states: &[MemberState]) {
        let started = Instant::now();
        let dirty = self.dirty(states);
        let looked_at = self.compute(&dirty);
        let computed = started.elapsed();
        self.report_problems(&looked_at);
        let w = writer::sync(
            &self.local_client,
            &self.reconciler.want,
            &looked_at,
            &self.local,
            &self.me,
            &mut self.backoff,
        )
        .await;
        self.last_compute = computed;
        self.last_end = Instant::now();
        self.record(&w, &looked_at, started, computed);
        if let Some(due) = self.backoff.next_due() {
            // A pass when the first failed write may be tried again (each object keeps its
            // own backoff; the others are not rewritten).
            self.next_wait = self
                .next_wait
                .min(due.saturating_duration_since(Instant::now()));
        } else if w.errors == 0 && w.deferred == 0 && !self.written_once {
            self.written_once = true;
            let want = &self.reconciler.want;
            tracing::info!(
                imports = want.imports.len(),
                slices = want.slices.len(),
                "first pass written as leader; ready"
            );
            self.health.set_ready();
        }
    }

    /// The problems of the services the pass computed, logged; a full pass is counted.
    fn report_problems(&mut self, looked_at: &Computed) {
        let want = &self.reconciler.want;
        match looked_at {
            Computed::All => {
                self.need_full = false;
                self.last_full = Instant::now();
                self.metrics.full_passes.inc();
                self.metrics
                    .services_computed
                    .inc_by(want.imports.len() as u64);
                for p in want.problems.values().flatten() {
                    tracing::warn!("{p}");
                }
            }
            Computed::Some(keys) => {
                self.metrics.services_computed.inc_by(keys.len() as u64);
                for p in keys.iter().filter_map(|k| want.problems.get(k)).flatten() {
                    tracing::warn!("{p}");
                }
            }
        }
    }

    /// The pass's metrics and, when it wrote or was full, its log line.
    fn record(
        &self,
        w: &writer::Written,
        looked_at: &Computed,
        started: Instant,
        computed: Duration,
    ) {
        let (m, want) = (&self.metrics, &self.reconciler.want);
        m.passes.inc();
        m.pass_seconds.observe(started.elapsed().as_secs_f64());
        m.imports.set(want.imports.len() as i64);
        m.slices.set(want.slices.len() as i64);
        m.problems.set(want.problem_count() as u64);
        m.slices_withheld.set(want.withheld_count() as i64);
        m.retries_waiting.set(self.backoff.len() as i64);
        m.invalid_exports.set(want.invalid_export_count() as i64);
        for (kind, n) in [
            ("ServiceImport", w.imports + w.imports_deleted),
            ("EndpointSlice", w.slices + w.slices_deleted),
            ("ServiceExportStatus", w.exports),
        ] {
            m.writes.get_or_create(&KindLabel { kind }).inc_by(n as u64);
        }
        m.write_errors.inc_by(w.errors as u64);
        m.last_pass.set(Timestamp::now().as_second());
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
    }
}

/// When a pass woken at `now` starts: after [`DEBOUNCE`], and not before the last pass,
/// which ended at `last_end` and computed for `last_compute`, is that long (at most
/// [`MAX_SETTLE`]) in the past.
fn settled(last_end: Instant, last_compute: Duration, now: Instant) -> Instant {
    (now + DEBOUNCE).max(last_end + last_compute.min(MAX_SETTLE))
}

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
