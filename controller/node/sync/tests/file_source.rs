//! The file source end to end: a directory of YAML drives the controller; edits to the files
//! reach the dataplane as minimal diffs; broken documents are rejected while the rest works;
//! /metrics, /healthz and /readyz answer over real HTTP.

mod common;

use std::time::Duration;

use common::{fe, start};
use mcs_model::{NodeConfig, Protocol};
use mcs_sync::source::file::FileSource;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    sync::mpsc,
};

const WAIT: Duration = Duration::from_secs(20);

const IMPORT: &str = r#"
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: web, namespace: shop }
spec:
  type: ClusterSetIP
  ips: ["198.18.100.10"]
  ports: [{ name: http, protocol: TCP, port: 80 }]
"#;

fn slice(cluster: &str, addr: &str, ready: bool) -> String {
    format!(
        r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-{cluster}
  namespace: shop
  labels:
    multicluster.kubernetes.io/service-name: web
    multicluster.kubernetes.io/source-cluster: {cluster}
addressType: IPv4
ports: [{{ name: http, protocol: TCP, port: 8080 }}]
endpoints: [{{ addresses: ["{addr}"], conditions: {{ ready: {ready} }} }}]
"#
    )
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, out)
}

#[tokio::test]
async fn file_edits_reach_the_dataplane_and_failover_to_the_remote_cluster() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("import.yaml"), IMPORT).unwrap();
    std::fs::write(dir.path().join("c1.yaml"), slice("c1", "198.18.1.2", true)).unwrap();
    std::fs::write(dir.path().join("c2.yaml"), slice("c2", "198.18.2.2", true)).unwrap();
    let (tx, rx) = mpsc::channel(64);
    let node = NodeConfig {
        cluster_id: "c1".into(),
        zone: None,
        ..Default::default()
    };
    let run = start(node, true, rx);
    let addr = mcs_sync::http::spawn(
        "127.0.0.1:0".parse().unwrap(),
        run.registry.clone(),
        run.health.clone(),
    )
    .await
    .unwrap();
    assert_eq!(
        get(addr, "/readyz").await.0,
        503,
        "not ready before the first sync"
    );
    assert_eq!(get(addr, "/healthz").await.0, 200);
    tokio::spawn(FileSource::new(dir.path()).run(tx, Duration::from_millis(50)));

    let f = fe("198.18.100.10", 80, Protocol::Tcp);
    let dp = run.dataplane.clone();
    dp.wait_for("local backend selected", WAIT, |s| {
        common::selected_in(s, &f) == ["198.18.1.2:8080@c1"]
    })
    .await;
    assert!(run.health.is_ready());
    assert_eq!(get(addr, "/readyz").await.0, 200);

    // The local endpoint goes unready: failover to c2.
    std::fs::write(dir.path().join("c1.yaml"), slice("c1", "198.18.1.2", false)).unwrap();
    dp.wait_for("failover to c2", WAIT, |s| {
        common::selected_in(s, &f) == ["198.18.2.2:8080@c2"]
    })
    .await;

    // A broken file is rejected; the service keeps working; metrics say so.
    std::fs::write(dir.path().join("zz-broken.yaml"), "kind: [oops\n").unwrap();
    std::fs::write(dir.path().join("c3.yaml"), slice("c3", "127.0.0.1", true)).unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (_, body) = get(addr, "/metrics").await;
        if body.contains(r#"mcs_rejected{reason="unparsable"} 1"#)
            && body.contains(r#"mcs_rejected{reason="hostile_endpoint"} 1"#)
        {
            assert!(body.contains("mcs_frontends 1"), "{body}");
            assert!(body.contains("mcs_sync_latency_seconds_count"), "{body}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rejections never showed in /metrics: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        dp.selected(&f),
        ["198.18.2.2:8080@c2"],
        "loopback endpoint must never be programmed"
    );

    // The import goes: the frontend is removed.
    std::fs::remove_file(dir.path().join("import.yaml")).unwrap();
    dp.wait_for("frontend removed", WAIT, |s| s.table.frontends.is_empty())
        .await;
    let _ = run.stop.send(true);
}
