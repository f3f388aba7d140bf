//! Benchmarks of mcs-dataplane.
//!
//! # Layout
//!
//! - `benches/`: criterion micro-benchmarks of the hot paths (`cargo bench -p mcs-bench`).
//! - [`fixtures`]: synthetic ClusterSets of a given size, shared by the benches.
//! - [`harness`]: the side-by-side harness behind the `mcs-bench` binary.
//! - [`faults`]: the fault suite (`mcs-bench faults`).
//! - [`controller_scale`]: the MCS controller at scale (`mcs-bench controller-scale`).
//! - [`export_demo`]: the export story (`mcs-bench export-demo`, part of `scripts/demo.sh`).
#![forbid(unsafe_code)]

pub mod controller_scale;
pub mod dns_perf;
pub mod export_demo;
pub mod faults;
pub mod harness;
pub mod lifecycle;
pub mod scale;

/// Synthetic inputs.
pub mod fixtures {
    use std::{collections::BTreeMap, net::Ipv4Addr};

    use mcs_model::{
        input::{EndpointInput, ImportInput, ImportPortInput, SliceInput, SlicePortInput},
        validate::{LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER},
    };

    /// `services` ServiceImports, each with one slice per cluster of `endpoints` endpoints;
    /// addresses in 198.18.0.0/15.
    pub fn clusterset(
        services: u32,
        clusters: u32,
        endpoints: u32,
    ) -> (Vec<ImportInput>, Vec<SliceInput>) {
        let base_vip = u32::from(Ipv4Addr::new(198, 18, 0, 0));
        let base_ep = u32::from(Ipv4Addr::new(198, 19, 0, 0));
        let mut imports = Vec::new();
        let mut slices = Vec::new();
        for s in 0..services {
            imports.push(ImportInput {
                namespace: format!("ns{}", s % 100),
                name: format!("svc{s}"),
                created: Some("2026-11-01T00:00:00Z".into()),
                type_: "ClusterSetIP".into(),
                ips: vec![Ipv4Addr::from(base_vip + s).to_string()],
                ports: vec![ImportPortInput {
                    name: Some("http".into()),
                    protocol: Some("TCP".into()),
                    port: 80,
                }],
                ..Default::default()
            });
            for c in 0..clusters {
                slices.push(slice(s, c, endpoints, base_ep, None));
            }
        }
        (imports, slices)
    }

    /// The slice of service `s` in cluster `c`; endpoint `not_ready` (if any) is not ready.
    pub fn slice(
        s: u32,
        c: u32,
        endpoints: u32,
        base_ep: u32,
        not_ready: Option<u32>,
    ) -> SliceInput {
        SliceInput {
            namespace: format!("ns{}", s % 100),
            name: format!("svc{s}-c{c}"),
            labels: BTreeMap::from([
                (LABEL_SERVICE_NAME.to_string(), format!("svc{s}")),
                (LABEL_SOURCE_CLUSTER.to_string(), format!("c{c}")),
            ]),
            address_type: "IPv4".into(),
            ports: vec![SlicePortInput {
                name: Some("http".into()),
                protocol: Some("TCP".into()),
                port: Some(8080),
            }],
            endpoints: (0..endpoints)
                .map(|e| EndpointInput {
                    addresses: vec![
                        Ipv4Addr::from(base_ep + (s * 64 + c * 16 + e) % 131_072).to_string(),
                    ],
                    ready: Some(not_ready != Some(e)),
                    ..Default::default()
                })
                .collect(),
        }
    }

    /// The table of 10k ServiceImports × 3 clusters × 10 endpoints, computed by the index
    /// (only the local cluster `c0` selected).
    pub fn table_10k() -> mcs_model::ForwardingTable {
        let (imports, slices) = clusterset(10_000, 3, 10);
        mcs_model::compute(
            mcs_model::NodeConfig {
                cluster_id: "c0".into(),
                zone: None,
                ..Default::default()
            },
            imports,
            slices,
        )
        .0
    }

    /// Base of endpoint addresses used by [`clusterset`].
    pub fn endpoint_base() -> u32 {
        u32::from(Ipv4Addr::new(198, 19, 0, 0))
    }
}

/// Resident memory of this process in bytes (Linux `/proc/self/statm`), for memory reports.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
