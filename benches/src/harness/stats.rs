//! Summaries of repeated runs, and a fixed log-linear latency histogram.

use serde::Serialize;

/// Median, minimum and maximum of the repetitions of one figure.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Median (the lower middle of an even count, so it is always a measured value).
    pub median: f64,
    /// Smallest repetition.
    pub min: f64,
    /// Largest repetition.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Self {
            median: v[(v.len() - 1) / 2],
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

/// The percentiles reported for latency, and plotted as a CDF.
pub const PERCENTILES: [f64; 9] = [50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99];

/// Sub-buckets per power of two: 64, so a recorded value is within 1.6% of the truth.
const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// Enough buckets for any u64.
const BUCKETS: usize = (64 - SUB_BITS as usize) * SUB + SUB;

/// A latency histogram of fixed size (no allocation while recording), in nanoseconds.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            total: 0,
        }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        let bits = 64 - v.leading_zeros();
        if bits <= SUB_BITS + 1 {
            v as usize
        } else {
            let e = bits - SUB_BITS - 1;
            e as usize * SUB + (v >> e) as usize
        }
    }

    /// Smallest value of bucket `i`.
    fn lower(i: usize) -> u64 {
        if i < 2 * SUB {
            i as u64
        } else {
            let e = i / SUB - 1;
            ((i % SUB + SUB) as u64) << e
        }
    }

    /// Records one value.
    pub fn record(&mut self, v: u64) {
        self.counts[Self::index(v)] += 1;
        self.total += 1;
    }

    /// Adds another histogram.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The value at percentile `p` (0–100): the lower bound of the bucket holding it.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((p / 100.0) * self.total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::lower(i);
            }
        }
        Self::lower(BUCKETS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_a_measured_median() {
        let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 10.0));
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[f64::NAN]), None);
    }

    #[test]
    fn buckets_are_contiguous_and_precise() {
        let mut last = 0;
        for i in 0..BUCKETS - 1 {
            let lo = Histogram::lower(i);
            assert!(i == 0 || lo > last, "bucket {i}");
            assert_eq!(Histogram::index(lo), i);
            last = lo;
        }
        for v in [
            0u64,
            1,
            127,
            128,
            129,
            1000,
            123_456,
            9_999_999,
            u64::MAX / 2,
            u64::MAX,
        ] {
            let lo = Histogram::lower(Histogram::index(v));
            assert!(
                lo <= v && (v - lo) as f64 <= v as f64 / 64.0 + 1.0,
                "{v} -> {lo}"
            );
        }
    }

    #[test]
    fn percentiles_of_a_uniform_run() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let p50 = h.percentile(50.0) as f64;
        let p99 = h.percentile(99.0) as f64;
        assert!((p50 - 5_000_000.0).abs() / 5_000_000.0 < 0.02, "{p50}");
        assert!((p99 - 9_900_000.0).abs() / 9_900_000.0 < 0.02, "{p99}");
        let mut g = Histogram::default();
        g.record(1);
        g.merge(&h);
        assert_eq!(g.count(), 10_001);
        assert_eq!(g.percentile(0.0), 1);
    }
}
