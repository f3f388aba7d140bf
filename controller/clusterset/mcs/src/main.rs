//! `mcs-controller`: the MCS controller binary (see the library's docs).
#![forbid(unsafe_code)]

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// The MCS controller of mcs-dataplane. Run one in every cluster of the ClusterSet: it reads
/// ServiceExports (and the Services and EndpointSlices behind them) in every member cluster
/// and writes ServiceImports, MCS EndpointSlices and ServiceExport conditions into its own.
#[derive(Parser, Debug)]
#[command(name = "mcs-controller", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs the controller.
    Run(RunArgs),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// This cluster's id (an RFC 1123 label, or labels joined by dots): the context of
    /// --clusterset-kubeconfig that is this cluster. Absent or empty: read from this
    /// cluster's `cluster.clusterset.k8s.io` ClusterProperty.
    #[arg(long, env = "MCS_CLUSTER_ID")]
    cluster_id: Option<String>,
    /// A kubeconfig whose contexts are the member clusters, each named by its cluster id
    /// (this cluster's context may be absent: then the in-cluster config or KUBECONFIG is
    /// used for it). Read-only access is enough for the others.
    #[arg(long, env = "MCS_CLUSTERSET_KUBECONFIG")]
    clusterset_kubeconfig: PathBuf,
    /// A range ClusterSetIPs are allocated from (repeatable, IPv4 and IPv6; the agent's
    /// `--clusterset-ip-cidr` must list the same). Required. Env: comma-separated.
    #[arg(
        long = "clusterset-ip-cidr",
        value_name = "CIDR",
        env = "MCS_CLUSTERSET_IP_CIDR",
        value_delimiter = ','
    )]
    clusterset_ip_cidrs: Vec<String>,
    /// Seconds a member cluster may stay unreachable before its endpoints are withdrawn
    /// (they return when it answers again).
    #[arg(long, default_value_t = 300)]
    member_timeout_secs: u64,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:9465")]
    metrics_addr: SocketAddr,
    /// Namespace of the leader-election Lease (default: this pod's, from POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the Lease.
    #[arg(long, default_value = "mcs-controller")]
    lease_name: String,
    /// This replica's identity in the Lease (default: POD_NAME, else host name and pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease lasts without renewal (a standby takes over after this).
    #[arg(long, default_value_t = 15)]
    lease_secs: u64,
    /// Do not elect a leader (a single replica).
    #[arg(long)]
    no_leader_election: bool,
    /// Longest wait, in milliseconds, between two attempts of a failed list or watch:
    /// retries start at 100 ms and double up to this, jittered down to half; only a completed
    /// list or a watch event starts them over (a member failing lists is asked at most ~13
    /// times a minute per watcher).
    #[arg(long, default_value_t = 20_000)]
    watch_retry_max_ms: u64,
    /// Seconds between full passes (every service computed and compared), a safety net:
    /// passes compute only what changed, which a property test shows equal to a full pass,
    /// and a re-list, a member coming or going, or the first pass as leader is a full pass
    /// anyway. A full pass costs CPU in proportion to the exports of the whole ClusterSet
    /// (at 10,000 a resync every minute was most of what the controllers spent between
    /// changes).
    #[arg(long, default_value_t = 600)]
    resync_secs: u64,
    /// Namespaces whose ServiceExports are refused, in every member (comma-separated; an
    /// empty value refuses none). Their exports get `Valid=False` (`NamespaceNotAllowed`) and
    /// no import. Every cluster's controller should be given the same list.
    #[arg(
        long = "refuse-export-namespaces",
        value_name = "NAMESPACES",
        env = "MCS_REFUSE_EXPORT_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system,kube-public,kube-node-lease"
    )]
    refuse_export_namespaces: Vec<String>,
    /// The most ClusterSetIPs the ServiceImports of one namespace hold (0: no bound). An
    /// import that already has its addresses keeps them; a new one past the quota gets none
    /// (its Ready=False, `ClusterSetIPQuotaExceeded`, and the local export's Ready=False,
    /// `NoClusterSetIP`). Every cluster's controller should be given the same value.
    #[arg(long, env = "MCS_CLUSTERSET_IPS_PER_NAMESPACE", default_value_t = 0)]
    clusterset_ips_per_namespace: usize,
    /// Also export EndpointSlices that Kubernetes' EndpointSlice controller did not compute
    /// from a Service's selector: those of selectorless Services (mirrored from Endpoints, or
    /// written by hand) and hand-written ones. Risk: whoever can write Endpoints or
    /// EndpointSlices in a member can then send every cluster's clients of that service to
    /// any address. Off: such slices are withheld (logged, mcs_controller_slices_withheld),
    /// and a local export of a selectorless Service is Ready=False (`SelectorlessService`).
    /// Agents use the copies only with their own --allow-selectorless-slices.
    #[arg(long, env = "MCS_EXPORT_SELECTORLESS_SLICES")]
    export_selectorless_slices: bool,
    /// The most ServiceExports one namespace of one member may have merged (0: no bound).
    /// The oldest are kept; younger ones are refused (`Valid=False`, `ExportLimitExceeded`),
    /// so one tenant cannot fill every cluster with ServiceImports. Every cluster's
    /// controller should be given the same value.
    #[arg(long, env = "MCS_EXPORTS_PER_NAMESPACE", default_value_t = 5000)]
    exports_per_namespace: usize,
    /// The most ServiceExports one member may have merged, over all its namespaces (0: no
    /// bound); past it, as past --exports-per-namespace.
    #[arg(long, env = "MCS_EXPORTS_PER_MEMBER", default_value_t = 20000)]
    exports_per_member: usize,
    /// The most bytes of exported labels and annotations (keys, values and 64 bytes per
    /// entry) this controller keeps of one namespace's ServiceExports in one member. An
    /// export that does not fit is kept and imported without them (`Valid=True`, reason
    /// `ExportedMetadataOverBudget`; mcs_controller_exports_over_budget) until others shrink
    /// or go; the ones that came first are kept. Every cluster's controller should be given
    /// the same value.
    #[arg(long, env = "MCS_EXPORTED_METADATA_BYTES_PER_NAMESPACE", default_value_t = 2 << 20)]
    exported_metadata_bytes_per_namespace: usize,
    /// The same, over all of one member's namespaces, first come; past it a namespace still
    /// keeps its fair share (this over the namespaces holding metadata), up to twice this in
    /// all: what one member's exports may make this controller hold (with N members, up to
    /// 2N times this).
    #[arg(long, env = "MCS_EXPORTED_METADATA_BYTES_PER_MEMBER", default_value_t = 8 << 20)]
    exported_metadata_bytes_per_member: usize,
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("MCS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    mcs_runtime::logging::init(filter);
    let Command::Run(args) = Cli::parse().command;
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mcs-controller: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mcs-controller: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// The cluster id from this cluster's ClusterProperty (in-cluster config or KUBECONFIG).
async fn cluster_id_from_property() -> anyhow::Result<String> {
    let config = kube::Config::infer().await.context(
        "no --cluster-id, and no in-cluster config or KUBECONFIG to read the ClusterProperty",
    )?;
    let client = mcs_runtime::client::client(config)?;
    let api: kube::Api<mcs_api::ClusterProperty> = kube::Api::all(client);
    let cp = api
        .get_opt(mcs_api::CLUSTER_ID_PROPERTY)
        .await
        .context("reading the cluster-id ClusterProperty")?
        .with_context(|| {
            format!(
                "no --cluster-id and no ClusterProperty {}: set one of them",
                mcs_api::CLUSTER_ID_PROPERTY
            )
        })?;
    Ok(cp.spec.value)
}

async fn run(mut args: RunArgs) -> anyhow::Result<()> {
    // A watch per kind per member, the metrics listener's connections: none of them may be
    // what stops another socket from opening.
    mcs_runtime::open_files::raise();
    let cluster_id = match args.cluster_id.take().filter(|c| !c.is_empty()) {
        Some(c) => c,
        None => cluster_id_from_property().await?,
    };
    if !mcs_model::validate::cluster_id(&cluster_id) {
        bail!(
            "cluster id {cluster_id:?} is not a cluster id (lowercase DNS labels joined by dots, \
             at most 63 bytes)"
        );
    }
    let ranges = mcs_model::guard::parse_clusterset_ranges(&args.clusterset_ip_cidrs)
        .map_err(anyhow::Error::msg)?;
    if ranges.is_empty() {
        bail!(
            "no ClusterSetIP range: pass --clusterset-ip-cidr (e.g. 198.18.100.0/24), the same \
             ranges as the agents'"
        );
    }
    let kc = Kubeconfig::read_from(&args.clusterset_kubeconfig).with_context(|| {
        format!(
            "reading --clusterset-kubeconfig {}",
            args.clusterset_kubeconfig.display()
        )
    })?;
    let mut members = Vec::new();
    for ctx in &kc.contexts {
        let id = ctx.name.clone();
        if !mcs_model::validate::cluster_id(&id) {
            bail!(
                "context {id:?} of {} is not a cluster id (lowercase DNS labels joined by dots, at \
                 most 63 bytes): name each context by its cluster's id",
                args.clusterset_kubeconfig.display()
            );
        }
        let config = kube::Config::from_custom_kubeconfig(
            kc.clone(),
            &KubeConfigOptions {
                context: Some(id.clone()),
                ..Default::default()
            },
        )
        .await
        .with_context(|| format!("context {id}"))?;
        members.push((id, mcs_runtime::client::client(config)?));
    }
    if !members.iter().any(|(id, _)| *id == cluster_id) {
        let config = kube::Config::infer().await.with_context(|| {
            format!(
                "cluster {cluster_id} has no context in {} and there is no in-cluster config or \
                 KUBECONFIG",
                args.clusterset_kubeconfig.display()
            )
        })?;
        members.push((cluster_id.clone(), mcs_runtime::client::client(config)?));
    }
    tracing::info!(
        cluster = %cluster_id,
        members = ?members.iter().map(|m| m.0.clone()).collect::<Vec<_>>(),
        ranges = ?ranges.iter().map(ToString::to_string).collect::<Vec<_>>(),
        refused_namespaces = ?args.refuse_export_namespaces,
        "mcs-controller starting"
    );
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = mcs_controller::Metrics::new(&mut registry);
    let health = mcs_runtime::http::Health::default();
    let addr = mcs_runtime::http::spawn(args.metrics_addr, Arc::new(registry), health.clone())
        .await
        .with_context(|| format!("binding --metrics-addr {}", args.metrics_addr))?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "mcs-controller".into());
        format!("{host}-{}", std::process::id())
    });
    let cfg = mcs_controller::Config {
        cluster_id: cluster_id.clone(),
        members,
        ranges,
        member_timeout: Duration::from_secs(args.member_timeout_secs),
        retry_max: Duration::from_millis(args.watch_retry_max_ms),
        lease: (!args.no_leader_election).then(|| mcs_controller::lease::LeaseConfig {
            namespace: args.lease_namespace.clone(),
            name: args.lease_name.clone(),
            identity,
            duration: Duration::from_secs(args.lease_secs.max(3)),
        }),
        resync: Duration::from_secs(args.resync_secs.max(1)),
        refused_namespaces: args
            .refuse_export_namespaces
            .iter()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect(),
        ip_quota: (args.clusterset_ips_per_namespace > 0)
            .then_some(args.clusterset_ips_per_namespace),
        export_selectorless: args.export_selectorless_slices,
        exports_per_namespace: (args.exports_per_namespace > 0)
            .then_some(args.exports_per_namespace),
        exports_per_member: (args.exports_per_member > 0).then_some(args.exports_per_member),
        meta_limits: mcs_controller::budget::MetaLimits {
            per_namespace: args.exported_metadata_bytes_per_namespace,
            per_member: args.exported_metadata_bytes_per_member,
        },
        pod: std::env::var("POD_NAMESPACE")
            .ok()
            .zip(std::env::var("POD_NAME").ok())
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty()),
    };
    tokio::select! {
        r = mcs_controller::run(cfg, health, metrics) => r,
        () = mcs_runtime::signals::shutdown() => {
            tracing::info!("SIGTERM or SIGINT; stopping");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_ids_fit_a_label_value() {
        use mcs_model::validate::cluster_id as ok;
        assert!(ok("c1") && ok("east.prod") && ok(&"c".repeat(63)));
        let dot_at_40 = format!("{}.{}", "a".repeat(39), "b".repeat(10));
        assert!(ok(&dot_at_40));
        assert!(!ok(&"c".repeat(64)), "over 63 bytes: not a label value");
        assert!(!ok("") && !ok("a..b") && !ok("-a") && !ok("A") && !ok("a_b"));
    }
}
