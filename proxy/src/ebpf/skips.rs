//! The socket LB's per-frontend skip counters (`MCS_SKIPS_V1`, written by the connect hooks
//! when passive health moves a connect off a backend the client pod failed on lately), as
//! metrics: `mcs_proxy_skipped_connections_total{frontend}` and
//! `mcs_proxy_fallback_connections_total{frontend}` (the userspace forwarder's names and
//! labels), for the frontends that skipped a backend. Read at scrape from the pinned map (per
//! CPU, summed; at most [`SKIPS_MAP_MAX_ENTRIES`] entries); nothing per connection in userspace.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use aya::maps::{Map, MapData, PerCpuHashMap};
use mcs_ebpf_common::{FrontendKey, SKIPS_MAP, SKIPS_MAP_MAX_ENTRIES, SkipCounts, proto};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, NoLabelSet},
    metrics::MetricType,
};

use super::{L4, sock4, sock6};

/// The skip counters map of an agent's pin directory, for scrapes.
#[derive(Debug)]
pub struct SkipMetrics {
    pin: PathBuf,
}

/// The counters map as the socket LB holds it, to remove a frontend's entry with the frontend.
pub(super) struct Counters(pub(super) PerCpuHashMap<MapData, FrontendKey, SkipCounts>);

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Counters")
    }
}

impl Counters {
    /// Removes the counters of the frontend `vip`/`l4` (none: nothing to do).
    pub(super) fn remove(&mut self, vip: SocketAddr, l4: L4) {
        let _ = self.0.remove(&key(vip, l4));
    }
}

/// The counters map's key of a frontend.
pub(super) fn key(vip: SocketAddr, l4: L4) -> FrontendKey {
    let (addr, family) = match vip {
        SocketAddr::V4(a) => ([u32::from_ne_bytes(a.ip().octets()), 0, 0, 0], 4),
        SocketAddr::V6(a) => (super::ip6_words(*a.ip()), 6),
    };
    FrontendKey {
        addr,
        port: vip.port().to_be(),
        proto: l4.number(),
        family,
    }
}

/// The frontend label of a key, as `mcs_model::Frontend` prints it (`198.18.0.10:80/TCP`).
fn label(k: &FrontendKey) -> String {
    let vip = match k.family {
        4 => sock4(k.addr[0], k.port),
        _ => sock6(k.addr, k.port),
    };
    let p = if k.proto == proto::UDP { "UDP" } else { "TCP" };
    format!("{vip}/{p}")
}

/// Opens the counters map pinned in `pin_dir`.
pub(super) fn open(
    pin_dir: &Path,
) -> Result<PerCpuHashMap<MapData, FrontendKey, SkipCounts>, aya::maps::MapError> {
    let data = MapData::from_pin(pin_dir.join(SKIPS_MAP))?;
    PerCpuHashMap::try_from(Map::from_map_data(data)?)
}

impl SkipMetrics {
    /// The counters of the socket LB pinned in `pin_dir`.
    pub fn new(pin_dir: &Path) -> Self {
        Self {
            pin: pin_dir.to_path_buf(),
        }
    }

    /// Every frontend with a skip, with its counts summed over the CPUs (at most the map's
    /// size; none when the map is not there: an agent before these counters).
    pub fn read(&self) -> Vec<(String, SkipCounts)> {
        let Ok(map) = open(&self.pin) else {
            return Vec::new();
        };
        map.iter()
            .take(SKIPS_MAP_MAX_ENTRIES as usize)
            .filter_map(Result::ok)
            .map(|(k, per_cpu)| {
                let sum = per_cpu
                    .iter()
                    .fold(SkipCounts::default(), |a, c| SkipCounts {
                        skipped: a.skipped.saturating_add(c.skipped),
                        fallback: a.fallback.saturating_add(c.fallback),
                    });
                (label(&k), sum)
            })
            .collect()
    }
}

/// A counter family: name, help, and its value in a frontend's counts.
type Family = (&'static str, &'static str, fn(&SkipCounts) -> u64);

impl Collector for SkipMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let counts = self.read();
        let families: [Family; 2] = [
            (
                crate::userspace::metrics::SKIPPED_CONNECTIONS.0,
                crate::userspace::metrics::SKIPPED_CONNECTIONS.1,
                |c| c.skipped,
            ),
            (
                "fallback_connections",
                "Connections taken by a fallback backend (another cluster's or zone's) because every selected backend is skipped after failed connects (eBPF: frontends that skipped one)",
                |c| c.fallback,
            ),
        ];
        for (name, help, value) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (frontend, c) in &counts {
                family
                    .encode_family(&[("frontend", frontend.as_str())])?
                    .encode_counter::<NoLabelSet, _, u64>(&value(c), None)?;
            }
        }
        Ok(())
    }
}
