//! The index's heap at scale, counted by the allocator (not RSS): what each stage of the
//! control plane keeps for `MCS_BENCH_IMPORTS` ServiceImports × 2 clusters × 5 endpoints
//! (default 100,000: 1M endpoints), and how long the pure index takes to build and flush.
//!
//! Inputs are made one at a time and handed over, as a source does, so only what the index
//! keeps is counted. `cargo bench -p mcs-bench --bench index_memory`.
// A counting global allocator needs `unsafe impl GlobalAlloc`; it only forwards to the system
// allocator and adds up sizes. Bench-only.
#![allow(unsafe_code)]

use std::{
    alloc::{GlobalAlloc, Layout, System},
    collections::BTreeMap,
    net::Ipv4Addr,
    sync::atomic::{AtomicUsize, Ordering},
    time::Instant,
};

use mcs_model::{
    Index, NodeConfig,
    guard::Guard,
    input::{EndpointInput, ImportInput, ImportPortInput, SliceInput, SlicePortInput},
    validate::{LABEL_MANAGED_BY, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER},
};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let now = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const CLUSTERS: usize = 2;
const ENDPOINTS: usize = 5;

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn import(i: usize) -> ImportInput {
    ImportInput {
        namespace: format!("ns{}", i % 100),
        name: format!("svc{i}"),
        created: Some("2026-11-01T00:00:00Z".into()),
        uid: Some(format!("00000000-0000-0000-0000-{i:012}")),
        type_: "ClusterSetIP".into(),
        ips: vec![Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i as u32).to_string()],
        ports: vec![ImportPortInput {
            name: Some("http".into()),
            protocol: Some("TCP".into()),
            port: 80,
        }],
        ..Default::default()
    }
}

fn slice(i: usize, c: usize) -> SliceInput {
    let base = u32::from(Ipv4Addr::new(198, 19, 192, 0));
    SliceInput {
        namespace: format!("ns{}", i % 100),
        name: format!("svc{i}-c{c}"),
        labels: BTreeMap::from([
            (LABEL_SERVICE_NAME.to_string(), format!("svc{i}")),
            (LABEL_SOURCE_CLUSTER.to_string(), format!("c{c}")),
            (LABEL_MANAGED_BY.to_string(), "bench".to_string()),
        ]),
        address_type: "IPv4".into(),
        ports: vec![SlicePortInput {
            name: Some("http".into()),
            protocol: Some("TCP".into()),
            port: Some(8080),
        }],
        endpoints: (0..ENDPOINTS)
            .map(|e| EndpointInput {
                addresses: vec![
                    Ipv4Addr::from(base + ((i * 16 + c * 8 + e) % 16_000) as u32).to_string(),
                ],
                ready: Some(true),
                zone: Some(format!("zone-{}", e % 3)),
                node_name: Some(format!("node-{}", (i + e) % 500)),
                ..Default::default()
            })
            .collect(),
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let imports = mcs_bench::scale::env_count("MCS_BENCH_IMPORTS", 100_000);
    assert!(
        imports <= mcs_bench::scale::MAX_IMPORTS,
        "the VIP ranges hold 114,688 imports"
    );
    let endpoints = imports * CLUSTERS * ENDPOINTS;
    let guard = Guard {
        clusterset_cidrs: mcs_model::guard::parse_clusterset_ranges(&mcs_bench::scale::VIP_CIDRS)
            .expect("valid range"),
        limits: mcs_model::Limits {
            frontends: 1_000_000,
            backends: 10_000_000,
            ..Default::default()
        },
        ..Default::default()
    };
    let node = NodeConfig {
        cluster_id: "c0".into(),
        guard,
        ..Default::default()
    };
    let base = LIVE.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let mut index = Index::new(node);
    for i in 0..imports {
        index.upsert_import(import(i));
    }
    let after_imports = LIVE.load(Ordering::Relaxed) - base;
    for i in 0..imports {
        for c in 0..CLUSTERS {
            index.upsert_slice(slice(i, c));
        }
    }
    let after_slices = LIVE.load(Ordering::Relaxed) - base;
    let t1 = Instant::now();
    let diff = index.flush();
    let flush_s = t1.elapsed().as_secs_f64();
    let build_s = t1.duration_since(t0).as_secs_f64();
    let with_diff = LIVE.load(Ordering::Relaxed) - base;
    // A dataplane that keeps the table (as `--dataplane log` does) shares every `Service`.
    let mut copy = mcs_model::ForwardingTable::default();
    copy.apply(&diff);
    let held = LIVE.load(Ordering::Relaxed) - base;
    let peak = PEAK.load(Ordering::Relaxed) - base;
    // What the userspace forwarder adds on top: its routes and per-backend counters (Maglev
    // tables are built at a route's first connection; here none has had one).
    let metrics = mcs_proxy::userspace::metrics::ProxyMetrics::default();
    let routes = mcs_proxy::userspace::routes::SharedRoutes::new();
    routes.apply(&diff, mcs_proxy::maglev::DEFAULT_TABLE_SIZE, &metrics);
    drop(diff);
    let routes_held = LIVE.load(Ordering::Relaxed) - base - held;
    let backends = imports * ENDPOINTS; // local cluster first: one cluster's endpoints are selected
    assert_eq!(
        index.table().frontends.len(),
        imports,
        "every import programmed"
    );
    assert!(index.rejections().is_empty(), "nothing rejected");
    println!(
        "index heap, {imports} imports x {CLUSTERS} clusters x {ENDPOINTS} endpoints ({endpoints} endpoints):"
    );
    println!(
        "  imports held:                {:8.1} MiB ({:.0} B per import)",
        mib(after_imports),
        after_imports as f64 / imports as f64
    );
    println!(
        "  + slices held:               {:8.1} MiB ({:.0} B per endpoint)",
        mib(after_slices - after_imports),
        (after_slices - after_imports) as f64 / endpoints as f64
    );
    println!(
        "  + table and derived (flush): {:8.1} MiB ({:.0} B per endpoint)",
        mib(held - after_slices),
        (held - after_slices) as f64 / endpoints as f64
    );
    println!(
        "  total held:                  {:8.1} MiB ({:.0} B per endpoint); peak {:.1} MiB, with the first diff {:.1} MiB",
        mib(held),
        held as f64 / endpoints as f64,
        mib(peak),
        mib(with_diff)
    );
    println!("  time: upserts {build_s:.2} s, first flush {flush_s:.2} s");
    println!(
        "  userspace forwarder routes:  {:8.1} MiB ({:.0} B per selected backend, {backends} backends)",
        mib(routes_held),
        routes_held as f64 / backends as f64
    );
    assert_eq!(routes.load().len(), imports, "a route per frontend");
    drop(routes);
    drop(copy);
}
