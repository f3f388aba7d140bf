//! Benchmarks of mcs-dataplane.
//!
//! # Layout
//!
//! - `benches/`: criterion micro-benchmarks of the hot paths (`cargo bench -p mcs-bench`).
//! - [`fixtures`]: synthetic forwarding tables of a given size, shared by the benches.
//! - The side-by-side harness `mcs-bench` (issue 6) will live here too.
#![forbid(unsafe_code)]

/// Synthetic tables.
pub mod fixtures {
    use std::net::{IpAddr, Ipv4Addr};

    use mcs_model::{Backend, ForwardingTable, Frontend, Protocol, Service};

    /// A table of `services` frontends with `clusters × endpoints` backends each, addresses in
    /// 198.18.0.0/15.
    pub fn table(services: u32, clusters: u32, endpoints: u32) -> ForwardingTable {
        let mut t = ForwardingTable::default();
        for s in 0..services {
            let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + s);
            let f = Frontend {
                vip: IpAddr::V4(vip),
                port: 80,
                protocol: Protocol::Tcp,
            };
            let mut backends = Vec::new();
            for c in 0..clusters {
                for e in 0..endpoints {
                    let a =
                        u32::from(Ipv4Addr::new(198, 19, 0, 0)) + (s * 64 + c * 16 + e) % 65_536;
                    backends.push(Backend {
                        address: IpAddr::V4(Ipv4Addr::from(a)),
                        port: 8080,
                        cluster: format!("c{c}"),
                        zone: None,
                        ready: true,
                        serving: true,
                        terminating: false,
                        selected: c == 0,
                    });
                }
            }
            t.frontends.insert(
                f,
                Service {
                    service: format!("ns/svc{s}"),
                    affinity: None,
                    backends,
                },
            );
        }
        t
    }
}
