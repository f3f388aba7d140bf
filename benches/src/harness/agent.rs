//! Our agent as the benches run it (the side-by-side harness and the fault suite): its command
//! line, and its HTTP endpoint — on the host's loopback for the eBPF agent, inside the node's
//! network namespace for the userspace one (whose netns cannot reach the host's loopback).

use std::{ffi::OsString, net::SocketAddr, path::Path, time::Duration};

use anyhow::bail;
use mcs_sandbox::netns::Netns;

/// The flags of one `mcs-agent run` that every bench sets.
#[derive(Debug)]
pub struct AgentArgs<'a> {
    /// `ebpf` or `userspace`.
    pub dataplane: &'static str,
    pub cluster_id: &'a str,
    /// The value of `--source` (`file:DIR`, or `kube` with `--kubeconfig` added by the caller).
    pub source: String,
    pub clusterset_ip_cidr: &'a str,
    pub max_frontends: u32,
    pub metrics_port: u16,
    pub file_poll_ms: u32,
    /// eBPF: the pin directory of its socket LB. Userspace: an empty one of its own, since a
    /// userspace agent removes an eBPF socket LB pinned in its `--bpf-pin-dir` and must not
    /// find another mode's or a node's.
    pub pins: &'a Path,
    /// eBPF: the cgroup whose sockets it serves.
    pub cgroup: Option<&'a Path>,
}

impl AgentArgs<'_> {
    /// The arguments after the binary (the caller appends its own flags).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = [
            "run",
            "--dataplane",
            self.dataplane,
            "--cluster-id",
            self.cluster_id,
            "--source",
            &self.source,
            "--clusterset-ip-cidr",
            self.clusterset_ip_cidr,
            "--max-frontends",
            &self.max_frontends.to_string(),
            "--metrics-addr",
            &format!("127.0.0.1:{}", self.metrics_port),
            "--file-poll-ms",
            &self.file_poll_ms.to_string(),
            "--bpf-pin-dir",
        ]
        .map(OsString::from)
        .into();
        a.push(self.pins.into());
        if let Some(cg) = self.cgroup {
            a.extend(["--cgroup-root".into(), cg.into()]);
        }
        a
    }
}

/// Where the agent's `/metrics`, `/readyz` and `/healthz` answer.
#[derive(Clone, Copy, Debug)]
pub struct AgentHttp<'a> {
    pub port: u16,
    /// The node's namespace for an agent that runs inside it; `None` on the host.
    pub node: Option<&'a Netns>,
}

impl AgentHttp<'_> {
    /// The body of `path` when it answers 200.
    pub fn get(&self, path: &str) -> anyhow::Result<String> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        match self.node {
            None => http_get(addr, path),
            Some(ns) => ns.run(|| http_get(addr, path))?,
        }
    }

    /// How many frontends the agent reports programmed (`mcs_frontends`).
    pub fn frontends(&self) -> anyhow::Result<Option<f64>> {
        Ok(metric(&self.get("/metrics")?, "mcs_frontends"))
    }
}

/// A minimal HTTP/1.0 GET; returns the body.
pub fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: bench\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    match text.split_once("\r\n\r\n") {
        Some((head, body))
            if head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200") =>
        {
            Ok(body.to_string())
        }
        _ => bail!(
            "GET {path} from {addr}: {}",
            text.lines().next().unwrap_or("")
        ),
    }
}

/// The value of an unlabelled metric in a Prometheus text exposition.
pub fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn metric_reads_unlabelled_values() {
        let body = "# HELP x\nmcs_frontends 12\nmcs_frontends_total 3\n";
        assert_eq!(super::metric(body, "mcs_frontends"), Some(12.0));
        assert_eq!(super::metric(body, "mcs_backends"), None);
    }

    #[test]
    fn the_args_name_each_flag_once_and_the_cgroup_only_for_ebpf() {
        let pins = std::path::Path::new("/sys/fs/bpf/x");
        let cg = std::path::Path::new("/sys/fs/cgroup/y");
        let mut a = super::AgentArgs {
            dataplane: "userspace",
            cluster_id: "c1",
            source: "file:/tmp/o".into(),
            clusterset_ip_cidr: "198.18.64.0/18",
            max_frontends: 20000,
            metrics_port: 9,
            file_poll_ms: 50,
            pins,
            cgroup: None,
        };
        let text = |a: &super::AgentArgs<'_>| {
            a.to_args()
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            text(&a),
            "run --dataplane userspace --cluster-id c1 --source file:/tmp/o \
             --clusterset-ip-cidr 198.18.64.0/18 --max-frontends 20000 \
             --metrics-addr 127.0.0.1:9 --file-poll-ms 50 --bpf-pin-dir /sys/fs/bpf/x"
        );
        a.dataplane = "ebpf";
        a.cgroup = Some(cg);
        assert!(text(&a).ends_with("--bpf-pin-dir /sys/fs/bpf/x --cgroup-root /sys/fs/cgroup/y"));
    }
}
