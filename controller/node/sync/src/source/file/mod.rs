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
//!
//! # Layout
//!
//! - `parse`: one file's text to objects (YAML or JSON, within the budget; unknown
//!   versions, nameless objects and second definitions become rejections).
//! - here: the directory: which files changed, which object wins, what is sent.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use mcs_model::validate::{Reason, Rejection};
use tokio::sync::mpsc;

mod parse;

use super::SourceEvent;
use parse::{Key, Object, duplicate, file_rejection, parse_file, unreadable_key};

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

/// What the source keeps of an object between reads. Imports and slices are kept as a
/// fingerprint (128 bits of SipHash over the converted input): the object itself goes to the
/// index, which keeps its validated form, and keeping a second, whole copy here for change
/// detection held as much memory again as the index (951 MiB at 1M endpoints against 422 MiB
/// with the kube source). The small ones (the cluster id, unreadable documents) are kept
/// whole. An object whose definition changes to a file not parsed in this read (a duplicate
/// in an earlier file went away) is read again from that file.
/// (24 bytes: a `u128` or a `String` in it would make it 32.)
#[derive(Clone, Debug, PartialEq)]
enum Held {
    Import(Fingerprint),
    Slice(Fingerprint),
    ClusterId(Box<str>),
    Unreadable(Arc<Rejection>),
}

/// 128 bits, as two words (8-byte aligned).
type Fingerprint = [u64; 2];

impl Held {
    fn of(object: &Object) -> Self {
        match object {
            Object::Import(i) => Held::Import(fingerprint(1, i)),
            Object::Slice(s) => Held::Slice(fingerprint(2, s)),
            Object::ClusterId(id) => Held::ClusterId(id.as_str().into()),
            Object::Unreadable(r) => Held::Unreadable(Arc::new(r.clone())),
        }
    }
}

/// 128 bits of SipHash-1-3 (two fixed-key streams) over `kind` and `value`: equal for equal
/// values within this process; a collision between two versions of one object is as likely
/// as guessing a random 128-bit number.
fn fingerprint(kind: u8, value: &impl std::hash::Hash) -> Fingerprint {
    use std::hash::{DefaultHasher, Hash as _, Hasher as _};
    let mut a = DefaultHasher::new();
    let mut b = DefaultHasher::new();
    (kind, 0u8).hash(&mut a);
    (kind, 1u8).hash(&mut b);
    value.hash(&mut a);
    value.hash(&mut b);
    [a.finish(), b.finish()]
}

/// One key, shared by the per-file and merged views.
type SharedKey = Arc<Key>;

/// The state of the directory as last read.
#[derive(Debug, Default)]
pub struct FileSource {
    dir: PathBuf,
    limits: FileLimits,
    stamps: HashMap<PathBuf, (u64, SystemTime)>,
    /// What each file held when it last parsed, in key order.
    per_file: HashMap<PathBuf, Box<[(SharedKey, Held)]>>,
    /// Why a file could not be read this time (its last good objects stay in `per_file`).
    broken: HashMap<PathBuf, Arc<Rejection>>,
    /// What was last sent.
    current: BTreeMap<SharedKey, Held>,
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

    /// Reads and parses `path` (`len` bytes long): its fingerprints go into `per_file` and
    /// its objects are returned; a file that cannot be read or parsed goes into `broken` and
    /// keeps what it last held (`None`).
    fn read(&mut self, path: &Path, len: u64) -> Option<BTreeMap<Key, Object>> {
        let parsed = if len > self.limits.max_file_bytes {
            Err(file_rejection(
                path,
                Reason::TooLarge,
                format!(
                    "{len} bytes; files over {} bytes are not read",
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
                let held = objects
                    .iter()
                    .map(|(k, v)| (Arc::new(k.clone()), Held::of(v)))
                    .collect();
                self.per_file.insert(path.to_path_buf(), held);
                self.broken.remove(path);
                Some(objects)
            }
            Err(rejection) => {
                // Keep what the file held when it last parsed.
                self.broken.insert(path.to_path_buf(), Arc::new(rejection));
                None
            }
        }
    }

    /// Reads the directory and returns the events that turn the previous state into the new
    /// one: removals first, then the rest in file order. An unreadable directory is an error
    /// (the previous state is kept).
    pub fn scan(&mut self) -> std::io::Result<Vec<SourceEvent>> {
        let mut events = Vec::new();
        let mut removals = Vec::new();
        self.scan_each(&mut |ev| {
            if matches!(
                ev,
                SourceEvent::DeleteImport(..)
                    | SourceEvent::DeleteSlice(..)
                    | SourceEvent::Readable(_)
            ) {
                removals.push(ev);
            } else {
                events.push(ev);
            }
            true
        })?;
        removals.append(&mut events);
        Ok(removals)
    }

    /// Reads the directory and hands each event to `emit` as soon as it is known, file by
    /// file (the files' objects are not all held at once: at 1M endpoints holding them was
    /// 240 MiB above the settled size), removals last. `emit` returning false stops the
    /// read (the receiver is gone); the state is then partly updated. An unreadable
    /// directory is an error (the previous state is kept).
    pub fn scan_each(&mut self, emit: &mut dyn FnMut(SourceEvent) -> bool) -> std::io::Result<()> {
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
        // Files whose size or modification time changed (or that are new): parsed again.
        let mut changed: HashMap<&Path, u64> = HashMap::new();
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
            changed.insert(path, meta.len());
        }
        let before = self.per_file.len() + self.broken.len();
        self.per_file.retain(|p, _| seen.contains_key(p));
        self.broken.retain(|p, _| seen.contains_key(p));
        self.stamps.retain(|p, _| seen.contains_key(p));
        // Nothing read and nothing removed: the state is what it was. (Merging and comparing
        // every object on each poll cost half a core at 10k services with 100 ms polling.)
        if changed.is_empty() && self.per_file.len() + self.broken.len() == before {
            return Ok(());
        }
        // The merge, file by file in sorted order: the first definition of an object wins,
        // later ones are reported. `next` is the merged view; what differs from `current` is
        // sent as it is found.
        let mut next: HashMap<SharedKey, Held> = HashMap::with_capacity(self.current.len());
        let mut origin: HashMap<SharedKey, &Path> = HashMap::new();
        for path in &files {
            let mut parsed = match changed.get(path.as_path()) {
                Some(&len) => self.read(path, len),
                None => None,
            };
            // A winning object that changed but whose file was not parsed now (a duplicate in
            // an earlier file went away): parse the file again.
            if parsed.is_none()
                && !changed.contains_key(path.as_path())
                && self.per_file.get(path).is_some_and(|objs| {
                    objs.iter().any(|(k, v)| {
                        matches!(v, Held::Import(_) | Held::Slice(_))
                            && !origin.contains_key(k)
                            && self.current.get(k) != Some(v)
                    })
                })
            {
                let len = std::fs::metadata(path).map_or(0, |m| m.len());
                parsed = self.read(path, len);
            }
            // After any read of it: a file that stopped parsing is reported now.
            if let Some(broken) = self.broken.get(path) {
                let key = Arc::new(unreadable_key(path, usize::MAX));
                let held = Held::Unreadable(broken.clone());
                if !self.place(key, held, None, path, &mut next, emit) {
                    return Ok(());
                }
            }
            let Some(objs) = self.per_file.get(path) else {
                continue;
            };
            for (k, v) in objs.iter() {
                if let Some(first) = origin.get(k) {
                    let (dk, dv) = duplicate(k, path, first);
                    let held = Held::Unreadable(Arc::new(dv));
                    if !self.place(Arc::new(dk), held, None, path, &mut next, emit) {
                        return Ok(());
                    }
                    continue;
                }
                origin.insert(k.clone(), path);
                let object = parsed.as_mut().and_then(|o| o.remove(&**k));
                if !self.place(k.clone(), v.clone(), object, path, &mut next, emit) {
                    return Ok(());
                }
            }
        }
        for (key, old) in &self.current {
            if next.contains_key(key) {
                continue;
            }
            let event = match old {
                Held::Import(_) => SourceEvent::DeleteImport(key.1.to_string(), key.2.to_string()),
                Held::Slice(_) => SourceEvent::DeleteSlice(key.1.to_string(), key.2.to_string()),
                Held::Unreadable(r) => SourceEvent::Readable(r.object.clone()),
                Held::ClusterId(_) => continue,
            };
            if !emit(event) {
                return Ok(());
            }
        }
        // Built at once from key order: full B-tree nodes (inserted one by one, its nodes
        // were about half full: ~7 MiB at 1M).
        let mut current: Vec<(SharedKey, Held)> = next.into_iter().collect();
        current.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        self.current = current.into_iter().collect();
        Ok(())
    }

    /// Puts `key` into the merged view `next` and sends what changed: `held` if it differs
    /// from what was sent last (an import or slice with its `object`, parsed from `path` in
    /// this read). False when `emit` says the receiver is gone.
    fn place(
        &self,
        key: SharedKey,
        held: Held,
        object: Option<Object>,
        path: &Path,
        next: &mut HashMap<SharedKey, Held>,
        emit: &mut dyn FnMut(SourceEvent) -> bool,
    ) -> bool {
        if self.current.get(&key) == Some(&held) {
            next.insert(key, held);
            return true;
        }
        let event = match &held {
            Held::ClusterId(id) => SourceEvent::ClusterId(id.to_string()),
            Held::Unreadable(r) => SourceEvent::Unreadable(Rejection::clone(r)),
            // Moved out of this read's parse: sent without a copy.
            Held::Import(_) | Held::Slice(_) => match object {
                Some(Object::Import(i)) => SourceEvent::Import(i),
                Some(Object::Slice(s)) => SourceEvent::Slice(s),
                _ => {
                    // Its file could not be parsed again: what was sent stays.
                    tracing::warn!(file = %path.display(), object = ?key, "cannot read an object's definition again; it keeps its previous state until its file changes");
                    if let Some(old) = self.current.get(&key) {
                        next.insert(key, old.clone());
                    }
                    return true;
                }
            },
        };
        next.insert(key, held);
        emit(event)
    }

    /// Reads the directory once, sends everything (as each file is read) and `Synced`, then
    /// re-reads it every `interval` and sends changes (removals first), until the receiver is
    /// dropped. Reading and parsing run on a blocking thread, never on the runtime's workers.
    pub async fn run(mut self, tx: mpsc::Sender<SourceEvent>, interval: Duration) {
        let mut synced = false;
        loop {
            let first = !synced;
            let sender = tx.clone();
            let (back, result) = match tokio::task::spawn_blocking(move || {
                let r = if first {
                    // Straight into the channel: the index takes each file's objects while the
                    // next file is parsed.
                    self.scan_each(&mut |ev| sender.blocking_send(ev).is_ok())
                        .map(|()| Vec::new())
                } else {
                    self.scan()
                };
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

    /// The first read hands a file's objects on before it parses the next file: an event of
    /// `a.yaml` is seen while `b.yaml` is still unread (the test rewrites `b.yaml` then, and
    /// the read sends what it holds now).
    #[test]
    fn each_file_is_sent_before_the_next_is_parsed() {
        let dir = tempfile::tempdir().unwrap();
        let import = |name: &str| IMPORT.replace("name: web", &format!("name: {name}"));
        std::fs::write(dir.path().join("a.yaml"), import("first")).unwrap();
        std::fs::write(dir.path().join("b.yaml"), import("second")).unwrap();
        let mut src = FileSource::new(dir.path());
        let mut names = Vec::new();
        src.scan_each(&mut |ev| {
            if let SourceEvent::Import(i) = ev {
                if names.is_empty() {
                    std::fs::write(dir.path().join("b.yaml"), import("rewritten")).unwrap();
                }
                names.push(i.name);
            }
            true
        })
        .unwrap();
        assert_eq!(names, ["first", "rewritten"]);
        // The rewrite changed b.yaml's size: the next read sees it and has nothing to send
        // (what it holds was sent).
        assert!(src.scan().unwrap().is_empty());
    }

    /// A file not changed on disk (same size and mtime) that must be read again, because a
    /// duplicate it held now wins, and no longer parses: it is reported in that same read.
    #[test]
    fn a_file_read_again_that_no_longer_parses_is_reported_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, IMPORT).unwrap();
        let other = IMPORT.replace("port: 80", "port: 81");
        std::fs::write(&b, &other).unwrap();
        let mut src = FileSource::new(dir.path());
        src.scan().unwrap();
        // b.yaml turns unparsable at the same size and mtime; a.yaml goes.
        let mtime = std::fs::metadata(&b).unwrap().modified().unwrap();
        let broken = format!("kind: [{}", "x".repeat(other.len() - 7));
        assert_eq!(broken.len(), other.len());
        std::fs::write(&b, &broken).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&b)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        std::fs::remove_file(&a).unwrap();
        let ev = src.scan().unwrap();
        assert!(
            ev.iter()
                .any(|e| matches!(e, SourceEvent::Unreadable(r) if r.object.contains("b.yaml"))),
            "{ev:?}"
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

    /// `.json` files are read by serde_json: the same objects as the YAML parser gives, and
    /// hostile nesting, garbage and too many documents are refused with a reason while the
    /// other files are read.
    #[test]
    fn json_files_are_read_as_json_with_limits() {
        let dir = tempfile::tempdir().unwrap();
        let import = serde_json::json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
            "metadata": { "name": "web", "namespace": "ns" },
            "spec": { "type": "ClusterSetIP", "ips": ["198.18.0.10"],
                      "ports": [{ "name": "http", "port": 80 }] }
        });
        let api = serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": [
            import.clone(),
        ]})
        .to_string()
        .replace("\"web\"", "\"api\"");
        std::fs::write(dir.path().join("a.json"), &api).unwrap();
        std::fs::write(dir.path().join("b.json"), "[".repeat(200_000)).unwrap();
        std::fs::write(dir.path().join("c.json"), "{\"kind\": ").unwrap();
        std::fs::write(
            dir.path().join("d.json"),
            format!("{import} {import} {import}"),
        )
        .unwrap();
        let limits = FileLimits {
            max_documents: 2,
            ..FileLimits::default()
        };
        let ev = FileSource::with_limits(dir.path(), limits).scan().unwrap();
        assert_eq!(imports(&ev), ["ns/api [\"198.18.0.10\"]"]);
        let mut r = rejections(&ev);
        r.sort();
        assert_eq!(r.len(), 3, "{r:?}");
        assert_eq!(r[0].0, Reason::Unparsable, "{r:?}");
        assert_eq!(r[1].0, Reason::TooLarge, "{r:?}");
        assert!(
            r[1].1.contains("recursion limit") || r[2].1.contains("recursion limit"),
            "{r:?}"
        );
        assert_eq!(r[2].0, Reason::TooLarge, "{r:?}");
        // YAML and JSON of the same object are the same input.
        let yaml = dir.path().join("yaml");
        std::fs::create_dir(&yaml).unwrap();
        std::fs::write(yaml.join("a.yaml"), IMPORT).unwrap();
        let json = dir.path().join("json");
        std::fs::create_dir(&json).unwrap();
        std::fs::write(json.join("a.json"), import.to_string()).unwrap();
        assert_eq!(
            FileSource::new(&yaml).scan().unwrap(),
            FileSource::new(&json).scan().unwrap()
        );
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

    /// When the first definition of an object goes, the next one (in a file that did not
    /// change, so is not parsed again by itself) is read again and sent: the source keeps only
    /// fingerprints of objects, not the objects.
    #[test]
    fn the_next_definition_is_sent_when_the_first_goes() {
        let dir = tempfile::tempdir().unwrap();
        let other = IMPORT.replace("198.18.0.10", "198.18.0.99");
        let api = IMPORT.replace("name: web", "name: api");
        std::fs::write(dir.path().join("a.yaml"), IMPORT).unwrap();
        std::fs::write(dir.path().join("b.yaml"), &other).unwrap();
        let mut src = FileSource::new(dir.path());
        let ev = src.scan().unwrap();
        assert_eq!(imports(&ev), ["ns/web [\"198.18.0.10\"]"]);
        assert_eq!(rejections(&ev).len(), 1, "{ev:?}");
        std::fs::write(dir.path().join("a.yaml"), &api).unwrap();
        let ev = src.scan().unwrap();
        let mut sent = imports(&ev);
        sent.sort();
        assert_eq!(
            sent,
            ["ns/api [\"198.18.0.10\"]", "ns/web [\"198.18.0.99\"]"]
        );
        assert!(
            !ev.iter()
                .any(|e| matches!(e, SourceEvent::DeleteImport(..))),
            "{ev:?}"
        );
        assert!(
            ev.iter().any(|e| matches!(e, SourceEvent::Readable(..))),
            "{ev:?}"
        );
        assert!(src.scan().unwrap().is_empty(), "nothing changed");
        // And back: the first file's definition wins again.
        std::fs::write(dir.path().join("a.yaml"), format!("{api}---\n{IMPORT}")).unwrap();
        let ev = src.scan().unwrap();
        assert_eq!(imports(&ev), ["ns/web [\"198.18.0.10\"]"]);
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
            let _ = super::parse_file(std::path::Path::new("fuzz.json"), &text, &super::FileLimits::default());
        }
    }
}
