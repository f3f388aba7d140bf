//! The address plan and knobs shared by the control-plane benches at scale (`control_plane`,
//! `agent_memory`): import `i` has VIP 198.18.0.0 + i and, per cluster `c`, five endpoints in
//! 198.19.192.0/18.

use std::net::Ipv4Addr;

/// Most imports the address plan holds: VIPs are 198.18.0.0 + i, below the endpoints'
/// 198.19.192.0/18.
pub const MAX_IMPORTS: usize = 0x1_c000;
/// The ranges that hold every VIP (`--clusterset-ip-cidr`); the endpoints are outside.
pub const VIP_CIDRS: [&str; 3] = ["198.18.0.0/16", "198.19.0.0/17", "198.19.128.0/18"];

/// The VIP of import `i`.
pub fn vip(i: usize) -> String {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i as u32).to_string()
}

/// Endpoint `e` of cluster `c` of import `i`: in 198.19.192.0/18, so shared by many imports
/// at large sizes (as pods' addresses are not, but the index does not care).
pub fn endpoint(i: usize, c: usize, e: usize) -> String {
    let base = u32::from(Ipv4Addr::new(198, 19, 192, 0));
    Ipv4Addr::from(base + ((i * 16 + c * 8 + e) % 16_000) as u32).to_string()
}

/// A count from the environment, or `default` when unset or not a number.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// ServiceImport `svc<i>` in namespace `ns`: one VIP, port 80/TCP named `http`.
pub fn import_json(ns: &str, i: usize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
        "metadata": { "name": format!("svc{i}"), "namespace": ns },
        "spec": { "type": "ClusterSetIP", "ips": [vip(i)],
                  "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] }
    })
}

/// EndpointSlice `svc<i>-c<c>`: cluster `c`'s five endpoints of import `i`, port 8080; all
/// ready but `unready`.
pub fn slice_json(ns: &str, i: usize, c: usize, unready: Option<usize>) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": format!("svc{i}-c{c}"), "namespace": ns, "labels": {
            "multicluster.kubernetes.io/service-name": format!("svc{i}"),
            "multicluster.kubernetes.io/source-cluster": format!("c{c}"),
            "endpointslice.kubernetes.io/managed-by": "bench" } },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
        "endpoints": (0..5).map(|e| serde_json::json!({
            "addresses": [endpoint(i, c, e)], "conditions": { "ready": unready != Some(e) } }))
            .collect::<Vec<_>>()
    })
}
