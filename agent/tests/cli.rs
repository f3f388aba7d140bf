//! The `mcs-agent` binary as a user runs it: `table` prints the documented JSON shape for the
//! example ClusterSet, `run` serves health and metrics and stops cleanly on SIGTERM.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

fn agent() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mcs-agent"));
    cmd.env("MCS_CLUSTERSET_IP_CIDR", mcs_test_support::CLUSTERSET_CIDRS);
    cmd
}

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/two-clusters")
}

#[test]
fn table_json_has_the_documented_shape_and_order() {
    let out = agent()
        .args([
            "table",
            "--format",
            "json",
            "--cluster-id",
            "c1",
            "--source",
        ])
        .arg(format!("file:{}", examples().display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Key order as documented (serde_json::Value sorts keys, so check the raw text).
    let raw = String::from_utf8_lossy(&out.stdout);
    let order = |keys: &[&str], from: usize| {
        let mut at = from;
        for k in keys {
            let i = raw[at..]
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k} after {at}"));
            at += i;
        }
    };
    order(
        &[
            "frontends",
            "vip",
            "port",
            "protocol",
            "service",
            "affinity",
            "backends",
        ],
        0,
    );
    let first_backend = raw.find("\"backends\"").unwrap();
    order(
        &[
            "address",
            "port",
            "cluster",
            "zone",
            "ready",
            "serving",
            "terminating",
            "selected",
        ],
        first_backend,
    );
    assert!(raw.trim_end().ends_with("\"rejected\": []\n}") || raw.contains("\"rejected\": []"));
    let fronts = v["frontends"].as_array().unwrap();
    let ids: Vec<String> = fronts
        .iter()
        .map(|f| {
            format!(
                "{} {} {}",
                f["vip"].as_str().unwrap(),
                f["port"],
                f["protocol"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        ids,
        [
            "198.18.100.10 80 TCP",
            "198.18.100.11 9090 TCP",
            "198.18.100.12 53 UDP",
            "2001:2::100:10 80 TCP"
        ]
    );
    let web = &fronts[0];
    assert_eq!(web["service"], "shop/web");
    assert_eq!(web["affinity"], serde_json::Value::Null);
    let picked: Vec<(String, bool)> = web["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                format!(
                    "{}@{}",
                    b["address"].as_str().unwrap(),
                    b["cluster"].as_str().unwrap()
                ),
                b["selected"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        picked,
        [
            ("198.18.1.2@c1".to_string(), true),
            ("198.18.1.3@c1".to_string(), true),
            ("198.18.2.2@c2".to_string(), false),
            ("198.18.2.3@c2".to_string(), false),
        ]
    );
    assert_eq!(
        fronts[1]["affinity"],
        serde_json::json!({ "clientIP": true, "timeoutSeconds": 600 })
    );
    assert_eq!(v["rejected"], serde_json::json!([]));
}

#[test]
fn table_reports_rejections_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["imports.yaml", "slices-c1.yaml"] {
        std::fs::copy(examples().join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(
        dir.path().join("bad.yaml"),
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: evil\n  namespace: shop\n  labels:\n    multicluster.kubernetes.io/service-name: web\n    multicluster.kubernetes.io/source-cluster: c9\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [169.254.169.254]}]\n",
    )
    .unwrap();
    let out = agent()
        .args([
            "table",
            "--format",
            "json",
            "--cluster-id",
            "c1",
            "--source",
        ])
        .arg(format!("file:{}", dir.path().display()))
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["frontends"].as_array().unwrap().len(), 4);
    let rej = v["rejected"].as_array().unwrap();
    assert_eq!(rej.len(), 1, "{rej:?}");
    assert_eq!(rej[0]["object"], "EndpointSlice shop/evil");
    assert!(
        rej[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("hostile_endpoint")
    );
}

#[test]
fn missing_source_directory_is_a_clear_error() {
    let out = agent()
        .args(["table", "--source", "file:/nonexistent/mcs"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/mcs") && err.contains("does not exist"),
        "{err}"
    );
    let out = agent()
        .args(["table", "--source", "etcd"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("use `kube` or `file:DIR`"));
}

#[test]
fn a_cluster_id_no_slice_label_could_carry_is_refused_with_the_rule() {
    for bad in ["C1", "c1.", "a_b", &"a".repeat(64)] {
        let out = agent()
            .args(["table", "--cluster-id", bad, "--source"])
            .arg(format!("file:{}", examples().display()))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} was taken");
        assert!(
            err.contains("is not a cluster id") && err.contains("at most 63 bytes"),
            "{bad}: {err}"
        );
    }
}
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some((out.split_whitespace().nth(1)?.parse().ok()?, out))
}

#[test]
fn run_serves_readyz_and_metrics_and_stops_on_sigterm() {
    let port = mcs_test_support::ports::unused_port_or_panic();
    let mut child = agent()
        .args([
            "run",
            "--dataplane",
            "log",
            "--cluster-id",
            "c1",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--source",
        ])
        .arg(format!("file:{}", examples().display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((200, _)) = http_get(port, "/readyz") {
            break;
        }
        assert!(Instant::now() < deadline, "agent never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, body) = http_get(port, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("mcs_frontends 4"), "{body}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "exit after SIGTERM: {status}");
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("first full table programmed"), "{log}");
    assert!(log.contains("shutting down"), "{log}");
}

#[test]
fn help_lists_the_subcommands() {
    let out = agent().arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in ["run", "table", "status", "uninstall", "demo"] {
        assert!(text.contains(cmd), "{text}");
    }
}

/// The flags that go with examples/hostile (see the file's header).
const HOSTILE_FLAGS: [&str; 10] = [
    "--cluster-id",
    "c1",
    "--clusterset-ip-cidr",
    "198.18.100.0/24",
    "--clusterset-ip-cidr",
    "2001:2::100:0/112",
    "--protect-address",
    "198.18.10.1",
    "--source",
    "file:examples/hostile",
];

/// What examples/hostile must be answered with: each (object, reason).
const HOSTILE_REJECTIONS: [(&str, &str); 15] = [
    ("EndpointSlice good/web-c1", "protected_address"),
    ("EndpointSlice good/web-c1", "noncanonical_address"),
    ("EndpointSlice good/web-c1", "endpoint_is_clusterset_ip"),
    ("EndpointSlice good/web-mirrored", "default_controller"),
    ("ServiceImport evil/apiserver", "vip_not_allowed"),
    ("ServiceImport evil/mapped", "noncanonical_address"),
    ("ServiceImport evil/node", "protected_address"),
    ("ServiceImport evil/policy", "invalid_policy"),
    ("ServiceImport evil/ports", "too_many_ports"),
    ("ServiceImport evil/thief", "vip_conflict"),
    ("examples/hostile/objects.yaml document 10", "unparsable"),
    (
        "examples/hostile/objects.yaml document 11",
        "unsupported_version",
    ),
    ("examples/hostile/objects.yaml document 12", "missing_name"),
    (
        "examples/hostile/objects.yaml document 13",
        "duplicate_object",
    ),
    ("file examples/hostile/nested.yaml", "too_large"),
];

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn table_without_a_clusterset_range_says_what_to_pass() {
    let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .env_remove("MCS_CLUSTERSET_IP_CIDR")
        .args(["table", "--source"])
        .arg(format!("file:{}", examples().display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--clusterset-ip-cidr"), "{err}");
    // An empty value (an unset ConfigMap key) is the same as none.
    let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .env("MCS_CLUSTERSET_IP_CIDR", "")
        .args(["run", "--dataplane", "log", "--source"])
        .arg(format!("file:{}", examples().display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no ClusterSetIP range given"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A range that covers the world is refused.
    let out = agent()
        .args(["table", "--clusterset-ip-cidr", "0.0.0.0/0", "--source"])
        .arg(format!("file:{}", examples().display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn hostile_objects_are_rejected_with_reasons_by_table() {
    let out = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .current_dir(repo_root())
        .args(["table", "--format", "json"])
        .args(HOSTILE_FLAGS)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let frontends: Vec<String> = v["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            format!(
                "{}:{} {}",
                f["vip"].as_str().unwrap(),
                f["port"],
                f["service"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        frontends,
        ["198.18.100.10:80 good/web", "198.18.100.21:80 evil/policy"]
    );
    let web = &v["frontends"][0]["backends"];
    assert_eq!(web.as_array().unwrap().len(), 1, "{web}");
    assert_eq!(web[0]["address"], "198.18.1.2");
    let rejected: Vec<(String, String)> = v["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["object"].as_str().unwrap().to_string(),
                // "label: message"
                r["reason"]
                    .as_str()
                    .unwrap()
                    .split(':')
                    .next()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();
    for (object, reason) in HOSTILE_REJECTIONS {
        assert!(
            rejected.iter().any(|(o, r)| o == object && r == reason),
            "{object}: {reason} missing from {rejected:?}"
        );
    }
    assert_eq!(rejected.len(), HOSTILE_REJECTIONS.len(), "{rejected:?}");
}

#[test]
fn a_live_agent_rejects_hostile_objects_and_serves_the_rest() {
    let port = mcs_test_support::ports::unused_port_or_panic();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mcs-agent"))
        .current_dir(repo_root())
        .args(["run", "--dataplane", "log", "--metrics-addr"])
        .arg(format!("127.0.0.1:{port}"))
        .args(HOSTILE_FLAGS)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((200, _)) = http_get(port, "/readyz") {
            break;
        }
        assert!(Instant::now() < deadline, "agent never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, body) = http_get(port, "/metrics").unwrap();
    assert!(body.contains("mcs_frontends 2"), "{body}");
    for (_, reason) in HOSTILE_REJECTIONS {
        assert!(
            body.lines().any(|l| l.starts_with("mcs_rejected{")
                && l.contains(&format!("reason=\"{reason}\""))
                && !l.ends_with(" 0")),
            "no mcs_rejected for {reason}: {body}"
        );
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("vip_not_allowed"), "{log}");
}
