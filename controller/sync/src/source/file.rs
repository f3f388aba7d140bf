//! The file source: a directory of YAML (or JSON) files holding ServiceImports, EndpointSlices
//! and ClusterProperties, in multi-document files or `kind: List`. The directory is re-read
//! every poll interval; only files whose size or modification time changed are parsed again,
//! and only objects that changed are sent.
//!
//! A file is input from anyone who can write the directory, so: its size is checked before it
//! is read, the YAML parser (serde-saphyr) runs with a budget (nesting depth, documents,
//! nodes), parsing runs on a blocking thread, and nothing is dropped silently — a document
//! without apiVersion or kind, an unknown version, a nameless object or a second definition of
//! an object becomes an `Unreadable` rejection with a reason. A file that stops parsing keeps
//! the objects it last had (reported as unreadable) rather than withdrawing them.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use mcs_api::{ClusterProperty, ServiceImport};
use mcs_model::validate::{Reason, Rejection};
use tokio::sync::mpsc;

use super::SourceEvent;
use crate::convert;

/// Default time between two reads of the directory.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Limits on what one file may cost to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileLimits {
    /// Largest file read, in bytes.
    pub max_file_bytes: u64,
    /// Deepest nesting of YAML collections.
    pub max_depth: usize,
    /// Most documents in one file.
    pub max_documents: usize,
}

impl Default for FileLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: 32 << 20,
            max_depth: 32,
            max_documents: 200_000,
        }
    }
}

/// The API versions the file source reads, per group.
const KNOWN_VERSIONS: [(&str, &[&str]); 3] = [
    ("multicluster.x-k8s.io", &["v1alpha1", "v1beta1"]),
    ("discovery.k8s.io", &["v1"]),
    ("about.k8s.io", &["v1alpha1", "v1beta1"]),
];

/// One object read from a file.
#[derive(Clone, Debug, PartialEq)]
enum Object {
    Import(mcs_model::input::ImportInput),
    Slice(mcs_model::input::SliceInput),
    ClusterId(String),
    Unreadable(Rejection),
}

/// Key of an object: (kind, namespace, name) or, for unreadable documents, (marker, file,
/// index).
type Key = (String, String, String);

/// The state of the directory as last read.
#[derive(Debug, Default)]
pub struct FileSource {
    dir: PathBuf,
    limits: FileLimits,
    stamps: HashMap<PathBuf, (u64, SystemTime)>,
    /// Objects by file, shared with `current` (one copy of each object, not two).
    per_file: HashMap<PathBuf, BTreeMap<Key, Arc<Object>>>,
    /// Why a file could not be read this time (its last good objects stay in `per_file`).
    broken: HashMap<PathBuf, Arc<Object>>,
    current: BTreeMap<Key, Arc<Object>>,
}

impl FileSource {
    /// A source for `dir` (nothing read yet), with the default limits.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self::with_limits(dir, FileLimits::default())
    }

    /// A source for `dir` with `limits`.
    pub fn with_limits(dir: impl Into<PathBuf>, limits: FileLimits) -> Self {
        Self {
            dir: dir.into(),
            limits,
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
            seen.insert(path.clone(), ());
            if self.stamps.get(path) == Some(&stamp)
                && (self.per_file.contains_key(path) || self.broken.contains_key(path))
            {
                continue;
            }
            self.stamps.insert(path.clone(), stamp);
            changed = true;
            let parsed = if meta.len() > self.limits.max_file_bytes {
                Err(file_rejection(
                    path,
                    Reason::TooLarge,
                    format!(
                        "{} bytes; files over {} bytes are not read",
                        meta.len(),
                        self.limits.max_file_bytes
                    ),
                ))
            } else {
                match std::fs::read_to_string(path) {
                    Ok(text) => parse_file(path, &text, &self.limits),
                    Err(e) => Err(file_rejection(
                        path,
                        Reason::Unparsable,
                        format!("cannot read: {e}"),
                    )),
                }
            };
            match parsed {
                Ok(objects) => {
                    let objects = objects.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
                    self.per_file.insert(path.clone(), objects);
                    self.broken.remove(path);
                }
                Err(rejection) => {
                    // Keep what the file held when it last parsed.
                    self.broken
                        .insert(path.clone(), Arc::new(Object::Unreadable(rejection)));
                }
            }
        }
        let before = self.per_file.len() + self.broken.len();
        self.per_file.retain(|p, _| seen.contains_key(p));
        self.broken.retain(|p, _| seen.contains_key(p));
        self.stamps.retain(|p, _| seen.contains_key(p));
        // Nothing read and nothing removed: the state is what it was. (Merging and comparing
        // every object on each poll cost half a core at 10k services with 100 ms polling.)
        if !changed && self.per_file.len() + self.broken.len() == before {
            return Ok(Vec::new());
        }

        // The first definition of an object wins (files in sorted order); later ones are
        // reported.
        let mut next: BTreeMap<Key, Arc<Object>> = BTreeMap::new();
        let mut origin: HashMap<Key, &Path> = HashMap::new();
        for path in &files {
            if let Some(broken) = self.broken.get(path) {
                next.insert(unreadable_key(path, usize::MAX), broken.clone());
            }
            let Some(objs) = self.per_file.get(path) else {
                continue;
            };
            for (k, v) in objs {
                if let Some(first) = origin.get(k) {
                    let (dk, dv) = duplicate(k, path, first);
                    next.insert(dk, Arc::new(dv));
                    continue;
                }
                origin.insert(k.clone(), path);
                next.insert(k.clone(), v.clone());
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
    /// `interval` and sends changes, until the receiver is dropped. Reading and parsing run on
    /// a blocking thread, never on the runtime's workers.
    pub async fn run(mut self, tx: mpsc::Sender<SourceEvent>, interval: Duration) {
        let mut synced = false;
        loop {
            let (back, result) = match tokio::task::spawn_blocking(move || {
                let r = self.scan();
                (self, r)
            })
            .await
            {
                Ok(v) => v,
                Err(e) => {
                    tracing::error!(error = %e, "the file source's reader failed; stopping it");
                    return;
                }
            };
            self = back;
            match result {
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

fn unreadable_key(path: &Path, index: usize) -> Key {
    (
        "#unreadable".into(),
        path.display().to_string(),
        format!("{index:020}"),
    )
}

fn file_rejection(path: &Path, reason: Reason, message: String) -> Rejection {
    Rejection::new(format!("file {}", path.display()), reason, message)
}

fn unreadable(path: &Path, index: usize, reason: Reason, message: String) -> (Key, Object) {
    let object = format!("{} document {}", path.display(), index + 1);
    (
        unreadable_key(path, index),
        Object::Unreadable(Rejection::new(&object, reason, message)),
    )
}

/// The rejection of a second definition of `key` in `path` (the first is in `first`).
fn duplicate(key: &Key, path: &Path, first: &Path) -> (Key, Object) {
    let (kind, ns, name) = key;
    let object = format!("{kind} {ns}/{name} in {}", path.display());
    (
        (
            "#duplicate".into(),
            path.display().to_string(),
            format!("{kind}/{ns}/{name}"),
        ),
        Object::Unreadable(Rejection::new(
            &object,
            Reason::DuplicateObject,
            format!(
                "defined again; the first definition, in {}, is used",
                first.display()
            ),
        )),
    )
}

/// Each document as it is parsed: converted at once, so only one YAML tree is alive at a time
/// (holding them all first peaked at hundreds of MiB for 10k services).
#[derive(Default)]
struct Documents(Vec<Option<Vec<Converted>>>);

/// One converted item: an object, nothing (not ours), or why it is unusable.
type Converted = Result<Option<(Key, Object)>, (Reason, String)>;

impl Extend<serde_json::Value> for Documents {
    fn extend<I: IntoIterator<Item = serde_json::Value>>(&mut self, iter: I) {
        for doc in iter {
            let items = match doc {
                serde_json::Value::Null => None,
                serde_json::Value::Object(mut m)
                    if m.get("kind").and_then(|k| k.as_str()) == Some("List") =>
                {
                    match m.remove("items") {
                        Some(serde_json::Value::Array(items)) => {
                            Some(items.into_iter().map(object).collect())
                        }
                        _ => Some(vec![Err((
                            Reason::Unparsable,
                            "a List without items".to_string(),
                        ))]),
                    }
                }
                v => Some(vec![object(v)]),
            };
            self.0.push(items);
        }
    }
}

/// Parses every document of a file; what cannot be used becomes an `Unreadable` entry. `Err`
/// when the file as a whole cannot be parsed (syntax, over the budget).
fn parse_file(
    path: &Path,
    text: &str,
    limits: &FileLimits,
) -> Result<BTreeMap<Key, Object>, Rejection> {
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: limits.max_depth,
            flow_nesting_limit: limits.max_depth,
            max_documents: limits.max_documents,
            max_nodes: text.len().max(1024),
            max_events: text.len().saturating_mul(2).max(4096),
            max_reader_input_bytes: Some(limits.max_file_bytes.try_into().unwrap_or(usize::MAX)),
        },
    };
    let docs: Documents =
        serde_saphyr::from_str_multiple_with_options::<serde_json::Value, Documents>(text, options)
            .map_err(|e| {
                let msg = e.to_string();
                let first = msg.lines().next().unwrap_or("").to_string();
                let reason = if msg.contains("budget") || msg.contains("limit") {
                    Reason::TooLarge
                } else {
                    Reason::Unparsable
                };
                file_rejection(path, reason, format!("invalid YAML: {first}"))
            })?;
    let mut out = BTreeMap::new();
    let mut first_doc: HashMap<Key, usize> = HashMap::new();
    for (i, items) in docs.0.into_iter().enumerate() {
        let Some(items) = items else { continue };
        for item in items {
            match item {
                Ok(Some((k, v))) => {
                    if let Some(first) = first_doc.get(&k) {
                        let (kind, ns, name) = &k;
                        let (dk, dv) = unreadable(
                            path,
                            i,
                            Reason::DuplicateObject,
                            format!(
                                "{kind} {ns}/{name} is defined again; the first definition (document {}) is used",
                                first + 1
                            ),
                        );
                        out.insert(dk, dv);
                        continue;
                    }
                    first_doc.insert(k.clone(), i);
                    out.insert(k, v);
                }
                Ok(None) => {}
                Err((reason, msg)) => {
                    let (k, v) = unreadable(path, i, reason, msg);
                    out.insert(k, v);
                }
            }
        }
    }
    Ok(out)
}

fn object(v: serde_json::Value) -> Result<Option<(Key, Object)>, (Reason, String)> {
    let unparsable = |m: String| (Reason::Unparsable, m);
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
    if kind.is_empty() {
        return Err(unparsable("document has no kind".into()));
    }
    if api_version.is_empty() {
        return Err(unparsable(format!("{kind} has no apiVersion")));
    }
    let (group, version) = api_version.split_once('/').unwrap_or(("", &api_version));
    let Some((_, versions)) = KNOWN_VERSIONS.iter().find(|(g, _)| *g == group) else {
        // Other groups (core Namespaces, apps, ...) may sit in the same files: not ours.
        return Ok(None);
    };
    let ours = matches!(
        (group, kind.as_str()),
        ("multicluster.x-k8s.io", "ServiceImport")
            | ("discovery.k8s.io", "EndpointSlice")
            | ("about.k8s.io", "ClusterProperty")
    );
    if !ours {
        // ServiceExport and other kinds of our groups: not read by the agent.
        return Ok(None);
    }
    if !versions.contains(&version) {
        return Err((
            Reason::UnsupportedVersion,
            format!("{kind} of {api_version}: the agent reads {group} {versions:?}"),
        ));
    }
    let name = v
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or("");
    if name.is_empty() {
        return Err((Reason::MissingName, format!("{kind} without metadata.name")));
    }
    match kind.as_str() {
        "ServiceImport" => {
            let si: ServiceImport =
                serde_json::from_value(v).map_err(|e| unparsable(format!("ServiceImport: {e}")))?;
            let input = convert::import(&si);
            let key = (
                "ServiceImport".into(),
                input.namespace.clone(),
                input.name.clone(),
            );
            Ok(Some((key, Object::Import(input))))
        }
        "EndpointSlice" => {
            let es: convert::LeanSlice =
                serde_json::from_value(v).map_err(|e| unparsable(format!("EndpointSlice: {e}")))?;
            let input = convert::slice(es);
            let key = (
                "EndpointSlice".into(),
                input.namespace.clone(),
                input.name.clone(),
            );
            Ok(Some((key, Object::Slice(input))))
        }
        _ => {
            let cp: ClusterProperty = serde_json::from_value(v)
                .map_err(|e| unparsable(format!("ClusterProperty: {e}")))?;
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
mod hostile_files {
    use super::*;

    fn rejections(events: &[SourceEvent]) -> Vec<(Reason, String)> {
        events
            .iter()
            .filter_map(|e| match e {
                SourceEvent::Unreadable(r) => Some((r.reason, r.message.clone())),
                _ => None,
            })
            .collect()
    }

    fn imports(events: &[SourceEvent]) -> Vec<String> {
        events
            .iter()
            .filter_map(|e| match e {
                SourceEvent::Import(i) => Some(format!("{}/{} {:?}", i.namespace, i.name, i.ips)),
                _ => None,
            })
            .collect()
    }

    const IMPORT: &str = "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {name: web, namespace: ns}\nspec: {type: ClusterSetIP, ips: [198.18.0.10], ports: [{name: http, port: 80}]}\n";

    #[test]
    fn deep_nesting_is_refused_by_the_parser_budget() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), "[".repeat(200_000)).unwrap();
        std::fs::write(dir.path().join("b.yaml"), IMPORT).unwrap();
        let ev = FileSource::new(dir.path()).scan().unwrap();
        let r = rejections(&ev);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0].0, Reason::TooLarge, "{r:?}");
        assert_eq!(imports(&ev).len(), 1, "the other file is read");
    }

    #[test]
    fn oversized_files_are_not_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), IMPORT).unwrap();
        let limits = FileLimits {
            max_file_bytes: 64,
            ..FileLimits::default()
        };
        let ev = FileSource::with_limits(dir.path(), limits).scan().unwrap();
        assert_eq!(rejections(&ev)[0].0, Reason::TooLarge);
        assert!(imports(&ev).is_empty());
    }

    #[test]
    fn nothing_is_dropped_silently() {
        let dir = tempfile::tempdir().unwrap();
        let no_version = "kind: ServiceImport\nmetadata: {name: a, namespace: ns}\nspec: {type: ClusterSetIP, ports: []}\n";
        let v999 = "apiVersion: multicluster.x-k8s.io/v999\nkind: ServiceImport\nmetadata: {name: b, namespace: ns}\nspec: {type: ClusterSetIP, ports: []}\n";
        let nameless = "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {namespace: ns}\nspec: {type: ClusterSetIP, ports: []}\n";
        let other = IMPORT.replace("198.18.0.10", "198.18.0.99");
        std::fs::write(
            dir.path().join("a.yaml"),
            format!("{no_version}---\n{v999}---\n{nameless}---\n{IMPORT}---\n{other}"),
        )
        .unwrap();
        // The same object again in a later file.
        std::fs::write(dir.path().join("b.yaml"), &other).unwrap();
        let ev = FileSource::new(dir.path()).scan().unwrap();
        let mut reasons: Vec<Reason> = rejections(&ev).into_iter().map(|r| r.0).collect();
        reasons.sort();
        assert_eq!(
            reasons,
            [
                Reason::Unparsable,
                Reason::MissingName,
                Reason::DuplicateObject,
                Reason::DuplicateObject,
                Reason::UnsupportedVersion,
            ],
        );
        assert_eq!(
            imports(&ev),
            ["ns/web [\"198.18.0.10\"]"],
            "the first definition wins"
        );
    }

    #[test]
    fn a_file_that_breaks_keeps_its_last_objects_until_fixed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.yaml");
        std::fs::write(&path, IMPORT).unwrap();
        let mut src = FileSource::new(dir.path());
        assert_eq!(imports(&src.scan().unwrap()).len(), 1);
        std::fs::write(&path, format!("{IMPORT}  broken: [\n")).unwrap();
        let ev = src.scan().unwrap();
        assert!(
            !ev.iter()
                .any(|e| matches!(e, SourceEvent::DeleteImport(..))),
            "{ev:?}"
        );
        assert_eq!(rejections(&ev).len(), 1);
        std::fs::remove_file(&path).unwrap();
        let ev = src.scan().unwrap();
        assert!(
            ev.iter()
                .any(|e| matches!(e, SourceEvent::DeleteImport(..)))
        );
        assert!(ev.iter().any(|e| matches!(e, SourceEvent::Readable(..))));
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
            let _ = super::parse_file(std::path::Path::new("fuzz.yaml"), &text, &super::FileLimits::default());
        }
    }
}
