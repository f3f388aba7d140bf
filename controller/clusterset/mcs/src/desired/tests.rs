//! The O(change) passes against a full pass: any sequence of changes to the stores,
//! each followed by a pass whose writes land in the local imports, leaves the
//! reconciler's desired state equal to a full pass over the same objects.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::Namespace,
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use mcs_api::{LABEL_MANAGED_BY, ServiceImport, ServiceImportSpec};
use mcs_merge::{Port, ServiceKind, ServiceShape};
use proptest::prelude::*;

use super::*;
use crate::selection::member_slice_service;
use crate::store::{Changes, Store};

const MEMBERS: [&str; 3] = ["c1", "c2", "c3"];
const NAMESPACES: [&str; 2] = ["a", "b"];
const NAMES: [&str; 4] = ["w", "x", "y", "z"];

#[derive(Clone, Debug)]
enum Change {
    Export {
        m: usize,
        k: (usize, usize),
        created: i64,
        labels: u8,
        deleting: bool,
    },
    Unexport {
        m: usize,
        k: (usize, usize),
    },
    Service {
        m: usize,
        k: (usize, usize),
        ports: u8,
        headless: bool,
        families: u8,
        selector: bool,
    },
    NoService {
        m: usize,
        k: (usize, usize),
    },
    Slice {
        m: usize,
        k: (usize, usize),
        i: u8,
        ready: bool,
        computed: bool,
    },
    NoSlice {
        m: usize,
        k: (usize, usize),
        i: u8,
    },
    Namespace {
        ns: usize,
        state: u8,
    },
    ForeignImport {
        k: (usize, usize),
        ip: u8,
    },
    ImportGone {
        k: (usize, usize),
    },
    MemberReach {
        m: usize,
        reach: u8,
    },
}

fn key() -> impl Strategy<Value = (usize, usize)> {
    (0..NAMESPACES.len(), 0..NAMES.len())
}

fn change() -> impl Strategy<Value = Change> {
    let m = 0..MEMBERS.len();
    prop_oneof![
        4 => (m.clone(), key(), 0..4i64, 0..3u8, prop::bool::weighted(0.1)).prop_map(
            |(m, k, created, labels, deleting)| Change::Export { m, k, created, labels, deleting }
        ),
        2 => (m.clone(), key()).prop_map(|(m, k)| Change::Unexport { m, k }),
        4 => (m.clone(), key(), 0..3u8, prop::bool::weighted(0.15), 0..3u8, prop::bool::weighted(0.85))
            .prop_map(|(m, k, ports, headless, families, selector)| Change::Service {
                m, k, ports, headless, families, selector
            }),
        1 => (m.clone(), key()).prop_map(|(m, k)| Change::NoService { m, k }),
        4 => (m.clone(), key(), 0..2u8, any::<bool>(), prop::bool::weighted(0.85))
            .prop_map(|(m, k, i, ready, computed)| Change::Slice { m, k, i, ready, computed }),
        1 => (m.clone(), key(), 0..2u8).prop_map(|(m, k, i)| Change::NoSlice { m, k, i }),
        1 => (0..NAMESPACES.len(), 0..4u8).prop_map(|(ns, state)| Change::Namespace { ns, state }),
        2 => (key(), 0..8u8).prop_map(|(k, ip)| Change::ForeignImport { k, ip }),
        1 => key().prop_map(|k| Change::ImportGone { k }),
        1 => (m, 0..6u8).prop_map(|(m, reach)| Change::MemberReach { m, reach }),
    ]
}

fn ok((ns, name): (usize, usize)) -> ObjKey {
    (NAMESPACES[ns].to_string(), NAMES[name].to_string())
}

struct World {
    changes: Arc<Changes>,
    exports: Vec<Store<LeanExport>>,
    services: Vec<Store<ServiceShape>>,
    slices: Vec<Store<EndpointSlice>>,
    namespaces: Store<Namespace>,
    imports: Store<HeldImport>,
    reach: [Reach; 3],
    policy: Policy,
}

impl World {
    fn new(policy: Policy) -> Self {
        let changes = Arc::new(Changes::default());
        let w = World {
            exports: MEMBERS
                .iter()
                .map(|_| Store::new(changes.clone(), None))
                .collect(),
            services: MEMBERS
                .iter()
                .map(|_| Store::new(changes.clone(), None))
                .collect(),
            slices: MEMBERS
                .iter()
                .map(|_| Store::new(changes.clone(), Some(member_slice_service)))
                .collect(),
            namespaces: Store::new(changes.clone(), None),
            imports: Store::new(changes.clone(), None),
            changes,
            reach: [Reach::Up; 3],
            policy,
        };
        w.namespace(0, 0);
        w.namespace(1, 0);
        w
    }

    fn namespace(&self, ns: usize, state: u8) {
        let key = (String::new(), NAMESPACES[ns].to_string());
        match state {
            0 | 1 => self.namespaces.apply(
                key.clone(),
                Arc::new(Namespace {
                    metadata: ObjectMeta {
                        name: Some(key.1.clone()),
                        deletion_timestamp: (state == 1).then_some(Time(Timestamp::UNIX_EPOCH)),
                        ..Default::default()
                    },
                    ..Default::default()
                }),
            ),
            2 => self.namespaces.remove(&key),
            _ => {}
        }
    }

    fn apply(&mut self, c: &Change) {
        match c.clone() {
            Change::Export {
                m,
                k,
                created,
                labels,
                deleting,
            } => self.exports[m].apply(
                ok(k),
                Arc::new(LeanExport {
                    created,
                    deleting,
                    generation: Some(1),
                    labels: (0..labels)
                        .map(|i| (format!("l{i}"), MEMBERS[m].to_string()))
                        .collect(),
                    ..Default::default()
                }),
            ),
            Change::Unexport { m, k } => self.exports[m].remove(&ok(k)),
            Change::Service {
                m,
                k,
                ports,
                headless,
                families,
                selector,
            } => self.services[m].apply(
                ok(k),
                Arc::new(ServiceShape {
                    kind: Some(ServiceKind::ClusterIp),
                    headless,
                    ports: (0..=ports)
                        .map(|i| Port {
                            name: format!("p{i}"),
                            protocol: "TCP".into(),
                            port: 80 + i32::from(i) + i32::from(m == 2 && ports == 2),
                            app_protocol: None,
                        })
                        .collect(),
                    ip_families: match families {
                        0 => vec!["IPv4".into()],
                        1 => vec!["IPv6".into()],
                        _ => vec!["IPv4".into(), "IPv6".into()],
                    },
                    selector,
                    ..Default::default()
                }),
            ),
            Change::NoService { m, k } => self.services[m].remove(&ok(k)),
            Change::Slice {
                m,
                k,
                i,
                ready,
                computed,
            } => {
                let (ns, name) = ok(k);
                let slice = format!("{name}-{i}");
                let manager = if computed {
                    DEFAULT_SLICE_CONTROLLER
                } else {
                    "someone"
                };
                self.slices[m].apply(
                    (ns.clone(), slice.clone()),
                    Arc::new(EndpointSlice {
                        metadata: ObjectMeta {
                            name: Some(slice),
                            namespace: Some(ns),
                            labels: Some(BTreeMap::from([
                                (crate::objects::LABEL_K8S_SERVICE_NAME.into(), name),
                                (LABEL_MANAGED_BY.into(), manager.into()),
                            ])),
                            ..Default::default()
                        },
                        address_type: "IPv4".into(),
                        endpoints: Some(vec![Endpoint {
                            addresses: vec![format!("198.18.{m}.{}", 10 + i)],
                            conditions: Some(EndpointConditions {
                                ready: Some(ready),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }]),
                        ports: Some(vec![EndpointPort {
                            name: Some("p0".into()),
                            port: Some(8080),
                            protocol: Some("TCP".into()),
                            ..Default::default()
                        }]),
                    }),
                );
            }
            Change::NoSlice { m, k, i } => {
                let (ns, name) = ok(k);
                self.slices[m].remove(&(ns, format!("{name}-{i}")));
            }
            Change::Namespace { ns, state } => self.namespace(ns, state),
            Change::ForeignImport { k, ip } => {
                let (ns, name) = ok(k);
                let mut si = ServiceImport::new(
                    &name,
                    ServiceImportSpec {
                        ips: if ip < 7 {
                            vec![format!("198.18.100.{ip}")]
                        } else {
                            vec![]
                        },
                        ..Default::default()
                    },
                );
                si.metadata.namespace = Some(ns.clone());
                si.metadata.labels =
                    Some(BTreeMap::from([(MANAGED_LABEL.into(), "someone".into())]));
                self.imports
                    .apply((ns, name), Arc::new(HeldImport::new(&si)));
            }
            Change::ImportGone { k } => self.imports.remove(&ok(k)),
            Change::MemberReach { m, reach } => {
                self.reach[m] = match reach {
                    0 | 1 => Reach::Up,
                    2 | 3 => Reach::Failing {
                        unauthorized: reach == 3,
                    },
                    _ => Reach::Gone {
                        unauthorized: reach == 5,
                    },
                };
            }
        }
    }

    /// `f` of a snapshot of the stores (read-locked meanwhile).
    fn with_snapshot<R>(&self, f: impl FnOnce(&Snapshot<'_>) -> R) -> R {
        let g: Vec<_> = (0..MEMBERS.len())
            .map(|m| {
                (
                    self.exports[m].read(),
                    self.services[m].read(),
                    self.slices[m].read(),
                )
            })
            .collect();
        let (ns, imports) = (self.namespaces.read(), self.imports.read());
        f(&Snapshot {
            local: "c1".into(),
            members: MEMBERS
                .iter()
                .zip(&g)
                .zip(self.reach)
                .map(|((id, g), reach)| MemberView {
                    id: (*id).into(),
                    reach,
                    exports: &g.0.map,
                    exports_generation: g.0.generation,
                    services: &g.1.map,
                    slices: &g.2,
                })
                .collect(),
            namespaces: &ns.map,
            imports: &imports.map,
            now: Time(Timestamp::UNIX_EPOCH),
            policy: &self.policy,
        })
    }

    /// A pass of `r` over what changed, its imports then written as the writer would.
    fn pass(&self, r: &mut Reconciler, all: bool) -> Computed {
        let mut dirty = self.changes.take();
        dirty.all |= all;
        let computed = self.with_snapshot(|s| r.pass(s, &dirty));
        let have = self.imports.snapshot();
        let keys: Vec<ObjKey> = match &computed {
            Computed::All => have.keys().chain(r.want.imports.keys()).cloned().collect(),
            Computed::Some(k) => k.iter().cloned().collect(),
        };
        for k in keys {
            match (r.want.imports.get(&k), have.get(&k)) {
                (Some(si), h) if h.is_none_or(|h| !h.same(si)) => {
                    self.imports.apply(k, Arc::new(HeldImport::new(si)));
                }
                (None, Some(h)) if h.ours => self.imports.remove(&k),
                _ => {}
            }
        }
        computed
    }

    fn full(&self) -> Desired {
        self.with_snapshot(|s| desired(s, ranges()))
    }
}

fn json(si: &ServiceImport) -> serde_json::Value {
    serde_json::to_value(si).unwrap()
}

fn imports(d: &Desired) -> BTreeMap<ObjKey, serde_json::Value> {
    d.imports
        .iter()
        .map(|(k, si)| (k.clone(), json(si)))
        .collect()
}

fn ranges() -> Vec<IpCidr> {
    vec![
        "198.18.100.0/29".parse().unwrap(),
        "2001:2::100:0/126".parse().unwrap(),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    (
        prop::option::of(2..5usize),
        prop::option::of(1..3usize),
        prop::option::of(2..5usize),
        any::<bool>(),
        prop::bool::weighted(0.2),
    )
        .prop_map(
            |(ip_quota, per_ns, per_member, selectorless, refuse)| Policy {
                refused_namespaces: if refuse {
                    ["b".to_string()].into()
                } else {
                    Default::default()
                },
                ip_quota,
                exports_per_namespace: per_ns,
                exports_per_member: per_member,
                export_selectorless: selectorless,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn any_changes_leave_what_a_full_pass_computes(
        policy in policy(),
        steps in prop::collection::vec(prop::collection::vec(change(), 1..4), 1..25),
    ) {
        let mut world = World::new(policy);
        let mut r = Reconciler::new(ranges());
        let mut reach = world.reach;
        world.pass(&mut r, true);
        for batch in &steps {
            for c in batch {
                world.apply(c);
            }
            // A member failing, coming or going is a full pass, as in the controller's
            // loop.
            let all = reach != world.reach;
            reach = world.reach;
            world.pass(&mut r, all);
        }
        // The writes of the last pass, seen by the watchers, are one more pass.
        for _ in 0..3 {
            world.pass(&mut r, false);
        }
        let full = world.full();
        prop_assert_eq!(imports(&r.want), imports(&full));
        prop_assert_eq!(&r.want.slices, &full.slices);
        prop_assert_eq!(&r.want.slices_of, &full.slices_of);
        prop_assert_eq!(&r.want.export_conditions, &full.export_conditions);
        prop_assert_eq!(&r.want.counts, &full.counts);
        prop_assert_eq!(r.want.problem_count(), r.want.problems.values().map(Vec::len).sum::<usize>());
        prop_assert_eq!(r.want.withheld_count(), r.want.withheld.values().sum::<usize>());
        prop_assert_eq!(r.want.invalid_export_count(), r.want.export_conditions.values().filter(|c| invalid(c)).count());
        prop_assert_eq!(&r.want.withheld, &full.withheld);
        prop_assert_eq!(&r.want.problems, &full.problems);
    }
}

#[test]
fn a_pass_after_one_change_computes_that_service_only() {
    let mut world = World::new(Policy::default());
    let mut r = Reconciler::new(ranges());
    for m in 0..2 {
        for name in 0..NAMES.len() {
            world.apply(&Change::Service {
                m,
                k: (0, name),
                ports: 0,
                headless: false,
                families: 0,
                selector: true,
            });
            world.apply(&Change::Export {
                m,
                k: (0, name),
                created: 1,
                labels: 0,
                deleting: false,
            });
        }
    }
    assert_eq!(world.pass(&mut r, true), Computed::All);
    assert_eq!(r.want.imports.len(), NAMES.len());
    // Its own writes come back as changes of those services: nothing differs then.
    let before = r.want.clone();
    world.pass(&mut r, false);
    assert_eq!(format!("{:?}", r.want), format!("{before:?}"));
    world.apply(&Change::Slice {
        m: 1,
        k: (0, 2),
        i: 0,
        ready: true,
        computed: true,
    });
    assert_eq!(
        world.pass(&mut r, false),
        Computed::Some([ok((0, 2))].into()),
    );
    assert_eq!(r.want.slices_of[&ok((0, 2))].len(), 1);
    assert_eq!(
        imports(&r.want),
        imports(&before),
        "the other imports are as they were"
    );
}

#[test]
fn an_import_says_which_exporting_clusters_do_not_answer() {
    let mut world = World::new(Policy::default());
    let mut r = Reconciler::new(ranges());
    for m in 0..3 {
        world.apply(&Change::Service {
            m,
            k: (0, 0),
            ports: 0,
            headless: false,
            families: 0,
            selector: true,
        });
    }
    for m in 1..3 {
        world.apply(&Change::Export {
            m,
            k: (0, 0),
            created: 1,
            labels: 0,
            deleting: false,
        });
    }
    let reachable = |r: &Reconciler| {
        let c = r.want.imports[&ok((0, 0))]
            .status
            .as_ref()
            .unwrap()
            .conditions
            .iter()
            .find(|c| c.type_ == CLUSTERS_REACHABLE)
            .cloned()
            .unwrap();
        (c.status, c.reason, c.message)
    };
    world.pass(&mut r, true);
    assert_eq!(reachable(&r).0, "True");
    // c1 does not export it: its state is not the import's business.
    world.apply(&Change::MemberReach { m: 0, reach: 4 });
    world.pass(&mut r, true);
    assert_eq!(reachable(&r).0, "True");
    world.apply(&Change::MemberReach { m: 1, reach: 2 });
    world.pass(&mut r, true);
    assert_eq!(
        reachable(&r),
        (
            "False".into(),
            CLUSTER_UNREACHABLE.into(),
            "cluster c2 does not answer: its last known endpoints are kept until the member timeout".into()
        )
    );
    world.apply(&Change::MemberReach { m: 2, reach: 5 });
    world.pass(&mut r, true);
    let (status, reason, message) = reachable(&r);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", CLUSTER_UNAUTHORIZED)
    );
    assert!(
        message.ends_with("; cluster c3 refuses this controller's credentials (HTTP 401/403): its endpoints are withdrawn (member timeout passed)"),
        "{message}"
    );
    world.apply(&Change::MemberReach { m: 1, reach: 0 });
    world.apply(&Change::MemberReach { m: 2, reach: 0 });
    world.pass(&mut r, true);
    assert_eq!(reachable(&r).0, "True");
}
