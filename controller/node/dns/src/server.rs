//! The agent's `clusterset.local` DNS server (feature `server`): UDP and TCP on every
//! `--dns-listen` address, answers from the agent's own zone ([`crate::Answerer`]), a
//! per-client rate limit, metrics.
//!
//! UDP: hickory-server (0.26.3) does the wire work: it answers FORMERR to undecodable queries
//! itself. Every answer is made within what the response can carry ([`crate::Budget`]: 512
//! bytes without EDNS, else the payload size of the EDNS record we attach — the client's, at
//! most [`MAX_UDP_PAYLOAD`]), with TC when records were left out (the client then asks over
//! TCP).
//!
//! TCP is served here, not by hickory-server, whose TCP listener has no connection cap and
//! whose idle timeout restarts with every message (issue 32: 1,100 held connections used up
//! the agent's file descriptors, and with them `/healthz` and the watches). Here a connection
//! is refused (closed at once, counted) past [`TcpLimits::connections`] in total or
//! [`TcpLimits::per_client`] from one client; it is closed after [`TcpLimits::idle`] without a
//! query and after [`TcpLimits::lifetime`] however busy; a failed `accept` (no file
//! descriptor left) backs off instead of spinning. [`raise_fd_limit`] lifts the soft file
//! limit to the hard one at start, and the total cap is kept below it with room for the
//! health server, the watches, the metrics and the maps.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::{Answerer, Budget};
use anyhow::Context as _;
use hickory_server::{
    net::{
        NetError,
        runtime::{Time, TokioTime},
        xfer::Protocol,
    },
    proto::{
        op::{Edns, Header, Message, MessageType, OpCode, ResponseCode},
        rr::{Name, Record, RecordType},
        serialize::binary::BinEncoder,
    },
    server::{Request, RequestHandler, ResponseHandler, ResponseInfo},
    zone_handler::{MessageResponse, MessageResponseBuilder},
};
use mcs_runtime::http::Health;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// The largest UDP response we send to an EDNS client (the DNS flag day 2020 value: no IP
/// fragmentation on common paths).
pub const MAX_UDP_PAYLOAD: u16 = 1232;
/// File descriptors kept free of DNS-over-TCP connections for everything else the agent
/// holds open (API server watches, the health and metrics server, the dataplane's maps and
/// listeners, the file source).
pub const FD_HEADROOM: u64 = 512;
/// The OPT record we attach to an EDNS client's answer (no options): not part of the
/// answer's budget.
const OPT_RECORD: u16 = 11;
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
    /// Caps of DNS over TCP.
    pub tcp: TcpLimits,
}

/// Caps of DNS over TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpLimits {
    /// Connections open at once, over every listener.
    pub connections: usize,
    /// Connections open at once from one client (an IPv4 address, an IPv6 /64).
    pub per_client: usize,
    /// Time allowed before the first query and between two queries.
    pub idle: Duration,
    /// A connection's whole life, however many queries it sends: then it is closed (RFC
    /// 7766 6.2.3 lets a server close idle or long connections; clients reconnect).
    pub lifetime: Duration,
}

impl Default for TcpLimits {
    fn default() -> Self {
        Self {
            connections: 512,
            per_client: 32,
            idle: Duration::from_secs(5),
            lifetime: Duration::from_secs(30),
        }
    }
}

/// Lifts this process's soft limit of open files to its hard limit (the DaemonSet's runtime
/// sets both; the soft one is often 1,024) and returns the soft limit now in force.
pub fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            1024
        }
    }
}

/// `limits` with the total connection cap lowered, if need be, to leave [`FD_HEADROOM`] file
/// descriptors free under `fd_limit` (logged when lowered).
pub fn fit_to_fd_limit(mut limits: TcpLimits, fd_limit: u64) -> TcpLimits {
    let room = usize::try_from(fd_limit.saturating_sub(FD_HEADROOM)).unwrap_or(usize::MAX);
    if limits.connections > room {
        tracing::warn!(
            asked = limits.connections,
            kept = room,
            fd_limit,
            "DNS over TCP: fewer connections than asked, to keep {FD_HEADROOM} file descriptors for the rest of the agent"
        );
        limits.connections = room;
    }
    limits.per_client = limits.per_client.min(limits.connections);
    limits
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueryLabels {
    /// The question's record type.
    qtype: String,
    rcode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    /// `total` or `per_client`: which cap refused the connection.
    cap: &'static str,
}

/// DNS metrics (`mcs_dns_*`).
#[derive(Clone, Debug)]
struct DnsMetrics {
    queries: Family<QueryLabels, Counter>,
    seconds: Histogram,
    rate_limited: Counter,
    truncated: Counter,
    tcp_open: Gauge,
    tcp_refused: Family<RefusedLabels, Counter>,
    tcp_closed_idle: Counter,
}

impl DnsMetrics {
    fn new(registry: &mut Registry) -> Self {
        let m = Self {
            queries: Family::default(),
            seconds: Histogram::new([1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.02]),
            rate_limited: Counter::default(),
            truncated: Counter::default(),
            tcp_open: Gauge::default(),
            tcp_refused: Family::default(),
            tcp_closed_idle: Counter::default(),
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
        r.register(
            "truncated",
            "Answers that left records out (TC over UDP; over TCP, what fits in one message)",
            m.truncated.clone(),
        );
        r.register(
            "tcp_connections",
            "DNS-over-TCP connections open",
            m.tcp_open.clone(),
        );
        r.register(
            "tcp_refused",
            "DNS-over-TCP connections closed at once: over the total or the per-client cap",
            m.tcp_refused.clone(),
        );
        r.register(
            "tcp_closed_idle",
            "DNS-over-TCP connections closed for idleness or at the end of their lifetime",
            m.tcp_closed_idle.clone(),
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
        let key = client_key(ip);
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

/// Who a client is, for its rate limit and its TCP connections: its IPv4 address (also when
/// it reaches a `[::]` listener as an IPv4-mapped address), or its IPv6 /64.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The question type as a label: the types the zone answers and a few common ones by name,
/// every other one (a client may ask any of 65,536) as `other`, so a client cannot grow the
/// label set.
fn qtype_label(qtype: Option<RecordType>) -> &'static str {
    match qtype {
        None => "none",
        Some(RecordType::A) => "A",
        Some(RecordType::AAAA) => "AAAA",
        Some(RecordType::SRV) => "SRV",
        Some(RecordType::PTR) => "PTR",
        Some(RecordType::TXT) => "TXT",
        Some(RecordType::SOA) => "SOA",
        Some(RecordType::NS) => "NS",
        Some(RecordType::CNAME) => "CNAME",
        Some(RecordType::ANY) => "ANY",
        Some(_) => "other",
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
                qtype: qtype_label(qtype).to_string(),
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
                let opt = if edns.is_some() { OPT_RECORD } else { 0 };
                let start = usize::from(request.metadata.id);
                let budget = if request.protocol() == Protocol::Udp {
                    let payload = edns.as_ref().map_or(512, |e| e.max_payload().max(512));
                    Budget::udp(payload - opt, start)
                } else {
                    Budget {
                        bytes: u16::MAX - opt,
                        ..Budget::tcp(start)
                    }
                };
                let mut a =
                    self.answerer
                        .answer_within(&name, q.query_type(), q.query_class(), budget);
                if a.truncated {
                    self.metrics.truncated.inc();
                }
                if !self.health.is_ready() && a.rcode != ResponseCode::Refused {
                    // Before the first full sync the zone is incomplete: an NXDOMAIN now
                    // would be cached by clients. SERVFAIL makes them retry.
                    a = crate::Answer::code(ResponseCode::ServFail);
                }
                (Some(q.query_type()), a)
            }
            Ok(info) => (
                Some(info.query.query_type()),
                crate::Answer::code(ResponseCode::NotImp),
            ),
            Err(_) => (None, crate::Answer::code(ResponseCode::FormErr)),
        };
        meta.response_code = answer.rcode;
        meta.authoritative = answer.authoritative;
        meta.truncation = answer.truncated;
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
/// limit allows (logged when it is smaller). Neither `SO_REUSEADDR` nor `SO_REUSEPORT`:
/// with either, another process of the host network could bind the address too and take
/// queries (UDP's `SO_REUSEADDR` does not even ask for the same user). The node's next agent
/// takes this very socket instead ([`mcs_runtime::handover`]).
fn bind_udp(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket, sockopt,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(addr),
    )?;
    let std_socket = std::net::UdpSocket::from(fd);
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
    Ok(std_socket)
}

/// Where a TCP connection's responses go: encoded (at most one DNS message, 64 KiB) and kept
/// for the connection to write.
#[derive(Clone, Default)]
struct Collected(Arc<Mutex<Vec<Vec<u8>>>>);

#[async_trait::async_trait]
impl ResponseHandler for Collected {
    async fn send_response<'a>(
        &mut self,
        response: MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, NetError> {
        let (info, bytes) = encode(response, u16::MAX)?;
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(bytes);
        Ok(info)
    }
}

/// `response` on the wire, within `max_size` bytes (records that do not fit are left out,
/// with TC set).
fn encode<'a>(
    response: MessageResponse<
        '_,
        'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
    >,
    max_size: u16,
) -> Result<(ResponseInfo, Vec<u8>), hickory_server::proto::ProtoError> {
    let mut bytes = Vec::with_capacity(512);
    let mut encoder = BinEncoder::new(&mut bytes);
    encoder.set_max_size(max_size);
    let info = response.destructive_emit(&mut encoder)?;
    Ok((info, bytes))
}

/// Open TCP connections, in total and per client.
#[derive(Debug)]
struct TcpConnections {
    limits: TcpLimits,
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// One admitted connection; dropping it gives its place back.
struct TcpPermit {
    table: Arc<TcpConnections>,
    key: IpAddr,
    gauge: Gauge,
}

impl TcpConnections {
    /// A place for a connection of `ip`, or which cap refused it.
    fn admit(self: &Arc<Self>, ip: IpAddr, gauge: &Gauge) -> Result<TcpPermit, &'static str> {
        let key = client_key(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.0 >= self.limits.connections {
            return Err("total");
        }
        let mine = open.1.entry(key).or_insert(0);
        if *mine >= self.limits.per_client {
            return Err("per_client");
        }
        *mine += 1;
        open.0 += 1;
        gauge.inc();
        Ok(TcpPermit {
            table: self.clone(),
            key,
            gauge: gauge.clone(),
        })
    }
}

impl Drop for TcpPermit {
    fn drop(&mut self) {
        let mut open = self.table.open.lock().unwrap_or_else(|p| p.into_inner());
        open.0 = open.0.saturating_sub(1);
        if let Some(n) = open.1.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&self.key);
            }
        }
        self.gauge.dec();
    }
}

/// Most tasks reading one UDP socket: each answers the query it read before it reads the
/// next, so a stop (the node's next agent takes over the socket) loses none it read.
const UDP_READERS: usize = 4;

/// The largest query read over UDP (a longer datagram is cut, and answered FORMERR).
const UDP_QUERY_BYTES: usize = 4096;

/// Where a UDP query's answer goes: sent at once to the client, from the socket it came on,
/// cut to `max_size` (records that do not fit are left out, with TC set).
#[derive(Clone)]
struct UdpReply {
    socket: Arc<tokio::net::UdpSocket>,
    to: SocketAddr,
    /// The query's id, for a SERVFAIL when the answer cannot be encoded.
    id: u16,
    /// 512 without EDNS (RFC 1035 4.2.1), else the client's payload size within 512 and
    /// [`MAX_UDP_PAYLOAD`] (as the answer's budget).
    max_size: u16,
}

#[async_trait::async_trait]
impl ResponseHandler for UdpReply {
    async fn send_response<'a>(
        &mut self,
        response: MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, NetError> {
        let (info, bytes) = match encode(response, self.max_size) {
            Ok(encoded) => encoded,
            Err(e) => {
                tracing::warn!(error = %e, "DNS over UDP: an answer could not be encoded; SERVFAIL");
                let mut m = Message::new(self.id, MessageType::Response, OpCode::Query);
                m.metadata.response_code = ResponseCode::ServFail;
                let bytes = m.to_vec()?;
                let info = ResponseInfo::from(Header {
                    metadata: m.metadata,
                    counts: Default::default(),
                });
                (info, bytes)
            }
        };
        // A send that fails (the client's port is gone, a full buffer) is the client's loss,
        // as for any UDP server.
        let _ = self.socket.send_to(&bytes, self.to).await;
        Ok(info)
    }
}

/// What a query message is: a query to answer, a FORMERR to send (it had a header, but
/// is no query we can read), or nothing to send (a response: never answered, no reflection).
enum Parsed {
    Query(Box<Request>),
    FormErr(Vec<u8>),
    Drop,
}

fn parse(message: Vec<u8>, peer: SocketAddr, protocol: Protocol) -> Parsed {
    let id = (message.len() >= 12).then(|| u16::from_be_bytes([message[0], message[1]]));
    let is_response = message.get(2).is_some_and(|b| b & 0x80 != 0);
    match Request::from_bytes(message, peer, protocol) {
        Ok(r) if r.metadata.message_type == MessageType::Query => Parsed::Query(Box::new(r)),
        Ok(_) => Parsed::Drop,
        Err(_) => {
            // No header, or one that says it is a response (QR): nothing is sent.
            let Some(id) = id.filter(|_| !is_response) else {
                return Parsed::Drop;
            };
            let mut m = Message::new(id, MessageType::Response, OpCode::Query);
            m.metadata.response_code = ResponseCode::FormErr;
            m.to_vec().map_or(Parsed::Drop, Parsed::FormErr)
        }
    }
}

/// Returns at a stop (or when the server is gone).
async fn until_stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// Reads queries from `socket` and answers each before reading the next, until `stop`
/// (then the query in hand is answered, and the rest stay in the socket for whoever else
/// holds it: the node's next agent). With `after_ready`, reading starts once the agent is
/// ready (an inherited socket, which the running agent answers meanwhile).
async fn serve_udp(
    socket: Arc<tokio::net::UdpSocket>,
    handler: Arc<Handler>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    after_ready: bool,
) {
    if after_ready {
        tokio::select! {
            () = handler.health.wait_ready() => {}
            () = until_stopped(&mut stop) => return,
        }
    }
    let mut buf = vec![0u8; UDP_QUERY_BYTES];
    let mut last_warning: Option<Instant> = None;
    loop {
        let (n, peer) = tokio::select! {
            biased;
            () = until_stopped(&mut stop) => return,
            read = socket.recv_from(&mut buf) => match read {
                Ok(read) => read,
                Err(e) => {
                    if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::warn!(error = %e, "DNS over UDP: receive failed");
                        last_warning = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        // Nothing can be sent back to port 0 (or to an unspecified address).
        if peer.port() == 0 || peer.ip().is_unspecified() {
            continue;
        }
        let started = Instant::now();
        match parse(buf[..n].to_vec(), peer, Protocol::Udp) {
            Parsed::Query(request) => {
                let reply = UdpReply {
                    socket: socket.clone(),
                    to: peer,
                    id: request.metadata.id,
                    max_size: request
                        .edns
                        .as_ref()
                        .map_or(512, |e| e.max_payload().clamp(512, MAX_UDP_PAYLOAD)),
                };
                handler
                    .handle_request::<_, TokioTime>(&request, reply)
                    .await;
            }
            Parsed::FormErr(bytes) => {
                // Within the client's rate, as any answer.
                if handler.limit.allow(peer.ip()) {
                    let _ = socket.send_to(&bytes, peer).await;
                    handler.count(None, ResponseCode::FormErr, started);
                } else {
                    handler.metrics.rate_limited.inc();
                }
            }
            Parsed::Drop => {}
        }
    }
}

/// Accepts DNS-over-TCP connections on `listener` within the caps; each connection runs in
/// a task of this one's (they end with it).
async fn serve_tcp(
    listener: tokio::net::TcpListener,
    handler: Arc<Handler>,
    table: Arc<TcpConnections>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    after_ready: bool,
) {
    if after_ready {
        tokio::select! {
            () = handler.health.wait_ready() => {}
            () = until_stopped(&mut stop) => return,
        }
    }
    let mut connections = tokio::task::JoinSet::new();
    let mut last_warning: Option<Instant> = None;
    loop {
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            biased;
            () = until_stopped(&mut stop) => {
                // No more connections from here (the listener stays open while the node's
                // next agent holds it); those open end after the query in hand.
                drop(listener);
                while connections.join_next().await.is_some() {}
                return;
            }
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE/ENFILE (no descriptor left), ECONNABORTED, ...: the listener stays;
                // wait a little rather than spin on an error that will repeat.
                if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(error = %e, "DNS over TCP: accept failed; retrying in 100 ms");
                    last_warning = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match table.admit(peer.ip(), &handler.metrics.tcp_open) {
            Ok(permit) => {
                let handler = handler.clone();
                let limits = table.limits;
                let stop = stop.clone();
                connections.spawn(async move {
                    let _permit = permit;
                    tcp_connection(stream, peer, &handler, limits, stop).await;
                });
            }
            Err(cap) => {
                handler
                    .metrics
                    .tcp_refused
                    .get_or_create(&RefusedLabels { cap })
                    .inc();
                drop(stream);
            }
        }
    }
}

/// One DNS-over-TCP connection: length-prefixed queries (RFC 1035 4.2.2), answered in
/// order, until the client closes, is idle too long, sends something that is not a query,
/// or the connection's lifetime is over.
async fn tcp_connection(
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    handler: &Handler,
    limits: TcpLimits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        time::timeout_at,
    };
    let end = tokio::time::Instant::now() + limits.lifetime;
    let mut answered = 0usize;
    loop {
        let idle_end = (tokio::time::Instant::now() + limits.idle).min(end);
        let mut len = [0u8; 2];
        // At a stop, a connection waiting for its next query ends (a client sees EOF between
        // answers, and asks again on a new connection, as RFC 7766 expects of it); one in
        // the middle of a query, or not yet past its first (the client sent it, or is about
        // to), is answered first.
        let first = tokio::select! {
            biased;
            () = until_stopped(&mut stop), if answered > 0 => {
                // A query already sent (pipelined) is answered; else the connection ends.
                match tokio::time::timeout(Duration::ZERO, stream.peek(&mut len[..1])).await {
                    Ok(Ok(n)) if n > 0 => Ok(Ok(n)),
                    _ => return,
                }
            }
            first = timeout_at(idle_end, stream.peek(&mut len[..1])) => first,
        };
        match first {
            Ok(Ok(n)) if n > 0 => {}
            // EOF, or an error.
            Ok(_) => return,
            Err(_) => {
                handler.metrics.tcp_closed_idle.inc();
                return;
            }
        }
        // Whether `buf` was filled before `idle_end` (a timeout is counted).
        let mut fill =
            async |buf: &mut [u8]| match timeout_at(idle_end, stream.read_exact(buf)).await {
                Ok(read) => read.is_ok(),
                Err(_) => {
                    handler.metrics.tcp_closed_idle.inc();
                    false
                }
            };
        if !fill(&mut len).await {
            return;
        }
        let mut message = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if !fill(&mut message).await {
            return;
        }
        let started = Instant::now();
        let request = match parse(message, peer, Protocol::Tcp) {
            Parsed::Query(r) => r,
            // A response: never answered (no reflection); the connection ends.
            Parsed::Drop => return,
            // Not a query we can read: FORMERR (as over UDP), and the connection ends (its
            // framing cannot be trusted any more).
            Parsed::FormErr(bytes) => {
                if let Ok(n) = u16::try_from(bytes.len()) {
                    let mut framed = n.to_be_bytes().to_vec();
                    framed.extend_from_slice(&bytes);
                    let _ = timeout_at(end, stream.write_all(&framed)).await;
                }
                handler.count(None, ResponseCode::FormErr, started);
                return;
            }
        };
        let out = Collected::default();
        handler
            .handle_request::<_, TokioTime>(&request, out.clone())
            .await;
        let responses = std::mem::take(&mut *out.0.lock().unwrap_or_else(|p| p.into_inner()));
        for r in responses {
            let Ok(n) = u16::try_from(r.len()) else {
                return;
            };
            let mut framed = Vec::with_capacity(r.len() + 2);
            framed.extend_from_slice(&n.to_be_bytes());
            framed.extend_from_slice(&r);
            match timeout_at(end, stream.write_all(&framed)).await {
                Ok(Ok(())) => {}
                _ => return,
            }
        }
        answered += 1;
    }
}

/// A running DNS server (stopped when dropped or by [`DnsServer::shutdown`]).
pub struct DnsServer {
    /// Told `true` at a stop.
    stop: tokio::sync::watch::Sender<bool>,
    /// The UDP readers and TCP listeners.
    tasks: Vec<tokio::task::JoinHandle<()>>,
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

/// How long a stop waits for the queries in hand (a TCP client in the middle of sending
/// one may take its idle limit) before the rest are cut.
const STOP_GRACE: Duration = Duration::from_secs(5);

impl DnsServer {
    /// Binds every address (UDP and TCP; port 0 picks one, the same for both), or takes
    /// the socket `sockets` inherited from the node's running agent, and serves `zone`
    /// ([`DnsServer::prepare`], then [`Unbound::bind`]). Must run inside the tokio runtime.
    pub async fn start(
        zone: Arc<mcs_model::dns::Zone>,
        config: &DnsConfig,
        registry: &mut Registry,
        health: Health,
        sockets: &mcs_runtime::handover::Sockets,
    ) -> anyhow::Result<Self> {
        Self::prepare(zone, config, registry, health)
            .bind(sockets)
            .await
    }

    /// The server's answers and metrics (registered in `registry`), not bound yet.
    pub fn prepare(
        zone: Arc<mcs_model::dns::Zone>,
        config: &DnsConfig,
        registry: &mut Registry,
        health: Health,
    ) -> Unbound {
        let handler = Arc::new(Handler {
            answerer: Answerer::new(zone, config.ttl),
            health,
            metrics: DnsMetrics::new(registry),
            limit: RateLimit {
                per_second: f64::from(config.rate_limit),
                clients: Mutex::new(HashMap::new()),
            },
        });
        let table = Arc::new(TcpConnections {
            limits: config.tcp,
            open: Mutex::new((0, HashMap::new())),
        });
        Unbound {
            handler,
            table,
            listen: config.listen.clone(),
        }
    }
}

/// A DNS server whose answers and metrics exist, not bound yet ([`DnsServer::prepare`]).
pub struct Unbound {
    handler: Arc<Handler>,
    table: Arc<TcpConnections>,
    listen: Vec<SocketAddr>,
}

impl std::fmt::Debug for Unbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unbound")
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

impl Unbound {
    /// Binds every address, or takes the socket `sockets` inherited from the node's running
    /// agent (an address in use is tried again every second, for at most
    /// [`mcs_runtime::http::BIND_PATIENCE`]), and serves. An inherited socket is read from
    /// when the agent is ready (the running agent answers it meanwhile; this one would
    /// answer SERVFAIL).
    pub async fn bind(self, sockets: &mcs_runtime::handover::Sockets) -> anyhow::Result<DnsServer> {
        use mcs_runtime::handover::Kind;
        let Self {
            handler,
            table,
            listen,
        } = self;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut addrs = Vec::new();
        let mut tasks = Vec::new();
        for addr in &listen {
            let tcp_inherited = sockets.inherits(Kind::TcpListener, *addr);
            // Not shared with any other process: the next agent of the node takes these
            // sockets from this one (`sockets`).
            let listener = mcs_runtime::http::bind_patiently("DNS (TCP)", *addr, || {
                tokio::net::TcpListener::from_std(sockets.tcp_listener(*addr, 1024)?)
            })
            .await
            .with_context(|| format!("binding the DNS address {addr} (TCP)"))?;
            let bound = listener.local_addr()?;
            let udp_inherited = sockets.inherits(Kind::Udp, bound);
            let udp = mcs_runtime::http::bind_patiently("DNS (UDP)", bound, || {
                tokio::net::UdpSocket::from_std(sockets.udp(bound, bind_udp)?)
            })
            .await
            .with_context(|| format!("binding the DNS address {bound} (UDP)"))?;
            tasks.push(tokio::spawn(serve_tcp(
                listener,
                handler.clone(),
                table.clone(),
                stopped.clone(),
                tcp_inherited,
            )));
            let udp = Arc::new(udp);
            for _ in 0..UDP_READERS {
                tasks.push(tokio::spawn(serve_udp(
                    udp.clone(),
                    handler.clone(),
                    stopped.clone(),
                    udp_inherited,
                )));
            }
            addrs.push(bound);
        }
        Ok(DnsServer { stop, tasks, addrs })
    }
}

impl DnsServer {
    /// Stops reading queries, answers those in hand (for at most [`STOP_GRACE`]) and
    /// returns. The sockets close with this agent's copies: what waits in them is for
    /// whoever else holds them (the node's next agent).
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        let tasks = std::mem::take(&mut self.tasks);
        let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
        let all_done = async {
            for t in tasks {
                let _ = t.await;
            }
        };
        if tokio::time::timeout(STOP_GRACE, all_done).await.is_err() {
            tracing::warn!(
                grace_s = STOP_GRACE.as_secs(),
                "DNS: queries still in hand at the end of the stop's grace are cut"
            );
            for a in aborts {
                a.abort();
            }
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever type a client asks, the label is one of a fixed few.
    #[test]
    fn question_types_map_to_a_bounded_label_set() {
        let labels: std::collections::BTreeSet<&str> = (0..=u16::MAX)
            .map(|t| qtype_label(Some(RecordType::from(t))))
            .chain([qtype_label(None)])
            .collect();
        assert_eq!(labels.len(), 11, "{labels:?}");
        assert_eq!(qtype_label(Some(RecordType::AAAA)), "AAAA");
        assert_eq!(qtype_label(Some(RecordType::from(65_000))), "other");
    }

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
        // IPv4 clients of a `[::]` listener arrive IPv4-mapped: each is its own client, not
        // one /64 for all of them.
        let m1: IpAddr = "::ffff:198.18.0.7".parse().unwrap();
        let m2: IpAddr = "::ffff:198.18.0.8".parse().unwrap();
        assert_eq!(client_key(m1), "198.18.0.7".parse::<IpAddr>().unwrap());
        assert!((0..3).all(|_| l.allow(m1)));
        assert!(
            l.allow(m2),
            "another mapped client is not limited by the first"
        );
        let none = RateLimit {
            per_second: 0.0,
            clients: Mutex::new(HashMap::new()),
        };
        assert!((0..10_000).all(|_| none.allow(a)));
    }
}
