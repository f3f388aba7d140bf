//! The userspace dataplane end to end, as a user runs it: the `mcs-agent` binary runs inside
//! a "node" network namespace with `--source file:DIR --dataplane userspace`; a client "pod"
//! namespace reaches the ClusterSetIPs; two "cluster" namespaces hold two backends each
//! (addresses of examples/two-clusters). Real nftables, TPROXY, sockets.
//!
//! ```text
//!  cli 198.18.10.2 ── node 198.18.10.1 │ 198.18.1.1 ── c1: 198.18.1.2, 198.18.1.3 (+ 2001:2::1:2/3)
//!                                      │ 198.18.2.1 ── c2: 198.18.2.2, 198.18.2.3
//! ```

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use mcs_test_support::{
    netns::{Netns, veth},
    prereq, require,
};

const WAIT: Duration = Duration::from_secs(20);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The sandbox: namespaces, backends, the agent. Dropping it stops the agent and removes all.
struct Sandbox {
    cli: Netns,
    node: Netns,
    c1: Netns,
    c2: Netns,
    dir: tempfile::TempDir,
    agent: Option<Child>,
    metrics_port: u16,
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

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/two-clusters")
}

/// A TCP server that answers every chunk it reads with `<its address> <chunk>`, per
/// connection, until EOF; and a UDP server that answers each datagram the same way.
fn serve(ns: &Netns, addr: SocketAddr) -> Vec<std::thread::JoinHandle<()>> {
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
    fn new(backends: &[&str]) -> Self {
        let cli = Netns::new("cli").unwrap();
        let node = Netns::new("node").unwrap();
        let c1 = Netns::new("c1").unwrap();
        let c2 = Netns::new("c2").unwrap();
        veth(&cli, "eth0", &node, "cli0").unwrap();
        veth(&node, "c1", &c1, "eth0").unwrap();
        veth(&node, "c2", &c2, "eth0").unwrap();
        cli.addr("eth0", "198.18.10.2/24").unwrap();
        cli.addr("eth0", "2001:2::10:2/112").unwrap();
        node.addr("cli0", "198.18.10.1/24").unwrap();
        node.addr("cli0", "2001:2::10:1/112").unwrap();
        node.addr("c1", "198.18.1.1/24").unwrap();
        node.addr("c1", "2001:2::1:1/112").unwrap();
        node.addr("c2", "198.18.2.1/24").unwrap();
        for a in [
            "198.18.1.2/24",
            "198.18.1.3/24",
            "2001:2::1:2/112",
            "2001:2::1:3/112",
        ] {
            c1.addr("eth0", a).unwrap();
        }
        for a in ["198.18.2.2/24", "198.18.2.3/24"] {
            c2.addr("eth0", a).unwrap();
        }
        cli.route("default", "198.18.10.1").unwrap();
        cli.route("default", "2001:2::10:1").unwrap();
        c1.route("default", "198.18.1.1").unwrap();
        c1.route("default", "2001:2::1:1").unwrap();
        c2.route("default", "198.18.2.1").unwrap();
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
    fn start_agent(&mut self, extra: &[&str]) {
        let mut cmd = self.node.command(env!("CARGO_BIN_EXE_mcs-agent"));
        cmd.args([
            "run",
            "--dataplane",
            "userspace",
            "--cluster-id",
            "c1",
            "--file-poll-ms",
            "50",
        ])
        .args([
            "--metrics-addr",
            &format!("127.0.0.1:{}", self.metrics_port),
        ])
        .arg("--source")
        .arg(format!("file:{}", self.dir.path().display()))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("MCS_TEST_AGENT_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::piped()
        });
        self.agent = Some(cmd.spawn().unwrap());
        let deadline = Instant::now() + WAIT;
        while self.http("/readyz").map(|(c, _)| c) != Some(200) {
            if let Some(status) = self.agent.as_mut().unwrap().try_wait().unwrap() {
                let mut log = String::new();
                self.agent
                    .as_mut()
                    .unwrap()
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut log)
                    .unwrap();
                panic!("agent exited ({status}): {log}");
            }
            assert!(Instant::now() < deadline, "agent not ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the agent with SIGTERM; returns its log.
    fn stop_agent(&mut self) -> String {
        let mut a = self.agent.take().unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(a.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = a.wait().unwrap();
        let mut log = String::new();
        if let Some(mut e) = a.stderr.take() {
            e.read_to_string(&mut log).unwrap();
        }
        assert!(status.success(), "agent exit {status}: {log}");
        log
    }

    fn http(&self, path: &str) -> Option<(u16, String)> {
        let port = self.metrics_port;
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
    fn tcp(&self, to: &str, msg: &str) -> Result<String, String> {
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
    fn udp(&self, to: &str, msg: &str) -> Result<(String, SocketAddr), String> {
        let (to, msg) = (to.parse::<SocketAddr>().unwrap(), msg.to_string());
        self.cli
            .run(move || {
                let s = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                s.send_to(msg.as_bytes(), to).map_err(|e| e.to_string())?;
                let mut buf = [0u8; 2048];
                let (n, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
                Ok((String::from_utf8_lossy(&buf[..n]).to_string(), from))
            })
            .unwrap()
    }

    /// Which backend answered each of `n` new connections (by the address it prefixes).
    fn distribution(&self, to: &str, n: usize) -> BTreeMap<String, usize> {
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

    fn nft_table(&self) -> Option<String> {
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

    fn write(&self, file: &str, text: &str) {
        // Write beside and rename, so the source never reads a half-written file.
        let tmp = self.dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.dir.path().join(file)).unwrap();
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap()
    }
}

fn prerequisites() -> bool {
    require(prereq::all([
        prereq::root(),
        prereq::program("ip"),
        prereq::program("nft"),
    ]))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const ALL: [&str; 6] = [
    "198.18.1.2:8080",
    "198.18.1.3:8080",
    "198.18.2.2:8080",
    "198.18.2.3:8080",
    "[2001:2::1:2]:8080",
    "[2001:2::1:3]:8080",
];

#[test]
fn tcp_udp_ipv6_local_first_then_failover_and_clean_exit() {
    if !prerequisites() {
        return;
    }
    let mut backends = ALL.to_vec();
    backends.extend(["198.18.1.2:5353", "198.18.2.2:5353"]);
    let mut sb = Sandbox::new(&backends);
    sb.start_agent(&[]);
    assert!(sb.nft_table().unwrap().contains("198.18.100.10 . tcp . 80"));

    // TCP to the ClusterSetIP: only the local cluster's two backends, both used.
    let d = sb.distribution("198.18.100.10:80", 30);
    assert_eq!(
        d.keys().cloned().collect::<Vec<_>>(),
        ["198.18.1.2:8080", "198.18.1.3:8080"],
        "{d:?}"
    );

    // IPv6 VIP → IPv6 backends.
    let d6 = sb.distribution("[2001:2::100:10]:80", 10);
    assert!(d6.keys().all(|k| k.starts_with("[2001:2::1:")), "{d6:?}");

    // UDP: the reply comes from the VIP; the local ready backend answers.
    let (reply, from) = sb.udp("198.18.100.12:53", "q1").unwrap();
    assert_eq!(reply, "198.18.1.2:5353 q1");
    assert_eq!(
        from,
        "198.18.100.12:53".parse().unwrap(),
        "reply must come from the VIP"
    );

    // The local cluster's web endpoints go unready: new connections fail over to c2.
    let c1 = sb.read("slices-c1.yaml");
    sb.write("slices-c1.yaml", &c1.replace(
        "- { addresses: [\"198.18.1.2\"], conditions: { ready: true, serving: true, terminating: false }, zone: z1, nodeName: c1-node-a }\n- { addresses: [\"198.18.1.3\"], conditions: { ready: true, serving: true, terminating: false }, zone: z2, nodeName: c1-node-b }",
        "- { addresses: [\"198.18.1.2\"], conditions: { ready: false }, zone: z1 }\n- { addresses: [\"198.18.1.3\"], conditions: { ready: false }, zone: z2 }",
    ));
    wait_until("failover to c2", || {
        sb.tcp("198.18.100.10:80", "x")
            .is_ok_and(|r| r.starts_with("198.18.2."))
    });
    let d = sb.distribution("198.18.100.10:80", 20);
    assert!(d.keys().all(|k| k.starts_with("198.18.2.")), "{d:?}");

    // Metrics per frontend and backend.
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics.contains(
            "mcs_proxy_connections_total{frontend=\"198.18.100.10:80/TCP\",backend=\"198.18.2."
        ),
        "{metrics}"
    );

    // SIGTERM: clean exit, interception removed.
    let log = sb.stop_agent();
    assert!(log.contains("interception removed"), "{log}");
    assert!(sb.nft_table().is_none(), "nft table left behind");
    let rules = sb
        .node
        .command("ip")
        .args(["rule", "list"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&rules.stdout).contains("0x4d43"),
        "ip rule left behind"
    );
}

#[test]
fn retries_a_refusing_backend_and_keeps_affinity_per_client() {
    if !prerequisites() {
        return;
    }
    // 198.18.1.3 has no listener: connects there are refused and retried on 198.18.1.2.
    let mut sb = Sandbox::new(&["198.18.1.2:8080", "198.18.1.2:9090", "198.18.1.3:9090"]);
    sb.start_agent(&[]);
    let d = sb.distribution("198.18.100.10:80", 20);
    assert_eq!(
        d.keys().cloned().collect::<Vec<_>>(),
        ["198.18.1.2:8080"],
        "{d:?}"
    );
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics.contains("mcs_proxy_retries_total{frontend=\"198.18.100.10:80/TCP\"}"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("mcs_proxy_retries_total{frontend=\"198.18.100.10:80/TCP\"} 0"),
        "no retry counted"
    );

    // cart has ClientIP affinity: every connection of this client lands on one backend.
    let d = sb.distribution("198.18.100.11:9090", 20);
    assert_eq!(d.len(), 1, "affinity broken: {d:?}");
    sb.stop_agent();
}

#[test]
fn drain_keeps_an_open_stream_while_new_connections_go_elsewhere() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&["--drain-timeout-s", "60"]);
    // An open stream through the VIP.
    let stream = sb
        .cli
        .run(|| {
            let s = TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)
                .unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            s
        })
        .unwrap();
    let ask = |mut s: &TcpStream, m: &str| -> String {
        s.write_all(m.as_bytes()).unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).to_string()
    };
    let first = ask(&stream, "one");
    let backend = first.split_whitespace().next().unwrap().to_string();
    let (other, kept) = if backend == "198.18.1.2:8080" {
        ("198.18.1.3", "198.18.1.2")
    } else {
        ("198.18.1.2", "198.18.1.3")
    };
    // Remove that backend's endpoint from the slice.
    let c1 = sb.read("slices-c1.yaml");
    let line = c1
        .lines()
        .find(|l| l.contains(&format!("[\"{kept}\"]")) && l.contains("c1-node"))
        .unwrap()
        .to_string();
    sb.write("slices-c1.yaml", &c1.replace(&format!("{line}\n"), ""));
    wait_until("new connections avoid the removed backend", || {
        (0..6).all(|i| {
            sb.tcp("198.18.100.10:80", &format!("n{i}"))
                .is_ok_and(|r| r.starts_with(other))
        })
    });
    // The open stream still works, on its old backend.
    let again = ask(&stream, "two");
    assert_eq!(again, format!("{backend} two"));
    drop(stream);
    sb.stop_agent();
}

#[test]
fn connections_above_the_cap_are_refused_while_open_ones_continue() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&["--max-connections", "2"]);
    let open = |sb: &Sandbox| -> std::io::Result<TcpStream> {
        sb.cli
            .run(|| {
                let s =
                    TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)?;
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                Ok(s)
            })
            .unwrap()
    };
    let ask = |mut s: &TcpStream, m: &str| -> std::io::Result<String> {
        s.write_all(m.as_bytes())?;
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).to_string())
    };
    let a = open(&sb).unwrap();
    let b = open(&sb).unwrap();
    assert!(ask(&a, "a").unwrap().ends_with(" a"));
    assert!(ask(&b, "b").unwrap().ends_with(" b"));
    // The third is accepted by the kernel (TPROXY) and reset by the forwarder.
    let refused = open(&sb).and_then(|c| ask(&c, "c"));
    assert!(
        refused.as_ref().map_or(true, String::is_empty),
        "third connection served: {refused:?}"
    );
    // The open ones carry on.
    assert!(ask(&a, "a2").unwrap().ends_with(" a2"));
    assert!(ask(&b, "b2").unwrap().ends_with(" b2"));
    drop((a, b));
    sb.stop_agent();
}

#[test]
fn a_table_left_by_a_crash_is_replaced_at_start() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    // What a crashed agent leaves: its table with a stale frontend, and its ip rule.
    let out = sb
        .node
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(
                b"table inet mcs_dataplane {\n set frontends4 {\n  type ipv4_addr . inet_proto . inet_service\n  elements = { 198.18.99.99 . tcp . 80 }\n }\n}\n",
            )?;
            c.wait()
        })
        .unwrap();
    assert!(out.success());
    sb.node
        .ip(&["rule", "add", "fwmark", "0x4d43", "lookup", "19779"])
        .unwrap();
    sb.start_agent(&[]);
    let table = sb.nft_table().unwrap();
    assert!(
        !table.contains("198.18.99.99"),
        "stale frontend kept: {table}"
    );
    assert!(table.contains("198.18.100.10 . tcp . 80"));
    let rules = sb
        .node
        .command("ip")
        .args(["rule", "list"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&rules.stdout)
            .matches("0x4d43")
            .count(),
        1,
        "duplicate ip rules"
    );
    assert!(sb.tcp("198.18.100.10:80", "hi").unwrap().ends_with(" hi"));
    sb.stop_agent();
    let _ = (&sb.c1, &sb.c2, Path::new("/"));
}

#[test]
fn demo_runs_end_to_end_and_leaves_nothing_behind() {
    if !prerequisites() {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .args(["demo", "--requests", "20"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "[6/6]",
        "cluster c1:",
        "cluster c2:",
        "failover: new connections reach cluster c2",
        "replies came from the ClusterSetIP: yes",
        "nothing left behind",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    // The demo checks its own namespaces are gone ("nothing left behind", asserted above).
}
