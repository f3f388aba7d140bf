//! The node's guard, built once from the flags and what the node is: the ClusterSetIP ranges,
//! the addresses never to program (the node's interface addresses, the API server's, the
//! DNS servers of `/etc/resolv.conf` — with the DaemonSet's `ClusterFirstWithHostNet`, the
//! cluster DNS Service's ClusterIP, which a ClusterSetIP range overlapping the Service range
//! would otherwise let an import take — and `--protect-address`), the trusted slice managers
//! and the caps. `table` and `run` build it
//! the same way, so `table` shows what `run` would program.

use std::{collections::BTreeSet, net::IpAddr};

use anyhow::bail;
use mcs_model::{Guard, Limits};

use crate::cli::GuardArgs;

/// What to say when no range is given.
const NO_CIDR: &str = "no ClusterSetIP range given: pass --clusterset-ip-cidr CIDR (repeatable, \
IPv4 and IPv6; or MCS_CLUSTERSET_IP_CIDR, comma-separated) with the range(s) your MCS \
controller allocates ClusterSetIPs from, e.g. --clusterset-ip-cidr 198.18.100.0/24. The agent \
programs no VIP outside them, so that no object can redirect other traffic of the node";

/// The guard of `args`, protecting also `apiserver` (the API server's addresses, if known).
pub fn build(args: &GuardArgs, apiserver: &[IpAddr]) -> anyhow::Result<Guard> {
    let cidrs = mcs_model::guard::parse_clusterset_ranges(&args.clusterset_ip_cidrs)
        .map_err(anyhow::Error::msg)?;
    if cidrs.is_empty() {
        bail!(NO_CIDR);
    }
    let mut protected: BTreeSet<IpAddr> = node_addresses();
    protected.extend(apiserver.iter().copied());
    protected.extend(resolvers(
        &std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
    ));
    protected.extend(args.protect_addresses.iter().copied());
    tracing::info!(
        ranges = ?cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
        protected = ?protected,
        "ClusterSetIP ranges and protected addresses"
    );
    Ok(Guard {
        clusterset_cidrs: cidrs,
        protected,
        trusted_managed_by: args.trusted_managed_by.iter().cloned().collect(),
        allow_selectorless: args.allow_selectorless_slices,
        limits: Limits {
            ports_per_import: args.max_ports_per_import,
            backends_per_frontend: args.max_backends_per_frontend,
            frontends: args.max_frontends,
            backends: args.max_backends,
            ..Limits::default()
        },
    })
}

/// The addresses of this network namespace's interfaces (loopback and link-local are
/// refused anyway).
fn node_addresses() -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    match nix::ifaddrs::getifaddrs() {
        Ok(addrs) => {
            for a in addrs {
                let Some(sa) = a.address else { continue };
                if let Some(v4) = sa.as_sockaddr_in() {
                    out.insert(IpAddr::V4(v4.ip()));
                } else if let Some(v6) = sa.as_sockaddr_in6() {
                    out.insert(IpAddr::V6(v6.ip()));
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the node's addresses; only --protect-address and the API server are protected")
        }
    }
    out.retain(|ip| mcs_model::validate::hostile(*ip).is_none());
    out
}

/// The `nameserver` addresses of a resolv.conf (loopback and link-local ones are refused
/// anyway).
fn resolvers(resolv_conf: &str) -> Vec<IpAddr> {
    resolv_conf
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| {
            rest.split_whitespace()
                .next()?
                .split('%')
                .next()?
                .parse()
                .ok()
        })
        .filter(|ip| mcs_model::validate::hostile(*ip).is_none())
        .collect()
}

/// The addresses of the API server `url` names (an IP, or a name resolved now).
pub async fn apiserver_addresses(url: &http::Uri) -> Vec<IpAddr> {
    let Some(host) = url.host() else {
        return Vec::new();
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip];
    }
    let port = url.port_u16().unwrap_or(443);
    match tokio::net::lookup_host((host, port)).await {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        Err(e) => {
            tracing::warn!(host, error = %e, "cannot resolve the API server's name; its addresses are not protected");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cidrs: &[&str]) -> GuardArgs {
        GuardArgs {
            clusterset_ip_cidrs: cidrs.iter().map(ToString::to_string).collect(),
            trusted_managed_by: vec![],
            allow_selectorless_slices: false,
            protect_addresses: vec!["198.18.10.1".parse().unwrap()],
            max_ports_per_import: 100,
            max_backends_per_frontend: 1024,
            max_frontends: 10,
            max_backends: 100,
            max_file_bytes: 1 << 20,
        }
    }

    #[tokio::test]
    async fn the_api_servers_address_is_found_from_its_url() {
        for (url, want) in [
            ("https://198.18.0.1:6443", vec!["198.18.0.1"]),
            ("https://[2001:2::1]:443", vec!["2001:2::1"]),
        ] {
            let got = apiserver_addresses(&url.parse().unwrap()).await;
            let want: Vec<IpAddr> = want.iter().map(|a| a.parse().unwrap()).collect();
            assert_eq!(got, want, "{url}");
        }
        let named = apiserver_addresses(&"https://localhost:6443".parse().unwrap()).await;
        assert!(
            named.iter().all(IpAddr::is_loopback) && !named.is_empty(),
            "{named:?}"
        );
    }

    #[test]
    fn the_dns_servers_of_resolv_conf_are_protected() {
        let conf = "# kubelet\nsearch mcs-system.svc.cluster.local svc.cluster.local\nnameserver 198.18.96.10\nnameserver\t2001:2::96:a\nnameserver fe80::1%eth0\nnameserver 127.0.0.53\noptions ndots:5\n";
        let want: Vec<IpAddr> = vec![
            "198.18.96.10".parse().unwrap(),
            "2001:2::96:a".parse().unwrap(),
        ];
        assert_eq!(resolvers(conf), want);
        assert!(resolvers("").is_empty());
    }

    #[test]
    fn the_guard_protects_the_api_server_and_refuses_bad_ranges() {
        let apiserver: IpAddr = "198.18.100.1".parse().unwrap();
        let g = build(&args(&["198.18.100.0/24", ""]), &[apiserver]).unwrap();
        assert!(g.protected.contains(&apiserver));
        assert!(g.protected.contains(&"198.18.10.1".parse().unwrap()));
        assert_eq!(g.clusterset_cidrs.len(), 1, "empty entries are ignored");
        assert_eq!(g.limits.frontends, 10);
        let e = build(&args(&[""]), &[]).unwrap_err().to_string();
        assert!(e.contains("--clusterset-ip-cidr"), "{e}");
        assert!(
            build(&args(&["198.0.0.0/7"]), &[]).is_err(),
            "wider than /8"
        );
        assert!(build(&args(&["2001::/16"]), &[]).is_err(), "wider than /32");
        assert!(
            build(&args(&["198.18.100.1/24"]), &[]).is_err(),
            "host bits"
        );
    }
}
