//! `mcs-agent demo`: the main job on the embedded default, in a sandbox of network namespaces.
//!
//! ```text
//!  client pod ── node (mcs-agent run --source file:<embedded examples>) ─┬─ cluster c1: 198.18.1.2, .3
//!  198.18.10.2    198.18.10.1                                            └─ cluster c2: 198.18.2.2, .3
//! ```
//!
//! It sends TCP and UDP traffic to the ClusterSetIPs, prints the per-cluster distribution and
//! latency, stops the local cluster's backends to show failover to the remote cluster, and
//! removes everything it created (also on error or Ctrl-C).

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::Path,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use mcs_sandbox::{backend::Backend, netns::Netns};

use crate::cli::{DataplaneKind, DemoArgs};

/// The example ClusterSet, embedded: the demo needs no file outside the binary.
const EXAMPLE: [(&str, &str); 4] = [
    (
        "cluster.yaml",
        include_str!("../../examples/two-clusters/cluster.yaml"),
    ),
    (
        "imports.yaml",
        include_str!("../../examples/two-clusters/imports.yaml"),
    ),
    (
        "slices-c1.yaml",
        include_str!("../../examples/two-clusters/slices-c1.yaml"),
    ),
    (
        "slices-c2.yaml",
        include_str!("../../examples/two-clusters/slices-c2.yaml"),
    ),
];
/// The example ClusterSet's ClusterSetIP ranges (what its MCS controller allocates from).
const CLUSTERSET_CIDRS: [&str; 2] = ["198.18.100.0/24", "2001:2::100:0/112"];
const WEB_VIP: &str = "198.18.100.10:80";
const WEB_VIP6: &str = "[2001:2::100:10]:80";
const DNS_VIP: &str = "198.18.100.12:53";
const METRICS_PORT: u16 = 9464;
/// Backends of the local cluster c1 that the demo stops.
const DEAD_BACKENDS: usize = 2;
/// Largest request a demo backend reads.
const IO_TIMEOUT: Duration = Duration::from_secs(3);
const READY_TIMEOUT: Duration = Duration::from_secs(30);

struct Step(usize);

impl Step {
    fn say(&mut self, what: &str) {
        self.0 += 1;
        println!("\n[{}/6] {what}", self.0);
    }
}

/// A backend: answers TCP and UDP with `cluster <c> backend <addr> got <request>`; stops when
/// dropped.
fn start_backend(ns: &Netns, cluster: &'static str, addr: SocketAddr) -> anyhow::Result<Backend> {
    let prefix = format!("cluster {cluster} backend {addr} got ");
    Backend::start(ns, addr, prefix, true, IO_TIMEOUT)
}

/// The eBPF part of the sandbox: the client cgroup and the pin directory.
struct EbpfDemo {
    cgroup: mcs_sandbox::cgroup::TestCgroup,
    pins: std::path::PathBuf,
    /// The cgroup this process came from, while it is inside the demo cgroup.
    home: Option<std::path::PathBuf>,
}

impl EbpfDemo {
    /// Moves this process into the demo cgroup.
    fn join(&mut self) -> anyhow::Result<()> {
        let root = mcs_sandbox::cgroup::cgroup2_root().context("no cgroup v2")?;
        let own = std::fs::read_to_string("/proc/self/cgroup")?;
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap_or("/")
            .trim_start_matches('/')
            .to_string();
        self.home = Some(root.join(rel));
        std::fs::write(
            self.cgroup.path().join("cgroup.procs"),
            std::process::id().to_string(),
        )
        .context("joining the demo cgroup")?;
        Ok(())
    }

    /// Moves this process back where it was.
    fn leave(&mut self) {
        if let Some(home) = self.home.take() {
            let _ = std::fs::write(home.join("cgroup.procs"), std::process::id().to_string());
        }
    }
}

impl Drop for EbpfDemo {
    fn drop(&mut self) {
        // Out of the cgroup before it is removed (removal kills what is inside).
        self.leave();
        let _ = mcs_proxy::ebpf::SocketLb::uninstall(&self.pins);
    }
}

/// Everything the demo creates; dropping it removes it all.
struct Sandbox {
    cli: Netns,
    node: Netns,
    c1: Netns,
    c2: Netns,
    dir: std::path::PathBuf,
    agent: Option<Child>,
    ebpf: Option<EbpfDemo>,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(a.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(5);
            while a.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = a.kill();
            let _ = a.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        // Leave the cgroup, detach and unpin (eBPF), then the namespaces go with their guards.
        drop(self.ebpf.take());
    }
}

fn build() -> anyhow::Result<Sandbox> {
    let mcs_sandbox::topology::TwoClusters { cli, node, c1, c2 } =
        mcs_sandbox::topology::TwoClusters::build()?;
    let dir = std::env::temp_dir().join(format!("{}-demo", mcs_sandbox::resource_prefix()));
    std::fs::create_dir_all(&dir)?;
    for (name, text) in EXAMPLE {
        std::fs::write(dir.join(name), text)?;
    }
    Ok(Sandbox {
        cli,
        node,
        c1,
        c2,
        dir,
        agent: None,
        ebpf: None,
    })
}

/// Where the agent serves /metrics and /readyz: inside the node namespace (userspace) or,
/// for eBPF, in this namespace on a free port (the agent then runs outside the node namespace,
/// because `ip netns exec` hides bpffs and the cgroup hierarchy, and eBPF needs no netns).
#[derive(Clone, Copy)]
enum Metrics<'a> {
    Node(&'a Netns),
    Host(u16),
}

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s =
        TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), IO_TIMEOUT).ok()?;
    s.set_read_timeout(Some(IO_TIMEOUT)).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some((out.split_whitespace().nth(1)?.parse().ok()?, out))
}

fn http(at: Metrics<'_>, path: &str) -> Option<(u16, String)> {
    match at {
        Metrics::Host(port) => get(port, path),
        Metrics::Node(node) => {
            let path = path.to_string();
            node.run(move || get(METRICS_PORT, &path)).ok().flatten()
        }
    }
}

/// Results of a run of requests: per cluster and backend, and latencies.
#[derive(Default)]
struct Tally {
    by_backend: BTreeMap<String, usize>,
    latencies: Vec<Duration>,
    /// Requests that got an error (refused, reset, timeout).
    failed: usize,
    /// Replies that came back cut or wrong (not the whole answer to this request).
    incomplete: usize,
    first_error: Option<String>,
}

impl Tally {
    /// Counts one request whose whole reply must end with `got {request}\n`.
    fn add(&mut self, request: &str, reply: Result<String, String>, took: Duration) {
        let whole = format!(" got {request}\n");
        match reply {
            Ok(r) if r.starts_with("cluster ") && !r.ends_with(&whole) => {
                self.incomplete += 1;
                self.first_error
                    .get_or_insert(format!("incomplete reply {r:?}"));
            }
            Ok(r) if r.starts_with("cluster ") => {
                let mut w = r.split_whitespace();
                let (cluster, backend) = (w.nth(1).unwrap_or("?"), w.nth(1).unwrap_or("?"));
                *self
                    .by_backend
                    .entry(format!("{cluster} {backend}"))
                    .or_default() += 1;
                self.latencies.push(took);
            }
            Ok(r) => {
                self.incomplete += 1;
                self.first_error
                    .get_or_insert(format!("unexpected reply {r:?}"));
            }
            Err(e) => {
                self.failed += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    /// Requests without a whole reply.
    fn bad(&self) -> usize {
        self.failed + self.incomplete
    }

    fn print(&mut self, what: &str) -> (f64, f64) {
        let total: usize = self.by_backend.values().sum::<usize>() + self.bad();
        println!("    {what}: {total} requests");
        let mut per_cluster: BTreeMap<&str, usize> = BTreeMap::new();
        for (k, n) in &self.by_backend {
            *per_cluster
                .entry(k.split(' ').next().unwrap_or("?"))
                .or_default() += n;
        }
        for (c, n) in &per_cluster {
            println!(
                "      cluster {c}: {n:>4} ({:.0}%)",
                100.0 * *n as f64 / total.max(1) as f64
            );
            for (k, m) in self
                .by_backend
                .iter()
                .filter(|(k, _)| k.starts_with(&format!("{c} ")))
            {
                println!("        {:<22} {m:>4}", k.split(' ').nth(1).unwrap_or("?"));
            }
        }
        println!(
            "      failed: {}, incomplete replies: {}{}",
            self.failed,
            self.incomplete,
            self.first_error
                .as_deref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        );
        if self.latencies.is_empty() {
            return (f64::NAN, f64::NAN);
        }
        self.latencies.sort();
        let q = |p: f64| self.latencies[((self.latencies.len() - 1) as f64 * p) as usize];
        let (p50, p99) = (q(0.5).as_secs_f64() * 1e6, q(0.99).as_secs_f64() * 1e6);
        println!(
            "      latency per request (connect + request + response): p50 {p50:.0} µs, p99 {p99:.0} µs"
        );
        (p50, p99)
    }
}

fn tcp_requests(cli: &Netns, to: &str, n: usize) -> anyhow::Result<Tally> {
    let to: SocketAddr = to.parse()?;
    cli.run(move || {
        let mut t = Tally::default();
        for i in 0..n {
            let start = Instant::now();
            let reply = (|| -> Result<String, String> {
                let mut s =
                    TcpStream::connect_timeout(&to, IO_TIMEOUT).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(IO_TIMEOUT))
                    .map_err(|e| e.to_string())?;
                // The request in one write, then a half-close: the backend reads to EOF.
                s.write_all(format!("GET /{i}").as_bytes())
                    .map_err(|e| e.to_string())?;
                s.shutdown(std::net::Shutdown::Write)
                    .map_err(|e| e.to_string())?;
                let mut out = String::new();
                s.read_to_string(&mut out).map_err(|e| e.to_string())?;
                Ok(out)
            })();
            t.add(&format!("GET /{i}"), reply, start.elapsed());
        }
        t
    })
}

fn udp_requests(cli: &Netns, to: &str, n: usize) -> anyhow::Result<(Tally, bool)> {
    let to: SocketAddr = to.parse()?;
    cli.run(move || {
        let mut t = Tally::default();
        let mut from_vip = true;
        for i in 0..n {
            let start = Instant::now();
            let reply = (|| -> Result<String, String> {
                let s = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(IO_TIMEOUT))
                    .map_err(|e| e.to_string())?;
                s.send_to(format!("query {i}").as_bytes(), to)
                    .map_err(|e| e.to_string())?;
                let mut buf = [0u8; 512];
                let (k, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
                from_vip &= from == to;
                Ok(String::from_utf8_lossy(&buf[..k]).to_string())
            })();
            t.add(&format!("query {i}"), reply, start.elapsed());
        }
        (t, from_vip)
    })
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> anyhow::Result<std::process::ExitCode> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the demo builds network namespaces and nftables rules: run it as root (bash scripts/demo.sh)"
        );
    }
    for tool in ["ip", "nft"] {
        if !std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        {
            bail!("`{tool}` not found: install iproute2 and nftables (bash scripts/setup.sh does)");
        }
    }
    let n = args.requests.max(1);
    let dataplanes: Vec<&str> = match args.dataplane {
        DataplaneKind::Userspace | DataplaneKind::Log => vec!["userspace"],
        DataplaneKind::Ebpf => vec!["ebpf"],
        DataplaneKind::Both => vec!["userspace", "ebpf"],
        DataplaneKind::Auto => {
            if mcs_sandbox::cgroup::cgroup2_root().is_some() && Path::new("/sys/fs/bpf").is_dir() {
                println!(
                    "--dataplane auto: cgroup v2 and bpffs are here; using the eBPF socket LB"
                );
                vec!["ebpf"]
            } else {
                println!("--dataplane auto: no cgroup v2 or no bpffs; using userspace");
                vec!["userspace"]
            }
        }
    };
    let mut summaries = Vec::new();
    for dp in &dataplanes {
        summaries.push((dp, story(dp, n)?));
    }
    if summaries.len() > 1 {
        println!("\nside by side (same sandbox shape and requests; a new connection per request):");
        println!(
            "  {:<10} {:>14} {:>14} {:>14} {:>12}",
            "dataplane", "TCP p50 µs", "TCP p99 µs", "UDP p50 µs", "failover ms"
        );
        for (dp, s) in &summaries {
            println!(
                "  {:<10} {:>14.0} {:>14.0} {:>14.0} {:>12.0}",
                dp, s.tcp.0, s.tcp.1, s.udp.0, s.failover_ms
            );
        }
    }
    let unexpected: Vec<&String> = summaries.iter().flat_map(|(_, s)| &s.unexpected).collect();
    if !unexpected.is_empty() {
        println!("\nFAILED: requests failed or came back incomplete where none should:");
        for u in &unexpected {
            println!("  {u}");
        }
        return Ok(std::process::ExitCode::FAILURE);
    }
    println!("\nevery request of every step that should succeed got its whole reply");
    Ok(std::process::ExitCode::SUCCESS)
}

/// What one run of the story measured.
struct Summary {
    tcp: (f64, f64),
    udp: (f64, f64),
    failover_ms: f64,
    /// Steps that should have had no failure and had some.
    unexpected: Vec<String>,
}

/// The demo's story on one dataplane.
fn story(dataplane: &str, n: usize) -> anyhow::Result<Summary> {
    let mut step = Step(0);
    println!(
        "mcs-agent demo: a ClusterSet of two clusters in network namespaces, dataplane {dataplane}"
    );

    step.say("building the sandbox: client pod, node, clusters c1 (local) and c2 (remote)");
    let mut sb = build().context("building the sandbox")?;
    let mut backends = Vec::new();
    for (ns, cluster, addrs) in [
        (&sb.c1, "c1", &["198.18.1.2", "198.18.1.3"][..]),
        (&sb.c2, "c2", &["198.18.2.2", "198.18.2.3"][..]),
    ] {
        for a in addrs {
            for port in [8080, 5353] {
                backends.push(start_backend(ns, cluster, format!("{a}:{port}").parse()?)?);
            }
        }
    }
    for a in ["[2001:2::1:2]:8080", "[2001:2::1:3]:8080"] {
        backends.push(start_backend(&sb.c1, "c1", a.parse()?)?);
    }
    println!(
        "    namespaces: {}, {}, {}, {}",
        sb.cli.name(),
        sb.node.name(),
        sb.c1.name(),
        sb.c2.name()
    );
    println!(
        "    {} backend sockets listening (TCP 8080, UDP 5353)",
        backends.len()
    );

    step.say("starting the agent on the node: mcs-agent run --source file:<example ClusterSet> --cluster-id c1");
    let exe = std::env::current_exe()?;
    // eBPF: the client pod's sockets are those of processes in a cgroup the agent attaches to;
    // here that is this demo process itself (it joins the cgroup once the agent runs). The
    // packets then go straight from the pod to the backend, routed by the node.
    let dataplane_args: Vec<String>;
    if dataplane == "ebpf" {
        let cg =
            mcs_sandbox::cgroup::TestCgroup::new("demo").context("creating the demo cgroup")?;
        let pins =
            Path::new("/sys/fs/bpf").join(format!("{}-demo", mcs_sandbox::resource_prefix()));
        dataplane_args = vec![
            "--cgroup-root".into(),
            cg.path().display().to_string(),
            "--bpf-pin-dir".into(),
            pins.display().to_string(),
        ];
        sb.node.enable_forwarding()?;
        sb.ebpf = Some(EbpfDemo {
            cgroup: cg,
            pins,
            home: None,
        });
    } else {
        // A userspace agent removes an eBPF socket LB pinned in its --bpf-pin-dir (a switched
        // dataplane): the demo's own empty directory, never the node's /sys/fs/bpf/mcs.
        dataplane_args = vec![
            "--bpf-pin-dir".into(),
            sb.dir.join("no-pins").display().to_string(),
        ];
    }
    let log_path = sb.dir.join("agent.log");
    let log = std::fs::File::create(&log_path)?;
    let host_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let (mut cmd, metrics_port) = if dataplane == "ebpf" {
        (std::process::Command::new(&exe), host_port)
    } else {
        (
            sb.node.command(exe.to_str().context("binary path")?),
            METRICS_PORT,
        )
    };
    cmd.args([
        "run",
        "--dataplane",
        dataplane,
        "--cluster-id",
        "c1",
        "--file-poll-ms",
        "100",
        // The demo shows how the connections spread over the backends.
        "--metrics-per-backend",
    ])
    .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
    .args(
        CLUSTERSET_CIDRS
            .iter()
            .flat_map(|c| ["--clusterset-ip-cidr", c]),
    )
    .arg("--source")
    .arg(format!("file:{}", sb.dir.display()))
    .args(&dataplane_args)
    .stdout(Stdio::null())
    .stderr(log);
    sb.agent = Some(cmd.spawn().context("starting the agent")?);
    let started = Instant::now();
    let at = if dataplane == "ebpf" {
        Metrics::Host(metrics_port)
    } else {
        Metrics::Node(&sb.node)
    };
    while http(at, "/readyz").map(|r| r.0) != Some(200) {
        if let Some(status) = sb.agent.as_mut().and_then(|a| a.try_wait().ok().flatten()) {
            bail!(
                "the agent exited ({status}); its log:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        if started.elapsed() > READY_TIMEOUT {
            bail!(
                "the agent was not ready after {READY_TIMEOUT:?}; its log:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "    ready in {:.0} ms; it programs these frontends:",
        started.elapsed().as_secs_f64() * 1e3
    );
    if let Some(e) = sb.ebpf.as_mut() {
        e.join()?;
        println!(
            "    (this demo process joined cgroup {}: its sockets are the client pod's)",
            e.cgroup.path().display()
        );
    }
    let guard = mcs_model::Guard {
        clusterset_cidrs: CLUSTERSET_CIDRS
            .iter()
            .map(|c| c.parse().map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?,
        ..Default::default()
    };
    let table = crate::table::table_text(&sb.dir, "c1", guard)?;
    for line in table.lines() {
        println!("      {line}");
    }

    step.say(&format!(
        "traffic from the client pod to the ClusterSetIPs ({n} new connections each)"
    ));
    // Steps where every request must get its whole reply but `allowed` may fail outright
    // (none, but where a backend just died); anything more is a bug.
    let mut unexpected: Vec<String> = Vec::new();
    let mut expect = |what: &str, t: &Tally, allowed: usize| {
        if t.incomplete > 0 || t.failed > allowed {
            unexpected.push(format!(
                "{dataplane}: {what}: {} failed, {} incomplete ({}){}",
                t.failed,
                t.incomplete,
                t.first_error.as_deref().unwrap_or("?"),
                if allowed > 0 {
                    format!("; at most {allowed} failed expected")
                } else {
                    String::new()
                }
            ));
        }
    };
    let what = format!("TCP {WEB_VIP} (shop/web)");
    let mut t = tcp_requests(&sb.cli, WEB_VIP, n)?;
    let tcp = t.print(&what);
    expect(&what, &t, 0);
    let what = format!("TCP {WEB_VIP6} (shop/web, IPv6)");
    let mut t = tcp_requests(&sb.cli, WEB_VIP6, n.min(50))?;
    t.print(&what);
    expect(&what, &t, 0);
    let what = format!("UDP {DNS_VIP} (shop/dns-cache)");
    let (mut udp, from_vip) = udp_requests(&sb.cli, DNS_VIP, n.min(100))?;
    let udp_lat = udp.print(&what);
    expect(&what, &udp, 0);
    println!(
        "      replies came from the ClusterSetIP: {}",
        if from_vip { "yes" } else { "NO" }
    );
    println!("    Only cluster c1 serves: it is the local cluster and has ready endpoints.");

    step.say("stopping the local cluster's backends (c1)");
    backends.retain(|b| !b.addr().to_string().starts_with("198.18.1."));
    std::thread::sleep(Duration::from_millis(50));
    let mut during = tcp_requests(&sb.cli, WEB_VIP, 10)?;
    let what = "right after the stop, before c1's endpoints are marked not ready";
    during.print(what);
    println!("    (c1 is still the local cluster with ready endpoints, so the agent keeps to it;");
    if dataplane == "ebpf" {
        println!(
            "     the socket LB rewrote connect(), so the client sees a refusal itself, once per"
        );
        println!(
            "     dead backend: the kernel marks a backend that refused this pod, and the pod's next"
        );
        println!(
            "     connects go to c2's fallback backends. More than {DEAD_BACKENDS} failures are counted against the demo.)"
        );
        expect(&format!("TCP {WEB_VIP} {what}"), &during, DEAD_BACKENDS);
    } else {
        println!(
            "     the forwarder tries c1's backends, and when each refuses, c2's take the connection:"
        );
        println!("     the client sees no failure. A failure here is counted against the demo.)");
        expect(&format!("TCP {WEB_VIP} {what}"), &during, 0);
    }
    println!(
        "    The MCS controller of c1 now reports its endpoints not ready (EndpointSlice update)."
    );
    let c1 = std::fs::read_to_string(sb.dir.join("slices-c1.yaml"))?;
    let unready = c1
        .replace("ready: true", "ready: false")
        .replace("serving: true", "serving: false");
    let tmp = sb.dir.join(".slices-c1.yaml.tmp");
    std::fs::write(&tmp, unready)?;
    let changed = Instant::now();
    std::fs::rename(&tmp, sb.dir.join("slices-c1.yaml"))?;
    let mut first_remote = None;
    // Both dataplanes already send these connections to c2 as a fallback (the forwarder after
    // each c1 backend refused, the socket LB after each refused this pod once); the failover
    // is when the table selects c2 (the change applied): for the forwarder a request that no
    // fallback served, for the socket LB the maps selecting only c2 for both frontends.
    let fallbacks = || {
        let (_, metrics) = http(at, "/metrics")?;
        let series = format!("mcs_proxy_fallback_connections_total{{frontend=\"{WEB_VIP}/TCP\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.trim().parse::<u64>().ok())
    };
    let maps_select_c2 = || {
        let Some(p) = sb
            .ebpf
            .as_ref()
            .and_then(|e| mcs_proxy::ebpf::read_pinned(&e.pins).ok())
        else {
            return false;
        };
        [format!("{WEB_VIP}/TCP"), format!("{DNS_VIP}/UDP")]
            .iter()
            .all(|f| {
                p.frontends
                    .get(f)
                    .is_some_and(|b| !b.is_empty() && b.iter().all(|b| b.starts_with("198.18.2.")))
            })
    };
    while changed.elapsed() < Duration::from_secs(10) {
        let before = if dataplane == "ebpf" {
            None
        } else {
            fallbacks()
        };
        let t = tcp_requests(&sb.cli, WEB_VIP, 1)?;
        let reached_c2 = t.by_backend.keys().any(|k| k.starts_with("c2 "));
        let selected = if dataplane == "ebpf" {
            maps_select_c2()
        } else {
            before.is_some() && fallbacks() == before
        };
        if reached_c2 && selected {
            first_remote = Some(changed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let failover_ms = first_remote.map_or(f64::NAN, |t| t.as_secs_f64() * 1e3);
    match first_remote {
        Some(t) => println!(
            "    failover: new connections reach cluster c2 {:.0} ms after the EndpointSlice change",
            t.as_secs_f64() * 1e3
        ),
        None => bail!(
            "no failover to c2 within 10 s; agent log:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        ),
    }

    step.say("traffic after failover");
    let what = format!("TCP {WEB_VIP} (shop/web) after failover");
    let mut t = tcp_requests(&sb.cli, WEB_VIP, n)?;
    t.print(&what);
    expect(&what, &t, 0);
    let what = format!("UDP {DNS_VIP} (shop/dns-cache) after failover");
    let (mut udp, _) = udp_requests(&sb.cli, DNS_VIP, n.min(100))?;
    udp.print(&what);
    expect(&what, &udp, 0);
    if let Some(e) = sb.ebpf.as_ref() {
        println!("    what the eBPF maps hold now (mcs-agent status):");
        if let Ok(p) = mcs_proxy::ebpf::read_pinned(&e.pins) {
            for (f, b) in p
                .frontends
                .iter()
                .filter(|(f, _)| f.starts_with("198.18.100.10:80"))
            {
                println!("      {f} -> {}", b.join(", "));
            }
        }
    } else if let Some((_, metrics)) = http(at, "/metrics") {
        let lines: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                l.starts_with("mcs_proxy_connections_total{frontend=\"198.18.100.10:80/TCP\"")
            })
            .collect();
        println!("    the agent's metrics (mcs_proxy_connections_total):");
        for l in lines {
            println!("      {l}");
        }
    }

    step.say(
        "cleaning up: stopping the agent, removing namespaces, nftables rules, eBPF pins and files",
    );
    drop(backends);
    let names = [
        sb.cli.name().to_string(),
        sb.node.name().to_string(),
        sb.c1.name().to_string(),
        sb.c2.name().to_string(),
    ];
    let pins = sb.ebpf.as_ref().map(|e| e.pins.clone());
    drop(sb);
    let mut left: Vec<String> = names
        .iter()
        .filter(|n| Path::new("/run/netns").join(n).exists())
        .cloned()
        .collect();
    left.extend(pins.filter(|p| p.exists()).map(|p| p.display().to_string()));
    if left.is_empty() {
        println!("    done: nothing left behind");
    } else {
        println!("    warning: still present: {left:?}");
    }
    if !from_vip {
        unexpected.push(format!(
            "{dataplane}: UDP replies did not all come from the ClusterSetIP"
        ));
    }
    Ok(Summary {
        tcp,
        udp: udp_lat,
        failover_ms,
        unexpected,
    })
}
