//! The fault suite (`mcs-bench faults`): each scenario runs steady load from the client pod to
//! a ClusterSetIP while a fault is injected, and counts what the client saw — connections
//! tried, failed, replies cut, the longest gap between two served connections. A bench, not a
//! test: the figures go into docs/faults.md; `--smoke` (CI) asserts only that no
//! reply was cut and that the load ran.
//!
//! # Layout
//!
//! ```text
//!  client (cli netns; in the agent's cgroup for eBPF) ── node (agent) ─┬─ c1: 198.18.1.2, .3 :8080
//!                                                                      └─ c2: 198.18.2.2, .3 :8080
//! ```
//!
//! The client is a child process (`mcs-bench crr-loop`, one new connection per request); the
//! agent reads a file source in a temporary directory the scenarios rewrite.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use mcs_sandbox::{backend::Backend, cgroup::TestCgroup, netns::Netns, topology::TwoClusters};
use serde::{Deserialize, Serialize};

use mcs_test_support::{
    apiserver::{ApiServer, PeerApiServer, User},
    kubectl::Kubectl,
};

use crate::harness::agent::{AgentArgs, AgentHttp};

/// The ClusterSetIP of the measured service.
pub const VIP: &str = "198.18.100.10:80";
const BACKENDS: [(&str, &str); 4] = [
    ("c1", "198.18.1.2"),
    ("c1", "198.18.1.3"),
    ("c2", "198.18.2.2"),
    ("c2", "198.18.2.3"),
];
const PORT: u16 = 8080;
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// What the client saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoadResult {
    /// Connections tried.
    pub tried: u64,
    /// Connections that got the whole reply.
    pub ok: u64,
    /// Connections that failed (refused, reset, timeout, closed before any reply).
    pub failed: u64,
    /// Replies that came back cut or wrong (some bytes, not the whole answer).
    pub incomplete: u64,
    /// Longest time between two served connections, in milliseconds.
    pub longest_gap_ms: f64,
    /// The first error seen.
    pub first_error: Option<String>,
    /// The slowest connection: how long it took and how it ended.
    #[serde(default)]
    pub slowest: Option<(f64, String)>,
    /// Whole replies per backend (the address the backend names in its reply).
    #[serde(default)]
    pub by_backend: std::collections::BTreeMap<String, u64>,
}

/// `mcs-bench crr-loop`: new connections to `to` for `seconds` (at most `max` of them), each
/// sending a request, half-closing and reading the whole reply.
pub fn crr_loop(to: SocketAddr, seconds: f64, max: u64) -> LoadResult {
    let mut r = LoadResult::default();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    let mut last_ok = start;
    while Instant::now() < end && r.tried < max {
        if !r.crr_once(to, &mut last_ok) {
            // A refused connect returns at once: do not spin.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    r.finish(last_ok);
    r
}

impl LoadResult {
    /// One new connection to `to` (request `GET /<n>`, half-close, the whole reply), counted;
    /// `last_ok` is when the previous connection was served (for the longest gap). Whether
    /// this one was served whole.
    pub fn crr_once(&mut self, to: SocketAddr, last_ok: &mut Instant) -> bool {
        self.tried += 1;
        let req = format!("GET /{}", self.tried);
        let began = Instant::now();
        let one = || -> std::io::Result<String> {
            let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.write_all(req.as_bytes())?;
            s.shutdown(std::net::Shutdown::Write)?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        };
        let outcome = one();
        let took = began.elapsed().as_secs_f64() * 1e3;
        if self.slowest.as_ref().is_none_or(|(ms, _)| took > *ms) {
            let how = match &outcome {
                Ok(o) if o.is_empty() => "closed without a reply".to_string(),
                Ok(_) => "replied".to_string(),
                Err(e) => e.to_string(),
            };
            self.slowest = Some((took, how));
        }
        match outcome {
            Ok(out) if out.starts_with("backend ") && out.ends_with(&format!(" {req}\n")) => {
                self.ok += 1;
                if let Some(b) = out.split_whitespace().nth(1) {
                    *self.by_backend.entry(b.to_string()).or_default() += 1;
                }
                self.served(last_ok);
                true
            }
            // Closed before any reply (e.g. the forwarder's process died): a failure the
            // client sees, not a reply it could take for whole.
            Ok(out) if out.is_empty() => {
                self.failed += 1;
                self.first_error
                    .get_or_insert("closed without a reply".to_string());
                false
            }
            Ok(out) => {
                self.incomplete += 1;
                self.first_error.get_or_insert(format!("cut reply {out:?}"));
                false
            }
            Err(e) => {
                self.failed += 1;
                self.first_error.get_or_insert(e.to_string());
                false
            }
        }
    }

    /// A request served now: the gap since the one before counts toward the longest.
    pub fn served(&mut self, last_ok: &mut Instant) {
        let now = Instant::now();
        let gap = now.duration_since(*last_ok).as_secs_f64() * 1e3;
        self.longest_gap_ms = self.longest_gap_ms.max(gap);
        *last_ok = now;
    }

    /// At the end: the time since the last served request counts as a gap too.
    pub fn finish(&mut self, last_ok: Instant) {
        let tail = Instant::now().duration_since(last_ok).as_secs_f64() * 1e3;
        self.longest_gap_ms = self.longest_gap_ms.max(tail);
    }
}

/// A backend: reads the whole request, answers `backend ADDR REQUEST\n`; stops when dropped.
pub(crate) fn start_backend(ns: &Netns, addr: SocketAddr) -> anyhow::Result<Backend> {
    Backend::start(ns, addr, format!("backend {addr} "), false, IO_TIMEOUT)
}

/// The ClusterSet as the agent's file source: the import and one slice per cluster, with the
/// ready flags given.
fn objects(ready: &dyn Fn(&str) -> bool) -> String {
    let mut y = String::from(
        "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\n\
         metadata: { name: web, namespace: shop, creationTimestamp: \"2026-11-01T10:00:00Z\" }\n\
         spec: { type: ClusterSetIP, ips: [\"198.18.100.10\"], ports: [{ name: http, protocol: TCP, port: 80 }] }\n",
    );
    for cluster in ["c1", "c2"] {
        y.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{ name: web-{cluster}, namespace: shop, labels: {{ multicluster.kubernetes.io/service-name: web, multicluster.kubernetes.io/source-cluster: {cluster} }} }}\n\
             addressType: IPv4\nports: [{{ name: http, protocol: TCP, port: {PORT} }}]\nendpoints:\n"
        ));
        for (_, a) in BACKENDS.iter().filter(|(c, _)| *c == cluster) {
            y.push_str(&format!(
                "- {{ addresses: [\"{a}\"], conditions: {{ ready: {} }} }}\n",
                ready(a)
            ));
        }
    }
    y
}

/// Writes the objects atomically (the file source never reads half a file).
fn write_objects(dir: &Path, ready: &dyn Fn(&str) -> bool) -> anyhow::Result<()> {
    let tmp = dir.join(".objects.yaml.tmp");
    std::fs::write(&tmp, objects(ready))?;
    std::fs::rename(&tmp, dir.join("objects.yaml"))?;
    Ok(())
}

/// Services of the burst scenario (`--smoke`: a tenth, which a debug build programs within
/// its 1 s third).
pub const BURST_SERVICES: u32 = 10_000;

/// `n` more imports (no endpoints) in their own file, VIPs from 198.18.64.1 up, skipping the
/// measured one.
fn write_burst(dir: &Path, n: u32) -> anyhow::Result<()> {
    let base = u32::from(std::net::Ipv4Addr::new(198, 18, 64, 1));
    let skip: std::net::Ipv4Addr = "198.18.100.10".parse()?;
    let mut y = String::new();
    let mut written = 0;
    let mut i = 0;
    while written < n {
        let vip = std::net::Ipv4Addr::from(base + i);
        i += 1;
        if vip == skip {
            continue;
        }
        y.push_str(&format!(
            "---\napiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\n\
             metadata: {{ name: b{written}, namespace: burst }}\n\
             spec: {{ type: ClusterSetIP, ips: [\"{vip}\"], ports: [{{ name: http, protocol: TCP, port: 80 }}] }}\n"
        ));
        written += 1;
    }
    let tmp = dir.join(".burst.yaml.tmp");
    std::fs::write(&tmp, y)?;
    std::fs::rename(&tmp, dir.join("burst.yaml"))?;
    Ok(())
}

/// Which dataplane a scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Dataplane {
    /// The eBPF socket LB.
    Ebpf,
    /// The userspace forwarder.
    Userspace,
}

impl Dataplane {
    fn name(self) -> &'static str {
        match self {
            Dataplane::Ebpf => "ebpf",
            Dataplane::Userspace => "userspace",
        }
    }
}

/// The control plane of a kube-source run: etcd with two kube-apiservers, the agent watching
/// the first (`api`), the scenario writing through the second (`peer`) while the first is down.
/// The peer is declared first, so it stops before etcd does.
struct ControlPlane {
    /// Held so the peer runs as long as the scenario; reached only through `kubectl`.
    _peer: PeerApiServer,
    api: ApiServer,
    kubectl: Kubectl,
}

impl ControlPlane {
    fn start() -> anyhow::Result<Self> {
        mcs_test_support::apiserver::prerequisites().map_err(anyhow::Error::msg)?;
        let api = ApiServer::start()?;
        let peer = api.start_peer()?;
        let kubectl = Kubectl::new(&peer.kubeconfig(User::Admin))?;
        Ok(Self {
            _peer: peer,
            api,
            kubectl,
        })
    }

    /// `kubectl apply` of `yaml` through the peer API server (up all the time).
    fn apply(&self, yaml: &str) -> anyhow::Result<()> {
        self.kubectl.apply(yaml)
    }
}

/// The sandbox of one scenario run.
struct Bed {
    /// Set when the agent watches a real API server instead of a file source.
    kube: Option<ControlPlane>,
    topo: TwoClusters,
    dir: tempfile::TempDir,
    cg: TestCgroup,
    pins: PathBuf,
    agent_bin: PathBuf,
    agent: Option<Child>,
    dataplane: Dataplane,
    backends: Vec<Backend>,
    metrics_port: u16,
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.kill_agent();
        if self.dataplane == Dataplane::Ebpf {
            let _ = Command::new(&self.agent_bin)
                .args(["uninstall", "--bpf-pin-dir"])
                .arg(&self.pins)
                .output();
        }
    }
}

impl Bed {
    fn new(dataplane: Dataplane, agent_bin: &Path, kube: bool) -> anyhow::Result<Self> {
        let kube = if kube {
            // The userspace agent runs in the node's namespace, which cannot reach the API
            // server on the host's loopback.
            anyhow::ensure!(
                dataplane == Dataplane::Ebpf,
                "the kube-source scenarios run on the eBPF dataplane only (the userspace agent \
                 runs in the node's network namespace, where the test API server on the host's \
                 loopback is out of reach; the watch code is the same for both)"
            );
            let cp = ControlPlane::start().context("starting etcd and two kube-apiservers")?;
            cp.apply(&format!(
                "apiVersion: v1\nkind: Namespace\nmetadata: {{ name: shop }}\n---\n{}",
                objects(&|_| true)
            ))?;
            Some(cp)
        } else {
            None
        };
        let topo = TwoClusters::build().context("building the namespaces")?;
        // eBPF: packets go from the client pod straight to the backends, routed by the node.
        topo.node.enable_forwarding()?;
        let mut backends = Vec::new();
        for (c, a) in BACKENDS {
            let ns = if c == "c1" { &topo.c1 } else { &topo.c2 };
            backends.push(start_backend(ns, SocketAddr::new(a.parse()?, PORT))?);
        }
        let dir = tempfile::Builder::new()
            .prefix(&mcs_sandbox::unique_name("faults"))
            .tempdir()?;
        write_objects(dir.path(), &|_| true)?;
        let cg = TestCgroup::new("faults")?;
        let pins = Path::new("/sys/fs/bpf").join(mcs_sandbox::unique_name("faults"));
        let metrics_port = mcs_test_support::ports::unused_port()?;
        let mut bed = Self {
            kube,
            topo,
            dir,
            cg,
            pins,
            agent_bin: agent_bin.to_path_buf(),
            agent: None,
            dataplane,
            backends,
            metrics_port,
        };
        bed.start_agent()?;
        Ok(bed)
    }

    fn start_agent(&mut self) -> anyhow::Result<()> {
        let mut cmd = match self.dataplane {
            // The eBPF agent runs outside `ip netns exec` (which hides bpffs and cgroupfs).
            Dataplane::Ebpf => Command::new(&self.agent_bin),
            Dataplane::Userspace => self
                .topo
                .node
                .command(self.agent_bin.to_str().context("agent path")?),
        };
        let source = match &self.kube {
            Some(_) => "kube".to_string(),
            None => format!("file:{}", self.dir.path().display()),
        };
        let ebpf = self.dataplane == Dataplane::Ebpf;
        let no_pins = self.dir.path().join("no-pins");
        let args = AgentArgs {
            dataplane: self.dataplane.name(),
            cluster_id: "c1",
            source,
            // Room for the burst's 10,000 VIPs (198.18.64.0/18) beside the measured one.
            clusterset_ip_cidr: "198.18.64.0/18",
            max_frontends: 20000,
            metrics_port: self.metrics_port,
            file_poll_ms: 50,
            pins: if ebpf { &self.pins } else { &no_pins },
            cgroup: ebpf.then(|| self.cg.path()),
        };
        cmd.args(args.to_args()).stdout(Stdio::null()).stderr(
            if std::env::var_os("MCS_FAULTS_AGENT_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            },
        );
        if let Some(cp) = &self.kube {
            cmd.arg("--kubeconfig").arg(cp.api.kubeconfig(User::Admin));
        }
        self.agent = Some(cmd.spawn().context("starting the agent")?);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.ready() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the agent did not become ready in 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The agent's HTTP endpoint (in the node's namespace for the userspace agent).
    fn http(&self) -> AgentHttp<'_> {
        AgentHttp {
            port: self.metrics_port,
            node: (self.dataplane == Dataplane::Userspace).then_some(&self.topo.node),
        }
    }

    fn ready(&self) -> bool {
        self.http().get("/readyz").is_ok()
    }

    /// Waits (up to `limit`) until the agent reports `frontends` frontends programmed; how
    /// long it took.
    fn wait_frontends(&self, frontends: u64, limit: Duration) -> Option<Duration> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if self.http().frontends().ok().flatten() == Some(frontends as f64) {
                return Some(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// Starts the load client in the client pod (and, for eBPF, in the agent's cgroup).
    fn start_load(&self, seconds: f64) -> anyhow::Result<Child> {
        let me = std::env::current_exe()?;
        let mut cmd = match self.dataplane {
            Dataplane::Ebpf => self.cg.command(Some(&self.topo.cli), &me),
            Dataplane::Userspace => self.topo.cli.command(me.to_str().context("bench path")?),
        };
        cmd.args(["crr-loop", "--to", VIP, "--seconds", &seconds.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        Ok(cmd.spawn()?)
    }
}

fn finish_load(child: Child) -> anyhow::Result<LoadResult> {
    load_result(&child.wait_with_output()?)
}

/// The load client's result: the last line of its output.
pub(crate) fn load_result(out: &std::process::Output) -> anyhow::Result<LoadResult> {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .last()
        .context("the load client printed nothing")?;
    Ok(serde_json::from_str(line)?)
}

/// A scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// The agent is SIGKILLed a third into the run and restarted at once.
    AgentKill,
    /// One of the local cluster's two backends dies a third into the run, with no
    /// EndpointSlice change until two thirds in (then it is marked not ready).
    BackendKill,
    /// One local endpoint's readiness flips every 100 ms for the whole run.
    Flap,
    /// 10,000 other services (a tenth in smoke mode) are created a third into the run and
    /// deleted at two thirds.
    Burst,
    /// The API server the agent watches stops a third into the run for a while (60 s by
    /// default); meanwhile a new service is created through a second API server on the same
    /// etcd; then the first comes back.
    ApiServerDown,
}

impl Scenario {
    /// Every scenario.
    pub const ALL: [Scenario; 5] = [
        Scenario::AgentKill,
        Scenario::BackendKill,
        Scenario::Flap,
        Scenario::Burst,
        Scenario::ApiServerDown,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::AgentKill => "agent-kill",
            Scenario::BackendKill => "backend-kill",
            Scenario::Flap => "flap",
            Scenario::Burst => "burst",
            Scenario::ApiServerDown => "apiserver-down",
        }
    }

    /// By name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.name() == s)
    }

    fn describe(self) -> &'static str {
        match self {
            Scenario::AgentKill => "agent SIGKILLed and restarted",
            Scenario::BackendKill => {
                "one of two local backends killed, its endpoint marked not ready only later"
            }
            Scenario::Flap => "one local endpoint's readiness flipping every 100 ms",
            Scenario::Burst => "other services created in a burst, then deleted",
            Scenario::ApiServerDown => {
                "the watched API server stopped, a service created meanwhile through another"
            }
        }
    }

    /// Whether it runs on `dataplane` (the kube-source scenario needs the agent outside the
    /// node's namespace, which only the eBPF agent is).
    pub fn runs_on(self, dataplane: Dataplane) -> bool {
        self != Scenario::ApiServerDown || dataplane == Dataplane::Ebpf
    }
}

/// One scenario's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// Scenario name.
    pub scenario: &'static str,
    /// Dataplane.
    pub dataplane: &'static str,
    /// What the client saw.
    pub load: LoadResult,
    /// For `backend-kill`: connections that failed while the dead backend was still listed.
    pub note: String,
}

/// How long some scenarios last.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Seconds of load (plus `apiserver_down` for that scenario).
    pub seconds: f64,
    /// Services of the burst scenario.
    pub burst: u32,
    /// Seconds the API server stays down.
    pub apiserver_down: f64,
}

/// Runs `scenario` on `dataplane` at `sizes`.
pub fn run(
    scenario: Scenario,
    dataplane: Dataplane,
    sizes: Sizes,
    agent: &Path,
) -> anyhow::Result<Outcome> {
    let Sizes {
        seconds,
        burst,
        apiserver_down,
    } = sizes;
    let mut bed = Bed::new(dataplane, agent, scenario == Scenario::ApiServerDown)?;
    let load = bed.start_load(if scenario == Scenario::ApiServerDown {
        seconds + apiserver_down
    } else {
        seconds
    })?;
    let third = Duration::from_secs_f64(seconds / 3.0);
    let note = match scenario {
        Scenario::AgentKill => {
            std::thread::sleep(third);
            bed.kill_agent();
            let t = Instant::now();
            bed.start_agent()?;
            format!(
                "restarted and ready again in {:.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            )
        }
        Scenario::BackendKill => {
            std::thread::sleep(third);
            let dead = SocketAddr::new("198.18.1.2".parse()?, PORT);
            bed.backends.retain(|b| b.addr() != dead);
            std::thread::sleep(third);
            write_objects(bed.dir.path(), &|a| a != "198.18.1.2")?;
            "killed at 1/3, marked not ready at 2/3".to_string()
        }
        Scenario::Flap => {
            let end = Instant::now() + Duration::from_secs_f64(seconds);
            let mut ready = true;
            let mut flips = 0u32;
            while Instant::now() < end {
                ready = !ready;
                flips += 1;
                write_objects(bed.dir.path(), &|a| a != "198.18.1.3" || ready)?;
                std::thread::sleep(Duration::from_millis(100));
            }
            format!("{flips} flips")
        }
        Scenario::Burst => {
            std::thread::sleep(third);
            let t = Instant::now();
            write_burst(bed.dir.path(), burst)?;
            let added = bed.wait_frontends(u64::from(burst) + 1, third);
            std::thread::sleep(third.saturating_sub(t.elapsed()));
            std::fs::remove_file(bed.dir.path().join("burst.yaml"))?;
            let removed = bed.wait_frontends(1, third);
            let ms = |d: Option<Duration>| {
                d.map_or("not within the run".to_string(), |d| {
                    format!("{:.0} ms", d.as_secs_f64() * 1e3)
                })
            };
            format!(
                "{burst} services programmed in {}, removed in {}",
                ms(added),
                ms(removed)
            )
        }
        Scenario::ApiServerDown => {
            std::thread::sleep(third);
            let cp = bed.kube.as_mut().context("kube control plane")?;
            cp.api.stop_apiserver();
            let down = Instant::now();
            cp.apply(
                "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\n\
                 metadata: { name: web2, namespace: shop }\n\
                 spec: { type: ClusterSetIP, ips: [\"198.18.100.11\"], ports: [{ name: http, protocol: TCP, port: 80 }] }\n",
            )?;
            std::thread::sleep(
                Duration::from_secs_f64(apiserver_down).saturating_sub(down.elapsed()),
            );
            cp.api.restart()?;
            let was_down = down.elapsed();
            let arrived = bed.wait_frontends(2, Duration::from_secs(60));
            format!(
                "down {:.0} s; the service created meanwhile programmed {} after it was back",
                was_down.as_secs_f64(),
                arrived.map_or("not within 60 s".to_string(), |d| format!(
                    "{:.0} ms",
                    d.as_secs_f64() * 1e3
                ))
            )
        }
    };
    let load = finish_load(load)?;
    Ok(Outcome {
        scenario: scenario.name(),
        dataplane: dataplane.name(),
        load,
        note,
    })
}

/// The outcomes as a markdown table.
pub fn markdown(outcomes: &[Outcome], command: &str) -> String {
    let mut s = String::from(
        "| scenario | dataplane | connections tried | failed | cut replies | longest gap (ms) | note |\n|---|---|---|---|---|---|---|\n",
    );
    for o in outcomes {
        let desc = Scenario::parse(o.scenario).map_or("", Scenario::describe);
        s.push_str(&format!(
            "| {} ({desc}) | {} | {} | {} | {} | {:.0} | {}{} |\n",
            o.scenario,
            o.dataplane,
            o.load.tried,
            o.load.failed,
            o.load.incomplete,
            o.load.longest_gap_ms,
            o.note,
            o.load
                .first_error
                .as_deref()
                .map(|e| format!("; first error: {e}"))
                .unwrap_or_default()
                + &o.load
                    .slowest
                    .as_ref()
                    .filter(|(ms, _)| *ms > 100.0)
                    .map(|(ms, how)| format!("; slowest: {ms:.0} ms, {how}"))
                    .unwrap_or_default()
        ));
    }
    s.push_str(&format!("\nCommand: `{command}`\n"));
    s
}
