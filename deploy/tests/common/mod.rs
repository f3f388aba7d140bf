//! What the tests of this folder share: the chart rendered by `helm template`, and YAML
//! streams read as objects.
#![allow(dead_code)] // each test binary uses its own part

use std::process::Command;

/// The ClusterSetIP ranges the chart is rendered with.
pub const TEST_CIDRS: &str = "198.18.100.0/24,2001:2::100:0/112";

/// `helm template` of the chart with [`TEST_CIDRS`] and `extra` arguments.
pub fn helm_template(extra: &[&str]) -> String {
    mcs_test_support::kubectl::stdout_of(
        Command::new("helm")
            .args(["template", "mcs"])
            .arg(mcs_deploy::dir().join("helm/mcs-dataplane"))
            .args(["--set", &format!("clustersetIPCIDRs={{{TEST_CIDRS}}}")])
            .args(extra),
        None,
    )
    .unwrap()
}

/// The objects of a YAML stream, sorted by kind, namespace and name.
pub fn objects(yaml: &str) -> Vec<serde_json::Value> {
    let mut v: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(yaml)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &serde_json::Value| !v.is_null())
        .collect();
    let key = |o: &serde_json::Value| {
        (
            o["kind"].as_str().unwrap_or_default().to_string(),
            o["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    v.sort_by_key(key);
    v
}
