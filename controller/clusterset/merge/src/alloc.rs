//! ClusterSetIP allocation: the first free address of a range, probing from a point derived
//! from the service's name, so that clusters that allocate independently (each writes its own
//! imports) mostly give a service the same ClusterSetIP. The import is the record: a
//! controller that restarts keeps the addresses its imports already have and reserves them
//! before allocating anything.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use mcs_model::guard::IpCidr;

/// Addresses in use and the ranges to allocate from.
#[derive(Clone, Debug)]
pub struct Allocator {
    ranges: Vec<IpCidr>,
    used: BTreeSet<IpAddr>,
}

/// How many addresses are probed at most per allocation (a full range fails faster than a
/// scan of a /8 would).
const MAX_PROBES: u128 = 1 << 20;

impl Allocator {
    /// An allocator over `ranges` with nothing in use.
    pub fn new(ranges: Vec<IpCidr>) -> Self {
        Self {
            ranges,
            used: BTreeSet::new(),
        }
    }

    /// Whether `ip` lies in one of the ranges (and is not its network or broadcast address).
    pub fn allowed(&self, ip: IpAddr) -> bool {
        self.ranges.iter().any(|r| {
            r.contains(ip) && {
                let (size, base) = span(r);
                let off = offset(base, ip);
                off != 0 && !(ip.is_ipv4() && size > 2 && off == size - 1)
            }
        })
    }

    /// Marks `ip` as in use; false when it already was.
    pub fn reserve(&mut self, ip: IpAddr) -> bool {
        self.used.insert(ip)
    }

    /// Frees `ip`.
    pub fn release(&mut self, ip: IpAddr) {
        self.used.remove(&ip);
    }

    /// Allocates a free address of the family (`IPv4`/`IPv6`) for `name`, or `None` when no
    /// range of that family has room.
    pub fn allocate(&mut self, family: &str, name: &str) -> Option<IpAddr> {
        let want_v4 = match family {
            "IPv4" => true,
            "IPv6" => false,
            _ => return None,
        };
        let h = u128::from(fnv1a(name.as_bytes()));
        for r in self.ranges.iter().filter(|r| r.addr().is_ipv4() == want_v4) {
            let (size, base) = span(r);
            // Usable offsets: 1 ..= size - 2 for IPv4 (no network, no broadcast), 1 ..
            // size - 1 for IPv6 (no subnet-router anycast at 0).
            let (first, last) = if want_v4 && size > 2 {
                (1, size - 2)
            } else {
                (1, size.saturating_sub(1))
            };
            if last < first {
                continue;
            }
            let n = last - first + 1;
            let start = h % n;
            for i in 0..n.min(MAX_PROBES) {
                let off = first + (start + i) % n;
                let ip = at(base, off, want_v4);
                if self.used.insert(ip) {
                    return Some(ip);
                }
            }
        }
        None
    }
}

/// (number of addresses, network address as a number).
fn span(r: &IpCidr) -> (u128, u128) {
    let bits: u32 = if r.addr().is_ipv4() { 32 } else { 128 };
    let host = bits - u32::from(r.prefix_len());
    let size = if host >= 128 {
        u128::MAX
    } else {
        1u128 << host
    };
    (size, to_u128(r.addr()))
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn offset(base: u128, ip: IpAddr) -> u128 {
    to_u128(ip).wrapping_sub(base)
}

fn at(base: u128, off: u128, v4: bool) -> IpAddr {
    let v = base.wrapping_add(off);
    if v4 {
        // An IPv4 range's addresses stay in 32 bits (offsets are below its size).
        IpAddr::V4(Ipv4Addr::from(v as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(v))
    }
}

/// FNV-1a, 64 bits: stable across runs and machines (unlike std's hasher).
pub fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> IpCidr {
        let (a, l) = s.split_once('/').unwrap();
        IpCidr::new(a.parse().unwrap(), l.parse().unwrap()).unwrap()
    }

    #[test]
    fn allocates_inside_the_range_without_network_broadcast_or_reuse() {
        let mut a = Allocator::new(vec![cidr("198.18.100.0/30"), cidr("2001:2::100:0/126")]);
        let x = a.allocate("IPv4", "ns/a").unwrap();
        let y = a.allocate("IPv4", "ns/b").unwrap();
        assert_ne!(x, y);
        let mut got = [x, y];
        got.sort();
        assert_eq!(
            got,
            [
                "198.18.100.1".parse::<IpAddr>().unwrap(),
                "198.18.100.2".parse().unwrap()
            ]
        );
        assert_eq!(a.allocate("IPv4", "ns/c"), None, "a /30 has two addresses");
        let v6 = a.allocate("IPv6", "ns/a").unwrap();
        assert!(
            cidr("2001:2::100:0/126").contains(v6)
                && v6 != "2001:2::100:0".parse::<IpAddr>().unwrap()
        );
        assert_eq!(a.allocate("IPv5", "ns/a"), None);
        a.release(x);
        assert_eq!(a.allocate("IPv4", "ns/d"), Some(x));
    }

    #[test]
    fn the_same_name_gets_the_same_address_in_independent_allocators() {
        let r = vec![cidr("198.18.64.0/18")];
        let mut a = Allocator::new(r.clone());
        let mut b = Allocator::new(r);
        for i in 0..100 {
            let n = format!("ns/svc{i}");
            assert_eq!(a.allocate("IPv4", &n), b.allocate("IPv4", &n));
        }
    }

    #[test]
    fn allowed_and_reserved_addresses() {
        let mut a = Allocator::new(vec![cidr("198.18.100.0/24")]);
        assert!(a.allowed("198.18.100.7".parse().unwrap()));
        assert!(!a.allowed("198.18.100.0".parse().unwrap()));
        assert!(!a.allowed("198.18.100.255".parse().unwrap()));
        assert!(!a.allowed("198.18.101.1".parse().unwrap()));
        assert!(a.reserve("198.18.100.7".parse().unwrap()));
        assert!(!a.reserve("198.18.100.7".parse().unwrap()));
    }
}
