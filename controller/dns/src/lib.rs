//! `clusterset.local` DNS answers, as the MCS DNS specification 1.0.0 (KEP-1645
//! `specification.md`) defines them, from the agent's [`Zone`] (kept up to date by its index).
//! Pure: no kube, aya, tokio or sockets; the server around it is the agent's.
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
//! An existing name asked for another type is NODATA (NOERROR, no answer, the SOA in the
//! authority section); so are empty non-terminals (`svc.clusterset.local`, a namespace with
//! services, `<clusterid>.<svc>…` above endpoint names). Anything else in the zone is
//! NXDOMAIN (with the SOA); anything outside it is REFUSED: this is not a resolver.

#![forbid(unsafe_code)]

use std::{net::IpAddr, sync::Arc};

use hickory_proto::{
    op::{Message, MessageType, OpCode, ResponseCode},
    rr::{
        DNSClass, Name, RData, Record, RecordType,
        rdata::{A, AAAA, SOA, SRV, TXT},
    },
};
use mcs_model::{
    Protocol,
    dns::{DnsEndpoint, DnsPort, ServiceRecords, Zone},
};

/// The zone's name.
pub const ZONE: &str = "clusterset.local.";
/// What `dns-version.clusterset.local TXT` says.
pub const DNS_VERSION: &str = "1.0.0";
/// The default TTL of every record (and the SOA minimum, the negative-caching TTL).
pub const DEFAULT_TTL: u32 = 5;

/// One answer: what goes into the response besides the question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// NOERROR, NXDOMAIN, REFUSED, NOTIMP or FORMERR.
    pub rcode: ResponseCode,
    /// Set for every name in the zone.
    pub authoritative: bool,
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
    /// `<hostname>.<cluster>.<service>` of a headless service: the matching endpoints.
    Endpoint(Vec<DnsEndpoint>),
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

    /// The answer to one question.
    pub fn answer(&self, qname: &Name, qtype: RecordType, qclass: DNSClass) -> Answer {
        if !matches!(qclass, DNSClass::IN | DNSClass::ANY) || !self.origin.zone_of(qname) {
            return Answer::refused();
        }
        if matches!(qtype, RecordType::AXFR | RecordType::IXFR) {
            return Answer::refused();
        }
        let mut out = Answer {
            rcode: ResponseCode::NoError,
            authoritative: true,
            answers: Vec::new(),
            authority: Vec::new(),
        };
        let Some(node) = self.find(qname) else {
            out.rcode = ResponseCode::NXDomain;
            out.authority.push(self.soa());
            return out;
        };
        let owner = qname.clone();
        let want = |t: RecordType| qtype == t || qtype == RecordType::ANY;
        match node {
            Node::Apex => {
                if want(RecordType::SOA) {
                    out.answers.push(self.soa());
                }
            }
            Node::Version => {
                if want(RecordType::TXT) {
                    out.answers.push(Record::from_rdata(
                        owner,
                        self.ttl,
                        RData::TXT(TXT::new(vec![DNS_VERSION.to_string()])),
                    ));
                }
            }
            Node::Empty => {}
            Node::Service(s) if !s.headless => {
                self.addresses(&owner, s.ips.iter().copied(), qtype, &mut out.answers);
                if want(RecordType::SRV) {
                    let target = qname.to_lowercase();
                    for port in port_numbers(&s.ports) {
                        out.answers
                            .push(self.srv(&owner, 100, port, target.clone()));
                    }
                }
            }
            Node::Service(s) => {
                self.addresses(
                    &owner,
                    s.endpoints.iter().map(|e| e.address),
                    qtype,
                    &mut out.answers,
                );
                if want(RecordType::SRV) {
                    let base = qname.to_lowercase();
                    let weight = weight(s.endpoints.len());
                    for e in &s.endpoints {
                        let Some(target) = endpoint_name(e, &base) else {
                            continue;
                        };
                        for port in port_numbers(&e.ports) {
                            out.answers
                                .push(self.srv(&owner, weight, port, target.clone()));
                        }
                    }
                }
            }
            Node::Port(s, name, protocol) => {
                if want(RecordType::SRV) {
                    // The service's own name: the question less `_<port>._<proto>`.
                    let base = qname
                        .to_lowercase()
                        .trim_to(usize::from(qname.num_labels()) - 2);
                    let named =
                        |p: &&DnsPort| p.name.as_deref() == Some(&name) && p.protocol == protocol;
                    if s.headless {
                        let weight = weight(s.endpoints.len());
                        for e in &s.endpoints {
                            let Some(target) = endpoint_name(e, &base) else {
                                continue;
                            };
                            for p in e.ports.iter().filter(named) {
                                out.answers
                                    .push(self.srv(&owner, weight, p.port, target.clone()));
                            }
                        }
                    } else {
                        for p in s.ports.iter().filter(named) {
                            out.answers
                                .push(self.srv(&owner, 100, p.port, base.clone()));
                        }
                    }
                }
            }
            Node::Endpoint(eps) => {
                self.addresses(
                    &owner,
                    eps.iter().map(|e| e.address),
                    qtype,
                    &mut out.answers,
                );
            }
        }
        if out.answers.is_empty() {
            out.authority.push(self.soa());
        }
        out
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
        out: &mut Vec<Record>,
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
            out.push(Record::from_rdata(owner.clone(), self.ttl, rdata));
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
        if service.headless && service.endpoints.is_empty() {
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
                service.endpoints.iter().any(|e| e.ports.iter().any(has))
            } else {
                service.ports.iter().any(has)
            };
            return exists.then(|| Node::Port(service.clone(), port.to_string(), protocol));
        }
        if !service.headless {
            return None;
        }
        let asked = rest.join(".");
        let matching: Vec<DnsEndpoint> = service
            .endpoints
            .iter()
            .filter(|e| asked == format!("{}.{}", e.hostname, e.cluster))
            .cloned()
            .collect();
        if !matching.is_empty() {
            return Some(Node::Endpoint(matching));
        }
        // An empty non-terminal above some endpoint's name (`<cluster>`, or a part of a dotted
        // cluster id)?
        let ent = service.endpoints.iter().any(|e| {
            let full = format!("{}.{}", e.hostname, e.cluster);
            full.len() > asked.len() && full.ends_with(&format!(".{asked}"))
        });
        ent.then_some(Node::Empty)
    }
}

/// `<hostname>.<cluster>.<service name>`, if it makes a valid name.
/// The distinct port numbers of `ports`, in order: ports that differ only in protocol
/// (tcp/42 and udp/42) give the same SRV data at a bare name, and an RRset holds no duplicates
/// (RFC 2181 5).
fn port_numbers(ports: &[DnsPort]) -> Vec<u16> {
    let mut out: Vec<u16> = Vec::with_capacity(ports.len());
    for p in ports {
        if !out.contains(&p.port) {
            out.push(p.port);
        }
    }
    out
}

fn endpoint_name(e: &DnsEndpoint, service: &Name) -> Option<Name> {
    Name::from_ascii(format!("{}.{}", e.hostname, e.cluster))
        .ok()?
        .append_domain(service)
        .ok()
}

/// SRV weight of each of `n` equal targets.
fn weight(n: usize) -> u16 {
    u16::try_from(100 / n.max(1)).unwrap_or(1).max(1)
}

#[cfg(test)]
mod tests;
