//! kube-proxy's kernel dataplanes as the bench programs them: iptables, nftables and IPVS
//! rules for the measured services and the fillers.

use super::*;

impl Bed {
    /// kube-proxy's iptables rules (`iptables`).
    pub(super) fn setup_iptables(&mut self) -> anyhow::Result<Option<ModeState>> {
        if !have("iptables-restore") {
            return Ok(Some(ModeState::Failed("iptables is not installed".into())));
        }
        self.program_iptables(0)?;
        Ok(None)
    }

    /// kube-proxy's IPVS mode (`ipvs`), where the kernel has IPVS.
    pub(super) fn setup_ipvs(&mut self, mode: Mode) -> anyhow::Result<Option<ModeState>> {
        if !have("ipvsadm") {
            return Ok(Some(ModeState::Unavailable(
                "ipvsadm is not installed".into(),
            )));
        }
        // The kernel module creates the per-namespace IPVS state; without it ipvsadm
        // says "Protocol not available".
        let probe = self.topo.node.command("ipvsadm").arg("-Ln").output()?;
        if !probe.status.success() {
            return Ok(Some(ModeState::Unavailable(format!(
                "the kernel has no IPVS (`ipvsadm -Ln`: {})",
                String::from_utf8_lossy(&probe.stderr)
                    .trim()
                    .replace('\n', " ")
            ))));
        }
        self.topo
            .node
            .ip(&["link", "add", "kube-ipvs0", "type", "dummy"])?;
        for off in [1, 2] {
            self.topo
                .node
                .addr("kube-ipvs0", &format!("{}/32", mode.vip(off)))?;
        }
        self.program_ipvs(0)?;
        Ok(None)
    }

    /// The services a kernel mode programs: `fillers` others first, then the measured ones
    /// last (the worst case of a linear list).
    pub(super) fn kernel_services(&self, mode: Mode, fillers: usize) -> Vec<KernelService> {
        let (web, udp, bulk) = service_eps(self.web);
        let svc = |name: String, vip, proto, port, eps| KernelService {
            name,
            vip,
            proto,
            port,
            eps,
        };
        (0..fillers)
            .map(|i| {
                let vip = mode.vip(256 + i as u32);
                svc(format!("f{i}"), vip, "tcp", 80, filler_eps().to_vec())
            })
            .chain([
                svc("web".into(), mode.vip(1), "tcp", 80, web),
                svc("udp".into(), mode.vip(1), "udp", UDP_PORT, udp),
                svc("bulk".into(), mode.vip(2), "tcp", BULK_PORT, bulk),
            ])
            .collect()
    }
    /// Writes `text` to `file` in the work directory and runs `program` on it inside the node
    /// namespace (`args` before the file; `stdin`: feed the file on standard input).
    pub(super) fn load_rules(
        &self,
        file: &str,
        text: &str,
        program: &str,
        args: &[&str],
        stdin: bool,
    ) -> anyhow::Result<()> {
        let path = self.work.join(file);
        std::fs::write(&path, text)?;
        let mut cmd = self.topo.node.command(program);
        cmd.args(args);
        if stdin {
            cmd.stdin(std::fs::File::open(&path)?);
        } else {
            cmd.arg(&path);
        }
        run_ok(&mut cmd).map(drop)
    }
    /// kube-proxy's iptables layout: KUBE-SERVICES matches each service and jumps to its
    /// KUBE-SVC chain, which picks an endpoint chain with `statistic`. Only this mode's range
    /// enters the list, so the other modes' traffic does not pay for it.
    pub(super) fn program_iptables(&self, fillers: usize) -> anyhow::Result<()> {
        let mode = Mode::Iptables;
        let mut chains = String::new();
        let mut rules = format!("-A PREROUTING -d {}/18 -j KUBE-SERVICES\n", mode.vip_base());
        for KernelService {
            name,
            vip,
            proto,
            port,
            eps,
        } in self.kernel_services(mode, fillers)
        {
            let _ = writeln!(chains, ":KUBE-SVC-{name} - [0:0]");
            let _ = writeln!(
                rules,
                "-A KUBE-SERVICES -d {vip}/32 -p {proto} -m {proto} --dport {port} -j KUBE-SVC-{name}"
            );
            for (i, ep) in eps.iter().enumerate() {
                let _ = writeln!(chains, ":KUBE-SEP-{name}-{i} - [0:0]");
                let left = eps.len() - i;
                if left > 1 {
                    let _ = writeln!(
                        rules,
                        "-A KUBE-SVC-{name} -m statistic --mode random --probability {:.5} -j KUBE-SEP-{name}-{i}",
                        1.0 / left as f64
                    );
                } else {
                    let _ = writeln!(rules, "-A KUBE-SVC-{name} -j KUBE-SEP-{name}-{i}");
                }
                let _ = writeln!(
                    rules,
                    "-A KUBE-SEP-{name}-{i} -p {proto} -m {proto} -j DNAT --to-destination {ep}"
                );
            }
        }
        let input = format!(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n{chains}{rules}COMMIT\n"
        );
        self.load_rules("iptables.rules", &input, "iptables-restore", &[], false)
    }
    /// kube-proxy's nftables layout: one verdict map from address . protocol . port to a
    /// service chain, which picks an endpoint chain with `numgen random`.
    pub(super) fn program_nftables(&self, fillers: usize) -> anyhow::Result<()> {
        let mut elements = vec![];
        let mut chains = String::new();
        for KernelService {
            name,
            vip,
            proto,
            port,
            eps,
        } in self.kernel_services(Mode::Nftables, fillers)
        {
            elements.push(format!("{vip} . {proto} . {port} : goto svc_{name}"));
            let picks: Vec<String> = (0..eps.len())
                .map(|i| format!("{i} : goto sep_{name}_{i}"))
                .collect();
            let _ = writeln!(
                chains,
                "  chain svc_{name} {{ numgen random mod {} vmap {{ {} }}; }}",
                eps.len(),
                picks.join(", ")
            );
            for (i, ep) in eps.iter().enumerate() {
                let _ = writeln!(
                    chains,
                    "  chain sep_{name}_{i} {{ meta l4proto {proto} dnat to {ep}; }}"
                );
            }
        }
        let script = format!(
            "table ip mcs_bench_kp {{}}\ndelete table ip mcs_bench_kp\ntable ip mcs_bench_kp {{\n\
             {chains}\
               map service_ips {{ type ipv4_addr . inet_proto . inet_service : verdict; elements = {{ {} }}; }}\n\
               chain prerouting {{ type nat hook prerouting priority dstnat; policy accept; ip daddr . meta l4proto . th dport vmap @service_ips; }}\n\
             }}\n",
            elements.join(",\n    ")
        );
        self.load_rules("nftables.nft", &script, "nft", &["-f"], false)
    }
    /// kube-proxy's IPVS layout: a virtual server per service (NAT, rr).
    pub(super) fn program_ipvs(&self, fillers: usize) -> anyhow::Result<()> {
        let mut rules = String::from("-C\n");
        for KernelService {
            vip,
            proto,
            port,
            eps,
            ..
        } in self.kernel_services(Mode::Ipvs, fillers)
        {
            let flag = if proto == "udp" { "-u" } else { "-t" };
            let _ = writeln!(rules, "-A {flag} {vip}:{port} -s rr");
            for ep in eps {
                let _ = writeln!(rules, "-a {flag} {vip}:{port} -r {ep} -m");
            }
        }
        self.load_rules("ipvs.rules", &rules, "ipvsadm-restore", &[], true)
    }
}

/// A service as the kernel modes program it.
#[derive(Debug)]
pub(super) struct KernelService {
    name: String,
    vip: Ipv4Addr,
    proto: &'static str,
    port: u16,
    eps: Vec<SocketAddr>,
}

pub(super) fn filler_eps() -> [SocketAddr; 2] {
    FILLER_BACKENDS.map(|ip| SocketAddr::from((ip, HTTP_PORT)))
}
