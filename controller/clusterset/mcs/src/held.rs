//! What the controller keeps of the objects it wrote into its own cluster (ServiceImports,
//! MCS EndpointSlices) and of the conditions it wrote on ServiceExports: only what a pass
//! reads (whether an import is ours, its ClusterSetIPs, each condition's transition time)
//! and, for everything the writer compares, a [`Fingerprint`].
//!
//! The writer compares what it wants with what the cluster holds; holding a copy of every
//! object it wrote (with its endpoints, ports and labels) for that was most of the
//! controller's memory at 10,000 exports. The fingerprint of the wanted object is computed
//! the same way at comparison time ([`slice_content`], [`import_spec`], ...), so "same"
//! means what it meant with whole objects: equal as written (JSON, maps in key order).
//!
//! A fingerprint is 128 bits of two SipHash-1-3 functions with random keys drawn once per
//! process, so nobody who can write into the cluster can make a differing object look the
//! same (they do not know the keys), and two differing objects meet the same value by chance
//! with a probability of 2⁻¹²⁸.

use std::{
    hash::{BuildHasher as _, DefaultHasher, Hasher as _, RandomState},
    sync::{
        LazyLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use k8s_openapi::{
    api::discovery::v1::EndpointSlice,
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use mcs_api::{EndpointSliceObjects, ServiceImport};
use serde::Serialize;

use crate::{MANAGED_LABEL, MANAGER};

/// A keyed 128-bit hash of a value as serialised (see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(u64, u64);

static KEYS: LazyLock<(RandomState, RandomState)> =
    LazyLock::new(|| (RandomState::new(), RandomState::new()));

/// A value that could not be serialised gets a fingerprint nothing else has (it is written
/// again, never taken as the same).
static UNIQUE: AtomicU64 = AtomicU64::new(0);

struct Sink(DefaultHasher, DefaultHasher);

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.write(b);
        self.1.write(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Fingerprint {
    /// The fingerprint of `v` as JSON (streamed into the hashers, nothing allocated).
    pub fn of<T: Serialize + ?Sized>(v: &T) -> Self {
        let mut s = Sink(KEYS.0.build_hasher(), KEYS.1.build_hasher());
        match serde_json::to_writer(&mut s, v) {
            Ok(()) => Self(s.0.finish(), s.1.finish()),
            Err(_) => Self(u64::MAX, UNIQUE.fetch_add(1, Ordering::Relaxed)),
        }
    }
}

/// The labels this controller writes on its slices (the same four keys for every slice).
const SLICE_LABELS: [&str; 4] = [
    mcs_api::LABEL_SERVICE_NAME,
    mcs_api::LABEL_SOURCE_CLUSTER,
    mcs_api::LABEL_MANAGED_BY,
    mcs_api::LABEL_SOURCE_MANAGED_BY,
];

/// What the writer compares of a slice of ours: our labels (a label someone else added is not
/// ours to remove, and a merge patch could not: comparing it would write the slice again at
/// every pass), address type, endpoints, ports.
pub fn slice_content(es: &EndpointSlice) -> Fingerprint {
    let labels = es.metadata.labels.as_ref();
    let ours: [Option<&String>; 4] = SLICE_LABELS.map(|k| labels.and_then(|l| l.get(k)));
    Fingerprint::of(&(ours, &es.address_type, &es.endpoints, &es.ports))
}

/// What the writer compares of an import's spec write: the spec and the annotations.
pub fn import_spec(si: &ServiceImport) -> Fingerprint {
    Fingerprint::of(&(&si.spec, &si.metadata.annotations))
}

/// What the writer compares of an import's status clusters.
pub fn import_clusters(si: &ServiceImport) -> Fingerprint {
    Fingerprint::of(&si.status.as_ref().map(|s| &s.clusters))
}

/// `status.endpointSliceObjects` of an import.
fn endpoint_slice_objects(si: &ServiceImport) -> Option<EndpointSliceObjects> {
    si.status.as_ref().and_then(|s| s.endpoint_slice_objects)
}

/// Set once a status write with `endpointSliceObjects` came back without it: this cluster's
/// ServiceImport CRD is older than mcs-api v0.5.2 and prunes the field. From then on an
/// import held without it counts as holding it, so nothing is written again and again;
/// the controller's next start tries again (apply newer CRDs before upgrading the chart, or
/// restart the controller after: docs/install.md). One flag per process: a controller
/// writes into one cluster.
static ENDPOINT_SLICE_OBJECTS_PRUNED: AtomicBool = AtomicBool::new(false);

/// Notes what a status write of `want` returned: if the API server dropped
/// `endpointSliceObjects`, says so once and stops asking for it (see
/// [`ENDPOINT_SLICE_OBJECTS_PRUNED`]).
pub fn note_written_status(want: &ServiceImport, written: &ServiceImport) {
    if endpoint_slice_objects(want).is_some()
        && endpoint_slice_objects(written).is_none()
        && !ENDPOINT_SLICE_OBJECTS_PRUNED.swap(true, Ordering::Relaxed)
    {
        tracing::warn!(
            "this cluster's ServiceImport CRD drops status.endpointSliceObjects (it is older than mcs-api v0.5.2): imports are written without it, and Gateway API implementations cannot tell that their endpoints are in MCS EndpointSlices; install the CRDs of deploy/crds (or upstream v0.5.2) and restart the controller"
        );
    }
}

/// What the writer compares of a list of conditions: type, status, reason, message and
/// observed generation of each, in any order (transition times are kept, not compared).
pub fn conditions_compared(c: &[Condition]) -> Fingerprint {
    let mut v: Vec<(&str, &str, &str, &str, Option<i64>)> = c
        .iter()
        .map(|c| {
            (
                c.type_.as_str(),
                c.status.as_str(),
                c.reason.as_str(),
                c.message.as_str(),
                c.observed_generation,
            )
        })
        .collect();
    v.sort_unstable();
    Fingerprint::of(&v)
}

/// What is kept of a list of conditions written by us.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldConditions {
    /// Each condition's type, status and last transition time (kept while its status stays).
    since: Vec<(String, String, Time)>,
    /// [`conditions_compared`] of the list.
    compared: Fingerprint,
}

impl Default for HeldConditions {
    fn default() -> Self {
        Self::new(&[])
    }
}

impl HeldConditions {
    /// What is kept of `c`.
    pub fn new(c: &[Condition]) -> Self {
        Self {
            since: c
                .iter()
                .map(|c| {
                    (
                        c.type_.clone(),
                        c.status.clone(),
                        c.last_transition_time.clone(),
                    )
                })
                .collect(),
            compared: conditions_compared(c),
        }
    }

    /// Whether `want` says what these say (times aside).
    pub fn same(&self, want: &[Condition]) -> bool {
        self.compared == conditions_compared(want)
    }

    /// Since when the condition `type_` has had `status`, if it has it.
    pub fn since(&self, type_: &str, status: &str) -> Option<&Time> {
        self.since
            .iter()
            .find(|(t, s, _)| t == type_ && s == status)
            .map(|(_, _, since)| since)
    }
}

/// What the controller keeps of a ServiceImport in its own cluster (ours or another
/// manager's).
#[derive(Clone, Debug, PartialEq)]
pub struct HeldImport {
    /// It carries [`MANAGED_LABEL`] = [`MANAGER`].
    pub ours: bool,
    /// `spec.ips`.
    pub ips: Vec<String>,
    /// Its labels, sorted by key (few: ours and the exported ones).
    pub labels: Vec<(String, String)>,
    /// [`import_spec`].
    pub spec: Fingerprint,
    /// [`import_clusters`].
    pub clusters: Fingerprint,
    /// `status.endpointSliceObjects`.
    pub endpoint_slice_objects: Option<EndpointSliceObjects>,
    /// `status.conditions`.
    pub conditions: HeldConditions,
}

impl HeldImport {
    /// What is kept of `si`.
    pub fn new(si: &ServiceImport) -> Self {
        let labels: Vec<(String, String)> = si
            .metadata
            .labels
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self {
            ours: labels
                .iter()
                .any(|(k, v)| k == MANAGED_LABEL && v == MANAGER),
            ips: si.spec.ips.clone(),
            labels,
            spec: import_spec(si),
            clusters: import_clusters(si),
            endpoint_slice_objects: endpoint_slice_objects(si),
            conditions: HeldConditions::new(si.status.as_ref().map_or(&[][..], |s| &s.conditions)),
        }
    }

    /// The value of its label `k`.
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .binary_search_by(|(lk, _)| lk.as_str().cmp(k))
            .ok()
            .map(|i| self.labels[i].1.as_str())
    }

    /// Whether it holds what we manage of `want`'s spec write: spec and annotations, and our
    /// labels (it may carry others).
    pub fn spec_same(&self, want: &ServiceImport) -> bool {
        self.spec == import_spec(want)
            && want
                .metadata
                .labels
                .iter()
                .flatten()
                .all(|(k, v)| self.label(k) == Some(v.as_str()))
    }

    /// Whether it holds `want`'s status (clusters, `endpointSliceObjects` unless this
    /// cluster's CRD drops it, and conditions, times aside).
    pub fn status_same(&self, want: &ServiceImport) -> bool {
        let want_objects = endpoint_slice_objects(want);
        self.clusters == import_clusters(want)
            && (self.endpoint_slice_objects == want_objects
                || self.endpoint_slice_objects.is_none()
                    && ENDPOINT_SLICE_OBJECTS_PRUNED.load(Ordering::Relaxed))
            && self
                .conditions
                .same(want.status.as_ref().map_or(&[][..], |s| &s.conditions))
    }

    /// Whether it holds all we manage of `want` ([`Self::spec_same`] and
    /// [`Self::status_same`]).
    pub fn same(&self, want: &ServiceImport) -> bool {
        self.spec_same(want) && self.status_same(want)
    }
}

/// What the controller keeps of an MCS EndpointSlice of ours in its own cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldSlice {
    /// Its `multicluster.kubernetes.io/service-name` label.
    pub service: Option<String>,
    /// [`slice_content`].
    pub content: Fingerprint,
}

impl HeldSlice {
    /// What is kept of `es`.
    pub fn new(es: &EndpointSlice) -> Self {
        Self {
            service: es
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(mcs_api::LABEL_SERVICE_NAME))
                .cloned(),
            content: slice_content(es),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::discovery::v1::{Endpoint, EndpointConditions},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
        jiff::Timestamp,
    };
    use mcs_api::{ClusterStatus, ServiceImportSpec, ServiceImportStatus};

    use super::*;

    #[test]
    fn a_slice_compares_by_our_labels_only() {
        let mut es = EndpointSlice {
            metadata: kube::api::ObjectMeta {
                labels: Some(
                    SLICE_LABELS
                        .iter()
                        .map(|k| (k.to_string(), "x".to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: None,
            ports: None,
        };
        let ours = slice_content(&es);
        // A label someone else added changes nothing the writer compares.
        es.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("team".into(), "a".into());
        assert_eq!(slice_content(&es), ours);
        // One of ours that differs, or is gone, does.
        let labels = es.metadata.labels.as_mut().unwrap();
        labels.insert(mcs_api::LABEL_SOURCE_CLUSTER.into(), "y".into());
        assert_ne!(slice_content(&es), ours);
        es.metadata
            .labels
            .as_mut()
            .unwrap()
            .remove(mcs_api::LABEL_SOURCE_CLUSTER);
        assert_ne!(slice_content(&es), ours);
    }

    fn slice(addr: &str, ready: Option<bool>) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some("web-c2-1".into()),
                labels: Some(BTreeMap::from([(
                    mcs_api::LABEL_SERVICE_NAME.into(),
                    "web".into(),
                )])),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: Some(vec![Endpoint {
                addresses: vec![addr.into()],
                conditions: Some(EndpointConditions {
                    ready,
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ports: Some(vec![]),
        }
    }

    #[test]
    fn a_held_slice_is_the_same_exactly_when_its_content_is() {
        let held = HeldSlice::new(&slice("198.18.1.1", Some(true)));
        assert_eq!(held.service.as_deref(), Some("web"));
        assert_eq!(
            held.content,
            slice_content(&slice("198.18.1.1", Some(true)))
        );
        for other in [
            slice("198.18.1.2", Some(true)),
            slice("198.18.1.1", Some(false)),
            slice("198.18.1.1", None),
            EndpointSlice {
                ports: None,
                ..slice("198.18.1.1", Some(true))
            },
            EndpointSlice {
                endpoints: Some(vec![]),
                ..slice("198.18.1.1", Some(true))
            },
        ] {
            assert_ne!(held.content, slice_content(&other), "{other:?}");
        }
        // The name is the key, not the content.
        let mut renamed = slice("198.18.1.1", Some(true));
        renamed.metadata.name = Some("other".into());
        assert_eq!(held.content, slice_content(&renamed));
    }

    fn import(ips: &[&str], reason: &str, extra_label: bool) -> ServiceImport {
        let mut si = ServiceImport::new(
            "web",
            ServiceImportSpec {
                ips: ips.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
        );
        let mut labels = BTreeMap::from([(MANAGED_LABEL.to_string(), MANAGER.to_string())]);
        if extra_label {
            labels.insert("team".into(), "a".into());
        }
        si.metadata.labels = Some(labels);
        si.status = Some(ServiceImportStatus {
            endpoint_slice_objects: Some(mcs_api::EndpointSliceObjects::Present),
            clusters: vec![ClusterStatus {
                cluster: "c2".into(),
            }],
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: reason.into(),
                message: "m".into(),
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
                observed_generation: None,
            }],
        });
        si
    }

    #[test]
    fn a_held_import_compares_spec_our_labels_and_status_but_not_times() {
        let want = import(&["198.19.56.1"], "Ready", false);
        let held = HeldImport::new(&import(&["198.19.56.1"], "Ready", true));
        assert!(held.ours);
        assert_eq!(held.ips, ["198.19.56.1"]);
        assert_eq!(held.label("team"), Some("a"));
        assert!(held.same(&want), "a label of someone else's is left alone");
        assert!(!held.spec_same(&import(&["198.19.56.2"], "Ready", false)));
        assert!(!held.same(&import(&["198.19.56.1"], "Other", false)));
        assert!(held.spec_same(&import(&["198.19.56.1"], "Other", false)));
        let mut later = want.clone();
        later.status.as_mut().unwrap().conditions[0].last_transition_time =
            Time(Timestamp::from_second(60).unwrap());
        assert!(held.same(&later), "transition times are not compared");
        assert_eq!(
            held.conditions.since("Ready", "True"),
            Some(&Time(Timestamp::UNIX_EPOCH))
        );
        assert_eq!(held.conditions.since("Ready", "False"), None);
        let mut annotated = want.clone();
        annotated.metadata.annotations = Some(BTreeMap::from([("a".into(), "b".into())]));
        assert!(!held.spec_same(&annotated));
        // Our label missing: not ours, not the same.
        let mut theirs = want.clone();
        theirs.metadata.labels = None;
        let theirs = HeldImport::new(&theirs);
        assert!(!theirs.ours && !theirs.spec_same(&want));
    }

    #[test]
    fn an_import_without_endpoint_slice_objects_is_written_again_until_the_crd_drops_it() {
        // The flag is the process's: this test alone sets it, and clears it when done.
        struct Forget;
        impl Drop for Forget {
            fn drop(&mut self) {
                ENDPOINT_SLICE_OBJECTS_PRUNED.store(false, Ordering::Relaxed);
            }
        }
        let _forget = Forget;
        let want = import(&["198.19.56.1"], "Ready", false);
        let mut old = want.clone();
        old.status.as_mut().unwrap().endpoint_slice_objects = None;
        let held = HeldImport::new(&old);
        // Written before the field existed: written again, with it.
        assert!(!held.status_same(&want));
        // The write came back without it (a CRD older than v0.5.2 prunes it): from then on
        // the import counts as written, so it is not written on every pass.
        note_written_status(&want, &old);
        assert!(held.status_same(&want));
        // A value that differs still does.
        let mut absent = want.clone();
        absent.status.as_mut().unwrap().endpoint_slice_objects = Some(EndpointSliceObjects::Absent);
        assert!(!HeldImport::new(&absent).status_same(&want));
    }
}
