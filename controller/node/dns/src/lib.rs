//! `clusterset.local` DNS answers, as the MCS DNS specification 1.0.0 (KEP-1645
//! `specification.md`) defines them, from the agent's [`Zone`] (kept up to date by its index).
//! Pure: no kube, aya, tokio or sockets. The server around it ([`server`], feature `server`,
//! which `mcs-agent` turns on) is the only part with sockets.
//!
//! Names (zone `clusterset.local.`, case-insensitive; answers carry the name as asked):
//!
//! | name | records |
//! |---|---|
//! | `dns-version.clusterset.local` | TXT `"1.0.0"` |
//! | `<svc>.<ns>.svc.clusterset.local`, ClusterSetIP | A/AAAA of the ClusterSetIPs; SRV per port (target: the name itself) |
//! | `_<port>._<proto>.<svc>.<ns>.svc.clusterset.local`, ClusterSetIP | SRV of that named port |
//! | `<svc>.<ns>.svc.clusterset.local`, Headless | A/AAAA of every ready endpoint; SRV per port × endpoint; NXDOMAIN when none is ready |
//! | `<hostname>.<clusterid>.<svc>.<ns>.svc.clusterset.local`, Headless | A/AAAA of that endpoint (`hostname`: the endpoint's, else its dashed address; cluster ids may hold dots) |
//! | `_<port>._<proto>.<svc>.<ns>.svc.clusterset.local`, Headless | SRV per endpoint of that named port |
//!
//! Answers are bounded by what one response can carry ([`Budget`]: 512 bytes or the EDNS
//! payload over UDP, 64 KiB over TCP): records are encoded as they are made and stop at the
//! first that does not fit, so a headless service with a thousand endpoints of a hundred
//! ports each costs one message's worth of work, not a hundred thousand records. A long RRset
//! starts where the query's id points (the same records for the same query; queries spread
//! over all of them). Over UDP a cut answer sets TC, and ANY gets RFC 8482's one HINFO
//! record. Endpoint names are published only when `<hostname>.<cluster>` is made of valid
//! DNS labels; endpoints that share a name are one SRV target.
//!
//! An existing name asked for another type is NODATA (NOERROR, no answer, the SOA in the
//! authority section); so are empty non-terminals (`svc.clusterset.local`, a namespace with
//! services, `<clusterid>.<svc>…` above endpoint names). Anything else in the zone is
//! NXDOMAIN (with the SOA); anything outside it is REFUSED: this is not a resolver.

#![forbid(unsafe_code)]

#[cfg(feature = "server")]
pub mod server;

use std::{net::IpAddr, sync::Arc};

use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{
        DNSClass, Name, RData, Record, RecordType,
        rdata::{A, AAAA, HINFO, SOA, SRV, TXT},
    },
    serialize::binary::{BinEncodable, BinEncoder},
};
use mcs_model::{
    Protocol,
    dns::{DnsPort, ServiceRecords, Zone},
};

/// The zone's name.
pub const ZONE: &str = "clusterset.local.";
/// What `dns-version.clusterset.local TXT` says.
pub const DNS_VERSION: &str = "1.0.0";
/// The default TTL of every record (and the SOA minimum, the negative-caching TTL).
pub const DEFAULT_TTL: u32 = 5;

/// How large an answer may be, and where a long RRset starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Bytes the whole response may take: header, question and records (an OPT record the
    /// server adds is not counted: leave room for it).
    pub bytes: u16,
    /// Over UDP, an answer that leaves records out sets TC (the client asks again over TCP),
    /// and ANY gets RFC 8482's minimal answer (one HINFO record) instead of every record: a
    /// small spoofed query must not draw a large reply at someone else.
    pub udp: bool,
    /// Where a long RRset starts (records are taken from there on, wrapping around): a
    /// client's query id, so one query always gets the same records and many queries spread
    /// over all of them.
    pub start: usize,
}

impl Budget {
    /// A TCP answer: at most a whole DNS message (64 KiB); what does not fit is left out,
    /// without TC (there is nothing larger to retry with).
    pub fn tcp(start: usize) -> Self {
        Self {
            bytes: u16::MAX,
            udp: false,
            start,
        }
    }

    /// A UDP answer of at most `bytes` (512 without EDNS, else the client's payload size less
    /// the OPT record).
    pub fn udp(bytes: u16, start: usize) -> Self {
        Self {
            bytes,
            udp: true,
            start,
        }
    }
}

/// One answer: what goes into the response besides the question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// NOERROR, NXDOMAIN, REFUSED, NOTIMP or FORMERR.
    pub rcode: ResponseCode,
    /// Set for every name in the zone.
    pub authoritative: bool,
    /// Set when records were left out over UDP (TC).
    pub truncated: bool,
    /// Answer section.
    pub answers: Vec<Record>,
    /// Authority section (the SOA of negative answers).
    pub authority: Vec<Record>,
}

impl Answer {
    fn refused() -> Self {
        Self::code(ResponseCode::Refused)
    }

    /// An answer that is only a response code (REFUSED, NOTIMP, FORMERR, SERVFAIL): not
    /// authoritative, no records.
    pub fn code(rcode: ResponseCode) -> Self {
        Self {
            rcode,
            authoritative: false,
            truncated: false,
            answers: Vec::new(),
            authority: Vec::new(),
        }
    }
}

/// Answers queries from a zone.
#[derive(Clone, Debug)]
pub struct Answerer {
    zone: Arc<Zone>,
    ttl: u32,
    origin: Name,
}

/// What a name in the zone is.
enum Node {
    /// The apex.
    Apex,
    /// `dns-version`.
    Version,
    /// An empty non-terminal: exists, holds nothing.
    Empty,
    /// A service's own name.
    Service(Arc<ServiceRecords>),
    /// `_<port>._<proto>.<service>`: the service and the (name, protocol) asked for.
    Port(Arc<ServiceRecords>, String, Protocol),
    /// `<hostname>.<cluster>.<service>` of a headless service: the service and the name
    /// below it (`<hostname>.<cluster>`).
    Endpoint(Arc<ServiceRecords>, String),
}

/// The records of an answer as they are made, each encoded as it is added (with the header,
/// the question and name compression, as the response will be), so that an answer never
/// holds more than fits: a service with a hundred thousand SRV records costs the records that
/// fit in one message, not all of them.
struct Sink<'b> {
    encoder: BinEncoder<'b>,
    records: Vec<Record>,
    full: bool,
}

impl<'b> Sink<'b> {
    fn new(buf: &'b mut Vec<u8>, budget: Budget, qname: &Name, qtype: RecordType) -> Self {
        let mut encoder = BinEncoder::new(buf);
        encoder.set_max_size(budget.bytes);
        // The header is 12 bytes; the question as the response echoes it.
        let fits = encoder.emit_vec(&[0; 12]).is_ok()
            && Query::query(qname.clone(), qtype)
                .emit(&mut encoder)
                .is_ok();
        Self {
            encoder,
            records: Vec::new(),
            full: !fits,
        }
    }

    /// Adds `record` if it fits; false once one did not (nothing more is added then).
    fn push(&mut self, record: Record) -> bool {
        if self.full {
            return false;
        }
        if self.encoder.emit_all(std::iter::once(&record)).is_ok() {
            self.records.push(record);
            true
        } else {
            self.full = true;
            false
        }
    }
}

impl Answerer {
    /// An answerer over `zone`, every record with `ttl`.
    pub fn new(zone: Arc<Zone>, ttl: u32) -> Self {
        Self {
            zone,
            ttl,
            origin: Name::from_ascii(ZONE).unwrap_or_else(|_| Name::root()),
        }
    }

    /// The TTL of every record.
    pub fn ttl(&self) -> u32 {
        self.ttl
    }

    /// The answer to one question, as TCP would carry it (see [`Answerer::answer_within`]).
    pub fn answer(&self, qname: &Name, qtype: RecordType, qclass: DNSClass) -> Answer {
        self.answer_within(qname, qtype, qclass, Budget::tcp(0))
    }

    /// The answer to one question within `budget`: records are made one at a time and stop
    /// at the first that does not fit.
    pub fn answer_within(
        &self,
        qname: &Name,
        qtype: RecordType,
        qclass: DNSClass,
        budget: Budget,
    ) -> Answer {
        if !matches!(qclass, DNSClass::IN | DNSClass::ANY) || !self.origin.zone_of(qname) {
            return Answer::refused();
        }
        if matches!(qtype, RecordType::AXFR | RecordType::IXFR) {
            return Answer::refused();
        }
        let mut out = Answer {
            rcode: ResponseCode::NoError,
            authoritative: true,
            truncated: false,
            answers: Vec::new(),
            authority: Vec::new(),
        };
        let Some(node) = self.find(qname) else {
            out.rcode = ResponseCode::NXDomain;
            out.authority.push(self.soa());
            return out;
        };
        let mut buf = Vec::with_capacity(512);
        let mut sink = Sink::new(&mut buf, budget, qname, qtype);
        if qtype == RecordType::ANY && budget.udp {
            // RFC 8482 4.2: one synthesized HINFO instead of every record of the name.
            sink.push(Record::from_rdata(
                qname.clone(),
                self.ttl,
                RData::HINFO(HINFO::new("RFC8482".to_string(), String::new())),
            ));
        } else {
            self.records(qname, qtype, node, budget.start, &mut sink);
        }
        out.truncated = sink.full && budget.udp;
        out.answers = sink.records;
        if out.answers.is_empty() {
            out.authority.push(self.soa());
        }
        out
    }

    /// The records of `node` for `qtype`, into `sink` until it is full.
    fn records(
        &self,
        qname: &Name,
        qtype: RecordType,
        node: Node,
        start: usize,
        sink: &mut Sink<'_>,
    ) {
        let owner = qname;
        let want = |t: RecordType| qtype == t || qtype == RecordType::ANY;
        match node {
            Node::Apex => {
                if want(RecordType::SOA) {
                    sink.push(self.soa());
                }
            }
            Node::Version => {
                if want(RecordType::TXT) {
                    sink.push(Record::from_rdata(
                        owner.clone(),
                        self.ttl,
                        RData::TXT(TXT::new(vec![DNS_VERSION.to_string()])),
                    ));
                }
            }
            Node::Empty => {}
            Node::Service(s) if !s.headless => {
                self.addresses(owner, s.ips.iter().copied(), qtype, sink);
                if want(RecordType::SRV) {
                    let target = qname.to_lowercase();
                    for port in port_numbers(s.ports.iter()) {
                        if !sink.push(self.srv(owner, 100, port, target.clone())) {
                            break;
                        }
                    }
                }
            }
            Node::Service(s) => {
                let eps = s.endpoints();
                self.addresses(owner, rotated(eps, start).map(|e| e.address), qtype, sink);
                if want(RecordType::SRV) {
                    let base = qname.to_lowercase();
                    self.endpoint_srvs(owner, &s, &base, start, |_| true, sink);
                }
            }
            Node::Port(s, name, protocol) => {
                if want(RecordType::SRV) {
                    // The service's own name: the question less `_<port>._<proto>`.
                    let base = qname
                        .to_lowercase()
                        .trim_to(usize::from(qname.num_labels()) - 2);
                    let named =
                        |p: &DnsPort| p.name.as_deref() == Some(&name) && p.protocol == protocol;
                    if s.headless {
                        self.endpoint_srvs(owner, &s, &base, start, named, sink);
                    } else {
                        for p in s.ports.iter().filter(|p| named(p)) {
                            if !sink.push(self.srv(owner, 100, p.port, base.clone())) {
                                break;
                            }
                        }
                    }
                }
            }
            Node::Endpoint(s, name) => {
                let eps = s.lookup(&name);
                self.addresses(owner, eps.iter().map(|e| e.address), qtype, sink);
            }
        }
    }

    /// SRV records of a headless service: one per endpoint name and distinct port number
    /// among the ports `keep` admits, names taken from `start` on.
    fn endpoint_srvs(
        &self,
        owner: &Name,
        s: &ServiceRecords,
        base: &Name,
        start: usize,
        keep: impl Fn(&DnsPort) -> bool,
        sink: &mut Sink<'_>,
    ) {
        let names = s.names();
        let weight = weight(names.len());
        for name in rotated(&names, start) {
            let Some(target) = endpoint_name(name, base) else {
                continue;
            };
            let eps = s.lookup(name);
            let ports = eps.iter().flat_map(|e| e.ports.iter()).filter(|p| keep(p));
            for port in port_numbers(ports) {
                if !sink.push(self.srv(owner, weight, port, target.clone())) {
                    return;
                }
            }
        }
    }

    /// A whole response to a request message (for `mcs-agent dns` and tests; the server
    /// builds its responses from [`Answerer::answer`] itself): NOTIMP for anything but a
    /// query, FORMERR unless there is exactly one question.
    pub fn respond(&self, request: &Message) -> Message {
        let mut resp = Message::new(
            request.metadata.id,
            MessageType::Response,
            request.metadata.op_code,
        );
        resp.metadata.recursion_desired = request.metadata.recursion_desired;
        resp.metadata.recursion_available = false;
        resp.queries = request.queries.clone();
        let a = if request.metadata.message_type != MessageType::Query
            || request.metadata.op_code != OpCode::Query
        {
            Answer::code(ResponseCode::NotImp)
        } else if request.queries.len() != 1 {
            Answer::code(ResponseCode::FormErr)
        } else {
            let q = &request.queries[0];
            self.answer(q.name(), q.query_type(), q.query_class())
        };
        resp.metadata.response_code = a.rcode;
        resp.metadata.authoritative = a.authoritative;
        resp.metadata.truncation = a.truncated;
        resp.answers = a.answers;
        resp.authorities = a.authority;
        resp
    }

    fn soa(&self) -> Record {
        let n = |s: &str| Name::from_ascii(s).unwrap_or_else(|_| Name::root());
        Record::from_rdata(
            self.origin.clone(),
            self.ttl,
            RData::SOA(SOA::new(
                n("ns.dns.clusterset.local."),
                n("hostmaster.clusterset.local."),
                self.zone.serial(),
                7200,
                1800,
                86400,
                self.ttl,
            )),
        )
    }

    fn srv(&self, owner: &Name, weight: u16, port: u16, target: Name) -> Record {
        Record::from_rdata(
            owner.clone(),
            self.ttl,
            RData::SRV(SRV::new(0, weight, port, target)),
        )
    }

    fn addresses(
        &self,
        owner: &Name,
        ips: impl Iterator<Item = IpAddr>,
        qtype: RecordType,
        sink: &mut Sink<'_>,
    ) {
        for ip in ips {
            let rdata = match ip {
                IpAddr::V4(v4) if matches!(qtype, RecordType::A | RecordType::ANY) => {
                    RData::A(A(v4))
                }
                IpAddr::V6(v6) if matches!(qtype, RecordType::AAAA | RecordType::ANY) => {
                    RData::AAAA(AAAA(v6))
                }
                _ => continue,
            };
            if !sink.push(Record::from_rdata(owner.clone(), self.ttl, rdata)) {
                return;
            }
        }
    }

    /// What `qname` (inside the zone) is, if it exists.
    fn find(&self, qname: &Name) -> Option<Node> {
        // Labels below the zone, lowercased, leftmost first.
        let below = usize::from(qname.num_labels()) - usize::from(self.origin.num_labels());
        let labels: Vec<String> = qname
            .iter()
            .take(below)
            .map(|l| String::from_utf8_lossy(l).to_ascii_lowercase())
            .collect();
        let n = labels.len();
        match n {
            0 => return Some(Node::Apex),
            1 if labels[0] == "dns-version" => return Some(Node::Version),
            _ => {}
        }
        if labels[n - 1] != "svc" {
            return None;
        }
        if n == 1 {
            return Some(Node::Empty);
        }
        let ns = &labels[n - 2];
        if n == 2 {
            return self.zone.has_namespace(ns).then_some(Node::Empty);
        }
        let service = self.zone.get(ns, &labels[n - 3])?;
        if service.headless && service.endpoints().is_empty() {
            return None;
        }
        let rest = &labels[..n - 3];
        if rest.is_empty() {
            return Some(Node::Service(service));
        }
        if let [port, proto] = rest
            && let (Some(port), Some(proto)) = (port.strip_prefix('_'), proto.strip_prefix('_'))
        {
            let protocol = match proto {
                "tcp" => Protocol::Tcp,
                "udp" => Protocol::Udp,
                "sctp" => Protocol::Sctp,
                _ => return None,
            };
            let has = |p: &DnsPort| p.name.as_deref() == Some(port) && p.protocol == protocol;
            let exists = if service.headless {
                service.endpoints().iter().any(|e| e.ports.iter().any(has))
            } else {
                service.ports.iter().any(has)
            };
            return exists.then(|| Node::Port(service.clone(), port.to_string(), protocol));
        }
        if !service.headless {
            return None;
        }
        let asked = rest.join(".");
        if !service.lookup(&asked).is_empty() {
            return Some(Node::Endpoint(service, asked));
        }
        // An empty non-terminal above some endpoint's name (`<cluster>`, or a part of a dotted
        // cluster id)?
        service.is_cluster(&asked).then_some(Node::Empty)
    }
}

/// The distinct port numbers of `ports`, in order: ports that differ only in protocol
/// (tcp/42 and udp/42) give the same SRV data at a bare name, and an RRset holds no duplicates
/// (RFC 2181 5).
fn port_numbers<'p>(ports: impl Iterator<Item = &'p DnsPort>) -> Vec<u16> {
    let mut out: Vec<u16> = Vec::new();
    for p in ports {
        if !out.contains(&p.port) {
            out.push(p.port);
        }
    }
    out
}

/// `items` from `start` (modulo their number) on, wrapping around.
fn rotated<T>(items: &[T], start: usize) -> impl Iterator<Item = &T> {
    let at = start.checked_rem(items.len()).unwrap_or(0);
    items[at..].iter().chain(&items[..at])
}

/// `<hostname>.<cluster>.<service name>`, if it makes a valid name.
fn endpoint_name(name: &str, service: &Name) -> Option<Name> {
    Name::from_ascii(name).ok()?.append_domain(service).ok()
}

/// SRV weight of each of `n` equal targets.
fn weight(n: usize) -> u16 {
    u16::try_from(100 / n.max(1)).unwrap_or(1).max(1)
}

#[cfg(test)]
mod tests;
