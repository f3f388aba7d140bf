use std::sync::Arc;

use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{DNSClass, Name, RData, RecordType},
};
use mcs_model::{
    Protocol,
    dns::{DnsEndpoint, DnsPort, ServiceRecords, Zone},
    input::ServiceRef,
};
use proptest::prelude::*;

use super::*;

fn port(name: Option<&str>, protocol: Protocol, port: u16) -> DnsPort {
    DnsPort {
        name: name.map(String::from),
        protocol,
        port,
    }
}

fn ep(cluster: &str, hostname: &str, addr: &str) -> DnsEndpoint {
    DnsEndpoint {
        cluster: cluster.into(),
        hostname: hostname.into(),
        address: addr.parse().unwrap(),
        ports: Arc::from(vec![port(Some("http"), Protocol::Tcp, 8080)]),
    }
}

fn zone() -> Answerer {
    let z = Arc::new(Zone::new());
    z.set(
        &ServiceRef::new("shop", "web"),
        Some(ServiceRecords::cluster_set_ip(
            vec![
                "198.18.100.7".parse().unwrap(),
                "2001:2::100:7".parse().unwrap(),
            ],
            vec![
                port(Some("http"), Protocol::Tcp, 80),
                port(None, Protocol::Udp, 53),
                // Same number as the UDP port: one SRV record for both.
                port(Some("dns-tcp"), Protocol::Tcp, 53),
            ],
        )),
    );
    z.set(
        &ServiceRef::new("shop", "db"),
        Some(ServiceRecords::headless(
            vec![port(Some("http"), Protocol::Tcp, 80)],
            vec![
                ep("c1", "db-0", "198.18.64.2"),
                ep("eu.c2", "198-18-68-3", "198.18.68.3"),
            ],
        )),
    );
    z.set(
        &ServiceRef::new("shop", "empty"),
        Some(ServiceRecords::headless(vec![], vec![])),
    );
    Answerer::new(z, 7)
}

fn ask(a: &Answerer, name: &str, t: RecordType) -> Answer {
    a.answer(&Name::from_ascii(name).unwrap(), t, DNSClass::IN)
}

fn rdatas(ans: &Answer) -> Vec<String> {
    let mut v: Vec<String> = ans.answers.iter().map(|r| r.data.to_string()).collect();
    v.sort();
    v
}

fn nodata(ans: &Answer) -> bool {
    ans.rcode == ResponseCode::NoError
        && ans.answers.is_empty()
        && ans.authority.len() == 1
        && matches!(ans.authority[0].data, RData::SOA(_))
}

#[test]
fn dns_version_is_1_0_0() {
    let a = zone();
    let ans = ask(&a, "dns-version.clusterset.local.", RecordType::TXT);
    assert_eq!(ans.rcode, ResponseCode::NoError);
    assert!(ans.authoritative);
    assert_eq!(rdatas(&ans), ["1.0.0"]);
    assert!(nodata(&ask(
        &a,
        "dns-version.clusterset.local.",
        RecordType::A
    )));
}

#[test]
fn clusterset_ip_service_a_aaaa_and_srv() {
    let a = zone();
    let ans = ask(&a, "web.shop.svc.clusterset.local.", RecordType::A);
    assert_eq!(rdatas(&ans), ["198.18.100.7"]);
    assert_eq!(ans.answers[0].ttl, 7);
    assert_eq!(
        rdatas(&ask(&a, "web.shop.svc.clusterset.local.", RecordType::AAAA)),
        ["2001:2::100:7"]
    );
    // The bare name: one SRV per port number, unnamed too (the conformance suite asks this);
    // udp/53 and tcp/53 give one record, not a duplicate.
    assert_eq!(
        rdatas(&ask(&a, "web.shop.svc.clusterset.local.", RecordType::SRV)),
        [
            "0 100 53 web.shop.svc.clusterset.local.",
            "0 100 80 web.shop.svc.clusterset.local."
        ]
    );
    assert_eq!(
        rdatas(&ask(
            &a,
            "_http._tcp.web.shop.svc.clusterset.local.",
            RecordType::SRV
        )),
        ["0 100 80 web.shop.svc.clusterset.local."]
    );
    // A named port asked with the wrong protocol, an unknown port: no such name.
    for n in [
        "_http._udp.web.shop.svc.clusterset.local.",
        "_nope._tcp.web.shop.svc.clusterset.local.",
        "_http._quic.web.shop.svc.clusterset.local.",
    ] {
        assert_eq!(
            ask(&a, n, RecordType::SRV).rcode,
            ResponseCode::NXDomain,
            "{n}"
        );
    }
    // No <cluster>.<svc> or <host>.<cluster>.<svc> names under a ClusterSetIP service.
    for n in [
        "c1.web.shop.svc.clusterset.local.",
        "x.c1.web.shop.svc.clusterset.local.",
    ] {
        assert_eq!(
            ask(&a, n, RecordType::A).rcode,
            ResponseCode::NXDomain,
            "{n}"
        );
    }
    // The port name asked for an address: the name exists, so NODATA.
    assert!(nodata(&ask(
        &a,
        "_http._tcp.web.shop.svc.clusterset.local.",
        RecordType::A
    )));
    assert!(nodata(&ask(
        &a,
        "web.shop.svc.clusterset.local.",
        RecordType::TXT
    )));
}

#[test]
fn headless_service_endpoints_names_and_srv() {
    let a = zone();
    assert_eq!(
        rdatas(&ask(&a, "db.shop.svc.clusterset.local.", RecordType::A)),
        ["198.18.64.2", "198.18.68.3"]
    );
    assert_eq!(
        rdatas(&ask(
            &a,
            "db-0.c1.db.shop.svc.clusterset.local.",
            RecordType::A
        )),
        ["198.18.64.2"]
    );
    // A cluster id with a dot, an endpoint without hostname (its dashed address).
    assert_eq!(
        rdatas(&ask(
            &a,
            "198-18-68-3.eu.c2.db.shop.svc.clusterset.local.",
            RecordType::A
        )),
        ["198.18.68.3"]
    );
    let srv = [
        "0 50 8080 198-18-68-3.eu.c2.db.shop.svc.clusterset.local.",
        "0 50 8080 db-0.c1.db.shop.svc.clusterset.local.",
    ];
    assert_eq!(
        rdatas(&ask(&a, "db.shop.svc.clusterset.local.", RecordType::SRV)),
        srv
    );
    assert_eq!(
        rdatas(&ask(
            &a,
            "_http._tcp.db.shop.svc.clusterset.local.",
            RecordType::SRV
        )),
        srv
    );
    // Empty non-terminals above endpoint names: NODATA, not NXDOMAIN.
    for n in [
        "c1.db.shop.svc.clusterset.local.",
        "eu.c2.db.shop.svc.clusterset.local.",
        "c2.db.shop.svc.clusterset.local.",
    ] {
        assert!(nodata(&ask(&a, n, RecordType::A)), "{n}");
    }
    for n in [
        "db-1.c1.db.shop.svc.clusterset.local.",
        "db-0.c2.db.shop.svc.clusterset.local.",
        "c3.db.shop.svc.clusterset.local.",
    ] {
        assert_eq!(
            ask(&a, n, RecordType::A).rcode,
            ResponseCode::NXDomain,
            "{n}"
        );
    }
    // No ready endpoint: the name does not exist.
    assert_eq!(
        ask(&a, "empty.shop.svc.clusterset.local.", RecordType::A).rcode,
        ResponseCode::NXDomain
    );
}

#[test]
fn names_are_case_insensitive_and_answers_carry_the_name_as_asked() {
    let a = zone();
    let ans = ask(&a, "WeB.Shop.SVC.ClusterSet.Local.", RecordType::A);
    assert_eq!(rdatas(&ans), ["198.18.100.7"]);
    assert_eq!(
        ans.answers[0].name.to_string(),
        "WeB.Shop.SVC.ClusterSet.Local."
    );
    let ans = ask(&a, "DB-0.C1.DB.shop.svc.clusterset.local.", RecordType::A);
    assert_eq!(rdatas(&ans), ["198.18.64.2"]);
}

#[test]
fn empty_non_terminals_nxdomain_and_the_apex() {
    let a = zone();
    for n in ["svc.clusterset.local.", "shop.svc.clusterset.local."] {
        assert!(nodata(&ask(&a, n, RecordType::A)), "{n}");
    }
    for n in [
        "other.svc.clusterset.local.",
        "nope.shop.svc.clusterset.local.",
        "web.shop.clusterset.local.",
        "x.clusterset.local.",
    ] {
        let ans = ask(&a, n, RecordType::A);
        assert_eq!(ans.rcode, ResponseCode::NXDomain, "{n}");
        assert!(ans.authoritative);
        assert!(matches!(ans.authority[0].data, RData::SOA(_)), "{n}: SOA");
    }
    let soa = ask(&a, "clusterset.local.", RecordType::SOA);
    assert_eq!(soa.answers.len(), 1);
    let RData::SOA(s) = &soa.answers[0].data else {
        panic!("not an SOA")
    };
    assert_eq!(s.minimum, 7, "negative answers are cached for the TTL");
    assert!(nodata(&ask(&a, "clusterset.local.", RecordType::A)));
}

#[test]
fn outside_the_zone_transfers_and_other_classes_are_refused() {
    let a = zone();
    for n in [
        "example.com.",
        "local.",
        "cluster.local.",
        "kubernetes.default.svc.cluster.local.",
    ] {
        let ans = ask(&a, n, RecordType::A);
        assert_eq!(ans.rcode, ResponseCode::Refused, "{n}");
        assert!(!ans.authoritative && ans.answers.is_empty());
    }
    assert_eq!(
        ask(&a, "clusterset.local.", RecordType::AXFR).rcode,
        ResponseCode::Refused
    );
    let ch = a.answer(
        &Name::from_ascii("dns-version.clusterset.local.").unwrap(),
        RecordType::TXT,
        DNSClass::CH,
    );
    assert_eq!(ch.rcode, ResponseCode::Refused);
}

#[test]
fn any_returns_every_record_of_the_name() {
    let a = zone();
    let ans = ask(&a, "web.shop.svc.clusterset.local.", RecordType::ANY);
    assert_eq!(ans.answers.len(), 4, "{:?}", rdatas(&ans));
}

/// A headless service as issue 32 found it: 10 slices of 1,000 endpoints × 100 ports (here
/// 1,000 endpoints, each with the same 100 shared ports: what the index keeps after its cap).
fn huge() -> Answerer {
    let z = Arc::new(Zone::new());
    let ports: Arc<[DnsPort]> = (0..100)
        .map(|i| port(Some(&format!("p{i}")), Protocol::Tcp, 1000 + i))
        .collect();
    let eps = (0..1000u32)
        .map(|i| DnsEndpoint {
            cluster: "c1".into(),
            hostname: format!("pod-{i}").into(),
            address: std::net::Ipv4Addr::from(0xc612_4000 + i).into(),
            ports: ports.clone(),
        })
        .collect();
    z.set(
        &ServiceRef::new("shop", "big"),
        Some(ServiceRecords::headless(vec![], eps)),
    );
    Answerer::new(z, 5)
}

fn encoded_len(a: &Answerer, name: &str, t: RecordType, budget: Budget) -> (Answer, usize) {
    let qname = Name::from_ascii(name).unwrap();
    let ans = a.answer_within(&qname, t, DNSClass::IN, budget);
    let mut m = Message::query();
    m.add_query(Query::query(qname, t));
    m.metadata.message_type = MessageType::Response;
    m.answers = ans.answers.clone();
    m.authorities = ans.authority.clone();
    let n = m.to_vec().unwrap().len();
    (ans, n)
}

#[test]
fn answers_hold_only_what_fits_and_say_so_over_udp() {
    let a = huge();
    let name = "big.shop.svc.clusterset.local.";
    for t in [RecordType::SRV, RecordType::A, RecordType::ANY] {
        let (ans, n) = encoded_len(&a, name, t, Budget::tcp(0));
        assert!(n <= 65_535, "{t}: {n} bytes over TCP");
        assert!(!ans.truncated, "{t}: no TC over TCP");
        let (ans, n) = encoded_len(&a, name, t, Budget::udp(512, 0));
        assert!(n <= 512, "{t}: {n} bytes over UDP");
        assert!(
            ans.truncated || t == RecordType::ANY,
            "{t}: TC when records were left out"
        );
        assert!(!ans.answers.is_empty(), "{t}: what fits is answered");
    }
    // Over TCP the SRV answer is a subset of the 100,000 records, each one valid.
    let (ans, _) = encoded_len(&a, name, RecordType::SRV, Budget::tcp(0));
    assert!(
        ans.answers.len() > 500 && ans.answers.len() < 100_000,
        "{}",
        ans.answers.len()
    );
    // A named port of the headless service: bounded too.
    let (ans, n) = encoded_len(
        &a,
        "_p7._tcp.big.shop.svc.clusterset.local.",
        RecordType::SRV,
        Budget::udp(1232 - 11, 3),
    );
    assert!(n <= 1221 && ans.truncated && !ans.answers.is_empty());
    // Every A record fits over TCP: all 1,000 addresses.
    let (ans, _) = encoded_len(&a, name, RecordType::A, Budget::tcp(0));
    assert_eq!(ans.answers.len(), 1000);
}

#[test]
fn a_long_rrset_starts_where_the_query_id_points() {
    let a = huge();
    let name = "big.shop.svc.clusterset.local.";
    let first = |start: usize| {
        let (ans, _) = encoded_len(&a, name, RecordType::A, Budget::udp(512, start));
        rdatas(&ans)
    };
    assert_eq!(first(7), first(7), "the same query gets the same records");
    assert_ne!(first(7), first(8));
    // Every address is in some UDP answer: 1,000 starts cover all.
    let mut seen = std::collections::BTreeSet::new();
    for start in 0..1000 {
        seen.extend(first(start));
    }
    assert_eq!(seen.len(), 1000);
}

#[test]
fn any_over_udp_gets_one_hinfo_record() {
    let a = zone();
    for n in [
        "web.shop.svc.clusterset.local.",
        "db.shop.svc.clusterset.local.",
    ] {
        let ans = a.answer_within(
            &Name::from_ascii(n).unwrap(),
            RecordType::ANY,
            DNSClass::IN,
            Budget::udp(512, 0),
        );
        assert_eq!(ans.answers.len(), 1, "{n}");
        assert!(matches!(ans.answers[0].data, RData::HINFO(_)), "{n}");
        assert!(!ans.truncated);
    }
    // A name that does not exist is still NXDOMAIN.
    let ans = a.answer_within(
        &Name::from_ascii("nope.shop.svc.clusterset.local.").unwrap(),
        RecordType::ANY,
        DNSClass::IN,
        Budget::udp(512, 0),
    );
    assert_eq!(ans.rcode, ResponseCode::NXDomain);
}

#[test]
fn endpoints_without_a_valid_name_and_duplicate_hostnames() {
    let z = Arc::new(Zone::new());
    z.set(
        &ServiceRef::new("shop", "db"),
        Some(ServiceRecords::headless(
            vec![],
            vec![
                ep("c1", "db-0", "198.18.64.2"),
                // The same hostname again: one name, both addresses, one SRV target.
                ep("c1", "db-0", "198.18.64.3"),
                // Cluster ids that make no DNS name: addresses at the service's name only.
                ep("C2", "db-0", "198.18.65.2"),
                ep("c3.", "db-0", "198.18.65.3"),
                ep("c\\4", "db-0", "198.18.65.4"),
            ],
        )),
    );
    let a = Answerer::new(z, 5);
    assert_eq!(
        rdatas(&ask(&a, "db.shop.svc.clusterset.local.", RecordType::A)).len(),
        5
    );
    assert_eq!(
        rdatas(&ask(&a, "db.shop.svc.clusterset.local.", RecordType::SRV)),
        ["0 100 8080 db-0.c1.db.shop.svc.clusterset.local."]
    );
    assert_eq!(
        rdatas(&ask(
            &a,
            "db-0.c1.db.shop.svc.clusterset.local.",
            RecordType::A
        )),
        ["198.18.64.2", "198.18.64.3"]
    );
    for n in [
        "db-0.c2.db.shop.svc.clusterset.local.",
        "c2.db.shop.svc.clusterset.local.",
        "c3.db.shop.svc.clusterset.local.",
    ] {
        assert_eq!(
            ask(&a, n, RecordType::A).rcode,
            ResponseCode::NXDomain,
            "{n}"
        );
    }
}

#[test]
fn respond_echoes_the_question_and_checks_the_header() {
    let a = zone();
    let mut q = Message::query();
    q.add_query(Query::query(
        Name::from_ascii("WEB.shop.svc.clusterset.local.").unwrap(),
        RecordType::A,
    ));
    q.metadata.recursion_desired = true;
    let bytes = q.to_vec().unwrap();
    let r = a.respond(&Message::from_vec(&bytes).unwrap());
    assert_eq!(r.metadata.id, q.metadata.id);
    assert_eq!(r.metadata.message_type, MessageType::Response);
    assert!(r.metadata.authoritative && !r.metadata.recursion_available);
    assert_eq!(r.queries, q.queries);
    assert_eq!(r.answers.len(), 1);

    let mut update = q.clone();
    update.metadata.op_code = OpCode::Update;
    assert_eq!(
        a.respond(&update).metadata.response_code,
        ResponseCode::NotImp
    );
    let mut two = q.clone();
    two.add_query(Query::query(
        Name::from_ascii("x.clusterset.local.").unwrap(),
        RecordType::A,
    ));
    assert_eq!(
        a.respond(&two).metadata.response_code,
        ResponseCode::FormErr
    );
}

proptest! {
    /// Any name, any type: an answer, never a panic; inside the zone authoritative, outside
    /// refused; answers only for names that exist.
    #[test]
    fn any_question_gets_an_answer(labels in proptest::collection::vec("[a-zA-Z0-9_-]{1,12}", 0..7), t in 0u16..300) {
        let a = zone();
        let mut text = labels.join(".");
        text.push_str(if labels.len() % 2 == 0 { ".svc.clusterset.local." } else { ".example." });
        if let Ok(name) = Name::from_ascii(&text) {
            let ans = a.answer(&name, RecordType::from(t), DNSClass::IN);
            prop_assert!(ans.rcode == ResponseCode::NoError || ans.rcode == ResponseCode::NXDomain || ans.rcode == ResponseCode::Refused);
            if ans.rcode == ResponseCode::NXDomain {
                prop_assert!(ans.answers.is_empty());
            }
            for r in &ans.answers {
                prop_assert_eq!(&r.name, &name);
            }
        }
    }
}
