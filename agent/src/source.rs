//! The source of the agent's objects, as the subcommands start it: the node's settings and
//! guard, the kube client, the source task, and the first full sync (for the one-shot
//! subcommands `table` and `dns`).

use std::time::Duration;

use anyhow::{Context as _, bail};
use mcs_model::{Index, NodeConfig};
use mcs_sync::{
    SourceEvent,
    source::{
        self, SourceSpec,
        file::{FileLimits, FileSource},
    },
};
use tokio::sync::mpsc;

use crate::cli::SourceArgs;

/// Capacity of the source → sync loop channel.
pub(crate) const SOURCE_CHANNEL: usize = 4096;

/// The node's settings for the index, with the guard built from the flags and the node.
pub(crate) fn node_config(
    args: &SourceArgs,
    node_name: Option<&str>,
    apiserver: &[std::net::IpAddr],
) -> anyhow::Result<NodeConfig> {
    Ok(NodeConfig {
        cluster_id: args.cluster_id.clone().unwrap_or_default(),
        zone: args.zone.clone(),
        node_name: node_name.map(str::to_string),
        guard: crate::guard::build(&args.guard, apiserver)?,
    })
}

/// A client for `--source kube`, and the addresses of its API server (protected).
pub(crate) async fn kube_client(
    args: &SourceArgs,
) -> anyhow::Result<(kube::Client, Vec<std::net::IpAddr>)> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig or in-cluster config")?,
    };
    let apiserver = crate::guard::apiserver_addresses(&config.cluster_url).await;
    Ok((kube::Client::try_from(config)?, apiserver))
}

/// The source of `args`: its client (kube) and the node config, ready to start.
pub(crate) struct Prepared {
    pub(crate) client: Option<kube::Client>,
    pub(crate) node: NodeConfig,
}

/// Checks the source and builds the node config (before anything is started or touched).
pub(crate) async fn prepare(
    args: &SourceArgs,
    node_name: Option<&str>,
) -> anyhow::Result<Prepared> {
    match &args.source {
        SourceSpec::File(dir) => {
            if !dir.is_dir() {
                bail!(
                    "source directory {} does not exist or is not a directory",
                    dir.display()
                );
            }
            Ok(Prepared {
                client: None,
                node: node_config(args, node_name, &[])?,
            })
        }
        SourceSpec::Kube => {
            let (client, apiserver) = kube_client(args).await?;
            Ok(Prepared {
                client: Some(client),
                node: node_config(args, node_name, &apiserver)?,
            })
        }
    }
}

/// Starts the source of `args` as a task sending into `tx` (`client`: from [`prepare`]).
pub(crate) fn spawn_source(
    args: &SourceArgs,
    client: Option<kube::Client>,
    tx: mpsc::Sender<SourceEvent>,
    poll: Duration,
) {
    match &args.source {
        SourceSpec::File(dir) => {
            let limits = FileLimits {
                max_file_bytes: args.guard.max_file_bytes,
                ..FileLimits::default()
            };
            tokio::spawn(FileSource::with_limits(dir, limits).run(tx, poll));
        }
        SourceSpec::Kube => {
            if let Some(client) = client {
                let options = mcs_sync::source::kube::Options {
                    watch_cluster_id: args.cluster_id.is_none(),
                    retry_max: Duration::from_millis(args.watch_retry_max_ms),
                    ..Default::default()
                };
                tokio::spawn(mcs_sync::source::kube::run(client, tx, options));
            }
        }
    }
}

/// The index after the source's first full sync (or its end), and what it could not read.
pub(crate) async fn first_sync(
    args: &SourceArgs,
    timeout_s: u64,
    track_dns: bool,
) -> anyhow::Result<(Index, Vec<mcs_model::Rejection>)> {
    let prepared = prepare(args, None).await?;
    let (tx, mut rx) = mpsc::channel(SOURCE_CHANNEL);
    spawn_source(args, prepared.client, tx, Duration::from_secs(3600));
    let mut index = Index::new(prepared.node);
    if track_dns {
        index.track_dns();
    }
    let mut unreadable = std::collections::BTreeMap::new();
    let fixed = args.cluster_id.is_some();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
    loop {
        let ev = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .context("timed out waiting for the source's first full sync")?;
        // Stop at the first full sync (or if the source ended).
        let Some(ev) = ev else { break };
        if source::apply(&mut index, &mut unreadable, ev, fixed) {
            break;
        }
    }
    index.flush();
    Ok((index, unreadable.into_values().collect()))
}
