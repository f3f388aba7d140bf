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
    /// Its cluster id (may contain dots).
    pub cluster: String,
    /// Its hostname, or its address with dashes (`198-18-1-2`, `2001-2--5`) when it has none.
    pub hostname: String,
    /// Its address.
    pub address: IpAddr,
    /// Its slice's ports (target ports), for SRV.
    pub ports: Vec<DnsPort>,
}

/// The records of one service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRecords {
    /// `spec.type: Headless`.
    pub headless: bool,
    /// ClusterSetIPs this node programs for it (none for Headless).
    pub ips: Vec<IpAddr>,
    /// The import's ports (SRV of a ClusterSetIP service).
    pub ports: Vec<DnsPort>,
    /// Ready endpoints (Headless only), sorted, one per (cluster, address).
    pub endpoints: Vec<DnsEndpoint>,
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
        ServiceRecords {
            headless: false,
            ips: vec![ip.parse().unwrap()],
            ports: vec![],
            endpoints: vec![],
        }
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

    #[test]
    fn dashed_addresses() {
        assert_eq!(dashed("198.18.1.2".parse().unwrap()), "198-18-1-2");
        assert_eq!(dashed("2001:2::5".parse().unwrap()), "2001-2--5");
    }
}
