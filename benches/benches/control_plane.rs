//! Control plane against a real kube-apiserver (not criterion: each sample is an API write):
//!
//! - full sync: time from starting the kube source to the first full table applied, and then
//!   `MCS_BENCH_SYNC_AB` (default 3) more of each way of reading EndpointSlices (JSON in
//!   pages, protobuf in pages, protobuf from the watch cache in one response), interleaved,
//!   medians shown;
//! - event latency: time from an EndpointSlice write (one endpoint flips readiness) to the
//!   dataplane having the diff, p50/p99 over `MCS_BENCH_SAMPLES` writes;
//! - burst: one write to each of up to 10,000 slices by 16 writers; every written state must
//!   reach the table (else the bench fails), and how many diffs it took is shown;
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
use mcs_model::{
    Dataplane, DataplaneError, ForwardingTable, Frontend, NodeConfig, Protocol, TableDiff,
};
use mcs_sync::{
    SyncConfig, SyncLoop,
    http::Health,
    metrics::Metrics,
    source::{
        kube::{SLICE_PAGE_SIZE, SliceEncoding},
        slice_watch::ListFrom,
    },
};
use tokio::sync::Notify;

/// Records when diffs arrive, and keeps the table they make.
#[derive(Clone, Default)]
struct Timed {
    diffs: Arc<Mutex<Vec<(Instant, usize)>>>,
    table: Arc<Mutex<ForwardingTable>>,
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
        self.table.lock().unwrap().apply(diff);
        self.notify.notify_waiters();
        Ok(())
    }
}

fn rss_mib() -> f64 {
    mcs_bench::rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64
}

use mcs_bench::scale::{MAX_IMPORTS, VIP_CIDRS, endpoint, env_count, import_json, slice_json, vip};

fn slice(ns: &str, i: usize, c: usize, unready: Option<usize>) -> EndpointSlice {
    serde_json::from_value(slice_json(ns, i, c, unready)).unwrap()
}

/// The readiness of import `i`'s c1 endpoints (by `e`) in `table`, if all five are there.
fn c1_ready(table: &ForwardingTable, i: usize) -> Option<Vec<bool>> {
    let frontend = Frontend {
        vip: vip(i).parse().ok()?,
        port: 80,
        protocol: Protocol::Tcp,
    };
    let svc = table.frontends.get(&frontend)?;
    (0..5)
        .map(|e| {
            let address: std::net::IpAddr = endpoint(i, 1, e).parse().ok()?;
            svc.backends
                .iter()
                .find(|b| &*b.cluster == "c1" && b.address == address)
                .map(|b| b.ready)
        })
        .collect()
}

/// The agent's controller over `dp`, and its health (ready after the first full table).
fn controller(dp: Timed) -> (SyncLoop<Timed>, Health) {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let health = Health::default();
    // Caps as high as the agent process's below: every import is admitted at any size.
    let mut node = NodeConfig {
        cluster_id: "c0".into(),
        ..Default::default()
    };
    node.guard.limits.frontends = 1_000_000;
    node.guard.limits.backends = 10_000_000;
    let controller = SyncLoop::new(
        node,
        dp,
        SyncConfig {
            cluster_id_fixed: true,
            ..Default::default()
        },
        metrics,
        health.clone(),
        None,
    );
    (controller, health)
}

/// How the A/B reads EndpointSlices: name, encoding, and where the protobuf list comes from.
const SLICE_READS: [(&str, SliceEncoding, ListFrom); 3] = [
    (
        "JSON",
        SliceEncoding::Json,
        ListFrom::Etcd {
            page_size: SLICE_PAGE_SIZE,
        },
    ),
    (
        "protobuf",
        SliceEncoding::Protobuf,
        ListFrom::Etcd {
            page_size: SLICE_PAGE_SIZE,
        },
    ),
    (
        "protobuf from the watch cache",
        SliceEncoding::Protobuf,
        ListFrom::Cache,
    ),
];

/// A full sync (start → first full table applied) of a fresh kube source and controller,
/// reading EndpointSlices as `slices` listed from `slice_list`; everything is dropped after.
async fn fresh_full_sync(
    client: &kube::Client,
    slices: SliceEncoding,
    slice_list: ListFrom,
) -> Duration {
    let (controller, health) = controller(Timed::default());
    let (tx, rx) = tokio::sync::mpsc::channel(8192);
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let start = Instant::now();
    let options = mcs_sync::source::kube::Options {
        slices,
        slice_list,
        ..Default::default()
    };
    let source = tokio::spawn(mcs_sync::source::kube::run(client.clone(), tx, options));
    let run = tokio::spawn(controller.run(rx, stop_rx));
    while !health.is_ready() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = start.elapsed();
    let _ = stop.send(true);
    let _ = run.await;
    let _ = source.await;
    took
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` asks for a listing
    }
    let imports = env_count("MCS_BENCH_IMPORTS", 1000);
    let ab_reps = env_count("MCS_BENCH_SYNC_AB", 3);
    let samples = env_count("MCS_BENCH_SAMPLES", 100);
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
                        let import: ServiceImport = serde_json::from_value(import_json(&ns, i)).unwrap();
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
        let dp = Timed::default();
        let (controller, health) = controller(dp.clone());
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

        // EndpointSlices as JSON, protobuf in pages and protobuf from the watch cache (the
        // default): fresh full syncs, interleaved.
        let mut ab: [Vec<f64>; 3] = Default::default();
        for _ in 0..ab_reps {
            for (k, (_, enc, list)) in SLICE_READS.into_iter().enumerate() {
                ab[k].push(fresh_full_sync(&client, enc, list).await.as_secs_f64());
            }
        }

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

        // A burst: one write to each of `burst` slices (cluster c1 of imports 0..burst) by 16
        // writers, each moving the unready endpoint on from what the controller's table holds,
        // so every write changes something. Then wait until the table shows every written
        // state (none lost) and count the diffs it took (coalescing).
        let burst = imports.min(10_000);
        let want: Vec<usize> = {
            let t = dp.table.lock().unwrap();
            (0..burst)
                .map(|i| match c1_ready(&t, i) {
                    Some(ready) => ready.iter().position(|r| !r).map_or(0, |u| (u + 1) % 5),
                    None => panic!("svc{i} has no c1 backends in the synced table"),
                })
                .collect()
        };
        let diffs_before = dp.diffs.lock().unwrap().len();
        let burst_start = Instant::now();
        stream::iter(0..burst)
            .for_each_concurrent(16, |i| {
                let (es, ns, u) = (es.clone(), ns.clone(), want[i]);
                async move {
                    let s = slice(&ns, i, 1, Some(u));
                    es.patch(&format!("svc{i}-c1"), &PatchParams::apply("bench").force(), &Patch::Apply(&s))
                        .await
                        .unwrap_or_else(|e| panic!("writing svc{i}-c1: {e}"));
                }
            })
            .await;
        let writes_done = burst_start.elapsed();
        let burst_deadline = Instant::now() + Duration::from_secs(120);
        let missing = loop {
            let notified = dp.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let missing = {
                let t = dp.table.lock().unwrap();
                (0..burst)
                    .filter(|&i| c1_ready(&t, i).is_none_or(|r| r.iter().position(|r| !r) != Some(want[i])))
                    .count()
            };
            if missing == 0 || Instant::now() > burst_deadline {
                break missing;
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
        };
        assert_eq!(missing, 0, "{missing} of {burst} burst writes never reached the table within 120 s");
        let (burst_diffs, burst_changes, last_diff) = {
            let d = dp.diffs.lock().unwrap();
            let new = &d[diffs_before..];
            (new.len(), new.iter().map(|(_, n)| n).sum::<usize>(), new.last().map(|(t, _)| *t))
        };
        let settled = last_diff.map_or(Duration::ZERO, |t| t.duration_since(burst_start));
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
        if ab_reps > 0 {
            println!("  full sync by how EndpointSlices are read ({ab_reps} interleaved runs each):");
            let json_median = median(&mut ab[0].clone());
            for ((name, _, _), runs) in SLICE_READS.iter().zip(&ab) {
                let m = median(&mut runs.clone());
                let all = runs.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(", ");
                println!("    {name:<30} median {m:.2} s ({:.2}x JSON's speed) [{all}]", json_median / m);
            }
        }
        println!(
            "  EndpointSlice write → diff applied: p50 {:.1} ms, p99 {:.1} ms ({samples} writes)",
            q(0.5),
            q(0.99)
        );
        println!(
            "  burst of {burst} EndpointSlice writes (16 writers, {:.1} s): all {burst} in the table {:.2} s after the first write, in {burst_diffs} diffs ({burst_changes} frontend changes); none lost",
            writes_done.as_secs_f64(),
            settled.as_secs_f64()
        );
        println!("  RSS growth while holding the ClusterSet: {rss:.1} MiB");
        match agent_rss(&kubeconfig).await {
            Ok(AgentMemory { secs, ready, settled, peak }) => println!(
                "  mcs-agent process (--dataplane log, kube source): ready in {secs:.2} s; RSS {ready:.1} MiB then, {settled:.1} MiB 2 s later, peak {peak:.1} MiB"
            ),
            // In CI the agent binary is there: not measuring it is a failure, not a skip.
            Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("mcs-agent process RSS not measured: {e}")
            }
            Err(e) => println!("  mcs-agent process RSS: not measured: {e}"),
        }
    });
}

/// The agent process's memory, in MiB.
struct AgentMemory {
    /// Seconds from starting the process to `/readyz` (polled every 50 ms).
    secs: f64,
    /// VmRSS when `/readyz` turned ready.
    ready: f64,
    /// VmRSS 2 s later (what was freed after the sync given back).
    settled: f64,
    /// VmHWM then: the most it ever held.
    peak: f64,
}

/// Reads VmRSS and VmHWM of a process, in MiB.
fn vm(pid: u32) -> Result<(f64, f64), String> {
    let field = |name| {
        mcs_bench::harness::procs::status_mib(pid, name).ok_or(format!("no {name} of {pid}"))
    };
    Ok((field("VmRSS")?, field("VmHWM")?))
}

/// Starts the real agent binary against the apiserver, waits for /readyz, returns its memory.
async fn agent_rss(kubeconfig: &std::path::Path) -> Result<AgentMemory, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let agent = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("mcs-agent"))
        .filter(|p| p.is_file())
        .ok_or("no mcs-agent binary next to the bench (cargo build --release -p mcs-agent)")?;
    let port = mcs_test_support::ports::unused_port().map_err(|e| e.to_string())?;
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
    let started = Instant::now();
    let deadline = started + Duration::from_secs(300);
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
    let secs = started.elapsed().as_secs_f64();
    let pid = child.id().ok_or("agent exited")?;
    let (ready, _) = vm(pid)?;
    // A measurement interval, not synchronisation: what the agent holds once it is idle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (settled, peak) = vm(pid)?;
    let _ = child.kill().await;
    Ok(AgentMemory {
        secs,
        ready,
        settled,
        peak,
    })
}
