//! What the controller's multi-cluster tests share: a ClusterSet of real API servers (with or
//! without kube-controller-manager and a node stand-in), the controller as a real process, and
//! small object helpers. Each test file uses part of it.
#![allow(
    dead_code,
    reason = "each test binary uses a different part of this module"
)]

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    core::v1::{Namespace, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client,
    api::{ListParams, PostParams},
};
use mcs_api::{ServiceExport, ServiceImport};
use mcs_test_support::apiserver::{self, ApiServer, User};

/// How long a test waits for one expected state.
pub const WAIT: Duration = Duration::from_secs(30);
/// The ClusterSetIP range every controller of the tests is given.
pub const RANGE: &str = "198.18.100.0/24";
/// The namespace the tests' objects live in (created in every cluster).
pub const NS: &str = "shop";

/// A controller process, killed on drop.
pub struct Controller(Child);

impl Controller {
    /// A line of the process's `/proc/<pid>/limits` (e.g. `Max open files`): soft, hard.
    pub fn limit(&self, name: &str) -> (String, String) {
        let text = std::fs::read_to_string(format!("/proc/{}/limits", self.0.id())).unwrap();
        let line = text.lines().find(|l| l.starts_with(name)).expect("a limit");
        let mut f = line[name.len()..].split_whitespace();
        (f.next().unwrap().into(), f.next().unwrap().into())
    }

    /// The process's resident set size in bytes (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.id())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS");
        kib * 1024
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The controller of cluster `id`, a single replica (no leader election).
pub fn start_controller(id: &str, kubeconfig: &PathBuf) -> Controller {
    start_controller_with(id, kubeconfig, &["--no-leader-election"])
}

/// The controller of cluster `id`, a single replica, and the loopback port of its metrics.
pub fn start_controller_with_metrics(id: &str, kubeconfig: &PathBuf) -> (Controller, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let ctl = start_controller_with(
        id,
        kubeconfig,
        &["--no-leader-election", "--metrics-addr", &addr],
    );
    (ctl, port)
}

/// The controller of cluster `id` with `extra` arguments (metrics on a random loopback port
/// unless they say `--metrics-addr`; watch retries capped at 500 ms unless they say
/// `--watch-retry-max-ms`). Its log goes to the test's stderr with
/// `MCS_TEST_CONTROLLER_LOG` set.
pub fn start_controller_with(id: &str, kubeconfig: &PathBuf, extra: &[&str]) -> Controller {
    start_controller_env(id, kubeconfig, extra, &[])
}

/// [`start_controller_with`], with `env` set in the controller's environment.
pub fn start_controller_env(
    id: &str,
    kubeconfig: &PathBuf,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Controller {
    let metrics: &[&str] = if extra.contains(&"--metrics-addr") {
        &[]
    } else {
        &["--metrics-addr", "127.0.0.1:0"]
    };
    let child = Command::new(env!("CARGO_BIN_EXE_mcs-controller"))
        .args(["run", "--cluster-id", id, "--clusterset-ip-cidr", RANGE])
        .args(metrics)
        .args(if extra.contains(&"--watch-retry-max-ms") {
            &[][..]
        } else {
            &["--watch-retry-max-ms", "500"][..]
        })
        .args(extra)
        .envs(env.iter().copied())
        .arg("--clusterset-kubeconfig")
        .arg(kubeconfig)
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("MCS_TEST_CONTROLLER_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .spawn()
        .expect("start mcs-controller");
    Controller(child)
}

/// Polls `f` every 100 ms until it returns `Some`, for at most [`WAIT`].
pub async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    f: impl FnMut() -> F,
) -> T {
    until_within(what, WAIT, f).await
}

/// Polls `f` every 100 ms until it returns `Some`, for at most `wait`.
pub async fn until_within<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    wait: Duration,
    mut f: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {wait:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A typed object from JSON.
pub fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).unwrap()
}

/// Creates `o` in namespace `ns`.
pub async fn create<K>(client: &Client, ns: &str, o: K)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    Api::<K>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &o)
        .await
        .unwrap();
}

/// A ClusterIP Service `name` selecting `app: name`, with ClientIP affinity.
pub fn service(name: &str, ports: serde_json::Value) -> Service {
    obj(serde_json::json!({
        "metadata": { "name": name },
        "spec": { "selector": { "app": name }, "ports": ports,
                  "sessionAffinity": "ClientIP",
                  "sessionAffinityConfig": { "clientIP": { "timeoutSeconds": 10 } } }
    }))
}

/// Service `name` in namespace `ns` (port 80 → 8080, named http) with one ready endpoint at
/// `addr`, in an EndpointSlice as Kubernetes' EndpointSlice controller writes it (for
/// clusters without kube-controller-manager).
pub async fn service_with_endpoint(k: &Client, ns: &str, name: &str, addr: &str) {
    create(
        k,
        ns,
        service(
            name,
            serde_json::json!([{ "name": "http", "port": 80, "targetPort": 8080 }]),
        ),
    )
    .await;
    create(
        k,
        ns,
        obj::<EndpointSlice>(serde_json::json!({
            "metadata": { "name": format!("{name}-abcde"), "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" } },
            "addressType": "IPv4",
            "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
            "endpoints": [{ "addresses": [addr], "conditions": { "ready": true } }]
        })),
    )
    .await;
}

/// A ServiceExport of `name`.
pub fn export(name: &str) -> ServiceExport {
    obj(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
        "metadata": { "name": name }, "spec": {}
    }))
}

/// (status, reason) of the export's condition of type `t`.
pub fn condition(se: &ServiceExport, t: &str) -> Option<(String, String)> {
    se.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == t)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// The ServiceImport `ns/name`, if it exists.
pub async fn get_import(c: &Client, ns: &str, name: &str) -> Option<ServiceImport> {
    Api::<ServiceImport>::namespaced(c.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

/// The MCS EndpointSlices of service `ns/name`.
pub async fn mcs_slices(c: &Client, ns: &str, name: &str) -> Vec<EndpointSlice> {
    Api::<EndpointSlice>::namespaced(c.clone(), ns)
        .list(
            &ListParams::default()
                .labels(&format!("multicluster.kubernetes.io/service-name={name}")),
        )
        .await
        .unwrap()
        .items
}

/// Clusters (etcd + kube-apiserver each, optionally kube-controller-manager and a node
/// stand-in), a clusterset kubeconfig of all (contexts named by cluster id) and namespace
/// [`NS`] in each, with admin clients. Everything stops when it is dropped.
pub struct ClusterSet {
    /// Admin clients, in the order of the ids.
    pub clients: Vec<Client>,
    /// The runtime the tests' async parts (and the node stand-ins) run on; dropped (its
    /// tasks stopped) before the servers.
    pub rt: tokio::runtime::Runtime,
    /// The API servers, in the order of the ids (a test may stop and restart one).
    pub servers: Vec<ApiServer>,
    /// The clusterset kubeconfig (every controller's `--clusterset-kubeconfig`).
    pub kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl ClusterSet {
    /// Starts a cluster per id. With `nodes`, each cluster also runs kube-controller-manager
    /// and a node stand-in (`<id>-node`), so Deployments get pods and Services get the
    /// EndpointSlice controller's slices.
    pub fn start(ids: &[&str], nodes: bool) -> Self {
        let crds = vec![apiserver::project_crds(); ids.len()];
        Self::start_with_crds(ids, nodes, &crds)
    }

    /// As [`ClusterSet::start`], cluster `ids[i]` with the CRDs of directory `crds[i]`.
    pub fn start_with_crds(ids: &[&str], nodes: bool, crds: &[PathBuf]) -> Self {
        let mut servers = Vec::new();
        for (id, crds) in ids.iter().zip(crds) {
            let mut s =
                ApiServer::start_with_crds(crds).unwrap_or_else(|e| panic!("cluster {id}: {e:#}"));
            if nodes {
                s.start_controller_manager()
                    .unwrap_or_else(|e| panic!("cluster {id}: {e:#}"));
            }
            servers.push(s);
        }
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("clusterset.kubeconfig");
        let members: Vec<(&str, &ApiServer)> = ids.iter().copied().zip(&servers).collect();
        std::fs::write(
            &kubeconfig,
            apiserver::clusterset_kubeconfig(&members, User::Admin).unwrap(),
        )
        .unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let clients = rt.block_on(async {
            let mut clients = Vec::new();
            for (i, s) in servers.iter().enumerate() {
                let k = s.client().await;
                Api::<Namespace>::all(k.clone())
                    .create(
                        &PostParams::default(),
                        &obj(serde_json::json!({ "metadata": { "name": NS } })),
                    )
                    .await
                    .unwrap();
                if nodes {
                    let (k, node) = (k.clone(), format!("{}-node", ids[i]));
                    tokio::spawn(async move {
                        if let Err(e) =
                            mcs_test_support::node::keep_pods_running(k, &node, i as u8).await
                        {
                            panic!("node stand-in {node}: {e:#}");
                        }
                    });
                }
                clients.push(k);
            }
            clients
        });
        Self {
            servers,
            _dir: dir,
            kubeconfig,
            rt,
            clients,
        }
    }
}

/// A loopback TCP port for a controller's `--metrics-addr` (not every test binary uses it).
#[allow(unused_imports)]
pub use mcs_test_support::ports::unused_port_or_panic as free_port;

/// The text of `GET /metrics` on loopback `port`, or `None` while nothing answers there.
pub fn scrape(port: u16) -> Option<String> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}

/// The value of the metric line `name` (without labels) in `text`.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
