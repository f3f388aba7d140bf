//! `mcs-testbed`: N clusters of real etcd + kube-apiserver on loopback for scripts (the MCS
//! conformance run), until it is stopped (SIGTERM, SIGINT, or its stdin closing); then they
//! are stopped and their directories removed.
//!
//! Each cluster runs kube-controller-manager too (EndpointSlices of Services, Deployments,
//! ReplicaSets, namespace deletion, garbage collection). It writes one kubeconfig with a
//! context per cluster (named by the cluster id) and, with `--pods-running`, stands in for the
//! scheduler and kubelets that do not exist here (`mcs_test_support::node`): every Pending pod
//! is bound to the cluster's one Node and reported Running and Ready with an address from
//! 198.18.64.0/18 (no container runs).

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
use mcs_test_support::{
    apiserver::{self, ApiServer, User},
    node,
};

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
        let mut api = ApiServer::start().with_context(|| format!("starting cluster {c}"))?;
        api.start_controller_manager()
            .with_context(|| format!("starting cluster {c}'s kube-controller-manager"))?;
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
        for (i, (api, c)) in servers.iter().zip(&clusters).enumerate() {
            let kubeconfig = api.kubeconfig(User::Admin);
            let node_name = format!("{c}-node");
            rt.spawn(async move {
                let r = async {
                    let client = apiserver::client_from(&kubeconfig).await?;
                    node::keep_pods_running(client, &node_name, i as u8).await
                };
                if let Err(e) = r.await {
                    eprintln!("mcs-testbed: node stand-in of cluster {i}: {e:#}");
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
