//! `clusterset.local` DNS from a real agent process (`run --dataplane log --dns-listen`), over
//! real UDP and TCP sockets on loopback, from a file source: the MCS DNS spec's names and
//! types, NODATA vs NXDOMAIN, REFUSED outside the zone (not a resolver, even when recursion
//! is asked), truncation with TC over UDP (512 bytes without EDNS, 1232 at most with it) and
//! the whole answer over TCP, a change of the source reaching DNS, metrics, and the
//! per-client rate limit. `mcs-agent dns` prints the same answers without a socket. A real
//! CoreDNS run with our shipped snippets (`deploy/dns/`, plain CoreDNS and NodeLocal
//! DNSCache) forwards `clusterset.local` to the agent, as a cluster DNS does.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Edns, Message, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};

const WAIT: Duration = Duration::from_secs(20);

use mcs_test_support::ports::unused_port_or_panic as free_port;

/// An MCS EndpointSlice of ours as YAML: `ports` is the value of `ports:` (a flow list, or a
/// block list starting with a newline), `endpoints` the lines of `endpoints:`, each ending in a
/// newline.
fn mcs_slice(
    ns: &str,
    name: &str,
    service: &str,
    cluster: &str,
    ports: &str,
    endpoints: &str,
) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n    multicluster.kubernetes.io/service-name: {service}\n    multicluster.kubernetes.io/source-cluster: {cluster}\n    endpointslice.kubernetes.io/managed-by: mcs-controller.mcs-dataplane\naddressType: IPv4\nports: {ports}\nendpoints:\n{endpoints}"
    )
}

/// One endpoint line of [`mcs_slice`]: `address`, an optional hostname, ready or not.
fn endpoint(address: &str, hostname: Option<&str>, ready: bool) -> String {
    let host = hostname.map_or(String::new(), |h| format!(" hostname: {h},"));
    format!("  - {{ addresses: [\"{address}\"],{host} conditions: {{ ready: {ready} }} }}\n")
}

/// The ClusterSet of the test: `web` (ClusterSetIP, dual-stack, a named and an unnamed
/// port), `db` (headless; c1's db-0 ready, db-1 not; cluster `eu.c2` has one ready endpoint
/// without hostname) and `big` (headless, 100 ready endpoints: too many for a UDP answer).
fn write_objects(dir: &Path) {
    let mut big = String::new();
    for i in 0..100 {
        big.push_str(&format!(
            "  - {{ addresses: [\"198.18.70.{}\"], conditions: {{ ready: true }} }}\n",
            i + 2
        ));
    }
    let db_c1 = mcs_slice(
        "shop",
        "db-c1",
        "db",
        "c1",
        "[{ name: pg, protocol: TCP, port: 5432 }]",
        &(endpoint("198.18.64.2", Some("db-0"), true)
            + &endpoint("198.18.64.3", Some("db-1"), false)),
    );
    let db_c2 = mcs_slice(
        "shop",
        "db-c2",
        "db",
        "eu.c2",
        "[{ name: pg, protocol: TCP, port: 15432 }]",
        &endpoint("198.18.68.3", None, true),
    );
    let big_c1 = mcs_slice(
        "shop",
        "big-c1",
        "big",
        "c1",
        "[{ name: tcp, protocol: TCP, port: 7000 }]",
        &big,
    );
    let text = format!(
        r#"apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: web, namespace: shop, creationTimestamp: "2026-11-01T10:00:00Z" }}
spec:
  type: ClusterSetIP
  ipFamilies: [IPv4, IPv6]
  ips: ["198.18.100.10", "2001:2::100:10"]
  ports:
  - {{ name: http, protocol: TCP, port: 80 }}
  - {{ protocol: UDP, port: 53 }}
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: db, namespace: shop, creationTimestamp: "2026-11-01T10:00:00Z" }}
spec:
  type: Headless
  ports:
  - {{ name: pg, protocol: TCP, port: 5432 }}
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: big, namespace: shop, creationTimestamp: "2026-11-01T10:00:00Z" }}
spec:
  type: Headless
  ports:
  - {{ name: tcp, protocol: TCP, port: 7000 }}
---
{db_c1}---
{db_c2}---
{big_c1}"#
    );
    std::fs::write(dir.join("objects.yaml"), text).unwrap();
}

/// An agent serving DNS on a loopback port; killed on drop.
struct Agent {
    child: Child,
    dns: SocketAddr,
    metrics: u16,
    /// Its stderr.
    log: tempfile::NamedTempFile,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn child_alive(&self) -> bool {
        // `try_wait` needs `&mut`; /proc tells the same without reaping.
        Path::new(&format!("/proc/{}", self.child.id())).exists()
    }

    fn start(dir: &Path, extra: &[&str]) -> Self {
        let source = format!("file:{}", dir.display());
        Self::start_with(&["--source", &source], extra)
    }

    /// An agent with `source` arguments (`--source ...` and what goes with it).
    fn start_with(source: &[&str], extra: &[&str]) -> Self {
        Self::start_under(Command::new(env!("CARGO_BIN_EXE_mcs-agent")), source, extra)
    }

    /// An agent whose soft and hard open-file limits are both `nofile` (prlimit), as a
    /// container runtime may set them.
    fn start_with_fd_limit(dir: &Path, nofile: u32, extra: &[&str]) -> Self {
        let mut cmd = Command::new("prlimit");
        cmd.arg(format!("--nofile={nofile}:{nofile}"))
            .arg("--")
            .arg(env!("CARGO_BIN_EXE_mcs-agent"));
        let source = format!("file:{}", dir.display());
        Self::start_under(cmd, &["--source", &source], extra)
    }

    fn start_under(cmd: Command, source: &[&str], extra: &[&str]) -> Self {
        let dns: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let agent = Self::spawn_on(cmd, source, extra, dns, free_port());
        let deadline = Instant::now() + WAIT;
        while agent.http("/readyz").is_none_or(|(code, _)| code != 200) {
            assert!(Instant::now() < deadline, "the agent never became ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        agent
    }

    /// The node's next agent beside `running`, on its DNS and metrics addresses (which
    /// `running` answers too, so readiness is read from the next one's log).
    fn start_next(dir: &Path, running: &Self, extra: &[&str]) -> Self {
        let source = format!("file:{}", dir.display());
        let agent = Self::spawn_on(
            Command::new(env!("CARGO_BIN_EXE_mcs-agent")),
            &["--source", &source],
            extra,
            running.dns,
            running.metrics,
        );
        agent.wait_logged(
            "first full table programmed; ready",
            "the next agent never became ready",
        );
        agent
    }

    fn logged(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Waits (at most [`WAIT`], while the agent lives) until its log says `text`; else fails
    /// with `what` and the log.
    fn wait_logged(&self, text: &str, what: &str) {
        let deadline = Instant::now() + WAIT;
        while !self.logged().contains(text) {
            assert!(
                Instant::now() < deadline && self.child_alive(),
                "{what}: {}",
                self.logged()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn_on(
        mut cmd: Command,
        source: &[&str],
        extra: &[&str],
        dns: SocketAddr,
        metrics: u16,
    ) -> Self {
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = cmd
            .env("MCS_CLUSTERSET_IP_CIDR", mcs_test_support::CLUSTERSET_CIDRS)
            .args(["run", "--dataplane", "log", "--cluster-id", "c1"])
            .args(["--file-poll-ms", "100", "--dns-ttl", "3"])
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics}"))
            .arg("--dns-listen")
            .arg(dns.to_string())
            .args(extra)
            .args(source)
            .env("MCS_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        Self {
            child,
            dns,
            metrics,
            log,
        }
    }

    /// A counter or gauge of `/metrics` (the first series whose line starts with `series`).
    fn metric(&self, series: &str) -> f64 {
        let (_, body) = self.http("/metrics").expect("/metrics answers");
        body.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// File descriptors the agent holds.
    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    fn http(&self, path: &str) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some((out.split_whitespace().nth(1)?.parse().ok()?, out))
    }
}

fn query(name: &str, t: RecordType, edns: Option<u16>) -> Message {
    let mut q = Message::query();
    q.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
    q.metadata.recursion_desired = true;
    if let Some(size) = edns {
        let mut e = Edns::new();
        e.set_max_payload(size);
        q.set_edns(e);
    }
    q
}

/// One UDP exchange; also returns the response's size on the wire.
fn udp(to: SocketAddr, q: &Message) -> (Message, usize) {
    let s = UdpSocket::bind(if to.is_ipv6() {
        "[::1]:0"
    } else {
        "127.0.0.1:0"
    })
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.send_to(&q.to_vec().unwrap(), to).unwrap();
    let mut buf = [0u8; 65_535];
    let (n, _) = s.recv_from(&mut buf).expect("a UDP answer");
    let m = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(m.metadata.id, q.metadata.id);
    (m, n)
}

/// One TCP exchange (two-byte length prefix).
fn tcp(to: SocketAddr, q: &Message) -> Message {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = q.to_vec().unwrap();
    s.write_all(&(body.len() as u16).to_be_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut len = [0u8; 2];
    s.read_exact(&mut len).unwrap();
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut buf).unwrap();
    Message::from_vec(&buf).unwrap()
}

fn rdatas(m: &Message) -> Vec<String> {
    let mut v: Vec<String> = m.answers.iter().map(|r| r.data.to_string()).collect();
    v.sort();
    v
}

/// The sorted answers of one plain UDP query (no EDNS).
fn ask(to: SocketAddr, name: &str, t: RecordType) -> Vec<String> {
    rdatas(&udp(to, &query(name, t, None)).0)
}

fn is_nodata(m: &Message) -> bool {
    m.metadata.response_code == ResponseCode::NoError
        && m.answers.is_empty()
        && matches!(m.authorities.first().map(|r| &r.data), Some(RData::SOA(_)))
}

#[test]
fn dns_over_udp_and_tcp_from_the_agents_index() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let agent = Agent::start(dir.path(), &[]);
    let to = agent.dns;

    let (m, _) = udp(
        to,
        &query("dns-version.clusterset.local.", RecordType::TXT, None),
    );
    assert_eq!(rdatas(&m), ["1.0.0"]);
    assert!(m.metadata.authoritative && !m.metadata.recursion_available);

    let (m, _) = udp(
        to,
        &query("Web.Shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert_eq!(rdatas(&m), ["198.18.100.10"]);
    assert_eq!(m.answers[0].ttl, 3, "--dns-ttl");
    assert_eq!(
        m.answers[0].name.to_string(),
        "Web.Shop.svc.clusterset.local."
    );
    assert_eq!(
        m.queries[0].name().to_string(),
        "Web.Shop.svc.clusterset.local."
    );
    assert_eq!(
        ask(to, "web.shop.svc.clusterset.local.", RecordType::AAAA),
        ["2001:2::100:10"]
    );
    assert_eq!(
        ask(to, "web.shop.svc.clusterset.local.", RecordType::SRV),
        [
            "0 100 53 web.shop.svc.clusterset.local.",
            "0 100 80 web.shop.svc.clusterset.local."
        ]
    );
    assert_eq!(
        ask(
            to,
            "_http._tcp.web.shop.svc.clusterset.local.",
            RecordType::SRV
        ),
        ["0 100 80 web.shop.svc.clusterset.local."]
    );

    // Headless: ready endpoints only; names per endpoint; SRV to those names with each
    // cluster's target port.
    assert_eq!(
        ask(to, "db.shop.svc.clusterset.local.", RecordType::A),
        ["198.18.64.2", "198.18.68.3"]
    );
    assert_eq!(
        ask(to, "db-0.c1.db.shop.svc.clusterset.local.", RecordType::A),
        ["198.18.64.2"]
    );
    assert_eq!(
        ask(
            to,
            "198-18-68-3.eu.c2.db.shop.svc.clusterset.local.",
            RecordType::A
        ),
        ["198.18.68.3"]
    );
    assert_eq!(
        ask(
            to,
            "_pg._tcp.db.shop.svc.clusterset.local.",
            RecordType::SRV
        ),
        [
            "0 50 15432 198-18-68-3.eu.c2.db.shop.svc.clusterset.local.",
            "0 50 5432 db-0.c1.db.shop.svc.clusterset.local."
        ]
    );
    let (m, _) = udp(
        to,
        &query("db-1.c1.db.shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert_eq!(
        m.metadata.response_code,
        ResponseCode::NXDomain,
        "db-1 is not ready"
    );

    // NODATA vs NXDOMAIN, both with the SOA.
    let (m, _) = udp(
        to,
        &query("web.shop.svc.clusterset.local.", RecordType::TXT, None),
    );
    assert!(is_nodata(&m), "{m}");
    let (m, _) = udp(
        to,
        &query("shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert!(is_nodata(&m), "{m}");
    let (m, _) = udp(
        to,
        &query("nope.shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert!(matches!(m.authorities[0].data, RData::SOA(_)));

    // Not a resolver: outside the zone is refused, recursion desired or not.
    for name in ["example.com.", "kubernetes.default.svc.cluster.local."] {
        let (m, _) = udp(to, &query(name, RecordType::A, None));
        assert_eq!(m.metadata.response_code, ResponseCode::Refused, "{name}");
        assert!(m.answers.is_empty());
    }

    // 100 addresses do not fit in UDP: TC, within 512 bytes without EDNS and within 1232
    // with a larger EDNS buffer; TCP carries them all.
    let (m, n) = udp(
        to,
        &query("big.shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert!(
        m.metadata.truncation && n <= 512,
        "TC {} size {n}",
        m.metadata.truncation
    );
    let (m, n) = udp(
        to,
        &query("big.shop.svc.clusterset.local.", RecordType::A, Some(4096)),
    );
    assert!(
        m.metadata.truncation && n <= 1232,
        "TC {} size {n}",
        m.metadata.truncation
    );
    let m = tcp(
        to,
        &query("big.shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert!(!m.metadata.truncation);
    assert_eq!(m.answers.len(), 100);
    // A small answer with EDNS carries our OPT back.
    let (m, _) = udp(
        to,
        &query("web.shop.svc.clusterset.local.", RecordType::A, Some(4096)),
    );
    assert_eq!(m.edns.as_ref().map(|e| e.max_payload()), Some(1232));

    // A new import in the source: its name resolves (same index, no second watch).
    std::fs::write(
        dir.path().join("new.yaml"),
        r#"apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: cart, namespace: shop, creationTimestamp: "2026-11-02T10:00:00Z" }
spec: { type: ClusterSetIP, ips: ["198.18.100.11"], ports: [{ port: 9090 }] }
"#,
    )
    .unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let (m, _) = udp(
            to,
            &query("cart.shop.svc.clusterset.local.", RecordType::A, None),
        );
        if rdatas(&m) == ["198.18.100.11"] {
            break;
        }
        assert!(Instant::now() < deadline, "cart never resolved: {m}");
        std::thread::sleep(Duration::from_millis(50));
    }

    let (code, body) = agent.http("/metrics").unwrap();
    assert_eq!(code, 200);
    // Queries are counted, not logged one by one (hickory-server's per-query lines are off,
    // also with MCS_LOG=info as the DaemonSet sets it).
    let log = std::fs::read_to_string(agent.log.path()).unwrap();
    assert!(log.contains("serving clusterset.local DNS"), "{log}");
    assert!(
        !log.contains("hickory_server"),
        "per-query log lines:\n{log}"
    );
    for line in [
        "mcs_dns_queries_total{qtype=\"A\",rcode=\"NOERROR\"}",
        "mcs_dns_queries_total{qtype=\"A\",rcode=\"NXDOMAIN\"}",
        "mcs_dns_queries_total{qtype=\"A\",rcode=\"REFUSED\"}",
        "mcs_dns_query_seconds_count",
    ] {
        assert!(body.contains(line), "{line} missing from:\n{body}");
    }
}

/// As the chart runs it: `--dns-listen-ips` from the downward API's `status.podIPs` (both
/// families of a dual-stack node) at `--dns-port`, beside `--dns-listen`.
#[test]
fn every_pod_ip_is_answered_on_at_the_dns_port() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let port = free_port();
    let agent = Agent::start(
        dir.path(),
        &[
            "--dns-listen-ips",
            "127.0.0.2,::1",
            "--dns-port",
            &port.to_string(),
        ],
    );
    let name = "web.shop.svc.clusterset.local.";
    for to in [
        agent.dns,
        SocketAddr::from(([127, 0, 0, 2], port)),
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
    ] {
        assert_eq!(ask(to, name, RecordType::A), ["198.18.100.10"], "A at {to}");
        assert_eq!(
            ask(to, name, RecordType::AAAA),
            ["2001:2::100:10"],
            "AAAA at {to}"
        );
        assert_eq!(
            rdatas(&tcp(to, &query(name, RecordType::AAAA, None))),
            ["2001:2::100:10"],
            "AAAA over TCP at {to}"
        );
    }
}

/// `/status` (what `kubectl mcs` reads through the pod proxy): the node's summary, one
/// service's frontends and backends, its rejections, and what the agent's own DNS listener
/// answers when asked over UDP.
#[test]
fn status_reports_the_table_the_rejections_and_what_dns_answers() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    std::fs::write(
        dir.path().join("stray.yaml"),
        r#"apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: stray, namespace: shop }
spec:
  type: ClusterSetIP
  ips: ["198.18.250.1"]
  ports: [{ name: http, protocol: TCP, port: 80 }]
---
"#
        .to_string()
            + &mcs_slice(
                "shop",
                "web-c1",
                "web",
                "c1",
                "[{ name: http, protocol: TCP, port: 8080 }]",
                &endpoint("198.18.64.10", None, true),
            ),
    )
    .unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let json = |path: &str| -> serde_json::Value {
        let (code, body) = agent.http(path).expect("/status answers");
        assert_eq!(code, 200, "{body}");
        let (_, body) = body.split_once("\r\n\r\n").expect("a body");
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
    };

    let all = json("/status");
    assert_eq!(all["ready"], true);
    assert_eq!(all["dataplane"], "log");
    assert_eq!(all["cluster_id"], "c1");
    assert!(all["frontends"].as_u64().unwrap() >= 3, "{all}");
    assert_eq!(all["rejected_total"], 1, "{all}");
    assert_eq!(all["rejected"][0]["object"], "ServiceImport shop/stray");
    assert!(all["service"].is_null());
    assert!(
        all["heap"]["committed_bytes"].as_u64().unwrap() > 0,
        "{all}"
    );
    // Kept off transparent huge pages (allocator.rs says why).
    assert_eq!(all["heap"]["thp_disabled"], true, "{all}");
    let checks = all["dns"]["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 1, "{all}");
    assert_eq!(checks[0]["name"], "dns-version.clusterset.local.");
    assert_eq!(checks[0]["rcode"], "NoError");
    assert_eq!(checks[0]["answers"], serde_json::json!(["1.0.0"]));

    let web = json("/status?service=shop%2Fweb");
    let frontends: Vec<&str> = web["service"]["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["frontend"].as_str().unwrap())
        .collect();
    assert!(frontends.contains(&"198.18.100.10:80/TCP"), "{web}");
    assert!(frontends.contains(&"[2001:2::100:10]:53/UDP"), "{web}");
    for f in web["service"]["frontends"].as_array().unwrap() {
        assert_eq!(f["programmed"], true, "{f}");
        // web's one slice is IPv4, with the http port only.
        if f["frontend"] == "198.18.100.10:80/TCP" {
            assert!(!f["backends"].as_array().unwrap().is_empty(), "{f}");
        }
    }
    assert!(web["rejected"].as_array().unwrap().is_empty(), "{web}");
    let answers = |st: &serde_json::Value, t: &str| {
        st["dns"]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["qtype"] == t)
            .map(|c| c["answers"].clone())
    };
    assert_eq!(
        answers(&web, "A"),
        Some(serde_json::json!(["198.18.100.10"]))
    );
    assert_eq!(
        answers(&web, "AAAA"),
        Some(serde_json::json!(["2001:2::100:10"]))
    );

    let stray = json("/status?service=shop/stray");
    assert!(stray["service"]["frontends"].as_array().unwrap().is_empty());
    assert_eq!(
        stray["rejected"][0]["object"], "ServiceImport shop/stray",
        "{stray}"
    );
    assert!(
        stray["rejected"][0]["message"]
            .as_str()
            .unwrap()
            .contains("198.18.250.1"),
        "{stray}"
    );
    assert_eq!(answers(&stray, "A"), Some(serde_json::json!([])));

    // Anything but a namespace/name is not looked up (nor asked of DNS).
    let odd = json("/status?service=..%2F..%2Fetc");
    assert!(odd["service"].is_null(), "{odd}");
}

#[test]
fn a_client_over_the_rate_limit_is_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let agent = Agent::start(dir.path(), &["--dns-rate-limit", "5"]);
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let q = query("web.shop.svc.clusterset.local.", RecordType::A, None)
        .to_vec()
        .unwrap();
    for _ in 0..50 {
        s.send_to(&q, agent.dns).unwrap();
    }
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut answered = 0;
    let mut buf = [0u8; 4096];
    while s.recv_from(&mut buf).is_ok() {
        answered += 1;
    }
    assert!(answered >= 1, "the first queries are answered");
    assert!(answered < 50, "all 50 answered at 5 per second");
    let (_, body) = agent.http("/metrics").unwrap();
    let dropped: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix("mcs_dns_rate_limited_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert_eq!(dropped, 50 - answered, "{body}");
}

#[test]
fn dns_command_prints_the_answer_without_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
            .env("MCS_CLUSTERSET_IP_CIDR", mcs_test_support::CLUSTERSET_CIDRS)
            .args(["dns", "--cluster-id", "c1", "--source"])
            .arg(format!("file:{}", dir.path().display()))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["_pg._tcp.db.shop.svc.clusterset.local", "SRV"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("SRV 0 50 5432 db-0.c1.db.shop.svc.clusterset.local."),
        "{text}"
    );
    let out = run(&["nope.shop.svc.clusterset.local"]);
    assert_eq!(out.status.code(), Some(1), "NXDOMAIN exits 1");
    assert!(String::from_utf8_lossy(&out.stdout).contains("NXDomain"));
    let out = run(&["web.shop.svc.clusterset.local", "BOGUS"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a DNS record type"));
}

/// `kubectl apply -f -` of `yaml` with `kubeconfig`; panics unless it succeeds.
fn kubectl_apply(kubeconfig: &Path, yaml: &str) {
    mcs_test_support::kubectl::Kubectl::new(kubeconfig)
        .and_then(|k| k.apply(yaml))
        .expect("kubectl apply");
}

/// The same index from `--source kube`: objects written to a real API server are answered.
#[test]
fn dns_from_the_kube_source() {
    let Some(api) = mcs_test_support::apiserver::shared() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ns = rt.block_on(api.fresh_namespace("dns"));
    let kubeconfig = api.kubeconfig(mcs_test_support::apiserver::User::Admin);
    let pg_c2 = mcs_slice(
        &ns,
        "pg-c2",
        "pg",
        "c2",
        "[{ name: pg, protocol: TCP, port: 5432 }]",
        &endpoint("198.18.68.9", Some("pg-0"), true),
    );
    let yaml = format!(
        r#"apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: pg, namespace: {ns} }}
spec: {{ type: Headless, ports: [{{ name: pg, protocol: TCP, port: 5432 }}] }}
---
{pg_c2}"#
    );
    kubectl_apply(&kubeconfig, &yaml);
    let kc = kubeconfig.display().to_string();
    let agent = Agent::start_with(&["--source", "kube", "--kubeconfig", &kc], &[]);
    let name = format!("pg-0.c2.pg.{ns}.svc.clusterset.local.");
    let deadline = Instant::now() + WAIT;
    loop {
        let (m, _) = udp(agent.dns, &query(&name, RecordType::A, None));
        if rdatas(&m) == ["198.18.68.9"] {
            break;
        }
        assert!(Instant::now() < deadline, "{name} never resolved: {m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// CoreDNS (`coredns` from `scripts/setup.sh`) on a loopback port.
struct CoreDns(Child);

impl Drop for CoreDns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn coredns_binary() -> Option<std::path::PathBuf> {
    if let Some(dir) = std::env::var_os("MCS_COREDNS_BIN_DIR") {
        let p = std::path::PathBuf::from(dir).join("coredns");
        if p.is_file() {
            return Some(p);
        }
    }
    mcs_test_support::prereq::find_program("coredns")
}

/// Runs CoreDNS with `corefile` and waits until it answers on `port`.
fn start_coredns(dir: &Path, corefile: &str, port: u16) -> CoreDns {
    let conf = dir.join("Corefile");
    std::fs::write(&conf, corefile).unwrap();
    let child = Command::new(coredns_binary().unwrap())
        .arg("-conf")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let dns = CoreDns(child);
    let to: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + WAIT;
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let q = query("dns-version.clusterset.local.", RecordType::TXT, None);
    let mut buf = [0u8; 4096];
    loop {
        s.send_to(&q.to_vec().unwrap(), to).unwrap();
        if let Ok((n, _)) = s.recv_from(&mut buf)
            && Message::from_vec(&buf[..n]).is_ok_and(|m| rdatas(&m) == ["1.0.0"])
        {
            return dns;
        }
        assert!(
            Instant::now() < deadline,
            "CoreDNS never answered on {to}:\n{corefile}"
        );
    }
}

#[test]
fn coredns_with_the_shipped_snippets_forwards_clusterset_local_to_the_agent() {
    if !mcs_test_support::require(
        coredns_binary()
            .map(|_| ())
            .ok_or_else(|| "coredns not found (run `bash scripts/setup.sh`)".to_string()),
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let agent = Agent::start(dir.path(), &[]);
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dns");
    let upstream = agent.dns.to_string();
    let port = free_port();
    let metrics_port = free_port();
    let plain = std::fs::read_to_string(deploy.join("Corefile.clusterset.local"))
        .unwrap()
        .replace("MCS_DNS_IP", &upstream)
        .replace("clusterset.local:53", &format!("clusterset.local:{port}"));
    // NodeLocal DNSCache fills in its own placeholders: its local address and the cluster
    // DNS's service address (both loopback here).
    let nodelocal = std::fs::read_to_string(deploy.join("nodelocaldns.clusterset.local"))
        .unwrap()
        .replace("MCS_DNS_IP", &upstream)
        .replace("clusterset.local:53", &format!("clusterset.local:{port}"))
        .replace("__PILLAR__LOCAL__DNS__", "127.0.0.1")
        .replace("__PILLAR__DNS__SERVER__", "")
        .replace(
            "prometheus :9253",
            &format!("prometheus 127.0.0.1:{metrics_port}"),
        );
    for (what, corefile) in [("plain CoreDNS", plain), ("NodeLocal DNSCache", nodelocal)] {
        let cd_dir = tempfile::tempdir().unwrap();
        let _coredns = start_coredns(cd_dir.path(), &corefile, port);
        let to: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        assert_eq!(
            ask(to, "web.shop.svc.clusterset.local.", RecordType::A),
            ["198.18.100.10"],
            "{what}"
        );
        assert_eq!(
            ask(to, "db-0.c1.db.shop.svc.clusterset.local.", RecordType::A),
            ["198.18.64.2"],
            "{what}"
        );
        assert_eq!(
            ask(
                to,
                "_http._tcp.web.shop.svc.clusterset.local.",
                RecordType::SRV
            ),
            ["0 100 80 web.shop.svc.clusterset.local."],
            "{what}"
        );
        let (m, _) = udp(
            to,
            &query("nope.shop.svc.clusterset.local.", RecordType::A, None),
        );
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain, "{what}");
        // The big answer: truncated over UDP, whole over TCP, through CoreDNS too.
        let (m, n) = udp(
            to,
            &query("big.shop.svc.clusterset.local.", RecordType::A, None),
        );
        assert!(
            m.metadata.truncation && n <= 512,
            "{what}: TC {} size {n}",
            m.metadata.truncation
        );
        let m = tcp(
            to,
            &query("big.shop.svc.clusterset.local.", RecordType::A, None),
        );
        assert_eq!(m.answers.len(), 100, "{what}");
    }
}

/// `dig` (Debian dnsutils) as a user runs it, against the agent fed by the real API server:
/// every record kind, TCP, truncation, REFUSED outside the zone, and an endpoint going
/// unready leaving the headless answer.
#[test]
fn dig_against_the_agent_fed_by_the_api_server() {
    let Some(api) = mcs_test_support::apiserver::shared() else {
        return;
    };
    if !mcs_test_support::require(mcs_test_support::prereq::program("dig")) {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ns = rt.block_on(api.fresh_namespace("dig"));
    let kubeconfig = api.kubeconfig(mcs_test_support::apiserver::User::Admin);
    let apply = |yaml: &str| kubectl_apply(&kubeconfig, yaml);
    let db_slice = |ready_1: bool| {
        mcs_slice(
            &ns,
            "db-c1",
            "db",
            "c1",
            "[{ name: pg, protocol: TCP, port: 5432 }]",
            &(endpoint("198.18.64.2", Some("db-0"), true)
                + &endpoint("198.18.64.3", Some("db-1"), ready_1)),
        )
    };
    let mut big = String::new();
    for i in 0..60 {
        big.push_str(&format!(
            "  - {{ addresses: [\"198.18.70.{}\"], conditions: {{ ready: true }} }}\n",
            i + 2
        ));
    }
    apply(&format!(
        r#"apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: web, namespace: {ns} }}
spec:
  type: ClusterSetIP
  ipFamilies: [IPv4, IPv6]
  ips: ["198.18.100.20", "2001:2::100:20"]
  ports: [{{ name: http, protocol: TCP, port: 80 }}]
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: db, namespace: {ns} }}
spec: {{ type: Headless, ports: [{{ name: pg, protocol: TCP, port: 5432 }}] }}
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: big, namespace: {ns} }}
spec: {{ type: Headless, ports: [{{ name: tcp, protocol: TCP, port: 7000 }}] }}
---
{}---
{}"#,
        db_slice(true),
        mcs_slice(
            &ns,
            "big-c1",
            "big",
            "c1",
            "[{ name: tcp, protocol: TCP, port: 7000 }]",
            &big
        )
    ));
    let kc = kubeconfig.display().to_string();
    let agent = Agent::start_with(&["--source", "kube", "--kubeconfig", &kc], &[]);
    let port = agent.dns.port().to_string();
    let dig = |args: &[&str]| -> String {
        let out = Command::new("dig")
            .args(["@127.0.0.1", "-p", &port, "+time=2", "+tries=1"])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let short = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = dig(&[&["+short"], args].concat())
            .lines()
            .map(str::to_string)
            .collect();
        v.sort();
        v
    };
    let web = format!("web.{ns}.svc.clusterset.local");
    let db = format!("db.{ns}.svc.clusterset.local");
    // The agent has listed when web resolves.
    let deadline = Instant::now() + WAIT;
    while short(&[&web, "A"]) != ["198.18.100.20"] {
        assert!(Instant::now() < deadline, "{web} never resolved");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(short(&[&web, "AAAA"]), ["2001:2::100:20"]);
    assert_eq!(short(&[&web, "SRV"]), [format!("0 100 80 {web}.")]);
    assert_eq!(
        short(&[&format!("_http._tcp.{web}"), "SRV"]),
        [format!("0 100 80 {web}.")]
    );
    assert_eq!(
        short(&["dns-version.clusterset.local", "TXT"]),
        ["\"1.0.0\""]
    );
    assert_eq!(short(&[&db, "A"]), ["198.18.64.2", "198.18.64.3"]);
    assert_eq!(short(&[&format!("db-1.c1.{db}"), "A"]), ["198.18.64.3"]);
    assert_eq!(
        short(&[&format!("_pg._tcp.{db}"), "SRV"]),
        [
            format!("0 50 5432 db-0.c1.{db}."),
            format!("0 50 5432 db-1.c1.{db}.")
        ]
    );
    // Over TCP the same.
    assert_eq!(short(&["+tcp", &web, "A"]), ["198.18.100.20"]);
    // Status lines: NODATA is NOERROR with the SOA, NXDOMAIN, REFUSED outside the zone.
    let full = dig(&[&web, "MX"]);
    assert!(
        full.contains("status: NOERROR") && full.contains("ANSWER: 0") && full.contains("IN\tSOA"),
        "{full}"
    );
    let full = dig(&[&format!("nope.{ns}.svc.clusterset.local"), "A"]);
    assert!(
        full.contains("status: NXDOMAIN") && full.contains("flags: qr aa"),
        "{full}"
    );
    let full = dig(&["example.com", "A"]);
    assert!(
        full.contains("status: REFUSED") && full.contains("ANSWER: 0"),
        "{full}"
    );
    // Truncation: 60 addresses without EDNS over UDP set TC; dig then retries over TCP by
    // itself and gets them all.
    let full = dig(&[
        "+noedns",
        "+ignore",
        &format!("big.{ns}.svc.clusterset.local"),
        "A",
    ]);
    assert!(full.contains(" tc"), "{full}");
    assert_eq!(
        short(&["+noedns", &format!("big.{ns}.svc.clusterset.local"), "A"]).len(),
        60
    );
    // db-1 goes unready: it leaves the headless answer and its own name.
    apply(&db_slice(false));
    let deadline = Instant::now() + WAIT;
    while short(&[&db, "A"]) != ["198.18.64.2"] {
        assert!(Instant::now() < deadline, "db-1 never left {db}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(dig(&[&format!("db-1.c1.{db}"), "A"]).contains("status: NXDOMAIN"));
}

/// A bounded fuzz of the server: random and mutated queries over UDP and TCP never stop it
/// from answering a good query afterwards (no panic, no hang).
#[test]
fn garbage_queries_do_not_stop_the_server() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let mut agent = Agent::start(dir.path(), &[]);
    let good = query("web.shop.svc.clusterset.local.", RecordType::A, None)
        .to_vec()
        .unwrap();
    // A small deterministic generator (xorshift): the same cases every run.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    for i in 0..3000 {
        let mut pkt = if i % 3 == 0 {
            (0..(next() % 600) as usize).map(|_| next() as u8).collect()
        } else {
            // A good query with a few bytes flipped, cut or extended.
            let mut p = good.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % p.len();
                p[at] = next() as u8;
            }
            if i % 5 == 0 {
                p.truncate((next() as usize) % p.len());
            }
            p
        };
        if pkt.is_empty() {
            pkt.push(0);
        }
        let _ = s.send_to(&pkt, agent.dns);
        if i % 100 == 0 {
            // Over TCP too: a length prefix that lies, then the bytes.
            if let Ok(mut t) = TcpStream::connect(agent.dns) {
                let _ = t.write_all(&((next() % 1000) as u16).to_be_bytes());
                let _ = t.write_all(&pkt);
            }
        }
    }
    // The flood may still fill the server's receive buffer (the kernel drops what does not
    // fit, as it would for any server): ask as a resolver does, again after a second.
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let q = query("web.shop.svc.clusterset.local.", RecordType::A, None);
    let mut buf = [0u8; 4096];
    let answer = (0..5).find_map(|_| {
        s.send_to(&q.to_vec().unwrap(), agent.dns).unwrap();
        // Answers to earlier attempts count too (same id).
        let (n, _) = s.recv_from(&mut buf).ok()?;
        Message::from_vec(&buf[..n]).ok()
    });
    let m = answer.expect("no UDP answer after the garbage, in five attempts");
    assert_eq!(rdatas(&m), ["198.18.100.10"]);
    let m = tcp(
        agent.dns,
        &query("web.shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert_eq!(rdatas(&m), ["198.18.100.10"]);
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent exited"
    );
}

/// A TCP connection to `to` from the loopback address `from` (any port).
fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&format!("{from}:0").parse::<SocketAddr>().unwrap().into())?;
    s.connect_timeout(&to.into(), Duration::from_secs(5))?;
    Ok(s.into())
}

/// Whether the server closed `s` (EOF or reset) within a read timeout of `wait`.
fn closed_by_server(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// This test process's own soft open-file limit, lifted to its hard limit (it holds many
/// client sockets).
fn lift_own_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

#[test]
fn held_tcp_connections_are_capped_and_the_agent_keeps_working() {
    // Issue 32: 1,100 held DNS-over-TCP connections at the default 1,024 file descriptors
    // stopped /healthz, other clients' TCP queries and the file source. Here the agent runs
    // with 1,024 descriptors (soft = hard, so it cannot lift them): DNS over TCP keeps 512 of
    // them for the rest, one client gets at most 32 connections, and everything else works.
    lift_own_fd_limit();
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let agent = Agent::start_with_fd_limit(dir.path(), 1024, &[]);
    let q = query("web.shop.svc.clusterset.local.", RecordType::A, None);
    // One client holds as many connections as it can: 32 stay, the rest are closed at once.
    let mut held: Vec<TcpStream> = (0..1100)
        .filter_map(|_| connect_from("127.0.0.1", agent.dns).ok())
        .collect();
    let deadline = Instant::now() + WAIT;
    while agent.metric("mcs_dns_tcp_refused_total{cap=\"per_client\"}") < 1000.0 {
        assert!(Instant::now() < deadline, "per-client refusals not counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(agent.metric("mcs_dns_tcp_connections") <= 32.0);
    // Many clients (127.0.0.2..=127.0.0.41: 40 x 32 > 512): the total cap holds.
    for c in 2..=41 {
        held.extend((0..32).filter_map(|_| connect_from(&format!("127.0.0.{c}"), agent.dns).ok()));
    }
    while agent.metric("mcs_dns_tcp_refused_total{cap=\"total\"}") < 1.0 {
        assert!(Instant::now() < deadline, "total refusals not counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(agent.metric("mcs_dns_tcp_connections") <= 512.0);
    assert!(
        agent.open_fds() < 1024 - 256,
        "{} descriptors open",
        agent.open_fds()
    );
    // Health, UDP and the file source still work while every TCP place is taken.
    assert_eq!(agent.http("/healthz").map(|(c, _)| c), Some(200));
    assert_eq!(rdatas(&udp(agent.dns, &q).0), ["198.18.100.10"]);
    std::fs::write(
        dir.path().join("late.yaml"),
        "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: { name: late, namespace: shop }\nspec: { type: ClusterSetIP, ips: [\"198.18.100.77\"], ports: [{ port: 80, protocol: TCP }] }\n",
    )
    .unwrap();
    let late = query("late.shop.svc.clusterset.local.", RecordType::A, None);
    while rdatas(&udp(agent.dns, &late).0) != ["198.18.100.77"] {
        assert!(Instant::now() < deadline, "a file change did not reach DNS");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The held connections send nothing: closed after the idle time (5 s), after which
    // another client's TCP query is answered.
    drop(held);
    let deadline = Instant::now() + WAIT;
    while agent.metric("mcs_dns_tcp_connections") > 0.0 {
        assert!(
            Instant::now() < deadline,
            "closed connections still counted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(rdatas(&tcp(agent.dns, &q)), ["198.18.100.10"]);
    assert!(agent.child_alive());
}

#[test]
fn a_busy_tcp_connection_is_closed_at_the_end_of_its_lifetime() {
    // The idle timeout used to restart with every message: a query every 4 s held a
    // connection forever. Here: idle 1 s, lifetime 3 s; a query every 300 ms keeps it from
    // being idle, and it is closed all the same.
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let agent = Agent::start(
        dir.path(),
        &["--dns-tcp-idle-s", "1", "--dns-tcp-lifetime-s", "3"],
    );
    let mut s = TcpStream::connect(agent.dns).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = query("web.shop.svc.clusterset.local.", RecordType::A, None)
        .to_vec()
        .unwrap();
    let started = Instant::now();
    let mut answered = 0;
    let closed = loop {
        assert!(started.elapsed() < WAIT, "never closed");
        let mut framed = (body.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&body);
        if s.write_all(&framed).is_err() {
            break true;
        }
        let mut len = [0u8; 2];
        match s.read_exact(&mut len) {
            Ok(()) => {}
            Err(_) => break true,
        }
        let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(rdatas(&Message::from_vec(&buf).unwrap()), ["198.18.100.10"]);
        answered += 1;
        if closed_by_server(&mut s, Duration::from_millis(300)) {
            break true;
        }
    };
    assert!(
        closed && answered >= 2,
        "answered {answered} before the close"
    );
    assert!(agent.metric("mcs_dns_tcp_closed_idle_total") >= 1.0);
    // A connection that never asks is closed after the idle time.
    let mut idle = TcpStream::connect(agent.dns).unwrap();
    assert!(closed_by_server(&mut idle, WAIT));
}

#[test]
fn a_huge_headless_service_is_answered_within_one_message() {
    // Issue 32: ten slices of 1,000 endpoints x 100 ports were all accepted and one SRV
    // query built 100,000 records (1.7 s, +300 MB). Now the import holds 1,024 endpoints
    // (rejected as too_many_backends past them), and an answer holds what fits.
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from(
        "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: { name: huge, namespace: shop }\nspec:\n  type: Headless\n  ports:\n",
    );
    for p in 0..100 {
        text.push_str(&format!(
            "  - {{ name: p{p}, protocol: TCP, port: {} }}\n",
            1000 + p
        ));
    }
    let ports: String = (0..100)
        .map(|p| format!("  - {{ name: p{p}, protocol: TCP, port: {} }}\n", 1000 + p))
        .collect();
    for s in 0..10 {
        text.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: huge-{s}\n  namespace: shop\n  labels:\n    multicluster.kubernetes.io/service-name: huge\n    multicluster.kubernetes.io/source-cluster: c{s}\n    endpointslice.kubernetes.io/managed-by: mcs-controller.multicluster.x-k8s.io\naddressType: IPv4\nports:\n{ports}endpoints:\n"
        ));
        for e in 0..1000u32 {
            let ip = std::net::Ipv4Addr::from(0xc612_0000 + (s << 12) + e + 2);
            text.push_str(&format!(
                "  - {{ addresses: [\"{ip}\"], hostname: h{e}, conditions: {{ ready: true }} }}\n"
            ));
        }
    }
    std::fs::write(dir.path().join("huge.yaml"), text).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let srv = query("huge.shop.svc.clusterset.local.", RecordType::SRV, None);
    let deadline = Instant::now() + WAIT;
    let m = loop {
        let m = tcp(agent.dns, &srv);
        if !m.answers.is_empty() {
            break m;
        }
        assert!(Instant::now() < deadline, "no SRV answer");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!m.answers.is_empty() && m.answers.len() < 100_000);
    assert!(m.to_vec().unwrap().len() <= 65_535);
    let (m, n) = udp(agent.dns, &srv);
    assert!(
        m.metadata.truncation && n <= 512 && !m.answers.is_empty(),
        "TC {} size {n}",
        m.metadata.truncation
    );
    let (m, n) = udp(
        agent.dns,
        &query("huge.shop.svc.clusterset.local.", RecordType::A, Some(4096)),
    );
    assert!(
        m.metadata.truncation && n <= 1232,
        "TC {} size {n}",
        m.metadata.truncation
    );
    // Every A record fits over TCP: the 1,024 kept, this cluster's (none here) first, then by cluster.
    let m = tcp(
        agent.dns,
        &query("huge.shop.svc.clusterset.local.", RecordType::A, None),
    );
    assert_eq!(m.answers.len(), 1024);
    let (_, body) = agent.http("/metrics").unwrap();
    assert!(body.contains("reason=\"too_many_backends\""), "{body}");
    // ANY over UDP: RFC 8482's one record, not every record.
    let (m, _) = udp(
        agent.dns,
        &query("huge.shop.svc.clusterset.local.", RecordType::ANY, None),
    );
    assert_eq!(m.answers.len(), 1);
    assert!(matches!(m.answers[0].data, RData::HINFO(_)));
    // NXDOMAIN under the big service is a lookup, not a walk: answered (no timing asserted).
    let m = tcp(
        agent.dns,
        &query(
            "nope.c1.huge.shop.svc.clusterset.local.",
            RecordType::A,
            None,
        ),
    );
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
}

/// Issue 52: the metrics port is on the host network, so every pod of the node reaches it.
/// On a table at the caps (one import of 100 ports with 990 backends each: 99,000
/// backends, whose whole `/status` answer would be ~30 MB), 1,000 idle connections from 100
/// addresses and 20 `/status` requests whose answers are never read leave the agent small,
/// and `/healthz`, `/status` and DNS keep answering everyone else.
#[test]
fn the_metrics_port_is_bounded_against_idle_connections_and_unread_answers() {
    lift_own_fd_limit();
    let dir = tempfile::tempdir().unwrap();
    let ports: String = (1..=100)
        .map(|p| format!("  - {{ name: p{p}, protocol: TCP, port: {p} }}\n"))
        .collect();
    let endpoints: String = (0..990)
        .map(|i| {
            format!(
                "  - {{ addresses: [\"198.18.{}.{}\"], conditions: {{ ready: true }} }}\n",
                72 + i / 250,
                2 + i % 250
            )
        })
        .collect();
    let slice_ports: String = (1..=100)
        .map(|p| format!("  - {{ name: p{p}, protocol: TCP, port: {} }}\n", 8000 + p))
        .collect();
    std::fs::write(
        dir.path().join("big.yaml"),
        format!(
            r#"apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {{ name: big, namespace: shop }}
spec:
  type: ClusterSetIP
  ips: ["198.18.100.20"]
  ports:
{ports}---
{}"#,
            mcs_slice(
                "shop",
                "big-c1",
                "big",
                "c1",
                &format!("\n{}", slice_ports.trim_end()),
                &endpoints
            )
        ),
    )
    .unwrap();
    write_objects(dir.path());
    // At 1,024 descriptors (soft = hard, as a container runtime may set them), where the
    // listener keeps to a quarter of them and DNS over TCP to half.
    let agent = Agent::start_with_fd_limit(dir.path(), 1024, &[]);
    let to: SocketAddr = format!("127.0.0.1:{}", agent.metrics).parse().unwrap();
    let deadline = Instant::now() + WAIT;
    let total_backends = || -> u64 {
        let (_, body) = agent.http("/status").expect("/status answers");
        let (_, json) = body.split_once("\r\n\r\n").unwrap();
        let st: serde_json::Value = serde_json::from_str(json).unwrap();
        st["backends"].as_u64().unwrap_or(0)
    };
    while total_backends() < 99_000 {
        assert!(
            Instant::now() < deadline,
            "the big import was never programmed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // One service's answer lists 1,000 backends and says it is truncated; the counts are whole.
    let (code, body) = agent
        .http("/status?service=shop/big")
        .expect("/status answers");
    assert_eq!(code, 200);
    assert!(body.len() < 1_000_000, "{} bytes", body.len());
    let (_, json) = body.split_once("\r\n\r\n").unwrap();
    let st: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(st["service"]["truncated"], true);
    let fes = st["service"]["frontends"].as_array().unwrap();
    assert_eq!(fes.len(), 100);
    let listed: usize = fes
        .iter()
        .map(|f| f["backends"].as_array().unwrap().len())
        .sum();
    assert_eq!(listed, 1000);
    assert!(
        fes.iter()
            .all(|f| f["backends_total"] == 990 && f["selected"] == 990)
    );

    // 20 readers ask for the big answer and never read it (each from its own address).
    let unread: Vec<TcpStream> = (0..20)
        .map(|i| {
            let mut s = connect_from(&format!("127.0.1.{}", i + 1), to).unwrap();
            write!(s, "GET /status?service=shop%2Fbig HTTP/1.0\r\n\r\n").unwrap();
            s
        })
        .collect();
    // 1,000 idle connections from 100 addresses (10 each, within an address's 16): past the
    // listener's places each one pushes out the oldest idle one.
    let idle: Vec<TcpStream> = (0..1000)
        .filter_map(|i| connect_from(&format!("127.0.2.{}", 1 + i % 100), to).ok())
        .collect();
    assert_eq!(agent.http("/healthz").map(|(c, _)| c), Some(200));
    let q = query("web.shop.svc.clusterset.local.", RecordType::A, None);
    assert_eq!(rdatas(&udp(agent.dns, &q).0), ["198.18.100.10"]);
    // A small answer is still served to another reader (or refused at once as busy while
    // the unread ones hold every large-answer slot: never queued, never a timeout).
    let (code, _) = agent
        .http("/status")
        .expect("/status answers or refuses at once");
    assert!(code == 200 || code == 503, "{code}");
    // One address holds at most 16 connections: the 17th gets a 503 at once.
    let mut mine: Vec<TcpStream> = (0..17)
        .map(|_| connect_from("127.0.3.1", to).unwrap())
        .collect();
    let mut last = mine.pop().unwrap();
    last.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = String::new();
    last.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 503")
            && answer.contains("too many connections from your address"),
        "{answer:?}"
    );
    let rss_kib = |field: &str| -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", agent.child.id()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    };
    let peak = rss_kib("VmHWM:");
    eprintln!(
        "under the flood: peak RSS {} MiB, {} descriptors open",
        peak / 1024,
        agent.open_fds()
    );
    assert!(
        peak < 128 * 1024,
        "the agent's peak RSS is {} MiB",
        peak / 1024
    );
    assert!(
        agent.open_fds() < 1024,
        "{} descriptors open",
        agent.open_fds()
    );
    // Every unread request was answered (200, or 503 when every large-answer slot was
    // taken) or closed: none hangs.
    for mut s in unread {
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut head = [0u8; 12];
        match s.read_exact(&mut head) {
            Ok(()) => assert!(
                head.starts_with(b"HTTP/1.1 200") || head.starts_with(b"HTTP/1.1 503"),
                "{:?}",
                String::from_utf8_lossy(&head)
            ),
            Err(e) => assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "an unread /status request hangs: {e}"
            ),
        }
    }
    drop((idle, mine));
    assert_eq!(agent.http("/healthz").map(|(c, _)| c), Some(200));
    assert!(agent.child_alive());
}

/// A process of the host network binding `addr` with `SO_REUSEADDR` and `SO_REUSEPORT`, as
/// the intruder of issue 52 did: `Err(EADDRINUSE)` when the address is the agent's alone.
fn bind_with_reuse(
    ty: nix::sys::socket::SockType,
    addr: SocketAddr,
) -> Result<std::os::fd::OwnedFd, nix::Error> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockaddrStorage, bind, setsockopt, sockopt};
    let fd = nix::sys::socket::socket(AddressFamily::Inet, ty, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(addr),
    )?;
    Ok(fd)
}

/// No other process may join the agent's metrics and DNS sockets.
fn assert_no_other_process_binds(agent: &Agent) {
    use nix::sys::socket::SockType;
    let metrics = SocketAddr::from(([127, 0, 0, 1], agent.metrics));
    for (what, ty, addr) in [
        ("metrics", SockType::Stream, metrics),
        ("DNS over TCP", SockType::Stream, agent.dns),
        ("DNS over UDP", SockType::Datagram, agent.dns),
    ] {
        assert_eq!(
            bind_with_reuse(ty, addr).err(),
            Some(nix::Error::EADDRINUSE),
            "another process could bind the {what} address {addr}"
        );
    }
}

/// Issue 52, item 5: the sockets were `SO_REUSEPORT`, so any process of the host network
/// with the agent's user id joined them and took a share of the queries and `/status`
/// answers (7 of 20 `/status`, 15 of 30 DNS answers were measured forged). They are the
/// agent's alone now: a process binding their addresses with both reuse options is refused.
#[test]
fn no_other_process_can_bind_the_dns_or_metrics_addresses() {
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let agent = Agent::start(dir.path(), &[]);
    assert_no_other_process_binds(&agent);
    for _ in 0..30 {
        assert_eq!(
            ask(agent.dns, "web.shop.svc.clusterset.local.", RecordType::A),
            ["198.18.100.10"]
        );
    }
}

/// One query for `web`'s A record over UDP or TCP, never panicking: its answer's addresses,
/// or what went wrong.
fn try_ask(to: SocketAddr, over_tcp: bool) -> Result<Vec<String>, String> {
    let q = query("web.shop.svc.clusterset.local.", RecordType::A, None);
    let body = q.to_vec().map_err(|e| e.to_string())?;
    let answer = if over_tcp {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))
            .map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        s.write_all(&(body.len() as u16).to_be_bytes())
            .map_err(|e| format!("write: {e}"))?;
        s.write_all(&body).map_err(|e| format!("write: {e}"))?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len).map_err(|e| format!("read: {e}"))?;
        let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut buf).map_err(|e| format!("read: {e}"))?;
        buf
    } else {
        let s = UdpSocket::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        s.send_to(&body, to).map_err(|e| format!("send: {e}"))?;
        let mut buf = vec![0u8; 65_535];
        let (n, _) = s.recv_from(&mut buf).map_err(|e| format!("recv: {e}"))?;
        buf.truncate(n);
        buf
    };
    let m = Message::from_vec(&answer).map_err(|e| e.to_string())?;
    if m.metadata.id != q.metadata.id || m.metadata.response_code != ResponseCode::NoError {
        return Err(format!(
            "id {} rcode {:?}",
            m.metadata.id, m.metadata.response_code
        ));
    }
    Ok(rdatas(&m))
}

/// Issue 52, item 5: an upgrade without `SO_REUSEPORT`. The node's next agent takes the
/// running one's DNS and metrics sockets over `--handover-socket` (the same sockets), reads
/// the DNS ones only once it is ready itself, and serves them alone when the old one stops.
/// Under a client's steady queries over UDP and TCP, none fails or is answered SERVFAIL; and
/// at no point may another process bind the addresses.
#[test]
fn the_next_agent_takes_the_dns_and_metrics_sockets_and_no_query_fails() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let handover = tempfile::tempdir().unwrap();
    let path = handover.path().join("agent.sock");
    let path = path.to_str().unwrap();
    let extra = ["--handover-socket", path, "--dns-rate-limit", "0"];
    let mut old = Agent::start(dir.path(), &extra);
    let (stop, done) = (AtomicBool::new(false), AtomicUsize::new(0));
    let to = old.dns;
    let (tried, failed, next) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let (mut tried, mut failed) = (0usize, Vec::new());
            let deadline = Instant::now() + Duration::from_secs(60);
            while !stop.load(Ordering::Acquire) && tried < 20_000 && Instant::now() < deadline {
                let over_tcp = tried % 2 == 1;
                match try_ask(to, over_tcp) {
                    Ok(a) if a == ["198.18.100.10"] => {}
                    other => failed.push(format!("#{tried} (tcp: {over_tcp}): {other:?}")),
                }
                tried += 1;
                done.store(tried, Ordering::Release);
            }
            (tried, failed)
        });
        let progress = |n: usize| {
            let from = done.load(Ordering::Acquire);
            let deadline = Instant::now() + WAIT;
            while done.load(Ordering::Acquire) < from + n && !load.is_finished() {
                assert!(Instant::now() < deadline, "the queries stopped");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        progress(200);
        let next = Agent::start_next(dir.path(), &old, &extra);
        assert!(
            next.logged()
                .contains("took the listening sockets of the node's running agent"),
            "{}",
            next.logged()
        );
        assert_no_other_process_binds(&next);
        progress(200);
        // The old agent is stopped, as the DaemonSet does once the next pod is ready.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(old.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert!(old.child.wait().unwrap().success());
        assert!(
            old.logged()
                .contains("handed this agent's sockets to the node's next agent"),
            "{}",
            old.logged()
        );
        progress(400);
        stop.store(true, Ordering::Release);
        let (tried, failed) = load.join().unwrap();
        (tried, failed, next)
    });
    assert!(
        failed.is_empty(),
        "{} of {tried} queries failed across the handover: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    // The next agent alone answers now, on the same addresses, and still alone.
    assert_eq!(next.http("/readyz").map(|(c, _)| c), Some(200));
    assert!(next.metric("mcs_dns_queries_total{qtype=\"A\",rcode=\"NOERROR\"}") >= 400.0);
    assert_no_other_process_binds(&next);
    // The path leads to the next agent now.
    assert!(std::os::unix::net::UnixStream::connect(path).is_ok());
    eprintln!("{tried} queries across the handover (UDP and TCP), none failed");
}

/// The previous release of the agent shared its sockets by `SO_REUSEPORT` and hands nothing
/// over; an address held by it (or by any other process) keeps only its own listener
/// waiting, not the table: the next agent programs its first table while DNS waits, and
/// answers DNS within a second of the address being free.
#[test]
fn an_address_held_by_another_process_keeps_only_its_listener_waiting() {
    use nix::sys::socket::SockType;
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path());
    let dns: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    // As the previous release held them.
    let held = [
        bind_with_reuse(SockType::Stream, dns).unwrap(),
        bind_with_reuse(SockType::Datagram, dns).unwrap(),
    ];
    nix::sys::socket::listen(&held[0], nix::sys::socket::Backlog::new(16).unwrap()).unwrap();
    let source = format!("file:{}", dir.path().display());
    let agent = Agent::spawn_on(
        Command::new(env!("CARGO_BIN_EXE_mcs-agent")),
        &["--source", &source],
        &[],
        dns,
        free_port(),
    );
    agent.wait_logged(
        "first full table programmed; ready",
        "the table waited for the DNS address",
    );
    assert!(
        agent.logged().contains("address in use"),
        "{}",
        agent.logged()
    );
    assert_eq!(agent.http("/readyz").map(|(c, _)| c), Some(200));
    drop(held);
    agent.wait_logged("serving clusterset.local DNS", "DNS was never served");
    assert_eq!(
        ask(agent.dns, "web.shop.svc.clusterset.local.", RecordType::A),
        ["198.18.100.10"]
    );
    assert_no_other_process_binds(&agent);
}
