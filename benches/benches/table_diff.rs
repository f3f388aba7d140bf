//! The controller's index at scale: 10k ServiceImports × 3 clusters × 10 endpoints.
//!
//! - `full_compute`: all objects into a fresh index and the first flush (cold start, resync).
//! - `single_endpoint_change`: one endpoint flips readiness; upsert its slice and flush the
//!   minimal diff (what every EndpointSlice event costs).
//!
//! Also prints the index's memory (RSS growth while building it).
use criterion::{Criterion, criterion_group, criterion_main};
use mcs_bench::fixtures;
use mcs_model::{Index, NodeConfig};

const SERVICES: u32 = 10_000;
const CLUSTERS: u32 = 3;
const ENDPOINTS: u32 = 10;

fn node() -> NodeConfig {
    NodeConfig {
        cluster_id: "c0".into(),
        zone: None,
        ..Default::default()
    }
}

fn build(
    imports: &[mcs_model::input::ImportInput],
    slices: &[mcs_model::input::SliceInput],
) -> Index {
    let mut idx = Index::new(node());
    for i in imports {
        idx.upsert_import(i.clone());
    }
    for s in slices {
        idx.upsert_slice(s.clone());
    }
    idx.flush();
    idx
}

fn bench(c: &mut Criterion) {
    let (imports, slices) = fixtures::clusterset(SERVICES, CLUSTERS, ENDPOINTS);
    let before = mcs_bench::rss_bytes().unwrap_or(0);
    let mut idx = build(&imports, &slices);
    let after = mcs_bench::rss_bytes().unwrap_or(0);
    eprintln!(
        "index memory: {:.1} MiB RSS growth for {SERVICES} imports x {CLUSTERS} clusters x {ENDPOINTS} endpoints ({} frontends)",
        (after.saturating_sub(before)) as f64 / (1 << 20) as f64,
        idx.table().frontends.len()
    );

    let mut g = c.benchmark_group("index");
    g.sample_size(10);
    g.bench_function("full_compute_10k_x3x10", |b| {
        b.iter(|| build(&imports, &slices))
    });
    let base = fixtures::endpoint_base();
    let mut flip = 0u32;
    g.sample_size(100);
    g.bench_function("single_endpoint_change_10k_x3x10", |b| {
        b.iter(|| {
            flip += 1;
            let svc = flip % SERVICES;
            // Alternate per round over all services, so every upsert is a real change.
            let not_ready = if (flip / SERVICES).is_multiple_of(2) {
                Some(3)
            } else {
                None
            };
            idx.upsert_slice(fixtures::slice(svc, 0, ENDPOINTS, base, not_ready));
            let d = idx.flush();
            std::hint::black_box(d)
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
