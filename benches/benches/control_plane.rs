//! Control plane against a real kube-apiserver (not criterion: each sample is an API write):
//!
//! - full sync: time from starting the kube source to the first full table applied;
//! - event latency: time from an EndpointSlice write (one endpoint flips readiness) to the
//!   dataplane having the diff, p50/p99 over `MCS_BENCH_SAMPLES` writes;
//! - memory: RSS growth of this process while the controller holds the ClusterSet, and the
//!   RSS of a real `mcs-agent run --dataplane log` process (built next to this bench:
//!   `cargo build --release -p mcs-agent` first) once it is ready with the same ClusterSet.
//!
//! `MCS_BENCH_IMPORTS=10000 cargo bench -p mcs-bench --bench control_plane` (default 1000
//! imports, each with 2 clusters × 5 endpoints). Needs root-free prerequisites only: etcd and
//! kube-apiserver (`bash scripts/setup.sh`).
//!
//! `MCS_BENCH_KUBECONFIG=FILE` runs against an API server that is already up (its current
//! context; e.g. `mcs-testbed --clusters c0 --kubeconfig-out FILE`) in namespace
//! `mcs-bench-<imports>`, and reuses the objects a previous run left there. One size per API
//! server: every size uses the same VIPs.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{StreamExt as _, stream};
use k8s_openapi::api::{core::v1::Namespace, discovery::v1::EndpointSlice};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use mcs_api::ServiceImport;
use mcs_model::{Dataplane, DataplaneError, NodeConfig, TableDiff};
use mcs_sync::{SyncConfig, SyncLoop, http::Health, metrics::Metrics};
use tokio::sync::Notify;

/// Records when diffs arrive.
#[derive(Clone, Default)]
struct Timed {
    diffs: Arc<Mutex<Vec<(Instant, usize)>>>,
    notify: Arc<Notify>,
}

impl Dataplane for Timed {
    fn name(&self) -> &'static str {
        "timed"
    }
    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError> {
        self.diffs
            .lock()
            .unwrap()
            .push((Instant::now(), diff.upsert.len() + diff.remove.len()));
        self.notify.notify_waiters();
        Ok(())
    }
}

fn rss_mib() -> f64 {
    mcs_bench::rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64
}

/// Most imports the bench's address plan holds: VIPs are 198.18.0.0 + i, below the
/// endpoints' 198.19.192.0/18.
const MAX_IMPORTS: usize = 0x1_c000;
/// The ranges that hold every VIP (`--clusterset-ip-cidr`); the endpoints are outside.
const VIP_CIDRS: [&str; 3] = ["198.18.0.0/16", "198.19.0.0/17", "198.19.128.0/18"];

fn vip(i: usize) -> String {
    let base = u32::from(std::net::Ipv4Addr::new(198, 18, 0, 0));
    std::net::Ipv4Addr::from(base + i as u32).to_string()
}

/// Endpoint `e` of cluster `c` of import `i`: in 198.19.192.0/18, so shared by many imports
/// at large sizes (as pods' addresses are not, but the index does not care).
fn endpoint(i: usize, c: usize, e: usize) -> String {
    let base = u32::from(std::net::Ipv4Addr::new(198, 19, 192, 0));
    std::net::Ipv4Addr::from(base + ((i * 16 + c * 8 + e) % 16_000) as u32).to_string()
}

fn slice(ns: &str, i: usize, c: usize, unready: Option<usize>) -> EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": format!("svc{i}-c{c}"), "namespace": ns, "labels": {
            "multicluster.kubernetes.io/service-name": format!("svc{i}"),
            "multicluster.kubernetes.io/source-cluster": format!("c{c}"),
            "endpointslice.kubernetes.io/managed-by": "bench" } },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": (0..5).map(|e| serde_json::json!({
            "addresses": [endpoint(i, c, e)], "conditions": { "ready": unready != Some(e) } })).collect::<Vec<_>>()
    }))
    .unwrap()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` asks for a listing
    }
    let imports: usize = std::env::var("MCS_BENCH_IMPORTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let samples: usize = std::env::var("MCS_BENCH_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    assert!(
        imports <= MAX_IMPORTS,
        "MCS_BENCH_IMPORTS={imports}: the address plan holds at most {MAX_IMPORTS}"
    );
    // An API server of the bench's own, or (MCS_BENCH_KUBECONFIG) one that is already up, e.g.
    // `mcs-testbed`'s, whose namespace keeps the objects between runs: creating 100k imports
    // takes minutes, so a second run at the same size reuses them.
    let external = std::env::var_os("MCS_BENCH_KUBECONFIG").map(std::path::PathBuf::from);
    let api = match &external {
        Some(_) => None,
        None => match mcs_test_support::apiserver::shared() {
            Some(api) => Some(api),
            None => return,
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (client, ns, kubeconfig) = match (&external, api) {
            (Some(path), _) => {
                let client = mcs_test_support::apiserver::client_from(path)
                    .await
                    .unwrap_or_else(|e| panic!("MCS_BENCH_KUBECONFIG={}: {e:#}", path.display()));
                let ns = format!("mcs-bench-{imports}");
                // Every size uses the same VIPs (198.18.0.0 + i): another size's imports, older,
                // would own them, and this run's writes would rightly change nothing.
                let others: Vec<String> = Api::<Namespace>::all(client.clone())
                    .list_metadata(&Default::default())
                    .await
                    .unwrap_or_else(|e| panic!("listing namespaces: {e}"))
                    .items
                    .into_iter()
                    .filter_map(|n| n.metadata.name)
                    .filter(|n| n.starts_with("mcs-bench-") && *n != ns)
                    .collect();
                assert!(
                    others.is_empty(),
                    "MCS_BENCH_KUBECONFIG={}: namespaces {others:?} hold another size's imports with the same VIPs; delete them or use another API server",
                    path.display()
                );
                let namespace: Namespace =
                    serde_json::from_value(serde_json::json!({ "metadata": { "name": ns } })).unwrap();
                match Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(e) => panic!("creating namespace {ns}: {e}"),
                }
                (client, ns, path.clone())
            }
            (None, Some(api)) => (
                api.client().await,
                api.fresh_namespace("bench").await,
                api.kubeconfig(mcs_test_support::apiserver::User::Admin),
            ),
            (None, None) => unreachable!("no API server"),
        };
        let si: Api<ServiceImport> = Api::namespaced(client.clone(), &ns);
        let es: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
        let t = Instant::now();
        let held = si.list_metadata(&Default::default()).await.map(|l| l.items.len()).unwrap_or(0);
        let reused = held == imports
            && es.list_metadata(&Default::default()).await.map(|l| l.items.len()).unwrap_or(0) == 2 * imports;
        if !reused {
            // Already there (an earlier run that stopped half-way): kept as it is.
            let create = |r: Result<(), kube::Error>| match r {
                Ok(()) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => panic!("creating: {e}"),
            };
            stream::iter(0..imports)
                .for_each_concurrent(16, |i| {
                    let (si, es, ns) = (si.clone(), es.clone(), ns.clone());
                    async move {
                        let import: ServiceImport = serde_json::from_value(serde_json::json!({
                            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
                            "metadata": { "name": format!("svc{i}"), "namespace": ns },
                            "spec": { "type": "ClusterSetIP", "ips": [vip(i)], "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] }
                        })).unwrap();
                        create(si.create(&PostParams::default(), &import).await.map(drop));
                        for c in 0..2 {
                            create(es.create(&PostParams::default(), &slice(&ns, i, c, None)).await.map(drop));
                        }
                    }
                })
                .await;
        }
        let created = t.elapsed();
        if reused {
            eprintln!("reusing {imports} imports and {} slices in namespace {ns}", imports * 2);
        } else {
            eprintln!("created {imports} imports and {} slices in {:.1}s", imports * 2, created.as_secs_f64());
        }

        let rss0 = rss_mib();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(Metrics::new(&mut registry));
        let health = Health::default();
        let dp = Timed::default();
        // Caps as high as the agent process's below: every import is admitted at any size.
        let mut node = NodeConfig { cluster_id: "c0".into(), ..Default::default() };
        node.guard.limits.frontends = 1_000_000;
        node.guard.limits.backends = 10_000_000;
        let controller = SyncLoop::new(
            node,
            dp.clone(),
            SyncConfig { cluster_id_fixed: true, ..Default::default() },
            metrics,
            health.clone(),
            None,
        );
        let (tx, rx) = tokio::sync::mpsc::channel(8192);
        let (_stop, stop_rx) = tokio::sync::watch::channel(false);
        let start = Instant::now();
        tokio::spawn(mcs_sync::source::kube::run(
            client.clone(),
            tx,
            Default::default(),
        ));
        tokio::spawn(controller.run(rx, stop_rx));
        while !health.is_ready() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let full_sync = start.elapsed();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rss = rss_mib() - rss0;

        let mut lat = Vec::with_capacity(samples);
        for k in 0..samples {
            let i = (k * 7919) % imports;
            // Every write changes something (a write that changes nothing rightly yields no
            // diff): one endpoint unready if all are ready, else all ready, from what the API
            // server holds now (a reused namespace keeps an earlier run's writes).
            let held = es.get(&format!("svc{i}-c0")).await.unwrap();
            let all_ready = held
                .endpoints
                .iter()
                .flatten()
                .all(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false));
            let flip = all_ready.then_some(k % 5);
            let before = dp.diffs.lock().unwrap().len();
            let t0 = Instant::now();
            let s = slice(&ns, i, 0, flip);
            es.patch(&format!("svc{i}-c0"), &PatchParams::apply("bench").force(), &Patch::Apply(&s))
                .await
                .unwrap();
            loop {
                let notified = dp.notify.notified();
                tokio::pin!(notified);
                // Register before checking, so a diff between the check and the wait wakes us.
                notified.as_mut().enable();
                if dp.diffs.lock().unwrap().len() > before {
                    break;
                }
                if tokio::time::timeout(Duration::from_secs(10), notified).await.is_err() {
                    let got = es.get(&format!("svc{i}-c0")).await.unwrap();
                    panic!(
                        "no diff within 10 s after writing svc{i}-c0 (diffs so far {}): now {:?}",
                        dp.diffs.lock().unwrap().len(),
                        got.endpoints.iter().flatten().map(|e| e.conditions.as_ref().and_then(|c| c.ready)).collect::<Vec<_>>()
                    );
                }
            }
            lat.push(t0.elapsed());
        }
        lat.sort();
        let q = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e3;
        println!(
            "control plane, {imports} ServiceImports x 2 clusters x 5 endpoints ({} endpoints):",
            imports * 10
        );
        if reused {
            println!("  reused {imports} ServiceImports and {} EndpointSlices of an earlier run", imports * 2);
        } else {
            println!(
                "  created {imports} ServiceImports and {} EndpointSlices in {:.1} s (16 writers)",
                imports * 2,
                created.as_secs_f64()
            );
        }
        println!("  full sync (start → first full table applied): {:.2} s", full_sync.as_secs_f64());
        println!(
            "  EndpointSlice write → diff applied: p50 {:.1} ms, p99 {:.1} ms ({samples} writes)",
            q(0.5),
            q(0.99)
        );
        println!("  RSS growth while holding the ClusterSet: {rss:.1} MiB");
        match agent_rss(&kubeconfig).await {
            Ok(mib) => println!(
                "  mcs-agent process (--dataplane log, kube source) RSS when ready: {mib:.1} MiB"
            ),
            // In CI the agent binary is there: not measuring it is a failure, not a skip.
            Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("mcs-agent process RSS not measured: {e}")
            }
            Err(e) => println!("  mcs-agent process RSS: not measured: {e}"),
        }
    });
}

/// Starts the real agent binary against the apiserver, waits for /readyz, returns its RSS.
async fn agent_rss(kubeconfig: &std::path::Path) -> Result<f64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let agent = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("mcs-agent"))
        .filter(|p| p.is_file())
        .ok_or("no mcs-agent binary next to the bench (cargo build --release -p mcs-agent)")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let mut child = tokio::process::Command::new(&agent)
        .args([
            "run",
            "--dataplane",
            "log",
            "--source",
            "kube",
            "--cluster-id",
            "c0",
            // The bench's VIPs (see `vip`); its endpoints are outside.
            "--clusterset-ip-cidr",
            VIP_CIDRS[0],
            "--clusterset-ip-cidr",
            VIP_CIDRS[1],
            "--clusterset-ip-cidr",
            VIP_CIDRS[2],
            "--max-frontends",
            "1000000",
            "--max-backends",
            "10000000",
        ])
        .args([
            "--log-level",
            "error",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", agent.display()))?;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let ready = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
            s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).ok()?;
            Some(text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.0 200"))
        })
        .await
        .ok()
        .flatten()
        .unwrap_or(false);
        if ready {
            break;
        }
        if Instant::now() > deadline {
            return Err("agent not ready within 300 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.id().ok_or("agent exited")?;
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or("no VmRSS")?;
    let _ = child.kill().await;
    Ok(kib / 1024.0)
}
