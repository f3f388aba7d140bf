//! The topology helpers against the real kernel: two namespaces joined by a veth pair carry a
//! TCP connection over IPv4 and IPv6; a command started in a test cgroup is in it; everything
//! is gone after the guards drop.

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::Path,
};

use mcs_test_support::{
    cgroup::{self, TestCgroup},
    netns::{Netns, Pair},
    prereq, require,
};

fn exchange(pair: &Pair, listen: &str, connect: &str) {
    let listener = pair
        .b
        .run(|| TcpListener::bind(listen))
        .unwrap()
        .expect("bind in b");
    let server = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().expect("accept");
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        write!(s, "{buf} from {}", peer.ip()).unwrap();
    });
    let connect = connect.to_string();
    let reply = pair
        .a
        .run(move || {
            let mut s = TcpStream::connect(&connect).expect("connect from a");
            s.write_all(b"ping").unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        })
        .unwrap();
    server.join().unwrap();
    assert!(reply.starts_with("ping from "), "{reply}");
}

#[test]
fn veth_pair_carries_tcp_over_ipv4_and_ipv6_and_is_removed() {
    if !require(prereq::all([prereq::root(), prereq::program("ip")])) {
        return;
    }
    let pair = Pair::new("198.18.10.1/30", "198.18.10.2/30").expect("pair");
    pair.a.addr("eth0", "2001:2:0:10::1/64").unwrap();
    pair.b.addr("eth0", "2001:2:0:10::2/64").unwrap();
    exchange(&pair, "198.18.10.2:7000", "198.18.10.2:7000");
    exchange(&pair, "[2001:2:0:10::2]:7001", "[2001:2:0:10::2]:7001");
    let (a, b) = (pair.a.path(), pair.b.path());
    assert!(a.exists() && b.exists());
    drop(pair);
    assert!(
        !a.exists() && !b.exists(),
        "namespaces must be removed on drop"
    );
}

#[test]
fn routes_reach_a_third_namespace_through_a_forwarding_node() {
    if !require(prereq::all([prereq::root(), prereq::program("ip")])) {
        return;
    }
    // cli ── node ── be : the shape of the dataplane tests.
    let cli = Netns::new("cli").unwrap();
    let node = Netns::new("node").unwrap();
    let be = Netns::new("be").unwrap();
    mcs_test_support::netns::veth(&cli, "eth0", &node, "cli0").unwrap();
    mcs_test_support::netns::veth(&node, "be0", &be, "eth0").unwrap();
    cli.addr("eth0", "198.18.20.2/24").unwrap();
    node.addr("cli0", "198.18.20.1/24").unwrap();
    node.addr("be0", "198.18.21.1/24").unwrap();
    be.addr("eth0", "198.18.21.2/24").unwrap();
    cli.route("default", "198.18.20.1").unwrap();
    be.route("default", "198.18.21.1").unwrap();
    node.enable_forwarding().unwrap();
    let pair = Pair { a: cli, b: be };
    exchange(&pair, "198.18.21.2:7002", "198.18.21.2:7002");
}

#[test]
fn command_in_test_cgroup_runs_inside_it_and_cgroup_is_removed() {
    if !require(prereq::all([prereq::root(), cgroup::prerequisite()])) {
        return;
    }
    let cg = TestCgroup::new("cg").expect("cgroup");
    let out = cg
        .command(None, Path::new("/bin/cat"))
        .arg("/proc/self/cgroup")
        .output()
        .expect("run cat in cgroup");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let name = cg.path().file_name().unwrap().to_string_lossy().to_string();
    // cgroup v2 line: "0::/<path>"
    assert!(
        text.lines()
            .any(|l| l.starts_with("0::") && l.ends_with(&name)),
        "not in the test cgroup: {text}"
    );
    let path = cg.path().to_path_buf();
    drop(cg);
    assert!(!path.exists(), "cgroup must be removed on drop");
}
