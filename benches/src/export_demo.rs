//! The export story (`mcs-bench export-demo`, run by `scripts/demo.sh` after the agent's
//! demo): a Service exported in cluster c2 reaches a client pod of cluster c1 through the
//! ClusterSetIP that our controller allocated and our agent programmed, found by its
//! `clusterset.local` name through the agent's DNS.
//!
//! Real parts: two clusters of etcd + kube-apiserver, `mcs-controller` in each, `mcs-agent`
//! (eBPF socket LB) on c1's node watching c1's API server, network namespaces for the client
//! pod and c2's pods. Written by hand: c2's Service, ServiceExport and the Service's
//! EndpointSlice — the last stands in for c2's EndpointSlice controller, since c2's pods are
//! processes in network namespaces here, not kubelet pods. Nothing is written between the clusters but by the
//! controller, and nothing into the dataplane but by the agent.
//!
//! Every step checks itself; an unexpected failure or cut reply exits 1.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use k8s_openapi::api::{
    core::v1::{Namespace, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client,
    api::{DeleteParams, PostParams},
};
use mcs_api::{ServiceExport, ServiceImport};
use mcs_sandbox::{cgroup::TestCgroup, topology::TwoClusters};
use mcs_test_support::apiserver::{self, ApiServer, User};

use crate::{
    faults::{LoadResult, load_result, start_backend},
    harness::{
        agent::http_get,
        procs::{Proc, catch_signals, interrupted, sibling, tail},
        tools::resolve_a,
    },
};

const RANGE: &str = "198.18.100.0/24";
const NS: &str = "shop";
const WAIT: Duration = Duration::from_secs(30);

fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> anyhow::Result<T> {
    Ok(serde_json::from_value(v)?)
}

async fn poll<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut f: impl FnMut() -> F,
) -> anyhow::Result<(T, Duration)> {
    let t = Instant::now();
    loop {
        if let Some(v) = f().await {
            return Ok((v, t.elapsed()));
        }
        if t.elapsed() > WAIT {
            bail!("timed out after {WAIT:?} waiting for {what}");
        }
        interrupted()?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Load from the client pod (in the agent's cgroup) to `to` for `seconds`.
fn load(
    cg: &TestCgroup,
    topo: &TwoClusters,
    to: SocketAddr,
    seconds: f64,
) -> anyhow::Result<LoadResult> {
    let me = std::env::current_exe()?;
    let out = cg
        .command(Some(&topo.cli), &me)
        .args([
            "crr-loop",
            "--to",
            &to.to_string(),
            "--seconds",
            &seconds.to_string(),
        ])
        .args(["--max", "400"])
        .stderr(Stdio::inherit())
        .output()?;
    load_result(&out)
}

fn show(r: &LoadResult) -> String {
    let by: Vec<String> = r
        .by_backend
        .iter()
        .map(|(b, n)| format!("{b}: {n}"))
        .collect();
    format!(
        "{} tried, {} served whole, {} failed, {} cut{}",
        r.tried,
        r.ok,
        r.failed,
        r.incomplete,
        if by.is_empty() {
            String::new()
        } else {
            format!(" — served by {}", by.join(", "))
        }
    )
}

/// Runs the story; `agent`/`controller`: the binaries (default: next to this one).
pub fn run(agent: Option<PathBuf>, controller: Option<PathBuf>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut logs = Vec::new();
    let problems = match story(agent, controller, dir.path(), &mut logs) {
        Ok(p) => p,
        Err(e) => vec![format!("{e:#}")],
    };
    if problems.is_empty() {
        println!("export story: every step did what it should");
        return Ok(());
    }
    for p in &problems {
        println!("FAILED: {p}");
    }
    for l in &logs {
        println!("--- {} (last lines)\n{}", l.display(), tail(l, 15));
    }
    bail!("the export story failed ({} problems)", problems.len())
}

/// The steps; returns what went wrong in the steps that check themselves (a step that could
/// not run at all is an error). The processes' logs go to `dir`, their paths into `logs`.
fn story(
    agent: Option<PathBuf>,
    controller: Option<PathBuf>,
    dir: &Path,
    logs: &mut Vec<PathBuf>,
) -> anyhow::Result<Vec<String>> {
    apiserver::prerequisites().map_err(anyhow::Error::msg)?;
    // A stop signal ends the story through its clean-up (namespaces, pins, servers).
    catch_signals()?;
    let agent = agent.unwrap_or_else(|| sibling("mcs-agent"));
    let controller = controller.unwrap_or_else(|| sibling("mcs-controller"));
    for b in [&agent, &controller] {
        anyhow::ensure!(b.is_file(), "{} not found (build it first)", b.display());
    }
    let mut problems: Vec<String> = Vec::new();

    println!("[1/5] two clusters (etcd + kube-apiserver each) and the pods' network");
    let c1 = ApiServer::start().context("starting cluster c1")?;
    let c2 = ApiServer::start().context("starting cluster c2")?;
    let topo = TwoClusters::build().context("building the network namespaces")?;
    topo.node.enable_forwarding()?;
    let _pods = [
        start_backend(&topo.c2, "198.18.2.2:8080".parse()?)?,
        start_backend(&topo.c2, "198.18.2.3:8080".parse()?)?,
    ];
    let kc = dir.join("clusterset.kubeconfig");
    std::fs::write(
        &kc,
        apiserver::clusterset_kubeconfig(&[("c1", &c1), ("c2", &c2)], User::Admin)?,
    )?;
    println!("      c1 {}  c2 {}", c1.url(), c2.url());
    println!("      c2's pods: 198.18.2.2:8080, 198.18.2.3:8080; c1's client pod: 198.18.10.2");

    let rt = tokio::runtime::Runtime::new()?;
    let (k1, k2) = rt.block_on(async { (c1.client().await, c2.client().await) });
    rt.block_on(async {
        for k in [&k1, &k2] {
            Api::<Namespace>::all(k.clone())
                .create(
                    &PostParams::default(),
                    &obj(serde_json::json!({ "metadata": { "name": NS } }))?,
                )
                .await?;
        }
        anyhow::Ok(())
    })?;

    println!("[2/5] in c2: Service {NS}/web (80 -> 8080), its EndpointSlice, a ServiceExport");
    rt.block_on(export_web(&k2))?;
    println!(
        "      (the EndpointSlice stands in for c2's EndpointSlice controller: its pods are netns processes here)"
    );

    println!("[3/5] mcs-controller in c1 and c2 (each reads both, writes only its own cluster)");
    let mut procs = Vec::new();
    for id in ["c1", "c2"] {
        let mut cmd = Command::new(&controller);
        cmd.args(["run", "--cluster-id", id, "--clusterset-ip-cidr", RANGE])
            .args(["--metrics-addr", "127.0.0.1:0", "--no-leader-election"])
            .arg("--clusterset-kubeconfig")
            .arg(&kc);
        let log = dir.join(format!("controller-{id}.log"));
        procs.push(Proc::spawn(&format!("mcs-controller {id}"), cmd, &log)?);
        logs.push(log);
    }
    let (import, took) = rt.block_on(poll("the ServiceImport in c1", || async {
        Api::<ServiceImport>::namespaced(k1.clone(), NS)
            .get_opt("web")
            .await
            .ok()
            .flatten()
            // Its ClusterSetIP (spec) and its clusters (status, written right after).
            .filter(|si| {
                !si.spec.ips.is_empty()
                    && si.status.as_ref().is_some_and(|s| !s.clusters.is_empty())
            })
    }))?;
    let vip = import.spec.ips[0].clone();
    let vip_ip: IpAddr = vip.parse().context("the ServiceImport's ClusterSetIP")?;
    println!(
        "      c1 has ServiceImport {NS}/web, ClusterSetIP {vip} (allocated from {RANGE}), clusters {:?}, {:.0} ms after the controllers started",
        import
            .status
            .as_ref()
            .map(|s| s
                .clusters
                .iter()
                .map(|c| c.cluster.clone())
                .collect::<Vec<_>>())
            .unwrap_or_default(),
        took.as_secs_f64() * 1e3
    );
    let (valid, _) = rt.block_on(poll("the export's conditions in c2", || async {
        let se = Api::<ServiceExport>::namespaced(k2.clone(), NS)
            .get("web")
            .await
            .ok()?;
        se.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Valid")
            .map(|c| format!("{}={} ({})", c.type_, c.status, c.reason))
    }))?;
    println!("      c2's ServiceExport: {valid}");

    println!(
        "[4/5] mcs-agent (eBPF socket LB, clusterset.local DNS) on c1's node, watching c1's API server"
    );
    let cg = TestCgroup::new("export")?;
    let pins = Path::new("/sys/fs/bpf").join(mcs_sandbox::unique_name("export"));
    let free = || -> anyhow::Result<u16> { Ok(mcs_test_support::ports::unused_port()?) };
    let (metrics_port, dns_port) = (free()?, free()?);
    let dns = SocketAddr::from(([127, 0, 0, 1], dns_port));
    let mut cmd = Command::new(&agent);
    cmd.args([
        "run",
        "--dataplane",
        "ebpf",
        "--source",
        "kube",
        "--cluster-id",
        "c1",
    ])
    .args(["--clusterset-ip-cidr", RANGE])
    .arg("--kubeconfig")
    .arg(c1.kubeconfig(User::Admin))
    .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
    .args(["--dns-listen", &dns.to_string()])
    .arg("--cgroup-root")
    .arg(cg.path())
    .arg("--bpf-pin-dir")
    .arg(&pins);
    let log = dir.join("agent.log");
    let _agent = Proc::spawn("mcs-agent", cmd, &log)?;
    logs.push(log);
    let _unpin = Unpin(agent.clone(), pins.clone());
    let metrics = SocketAddr::from(([127, 0, 0, 1], metrics_port));
    rt.block_on(poll("the agent's first table", || async {
        http_get(metrics, "/readyz").ok()
    }))?;
    let name = format!("web.{NS}.svc.clusterset.local.");
    let (rcode, ips) = resolve_a(dns, &name, Duration::from_secs(2))?;
    println!("      {name} A (the agent's DNS, {dns}): {rcode} {ips:?}");
    if ips != [vip_ip] {
        problems.push(format!(
            "step 4: {name} resolved to {ips:?} ({rcode}), not the ClusterSetIP {vip}"
        ));
    }
    let to = SocketAddr::new(ips.first().copied().unwrap_or(vip_ip), 80);
    let r = load(&cg, &topo, to, 2.0)?;
    println!("      {to} from c1's client pod: {}", show(&r));
    if r.ok == 0 || r.failed > 0 || r.incomplete > 0 {
        problems.push(format!("step 4: {}", show(&r)));
    }
    if r.by_backend.keys().any(|b| !b.starts_with("198.18.2.")) {
        problems.push(format!(
            "step 4: a backend outside c2 answered: {:?}",
            r.by_backend
        ));
    }

    println!("[5/5] c2 unexports web: the import goes from c1, the agent unprograms the VIP");
    rt.block_on(async {
        Api::<ServiceExport>::namespaced(k2.clone(), NS)
            .delete("web", &DeleteParams::default())
            .await?;
        anyhow::Ok(())
    })?;
    let (_, took) = rt.block_on(poll("the import gone from c1", || async {
        Api::<ServiceImport>::namespaced(k1.clone(), NS)
            .get_opt("web")
            .await
            .ok()
            .and_then(|o| o.is_none().then_some(()))
    }))?;
    let (_, took_dp) = rt.block_on(poll("the VIP unprogrammed", || async {
        let m = http_get(metrics, "/metrics").ok()?;
        (crate::harness::agent::metric(&m, "mcs_frontends") == Some(0.0)).then_some(())
    }))?;
    println!(
        "      import deleted {:.0} ms after the unexport; VIP unprogrammed {:.0} ms after that",
        took.as_secs_f64() * 1e3,
        took_dp.as_secs_f64() * 1e3
    );
    let (rcode, ips) = resolve_a(dns, &name, Duration::from_secs(2))?;
    println!("      {name} A now: {rcode} {ips:?}");
    if !ips.is_empty() || rcode != hickory_proto::op::ResponseCode::NXDomain {
        problems.push(format!(
            "step 5: {name} still resolves after the unexport: {rcode} {ips:?}"
        ));
    }
    let r = load(&cg, &topo, to, 0.5)?;
    println!(
        "      {to} now (failures expected: nothing serves it): {}",
        show(&r)
    );
    if r.ok > 0 {
        problems.push(format!(
            "step 5: the unexported VIP still served {} connections",
            r.ok
        ));
    }

    drop(procs);
    Ok(problems)
}

/// Detaches the agent's programs and removes its pins, also when the story fails.
struct Unpin(PathBuf, PathBuf);

impl Drop for Unpin {
    fn drop(&mut self) {
        let _ = Command::new(&self.0)
            .args(["uninstall", "--bpf-pin-dir"])
            .arg(&self.1)
            .output();
    }
}

async fn export_web(k2: &Client) -> anyhow::Result<()> {
    let svc: Service = obj(serde_json::json!({
        "metadata": { "name": "web" },
        "spec": { "selector": { "app": "web" },
                  "ports": [{ "name": "http", "port": 80, "targetPort": 8080 }] }
    }))?;
    Api::<Service>::namespaced(k2.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await?;
    let es: EndpointSlice = obj(serde_json::json!({
        "metadata": { "name": "web-x7k2p", "labels": {
            "kubernetes.io/service-name": "web",
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" } },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": [
            { "addresses": ["198.18.2.2"], "conditions": { "ready": true } },
            { "addresses": ["198.18.2.3"], "conditions": { "ready": true } }
        ]
    }))?;
    Api::<EndpointSlice>::namespaced(k2.clone(), NS)
        .create(&PostParams::default(), &es)
        .await?;
    let se: ServiceExport = obj(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
        "metadata": { "name": "web" }, "spec": {}
    }))?;
    Api::<ServiceExport>::namespaced(k2.clone(), NS)
        .create(&PostParams::default(), &se)
        .await?;
    Ok(())
}
