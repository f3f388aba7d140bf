use proptest::prelude::*;

use super::*;

fn port(name: &str, protocol: &str, port: i32) -> Port {
    Port {
        name: name.into(),
        protocol: protocol.into(),
        port,
        app_protocol: None,
    }
}

fn svc(ports: Vec<Port>) -> ServiceShape {
    ServiceShape {
        kind: Some(ServiceKind::ClusterIp),
        ports,
        session_affinity: Some("ClientIP".into()),
        session_affinity_timeout: Some(Some(10)),
        ip_families: vec!["IPv4".into()],
        ..Default::default()
    }
}

fn export(created: i64, service: Option<ServiceShape>) -> Export {
    Export {
        created,
        service,
        ..Default::default()
    }
}

fn key() -> ServiceKey {
    ServiceKey {
        namespace: "ns".into(),
        name: "hello".into(),
    }
}

fn hello() -> Vec<Port> {
    vec![port("tcp", "TCP", 42), port("udp", "UDP", 42)]
}

#[test]
fn one_export_gives_an_import_with_its_fields_and_no_conflict() {
    let m = merge(
        &key(),
        &[("c1".to_string(), export(100, Some(svc(hello()))))].into(),
    );
    let i = m.import.unwrap();
    assert!(!i.headless);
    assert_eq!(i.ports, hello());
    assert_eq!(i.session_affinity.as_deref(), Some("ClientIP"));
    assert_eq!(i.session_affinity_timeout, Some(Some(10)));
    assert_eq!(i.ip_families, ["IPv4"]);
    assert_eq!(i.clusters, ["c1"]);
    let c = &m.exports["c1"];
    assert!(c.valid.status && c.ready.status);
    assert_eq!(c.conflict.as_ref().unwrap().reason, reason::NO_CONFLICTS);
    assert!(!c.conflict.as_ref().unwrap().status);
}

#[test]
fn no_service_and_external_name_are_invalid_and_give_no_import() {
    let external = ServiceShape {
        kind: Some(ServiceKind::ExternalName),
        ..Default::default()
    };
    let m = merge(
        &key(),
        &[
            ("c1".to_string(), export(1, None)),
            ("c2".to_string(), export(2, Some(external))),
        ]
        .into(),
    );
    assert_eq!(m.import, None);
    assert_eq!(m.exports["c1"].valid.reason, reason::NO_SERVICE);
    assert_eq!(m.exports["c2"].valid.reason, reason::INVALID_SERVICE_TYPE);
    assert!(
        m.exports
            .values()
            .all(|c| !c.valid.status && c.conflict.is_none())
    );
}

#[test]
fn port_union_with_a_conflict_on_both_exports() {
    // As the conformance suite: c2 adds an SCTP port: the union is exposed, and it is a conflict.
    let m = merge(
        &key(),
        &[
            ("c1".to_string(), export(100, Some(svc(hello())))),
            (
                "c2".to_string(),
                export(
                    102,
                    Some(svc(vec![port("tcp", "TCP", 42), port("stcp", "SCTP", 142)])),
                ),
            ),
        ]
        .into(),
    );
    let i = m.import.unwrap();
    assert_eq!(
        i.ports,
        [
            port("stcp", "SCTP", 142),
            port("tcp", "TCP", 42),
            port("udp", "UDP", 42)
        ]
    );
    assert_eq!(i.clusters, ["c1", "c2"]);
    for c in ["c1", "c2"] {
        let k = m.exports[c].conflict.as_ref().unwrap();
        assert!(k.status, "{c}");
        assert_eq!(k.reason, reason::PORT);
    }
}

#[test]
fn a_conflicting_port_loses_to_the_oldest_export() {
    let m = merge(
        &key(),
        &[
            ("c1".to_string(), export(100, Some(svc(hello())))),
            (
                "c2".to_string(),
                export(99, Some(svc(vec![port("tcp", "TCP", 43)]))),
            ),
        ]
        .into(),
    );
    // c2 is older here: its tcp/43 wins, c1's tcp/42 loses, udp/42 joins.
    assert_eq!(
        m.import.unwrap().ports,
        [port("tcp", "TCP", 43), port("udp", "UDP", 42)]
    );
    assert!(
        m.exports
            .values()
            .all(|c| c.conflict.as_ref().unwrap().status)
    );
}

#[test]
fn headlessness_and_every_field_conflict_with_their_reason() {
    let mut other = svc(hello());
    other.headless = true;
    other.session_affinity = None;
    other.session_affinity_timeout = None;
    other.internal_traffic_policy = Some("Local".into());
    other.traffic_distribution = Some("PreferClose".into());
    let mut e2 = export(200, Some(other));
    e2.labels.insert("a".into(), "b".into());
    let m = merge(
        &key(),
        &[
            ("c1".to_string(), export(100, Some(svc(hello())))),
            ("c2".to_string(), e2),
        ]
        .into(),
    );
    let i = m.import.unwrap();
    assert!(!i.headless, "the oldest (ClusterSetIP) wins");
    let r = &m.exports["c1"].conflict.as_ref().unwrap().reason;
    for want in [
        reason::TYPE,
        reason::SESSION_AFFINITY,
        reason::SESSION_AFFINITY_CONFIG,
        reason::INTERNAL_TRAFFIC_POLICY,
        reason::TRAFFIC_DISTRIBUTION,
        reason::LABELS,
    ] {
        assert!(r.split(',').any(|x| x == want), "{want} missing from {r}");
    }
    assert!(
        !r.contains(reason::IP_FAMILY),
        "headless imports have no families: {r}"
    );
}

#[test]
fn a_headless_import_carries_the_families_of_its_services() {
    let mut h = svc(hello());
    h.headless = true;
    let m = merge(&key(), &[("a".to_string(), export(100, Some(h)))].into());
    let i = m.import.unwrap();
    assert!(i.headless);
    assert_eq!(i.ip_families, ["IPv4"]);
}

#[test]
fn ties_on_the_timestamp_go_to_the_smaller_cluster_id() {
    let mut h = svc(hello());
    h.headless = true;
    let m = merge(
        &key(),
        &[
            ("b".to_string(), export(100, Some(h))),
            ("a".to_string(), export(100, Some(svc(hello())))),
        ]
        .into(),
    );
    assert!(!m.import.unwrap().headless);
}

#[test]
fn the_import_carries_at_most_100_ports_the_oldest_first() {
    assert_eq!(
        MAX_PORTS,
        mcs_model::guard::Limits::default().ports_per_import
    );
    let many: Vec<Port> = (0..100)
        .map(|i| port(&format!("p{i}"), "TCP", 1000 + i))
        .collect();
    let m = merge(
        &key(),
        &[
            (
                "c1".to_string(),
                export(1, Some(svc(vec![port("web", "TCP", 80)]))),
            ),
            ("c2".to_string(), export(2, Some(svc(many)))),
        ]
        .into(),
    );
    let i = m.import.unwrap();
    assert_eq!(i.ports.len(), MAX_PORTS);
    assert!(
        i.ports.contains(&port("web", "TCP", 80)),
        "the older export's port is kept"
    );
    assert!(
        !i.ports.contains(&port("p99", "TCP", 1099)),
        "the youngest port is left out"
    );
    assert_eq!(i.clusters, ["c1", "c2"]);
    for c in ["c1", "c2"] {
        let k = m.exports[c].conflict.as_ref().unwrap();
        assert!(k.status && k.reason == reason::PORT, "{c}: {k:?}");
        assert!(
            k.message.contains("at most 100 ports") && k.message.contains("1 of c2"),
            "{}",
            k.message
        );
        assert!(m.exports[c].valid.status);
    }
}

#[test]
fn exports_with_metadata_an_import_cannot_carry_or_refused_are_invalid_alone() {
    let bad_labels = Export {
        labels: [("bad key!".to_string(), "x".to_string())].into(),
        ..export(1, Some(svc(hello())))
    };
    let bad_annotations = Export {
        annotations: [("a".to_string(), "v".repeat(meta::MAX_ANNOTATION_BYTES))].into(),
        ..export(1, Some(svc(hello())))
    };
    let refused = Export {
        refused: Some(meta::Refusal::new("ServiceNotAllowed", "no")),
        ..export(1, Some(svc(hello())))
    };
    let m = merge(
        &key(),
        &[
            ("c1".to_string(), bad_labels),
            ("c2".to_string(), bad_annotations),
            ("c3".to_string(), refused),
            ("c4".to_string(), export(5, Some(svc(hello())))),
        ]
        .into(),
    );
    let i = m.import.unwrap();
    assert_eq!(i.clusters, ["c4"], "only the valid export is imported");
    assert!(i.labels.is_empty() && i.annotations.is_empty());
    for (c, r) in [
        ("c1", meta::INVALID_LABELS),
        ("c2", meta::INVALID_ANNOTATIONS),
        ("c3", "ServiceNotAllowed"),
    ] {
        let e = &m.exports[c];
        assert_eq!((e.valid.status, e.valid.reason.as_str()), (false, r), "{c}");
        assert!(!e.ready.status && e.conflict.is_none(), "{c}");
    }
    let c4 = &m.exports["c4"];
    assert!(c4.valid.status && !c4.conflict.as_ref().unwrap().status);
}

fn arb_export() -> impl Strategy<Value = Export> {
    let port = (
        prop::sample::select(vec!["tcp", "udp", "http", ""]),
        prop::sample::select(vec!["TCP", "UDP", "SCTP"]),
        prop::sample::select(vec![42, 43, 80]),
    )
        .prop_map(|(n, p, x)| port(n, p, x));
    (
        0i64..4,
        prop::option::weighted(
            0.85,
            (prop::collection::vec(port, 0..4), any::<bool>(), 0u8..3),
        ),
        prop::option::of(prop::sample::select(vec!["Local", "Cluster"])),
    )
        .prop_map(|(created, service, itp)| Export {
            created,
            service: service.map(|(ports, headless, kind)| ServiceShape {
                kind: Some(match kind {
                    0 => ServiceKind::ClusterIp,
                    1 => ServiceKind::NodePort,
                    _ => ServiceKind::ExternalName,
                }),
                headless,
                ports,
                internal_traffic_policy: itp.map(str::to_string),
                ip_families: vec!["IPv4".into()],
                ..Default::default()
            }),
            ..Default::default()
        })
}

proptest! {
    /// Every cluster computes the same merge, whatever order the exports arrive in (the map is
    /// rebuilt from a shuffled list), and the import is the oldest valid export's.
    #[test]
    fn the_merge_is_the_same_in_any_order_and_follows_the_oldest(
        exports in prop::collection::vec(arb_export(), 1..5),
        seed in any::<u64>(),
    ) {
        let named: Vec<(ClusterId, Export)> =
            exports.into_iter().enumerate().map(|(i, e)| (format!("c{i}"), e)).collect();
        let a: BTreeMap<ClusterId, Export> = named.iter().cloned().collect();
        let mut shuffled = named.clone();
        let n = shuffled.len();
        for i in 0..n {
            shuffled.swap(i, (seed as usize).wrapping_add(i * 7) % n);
        }
        let b: BTreeMap<ClusterId, Export> = shuffled.into_iter().collect();
        let ma = merge(&key(), &a);
        prop_assert_eq!(&ma, &merge(&key(), &b));

        // Every export has conditions; valid ones exactly are the import's clusters.
        prop_assert_eq!(ma.exports.len(), a.len());
        let valid: Vec<&ClusterId> = ma.exports.iter().filter(|(_, c)| c.valid.status).map(|(k, _)| k).collect();
        match &ma.import {
            None => prop_assert!(valid.is_empty()),
            Some(i) => {
                prop_assert_eq!(i.clusters.iter().collect::<Vec<_>>(), valid);
                let oldest = a.iter()
                    .filter(|(c, _)| ma.exports[*c].valid.status)
                    .min_by_key(|(c, e)| (e.created, (*c).clone()))
                    .unwrap();
                let w = oldest.1.service.as_ref().unwrap();
                prop_assert_eq!(i.headless, w.headless);
                // The winner's ports are all in the import; no two ports share a name or a
                // protocol+port.
                for p in &w.ports {
                    let kept = i.ports.iter().any(|q| q.name == p.name && q.protocol == p.protocol && q.port == p.port);
                    let dup_in_winner = w.ports.iter().filter(|q| q.name == p.name || (q.protocol == p.protocol && q.port == p.port)).count() > 1;
                    prop_assert!(kept || dup_in_winner, "winner's port {:?} lost", p);
                }
                let names: BTreeSet<&str> = i.ports.iter().map(|p| p.name.as_str()).collect();
                prop_assert_eq!(names.len(), i.ports.len());
                // Conflict is the same on every valid export.
                let conflicts: BTreeSet<_> = ma.exports.values().filter_map(|c| c.conflict.clone()).collect::<Vec<_>>().into_iter().map(|c| (c.status, c.reason)).collect();
                prop_assert_eq!(conflicts.len(), 1);
            }
        }
    }
}
