//! What an operator applies, checked against a real kube-apiserver: the kustomize base and the
//! Helm chart (rendered by real `kubectl kustomize` and `helm template`) render the same
//! objects, and the apiserver accepts them (`kubectl apply --dry-run=server`), as well as the
//! CRDs and a chart rendered with non-default values.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

mod common;

use common::{TEST_CIDRS, helm_template, objects};
use mcs_test_support::{
    apiserver::{self, User},
    prereq, require,
};

fn kubectl() -> PathBuf {
    apiserver::find_kube_binary("kubectl").expect("kubectl")
}

/// Runs `cmd` with `stdin`; its output, insisting on success.
fn run(cmd: &mut Command, stdin: Option<&str>) -> String {
    mcs_test_support::kubectl::stdout_of(cmd, stdin).unwrap()
}

/// Helm's pod templates carry `checksum/config` (the ConfigMap's hash, so that a changed
/// value rolls the pods); kustomize has no such thing. Checks every DaemonSet and Deployment
/// of `helmed` has it and removes it, so the rest can be compared.
fn strip_config_checksums(helmed: &mut [serde_json::Value]) {
    for o in helmed
        .iter_mut()
        .filter(|o| o["kind"] == "DaemonSet" || o["kind"] == "Deployment")
    {
        let kind = o["kind"].to_string();
        let meta = o["spec"]["template"]["metadata"]
            .as_object_mut()
            .expect("pod template metadata");
        let ann = meta
            .get_mut("annotations")
            .and_then(|a| a.as_object_mut())
            .unwrap_or_else(|| panic!("no pod template annotations in helm's {kind}"));
        let sum = ann.remove("checksum/config");
        assert!(
            sum.as_ref()
                .and_then(|s| s.as_str())
                .is_some_and(|s| s.len() == 64),
            "helm's pod template lacks checksum/config: {sum:?}"
        );
        if ann.is_empty() {
            meta.remove("annotations");
        }
    }
}

/// Objects of a multi-document YAML, sorted by (kind, namespace, name).
fn prerequisites() -> bool {
    require(prereq::all([
        apiserver::prerequisites(),
        prereq::program("helm"),
        apiserver::find_kube_binary("kubectl")
            .map(|_| ())
            .ok_or_else(|| "kubectl not found".to_string()),
    ]))
}

#[test]
fn kustomize_base_and_helm_chart_render_the_same_objects() {
    if !prerequisites() {
        return;
    }
    let kustomized = run(
        Command::new(kubectl())
            .arg("kustomize")
            .arg(mcs_deploy::dir().join("kustomize/base")),
        None,
    );
    // The ClusterSetIP range is required: the base leaves it empty (the agent refuses to
    // start so) and the chart refuses to render without it.
    let out = Command::new("helm")
        .args(["template", "mcs"])
        .arg(mcs_deploy::dir().join("helm/mcs-dataplane"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("set clustersetIPCIDRs"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let helmed = helm_template(&[]);
    let (mut a, mut b) = (objects(&kustomized), objects(&helmed));
    strip_config_checksums(&mut b);
    for o in &mut a {
        if o["kind"] == "ConfigMap" {
            assert_eq!(o["data"]["MCS_CLUSTERSET_IP_CIDR"], "");
            o["data"]["MCS_CLUSTERSET_IP_CIDR"] = TEST_CIDRS.into();
        }
    }
    let kinds: Vec<&str> = a.iter().map(|o| o["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "Namespace",
            "Role",
            "Role",
            "RoleBinding",
            "Service",
            "Service",
            "ServiceAccount",
            // The pod proxy kept to the metrics ports (the agents are on the host network).
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding"
        ]
    );
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            x, y,
            "kustomize and helm differ for {} {}",
            x["kind"], x["metadata"]["name"]
        );
    }
    assert_eq!(a.len(), b.len());
}

/// The admin kubeconfig of the shared API server and a kubectl runner with it, after the
/// agent's namespace exists (namespaced objects can only be dry-run in an existing one).
fn admin_kubectl() -> (PathBuf, impl Fn(&[&str], Option<&str>) -> String) {
    let kc = apiserver::shared().unwrap().kubeconfig(User::Admin);
    let kc2 = kc.clone();
    let k = move |args: &[&str], stdin: Option<&str>| {
        run(
            Command::new(kubectl())
                .arg("--kubeconfig")
                .arg(&kc2)
                .args(args),
            stdin,
        )
    };
    // Once per test binary: two tests applying it at once race to create it.
    static NAMESPACE: std::sync::Once = std::sync::Once::new();
    NAMESPACE.call_once(|| {
        let ns = mcs_deploy::dir().join("kustomize/base/namespace.yaml");
        k(&["apply", "-f", &ns.display().to_string()], None);
    });
    (kc, k)
}

#[test]
fn the_apiserver_accepts_crds_base_and_chart() {
    if !prerequisites() {
        return;
    }
    let (_, k) = admin_kubectl();
    let out = k(
        &[
            "apply",
            "--dry-run=server",
            "-k",
            &mcs_deploy::dir().join("crds").display().to_string(),
        ],
        None,
    );
    assert_eq!(out.matches("(server dry run)").count(), 3, "{out}");
    let out = k(
        &[
            "apply",
            "--dry-run=server",
            "-k",
            &mcs_deploy::dir()
                .join("kustomize/base")
                .display()
                .to_string(),
        ],
        None,
    );
    assert!(
        out.contains("daemonset.apps/mcs-agent created (server dry run)"),
        "{out}"
    );
    let out = k(
        &["apply", "--dry-run=server", "-f", "-"],
        Some(&helm_template(&[])),
    );
    assert!(
        out.contains("clusterrole.rbac.authorization.k8s.io/mcs-agent created (server dry run)"),
        "{out}"
    );

    // Non-default values render and are accepted too.
    let custom = helm_template(&[
        "--set",
        "clusterId=c7",
        "--set",
        "dataplane=ebpf",
        "--set",
        "metricsPort=9500",
        "--set",
        "cgroupRoot=/sys/fs/cgroup/unified",
    ]);
    assert!(custom.contains("MCS_CLUSTER_ID: \"c7\""), "{custom}");
    assert!(
        custom.contains("port: 9500") && custom.contains("MCS_METRICS_ADDR: 0.0.0.0:9500"),
        "{custom}"
    );

    // The update strategy: with the userspace dataplane the next agent starts beside the old
    // one (maxSurge), so the agent declares no ports (each would be a hostPort on the host
    // network, and the scheduler would keep the surging pod off the node); one node at a
    // time otherwise (two eBPF agents would write the same pinned maps).
    let strategy = |yaml: &str| {
        let ds = objects(yaml)
            .into_iter()
            .find(|o| o["kind"] == "DaemonSet")
            .unwrap();
        assert!(
            ds["spec"]["template"]["spec"]["containers"][0]["ports"].is_null(),
            "{ds}"
        );
        ds["spec"]["updateStrategy"]["rollingUpdate"].clone()
    };
    assert_eq!(
        strategy(&helm_template(&["--set", "dataplane=userspace"])),
        serde_json::json!({"maxSurge": 1, "maxUnavailable": 0})
    );
    for dp in ["ebpf", "auto"] {
        assert_eq!(
            strategy(&helm_template(&["--set", &format!("dataplane={dp}")])),
            serde_json::json!({"maxUnavailable": 1}),
            "{dp}"
        );
    }
    // The userspace agent gets no eBPF capabilities (it only unlinks pins a previous eBPF
    // agent left); the others get BPF and PERFMON.
    let added = |yaml: &str| {
        let ds = objects(yaml)
            .into_iter()
            .find(|o| o["kind"] == "DaemonSet")
            .unwrap();
        ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
            .clone()
    };
    assert_eq!(
        added(&helm_template(&["--set", "dataplane=userspace"])),
        serde_json::json!(["NET_ADMIN", "NET_BIND_SERVICE"])
    );
    for dp in ["ebpf", "auto"] {
        assert_eq!(
            added(&helm_template(&["--set", &format!("dataplane={dp}")])),
            serde_json::json!(["NET_ADMIN", "NET_BIND_SERVICE", "BPF", "PERFMON"]),
            "{dp}"
        );
    }
    assert!(
        custom.contains("path: /sys/fs/cgroup/unified")
            && custom.contains("mountPath: /run/mcs/cgroup")
    );
    let out = k(&["apply", "--dry-run=server", "-f", "-"], Some(&custom));
    assert!(out.contains("(server dry run)"), "{out}");

    // Several nodes on one kernel: each agent mounts its node's subdirectory of the host
    // directories; off by default (a real node has its kernel to itself).
    let mounts = |yaml: &str| {
        objects(yaml)
            .into_iter()
            .find(|o| o["kind"] == "DaemonSet")
            .map(|o| o["spec"]["template"]["spec"]["containers"][0]["volumeMounts"].clone())
            .unwrap()
    };
    let shared = helm_template(&["--set", "nodeSubdirectories=true"]);
    for m in mounts(&shared).as_array().unwrap() {
        let per_node = ["bpffs", "cgroup2", "handover"].contains(&m["name"].as_str().unwrap());
        assert_eq!(
            m.get("subPathExpr").and_then(|v| v.as_str()),
            per_node.then_some("$(NODE_NAME)"),
            "{m}"
        );
    }
    assert!(!mounts(&helm_template(&[])).to_string().contains("subPath"));
    let out = k(&["apply", "--dry-run=server", "-f", "-"], Some(&shared));
    assert!(out.contains("(server dry run)"), "{out}");

    // A changed value changes the agents' pod template (its ConfigMap checksum), so
    // `helm upgrade` rolls them.
    let sum = |yaml: &str| {
        objects(yaml)
            .into_iter()
            .find(|o| o["kind"] == "DaemonSet")
            .map(|o| o["spec"]["template"]["metadata"]["annotations"]["checksum/config"].clone())
            .unwrap()
    };
    assert_ne!(
        sum(&helm_template(&[])),
        sum(&helm_template(&["--set", "dataplane=userspace"]))
    );

    // A cluster without kube-proxy: the API server's address is given to both workloads.
    let direct = helm_template(&[
        "--set",
        "controller.enabled=true",
        "--set",
        "apiServer.host=198.18.0.1",
        "--set",
        "apiServer.port=6443",
    ]);
    for o in objects(&direct)
        .iter()
        .filter(|o| o["kind"] == "DaemonSet" || o["kind"] == "Deployment")
    {
        let env = o["spec"]["template"]["spec"]["containers"][0]["env"].to_string();
        assert!(
            env.contains(r#"{"name":"KUBERNETES_SERVICE_HOST","value":"198.18.0.1"}"#)
                && env.contains(r#"{"name":"KUBERNETES_SERVICE_PORT","value":"6443"}"#),
            "{} {env}",
            o["kind"]
        );
    }
    assert!(!helm_template(&[]).contains("KUBERNETES_SERVICE_HOST"));
    let out = k(&["apply", "--dry-run=server", "-f", "-"], Some(&direct));
    assert!(out.contains("(server dry run)"), "{out}");
    let _ = Path::new("/");
}

/// The objects with our MCS controller: `kustomize/with-controller` and the chart with
/// `controller.enabled=true` render the same, the API server accepts them, and the
/// controller's roles grant what it writes and nothing more (SubjectAccessReviews).
#[test]
fn with_the_controller_kustomize_and_helm_agree_and_its_roles_are_least_privilege() {
    if !prerequisites() {
        return;
    }
    let kustomized = run(
        Command::new(kubectl())
            .arg("kustomize")
            .arg(mcs_deploy::dir().join("kustomize/with-controller")),
        None,
    );
    let helmed = helm_template(&["--set", "controller.enabled=true"]);
    let (mut a, mut b) = (objects(&kustomized), objects(&helmed));
    strip_config_checksums(&mut b);
    for o in &mut a {
        if o["kind"] == "ConfigMap" {
            o["data"]["MCS_CLUSTERSET_IP_CIDR"] = TEST_CIDRS.into();
        }
    }
    assert_eq!(a.len(), b.len(), "object counts differ");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            x, y,
            "kustomize and helm differ for {} {}",
            x["kind"], x["metadata"]["name"]
        );
    }
    assert!(
        a.iter()
            .any(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "mcs-controller")
    );
    // The default chart has no controller.
    assert!(!helm_template(&[]).contains("mcs-controller"));

    let (kc, k) = admin_kubectl();
    let out = k(&["apply", "--dry-run=server", "-f", "-"], Some(&helmed));
    assert!(
        out.contains("deployment.apps/mcs-controller created (server dry run)"),
        "{out}"
    );
    // Apply the roles for real and ask the API server what they allow.
    for f in ["controller-rbac.yaml", "controller-reader.yaml"] {
        k(
            &[
                "apply",
                "-f",
                &mcs_deploy::dir()
                    .join("kustomize/with-controller")
                    .join(f)
                    .display()
                    .to_string(),
            ],
            None,
        );
    }
    let can = |who: &str, verb: &str, resource: &str, ns: &str| -> bool {
        let (resource, sub) = match resource.split_once('/') {
            Some((r, s)) => (r, Some(s)),
            None => (resource, None),
        };
        let mut args = vec![
            "auth",
            "can-i",
            verb,
            resource,
            "--as",
            who,
            "--as-group",
            "system:serviceaccounts",
        ];
        if !ns.is_empty() {
            args.extend(["-n", ns]);
        }
        if let Some(sub) = sub {
            args.extend(["--subresource", sub]);
        }
        let out = Command::new(kubectl())
            .arg("--kubeconfig")
            .arg(&kc)
            .args(&args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    let ctl = "system:serviceaccount:mcs-system:mcs-controller";
    for (verb, res, ns, want) in [
        (
            "create",
            "serviceimports.multicluster.x-k8s.io",
            "shop",
            true,
        ),
        (
            "delete",
            "serviceimports.multicluster.x-k8s.io",
            "shop",
            true,
        ),
        (
            "patch",
            "serviceimports.multicluster.x-k8s.io/status",
            "shop",
            true,
        ),
        (
            "patch",
            "serviceexports.multicluster.x-k8s.io/status",
            "shop",
            true,
        ),
        (
            "watch",
            "serviceexports.multicluster.x-k8s.io",
            "shop",
            true,
        ),
        (
            "update",
            "serviceexports.multicluster.x-k8s.io",
            "shop",
            false,
        ),
        ("create", "endpointslices.discovery.k8s.io", "shop", true),
        ("watch", "services", "shop", true),
        ("update", "services", "shop", false),
        ("create", "pods", "shop", false),
        ("get", "secrets", "mcs-system", false),
        ("update", "leases.coordination.k8s.io", "mcs-system", true),
        ("update", "leases.coordination.k8s.io", "kube-system", false),
    ] {
        assert_eq!(
            can(ctl, verb, res, ns),
            want,
            "mcs-controller {verb} {res} in {ns}"
        );
    }
    // Another cluster's controller reads here, and writes nothing.
    let reader = "system:serviceaccount:mcs-system:mcs-controller-reader";
    for (verb, res, want) in [
        ("list", "serviceexports.multicluster.x-k8s.io", true),
        ("watch", "services", true),
        ("watch", "endpointslices.discovery.k8s.io", true),
        ("create", "serviceimports.multicluster.x-k8s.io", false),
        ("create", "endpointslices.discovery.k8s.io", false),
        (
            "patch",
            "serviceexports.multicluster.x-k8s.io/status",
            false,
        ),
        ("get", "secrets", false),
    ] {
        assert_eq!(can(reader, verb, res, "shop"), want, "reader {verb} {res}");
    }
}

/// DNS objects: Service mcs-dns in front of every agent's DNS port (on by default, off with
/// `dns.enabled=false`); the AKS `coredns-custom` ConfigMap rendered by the chart equals the
/// shipped snippet with the address filled in, needs `dns.clusterIP`, and the API server
/// accepts it and the fixed ClusterIP.
#[test]
fn dns_service_and_the_aks_coredns_custom_snippet() {
    if !prerequisites() {
        return;
    }
    let default = objects(&helm_template(&[]));
    let svc = default
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "mcs-dns")
        .expect("Service mcs-dns");
    let ports: Vec<(&str, i64, i64)> = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["protocol"].as_str().unwrap(),
                p["port"].as_i64().unwrap(),
                p["targetPort"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(ports, [("UDP", 53, 10053), ("TCP", 53, 10053)]);
    let ds = default.iter().find(|o| o["kind"] == "DaemonSet").unwrap();
    let env = ds["spec"]["template"]["spec"]["containers"][0]["env"].to_string();
    // Every node address (both families on a dual-stack node) at the DNS port.
    assert!(
        env.contains(r#"{"name":"MCS_DNS_LISTEN_IPS","valueFrom":{"fieldRef":{"fieldPath":"status.podIPs"}}}"#)
            && env.contains(r#"{"name":"MCS_DNS_PORT","value":"10053"}"#),
        "{env}"
    );
    assert_eq!(svc["spec"]["ipFamilyPolicy"], "PreferDualStack");
    let single = objects(&helm_template(&["--set", "dns.ipFamilyPolicy=SingleStack"]));
    let svc1 = single
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "mcs-dns")
        .unwrap();
    assert_eq!(svc1["spec"]["ipFamilyPolicy"], "SingleStack");

    let off = helm_template(&["--set", "dns.enabled=false"]);
    assert!(
        !off.contains("mcs-dns") && !off.contains("MCS_DNS_LISTEN"),
        "{off}"
    );

    let out = Command::new("helm")
        .args(["template", "mcs"])
        .arg(mcs_deploy::dir().join("helm/mcs-dataplane"))
        .args([
            "--set",
            "clustersetIPCIDRs={198.18.100.0/24}",
            "--set",
            "dns.aksCorednsCustom=true",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs dns.clusterIP"));

    let ip = "198.19.224.53";
    let aks = helm_template(&[
        "--set",
        "dns.aksCorednsCustom=true",
        "--set",
        &format!("dns.clusterIP={ip}"),
    ]);
    let rendered = objects(&aks)
        .into_iter()
        .find(|o| o["metadata"]["name"] == "coredns-custom")
        .expect("the coredns-custom ConfigMap");
    let shipped = std::fs::read_to_string(mcs_deploy::dir().join("dns/aks-coredns-custom.yaml"))
        .unwrap()
        .replace("MCS_DNS_IP", ip);
    assert_eq!(
        rendered,
        objects(&shipped)[0],
        "chart and deploy/dns/ differ"
    );
    assert!(
        rendered["data"]["mcs-dataplane.server"]
            .as_str()
            .unwrap()
            .contains(&format!("forward . {ip}"))
    );
    let (_, k) = admin_kubectl();
    let out = k(&["apply", "--dry-run=server", "-f", "-"], Some(&aks));
    assert!(
        out.contains("service/mcs-dns created (server dry run)")
            && out.contains("configmap/coredns-custom created (server dry run)"),
        "{out}"
    );
}
