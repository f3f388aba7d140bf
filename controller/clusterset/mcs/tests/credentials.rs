//! A member's credentials from a token file (issue 32): the controller reports a member that
//! refuses its token as unauthorized (log, `mcs_controller_member_unauthorized`, an Event on
//! its Pod), keeps going
//! for the other members, and picks up a rotated token from the file without a restart. Two
//! real kube-apiservers (with their etcd) and the controller as a real process.

mod common;

use std::time::Duration;

use common::*;
use mcs_test_support::apiserver;

#[test]
fn a_refused_token_is_reported_and_a_rotated_token_file_is_picked_up() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let set = ClusterSet::start(&["c1", "c2"], false);
    let (rt, ns) = (&set.rt, NS);
    let (k1, k2) = (&set.clients[0], &set.clients[1]);
    // The ClusterSet kubeconfig with c2's user reading its token from a file, which holds a
    // token c2 does not know.
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(&set.kubeconfig).unwrap();
    let marker = "- name: c2\n  user:\n    token: ";
    let at = text.find(marker).expect("c2's user in the kubeconfig") + marker.len();
    let token = text[at..].lines().next().unwrap().to_string();
    let token_file = dir.path().join("c2.token");
    std::fs::write(&token_file, "revoked-token").unwrap();
    let kubeconfig = dir.path().join("clusterset.kubeconfig");
    std::fs::write(
        &kubeconfig,
        text.replacen(
            &format!("{marker}{token}"),
            &format!(
                "- name: c2\n  user:\n    tokenFile: {}",
                token_file.display()
            ),
            1,
        ),
    )
    .unwrap();
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let _ctl1 = start_controller_env(
        "c1",
        &kubeconfig,
        &["--no-leader-election", "--metrics-addr", &metrics],
        &[("POD_NAMESPACE", ns), ("POD_NAME", "mcs-controller-0")],
    );
    let unauthorized = |v: f64| {
        move || async move {
            scrape(port)
                .and_then(|t| metric(&t, "mcs_controller_member_unauthorized{cluster=\"c2\"}"))
                .filter(|m| *m == v)
        }
    };
    rt.block_on(async {
        create(
            k2,
            ns,
            service("web", serde_json::json!([{ "name": "http", "port": 80 }])),
        )
        .await;
        create(k2, ns, export("web")).await;
        create(
            k1,
            ns,
            service("local", serde_json::json!([{ "name": "http", "port": 80 }])),
        )
        .await;
        create(k1, ns, export("local")).await;
        until("c2 reported unauthorized", unauthorized(1.0)).await;
        let up = scrape(port)
            .and_then(|t| metric(&t, "mcs_controller_member_up{cluster=\"c2\"}"))
            .unwrap();
        assert_eq!(up, 0.0);
        assert!(get_import(k1, ns, "web").await.is_none());
        // And an Event on the controller's Pod says so.
        let events: kube::Api<k8s_openapi::api::events::v1::Event> =
            kube::Api::namespaced(k1.clone(), ns);
        let ev = until("the MemberUnauthorized Event", || async {
            events
                .list(&Default::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("MemberUnauthorized"))
        })
        .await;
        let regarding = ev.regarding.unwrap();
        assert_eq!(
            (regarding.kind.as_deref(), regarding.name.as_deref()),
            (Some("Pod"), Some("mcs-controller-0"))
        );
        assert!(
            ev.note
                .unwrap()
                .contains("member cluster c2 refuses our credentials")
        );

        // Rotation: the right token written to the file is read again (kube-rs reads a token
        // file again when it is a minute old) and c2's export comes in, no restart.
        std::fs::write(&token_file, &token).unwrap();
        until_within(
            "c2 authorized again",
            Duration::from_secs(120),
            unauthorized(0.0),
        )
        .await;
        until_within(
            "c2's web imported into c1",
            Duration::from_secs(60),
            || async { get_import(k1, ns, "web").await },
        )
        .await;
        assert!(get_import(k1, ns, "local").await.is_some());
    });
}
