//! A real etcd + kube-apiserver on loopback for integration tests.
//!
//! [`shared`] starts one per test binary on first use (about 4 s) and every test of that binary
//! shares it, each in its own namespace ([`ApiServer::fresh_namespace`]); a test that restarts
//! the apiserver starts its own with [`ApiServer::start`]. The processes run under a supervisor
//! that stops them and removes their data when the test process exits, however it exits.
//!
//! By default no controller-manager, scheduler or kubelet run: namespaces never finish
//! deleting, owner references are not garbage collected, Services get no EndpointSlices. Tests
//! create what they need, or start kube-controller-manager
//! ([`ApiServer::start_controller_manager`]) and a node stand-in ([`crate::node`]).
//!
//! Identities ([`User`]) come from a static token file: an admin in `system:masters`, the
//! agent's ServiceAccount identity (`system:serviceaccount:mcs-system:mcs-agent`) with no
//! permission until a test binds one, and an unprivileged user.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use k8s_openapi::{
    api::core::v1::Namespace,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, Config,
    api::{Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::{prereq, supervise::Supervised};

/// Range for Service ClusterIPs: inside 198.18.0.0/15, away from the test hosts (8,190
/// addresses: the controller bench creates thousands of Services per cluster).
pub const SERVICE_CLUSTER_IP_RANGE: &str = "198.19.224.0/19";
/// How long the apiserver may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The identities known to the test apiserver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum User {
    /// `mcs-admin`, group `system:masters`: may do anything.
    Admin,
    /// `system:serviceaccount:mcs-system:mcs-agent`: what the agent's DaemonSet runs as. Has no
    /// permission until a (Cluster)RoleBinding names it.
    Agent,
    /// `mcs-nobody`: authenticated, nothing granted.
    Nobody,
}

impl User {
    const ALL: [User; 3] = [User::Admin, User::Agent, User::Nobody];

    /// The user name the apiserver sees.
    pub fn name(self) -> &'static str {
        match self {
            User::Admin => "mcs-admin",
            User::Agent => "system:serviceaccount:mcs-system:mcs-agent",
            User::Nobody => "mcs-nobody",
        }
    }

    fn token(self) -> &'static str {
        match self {
            User::Admin => "mcs-admin-token",
            User::Agent => "mcs-agent-token",
            User::Nobody => "mcs-nobody-token",
        }
    }

    fn groups(self) -> &'static str {
        match self {
            User::Admin => "system:masters",
            User::Agent => "system:serviceaccounts,system:serviceaccounts:mcs-system",
            User::Nobody => "mcs:nobody",
        }
    }

    fn short(self) -> &'static str {
        match self {
            User::Admin => "admin",
            User::Agent => "agent",
            User::Nobody => "nobody",
        }
    }
}

/// What a test needs for the apiserver: the binaries.
pub fn prerequisites() -> Result<(), String> {
    prereq::all([
        find_kube_binary("kube-apiserver")
            .map(|_| ())
            .ok_or_else(|| {
                "kube-apiserver not found (set MCS_KUBE_BIN_DIR or run `bash scripts/setup.sh`)"
                    .to_string()
            }),
        prereq::program("etcd"),
    ])
}

/// What a test needs for a cluster with kube-controller-manager: the API server's
/// prerequisites and the controller-manager binary.
pub fn controller_manager_prerequisites() -> Result<(), String> {
    prereq::all([
        prerequisites(),
        find_kube_binary("kube-controller-manager")
            .map(|_| ())
            .ok_or_else(|| {
                "kube-controller-manager not found (set MCS_KUBE_BIN_DIR or run `bash scripts/setup.sh`)"
                    .to_string()
            }),
    ])
}

/// The apiserver shared by the tests of this test binary, started on first use. `None` (after
/// printing why) when a prerequisite is missing on a laptop; panics in CI or when it fails to
/// start.
pub fn shared() -> Option<&'static ApiServer> {
    // Started at most once: a failure fails every test that wants it, without retrying.
    static SHARED: OnceLock<Result<ApiServer, String>> = OnceLock::new();
    if !crate::require(prerequisites()) {
        return None;
    }
    match SHARED.get_or_init(|| ApiServer::start().map_err(|e| format!("{e:#}"))) {
        Ok(api) => Some(api),
        Err(e) => panic!("starting the test kube-apiserver: {e}"),
    }
}

/// A running etcd + kube-apiserver.
#[derive(Debug)]
pub struct ApiServer {
    /// Declared first: dropped (stopped) before the API server it talks to.
    controller_manager: Option<Supervised>,
    dir: PathBuf,
    url: String,
    etcd_url: String,
    etcd: Supervised,
    apiserver: Supervised,
    apiserver_args: Vec<String>,
    apiserver_bin: PathBuf,
}

impl ApiServer {
    /// Starts etcd and kube-apiserver on free loopback ports, waits until ready, applies the
    /// project's CRDs (`deploy/crds/`) and waits until they are established. Blocking.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with_crds(&project_crds())
    }

    /// As [`ApiServer::start`], with the CRDs of another directory (every `*.yaml` but a
    /// kustomization): e.g. the upstream project's ([`upstream_mcs_crds`]).
    ///
    /// A start that fails because a port was taken between picking and binding it (another
    /// process's server) is tried again on new ports, three times in all.
    pub fn start_with_crds(crds: &Path) -> anyhow::Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::start_once(crds) {
                Err(e) if attempt < 3 && format!("{e:#}").contains("address already in use") => {
                    eprintln!(
                        "mcs-test-support: a port was taken before kube-apiserver or etcd bound it \
                         (attempt {attempt} of 3), starting again on new ports"
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn start_once(crds: &Path) -> anyhow::Result<Self> {
        crate::sweep_stale();
        let started = Instant::now();
        let apiserver_bin = find_kube_binary("kube-apiserver").context("kube-apiserver binary")?;
        let etcd_bin = prereq::find_program("etcd").context("etcd binary")?;
        // /dev/shm keeps etcd's fsyncs cheap; the supervisor removes the directory.
        let base = if Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("{}-apiserver-", crate::resource_prefix()))
            .tempdir_in(base)?
            .keep();
        let write = |name: &str, data: &str| -> anyhow::Result<PathBuf> {
            let p = dir.join(name);
            std::fs::write(&p, data).with_context(|| format!("writing {}", p.display()))?;
            Ok(p)
        };

        // TLS: a CA, a serving certificate for 127.0.0.1, a service-account signing key.
        let pki = Pki::generate()?;
        let ca = write("ca.crt", &pki.ca_pem)?;
        let cert = write("apiserver.crt", &pki.serving_cert_pem)?;
        let key = write("apiserver.key", &pki.serving_key_pem)?;
        let sa_key = write("sa.key", &pki.sa_key_pem)?;
        let sa_pub = write("sa.pub", &pki.sa_pub_pem)?;
        let tokens: String = User::ALL
            .iter()
            .map(|u| {
                format!(
                    "{},{},{}-uid,\"{}\"\n",
                    u.token(),
                    u.name(),
                    u.short(),
                    u.groups()
                )
            })
            .collect();
        let token_file = write("tokens.csv", &tokens)?;
        // Lists and watches are audited (metadata only), so a test can count what clients
        // asked and what they were answered ([`ApiServer::refused_reads`]).
        let audit_policy = write(
            "audit-policy.yaml",
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n  verbs: [list, watch]\n- level: None\n",
        )?;

        let etcd_port = crate::ports::unused_port()?;
        let etcd_peer_port = crate::ports::unused_port()?;
        let port = crate::ports::unused_port()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let etcd_args = vec![
            "--name=mcs-test".into(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer_port}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer_port}"),
            format!("--initial-cluster=mcs-test=http://127.0.0.1:{etcd_peer_port}"),
            "--listen-metrics-urls=".into(),
            "--log-level=warn".into(),
            "--unsafe-no-fsync".into(),
        ];
        // The supervisor of etcd (the last to stop) removes the directory.
        let etcd = Supervised::spawn(
            "etcd",
            &etcd_bin,
            &etcd_args,
            &dir.join("etcd.log"),
            Some(&dir),
        )?;

        let p = |path: &Path| path.display().to_string();
        let apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", p(&cert)),
            format!("--tls-private-key-file={}", p(&key)),
            format!("--client-ca-file={}", p(&ca)),
            format!("--token-auth-file={}", p(&token_file)),
            "--authorization-mode=RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={}", p(&sa_pub)),
            format!("--service-account-signing-key-file={}", p(&sa_key)),
            format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"),
            "--endpoint-reconciler-type=none".into(),
            "--disable-admission-plugins=ServiceAccount".into(),
            "--enable-priority-and-fairness=false".into(),
            format!("--cert-dir={}", p(&dir.join("certs"))),
            format!("--audit-policy-file={}", p(&audit_policy)),
            format!("--audit-log-path={}", p(&dir.join("audit.log"))),
            "--audit-log-format=json".into(),
            "--audit-log-mode=blocking".into(),
            "--v=1".into(),
        ];
        let apiserver = Supervised::spawn(
            "kube-apiserver",
            &apiserver_bin,
            &apiserver_args,
            &dir.join("kube-apiserver.log"),
            None,
        )?;
        let url = format!("https://127.0.0.1:{port}");
        let mut api = ApiServer {
            controller_manager: None,
            etcd_url: etcd_url.clone(),
            dir: dir.clone(),
            url,
            etcd,
            apiserver,
            apiserver_args,
            apiserver_bin,
        };
        for user in User::ALL {
            write(
                &format!("kubeconfig-{}", user.short()),
                &kubeconfig_yaml(&api.url, user, &pki.ca_pem),
            )?;
        }
        api.wait_ready()?;
        block_on(apply_crds(api.kubeconfig(User::Admin), crds.to_path_buf()))?;
        eprintln!(
            "mcs-test-support: kube-apiserver ready at {} in {:.1}s (logs in {})",
            api.url,
            started.elapsed().as_secs_f64(),
            api.dir.display()
        );
        Ok(api)
    }

    /// LIST and WATCH requests this API server answered 403 Forbidden, by resource, as its
    /// audit log records them (written before the answer is sent): how often clients retry a
    /// read they are refused (a broken watch is started again before anything is listed).
    pub fn refused_reads(&self) -> std::collections::BTreeMap<String, usize> {
        let mut by = std::collections::BTreeMap::new();
        let text = std::fs::read_to_string(self.dir.join("audit.log")).unwrap_or_default();
        for line in text.lines() {
            let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if (ev["verb"] == "list" || ev["verb"] == "watch")
                && ev["stage"] == "ResponseComplete"
                && ev["responseStatus"]["code"] == 403
                && let Some(r) = ev["objectRef"]["resource"].as_str()
            {
                *by.entry(r.to_string()).or_insert(0) += 1;
            }
        }
        by
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Path of a kubeconfig for `user` (for kubectl and for the agent's `--kubeconfig`).
    pub fn kubeconfig(&self, user: User) -> PathBuf {
        self.dir.join(format!("kubeconfig-{}", user.short()))
    }

    /// A kube client for the admin.
    pub async fn client(&self) -> Client {
        self.client_as(User::Admin).await
    }

    /// A kube client for `user`.
    pub async fn client_as(&self, user: User) -> Client {
        client_from(&self.kubeconfig(user))
            .await
            .expect("kube client for the test apiserver")
    }

    /// Creates a new namespace `<tag>-<n>` and returns its name.
    pub async fn fresh_namespace(&self, tag: &str) -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let tag: String = tag
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .take(40)
            .collect();
        let name = format!(
            "{}-{}",
            tag.trim_matches('-'),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name }
        }))
        .expect("namespace object");
        Api::<Namespace>::all(self.client().await)
            .create(&PostParams::default(), &ns)
            .await
            .expect("creating test namespace");
        name
    }

    /// Stops kube-apiserver (etcd keeps the data) and starts it again on the same port; waits
    /// until it is ready. For tests of watch recovery.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.apiserver.stop();
        let log = self.dir.join("kube-apiserver.log");
        self.apiserver = Supervised::spawn(
            "kube-apiserver",
            &self.apiserver_bin,
            &self.apiserver_args,
            &log,
            None,
        )?;
        self.wait_ready()
    }

    /// Runs `etcdctl` (v3 API) against this apiserver's etcd, e.g. to delete a key behind the
    /// apiserver's back or to compact the history (forcing `410 Gone` on resumed watches).
    pub fn etcdctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let bin =
            prereq::find_program("etcdctl").context("etcdctl not found (Debian etcd-client)")?;
        let out = std::process::Command::new(bin)
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.etcd_url))
            .args(args)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "etcdctl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    }

    /// Starts kube-controller-manager against this API server, with the controllers that a
    /// cluster without nodes can use: EndpointSlices of Services and their mirroring,
    /// Deployments and ReplicaSets, namespace deletion, garbage collection and ClusterRole
    /// aggregation. Waits until the
    /// EndpointSlice controller's workers run (its log says so), with a deadline. Stopped when
    /// the server is dropped. Log: `kube-controller-manager.log` in the server's directory.
    pub fn start_controller_manager(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.controller_manager.is_none(),
            "kube-controller-manager already runs"
        );
        let bin = find_kube_binary("kube-controller-manager").context(
            "kube-controller-manager not found (set MCS_KUBE_BIN_DIR or run `bash scripts/setup.sh`)",
        )?;
        let log = self.dir.join("kube-controller-manager.log");
        let args = vec![
            format!("--kubeconfig={}", self.kubeconfig(User::Admin).display()),
            "--controllers=endpointslice,endpointslicemirroring,deployment,replicaset,namespace,garbagecollector,clusterrole-aggregation".into(),
            "--leader-elect=false".into(),
            // No serving port: nothing here scrapes it, and it needs no certificate.
            "--secure-port=0".into(),
            // Tests create hundreds of objects at once; the default 20 requests/s would make
            // the controller-manager, not the code under test, what they measure.
            "--kube-api-qps=200".into(),
            "--kube-api-burst=400".into(),
            "--concurrent-service-endpoint-syncs=10".into(),
            "--v=2".into(),
        ];
        let mut kcm = Supervised::spawn("kube-controller-manager", &bin, &args, &log, None)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            // Logged once its caches are synced and its workers run.
            if text.contains("\"Starting service queue worker threads\"") {
                break;
            }
            if !(kcm.running() && kcm.pid().is_none_or(|p| crate::pid_alive(p as u32))) {
                bail!(
                    "kube-controller-manager exited while starting:\n{}",
                    kcm.log_tail(20)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-controller-manager did not start its EndpointSlice controller within {READY_TIMEOUT:?}:\n{}",
                    kcm.log_tail(20)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.controller_manager = Some(kcm);
        Ok(())
    }

    /// Stops kube-apiserver only (etcd keeps running), until [`ApiServer::restart`].
    pub fn stop_apiserver(&mut self) {
        self.apiserver.stop();
    }

    /// Polls `/readyz` until it answers ok and namespace `default` exists, with a deadline.
    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let etcd_tail = self.etcd.log_tail(10);
        wait_ready(
            &self.kubeconfig(User::Admin),
            &mut self.apiserver,
            &etcd_tail,
        )
    }

    /// Starts a second kube-apiserver on the same etcd (another instance of an HA control
    /// plane) on its own port and waits until it is ready. Stop it before this one is dropped.
    pub fn start_peer(&self) -> anyhow::Result<PeerApiServer> {
        let port = crate::ports::unused_port()?;
        let args: Vec<String> = self
            .apiserver_args
            .iter()
            .map(|a| {
                if a.starts_with("--secure-port=") {
                    format!("--secure-port={port}")
                } else {
                    a.clone()
                }
            })
            .collect();
        let url = format!("https://127.0.0.1:{port}");
        let ca_pem = std::fs::read_to_string(self.dir.join("ca.crt"))?;
        let tag = format!("peer{port}");
        for user in User::ALL {
            std::fs::write(
                self.dir.join(format!("kubeconfig-{tag}-{}", user.short())),
                kubeconfig_yaml(&url, user, &ca_pem),
            )?;
        }
        let mut apiserver = Supervised::spawn(
            "kube-apiserver (peer)",
            &self.apiserver_bin,
            &args,
            &self.dir.join(format!("kube-apiserver-{tag}.log")),
            None,
        )?;
        let peer_kubeconfig = self
            .dir
            .join(format!("kubeconfig-{tag}-{}", User::Admin.short()));
        wait_ready(&peer_kubeconfig, &mut apiserver, &self.etcd.log_tail(10))?;
        Ok(PeerApiServer {
            dir: self.dir.clone(),
            tag,
            url,
            _apiserver: apiserver,
        })
    }
}

/// Runs a future on a private runtime in its own thread (callers may be inside a runtime).
fn block_on<T: Send + 'static>(
    fut: impl std::future::Future<Output = anyhow::Result<T>> + Send + 'static,
) -> anyhow::Result<T> {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(fut)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("apiserver helper thread panicked"))?
}

/// A second kube-apiserver on the etcd of an [`ApiServer`] (see [`ApiServer::start_peer`]);
/// dropping it stops it.
#[derive(Debug)]
pub struct PeerApiServer {
    dir: PathBuf,
    tag: String,
    url: String,
    _apiserver: Supervised,
}

impl PeerApiServer {
    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Path of a kubeconfig for `user` on this instance.
    pub fn kubeconfig(&self, user: User) -> PathBuf {
        self.dir
            .join(format!("kubeconfig-{}-{}", self.tag, user.short()))
    }
}

/// A kubeconfig whose contexts are `members` (cluster id, API server), each context, cluster
/// and user named by the cluster id, all as `user`: what the MCS controller's
/// `--clusterset-kubeconfig` and the conformance suite's `-contexts` read.
pub fn clusterset_kubeconfig(members: &[(&str, &ApiServer)], user: User) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let mut clusters = String::new();
    let mut users = String::new();
    let mut contexts = String::new();
    for (id, api) in members {
        let ca = std::fs::read_to_string(api.dir.join("ca.crt"))?;
        let _ = write!(
            clusters,
            "- name: {id}\n  cluster:\n    server: {}\n    certificate-authority-data: {}\n",
            api.url,
            base64(ca.as_bytes())
        );
        let _ = write!(
            users,
            "- name: {id}\n  user:\n    token: {}\n",
            user.token()
        );
        let _ = write!(
            contexts,
            "- name: {id}\n  context:\n    cluster: {id}\n    user: {id}\n"
        );
    }
    let current = members.first().map_or("", |m| m.0);
    Ok(format!(
        "apiVersion: v1\nkind: Config\nclusters:\n{clusters}users:\n{users}contexts:\n{contexts}current-context: {current}\n"
    ))
}

fn kubeconfig_yaml(url: &str, user: User, ca_pem: &str) -> String {
    let ca_b64 = base64(ca_pem.as_bytes());
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    \
         certificate-authority-data: {ca_b64}\nusers:\n- name: {u}\n  user:\n    token: {t}\n\
         contexts:\n- name: test\n  context:\n    cluster: test\n    user: {u}\n\
         current-context: test\n",
        u = user.short(),
        t = user.token(),
    )
}

/// Polls `/readyz` of the apiserver run by `server` (through `kubeconfig`) until it answers ok
/// and namespace `default` exists, with a deadline.
fn wait_ready(kubeconfig: &Path, server: &mut Supervised, etcd_tail: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let alive = server.running() && server.pid().is_none_or(|p| crate::pid_alive(p as u32));
        if !alive {
            bail!(
                "kube-apiserver exited during start-up; its log ends with:\n{}\n\
                 etcd log ends with:\n{etcd_tail}",
                server.log_tail(30),
            );
        }
        let kc = kubeconfig.to_path_buf();
        let ready = block_on(async move {
            let client = client_from(&kc).await?;
            let req = http::Request::get("/readyz").body(Vec::new())?;
            let body = client.request_text(req).await?;
            anyhow::ensure!(body.trim() == "ok", "readyz: {body}");
            let ns = Api::<Namespace>::all(client).get_opt("default").await?;
            anyhow::ensure!(ns.is_some(), "namespace default not there yet");
            Ok(())
        });
        match ready {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() > deadline => {
                bail!(
                    "kube-apiserver not ready after {READY_TIMEOUT:?}: {e:#}\nlog ends with:\n{}",
                    server.log_tail(30)
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// A kube client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> anyhow::Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// The project's CRDs: `deploy/crds/`.
pub fn project_crds() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds")
}

/// The CRDs of the upstream MCS API module `sigs.k8s.io/mcs-api` at `version` (its
/// `config/crd/`, as the upstream project and Submariner install them), from the Go module
/// cache (`go mod download`, through the Go module proxy the first time). `Err` says why not
/// (no `go`, no proxy): a prerequisite for [`crate::require`].
pub fn upstream_mcs_crds(version: &str) -> Result<PathBuf, String> {
    let go =
        crate::prereq::find_program("go").ok_or("go not found (scripts/setup.sh installs it)")?;
    let out = std::process::Command::new(go)
        .args([
            "mod",
            "download",
            "-json",
            &format!("sigs.k8s.io/mcs-api@{version}"),
        ])
        // Outside any module: `go mod download` of a path@version needs none.
        .current_dir(std::env::temp_dir())
        .output()
        .map_err(|e| format!("go mod download: {e}"))?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "go mod download sigs.k8s.io/mcs-api@{version}: {e}; {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(err) = info["Error"].as_str() {
        return Err(format!(
            "go mod download sigs.k8s.io/mcs-api@{version}: {err}"
        ));
    }
    let dir = Path::new(info["Dir"].as_str().ok_or("go mod download: no Dir")?).join("config/crd");
    if !dir.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    Ok(dir)
}

/// Applies every CRD in `dir` (server-side apply, taking over every field: a CRD already
/// there is replaced in place, its objects kept) and waits until established.
pub async fn apply_crds(kubeconfig: PathBuf, dir: PathBuf) -> anyhow::Result<()> {
    let client = client_from(&kubeconfig).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let mut names = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect();
    entries.sort();
    for path in entries {
        let text = std::fs::read_to_string(&path)?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let name = crd.metadata.name.clone().context("CRD without a name")?;
        crds.patch(
            &name,
            &PatchParams::apply("mcs-test-support").force(),
            &Patch::Apply(&crd),
        )
        .await
        .with_context(|| format!("applying {}", path.display()))?;
        names.push(name);
    }
    for name in names {
        wait_established(&crds, &name).await?;
    }
    Ok(())
}

/// Waits (up to 30 s) until the CRD `name` is Established.
pub async fn wait_established(
    crds: &Api<CustomResourceDefinition>,
    name: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let crd = crds.get(name).await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "CRD {name} not established in 30s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Marks `version` of the CRD `name` served or not (as a release that drops a version does).
pub async fn set_served(
    crds: &Api<CustomResourceDefinition>,
    name: &str,
    version: &str,
    served: bool,
) -> anyhow::Result<()> {
    let crd = crds.get(name).await?;
    let i = crd
        .spec
        .versions
        .iter()
        .position(|v| v.name == version)
        .with_context(|| format!("CRD {name} has no version {version}"))?;
    let patch = serde_json::json!([
        { "op": "replace", "path": format!("/spec/versions/{i}/served"), "value": served }
    ]);
    crds.patch(
        name,
        &PatchParams::default(),
        &Patch::Json::<()>(serde_json::from_value(patch)?),
    )
    .await?;
    Ok(())
}

/// `kube-apiserver`/`kubectl` from `MCS_KUBE_BIN_DIR`, else from PATH.
pub fn find_kube_binary(name: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("MCS_KUBE_BIN_DIR") {
        let p = PathBuf::from(dir).join(name);
        if p.is_file() {
            return Some(p);
        }
    }
    prereq::find_program(name)
}

struct Pki {
    ca_pem: String,
    serving_cert_pem: String,
    serving_key_pem: String,
    sa_key_pem: String,
    sa_pub_pem: String,
}

impl Pki {
    fn generate() -> anyhow::Result<Self> {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
            KeyUsagePurpose, SanType,
        };
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "mcs-test-ca");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let serving_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".to_string()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        let serving = params.signed_by(&serving_key, &ca)?;
        let sa = KeyPair::generate()?;
        Ok(Self {
            ca_pem: ca.pem(),
            serving_cert_pem: serving.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            sa_key_pem: sa.serialize_pem(),
            sa_pub_pem: sa.public_key_pem(),
        })
    }
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
        ] {
            assert_eq!(super::base64(i.as_bytes()), o);
        }
    }
}
