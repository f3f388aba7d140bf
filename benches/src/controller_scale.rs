//! The MCS controller at scale (`mcs-bench controller-scale`): N real clusters (etcd +
//! kube-apiserver each), `mcs-controller` in each, `exports` services exported across them
//! (each by one cluster, with a Service and one EndpointSlice of two endpoints). Reports:
//! the time to create them and for every cluster to hold every import and slice; then, one at
//! a time, the time from a ServiceExport create to its ServiceImport in every cluster, and
//! from an endpoint change in the exporting cluster to the MCS slice in another (p50, p99);
//! and each controller's RSS and CPU time; and what loaded the API servers while the exports
//! were written and imported (requests by verb and resource, with the time the API servers
//! spent in them, from their own `apiserver_request_*` metrics). With `--no-controller` the
//! same writes run with no controller: the baseline of the write time. A bench: it asserts
//! nothing about speed.
//!
//! Every cluster's imports, MCS slices and exports are followed by watches opened before the
//! first write (not by lists of every object again and again, which loaded the API servers
//! being measured); the export latency ends at the watch event of the last cluster.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::Condition,
};
use kube::{
    Api, Client, ResourceExt as _,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use mcs_api::{ServiceExport, ServiceImport};
use mcs_test_support::apiserver::{self, ApiServer, User};
use serde::Serialize;

use crate::harness::procs::{Proc, catch_signals, cpu_seconds, interrupted, rss_mib, sibling};

const NS: &str = "scale";
const RANGE: &str = "198.18.64.0/18";

/// What was measured.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Clusters.
    pub clusters: usize,
    /// Exported services.
    pub exports: usize,
    /// Seconds to write every Service, EndpointSlice and ServiceExport.
    pub create_s: f64,
    /// Seconds from the first write until every cluster held every import and slice.
    pub converge_s: f64,
    /// ServiceExport create → ServiceImport in every cluster, ms (p50, p99, samples).
    pub export_ms: (f64, f64, usize),
    /// Endpoint readiness change → the MCS slice in another cluster, ms (p50, p99, samples).
    pub endpoint_ms: (f64, f64, usize),
    /// Each controller's RSS at the end, MiB.
    pub rss_mib: Vec<f64>,
    /// Whether controllers ran (false: the baseline, writes only).
    pub controllers: bool,
    /// CPU seconds of all controllers from the first write to convergence.
    pub controller_cpu_s: f64,
    /// CPU seconds of all controllers per 1,000 endpoint changes (the one-at-a-time phase).
    pub controller_cpu_per_1000_changes_s: f64,
    /// CPU seconds of all API servers from the first write to convergence
    /// (`process_cpu_seconds_total`).
    pub apiserver_cpu_s: f64,
    /// CPU seconds of all API servers per 1,000 endpoint changes (the one-at-a-time phase:
    /// the bench's read and patch of the source slice and its watch of the other cluster's,
    /// plus what the controllers read and write for each change).
    pub apiserver_cpu_per_1000_changes_s: f64,
    /// Requests the API servers served from the first write to convergence, all clusters:
    /// (verb, resource, count, seconds spent), most time first.
    pub requests: Vec<(String, String, f64, f64)>,
    /// Services nobody exports in each cluster (each with one EndpointSlice of ten
    /// endpoints), written before the controllers start.
    pub unexported: usize,
    /// Changes to those unexported slices, after the latencies were measured.
    pub churn: Option<Churn>,
}

/// Changes to slices of Services nobody exports, and what they cost the controllers.
#[derive(Debug, Serialize)]
pub struct Churn {
    /// Changes written (each a patch of one unexported slice, spread over the clusters).
    pub changes: usize,
    /// Seconds they took (the rate asked for, or the most the API servers took).
    pub seconds: f64,
    /// CPU seconds of all controllers over those seconds.
    pub controller_cpu_s: f64,
    /// EndpointSlices the controllers received from their members' watches meanwhile (sum
    /// of `mcs_controller_member_watch_objects_total{kind="EndpointSlice"}` over every
    /// controller and member).
    pub slices_received: f64,
}

/// What one run does.
#[derive(Debug, Clone)]
pub struct Params {
    /// Clusters (at least 2).
    pub clusters: usize,
    /// Exported services, spread over the clusters.
    pub exports: usize,
    /// One-at-a-time samples of each latency.
    pub samples: usize,
    /// The controller binary (default: next to this one).
    pub controller: Option<PathBuf>,
    /// Whether controllers run (false: the writes alone, the baseline).
    pub with_controllers: bool,
    /// The longest wait for convergence and for each sample.
    pub wait: Duration,
    /// Services nobody exports, per cluster.
    pub unexported: usize,
    /// Changes per second to unexported slices, for `churn_secs` (0: none).
    pub churn_per_s: usize,
    /// How long the churn lasts.
    pub churn_secs: u64,
}

/// What the API servers' metrics say: requests (count, seconds) by (verb, resource), and CPU.
#[derive(Debug, Default, Clone)]
struct Load {
    requests: std::collections::BTreeMap<(String, String), (f64, f64)>,
    cpu_s: f64,
}

impl Load {
    /// Adds one API server's `/metrics` text.
    fn add(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            if series == "process_cpu_seconds_total" {
                self.cpu_s += v;
                continue;
            }
            let (count, name) = if let Some(l) = series.strip_prefix("apiserver_request_total{") {
                (true, l)
            } else if let Some(l) = series.strip_prefix("apiserver_request_duration_seconds_sum{") {
                (false, l)
            } else {
                continue;
            };
            let label = |k: &str| {
                name.split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                    .map(|v| v.trim_end_matches('}').trim_end_matches('"').to_string())
                    .unwrap_or_default()
            };
            let e = self
                .requests
                .entry((label("verb"), label("resource")))
                .or_default();
            if count {
                e.0 += v;
            } else {
                e.1 += v;
            }
        }
    }

    /// What happened between `before` and `self`, most time first.
    fn since(&self, before: &Load) -> (f64, Vec<(String, String, f64, f64)>) {
        let mut v: Vec<(String, String, f64, f64)> = self
            .requests
            .iter()
            .map(|((verb, res), (n, s))| {
                let (n0, s0) = before
                    .requests
                    .get(&(verb.clone(), res.clone()))
                    .copied()
                    .unwrap_or_default();
                (verb.clone(), res.clone(), n - n0, s - s0)
            })
            .filter(|r| r.2 > 0.0)
            .collect();
        v.sort_by(|a, b| b.3.total_cmp(&a.3));
        (self.cpu_s - before.cpu_s, v)
    }
}

async fn load(clients: &[Client]) -> anyhow::Result<Load> {
    let mut l = Load::default();
    for k in clients {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        l.add(&k.request_text(req).await?);
    }
    Ok(l)
}

fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("object literal")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Writes service `name` (Service, EndpointSlice, ServiceExport) into `k`.
async fn export(k: &Client, name: &str, i: usize) -> anyhow::Result<()> {
    service(k, name, i).await?;
    service_export(k, name).await
}

/// Writes Service `name` (port 80 → 8080, selecting `app: name`) into `k`.
async fn create_service(k: &Client, name: &str) -> anyhow::Result<()> {
    let svc: Service = obj(serde_json::json!({
        "metadata": { "name": name },
        "spec": { "selector": { "app": name },
                  "ports": [{ "name": "http", "port": 80, "targetPort": 8080 }] }
    }));
    Api::<Service>::namespaced(k.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await?;
    Ok(())
}

/// Writes service `name`'s Service and EndpointSlice (its `i`-th pair of addresses) into `k`.
async fn service(k: &Client, name: &str, i: usize) -> anyhow::Result<()> {
    let a = |n: usize| format!("198.19.{}.{}", (n / 250) % 250, n % 250 + 2);
    create_service(k, name).await?;
    let es: EndpointSlice = obj(serde_json::json!({
        // Written as Kubernetes' EndpointSlice controller would (no controller-manager here).
        "metadata": { "name": format!("{name}-a"), "labels": {
            "kubernetes.io/service-name": name,
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" } },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": [{ "addresses": [a(2 * i)], "conditions": { "ready": true } },
                      { "addresses": [a(2 * i + 1)], "conditions": { "ready": true } }]
    }));
    Api::<EndpointSlice>::namespaced(k.clone(), NS)
        .create(&PostParams::default(), &es)
        .await?;
    Ok(())
}

/// Writes Service `name`, nobody exports it, with one EndpointSlice of ten endpoints.
async fn unexported(k: &Client, name: &str, i: usize) -> anyhow::Result<()> {
    create_service(k, name).await?;
    Api::<EndpointSlice>::namespaced(k.clone(), NS)
        .create(&PostParams::default(), &unexported_slice(name, i, 0))
        .await?;
    Ok(())
}

/// The EndpointSlice of unexported Service `name` (its `i`-th), version `v` of its
/// addresses (in 198.18.128.0/17).
fn unexported_slice(name: &str, i: usize, v: usize) -> EndpointSlice {
    let eps: Vec<serde_json::Value> = (0..10)
        .map(|e| {
            let n = (i * 10 + e + v) % (128 * 256 - 2) + 1;
            serde_json::json!({ "addresses": [format!("198.18.{}.{}", 128 + n / 256, n % 256)],
                                "conditions": { "ready": true } })
        })
        .collect();
    obj(serde_json::json!({
        "metadata": { "name": format!("{name}-a"), "labels": {
            "kubernetes.io/service-name": name,
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" } },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": eps
    }))
}

/// The sum of `mcs_controller_member_watch_objects_total{…kind="EndpointSlice"}` on the
/// controllers' metrics `ports`.
fn slices_received(ports: &[u16]) -> f64 {
    use std::io::{Read as _, Write as _};
    let mut sum = 0.0;
    for port in ports {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", *port)) else {
            continue;
        };
        let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        sum += text
            .lines()
            .filter(|l| {
                l.starts_with("mcs_controller_member_watch_objects_total{")
                    && l.contains("kind=\"EndpointSlice\"")
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>();
    }
    sum
}

/// Writes the ServiceExport of service `name` into `k`.
async fn service_export(k: &Client, name: &str) -> anyhow::Result<()> {
    let se: ServiceExport = obj(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
        "metadata": { "name": name }, "spec": {}
    }));
    Api::<ServiceExport>::namespaced(k.clone(), NS)
        .create(&PostParams::default(), &se)
        .await?;
    Ok(())
}

/// What one cluster holds of the bench's imports, MCS slices and exports, kept by watches
/// (opened before the first write, so their lists are small and no event is missed).
/// Counting by watch instead of listing every object of every cluster again and again keeps
/// the bench's own reads from loading the API servers it measures.
struct Seen {
    state: std::sync::Mutex<SeenState>,
    /// Woken by every event of every cluster's watches (one for all: [`until`] waits on it).
    changed: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct SeenState {
    /// Import name → when it was first seen with a ClusterSetIP (where the export latency
    /// ends: what the agents need).
    imported: HashMap<String, Instant>,
    /// Imports whose status is written too (`Ready=True`).
    complete: HashSet<String>,
    /// MCS slice names.
    slices: HashSet<String>,
    /// Exports of this cluster whose conditions say `Valid=True` and `Ready=True`.
    exports_ready: HashSet<String>,
}

type Put<K> = fn(&mut SeenState, &K, Instant);
type Forget = fn(&mut SeenState, &str);

fn is_true(conds: &[Condition], type_: &str) -> bool {
    conds.iter().any(|c| c.type_ == type_ && c.status == "True")
}

impl Seen {
    /// Starts the watches of `k`'s imports, MCS slices and exports in the bench's namespace;
    /// each event wakes `changed`.
    fn start(k: &Client, changed: &Arc<tokio::sync::Notify>) -> Arc<Self> {
        let seen = Arc::new(Self {
            state: Default::default(),
            changed: changed.clone(),
        });
        let all = watcher::Config::default;
        seen.watch::<ServiceImport>(
            Api::namespaced(k.clone(), NS),
            all(),
            |st, si, now| {
                let name = si.name_any();
                if si.spec.ips.is_empty() {
                    st.imported.remove(&name);
                } else {
                    st.imported.entry(name.clone()).or_insert(now);
                }
                let ready = si
                    .status
                    .as_ref()
                    .is_some_and(|s| is_true(&s.conditions, "Ready"));
                if ready && !si.spec.ips.is_empty() {
                    st.complete.insert(name);
                } else {
                    st.complete.remove(&name);
                }
            },
            |st, name| {
                st.imported.remove(name);
                st.complete.remove(name);
            },
        );
        seen.watch::<EndpointSlice>(
            Api::namespaced(k.clone(), NS),
            all().labels(mcs_api::LABEL_SERVICE_NAME),
            |st, es, _| {
                st.slices.insert(es.name_any());
            },
            |st, name| {
                st.slices.remove(name);
            },
        );
        seen.watch::<ServiceExport>(
            Api::namespaced(k.clone(), NS),
            all(),
            |st, se, _| {
                let c = se.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
                if is_true(c, "Valid") && is_true(c, "Ready") {
                    st.exports_ready.insert(se.name_any());
                } else {
                    st.exports_ready.remove(&se.name_any());
                }
            },
            |st, name| {
                st.exports_ready.remove(name);
            },
        );
        seen
    }

    /// Watches `api` (re-listing after a failure): each object goes through `put`; a deleted
    /// one, or one a re-list no longer holds, through `forget`.
    fn watch<K>(self: &Arc<Self>, api: Api<K>, cfg: watcher::Config, put: Put<K>, forget: Forget)
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
        K::DynamicType: Default,
    {
        use kube::runtime::WatchStreamExt as _;
        let seen = self.clone();
        tokio::spawn(async move {
            let mut w = watcher(api, cfg).default_backoff().boxed();
            // Names listed so far in a re-list, and every name put since (to find the gone).
            let mut listing: Option<HashSet<String>> = None;
            let mut known: HashSet<String> = HashSet::new();
            while let Some(ev) = w.next().await {
                let now = Instant::now();
                let mut st = seen.state.lock().expect("bench state");
                match ev {
                    Err(e) => eprintln!("controller-scale: a watch failed (it lists again): {e}"),
                    Ok(watcher::Event::Init) => listing = Some(HashSet::new()),
                    Ok(watcher::Event::InitApply(o)) => {
                        put(&mut st, &o, now);
                        known.insert(o.name_any());
                        if let Some(l) = listing.as_mut() {
                            l.insert(o.name_any());
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        let listed = listing.take().unwrap_or_default();
                        for gone in known.difference(&listed) {
                            forget(&mut st, gone);
                        }
                        known = listed;
                    }
                    Ok(watcher::Event::Apply(o)) => {
                        put(&mut st, &o, now);
                        known.insert(o.name_any());
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        forget(&mut st, &o.name_any());
                        known.remove(&o.name_any());
                    }
                }
                drop(st);
                seen.changed.notify_waiters();
            }
        });
    }

    /// (complete imports: address and status; MCS slices; this cluster's ready exports).
    fn counts(&self) -> (usize, usize, usize) {
        let st = self.state.lock().expect("bench state");
        (st.complete.len(), st.slices.len(), st.exports_ready.len())
    }

    /// When import `name` was first seen with a ClusterSetIP.
    fn imported(&self, name: &str) -> Option<Instant> {
        self.state
            .lock()
            .expect("bench state")
            .imported
            .get(name)
            .copied()
    }
}

/// Waits until `done` holds, woken by any watch event (`changed`, and at least every
/// 100 ms), or fails after `wait` since `t0` with `what`.
async fn until(
    changed: &tokio::sync::Notify,
    t0: Instant,
    wait: Duration,
    what: &str,
    done: impl Fn() -> bool,
) -> anyhow::Result<()> {
    loop {
        // Registered before `done` is read, so an event in between is not missed.
        let mut woken = std::pin::pin!(changed.notified());
        woken.as_mut().enable();
        if done() {
            return Ok(());
        }
        if t0.elapsed() > wait {
            bail!("{what} after {wait:?}");
        }
        interrupted()?;
        let _ = tokio::time::timeout(Duration::from_millis(100), woken).await;
    }
}

/// Runs the bench as `p` says.
pub fn run(p: Params) -> anyhow::Result<Report> {
    let Params {
        clusters,
        exports,
        samples,
        controller,
        with_controllers,
        wait,
        unexported: idle,
        churn_per_s,
        churn_secs,
    } = p;
    apiserver::prerequisites().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(clusters >= 2, "--clusters must be at least 2");
    // A stop signal ends the run through its clean-up (controllers, API servers).
    catch_signals()?;
    let controller = controller.unwrap_or_else(|| sibling("mcs-controller"));
    anyhow::ensure!(controller.is_file(), "{} not found", controller.display());
    let ids: Vec<String> = (1..=clusters).map(|i| format!("c{i}")).collect();
    let mut servers = Vec::new();
    for id in &ids {
        servers.push(ApiServer::start().with_context(|| format!("starting {id}"))?);
    }
    let dir = tempfile::tempdir()?;
    // MCS_BENCH_KEEP=1 keeps the controllers' logs (and kubeconfig) after the run.
    let dir_path = if std::env::var_os("MCS_BENCH_KEEP").is_some() {
        let kept = dir.keep();
        eprintln!("controller-scale: logs kept in {}", kept.display());
        kept
    } else {
        dir.path().to_path_buf()
    };
    let kc = dir_path.join("clusterset.kubeconfig");
    let members: Vec<(&str, &ApiServer)> =
        ids.iter().map(String::as_str).zip(servers.iter()).collect();
    std::fs::write(
        &kc,
        apiserver::clusterset_kubeconfig(&members, User::Admin)?,
    )?;
    let rt = tokio::runtime::Runtime::new()?;
    let clients: Vec<Client> = rt.block_on(async {
        let mut v = Vec::new();
        for s in &servers {
            v.push(s.client().await);
        }
        v
    });
    rt.block_on(async {
        for k in &clients {
            Api::<Namespace>::all(k.clone())
                .create(
                    &PostParams::default(),
                    &obj(serde_json::json!({ "metadata": { "name": NS } })),
                )
                .await?;
        }
        anyhow::Ok(())
    })?;
    // Services nobody exports, before any controller starts (as in a cluster it is
    // installed into).
    if idle > 0 {
        let t = Instant::now();
        rt.block_on(async {
            futures::stream::iter(0..idle * clients.len())
                .map(|i| {
                    let k = clients[i % clients.len()].clone();
                    let name = format!("idle{}", i / clients.len());
                    async move { unexported(&k, &name, i).await }
                })
                .buffer_unordered(32)
                .map(|r| r.and_then(|()| interrupted()))
                .try_collect::<Vec<()>>()
                .await
        })?;
        eprintln!(
            "controller-scale: {idle} unexported Services per cluster written in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let mut procs = Vec::new();
    let mut metrics_ports = Vec::new();
    for id in ids.iter().filter(|_| with_controllers) {
        let port = mcs_test_support::ports::unused_port()?;
        metrics_ports.push(port);
        let mut cmd = Command::new(&controller);
        cmd.args(["run", "--cluster-id", id, "--clusterset-ip-cidr", RANGE])
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .arg("--no-leader-election")
            // Every export in one namespace: the bench measures scale, not the limits.
            .args(["--exports-per-namespace", "0", "--exports-per-member", "0"])
            .arg("--clusterset-kubeconfig")
            .arg(&kc);
        let log = dir_path.join(format!("controller-{id}.log"));
        procs.push(Proc::spawn(&format!("mcs-controller {id}"), cmd, &log)?);
    }

    // Every cluster's imports, MCS slices and exports, watched from before the first write.
    let changed = Arc::new(tokio::sync::Notify::new());
    let seen: Vec<Arc<Seen>> = {
        let _rt = rt.enter();
        clients.iter().map(|k| Seen::start(k, &changed)).collect()
    };
    let cpu = |procs: &[Proc]| procs.iter().map(|p| cpu_seconds(p.pid())).sum::<f64>();
    let load0 = rt.block_on(load(&clients))?;
    let cpu0 = cpu(&procs);
    // Bulk: every export, 32 writes in flight.
    let t0 = Instant::now();
    rt.block_on(async {
        futures::stream::iter(0..exports)
            .map(|i| {
                let k = clients[i % clients.len()].clone();
                async move { export(&k, &format!("s{i}"), i).await }
            })
            .buffer_unordered(32)
            .map(|r| r.and_then(|()| interrupted()))
            .try_collect::<Vec<()>>()
            .await
    })?;
    let create_s = t0.elapsed().as_secs_f64();
    eprintln!("controller-scale: {exports} exports written in {create_s:.1} s");
    if !with_controllers {
        let (apiserver_cpu_s, requests) = rt.block_on(load(&clients))?.since(&load0);
        return Ok(Report {
            clusters,
            exports,
            create_s,
            converge_s: f64::NAN,
            export_ms: (f64::NAN, f64::NAN, 0),
            endpoint_ms: (f64::NAN, f64::NAN, 0),
            rss_mib: Vec::new(),
            controllers: false,
            controller_cpu_s: 0.0,
            controller_cpu_per_1000_changes_s: 0.0,
            apiserver_cpu_s,
            apiserver_cpu_per_1000_changes_s: 0.0,
            requests,
            unexported: idle,
            churn: None,
        });
    }
    // Converged: every cluster holds every import (address and status) and slice, and every
    // export's conditions say it is valid and ready.
    let converged = rt.block_on(until(&changed, t0, wait, "not converged", || {
        let c: Vec<_> = seen.iter().map(|s| s.counts()).collect();
        c.iter().all(|&(i, s, _)| i == exports && s == exports)
            && c.iter().map(|c| c.2).sum::<usize>() == exports
    }));
    if let Err(e) = converged {
        let got: Vec<String> = ids
            .iter()
            .zip(&seen)
            .map(|(id, s)| {
                let (i, sl, ex) = s.counts();
                format!("{id}: {i} imports, {sl} slices, {ex} exports ready")
            })
            .collect();
        bail!(
            "{e} (of {exports}: {}; a larger ClusterSet needs a longer --wait-secs)",
            got.join("; ")
        );
    }
    let converge_s = t0.elapsed().as_secs_f64();
    let controller_cpu_s = cpu(&procs) - cpu0;
    let (apiserver_cpu_s, requests) = rt.block_on(load(&clients))?.since(&load0);
    eprintln!(
        "controller-scale: every cluster holds every import and slice after {converge_s:.1} s"
    );

    // One at a time: a new export until imported everywhere.
    let mut export_ms = Vec::new();
    for j in 0..samples {
        let k = &clients[j % clients.len()];
        let name = format!("x{j}");
        let each = rt.block_on(async {
            service(k, &name, exports + j).await?;
            // From the ServiceExport's create to its import (with a ClusterSetIP) seen by the
            // watch of every cluster.
            let t = Instant::now();
            service_export(k, &name).await?;
            let what = format!("{name} not imported everywhere");
            until(&changed, t, wait, &what, || {
                seen.iter().all(|s| s.imported(&name).is_some())
            })
            .await?;
            let each: Vec<f64> = seen
                .iter()
                .filter_map(|s| s.imported(&name))
                .map(|l| l.saturating_duration_since(t).as_secs_f64() * 1e3)
                .collect();
            anyhow::Ok(each)
        })?;
        let ms = each.iter().copied().fold(0.0, f64::max);
        // Each sample in the log (with each cluster's time), so an outlier can be placed.
        eprintln!(
            "controller-scale: {name} (exported by c{}) imported everywhere in {ms:.0} ms ({}), {:.1} s after the first write",
            j % clients.len() + 1,
            each.iter()
                .enumerate()
                .map(|(i, m)| format!("c{}: {m:.0}", i + 1))
                .collect::<Vec<_>>()
                .join(", "),
            t0.elapsed().as_secs_f64()
        );
        export_ms.push(ms);
    }

    // One at a time: an endpoint goes not ready in the exporting cluster; seen in another.
    let mut endpoint_ms = Vec::new();
    let cpu1 = cpu(&procs);
    let load1 = rt.block_on(load(&clients))?;
    for j in 0..samples.min(exports) {
        let from = j % clients.len();
        let to = (from + 1) % clients.len();
        let name = format!("s{j}");
        let ms = rt.block_on(async {
            // A watch of the other cluster's MCS slices of the service, listed before the
            // change (no event missed; no list of every slice per poll).
            let dst: Api<EndpointSlice> = Api::namespaced(clients[to].clone(), NS);
            let selector = format!("multicluster.kubernetes.io/service-name={name}");
            let mut seen = watcher(dst, watcher::Config::default().labels(&selector)).boxed();
            loop {
                match seen.try_next().await? {
                    Some(watcher::Event::InitDone) => break,
                    Some(_) => {}
                    None => bail!("the watch of {name}'s slices ended"),
                }
            }
            let src: Api<EndpointSlice> = Api::namespaced(clients[from].clone(), NS);
            let mut es = src.get(&format!("{name}-a")).await?;
            if let Some(eps) = es.endpoints.as_mut() {
                eps[0].conditions = Some(obj(serde_json::json!({ "ready": false })));
            }
            src.patch(
                &format!("{name}-a"),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "endpoints": es.endpoints })),
            )
            .await?;
            let t = Instant::now();
            let not_ready = |s: &EndpointSlice| {
                s.endpoints.as_ref().is_some_and(|e| {
                    e.first()
                        .and_then(|e| e.conditions.as_ref())
                        .and_then(|c| c.ready)
                        == Some(false)
                })
            };
            tokio::time::timeout(wait, async {
                while let Some(ev) = seen.try_next().await? {
                    if let watcher::Event::Apply(s) | watcher::Event::InitApply(s) = &ev
                        && not_ready(s)
                    {
                        return anyhow::Ok(());
                    }
                    interrupted()?;
                }
                bail!("the watch of {name}'s slices ended")
            })
            .await
            .with_context(|| format!("{name}'s endpoint change not seen within {wait:?}"))??;
            anyhow::Ok(t.elapsed().as_secs_f64() * 1e3)
        })?;
        eprintln!(
            "controller-scale: {name}'s endpoint change (c{} → c{}) seen in {ms:.0} ms, {:.1} s after the first write",
            from + 1,
            to + 1,
            t0.elapsed().as_secs_f64()
        );
        endpoint_ms.push(ms);
    }
    let changes_cpu = cpu(&procs) - cpu1;
    let (changes_apiserver_cpu, _) = rt.block_on(load(&clients))?.since(&load1);
    // Changes to slices nobody exports, at the rate asked (bounded in count and time).
    let churn = if churn_per_s > 0 && idle > 0 && churn_secs > 0 {
        let total = churn_per_s * churn_secs as usize;
        let received0 = slices_received(&metrics_ports);
        let cpu2 = cpu(&procs);
        let t = Instant::now();
        rt.block_on(async {
            futures::stream::iter(0..total)
                .map(|c| {
                    let k = clients[c % clients.len()].clone();
                    let i = (c / clients.len()) % idle;
                    let due = t + Duration::from_secs_f64(c as f64 / churn_per_s as f64);
                    let name = format!("idle{i}");
                    let es = unexported_slice(&name, i * clients.len(), c + 1);
                    async move {
                        tokio::time::sleep_until(due.into()).await;
                        Api::<EndpointSlice>::namespaced(k, NS)
                            .patch(
                                &format!("{name}-a"),
                                &PatchParams::default(),
                                &Patch::Merge(serde_json::json!({ "endpoints": es.endpoints })),
                            )
                            .await?;
                        interrupted()
                    }
                })
                .buffer_unordered(64)
                .try_collect::<Vec<()>>()
                .await
        })?;
        let seconds = t.elapsed().as_secs_f64();
        // One exported change after them: once it is imported, the controllers' watches
        // delivered everything written before it.
        let name = "s0";
        rt.block_on(async {
            let src: Api<EndpointSlice> = Api::namespaced(clients[0].clone(), NS);
            let dst: Api<EndpointSlice> = Api::namespaced(clients[1].clone(), NS);
            src.patch(
                &format!("{name}-a"),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "endpoints": [
                    { "addresses": ["198.19.255.254"], "conditions": { "ready": true } }] })),
            )
            .await?;
            let selector = format!("multicluster.kubernetes.io/service-name={name}");
            let t = Instant::now();
            loop {
                let got = dst
                    .list(&kube::api::ListParams::default().labels(&selector))
                    .await?;
                let seen = got.items.iter().any(|s| {
                    s.endpoints
                        .iter()
                        .flatten()
                        .any(|e| e.addresses.iter().any(|a| a == "198.19.255.254"))
                });
                if seen {
                    return anyhow::Ok(());
                }
                if t.elapsed() > wait {
                    bail!("the marker change of {name} was not imported within {wait:?}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })?;
        let controller_cpu_s = cpu(&procs) - cpu2;
        let slices_received = slices_received(&metrics_ports) - received0;
        eprintln!(
            "controller-scale: {total} unexported slice changes in {seconds:.1} s: controllers used {controller_cpu_s:.2} CPU-s and received {slices_received} slices"
        );
        Some(Churn {
            changes: total,
            seconds,
            controller_cpu_s,
            slices_received,
        })
    } else {
        None
    };
    let rss: Vec<f64> = procs
        .iter()
        .map(|p| rss_mib(p.pid()).unwrap_or(0.0))
        .collect();
    drop(procs);
    let n_e = export_ms.len();
    let n_p = endpoint_ms.len();
    Ok(Report {
        clusters,
        exports,
        create_s,
        converge_s,
        export_ms: (pct(&mut export_ms, 0.5), pct(&mut export_ms, 0.99), n_e),
        endpoint_ms: (pct(&mut endpoint_ms, 0.5), pct(&mut endpoint_ms, 0.99), n_p),
        rss_mib: rss,
        controllers: true,
        controller_cpu_s,
        controller_cpu_per_1000_changes_s: if n_p == 0 {
            0.0
        } else {
            changes_cpu / n_p as f64 * 1000.0
        },
        apiserver_cpu_s,
        apiserver_cpu_per_1000_changes_s: if n_p == 0 {
            0.0
        } else {
            changes_apiserver_cpu / n_p as f64 * 1000.0
        },
        requests,
        unexported: idle,
        churn,
    })
}

/// The report as a markdown table row (with a header), and what loaded the API servers.
pub fn markdown(r: &Report, command: &str) -> String {
    let mut out = String::from(
        "| clusters | exports | controllers | written in | converged (every import and slice everywhere) | export → imported everywhere p50 / p99 | endpoint change → other cluster p50 / p99 | controller RSS | controller CPU (writes + converge) | controller CPU per 1,000 endpoint changes | API server CPU (writes + converge) | API server CPU per 1,000 endpoint changes |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let ms = |(p50, p99, n): (f64, f64, usize)| {
        if n == 0 {
            "–".to_string()
        } else {
            format!("{p50:.0} / {p99:.0} ms ({n} samples)")
        }
    };
    out.push_str(&format!(
        "| {} | {} | {} | {:.1} s | {} | {} | {} | {} | {} | {} | {:.0} s | {} |\n\n",
        r.clusters,
        r.exports,
        if r.controllers {
            "yes"
        } else {
            "none (baseline)"
        },
        r.create_s,
        if r.controllers {
            format!("{:.1} s", r.converge_s)
        } else {
            "–".into()
        },
        ms(r.export_ms),
        ms(r.endpoint_ms),
        if r.controllers {
            r.rss_mib
                .iter()
                .map(|m| format!("{m:.0}"))
                .collect::<Vec<_>>()
                .join(" / ")
                + " MiB"
        } else {
            "–".into()
        },
        if r.controllers {
            format!("{:.0} s", r.controller_cpu_s)
        } else {
            "–".into()
        },
        if r.controllers {
            format!("{:.1} s", r.controller_cpu_per_1000_changes_s)
        } else {
            "–".into()
        },
        r.apiserver_cpu_s,
        if r.controllers {
            format!("{:.1} s", r.apiserver_cpu_per_1000_changes_s)
        } else {
            "–".into()
        },
    ));
    if r.unexported > 0 {
        out.push_str(&format!(
            "Services nobody exports: {} per cluster, each with one EndpointSlice of ten endpoints, written before the controllers started.\n\n",
            r.unexported
        ));
    }
    if let Some(c) = &r.churn {
        out.push_str(&format!(
            "Changes to their slices: {} in {:.1} s ({:.0}/s): the controllers used {:.2} CPU-s ({:.1} % of one core) and received {:.0} EndpointSlices from their members' watches (the exported marker change after them included).\n\n",
            c.changes,
            c.seconds,
            c.changes as f64 / c.seconds.max(1e-9),
            c.controller_cpu_s,
            100.0 * c.controller_cpu_s / c.seconds.max(1e-9),
            c.slices_received
        ));
    }
    out.push_str("API server requests from the first write to convergence (all clusters; time spent in them):\n\n| verb | resource | requests | seconds |\n|---|---|---|---|\n");
    for (verb, res, n, secs) in r.requests.iter().take(10) {
        out.push_str(&format!("| {verb} | {res} | {n:.0} | {secs:.1} |\n"));
    }
    out.push_str(&format!("\nCommand: `{command}`\n"));
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn api_server_load_is_read_by_verb_and_resource() {
        let mut before = super::Load::default();
        before.add(
            "process_cpu_seconds_total 10\n\
             apiserver_request_total{code=\"201\",component=\"apiserver\",group=\"\",resource=\"services\",scope=\"resource\",verb=\"POST\",version=\"v1\"} 5\n",
        );
        let mut after = super::Load::default();
        after.add(
            "# HELP x\nprocess_cpu_seconds_total 12.5\n\
             apiserver_request_total{code=\"201\",component=\"apiserver\",group=\"\",resource=\"services\",scope=\"resource\",verb=\"POST\",version=\"v1\"} 9\n\
             apiserver_request_total{code=\"200\",resource=\"serviceimports\",verb=\"APPLY\"} 3\n\
             apiserver_request_total{code=\"409\",resource=\"serviceimports\",verb=\"APPLY\"} 1\n\
             apiserver_request_duration_seconds_sum{resource=\"serviceimports\",verb=\"APPLY\"} 0.5\n",
        );
        let (cpu, reqs) = after.since(&before);
        assert_eq!(cpu, 2.5);
        assert_eq!(
            reqs,
            [
                ("APPLY".into(), "serviceimports".into(), 4.0, 0.5),
                ("POST".into(), "services".into(), 4.0, 0.0),
            ]
        );
    }
}
