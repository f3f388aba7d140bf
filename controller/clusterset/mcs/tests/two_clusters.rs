//! The MCS controller as a real process in each of two clusters (two real kube-apiservers with
//! their etcd), each reading both and writing only its own: export → import in both; the
//! exporting cluster's EndpointSlices mirrored as MCS slices; conflicts on both exports; the
//! ClusterSetIP kept across a restart with nothing rewritten; ExternalName refused;
//! unexport → gone in both; leader failover; a member down past the timeout.
//!
//! These clusters run no kube-controller-manager, so the tests write a Service's EndpointSlice
//! themselves, labelled as the EndpointSlice controller labels them, to control every field
//! (`three_clusters.rs` uses the EndpointSlice controller's own slices of real pods).

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams},
};
use mcs_api::ServiceExport;
use mcs_test_support::apiserver;

#[test]
fn two_clusters_export_import_conflict_restart_and_unexport() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let set = ClusterSet::start(&["c1", "c2"], false);
    let (kc, rt) = (&set.kubeconfig, &set.rt);
    let (k1, k2) = (&set.clients[0], &set.clients[1]);
    rt.block_on(async {
        let ns = NS;
        let mut ctl1 = start_controller("c1", kc);
        let _ctl2 = start_controller("c2", kc);

        // c2 exports web, with one EndpointSlice as the EndpointSlice controller writes it.
        create(
            k2,
            ns,
            service(
                "web",
                serde_json::json!([{ "name": "http", "port": 80, "targetPort": 8080 }]),
            ),
        )
        .await;
        create(
            k2,
            ns,
            obj::<EndpointSlice>(serde_json::json!({
                "metadata": { "name": "web-abcde", "labels": {
                    "kubernetes.io/service-name": "web",
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" } },
                "addressType": "IPv4",
                "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
                "endpoints": [{ "addresses": ["198.18.2.2"], "conditions": { "ready": true } },
                              { "addresses": ["198.18.2.3"], "conditions": { "ready": false } }]
            })),
        )
        .await;
        create(k2, ns, export("web")).await;

        // The import appears in both clusters, with a ClusterSetIP from the range.
        for (cluster, k) in [("c1", &k1), ("c2", &k2)] {
            let si = until(&format!("ServiceImport in {cluster}"), || async {
                get_import(k, ns, "web")
                    .await
                    .filter(|si| !si.spec.ips.is_empty())
            })
            .await;
            assert_eq!(si.spec.type_, mcs_api::ServiceImportType::ClusterSetIP);
            assert_eq!(si.spec.ports.len(), 1);
            assert_eq!(si.spec.ports[0].port, 80);
            assert_eq!(si.spec.ports[0].name.as_deref(), Some("http"));
            assert_eq!(si.spec.ports[0].app_protocol, None);
            assert_eq!(si.spec.session_affinity.as_deref(), Some("ClientIP"));
            assert_eq!(si.spec.ip_families, ["IPv4"]);
            let ip: std::net::IpAddr = si.spec.ips[0].parse().unwrap();
            assert!(ip.to_string().starts_with("198.18.100."), "{ip}");
            let status = si.status.as_ref().unwrap();
            // What Gateway API implementations read: the endpoints are MCS EndpointSlices.
            assert_eq!(
                status.endpoint_slice_objects,
                Some(mcs_api::EndpointSliceObjects::Present)
            );
            assert_eq!(
                status
                    .clusters
                    .iter()
                    .map(|c| c.cluster.as_str())
                    .collect::<Vec<_>>(),
                ["c2"]
            );
            let ready = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .expect("the import's Ready condition");
            assert_eq!(
                (ready.status.as_str(), ready.reason.as_str()),
                ("True", "Ready")
            );
        }
        // The slice is mirrored into both clusters as c2's MCS slice.
        for k in [&k1, &k2] {
            let s = until("the MCS slice", || async {
                mcs_slices(k, ns, "web").await.into_iter().next()
            })
            .await;
            let labels = s.metadata.labels.clone().unwrap();
            assert_eq!(labels["multicluster.kubernetes.io/source-cluster"], "c2");
            assert_eq!(
                labels["endpointslice.kubernetes.io/managed-by"],
                mcs_controller::MANAGER
            );
            assert!(!labels.contains_key("kubernetes.io/service-name"));
            // Where the endpoints came from travels with them (issue 32): computed from a
            // selector by Kubernetes' EndpointSlice controller, so agents use them.
            assert_eq!(
                labels["multicluster.x-k8s.io/source-managed-by"],
                "endpointslice-controller.k8s.io"
            );
            let eps = s.endpoints.clone().unwrap();
            assert_eq!(eps.len(), 2);
            assert_eq!(eps[1].conditions.as_ref().unwrap().ready, Some(false));
            assert_eq!(s.ports.as_ref().unwrap()[0].port, Some(8080));
        }
        let ses2: Api<ServiceExport> = Api::namespaced(k2.clone(), ns);
        let se = until("c2's export conditions", || async {
            ses2.get("web")
                .await
                .ok()
                .filter(|se| condition(se, "Conflict").is_some())
        })
        .await;
        assert_eq!(
            condition(&se, "Valid").unwrap(),
            ("True".into(), "Valid".into())
        );
        assert_eq!(
            condition(&se, "Conflict").unwrap(),
            ("False".into(), "NoConflicts".into())
        );

        // c1 exports it too, later, with another port: the union, and a conflict on both.
        tokio::time::sleep(Duration::from_millis(1100)).await; // a later creationTimestamp (1 s)
        create(
            k1,
            ns,
            service(
                "web",
                serde_json::json!([{ "name": "http", "port": 80, "targetPort": 8080 },
                                   { "name": "admin", "port": 9000 }]),
            ),
        )
        .await;
        create(k1, ns, export("web")).await;
        let ses1: Api<ServiceExport> = Api::namespaced(k1.clone(), ns);
        for (cluster, api) in [("c1", &ses1), ("c2", &ses2)] {
            let se = until(&format!("Conflict on {cluster}"), || async {
                api.get("web")
                    .await
                    .ok()
                    .filter(|se| condition(se, "Conflict").is_some_and(|c| c.0 == "True"))
            })
            .await;
            assert_eq!(condition(&se, "Conflict").unwrap().1, "PortConflict");
        }
        let si = until("the port union", || async {
            get_import(k1, ns, "web")
                .await
                .filter(|si| si.spec.ports.len() == 2)
        })
        .await;
        let ip_before = si.spec.ips.clone();
        assert_eq!(
            si.status
                .unwrap()
                .clusters
                .iter()
                .map(|c| c.cluster.clone())
                .collect::<Vec<_>>(),
            ["c1", "c2"]
        );

        // A restart keeps the ClusterSetIP and rewrites nothing.
        let rv = get_import(k1, ns, "web")
            .await
            .unwrap()
            .metadata
            .resource_version;
        drop(ctl1);
        ctl1 = start_controller("c1", kc);
        // Poll with a deadline until the restarted controller has done a pass (its metrics
        // are on a random port, so watch for the ready condition of a new export instead).
        create(k1, ns, service("probe", serde_json::json!([{ "port": 7 }]))).await;
        create(k1, ns, export("probe")).await;
        until("the restarted controller's first pass", || async {
            get_import(k1, ns, "probe").await
        })
        .await;
        let si = get_import(k1, ns, "web").await.unwrap();
        assert_eq!(
            si.spec.ips, ip_before,
            "the ClusterSetIP changed across a restart"
        );
        assert_eq!(
            si.metadata.resource_version, rv,
            "a restart rewrote an unchanged import"
        );
        // The two imports have different addresses.
        let probe = get_import(k1, ns, "probe").await.unwrap();
        assert_ne!(probe.spec.ips, si.spec.ips);

        // ExternalName: Valid=False and no import.
        create(
            k1,
            ns,
            obj::<Service>(serde_json::json!({
                "metadata": { "name": "ext" },
                "spec": { "type": "ExternalName", "externalName": "example.invalid" }
            })),
        )
        .await;
        create(k1, ns, export("ext")).await;
        let se = until("ExternalName refused", || async {
            ses1.get("ext")
                .await
                .ok()
                .filter(|se| condition(se, "Valid").is_some())
        })
        .await;
        assert_eq!(
            condition(&se, "Valid").unwrap(),
            ("False".into(), "InvalidServiceType".into())
        );
        assert!(get_import(k1, ns, "ext").await.is_none());
        // ...and an Event on the export says why.
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(k1.clone(), ns);
        let ev = until("a Warning Event on the ExternalName export", || async {
            events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("ext"))
        })
        .await;
        assert_eq!(ev.reason.as_deref(), Some("InvalidServiceType"));
        assert_eq!(ev.type_.as_deref(), Some("Warning"));
        assert!(ev.note.unwrap_or_default().contains("ExternalName"));

        // An export from kube-system (refused by default): Valid=False, no import anywhere.
        create(
            k2,
            "kube-system",
            service("sys", serde_json::json!([{ "port": 53 }])),
        )
        .await;
        create(k2, "kube-system", export("sys")).await;
        let sys: Api<ServiceExport> = Api::namespaced(k2.clone(), "kube-system");
        let se = until("the kube-system export refused", || async {
            sys.get("sys")
                .await
                .ok()
                .filter(|se| condition(se, "Valid").is_some())
        })
        .await;
        assert_eq!(
            condition(&se, "Valid").unwrap(),
            ("False".into(), "NamespaceNotAllowed".into())
        );
        for k in [&k1, &k2] {
            assert!(get_import(k, "kube-system", "sys").await.is_none());
        }

        // Unexport everywhere: gone in both clusters, slices too.
        for api in [&ses1, &ses2] {
            api.delete("web", &DeleteParams::default()).await.unwrap();
        }
        for k in [&k1, &k2] {
            until("the import gone", || async {
                get_import(k, ns, "web").await.is_none().then_some(())
            })
            .await;
            until("the slices gone", || async {
                mcs_slices(k, ns, "web").await.is_empty().then_some(())
            })
            .await;
        }
        drop(ctl1);
    });
}

/// Writes c2's `web` (Service, one EndpointSlice, ServiceExport) in namespace `ns`.
async fn export_web(k2: &Client, ns: &str, name: &str) {
    service_with_endpoint(k2, ns, name, "198.18.2.2").await;
    create(k2, ns, export(name)).await;
}

/// Two replicas in c1 elect one leader through a Lease; killing it hands over to the other.
/// A member (c2) whose API server stays down past `--member-timeout-secs` has its endpoints
/// withdrawn from c1 (the import stays, from its last known export) and restored when it is
/// back.
#[test]
fn leader_failover_and_a_member_down_past_the_timeout() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let mut set = ClusterSet::start(&["c1", "c2"], false);
    let (kc, ns) = (set.kubeconfig.clone(), NS);
    let (k1, k2) = (set.clients[0].clone(), set.clients[1].clone());
    let replica = |identity: &str| {
        start_controller_with(
            "c1",
            &kc,
            &[
                "--identity",
                identity,
                "--lease-namespace",
                "default",
                "--lease-secs",
                "3",
                "--member-timeout-secs",
                "3",
            ],
        )
    };
    let mut replicas = vec![Some(replica("r1")), Some(replica("r2"))];
    let _ctl2 = start_controller("c2", &kc);
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(k1.clone(), "default");
    set.rt.block_on(async {
        export_web(&k2, ns, "web").await;
        until("web imported into c1", || async {
            get_import(&k1, ns, "web").await
        })
        .await;
        let holder = until("a lease holder", || async {
            leases
                .get_opt("mcs-controller")
                .await
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
        })
        .await;
        // Kill the leader; the other takes over and handles a new export.
        let idx = if holder == "r1" { 0 } else { 1 };
        replicas[idx] = None;
        export_web(&k2, ns, "web2").await;
        until("web2 imported by the new leader", || async {
            get_import(&k1, ns, "web2").await
        })
        .await;
        let now = leases.get("mcs-controller").await.unwrap();
        let spec = now.spec.unwrap();
        assert_ne!(spec.holder_identity.as_deref(), Some(holder.as_str()));
        assert_eq!(spec.lease_transitions, Some(1));
        until("c2's slices in c1", || async {
            (mcs_slices(&k1, ns, "web").await.len() == 1).then_some(())
        })
        .await;
    });

    // c2's API server goes away: past the timeout its endpoints are withdrawn in c1.
    set.servers[1].stop_apiserver();
    set.rt.block_on(async {
        until("c2's slices withdrawn", || async {
            mcs_slices(&k1, ns, "web").await.is_empty().then_some(())
        })
        .await;
        assert!(
            get_import(&k1, ns, "web").await.is_some(),
            "the import must stay while its exporter is unreachable"
        );
        // And the import says why.
        let (reason, message) = until("web says c2 does not answer", || async {
            let c = reachable(&get_import(&k1, ns, "web").await?)?;
            (c.status == "False").then_some((c.reason, c.message))
        })
        .await;
        assert_eq!(reason, "ClusterUnreachable");
        assert_eq!(
            message,
            "cluster c2 does not answer: its endpoints are withdrawn (member timeout passed)"
        );
    });
    set.servers[1].restart().unwrap();
    set.rt.block_on(async {
        until("c2's slices back", || async {
            (mcs_slices(&k1, ns, "web").await.len() == 1).then_some(())
        })
        .await;
        until("web says every exporting cluster answers", || async {
            let c = reachable(&get_import(&k1, ns, "web").await?)?;
            (c.status == "True").then_some(())
        })
        .await;
    });
    drop(replicas);
}

/// The import's `ClustersReachable` condition.
fn reachable(
    si: &mcs_api::ServiceImport,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    si.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "ClustersReachable")
        .cloned()
}
