//! A controller reads of a member only what that member exports: the slices of a Service
//! nobody exports are never sent to it (their changes wake nothing), and only exported
//! Services are kept. Two real kube-apiservers; the controller as a real process, observed
//! through its metrics (`mcs_controller_member_objects`, `..._member_watch_objects`).

mod common;

use common::*;
use k8s_openapi::api::{core::v1::Namespace, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use mcs_api::ServiceExport;
use mcs_test_support::apiserver;

/// Services of c2 nobody exports.
const IDLE: usize = 40;

#[test]
fn a_member_s_unexported_services_and_their_slices_are_never_read() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let set = ClusterSet::start(&["c1", "c2"], false);
    let (kc, rt) = (&set.kubeconfig, &set.rt);
    let (k1, k2) = (&set.clients[0], &set.clients[1]);
    rt.block_on(async {
        // c2: IDLE Services with a slice each, nobody exports them; a Service `web` in
        // another namespace, unexported; and `web` in NS, exported.
        for i in 0..IDLE {
            service_with_endpoint(k2, NS, &format!("idle-{i}"), "198.18.2.10").await;
        }
        Api::<Namespace>::all(k2.clone())
            .create(
                &PostParams::default(),
                &obj(serde_json::json!({ "metadata": { "name": "other" } })),
            )
            .await
            .unwrap();
        service_with_endpoint(k2, "other", "web", "198.18.2.20").await;
        service_with_endpoint(k2, NS, "web", "198.18.2.2").await;
        create(k2, NS, export("web")).await;

        let (_ctl1, port) = start_controller_with_metrics("c1", kc);
        let _ctl2 = start_controller("c2", kc);

        // Imported into c1 with c2's endpoint.
        imported(k1, "web", "198.18.2.2", "web's endpoint imported into c1").await;
        let held = |kind: &str| member_metric(port, "mcs_controller_member_objects", "c2", kind);
        let received =
            |kind: &str| member_metric(port, "mcs_controller_member_watch_objects", "c2", kind);
        assert_eq!(held("Service"), 1.0, "only the exported Service is kept");
        // web's slice in NS, and the slice of the same name in `other` (the selector names
        // Services, not namespaces); none of the IDLE ones.
        let slices = held("EndpointSlice");
        assert!((2.0..=3.0).contains(&slices), "slices held of c2: {slices}");
        let before = received("EndpointSlice");
        assert!(
            (1.0..=6.0).contains(&before),
            "slices received from c2: {before}"
        );
        assert!(
            received("Service") >= (IDLE + 2) as f64,
            "Services are watched whole (kept only when exported)"
        );

        // Every unexported slice changes, then web's: when web's change is imported, the
        // watch has delivered everything before it, and nothing of the IDLE ones.
        let slices2 = Api::<EndpointSlice>::namespaced(k2.clone(), NS);
        for i in 0..IDLE {
            set_address(&slices2, &format!("idle-{i}-abcde"), "198.18.2.11").await;
        }
        set_address(&slices2, "web-abcde", "198.18.2.9").await;
        imported(
            k1,
            "web",
            "198.18.2.9",
            "web's new endpoint imported into c1",
        )
        .await;
        let after = received("EndpointSlice");
        assert!(
            after - before <= 3.0,
            "{} slice changes received from c2 for {IDLE} unexported changes and one exported",
            after - before
        );

        // A Service exported later is read by name, its slices by a new selector.
        create(k2, NS, export("idle-7")).await;
        imported(k1, "idle-7", "198.18.2.11", "idle-7 imported into c1").await;
        until("two Services held", || async {
            (held("Service") == 2.0).then_some(())
        })
        .await;

        // An export whose name no Service can have is passed on at once (NoService), and
        // never enters a selector; the others keep working.
        create(k2, NS, export("web.v2")).await;
        let exports2 = Api::<ServiceExport>::namespaced(k2.clone(), NS);
        until("web.v2 says it has no Service", || async {
            let se = exports2.get_opt("web.v2").await.ok()??;
            (condition(&se, "Valid")? == ("False".into(), "NoService".into())).then_some(())
        })
        .await;

        // Unexported: dropped; exported again: read again.
        exports2
            .delete("web", &DeleteParams::default())
            .await
            .unwrap();
        until("web's import gone from c1", || async {
            get_import(k1, NS, "web").await.is_none().then_some(())
        })
        .await;
        until("one Service held", || async {
            (held("Service") == 1.0).then_some(())
        })
        .await;
        create(k2, NS, export("web")).await;
        imported(k1, "web", "198.18.2.9", "web imported into c1 again").await;
        assert_eq!(
            member_metric(port, "mcs_controller_member_exports_held_back", "c2", ""),
            0.0
        );
    });
}

/// Waits until cluster `k`'s MCS slices of `name` hold `addr` (`what` names the wait).
async fn imported(k: &Client, name: &str, addr: &str, what: &str) {
    until(what, || async {
        endpoints(k, name)
            .await
            .iter()
            .any(|a| a == addr)
            .then_some(())
    })
    .await;
}

/// The addresses of the MCS slices of `name` in cluster `k`.
async fn endpoints(k: &Client, name: &str) -> Vec<String> {
    mcs_slices(k, NS, name)
        .await
        .into_iter()
        .flat_map(|s| s.endpoints.into_iter().flatten())
        .flat_map(|e| e.addresses)
        .collect()
}

/// Sets the one endpoint of slice `name` to `addr`.
async fn set_address(api: &Api<EndpointSlice>, name: &str, addr: &str) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({
            "endpoints": [{ "addresses": [addr], "conditions": { "ready": true } }]
        })),
    )
    .await
    .unwrap();
}

/// The value of metric `name{cluster="member"[,kind="kind"]}` (0 when absent).
fn member_metric(port: u16, name: &str, member: &str, kind: &str) -> f64 {
    let text = scrape(port).unwrap_or_default();
    let labels = if kind.is_empty() {
        format!("{{cluster=\"{member}\"}}")
    } else {
        format!("{{cluster=\"{member}\",kind=\"{kind}\"}}")
    };
    let total = format!("{name}_total{labels}");
    let plain = format!("{name}{labels}");
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(&total).or_else(|| l.strip_prefix(&plain))?;
            rest.trim().parse().ok()
        })
        .unwrap_or(0.0)
}
