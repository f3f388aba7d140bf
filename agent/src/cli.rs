//! Command-line interface, parsed once at the edge into typed options.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use clap::{Args, Parser, Subcommand, ValueEnum};
use mcs_model::Limits;
use mcs_sync::source::SourceSpec;

/// The mcs-dataplane node agent: makes Kubernetes Multi-Cluster Services ClusterSetIPs
/// reachable from every pod of the node, with an eBPF socket load balancer or a userspace
/// transparent proxy.
#[derive(Debug, Parser)]
#[command(name = "mcs-agent", version, about, long_about = None)]
pub struct Cli {
    /// Log level (error, warn, info, debug, trace); default info (warn for `table` and `dns`).
    /// `MCS_LOG` overrides it with a full tracing filter.
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Watch ServiceImports and MCS EndpointSlices and program the dataplane.
    Run(Box<RunArgs>),
    /// Compute and print the forwarding table from a source, without touching the system.
    Table(TableArgs),
    /// Print the `clusterset.local` DNS answer the agent would give for a name, from a
    /// source, without a socket (e.g. `mcs-agent dns --source kube web.shop.svc.clusterset.local A`).
    Dns(DnsQueryArgs),
    /// Print what the eBPF dataplane has programmed, read back from the pinned maps.
    Status(StatusArgs),
    /// Detach the eBPF programs and remove the pinned maps (the agent leaves them in place
    /// when it stops, so that traffic keeps flowing across restarts), and remove the userspace
    /// forwarder's nftables table and policy routing that a killed agent left.
    Uninstall(UninstallArgs),
    /// Build a sandbox of network namespaces with two clusters and show the dataplane at work
    /// (needs root; removes everything it creates).
    Demo(DemoArgs),
}

/// Where objects come from and who this node is.
#[derive(Debug, Args)]
pub struct SourceArgs {
    /// `kube` (the API server of --kubeconfig, KUBECONFIG or the in-cluster config) or
    /// `file:DIR` (a directory of YAML: ServiceImports, EndpointSlices, ClusterProperty).
    #[arg(long, value_parser = parse_source)]
    pub source: SourceSpec,
    /// This cluster's id; when absent (or empty), read from the `cluster.clusterset.k8s.io`
    /// ClusterProperty. Local endpoints are preferred over remote ones.
    /// Lowercase DNS labels joined by dots, at most 63 bytes (the MCS controller's rule).
    #[arg(long, env = "MCS_CLUSTER_ID", value_parser = parse_cluster_id)]
    pub cluster_id: Option<String>,
    /// This node's zone, for `trafficDistribution: PreferClose`.
    #[arg(long, env = "MCS_ZONE")]
    pub zone: Option<String>,
    /// Kubeconfig for `--source kube` (default: KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Longest wait, in milliseconds, between two attempts of a failed watch (`--source
    /// kube`): retries start at 100 ms and double up to this, jittered down to half; only a
    /// completed list or a watch event starts them over, so an API server failing lists is
    /// asked at most ~13 times a minute per watcher. While the API server is away the
    /// dataplane keeps its last table; this bounds how late changes made meanwhile arrive
    /// once it is back.
    #[arg(long, default_value_t = 20_000)]
    pub watch_retry_max_ms: u64,
    #[command(flatten)]
    pub guard: GuardArgs,
}

/// What the agent may program at all, whatever the objects say. `table` and `run` apply the
/// same rules, so `table` shows exactly what `run` would program.
#[derive(Debug, Args)]
pub struct GuardArgs {
    /// A range ClusterSetIPs are allocated from (repeatable; IPv4 and IPv6), e.g.
    /// `--clusterset-ip-cidr 198.18.100.0/24`. Required. A VIP outside every range is
    /// rejected, and so is an endpoint inside one (it would loop). Env: comma-separated.
    #[arg(
        long = "clusterset-ip-cidr",
        value_name = "CIDR",
        env = "MCS_CLUSTERSET_IP_CIDR",
        value_delimiter = ','
    )]
    pub clusterset_ip_cidrs: Vec<String>,
    /// Only EndpointSlices whose `endpointslice.kubernetes.io/managed-by` is one of these are
    /// used (repeatable; env: comma-separated). Unset: any manager but Kubernetes' own
    /// EndpointSlice and mirroring controllers. See docs/install.md for each MCS controller.
    #[arg(long = "trusted-managed-by", value_name = "VALUE", env = "MCS_TRUSTED_MANAGED_BY", value_delimiter = ',', value_parser = non_empty)]
    pub trusted_managed_by: Vec<String>,
    /// Also use MCS slices whose source slice no Service selector computed (label
    /// `multicluster.x-k8s.io/source-managed-by` other than `endpointslice-controller.k8s.io`:
    /// mirrored from `Endpoints`, or written by hand). Off by default: whoever may write
    /// `Endpoints` or EndpointSlices in any member's namespace could then send this
    /// cluster's clients to any address the guard allows.
    #[arg(long, env = "MCS_ALLOW_SELECTORLESS_SLICES")]
    pub allow_selectorless_slices: bool,
    /// An address never to program as a VIP or endpoint, besides the ones found (the node's
    /// interface addresses and the API server's), e.g. the node's `status.hostIP`
    /// (repeatable; env: comma-separated).
    #[arg(
        long = "protect-address",
        value_name = "IP",
        env = "MCS_PROTECT_ADDRESS",
        value_delimiter = ','
    )]
    pub protect_addresses: Vec<IpAddr>,
    /// Most ports of one ServiceImport; an import with more is rejected.
    #[arg(long, default_value_t = Limits::default().ports_per_import)]
    pub max_ports_per_import: usize,
    /// Most backends of one frontend; more are trimmed (selected ones kept first). At most
    /// 1024, what the eBPF maps hold per frontend.
    #[arg(long, default_value_t = Limits::default().backends_per_frontend, value_parser = parse_backends_per_frontend)]
    pub max_backends_per_frontend: usize,
    /// Most frontends (VIP × port) in the table; imports are admitted oldest first. The eBPF
    /// maps are made to hold this many with `--max-backends` (docs/install.md, Sizing).
    #[arg(long, env = "MCS_MAX_FRONTENDS", default_value_t = Limits::default().frontends)]
    pub max_frontends: usize,
    /// Most backends in the table, summed over frontends; admitted with their imports.
    #[arg(long, env = "MCS_MAX_BACKENDS", default_value_t = Limits::default().backends)]
    pub max_backends: usize,
    /// Largest file `--source file:DIR` reads, in bytes.
    #[arg(long, default_value_t = mcs_sync::source::file::FileLimits::default().max_file_bytes)]
    pub max_file_bytes: u64,
}

/// Options of `mcs-agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Which dataplane programs the table: `auto` (eBPF when the kernel allows it, else
    /// userspace), `ebpf`, `userspace`, or `log` (program nothing, log what would be).
    #[arg(long, env = "MCS_DATAPLANE", value_enum, default_value_t = DataplaneKind::Auto)]
    pub dataplane: DataplaneKind,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "MCS_METRICS_ADDR", default_value = "0.0.0.0:9464")]
    pub metrics_addr: SocketAddr,
    /// cgroup v2 directory whose processes (and descendants) the eBPF dataplane serves.
    #[arg(long, env = "MCS_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    #[command(flatten)]
    pub pins: PinArgs,
    /// eBPF backend choice per connection: `random`, or `maglev` (consistent per client pod,
    /// minimal disruption when backends change).
    #[arg(long, env = "MCS_EBPF_SELECTION", value_enum, default_value_t = Selection::Random)]
    pub ebpf_selection: Selection,
    /// Name of this node (reported on Kubernetes Events).
    #[arg(long, env = "NODE_NAME", default_value = "unknown-node")]
    pub node_name: String,
    /// How often `file:DIR` is re-read, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub file_poll_ms: u64,
    /// The DaemonSet that runs this agent (`--source kube` only; the chart sets it). Watched:
    /// when it is deleted (an uninstall), the agent removes its eBPF programs and pins at
    /// stop; while it exists (a restart, an upgrade) they stay, so traffic keeps flowing.
    #[arg(long, env = "MCS_OWNER_DAEMONSET", requires = "owner_namespace")]
    pub owner_daemonset: Option<String>,
    /// Userspace dataplane, at a stop that is not an uninstall: how long the forwarder waits
    /// for the node's next agent to listen on every frontend before closing its own sockets
    /// (the forwarder's listeners share each address by SO_REUSEPORT, so new connections go to
    /// the next agent and none is refused); the interception is kept for it. Default: 30 when the
    /// agent's DaemonSet (`--owner-daemonset`) rolls with maxSurge, as the chart's userspace
    /// DaemonSet does, so the next pod starts first; else 0 (close at once; a DaemonSet
    /// without surge starts the next pod only after this one is gone, and the interception
    /// is removed at stop).
    #[arg(long, env = "MCS_HANDOVER_WAIT_S", value_name = "SECONDS")]
    pub handover_wait_s: Option<u64>,
    /// A Unix socket path where the node's running agent hands its listening sockets
    /// (metrics, DNS) to the next one: at start this agent takes them from the agent
    /// serving the path (the same sockets: no query or connection is refused while both
    /// run), binds the rest, then serves the path itself (mode 0600). Without it every
    /// address is bound afresh and waits while another process holds it. Its directory must
    /// be reachable only by the agent's pods (the chart mounts a host directory).
    #[arg(long, env = "MCS_HANDOVER_SOCKET", value_name = "PATH")]
    pub handover_socket: Option<std::path::PathBuf>,
    /// The namespace of `--owner-daemonset`.
    #[arg(long, env = "POD_NAMESPACE")]
    pub owner_namespace: Option<String>,
    #[command(flatten)]
    pub proxy: ProxyArgs,
    #[command(flatten)]
    pub dns: DnsArgs,
}

/// Options of the `clusterset.local` DNS server (`run`).
#[derive(Debug, Args)]
pub struct DnsArgs {
    /// Answer `clusterset.local` DNS (UDP and TCP) on this address (repeatable; env
    /// comma-separated). Off when neither this nor `--dns-listen-ips` is given. Names outside the zone are refused: point only
    /// the `clusterset.local` zone of the cluster DNS here (docs/install.md).
    #[arg(
        long = "dns-listen",
        value_name = "ADDR:PORT",
        env = "MCS_DNS_LISTEN",
        value_delimiter = ','
    )]
    pub listen: Vec<SocketAddr>,
    /// Also answer on each of these addresses (repeatable; env comma-separated), at
    /// `--dns-port`. Made for the downward API's `status.podIPs` (every address of a pod, or
    /// of the node for a host-network pod: both families on a dual-stack node), which a
    /// port cannot be appended to.
    #[arg(
        long = "dns-listen-ips",
        value_name = "IP",
        env = "MCS_DNS_LISTEN_IPS",
        value_delimiter = ','
    )]
    pub listen_ips: Vec<IpAddr>,
    /// The port of `--dns-listen-ips`.
    #[arg(long = "dns-port", env = "MCS_DNS_PORT", default_value_t = 10053)]
    pub port: u16,
    #[command(flatten)]
    pub answers: DnsAnswerArgs,
    /// Queries per second answered per client (an IPv4 address or an IPv6 /64); over it,
    /// queries are dropped and counted (`mcs_dns_rate_limited_total`). 0: no limit. The
    /// cluster DNS pods are usually the only clients (they forward every pod's queries).
    #[arg(
        long = "dns-rate-limit",
        env = "MCS_DNS_RATE_LIMIT",
        default_value_t = 20_000
    )]
    pub rate_limit: u32,
    /// DNS-over-TCP connections open at once, in total (past it, new ones are closed at once
    /// and counted in `mcs_dns_tcp_refused_total{cap="total"}`). Lowered at start if the
    /// open-file limit would leave fewer than 512 descriptors for the rest of the agent.
    #[arg(
        long = "dns-tcp-connections",
        env = "MCS_DNS_TCP_CONNECTIONS",
        default_value_t = mcs_dns::server::TcpLimits::default().connections,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000)
    )]
    pub tcp_connections: usize,
    /// DNS-over-TCP connections open at once from one client (an IPv4 address, an IPv6 /64);
    /// `cap="per_client"` in the same counter. Each connection is closed after 5 s without a
    /// query and after 30 s in any case (`--dns-tcp-idle-s`, `--dns-tcp-lifetime-s`).
    #[arg(
        long = "dns-tcp-connections-per-client",
        env = "MCS_DNS_TCP_CONNECTIONS_PER_CLIENT",
        default_value_t = mcs_dns::server::TcpLimits::default().per_client,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000)
    )]
    pub tcp_connections_per_client: usize,
    /// Seconds a DNS-over-TCP connection may stay without a query (before the first one and
    /// between two).
    #[arg(
        long = "dns-tcp-idle-s",
        env = "MCS_DNS_TCP_IDLE_S",
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub tcp_idle_s: u64,
    /// Seconds a DNS-over-TCP connection may stay open at all, however busy (a client that
    /// keeps it alive with a query every few seconds is closed then, and reconnects).
    #[arg(
        long = "dns-tcp-lifetime-s",
        env = "MCS_DNS_TCP_LIFETIME_S",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=86_400)
    )]
    pub tcp_lifetime_s: u64,
}

/// How answers are made.
#[derive(Debug, Args)]
pub struct DnsAnswerArgs {
    /// TTL of every record, in seconds (also how long clients cache a negative answer).
    #[arg(long = "dns-ttl", env = "MCS_DNS_TTL", default_value_t = mcs_dns::DEFAULT_TTL)]
    pub ttl: u32,
}

/// Options of `mcs-agent dns`.
#[derive(Debug, Args)]
pub struct DnsQueryArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub answers: DnsAnswerArgs,
    /// Give up on `--source kube` if the first sync takes longer (seconds).
    #[arg(long, default_value_t = 30)]
    pub timeout_s: u64,
    /// The name asked (a trailing dot is optional).
    pub name: String,
    /// The record type asked: A, AAAA, SRV, TXT, SOA, ANY, ...
    #[arg(default_value = "A")]
    pub record_type: String,
}

/// Options of the userspace forwarder.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Ignored: the forwarder listens on each frontend's own ClusterSetIP and port (up to
    /// 0.1.0 it listened on this port behind TPROXY). Accepted so older configurations start.
    #[arg(long, env = "MCS_PROXY_PORT", hide = true)]
    pub proxy_port: Option<u16>,
    /// nftables table (family inet) the agent owns.
    #[arg(long, default_value = "mcs_dataplane")]
    pub nft_table: String,
    /// Expose the forwarder's connection, byte and connect-failure counters per backend of
    /// each frontend (`backend` label) instead of summed per frontend. Costs four series per
    /// backend: at 1M endpoints, 4M series from every node. Off: seven series per frontend.
    #[arg(long, env = "MCS_METRICS_PER_BACKEND")]
    pub metrics_per_backend: bool,
    /// Firewall mark and routing table of intercepted packets.
    #[arg(long, default_value_t = 0x4d43)]
    pub fwmark: u32,
    /// Most open TCP connections; more are refused with a reset. Its last quarter is kept
    /// for clients holding fewer than a sixteenth of that quarter each, so a few clients at
    /// their own cap cannot take it all.
    #[arg(long, default_value_t = 65_536)]
    pub max_connections: usize,
    /// Most open TCP connections of one client address; more are refused with a reset.
    #[arg(long, default_value_t = 16_384)]
    pub max_connections_per_client: usize,
    /// Timeout of one backend connect attempt, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Backends tried per connection (first pick plus retries) among the selected ones; when
    /// every one tried refused, as many again among the fallback ones (another cluster's or
    /// zone's).
    #[arg(long, default_value_t = 3)]
    pub connect_attempts: usize,
    /// A connection to a removed backend (or open at shutdown) lives at most this long.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Close TCP connections idle this long.
    #[arg(long, default_value_t = 3600)]
    pub idle_timeout_s: u64,
    /// Expire UDP sessions idle this long.
    #[arg(long, default_value_t = 30)]
    pub udp_idle_timeout_s: u64,
    /// Most UDP sessions (client flows) in all.
    #[arg(long, default_value_t = 65_536)]
    pub max_udp_sessions: usize,
    /// Most UDP sessions of one client address.
    #[arg(long, default_value_t = 4_096)]
    pub max_udp_sessions_per_client: usize,
    /// Never switch a bulk transfer to zero-copy splice(2); always copy through a buffer
    /// (small messages are always copied: for them a copy is cheaper than two splices).
    #[arg(long)]
    pub no_splice: bool,
    /// TCP worker threads per address family, each with its own listener (the kernel
    /// spreads new connections over them); 0: one per CPU the agent may run on.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=256))]
    pub tcp_workers: u16,
    /// What the TCP workers run on: io-uring (one ring per worker: multishot accept, and
    /// connects, receives and sends batched into one system call per loop), epoll, or auto:
    /// io_uring where the kernel allows it (not kernel.io_uring_disabled, not blocked by
    /// seccomp), else epoll with a warning. The metric mcs_proxy_tcp_io_uring_workers says
    /// which runs.
    #[arg(long, value_enum, env = "MCS_TCP_ENGINE", default_value_t = TcpEngineArg::Auto)]
    pub tcp_engine: TcpEngineArg,
}

/// Where the eBPF dataplane pins its maps and links.
#[derive(Debug, Args)]
pub struct PinArgs {
    /// bpffs directory of the pinned maps and links.
    #[arg(long, env = "MCS_BPF_PIN_DIR", default_value = mcs_proxy::ebpf::DEFAULT_PIN_DIR)]
    pub bpf_pin_dir: PathBuf,
}

/// Options of `mcs-agent uninstall`.
#[derive(Debug, Args)]
pub struct UninstallArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// The userspace forwarder's nftables table (family inet), as `run --nft-table`.
    #[arg(long, default_value = "mcs_dataplane")]
    pub nft_table: String,
    /// The userspace forwarder's firewall mark and routing table, as `run --fwmark`.
    #[arg(long, default_value_t = 0x4d43)]
    pub fwmark: u32,
}

/// Options of `mcs-agent status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Options of `mcs-agent demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Which dataplane the demo's agent uses; `both` runs the story on each and compares.
    #[arg(long, value_enum, default_value_t = DataplaneKind::Both)]
    pub dataplane: DataplaneKind,
    /// New connections per traffic step.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
}

/// Options of `mcs-agent table`.
#[derive(Debug, Args)]
pub struct TableArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Give up on `--source kube` if the first sync takes longer (seconds).
    #[arg(long, default_value_t = 30)]
    pub timeout_s: u64,
}

/// eBPF backend selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Selection {
    /// At random per connection.
    Random,
    /// Maglev table per frontend, hashed by the client's network namespace.
    Maglev,
}

/// What the userspace forwarder's TCP workers run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TcpEngineArg {
    /// io_uring where available, else epoll.
    Auto,
    /// io_uring; the agent does not start without it.
    IoUring,
    /// epoll (tokio).
    Epoll,
}

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// For people.
    Text,
    /// The stable JSON shape (see docs/agent.md).
    Json,
}

/// Dataplanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DataplaneKind {
    /// Only log what would be programmed.
    Log,
    /// eBPF socket load balancer (cgroup hooks).
    Ebpf,
    /// Userspace transparent forwarder (nftables marks, sockets on each ClusterSetIP:port).
    Userspace,
    /// eBPF when the kernel allows it, else userspace.
    Auto,
    /// `demo` only: run the story on userspace, then eBPF, and compare.
    Both,
}

impl DnsArgs {
    /// Every address DNS is answered on: `--dns-listen`, then each `--dns-listen-ips` at
    /// `--dns-port`, each once (a pod IP may also be named in `--dns-listen`).
    pub fn addresses(&self) -> Vec<SocketAddr> {
        let mut all = self.listen.clone();
        for ip in &self.listen_ips {
            let a = SocketAddr::new(*ip, self.port);
            if !all.contains(&a) {
                all.push(a);
            }
        }
        all
    }
}

/// An empty value (e.g. an unset ConfigMap key) counts as absent.
fn non_empty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("must not be empty".into())
    } else {
        Ok(s.trim().to_string())
    }
}

fn parse_cluster_id(s: &str) -> Result<String, String> {
    let id = non_empty(s)?;
    if mcs_model::validate::cluster_id(&id) {
        Ok(id)
    } else {
        Err(format!(
            "{id:?} is not a cluster id: lowercase DNS labels (a-z, 0-9, '-') joined by dots, \
             at most 63 bytes, as the source-cluster label of every MCS EndpointSlice must be"
        ))
    }
}

fn parse_backends_per_frontend(s: &str) -> Result<usize, String> {
    let max = Limits::EBPF_BACKENDS_PER_FRONTEND;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("{s:?} is not in 1..={max}")),
    }
}

fn parse_source(s: &str) -> Result<SourceSpec, String> {
    s.parse()
}
