//! What the API server would refuse in the metadata of a ServiceImport, checked before it is
//! written: an export whose `exportedLabels` or `exportedAnnotations` could not be written
//! (or would make the import too large to carry) is refused on its own, with a reason, instead
//! of failing every write of its import. The rules are Kubernetes' (`apimachinery`'s
//! `IsQualifiedName`, `IsValidLabelValue`, `ValidateAnnotations`), plus our bound on the
//! labels' total size.

use std::collections::BTreeMap;

/// The most bytes (keys and values) of one object's annotations (Kubernetes'
/// `TotalAnnotationSizeLimitB`).
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;
/// The most bytes (keys and values) of an export's labels. Kubernetes bounds each label, not
/// their number; this keeps an import (with [`MAX_ANNOTATION_BYTES`] of annotations and
/// [`crate::MAX_PORTS`] ports) well below the API server's request limit (~1.5 MiB).
pub const MAX_LABEL_BYTES: usize = 64 * 1024;
/// The longest label value, name part of a qualified name, or DNS label.
pub const MAX_NAME: usize = 63;
/// The longest DNS subdomain (a qualified name's prefix, an object name).
pub const MAX_SUBDOMAIN: usize = 253;

/// Why an export's metadata cannot be carried: a `Valid=False` reason and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The reason (`InvalidExportedLabels`, `InvalidExportedAnnotations`, …).
    pub reason: String,
    /// For a person (names from the object are quoted and cut short).
    pub message: String,
}

impl Refusal {
    /// A refusal with `reason` and `message`.
    pub fn new(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// `Valid=False` reason: an exported label cannot be put on a ServiceImport.
pub const INVALID_LABELS: &str = "InvalidExportedLabels";
/// `Valid=False` reason: an exported annotation cannot be put on a ServiceImport.
pub const INVALID_ANNOTATIONS: &str = "InvalidExportedAnnotations";

/// `s` quoted and escaped, at most 64 characters of it, for a message.
pub fn quoted(s: &str) -> String {
    let cut: String = s.chars().take(64).collect();
    if cut.len() < s.len() {
        format!("{cut:?}…")
    } else {
        format!("{cut:?}")
    }
}

/// Whether `s` is a DNS label (RFC 1123: 1–63 lowercase letters, digits and dashes, not
/// starting or ending with a dash).
pub fn dns_label(s: &str) -> bool {
    mcs_model::validate::dns_label(s)
}

/// Whether `s` is a DNS subdomain (RFC 1123 labels joined by dots, at most 253 bytes), as
/// Kubernetes wants object names and qualified names' prefixes.
pub fn dns_subdomain(s: &str) -> bool {
    s.len() <= MAX_SUBDOMAIN && s.split('.').all(dns_label)
}

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?` of at most 63 bytes, or empty when `empty_ok`.
fn name_part(s: &str, empty_ok: bool) -> bool {
    let b = s.as_bytes();
    if b.is_empty() {
        return empty_ok;
    }
    b.len() <= MAX_NAME
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Whether `s` is a qualified name (`[prefix/]name`): a label or annotation key.
pub fn qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        None => name_part(s, false),
        Some((prefix, name)) => {
            !prefix.is_empty() && dns_subdomain(prefix) && name_part(name, false)
        }
    }
}

/// Whether `s` is a label value (empty, or a name part of at most 63 bytes).
pub fn label_value(s: &str) -> bool {
    name_part(s, true)
}

/// Bytes of keys and values.
fn size(m: &BTreeMap<String, String>) -> usize {
    m.iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// Checks exported labels as the API server checks an object's labels (and their total
/// against [`MAX_LABEL_BYTES`]).
pub fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), Refusal> {
    let total = size(labels);
    if total > MAX_LABEL_BYTES {
        return Err(Refusal::new(
            INVALID_LABELS,
            format!("exportedLabels hold {total} bytes; at most {MAX_LABEL_BYTES} are carried"),
        ));
    }
    for (k, v) in labels {
        if !qualified_name(k) {
            return Err(Refusal::new(
                INVALID_LABELS,
                format!(
                    "exportedLabels key {} is not a qualified name ([prefix/]name: a DNS subdomain, then 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric)",
                    quoted(k)
                ),
            ));
        }
        if !label_value(v) {
            return Err(Refusal::new(
                INVALID_LABELS,
                format!(
                    "exportedLabels value of {} is not a label value (at most 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric): {}",
                    quoted(k),
                    quoted(v)
                ),
            ));
        }
    }
    Ok(())
}

/// Checks exported annotations as the API server checks an object's annotations (keys are
/// qualified names once lowercased; at most [`MAX_ANNOTATION_BYTES`] in all).
pub fn check_annotations(annotations: &BTreeMap<String, String>) -> Result<(), Refusal> {
    let total = size(annotations);
    if total > MAX_ANNOTATION_BYTES {
        return Err(Refusal::new(
            INVALID_ANNOTATIONS,
            format!(
                "exportedAnnotations hold {total} bytes; Kubernetes allows at most {MAX_ANNOTATION_BYTES}"
            ),
        ));
    }
    if let Some(k) = annotations
        .keys()
        .find(|k| !qualified_name(&k.to_ascii_lowercase()))
    {
        return Err(Refusal::new(
            INVALID_ANNOTATIONS,
            format!(
                "exportedAnnotations key {} is not a qualified name ([prefix/]name: a DNS subdomain, then 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric)",
                quoted(k)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn qualified_names_as_kubernetes_has_them() {
        for ok in [
            "a",
            "app",
            "A_b.c-D",
            "example.com/x",
            "app.kubernetes.io/managed-by",
            &"n".repeat(63),
            &format!(
                "{}/x",
                [
                    "a".repeat(63),
                    "b".repeat(63),
                    "c".repeat(63),
                    "d".repeat(61)
                ]
                .join(".")
            ),
        ] {
            assert!(qualified_name(ok), "{ok}");
        }
        for bad in [
            "",
            "bad key!",
            "-a",
            "a-",
            "/a",
            "a/",
            "a/b/c",
            "Example.com/x",
            "ex_ample.com/x",
            &"n".repeat(64),
            &format!("{}/x", "a.".repeat(127)),
            "é",
        ] {
            assert!(!qualified_name(bad), "{bad}");
        }
    }

    #[test]
    fn label_values_and_subdomains() {
        assert!(label_value("") && label_value("v1.2_x-Y") && label_value(&"v".repeat(63)));
        assert!(!label_value(&"v".repeat(64)) && !label_value("x!") && !label_value(".x"));
        assert!(dns_subdomain("a.b-c.d") && !dns_subdomain("a..b") && !dns_subdomain("a.-b"));
        assert!(!dns_subdomain(&"a".repeat(254)));
    }

    #[test]
    fn labels_refused_with_a_reason_and_a_short_message() {
        assert_eq!(check_labels(&map(&[("team", "shop"), ("a/b", "")])), Ok(()));
        let r = check_labels(&map(&[("bad key!", "x")])).unwrap_err();
        assert_eq!(r.reason, INVALID_LABELS);
        assert!(r.message.contains("\"bad key!\""), "{}", r.message);
        let r = check_labels(&map(&[("ok", &"v".repeat(64))])).unwrap_err();
        assert!(r.message.contains("value"), "{}", r.message);
        let long = "k".repeat(100_000);
        let r = check_labels(&map(&[(&long, "x")])).unwrap_err();
        assert!(
            r.message.len() < 400,
            "the key is cut short: {}",
            r.message.len()
        );
        let many: BTreeMap<String, String> = (0..2000)
            .map(|i| (format!("k{i:05}"), "v".repeat(40)))
            .collect();
        assert!(check_labels(&many).unwrap_err().message.contains("bytes"));
    }

    #[test]
    fn annotations_refused_over_256_kib_or_with_a_bad_key() {
        assert_eq!(
            check_annotations(&map(&[("Example/Upper", "any value, !?"), ("x", "")])),
            Ok(())
        );
        let big = "v".repeat(MAX_ANNOTATION_BYTES);
        assert_eq!(
            check_annotations(&map(&[("k", &big)])).unwrap_err().reason,
            INVALID_ANNOTATIONS
        );
        assert_eq!(
            check_annotations(&map(&[("k", &big[..MAX_ANNOTATION_BYTES - 1])])),
            Ok(())
        );
        assert!(check_annotations(&map(&[("bad key!", "x")])).is_err());
    }
}
