//! A member whose MCS CRDs are older or change under the controller (the upgrade that made
//! peers of another implementation delete their imports, cilium/cilium#47793): a member that
//! serves ServiceExport only in v1alpha1 (upstream CRDs before v0.5) is read in v1alpha1; its
//! CRDs replaced in place by ours (v1beta1 storage), its objects migrated, `storedVersions`
//! trimmed, then v1alpha1 no longer served: the import in the other cluster is never deleted
//! nor rewritten, and an export made afterwards (read in v1beta1) is imported. Two real
//! kube-apiservers; the controller of c1 as a real process (c2 runs none: our chart refuses
//! CRDs without v1beta1).

mod common;

use common::*;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client,
    api::{DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
    discovery::ApiResource,
};
use mcs_test_support::apiserver::{self, User};

const UPSTREAM_V1ALPHA1_ONLY: &str = "v0.4.1";
const EXPORTS_CRD: &str = "serviceexports.multicluster.x-k8s.io";

/// The ServiceExport API of `version` in `client`'s cluster.
fn exports(client: &Client, version: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("multicluster.x-k8s.io", version, "ServiceExport");
    Api::namespaced_with(client.clone(), NS, &ApiResource::from_gvk(&gvk))
}

/// (uid, resourceVersion) of the import `name` in c1 and of its MCS slices, once it has
/// c2's endpoint.
async fn imported(k1: &Client, name: &str) -> (String, String, Vec<(String, String)>) {
    until(
        &format!("{name} imported in c1 with c2's endpoint"),
        || async {
            let si = get_import(k1, NS, name).await?;
            let slices = mcs_slices(k1, NS, name).await;
            let has_endpoint = slices
                .iter()
                .any(|s| s.endpoints.as_ref().is_some_and(|e| !e.is_empty()));
            has_endpoint.then(|| {
                (
                    si.metadata.uid.clone().unwrap(),
                    si.metadata.resource_version.clone().unwrap(),
                    slices
                        .iter()
                        .map(|s| {
                            (
                                s.metadata.uid.clone().unwrap(),
                                s.metadata.resource_version.clone().unwrap(),
                            )
                        })
                        .collect(),
                )
            })
        },
    )
    .await
}

#[test]
fn a_member_on_v1alpha1_crds_is_read_and_its_crd_upgrade_never_deletes_or_rewrites_an_import() {
    if !mcs_test_support::require(apiserver::prerequisites()) {
        return;
    }
    let upstream = apiserver::upstream_mcs_crds(UPSTREAM_V1ALPHA1_ONLY);
    if !mcs_test_support::require(upstream.as_ref().map(|_| ()).map_err(Clone::clone)) {
        return;
    }
    let set = ClusterSet::start_with_crds(
        &["c1", "c2"],
        false,
        &[apiserver::project_crds(), upstream.unwrap()],
    );
    let (kc, rt) = (&set.kubeconfig, &set.rt);
    let (k1, k2) = (&set.clients[0], &set.clients[1]);
    rt.block_on(async {
        let (_ctl1, port) = start_controller_with_metrics("c1", kc);
        // The version c2's exports are read in, as its metric says (1 for that one).
        let read_in = |version: &str| {
            scrape(port).and_then(|t| {
                metric(
                    &t,
                    &format!(
                        "mcs_controller_member_export_version{{cluster=\"c2\",version=\"{version}\"}}"
                    ),
                )
            }) == Some(1.0)
        };

        // c2 serves ServiceExport in v1alpha1 only: web is exported there and imported in c1.
        service_with_endpoint(k2, NS, "web", "198.18.2.2").await;
        let v1alpha1_export = obj(serde_json::json!({
            "apiVersion": "multicluster.x-k8s.io/v1alpha1", "kind": "ServiceExport",
            "metadata": { "name": "web" }
        }));
        exports(k2, "v1alpha1")
            .create(&PostParams::default(), &v1alpha1_export)
            .await
            .unwrap();
        let before = imported(k1, "web").await;
        until("c2 read in v1alpha1, by its metric", || async {
            read_in("v1alpha1").then_some(())
        })
        .await;

        // c2's CRDs replaced in place by ours: v1alpha1 and v1beta1 served, v1beta1 stored.
        apiserver::apply_crds(
            set.servers[1].kubeconfig(User::Admin),
            apiserver::project_crds(),
        )
        .await
        .unwrap();
        // Every export written again (now stored in v1beta1), then storedVersions trimmed,
        // as a storage-version migration does.
        let v1beta1 = exports(k2, "v1beta1");
        let se = until("web served in v1beta1 by c2", || async {
            v1beta1.get_opt("web").await.ok().flatten()
        })
        .await;
        v1beta1
            .replace("web", &PostParams::default(), &se)
            .await
            .unwrap();
        let crds: Api<CustomResourceDefinition> = Api::all(k2.clone());
        crds.patch_status(
            EXPORTS_CRD,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": { "storedVersions": ["v1beta1"] } })),
        )
        .await
        .unwrap();
        // Then v1alpha1 no longer served (as a release that drops it): the controller's
        // v1alpha1 watch ends with 404 and it reads v1beta1 from then on.
        apiserver::set_served(&crds, EXPORTS_CRD, "v1alpha1", false)
            .await
            .unwrap();

        // An export made now, in v1beta1 only, is imported: the controller went through the
        // upgrade and reads the new version.
        service_with_endpoint(k2, NS, "cart", "198.18.2.3").await;
        create(k2, NS, export("cart")).await;
        imported(k1, "cart").await;
        assert!(
            read_in("v1beta1") && !read_in("v1alpha1"),
            "c2 read in v1beta1 now, by its metric"
        );
        // And web's import and slices in c1 were neither deleted nor written meanwhile.
        let after = imported(k1, "web").await;
        assert_eq!(
            after, before,
            "c1's import of web (uid, resourceVersion) and its MCS slices changed across c2's CRD upgrade"
        );
    });
}
