//! The agent's `clusterset.local` DNS server: UDP and TCP on every `--dns-listen` address,
//! answers from the agent's own zone (`mcs-dns`), a per-client rate limit, metrics.
//!
//! hickory-server (0.26.3) does the wire work: it answers FORMERR to undecodable queries
//! itself, and caps UDP responses at 512 bytes without EDNS, else at the payload size of
//! the EDNS record we attach (the client's, at most [`MAX_UDP_PAYLOAD`]), setting TC when an
//! answer does not fit (the client then asks over TCP).

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use hickory_server::{
    Server,
    net::runtime::Time,
    proto::{
        op::{Edns, Header, MessageType, OpCode, ResponseCode},
        rr::{Name, RecordType},
    },
    server::{Request, RequestHandler, ResponseHandler, ResponseInfo},
    zone_handler::MessageResponseBuilder,
};
use mcs_dns::Answerer;
use mcs_sync::http::Health;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};

/// The largest UDP response we send to an EDNS client (the DNS flag day 2020 value: no IP
/// fragmentation on common paths).
pub const MAX_UDP_PAYLOAD: u16 = 1232;
/// Idle time allowed between two queries on a TCP connection.
const TCP_IDLE: Duration = Duration::from_secs(5);
/// Clients tracked by the rate limiter at most (beyond, idle ones are forgotten first).
const MAX_TRACKED_CLIENTS: usize = 65_536;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct DnsConfig {
    /// UDP and TCP addresses.
    pub listen: Vec<SocketAddr>,
    /// TTL of every record.
    pub ttl: u32,
    /// Queries per second per client (IPv4 address, IPv6 /64); 0: no limit.
    pub rate_limit: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueryLabels {
    /// The question's record type.
    qtype: String,
    rcode: String,
}

/// DNS metrics (`mcs_dns_*`).
#[derive(Clone, Debug)]
struct DnsMetrics {
    queries: Family<QueryLabels, Counter>,
    seconds: Histogram,
    rate_limited: Counter,
}

impl DnsMetrics {
    fn new(registry: &mut Registry) -> Self {
        let m = Self {
            queries: Family::default(),
            seconds: Histogram::new([1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.02]),
            rate_limited: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("mcs_dns");
        r.register(
            "queries",
            "DNS queries answered, by question type and response code",
            m.queries.clone(),
        );
        r.register(
            "query_seconds",
            "Time from a query's arrival to its answer being handed to the socket",
            m.seconds.clone(),
        );
        r.register(
            "rate_limited",
            "Queries dropped unanswered: their client was over --dns-rate-limit",
            m.rate_limited.clone(),
        );
        m
    }
}

/// A token bucket per client.
#[derive(Debug)]
struct RateLimit {
    per_second: f64,
    clients: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl RateLimit {
    /// Whether a query of `ip` may be answered now.
    fn allow(&self, ip: IpAddr) -> bool {
        if self.per_second <= 0.0 {
            return true;
        }
        let key = match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        };
        let now = Instant::now();
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if clients.len() >= MAX_TRACKED_CLIENTS && !clients.contains_key(&key) {
            clients.retain(|_, (_, seen)| now.duration_since(*seen) < Duration::from_secs(1));
            if clients.len() >= MAX_TRACKED_CLIENTS {
                // Too many clients at once to tell apart: new ones wait.
                return false;
            }
        }
        let (tokens, seen) = clients.entry(key).or_insert((self.per_second, now));
        *tokens = (*tokens + now.duration_since(*seen).as_secs_f64() * self.per_second)
            .min(self.per_second);
        *seen = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The response code as DNS tools print it (`NOERROR`, `NXDOMAIN`, ...).
fn rcode_label(rcode: ResponseCode) -> String {
    match rcode {
        ResponseCode::NoError => "NOERROR".into(),
        ResponseCode::FormErr => "FORMERR".into(),
        ResponseCode::ServFail => "SERVFAIL".into(),
        ResponseCode::NXDomain => "NXDOMAIN".into(),
        ResponseCode::NotImp => "NOTIMP".into(),
        ResponseCode::Refused => "REFUSED".into(),
        other => u16::from(other).to_string(),
    }
}

/// The request handler.
struct Handler {
    answerer: Answerer,
    health: Health,
    metrics: DnsMetrics,
    limit: RateLimit,
}

impl Handler {
    fn count(&self, qtype: Option<RecordType>, rcode: ResponseCode, started: Instant) {
        self.metrics
            .queries
            .get_or_create(&QueryLabels {
                qtype: qtype.map_or_else(|| "none".to_string(), |t| t.to_string()),
                rcode: rcode_label(rcode),
            })
            .inc();
        self.metrics
            .seconds
            .observe(started.elapsed().as_secs_f64());
    }
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let started = Instant::now();
        let mut meta =
            hickory_server::proto::op::Metadata::response_from_request(&request.metadata);
        if !self.limit.allow(request.src().ip()) {
            self.metrics.rate_limited.inc();
            meta.response_code = ResponseCode::Refused;
            // Dropped: nothing is sent (an answer would still amplify a spoofed flood).
            return ResponseInfo::from(Header {
                metadata: meta,
                counts: Default::default(),
            });
        }
        // Our EDNS, when the client sent one: its payload size, at most MAX_UDP_PAYLOAD.
        let edns = request.edns.as_ref().map(|theirs| {
            let mut e = Edns::new();
            e.set_max_payload(theirs.max_payload().min(MAX_UDP_PAYLOAD));
            e
        });
        let mut builder = MessageResponseBuilder::from_message_request(request);
        if let Some(e) = edns.as_ref() {
            builder.edns(e);
        }
        meta.recursion_available = false;
        let (qtype, answer) = match request.request_info() {
            Ok(info)
                if request.metadata.message_type == MessageType::Query
                    && request.metadata.op_code == OpCode::Query =>
            {
                let q = info.query;
                let name: Name = q.original().name().clone();
                let mut a = self.answerer.answer(&name, q.query_type(), q.query_class());
                if !self.health.is_ready() && a.rcode != ResponseCode::Refused {
                    // Before the first full sync the zone is incomplete: an NXDOMAIN now
                    // would be cached by clients. SERVFAIL makes them retry.
                    a = mcs_dns::Answer::code(ResponseCode::ServFail);
                }
                (Some(q.query_type()), a)
            }
            Ok(info) => (
                Some(info.query.query_type()),
                mcs_dns::Answer::code(ResponseCode::NotImp),
            ),
            Err(_) => (None, mcs_dns::Answer::code(ResponseCode::FormErr)),
        };
        meta.response_code = answer.rcode;
        meta.authoritative = answer.authoritative;
        let sent = response
            .send_response(builder.build(
                meta,
                answer.answers.iter(),
                answer.authority.iter(),
                [],
                [],
            ))
            .await;
        self.count(qtype, answer.rcode, started);
        match sent {
            Ok(info) => info,
            Err(e) => {
                tracing::debug!(error = %e, client = %request.src(), "could not send a DNS response");
                meta.response_code = ResponseCode::ServFail;
                ResponseInfo::from(Header {
                    metadata: meta,
                    counts: Default::default(),
                })
            }
        }
    }
}

/// The receive buffer asked for the UDP socket: a burst of queries from many clients (one
/// cluster DNS pod forwards for a whole node or cluster) must not overflow it while a
/// worker is busy (the kernel would drop them silently; the clients would wait for their
/// retry timeout). 4 MiB holds a few thousand queries.
const UDP_RECV_BUFFER: usize = 4 << 20;

/// A UDP socket on `addr` with a receive buffer of [`UDP_RECV_BUFFER`]: forced past
/// `net.core.rmem_max` with CAP_NET_ADMIN (as the DaemonSet runs), else as large as that
/// limit allows (logged when it is smaller).
fn bind_udp(addr: SocketAddr) -> anyhow::Result<tokio::net::UdpSocket> {
    use nix::sys::socket::{setsockopt, sockopt};
    let std_socket = std::net::UdpSocket::bind(addr)?;
    if setsockopt(&std_socket, sockopt::RcvBufForce, &UDP_RECV_BUFFER).is_err() {
        let _ = setsockopt(&std_socket, sockopt::RcvBuf, &UDP_RECV_BUFFER);
    }
    let got = nix::sys::socket::getsockopt(&std_socket, sockopt::RcvBuf).unwrap_or(0);
    // The kernel reports double the size asked (bookkeeping overhead included).
    if got < UDP_RECV_BUFFER {
        tracing::warn!(
            addr = %addr,
            bytes = got,
            "the DNS UDP receive buffer is smaller than asked ({UDP_RECV_BUFFER} bytes): without CAP_NET_ADMIN it is capped by net.core.rmem_max; bursts of queries may be dropped by the kernel"
        );
    }
    std_socket.set_nonblocking(true)?;
    Ok(tokio::net::UdpSocket::from_std(std_socket)?)
}

/// A running DNS server (stopped when dropped or by [`DnsServer::shutdown`]).
pub struct DnsServer {
    server: Server<Handler>,
    /// The bound addresses (UDP and TCP alike), for logs and tests.
    pub addrs: Vec<SocketAddr>,
}

impl std::fmt::Debug for DnsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsServer")
            .field("addrs", &self.addrs)
            .finish_non_exhaustive()
    }
}

impl DnsServer {
    /// Binds every address (UDP and TCP; port 0 picks one, the same for both) and serves
    /// `zone`. Must run inside the tokio runtime.
    pub async fn start(
        zone: Arc<mcs_model::dns::Zone>,
        config: &DnsConfig,
        registry: &mut Registry,
        health: Health,
    ) -> anyhow::Result<Self> {
        let handler = Handler {
            answerer: Answerer::new(zone, config.ttl),
            health,
            metrics: DnsMetrics::new(registry),
            limit: RateLimit {
                per_second: f64::from(config.rate_limit),
                clients: Mutex::new(HashMap::new()),
            },
        };
        let mut server = Server::new(handler);
        let mut addrs = Vec::new();
        for addr in &config.listen {
            let tcp = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the DNS address {addr} (TCP)"))?;
            let bound = tcp.local_addr()?;
            let udp = bind_udp(bound)
                .with_context(|| format!("binding the DNS address {bound} (UDP)"))?;
            server.register_listener(tcp, TCP_IDLE, 16);
            server.register_socket(udp);
            addrs.push(bound);
        }
        Ok(Self { server, addrs })
    }

    /// Stops serving and waits for the tasks.
    pub async fn shutdown(mut self) {
        if let Err(e) = self.server.shutdown_gracefully().await {
            tracing::debug!(error = %e, "DNS server shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_is_per_client_and_per_ipv6_64_and_refills() {
        let l = RateLimit {
            per_second: 3.0,
            clients: Mutex::new(HashMap::new()),
        };
        let a: IpAddr = "198.18.0.1".parse().unwrap();
        let b: IpAddr = "198.18.0.2".parse().unwrap();
        assert!((0..3).all(|_| l.allow(a)));
        assert!(!l.allow(a), "a fourth query within the second");
        assert!(l.allow(b), "another client is not limited by the first");
        let v6a: IpAddr = "2001:2::1".parse().unwrap();
        let v6b: IpAddr = "2001:2::2".parse().unwrap();
        assert!((0..3).all(|_| l.allow(v6a)));
        assert!(!l.allow(v6b), "one /64 is one client");
        // Refill: pretend a second passed.
        for (_, seen) in l.clients.lock().unwrap().values_mut() {
            *seen -= Duration::from_secs(1);
        }
        assert!(l.allow(a));
        let none = RateLimit {
            per_second: 0.0,
            clients: Mutex::new(HashMap::new()),
        };
        assert!((0..10_000).all(|_| none.allow(a)));
    }
}
