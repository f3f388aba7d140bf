//! One leader per cluster: a `coordination.k8s.io/v1` Lease, held by renewing it every third
//! of its duration. A holder counts as gone when its lease has not changed (same
//! resourceVersion) for a whole duration by *our* clock, so clock skew between replicas does
//! not matter (client-go's rule). Only the leader writes; the others watch and stay ready to
//! take over.

use std::time::{Duration, Instant};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};
use tokio::sync::watch;

/// Where the lease is and who we are.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// This replica's identity (pod name).
    pub identity: String,
    /// How long a lease lasts without renewal.
    pub duration: Duration,
}

/// Runs the election forever, publishing whether we lead on `leader`.
pub async fn run(client: Client, cfg: LeaseConfig, leader: watch::Sender<bool>) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut seen: Option<(String, Instant)> = None;
    loop {
        let lead = match step(&api, &cfg, &mut seen).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, lease = %cfg.name, "lease");
                // Without a renewal we may no longer lead once the duration has passed.
                *leader.borrow()
                    && seen
                        .as_ref()
                        .is_some_and(|(_, t)| t.elapsed() < cfg.duration)
            }
        };
        if lead != *leader.borrow() {
            if lead {
                tracing::info!(identity = %cfg.identity, lease = %format!("{}/{}", cfg.namespace, cfg.name), "leading");
            } else {
                tracing::warn!(identity = %cfg.identity, "no longer leading");
            }
            let _ = leader.send(lead);
        }
        tokio::time::sleep(cfg.duration / 3).await;
    }
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

async fn step(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    seen: &mut Option<(String, Instant)>,
) -> Result<bool, kube::Error> {
    let secs = i32::try_from(cfg.duration.as_secs())
        .unwrap_or(i32::MAX)
        .max(1);
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                namespace: Some(cfg.namespace.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(secs),
                acquire_time: Some(now()),
                renew_time: Some(now()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(l) => {
                *seen = l.metadata.resource_version.map(|v| (v, Instant::now()));
                Ok(true)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        };
    };
    let rv = lease.metadata.resource_version.clone().unwrap_or_default();
    let spec = lease.spec.get_or_insert_with(Default::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let changed = seen.as_ref().is_none_or(|(v, _)| *v != rv);
    if changed {
        *seen = Some((rv.clone(), Instant::now()));
    }
    let held_for = seen.as_ref().map_or(Duration::ZERO, |(_, t)| t.elapsed());
    let mine = holder == cfg.identity;
    let expired = holder.is_empty() || held_for > cfg.duration;
    if !mine && !expired {
        return Ok(false);
    }
    if !mine {
        tracing::info!(previous = %holder, "taking over the lease");
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(now());
    spec.lease_duration_seconds = Some(secs);
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(l) => {
            *seen = l.metadata.resource_version.map(|v| (v, Instant::now()));
            Ok(true)
        }
        // Someone else renewed or took it first.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
