//! The file source: a directory of YAML (or JSON) files holding ServiceImports, EndpointSlices
//! and ClusterProperties, in multi-document files or `kind: List`. The directory is re-read
//! every poll interval; only files whose size or modification time changed are parsed again,
//! and only objects that changed are sent.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use mcs_api::{ClusterProperty, ServiceImport};
use mcs_model::validate::{Reason, Rejection};
use serde::Deserialize;
use tokio::sync::mpsc;

use super::SourceEvent;
use crate::convert;

/// Default time between two reads of the directory.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// One object read from a file.
#[derive(Clone, Debug, PartialEq)]
enum Object {
    Import(mcs_model::input::ImportInput),
    Slice(mcs_model::input::SliceInput),
    ClusterId(String),
    Unreadable(Rejection),
}

/// Key of an object: (kind, namespace, name) or, for unreadable documents, (file, index).
type Key = (String, String, String);

/// The state of the directory as last read.
#[derive(Debug, Default)]
pub struct FileSource {
    dir: PathBuf,
    stamps: HashMap<PathBuf, (u64, SystemTime)>,
    /// Objects by file, shared with `current` (one copy of each object, not two).
    per_file: HashMap<PathBuf, BTreeMap<Key, Arc<Object>>>,
    current: BTreeMap<Key, Arc<Object>>,
}

impl FileSource {
    /// A source for `dir` (nothing read yet).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            ..Default::default()
        }
    }

    /// Reads the directory and returns the events that turn the previous state into the new
    /// one. An unreadable directory is an error (the previous state is kept).
    pub fn scan(&mut self) -> std::io::Result<Vec<SourceEvent>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.dir)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && p.extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
            })
            .collect();
        files.sort();
        let mut seen = HashMap::new();
        let mut changed = false;
        for path in &files {
            let Ok(meta) = std::fs::metadata(path) else {
                continue;
            };
            let stamp = (
                meta.len(),
                meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            );
            if self.stamps.get(path) != Some(&stamp) || !self.per_file.contains_key(path) {
                let objects = match std::fs::read_to_string(path) {
                    Ok(text) => parse_file(path, &text),
                    Err(e) => BTreeMap::from([unreadable(path, 0, format!("cannot read: {e}"))]),
                };
                let objects = objects.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
                self.per_file.insert(path.clone(), objects);
                self.stamps.insert(path.clone(), stamp);
                changed = true;
            }
            seen.insert(path.clone(), ());
        }
        let before = self.per_file.len();
        self.per_file.retain(|p, _| seen.contains_key(p));
        self.stamps.retain(|p, _| seen.contains_key(p));
        // Nothing read and nothing removed: the state is what it was. (Merging and comparing
        // every object on each poll cost half a core at 10k services with 100 ms polling.)
        if !changed && self.per_file.len() == before {
            return Ok(Vec::new());
        }

        // Later files win when two define the same object (sorted order, like kubectl -f DIR).
        let mut next = BTreeMap::new();
        for path in &files {
            if let Some(objs) = self.per_file.get(path) {
                next.extend(objs.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
        }
        let mut events = Vec::new();
        for (key, old) in &self.current {
            if !next.contains_key(key) {
                events.push(match &**old {
                    Object::Import(_) => SourceEvent::DeleteImport(key.1.clone(), key.2.clone()),
                    Object::Slice(_) => SourceEvent::DeleteSlice(key.1.clone(), key.2.clone()),
                    Object::ClusterId(_) => continue,
                    Object::Unreadable(r) => SourceEvent::Readable(r.object.clone()),
                });
            }
        }
        for (key, obj) in &next {
            if self.current.get(key) == Some(obj) {
                continue;
            }
            events.push(match &**obj {
                Object::Import(i) => SourceEvent::Import(i.clone()),
                Object::Slice(s) => SourceEvent::Slice(s.clone()),
                Object::ClusterId(id) => SourceEvent::ClusterId(id.clone()),
                Object::Unreadable(r) => SourceEvent::Unreadable(r.clone()),
            });
        }
        self.current = next;
        Ok(events)
    }

    /// Reads the directory once, sends everything and `Synced`, then re-reads it every
    /// `interval` and sends changes, until the receiver is dropped.
    pub async fn run(mut self, tx: mpsc::Sender<SourceEvent>, interval: Duration) {
        let mut synced = false;
        loop {
            match self.scan() {
                Ok(events) => {
                    for ev in events {
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                    if !synced {
                        synced = true;
                        tracing::info!(dir = %self.dir.display(), objects = self.current.len(), "file source synced");
                        if tx.send(SourceEvent::Synced).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "cannot read source directory; keeping the last state")
                }
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = tx.closed() => return,
            }
        }
    }
}

fn unreadable(path: &Path, index: usize, message: String) -> (Key, Object) {
    let object = format!("{} document {}", path.display(), index + 1);
    (
        (
            "#unreadable".into(),
            path.display().to_string(),
            index.to_string(),
        ),
        Object::Unreadable(Rejection {
            object,
            reason: Reason::Unparsable,
            message,
        }),
    )
}

/// Parses every document of a file; what cannot be used becomes an `Unreadable` entry.
fn parse_file(path: &Path, text: &str) -> BTreeMap<Key, Object> {
    let mut out = BTreeMap::new();
    // Each document is converted as soon as it is parsed, so only one YAML tree is alive at
    // a time (holding them all first peaked at hundreds of MiB for 10k services).
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let doc = match serde_yaml::Value::deserialize(doc) {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                let (k, v) = unreadable(path, i, format!("invalid YAML: {e}"));
                out.insert(k, v);
                // The YAML stream cannot be resumed after a syntax error.
                break;
            }
        };
        let items = if doc.get("kind").and_then(|k| k.as_str()) == Some("List") {
            match doc {
                serde_yaml::Value::Mapping(mut m) => match m.remove("items") {
                    Some(serde_yaml::Value::Sequence(items)) => items,
                    _ => Vec::new(),
                },
                _ => Vec::new(),
            }
        } else {
            vec![doc]
        };
        for item in items {
            match object(item) {
                Ok(Some((k, v))) => {
                    out.insert(k, v);
                }
                Ok(None) => {}
                Err(msg) => {
                    let (k, v) = unreadable(path, i, msg);
                    out.insert(k, v);
                }
            }
        }
    }
    out
}

fn object(v: serde_yaml::Value) -> Result<Option<(Key, Object)>, String> {
    let api_version = v
        .get("apiVersion")
        .and_then(|a| a.as_str())
        .unwrap_or("")
        .to_string();
    let kind = v
        .get("kind")
        .and_then(|a| a.as_str())
        .unwrap_or("")
        .to_string();
    let group = api_version.split('/').next().unwrap_or("");
    match (group, kind.as_str()) {
        ("multicluster.x-k8s.io", "ServiceImport") => {
            let si: ServiceImport =
                serde_yaml::from_value(v).map_err(|e| format!("ServiceImport: {e}"))?;
            let input = convert::import(&si);
            let key = (
                "ServiceImport".into(),
                input.namespace.clone(),
                input.name.clone(),
            );
            Ok(Some((key, Object::Import(input))))
        }
        ("discovery.k8s.io", "EndpointSlice") => {
            let es: EndpointSlice =
                serde_yaml::from_value(v).map_err(|e| format!("EndpointSlice: {e}"))?;
            let input = convert::slice(&es);
            let key = (
                "EndpointSlice".into(),
                input.namespace.clone(),
                input.name.clone(),
            );
            Ok(Some((key, Object::Slice(input))))
        }
        ("about.k8s.io", "ClusterProperty") => {
            let cp: ClusterProperty =
                serde_yaml::from_value(v).map_err(|e| format!("ClusterProperty: {e}"))?;
            if cp.metadata.name.as_deref() != Some(mcs_api::CLUSTER_ID_PROPERTY) {
                return Ok(None);
            }
            let key = (
                "ClusterProperty".into(),
                String::new(),
                mcs_api::CLUSTER_ID_PROPERTY.into(),
            );
            Ok(Some((key, Object::ClusterId(cp.spec.value))))
        }
        // Other kinds (ServiceExport, Namespace, ...) may sit in the same files: not ours.
        _ if !kind.is_empty() => Ok(None),
        _ => Err("document has no kind".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMPORT: &str = "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {name: web, namespace: ns}\nspec: {type: ClusterSetIP, ips: [198.18.0.10], ports: [{name: http, port: 80}]}\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-c1\n  namespace: ns\n  labels: {multicluster.kubernetes.io/service-name: web, multicluster.kubernetes.io/source-cluster: c1}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [198.18.1.2]}]\n";

    #[test]
    fn scan_sends_only_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), format!("{IMPORT}---\n{SLICE}")).unwrap();
        let mut src = FileSource::new(dir.path());
        let first = src.scan().unwrap();
        assert_eq!(first.len(), 2);
        assert!(src.scan().unwrap().is_empty(), "nothing changed");
        // Remove the slice.
        std::fs::write(dir.path().join("a.yaml"), format!("{IMPORT}\n# changed\n")).unwrap();
        let ev = src.scan().unwrap();
        assert_eq!(
            ev,
            vec![SourceEvent::DeleteSlice("ns".into(), "web-c1".into())]
        );
    }

    #[test]
    fn broken_documents_are_reported_and_the_rest_is_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), IMPORT).unwrap();
        std::fs::write(dir.path().join("b.yaml"), "kind: [unclosed\n").unwrap();
        std::fs::write(dir.path().join("c.yaml"), "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {name: x}\nspec: {ports: \"no\"}\n").unwrap();
        let mut src = FileSource::new(dir.path());
        let ev = src.scan().unwrap();
        assert_eq!(
            ev.iter()
                .filter(|e| matches!(e, SourceEvent::Import(_)))
                .count(),
            1
        );
        assert_eq!(
            ev.iter()
                .filter(|e| matches!(e, SourceEvent::Unreadable(_)))
                .count(),
            2
        );
    }
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

        /// Any file content parses into objects or `Unreadable` entries, never a panic.
        #[test]
        fn arbitrary_file_content_never_panics(text in prop_oneof![
            any::<String>(),
            "(apiVersion: (multicluster.x-k8s.io/v1beta1|discovery.k8s.io/v1|about.k8s.io/v1beta1)\nkind: (ServiceImport|EndpointSlice|ClusterProperty|List)\n(spec|metadata|items|endpoints|ports): [\\[\\]{}a-z0-9:, \"-]{0,40}\n(---\n)?){1,4}",
        ]) {
            let _ = super::parse_file(std::path::Path::new("fuzz.yaml"), &text);
        }
    }
}
