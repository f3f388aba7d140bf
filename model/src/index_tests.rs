use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::{
    ForwardingTable, Frontend, Protocol,
    index::{Index, compute},
    input::{EndpointInput, ImportInput, ImportPortInput, SliceInput, SlicePortInput},
    node::NodeConfig,
    validate::{LABEL_MANAGED_BY, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER, Reason},
};

pub(crate) fn node(cluster: &str) -> NodeConfig {
    NodeConfig {
        cluster_id: cluster.into(),
        zone: Some("z1".into()),
        node_name: Some("node-z1".into()),
        ..Default::default()
    }
}

pub(crate) fn mk_import(name: &str, ips: &[&str], ports: &[(&str, &str, i64)]) -> ImportInput {
    ImportInput {
        namespace: "ns".into(),
        name: name.into(),
        created: Some("2026-01-01T00:00:00Z".into()),
        type_: "ClusterSetIP".into(),
        ips: ips.iter().map(|s| s.to_string()).collect(),
        ports: ports
            .iter()
            .map(|(n, p, port)| ImportPortInput {
                name: (!n.is_empty()).then(|| n.to_string()),
                protocol: Some(p.to_string()),
                port: *port,
            })
            .collect(),
        ..Default::default()
    }
}

pub(crate) fn ep(addr: &str, ready: bool) -> EndpointInput {
    EndpointInput {
        addresses: vec![addr.into()],
        ready: Some(ready),
        ..Default::default()
    }
}

pub(crate) fn mk_slice(
    name: &str,
    svc: &str,
    cluster: &str,
    ports: &[(&str, i64)],
    eps: Vec<EndpointInput>,
) -> SliceInput {
    let v6 = eps.first().is_some_and(|e| e.addresses[0].contains(':'));
    SliceInput {
        namespace: "ns".into(),
        name: name.into(),
        labels: BTreeMap::from([
            (LABEL_SERVICE_NAME.to_string(), svc.to_string()),
            (LABEL_SOURCE_CLUSTER.to_string(), cluster.to_string()),
            (
                LABEL_MANAGED_BY.to_string(),
                "mcs-controller.example".to_string(),
            ),
        ]),
        address_type: if v6 { "IPv6" } else { "IPv4" }.into(),
        ports: ports
            .iter()
            .map(|(n, p)| SlicePortInput {
                name: (!n.is_empty()).then(|| n.to_string()),
                protocol: Some("TCP".into()),
                port: Some(*p),
            })
            .collect(),
        endpoints: eps,
    }
}

pub(crate) fn fe(vip: &str, port: u16) -> Frontend {
    Frontend {
        vip: vip.parse().unwrap(),
        port,
        protocol: Protocol::Tcp,
    }
}

pub(crate) fn selected(t: &ForwardingTable, f: &Frontend) -> Vec<String> {
    t.frontends[f]
        .selected()
        .map(|b| format!("{}:{}@{}", b.address, b.port, b.cluster))
        .collect()
}

pub(crate) fn fallback(t: &ForwardingTable, f: &Frontend) -> Vec<String> {
    t.frontends[f]
        .fallback()
        .map(|b| format!("{}:{}@{}", b.address, b.port, b.cluster))
        .collect()
}

#[test]
fn one_frontend_per_ip_and_port_with_family_matched_backends() {
    let imp = mk_import(
        "web",
        &["198.18.0.10", "2001:2::10"],
        &[("http", "TCP", 80), ("admin", "TCP", 81)],
    );
    let s4 = mk_slice(
        "web-c1",
        "web",
        "c1",
        &[("http", 8080), ("admin", 9090)],
        vec![ep("198.18.1.2", true)],
    );
    let s6 = mk_slice(
        "web-c1-v6",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("2001:2::1:2", true)],
    );
    let (t, rej) = compute(node("c1"), [imp], [s4, s6]);
    assert_eq!(t.frontends.len(), 4);
    assert_eq!(
        selected(&t, &fe("198.18.0.10", 80)),
        vec!["198.18.1.2:8080@c1"]
    );
    assert_eq!(
        selected(&t, &fe("198.18.0.10", 81)),
        vec!["198.18.1.2:9090@c1"]
    );
    assert_eq!(
        selected(&t, &fe("2001:2::10", 80)),
        vec!["2001:2::1:2:8080@c1"]
    );
    // The v6 slice has no "admin" port: the v6 admin frontend has no backend.
    assert!(t.frontends[&fe("2001:2::10", 81)].backends.is_empty());
    assert!(
        rej.is_empty() || rej.iter().all(|r| r.reason == Reason::NoMatchingPort),
        "{rej:?}"
    );
}

#[test]
fn headless_imports_get_no_frontends() {
    let mut imp = mk_import("h", &[], &[("", "TCP", 80)]);
    imp.type_ = "Headless".into();
    let (t, rej) = compute(node("c1"), [imp], []);
    assert!(t.frontends.is_empty());
    assert!(rej.is_empty());
}

#[test]
fn unnamed_single_port_matches_unnamed_import_port() {
    let imp = mk_import("db", &["198.18.0.11"], &[("", "TCP", 5432)]);
    let s = mk_slice(
        "db-c1",
        "db",
        "c1",
        &[("", 15432)],
        vec![ep("198.18.1.3", true)],
    );
    let (t, _) = compute(node("c1"), [imp], [s]);
    assert_eq!(
        selected(&t, &fe("198.18.0.11", 5432)),
        vec!["198.18.1.3:15432@c1"]
    );
}

#[test]
fn an_empty_slice_without_ports_is_not_a_rejection() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let s = mk_slice("web-c1", "web", "c1", &[], vec![]);
    let (t, rej) = compute(node("c1"), [imp], [s]);
    assert!(t.frontends[&fe("198.18.0.10", 80)].backends.is_empty());
    assert!(rej.is_empty(), "{rej:?}");
}

#[test]
fn slice_without_matching_port_contributes_nothing_and_says_so() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let s = mk_slice(
        "web-c1",
        "web",
        "c1",
        &[("grpc", 9000)],
        vec![ep("198.18.1.2", true)],
    );
    let (t, rej) = compute(node("c1"), [imp], [s]);
    assert!(t.frontends[&fe("198.18.0.10", 80)].backends.is_empty());
    assert_eq!(rej.len(), 1);
    assert_eq!(rej[0].reason, Reason::NoMatchingPort);
    assert_eq!(rej[0].object, "EndpointSlice ns/web-c1");
}

#[test]
fn local_cluster_first_then_remote_failover() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let local = mk_slice(
        "web-c1",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.2", true)],
    );
    let remote = mk_slice(
        "web-c2",
        "web",
        "c2",
        &[("http", 8080)],
        vec![ep("198.18.2.2", true)],
    );
    let mut idx = Index::new(node("c1"));
    idx.upsert_import(imp);
    idx.upsert_slice(local.clone());
    idx.upsert_slice(remote);
    idx.flush();
    let f = fe("198.18.0.10", 80);
    assert_eq!(selected(idx.table(), &f), vec!["198.18.1.2:8080@c1"]);
    // The remote one is what a forwarder tries when the local one refuses.
    assert_eq!(fallback(idx.table(), &f), vec!["198.18.2.2:8080@c2"]);
    // Local endpoint not ready: the remote cluster takes over.
    let mut down = local;
    down.endpoints[0].ready = Some(false);
    idx.upsert_slice(down);
    let d = idx.flush();
    assert_eq!(d.upsert.len(), 1);
    assert_eq!(selected(idx.table(), &f), vec!["198.18.2.2:8080@c2"]);
    assert!(
        fallback(idx.table(), &f).is_empty(),
        "not ready: never tried"
    );
    // Backends keep a stable order: (cluster, address, port).
    let clusters: Vec<&str> = idx.table().frontends[&f]
        .backends
        .iter()
        .map(|b| &*b.cluster)
        .collect();
    assert_eq!(clusters, vec!["c1", "c2"]);
}

#[test]
fn serving_terminating_only_when_nothing_is_ready_anywhere() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let term = EndpointInput {
        addresses: vec!["198.18.1.2".into()],
        ready: Some(false),
        serving: Some(true),
        terminating: Some(true),
        ..Default::default()
    };
    let gone = EndpointInput {
        addresses: vec!["198.18.1.3".into()],
        ready: Some(false),
        serving: Some(false),
        terminating: Some(true),
        ..Default::default()
    };
    let s1 = mk_slice("a", "web", "c1", &[("http", 80)], vec![term, gone]);
    let f = fe("198.18.0.10", 80);
    let (t, _) = compute(node("c1"), [imp.clone()], [s1.clone()]);
    assert_eq!(selected(&t, &f), vec!["198.18.1.2:80@c1"]);
    // A ready endpoint in a remote cluster beats a terminating local one.
    let s2 = mk_slice(
        "b",
        "web",
        "c2",
        &[("http", 80)],
        vec![ep("198.18.2.2", true)],
    );
    let (t, _) = compute(node("c1"), [imp], [s1, s2]);
    assert_eq!(selected(&t, &f), vec!["198.18.2.2:80@c2"]);
}

#[test]
fn prefer_close_picks_the_node_zone_when_it_has_one() {
    let mut imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    imp.traffic_distribution = Some("PreferClose".into());
    let mut a = ep("198.18.1.2", true);
    a.zone = Some("z1".into());
    let mut b = ep("198.18.1.3", true);
    b.zone = Some("z2".into());
    let s = mk_slice("s", "web", "c1", &[("http", 80)], vec![a, b]);
    let f = fe("198.18.0.10", 80);
    let (t, _) = compute(node("c1"), [imp.clone()], [s.clone()]);
    assert_eq!(selected(&t, &f), vec!["198.18.1.2:80@c1"]);
    assert_eq!(fallback(&t, &f), vec!["198.18.1.3:80@c1"]);
    imp.traffic_distribution = None;
    let (t, _) = compute(node("c1"), [imp], [s]);
    assert_eq!(selected(&t, &f).len(), 2);
}

#[test]
fn client_ip_affinity_with_default_and_explicit_timeout() {
    let mut imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    imp.session_affinity = Some("ClientIP".into());
    let (t, _) = compute(node("c1"), [imp.clone()], []);
    assert_eq!(
        t.frontends[&fe("198.18.0.10", 80)]
            .affinity
            .unwrap()
            .timeout_seconds,
        10_800
    );
    imp.affinity_timeout_seconds = Some(60);
    let (t, _) = compute(node("c1"), [imp], []);
    assert_eq!(
        t.frontends[&fe("198.18.0.10", 80)]
            .affinity
            .unwrap()
            .timeout_seconds,
        60
    );
}

#[test]
fn stale_cluster_is_dropped_in_one_call() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let mut idx = Index::new(node("c1"));
    idx.upsert_import(imp);
    idx.upsert_slice(mk_slice(
        "a",
        "web",
        "c1",
        &[("http", 80)],
        vec![ep("198.18.1.2", true)],
    ));
    idx.upsert_slice(mk_slice(
        "b",
        "web",
        "c2",
        &[("http", 80)],
        vec![ep("198.18.2.2", true)],
    ));
    idx.flush();
    idx.set_cluster_stale("c1", true);
    idx.flush();
    let f = fe("198.18.0.10", 80);
    assert_eq!(selected(idx.table(), &f), vec!["198.18.2.2:80@c2"]);
    assert_eq!(idx.table().frontends[&f].backends.len(), 1);
    idx.set_cluster_stale("c1", false);
    idx.flush();
    assert_eq!(selected(idx.table(), &f), vec!["198.18.1.2:80@c1"]);
}

#[test]
fn older_import_wins_a_vip_conflict_and_the_newer_takes_over_when_it_goes() {
    let mut old = mk_import("a", &["198.18.0.10"], &[("http", "TCP", 80)]);
    old.created = Some("2026-01-01T00:00:00Z".into());
    let mut new = mk_import("b", &["198.18.0.10"], &[("http", "TCP", 80)]);
    new.created = Some("2026-02-01T00:00:00Z".into());
    let mut idx = Index::new(node("c1"));
    idx.upsert_import(new);
    idx.upsert_import(old);
    idx.flush();
    let f = fe("198.18.0.10", 80);
    assert_eq!(idx.table().frontends[&f].service, "ns/a");
    let rej = idx.rejections();
    assert_eq!(rej.len(), 1);
    assert_eq!(
        (rej[0].object.as_str(), rej[0].reason),
        ("ServiceImport ns/b", Reason::VipConflict)
    );
    idx.delete_import("ns", "a");
    let d = idx.flush();
    assert_eq!(d.upsert[&f].service, "ns/b");
    assert!(idx.rejections().is_empty());
}

#[test]
fn invalid_input_is_rejected_with_reasons_and_the_rest_keeps_working() {
    let good = mk_import("good", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let too_many = mk_import(
        "many",
        &["198.18.0.1", "198.18.0.2", "198.18.0.3"],
        &[("", "TCP", 80)],
    );
    let bad_ip = mk_import("badip", &["not-an-ip", "198.18.0.12"], &[("", "TCP", 80)]);
    let ports = mk_import(
        "ports",
        &["198.18.0.13"],
        &[
            ("a", "TCP", 0),
            ("b", "TCP", 70000),
            ("c", "ICMP", 80),
            ("d", "TCP", 81),
            ("e", "TCP", 81),
        ],
    );
    let loopback_vip = mk_import("lo", &["127.0.0.1"], &[("", "TCP", 80)]);
    let hostile = mk_slice(
        "good-c1",
        "good",
        "c1",
        &[("http", 8080)],
        vec![
            ep("198.18.1.2", true),
            ep("127.0.0.1", true),
            ep("169.254.169.254", true),
            ep("0.0.0.0", true),
            ep("224.0.0.1", true),
            ep("255.255.255.255", true),
            ep("::ffff:127.0.0.1", true),
            ep("garbage", true),
        ],
    );
    let mut no_cluster = mk_slice(
        "nc",
        "good",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.9", true)],
    );
    no_cluster.labels.remove(LABEL_SOURCE_CLUSTER);
    let mut default_ctrl = mk_slice(
        "dc",
        "good",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.8", true)],
    );
    default_ctrl.labels.insert(
        LABEL_MANAGED_BY.into(),
        "endpointslice-controller.k8s.io".into(),
    );
    let (t, rej) = compute(
        node("c1"),
        [good, too_many, bad_ip, ports, loopback_vip],
        [hostile, no_cluster, default_ctrl],
    );
    assert_eq!(
        selected(&t, &fe("198.18.0.10", 80)),
        vec!["198.18.1.2:8080@c1"]
    );
    assert!(
        t.frontends.contains_key(&fe("198.18.0.12", 80)),
        "the valid ip of badip stays"
    );
    assert!(
        t.frontends.contains_key(&fe("198.18.0.13", 81)),
        "the valid port of ports stays"
    );
    assert_eq!(
        t.frontends.len(),
        3,
        "{:?}",
        t.frontends.keys().collect::<Vec<_>>()
    );
    let count = |r: Reason| rej.iter().filter(|x| x.reason == r).count();
    assert_eq!(count(Reason::TooManyIps), 1);
    assert_eq!(count(Reason::InvalidIp), 1);
    assert_eq!(count(Reason::InvalidPort), 2);
    assert_eq!(count(Reason::UnknownProtocol), 1);
    assert_eq!(count(Reason::DuplicatePort), 1);
    assert_eq!(count(Reason::HostileVip), 1);
    assert_eq!(count(Reason::HostileEndpoint), 5);
    // "garbage"; the IPv4-mapped address is a second spelling, refused as such.
    assert_eq!(count(Reason::InvalidEndpoint), 1);
    assert_eq!(count(Reason::NoncanonicalAddress), 1);
    assert_eq!(count(Reason::MissingClusterLabel), 1);
    assert_eq!(count(Reason::DefaultController), 1);
}

#[test]
fn hostile_addresses_include_mapped_and_v6_forms() {
    use crate::validate::hostile;
    for bad in [
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "fe80::1",
        "::",
        "::1",
        "ff02::1",
        // Cloud metadata services outside link-local (issue 52).
        "fd00:ec2::254",
        "100.100.100.200",
        "::ffff:100.100.100.200",
        "168.63.129.16",
        "192.0.0.192",
        "fd20:ce::254",
    ] {
        assert!(hostile(bad.parse().unwrap()).is_some(), "{bad}");
    }
    for ok in ["198.18.1.2", "2001:2::1", "::ffff:198.18.1.2"] {
        assert!(hostile(ok.parse().unwrap()).is_none(), "{ok}");
    }
}

#[test]
fn duplicate_endpoints_across_slices_are_merged() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let a = mk_slice(
        "a",
        "web",
        "c1",
        &[("http", 80)],
        vec![ep("198.18.1.2", false)],
    );
    let b = mk_slice(
        "b",
        "web",
        "c1",
        &[("http", 80)],
        vec![ep("198.18.1.2", true)],
    );
    let (t, _) = compute(node("c1"), [imp], [a, b]);
    let s = &t.frontends[&fe("198.18.0.10", 80)];
    assert_eq!(s.backends.len(), 1);
    assert!(s.backends[0].ready);
}

// ---- property tests ----------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Import(ImportInput),
    DeleteImport(String),
    Slice(SliceInput),
    DeleteSlice(String),
    Stale(String, bool),
    ClusterId(String),
}

fn arb_endpoint() -> impl Strategy<Value = EndpointInput> {
    (
        prop_oneof![
            (1u8..6).prop_map(|i| format!("198.18.1.{i}")),
            (1u8..4).prop_map(|i| format!("2001:2::1:{i}")),
            Just("127.0.0.1".to_string()),
            Just("junk".to_string()),
        ],
        proptest::option::of(any::<bool>()),
        proptest::option::of(any::<bool>()),
        proptest::option::of(any::<bool>()),
        proptest::option::of(prop_oneof![Just("z1".to_string()), Just("z2".to_string())]),
    )
        .prop_map(|(a, ready, serving, terminating, zone)| EndpointInput {
            addresses: vec![a],
            ready,
            serving,
            terminating,
            node_name: zone.as_ref().map(|z| format!("node-{z}")),
            zone,
            hostname: None,
        })
}

fn arb_op() -> impl Strategy<Value = Op> {
    let name = prop_oneof![Just("a"), Just("b"), Just("c")].prop_map(String::from);
    let cluster = prop_oneof![Just("c1"), Just("c2"), Just("c3")].prop_map(String::from);
    let import = (
        name.clone(),
        proptest::collection::vec(
            prop_oneof![
                Just("198.18.0.10"),
                Just("198.18.0.11"),
                Just("2001:2::10"),
                Just("bad")
            ],
            0..3,
        ),
        proptest::collection::vec(
            (
                prop_oneof![Just(""), Just("http")],
                prop_oneof![Just("TCP"), Just("UDP")],
                prop_oneof![Just(80i64), Just(81), Just(0)],
            ),
            0..3,
        ),
        0u8..3,
        any::<bool>(),
        any::<bool>(),
        (0u8..3, any::<bool>(), 0u8..5),
    )
        .prop_map(
            |(n, ips, ports, age, affinity, close, (uid, local, headless))| {
                let mut i = mk_import(&n, &ips, &ports);
                if headless == 0 {
                    i.type_ = "Headless".into();
                }
                i.created = Some(format!("2026-01-0{}T00:00:00Z", age + 1));
                i.uid = Some(format!("uid-{uid}"));
                if local {
                    i.internal_traffic_policy = Some("Local".into());
                }
                if affinity {
                    i.session_affinity = Some("ClientIP".into());
                }
                if close {
                    i.traffic_distribution = Some("PreferClose".into());
                }
                Op::Import(i)
            },
        );
    let slice = (
        prop_oneof![Just("s1"), Just("s2"), Just("s3"), Just("s4")],
        name.clone(),
        cluster.clone(),
        proptest::collection::vec(
            (
                prop_oneof![Just(""), Just("http")],
                prop_oneof![Just(8080i64), Just(9090)],
            ),
            0..3,
        ),
        proptest::collection::vec(arb_endpoint(), 0..4),
        any::<bool>(),
    )
        .prop_map(|(sn, svc, c, ports, eps, v6)| {
            let mut s = mk_slice(
                sn,
                &svc,
                &c,
                &ports.iter().map(|(n, p)| (*n, *p)).collect::<Vec<_>>(),
                eps,
            );
            s.address_type = if v6 { "IPv6" } else { "IPv4" }.into();
            Op::Slice(s)
        });
    prop_oneof![
        4 => import,
        6 => slice,
        1 => name.clone().prop_map(Op::DeleteImport),
        1 => prop_oneof![Just("s1"), Just("s2")].prop_map(|s| Op::DeleteSlice(s.into())),
        1 => (cluster.clone(), any::<bool>()).prop_map(|(c, s)| Op::Stale(c, s)),
        1 => cluster.prop_map(Op::ClusterId),
    ]
}

fn apply_op(idx: &mut Index, op: &Op) {
    match op.clone() {
        Op::Import(i) => idx.upsert_import(i),
        Op::DeleteImport(n) => idx.delete_import("ns", &n),
        Op::Slice(s) => idx.upsert_slice(s),
        Op::DeleteSlice(n) => idx.delete_slice("ns", &n),
        Op::Stale(c, s) => idx.set_cluster_stale(&c, s),
        Op::ClusterId(c) => idx.set_cluster_id(&c),
    }
}

/// Diffs applied in sequence (flushing at arbitrary points) yield exactly the table that a
/// fresh index computes from the final objects, and every selected backend is usable.
fn incremental_equals_fresh(
    node: NodeConfig,
    ops: &[Op],
    flush_mask: u64,
) -> Result<(), TestCaseError> {
    let mut idx = Index::new(node);
    let mut replica = ForwardingTable::default();
    // DNS is tracked from the start for even masks, switched on midway for odd ones.
    let zone = crate::dns::Zone::new();
    if flush_mask.is_multiple_of(2) {
        idx.track_dns();
    }
    // A caller that keeps the rejections until the version changes never misses a change.
    let mut seen = (idx.rejections_version(), idx.rejections());
    let mut check_seen = |idx: &Index| -> Result<(), TestCaseError> {
        let now = idx.rejections();
        if now != seen.1 {
            prop_assert_ne!(
                idx.rejections_version(),
                seen.0,
                "rejections changed: {:?}",
                now
            );
        }
        seen = (idx.rejections_version(), now);
        let sum: usize = idx
            .table()
            .frontends
            .values()
            .map(|s| s.backends.len())
            .sum();
        prop_assert_eq!(idx.table_backends(), sum);
        Ok(())
    };
    for (i, op) in ops.iter().enumerate() {
        apply_op(&mut idx, op);
        check_seen(&idx)?;
        if i == ops.len() / 2 {
            idx.track_dns();
        }
        if flush_mask & (1 << (i % 64)) != 0 {
            replica.apply(&idx.flush());
            check_seen(&idx)?;
            for (svc, r) in idx.take_dns_changes() {
                zone.set(&svc, r);
            }
        }
    }
    replica.apply(&idx.flush());
    check_seen(&idx)?;
    for (svc, r) in idx.take_dns_changes() {
        zone.set(&svc, r);
    }
    prop_assert_eq!(&replica, idx.table());

    // Fresh: replay only the final state of every object.
    let mut fresh = Index::new(idx.node().clone());
    for op in ops {
        if let Op::Stale(..) = op {
            apply_op(&mut fresh, op);
        }
    }
    let mut last_import: BTreeMap<String, Option<ImportInput>> = BTreeMap::new();
    let mut last_slice: BTreeMap<String, Option<SliceInput>> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Import(i) => {
                last_import.insert(i.name.clone(), Some(i.clone()));
            }
            Op::DeleteImport(n) => {
                last_import.insert(n.clone(), None);
            }
            Op::Slice(s) => {
                last_slice.insert(s.name.clone(), Some(s.clone()));
            }
            Op::DeleteSlice(n) => {
                last_slice.insert(n.clone(), None);
            }
            _ => {}
        }
    }
    for i in last_import.into_values().flatten() {
        fresh.upsert_import(i);
    }
    for s in last_slice.into_values().flatten() {
        fresh.upsert_slice(s);
    }
    fresh.flush();
    prop_assert_eq!(fresh.table(), idx.table());
    // The zone kept up to date per change equals the records computed fresh.
    for name in ["a", "b", "c"] {
        let svc = crate::input::ServiceRef::new("ns", name);
        prop_assert_eq!(
            zone.get("ns", name).map(|r| (*r).clone()),
            fresh.dns_records(&svc),
            "DNS records of {}",
            name
        );
    }
    prop_assert_eq!(fresh.rejections(), idx.rejections());

    let limits = idx.node().guard.limits;
    prop_assert!(idx.table().frontends.len() <= limits.frontends);
    let mut backends = 0;
    for svc in idx.table().frontends.values() {
        let any_ready = svc.backends.iter().any(|b| b.ready);
        prop_assert!(svc.backends.len() <= limits.backends_per_frontend);
        backends += svc.backends.len();
        for b in svc.selected() {
            prop_assert!(
                b.ready || (!any_ready && b.serving && b.terminating),
                "unusable backend selected: {:?}",
                b
            );
            prop_assert!(crate::validate::hostile(b.address).is_none());
        }
    }
    prop_assert!(backends <= limits.backends);
    // One owner per VIP.
    let mut owners: BTreeMap<std::net::IpAddr, &str> = BTreeMap::new();
    for (f, svc) in &idx.table().frontends {
        let o = owners.entry(f.vip).or_insert(svc.service.as_str());
        prop_assert_eq!(*o, svc.service.as_str(), "two owners of {}", f.vip);
    }
    // Deterministic output.
    let r = idx.rejections();
    prop_assert_eq!(
        crate::render::json(idx.table(), &r),
        crate::render::json(fresh.table(), &fresh.rejections())
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn incremental_diffs_equal_a_fresh_compute(ops in proptest::collection::vec(arb_op(), 1..40), flush_mask in any::<u64>()) {
        incremental_equals_fresh(node("c1"), &ops, flush_mask)?;
    }

    /// The same with caps small enough that trimming and admission happen all the time.
    #[test]
    fn incremental_diffs_equal_a_fresh_compute_at_the_caps(ops in proptest::collection::vec(arb_op(), 1..40), flush_mask in any::<u64>()) {
        let mut n = node("c1");
        n.guard.limits = crate::guard::Limits {
            ports_per_import: 2,
            ports_per_slice: 2,
            endpoints_per_slice: 3,
            backends_per_frontend: 2,
            frontends: 3,
            backends: 4,
        };
        incremental_equals_fresh(n, &ops, flush_mask)?;
    }
}
