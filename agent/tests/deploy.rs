//! What an operator applies, checked against a real kube-apiserver: the kustomize base and the
//! Helm chart (rendered by real `kubectl kustomize` and `helm template`) render the same
//! objects, and the apiserver accepts them (`kubectl apply --dry-run=server`), as well as the
//! CRDs and a chart rendered with non-default values.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use mcs_test_support::{
    apiserver::{self, User},
    prereq, require,
};

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn kubectl() -> PathBuf {
    apiserver::find_kube_binary("kubectl").expect("kubectl")
}

fn run(cmd: &mut Command, stdin: Option<&str>) -> String {
    use std::io::Write as _;
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Objects of a multi-document YAML, sorted by (kind, namespace, name).
fn objects(yaml: &str) -> Vec<serde_json::Value> {
    let mut v: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(yaml)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &serde_json::Value| !v.is_null())
        .collect();
    let key = |o: &serde_json::Value| {
        (
            o["kind"].as_str().unwrap_or_default().to_string(),
            o["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    v.sort_by_key(key);
    v
}

fn prerequisites() -> bool {
    require(prereq::all([
        apiserver::prerequisites(),
        prereq::program("helm"),
        apiserver::find_kube_binary("kubectl")
            .map(|_| ())
            .ok_or_else(|| "kubectl not found".to_string()),
    ]))
}

/// The ClusterSetIP ranges the chart is rendered with.
const TEST_CIDRS: &str = "198.18.100.0/24,2001:2::100:0/112";

fn helm_template(extra: &[&str]) -> String {
    run(
        Command::new("helm")
            .args([
                "template",
                "mcs",
                &deploy().join("helm/mcs-dataplane").display().to_string(),
                "--set",
                "clustersetIPCIDRs={198.18.100.0/24,2001:2::100:0/112}",
            ])
            .args(extra),
        None,
    )
}

#[test]
fn kustomize_base_and_helm_chart_render_the_same_objects() {
    if !prerequisites() {
        return;
    }
    let kustomized = run(
        Command::new(kubectl())
            .arg("kustomize")
            .arg(deploy().join("kustomize/base")),
        None,
    );
    // The ClusterSetIP range is required: the base leaves it empty (the agent refuses to
    // start so) and the chart refuses to render without it.
    let out = Command::new("helm")
        .args(["template", "mcs"])
        .arg(deploy().join("helm/mcs-dataplane"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("set clustersetIPCIDRs"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let helmed = helm_template(&[]);
    let (mut a, b) = (objects(&kustomized), objects(&helmed));
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
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "Namespace",
            "Service",
            "ServiceAccount"
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

#[test]
fn the_apiserver_accepts_crds_base_and_chart() {
    if !prerequisites() {
        return;
    }
    let api = apiserver::shared().unwrap();
    let kc = api.kubeconfig(User::Admin);
    let k = |args: &[&str], stdin: Option<&str>| {
        run(
            Command::new(kubectl())
                .arg("--kubeconfig")
                .arg(&kc)
                .args(args),
            stdin,
        )
    };
    // Namespaced objects can only be dry-run in an existing namespace.
    k(
        &[
            "apply",
            "-f",
            &deploy()
                .join("kustomize/base/namespace.yaml")
                .display()
                .to_string(),
        ],
        None,
    );
    let out = k(
        &[
            "apply",
            "--dry-run=server",
            "-k",
            &deploy().join("crds").display().to_string(),
        ],
        None,
    );
    assert_eq!(out.matches("(server dry run)").count(), 3, "{out}");
    let out = k(
        &[
            "apply",
            "--dry-run=server",
            "-k",
            &deploy().join("kustomize/base").display().to_string(),
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
        custom.contains("containerPort: 9500") && custom.contains("MCS_METRICS_ADDR: 0.0.0.0:9500")
    );
    assert!(
        custom.contains("path: /sys/fs/cgroup/unified")
            && custom.contains("mountPath: /sys/fs/cgroup/unified")
    );
    let out = k(&["apply", "--dry-run=server", "-f", "-"], Some(&custom));
    assert!(out.contains("(server dry run)"), "{out}");
    let _ = Path::new("/");
}
