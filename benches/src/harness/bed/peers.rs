//! The proxies the bench compares ours with: HAProxy (on the node address, and behind
//! TPROXY as our forwarder is) and nginx's stream proxy.

use super::*;

/// Firewall mark and routing table of `haproxy-tproxy`'s interception.
const HAPROXY_TPROXY_MARK: u32 = 0x4d54;
/// Port HAProxy listens on (transparent) behind its interception.
const HAPROXY_TPROXY_PORT: u16 = 15100;

impl Bed {
    /// HAProxy on the node address (`haproxy`).
    pub(super) fn setup_haproxy(
        &mut self,
        mode: Mode,
        target: &mut Target,
    ) -> anyhow::Result<Option<ModeState>> {
        if !have("haproxy") {
            return Ok(Some(ModeState::Failed("haproxy is not installed".into())));
        }
        let conf = self.work.join("haproxy.cfg");
        std::fs::write(&conf, haproxy_config(Some(mode.vip(1)), self.web))?;
        let conf = conf.to_string_lossy().into_owned();
        target.cpu_cgroup =
            Some(self.spawn_in_cgroup("haproxy", |t| &t.node, "haproxy", &["-db", "-f", &conf])?);
        target.bulk = SocketAddr::from((mode.vip(1), BULK_PORT));
        target.udp = None;
        Ok(None)
    }

    /// HAProxy behind TPROXY, as our forwarder (`haproxy-tproxy`).
    pub(super) fn setup_haproxy_tproxy(
        &mut self,
        mode: Mode,
        target: &mut Target,
    ) -> anyhow::Result<Option<ModeState>> {
        if !have("haproxy") {
            return Ok(Some(ModeState::Failed("haproxy is not installed".into())));
        }
        self.load_rules(
            "haproxy-tproxy.nft",
            &haproxy_tproxy_rules(mode.vip(1)),
            "nft",
            &["-f"],
            false,
        )?;
        // The mark is also the routing table's number.
        let mark = HAPROXY_TPROXY_MARK.to_string();
        self.topo.node.ip(&[
            "rule", "add", "fwmark", &mark, "lookup", &mark, "priority", "9044",
        ])?;
        self.topo.node.ip(&[
            "route",
            "add",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            &mark,
        ])?;
        let conf = self.work.join("haproxy-tproxy.cfg");
        std::fs::write(&conf, haproxy_config(None, self.web))?;
        let conf = conf.to_string_lossy().into_owned();
        target.cpu_cgroup = Some(self.spawn_in_cgroup(
            "haproxy-tproxy",
            |t| &t.node,
            "haproxy",
            &["-db", "-f", &conf],
        )?);
        target.bulk = SocketAddr::from((mode.vip(1), BULK_PORT));
        target.udp = None;
        Ok(None)
    }

    /// nginx's stream proxy on the node address (`nginx`).
    pub(super) fn setup_nginx(
        &mut self,
        mode: Mode,
        target: &mut Target,
    ) -> anyhow::Result<Option<ModeState>> {
        let module = Path::new("/usr/lib/nginx/modules/ngx_stream_module.so");
        if !have("nginx") || !module.exists() {
            return Ok(Some(ModeState::Failed(
                "nginx or its stream module is not installed".into(),
            )));
        }
        let conf = self.work.join("nginx-proxy.conf");
        std::fs::write(
            &conf,
            nginx_proxy_config(mode.vip(1), self.web, module, &self.work),
        )?;
        let conf = conf.to_string_lossy().into_owned();
        let err = self
            .work
            .join("nginx-proxy.err")
            .to_string_lossy()
            .into_owned();
        target.cpu_cgroup = Some(self.spawn_in_cgroup(
            "nginx-proxy",
            |t| &t.node,
            "nginx",
            &["-e", &err, "-c", &conf],
        )?);
        target.bulk = SocketAddr::from((mode.vip(1), BULK_PORT));
        Ok(None)
    }
}

/// HAProxy's configuration: listening on `vip` (a node address), or with `vip` `None` behind
/// TPROXY: one transparent listener for every intercepted frontend (as our forwarder has),
/// the backend chosen by the original destination port.
pub(super) fn haproxy_config(vip: Option<Ipv4Addr>, web: &[Ipv4Addr]) -> String {
    let b = BACKENDS[1];
    let servers: String = web
        .iter()
        .enumerate()
        .map(|(i, ip)| format!("  server s{i} {ip}:{HTTP_PORT}\n"))
        .collect();
    let proxies = match vip {
        Some(vip) => format!(
            "listen web\n  bind {vip}:80\n  balance roundrobin\n{servers}\
             listen bulk\n  bind {vip}:{BULK_PORT}\n  server c2 {b}:{BULK_PORT}\n"
        ),
        None => format!(
            "frontend intercepted\n  bind 0.0.0.0:{HAPROXY_TPROXY_PORT} transparent\n  use_backend bulk if {{ dst_port {BULK_PORT} }}\n  default_backend web\n\
             backend web\n  balance roundrobin\n{servers}\
             backend bulk\n  server c2 {b}:{BULK_PORT}\n"
        ),
    };
    format!(
        "global\n  nbthread 2\n  maxconn 4096\n  tune.pipesize 1048576\n\
         defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 60s\n  timeout server 60s\n  option splice-auto\n\
         {proxies}"
    )
}

/// The interception of `haproxy-tproxy`, shaped like our forwarder's: a set of frontends,
/// `tproxy` to the listener and a mark for the local route.
pub(super) fn haproxy_tproxy_rules(vip: Ipv4Addr) -> String {
    format!(
        "table ip mcs_bench_haproxy_tp {{\n\
           set frontends {{ type ipv4_addr . inet_proto . inet_service; elements = {{ {vip} . tcp . 80, {vip} . tcp . {BULK_PORT} }}; }}\n\
           chain prerouting {{ type filter hook prerouting priority mangle; policy accept;\n\
             meta l4proto tcp ip daddr . meta l4proto . th dport @frontends tproxy to :{HAPROXY_TPROXY_PORT} meta mark set {HAPROXY_TPROXY_MARK} accept; }}\n\
         }}\n"
    )
}

/// nginx's stream proxy. `proxy_half_close on` on the bulk server: without it nginx ends
/// both directions at the client's FIN, and the sink's byte count never reaches the client
/// (our forwarder and HAProxy pass a half-close on).
pub(super) fn nginx_proxy_config(
    vip: Ipv4Addr,
    web: &[Ipv4Addr],
    module: &Path,
    work: &Path,
) -> String {
    let b = BACKENDS[1];
    let servers = |port: u16| -> String {
        web.iter()
            .map(|ip| format!("server {ip}:{port}; "))
            .collect()
    };
    let (web_servers, udp_servers) = (servers(HTTP_PORT), servers(UDP_PORT));
    format!(
        "load_module {module};\nworker_processes 2;\ndaemon off;\npid {work}/nginx-proxy.pid;\nerror_log {work}/nginx-proxy.err;\n\
         events {{ worker_connections 8192; }}\n\
         stream {{\n\
           upstream web {{ {web_servers}}}\n\
           upstream udp {{ {udp_servers}}}\n\
           upstream bulk {{ server {b}:{BULK_PORT}; }}\n\
           server {{ listen {vip}:80 reuseport; proxy_pass web; }}\n\
           server {{ listen {vip}:{UDP_PORT} udp reuseport; proxy_pass udp; proxy_responses 1; proxy_timeout 5s; }}\n\
           server {{ listen {vip}:{BULK_PORT}; proxy_pass bulk; proxy_half_close on; }}\n\
         }}\n",
        module = module.display(),
        work = work.display()
    )
}
