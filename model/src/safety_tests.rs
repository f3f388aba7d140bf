//! The node's guard at work: objects written by someone careless or hostile are rejected or
//! trimmed with a reason, and everything else keeps working (issue 11).

use std::collections::BTreeSet;

use crate::{
    Guard, IpCidr, Limits, NodeConfig,
    index::{Index, compute},
    index_tests::{ep, fallback, fe, mk_import, mk_slice, node, selected},
    validate::{LABEL_MANAGED_BY, Reason, Rejection},
};

fn guarded(cidrs: &[&str], protected: &[&str]) -> NodeConfig {
    let mut n = node("c1");
    n.guard = Guard {
        clusterset_cidrs: cidrs.iter().map(|c| c.parse::<IpCidr>().unwrap()).collect(),
        protected: protected.iter().map(|a| a.parse().unwrap()).collect(),
        ..Default::default()
    };
    n
}

fn reasons_of<'a>(rej: &'a [Rejection], object: &str) -> Vec<(Reason, &'a str)> {
    rej.iter()
        .filter(|r| r.object == object)
        .map(|r| (r.reason, r.message.as_str()))
        .collect()
}

#[test]
fn vips_outside_the_clusterset_ranges_or_protected_are_refused() {
    let n = guarded(&["198.18.0.0/24", "2001:2::/64"], &["198.18.0.1"]);
    let imports = [
        mk_import("ok", &["198.18.0.10", "2001:2::10"], &[("", "TCP", 80)]),
        mk_import("apiserver", &["198.19.0.1"], &[("", "TCP", 443)]),
        mk_import("node", &["198.18.0.1"], &[("", "TCP", 22)]),
        mk_import("v6out", &["2001:2:1::10"], &[("", "TCP", 80)]),
        mk_import("mapped", &["::ffff:198.18.0.11"], &[("", "TCP", 80)]),
        mk_import("nat64", &["64:ff9b::c612:b"], &[("", "TCP", 80)]),
    ];
    let (t, rej) = compute(n, imports, []);
    let vips: Vec<String> = t.frontends.keys().map(|f| f.vip.to_string()).collect();
    assert_eq!(vips, ["198.18.0.10", "2001:2::10"]);
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/apiserver")[0].0,
        Reason::VipNotAllowed
    );
    assert!(
        reasons_of(&rej, "ServiceImport ns/apiserver")[0]
            .1
            .contains("198.18.0.0/24")
    );
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/node")[0].0,
        Reason::ProtectedAddress
    );
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/v6out")[0].0,
        Reason::VipNotAllowed
    );
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/mapped")[0].0,
        Reason::NoncanonicalAddress
    );
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/nat64")[0].0,
        Reason::NoncanonicalAddress
    );
}

#[test]
fn endpoints_that_would_loop_or_hit_the_node_are_refused() {
    let n = guarded(&["198.18.0.0/24"], &["198.18.1.1"]);
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let s = mk_slice(
        "web-c1",
        "web",
        "c1",
        &[("http", 8080)],
        vec![
            ep("198.18.1.2", true),
            ep("198.18.0.10", true), // the VIP itself
            ep("198.18.0.99", true), // another ClusterSetIP
            ep("198.18.1.1", true),  // the node
            ep("::ffff:198.18.1.3", true),
        ],
    );
    let (t, rej) = compute(n, [imp], [s]);
    assert_eq!(selected(&t, &fe("198.18.0.10", 80)), ["198.18.1.2:8080@c1"]);
    let r: Vec<Reason> = reasons_of(&rej, "EndpointSlice ns/web-c1")
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(
        r.iter()
            .filter(|r| **r == Reason::EndpointIsClusterSetIp)
            .count(),
        2
    );
    assert!(r.contains(&Reason::ProtectedAddress));
    assert!(r.contains(&Reason::NoncanonicalAddress));
}

#[test]
fn a_vip_has_one_owner_with_all_its_ports() {
    let mut old = mk_import("a", &["198.18.0.10"], &[("http", "TCP", 80)]);
    old.namespace = "team-a".into();
    old.created = Some("2026-01-01T00:00:00Z".into());
    // Another namespace asks for another port of the same VIP: it gets nothing.
    let mut thief = mk_import("b", &["198.18.0.10"], &[("ssh", "TCP", 22)]);
    thief.namespace = "attacker".into();
    thief.created = Some("2026-02-01T00:00:00Z".into());
    let mut idx = Index::new(node("c1"));
    idx.upsert_import(thief.clone());
    idx.upsert_import(old.clone());
    idx.flush();
    let keys: Vec<_> = idx.table().frontends.keys().copied().collect();
    assert_eq!(keys, [fe("198.18.0.10", 80)]);
    let rej = idx.rejections();
    assert_eq!(
        reasons_of(&rej, "ServiceImport attacker/b")[0].0,
        Reason::VipConflict
    );
    // When the owner goes, the other import takes the VIP with its own ports only.
    idx.delete_import("team-a", "a");
    let d = idx.flush();
    assert_eq!(d.remove, [fe("198.18.0.10", 80)]);
    assert_eq!(
        d.upsert.keys().copied().collect::<Vec<_>>(),
        [fe("198.18.0.10", 22)]
    );
}

#[test]
fn equal_timestamps_are_broken_by_uid_not_by_name() {
    // "aaa" sorts first by name, but the API server gave "zzz" the smaller uid.
    let mut x = mk_import("aaa", &["198.18.0.10"], &[("", "TCP", 80)]);
    x.uid = Some("f0000000-0000-0000-0000-000000000000".into());
    let mut y = mk_import("zzz", &["198.18.0.10"], &[("", "TCP", 80)]);
    y.uid = Some("10000000-0000-0000-0000-000000000000".into());
    let (t, _) = compute(node("c1"), [x, y], []);
    assert_eq!(t.frontends[&fe("198.18.0.10", 80)].service, "ns/zzz");
}

#[test]
fn slices_of_kubernetes_controllers_and_untrusted_managers_are_refused() {
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let mut mirrored = mk_slice(
        "m",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.6", true)],
    );
    mirrored.labels.insert(
        LABEL_MANAGED_BY.into(),
        "endpointslicemirroring-controller.k8s.io".into(),
    );
    let ours = mk_slice(
        "o",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.2", true)],
    );
    let mut other = mk_slice(
        "x",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.7", true)],
    );
    other
        .labels
        .insert(LABEL_MANAGED_BY.into(), "someone-else".into());
    let mut unlabelled = mk_slice(
        "u",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.8", true)],
    );
    unlabelled.labels.remove(LABEL_MANAGED_BY);

    // Without an allowlist: only Kubernetes' own controllers are refused.
    let all = [
        mirrored.clone(),
        ours.clone(),
        other.clone(),
        unlabelled.clone(),
    ];
    let (t, rej) = compute(node("c1"), [imp.clone()], all.clone());
    assert_eq!(t.frontends[&fe("198.18.0.10", 80)].backends.len(), 3);
    assert_eq!(
        reasons_of(&rej, "EndpointSlice ns/m")[0].0,
        Reason::DefaultController
    );
    // With one: only the trusted manager's slice counts.
    let mut n = node("c1");
    n.guard.trusted_managed_by = ["mcs-controller.example".to_string()].into();
    let (t, rej) = compute(n, [imp], all);
    assert_eq!(selected(&t, &fe("198.18.0.10", 80)), ["198.18.1.2:8080@c1"]);
    for o in ["EndpointSlice ns/x", "EndpointSlice ns/u"] {
        assert_eq!(reasons_of(&rej, o)[0].0, Reason::UntrustedManager, "{o}");
    }
}

#[test]
fn caps_reject_with_reasons_and_keep_the_rest() {
    let mut n = node("c1");
    n.guard.limits = Limits {
        ports_per_import: 3,
        endpoints_per_slice: 4,
        backends_per_frontend: 2,
        ..Limits::default()
    };
    let ports: Vec<(&str, &str, i64)> = (1..=4).map(|p| ("", "TCP", p)).collect();
    let huge = mk_import("huge", &["198.18.0.20"], &ports);
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let fat = mk_slice(
        "fat",
        "web",
        "c2",
        &[("http", 8080)],
        (10..15)
            .map(|i| ep(&format!("198.18.2.{i}"), true))
            .collect(),
    );
    let local = mk_slice(
        "local",
        "web",
        "c1",
        &[("http", 8080)],
        vec![
            ep("198.18.1.9", false),
            ep("198.18.1.3", true),
            ep("198.18.1.2", true),
        ],
    );
    let remote = mk_slice(
        "remote",
        "web",
        "c2",
        &[("http", 8080)],
        vec![ep("198.18.2.2", true)],
    );
    let (t, rej) = compute(n, [huge, imp], [fat, local, remote]);
    assert!(!t.frontends.contains_key(&fe("198.18.0.20", 1)));
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/huge")[0].0,
        Reason::TooManyPorts
    );
    assert_eq!(
        reasons_of(&rej, "EndpointSlice ns/fat")[0].0,
        Reason::TooManyEndpoints
    );
    // Four candidates, two kept: the two selected (ready, local) ones.
    let svc = &t.frontends[&fe("198.18.0.10", 80)];
    assert_eq!(svc.backends.len(), 2);
    assert_eq!(
        selected(&t, &fe("198.18.0.10", 80)),
        ["198.18.1.2:8080@c1", "198.18.1.3:8080@c1"]
    );
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/web")[0].0,
        Reason::TooManyBackends
    );
}

/// Issue 52's hog: one namespace fills the table with old many-port imports (no endpoints);
/// an import of another namespace, younger than all of them, is still admitted, and the hog
/// loses its youngest import instead. Within the hog, older imports keep their place.
#[test]
fn past_the_caps_a_namespace_within_its_share_is_admitted_whatever_another_holds() {
    let mut n = node("c1");
    n.guard.limits.frontends = 100;
    let mk = |ns: &str, name: &str, vip: &str, ports: i64, day: u8| {
        let p: Vec<(&str, &str, i64)> = (1..=ports).map(|p| ("", "TCP", p)).collect();
        let mut i = mk_import(name, &[vip], &p);
        i.namespace = ns.into();
        i.created = Some(format!("2026-01-{day:02}T00:00:00Z"));
        i
    };
    let mut idx = Index::new(n);
    // 10 imports of 10 ports: the whole table.
    for k in 0..10u8 {
        idx.upsert_import(mk(
            "hog",
            &format!("h{k}"),
            &format!("198.18.0.{}", 10 + k),
            10,
            1 + k,
        ));
    }
    idx.flush();
    assert_eq!(idx.table().frontends.len(), 100);
    assert!(idx.rejections().is_empty());
    // Two small imports in two other namespaces, the youngest of all.
    idx.upsert_import(mk("shop", "web", "198.18.1.10", 1, 20));
    idx.upsert_import(mk("bank", "api", "198.18.1.11", 2, 21));
    idx.flush();
    let vips: BTreeSet<String> = idx
        .table()
        .frontends
        .keys()
        .map(|f| f.vip.to_string())
        .collect();
    assert!(
        vips.contains("198.18.1.10") && vips.contains("198.18.1.11"),
        "{vips:?}"
    );
    let rej = idx.rejections();
    let over: Vec<&str> = rej
        .iter()
        .filter(|r| r.reason == Reason::OverCapacity)
        .map(|r| r.object.as_str())
        .collect();
    assert_eq!(
        over,
        ["ServiceImport hog/h9"],
        "the hog's youngest import goes"
    );
    assert!(
        rej[0].message.contains("namespaces share it fairly"),
        "{}",
        rej[0].message
    );
    assert_eq!(idx.table().frontends.len(), 93);
    // Within one namespace the old rule holds: a third small namespace arriving takes from
    // the hog again (its next-youngest), never from shop or bank.
    idx.upsert_import(mk("blog", "www", "198.18.1.12", 8, 22));
    idx.flush();
    let over: BTreeSet<String> = idx
        .rejections()
        .iter()
        .filter(|r| r.reason == Reason::OverCapacity)
        .map(|r| r.object.clone())
        .collect();
    assert_eq!(
        over,
        BTreeSet::from([
            "ServiceImport hog/h8".to_string(),
            "ServiceImport hog/h9".to_string()
        ])
    );
    // The newcomers leave: the hog gets its whole table back.
    for (ns, name) in [("shop", "web"), ("bank", "api"), ("blog", "www")] {
        idx.delete_import(ns, name);
    }
    idx.flush();
    assert_eq!(idx.table().frontends.len(), 100);
    assert!(idx.rejections().is_empty());
}

#[test]
fn a_full_table_admits_older_imports_first_and_takes_younger_ones_when_room_frees() {
    let mut n = node("c1");
    n.guard.limits.frontends = 3;
    let mk = |name: &str, vip: &str, ports: i64, day: u8| {
        let p: Vec<(&str, &str, i64)> = (1..=ports).map(|p| ("", "TCP", p)).collect();
        let mut i = mk_import(name, &[vip], &p);
        i.created = Some(format!("2026-01-{day:02}T00:00:00Z"));
        i
    };
    let mut idx = Index::new(n);
    // The youngest arrives first; older ones still win their place.
    idx.upsert_import(mk("young", "198.18.0.30", 2, 3));
    idx.flush();
    assert_eq!(idx.table().frontends.len(), 2);
    idx.upsert_import(mk("old", "198.18.0.10", 2, 1));
    idx.upsert_import(mk("mid", "198.18.0.20", 1, 2));
    let d = idx.flush();
    let vips: Vec<String> = idx
        .table()
        .frontends
        .keys()
        .map(|f| f.vip.to_string())
        .collect();
    assert_eq!(vips, ["198.18.0.10", "198.18.0.10", "198.18.0.20"]);
    assert_eq!(d.remove.len(), 2, "young's frontends are removed");
    assert_eq!(
        reasons_of(&idx.rejections(), "ServiceImport ns/young")[0].0,
        Reason::OverCapacity
    );
    idx.delete_import("ns", "old");
    idx.flush();
    let vips: Vec<String> = idx
        .table()
        .frontends
        .keys()
        .map(|f| f.vip.to_string())
        .collect();
    assert_eq!(vips, ["198.18.0.20", "198.18.0.30", "198.18.0.30"]);
    assert!(idx.rejections().is_empty());
}

#[test]
fn internal_traffic_policy_local_selects_only_endpoints_on_this_node() {
    let mut imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    imp.internal_traffic_policy = Some("Local".into());
    let mut here = ep("198.18.1.2", true);
    here.node_name = Some("node-z1".into());
    let mut there = ep("198.18.1.3", true);
    there.node_name = Some("node-z2".into());
    let s = mk_slice("s", "web", "c1", &[("http", 8080)], vec![here, there]);
    let (t, _) = compute(node("c1"), [imp.clone()], [s]);
    assert_eq!(selected(&t, &fe("198.18.0.10", 80)), ["198.18.1.2:8080@c1"]);
    // Traffic stays on the node: the endpoint elsewhere is no fallback either.
    assert!(fallback(&t, &fe("198.18.0.10", 80)).is_empty());
    // None on this node: nothing is selected (no fallback), as with kube-proxy.
    let mut elsewhere = ep("198.18.1.3", true);
    elsewhere.node_name = Some("node-z2".into());
    let s = mk_slice("s", "web", "c1", &[("http", 8080)], vec![elsewhere]);
    let (t, _) = compute(node("c1"), [imp.clone()], [s]);
    assert!(selected(&t, &fe("198.18.0.10", 80)).is_empty());
    assert!(fallback(&t, &fe("198.18.0.10", 80)).is_empty());
    imp.internal_traffic_policy = Some("Sometimes".into());
    let (_, rej) = compute(node("c1"), [imp], []);
    assert_eq!(rej[0].reason, Reason::InvalidPolicy);
}

#[test]
fn nameless_objects_are_rejected_not_dropped() {
    let imp = mk_import("", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let s = mk_slice(
        "",
        "web",
        "c1",
        &[("http", 8080)],
        vec![ep("198.18.1.2", true)],
    );
    let (t, rej) = compute(node("c1"), [imp], [s]);
    assert!(t.frontends.is_empty());
    assert_eq!(
        rej.iter()
            .filter(|r| r.reason == Reason::MissingName)
            .count(),
        2
    );
}

#[test]
fn headless_endpoints_count_against_the_caps() {
    // Issue 32: a headless import has no frontend, so its endpoints escaped every cap (ten
    // slices of 1,000 endpoints were all held, and DNS built every record).
    let mut n = node("c1");
    n.guard.limits.backends_per_frontend = 3;
    n.guard.limits.backends = 5;
    let headless = |name: &str, day: u8| {
        let mut i = mk_import(name, &[], &[("http", "TCP", 80)]);
        i.type_ = "Headless".into();
        i.created = Some(format!("2026-01-{day:02}T00:00:00Z"));
        i
    };
    let slice = |name: &str, svc: &str, cluster: &str, base: u8, count: u8| {
        mk_slice(
            name,
            svc,
            cluster,
            &[("http", 8080)],
            (0..count)
                .map(|i| ep(&format!("198.18.{base}.{}", i + 2), true))
                .collect(),
        )
    };
    let mut idx = Index::new(n);
    idx.track_dns();
    idx.upsert_import(headless("big", 1));
    idx.upsert_import(headless("young", 3));
    idx.upsert_import(mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]));
    // big: 2 remote + 2 local endpoints, one of them twice (another slice): 4 distinct.
    idx.upsert_slice(slice("big-c2", "big", "c2", 2, 2));
    idx.upsert_slice(slice("big-c1", "big", "c1", 1, 2));
    idx.upsert_slice(slice("big-c1b", "big", "c1", 1, 1));
    idx.upsert_slice(slice("young-c2", "young", "c2", 3, 3));
    idx.upsert_slice(slice("web-c2", "web", "c2", 4, 1));
    idx.flush();
    let rej = idx.rejections();
    // big: trimmed to 3, this cluster's endpoints first.
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/big")[0].0,
        Reason::TooManyBackends
    );
    let big = idx
        .dns_records(&crate::input::ServiceRef::new("ns", "big"))
        .unwrap();
    let kept: Vec<String> = big
        .endpoints()
        .iter()
        .map(|e| format!("{}@{}", e.address, e.cluster))
        .collect();
    assert_eq!(kept, ["198.18.1.2@c1", "198.18.1.3@c1", "198.18.2.2@c2"]);
    // big (3) + web's backend (1, created the same day as big, so admitted by name) fit
    // the table's 5; young's 3 more do not: rejected, and it has no DNS name.
    assert_eq!(
        reasons_of(&rej, "ServiceImport ns/young")[0].0,
        Reason::OverCapacity
    );
    assert!(
        idx.dns_records(&crate::input::ServiceRef::new("ns", "young"))
            .is_none()
    );
    assert_eq!(
        selected(idx.table(), &fe("198.18.0.10", 80)),
        ["198.18.4.2:8080@c2"]
    );
    idx.take_dns_changes();
    // Room frees: young gets its name.
    idx.delete_slice("ns", "big-c2");
    idx.delete_slice("ns", "big-c1");
    idx.flush();
    let changed: Vec<String> = idx
        .take_dns_changes()
        .into_iter()
        .filter(|(_, r)| r.is_some())
        .map(|(s, _)| s.to_string())
        .collect();
    assert!(changed.contains(&"ns/young".to_string()), "{changed:?}");
    assert!(idx.rejections().is_empty(), "{:?}", idx.rejections());
}

#[test]
fn slices_copied_from_selectorless_sources_are_refused_unless_allowed() {
    // Issue 32: an Endpoints-backed Service exported from another member became an MCS slice
    // and was trusted (the mirrored source slice is refused as `default_controller`, its copy
    // was not). Our controller now says where a slice came from.
    let imp = mk_import("web", &["198.18.0.10"], &[("http", "TCP", 80)]);
    let copied = |name: &str, source: Option<&str>, addr: &str| {
        let mut s = mk_slice(name, "web", "c2", &[("http", 8080)], vec![ep(addr, true)]);
        if let Some(m) = source {
            s.labels
                .insert(crate::validate::LABEL_SOURCE_MANAGED_BY.into(), m.into());
        }
        s
    };
    let slices = [
        copied(
            "selected",
            Some("endpointslice-controller.k8s.io"),
            "198.18.2.2",
        ),
        copied(
            "mirrored",
            Some("endpointslicemirroring-controller.k8s.io"),
            "198.18.2.3",
        ),
        copied("by-hand", Some("none"), "198.18.2.4"),
        // Without the label (another MCS controller): taken as it is.
        copied("unlabelled", None, "198.18.2.5"),
    ];
    let (t, rej) = compute(node("c1"), [imp.clone()], slices.clone());
    assert_eq!(
        selected(&t, &fe("198.18.0.10", 80)),
        ["198.18.2.2:8080@c2", "198.18.2.5:8080@c2"]
    );
    for o in ["EndpointSlice ns/mirrored", "EndpointSlice ns/by-hand"] {
        assert_eq!(reasons_of(&rej, o)[0].0, Reason::SelectorlessSource, "{o}");
    }
    let mut n = node("c1");
    n.guard.allow_selectorless = true;
    let (t, rej) = compute(n, [imp], slices);
    assert_eq!(selected(&t, &fe("198.18.0.10", 80)).len(), 4);
    assert!(rej.is_empty(), "{rej:?}");
}

#[test]
fn an_import_whose_writer_publishes_no_endpoint_slices_gets_no_frontend_but_its_name() {
    let n = guarded(&["198.18.0.0/24"], &[]);
    let mut theirs = mk_import("theirs", &["198.18.0.20"], &[("http", "TCP", 80)]);
    theirs.endpoint_slices_absent = true;
    let ours = mk_import("ours", &["198.18.0.21"], &[("http", "TCP", 80)]);
    // A slice that names the Absent import is not used either.
    let slices = ["theirs", "ours"].map(|svc| {
        mk_slice(
            &format!("{svc}-c1"),
            svc,
            "c1",
            &[("http", 8080)],
            vec![ep("198.18.1.2", true)],
        )
    });
    let mut index = Index::new(n);
    index.upsert_import(theirs.clone());
    index.upsert_import(ours);
    for s in slices {
        index.upsert_slice(s);
    }
    index.flush();
    let t = index.table();
    assert!(!t.frontends.contains_key(&fe("198.18.0.20", 80)));
    assert_eq!(selected(t, &fe("198.18.0.21", 80)), ["198.18.1.2:8080@c1"]);
    let rej = index.rejections();
    let why = reasons_of(&rej, "ServiceImport ns/theirs");
    assert_eq!(why.len(), 1, "{why:?}");
    assert_eq!(why[0].0, Reason::EndpointSlicesAbsent);
    assert!(
        why[0].1.contains("endpointSliceObjects is Absent"),
        "{}",
        why[0].1
    );
    // Its name answers its ClusterSetIP, which the implementation that wrote it serves.
    let records = index.dns_records(&theirs.service_ref()).expect("a name");
    assert_eq!(
        records.ips,
        ["198.18.0.20".parse::<std::net::IpAddr>().unwrap()]
    );
    assert!(
        index
            .dns_records(&crate::input::ServiceRef::new("ns", "ours"))
            .is_some()
    );
}
