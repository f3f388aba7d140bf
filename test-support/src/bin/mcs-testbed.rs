//! `mcs-testbed`: N clusters of real etcd + kube-apiserver on loopback for scripts (the MCS
//! conformance run), until it is stopped (SIGTERM, SIGINT, or its stdin closing); then they
//! are stopped and their directories removed.
//!
//! It writes one kubeconfig with a context per cluster (named by the cluster id) and, with
//! `--pods-running`, stands in for kubelets that do not exist here: every pod that is
//! Pending is given phase Running and a pod IP from 198.18.(64+i).0/24 (no container runs).

use std::{
    io::Read as _,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, ResourceExt as _,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use mcs_test_support::apiserver::{self, ApiServer, User};

const USAGE: &str = "usage: mcs-testbed --clusters c1,c2 --kubeconfig-out FILE [--pods-running]";

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mcs-testbed: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn run() -> anyhow::Result<()> {
    let mut clusters: Vec<String> = Vec::new();
    let mut out: Option<PathBuf> = None;
    let mut pods_running = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--clusters" => {
                clusters = args
                    .next()
                    .context(USAGE)?
                    .split(',')
                    .map(str::to_string)
                    .collect();
            }
            "--kubeconfig-out" => out = Some(args.next().context(USAGE)?.into()),
            "--pods-running" => pods_running = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => anyhow::bail!("unknown argument {other:?}; {USAGE}"),
        }
    }
    let out = out.context(USAGE)?;
    anyhow::ensure!(!clusters.is_empty(), "{USAGE}");
    apiserver::prerequisites().map_err(anyhow::Error::msg)?;

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    // Stdin closing (the parent script died) stops us too.
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
            stop.store(true, Ordering::SeqCst);
        });
    }

    let mut servers = Vec::new();
    for c in &clusters {
        let api = ApiServer::start().with_context(|| format!("starting cluster {c}"))?;
        eprintln!("mcs-testbed: cluster {c} at {}", api.url());
        servers.push(api);
    }
    let members: Vec<(&str, &ApiServer)> = clusters
        .iter()
        .map(String::as_str)
        .zip(servers.iter())
        .collect();
    std::fs::write(
        &out,
        apiserver::clusterset_kubeconfig(&members, User::Admin)?,
    )
    .with_context(|| format!("writing {}", out.display()))?;
    println!("KUBECONFIG={}", out.display());

    let rt = tokio::runtime::Runtime::new()?;
    if pods_running {
        for (i, api) in servers.iter().enumerate() {
            let kubeconfig = api.kubeconfig(User::Admin);
            rt.spawn(async move {
                if let Err(e) = keep_pods_running(&kubeconfig, i).await {
                    eprintln!("mcs-testbed: pod keeper of cluster {i}: {e:#}");
                }
            });
        }
    }
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("mcs-testbed: stopping");
    drop(rt);
    drop(servers);
    let _ = std::fs::remove_file(&out);
    Ok(())
}

/// Gives every Pending pod of the cluster phase Running and an address (198.18.(64+i).n).
async fn keep_pods_running(kubeconfig: &std::path::Path, i: usize) -> anyhow::Result<()> {
    let client = apiserver::client_from(kubeconfig).await?;
    let pods: Api<Pod> = Api::all(client.clone());
    let mut n: u32 = 0;
    let mut stream = watcher(
        pods,
        watcher::Config::default().fields("status.phase=Pending"),
    )
    .boxed();
    while let Some(ev) = stream.next().await {
        let pod = match ev {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => p,
            Ok(_) => continue,
            Err(e) => {
                eprintln!("mcs-testbed: pod watch: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let ns = pod.namespace().unwrap_or_default();
        n += 1;
        let ip = format!("198.18.{}.{}", 64 + i, 2 + n % 250);
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = serde_json::json!({
            "status": {
                "phase": "Running",
                "podIP": ip, "podIPs": [{ "ip": ip }],
                "startTime": now,
                "conditions": [
                    { "type": "PodScheduled", "status": "True", "lastTransitionTime": now },
                    { "type": "Ready", "status": "True", "lastTransitionTime": now }
                ]
            }
        });
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        if let Err(e) = api
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&status),
            )
            .await
        {
            eprintln!("mcs-testbed: marking {ns}/{} Running: {e}", pod.name_any());
        }
    }
    Ok(())
}
