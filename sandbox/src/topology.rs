//! The two-cluster topology of the demo and the dataplane tests: a client pod, a node, and
//! one namespace per cluster holding that cluster's backends (the addresses of
//! `examples/two-clusters`).
//!
//! ```text
//!  cli 198.18.10.2 ── node 198.18.10.1 │ 198.18.1.1 ── c1: 198.18.1.2, .3 (+ 2001:2::1:2, ::1:3)
//!      2001:2::10:2       2001:2::10:1 │ 198.18.2.1 ── c2: 198.18.2.2, .3
//! ```

use crate::netns::{Netns, veth};

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
    /// Builds the namespaces, links, addresses and routes.
    pub fn build() -> anyhow::Result<Self> {
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
        for (ns, dev, cidr) in [
            (cli, "eth0", "198.18.10.2/24"),
            (cli, "eth0", "2001:2::10:2/112"),
            (node, "cli0", "198.18.10.1/24"),
            (node, "cli0", "2001:2::10:1/112"),
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
