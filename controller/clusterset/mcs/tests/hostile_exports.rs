//! Exports that one tenant controls must not hurt the others (issue 32): each is refused on
//! its own (`Valid=False` with a reason, or a conflict) while every other service is imported,
//! and the controller writes nothing that the API server refuses; a metadata-only
//! ServiceExport is exported like any other. Two real kube-apiservers
//! (with their etcd) and the controller as a real process in each; c2's cluster id has a dot
//! at byte 40, where the MCS slice names cut it.

mod common;

use common::*;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{Api, Client};
use mcs_api::ServiceExport;
use mcs_test_support::apiserver;

/// A ServiceExport of `name` with `spec` as given.
fn export_with(name: &str, spec: serde_json::Value) -> ServiceExport {
    obj(serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
        "metadata": { "name": name }, "spec": spec
    }))
}

/// Waits until the export `ns/name` has a `Valid` condition and returns it with `Ready`'s
/// and `Conflict`'s.
async fn conditions_of(
    k: &Client,
    ns: &str,
    name: &str,
) -> (
    (String, String),
    Option<(String, String)>,
    Option<(String, String)>,
) {
    let api: Api<ServiceExport> = Api::namespaced(k.clone(), ns);
    let se = until(&format!("conditions of {ns}/{name}"), || async {
        api.get(name)
            .await
            .ok()
            .filter(|se| condition(se, "Valid").is_some())
    })
    .await;
    (
        condition(&se, "Valid").unwrap(),
        condition(&se, "Ready"),
        condition(&se, "Conflict"),
    )
}

#[test]
fn hostile_exports_are_refused_alone_and_nothing_is_retried_forever() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let c2_id = format!("{}.east", "a".repeat(39));
    let set = ClusterSet::start(&["c1", &c2_id], false);
    let (kc, rt, ns) = (&set.kubeconfig, &set.rt, NS);
    let (k1, k2) = (&set.clients[0], &set.clients[1]);
    let port1 = free_port();
    let metrics1 = format!("127.0.0.1:{port1}");
    // c1's controller exports slices no selector computed (its copies say so); c2's, as by
    // default, withholds them.
    let _ctl1 = start_controller_with(
        "c1",
        kc,
        &[
            "--no-leader-election",
            "--metrics-addr",
            &metrics1,
            "--export-selectorless-slices",
        ],
    );
    let (_ctl2, port2) = start_controller_with_metrics(&c2_id, kc);
    rt.block_on(async {
        // c1: an export with more labels than a ServiceImport can carry (256 within the
        // schema's bounds, 67 KB in all; a key no label may have is refused by the schema
        // now, the controller refuses it under other CRDs), one with 300 KiB of annotations
        // (two values, each within the schema's bound), one of the API server's own Service,
        // and `many` with one port.
        for name in ["bad", "fat", "many"] {
            create(k1, ns, service(name, serde_json::json!([{ "name": "web", "port": 80 }]))).await;
        }
        let prefix = format!("{}.{}.{}.com", "a".repeat(63), "b".repeat(63), "c".repeat(63));
        let labels: serde_json::Map<String, serde_json::Value> = (0..256)
            .map(|i| (format!("{prefix}/k{i:03}"), serde_json::Value::from("v".repeat(63))))
            .collect();
        create(k1, ns, export_with("bad", serde_json::json!({ "exportedLabels": labels }))).await;
        create(k1, ns, export_with("fat", serde_json::json!({ "exportedAnnotations": { "a": "v".repeat(150 * 1024), "b": "v".repeat(150 * 1024) } }))).await;
        create(k1, ns, export("many")).await;
        create(k1, "default", export("kubernetes")).await;

        // c2, a second later: `many` with 100 other ports; `web` with a slice of Kubernetes'
        // EndpointSlice controller (written here as it would); `handmade` (a selector, but a
        // slice written by hand) and `external` (no selector, and a slice that claims the
        // EndpointSlice controller wrote it).
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await; // a later creationTimestamp (1 s)
        let hundred: Vec<serde_json::Value> = (0..100)
            .map(|i| serde_json::json!({ "name": format!("p{i}"), "port": 1000 + i }))
            .collect();
        create(k2, ns, service("many", serde_json::Value::Array(hundred))).await;
        create(k2, ns, export("many")).await;
        let http = serde_json::json!([{ "name": "http", "port": 80 }]);
        create(k2, ns, service("web", http.clone())).await;
        create(k2, ns, service("handmade", http.clone())).await;
        let mut external = service("external", http);
        external.spec.as_mut().unwrap().selector = None;
        create(k2, ns, external).await;
        for (name, manager) in [
            ("web", Some("endpointslice-controller.k8s.io")),
            ("handmade", None),
            ("external", Some("endpointslice-controller.k8s.io")),
        ] {
            let mut labels = serde_json::json!({ "kubernetes.io/service-name": name });
            if let Some(m) = manager {
                labels["endpointslice.kubernetes.io/managed-by"] = m.into();
            }
            create(
                k2,
                ns,
                obj::<EndpointSlice>(serde_json::json!({
                    "metadata": { "name": format!("{name}-abcde"), "labels": labels },
                    "addressType": "IPv4",
                    "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
                    "endpoints": [{ "addresses": ["198.18.2.2"], "conditions": { "ready": true } }]
                })),
            )
            .await;
            create(k2, ns, export(name)).await;
        }

        // Every other service works: web is imported in both clusters with c2's slice, which
        // says the EndpointSlice controller computed it.
        for k in [k1, k2] {
            until("web imported", || async { get_import(k, ns, "web").await }).await;
            let s = until("c2's MCS slice of web", || async {
                mcs_slices(k, ns, "web").await.into_iter().next()
            })
            .await;
            let labels = s.metadata.labels.unwrap();
            assert_eq!(labels["multicluster.kubernetes.io/source-cluster"], c2_id);
            assert_eq!(
                labels["multicluster.x-k8s.io/source-managed-by"],
                "endpointslice-controller.k8s.io"
            );
        }
        // The slices no selector computed: c2 withholds them (and its export of the
        // selectorless Service says why); c1, told to export them, does, and its copies say
        // `none` (agents refuse them unless --allow-selectorless-slices: mcs-model's safety
        // tests), also for the one that claims the EndpointSlice controller.
        for name in ["handmade", "external"] {
            let s = until("c1's MCS slice", || async {
                mcs_slices(k1, ns, name).await.into_iter().next()
            })
            .await;
            assert_eq!(s.metadata.labels.unwrap()["multicluster.x-k8s.io/source-managed-by"], "none", "{name}");
        }
        let text = until("c2 withholding both slices", || async {
            scrape(port2).filter(|t| metric(t, "mcs_controller_slices_withheld") == Some(2.0))
        })
        .await;
        assert_eq!(metric(&text, "mcs_controller_write_errors_total"), Some(0.0), "{text}");
        for name in ["handmade", "external"] {
            assert!(get_import(k2, ns, name).await.is_some(), "{name} is imported");
            assert!(mcs_slices(k2, ns, name).await.is_empty(), "{name} has no MCS slice in c2");
        }
        let se: Api<ServiceExport> = Api::namespaced(k2.clone(), ns);
        let external = until("external's Ready=False", || async {
            se.get("external")
                .await
                .ok()
                .filter(|se| condition(se, "Ready").is_some_and(|c| c.0 == "False"))
        })
        .await;
        assert_eq!(condition(&external, "Valid").unwrap().0, "True");
        assert_eq!(condition(&external, "Ready").unwrap().1, "SelectorlessService");
        assert_eq!(conditions_of(k2, ns, "handmade").await.1.unwrap().0, "True");

        // The hostile exports are refused, each with its reason, and imported nowhere.
        for (namespace, name, reason) in [
            (ns, "bad", "InvalidExportedLabels"),
            (ns, "fat", "InvalidExportedAnnotations"),
            ("default", "kubernetes", "ServiceNotAllowed"),
        ] {
            let (valid, ready, conflict) = conditions_of(k1, namespace, name).await;
            assert_eq!(valid, ("False".into(), reason.into()), "{namespace}/{name}");
            assert_eq!(ready.unwrap().0, "False", "{namespace}/{name}");
            assert_eq!(conflict, None);
            for k in [k1, k2] {
                assert!(get_import(k, namespace, name).await.is_none(), "{namespace}/{name}");
            }
        }

        // The younger export cannot push the import past the agents' 100 ports: the older
        // export's port is kept, and both exports say so.
        for k in [k1, k2] {
            let si = until("many imported from both clusters", || async {
                get_import(k, ns, "many")
                    .await
                    .filter(|si| si.status.as_ref().is_some_and(|s| s.clusters.len() == 2))
            })
            .await;
            assert_eq!(si.spec.ports.len(), 100);
            assert!(si.spec.ports.iter().any(|p| p.port == 80), "the older export's port");
        }
        for k in [k1, k2] {
            let (valid, _, conflict) = conditions_of(k, ns, "many").await;
            assert_eq!(valid.0, "True");
            assert_eq!(conflict, Some(("True".into(), "PortConflict".into())));
        }

        // The canonical ServiceExport, metadata only, is exported like any other.
        create(k1, ns, service("plain", serde_json::json!([{ "port": 80 }]))).await;
        let ar = kube::api::ApiResource::erase::<ServiceExport>(&());
        Api::<kube::api::DynamicObject>::namespaced_with(k1.clone(), ns, &ar)
            .create(
                &Default::default(),
                &kube::api::DynamicObject::new("plain", &ar).within(ns),
            )
            .await
            .unwrap();
        for k in [k1, k2] {
            until("the metadata-only export imported", || async {
                get_import(k, ns, "plain").await
            })
            .await;
        }
        assert_eq!(conditions_of(k1, ns, "plain").await.0.0, "True");

        // And c1's controller wrote nothing the API server refused.
        let text = until("c1's metrics", || async { scrape(port1) }).await;
        assert_eq!(metric(&text, "mcs_controller_write_errors_total"), Some(0.0), "{text}");
        assert_eq!(metric(&text, "mcs_controller_retries_waiting"), Some(0.0));
        assert_eq!(metric(&text, "mcs_controller_invalid_exports"), Some(3.0));
    });
}

/// Large objects are not kept whole: 60 ServiceExports with 1 MB of exportedAnnotations each
/// (refused: over 256 KiB) and 60 Services with 240 KiB of annotations each (not exported)
/// add less than 30 MB to the controller's resident memory (they were kept whole: 70 MB and
/// more).
#[test]
fn large_exports_and_services_are_not_kept_whole() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let set = ClusterSet::start(&["c1"], false);
    let (kc, rt, ns) = (&set.kubeconfig, &set.rt, NS);
    let k1 = &set.clients[0];
    let ctl = start_controller("c1", kc);
    rt.block_on(async {
        create(k1, ns, service("probe", serde_json::json!([{ "port": 80 }]))).await;
        create(k1, ns, export("probe")).await;
        until("the controller's first import", || async {
            get_import(k1, ns, "probe").await
        })
        .await;
        let before = ctl.rss();
        const N: usize = 60;
        let quarter = "v".repeat(250 * 1024);
        let annotations: serde_json::Map<String, serde_json::Value> = ["a", "b", "c", "d"]
            .iter()
            .map(|k| (k.to_string(), serde_json::Value::from(quarter.clone())))
            .collect();
        let service_annotations: serde_json::Map<String, serde_json::Value> =
            ["a", "b", "c", "d"]
                .iter()
                .map(|k| (k.to_string(), serde_json::Value::from("s".repeat(60 * 1024))))
                .collect();
        for i in 0..N {
            let name = format!("big{i}");
            let mut svc = service(&name, serde_json::json!([{ "port": 80 }]));
            svc.metadata.annotations = Some(obj(serde_json::Value::Object(
                service_annotations.clone(),
            )));
            create(k1, ns, svc).await;
            create(k1, ns, export_with(&name, serde_json::json!({ "exportedAnnotations": annotations }))).await;
        }
        let exports: Api<ServiceExport> = Api::namespaced(k1.clone(), ns);
        until("every large export refused", || async {
            let listed = exports.list(&Default::default()).await.ok()?;
            let refused = listed
                .items
                .iter()
                .filter(|se| condition(se, "Valid").is_some_and(|c| c.1 == "InvalidExportedAnnotations"))
                .count();
            (refused == N).then_some(())
        })
        .await;
        let grown = ctl.rss().saturating_sub(before);
        assert!(
            grown < 30 << 20,
            "the controller grew by {} MiB for {N} refused 1 MB exports and {N} Services of 240 KiB",
            grown >> 20
        );
        eprintln!("controller RSS grew by {} MiB", grown >> 20);
    });
}

/// With `--clusterset-ips-per-namespace 2`, a namespace's third import gets no ClusterSetIP
/// (its Ready and its export's Ready say why) while other namespaces still get theirs; an
/// unexport frees room and the waiting import gets an address.
#[test]
fn a_namespace_past_its_clusterset_ip_quota_gets_no_more() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let (set, _ctl) = one_cluster(&["--clusterset-ips-per-namespace", "2"]);
    let (rt, ns, k1) = (&set.rt, NS, &set.clients[0]);
    rt.block_on(async {
        for (namespace, name) in [(ns, "a"), (ns, "b"), (ns, "c"), ("default", "d")] {
            create(
                k1,
                namespace,
                service(name, serde_json::json!([{ "port": 80 }])),
            )
            .await;
            create(k1, namespace, export(name)).await;
        }
        for (namespace, name) in [(ns, "a"), (ns, "b"), ("default", "d")] {
            until(
                &format!("{namespace}/{name} with a ClusterSetIP"),
                || async {
                    get_import(k1, namespace, name)
                        .await
                        .filter(|si| si.spec.ips.len() == 1)
                },
            )
            .await;
        }
        let c = until("c's import, not ready", || async {
            get_import(k1, ns, "c").await.filter(|si| {
                si.status.as_ref().is_some_and(|s| {
                    s.conditions.iter().any(|c| {
                        c.type_ == "Ready"
                            && c.status == "False"
                            && c.reason == "ClusterSetIPQuotaExceeded"
                    })
                })
            })
        })
        .await;
        assert!(c.spec.ips.is_empty());
        let exports: Api<ServiceExport> = Api::namespaced(k1.clone(), ns);
        until("c's export not ready", || async {
            let se = exports.get("c").await.ok()?;
            (condition(&se, "Ready")? == ("False".into(), "NoClusterSetIP".into())).then_some(())
        })
        .await;
        assert_eq!(
            condition(&exports.get("a").await.unwrap(), "Ready")
                .unwrap()
                .0,
            "True"
        );

        // a unexported: its address is given back, and c gets one.
        exports.delete("a", &Default::default()).await.unwrap();
        until("c with a ClusterSetIP", || async {
            get_import(k1, ns, "c")
                .await
                .filter(|si| si.spec.ips.len() == 1)
        })
        .await;
        until_true(&exports, "c", "Ready").await;
    });
}

/// With `--exports-per-namespace 2 --exports-per-member 3`, one tenant cannot fill every
/// cluster with imports: the youngest export past a limit is refused (`Valid=False`,
/// `ExportLimitExceeded`) and imported nowhere, the older ones are untouched, and an
/// unexport makes room for the waiting one.
#[test]
fn exports_past_the_per_namespace_and_per_member_limits_are_refused() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let (set, _ctl) = one_cluster(&["--exports-per-namespace", "2", "--exports-per-member", "3"]);
    let (rt, ns, k1) = (&set.rt, NS, &set.clients[0]);
    rt.block_on(async {
        // Oldest first (one creation second: then by namespace and name): NS/a, NS/b kept,
        // NS/c past the namespace's 2; default/d kept (the member's third), then default/e
        // past the member's 3.
        for (namespace, name) in [(ns, "a"), (ns, "b"), (ns, "c"), ("default", "d")] {
            create(
                k1,
                namespace,
                service(name, serde_json::json!([{ "port": 80 }])),
            )
            .await;
            create(k1, namespace, export(name)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await; // a later creationTimestamp (1 s)
        create(
            k1,
            "default",
            service("e", serde_json::json!([{ "port": 80 }])),
        )
        .await;
        create(k1, "default", export("e")).await;
        for (namespace, name) in [(ns, "a"), (ns, "b"), ("default", "d")] {
            until(&format!("{namespace}/{name} imported"), || async {
                get_import(k1, namespace, name).await
            })
            .await;
            assert_eq!(conditions_of(k1, namespace, name).await.0.0, "True");
        }
        for (namespace, name) in [(ns, "c"), ("default", "e")] {
            let (valid, _, _) = conditions_of(k1, namespace, name).await;
            assert_eq!(
                valid,
                ("False".into(), "ExportLimitExceeded".into()),
                "{namespace}/{name}"
            );
            assert!(
                get_import(k1, namespace, name).await.is_none(),
                "{namespace}/{name}"
            );
        }

        // a unexported: c (older than e) takes its place; e stays refused (the member holds
        // b, c, d).
        let exports: Api<ServiceExport> = Api::namespaced(k1.clone(), ns);
        exports.delete("a", &Default::default()).await.unwrap();
        until("c imported", || async { get_import(k1, ns, "c").await }).await;
        until_true(&exports, "c", "Valid").await;
        let (valid, _, _) = conditions_of(k1, "default", "e").await;
        assert_eq!(valid.1, "ExportLimitExceeded");
        assert!(get_import(k1, "default", "e").await.is_none());
    });
}

/// One namespace's exported labels and annotations are kept up to
/// `--exported-metadata-bytes-per-namespace`: an export past it is still imported, without
/// them, and says so (`Valid=True`, reason `ExportedMetadataOverBudget`), while the others are
/// imported with theirs; it is read again and imported with its annotations once another
/// export of its namespace goes.
#[test]
fn exported_metadata_past_the_namespace_budget_is_dropped_until_room_frees() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let (set, _ctl) = one_cluster(&["--exported-metadata-bytes-per-namespace", "300000"]);
    let (rt, ns, k1) = (&set.rt, NS, &set.clients[0]);
    let big = |name: &str| {
        export_with(
            name,
            serde_json::json!({ "exportedAnnotations": { "note": "n".repeat(200_000) } }),
        )
    };
    rt.block_on(async {
        for name in ["a", "b"] {
            create(k1, ns, service(name, serde_json::json!([{ "port": 80 }]))).await;
        }
        create(k1, ns, big("a")).await;
        until("a imported", || async { get_import(k1, ns, "a").await }).await;
        create(k1, ns, big("b")).await;
        let (valid, _, _) = conditions_of(k1, ns, "b").await;
        assert_eq!(valid, ("True".into(), "ExportedMetadataOverBudget".into()));
        let b = until("b imported", || async { get_import(k1, ns, "b").await }).await;
        assert!(
            !b.metadata
                .annotations
                .unwrap_or_default()
                .contains_key("note"),
            "imported without its annotations"
        );
        let a = get_import(k1, ns, "a").await.unwrap();
        assert_eq!(
            a.metadata.annotations.unwrap_or_default()["note"].len(),
            200_000,
            "the export that fits keeps its annotations"
        );

        // a goes: b fits now, is read again and imported with its annotations.
        let exports: Api<ServiceExport> = Api::namespaced(k1.clone(), ns);
        exports.delete("a", &Default::default()).await.unwrap();
        until("b imported with its annotations", || async {
            let b = get_import(k1, ns, "b").await?;
            (b.metadata
                .annotations
                .unwrap_or_default()
                .get("note")?
                .len()
                == 200_000)
                .then_some(())
        })
        .await;
        until("b's Valid reason back to Valid", || async {
            let se = exports.get("b").await.ok()?;
            (condition(&se, "Valid")? == ("True".into(), "Valid".into())).then_some(())
        })
        .await;
    });
}

/// The boundary the controller's trust in `endpointslice.kubernetes.io/managed-by` rests on:
/// a tenant bound to the built-in `edit` role in its namespace (what the threat model gives
/// it) may write Services and ServiceExports' neighbours but not EndpointSlices or
/// Endpoints (Kubernetes ≥ 1.22, CVE-2021-25740), so it cannot forge a slice that looks
/// computed by the EndpointSlice controller. Real RBAC: the `edit` role aggregated by a real
/// kube-controller-manager.
#[test]
fn a_tenant_with_edit_cannot_write_endpoint_slices() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let mut server = apiserver::ApiServer::start().expect("kube-apiserver");
    server
        .start_controller_manager()
        .expect("kube-controller-manager");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let admin = server.client().await;
        let ns = server.fresh_namespace("tenant").await;
        let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(admin.clone());
        until("the edit role aggregated", || async {
            let edit = roles.get("edit").await.ok()?;
            edit.rules?
                .iter()
                .any(|r| r.resources.iter().flatten().any(|x| x == "services"))
                .then_some(())
        })
        .await;
        let binding: k8s_openapi::api::rbac::v1::RoleBinding = obj(serde_json::json!({
            "metadata": { "name": "tenant-edit" },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                           "name": apiserver::User::Nobody.name() }]
        }));
        create(&admin, &ns, binding).await;
        let tenant = server.client_as(apiserver::User::Nobody).await;
        // It may write a Service (the binding is in force)...
        let services: Api<k8s_openapi::api::core::v1::Service> =
            Api::namespaced(tenant.clone(), &ns);
        let web = service("web", serde_json::json!([{ "port": 80 }]));
        until("the tenant creates a Service", || async {
            services.create(&Default::default(), &web).await.ok()
        })
        .await;
        // ...but no EndpointSlice claiming the EndpointSlice controller made it, and no
        // Endpoints.
        let forged: EndpointSlice = obj(serde_json::json!({
            "metadata": { "name": "web-forged", "labels": {
                "kubernetes.io/service-name": "web",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" } },
            "addressType": "IPv4",
            "endpoints": [{ "addresses": ["198.18.9.9"] }],
            "ports": [{ "port": 80 }]
        }));
        assert!(refused(
            Api::<EndpointSlice>::namespaced(tenant.clone(), &ns)
                .create(&Default::default(), &forged)
                .await
        ));
        let endpoints: k8s_openapi::api::core::v1::Endpoints = obj(serde_json::json!({
            "metadata": { "name": "web" },
            "subsets": [{ "addresses": [{ "ip": "198.18.9.9" }], "ports": [{ "port": 80 }] }]
        }));
        assert!(refused(
            Api::<k8s_openapi::api::core::v1::Endpoints>::namespaced(tenant, &ns)
                .create(&Default::default(), &endpoints)
                .await
        ));
    });
}

/// Whether `r` is the API server's 403 Forbidden.
fn refused<T>(r: Result<T, kube::Error>) -> bool {
    matches!(r, Err(kube::Error::Api(s)) if s.code == 403)
}

/// Waits until the export `name` has condition `type_` True.
async fn until_true(exports: &Api<ServiceExport>, name: &str, type_: &str) {
    until(&format!("{name}'s {type_}=True"), || async {
        let se = exports.get(name).await.ok()?;
        (condition(&se, type_)?.0 == "True").then_some(())
    })
    .await;
}

/// A one-cluster ClusterSet (c1) and its controller, run with `flags` and no leader election.
fn one_cluster(flags: &[&str]) -> (ClusterSet, Controller) {
    let set = ClusterSet::start(&["c1"], false);
    let ctl = start_controller_with(
        "c1",
        &set.kubeconfig,
        &[&["--no-leader-election"], flags].concat(),
    );
    (set, ctl)
}

/// Issue 52: the controller's metrics port takes the same bounds as the agent's (it served
/// the same code with no bound and never raised its open-files limit: 1,100 idle connections
/// took its `/healthz` down). 1,100 idle connections from 100 addresses: `/healthz` and
/// `/metrics` still answer, and the controller stays small.
#[test]
fn the_controllers_metrics_port_holds_against_idle_connections() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let port = free_port();
    let (set, ctl) = one_cluster(&["--metrics-addr", &format!("127.0.0.1:{port}")]);
    set.rt.block_on(async {
        until("/metrics answers", || async { scrape(port) }).await;
        // Raised at start, before the metrics port is served.
        let (soft, hard) = ctl.limit("Max open files");
        assert_eq!(
            soft, hard,
            "the open-files limit is raised to its hard limit"
        );
        let to: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut idle = Vec::new();
        for i in 0..1100u32 {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(format!("127.0.2.{}:0", 1 + i % 100).parse().unwrap())
                .unwrap();
            if let Ok(c) = s.connect(to).await {
                idle.push(c);
            }
        }
        let health = tokio::task::spawn_blocking(move || {
            use std::io::{Read as _, Write as _};
            let mut s = std::net::TcpStream::connect(to).ok()?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .ok()?;
            s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").ok()?;
            let mut out = String::new();
            s.read_to_string(&mut out).ok()?;
            Some(out)
        })
        .await
        .unwrap();
        assert!(
            health
                .as_deref()
                .is_some_and(|h| h.starts_with("HTTP/1.1 200")),
            "{health:?}"
        );
        assert!(scrape(port).is_some_and(|m| m.contains("mcs_controller_")));
        let rss = ctl.rss();
        assert!(rss < 128 << 20, "{} MiB", rss >> 20);
        drop(idle);
    });
}
