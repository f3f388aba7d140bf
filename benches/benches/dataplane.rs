//! Hot paths of the dataplanes: Maglev table build and lookup, the userspace forwarder's
//! route lookup among 10k frontends and backend pick (with and without ClientIP affinity),
//! and the encoding of eBPF map keys.
use std::{
    hint::black_box,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use criterion::{Criterion, criterion_group, criterion_main};
use mcs_bench::fixtures;
use mcs_model::{Affinity, ForwardingTable, Protocol};
use mcs_proxy::{
    maglev::{DEFAULT_TABLE_SIZE, Maglev},
    userspace::{metrics::ProxyMetrics, routes::SharedRoutes},
};

fn maglev(c: &mut Criterion) {
    let keys: Vec<String> = (0..100)
        .map(|i| format!("198.19.{}.{}:8080", i / 250, i % 250 + 1))
        .collect();
    c.bench_function("maglev_build_100_backends_16381", |b| {
        b.iter(|| Maglev::new(black_box(&keys), DEFAULT_TABLE_SIZE))
    });
    let table = Maglev::new(&keys, DEFAULT_TABLE_SIZE);
    let mut h = 0u64;
    c.bench_function("maglev_lookup", |b| {
        b.iter(|| {
            h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
            table.pick(black_box(h))
        })
    });
}

fn routes(c: &mut Criterion) {
    // 10k frontends, 3 clusters × 10 endpoints each, the first cluster selected.
    let mut table: ForwardingTable = fixtures::table_10k();
    if let Some(s) = table.frontends.values_mut().nth(7) {
        std::sync::Arc::make_mut(s).affinity = Some(Affinity {
            timeout_seconds: 60,
        });
    }
    let routes = SharedRoutes::new();
    routes.apply(
        &table.as_diff(),
        DEFAULT_TABLE_SIZE,
        &ProxyMetrics::default(),
    );
    let (f_plain, f_aff) = {
        let mut it = table.frontends.keys();
        (*it.nth(3).unwrap(), *it.nth(3).unwrap())
    };
    let dst = SocketAddr::new(f_plain.vip, f_plain.port);
    let client: SocketAddr = "198.18.10.2:40000".parse().unwrap();
    c.bench_function("route_lookup_10k_frontends", |b| {
        b.iter(|| {
            routes
                .load()
                .get(black_box(dst), Protocol::Tcp)
                .map(|r| r.backends.len())
        })
    });
    let plain = routes.load().get(dst, Protocol::Tcp).unwrap().clone();
    let aff = routes
        .load()
        .get(SocketAddr::new(f_aff.vip, f_aff.port), Protocol::Tcp)
        .unwrap()
        .clone();
    assert!(aff.affinity.is_some());
    let tried = mcs_proxy::userspace::routes::Tried::new();
    c.bench_function("backend_pick", |b| {
        b.iter(|| plain.pick(black_box(client), 0, 3, &tried))
    });
    c.bench_function("backend_pick_client_ip_affinity", |b| {
        b.iter(|| aff.pick(black_box(client), 0, 3, &tried))
    });
}

fn map_keys(c: &mut Criterion) {
    let v4 = Ipv4Addr::new(198, 18, 100, 10);
    let v6: Ipv6Addr = "2001:2::100:10".parse().unwrap();
    c.bench_function("ebpf_svc4_key", |b| {
        b.iter(|| {
            mcs_ebpf_common::Svc4Key::new(
                u32::from_ne_bytes(black_box(v4).octets()),
                80u16.to_be(),
                6,
                0,
            )
        })
    });
    c.bench_function("ebpf_svc6_key", |b| {
        b.iter(|| {
            mcs_ebpf_common::Svc6Key::new(
                mcs_proxy::ebpf::ip6_words(black_box(v6)),
                80u16.to_be(),
                6,
                0,
            )
        })
    });
    let _ = IpAddr::V4(v4);
}

criterion_group!(benches, maglev, routes, map_keys);
criterion_main!(benches);
