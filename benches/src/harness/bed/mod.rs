//! The test bed: the two-cluster topology, the backends, and every mode set up side by side
//! on the node, each on its own addresses so they never see each other's traffic.
//!
//! ```text
//!  cli 198.18.10.2 ── node ── c1: 198.18.1.2 (nginx :8080, UDP echo :9000)
//!                          └─ c2: 198.18.2.2 (nginx :8080, UDP echo :9000, TCP sink :5201)
//! ```
//!
//! Service `web` (80/TCP → 8080, 9000/UDP → 9000) has one backend, in c2, or with `--spread`
//! one in each cluster; `bulk` (5201/TCP) one backend in c2, the harness's TCP sink. Each mode has its own ClusterSetIPs: see [`Mode::vip_base`].
//!
//! # Layout
//!
//! - here: the topology, the backends, our agents (`mcs-ebpf`, `mcs-userspace`), the modes'
//!   dispatch and what the load generator needs.
//! - `peers`: HAProxy (also behind TPROXY) and nginx.
//! - `kernel`: kube-proxy's iptables, nftables and IPVS rules.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::Context;
use mcs_sandbox::{
    cgroup::TestCgroup,
    topology::{ClientNet, TwoClusters},
};

use super::agent::{AgentArgs, AgentHttp};
use super::procs::{Proc, deathsig, run_ok, wait_for};

mod kernel;
mod peers;

/// Backends of `web`, one per cluster.
pub const BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(198, 18, 1, 2), Ipv4Addr::new(198, 18, 2, 2)];
/// Backends of the filler services (never sent traffic).
const FILLER_BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(198, 18, 1, 3), Ipv4Addr::new(198, 18, 2, 3)];
/// Backend ports.
pub const HTTP_PORT: u16 = 8080;
/// UDP echo port (service and backend).
pub const UDP_PORT: u16 = 9000;
/// Bulk port (service and the TCP sink).
pub const BULK_PORT: u16 = 5201;
/// Most filler services a mode can hold (its /18 minus the first /24).
pub const MAX_SERVICES: usize = 16_128;

/// A way of reaching the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Client to the backend addresses: the limit.
    Direct,
    /// Our eBPF socket LB.
    McsEbpf,
    /// Our userspace TPROXY forwarder.
    McsUserspace,
    /// A second userspace forwarder, for A/B runs: another agent binary and/or other flags
    /// (`--agent-b`, `--agent-b-args`), measured interleaved with `mcs-userspace`.
    McsUserspaceB,
    /// kube-proxy iptables mode analog.
    Iptables,
    /// kube-proxy IPVS mode analog.
    Ipvs,
    /// kube-proxy nftables mode analog.
    Nftables,
    /// HAProxy, mode tcp, listening on a node address.
    Haproxy,
    /// HAProxy, mode tcp, behind the same kind of TPROXY interception as our forwarder (an
    /// nftables set of frontends, `tproxy to :port`, a fwmark route, `bind ... transparent`).
    HaproxyTproxy,
    /// nginx stream module.
    Nginx,
}

impl Mode {
    /// All modes, in report order.
    pub const ALL: [Mode; 10] = [
        Mode::Direct,
        Mode::McsEbpf,
        Mode::McsUserspace,
        Mode::McsUserspaceB,
        Mode::Iptables,
        Mode::Ipvs,
        Mode::Nftables,
        Mode::Haproxy,
        Mode::HaproxyTproxy,
        Mode::Nginx,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::McsEbpf => "mcs-ebpf",
            Mode::McsUserspace => "mcs-userspace",
            Mode::McsUserspaceB => "mcs-userspace-b",
            Mode::Iptables => "iptables",
            Mode::Ipvs => "ipvs",
            Mode::Nftables => "nftables",
            Mode::Haproxy => "haproxy",
            Mode::HaproxyTproxy => "haproxy-tproxy",
            Mode::Nginx => "nginx",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }

    /// Whether it can hold many services (the scaling workload applies).
    pub fn scales(self) -> bool {
        matches!(
            self,
            Mode::McsEbpf | Mode::McsUserspace | Mode::Iptables | Mode::Ipvs | Mode::Nftables
        )
    }

    /// First address of the mode's ClusterSetIP range: `web` is base+1, `bulk` base+2,
    /// filler `i` base+256+i. Proxies listen on node addresses instead.
    fn vip_base(self) -> Ipv4Addr {
        match self {
            Mode::Iptables => Ipv4Addr::new(198, 19, 0, 0),
            Mode::Nftables => Ipv4Addr::new(198, 19, 64, 0),
            Mode::McsUserspace => Ipv4Addr::new(198, 19, 128, 0),
            Mode::McsEbpf => Ipv4Addr::new(198, 19, 192, 0),
            Mode::Ipvs => Ipv4Addr::new(198, 18, 128, 0),
            Mode::Haproxy => Ipv4Addr::new(198, 18, 200, 0),
            Mode::Nginx => Ipv4Addr::new(198, 18, 201, 0),
            Mode::McsUserspaceB => Ipv4Addr::new(198, 18, 202, 0),
            Mode::HaproxyTproxy => Ipv4Addr::new(198, 18, 203, 0),
            Mode::Direct => Ipv4Addr::UNSPECIFIED,
        }
    }

    /// The client's source address for this mode (`None`: the client's main address): each
    /// mode's connections come from their own address, so a backend's TIME_WAIT sockets
    /// and the node's conntrack entries of one mode never meet the next mode's connections
    /// (the client's TCP timestamps differ per destination, and PAWS would reject them).
    fn client_source(self) -> Option<(Ipv4Addr, &'static str)> {
        let prefix = match self {
            Mode::Direct | Mode::McsEbpf => return None,
            Mode::McsUserspace | Mode::Iptables | Mode::Ipvs | Mode::Nftables => "/18",
            Mode::Haproxy | Mode::Nginx | Mode::McsUserspaceB | Mode::HaproxyTproxy => "/24",
        };
        let index = Mode::ALL.iter().position(|m| *m == self).unwrap_or(0) as u8;
        Some((Ipv4Addr::new(198, 18, 10, 10 + index), prefix))
    }

    fn vip(self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.vip_base()) + offset)
    }
}

/// Where the load generators of a mode connect.
#[derive(Debug, Clone)]
pub struct Target {
    /// HTTP service: one address, or for `direct` every backend (spread over the client's
    /// threads / flows).
    pub web: Vec<SocketAddr>,
    /// Bulk service.
    pub bulk: SocketAddr,
    /// UDP echo service (None: the mode has no UDP).
    pub udp: Option<Vec<SocketAddr>>,
    /// Whether the client must run in the cgroup with the socket LB attached.
    pub in_cgroup: bool,
    /// cgroup whose CPU time is the load balancer's (proxies).
    pub cpu_cgroup: Option<PathBuf>,
}

/// A mode's state after set-up.
#[derive(Debug)]
pub enum ModeState {
    /// Ready to measure.
    Ready(Target),
    /// The machine cannot run it (reported, not a failure).
    Unavailable(String),
    /// Set-up failed (a failure of the run).
    Failed(String),
}

/// The bed; dropping it stops every process and removes every namespace, cgroup, rule and
/// pinned map it created.
#[derive(Debug)]
pub struct Bed {
    procs: Vec<Proc>,
    /// Working directory (configs, logs).
    pub work: PathBuf,
    /// Binary of `mcs-agent`.
    agent: PathBuf,
    pins: PathBuf,
    ebpf_metrics: Option<SocketAddr>,
    cgroups: Vec<TestCgroup>,
    /// The cgroup the eBPF clients join.
    pub client_cg: Option<TestCgroup>,
    /// The namespaces.
    pub topo: TwoClusters,
    /// State of every selected mode.
    pub modes: BTreeMap<Mode, ModeState>,
    /// Filler services installed per scalable mode.
    pub services: usize,
    /// Process id of the agent of each mcs mode.
    agents: BTreeMap<Mode, u32>,
    /// Backends of `web` (one, or one per cluster).
    web: &'static [Ipv4Addr],
    /// The agent and flags of `mcs-userspace-b`.
    agent_b: Option<AgentB>,
}

/// The second userspace forwarder of an A/B run.
#[derive(Debug, Clone)]
pub struct AgentB {
    /// Its binary.
    pub agent: PathBuf,
    /// Flags added to its `run`.
    pub args: Vec<String>,
}

/// Metrics port (in the node namespace) of a userspace mode's agent.
fn userspace_metrics_port(mode: Mode) -> u16 {
    if mode == Mode::McsUserspaceB {
        9465
    } else {
        9464
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.procs.clear();
        if self.pins.exists() {
            let _ = Command::new(&self.agent)
                .args(["uninstall", "--bpf-pin-dir"])
                .arg(&self.pins)
                .output();
            let _ = std::fs::remove_dir_all(&self.pins);
        }
    }
}

impl Bed {
    /// Builds the topology and backends, then sets up each of `modes` (a mode that fails is
    /// recorded, the others go on). `spread`: `web` has a backend in each cluster (balanced
    /// modes then pay for uneven placement, which `direct` splits exactly); else one, in c2.
    pub fn build(
        modes: &[Mode],
        agent: &Path,
        agent_b: Option<AgentB>,
        work: &Path,
        spread: bool,
        client_net: ClientNet,
    ) -> anyhow::Result<Self> {
        sweep_stale_pins(agent);
        let topo = TwoClusters::build_with(client_net).context("building the namespaces")?;
        topo.node.enable_forwarding()?;
        for (ns, cidr) in [
            (&topo.node, "198.18.200.1/32"),
            (&topo.node, "198.18.201.1/32"),
        ] {
            ns.addr("lo", cidr)?;
        }
        for mode in Mode::ALL {
            if let Some((src, prefix)) = mode.client_source() {
                topo.cli.addr("eth0", &format!("{src}/32"))?;
                let dst = format!("{}{prefix}", mode.vip_base());
                mcs_sandbox::netns::check_cidr(&dst);
                topo.cli.ip(&[
                    "route",
                    "add",
                    &dst,
                    "via",
                    "198.18.10.1",
                    "src",
                    &src.to_string(),
                ])?;
            }
        }
        let mut bed = Bed {
            procs: vec![],
            work: work.into(),
            agent: agent.into(),
            pins: PathBuf::from("/sys/fs/bpf").join(mcs_sandbox::unique_name("bench")),
            ebpf_metrics: None,
            cgroups: vec![],
            client_cg: None,
            topo,
            modes: BTreeMap::new(),
            services: 1,
            agents: BTreeMap::new(),
            web: if spread { &BACKENDS } else { &BACKENDS[1..] },
            agent_b,
        };
        bed.start_backends()?;
        for &mode in modes {
            let state = match bed.setup(mode) {
                Ok(state) => state,
                Err(e) => ModeState::Failed(format!("{e:#}")),
            };
            bed.modes.insert(mode, state);
        }
        Ok(bed)
    }

    /// Starts a server inside namespace `ns` (of the topology) and its own cgroup: its CPU
    /// time is then measurable, and if the harness is killed, the next run's sweep kills
    /// the whole cgroup (the parent-death signal only reaches the first process, not e.g.
    /// nginx's workers).
    fn spawn_in_cgroup(
        &mut self,
        name: &str,
        ns: fn(&TwoClusters) -> &mcs_sandbox::netns::Netns,
        program: &str,
        args: &[&str],
    ) -> anyhow::Result<PathBuf> {
        let cg = TestCgroup::new(name)?;
        let wrapped = deathsig(program);
        let mut cmd = cg.command(Some(ns(&self.topo)), Path::new(&wrapped[0]));
        cmd.args(&wrapped[1..]).args(args);
        let path = cg.path().to_path_buf();
        self.cgroups.push(cg);
        let proc = Proc::spawn(name, cmd, &self.work.join(format!("{name}.log")))?;
        self.procs.push(proc);
        Ok(path)
    }

    fn start_backends(&mut self) -> anyhow::Result<()> {
        let exe = std::env::current_exe()?;
        let exe = exe.to_string_lossy().into_owned();
        for (i, ip) in BACKENDS.iter().enumerate() {
            let conf = self.work.join(format!("backend{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "worker_processes 1;\ndaemon off;\npid {work}/backend{i}.pid;\nerror_log {work}/backend{i}.err;\n\
                     events {{ worker_connections 8192; }}\n\
                     http {{ access_log off; keepalive_requests 1000000;\n\
                       server {{ listen {ip}:{HTTP_PORT} reuseport; location / {{ return 200 \"ok\\n\"; }} }} }}\n",
                    work = self.work.display()
                ),
            )?;
            let ns: fn(&TwoClusters) -> &mcs_sandbox::netns::Netns =
                if i == 0 { |t| &t.c1 } else { |t| &t.c2 };
            let conf = conf.to_string_lossy().into_owned();
            let err = self.work.join(format!("backend{i}.err"));
            let err = err.to_string_lossy().into_owned();
            self.spawn_in_cgroup(
                &format!("nginx-backend{i}"),
                ns,
                "nginx",
                &["-e", &err, "-c", &conf],
            )?;
            let listen = format!("{ip}:{UDP_PORT}");
            self.spawn_in_cgroup(
                &format!("udp-echo{i}"),
                ns,
                &exe,
                &["udp-echo", "--listen", &listen],
            )?;
        }
        let listen = SocketAddr::from((BACKENDS[1], BULK_PORT)).to_string();
        self.spawn_in_cgroup(
            "tcp-sink",
            |t| &t.c2,
            &exe,
            &["tcp-sink", "--listen", &listen],
        )?;
        // Ready when every backend answers from the client namespace.
        let cli = &self.topo.cli;
        let procs = &mut self.procs;
        let exe2 = std::env::current_exe()?;
        wait_for("the backends", Duration::from_secs(10), || {
            for p in procs.iter_mut() {
                p.check_alive()?;
            }
            for ip in BACKENDS {
                let mut cmd = cli.command(&exe2.to_string_lossy());
                cmd.args([
                    "check",
                    "--http",
                    &format!("{ip}:{HTTP_PORT}"),
                    "--udp",
                    &format!("{ip}:{UDP_PORT}"),
                ]);
                if run_ok(&mut cmd).is_err() {
                    return Ok(false);
                }
            }
            let bulk = SocketAddr::from((BACKENDS[1], BULK_PORT));
            cli.run(|| std::net::TcpStream::connect_timeout(&bulk, Duration::from_secs(1)).is_ok())
        })
    }

    fn setup(&mut self, mode: Mode) -> anyhow::Result<ModeState> {
        let web = SocketAddr::from((mode.vip(1), 80));
        let udp = SocketAddr::from((mode.vip(1), UDP_PORT));
        let bulk = SocketAddr::from((mode.vip(2), BULK_PORT));
        let mut target = Target {
            web: vec![web],
            bulk,
            udp: Some(vec![udp]),
            in_cgroup: false,
            cpu_cgroup: None,
        };
        let failed = match mode {
            Mode::Direct => {
                let (web, udp, _) = service_eps(self.web);
                target.web = web;
                target.udp = Some(udp);
                target.bulk = SocketAddr::from((BACKENDS[1], BULK_PORT));
                None
            }
            Mode::Haproxy => self.setup_haproxy(mode, &mut target)?,
            Mode::HaproxyTproxy => self.setup_haproxy_tproxy(mode, &mut target)?,
            Mode::Nginx => self.setup_nginx(mode, &mut target)?,
            Mode::Iptables => self.setup_iptables()?,
            Mode::Nftables => {
                self.program_nftables(0)?;
                None
            }
            Mode::Ipvs => self.setup_ipvs(mode)?,
            Mode::McsUserspace | Mode::McsUserspaceB => {
                target.cpu_cgroup = Some(self.start_userspace(mode)?);
                None
            }
            Mode::McsEbpf => self.setup_mcs_ebpf(mode, &mut target)?,
        };
        if let Some(state) = failed {
            return Ok(state);
        }
        Ok(ModeState::Ready(target))
    }

    /// Our agent with the eBPF socket LB (`mcs-ebpf`).
    fn setup_mcs_ebpf(
        &mut self,
        mode: Mode,
        target: &mut Target,
    ) -> anyhow::Result<Option<ModeState>> {
        if let Err(why) = mcs_sandbox::cgroup::prerequisite() {
            return Ok(Some(ModeState::Unavailable(why)));
        }
        let cg = TestCgroup::new("benchcli")?;
        let dir = self.work.join(format!("objects-{}", mode.name()));
        std::fs::create_dir_all(&dir)?;
        write_objects(&dir, mode, 0, self.web)?;
        let port = free_port()?;
        self.ebpf_metrics = Some(SocketAddr::from(([127, 0, 0, 1], port)));
        let wrapped = deathsig(&self.agent.to_string_lossy());
        let mut cmd = Command::new(&wrapped[0]);
        let args = AgentArgs {
            dataplane: "ebpf",
            cluster_id: "bench",
            source: format!("file:{}", dir.display()),
            clusterset_ip_cidr: "198.19.192.0/18",
            max_frontends: 65536,
            metrics_port: port,
            file_poll_ms: 100,
            pins: &self.pins,
            cgroup: Some(cg.path()),
        };
        cmd.args(&wrapped[1..]).args(args.to_args()).args([
            "--log-level",
            "warn",
            "--max-backends",
            "262144",
        ]);
        self.client_cg = Some(cg);
        let proc = Proc::spawn("mcs-ebpf", cmd, &self.work.join("mcs-ebpf.log"))?;
        self.agents.insert(Mode::McsEbpf, proc.pid());
        self.procs.push(proc);
        self.wait_frontends(Mode::McsEbpf, 3)?;
        target.in_cgroup = true;
        Ok(None)
    }

    /// Starts the userspace agent of `mode` (`mcs-userspace`, or the A/B variant with its own
    /// binary, flags, table, mark and port) and waits for its frontends; returns its cgroup.
    fn start_userspace(&mut self, mode: Mode) -> anyhow::Result<PathBuf> {
        let b = mode == Mode::McsUserspaceB;
        let dir = self.work.join(format!("objects-{}", mode.name()));
        std::fs::create_dir_all(&dir)?;
        write_objects(&dir, mode, 0, self.web)?;
        let no_pins = self.work.join("no-pins");
        let (agent, extra) = match (&self.agent_b, b) {
            (Some(ab), true) => (ab.agent.clone(), ab.args.clone()),
            _ => (self.agent.clone(), vec![]),
        };
        let agent = agent.to_string_lossy().into_owned();
        let cidr = format!("{}/{}", mode.vip_base(), if b { 24 } else { 18 });
        let mut args: Vec<String> = AgentArgs {
            dataplane: "userspace",
            cluster_id: "bench",
            source: format!("file:{}", dir.display()),
            clusterset_ip_cidr: &cidr,
            // The scaling step holds 10k fillers plus the measured services.
            max_frontends: 65536,
            metrics_port: userspace_metrics_port(mode),
            file_poll_ms: 100,
            pins: &no_pins,
            cgroup: None,
        }
        .to_args()
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
        args.extend(["--log-level", "warn", "--max-backends", "262144"].map(String::from));
        if b {
            // Its own interception, beside mcs-userspace's.
            args.extend(
                [
                    "--nft-table",
                    "mcs_bench_b",
                    "--fwmark",
                    "19780",
                    "--proxy-port",
                    "15002",
                ]
                .map(String::from),
            );
        }
        args.extend(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let cg = self.spawn_in_cgroup(mode.name(), |t| &t.node, &agent, &args)?;
        if let Some(p) = self.procs.last() {
            self.agents.insert(mode, p.pid());
        }
        self.wait_frontends(mode, 3)?;
        Ok(cg)
    }

    /// Waits until the agent of `mode` reports `n` frontends programmed.
    fn wait_frontends(&mut self, mode: Mode, n: usize) -> anyhow::Result<()> {
        let limit = Duration::from_secs(30 + n as u64 / 200);
        let http = AgentHttp {
            port: match mode {
                Mode::McsEbpf => self.ebpf_metrics.context("no eBPF agent")?.port(),
                _ => userspace_metrics_port(mode),
            },
            node: (mode != Mode::McsEbpf).then_some(&self.topo.node),
        };
        let procs = &mut self.procs;
        wait_for(
            &format!("{} to program {n} frontends", mode.name()),
            limit,
            || {
                for p in procs.iter_mut() {
                    p.check_alive()?;
                }
                Ok(http.frontends()? == Some(n as f64))
            },
        )
    }

    /// Installs `services` services in total (the measured ones plus fillers) in every
    /// scalable mode that is ready.
    pub fn set_services(&mut self, services: usize) -> anyhow::Result<()> {
        let fillers = services.saturating_sub(1).min(MAX_SERVICES);
        let ready: Vec<Mode> = self
            .modes
            .iter()
            .filter(|(m, s)| m.scales() && matches!(s, ModeState::Ready(_)))
            .map(|(m, _)| *m)
            .collect();
        for mode in ready {
            match mode {
                Mode::Iptables => self.program_iptables(fillers)?,
                Mode::Nftables => self.program_nftables(fillers)?,
                Mode::Ipvs => self.program_ipvs(fillers)?,
                Mode::McsEbpf | Mode::McsUserspace => {
                    let dir = self.work.join(format!("objects-{}", mode.name()));
                    write_objects(&dir, mode, fillers, self.web)?;
                    self.wait_frontends(mode, 3 + fillers)?;
                }
                _ => {}
            }
        }
        self.services = fillers + 1;
        Ok(())
    }

    /// Resident memory of the agent of `mode` (MiB), if it has one.
    pub fn agent_rss_mib(&self, mode: Mode) -> Option<f64> {
        super::procs::rss_mib(*self.agents.get(&mode)?)
    }

    /// The ready modes in report order.
    pub fn ready(&self) -> Vec<(Mode, Target)> {
        self.modes
            .iter()
            .filter_map(|(m, s)| match s {
                ModeState::Ready(t) => Some((*m, t.clone())),
                _ => None,
            })
            .collect()
    }

    /// A client command for `mode`: inside the client namespace, and inside the socket-LB
    /// cgroup for `mcs-ebpf`.
    pub fn client(&self, target: &Target, program: &str) -> Command {
        match (&self.client_cg, target.in_cgroup) {
            (Some(cg), true) => cg.command(Some(&self.topo.cli), Path::new(program)),
            _ => self.topo.cli.command(program),
        }
    }

    /// Empties the node's connection-tracking table. Run before every measurement: a mode's
    /// runs must not inherit the entries of the one before (their reply tuples collide with
    /// the next DNAT mode's, and NAT then searches for a free port on every new connection).
    pub fn reset_conntrack(&self) -> anyhow::Result<()> {
        let mut cmd = self.topo.node.command("conntrack");
        cmd.arg("-F");
        run_ok(&mut cmd).map(drop)
    }

    /// Fails if a server of the bed has died.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        for p in &mut self.procs {
            p.check_alive()?;
        }
        Ok(())
    }
}

fn service_eps(web: &[Ipv4Addr]) -> (Vec<SocketAddr>, Vec<SocketAddr>, Vec<SocketAddr>) {
    (
        web.iter()
            .map(|ip| SocketAddr::from((*ip, HTTP_PORT)))
            .collect(),
        web.iter()
            .map(|ip| SocketAddr::from((*ip, UDP_PORT)))
            .collect(),
        vec![SocketAddr::from((BACKENDS[1], BULK_PORT))],
    )
}

/// The MCS objects of the measured services plus `fillers` others, for `file:DIR`; written
/// to a temporary file and renamed, so the agent never reads half a file.
fn write_objects(dir: &Path, mode: Mode, fillers: usize, web: &[Ipv4Addr]) -> anyhow::Result<()> {
    let mut y = String::new();
    let import = |y: &mut String, name: &str, vip: Ipv4Addr, ports: &str| {
        let _ = write!(
            y,
            "---\napiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {{ name: {name}, namespace: bench }}\n\
             spec: {{ type: ClusterSetIP, ips: [\"{vip}\"], ports: [{ports}] }}\n"
        );
    };
    let slice = |y: &mut String,
                 name: &str,
                 svc: &str,
                 cluster: &str,
                 ip: Ipv4Addr,
                 ports: &str| {
        let _ = write!(
            y,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: bench\n  \
             labels: {{ multicluster.kubernetes.io/service-name: {svc}, multicluster.kubernetes.io/source-cluster: {cluster} }}\n\
             addressType: IPv4\nports: [{ports}]\nendpoints: [{{ addresses: [\"{ip}\"], conditions: {{ ready: true }} }}]\n"
        );
    };
    let http = "{ name: http, protocol: TCP, port: 80 }";
    let http_ep = format!("{{ name: http, protocol: TCP, port: {HTTP_PORT} }}");
    for i in 0..fillers {
        let name = format!("f{i}");
        import(&mut y, &name, mode.vip(256 + i as u32), http);
        for (c, ip) in ["c1", "c2"].iter().zip(FILLER_BACKENDS) {
            slice(&mut y, &format!("{name}-{c}"), &name, c, ip, &http_ep);
        }
    }
    let udp = format!("{{ name: udp, protocol: UDP, port: {UDP_PORT} }}");
    import(&mut y, "web", mode.vip(1), &format!("{http}, {udp}"));
    for (c, ip) in ["c1", "c2"].iter().zip(BACKENDS) {
        if !web.contains(&ip) {
            continue;
        }
        slice(
            &mut y,
            &format!("web-{c}"),
            "web",
            c,
            ip,
            &format!("{http_ep}, {udp}"),
        );
    }
    let bulk = format!("{{ name: iperf, protocol: TCP, port: {BULK_PORT} }}");
    import(&mut y, "bulk", mode.vip(2), &bulk);
    slice(&mut y, "bulk-c2", "bulk", "c2", BACKENDS[1], &bulk);
    let tmp = dir.join(".objects.yaml.tmp");
    std::fs::write(&tmp, y)?;
    std::fs::rename(&tmp, dir.join("objects.yaml"))?;
    Ok(())
}

/// Whether `program` is on PATH.
pub fn have(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(mcs_test_support::ports::unused_port()?)
}

/// Unpins the maps of eBPF agents of earlier runs that were killed before cleaning up.
fn sweep_stale_pins(agent: &Path) {
    let Ok(dir) = std::fs::read_dir("/sys/fs/bpf") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("mcst")
            .map(|r| {
                r.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .and_then(|d| d.parse::<u32>().ok())
        else {
            continue;
        };
        if name.contains("bench") && !mcs_sandbox::pid_alive(pid) {
            let _ = Command::new(agent)
                .args(["uninstall", "--bpf-pin-dir"])
                .arg(entry.path())
                .output();
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_address_is_a_test_address() {
        for mode in Mode::ALL.into_iter().filter(|m| *m != Mode::Direct) {
            for off in [1, 2, 256, 256 + MAX_SERVICES as u32 - 1] {
                let ip = mode.vip(off);
                assert!(
                    mcs_sandbox::netns::is_test_address(ip.into()),
                    "{mode:?} {ip}"
                );
            }
        }
        // Mode ranges do not overlap.
        let mut bases: Vec<u32> = Mode::ALL
            .iter()
            .filter(|m| m.scales())
            .map(|m| u32::from(m.vip_base()))
            .collect();
        bases.sort();
        assert!(
            bases
                .windows(2)
                .all(|w| w[1] - w[0] >= 256 + MAX_SERVICES as u32)
        );
    }

    #[test]
    fn objects_hold_the_measured_services_and_fillers() {
        let dir = tempfile::tempdir().unwrap();
        write_objects(dir.path(), Mode::McsUserspace, 5, &BACKENDS).unwrap();
        let text = std::fs::read_to_string(dir.path().join("objects.yaml")).unwrap();
        assert_eq!(text.matches("kind: ServiceImport").count(), 7);
        assert_eq!(text.matches("kind: EndpointSlice").count(), 13);
    }
}
