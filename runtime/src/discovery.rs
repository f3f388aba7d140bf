//! Which version of an MCS kind to read, asked of the API server: the group's preferred
//! version when the reader knows it, else the first it knows that is served. Clusters of one
//! ClusterSet may serve different versions (v1alpha1 only in upstream CRDs before v0.5, or
//! during an upgrade), and a version may stop being served while a reader runs.

use kube::Client;

/// The API group of ServiceImport and ServiceExport.
pub const MCS_GROUP: &str = "multicluster.x-k8s.io";
/// The versions of the MCS kinds both binaries read, in their order of preference.
pub const MCS_VERSIONS: [&str; 2] = ["v1beta1", "v1alpha1"];

/// The version to read among `served` (versions that have the kind): `preferred` when it is
/// one of them and the reader knows it, else the first of [`MCS_VERSIONS`] that is served.
pub fn choose_version<'a>(
    preferred: Option<&str>,
    served: impl IntoIterator<Item = &'a str>,
) -> Option<&'static str> {
    let served: Vec<&str> = served.into_iter().collect();
    if let Some(p) = preferred
        && served.contains(&p)
        && let Some(v) = MCS_VERSIONS.iter().find(|v| **v == p)
    {
        return Some(v);
    }
    MCS_VERSIONS.into_iter().find(|v| served.contains(v))
}

/// Asks the API server which version of MCS kind `kind` (`ServiceImport`, `ServiceExport`) to
/// read. The error says what is missing, for a log line or a member's health.
pub async fn mcs_version(client: &Client, kind: &str) -> Result<&'static str, String> {
    let group = kube::discovery::group(client, MCS_GROUP)
        .await
        .map_err(|e| {
            format!("API group {MCS_GROUP} is not served ({e}); are the MCS CRDs installed?")
        })?;
    let served: Vec<&str> = group
        .versions()
        .filter(|v| {
            group
                .versioned_resources(v)
                .iter()
                .any(|(r, _)| r.kind == kind)
        })
        .collect();
    choose_version(group.preferred_version(), served.iter().copied()).ok_or_else(|| {
        format!("{MCS_GROUP} serves {kind} in {served:?}, none of which is read ({MCS_VERSIONS:?})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_the_preferred_one_that_is_read() {
        assert_eq!(
            choose_version(Some("v1beta1"), ["v1alpha1", "v1beta1"]),
            Some("v1beta1")
        );
        // Lighthouse, Cloud Map, upstream CRDs before v0.5: v1alpha1 only.
        assert_eq!(
            choose_version(Some("v1alpha1"), ["v1alpha1"]),
            Some("v1alpha1")
        );
        // A newer preferred version nobody here knows: the best one that is read.
        assert_eq!(
            choose_version(Some("v1"), ["v1", "v1alpha1", "v1beta1"]),
            Some("v1beta1")
        );
        assert_eq!(choose_version(Some("v2"), ["v2"]), None);
        // The group prefers v1beta1 for another kind that has it.
        assert_eq!(
            choose_version(Some("v1beta1"), ["v1alpha1"]),
            Some("v1alpha1")
        );
    }
}
