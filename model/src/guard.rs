//! What a node allows the index to program, whatever the objects say: the ClusterSetIP ranges,
//! the addresses the agent itself depends on, the slice managers it trusts, and the caps that
//! keep a hostile object from exhausting the node. Parsed once at the edge (the agent's flags)
//! and handed to the index inside [`crate::NodeConfig`].

use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

/// An IP prefix, `198.18.0.0/15` or `2001:2::/48`. Host bits must be zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IpCidr {
    addr: IpAddr,
    len: u8,
}

impl IpCidr {
    /// A prefix; `None` when `len` is too long for the family or host bits are set.
    pub fn new(addr: IpAddr, len: u8) -> Option<Self> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let c = Self { addr, len };
        (len <= max && c.mask(addr) == addr).then_some(c)
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    fn mask(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => {
                let bits = u32::from(v4);
                let m = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from(bits & m))
            }
            IpAddr::V6(v6) => {
                let bits = u128::from(v6);
                let m = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(bits & m))
            }
        }
    }

    /// Whether `ip` (of the same family) is inside the prefix.
    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.addr.is_ipv4() && self.mask(ip) == self.addr
    }
}

impl fmt::Display for IpCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl FromStr for IpCidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, l) = s
            .trim()
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (address/length, e.g. 198.18.0.0/16)"))?;
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?}: {a:?} is not an IP address"))?;
        let len: u8 = l
            .parse()
            .map_err(|_| format!("{s:?}: {l:?} is not a prefix length"))?;
        if noncanonical(addr).is_some() {
            return Err(format!(
                "{s:?}: give IPv4 ranges in IPv4 form, not as IPv4-mapped/compatible IPv6"
            ));
        }
        IpCidr::new(addr, len)
            .ok_or_else(|| format!("{s:?}: the prefix length is too long or host bits are set"))
    }
}

/// Parses ClusterSetIP ranges as `--clusterset-ip-cidr` gives them (agent and MCS controller
/// alike): empty entries (an unset ConfigMap key) are skipped; a range wider than /8 (IPv4) or
/// /32 (IPv6) is refused, since a range that covers other networks lets any ServiceImport
/// redirect their traffic.
pub fn parse_clusterset_ranges<S: AsRef<str>>(values: &[S]) -> Result<Vec<IpCidr>, String> {
    let mut out = Vec::new();
    for v in values
        .iter()
        .map(|v| v.as_ref().trim())
        .filter(|v| !v.is_empty())
    {
        let c: IpCidr = v
            .parse()
            .map_err(|e| format!("--clusterset-ip-cidr: {e}"))?;
        let min = if c.addr().is_ipv4() { 8 } else { 32 };
        if c.prefix_len() < min {
            return Err(format!(
                "--clusterset-ip-cidr {c} is wider than /{min}: a ClusterSetIP range that covers \
                 other networks lets any ServiceImport redirect their traffic"
            ));
        }
        out.push(c);
    }
    Ok(out)
}

/// Why an address is a second spelling of another one (IPv4 written as IPv6), if it is.
/// Such forms are rejected, never normalised: one address has one spelling in the table, so
/// conflicts and loops are decided on the real address.
pub fn noncanonical(ip: IpAddr) -> Option<&'static str> {
    let IpAddr::V6(v6) = ip else { return None };
    let s = v6.segments();
    if v6.to_ipv4_mapped().is_some() {
        return Some("an IPv4-mapped IPv6 address (::ffff:a.b.c.d)");
    }
    // IPv4-compatible (deprecated, RFC 4291 2.5.5.1): ::a.b.c.d, except :: and ::1.
    if s[..6] == [0; 6] && !v6.is_unspecified() && !v6.is_loopback() {
        return Some("an IPv4-compatible IPv6 address (::a.b.c.d)");
    }
    // NAT64 well-known prefix 64:ff9b::/96 (RFC 6052) and local-use 64:ff9b:1::/48 (RFC 8215).
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..3] == [0x64, 0xff9b, 1] {
        return Some("a NAT64 address (64:ff9b::/96, 64:ff9b:1::/48)");
    }
    None
}

/// Caps on what objects may ask for. Each is a rejection with a reason when exceeded, never
/// an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Ports of one ServiceImport (more: the import is rejected).
    pub ports_per_import: usize,
    /// Ports of one EndpointSlice (the API's own limit is 100).
    pub ports_per_slice: usize,
    /// Endpoints of one EndpointSlice (the API's own limit is 1000).
    pub endpoints_per_slice: usize,
    /// Backends of one frontend (more are trimmed, deterministically: selected ones first).
    pub backends_per_frontend: usize,
    /// Frontends of the whole table (past it, namespaces share the table fairly, each one's
    /// imports oldest first; the rest are rejected).
    pub frontends: usize,
    /// Backends of the whole table, summed over frontends (admitted as frontends are).
    pub backends: usize,
}

impl Limits {
    /// Backends the eBPF maps hold per frontend (`MAX_BACKENDS_PER_SVC`).
    pub const EBPF_BACKENDS_PER_FRONTEND: usize = 1024;
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            ports_per_import: 100,
            ports_per_slice: 100,
            endpoints_per_slice: 1000,
            backends_per_frontend: Self::EBPF_BACKENDS_PER_FRONTEND,
            // At these the agent's peak RSS is within the DaemonSet's 512 MiB with every
            // dataplane (docs/safety.md).
            frontends: 10_000,
            backends: 100_000,
        }
    }
}

/// The node's rules for what may be programmed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Guard {
    /// ClusterSetIP ranges: a VIP outside every one is rejected, an endpoint inside one is
    /// rejected (it would loop). Empty means unrestricted: only for tests and embedding; the
    /// agent refuses to start without at least one.
    pub clusterset_cidrs: Vec<IpCidr>,
    /// Addresses never programmed, as VIP or endpoint: the node's own, the API server's.
    pub protected: BTreeSet<IpAddr>,
    /// `endpointslice.kubernetes.io/managed-by` values accepted on MCS slices. Empty: any
    /// manager but Kubernetes' own controllers.
    pub trusted_managed_by: BTreeSet<String>,
    /// Whether MCS slices copied from selectorless source slices (mirrored from `Endpoints`
    /// or written by hand, see `validate::LABEL_SOURCE_MANAGED_BY`) are used.
    pub allow_selectorless: bool,
    /// Caps.
    pub limits: Limits,
}

impl Guard {
    /// The ClusterSetIP range that holds `ip`, if any.
    pub fn clusterset_range(&self, ip: IpAddr) -> Option<&IpCidr> {
        self.clusterset_cidrs.iter().find(|c| c.contains(ip))
    }

    /// Whether `ip` may be a VIP by the ranges (always, when no range is configured).
    pub fn vip_allowed(&self, ip: IpAddr) -> bool {
        self.clusterset_cidrs.is_empty() || self.clusterset_range(ip).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_contain_and_refuse_nonsense() {
        let c: IpCidr = "198.18.0.0/15".parse().unwrap();
        assert!(c.contains("198.19.255.255".parse().unwrap()));
        assert!(!c.contains("198.20.0.0".parse().unwrap()));
        assert!(!c.contains("2001:2::1".parse().unwrap()));
        let c6: IpCidr = "2001:2::/48".parse().unwrap();
        assert!(c6.contains("2001:2::1".parse().unwrap()));
        assert!(!c6.contains("2001:3::1".parse().unwrap()));
        let all: IpCidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("198.18.0.1".parse().unwrap()) && all.prefix_len() == 0);
        let one: IpCidr = "198.18.0.1/32".parse().unwrap();
        assert!(one.contains("198.18.0.1".parse().unwrap()));
        for bad in [
            "198.18.0.1/15",
            "198.18.0.0/33",
            "198.18.0.0",
            "x/8",
            "::ffff:198.18.0.0/112",
            "2001:2::/129",
        ] {
            assert!(bad.parse::<IpCidr>().is_err(), "{bad}");
        }
        assert_eq!(c.to_string(), "198.18.0.0/15");
    }

    #[test]
    fn second_spellings_of_ipv4_are_found() {
        for bad in [
            "::ffff:198.18.0.10",
            "::198.18.0.10",
            "64:ff9b::c612:a",
            "64:ff9b:1::1",
        ] {
            assert!(noncanonical(bad.parse().unwrap()).is_some(), "{bad}");
        }
        for ok in ["198.18.0.10", "2001:2::10", "::1", "::", "64:ff9a::1"] {
            assert!(noncanonical(ok.parse().unwrap()).is_none(), "{ok}");
        }
    }
}
