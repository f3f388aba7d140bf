//! Diff of two forwarding tables that differ in one backend, at 10k frontends × 3 clusters ×
//! 10 endpoints.
use criterion::{Criterion, criterion_group, criterion_main};
use mcs_bench::fixtures;

fn diff_one_change(c: &mut Criterion) {
    let old = fixtures::table(10_000, 3, 10);
    let mut new = old.clone();
    if let Some(svc) = new.frontends.values_mut().nth(5_000) {
        svc.backends[0].ready = false;
    }
    c.bench_function("diff_10k_services_one_change", |b| {
        b.iter(|| mcs_model::diff(std::hint::black_box(&old), std::hint::black_box(&new)))
    });
}

criterion_group!(benches, diff_one_change);
criterion_main!(benches);
