//! The sandbox of the userspace dataplane tests: client, node, two clusters of backends.
//!
//! ```text
//!  cli 198.18.10.2 ── node 198.18.10.1 │ 198.18.1.1 ── c1: 198.18.1.2, 198.18.1.3 (+ 2001:2::1:2/3)
//!                                      │ 198.18.2.1 ── c2: 198.18.2.2, 198.18.2.3
//! ```
#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use mcs_test_support::{netns::Netns, prereq, require};

pub const WAIT: Duration = Duration::from_secs(20);
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The sandbox: namespaces, backends, the agent. Dropping it stops the agent and removes all.
pub struct Sandbox {
    pub cli: Netns,
    pub node: Netns,
    pub c1: Netns,
    pub c2: Netns,
    pub dir: tempfile::TempDir,
    pub agent: Option<Child>,
    pub metrics_port: u16,
    _servers: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }
}

/// SIGTERM to an agent process (as the kubelet stops its pod).
pub fn sigterm(agent: &Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

/// SIGTERM, then the agent's exit, which must be a success; returns its log (stderr, when
/// piped).
pub fn stop_agent(agent: Child) -> String {
    sigterm(&agent);
    let out = agent.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "agent exit {}: {log}", out.status);
    log
}

/// An agent process killed when dropped (a failed assertion leaves none behind).
pub struct Killed(pub Option<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/two-clusters")
}

/// A TCP server that answers every chunk it reads with `<its address> <chunk>`, per
/// connection, until EOF; and a UDP server that answers each datagram the same way.
pub fn serve(ns: &Netns, addr: SocketAddr) -> Vec<std::thread::JoinHandle<()>> {
    let tcp = ns
        .run(|| std::net::TcpListener::bind(addr))
        .unwrap()
        .unwrap();
    let udp = ns.run(|| UdpSocket::bind(addr)).unwrap().unwrap();
    let t = std::thread::spawn(move || {
        for s in tcp.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            let reply = format!("{addr} {}", String::from_utf8_lossy(&buf[..n]));
                            if s.write_all(reply.as_bytes()).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    let u = std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            let reply = format!("{addr} {}", String::from_utf8_lossy(&buf[..n]));
            let _ = udp.send_to(reply.as_bytes(), from);
        }
    });
    vec![t, u]
}

impl Sandbox {
    /// Builds the namespaces and starts backends on `backends` (a subset of the example's).
    /// The client is attached as `MCS_TEST_CLIENT_NET` says (routed when unset), so the whole
    /// suite can run behind a bridge too.
    pub fn new(backends: &[&str]) -> Self {
        let client = mcs_test_support::topology::ClientNet::from_env().unwrap();
        Self::new_on(client, backends)
    }

    /// As [`Sandbox::new`], with the client attached as `client` says.
    pub fn new_on(client: mcs_test_support::topology::ClientNet, backends: &[&str]) -> Self {
        let mcs_test_support::topology::TwoClusters { cli, node, c1, c2 } =
            mcs_test_support::topology::TwoClusters::build_with(client)
                .expect("two-cluster topology");
        let mut servers = Vec::new();
        for b in backends {
            let addr: SocketAddr = b.parse().unwrap();
            let ns = if b.contains("198.18.2.") { &c2 } else { &c1 };
            servers.extend(serve(ns, addr));
        }
        let dir = tempfile::tempdir().unwrap();
        for f in ["imports.yaml", "slices-c1.yaml", "slices-c2.yaml"] {
            std::fs::copy(examples().join(f), dir.path().join(f)).unwrap();
        }
        Sandbox {
            cli,
            node,
            c1,
            c2,
            dir,
            agent: None,
            metrics_port: 19464,
            _servers: servers,
        }
    }

    /// Starts the agent in the node namespace and waits until it is ready.
    pub fn start_agent(&mut self, extra: &[&str]) {
        self.start_agent_wrapped(&[], extra);
    }

    /// As [`Sandbox::start_agent`], the agent run by `wrapper` (e.g. `prlimit --nofile=N:N`).
    pub fn start_agent_wrapped(&mut self, wrapper: &[&str], extra: &[&str]) {
        let mut agent = self.spawn_agent(wrapper, self.metrics_port, extra);
        self.wait_ready(self.metrics_port, &mut agent);
        self.agent = Some(agent);
    }

    /// Another agent in the node namespace (beside `agent`, as a DaemonSet's next pod),
    /// serving metrics on `metrics_port`; not waited for ([`Sandbox::wait_ready`]).
    pub fn spawn_agent(&self, wrapper: &[&str], metrics_port: u16, extra: &[&str]) -> Child {
        let bin = env!("CARGO_BIN_EXE_mcs-agent");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = self.node.command(program);
                c.args(args).arg(bin);
                c
            }
            None => self.node.command(bin),
        };
        cmd.env("MCS_CLUSTERSET_IP_CIDR", mcs_test_support::CLUSTERSET_CIDRS);
        cmd.args([
            "run",
            "--dataplane",
            "userspace",
            "--cluster-id",
            "c1",
            "--file-poll-ms",
            "50",
        ])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .arg("--source")
        .arg(format!("file:{}", self.dir.path().display()))
        // A userspace agent removes an eBPF socket LB pinned in its --bpf-pin-dir (a switched
        // dataplane): a directory of its own, so it never touches another agent's pins.
        .arg("--bpf-pin-dir")
        .arg(self.dir.path().join("no-pins"))
        .args(extra)
        .args(tcp_engine().map(|e| format!("--tcp-engine={e}")))
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("MCS_TEST_AGENT_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::piped()
        });
        cmd.spawn().unwrap()
    }

    /// Waits until `agent` (metrics on `metrics_port`) is ready; panics with its log if it
    /// exits first.
    pub fn wait_ready(&self, metrics_port: u16, agent: &mut Child) {
        let deadline = Instant::now() + WAIT;
        while self.http_on(metrics_port, "/readyz").map(|(c, _)| c) != Some(200) {
            if let Some(status) = agent.try_wait().unwrap() {
                let mut log = String::new();
                if let Some(mut e) = agent.stderr.take() {
                    e.read_to_string(&mut log).unwrap();
                }
                panic!("agent exited ({status}): {log}");
            }
            if Instant::now() > deadline {
                let _ = agent.kill();
                let _ = agent.wait();
                panic!("agent not ready");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(engine) = tcp_engine() {
            // The suite must test the engine it says.
            let want_io_uring = engine == "io-uring";
            let workers = || {
                let (_, body) = self.http_on(metrics_port, "/metrics")?;
                body.lines()
                    .find_map(|l| l.strip_prefix("mcs_proxy_tcp_io_uring_workers "))?
                    .trim()
                    .parse::<u64>()
                    .ok()
            };
            while (workers().unwrap_or(0) > 0) != want_io_uring {
                if Instant::now() > deadline {
                    let seen = workers();
                    let _ = agent.kill();
                    let _ = agent.wait();
                    panic!(
                        "MCS_TEST_TCP_ENGINE={engine} but mcs_proxy_tcp_io_uring_workers is {seen:?}"
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Stops the agent with SIGTERM; returns its log.
    pub fn stop_agent(&mut self) -> String {
        self.terminate_agent();
        self.wait_agent()
    }

    /// Sends the agent SIGTERM without waiting for it to exit.
    pub fn terminate_agent(&self) {
        sigterm(self.agent.as_ref().unwrap());
    }

    /// Waits for the agent to exit, which must be a success; returns its log.
    pub fn wait_agent(&mut self) -> String {
        let mut a = self.agent.take().unwrap();
        let status = a.wait().unwrap();
        let mut log = String::new();
        if let Some(mut e) = a.stderr.take() {
            e.read_to_string(&mut log).unwrap();
        }
        assert!(status.success(), "agent exit {status}: {log}");
        log
    }

    pub fn http(&self, path: &str) -> Option<(u16, String)> {
        self.http_on(self.metrics_port, path)
    }

    /// GET `path` from the agent whose metrics are on `port`; status and the whole response.
    pub fn http_on(&self, port: u16, path: &str) -> Option<(u16, String)> {
        let path = path.to_string();
        self.node
            .run(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
                s.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes())
                    .ok()?;
                let mut out = String::new();
                s.read_to_string(&mut out).ok()?;
                Some((out.split_whitespace().nth(1)?.parse().ok()?, out))
            })
            .ok()
            .flatten()
    }

    /// One TCP request from the client pod: connect, send, half-close, read all.
    pub fn tcp(&self, to: &str, msg: &str) -> Result<String, String> {
        let (to, msg) = (to.parse::<SocketAddr>().unwrap(), msg.to_string());
        self.cli
            .run(move || -> Result<String, String> {
                let mut s =
                    TcpStream::connect_timeout(&to, IO_TIMEOUT).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                s.write_all(msg.as_bytes()).map_err(|e| e.to_string())?;
                s.shutdown(std::net::Shutdown::Write)
                    .map_err(|e| e.to_string())?;
                let mut out = String::new();
                s.read_to_string(&mut out).map_err(|e| e.to_string())?;
                Ok(out)
            })
            .unwrap()
    }

    /// One UDP request/response from the client pod; returns (reply, its source address).
    pub fn udp(&self, to: &str, msg: &str) -> Result<(String, SocketAddr), String> {
        let (to, msg) = (to.parse::<SocketAddr>().unwrap(), msg.to_string());
        self.cli
            .run(move || {
                let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
                let s = UdpSocket::bind(any).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                s.send_to(msg.as_bytes(), to).map_err(|e| e.to_string())?;
                let mut buf = [0u8; 2048];
                let (n, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
                Ok((String::from_utf8_lossy(&buf[..n]).to_string(), from))
            })
            .unwrap()
    }

    /// Which backend answered each of `n` new connections (by the address it prefixes).
    pub fn distribution(&self, to: &str, n: usize) -> BTreeMap<String, usize> {
        let mut seen = BTreeMap::new();
        for i in 0..n {
            let reply = self
                .tcp(to, &format!("req{i}"))
                .unwrap_or_else(|e| panic!("request {i} to {to}: {e}"));
            let backend = reply
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            assert!(reply.ends_with(&format!("req{i}")), "{reply}");
            *seen.entry(backend).or_default() += 1;
        }
        seen
    }

    pub fn nft_table(&self) -> Option<String> {
        let out = self
            .node
            .command("nft")
            .args(["list", "table", "inet", "mcs_dataplane"])
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).to_string())
    }

    pub fn write(&self, file: &str, text: &str) {
        // Write beside and rename, so the source never reads a half-written file.
        let tmp = self.dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.dir.path().join(file)).unwrap();
    }

    pub fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap()
    }
}

pub fn prerequisites() -> bool {
    require(prereq::all([
        prereq::root(),
        prereq::program("ip"),
        prereq::program("nft"),
    ]))
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub const ALL: [&str; 6] = [
    "198.18.1.2:8080",
    "198.18.1.3:8080",
    "198.18.2.2:8080",
    "198.18.2.3:8080",
    "[2001:2::1:2]:8080",
    "[2001:2::1:3]:8080",
];

/// The TCP engine this run tests (`MCS_TEST_TCP_ENGINE=io-uring|epoll`, passed as
/// `--tcp-engine` and checked in the agent's metrics); unset: the agent's default.
pub fn tcp_engine() -> Option<String> {
    std::env::var("MCS_TEST_TCP_ENGINE")
        .ok()
        .filter(|v| !v.is_empty())
}
