//! What a cluster id may be.

/// Whether `id` can be a cluster id: lowercase DNS labels (RFC 1123) joined by dots, at most
/// 63 bytes in all, so that it is a valid label value (`multicluster.kubernetes.io/source-cluster`
/// on every MCS EndpointSlice) and a DNS name part.
pub fn valid(id: &str) -> bool {
    id.len() <= 63 && id.split('.').all(mcs_model::validate::dns_label)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dns_labels_joined_by_dots_within_63_bytes() {
        for ok in ["c1", "east-1", "a.b", &"a".repeat(63)] {
            assert!(super::valid(ok), "{ok}");
        }
        for bad in ["", "C1", "a..b", "a.", "-a", "a_b", &"a".repeat(64), "a b"] {
            assert!(!super::valid(bad), "{bad}");
        }
    }
}
