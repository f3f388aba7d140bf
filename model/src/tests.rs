use std::net::{IpAddr, Ipv4Addr};

use proptest::prelude::*;

use super::*;

fn frontend(i: u8, port: u16) -> Frontend {
    Frontend {
        vip: IpAddr::V4(Ipv4Addr::new(198, 18, 0, i)),
        port,
        protocol: Protocol::Tcp,
    }
}

fn service(name: &str, backends: &[(u8, bool)]) -> Arc<Service> {
    Arc::new(Service {
        service: name.into(),
        affinity: None,
        backends: backends
            .iter()
            .map(|&(i, selected)| Backend {
                address: IpAddr::V4(Ipv4Addr::new(198, 18, 1, i)),
                port: 8080,
                cluster: "c1".into(),
                zone: None,
                ready: true,
                serving: true,
                terminating: false,
                selected,
                fallback: false,
            })
            .collect(),
    })
}

fn arb_table() -> impl Strategy<Value = ForwardingTable> {
    proptest::collection::btree_map(
        (0u8..8, 79u16..82),
        proptest::collection::vec((0u8..6, any::<bool>()), 0..4),
        0..10,
    )
    .prop_map(|m| ForwardingTable {
        frontends: m
            .into_iter()
            .map(|((i, port), bes)| (frontend(i, port), service("ns/svc", &bes)))
            .collect(),
    })
}

#[test]
fn unchanged_frontends_are_not_in_the_diff() {
    let mut a = ForwardingTable::default();
    a.frontends
        .insert(frontend(1, 80), service("ns/a", &[(1, true)]));
    a.frontends
        .insert(frontend(2, 80), service("ns/b", &[(2, true)]));
    let mut b = a.clone();
    b.frontends
        .insert(frontend(2, 80), service("ns/b", &[(2, true), (3, true)]));
    b.frontends.remove(&frontend(1, 80));
    let d = diff(&a, &b);
    assert_eq!(
        d.upsert.keys().copied().collect::<Vec<_>>(),
        vec![frontend(2, 80)]
    );
    assert_eq!(d.remove, vec![frontend(1, 80)]);
    assert!(diff(&b, &b).is_empty());
}

#[test]
fn frontend_display_brackets_ipv6() {
    let f = Frontend {
        vip: "2001:2::10".parse().unwrap(),
        port: 80,
        protocol: Protocol::Udp,
    };
    assert_eq!(f.to_string(), "[2001:2::10]:80/UDP");
}

proptest! {
    #[test]
    fn applying_the_diff_yields_the_new_table(old in arb_table(), new in arb_table()) {
        let d = diff(&old, &new);
        let mut t = old.clone();
        t.apply(&d);
        prop_assert_eq!(&t, &new);
        // Minimal: every upsert changes something, every removal removes something.
        for (f, s) in &d.upsert {
            prop_assert_ne!(old.frontends.get(f), Some(s));
        }
        for f in &d.remove {
            prop_assert!(old.frontends.contains_key(f) && !new.frontends.contains_key(f));
        }
    }
}
