//! Who may write MCS objects, asked of a real API server (with kube-controller-manager, whose
//! ClusterRole aggregation folds our roles into the built-in ones): the shipped roles
//! (`deploy/kustomize/base/user-roles.yaml`) let a namespace's admins and editors export and
//! its viewers read, and nobody else; the shipped admission policy
//! (`deploy/kustomize/with-controller/admission-policy.yaml`) refuses every ServiceImport and
//! MCS EndpointSlice write but the MCS controller's, with a reason, even for an editor who
//! may write EndpointSlices and for cluster admins, while plain EndpointSlices and the
//! namespace controller's clean-up pass; and the MCS controller writes no EndpointSlice but
//! its own; and in the chart's namespace the pod proxy reaches only the metrics ports.

use std::{
    path::Path,
    process::Output,
    time::{Duration, Instant},
};

use mcs_test_support::{
    apiserver::{self, ApiServer, User},
    kubectl::Kubectl,
};

const NS: &str = "shop";
const CONTROLLER: &str = "system:serviceaccount:mcs-system:mcs-controller";

/// The admin's kubectl, with what this test asks of it.
struct Admin(Kubectl);

impl Admin {
    fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        self.0.run(args, stdin).expect("kubectl")
    }

    /// Runs and insists on success.
    fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        self.0.ok(args, stdin).unwrap()
    }

    fn apply_file(&self, path: &Path) {
        self.ok(&["apply", "-f", &path.display().to_string()], None);
    }

    /// `resource` may name a subresource: `serviceexports.multicluster.x-k8s.io/status`.
    fn can(&self, who: &str, verb: &str, resource: &str) -> bool {
        let mut args = vec!["auth", "can-i", verb, "--as", who, "-n", NS];
        match resource.split_once('/') {
            Some((r, sub)) => args.extend([r, "--subresource", sub]),
            None => args.push(resource),
        }
        let out = self.run(&args, None);
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    }

    /// `kubectl create -f -` of `yaml` as `who`: Ok, or Err(stderr).
    fn create_as(&self, who: &str, yaml: &str) -> Result<(), String> {
        let out = self.run(&["create", "-f", "-", "--as", who], Some(yaml));
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn slice(name: &str, mcs: bool) -> String {
    let labels = if mcs {
        "multicluster.kubernetes.io/service-name: web\n    multicluster.kubernetes.io/source-cluster: c2\n    endpointslice.kubernetes.io/managed-by: mcs-controller.mcs-dataplane"
    } else {
        "kubernetes.io/service-name: web\n    endpointslice.kubernetes.io/managed-by: hand"
    };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {NS}\n  labels:\n    {labels}\naddressType: IPv4\nendpoints: [{{ addresses: [\"198.18.2.2\"] }}]\n"
    )
}

fn import(name: &str) -> String {
    format!(
        "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {{ name: {name}, namespace: {NS} }}\nspec: {{ type: ClusterSetIP, ips: [\"198.18.100.9\"], ports: [{{ port: 80 }}] }}\n"
    )
}

#[test]
fn roles_let_editors_export_and_viewers_read_and_only_the_controller_writes_imports() {
    if !mcs_test_support::require(mcs_test_support::prereq::all([
        apiserver::controller_manager_prerequisites(),
        apiserver::find_kube_binary("kubectl")
            .map(|_| ())
            .ok_or_else(|| "kubectl not found".to_string()),
    ])) {
        return;
    }
    let mut api = ApiServer::start().expect("API server");
    api.start_controller_manager()
        .expect("kube-controller-manager");
    let k = Admin(Kubectl::new(&api.kubeconfig(User::Admin)).unwrap());
    k.ok(&["create", "namespace", NS], None);
    k.apply_file(&mcs_deploy::dir().join("kustomize/base/namespace.yaml"));
    k.apply_file(&mcs_deploy::dir().join("kustomize/base/user-roles.yaml"));
    k.apply_file(&mcs_deploy::dir().join("kustomize/with-controller/controller-rbac.yaml"));
    for (user, role) in [("alice", "admin"), ("bob", "edit"), ("carol", "view")] {
        k.ok(
            &[
                "create",
                "rolebinding",
                &format!("{user}-{role}"),
                "--clusterrole",
                role,
                "--user",
                user,
                "-n",
                NS,
            ],
            None,
        );
    }
    // Aggregation runs in kube-controller-manager: wait until it folded our rules in.
    until("the editor role to include ServiceExports", || {
        k.can("bob", "create", "serviceexports.multicluster.x-k8s.io")
    });
    until("the view role to include ServiceImports", || {
        k.can("carol", "list", "serviceimports.multicluster.x-k8s.io")
    });
    let se = "serviceexports.multicluster.x-k8s.io";
    let si = "serviceimports.multicluster.x-k8s.io";
    for (who, verb, res, want) in [
        ("alice", "create", se, true),
        ("alice", "delete", se, true),
        ("bob", "create", se, true),
        ("bob", "update", se, true),
        ("bob", "delete", se, true),
        ("bob", "get", si, true),
        ("bob", "create", si, false),
        (
            "bob",
            "patch",
            "serviceexports.multicluster.x-k8s.io/status",
            false,
        ),
        ("carol", "get", se, true),
        ("carol", "list", si, true),
        ("carol", "watch", si, true),
        ("carol", "create", se, false),
        ("carol", "delete", se, false),
        ("dave", "get", se, false),
        ("dave", "list", si, false),
        ("dave", "create", se, false),
    ] {
        assert_eq!(k.can(who, verb, res), want, "{who} {verb} {res}");
    }

    // The admission policy. Bob may write EndpointSlices (and ServiceImports) as far as RBAC
    // goes, so what stops him below is the policy alone.
    k.ok(
        &[
            "create",
            "role",
            "slice-writer",
            "--verb=create,update,patch,delete,get",
            "--resource=endpointslices.discovery.k8s.io,serviceimports.multicluster.x-k8s.io",
            "-n",
            NS,
        ],
        None,
    );
    k.ok(
        &[
            "create",
            "rolebinding",
            "bob-slices",
            "--role",
            "slice-writer",
            "--user",
            "bob",
            "-n",
            NS,
        ],
        None,
    );
    k.apply_file(&mcs_deploy::dir().join("kustomize/with-controller/admission-policy.yaml"));
    // The policy takes effect when the API server has compiled it: poll with a probe.
    let mut probe = 0;
    until("the admission policy to refuse an MCS slice", || {
        probe += 1;
        match k.create_as("bob", &slice(&format!("probe-{probe}"), true)) {
            Ok(()) => false,
            Err(e) => e.contains("only the MCS controller"),
        }
    });
    let err = k.create_as("bob", &slice("bobs-mcs", true)).unwrap_err();
    assert!(
        err.contains("only the MCS controller may create endpointslices") && err.contains("bob"),
        "{err}"
    );
    k.create_as("bob", &slice("bobs-plain", false))
        .expect("a plain EndpointSlice passes the policy");
    let err = k.create_as("bob", &import("bobs")).unwrap_err();
    assert!(err.contains("serviceimports"), "{err}");
    // Cluster admins too: the policy is not RBAC.
    let admin = User::Admin.name();
    assert!(k.create_as(admin, &import("admins")).is_err());
    // The controller may.
    k.create_as(CONTROLLER, &slice("controllers", true))
        .expect("the controller writes MCS slices");
    k.create_as(CONTROLLER, &import("controllers"))
        .expect("the controller writes ServiceImports");
    // And only those: its token cannot write, take over or delete a Service's own slices
    // (issue 52: a stolen token could have repointed kube-dns, exported ClusterSet-wide).
    let own = "the MCS controller writes only its own EndpointSlices";
    let err = k
        .create_as(CONTROLLER, &slice("controllers-plain", false))
        .unwrap_err();
    assert!(err.contains(own), "{err}");
    let foreign = slice("controllers-foreign", true).replace(
        "managed-by: mcs-controller.mcs-dataplane",
        "managed-by: someone-else",
    );
    let err = k.create_as(CONTROLLER, &foreign).unwrap_err();
    assert!(err.contains(own), "{err}");
    let out = k.run(
        &[
            "delete",
            "endpointslice",
            "bobs-plain",
            "-n",
            NS,
            "--as",
            CONTROLLER,
        ],
        None,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(own));
    // Bob cannot delete the controller's slice; the namespace controller (namespace
    // clean-up) can.
    let out = k.run(
        &[
            "delete",
            "endpointslice",
            "controllers",
            "-n",
            NS,
            "--as",
            "bob",
        ],
        None,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("only the MCS controller may delete"));
    k.ok(
        &[
            "delete",
            "endpointslice",
            "controllers",
            "-n",
            NS,
            "--as",
            "system:serviceaccount:kube-system:namespace-controller",
        ],
        None,
    );

    // The pod proxy in the chart's namespace reaches only the metrics ports (the agents are
    // on the host network: a proxy to any port of theirs is one to any port of the node).
    // Admission comes before the pod is looked up, so no pod is needed: a refused port is
    // refused by the policy, an allowed one gets as far as "not found".
    k.apply_file(&mcs_deploy::dir().join("kustomize/base/proxy-policy.yaml"));
    let proxy = |port: u16| {
        let path = format!("/api/v1/namespaces/mcs-system/pods/mcs-agent-x:{port}/proxy/status");
        // As the cluster admin itself (RBAC lets it; the policy is what refuses).
        let out = k.run(&["get", "--raw", &path], None);
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let refused = "the pod proxy reaches only the metrics ports";
    until("the proxy policy to refuse port 22", || {
        proxy(22).contains(refused)
    });
    for port in [22, 10250, 2379, 6443] {
        let err = proxy(port);
        assert!(
            err.contains(refused) && err.contains(&format!("mcs-agent-x:{port}")),
            "{err}"
        );
    }
    for port in [9464, 9465] {
        let err = proxy(port);
        assert!(
            !err.contains(refused) && err.contains("not found"),
            "{port}: {err}"
        );
    }
}
