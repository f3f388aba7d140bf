//! Makes the local cluster hold what [`crate::desired`] says, writing only what differs (field
//! manager [`FIELD_MANAGER`]): ServiceImports and their status, MCS EndpointSlices,
//! ServiceExport conditions; and deleting the imports and slices of ours that are no longer
//! wanted. Creations go before the slices that refer to them; deletions of slices before their
//! import.
//!
//! Each write is the cheapest one for the API server that leaves the same object:
//! - an import's spec, labels and annotations: a server-side apply, so that a label or
//!   annotation no longer exported is removed while others' stay (apply removes only the
//!   fields its manager applied before);
//! - an import's and an export's status, which only this controller writes: a JSON merge
//!   patch naming every field ([`import_status_patch`]: null removes one no longer wanted);
//! - a new MCS slice: a create; a changed one: a JSON merge patch of everything we write of it
//!   ([`slice_patch`]; its labels are the same four keys for its whole life, its lists are
//!   replaced whole).
//!
//! No apply merge and no YAML parsing on the API server for the writes that are most of them
//! (status, slices); see docs/performance.md for what it saves.
//!
//! A failed write is retried on its own ([`Backoff`]): not before 1 s, then 2, 4, … up to
//! [`RETRY_MAX`], while the other objects are written as usual; it is forgotten once it
//! succeeds or the object no longer differs.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use k8s_openapi::{
    api::discovery::v1::EndpointSlice, apimachinery::pkg::apis::meta::v1::Condition,
};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams},
};
use mcs_api::ServiceImport;
use serde_json::json;

use crate::{
    desired::{Computed, Desired},
    held::{HeldSlice, slice_content},
    members::{Local, Member},
    objects::ObjKey,
    objects::{ExportVersion, WireExport},
};

/// The field manager of every write.
pub const FIELD_MANAGER: &str = "mcs-controller";

/// What one pass wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// ServiceImports created or changed (spec or status).
    pub imports: usize,
    /// ServiceImports deleted.
    pub imports_deleted: usize,
    /// EndpointSlices created or changed.
    pub slices: usize,
    /// EndpointSlices deleted.
    pub slices_deleted: usize,
    /// ServiceExport statuses written.
    pub exports: usize,
    /// Writes that failed (each retried after its backoff).
    pub errors: usize,
    /// Writes not tried in this pass: they failed before and their backoff has not passed.
    pub deferred: usize,
}

/// The first wait before a failed write is tried again.
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait before a failed write is tried again.
pub const RETRY_MAX: Duration = Duration::from_secs(60);

/// What a write is about: its kind (`ServiceImport`, `EndpointSlice`, `ServiceExport`
/// status) and object.
pub type Target = (&'static str, ObjKey);

/// Writes that failed, each with its own exponential backoff: when it may be tried again, how
/// long the next wait is, and the service it belongs to (computed again when it is due).
#[derive(Debug, Default)]
pub struct Backoff {
    failed: HashMap<Target, (Instant, Duration, ObjKey)>,
}

impl Backoff {
    /// Whether `t` failed and its wait has not passed at `now`.
    fn waiting(&self, t: &Target, now: Instant) -> bool {
        self.failed.get(t).is_some_and(|(due, _, _)| *due > now)
    }

    /// Records a failure of `t` (of service `svc`) at `now`: the wait doubles, from
    /// [`RETRY_FIRST`] to [`RETRY_MAX`].
    fn fail(&mut self, t: Target, svc: ObjKey, now: Instant) {
        let e = self
            .failed
            .entry(t)
            .or_insert((now, Duration::ZERO, svc.clone()));
        let wait = if e.1.is_zero() {
            RETRY_FIRST
        } else {
            (e.1 * 2).min(RETRY_MAX)
        };
        *e = (now + wait, wait, svc);
    }

    /// When the earliest failed write may be tried again.
    pub fn next_due(&self) -> Option<Instant> {
        self.failed.values().map(|(due, _, _)| *due).min()
    }

    /// The services with a failed write whose wait has passed at `now`.
    pub fn due(&self, now: Instant) -> impl Iterator<Item = &ObjKey> {
        self.failed
            .values()
            .filter(move |(due, _, _)| *due <= now)
            .map(|(_, _, svc)| svc)
    }

    /// Failed writes waiting for a retry.
    pub fn len(&self) -> usize {
        self.failed.len()
    }

    /// Whether no failed write waits.
    pub fn is_empty(&self) -> bool {
        self.failed.is_empty()
    }
}

impl Written {
    /// Whether anything was written or failed.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

fn apply() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// A JSON merge patch (or a create) by [`FIELD_MANAGER`].
fn merge() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// The merge patch that gives an import `si`'s status: every field of the status named, null
/// where `si` has none, so that one we no longer want is removed (lists are replaced whole).
pub fn import_status_patch(si: &ServiceImport) -> serde_json::Value {
    let status = si.status.as_ref();
    let list = |v: serde_json::Value| match v {
        serde_json::Value::Array(a) if a.is_empty() => serde_json::Value::Null,
        v => v,
    };
    json!({
        "status": {
            "endpointSliceObjects": status.and_then(|s| s.endpoint_slice_objects),
            "clusters": list(json!(status.map_or(&[][..], |s| &s.clusters))),
            "conditions": list(json!(status.map_or(&[][..], |s| &s.conditions))),
        }
    })
}

/// The merge patch that makes an MCS slice of ours hold `es`: its labels (always the same
/// keys, so none is left behind), address type (immutable: a different one fails, as an apply
/// did), endpoints and ports (replaced whole; null when `es` has none).
pub fn slice_patch(es: &EndpointSlice) -> serde_json::Value {
    let mut patch = json!({
        "addressType": es.address_type,
        "endpoints": es.endpoints,
        "ports": es.ports,
    });
    if let Some(labels) = &es.metadata.labels {
        patch["metadata"] = json!({ "labels": labels });
    }
    patch
}

/// Writes in flight at once (the API server handles them in parallel; one at a time, 1,000
/// imports took tens of seconds of round trips).
const IN_FLIGHT: usize = 16;

/// What one write did.
enum Outcome {
    Import,
    ImportDeleted,
    Slice,
    SliceDeleted,
    Export,
    Nothing,
    Error,
}

/// One pass's writes: what is tried, what failed before, what was looked at.
struct Pass<'a> {
    w: Written,
    backoff: &'a mut Backoff,
    /// Every target that differed in this pass (a failure of any other target of the
    /// services looked at is forgotten).
    differing: HashSet<Target>,
    now: Instant,
}

impl Pass<'_> {
    /// Whether `t`, which differs, is to be written now (else it waits for its backoff).
    fn due(&mut self, t: Target) -> bool {
        let waiting = self.backoff.waiting(&t, self.now);
        self.differing.insert(t);
        if waiting {
            self.w.deferred += 1;
        }
        !waiting
    }

    /// Runs `writes` with at most [`IN_FLIGHT`] in flight and counts their outcomes.
    async fn run_all<F>(&mut self, writes: Vec<F>)
    where
        F: std::future::Future<Output = (Target, ObjKey, Outcome)>,
    {
        let mut s = futures::stream::iter(writes).buffer_unordered(IN_FLIGHT);
        while let Some((t, svc, o)) = s.next().await {
            let w = &mut self.w;
            match o {
                Outcome::Error => {
                    w.errors += 1;
                    self.backoff.fail(t, svc, Instant::now());
                    continue;
                }
                Outcome::Import => w.imports += 1,
                Outcome::ImportDeleted => w.imports_deleted += 1,
                Outcome::Slice => w.slices += 1,
                Outcome::SliceDeleted => w.slices_deleted += 1,
                Outcome::Export => w.exports += 1,
                Outcome::Nothing => {}
            }
            self.backoff.failed.remove(&t);
        }
    }

    /// The pass's count; failures of targets of the services looked at that no longer
    /// differ are forgotten.
    fn finish(self, looked_at: &Computed) -> Written {
        let differing = self.differing;
        self.backoff.failed.retain(|t, (_, _, svc)| {
            differing.contains(t)
                || matches!(looked_at, Computed::Some(keys) if !keys.contains(svc))
        });
        self.w
    }
}

const IMPORT: &str = "ServiceImport";
const SLICE: &str = "EndpointSlice";
const EXPORT: &str = "ServiceExport";

/// Writes the difference between `want` and what the local stores hold, for the services
/// `looked_at` names (every one for a full pass): imports first, then slices (created, then
/// deleted), then imports no longer wanted, then export conditions.
pub async fn sync(
    client: &Client,
    want: &Desired,
    looked_at: &Computed,
    local: &Local,
    me: &Member,
    backoff: &mut Backoff,
) -> Written {
    let mut pass = Pass {
        w: Written::default(),
        backoff,
        differing: HashSet::new(),
        now: Instant::now(),
    };
    // What the local stores hold of the services looked at (a copy: the locks are not held
    // across the writes).
    let (have_imports, have_slices, slices_of) = {
        let imports = local.imports.read();
        let slices = local.slices.read();
        match looked_at {
            Computed::All => (
                imports.map.clone(),
                slices.map.clone(),
                None::<HashMap<ObjKey, ObjKey>>,
            ),
            Computed::Some(keys) => {
                let mut have_slices = HashMap::new();
                let mut slices_of = HashMap::new();
                for k in keys {
                    for sk in slices.by_service.get(k).into_iter().flatten() {
                        if let Some(es) = slices.map.get(sk) {
                            have_slices.insert(sk.clone(), es.clone());
                            slices_of.insert(sk.clone(), k.clone());
                        }
                    }
                }
                (
                    keys.iter()
                        .filter_map(|k| Some((k.clone(), imports.map.get(k)?.clone())))
                        .collect(),
                    have_slices,
                    Some(slices_of),
                )
            }
        }
    };
    // The entries of `map` for the services looked at: by lookup, not by a scan.
    fn of<'m, V>(
        map: &'m BTreeMap<ObjKey, V>,
        looked_at: &'m Computed,
    ) -> Vec<(&'m ObjKey, &'m V)> {
        match looked_at {
            Computed::All => map.iter().collect(),
            Computed::Some(keys) => keys.iter().filter_map(|k| map.get_key_value(k)).collect(),
        }
    }
    // The service a slice of ours belongs to.
    let service_of = |sk: &ObjKey, es: &HeldSlice| -> ObjKey {
        slices_of
            .as_ref()
            .and_then(|m| m.get(sk).cloned())
            .or_else(|| crate::members::mcs_slice_service(sk, es))
            .unwrap_or_else(|| sk.clone())
    };

    // Imports: create or update.
    let mut writes = Vec::new();
    for ((ns, name), si) in of(&want.imports, looked_at) {
        let key = (ns.clone(), name.clone());
        let have = have_imports.get(&key);
        let spec_same = have.is_some_and(|h| h.spec_same(si));
        if spec_same && have.is_some_and(|h| h.status_same(si)) {
            continue;
        }
        let target = (IMPORT, key.clone());
        if !pass.due(target.clone()) {
            continue;
        }
        let mut body = si.clone();
        body.status = None;
        let api: Api<ServiceImport> = Api::namespaced(client.clone(), ns);
        writes.push(async move {
            if !spec_same && let Err(e) = api.patch(name, &apply(), &Patch::Apply(&body)).await {
                tracing::warn!(import = %format!("{ns}/{name}"), error = %e, "writing ServiceImport");
                return (target, key, Outcome::Error);
            }
            let status = import_status_patch(si);
            let outcome = match api
                .patch_status(name, &merge(), &Patch::Merge(&status))
                .await
            {
                Ok(written) => {
                    crate::held::note_written_status(si, &written);
                    tracing::debug!(
                        import = %format!("{ns}/{name}"),
                        ips = ?si.spec.ips,
                        clusters = ?si.status.as_ref().map(|s| s.clusters.iter().map(|c| c.cluster.clone()).collect::<Vec<_>>()),
                        "ServiceImport written"
                    );
                    Outcome::Import
                }
                Err(e) => {
                    tracing::warn!(import = %format!("{ns}/{name}"), error = %e, "writing ServiceImport status");
                    Outcome::Error
                }
            };
            (target, key, outcome)
        });
    }
    pass.run_all(writes).await;

    // Slices: create or update.
    let mut writes = Vec::new();
    let wanted_slices: Vec<(&ObjKey, &ObjKey)> = of(&want.slices_of, looked_at)
        .into_iter()
        .flat_map(|(svc, sks)| sks.iter().map(move |sk| (svc, sk)))
        .collect();
    for (svc, sk) in wanted_slices {
        let Some(es) = want.slices.get(sk).map(|w| w.object()) else {
            continue;
        };
        let held = have_slices.get(sk);
        if held.is_some_and(|h| h.content == slice_content(&es)) {
            continue;
        }
        let target = (SLICE, sk.clone());
        if !pass.due(target.clone()) {
            continue;
        }
        let (ns, name) = sk;
        let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
        let svc = svc.clone();
        let new = held.is_none();
        writes.push(async move {
            let outcome = match write_slice(&api, name, &es, new).await {
                Ok(()) => Outcome::Slice,
                Err(e) => {
                    tracing::warn!(slice = %format!("{ns}/{name}"), error = %e, "writing EndpointSlice");
                    Outcome::Error
                }
            };
            (target, svc, outcome)
        });
    }
    pass.run_all(writes).await;

    // Slices of ours that are not wanted.
    let mut writes = Vec::new();
    for (sk, es) in &have_slices {
        if want.slices.contains_key(sk) {
            continue;
        }
        let target = (SLICE, sk.clone());
        if !pass.due(target.clone()) {
            continue;
        }
        let (ns, name) = sk;
        let svc = service_of(sk, es);
        let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
        writes.push(async move {
            let outcome = match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Outcome::SliceDeleted,
                Err(kube::Error::Api(e)) if e.code == 404 => Outcome::Nothing,
                Err(e) => {
                    tracing::warn!(slice = %format!("{ns}/{name}"), error = %e, "deleting EndpointSlice");
                    Outcome::Error
                }
            };
            (target, svc, outcome)
        });
    }
    pass.run_all(writes).await;

    // Imports of ours no longer wanted.
    let mut writes = Vec::new();
    for (key, si) in &have_imports {
        if !si.ours || want.imports.contains_key(key) {
            continue;
        }
        let target = (IMPORT, key.clone());
        if !pass.due(target.clone()) {
            continue;
        }
        let (ns, name) = key;
        let api: Api<ServiceImport> = Api::namespaced(client.clone(), ns);
        writes.push(async move {
            let outcome = match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => {
                    tracing::info!(import = %format!("{ns}/{name}"), "ServiceImport deleted: no cluster exports it any more");
                    Outcome::ImportDeleted
                }
                Err(kube::Error::Api(e)) if e.code == 404 => Outcome::Nothing,
                Err(e) => {
                    tracing::warn!(import = %format!("{ns}/{name}"), error = %e, "deleting ServiceImport");
                    Outcome::Error
                }
            };
            (target, key.clone(), outcome)
        });
    }
    pass.run_all(writes).await;

    // Conditions of the local exports.
    let exports: HashMap<ObjKey, std::sync::Arc<crate::objects::LeanExport>> = {
        let all = me.exports.read();
        of(&want.export_conditions, looked_at)
            .into_iter()
            .filter_map(|(k, _)| Some((k.clone(), all.map.get(k)?.clone())))
            .collect()
    };
    let mut writes = Vec::new();
    for (key, conds) in of(&want.export_conditions, looked_at) {
        let Some(se) = exports.get(key) else { continue };
        if se.conditions.same(conds) {
            continue;
        }
        let target = (EXPORT, key.clone());
        if !pass.due(target.clone()) {
            continue;
        }
        // A problem that is new (the conditions changed): a log line and an Event on the
        // ServiceExport, once per change (not per pass).
        for c in conds.iter().filter(|c| {
            (c.type_ == "Valid" && c.status == "False")
                || (c.type_ == "Conflict" && c.status == "True")
        }) {
            tracing::warn!(export = %format!("{}/{}", key.0, key.1), condition = %c.type_, reason = %c.reason, "{}", c.message);
            event(client, key, se.uid.clone(), c);
        }
        let version = me.export_version();
        writes.push(async move {
            let outcome = match write_export_status(client, key, conds, version).await {
                Ok(true) => Outcome::Export,
                Ok(false) => Outcome::Nothing,
                Err(()) => Outcome::Error,
            };
            (target, key.clone(), outcome)
        });
    }
    pass.run_all(writes).await;
    pass.finish(looked_at)
}

/// Writes the MCS slice `name` as `es`: created when this cluster holds no such slice (`new`;
/// if it exists after all, our store had not seen it yet, and it is patched), else patched.
async fn write_slice(
    api: &Api<EndpointSlice>,
    name: &str,
    es: &EndpointSlice,
    new: bool,
) -> Result<(), kube::Error> {
    if new {
        let post = kube::api::PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        match api.create(&post, es).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    api.patch(name, &merge(), &Patch::Merge(slice_patch(es)))
        .await
        .map(|_| ())
}

/// Ok(true): written; Ok(false): the export is gone; Err: failed (logged). Written in
/// `version`, the one this cluster's exports are read in.
async fn write_export_status(
    client: &Client,
    key: &ObjKey,
    conds: &[Condition],
    version: ExportVersion,
) -> Result<bool, ()> {
    let api: Api<WireExport> = Api::namespaced_with(client.clone(), &key.0, &version);
    // Only this controller writes an export's status: the list is replaced whole.
    let body = json!({ "status": { "conditions": conds } });
    match api
        .patch_status(&key.1, &merge(), &Patch::Merge(&body))
        .await
    {
        Ok(_) => Ok(true),
        // The export is gone (not a version that is not served: that says no reason).
        Err(kube::Error::Api(e)) if e.code == 404 && e.reason == "NotFound" => Ok(false),
        Err(e) => {
            tracing::warn!(export = %format!("{}/{}", key.0, key.1), error = %e, "writing ServiceExport status");
            Err(())
        }
    }
}

/// Publishes a Warning Event about `c` on the ServiceExport `key`. Its name is derived from
/// what it says, so a repeat of the same problem (e.g. after a restart) is one Event, not
/// many.
fn event(client: &Client, key: &ObjKey, uid: Option<String>, c: &Condition) {
    let (ns, name) = key.clone();
    warning_event(
        client,
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("multicluster.x-k8s.io/v1beta1".into()),
            kind: Some("ServiceExport".into()),
            namespace: Some(ns),
            name: Some(name),
            uid,
            ..Default::default()
        },
        "Export",
        &format!("{}/{}", c.type_, c.reason),
        &c.reason,
        &c.message,
    );
}

/// Publishes a Warning Event on `regarding` (in its namespace; in the background, a failure
/// is logged at debug). `what` names the problem in the Event's name (a hash of it, of
/// `regarding` and of `note`), so the same problem reported again is one Event.
pub fn warning_event(
    client: &Client,
    regarding: k8s_openapi::api::core::v1::ObjectReference,
    action: &str,
    what: &str,
    reason: &str,
    note: &str,
) {
    use k8s_openapi::{
        api::events::v1::Event,
        apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    };
    let ns = regarding.namespace.clone().unwrap_or_default();
    let name = regarding.name.clone().unwrap_or_default();
    let hash = mcs_merge::alloc::fnv1a(format!("{ns}/{name}/{what}/{note}").as_bytes());
    let base: String = name.chars().take(200).collect();
    let ev = Event {
        metadata: ObjectMeta {
            name: Some(format!("{base}.mcs-{hash:016x}")),
            namespace: Some(ns.clone()),
            ..Default::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        type_: Some("Warning".into()),
        reason: Some(reason.chars().take(128).collect()),
        action: Some(action.into()),
        note: Some(note.chars().take(1024).collect()),
        regarding: Some(regarding),
        reporting_controller: Some("mcs-dataplane.io/mcs-controller".into()),
        reporting_instance: Some("mcs-controller".into()),
        ..Default::default()
    };
    let api: Api<Event> = Api::namespaced(client.clone(), &ns);
    tokio::spawn(async move {
        match api.create(&kube::api::PostParams::default(), &ev).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => tracing::debug!(error = %e, "could not publish an Event"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_waits_1s_doubling_to_60s_on_its_own() {
        let mut b = Backoff::default();
        let t0 = Instant::now();
        let web: Target = (IMPORT, ("shop".into(), "web".into()));
        let other: Target = (IMPORT, ("shop".into(), "other".into()));
        assert!(!b.waiting(&web, t0) && b.next_due().is_none());
        let mut waits = Vec::new();
        for _ in 0..9 {
            b.fail(web.clone(), web.1.clone(), t0);
            waits.push(b.failed[&web].1.as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert!(b.waiting(&web, t0 + Duration::from_secs(59)));
        assert!(!b.waiting(&web, t0 + Duration::from_secs(60)));
        assert!(!b.waiting(&other, t0), "another object is not held back");
        assert_eq!(b.next_due(), Some(t0 + RETRY_MAX));
        assert_eq!(b.len(), 1);
        assert_eq!(b.due(t0 + RETRY_MAX).collect::<Vec<_>>(), [&web.1]);
        assert_eq!(b.due(t0).count(), 0);
    }

    fn keys(v: &serde_json::Value) -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    }

    #[test]
    fn the_status_merge_patch_names_every_status_field_and_nulls_the_empty_ones() {
        // Every field a status can hold, each set: the patch must name each one (a field added
        // to the type later and not named here would never be removed by a merge patch).
        let full = mcs_api::ServiceImportStatus {
            endpoint_slice_objects: Some(mcs_api::EndpointSliceObjects::Present),
            clusters: vec![mcs_api::ClusterStatus {
                cluster: "c1".into(),
            }],
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: "Ready".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ),
            }],
        };
        let mut si = ServiceImport::new("web", Default::default());
        si.status = Some(full.clone());
        let patch = import_status_patch(&si);
        assert_eq!(keys(&patch), ["status"]);
        assert_eq!(
            keys(&patch["status"]),
            keys(&serde_json::to_value(&full).unwrap())
        );
        assert_eq!(patch["status"]["clusters"][0]["cluster"], "c1");
        assert_eq!(patch["status"]["endpointSliceObjects"], "Present");
        // An import with nothing in its status: every field removed.
        si.status = None;
        let patch = import_status_patch(&si);
        for k in keys(&serde_json::to_value(&full).unwrap()) {
            assert!(patch["status"][&k].is_null(), "{k} is removed");
            assert!(
                patch["status"].as_object().unwrap().contains_key(&k),
                "{k} is named"
            );
        }
    }

    #[test]
    fn the_slice_merge_patch_carries_labels_type_endpoints_and_ports_and_nulls_missing_lists() {
        use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort};
        let mut es = EndpointSlice {
            metadata: kube::api::ObjectMeta {
                name: Some("web-c1-x".into()),
                labels: Some([("a".to_string(), "b".to_string())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: Some(vec![Endpoint {
                addresses: vec!["198.18.0.1".into()],
                ..Default::default()
            }]),
            ports: Some(vec![EndpointPort {
                port: Some(80),
                ..Default::default()
            }]),
        };
        let patch = slice_patch(&es);
        assert_eq!(
            keys(&patch),
            ["addressType", "endpoints", "metadata", "ports"]
        );
        assert_eq!(
            keys(&patch["metadata"]),
            ["labels"],
            "no name, no other metadata"
        );
        assert_eq!(patch["metadata"]["labels"]["a"], "b");
        assert_eq!(patch["endpoints"][0]["addresses"][0], "198.18.0.1");
        assert_eq!(patch["ports"][0]["port"], 80);
        es.endpoints = None;
        es.ports = None;
        let patch = slice_patch(&es);
        assert!(
            patch["endpoints"].is_null() && patch.as_object().unwrap().contains_key("endpoints")
        );
        assert!(patch["ports"].is_null() && patch.as_object().unwrap().contains_key("ports"));
    }
}
