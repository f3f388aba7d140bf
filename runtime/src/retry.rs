//! How a failed watch is retried, by the agent's sources and the MCS controller's watchers.

use std::time::Duration;

/// The retry delays of a failed watch: 100 ms doubling up to `max`, each drawn in
/// `[delay / 2, delay]` so that a DaemonSet's agents do not retry in step; reset by
/// [`crate::watch::ListWatch`] on a completed list or a watch event only.
#[derive(Debug)]
pub struct WatchRetry {
    max: Duration,
    next: Duration,
    seed: u64,
}

impl WatchRetry {
    /// The first delay.
    pub const MIN: Duration = Duration::from_millis(100);

    /// Delays capped at `max` (at least [`WatchRetry::MIN`]).
    pub fn new(max: Duration) -> Self {
        use std::hash::{BuildHasher as _, Hasher as _};
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Self {
            max: max.max(Self::MIN),
            next: Self::MIN,
            seed: seed | 1,
        }
    }

    /// The longest delay.
    pub fn cap(&self) -> Duration {
        self.max
    }
}

impl Iterator for WatchRetry {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        // xorshift64: cheap, good enough to spread retries.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        let half = delay / 2;
        let frac = (self.seed >> 11) as f64 / (1u64 << 53) as f64;
        Some(half + half.mul_f64(frac))
    }
}

impl kube::runtime::utils::Backoff for WatchRetry {
    fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_retry_doubles_to_its_cap_jittered_down_to_half_and_resets() {
        use kube::runtime::utils::Backoff as _;
        let max = Duration::from_secs(5);
        let mut r = WatchRetry::new(max);
        let mut nominal = WatchRetry::MIN;
        for _ in 0..20 {
            let d = r.next().unwrap();
            assert!(
                d >= nominal / 2 && d <= nominal,
                "{d:?} outside [{nominal:?}/2, {nominal:?}]"
            );
            nominal = (nominal * 2).min(max);
        }
        assert_eq!(nominal, max, "the cap is reached");
        r.reset();
        let d = r.next().unwrap();
        assert!(d <= WatchRetry::MIN, "after a reset it starts over: {d:?}");
        // A cap below the first delay is raised to it.
        let mut tiny = WatchRetry::new(Duration::ZERO);
        assert!(tiny.nth(5).unwrap() <= WatchRetry::MIN);
    }
}
