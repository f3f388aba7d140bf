//! Parsing one file of the file source: YAML (multi-document, `kind: List`) or JSON, within
//! the source's budget, each document converted as it is parsed.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use mcs_api::{ClusterProperty, ServiceImport};
use mcs_model::validate::{Reason, Rejection};

use super::FileLimits;
use crate::convert;

/// The API versions the file source reads, per group.
pub(super) const KNOWN_VERSIONS: [(&str, &[&str]); 3] = [
    ("multicluster.x-k8s.io", &["v1alpha1", "v1beta1"]),
    ("discovery.k8s.io", &["v1"]),
    ("about.k8s.io", &["v1alpha1", "v1beta1"]),
];

/// One object read from a file.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Object {
    Import(mcs_model::input::ImportInput),
    Slice(mcs_model::input::SliceInput),
    ClusterId(String),
    Unreadable(Rejection),
}

/// Key of an object: (kind, namespace, name) or, for unreadable documents, (marker, file,
/// index). Kinds and markers are fixed words; the rest are boxed (one key is kept per object
/// between reads: 144 bytes with its two strings, where three `String`s took 192).
pub(super) type Key = (&'static str, Box<str>, Box<str>);

pub(super) fn unreadable_key(path: &Path, index: usize) -> Key {
    (
        "#unreadable",
        path.display().to_string().into(),
        format!("{index:020}").into(),
    )
}

pub(super) fn file_rejection(path: &Path, reason: Reason, message: String) -> Rejection {
    Rejection::new(format!("file {}", path.display()), reason, message)
}

pub(super) fn unreadable(
    path: &Path,
    index: usize,
    reason: Reason,
    message: String,
) -> (Key, Object) {
    let object = format!("{} document {}", path.display(), index + 1);
    (
        unreadable_key(path, index),
        Object::Unreadable(Rejection::new(&object, reason, message)),
    )
}

/// The rejection of a second definition of `key` in `path` (the first is in `first`).
pub(super) fn duplicate(key: &Key, path: &Path, first: &Path) -> (Key, Rejection) {
    let (kind, ns, name) = key;
    let object = format!("{kind} {ns}/{name} in {}", path.display());
    (
        (
            "#duplicate",
            path.display().to_string().into(),
            format!("{kind}/{ns}/{name}").into(),
        ),
        Rejection::new(
            &object,
            Reason::DuplicateObject,
            format!(
                "defined again; the first definition, in {}, is used",
                first.display()
            ),
        ),
    )
}

/// Each document as it is parsed: converted at once, so only one YAML tree is alive at a time
/// (holding them all first peaked at hundreds of MiB for 10k services).
#[derive(Default)]
pub(super) struct Documents(Vec<Option<Vec<Converted>>>);

/// One converted item: an object, nothing (not ours), or why it is unusable.
pub(super) type Converted = Result<Option<(Key, Object)>, (Reason, String)>;

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
pub(super) fn parse_file(
    path: &Path,
    text: &str,
    limits: &FileLimits,
) -> Result<BTreeMap<Key, Object>, Rejection> {
    let docs: Documents = if path.extension().is_some_and(|e| e == "json") {
        parse_json(path, text, limits)?
    } else {
        parse_yaml(path, text, limits)?
    };
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

/// The documents of a YAML file, read with the budget of `limits` (depth, documents, nodes).
pub(super) fn parse_yaml(
    path: &Path,
    text: &str,
    limits: &FileLimits,
) -> Result<Documents, Rejection> {
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
        })
}

/// The documents of a `.json` file (one JSON value, or several one after another), read by
/// serde_json: a YAML parser reads JSON too, but at 1M endpoints it took most of the start's
/// CPU. serde_json refuses nesting deeper than 128 (the YAML budget's `max_depth` is 32); the
/// document count is held to `max_documents` as for YAML.
pub(super) fn parse_json(
    path: &Path,
    text: &str,
    limits: &FileLimits,
) -> Result<Documents, Rejection> {
    let mut docs = Documents::default();
    let values = serde_json::Deserializer::from_str(text).into_iter::<serde_json::Value>();
    for (n, value) in values.enumerate() {
        let value = value.map_err(|e| {
            let reason = if e.to_string().contains("recursion limit") {
                Reason::TooLarge
            } else {
                Reason::Unparsable
            };
            file_rejection(path, reason, format!("invalid JSON: {e}"))
        })?;
        if n >= limits.max_documents {
            return Err(file_rejection(
                path,
                Reason::TooLarge,
                format!("more than {} documents", limits.max_documents),
            ));
        }
        docs.extend(std::iter::once(value));
    }
    Ok(docs)
}

pub(super) fn object(v: serde_json::Value) -> Result<Option<(Key, Object)>, (Reason, String)> {
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
                "ServiceImport",
                input.namespace.as_str().into(),
                input.name.as_str().into(),
            );
            Ok(Some((key, Object::Import(input))))
        }
        "EndpointSlice" => {
            let es: convert::LeanSlice =
                serde_json::from_value(v).map_err(|e| unparsable(format!("EndpointSlice: {e}")))?;
            let input = convert::slice(es);
            let key = (
                "EndpointSlice",
                input.namespace.as_str().into(),
                input.name.as_str().into(),
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
                "ClusterProperty",
                "".into(),
                mcs_api::CLUSTER_ID_PROPERTY.into(),
            );
            Ok(Some((key, Object::ClusterId(cp.spec.value))))
        }
    }
}
