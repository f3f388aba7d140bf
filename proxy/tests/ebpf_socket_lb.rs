//! The eBPF socket load balancer against the running kernel: the embedded programs load, pin
//! their maps and links in a test pin directory under bpffs, attach to a test cgroup, and
//! translate the sockets of processes in that cgroup (run as probe children inside a fresh
//! network namespace with loopback backends): TCP connect, UDP sendto/recvfrom, getpeername,
//! IPv6; removed backends get no new connection; 1000 services; restart adoption; uninstall.

use std::{
    collections::BTreeSet,
    io::{Read as _, Write as _},
    net::SocketAddr,
    thread,
};

use aya::maps::MapData;
use mcs_proxy::ebpf::{L4, MapSizes, SocketLb, read_pinned};
use mcs_test_support::{
    netns::Netns,
    probe::Probe,
    socket_lb::{Fixture, probe_in, tcp, udp_backend},
};

mcs_test_support::probe_entry!();

/// The socket LB loaded with its maps pinned in the fixture's directory, attached to its cgroup.
fn open_attached(f: &Fixture) -> SocketLb {
    let mut lb = SocketLb::open(f.pins.path()).expect("load eBPF programs");
    lb.attach(f.cg.path()).expect("attach");
    lb
}

#[test]
fn tcp_udp_and_ipv6_are_translated_and_getpeername_shows_the_vip() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let be = f.tcp_backend("127.0.0.1:0");
    let ube = f.udp_backend("127.0.0.1:0");
    let be6 = f.tcp_backend("[::1]:0");
    let mut lb = open_attached(&f);
    lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[be])
        .unwrap();
    lb.set_service("198.18.0.10:53".parse().unwrap(), L4::Udp, &[ube])
        .unwrap();
    lb.set_service("[2001:2::10]:80".parse().unwrap(), L4::Tcp, &[be6])
        .unwrap();
    assert_eq!(lb.frontends_in_map(), 3);

    let r = f.probe(&tcp("198.18.0.10:80"));
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        r.reply,
        format!("backend {} got hi", be.port()),
        "connect not rewritten"
    );
    assert_eq!(
        r.peer,
        Some("198.18.0.10:80".parse().unwrap()),
        "getpeername must show the VIP"
    );

    let r = f.probe(&Probe::Udp {
        to: "198.18.0.10:53".parse().unwrap(),
        send: "q".into(),
    });
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.reply, format!("backend {} got q", ube.port()));
    assert_eq!(
        r.peer,
        Some("198.18.0.10:53".parse().unwrap()),
        "recvfrom must show the VIP"
    );

    let r = f.probe(&Probe::UdpConnected {
        to: "198.18.0.10:53".parse().unwrap(),
        send: "c".into(),
    });
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        r.reply,
        format!("backend {} got c", ube.port()),
        "connected UDP not translated"
    );
    assert_eq!(
        r.peer,
        Some("198.18.0.10:53".parse().unwrap()),
        "getpeername on UDP"
    );

    let r = f.probe(&tcp("[2001:2::10]:80"));
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.reply, format!("backend {} got hi", be6.port()));
    assert_eq!(r.peer, Some("[2001:2::10]:80".parse().unwrap()));

    // Outside the cgroup nothing is translated (no route to the VIP in this namespace).
    let mut cmd = f.ns.command(Probe::program().to_str().unwrap());
    tcp("198.18.0.10:80").configure(&mut cmd);
    let r = Probe::parse(&cmd.output().unwrap()).unwrap();
    assert!(r.error.is_some(), "translated outside the cgroup: {r:?}");

    // A destination that is not a frontend is untouched.
    let r = f.probe(&tcp(&be.to_string()));
    assert_eq!((r.error.as_deref(), r.peer), (None, Some(be)));
    let read = read_pinned(f.pins.path()).unwrap();
    assert_eq!(read.frontends["198.18.0.10:80/TCP"], vec![be.to_string()]);
}

#[test]
fn removed_backends_get_no_new_connections_and_1000_services_work() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let a = f.tcp_backend("127.0.0.1:0");
    let b = f.tcp_backend("127.0.0.1:0");
    let mut lb = open_attached(&f);
    let vip: SocketAddr = "198.18.0.10:80".parse().unwrap();
    lb.set_service(vip, L4::Tcp, &[a, b]).unwrap();
    let seen: BTreeSet<String> = (0..16)
        .map(|_| f.probe(&tcp("198.18.0.10:80")).reply)
        .collect();
    assert_eq!(
        seen.len(),
        2,
        "both backends should get connections: {seen:?}"
    );
    lb.set_service(vip, L4::Tcp, &[b]).unwrap();
    for _ in 0..16 {
        let r = f.probe(&tcp("198.18.0.10:80"));
        assert_eq!(
            r.reply,
            format!("backend {} got hi", b.port()),
            "removed backend got a connection"
        );
    }
    // 1000 services: 198.18.4.0 .. 198.18.7.231, each to backend a or b by parity.
    for i in 0..1000u32 {
        let ip = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(198, 18, 4, 0)) + i);
        lb.set_service(
            SocketAddr::new(ip.into(), 80),
            L4::Tcp,
            &[if i % 2 == 0 { a } else { b }],
        )
        .unwrap();
    }
    assert_eq!(lb.frontends_in_map(), 1001);
    for i in [0u32, 1, 499, 998, 999] {
        let ip = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(198, 18, 4, 0)) + i);
        let r = f.probe(&tcp(&format!("{ip}:80")));
        let want = if i % 2 == 0 { a } else { b };
        assert_eq!(
            r.reply,
            format!("backend {} got hi", want.port()),
            "service {i}"
        );
    }
}

#[test]
fn pinned_state_outlives_the_loader_is_adopted_and_uninstall_detaches() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let be = f.tcp_backend("127.0.0.1:0");
    {
        let mut lb = open_attached(&f);
        lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[be])
            .unwrap();
        lb.set_service("198.18.0.11:80".parse().unwrap(), L4::Tcp, &[be])
            .unwrap();
        assert_eq!(lb.adopted_links(), 0);
    }
    // The loader is gone (as if the agent died): connects are still translated.
    let r = f.probe(&tcp("198.18.0.10:80"));
    assert_eq!(r.reply, format!("backend {} got hi", be.port()), "{r:?}");

    // Skip counters the kernel left for both frontends and for one that was never programmed
    // (a connect racing its frontend's removal): the first full diff keeps only .10's.
    let skip_key = |vip: &str| {
        let a: std::net::SocketAddrV4 = vip.parse().unwrap();
        mcs_ebpf_common::FrontendKey {
            addr: [u32::from_ne_bytes(a.ip().octets()), 0, 0, 0],
            port: a.port().to_be(),
            proto: mcs_ebpf_common::proto::TCP,
            family: 4,
        }
    };
    let open_skips = || {
        let data =
            aya::maps::MapData::from_pin(f.pins.path().join(mcs_ebpf_common::SKIPS_MAP)).unwrap();
        aya::maps::HashMap::<_, mcs_ebpf_common::FrontendKey, mcs_ebpf_common::SkipCounts>::try_from(
            aya::maps::Map::from_map_data(data).unwrap(),
        )
        .unwrap()
    };
    {
        let mut skips = open_skips();
        for vip in ["198.18.0.10:80", "198.18.0.11:80", "198.18.0.12:80"] {
            let one = mcs_ebpf_common::SkipCounts {
                skipped: 1,
                fallback: 0,
            };
            skips.insert(skip_key(vip), one, 0).unwrap();
        }
    }

    // A new loader adopts maps and links; its first (full) diff drops what is gone.
    let mut lb = open_attached(&f);
    assert_eq!(lb.adopted_links(), mcs_proxy::ebpf::PROGRAMS.len());
    let mut diff = mcs_model::TableDiff::default();
    diff.upsert
        .insert(frontend("198.18.0.10:80"), service("web", &[be]).into());
    mcs_model::Dataplane::apply(&mut lb, &diff).unwrap();
    assert_eq!(
        lb.frontends_in_map(),
        1,
        "the frontend missing from the full table stays"
    );
    let left: Vec<String> = lb.skip_metrics().read().into_keys().collect();
    assert_eq!(
        left,
        ["198.18.0.10:80/TCP"],
        "skip counters of gone frontends stay"
    );
    assert!(open_skips().get(&skip_key("198.18.0.12:80"), 0).is_err());
    let r = f.probe(&tcp("198.18.0.10:80"));
    assert_eq!(r.reply, format!("backend {} got hi", be.port()));
    drop(lb);

    // Uninstall: links unpinned (programs detached), maps gone.
    SocketLb::uninstall(f.pins.path()).unwrap();
    assert!(!f.pins.path().exists());
    let r = f.probe(&tcp("198.18.0.10:80"));
    assert!(r.error.is_some(), "still translated after uninstall: {r:?}");
}

#[test]
fn client_ip_affinity_holds_per_client() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let backends: Vec<SocketAddr> = (0..4).map(|_| f.tcp_backend("127.0.0.1:0")).collect();
    let mut lb = open_attached(&f);
    lb.set_service_with(
        "198.18.0.12:80".parse().unwrap(),
        L4::Tcp,
        &backends,
        Some(60),
    )
    .unwrap();
    // Every connection of this client (its network namespace) lands on one backend.
    let seen: BTreeSet<String> = (0..12)
        .map(|_| f.probe(&tcp("198.18.0.12:80")).reply)
        .collect();
    assert_eq!(seen.len(), 1, "affinity broken: {seen:?}");
    // Without affinity the same client is spread.
    lb.set_service("198.18.0.12:80".parse().unwrap(), L4::Tcp, &backends)
        .unwrap();
    let seen: BTreeSet<String> = (0..16)
        .map(|_| f.probe(&tcp("198.18.0.12:80")).reply)
        .collect();
    assert!(seen.len() > 1, "no spread without affinity: {seen:?}");
}

#[test]
fn maglev_selection_is_consistent_per_client_across_reprogramming() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let backends: Vec<SocketAddr> = (0..5).map(|_| f.tcp_backend("127.0.0.1:0")).collect();
    let mut lb = open_attached(&f);
    lb.set_maglev(true);
    let vip: SocketAddr = "198.18.0.13:80".parse().unwrap();
    lb.set_service(vip, L4::Tcp, &backends).unwrap();
    let seen: BTreeSet<String> = (0..12)
        .map(|_| f.probe(&tcp("198.18.0.13:80")).reply)
        .collect();
    assert_eq!(
        seen.len(),
        1,
        "Maglev: one client (netns) should map to one backend: {seen:?}"
    );
    // Reprogramming the same backends (new ids) keeps the client where it was.
    lb.set_service(vip, L4::Tcp, &backends).unwrap();
    let again = f.probe(&tcp("198.18.0.13:80")).reply;
    assert_eq!(Some(&again), seen.iter().next());
    // Removing the frontend removes its table; the maps hold nothing for it.
    lb.remove_service(vip, L4::Tcp);
    assert_eq!(lb.frontends_in_map(), 0);
}

/// A dual-stack (AF_INET6) socket that connects to an IPv4 ClusterSetIP written as
/// `::ffff:a.b.c.d` (as Java and Node do) is translated through the IPv4 maps, and
/// getpeername/recvfrom show the mapped VIP it asked for.
#[test]
fn a_dual_stack_socket_to_a_v4_mapped_vip_uses_the_ipv4_frontend() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let be = f.tcp_backend("127.0.0.1:0");
    let ube = f.udp_backend("127.0.0.1:0");
    let mut lb = open_attached(&f);
    lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[be])
        .unwrap();
    lb.set_service("198.18.0.10:53".parse().unwrap(), L4::Udp, &[ube])
        .unwrap();

    let r = f.probe(&tcp("[::ffff:198.18.0.10]:80"));
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.reply, format!("backend {} got hi", be.port()));
    assert_eq!(r.peer, Some("[::ffff:198.18.0.10]:80".parse().unwrap()));

    let r = f.probe(&Probe::Udp {
        to: "[::ffff:198.18.0.10]:53".parse().unwrap(),
        send: "m".into(),
    });
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.reply, format!("backend {} got m", ube.port()));
    assert_eq!(r.peer, Some("[::ffff:198.18.0.10]:53".parse().unwrap()));

    // A mapped address that is no IPv4 frontend is untouched (the backend itself).
    let mapped_be: SocketAddr = format!("[::ffff:127.0.0.1]:{}", be.port()).parse().unwrap();
    let r = f.probe(&tcp(&mapped_be.to_string()));
    assert_eq!((r.error.as_deref(), r.peer), (None, Some(mapped_be)));
}

fn frontend(vip: &str) -> mcs_model::Frontend {
    let a: SocketAddr = vip.parse().unwrap();
    mcs_model::Frontend {
        vip: a.ip(),
        port: a.port(),
        protocol: mcs_model::Protocol::Tcp,
    }
}

fn service(name: &str, backends: &[SocketAddr]) -> mcs_model::Service {
    mcs_model::Service {
        service: format!("ns/{name}"),
        affinity: None,
        backends: backends
            .iter()
            .map(|b| mcs_model::Backend {
                address: b.ip(),
                port: b.port(),
                cluster: "c1".into(),
                zone: None,
                ready: true,
                serving: true,
                terminating: false,
                selected: true,
                fallback: false,
            })
            .collect(),
    }
}

/// A frontend that cannot be programmed (too many backends; the backends map full) is
/// rejected alone: the diff applies, the others are programmed and translate, nothing of the
/// failed one is left in the maps, no backend id leaks across retries, and it is programmed
/// once room frees.
#[test]
fn a_frontend_that_does_not_fit_is_rejected_alone_and_nothing_leaks() {
    use mcs_model::{Dataplane as _, TableDiff};
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let good = f.tcp_backend("127.0.0.1:0");
    let mut lb = open_attached(&f);
    lb.limit_backend_ids(3);
    let many: Vec<SocketAddr> = (0..1100)
        .map(|i| SocketAddr::from(([127, 0, 1, (i % 250) as u8 + 1], 1000 + i as u16)))
        .collect();
    let three: Vec<SocketAddr> = (0..3)
        .map(|i| SocketAddr::from(([127, 0, 2, 1], 2000 + i)))
        .collect();
    let one = [good];
    let mut diff = TableDiff::default();
    diff.upsert
        .insert(frontend("198.18.0.10:80"), service("good", &one).into());
    diff.upsert
        .insert(frontend("198.18.0.11:80"), service("huge", &many).into());
    diff.upsert
        .insert(frontend("198.18.0.12:80"), service("nofit", &three).into());
    for _ in 0..3 {
        // Applied three times (as a retrying controller would): the same outcome, no leak.
        lb.apply(&diff)
            .expect("the diff applies; bad frontends are rejected alone");
        assert_eq!(lb.backend_ids(), 1, "backend ids leaked");
        assert_eq!(lb.frontends_in_map(), 1);
        let mut failed: Vec<String> = lb
            .unprogrammed()
            .iter()
            .map(|r| format!("{} {}", r.object, r.reason))
            .collect();
        failed.sort();
        assert_eq!(
            failed,
            [
                "ServiceImport ns/huge unprogrammable",
                "ServiceImport ns/nofit unprogrammable"
            ]
        );
    }
    let read = read_pinned(f.pins.path()).unwrap();
    assert_eq!(read.frontends.len(), 1, "{read:?}");
    let r = f.probe(&tcp("198.18.0.10:80"));
    assert_eq!(r.reply, format!("backend {} got hi", good.port()), "{r:?}");
    // Room frees (the good frontend goes): the one that did not fit is programmed.
    let mut diff = TableDiff::default();
    diff.remove.push(frontend("198.18.0.10:80"));
    lb.apply(&diff).unwrap();
    let failed: Vec<String> = lb.unprogrammed().iter().map(|r| r.object.clone()).collect();
    assert_eq!(failed, ["ServiceImport ns/huge"]);
    assert_eq!(lb.backend_ids(), 3);
    assert_eq!(
        read_pinned(f.pins.path()).unwrap().frontends["198.18.0.12:80/TCP"].len(),
        3
    );
}

/// The maps are made at the sizes asked (entries allocated as written), a table larger than
/// the services map is programmed up to it with the rest rejected alone (the kernel's "full",
/// not a guess of ours), and maps adopted from the pins keep the size they were made with
/// whatever a restarted agent asks.
#[test]
fn maps_are_sized_as_asked_and_a_pinned_size_is_kept() {
    use mcs_model::{Dataplane as _, TableDiff};
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let small = MapSizes {
        services: 10,
        backends: 64,
        members: 16,
        maglev: 251,
    };
    let mut lb = SocketLb::open_sized(f.pins.path(), small).unwrap();
    assert_eq!(lb.capacity(), small);
    for (map, entries) in [
        ("MCS_SVC4_V1", 10),
        ("MCS_SVC6_V1", 10),
        ("MCS_BE4_V1", 64),
        ("MCS_MEMBER_V1", 16),
        ("MCS_MAGLEV_V1", 251),
    ] {
        let info = MapData::from_pin(f.pins.path().join(map))
            .unwrap()
            .info()
            .unwrap();
        assert_eq!(info.max_entries(), entries, "{map}");
        assert_eq!(info.map_flags() & 1, 1, "{map} is not BPF_F_NO_PREALLOC");
    }
    lb.attach(f.cg.path()).unwrap();
    let good = f.tcp_backend("127.0.0.1:0");
    let three = |n: u8| -> Vec<SocketAddr> {
        (0..3)
            .map(|i| SocketAddr::from(([127, 0, 3, n], 3000 + i)))
            .collect()
    };
    // 4 + 2 + 4 entries fill the services map; the fourth frontend's 4 do not fit.
    let mut diff = TableDiff::default();
    diff.upsert
        .insert(frontend("198.18.0.20:80"), service("a", &three(1)).into());
    diff.upsert
        .insert(frontend("198.18.0.21:80"), service("b", &[good]).into());
    diff.upsert
        .insert(frontend("198.18.0.22:80"), service("c", &three(2)).into());
    diff.upsert
        .insert(frontend("198.18.0.23:80"), service("d", &three(3)).into());
    let v0 = lb.unprogrammed_version();
    lb.apply(&diff)
        .expect("the diff applies; what does not fit is rejected alone");
    assert_ne!(
        lb.unprogrammed_version(),
        v0,
        "a new failure must change the version"
    );
    let failed: Vec<String> = lb.unprogrammed().iter().map(|r| r.object.clone()).collect();
    assert_eq!(failed, ["ServiceImport ns/d"]);
    assert!(!lb.programmed(&frontend("198.18.0.23:80")));
    assert!(lb.programmed(&frontend("198.18.0.22:80")));
    assert_eq!(lb.frontends_in_map(), 3);
    assert_eq!(lb.backend_ids(), 7, "backend ids leaked");
    let r = f.probe(&tcp("198.18.0.21:80"));
    assert_eq!(r.reply, format!("backend {} got hi", good.port()), "{r:?}");
    let v1 = lb.unprogrammed_version();
    lb.apply(&TableDiff::default()).unwrap();
    assert_eq!(
        lb.unprogrammed_version(),
        v1,
        "nothing changed, the version must not"
    );
    // Room frees (a goes, 4 entries): d is programmed in its place.
    let mut gone = TableDiff::default();
    gone.remove.push(frontend("198.18.0.20:80"));
    lb.apply(&gone).unwrap();
    assert!(lb.unprogrammed().is_empty(), "{:?}", lb.unprogrammed());
    assert!(lb.programmed(&frontend("198.18.0.23:80")));
    assert_ne!(lb.unprogrammed_version(), v1);
    assert_eq!(lb.frontends_in_map(), 3);
    drop(lb);
    // A restarted agent asking for more adopts the maps as they are.
    let lb = SocketLb::open_sized(f.pins.path(), MapSizes::default()).unwrap();
    assert_eq!(lb.capacity(), small);
    assert_eq!(lb.frontends_in_map(), 3);
    let r = f.probe(&tcp("198.18.0.21:80"));
    assert_eq!(r.reply, format!("backend {} got hi", good.port()), "{r:?}");
}

/// Backend ids are stable while a backend stays selected: ClientIP affinity survives a
/// scale-up from one backend to eight.
#[test]
fn affinity_survives_a_scale_up() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let backends: Vec<SocketAddr> = (0..8).map(|_| f.tcp_backend("127.0.0.1:0")).collect();
    let mut lb = open_attached(&f);
    let vip: SocketAddr = "198.18.0.13:80".parse().unwrap();
    lb.set_service_with(vip, L4::Tcp, &backends[..1], Some(600))
        .unwrap();
    let first = f.probe(&tcp("198.18.0.13:80")).reply;
    assert_eq!(first, format!("backend {} got hi", backends[0].port()));
    for n in 2..=8 {
        lb.set_service_with(vip, L4::Tcp, &backends[..n], Some(600))
            .unwrap();
        let r = f.probe(&tcp("198.18.0.13:80"));
        assert_eq!(r.reply, first, "affinity lost when scaling to {n} backends");
    }
    assert_eq!(lb.backend_ids(), 8);
}

/// While two services are reprogrammed over and over, every connection to one of them lands
/// on one of its own backends, never on the other's.
#[test]
fn racing_connects_never_land_on_another_services_backend() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let a: Vec<SocketAddr> = (0..3).map(|_| f.tcp_backend("127.0.0.1:0")).collect();
    let b: Vec<SocketAddr> = (0..3).map(|_| f.tcp_backend("127.0.0.1:0")).collect();
    let mut lb = open_attached(&f);
    let (va, vb): (SocketAddr, SocketAddr) = (
        "198.18.0.14:80".parse().unwrap(),
        "198.18.0.15:80".parse().unwrap(),
    );
    lb.set_service(va, L4::Tcp, &a).unwrap();
    lb.set_service(vb, L4::Tcp, &b).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let updater = {
        let (a, b, stop) = (a.clone(), b.clone(), stop.clone());
        thread::spawn(move || {
            let mut n = 0usize;
            // Bounded: stops when told, or after 200,000 rounds.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 200_000 {
                let k = n % 3 + 1;
                lb.set_service(va, L4::Tcp, &a[..k]).unwrap();
                lb.set_service(vb, L4::Tcp, &b[(3 - k)..]).unwrap();
                n += 1;
            }
            (lb, n)
        })
    };
    let own: BTreeSet<String> = a
        .iter()
        .map(|s| format!("backend {} got hi", s.port()))
        .collect();
    let mut served = 0;
    for _ in 0..60 {
        let r = f.probe(&tcp("198.18.0.14:80"));
        assert_eq!(r.error, None, "a connect failed during updates: {r:?}");
        assert!(own.contains(&r.reply), "landed elsewhere: {r:?}");
        served += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (lb, rounds) = updater.join().unwrap();
    assert!(rounds > 0 && served == 60);
    // At the end A has k backends and B k others: one id each, none left over.
    let k = (rounds - 1) % 3 + 1;
    assert_eq!(lb.backend_ids(), 2 * k, "after {rounds} rounds");
}

/// An unconnected UDP socket keeps its backend for a VIP while that backend is selected
/// (QUIC, DNS over one socket): through a scale-up it stays; when its backend is removed it
/// moves, once, to another and stays there.
#[test]
fn unconnected_udp_keeps_its_backend_while_it_is_selected() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let backends: Vec<SocketAddr> = (0..8).map(|_| f.udp_backend("127.0.0.1:0")).collect();
    let mut lb = open_attached(&f);
    let vip: SocketAddr = "198.18.0.16:53".parse().unwrap();
    lb.set_service(vip, L4::Udp, &backends[..4]).unwrap();
    let sync = tempfile::tempdir().unwrap();
    let p = Probe::UdpSegments {
        to: vip,
        per_segment: 12,
        segments: 3,
        sync_dir: sync.path().to_path_buf(),
    };
    let mut cmd = f.cg.command(Some(&f.ns), &Probe::program());
    p.configure(&mut cmd);
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("probe");
    let wait_file = |name: &str| -> String {
        let path = sync.path().join(name);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Ok(s) = std::fs::read_to_string(&path) {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "probe never wrote {name}"
            );
            thread::sleep(std::time::Duration::from_millis(10));
        }
    };
    // Segment 0 done: scale up to eight backends.
    wait_file("seg0");
    lb.set_service(vip, L4::Udp, &backends).unwrap();
    std::fs::write(sync.path().join("go0"), "").unwrap();
    // Segment 1 done: remove the backend it was on.
    let last = wait_file("seg1");
    let on: SocketAddr = backends
        .iter()
        .copied()
        .find(|b| last.starts_with(&format!("backend {} ", b.port())))
        .expect("reply names a backend");
    let rest: Vec<SocketAddr> = backends.iter().copied().filter(|b| *b != on).collect();
    lb.set_service(vip, L4::Udp, &rest).unwrap();
    std::fs::write(sync.path().join("go1"), "").unwrap();
    let r = Probe::parse(&child.wait_with_output().unwrap()).unwrap();
    assert_eq!(r.error, None, "{r:?}");
    let port_of = |reply: &String| reply.split(' ').nth(1).unwrap().to_string();
    let seg: Vec<std::collections::BTreeSet<String>> = r
        .replies
        .chunks(12)
        .map(|c| c.iter().map(port_of).collect())
        .collect();
    assert_eq!(seg.len(), 3, "{r:?}");
    assert_eq!(seg[0].len(), 1, "one socket spread over backends: {seg:?}");
    assert_eq!(seg[1], seg[0], "moved on a scale-up: {seg:?}");
    assert_eq!(seg[2].len(), 1, "{seg:?}");
    assert_ne!(seg[2], seg[0], "stayed on a removed backend: {seg:?}");
}

/// One pod churning UDP sockets cannot flush the reverse translations other pods depend on:
/// the new entries a network namespace may create in the shared LRU maps are bounded per
/// second (`NETNS_QUOTA_PER_WINDOW`), so 20,000 sockets leave at most that many entries per
/// second they took, and another pod's socket still sees replies from the VIP.
#[test]
fn one_pod_cannot_flush_the_reverse_translations_of_others() {
    // The fixture's namespace is the victim's; the attacker has one of its own.
    let Some(f) = Fixture::new("bpfv") else {
        return;
    };
    let attacker_ns = Netns::new("bpfa").unwrap();
    let be = f.udp_backend("127.0.0.1:0");
    // The same backend address answers in the attacker's namespace too.
    let _sink = udp_backend(&attacker_ns, &be.to_string());
    let mut lb = open_attached(&f);
    let vip: SocketAddr = "198.18.0.17:53".parse().unwrap();
    lb.set_service(vip, L4::Udp, &[be]).unwrap();
    let sync = tempfile::tempdir().unwrap();
    let victim = Probe::UdpSegments {
        to: vip,
        per_segment: 1,
        segments: 2,
        sync_dir: sync.path().to_path_buf(),
    };
    let mut cmd = f.cg.command(Some(&f.ns), &Probe::program());
    victim.configure(&mut cmd);
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("victim probe");
    let seg0 = sync.path().join("seg0");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !seg0.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "victim never answered"
        );
        thread::sleep(std::time::Duration::from_millis(10));
    }
    let before = mcs_proxy::ebpf::reverse_entries(f.pins.path()).unwrap().0;
    let started = std::time::Instant::now();
    let flood = probe_in(
        &f.cg,
        &attacker_ns,
        &Probe::UdpFlood {
            to: vip,
            sockets: 20_000,
        },
    );
    // Windows the flood can have touched: the seconds it took, plus the partial ones at
    // either end.
    let windows = started.elapsed().as_secs() as usize + 2;
    assert!(flood.ok > 19_000, "{flood:?}");
    let added = mcs_proxy::ebpf::reverse_entries(f.pins.path()).unwrap().0 - before;
    let bound = windows * mcs_ebpf_common::NETNS_QUOTA_PER_WINDOW as usize;
    assert!(
        added <= bound,
        "one pod created {added} reverse entries (quota {bound} over {windows} windows)"
    );
    std::fs::write(sync.path().join("go0"), "").unwrap();
    let r = Probe::parse(&child.wait_with_output().unwrap()).unwrap();
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        r.peers,
        [vip, vip],
        "the victim's reverse translation was flushed"
    );
}

fn abort(s: std::net::TcpStream) {
    let l = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &l);
    drop(s);
}

/// Through the socket LB the connection is the client's own, to the backend: a backend's
/// reset reaches the client as a reset after the bytes before it, a client's reset reaches
/// the backend as a reset, and clean closes are EOF after every byte.
#[test]
fn resets_and_clean_closes_pass_through_the_socket_lb() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let resetting = f.special_tcp_backend(|mut s| {
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"partial-");
        std::thread::sleep(std::time::Duration::from_millis(100));
        abort(s);
    });
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let observing = f.special_tcp_backend(|mut s| {
        let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
        let mut got = Vec::new();
        let how = match s.read_to_end(&mut got) {
            Ok(_) => "eof".to_string(),
            Err(e) => format!("{:?}", e.kind()),
        };
        SEEN.lock()
            .unwrap()
            .push(format!("{} {how}", String::from_utf8_lossy(&got)));
    });
    let echo = f.tcp_backend("127.0.0.1:0");
    let mut lb = open_attached(&f);
    lb.set_service("198.18.0.20:80".parse().unwrap(), L4::Tcp, &[resetting])
        .unwrap();
    lb.set_service("198.18.0.21:80".parse().unwrap(), L4::Tcp, &[observing])
        .unwrap();
    lb.set_service("198.18.0.22:80".parse().unwrap(), L4::Tcp, &[echo])
        .unwrap();

    let r = f.probe(&tcp("198.18.0.20:80"));
    assert_eq!(r.reply, "partial-", "{r:?}");
    assert!(
        r.error.as_deref().is_some_and(|e| e.contains("reset")),
        "a backend's reset did not reach the client: {r:?}"
    );

    let r = f.probe(&Probe::TcpReset {
        to: "198.18.0.21:80".parse().unwrap(),
        send: "hello".into(),
    });
    assert_eq!(r.error, None, "{r:?}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while SEEN.lock().unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "backend saw nothing");
        thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(SEEN.lock().unwrap()[0], "hello ConnectionReset");

    // Clean: the request half-closed, the whole answer, then EOF.
    let r = f.probe(&tcp("198.18.0.22:80"));
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.reply, format!("backend {} got hi", echo.port()));
}

/// Payloads of many sizes (1 B to 8 MiB) sent through the socket LB to an echoing backend come
/// back byte for byte: the kernel's own connection carries them, the LB only chose its peer.
#[test]
fn random_payloads_arrive_byte_exact_both_ways_through_the_socket_lb() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let echo = f.special_tcp_backend(mcs_test_support::probe::echo_until_eof);
    let mut lb = open_attached(&f);
    lb.set_service("198.18.0.30:80".parse().unwrap(), L4::Tcp, &[echo])
        .unwrap();
    let sizes = mcs_test_support::probe::PAYLOAD_SIZES.to_vec();
    let n = sizes.len() as u32;
    let r = f.probe(&Probe::TcpEchoPayloads {
        to: "198.18.0.30:80".parse().unwrap(),
        sizes,
        seed: 7,
    });
    assert_eq!((r.ok, r.failed), (n, 0), "{:?}", r.error);
}

/// An address in the fixture's namespace where nothing listens: a connect to it is refused.
fn refusing(f: &Fixture, addr: &str) -> SocketAddr {
    let l =
        f.ns.run(|| std::net::TcpListener::bind(addr))
            .unwrap()
            .expect("bind");
    l.local_addr().unwrap()
}

/// `count` new TCP connections to `to`, one after the other, from one process of the pod.
fn tcp_loop(f: &Fixture, to: &str, count: u32) -> mcs_test_support::probe::ProbeResult {
    f.probe(&Probe::TcpLoop {
        to: to.parse().unwrap(),
        count,
        interval_ms: 0,
    })
}

/// Whether a connection to `vip` gets `want` back within `secs` seconds (one probe after
/// the other: a mark ends, a probe reaches the backend).
fn answers_within(f: &Fixture, vip: &str, want: &str, secs: u64) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if f.probe(&tcp(vip)).reply == want {
            return true;
        }
    }
    false
}

fn failed_marks(f: &Fixture) -> usize {
    read_pinned(f.pins.path()).unwrap().maps[mcs_ebpf_common::FAILED_MAP].entries
}

#[test]
fn a_backend_that_refuses_costs_its_pod_one_failed_connect_then_others_serve() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let alive = f.tcp_backend("127.0.0.1:0");
    let dead = refusing(&f, "127.0.0.1:0");
    let dead2 = refusing(&f, "127.0.0.1:0");
    let dead3 = refusing(&f, "127.0.0.1:0");
    let fallback = f.tcp_backend("127.0.0.1:0");
    let alive6 = f.tcp_backend("[::1]:0");
    let dead6 = refusing(&f, "[::1]:0");
    let mut lb = open_attached(&f);

    // One of two selected backends refuses: the pod's first connect to it fails and marks
    // it; the pod's next connects go to the other (without passive health half of them
    // would fail).
    lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[alive, dead])
        .unwrap();
    let r = tcp_loop(&f, "198.18.0.10:80", 40);
    assert!(r.failed <= 1 && r.ok + r.failed == 40, "{r:?}");
    if r.failed == 1 {
        assert_eq!(failed_marks(&f), 1, "the refused backend is marked");
    }

    // Every selected backend refuses: the fallback one (another cluster's) takes the
    // connections after at most one failure per dead backend.
    lb.set_service_staged(
        "198.18.0.11:80".parse().unwrap(),
        L4::Tcp,
        &[dead2, dead3],
        &[fallback],
        None,
    )
    .unwrap();
    let read = read_pinned(f.pins.path()).unwrap();
    assert_eq!(
        read.fallbacks["198.18.0.11:80/TCP"],
        vec![fallback.to_string()]
    );
    assert_eq!(read.frontends["198.18.0.11:80/TCP"].len(), 2);
    let r = tcp_loop(&f, "198.18.0.11:80", 40);
    assert!(r.failed <= 2 && r.ok >= 38, "{r:?}");
    assert!(failed_marks(&f) >= 2, "both refusing backends are marked");
    // `/status` lists them as skipped on this node.
    let skipped: BTreeSet<SocketAddr> =
        mcs_model::Dataplane::skipped(&lb, &frontend("198.18.0.11:80"), 16)
            .into_iter()
            .map(|s| {
                assert!(s.failures == 1 && s.for_ms <= 1_000, "{s:?}");
                SocketAddr::new(s.address, s.port)
            })
            .collect();
    assert_eq!(skipped, BTreeSet::from([dead2, dead3]));
    // Counted per frontend: every connection that succeeded went around both marks to the
    // fallback backend (nothing else answers), and only those two frontends counted.
    let counts = lb.skip_metrics().read();
    let c = counts["198.18.0.11:80/TCP"];
    assert_eq!(c.fallback, u64::from(r.ok), "{c:?} {r:?}");
    assert!(c.skipped >= c.fallback && c.skipped <= 40, "{c:?}");
    assert!(
        counts
            .keys()
            .all(|k| k == "198.18.0.11:80/TCP" || k == "198.18.0.10:80/TCP"),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("198.18.0.10:80/TCP").map_or(0, |c| c.fallback),
        0
    );
    // The metrics a scrape gets, in the userspace forwarder's names and labels.
    let mut registry = prometheus_client::registry::Registry::default();
    registry
        .sub_registry_with_prefix("mcs_proxy")
        .register_collector(Box::new(lb.skip_metrics()));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        format!(
            "mcs_proxy_skipped_connections_total{{frontend=\"198.18.0.11:80/TCP\"}} {}",
            c.skipped
        ),
        format!(
            "mcs_proxy_fallback_connections_total{{frontend=\"198.18.0.11:80/TCP\"}} {}",
            c.fallback
        ),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    let r = f.probe(&tcp("198.18.0.11:80"));
    assert_eq!(
        r.reply,
        format!("backend {} got hi", fallback.port()),
        "{r:?}"
    );
    assert_eq!(r.peer, Some("198.18.0.11:80".parse().unwrap()), "{r:?}");
    // The fallback backend is not selected: the membership map (UDP stickiness, affinity)
    // holds only the selected ones.
    assert_eq!(
        read.maps[mcs_ebpf_common::MEMBER_MAP].entries,
        4,
        "members: two frontends of two selected backends"
    );

    // IPv6 alike.
    lb.set_service(
        "[2001:2::10]:80".parse().unwrap(),
        L4::Tcp,
        &[alive6, dead6],
    )
    .unwrap();
    let r = tcp_loop(&f, "[2001:2::10]:80", 40);
    assert!(r.failed <= 1 && r.ok + r.failed == 40, "{r:?}");

    // The dead backend comes back: once its mark ends a connect probes it, it answers, and
    // the mark is gone (polled within a bound: the mark lasts 1 s, doubling per failure).
    if mcs_model::Dataplane::skipped(&lb, &frontend("198.18.0.10:80"), 16).is_empty() {
        // Step 1 may not have tried `dead` at all (a random pick); make it fail once now.
        let r = tcp_loop(&f, "198.18.0.10:80", 40);
        assert!(r.failed == 1, "{r:?}");
    }
    let marked = failed_marks(&f);
    mcs_test_support::socket_lb::tcp_backend(&f.ns, &dead.to_string());
    let back = format!("backend {} got hi", dead.port());
    assert!(
        answers_within(&f, "198.18.0.10:80", &back, 40),
        "a backend that answers again gets connections again"
    );
    assert_eq!(
        failed_marks(&f),
        marked - 1,
        "a connect that succeeds ends the mark"
    );
    // A frontend that goes takes its counters with it.
    lb.remove_service("198.18.0.11:80".parse().unwrap(), L4::Tcp);
    assert!(
        lb.skip_metrics()
            .read()
            .iter()
            .all(|(k, _)| k != "198.18.0.11:80/TCP")
    );
}

#[test]
fn a_blackholed_backend_costs_its_pod_one_slow_connect() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let alive = f.tcp_backend("127.0.0.1:0");
    let hole = refusing(&f, "127.0.0.1:0");
    // Packets to the hole's port are dropped (no reset): only the SYN's retransmission
    // timeout tells. The rule lives in the fixture's namespace and goes with it.
    let rule = format!(
        "add table inet mcs_test_hole\n\
         add chain inet mcs_test_hole out {{ type filter hook output priority 0; }}\n\
         add rule inet mcs_test_hole out tcp dport {} drop\n",
        hole.port()
    );
    let mut nft = f.ns.command("nft");
    nft.args(["-f", "-"]).stdin(std::process::Stdio::piped());
    let mut child = nft.spawn().expect("nft");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(rule.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "nft rule");
    let mut lb = open_attached(&f);
    lb.set_service("198.18.0.12:80".parse().unwrap(), L4::Tcp, &[alive, hole])
        .unwrap();
    // Each connect to the hole waits the probe's connect timeout (5 s); its first SYN
    // retransmission (1 s) marks the hole, so later connects of the pod go to `alive`.
    let r = tcp_loop(&f, "198.18.0.12:80", 30);
    assert!(r.failed <= 1 && r.ok + r.failed == 30, "{r:?}");
}

#[test]
fn a_pinned_link_of_another_program_is_replaced_and_the_rest_kept() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let be = f.tcp_backend("127.0.0.1:0");
    drop(open_attached(&f));
    // As an agent of another version would leave it: the link pinned as `mcs_connect4` runs
    // another program (here: sendmsg4's; the old connect4 link goes with its pin).
    let links = f.pins.path().join("links");
    std::fs::rename(links.join("mcs_sendmsg4"), links.join("mcs_connect4")).unwrap();
    let mut lb = open_attached(&f);
    // connect4 replaced, sendmsg4 attached anew, the other seven kept.
    assert_eq!(lb.adopted_links(), mcs_proxy::ebpf::PROGRAMS.len() - 2);
    lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[be])
        .unwrap();
    let r = f.probe(&tcp("198.18.0.10:80"));
    assert_eq!(r.reply, format!("backend {} got hi", be.port()), "{r:?}");
    drop(lb);
    // A third start keeps every link: they all run this build's programs.
    let lb = open_attached(&f);
    assert_eq!(lb.adopted_links(), mcs_proxy::ebpf::PROGRAMS.len());
}

#[test]
fn client_ip_affinity_returns_to_a_selected_backend_that_answers_again() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let local = refusing(&f, "127.0.0.1:0");
    let remote = f.tcp_backend("127.0.0.1:0");
    let mut lb = open_attached(&f);
    lb.set_service_staged(
        "198.18.0.13:80".parse().unwrap(),
        L4::Tcp,
        &[local],
        &[remote],
        Some(10_800),
    )
    .unwrap();
    // The selected backend refuses once; the pod's connects go to the fallback one.
    let r = tcp_loop(&f, "198.18.0.13:80", 10);
    assert!(r.failed <= 1 && r.ok >= 9, "{r:?}");
    // It answers again: the client's affinity follows selected backends only, so once the
    // mark ends the pod is back on it (polled within a bound), not held on the fallback for
    // the affinity's three hours.
    mcs_test_support::socket_lb::tcp_backend(&f.ns, &local.to_string());
    let back = format!("backend {} got hi", local.port());
    assert!(
        answers_within(&f, "198.18.0.13:80", &back, 20),
        "affinity held the pod on the fallback backend"
    );
    // And it stays there (affinity to the selected backend).
    for _ in 0..5 {
        assert_eq!(f.probe(&tcp("198.18.0.13:80")).reply, back);
    }
}

#[test]
fn links_of_an_agent_that_pinned_no_programs_are_replaced_once() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let be = f.tcp_backend("127.0.0.1:0");
    drop(open_attached(&f));
    // An older agent pinned its links only.
    std::fs::remove_dir_all(f.pins.path().join("programs")).unwrap();
    let mut lb = open_attached(&f);
    assert_eq!(
        lb.adopted_links(),
        0,
        "links of unknown programs are replaced"
    );
    lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[be])
        .unwrap();
    assert_eq!(
        f.probe(&tcp("198.18.0.10:80")).reply,
        format!("backend {} got hi", be.port())
    );
    drop(lb);
    let lb = open_attached(&f);
    assert_eq!(lb.adopted_links(), mcs_proxy::ebpf::PROGRAMS.len());
}

#[test]
fn links_pinned_on_another_cgroup_are_replaced() {
    let Some(f) = Fixture::new("bpf") else {
        return;
    };
    let be = f.tcp_backend("127.0.0.1:0");
    // An agent attached to another cgroup (its `--cgroup-root` since changed).
    let elsewhere = mcs_test_support::cgroup::TestCgroup::new("bpf-other").expect("cgroup");
    {
        let mut lb = SocketLb::open(f.pins.path()).expect("load");
        lb.attach(elsewhere.path()).expect("attach elsewhere");
    }
    // Same build, the fixture's cgroup: nothing kept, every hook attached here.
    let mut lb = open_attached(&f);
    assert_eq!(
        lb.adopted_links(),
        0,
        "links on another cgroup are not kept"
    );
    lb.set_service("198.18.0.10:80".parse().unwrap(), L4::Tcp, &[be])
        .unwrap();
    assert_eq!(
        f.probe(&tcp("198.18.0.10:80")).reply,
        format!("backend {} got hi", be.port())
    );
    drop(lb);
    assert_eq!(
        open_attached(&f).adopted_links(),
        mcs_proxy::ebpf::PROGRAMS.len()
    );
}
