//! The eBPF pipeline end to end: the embedded programs load into the running kernel, attach to
//! a test cgroup, and a TCP connect() from a process in that cgroup to a ClusterSetIP is
//! rewritten to the backend programmed in the maps. A process outside the cgroup is untouched.
//!
//! Runs inside a fresh network namespace: VIP 198.18.0.10:80, backend 127.0.0.1:<port> there.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, SocketAddrV4, TcpListener},
    thread,
};

use mcs_proxy::ebpf::{Protocol, SocketLb};
use mcs_test_support::{
    cgroup::{self, TestCgroup},
    netns::Netns,
    prereq,
    probe::Probe,
    require,
};

mcs_test_support::probe_entry!();

const VIP: &str = "198.18.0.10:80";

/// Accepts `n` connections and answers each with "backend <port> got <request>".
fn serve(listener: TcpListener, n: usize) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let port = listener.local_addr().unwrap().port();
        for _ in 0..n {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let mut req = String::new();
            let _ = s.read_to_string(&mut req);
            let _ = write!(s, "backend {port} got {req}");
        }
    })
}

#[test]
fn connect4_rewrites_vip_to_backend_for_processes_in_the_cgroup() {
    if !require(prereq::all([
        prereq::root(),
        cgroup::prerequisite(),
        prereq::program("ip"),
    ])) {
        return;
    }
    let ns = Netns::new("bpf").expect("netns");
    let cg = TestCgroup::new("bpf").expect("test cgroup");
    // The backend listens on loopback inside the namespace.
    let listener = ns
        .run(|| TcpListener::bind("127.0.0.1:0"))
        .unwrap()
        .expect("bind backend");
    let backend: SocketAddrV4 = match listener.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!(),
    };
    let server = serve(listener, 1);

    let mut lb =
        SocketLb::load().expect("load eBPF programs (needs root and a BPF-capable kernel)");
    lb.attach(cg.path())
        .expect("attach connect4 to the test cgroup");
    let vip: SocketAddrV4 = VIP.parse().unwrap();
    lb.set_service(vip, Protocol::Tcp, &[backend])
        .expect("program the service");
    assert_eq!(lb.frontends_in_map(), 1);

    // A client in the cgroup connects to the VIP and lands on the backend.
    let probe = Probe::Tcp {
        to: SocketAddr::V4(vip),
        send: "hello".into(),
    };
    let mut cmd = cg.command(Some(&ns), &Probe::program());
    probe.configure(&mut cmd);
    let out = cmd.output().expect("run probe");
    let result = Probe::parse(&out).expect("probe result");
    assert_eq!(result.error, None, "probe failed: {result:?}");
    assert_eq!(
        result.peer,
        Some(SocketAddr::V4(backend)),
        "connect was not rewritten"
    );
    assert_eq!(
        result.reply,
        format!("backend {} got hello", backend.port())
    );
    server.join().unwrap();

    // A client outside the cgroup (same namespace) is not translated: nothing listens on the
    // VIP there (no address, no route), so its connect fails.
    let mut cmd = ns.command(Probe::program().to_str().unwrap());
    probe.configure(&mut cmd);
    let untouched = Probe::parse(&cmd.output().expect("run probe")).expect("probe result");
    assert!(
        untouched.error.is_some(),
        "outside the cgroup the VIP must not be translated"
    );
    assert_ne!(untouched.peer, Some(SocketAddr::V4(backend)));
}

#[test]
fn non_frontend_destinations_are_untouched() {
    if !require(prereq::all([
        prereq::root(),
        cgroup::prerequisite(),
        prereq::program("ip"),
    ])) {
        return;
    }
    let ns = Netns::new("bpf").expect("netns");
    let cg = TestCgroup::new("bpf").expect("test cgroup");
    let listener = ns
        .run(|| TcpListener::bind("127.0.0.1:0"))
        .unwrap()
        .expect("bind");
    let direct = listener.local_addr().unwrap();
    let server = serve(listener, 1);
    let mut lb = SocketLb::load().expect("load");
    lb.attach(cg.path()).expect("attach");
    // A frontend on another port must not affect a direct connect.
    lb.set_service(
        VIP.parse().unwrap(),
        Protocol::Tcp,
        &["127.0.0.1:9".parse().unwrap()],
    )
    .expect("program");
    let probe = Probe::Tcp {
        to: direct,
        send: "x".into(),
    };
    let mut cmd = cg.command(Some(&ns), &Probe::program());
    probe.configure(&mut cmd);
    let result = Probe::parse(&cmd.output().unwrap()).unwrap();
    assert_eq!(result.error, None);
    assert_eq!(result.peer, Some(direct));
    server.join().unwrap();
}
