//! Fuzzing of the index with arbitrary objects (proptest, bounded: a fixed number of cases, so
//! it runs in CI in seconds): whatever comes in, nothing panics, nothing hostile is selected,
//! and the output renders.

use std::collections::BTreeMap;

use mcs_model::{Guard, Limits};
use mcs_model::{
    Index, NodeConfig,
    input::{EndpointInput, ImportInput, ImportPortInput, SliceInput, SlicePortInput},
    render,
    validate::{LABEL_MANAGED_BY, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER, hostile, refused},
};
use proptest::prelude::*;

/// A node that allows 198.18.0.0/24 and 2001:2::/64 as ClusterSetIPs, protects 198.18.1.1,
/// and has small caps so that fuzzed objects reach them.
fn guard() -> Guard {
    Guard {
        clusterset_cidrs: vec![
            "198.18.0.0/24".parse().unwrap(),
            "2001:2::/64".parse().unwrap(),
        ],
        protected: ["198.18.1.1".parse().unwrap()].into(),
        trusted_managed_by: Default::default(),
        allow_selectorless: false,
        limits: Limits {
            ports_per_import: 3,
            ports_per_slice: 2,
            endpoints_per_slice: 3,
            backends_per_frontend: 2,
            frontends: 4,
            backends: 5,
        },
    }
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[a-c]{1,2}",
        Just(String::new()),
        Just("198.18.0.1".to_string()),
        Just("2001:2::1".to_string()),
        Just("::ffff:127.0.0.1".to_string()),
        Just("::ffff:198.18.0.1".to_string()),
        Just("198.19.0.1".to_string()),
        Just("198.18.100.1".to_string()),
        Just("Local".to_string()),
        Just("169.254.169.254".to_string()),
        Just("TCP".to_string()),
        Just("UDP".to_string()),
        Just("ClusterSetIP".to_string()),
        Just("Headless".to_string()),
        Just("IPv4".to_string()),
        Just("IPv6".to_string()),
        Just("ClientIP".to_string()),
        Just("PreferClose".to_string()),
    ]
}

fn int() -> impl Strategy<Value = i64> {
    prop_oneof![
        any::<i64>(),
        0i64..70_000,
        Just(i64::MIN),
        Just(i64::MAX),
        Just(-1)
    ]
}

fn import() -> impl Strategy<Value = ImportInput> {
    (
        (text(), text(), proptest::option::of(text()), text()),
        proptest::collection::vec(text(), 0..4),
        proptest::collection::vec(text(), 0..3),
        proptest::collection::vec(
            (
                proptest::option::of(text()),
                proptest::option::of(text()),
                int(),
            ),
            0..4,
        ),
        (
            proptest::option::of(text()),
            proptest::option::of(int()),
            proptest::option::of(text()),
            proptest::option::of(text()),
            proptest::option::of(text()),
            proptest::bool::weighted(0.1),
        ),
    )
        .prop_map(
            |(
                (namespace, name, created, type_),
                ips,
                ip_families,
                ports,
                (aff, timeout, td, uid, itp, absent),
            )| {
                ImportInput {
                    namespace,
                    name,
                    created,
                    uid,
                    internal_traffic_policy: itp,
                    type_,
                    ips,
                    ip_families,
                    ports: ports
                        .into_iter()
                        .map(|(name, protocol, port)| ImportPortInput {
                            name,
                            protocol,
                            port,
                        })
                        .collect(),
                    session_affinity: aff,
                    affinity_timeout_seconds: timeout,
                    traffic_distribution: td,
                    endpoint_slices_absent: absent,
                }
            },
        )
}

fn slice() -> impl Strategy<Value = SliceInput> {
    (
        (text(), text(), text(), text(), text(), text()),
        proptest::collection::vec(
            (
                proptest::option::of(text()),
                proptest::option::of(text()),
                proptest::option::of(int()),
            ),
            0..3,
        ),
        proptest::collection::vec(
            (
                proptest::collection::vec(text(), 0..2),
                proptest::option::of(any::<bool>()),
                proptest::option::of(any::<bool>()),
                proptest::option::of(any::<bool>()),
                proptest::option::of(text()),
            ),
            0..4,
        ),
    )
        .prop_map(
            |((namespace, name, svc, cluster, managed, at), ports, eps)| SliceInput {
                namespace,
                name,
                labels: BTreeMap::from([
                    (LABEL_SERVICE_NAME.to_string(), svc),
                    (LABEL_SOURCE_CLUSTER.to_string(), cluster),
                    (LABEL_MANAGED_BY.to_string(), managed),
                ]),
                address_type: at,
                ports: ports
                    .into_iter()
                    .map(|(name, protocol, port)| SlicePortInput {
                        name,
                        protocol,
                        port,
                    })
                    .collect(),
                endpoints: eps
                    .into_iter()
                    .map(
                        |(addresses, ready, serving, terminating, zone)| EndpointInput {
                            addresses,
                            ready,
                            serving,
                            terminating,
                            node_name: zone.clone(),
                            zone,
                            hostname: None,
                        },
                    )
                    .collect(),
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1_000, max_shrink_iters: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_objects_never_panic(
        imports in proptest::collection::vec(import(), 0..6),
        slices in proptest::collection::vec(slice(), 0..6),
        cluster in text(),
        guarded in any::<bool>(),
    ) {
        let guard = if guarded { guard() } else { Guard::default() };
        let mut idx = Index::new(NodeConfig { cluster_id: cluster, zone: Some("z1".into()), node_name: Some("z1".into()), guard: guard.clone() });
        for i in imports.clone() { idx.upsert_import(i); }
        for s in slices.clone() { idx.upsert_slice(s); }
        idx.flush();
        for s in &slices { idx.delete_slice(&s.namespace, &s.name); }
        for i in imports.iter().take(2) { idx.delete_import(&i.namespace, &i.name); }
        idx.flush();
        for svc in idx.table().frontends.values() {
            for b in &svc.backends {
                prop_assert!(hostile(b.address).is_none(), "hostile backend programmed: {}", b.address);
                prop_assert!(refused(b.address, &guard, false).is_none(), "refused backend programmed: {}", b.address);
            }
        }
        for f in idx.table().frontends.keys() {
            prop_assert!(refused(f.vip, &guard, true).is_none(), "refused VIP programmed: {}", f.vip);
        }
        let r = idx.rejections();
        let _ = render::json(idx.table(), &r);
        let _ = render::text(idx.table(), &r);
    }
}
