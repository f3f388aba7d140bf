//! The agent's `/status` on its metrics port: read-only JSON for `kubectl mcs` (reached
//! through the API server's pod proxy, so it needs no network path to the node). The sync
//! loop answers for the table ([`mcs_sync::status`]); this adds the agent's version and what
//! its own DNS listener answers, asked over UDP like any client would, and the allocator's
//! view of its memory.
//!
//! `GET /status` is the node's summary; `GET /status?service=NAMESPACE/NAME` adds that
//! service's frontends and backends, its rejections and its DNS answers.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use mcs_model::status::{AgentStatus, DnsCheck, DnsStatus};
use mcs_runtime::http::StatusFn;
use mcs_sync::status::StatusRequest;
use tokio::sync::{mpsc, oneshot};

/// How long one DNS question to the agent's own listener may take.
const DNS_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the sync loop may take to answer (it answers between batches).
const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// The `/status` handler: questions go to the sync loop on `tx`; DNS is asked at `dns`.
pub(crate) fn handler(tx: mpsc::Sender<StatusRequest>, dns: Vec<SocketAddr>) -> StatusFn {
    let dns = Arc::new(dns);
    Arc::new(move |params| {
        let (tx, dns) = (tx.clone(), dns.clone());
        Box::pin(async move {
            let service = params
                .iter()
                .find(|(k, _)| k == "service")
                .and_then(|(_, v)| v.split_once('/'))
                .map(|(ns, n)| (ns.to_string(), n.to_string()))
                .filter(|(ns, n)| valid_label(ns) && valid_label(n));
            let (reply, rx) = oneshot::channel();
            let asked = tx
                .send(StatusRequest {
                    service: service.clone(),
                    reply,
                })
                .await
                .is_ok();
            let node = if asked {
                tokio::time::timeout(SYNC_TIMEOUT, rx)
                    .await
                    .ok()
                    .and_then(Result::ok)
            } else {
                None
            };
            let error = node.is_none().then(|| {
                "the sync loop did not answer within 5 s (stopping, or busy with a large batch)"
                    .to_string()
            });
            let dns = match dns.first() {
                Some(addr) => Some(dns_status(&dns, *addr, service.as_ref()).await),
                None => None,
            };
            let status = AgentStatus {
                version: env!("CARGO_PKG_VERSION").to_string(),
                node: node.unwrap_or_default(),
                error,
                heap: Some(crate::allocator::heap_info()),
                dns,
            };
            serde_json::to_string_pretty(&status)
                .unwrap_or_else(|e| format!("{{\"error\": \"encoding the status: {e}\"}}"))
                + "\n"
        })
    })
}

/// A Kubernetes name: lowercase alphanumerics and `-` (and `.`), at most 253 bytes. Anything
/// else cannot be a service, and is not echoed into a DNS question.
fn valid_label(s: &str) -> bool {
    s.len() <= 253
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

async fn dns_status(
    listen: &[SocketAddr],
    addr: SocketAddr,
    service: Option<&(String, String)>,
) -> DnsStatus {
    // A wildcard listener is asked on loopback of its family.
    let asked = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    };
    let mut questions = vec![("dns-version.clusterset.local.".to_string(), "TXT")];
    if let Some((ns, name)) = service {
        let fqdn = format!("{name}.{ns}.svc.clusterset.local.");
        questions.push((fqdn.clone(), "A"));
        questions.push((fqdn, "AAAA"));
    }
    let mut checks = Vec::new();
    for (name, qtype) in questions {
        checks.push(ask(asked, &name, qtype).await);
    }
    DnsStatus {
        listen: listen.iter().map(ToString::to_string).collect(),
        asked: asked.to_string(),
        checks,
    }
}

/// One UDP question, answered or not within [`DNS_TIMEOUT`].
async fn ask(to: SocketAddr, name: &str, qtype: &str) -> DnsCheck {
    use hickory_proto::{
        op::{Message, Query},
        rr::{Name, RecordType},
    };
    let mut check = DnsCheck {
        name: name.to_string(),
        qtype: qtype.to_string(),
        rcode: None,
        answers: Vec::new(),
        error: None,
    };
    let result: Result<Message, String> = async {
        let qname = Name::from_ascii(name).map_err(|e| e.to_string())?;
        let t: RecordType = qtype.parse().map_err(|e| format!("{e}"))?;
        let mut q = Message::query();
        q.add_query(Query::query(qname, t));
        q.metadata.id = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos()
            & 0xffff) as u16;
        let bytes = q.to_vec().map_err(|e| e.to_string())?;
        let bind: SocketAddr = if to.is_ipv6() {
            "[::]:0".parse().expect("an address")
        } else {
            "0.0.0.0:0".parse().expect("an address")
        };
        let sock = tokio::net::UdpSocket::bind(bind)
            .await
            .map_err(|e| e.to_string())?;
        sock.connect(to).await.map_err(|e| e.to_string())?;
        sock.send(&bytes).await.map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::time::timeout(DNS_TIMEOUT, sock.recv(&mut buf))
                .await
                .map_err(|_| format!("no answer from {to} within {} s", DNS_TIMEOUT.as_secs()))?
                .map_err(|e| e.to_string())?;
            let m = Message::from_vec(&buf[..n]).map_err(|e| e.to_string())?;
            if m.metadata.id == q.metadata.id {
                return Ok(m);
            }
        }
    }
    .await;
    match result {
        Ok(m) => {
            check.rcode = Some(format!("{:?}", m.metadata.response_code));
            check.answers = m.answers.iter().map(|r| r.data.to_string()).collect();
            check.answers.sort();
        }
        Err(e) => check.error = Some(e),
    }
    check
}
