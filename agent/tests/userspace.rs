//! The userspace dataplane end to end, as a user runs it: the `mcs-agent` binary runs inside
//! a "node" network namespace with `--source file:DIR --dataplane userspace`; a client "pod"
//! namespace reaches the ClusterSetIPs; two "cluster" namespaces hold two backends each
//! (addresses of examples/two-clusters). Real nftables, TPROXY, sockets.

mod common;

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use common::*;

#[test]
fn tcp_udp_ipv6_local_first_then_failover_and_clean_exit() {
    if !prerequisites() {
        return;
    }
    let mut backends = ALL.to_vec();
    backends.extend(["198.18.1.2:5353", "198.18.2.2:5353"]);
    let mut sb = Sandbox::new(&backends);
    sb.start_agent(&["--metrics-per-backend"]);
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

    // `/status` (what `kubectl mcs` reads): the forwarder's own figures, and the frontend
    // with c2's backends now selected.
    let (_, status) = sb.http("/status?service=shop/web").unwrap();
    for want in [
        "\"dataplane\": \"userspace\"",
        "\"TCP frontends listening\"",
        "\"UDP frontends listening\"",
        "\"TCP connections open\"",
        "\"frontend\": \"198.18.100.10:80/TCP\"",
    ] {
        assert!(status.contains(want), "{want} not in {status}");
    }

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

/// Every backend of the local cluster refuses while its EndpointSlice still says ready (the
/// pods died a moment ago): the first connections are tried on c1's backends, then taken by
/// c2's; once c1's refused, the node skips them (passive health) and the next ones go to
/// c2's at once; the client never sees a reset.
#[test]
fn when_every_local_backend_refuses_the_next_clusters_backends_take_the_connection() {
    if !prerequisites() {
        return;
    }
    // c1's web endpoints (198.18.1.2 and .3, ready in its slice) have no listener.
    let mut sb = Sandbox::new(&["198.18.2.2:8080", "198.18.2.3:8080"]);
    sb.start_agent(&["--metrics-per-backend"]);
    let mut served = std::collections::BTreeMap::new();
    for i in 0..20 {
        let r = sb
            .tcp("198.18.100.10:80", &format!("m{i}"))
            .unwrap_or_else(|e| panic!("request {i} failed: {e}"));
        assert!(r.ends_with(&format!(" m{i}")), "cut reply: {r:?}");
        *served
            .entry(r.split_whitespace().next().unwrap().to_string())
            .or_insert(0) += 1;
    }
    assert!(
        served.keys().all(|b| b.starts_with("198.18.2.")),
        "{served:?}"
    );
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics
            .contains("mcs_proxy_fallback_connections_total{frontend=\"198.18.100.10:80/TCP\"} 20"),
        "{metrics}"
    );
    // Connections whose first choice was skipped are counted for the frontend (once both of
    // c1's backends were marked, each connection's pick was one of them).
    let skipped: u64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "mcs_proxy_skipped_connections_total{frontend=\"198.18.100.10:80/TCP\"} ",
            )
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no skipped_connections series: {metrics}"));
    assert!((1..=20).contains(&skipped), "{skipped} skipped of 20");
    // c1's backends were tried first, and once they refused, this node skipped them
    // (passive health): far fewer refused connects than the 20 connections (one each, and
    // one more per backend each time its skip ends while the 20 connections last: 1 s,
    // then 2 s, 4 s, ...).
    for b in ["198.18.1.2:8080", "198.18.1.3:8080"] {
        let prefix = format!(
            "mcs_proxy_connect_failures_total{{frontend=\"198.18.100.10:80/TCP\",backend=\"{b}\"}} "
        );
        let failures: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{b}: no connect_failures series: {metrics}"));
        assert!(
            (1..=6).contains(&failures),
            "{b}: {failures} refused connects of 20"
        );
    }
    // `/status` names them as skipped on this node (what `kubectl mcs explain` shows). One
    // more connection first: a skip that ended meanwhile is renewed by its retry's refusal.
    sb.tcp("198.18.100.10:80", "again").unwrap();
    let (code, answer) = sb.http("/status?service=shop/web").unwrap();
    assert_eq!(code, 200, "{answer}");
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let status: serde_json::Value = serde_json::from_str(body).unwrap();
    let frontend = status["service"]["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["frontend"] == "198.18.100.10:80/TCP")
        .expect("the web frontend")
        .clone();
    let mut skipped: Vec<String> = frontend["skipped"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|b| format!("{}:{}", b["address"].as_str().unwrap(), b["port"]))
                .collect()
        })
        .unwrap_or_default();
    skipped.sort();
    assert_eq!(
        skipped,
        ["198.18.1.2:8080", "198.18.1.3:8080"],
        "{frontend}"
    );
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
    let stream = open_web(&sb).unwrap();
    let ask = |s: &TcpStream, m: &str| ask_once(s, m).unwrap();
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

/// Shutdown (SIGTERM) refuses new connections at once, while a connection open at that
/// moment keeps working until the drain bound and is then cut with a reset; then the
/// interception is gone.
#[test]
fn a_connection_open_at_shutdown_works_until_the_drain_bound_then_is_reset() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&["--drain-timeout-s", "2"]);
    let stream = open_web(&sb).unwrap();
    let first = ask_once(&stream, "one").unwrap();
    let backend = first.split_whitespace().next().unwrap().to_string();
    sb.terminate_agent();
    wait_until("shutdown closed the listeners", || open_web(&sb).is_err());
    assert_eq!(
        ask_once(&stream, "two").unwrap(),
        format!("{backend} two"),
        "the open connection stopped working at shutdown"
    );
    let (_, end) = read_until_end(&stream);
    assert_eq!(
        end.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset),
        "a connection cut at the drain bound must end with a reset"
    );
    sb.wait_agent();
    assert!(sb.nft_table().is_none(), "the interception was left behind");
}

#[test]
fn connections_above_the_cap_are_refused_while_open_ones_continue() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&["--max-connections", "2"]);
    let (a, b) = two_served_and_a_third_refused(&sb);
    assert!(ask_once(&b, "b2").unwrap().ends_with(" b2"));
    drop((a, b));
    sb.stop_agent();
}

/// Two connections to web are served, a third is refused (accepted by the kernel's TPROXY,
/// reset by the forwarder), and the first goes on being served; returns the two.
fn two_served_and_a_third_refused(sb: &Sandbox) -> (TcpStream, TcpStream) {
    let a = open_web(sb).unwrap();
    let b = open_web(sb).unwrap();
    assert!(ask_once(&a, "a").unwrap().ends_with(" a"));
    assert!(ask_once(&b, "b").unwrap().ends_with(" b"));
    let refused = open_web(sb).and_then(|c| ask_once(&c, "c"));
    assert!(
        refused.as_ref().map_or(true, String::is_empty),
        "third connection served: {refused:?}"
    );
    assert!(ask_once(&a, "a2").unwrap().ends_with(" a2"));
    (a, b)
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

/// Under a low open-files limit the frontends' sockets keep to their budget: the frontends
/// beyond it are not intercepted (counted, and said in one line), while the agent keeps
/// answering its metrics and the frontends within it are served.
#[test]
fn frontends_beyond_the_descriptor_budget_are_not_intercepted_and_the_agent_stays_up() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    // 200 more TCP frontends: 20 imports of 10 ports on 198.18.0.0/24, one ready endpoint each.
    let mut yaml = String::new();
    for i in 1..=20 {
        let ports: Vec<String> = (0..10)
            .map(|p| format!("{{ name: p{p}, protocol: TCP, port: {} }}", 8000 + p))
            .collect();
        let ports = ports.join(", ");
        yaml.push_str(&format!(
            "---\napiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {{ name: many{i}, namespace: shop }}\nspec: {{ type: ClusterSetIP, ips: [\"198.18.0.{i}\"], ports: [{ports}] }}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{ name: many{i}-c1, namespace: shop, labels: {{ multicluster.kubernetes.io/service-name: many{i}, multicluster.kubernetes.io/source-cluster: c1 }} }}\naddressType: IPv4\nports: [{ports}]\nendpoints: [{{ addresses: [\"198.18.1.2\"], conditions: {{ ready: true }} }}]\n"
        ));
    }
    sb.write("many.yaml", &yaml);
    // 256 descriptors: a budget of 128 sockets, so not all of the 200 frontends fit.
    sb.start_agent_wrapped(&["prlimit", "--nofile=256:256"], &[]);
    let metric = |name: &str| -> u64 {
        let (_, m) = sb.http("/metrics").expect("the agent answers /metrics");
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    wait_until("the 200 frontends tried", || {
        metric("mcs_proxy_listening_frontends") + metric("mcs_proxy_listen_failures_total") >= 200
    });
    let (listening, failed) = (
        metric("mcs_proxy_listening_frontends"),
        metric("mcs_proxy_listen_failures_total"),
    );
    assert!(
        listening > 0 && failed > 0,
        "listening {listening}, failed {failed}"
    );
    assert!(
        listening <= 128,
        "more frontends listening ({listening}) than sockets in the budget"
    );
    // The interception set holds exactly the frontends that listen.
    wait_until("the nft set holds the listening frontends", || {
        let table = sb.nft_table().unwrap_or_default();
        let elements = table.matches(" . tcp . ").count() + table.matches(" . udp . ").count();
        elements as u64 == metric("mcs_proxy_listening_frontends")
    });
    let log = sb.stop_agent();
    assert!(log.contains("frontends not intercepted"), "{log}");
}

/// A killed agent leaves its interception (so that a restart keeps the ClusterSetIPs
/// intercepted); meanwhile the frontends refuse at once (TCP reset, UDP port unreachable)
/// instead of black-holing, and `mcs-agent uninstall` removes the table, rules and routes.
#[test]
fn a_killed_agent_leaves_refusing_frontends_that_uninstall_removes() {
    if !prerequisites() {
        return;
    }
    let mut backends = ALL.to_vec();
    backends.push("198.18.1.2:5353");
    let mut sb = Sandbox::new(&backends);
    sb.start_agent(&[]);
    assert!(sb.tcp("198.18.100.10:80", "a").unwrap().ends_with(" a"));
    let mut killed = sb.agent.take().unwrap();
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(
        sb.nft_table().is_some(),
        "a killed agent's table should stay"
    );
    // The killed process's sockets go with it (an io_uring worker's listeners a moment later,
    // when the kernel tears its ring down); from then on the frontend refuses at once.
    wait_until("TCP to a frontend without a forwarder is refused", || {
        let refused = sb
            .cli
            .run(|| {
                let to: std::net::SocketAddr = "198.18.100.10:80".parse().unwrap();
                TcpStream::connect_timeout(&to, std::time::Duration::from_secs(5)).map(drop)
            })
            .unwrap();
        match refused {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => true,
            Err(e) => panic!("TCP to a frontend without a forwarder: {e}, not refused"),
            Ok(()) => false,
        }
    });
    let udp = sb
        .cli
        .run(|| {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            s.connect("198.18.100.12:53").unwrap();
            s.send(b"q").unwrap();
            let mut buf = [0u8; 64];
            s.recv(&mut buf).map(drop)
        })
        .unwrap();
    assert_eq!(
        udp.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionRefused),
        "UDP to a frontend without a forwarder must get port unreachable"
    );
    let pins = tempfile::tempdir().unwrap();
    let out = sb
        .node
        .command(env!("CARGO_BIN_EXE_mcs-agent"))
        .args(["uninstall", "--bpf-pin-dir"])
        .arg(pins.path().join("none"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "uninstall: {said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("removed nftables table inet mcs_dataplane"),
        "{said}"
    );
    assert!(sb.nft_table().is_none(), "uninstall left the table");
    for fam in ["-4", "-6"] {
        let o = sb
            .node
            .command("ip")
            .args([fam, "rule", "list"])
            .output()
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&o.stdout).contains("0x4d43"),
            "ip {fam} rule left"
        );
        let o = sb
            .node
            .command("ip")
            .args([fam, "route", "list", "table", "19779"])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&o.stdout).trim().is_empty(),
            "ip {fam} route left"
        );
    }
}

#[test]
fn a_restarted_agent_keeps_its_frontends_intercepted_and_holds_connections_until_its_first_table() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&[]);
    assert!(sb.tcp("198.18.100.10:80", "a").unwrap().ends_with(" a"));
    // A crash: the table stays with its elements.
    let mut crashed = sb.agent.take().unwrap();
    crashed.kill().unwrap();
    crashed.wait().unwrap();
    // The next agent starts before its source has anything (its first table is empty, so no
    // diff is applied and the previous run's frontends stay as they were).
    let files = ["imports.yaml", "slices-c1.yaml", "slices-c2.yaml"];
    let saved: Vec<String> = files.iter().map(|f| sb.read(f)).collect();
    for f in files {
        std::fs::remove_file(sb.dir.path().join(f)).unwrap();
    }
    sb.start_agent(&[]);
    let table = sb.nft_table().unwrap();
    assert!(
        table.contains("198.18.100.10 . tcp . 80"),
        "the previous run's frontend was not kept: {table}"
    );
    std::thread::scope(|s| {
        // A connection now is intercepted and accepted, and waits for the first table...
        let client = s.spawn(|| sb.tcp("198.18.100.10:80", "b"));
        wait_until("the connection is accepted and waiting", || {
            sb.http("/metrics").is_some_and(|(_, m)| {
                m.lines()
                    .any(|l| l.starts_with("mcs_proxy_active_connections ") && !l.ends_with(" 0"))
            })
        });
        // ...which arrives: the connection is served, not reset.
        for (f, text) in files.iter().zip(&saved) {
            sb.write(f, text);
        }
        let reply = client.join().unwrap();
        assert!(reply.as_ref().is_ok_and(|r| r.ends_with(" b")), "{reply:?}");
    });
    sb.stop_agent();
}

/// An upgrade as the chart's userspace DaemonSet rolls it (maxSurge): the next agent starts
/// beside the running one and listens on the same frontends (SO_REUSEPORT); the old one,
/// stopped, waits for it, closes its listeners (queued connections migrate,
/// `net.ipv4.tcp_migrate_req`) and leaves the interception to it. Under a client's steady
/// connections, none fails; the next agent serves after the old one is gone. Stopped with no
/// next agent, an agent waits its bound, says so and still keeps the interception.
#[test]
fn the_next_agent_takes_over_the_frontends_and_no_connection_is_refused() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&["--handover-wait-s", "20"]);
    let mut old = Killed(sb.agent.take());
    let next_port = sb.metrics_port + 1;
    let (stop, done) = (AtomicBool::new(false), AtomicUsize::new(0));
    let sb = &sb;
    let (tried, failed, next) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let (mut tried, mut failed) = (0usize, Vec::new());
            let deadline = Instant::now() + Duration::from_secs(90);
            while !stop.load(Ordering::Acquire) && tried < 50_000 && Instant::now() < deadline {
                let msg = format!("q{tried}");
                match sb.tcp("198.18.100.10:80", &msg) {
                    Ok(r) if r.ends_with(&format!(" {msg}")) => {}
                    other => failed.push(format!("{msg}: {other:?}")),
                }
                tried += 1;
                done.store(tried, Ordering::Release);
            }
            (tried, failed)
        });
        let progress = |n: usize| {
            let from = done.load(Ordering::Acquire);
            wait_until("the client's connections go on", || {
                done.load(Ordering::Acquire) >= from + n || load.is_finished()
            });
        };
        progress(100);
        let mut next = Killed(Some(sb.spawn_agent(
            &[],
            next_port,
            &["--handover-wait-s", "2"],
        )));
        sb.wait_ready(next_port, next.0.as_mut().unwrap());
        progress(100);
        let log = stop_agent(old.0.take().unwrap());
        assert!(
            log.contains("the next agent waits on every frontend too"),
            "the old agent did not see the next one: {log}"
        );
        assert!(
            log.contains("interception kept for the node's next agent"),
            "{log}"
        );
        progress(200);
        stop.store(true, Ordering::Release);
        let (tried, failed) = load.join().unwrap();
        (tried, failed, next)
    });
    assert!(
        failed.is_empty(),
        "{} of {tried} connections failed across the handover: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let served_by_next = sb
        .http_on(next_port, "/metrics")
        .map(|(_, m)| {
            m.lines()
                .filter_map(|l| l.strip_prefix("mcs_proxy_connections_total"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        })
        .unwrap_or(0.0);
    assert!(
        served_by_next >= 200.0,
        "the next agent served {served_by_next} connections"
    );
    assert!(
        sb.nft_table()
            .is_some_and(|t| t.contains("198.18.100.10 . tcp . 80")),
        "the interception was not left to the next agent"
    );
    // The last agent stops with no next one: it waits its bound (2 s), says so, and keeps
    // the interception (a restart; an uninstall is `mcs-agent uninstall` or the DaemonSet
    // deleted).
    let mut next = next;
    let log = stop_agent(next.0.take().unwrap());
    assert!(
        log.contains("no next agent on every frontend in time"),
        "{log}"
    );
    assert!(sb.nft_table().is_some(), "a restart keeps the interception");
    eprintln!(
        "{tried} connections across the handover, none failed; the next agent served {served_by_next}"
    );
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

/// A UDP frontend on an IPv6 ClusterSetIP (2001:2::100:12:53 → [2001:2::1:2]:5353).
const DNS6: &str = r#"
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: dns6, namespace: shop }
spec:
  type: ClusterSetIP
  ipFamilies: [IPv6]
  ips: ["2001:2::100:12"]
  ports: [{ name: dns, protocol: UDP, port: 53 }]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dns6-c1
  namespace: shop
  labels: { multicluster.kubernetes.io/service-name: dns6, multicluster.kubernetes.io/source-cluster: c1 }
addressType: IPv6
ports: [{ name: dns, protocol: UDP, port: 5353 }]
endpoints: [{ addresses: ["2001:2::1:2"], conditions: { ready: true } }]
"#;

/// Pods on every node network reach the frontends: routed (ptp, Calico-like), behind a Linux
/// bridge, and behind a bridge with br_netfilter on (`bridge-nf-call-iptables=1` and
/// `-ip6tables=1`, as kubeadm requires; a socket TPROXY assigned there was lost). TCP, UDP
/// connected and not, IPv4 and IPv6; replies come from the ClusterSetIP; a stopped agent
/// leaves no table, rule, route or socket behind.
#[test]
fn pods_on_a_routed_veth_or_a_bridge_with_or_without_br_netfilter_reach_every_frontend() {
    use mcs_test_support::topology::ClientNet;
    if !prerequisites() {
        return;
    }
    for net in [
        ClientNet::Routed,
        ClientNet::Bridge,
        ClientNet::BridgeNetfilter,
    ] {
        let mut backends = ALL.to_vec();
        backends.extend(["198.18.1.2:5353", "[2001:2::1:2]:5353"]);
        let mut sb = Sandbox::new_on(net, &backends);
        sb.write("v6-udp.yaml", DNS6);
        sb.start_agent(&[]);
        let tcp4 = sb.tcp("198.18.100.10:80", "t4");
        assert!(
            tcp4.as_ref().is_ok_and(|r| r.ends_with(" t4")),
            "{net:?}: TCP over IPv4: {tcp4:?}"
        );
        let tcp6 = sb.tcp("[2001:2::100:10]:80", "t6");
        assert!(
            tcp6.as_ref()
                .is_ok_and(|r| r.starts_with("[2001:2::1:") && r.ends_with(" t6")),
            "{net:?}: TCP over IPv6: {tcp6:?}"
        );
        for (vip, backend) in [
            ("198.18.100.12:53", "198.18.1.2:5353"),
            ("[2001:2::100:12]:53", "[2001:2::1:2]:5353"),
        ] {
            let to: std::net::SocketAddr = vip.parse().unwrap();
            let (reply, from) = sb
                .udp(vip, "u")
                .unwrap_or_else(|e| panic!("{net:?}: UDP to {vip}: {e}"));
            assert_eq!(
                (reply.as_str(), from),
                (format!("{backend} u").as_str(), to),
                "{net:?}: UDP to {vip}"
            );
            // A connected socket takes only the ClusterSetIP's replies.
            let got = sb
                .cli
                .run(move || {
                    let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
                    let s = std::net::UdpSocket::bind(any).map_err(|e| e.to_string())?;
                    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                        .unwrap();
                    s.connect(to).map_err(|e| e.to_string())?;
                    let mut out = Vec::new();
                    for m in ["c1", "c2"] {
                        s.send(m.as_bytes()).map_err(|e| e.to_string())?;
                        let mut buf = [0u8; 512];
                        let n = s.recv(&mut buf).map_err(|e| e.to_string())?;
                        out.push(String::from_utf8_lossy(&buf[..n]).to_string());
                    }
                    Ok::<_, String>(out)
                })
                .unwrap();
            assert_eq!(
                got,
                Ok(vec![format!("{backend} c1"), format!("{backend} c2")]),
                "{net:?}: connected UDP to {vip}"
            );
        }
        sb.stop_agent();
        assert!(sb.nft_table().is_none(), "{net:?}: nft table left behind");
        let out = |args: &[&str]| {
            let o = sb.node.command("ip").args(args).output().unwrap();
            String::from_utf8_lossy(&o.stdout).to_string()
        };
        for fam in ["-4", "-6"] {
            assert!(
                !out(&[fam, "rule", "list"]).contains("0x4d43"),
                "{net:?}: ip {fam} rule left behind"
            );
            assert!(
                out(&[fam, "route", "list", "table", "19779"])
                    .trim()
                    .is_empty(),
                "{net:?}: ip {fam} route left behind"
            );
        }
        let ss = sb.node.command("ss").args(["-Htuan"]).output().unwrap();
        let ss = String::from_utf8_lossy(&ss.stdout);
        assert!(
            !ss.lines()
                .any(|l| l.contains("198.18.100.") || l.contains("2001:2::100:")),
            "{net:?}: a socket on a ClusterSetIP left behind:\n{ss}"
        );
    }
}

#[test]
fn udp_over_ipv6_replies_from_the_vip() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&["[2001:2::1:2]:5353"]);
    sb.write("v6-udp.yaml", DNS6);
    sb.start_agent(&[]);
    let to: std::net::SocketAddr = "[2001:2::100:12]:53".parse().unwrap();
    let reply = sb
        .cli
        .run(move || {
            let s = std::net::UdpSocket::bind("[::]:0").unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            s.send_to(b"q6", to).unwrap();
            let mut buf = [0u8; 512];
            let (n, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
            Ok::<_, String>((String::from_utf8_lossy(&buf[..n]).to_string(), from))
        })
        .unwrap();
    let (text, from) = reply.expect("no UDP reply over IPv6");
    assert_eq!(text, "[2001:2::1:2]:5353 q6");
    assert_eq!(from, to, "the reply must come from the IPv6 VIP");
    sb.stop_agent();
}

#[test]
fn the_node_own_processes_are_intercepted_too() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    // Like any real node, this one needs a route that covers the ClusterSetIPs (here a default
    // route) so that connect() finds one; the output chain then marks the packets and the
    // policy route delivers them to the forwarder instead.
    sb.node.route("default", "198.18.10.2").unwrap();
    sb.start_agent(&[]);
    // A client in the node's namespace (a hostNetwork pod or a node daemon).
    let reply = sb
        .node
        .run(|| {
            let to: std::net::SocketAddr = "198.18.100.10:80".parse().unwrap();
            let mut s = TcpStream::connect_timeout(&to, std::time::Duration::from_secs(5))
                .map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            s.write_all(b"from-node").map_err(|e| e.to_string())?;
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).map_err(|e| e.to_string())?;
            Ok::<_, String>(out)
        })
        .unwrap();
    let reply = reply.expect("node-local client through the VIP");
    assert!(
        reply.starts_with("198.18.1.") && reply.ends_with(" from-node"),
        "{reply}"
    );
    sb.stop_agent();
}

/// The relay copies small messages and switches a direction to splice once a read fills its
/// buffer: many small round trips on one connection (each must arrive without waiting for
/// more data), then 8 MiB up and 4 MiB down with half-close in between, byte for byte.
#[test]
fn small_round_trips_and_bulk_both_ways_arrive_intact() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&[]);
    // 198.18.1.3 listens nowhere: a connection picked there is retried on 198.18.1.2.
    let listener = sb
        .c1
        .run(|| std::net::TcpListener::bind("198.18.1.2:8080"))
        .unwrap()
        .unwrap();
    let pattern = |i: usize| (i.wrapping_mul(31) ^ (i >> 11)) as u8;
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let mut first = [0u8; 4];
            s.read_exact(&mut first).unwrap();
            if &first == b"ping" {
                // Echo fixed-size messages until EOF.
                s.write_all(b"pong").unwrap();
                let mut msg = [0u8; 100];
                while s.read_exact(&mut msg).is_ok() {
                    s.write_all(&msg).unwrap();
                }
            } else {
                // Bulk: count and check everything up to EOF, then send 4 MiB and the count.
                let mut got = 4usize;
                let mut bad = first
                    .iter()
                    .enumerate()
                    .filter(|(i, b)| **b != pattern(*i))
                    .count();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = s.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    bad += buf[..n]
                        .iter()
                        .enumerate()
                        .filter(|(i, b)| **b != pattern(got + i))
                        .count();
                    got += n;
                }
                let down: Vec<u8> = (0..4 << 20).map(pattern).collect();
                s.write_all(&down).unwrap();
                s.write_all(format!("{got} {bad}").as_bytes()).unwrap();
            }
        }
    });
    sb.start_agent(&["--metrics-per-backend"]);
    let vip: std::net::SocketAddr = "198.18.100.10:80".parse().unwrap();
    sb.cli
        .run(move || {
            let mut s = TcpStream::connect_timeout(&vip, IO_TIMEOUT).unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            s.write_all(b"ping").unwrap();
            let mut pong = [0u8; 4];
            s.read_exact(&mut pong).unwrap();
            assert_eq!(&pong, b"pong");
            for k in 0..300u32 {
                let msg = [(k % 251) as u8; 100];
                s.write_all(&msg).unwrap();
                let mut back = [0u8; 100];
                s.read_exact(&mut back)
                    .unwrap_or_else(|e| panic!("round trip {k}: {e}"));
                assert_eq!(back, msg, "round trip {k}");
            }
        })
        .unwrap();
    let total = 8 << 20;
    let (down, trailer) = sb
        .cli
        .run(move || {
            let mut s = TcpStream::connect_timeout(&vip, IO_TIMEOUT).unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let up: Vec<u8> = (0..total).map(pattern).collect();
            s.write_all(&up).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut all = Vec::new();
            s.read_to_end(&mut all).unwrap();
            let trailer = String::from_utf8_lossy(&all[4 << 20..]).into_owned();
            all.truncate(4 << 20);
            (all, trailer)
        })
        .unwrap();
    server.join().unwrap();
    assert_eq!(
        trailer,
        format!("{total} 0"),
        "upstream bytes (count, mismatches)"
    );
    assert_eq!(down.len(), 4 << 20);
    assert!(
        down.iter().enumerate().all(|(i, b)| *b == pattern(i)),
        "downstream bytes differ"
    );
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics.contains("mcs_proxy_bytes_tx_total{frontend=\"198.18.100.10:80/TCP\",backend=\"198.18.1.2:8080\"}"),
        "{metrics}"
    );
    sb.stop_agent();
}

/// A VIP→VIP loop (a slice whose endpoint is another ClusterSetIP) ends in a rejection, not in
/// connections piling up through the forwarder until the cap.
#[test]
fn a_loop_through_another_clusterset_ip_is_rejected_not_forwarded() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.write(
        "loop.yaml",
        "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\n\
         metadata: { name: loopy, namespace: shop }\n\
         spec: { type: ClusterSetIP, ips: [\"198.18.100.20\"], ports: [{ name: http, protocol: TCP, port: 80 }] }\n\
         ---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: { name: loopy-c1, namespace: shop, labels: { multicluster.kubernetes.io/service-name: loopy, multicluster.kubernetes.io/source-cluster: c1 } }\n\
         addressType: IPv4\nports: [{ name: http, protocol: TCP, port: 80 }]\n\
         endpoints: [{ addresses: [\"198.18.100.10\"] }, { addresses: [\"198.18.100.20\"] }]\n",
    );
    sb.start_agent(&["--metrics-per-backend"]);
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("mcs_rejected{reason=\"endpoint_is_clusterset_ip\"} 2")),
        "{metrics}"
    );
    // Bounded: 20 attempts, each failing at once (no backend) instead of looping.
    for _ in 0..20 {
        assert!(sb.tcp("198.18.100.20:80", "x").is_err());
    }
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l == "mcs_proxy_active_connections 0"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("backend=\"198.18.100."),
        "a VIP was used as a backend: {metrics}"
    );
    // The other services are untouched.
    assert!(sb.tcp("198.18.100.10:80", "ok").unwrap().ends_with(" ok"));
    sb.stop_agent();
}

/// One client address cannot take the whole UDP session table: past its cap its new flows
/// are dropped (and counted) while its open flows go on.
#[test]
fn udp_sessions_are_capped_per_client() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&["198.18.1.2:5353"]);
    sb.start_agent(&["--max-udp-sessions-per-client", "3"]);
    // A connected socket per flow (a new client port each), as resolvers use.
    let flow = |sb: &Sandbox, msg: &str| -> std::io::Result<std::net::UdpSocket> {
        let msg = msg.to_string();
        sb.cli
            .run(move || {
                let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
                s.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
                s.connect("198.18.100.12:53")?;
                s.send(msg.as_bytes())?;
                let mut buf = [0u8; 256];
                let n = s.recv(&mut buf)?;
                assert!(String::from_utf8_lossy(&buf[..n]).ends_with(&msg));
                Ok(s)
            })
            .unwrap()
    };
    let socks: Vec<std::net::UdpSocket> = (0..3)
        .map(|i| flow(&sb, &format!("q{i}")).unwrap_or_else(|e| panic!("flow {i}: {e}")))
        .collect();
    assert!(
        flow(&sb, "q3").is_err(),
        "a fourth flow of one client was served"
    );
    // The open flows still work.
    socks[0].send(b"again").unwrap();
    let mut buf = [0u8; 256];
    let n = socks[0].recv(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).ends_with("again"));
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert!(
        metrics.lines().any(|l| l
            .starts_with("mcs_proxy_refused_total{frontend=\"198.18.100.12:53/UDP\"}")
            && !l.ends_with(" 0")),
        "{metrics}"
    );
    assert!(
        metrics.lines().any(|l| l == "mcs_proxy_udp_sessions 3"),
        "{metrics}"
    );
    sb.stop_agent();
}

/// One client address cannot take every TCP connection: past its share it is refused with a
/// reset while its open connections go on.
#[test]
fn tcp_connections_are_capped_per_client() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&ALL);
    sb.start_agent(&["--max-connections-per-client", "2"]);
    let (open, ask) = (open_web, ask_once);
    let (a, b) = two_served_and_a_third_refused(&sb);
    drop((a, b));
    // Its slots come back when its connections close.
    wait_until("slots given back", || {
        open(&sb)
            .and_then(|c| ask(&c, "d"))
            .is_ok_and(|r| r.ends_with(" d"))
    });
    sb.stop_agent();
}

/// Starts a TCP backend on both c1 web addresses that runs `serve` on each connection.
fn special_backends(sb: &Sandbox, serve: fn(TcpStream)) -> Vec<std::thread::JoinHandle<()>> {
    ["198.18.1.2:8080", "198.18.1.3:8080"]
        .iter()
        .map(|a| {
            let l = sb
                .c1
                .run(|| std::net::TcpListener::bind(*a))
                .unwrap()
                .unwrap();
            std::thread::spawn(move || {
                for s in l.incoming().flatten() {
                    std::thread::spawn(move || serve(s));
                }
            })
        })
        .collect()
}

/// Closes `s` with a reset (SO_LINGER 0).
fn reset_close(s: TcpStream) {
    socket2::SockRef::from(&s)
        .set_linger(Some(std::time::Duration::ZERO))
        .unwrap();
    drop(s);
}

/// Reads until EOF or an error; the bytes read, and how it ended.
fn read_until_end(mut s: &TcpStream) -> (Vec<u8>, std::io::Result<()>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, Ok(())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return (got, Err(e)),
        }
    }
}

/// A backend that resets mid-response: the client gets the bytes before it and then a reset,
/// not a clean end of stream (a cut reply must not look whole).
#[test]
fn a_backend_reset_reaches_the_client_as_a_reset() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&[]);
    let _b = special_backends(&sb, |mut s| {
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"partial-");
        let _ = s.flush();
        // Let the bytes leave before the reset.
        std::thread::sleep(std::time::Duration::from_millis(100));
        reset_close(s);
    });
    sb.start_agent(&[]);
    let (got, end) = sb
        .cli
        .run(|| {
            let s = TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)
                .unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            (&s).write_all(b"req").unwrap();
            read_until_end(&s)
        })
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&got), "partial-");
    assert_eq!(
        end.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset),
        "the client took a cut reply for a whole one"
    );
    sb.stop_agent();
}

/// A backend that answers and closes at once, or answers and resets at once: the reply and
/// its end often reach the forwarder in one wake-up, where the forwarder sends the reply
/// with its FIN in one segment (issue 16). Either way the client gets the whole reply and a
/// clean end after a FIN, and a reset after a reset — never a reset taken for an end.
#[test]
fn a_reply_with_its_fin_or_reset_right_behind_keeps_how_it_ended() {
    if !prerequisites() {
        return;
    }
    const REPLY: &[u8] = b"the-whole-reply";
    let mut sb = Sandbox::new(&[]);
    // The request says how to end: "fin" or "rst".
    let _b = special_backends(&sb, |mut s| {
        let mut req = [0u8; 3];
        if s.read_exact(&mut req).is_err() {
            return;
        }
        let _ = s.write_all(REPLY);
        if &req == b"rst" {
            reset_close(s);
        }
    });
    sb.start_agent(&[]);
    for round in 0..40 {
        let how: &'static [u8; 3] = if round % 2 == 0 { b"fin" } else { b"rst" };
        let (got, end) = sb
            .cli
            .run(move || {
                let s =
                    TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)
                        .unwrap();
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                (&s).write_all(how).unwrap();
                read_until_end(&s)
            })
            .unwrap();
        if how == b"fin" {
            assert!(end.is_ok(), "round {round}: a clean end arrived as {end:?}");
            assert_eq!(got, REPLY, "round {round}: the reply was cut");
        } else {
            assert_eq!(
                end.map_err(|e| e.kind()),
                Err(std::io::ErrorKind::ConnectionReset),
                "round {round}: a reset arrived as a clean end"
            );
            assert!(REPLY.starts_with(&got), "round {round}: bytes differ");
        }
    }
    sb.stop_agent();
}

/// A client that resets: the backend sees a reset, not a clean end of stream.
#[test]
fn a_client_reset_reaches_the_backend_as_a_reset() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&[]);
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let _b = special_backends(&sb, |s| {
        let _ = s.set_read_timeout(Some(IO_TIMEOUT));
        let mut first = [0u8; 5];
        let ok = (&s).read_exact(&mut first).is_ok();
        let (_, end) = read_until_end(&s);
        let how = match end {
            Ok(()) => "eof".to_string(),
            Err(e) => format!("{:?}", e.kind()),
        };
        SEEN.lock().unwrap().push(format!("{ok} {how}"));
    });
    sb.start_agent(&[]);
    sb.cli
        .run(|| {
            let s = TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)
                .unwrap();
            (&s).write_all(b"hello").unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
            reset_close(s);
        })
        .unwrap();
    wait_until("the backend saw the end", || {
        !SEEN.lock().unwrap().is_empty()
    });
    assert_eq!(SEEN.lock().unwrap()[0], "true ConnectionReset");
    sb.stop_agent();
}

/// Clean closes pass on as EOF after every byte, in each direction.
#[test]
fn clean_closes_pass_on_as_eof_after_all_bytes() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&[]);
    let _b = special_backends(&sb, |s| {
        let _ = s.set_read_timeout(Some(IO_TIMEOUT));
        let (req, end) = read_until_end(&s);
        if end.is_ok() {
            // Echo back everything received, then FIN.
            let _ = (&s).write_all(format!("{}:", req.len()).as_bytes());
            let _ = (&s).write_all(&req);
        }
    });
    sb.start_agent(&[]);
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let (got, end) = sb
        .cli
        .run(move || {
            let s = TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)
                .unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            (&s).write_all(&payload).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            read_until_end(&s)
        })
        .unwrap();
    assert!(end.is_ok(), "{end:?}");
    let expected: Vec<u8> = b"200000:"
        .iter()
        .copied()
        .chain((0..200_000u32).map(|i| (i % 251) as u8))
        .collect();
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "bytes differ");
    sb.stop_agent();
}

/// A UDP flow whose backend stops being selected moves to a selected one: its session ends
/// with the route change, and the client's next datagram opens a new one (a client that
/// reuses its port never stays pinned to a removed backend).
#[test]
fn a_udp_flow_leaves_a_backend_that_is_no_longer_selected() {
    if !prerequisites() {
        return;
    }
    let mut sb = Sandbox::new(&["198.18.1.2:5353", "198.18.2.2:5353"]);
    sb.start_agent(&[]);
    let sock = sb
        .cli
        .run(|| {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            s.connect("198.18.100.12:53").unwrap();
            s
        })
        .unwrap();
    let ask = |s: &std::net::UdpSocket, m: &str| -> std::io::Result<String> {
        s.send(m.as_bytes())?;
        let mut buf = [0u8; 256];
        let n = s.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).to_string())
    };
    assert!(ask(&sock, "a").unwrap().starts_with("198.18.1.2:5353"));
    let c1 = sb.read("slices-c1.yaml");
    sb.write(
        "slices-c1.yaml",
        &c1.replace("ready: true", "ready: false")
            .replace("serving: true", "serving: false"),
    );
    wait_until("new flows reach c2", || {
        sb.udp("198.18.100.12:53", "probe")
            .is_ok_and(|(r, _)| r.starts_with("198.18.2.2"))
    });
    // The old flow: its next datagram may be lost in the switch, the one after reaches c2.
    let _ = ask(&sock, "b");
    let r = ask(&sock, "c").expect("the old flow got no reply after its backend was removed");
    assert!(r.starts_with("198.18.2.2:5353"), "{r}");
    sb.stop_agent();
}

/// Payloads of many sizes (1 B to 8 MiB, around the copy buffer and splice chunk sizes) sent
/// through the forwarder and echoed back arrive byte for byte in both directions, with
/// splice and with `--no-splice`.
#[test]
fn random_payloads_arrive_byte_exact_both_ways_with_and_without_splice() {
    if !prerequisites() {
        return;
    }
    let sizes = mcs_test_support::probe::PAYLOAD_SIZES;
    for flags in [&[][..], &["--no-splice"][..]] {
        let mut sb = Sandbox::new(&[]);
        let _b = special_backends(&sb, mcs_test_support::probe::echo_until_eof);
        sb.start_agent(flags);
        for (i, &len) in sizes.iter().enumerate() {
            let data = mcs_test_support::probe::payload(i as u64 + 1, len);
            let sent = data.clone();
            let (got, end) = sb
                .cli
                .run(move || {
                    let s = TcpStream::connect_timeout(
                        &"198.18.100.10:80".parse().unwrap(),
                        IO_TIMEOUT,
                    )
                    .unwrap();
                    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                    let w = s.try_clone().unwrap();
                    let writer = std::thread::spawn(move || {
                        (&w).write_all(&sent).unwrap();
                        w.shutdown(std::net::Shutdown::Write).unwrap();
                    });
                    let r = read_until_end(&s);
                    writer.join().unwrap();
                    r
                })
                .unwrap();
            assert!(end.is_ok(), "{flags:?} {len} B: {end:?}");
            assert_eq!(got.len(), len, "{flags:?}: length of a {len} B payload");
            assert!(
                got == data,
                "{flags:?}: a {len} B payload came back changed"
            );
        }
        sb.stop_agent();
    }
}

/// A connection from the client pod to the web ClusterSetIP.
fn open_web(sb: &Sandbox) -> std::io::Result<TcpStream> {
    sb.cli
        .run(|| {
            let s = TcpStream::connect_timeout(&"198.18.100.10:80".parse().unwrap(), IO_TIMEOUT)?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            Ok(s)
        })
        .unwrap()
}

/// Sends `m` and reads one reply.
fn ask_once(mut s: &TcpStream, m: &str) -> std::io::Result<String> {
    s.write_all(m.as_bytes())?;
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).to_string())
}

/// A UDP flow whose backend refuses (ICMP port unreachable: its pod died while its slice
/// still says ready) leaves it: the session ends at each refusal, and the backend is skipped
/// on this node (passive health) after its second in a row, so the flow's next datagram is
/// answered by a backend that listens — here c2's, the fallback. Before, the session stayed
/// on the dead backend until idle.
#[test]
fn a_udp_flow_leaves_a_backend_that_refuses() {
    if !prerequisites() {
        return;
    }
    // c1's 198.18.1.2 is up (it serves web on 8080) but nothing listens on its 5353 (ready
    // in its slice); c2's 5353 answers.
    let mut sb = Sandbox::new(&["198.18.1.2:8080", "198.18.2.2:5353"]);
    sb.start_agent(&["--metrics-per-backend"]);
    let sock = sb
        .cli
        .run(|| {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            s.connect("198.18.100.12:53").unwrap();
            s
        })
        .unwrap();
    // Every datagram is sent and waited for at most 500 ms; at most 5 are tried.
    let mut replies = Vec::new();
    for i in 0..5 {
        let m = format!("d{i}");
        let _ = sock.send(m.as_bytes());
        let mut buf = [0u8; 256];
        match sock.recv(&mut buf) {
            Ok(n) => {
                replies.push(String::from_utf8_lossy(&buf[..n]).to_string());
                break;
            }
            // The refused datagram's ICMP may reach the client's connected socket too.
            Err(_) => continue,
        }
    }
    let (_, metrics) = sb.http("/metrics").unwrap();
    assert_eq!(replies.len(), 1, "no reply in 5 datagrams: {metrics}");
    assert!(replies[0].starts_with("198.18.2.2:5353 d"), "{replies:?}");
    // c1's is the only selected backend: its first refusal ends the session but does not
    // mark it (one flaky answer must not send every flow elsewhere), its second in a row does.
    assert!(
        metrics.contains(
            "mcs_proxy_connect_failures_total{frontend=\"198.18.100.12:53/UDP\",backend=\"198.18.1.2:5353\"} 2"
        ),
        "{metrics}"
    );
    sb.stop_agent();
}
