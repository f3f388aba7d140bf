//! Kubernetes Events for rejected objects, rate-limited: at most one per object and reason per
//! [`EVENT_INTERVAL`], and at most [`MAX_EVENTS_PER_FLUSH`] per flush. Publishing happens in a
//! background task and never blocks the controller.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use mcs_model::validate::Rejection;

/// Minimum time between two Events for the same object and reason.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(600);
/// Most Events sent after one flush.
pub const MAX_EVENTS_PER_FLUSH: usize = 20;

/// Publishes rejection Events.
#[derive(Clone)]
pub struct EventSink {
    recorder: Recorder,
    last: HashMap<(String, String), Instant>,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink")
            .field("tracked", &self.last.len())
            .finish()
    }
}

impl EventSink {
    /// A sink reporting as `mcs-agent` from `instance` (the node name).
    pub fn new(client: Client, instance: &str) -> Self {
        let reporter = Reporter {
            controller: "mcs-agent".into(),
            instance: Some(instance.into()),
        };
        Self {
            recorder: Recorder::new(client, reporter),
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
            let event = Event {
                type_: EventType::Warning,
                reason: "Rejected".into(),
                note: Some(format!("{}: {}", r.reason.label(), r.message)),
                action: "Program".into(),
                secondary: None,
            };
            let recorder = self.recorder.clone();
            tokio::spawn(async move {
                if let Err(e) = recorder.publish(&event, &reference).await {
                    tracing::debug!(error = %e, "could not publish Event");
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
