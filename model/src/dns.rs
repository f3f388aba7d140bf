//! What `clusterset.local` DNS answers from: per service, the records the MCS DNS
//! specification (1.0.0) gives it, derived by the [`crate::Index`] from the same validated
//! imports and slices as the forwarding table (no second watch), and a [`Zone`] that holds
//! them, updated per changed service (O(change)) and read by the DNS server.
//!
//! Wire format and query logic are `mcs-dns`'s; this module is plain data.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, RwLock},
};

use crate::{Protocol, input::ServiceRef};

/// A port as DNS publishes it (SRV).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DnsPort {
    /// Port name (SRV `_<name>._<proto>` needs one).
    pub name: Option<String>,
    /// Protocol.
    pub protocol: Protocol,
    /// Port number.
    pub port: u16,
}

/// A ready endpoint of a headless service.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DnsEndpoint {
    /// Its cluster id (may contain dots; shared with the index's other copies).
    pub cluster: Arc<str>,
    /// Its hostname, or its address with dashes (`198-18-1-2`, `2001-2--5`) when it has none.
    pub hostname: Box<str>,
    /// Its address.
    pub address: IpAddr,
    /// Its slice's ports (target ports), for SRV: one allocation per slice, shared by every
    /// endpoint of it.
    pub ports: Arc<[DnsPort]>,
}

/// The records of one service. Built by [`ServiceRecords::cluster_set_ip`] or
/// [`ServiceRecords::headless`], which also index the endpoints' names (a lookup by name is
/// a binary search, not a walk over every endpoint).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRecords {
    /// `spec.type: Headless`.
    pub headless: bool,
    /// ClusterSetIPs this node programs for it (none for Headless).
    pub ips: Vec<IpAddr>,
    /// The import's ports (SRV of a ClusterSetIP service).
    pub ports: Vec<DnsPort>,
    /// Ready endpoints (Headless only), sorted by (cluster, address), one per (cluster,
    /// address).
    endpoints: Vec<DnsEndpoint>,
    /// `<hostname>.<cluster>` of every endpoint whose name is a valid DNS name, sorted, with
    /// the endpoint's index. Endpoints that share a name (a hostname used twice in a cluster)
    /// are one name with several addresses: one SRV target, not duplicates.
    names: Vec<(Box<str>, usize)>,
    /// The empty non-terminals above those names: each named cluster id and its dotted
    /// suffixes (`eu.c2`, `c2`), sorted, distinct.
    clusters: Vec<Box<str>>,
}

impl ServiceRecords {
    /// A ClusterSetIP service: its addresses (those this node programs) and ports.
    pub fn cluster_set_ip(ips: Vec<IpAddr>, ports: Vec<DnsPort>) -> Self {
        Self {
            headless: false,
            ips,
            ports,
            endpoints: Vec::new(),
            names: Vec::new(),
            clusters: Vec::new(),
        }
    }

    /// A headless service: its import's ports and its ready endpoints (any order; one is kept
    /// per (cluster, address), the one with the smallest hostname, with the union of their
    /// ports, so the records do not depend on the order slices came in). An endpoint whose
    /// `<hostname>.<cluster>` is not a valid DNS name keeps its address records at the
    /// service's name but gets no name of its own (and so no SRV record): a name that does
    /// not resolve is never published.
    pub fn headless(ports: Vec<DnsPort>, mut endpoints: Vec<DnsEndpoint>) -> Self {
        endpoints.sort_by(|a, b| {
            (&a.cluster, a.address, &a.hostname, &a.ports).cmp(&(
                &b.cluster,
                b.address,
                &b.hostname,
                &b.ports,
            ))
        });
        // One endpoint per (cluster, address), whatever order its slices came in: the same
        // address in two slices of a cluster keeps the first hostname in that order and the
        // union of both slices' ports.
        let mut merged: Vec<DnsEndpoint> = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            match merged.last_mut() {
                Some(last) if last.cluster == e.cluster && last.address == e.address => {
                    if last.ports != e.ports {
                        let mut ports: Vec<DnsPort> =
                            last.ports.iter().chain(e.ports.iter()).cloned().collect();
                        ports.sort();
                        ports.dedup();
                        last.ports = ports.into();
                    }
                }
                _ => merged.push(e),
            }
        }
        merged.shrink_to_fit();
        let endpoints = merged;
        let mut names = Vec::new();
        let mut clusters: Vec<Box<str>> = Vec::new();
        for (i, e) in endpoints.iter().enumerate() {
            let name = format!("{}.{}", e.hostname, e.cluster);
            if !valid_name(&name) {
                continue;
            }
            names.push((name.into_boxed_str(), i));
            if clusters.last().is_none_or(|c| **c != *e.cluster) {
                let mut rest: &str = &e.cluster;
                loop {
                    clusters.push(rest.into());
                    match rest.split_once('.') {
                        Some((_, r)) => rest = r,
                        None => break,
                    }
                }
            }
        }
        names.sort();
        clusters.sort();
        clusters.dedup();
        Self {
            headless: true,
            ips: Vec::new(),
            ports,
            endpoints,
            names,
            clusters,
        }
    }

    /// The ready endpoints (Headless only), sorted by (cluster, address).
    pub fn endpoints(&self) -> &[DnsEndpoint] {
        &self.endpoints
    }

    /// The distinct endpoint names (`<hostname>.<cluster>`), sorted.
    pub fn names(&self) -> Vec<&str> {
        self.names
            .chunk_by(|a, b| a.0 == b.0)
            .map(|group| &*group[0].0)
            .collect()
    }

    /// The endpoints named `name` (`<hostname>.<cluster>`, lowercase).
    pub fn lookup(&self, name: &str) -> Vec<&DnsEndpoint> {
        let from = self.names.partition_point(|(n, _)| &**n < name);
        self.names[from..]
            .iter()
            .take_while(|(n, _)| &**n == name)
            .map(|(_, i)| &self.endpoints[*i])
            .collect()
    }

    /// Whether `name` (lowercase) is an empty non-terminal above some endpoint's name: a
    /// named cluster id or a dotted suffix of one.
    pub fn is_cluster(&self, name: &str) -> bool {
        self.clusters.binary_search_by(|c| (**c).cmp(name)).is_ok()
    }
}

/// Whether `name` (dotted labels, no trailing dot) is made of valid DNS labels as Kubernetes
/// allows them (lowercase RFC 1123 labels). A name too long to sit under its service's name
/// is left out by the answerer.
fn valid_name(name: &str) -> bool {
    name.split('.').all(crate::validate::dns_label)
}

/// `198.18.1.2` → `198-18-1-2`; `2001:2::5` → `2001-2--5`.
pub fn dashed(ip: IpAddr) -> String {
    ip.to_string().replace(['.', ':'], "-")
}

/// The services DNS answers for, by (namespace, name). Writers replace one service at a time;
/// readers take a read lock for one lookup (no copy of the zone per change or per query).
#[derive(Debug, Default)]
pub struct Zone {
    inner: RwLock<ZoneInner>,
}

#[derive(Debug, Default)]
struct ZoneInner {
    services: HashMap<ServiceRef, Arc<ServiceRecords>>,
    /// Services per namespace (a namespace with none is not a name).
    namespaces: HashMap<String, usize>,
    /// Bumped on every change (the SOA serial).
    serial: u32,
}

impl Zone {
    /// An empty zone.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets (or with `None` removes) one service's records.
    pub fn set(&self, svc: &ServiceRef, records: Option<ServiceRecords>) {
        let mut z = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let old = match records {
            Some(r) => {
                if z.services.get(svc).is_some_and(|o| **o == r) {
                    return;
                }
                z.services.insert(svc.clone(), Arc::new(r))
            }
            None => z.services.remove(svc),
        };
        let added = z.services.contains_key(svc);
        match (old.is_some(), added) {
            (false, true) => *z.namespaces.entry(svc.namespace.clone()).or_default() += 1,
            (true, false) => {
                if let Some(n) = z.namespaces.get_mut(&svc.namespace) {
                    *n -= 1;
                    if *n == 0 {
                        z.namespaces.remove(&svc.namespace);
                    }
                }
            }
            (false, false) => return,
            (true, true) => {}
        }
        z.serial = z.serial.wrapping_add(1);
    }

    /// One service's records (`namespace`, `name` as Kubernetes spells them: lowercase).
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<ServiceRecords>> {
        let z = self.inner.read().unwrap_or_else(|p| p.into_inner());
        z.services.get(&ServiceRef::new(namespace, name)).cloned()
    }

    /// Whether any service lives in `namespace`.
    pub fn has_namespace(&self, namespace: &str) -> bool {
        let z = self.inner.read().unwrap_or_else(|p| p.into_inner());
        z.namespaces.contains_key(namespace)
    }

    /// The number of services.
    pub fn len(&self) -> usize {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .services
            .len()
    }

    /// Whether it holds no service.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Changes so far (the SOA serial).
    pub fn serial(&self) -> u32 {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).serial
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ip: &str) -> ServiceRecords {
        ServiceRecords::cluster_set_ip(vec![ip.parse().unwrap()], vec![])
    }

    #[test]
    fn zone_counts_namespaces_and_bumps_the_serial_only_on_change() {
        let z = Zone::new();
        let (a, b) = (ServiceRef::new("ns", "a"), ServiceRef::new("ns", "b"));
        z.set(&a, Some(rec("198.18.0.1")));
        z.set(&b, Some(rec("198.18.0.2")));
        assert!(z.has_namespace("ns") && !z.has_namespace("other"));
        let serial = z.serial();
        z.set(&a, Some(rec("198.18.0.1")));
        assert_eq!(z.serial(), serial, "an unchanged service is no change");
        z.set(&a, None);
        assert!(z.has_namespace("ns"));
        z.set(&b, None);
        z.set(&b, None);
        assert!(!z.has_namespace("ns") && z.is_empty());
        assert_eq!(z.serial(), serial + 2);
    }

    fn ep(cluster: &str, hostname: &str, addr: &str, ports: &Arc<[DnsPort]>) -> DnsEndpoint {
        DnsEndpoint {
            cluster: cluster.into(),
            hostname: hostname.into(),
            address: addr.parse().unwrap(),
            ports: ports.clone(),
        }
    }

    #[test]
    fn headless_records_index_valid_names_merge_duplicates_and_skip_bad_clusters() {
        let ports: Arc<[DnsPort]> = Arc::from(vec![DnsPort {
            name: Some("http".into()),
            protocol: Protocol::Tcp,
            port: 80,
        }]);
        let r = ServiceRecords::headless(
            vec![],
            vec![
                ep("eu.c2", "db-0", "198.18.68.3", &ports),
                ep("c1", "db-0", "198.18.64.2", &ports),
                // The same hostname twice in a cluster: one name, two addresses.
                ep("c1", "db-0", "198.18.64.9", &ports),
                // The same (cluster, address) twice: one endpoint.
                ep("c1", "db-z", "198.18.64.2", &ports),
                // Cluster ids no DNS name can hold: addresses kept, no name.
                ep("C3", "db-0", "198.18.65.1", &ports),
                ep("c4.", "db-0", "198.18.65.2", &ports),
                ep("c\\5", "db-0", "198.18.65.3", &ports),
            ],
        );
        assert_eq!(r.endpoints().len(), 6);
        assert!(
            Arc::ptr_eq(&r.endpoints()[0].ports, &ports),
            "ports are shared"
        );
        assert_eq!(r.names(), ["db-0.c1", "db-0.eu.c2"]);
        assert_eq!(r.lookup("db-0.c1").len(), 2);
        assert!(r.lookup("db-z.c1").is_empty() && r.lookup("db-0.c3").is_empty());
        assert!(r.is_cluster("c1") && r.is_cluster("eu.c2") && r.is_cluster("c2"));
        assert!(!r.is_cluster("c3") && !r.is_cluster("eu"));
    }

    /// Found by `incremental_diffs_equal_a_fresh_compute_at_the_caps`: the same address in
    /// two slices of a cluster, one without ports, gave records that depended on which slice
    /// came first.
    #[test]
    fn one_address_in_two_slices_gives_the_same_records_in_either_order() {
        let none: Arc<[DnsPort]> = Arc::from(vec![]);
        let tcp = |port| DnsPort {
            name: None,
            protocol: Protocol::Tcp,
            port,
        };
        let p80: Arc<[DnsPort]> = Arc::from(vec![tcp(80)]);
        let p81: Arc<[DnsPort]> = Arc::from(vec![tcp(81)]);
        let a = vec![
            ep("c2", "2001-2--1-2", "2001:2::1:2", &none),
            ep("c2", "2001-2--1-2", "2001:2::1:2", &p81),
            ep("c2", "2001-2--1-2", "2001:2::1:2", &p80),
        ];
        let mut b = a.clone();
        b.reverse();
        let (ra, rb) = (
            ServiceRecords::headless(vec![], a),
            ServiceRecords::headless(vec![], b),
        );
        assert_eq!(ra, rb);
        assert_eq!(ra.endpoints().len(), 1);
        assert_eq!(&*ra.endpoints()[0].ports, &[tcp(80), tcp(81)]);
    }

    #[test]
    fn dashed_addresses() {
        assert_eq!(dashed("198.18.1.2".parse().unwrap()), "198-18-1-2");
        assert_eq!(dashed("2001:2::5".parse().unwrap()), "2001-2--5");
    }
}
