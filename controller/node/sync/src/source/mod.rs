//! Sources of MCS objects. Each runs as a task that sends [`SourceEvent`]s; the sync loop
//! does not care where they come from.
//!
//! - [`kube`]: watchers on a real API server ([`slice_watch`]: EndpointSlices in protobuf,
//!   decoded by [`protobuf`]).
//! - [`file`]: a directory of the same YAML objects, re-read when it changes.

pub mod file;
pub mod kube;
pub mod protobuf;
pub mod slice_watch;

use std::collections::BTreeMap;

use mcs_model::{
    Index,
    input::{ImportInput, SliceInput},
    validate::Rejection,
};

/// A change seen by a source.
#[derive(Clone, Debug, PartialEq)]
pub enum SourceEvent {
    /// A ServiceImport was added or changed.
    Import(ImportInput),
    /// A ServiceImport is gone: (namespace, name).
    DeleteImport(String, String),
    /// An EndpointSlice was added or changed.
    Slice(SliceInput),
    /// An EndpointSlice is gone: (namespace, name).
    DeleteSlice(String, String),
    /// This cluster's id (from the `cluster.clusterset.k8s.io` ClusterProperty).
    ClusterId(String),
    /// Something the source could not read at all (unparsable document, unknown kind); keyed
    /// by `object` so that a later fix clears it.
    Unreadable(Rejection),
    /// An unreadable object is readable again or gone.
    Readable(String),
    /// The source has delivered everything that existed when it started (first full sync).
    Synced,
}

/// Which source to use, parsed from `--source kube|file:DIR`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    /// The API server of the kubeconfig / in-cluster config.
    Kube,
    /// A directory of YAML files.
    File(std::path::PathBuf),
}

impl std::str::FromStr for SourceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kube" => Ok(SourceSpec::Kube),
            _ => match s.strip_prefix("file:") {
                Some(dir) if !dir.is_empty() => Ok(SourceSpec::File(dir.into())),
                _ => Err(format!("unknown source {s:?}: use `kube` or `file:DIR`")),
            },
        }
    }
}

/// Applies one source event to `index` (and to `unreadable`, keyed by object); returns true
/// for [`SourceEvent::Synced`]. With `cluster_id_fixed` (`--cluster-id`), ClusterProperty
/// updates are ignored. The one place that turns events into index calls: the sync loop,
/// `mcs-agent table` and the demo all use it.
pub fn apply(
    index: &mut Index,
    unreadable: &mut BTreeMap<String, Rejection>,
    ev: SourceEvent,
    cluster_id_fixed: bool,
) -> bool {
    match ev {
        SourceEvent::Import(i) => index.upsert_import(i),
        SourceEvent::DeleteImport(ns, n) => index.delete_import(&ns, &n),
        SourceEvent::Slice(s) => index.upsert_slice(s),
        SourceEvent::DeleteSlice(ns, n) => index.delete_slice(&ns, &n),
        SourceEvent::ClusterId(id) => {
            if cluster_id_fixed {
                tracing::debug!(id, "ignoring ClusterProperty: --cluster-id was given");
            } else if index.node().cluster_id != id {
                tracing::info!(cluster_id = %id, "cluster id from ClusterProperty");
                index.set_cluster_id(&id);
            }
        }
        SourceEvent::Unreadable(r) => {
            unreadable.insert(r.object.clone(), r);
        }
        SourceEvent::Readable(object) => {
            unreadable.remove(&object);
        }
        SourceEvent::Synced => return true,
    }
    false
}
