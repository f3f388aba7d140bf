//! Interception owned by the agent: one nftables table (`inet mcs_dataplane` by default) with a
//! set of frontends per family whose packets it marks, and the policy routing that makes a
//! marked packet's destination local (`ip rule fwmark MARK lookup TABLE`, `local default dev
//! lo` in that table). The kernel's ordinary socket lookup then finds the forwarder's sockets
//! bound to the frontend's ClusterSetIP and port ([`super::listen`]). Installing replaces a
//! table left by a crash in one transaction, keeping its set elements (so a restarting agent's
//! frontends stay intercepted, and connections made before its first table wait for it instead
//! of losing their SYN); the first full table then removes the elements that are no longer
//! frontends ([`Interception::kept`]). Updates add and delete set elements only (O(change));
//! uninstalling removes exactly what was installed.
//!
//! Pod traffic arriving on the node is marked in `prerouting`: on a routed interface, on a
//! bridge, or under br_netfilter while the frame is still being bridged (the mark stays with
//! the packet when it goes up to the IP layer, which does not run the hooks again); traffic of
//! the node's own processes is marked in `output` and rerouted through `lo`. A packet is
//! marked only when a transparent socket (ours) is there for it (`socket transparent 1`, a
//! lookup that assigns nothing); no rule rewrites an address, and the mark makes only
//! frontends local, so the node answers no ARP or ND for ClusterSetIPs and other ports of a
//! ClusterSetIP are routed as before. When no forwarder listens (the agent died and is
//! restarting), the next rules refuse the frontend's packets (TCP reset, ICMP port
//! unreachable): clients fail at once instead of waiting on a black hole. (The kernel's own
//! reset would not leave: its source, the ClusterSetIP, is no local address.)

use std::{
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
};

use mcs_model::Protocol;

/// Settings of the interception.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterceptConfig {
    /// nftables table name (family `inet`).
    pub table: String,
    /// Firewall mark of intercepted packets.
    pub mark: u32,
    /// Routing table for marked packets.
    pub route_table: u32,
    /// Priority of the `ip rule`.
    pub rule_priority: u32,
}

impl Default for InterceptConfig {
    fn default() -> Self {
        Self {
            table: "mcs_dataplane".into(),
            mark: 0x4d43,
            route_table: 0x4d43,
            rule_priority: 9043,
        }
    }
}

/// Errors of nft and ip.
#[derive(Debug, thiserror::Error)]
#[error("{command}: {message}")]
pub struct NftError {
    /// What ran.
    pub command: String,
    /// What it said.
    pub message: String,
}

/// A frontend as the set sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SetElement {
    /// VIP.
    pub vip: IpAddr,
    /// Protocol (TCP or UDP; others are not intercepted).
    pub protocol: Protocol,
    /// Port.
    pub port: u16,
}

impl SetElement {
    fn render(&self) -> Option<(&'static str, String)> {
        let proto = match self.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => return None,
        };
        Some(match self.vip {
            IpAddr::V4(ip) => ("frontends4", format!("{ip} . {proto} . {}", self.port)),
            IpAddr::V6(ip) => ("frontends6", format!("{ip} . {proto} . {}", self.port)),
        })
    }
}

/// `op element <family> <table> <set> { <element> }` lines of an nft script, one per element.
fn element_lines(op: &str, family: &str, table: &str, elements: &[SetElement]) -> String {
    elements
        .iter()
        .filter_map(SetElement::render)
        .map(|(set, e)| format!("{op} element {family} {table} {set} {{ {e} }}\n"))
        .collect()
}

/// The installed interception.
#[derive(Debug)]
pub struct Interception {
    cfg: InterceptConfig,
    kept: Vec<SetElement>,
}

impl Interception {
    /// Installs (or replaces, atomically) the table and the policy routing.
    pub fn install(cfg: InterceptConfig) -> Result<Self, NftError> {
        let t = &cfg.table;
        let mark = cfg.mark;
        let kept = leftover_elements(t);
        let mut script = format!(
            "table inet {t}\n\
             delete table inet {t}\n\
             table inet {t} {{\n\
               comment \"mcs-dataplane: ClusterSetIP interception, owned by mcs-agent\"\n\
               set frontends4 {{ type ipv4_addr . inet_proto . inet_service; }}\n\
               set frontends6 {{ type ipv6_addr . inet_proto . inet_service; }}\n\
               chain prerouting {{\n\
                 type filter hook prerouting priority mangle; policy accept;\n\
                 ip daddr . meta l4proto . th dport @frontends4 socket transparent 1 meta mark set {mark} accept\n\
                 ip6 daddr . meta l4proto . th dport @frontends6 socket transparent 1 meta mark set {mark} accept\n\
                 meta l4proto tcp ip daddr . meta l4proto . th dport @frontends4 reject with tcp reset\n\
                 meta l4proto udp ip daddr . meta l4proto . th dport @frontends4 reject\n\
                 meta l4proto tcp ip6 daddr . meta l4proto . th dport @frontends6 reject with tcp reset\n\
                 meta l4proto udp ip6 daddr . meta l4proto . th dport @frontends6 reject\n\
               }}\n\
               chain output {{\n\
                 type route hook output priority mangle; policy accept;\n\
                 ip daddr . meta l4proto . th dport @frontends4 meta mark set {mark}\n\
                 ip6 daddr . meta l4proto . th dport @frontends6 meta mark set {mark}\n\
               }}\n\
             }}\n"
        );
        script.push_str(&element_lines("add", "inet", t, &kept));
        nft(&script)?;
        // Earlier versions also had a bridge table (`meta broute`); it goes.
        let _ = nft(&format!("delete table bridge {t}\n"));
        let this = Self { cfg, kept };
        let (m, rt, prio) = (
            this.cfg.mark.to_string(),
            this.cfg.route_table.to_string(),
            this.cfg.rule_priority.to_string(),
        );
        // Make before break: a restarting agent (or one replacing a crash's leftovers) never
        // removes the routing it is about to add, so intercepted packets are never left
        // without their local route (a SYN lost there costs the client a 1 s retransmit).
        for fam in ["-4", "-6"] {
            let any = if fam == "-4" { "0.0.0.0/0" } else { "::/0" };
            ip(&[
                fam, "route", "replace", "local", any, "dev", "lo", "table", &rt,
            ])?;
            match ip(&[
                fam, "rule", "add", "fwmark", &m, "lookup", &rt, "priority", &prio,
            ]) {
                Ok(()) => {}
                // The same rule is there already (left by the previous agent): keep it.
                Err(e) if e.message.contains("File exists") => {}
                Err(e) => return Err(e),
            }
            // Copies at other priorities (an older configuration) go.
            for other in rule_priorities(fam, &m, &rt)
                .into_iter()
                .filter(|p| *p != this.cfg.rule_priority)
            {
                let p = other.to_string();
                let _ = ip(&[
                    fam, "rule", "del", "priority", &p, "fwmark", &m, "lookup", &rt,
                ]);
            }
        }
        tracing::info!(
            table = %this.cfg.table,
            mark,
            kept = this.kept.len(),
            "interception installed"
        );
        Ok(this)
    }

    /// Removes an interception a stopped agent left (`mcs-agent uninstall`; a killed agent
    /// leaves its table and routing so that a restart keeps the ClusterSetIPs intercepted):
    /// the table, an earlier version's bridge table, the `ip rule`s and the routing table.
    /// Returns whether there was a table.
    pub fn remove_leftover(cfg: &InterceptConfig) -> Result<bool, NftError> {
        let had = Self::exists(&cfg.table);
        let _ = nft(&format!("delete table bridge {}\n", cfg.table));
        remove_routing(cfg);
        if had {
            nft(&format!("delete table inet {}\n", cfg.table))?;
        }
        Ok(had)
    }

    /// The frontends a previous run left in the table, still intercepted after installing.
    pub fn kept(&self) -> &[SetElement] {
        &self.kept
    }

    /// Whether a table of this name exists (e.g. left by a crash).
    pub fn exists(table: &str) -> bool {
        Command::new("nft")
            .args(["list", "table", "inet", table])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Adds and removes frontends in one transaction.
    pub fn update(&self, add: &[SetElement], remove: &[SetElement]) -> Result<(), NftError> {
        let t = &self.cfg.table;
        // `destroy` would be idempotent but needs nft ≥ 1.0.8; delete what we know we added.
        let mut script = element_lines("delete", "inet", t, remove);
        script.push_str(&element_lines("add", "inet", t, add));
        if script.is_empty() {
            return Ok(());
        }
        nft(&script)
    }

    /// Removes the table and the policy routing.
    pub fn uninstall(&self) -> Result<(), NftError> {
        remove_routing(&self.cfg);
        let r = nft(&format!("delete table inet {}\n", self.cfg.table));
        tracing::info!(table = %self.cfg.table, "interception removed");
        r
    }

    /// The settings.
    pub fn config(&self) -> &InterceptConfig {
        &self.cfg
    }
}

/// Removes the policy routing of `cfg`: every copy of its `ip rule` a crash may have left, and
/// its routing table.
fn remove_routing(cfg: &InterceptConfig) {
    let (m, rt) = (cfg.mark.to_string(), cfg.route_table.to_string());
    for fam in ["-4", "-6"] {
        // Every copy a crash may have left.
        for _ in 0..16 {
            if ip(&[fam, "rule", "del", "fwmark", &m, "lookup", &rt]).is_err() {
                break;
            }
        }
        let _ = ip(&[fam, "route", "flush", "table", &rt]);
    }
}

/// The elements of both frontend sets of table `table`, if it exists (none when it does not or
/// cannot be read: a fresh table is then as before).
fn leftover_elements(table: &str) -> Vec<SetElement> {
    let mut out = Vec::new();
    for set in ["frontends4", "frontends6"] {
        let Ok(o) = Command::new("nft")
            .args(["-j", "list", "set", "inet", table, set])
            .stderr(Stdio::null())
            .output()
        else {
            continue;
        };
        if o.status.success() {
            out.extend(parse_set_json(&o.stdout));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Set elements from `nft -j list set` output (`{"concat": [addr, proto, port]}`); anything
/// else is skipped.
fn parse_set_json(json: &[u8]) -> Vec<SetElement> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(json) else {
        return Vec::new();
    };
    let sets = v["nftables"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let elems = sets
        .iter()
        .filter_map(|o| o["set"]["elem"].as_array())
        .flatten();
    elems
        .filter_map(|e| {
            let c = e["concat"].as_array()?;
            let [addr, proto, port] = c.as_slice() else {
                return None;
            };
            let vip: IpAddr = addr.as_str()?.parse().ok()?;
            let protocol = match (proto.as_str(), proto.as_u64()) {
                (Some("tcp"), _) | (_, Some(6)) => Protocol::Tcp,
                (Some("udp"), _) | (_, Some(17)) => Protocol::Udp,
                _ => return None,
            };
            let port = match (port.as_u64(), port.as_str()) {
                (Some(p), _) => u16::try_from(p).ok()?,
                (_, Some(p)) => p.parse().ok()?,
                _ => return None,
            };
            Some(SetElement {
                vip,
                protocol,
                port,
            })
        })
        .collect()
}

fn nft(script: &str) -> Result<(), NftError> {
    let err = |message: String| NftError {
        command: "nft -f -".into(),
        message,
    };
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(format!("cannot run nft (install nftables): {e}")))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())
        .map_err(|e| err(e.to_string()))?;
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}

/// Priorities of the `ip rule`s that send `mark` to table `rt`.
fn rule_priorities(fam: &str, mark: &str, rt: &str) -> Vec<u32> {
    let Ok(out) = Command::new("ip")
        .args([fam, "rule", "list", "fwmark", mark, "table", rt])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(':').next()?.trim().parse().ok())
        .collect()
}

fn ip(args: &[&str]) -> Result<(), NftError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| NftError {
            command: "ip".into(),
            message: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NftError {
            command: format!("ip {}", args.join(" ")),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_elements_are_read_from_nft_json_and_anything_else_is_skipped() {
        let json = br#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet",
            "name": "frontends4", "table": "t", "elem": [
              {"concat": ["198.18.100.11", "udp", 53]}, {"concat": ["198.18.100.10", "tcp", 80]},
              {"concat": ["2001:2::10", 6, "443"]}, {"concat": ["198.18.100.12", "sctp", 9]},
              {"concat": ["not-an-address", "tcp", 1]}, {"concat": ["198.18.100.13", "tcp", 70000]},
              {"concat": ["198.18.100.14", "tcp"]}, "198.18.100.15"]}}]}"#;
        let got = parse_set_json(json);
        let e = |vip: &str, protocol, port| SetElement {
            vip: vip.parse().unwrap(),
            protocol,
            port,
        };
        assert_eq!(
            got,
            vec![
                e("198.18.100.11", Protocol::Udp, 53),
                e("198.18.100.10", Protocol::Tcp, 80),
                e("2001:2::10", Protocol::Tcp, 443),
            ]
        );
        assert!(parse_set_json(b"not json").is_empty());
        assert!(parse_set_json(br#"{"nftables": [{"set": {"name": "frontends4"}}]}"#).is_empty());
    }
}
