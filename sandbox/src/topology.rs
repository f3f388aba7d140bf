//! The two-cluster topology of the demo and the dataplane tests: a client pod, a node, and
//! one namespace per cluster holding that cluster's backends (the addresses of
//! `examples/two-clusters`).
//!
//! ```text
//!  cli 198.18.10.2 ── node 198.18.10.1 │ 198.18.1.1 ── c1: 198.18.1.2, .3 (+ 2001:2::1:2, ::1:3)
//!      2001:2::10:2       2001:2::10:1 │ 198.18.2.1 ── c2: 198.18.2.2, .3
//! ```
//!
//! The client's side of the node is a routed veth (`cli0` holds the gateway addresses, as
//! with the ptp CNI or Calico) or a Linux bridge (`cbr0` holds them and `cli0` is its port, as
//! with the bridge CNI, flannel or kubenet), with br_netfilter on or off in the node
//! ([`ClientNet`]).

use crate::netns::{Netns, veth};

/// How the client pod is attached to the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClientNet {
    /// A routed veth (ptp, Calico-like).
    #[default]
    Routed,
    /// A port of a Linux bridge, br_netfilter off (`bridge-nf-call-iptables=0`).
    Bridge,
    /// A port of a Linux bridge with br_netfilter on (`bridge-nf-call-iptables=1` and
    /// `-ip6tables=1` in the node, as kubeadm requires).
    BridgeNetfilter,
}

impl ClientNet {
    /// From `MCS_TEST_CLIENT_NET` (see [`ClientNet::parse`]; unset: routed).
    pub fn from_env() -> anyhow::Result<Self> {
        let v = std::env::var("MCS_TEST_CLIENT_NET").unwrap_or_default();
        Self::parse(&v).map_err(|e| anyhow::anyhow!("MCS_TEST_CLIENT_NET: {e}"))
    }

    /// `routed` (or empty), `bridge` or `bridge-nf`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "" | "routed" => Ok(Self::Routed),
            "bridge" => Ok(Self::Bridge),
            "bridge-nf" => Ok(Self::BridgeNetfilter),
            other => Err(format!("{other}: expected routed, bridge or bridge-nf")),
        }
    }

    /// The name [`ClientNet::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Routed => "routed",
            Self::Bridge => "bridge",
            Self::BridgeNetfilter => "bridge-nf",
        }
    }
}

/// The namespaces; dropping it removes them (and their veths).
#[derive(Debug)]
pub struct TwoClusters {
    /// The client pod (`eth0`, default routes via the node).
    pub cli: Netns,
    /// The node running the agent (`cli0`, `c1`, `c2`).
    pub node: Netns,
    /// Cluster c1 (local): 198.18.1.2, 198.18.1.3, 2001:2::1:2, 2001:2::1:3.
    pub c1: Netns,
    /// Cluster c2 (remote): 198.18.2.2, 198.18.2.3.
    pub c2: Netns,
}

impl TwoClusters {
    /// Builds the namespaces, links, addresses and routes (the client routed).
    pub fn build() -> anyhow::Result<Self> {
        Self::build_with(ClientNet::Routed)
    }

    /// Builds the namespaces with the client attached as `client` says.
    pub fn build_with(client: ClientNet) -> anyhow::Result<Self> {
        crate::sweep_stale();
        let t = TwoClusters {
            cli: Netns::new("cli")?,
            node: Netns::new("node")?,
            c1: Netns::new("c1")?,
            c2: Netns::new("c2")?,
        };
        let TwoClusters { cli, node, c1, c2 } = &t;
        veth(cli, "eth0", node, "cli0")?;
        veth(node, "c1", c1, "eth0")?;
        veth(node, "c2", c2, "eth0")?;
        let gateway = if client == ClientNet::Routed {
            "cli0"
        } else {
            node.ip(&["link", "add", "cbr0", "type", "bridge"])?;
            node.ip(&["link", "set", "cli0", "master", "cbr0"])?;
            let on = if client == ClientNet::BridgeNetfilter {
                "1"
            } else {
                "0"
            };
            for key in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"] {
                let out = node
                    .command("sysctl")
                    .args(["-qw", &format!("net.bridge.{key}={on}")])
                    .output()?;
                crate::netns::check_output("sysctl", &out)?;
            }
            "cbr0"
        };
        for (ns, dev, cidr) in [
            (cli, "eth0", "198.18.10.2/24"),
            (cli, "eth0", "2001:2::10:2/112"),
            (node, gateway, "198.18.10.1/24"),
            (node, gateway, "2001:2::10:1/112"),
            (node, "c1", "198.18.1.1/24"),
            (node, "c1", "2001:2::1:1/112"),
            (node, "c2", "198.18.2.1/24"),
            (c1, "eth0", "198.18.1.2/24"),
            (c1, "eth0", "198.18.1.3/24"),
            (c1, "eth0", "2001:2::1:2/112"),
            (c1, "eth0", "2001:2::1:3/112"),
            (c2, "eth0", "198.18.2.2/24"),
            (c2, "eth0", "198.18.2.3/24"),
        ] {
            ns.addr(dev, cidr)?;
        }
        for (ns, via) in [
            (cli, "198.18.10.1"),
            (cli, "2001:2::10:1"),
            (c1, "198.18.1.1"),
            (c1, "2001:2::1:1"),
            (c2, "198.18.2.1"),
        ] {
            ns.route("default", via)?;
        }
        Ok(t)
    }
}
