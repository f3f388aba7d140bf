//! Makes the local cluster hold what [`crate::desired`] says, writing only what differs
//! (server-side apply, field manager [`FIELD_MANAGER`]): ServiceImports and their status, MCS
//! EndpointSlices, ServiceExport conditions; and deleting the imports and slices of ours that
//! are no longer wanted. Creations go before the slices that refer to them; deletions of
//! slices before their import.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::discovery::v1::EndpointSlice, apimachinery::pkg::apis::meta::v1::Condition,
};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams},
};
use mcs_api::{ServiceExport, ServiceImport};
use serde_json::{Value, json};

use crate::{
    desired::{Desired, ours},
    members::{Local, Member, ObjKey},
};

/// The field manager of every write.
pub const FIELD_MANAGER: &str = "mcs-controller";

/// What one pass wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// ServiceImports created or changed (spec or status).
    pub imports: usize,
    /// ServiceImports deleted.
    pub imports_deleted: usize,
    /// EndpointSlices created or changed.
    pub slices: usize,
    /// EndpointSlices deleted.
    pub slices_deleted: usize,
    /// ServiceExport statuses written.
    pub exports: usize,
    /// Writes that failed (retried on the next pass).
    pub errors: usize,
}

impl Written {
    /// Whether anything was written or failed.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

fn apply() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// What of an import we manage, for comparison.
fn import_view(si: &ServiceImport, keys: &BTreeMap<String, String>) -> Value {
    let labels: BTreeMap<&String, Option<&String>> = keys
        .keys()
        .map(|k| (k, si.metadata.labels.as_ref().and_then(|l| l.get(k))))
        .collect();
    json!({
        "labels": labels,
        "annotations": si.metadata.annotations,
        "spec": si.spec,
        "clusters": si.status.as_ref().map(|s| &s.clusters),
    })
}

fn slice_view(es: &EndpointSlice) -> Value {
    json!({
        "labels": es.metadata.labels,
        "addressType": es.address_type,
        "endpoints": es.endpoints,
        "ports": es.ports,
    })
}

fn conditions_view(c: &[Condition]) -> Vec<(String, String, String, String, Option<i64>)> {
    let mut v: Vec<_> = c
        .iter()
        .map(|c| {
            (
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                c.message.clone(),
                c.observed_generation,
            )
        })
        .collect();
    v.sort();
    v
}

/// Writes the difference between `want` and what the local stores hold.
pub async fn sync(client: &Client, want: &Desired, local: &Local, me: &Member) -> Written {
    let mut w = Written::default();
    let have_imports = local.imports.snapshot();
    let have_slices = local.slices.snapshot();

    // Imports: create or update.
    for ((ns, name), si) in &want.imports {
        let api: Api<ServiceImport> = Api::namespaced(client.clone(), ns);
        let keys = si.metadata.labels.clone().unwrap_or_default();
        let have = have_imports.get(&(ns.clone(), name.clone()));
        if have.is_some_and(|h| import_view(h, &keys) == import_view(si, &keys)) {
            continue;
        }
        let mut body = si.clone();
        body.status = None;
        let spec_same = have.is_some_and(|h| {
            let mut h = (**h).clone();
            h.status = None;
            import_view(&h, &keys) == import_view(&body, &keys)
        });
        if !spec_same && let Err(e) = api.patch(name, &apply(), &Patch::Apply(&body)).await {
            tracing::warn!(import = %format!("{ns}/{name}"), error = %e, "writing ServiceImport");
            w.errors += 1;
            continue;
        }
        let status = json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1",
            "kind": "ServiceImport",
            "status": si.status,
        });
        match api
            .patch_status(name, &apply(), &Patch::Apply(&status))
            .await
        {
            Ok(_) => {
                w.imports += 1;
                tracing::info!(
                    import = %format!("{ns}/{name}"),
                    ips = ?si.spec.ips,
                    clusters = ?si.status.as_ref().map(|s| s.clusters.iter().map(|c| c.cluster.clone()).collect::<Vec<_>>()),
                    "ServiceImport written"
                );
            }
            Err(e) => {
                tracing::warn!(import = %format!("{ns}/{name}"), error = %e, "writing ServiceImport status");
                w.errors += 1;
            }
        }
    }

    // Slices: create or update, then delete ours that are not wanted.
    for ((ns, name), es) in &want.slices {
        if have_slices
            .get(&(ns.clone(), name.clone()))
            .is_some_and(|h| slice_view(h) == slice_view(es))
        {
            continue;
        }
        let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
        match api.patch(name, &apply(), &Patch::Apply(es)).await {
            Ok(_) => w.slices += 1,
            Err(e) => {
                tracing::warn!(slice = %format!("{ns}/{name}"), error = %e, "writing EndpointSlice");
                w.errors += 1;
            }
        }
    }
    for (ns, name) in have_slices.keys() {
        if want.slices.contains_key(&(ns.clone(), name.clone())) {
            continue;
        }
        let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => w.slices_deleted += 1,
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                tracing::warn!(slice = %format!("{ns}/{name}"), error = %e, "deleting EndpointSlice");
                w.errors += 1;
            }
        }
    }

    // Imports of ours no longer wanted.
    for ((ns, name), si) in &have_imports {
        if !ours(si) || want.imports.contains_key(&(ns.clone(), name.clone())) {
            continue;
        }
        let api: Api<ServiceImport> = Api::namespaced(client.clone(), ns);
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {
                w.imports_deleted += 1;
                tracing::info!(import = %format!("{ns}/{name}"), "ServiceImport deleted: no cluster exports it any more");
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                tracing::warn!(import = %format!("{ns}/{name}"), error = %e, "deleting ServiceImport");
                w.errors += 1;
            }
        }
    }

    // Conditions of the local exports.
    let exports = me.exports.snapshot();
    for (key, conds) in &want.export_conditions {
        let Some(se) = exports.get(key) else { continue };
        let have = se
            .status
            .as_ref()
            .map(|s| conditions_view(&s.conditions))
            .unwrap_or_default();
        if have == conditions_view(conds) {
            continue;
        }
        match write_export_status(client, key, conds).await {
            Ok(true) => w.exports += 1,
            Ok(false) => {}
            Err(()) => w.errors += 1,
        }
        if let Some(c) = conds
            .iter()
            .find(|c| c.type_ == "Valid" && c.status == "False")
        {
            tracing::warn!(export = %format!("{}/{}", key.0, key.1), reason = %c.reason, "{}", c.message);
        }
        if let Some(c) = conds
            .iter()
            .find(|c| c.type_ == "Conflict" && c.status == "True")
        {
            tracing::warn!(export = %format!("{}/{}", key.0, key.1), reason = %c.reason, "{}", c.message);
        }
    }
    w
}

/// Ok(true): written; Ok(false): the export is gone; Err: failed (logged).
async fn write_export_status(
    client: &Client,
    key: &ObjKey,
    conds: &[Condition],
) -> Result<bool, ()> {
    let api: Api<ServiceExport> = Api::namespaced(client.clone(), &key.0);
    let body = json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1",
        "kind": "ServiceExport",
        "status": { "conditions": conds },
    });
    match api
        .patch_status(&key.1, &apply(), &Patch::Apply(&body))
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => {
            tracing::warn!(export = %format!("{}/{}", key.0, key.1), error = %e, "writing ServiceExport status");
            Err(())
        }
    }
}
