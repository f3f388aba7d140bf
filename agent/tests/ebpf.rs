//! The eBPF dataplane as a user runs it: `mcs-agent run --dataplane ebpf` attaches to a test
//! cgroup and pins under a test directory; clients are probe processes inside that cgroup and
//! a network namespace whose loopback device holds the backends (198.18.20.2/.3). The agent is
//! SIGKILLed under steady load: no connection fails; the restarted agent adopts maps and links;
//! `status` reads the maps back; `uninstall` detaches.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use mcs_test_support::{
    cgroup::TestCgroup,
    netns::Netns,
    prereq,
    probe::{Probe, ProbeResult},
    require,
};

mcs_test_support::probe_entry!();

const WAIT: Duration = Duration::from_secs(20);

const OBJECTS: &str = r#"
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: web, namespace: shop }
spec: { type: ClusterSetIP, ips: ["198.18.100.10"], ports: [{ name: http, protocol: TCP, port: 80 }] }
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-c1
  namespace: shop
  labels: { multicluster.kubernetes.io/service-name: web, multicluster.kubernetes.io/source-cluster: c1 }
addressType: IPv4
ports: [{ name: http, protocol: TCP, port: 8080 }]
endpoints:
- { addresses: ["198.18.20.2"], conditions: { ready: true } }
- { addresses: ["198.18.20.3"], conditions: { ready: true } }
"#;

struct Setup {
    ns: Netns,
    cg: TestCgroup,
    pins: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
            .args(["uninstall", "--bpf-pin-dir"])
            .arg(&self.pins)
            .output();
    }
}

fn setup() -> Option<Setup> {
    if !require(prereq::socket_lb()) {
        return None;
    }
    let ns = Netns::new("ebpf").unwrap();
    // Backend addresses on `lo` of the namespace (this kernel has no dummy interfaces).
    ns.addr("lo", "198.18.20.2/32").unwrap();
    ns.addr("lo", "198.18.20.3/32").unwrap();
    for a in ["198.18.20.2:8080", "198.18.20.3:8080"] {
        let l = ns.run(|| TcpListener::bind(a)).unwrap().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let mut req = String::new();
                let _ = s.read_to_string(&mut req);
                let _ = write!(s, "{a} got {req}");
            }
        });
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("objects.yaml"), OBJECTS).unwrap();
    let port = mcs_test_support::ports::unused_port_or_panic();
    let pins = Path::new("/sys/fs/bpf").join(mcs_test_support::unique_name("agent"));
    Some(Setup {
        ns,
        cg: TestCgroup::new("ebpf").unwrap(),
        pins,
        dir,
        port,
    })
}

impl Setup {
    #[allow(
        clippy::zombie_processes,
        reason = "the child is returned; callers kill and wait it"
    )]
    fn start_agent(&self) -> Child {
        self.start_agent_with(None)
    }

    /// The agent with only `caps` in its bounding set (e.g. `+net_admin,+bpf`), as the
    /// DaemonSet grants them, when given.
    #[allow(
        clippy::zombie_processes,
        reason = "the child is returned; callers kill and wait it"
    )]
    fn spawn_agent(&self, caps: Option<&str>) -> Child {
        let mut cmd = match caps {
            Some(c) => {
                let mut cmd = Command::new("setpriv");
                cmd.arg(format!("--bounding-set=-all,{c}"))
                    .arg("--inh-caps=-all")
                    .arg(env!("CARGO_BIN_EXE_mcs-agent"));
                cmd
            }
            None => Command::new(env!("CARGO_BIN_EXE_mcs-agent")),
        };
        cmd.env("MCS_CLUSTERSET_IP_CIDR", mcs_test_support::CLUSTERSET_CIDRS)
            .args([
                "run",
                "--dataplane",
                "ebpf",
                "--cluster-id",
                "c1",
                "--file-poll-ms",
                "50",
            ])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", self.port)])
            .arg("--cgroup-root")
            .arg(self.cg.path())
            .arg("--bpf-pin-dir")
            .arg(&self.pins)
            .arg("--source")
            .arg(format!("file:{}", self.dir.path().display()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    #[allow(
        clippy::zombie_processes,
        reason = "the child is returned; callers kill and wait it"
    )]
    fn start_agent_with(&self, caps: Option<&str>) -> Child {
        let mut child = self.spawn_agent(caps);
        let deadline = Instant::now() + WAIT;
        loop {
            let ready = TcpStream::connect(("127.0.0.1", self.port))
                .ok()
                .and_then(|mut s| {
                    s.write_all(b"GET /readyz HTTP/1.1\r\n\r\n").ok()?;
                    let mut out = String::new();
                    s.read_to_string(&mut out).ok()?;
                    Some(out.starts_with("HTTP/1.1 200"))
                });
            if ready == Some(true) {
                return child;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("agent not ready");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn probe(&self, p: &Probe) -> ProbeResult {
        let mut cmd = self.cg.command(Some(&self.ns), &Probe::program());
        p.configure(&mut cmd);
        Probe::parse(&cmd.output().unwrap()).unwrap()
    }

    fn status(&self) -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
            .args(["status", "--format", "json", "--bpf-pin-dir"])
            .arg(&self.pins)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

fn stderr_of(mut c: Child) -> String {
    let mut log = String::new();
    c.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    log
}

#[test]
fn sigkill_under_load_fails_no_connection_and_the_restart_adopts_the_maps() {
    let Some(s) = setup() else { return };
    let mut agent = s.start_agent();
    let vip: SocketAddr = "198.18.100.10:80".parse().unwrap();
    let r = s.probe(&Probe::Tcp {
        to: vip,
        send: "hi".into(),
    });
    assert_eq!(r.error, None, "{r:?}");
    assert!(r.reply.starts_with("198.18.20."), "{r:?}");
    assert_eq!(r.peer, Some(vip), "getpeername shows the VIP");
    let st = s.status();
    assert_eq!(
        st["frontends"]["198.18.100.10:80/TCP"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "{st}"
    );
    // The maps were made at the default caps' sizes (10,000 frontends, 100,000 backends and
    // one frontend's room), and status says how full they are: one frontend, two slots.
    assert_eq!(st["maps"]["MCS_SVC4_V1"]["max_entries"], 111_025, "{st}");
    assert_eq!(st["maps"]["MCS_SVC4_V1"]["entries"], 3, "{st}");
    assert_eq!(st["maps"]["MCS_BE4_V1"]["max_entries"], 101_025, "{st}");

    // Steady load in a client process while the agent is SIGKILLed.
    let mut load = s.cg.command(Some(&s.ns), &Probe::program());
    Probe::TcpLoop {
        to: vip,
        count: 150,
        interval_ms: 10,
    }
    .configure(&mut load);
    let load = load.stdout(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    agent.kill().unwrap();
    let _ = agent.wait();
    let r = Probe::parse(&load.wait_with_output().unwrap()).unwrap();
    assert_eq!(
        (r.ok, r.failed),
        (150, 0),
        "connections failed while the agent was down: {r:?}"
    );

    // Restart: the maps and links are adopted, and changes flow again.
    let agent = s.start_agent();
    let objects = OBJECTS.replace(
        "- { addresses: [\"198.18.20.3\"], conditions: { ready: true } }\n",
        "",
    );
    std::fs::write(s.dir.path().join("objects.yaml"), objects).unwrap();
    let deadline = Instant::now() + WAIT;
    while s.status()["frontends"]["198.18.100.10:80/TCP"]
        .as_array()
        .map(Vec::len)
        != Some(1)
    {
        assert!(
            Instant::now() < deadline,
            "backend removal never reached the maps"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for _ in 0..10 {
        let r = s.probe(&Probe::Tcp {
            to: vip,
            send: "x".into(),
        });
        assert!(
            r.reply.starts_with("198.18.20.2:8080"),
            "removed backend got a connection: {r:?}"
        );
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let log = stderr_of(agent);
    assert!(log.contains("kept pinned links"), "{log}");
    assert!(log.contains("adopted pinned eBPF maps"), "{log}");
    assert!(log.contains("stay attached"), "{log}");

    // Still translated after a clean stop; `uninstall` detaches.
    assert!(
        s.probe(&Probe::Tcp {
            to: vip,
            send: "y".into()
        })
        .error
        .is_none()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .args(["uninstall", "--bpf-pin-dir"])
        .arg(&s.pins)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!s.pins.exists());
    assert!(
        s.probe(&Probe::Tcp {
            to: vip,
            send: "z".into()
        })
        .error
        .is_some(),
        "translated after uninstall"
    );
}

#[test]
fn status_without_pins_says_what_to_do() {
    let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .args(["status", "--bpf-pin-dir", "/nonexistent/mcs-pins"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dataplane ebpf"));
}

#[test]
fn demo_runs_both_dataplanes_side_by_side() {
    let Some(_s) = setup() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .args(["demo", "--dataplane", "both", "--requests", "20"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "dataplane userspace",
        "dataplane ebpf",
        "failover: new connections reach cluster c2",
        "side by side",
        "replies came from the ClusterSetIP: yes",
        "what the eBPF maps hold now",
        "nothing left behind",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

/// The DaemonSet grants NET_ADMIN, BPF and PERFMON: with exactly those the eBPF agent loads,
/// attaches and translates; without any one of them it fails at start with a clear error.
#[test]
fn the_deployed_capabilities_are_exactly_what_the_ebpf_agent_needs() {
    let Some(s) = setup() else { return };
    if !require(prereq::program("setpriv")) {
        return;
    }
    let mut child = s.start_agent_with(Some("+net_admin,+bpf,+perfmon"));
    let r = s.probe(&Probe::Tcp {
        to: "198.18.100.10:80".parse().unwrap(),
        send: "caps".into(),
    });
    assert!(r.reply.ends_with("got caps"), "{r:?}");
    let _ = child.kill();
    let _ = child.wait();
    let _ = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .args(["uninstall", "--bpf-pin-dir"])
        .arg(&s.pins)
        .output();
    for caps in ["+bpf,+perfmon", "+net_admin,+perfmon", "+net_admin,+bpf"] {
        let mut child = s.spawn_agent(Some(caps));
        // Read stderr while it runs: a verifier log can be larger than the pipe.
        let mut stderr = child.stderr.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut err = String::new();
            let _ = stderr.read_to_string(&mut err);
            err
        });
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("agent with {caps} did not fail");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = reader.join().unwrap();
        assert!(!status.success(), "agent with only {caps} started: {err}");
        assert!(
            err.contains("eBPF") || err.contains("attaching"),
            "{caps}: {err}"
        );
        // All or nothing: no program stays attached after a failed start.
        let links = std::fs::read_dir(s.pins.join("links"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(links, 0, "{caps}: links left attached");
        let _ = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
            .args(["uninstall", "--bpf-pin-dir"])
            .arg(&s.pins)
            .output();
    }
}
