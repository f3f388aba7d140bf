//! Kubernetes Events for rejected objects, rate-limited: at most one per object and reason per
//! [`EVENT_INTERVAL`], and at most [`MAX_EVENTS_PER_FLUSH`] per flush. Publishing happens in a
//! background task and never blocks the sync loop.
//!
//! Every node's agent sees the same objects and rejects them alike, so an Event's name is
//! derived from what it says (object, reason, message): the first node creates it, the others
//! get `409 AlreadyExists` and stop there. A ClusterSet of 1,000 nodes writes one Event per
//! rejection, not 1,000; a rejection only one node makes (its own address, a map full there)
//! has its own text and so its own Event.

use std::{
    collections::HashMap,
    hash::{Hash as _, Hasher as _},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use mcs_model::validate::Rejection;

/// Minimum time between two Events for the same object and reason.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(600);
/// Most Events sent after one flush.
pub const MAX_EVENTS_PER_FLUSH: usize = 20;

/// Publishes rejection Events.
#[derive(Clone)]
pub struct EventSink {
    client: Client,
    instance: String,
    last: HashMap<(String, String), Instant>,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink")
            .field("instance", &self.instance)
            .field("tracked", &self.last.len())
            .finish()
    }
}

/// The Event's name: the object's name and a hash of what the Event says, so that every node
/// that sees the same rejection names it alike.
fn event_name(r: &Rejection, name: &str) -> String {
    // FNV-1a: stable across builds and nodes (std's hasher is not guaranteed to be).
    struct Fnv(u64);
    impl std::hash::Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    r.object.hash(&mut h);
    r.reason.label().hash(&mut h);
    r.message.hash(&mut h);
    // Names are at most 253 characters; keep room for the suffix.
    let base: String = name.chars().take(200).collect();
    format!("{base}.mcs-{:016x}", h.finish())
}

impl EventSink {
    /// A sink reporting as `mcs-agent` from `instance` (the node name).
    pub fn new(client: Client, instance: &str) -> Self {
        Self {
            client,
            instance: instance.into(),
            last: HashMap::new(),
        }
    }

    /// Publishes Events for new rejections, within the rate limits.
    pub fn publish(&mut self, new: &[Rejection]) {
        let now = Instant::now();
        self.last
            .retain(|_, t| now.duration_since(*t) < EVENT_INTERVAL);
        let mut sent = 0;
        for r in new {
            let Some(reference) = object_reference(&r.object) else {
                continue;
            };
            let key = (r.object.clone(), r.reason.label().to_string());
            if self.last.contains_key(&key) || sent >= MAX_EVENTS_PER_FLUSH {
                continue;
            }
            self.last.insert(key, now);
            sent += 1;
            let (Some(ns), Some(name)) = (reference.namespace.clone(), reference.name.clone())
            else {
                continue;
            };
            let event = Event {
                metadata: ObjectMeta {
                    name: Some(event_name(r, &name)),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                },
                event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
                type_: Some("Warning".into()),
                reason: Some("Rejected".into()),
                action: Some("Program".into()),
                note: Some(format!("{}: {}", r.reason.label(), r.message)),
                regarding: Some(reference),
                reporting_controller: Some("mcs-agent".into()),
                reporting_instance: Some(self.instance.clone()),
                ..Default::default()
            };
            let api: Api<Event> = Api::namespaced(self.client.clone(), &ns);
            tokio::spawn(async move {
                match api.create(&PostParams::default(), &event).await {
                    Ok(_) => {}
                    // Another node wrote it first.
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(e) => tracing::debug!(error = %e, "could not publish Event"),
                }
            });
        }
    }
}

/// `ServiceImport ns/name` / `EndpointSlice ns/name` → an ObjectReference.
pub fn object_reference(object: &str) -> Option<ObjectReference> {
    let (kind, rest) = object.split_once(' ')?;
    let (namespace, name) = rest.split_once('/')?;
    let api_version = match kind {
        "ServiceImport" => "multicluster.x-k8s.io/v1beta1",
        "EndpointSlice" => "discovery.k8s.io/v1",
        _ => return None,
    };
    Some(ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(kind.into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..Default::default()
    })
}
