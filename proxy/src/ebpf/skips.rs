//! The socket LB's per-frontend skip counters (`MCS_SKIPS_V1`, written by the connect hooks
//! when passive health moves a connect off a backend the client pod failed on lately), as
//! metrics: `mcs_proxy_skipped_connections_total{frontend}` and
//! `mcs_proxy_fallback_connections_total{frontend}` (the userspace forwarder's names and
//! labels), for the frontends that skipped a backend. Read from the pinned map at most once a
//! second, however often `/metrics` is asked (at most [`SKIPS_MAP_MAX_ENTRIES`] entries, two
//! system calls each); nothing per connection in userspace.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData};
use mcs_ebpf_common::{FrontendKey, SKIPS_MAP, SKIPS_MAP_MAX_ENTRIES, SkipCounts};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, NoLabelSet},
    metrics::MetricType,
};

use super::{L4, sock4, sock6};

/// How long a read of the counters serves the scrapes that follow it.
const READ_EVERY: Duration = Duration::from_secs(1);

/// The counters map as the socket LB holds it, to remove a frontend's entry with the frontend.
pub(super) struct Counters(pub(super) HashMap<MapData, FrontendKey, SkipCounts>);

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

    /// Removes every entry whose frontend `keep` does not name: a connect that read its
    /// frontend just before the frontend was removed may have made one after it.
    pub(super) fn retain(&mut self, keep: impl Fn(SocketAddr, L4) -> bool) {
        let stale: Vec<FrontendKey> = self
            .0
            .keys()
            .take(SKIPS_MAP_MAX_ENTRIES as usize)
            .filter_map(Result::ok)
            .filter(|k| {
                let l4 = L4::from_number(k.proto);
                !l4.is_some_and(|l4| keep(vip(k), l4))
            })
            .collect();
        for k in stale {
            let _ = self.0.remove(&k);
        }
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

/// The ClusterSetIP and port of a key.
fn vip(k: &FrontendKey) -> SocketAddr {
    match k.family {
        4 => sock4(k.addr[0], k.port),
        _ => sock6(k.addr, k.port),
    }
}

/// The frontend label of a key, as `mcs_model::Frontend` prints it (`198.18.0.10:80/TCP`).
fn label(k: &FrontendKey) -> String {
    let p = L4::from_number(k.proto).map_or("?", L4::name);
    format!("{}/{p}", vip(k))
}

/// Opens the counters map pinned in `pin_dir`.
fn open(pin_dir: &Path) -> Result<HashMap<MapData, FrontendKey, SkipCounts>, aya::maps::MapError> {
    let data = MapData::from_pin(pin_dir.join(SKIPS_MAP))?;
    HashMap::try_from(Map::from_map_data(data)?)
}

/// The skip counters of an agent's pin directory, for scrapes.
#[derive(Debug)]
pub struct SkipMetrics {
    pin: PathBuf,
    /// The last read, and when.
    last: Mutex<Option<(Instant, BTreeMap<String, SkipCounts>)>>,
}

impl SkipMetrics {
    /// The counters of the socket LB pinned in `pin_dir`.
    pub fn new(pin_dir: &Path) -> Self {
        Self {
            pin: pin_dir.to_path_buf(),
            last: Mutex::new(None),
        }
    }

    /// Every frontend with a skip and its counts (at most the map's size, each frontend once
    /// even if the walk restarted; none when the map is not there: an agent before these
    /// counters), read again only when the last read is a second old.
    pub fn read(&self) -> BTreeMap<String, SkipCounts> {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, counts)) = last.as_ref()
            && at.elapsed() < READ_EVERY
        {
            return counts.clone();
        }
        let counts: BTreeMap<String, SkipCounts> = open(&self.pin)
            .map(|map| {
                map.iter()
                    .take(SKIPS_MAP_MAX_ENTRIES as usize)
                    .filter_map(Result::ok)
                    .map(|(k, c)| (label(&k), c))
                    .collect()
            })
            .unwrap_or_default();
        *last = Some((Instant::now(), counts.clone()));
        counts
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
                "Connects a fallback backend (another cluster's or zone's) took because every selected backend tried was skipped after failed connects (eBPF: counted at connect, for frontends that skipped one)",
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
