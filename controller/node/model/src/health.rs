//! Passive health: what one node has seen of each backend's connects, and which backend a new
//! connection tries given that.
//!
//! A connect that fails (a reset to the SYN, or no answer before the dataplane's deadline)
//! marks its backend failed on this node for a while: 1 s after the first failure in a row,
//! doubling to 30 s; only a connect that succeeds clears it (backoff that only a success
//! resets). Once the time is up the backend is tried again (half-open): the next connect that
//! picks it decides. Failures are counted, times are the caller's (milliseconds of a
//! monotonic clock): this module has no clock, no lock and no allocation, so a dataplane can
//! keep one [`Health`] per backend in atomics and ask per connection.
//!
//! A single failure does not leave a frontend with fewer than half of its candidates: the
//! first failure of a backend marks it only while at least half of the frontend's candidates
//! (selected and fallback backends) would stay unmarked; a second failure in a row marks it
//! regardless. One flaky connect never sends all of a frontend's traffic to one backend of
//! several; a dead backend costs each node at most two failed connects before it is skipped.

/// A backend a dataplane skips now (the agent's `/status`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SkippedBackend {
    /// Its address.
    pub address: std::net::IpAddr,
    /// Its port.
    pub port: u16,
    /// Failed connects in a row.
    pub failures: u32,
    /// For how much longer it is skipped (ms); then it is tried again.
    pub for_ms: u64,
}

/// First wait after a failure (milliseconds).
pub const FIRST_WAIT_MS: u64 = 1_000;
/// Longest wait (milliseconds).
pub const MAX_WAIT_MS: u64 = 30_000;

/// What a node has seen of one backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// Failed connects in a row (0: the last one succeeded, or none was seen).
    pub failures: u32,
    /// Skipped until this time (ms); 0 when not marked.
    pub until_ms: u64,
}

impl Health {
    /// Whether new connections skip it at `now_ms`.
    pub fn skipped(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms
    }

    /// A connect to it succeeded: it is healthy again.
    pub fn succeeded(&mut self) {
        *self = Self::default();
    }

    /// A connect to it failed at `now_ms`. `may_mark`: whether marking it on a first failure
    /// leaves at least half of its frontend's candidates unmarked ([`may_mark_first`]); a
    /// second failure in a row marks it regardless. Returns whether it is now skipped.
    pub fn failed(&mut self, now_ms: u64, may_mark: bool) -> bool {
        self.failures = self.failures.saturating_add(1);
        if self.failures == 1 && !may_mark {
            return false;
        }
        self.until_ms = now_ms.saturating_add(wait_ms(self.failures));
        true
    }
}

/// How long a backend with `failures` failures in a row is skipped: 1 s, doubling to 30 s.
pub fn wait_ms(failures: u32) -> u64 {
    let doublings = failures.saturating_sub(1).min(16);
    (FIRST_WAIT_MS << doublings).min(MAX_WAIT_MS)
}

/// Whether a first failure may mark a backend of a frontend with `candidates` backends
/// (selected and fallback), `skipped` of them skipped now: at least half stay unmarked.
pub fn may_mark_first(candidates: usize, skipped: usize) -> bool {
    let left = candidates.saturating_sub(skipped + 1);
    2 * left >= candidates && left > 0
}

/// Which candidate a new connection tries: `first` (the policy's pick among the `selected`
/// ones, an index below `selected`) unless skipped; else the next selected one, walking from
/// `first`, that is not skipped; else the first fallback one (indices `selected..candidates`),
/// walking from `spare_start`, that is not skipped; and when every one is skipped, `first`
/// all the same (a connect that may succeed beats a refusal, and it tells whether the backend
/// is back). `skipped(i)` says whether candidate `i` is skipped now. `None` without selected
/// candidates.
pub fn choose(
    selected: usize,
    candidates: usize,
    first: usize,
    spare_start: usize,
    skipped: impl Fn(usize) -> bool,
) -> Option<usize> {
    if selected == 0 || first >= selected {
        return None;
    }
    if let Some(i) = (0..selected)
        .map(|k| (first + k) % selected)
        .find(|&i| !skipped(i))
    {
        return Some(i);
    }
    let spare = candidates.saturating_sub(selected);
    if let Some(i) = (0..spare)
        .map(|k| selected + (spare_start + k) % spare)
        .find(|&i| !skipped(i))
    {
        return Some(i);
    }
    Some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_failure_waits_one_second_doubling_to_thirty_and_only_a_success_clears_it() {
        let mut h = Health::default();
        assert!(!h.skipped(0));
        assert!(h.failed(10_000, true));
        assert!(h.skipped(10_999) && !h.skipped(11_000));
        // Half-open: tried again after the wait; it fails again, so twice as long.
        assert!(h.failed(11_000, true));
        assert_eq!(h.until_ms, 13_000);
        for _ in 0..20 {
            h.failed(20_000, true);
        }
        assert_eq!(h.until_ms, 20_000 + MAX_WAIT_MS);
        h.succeeded();
        assert_eq!(h, Health::default());
        assert!(!h.skipped(20_001));
    }

    #[test]
    fn a_first_failure_marks_only_while_half_the_candidates_stay_and_a_second_marks_anyway() {
        assert!(may_mark_first(2, 0), "one of two may be skipped");
        assert!(!may_mark_first(2, 1), "not the last one");
        assert!(
            !may_mark_first(1, 0),
            "a lone backend is never skipped on one failure"
        );
        assert!(may_mark_first(4, 1));
        assert!(!may_mark_first(4, 2));
        assert!(!may_mark_first(3, 1));
        let mut h = Health::default();
        assert!(!h.failed(0, false));
        assert!(!h.skipped(0));
        assert!(h.failed(5, false), "a second failure in a row marks it");
        assert!(h.skipped(5));
    }

    #[test]
    fn the_pick_stands_unless_skipped_then_selected_then_fallback_then_the_pick() {
        let none = |_: usize| false;
        assert_eq!(choose(3, 5, 1, 0, none), Some(1));
        assert_eq!(choose(3, 5, 1, 0, |i| i == 1), Some(2));
        assert_eq!(choose(3, 5, 2, 0, |i| i == 2), Some(0));
        assert_eq!(choose(3, 5, 1, 1, |i| i < 3), Some(4));
        assert_eq!(choose(3, 5, 1, 1, |i| i < 3 || i == 4), Some(3));
        assert_eq!(choose(3, 5, 1, 0, |_| true), Some(1));
        assert_eq!(choose(0, 2, 0, 0, none), None);
    }

    proptest! {
        /// Never a skipped backend while one is not skipped; never a fallback one while a
        /// selected one is not skipped; always a candidate.
        #[test]
        fn never_a_skipped_backend_while_another_is_usable(
            selected in 1usize..8,
            spare in 0usize..8,
            first in 0usize..8,
            spare_start in 0usize..8,
            mask in any::<u16>(),
        ) {
            let first = first % selected;
            let candidates = selected + spare;
            let skipped = |i: usize| mask & (1 << i) != 0;
            let i = choose(selected, candidates, first, spare_start, skipped).unwrap();
            prop_assert!(i < candidates);
            let any_selected = (0..selected).any(|i| !skipped(i));
            let any_usable = (0..candidates).any(|i| !skipped(i));
            if any_usable {
                prop_assert!(!skipped(i));
            } else {
                prop_assert_eq!(i, first);
            }
            if any_selected {
                prop_assert!(i < selected);
            }
        }

        /// Any sequence of single failures spread over a frontend's backends leaves at least
        /// half of them unskipped (only repeated failures of one backend mark past that).
        #[test]
        fn single_failures_never_skip_more_than_half(
            candidates in 1usize..12,
            order in proptest::collection::vec(0usize..12, 0..24),
        ) {
            let mut h = vec![Health::default(); candidates];
            for b in order.into_iter().map(|b| b % candidates) {
                if h[b].failures > 0 {
                    continue; // only first failures in this property
                }
                let skipped = h.iter().filter(|x| x.skipped(0)).count();
                h[b].failed(0, may_mark_first(candidates, skipped));
                let skipped = h.iter().filter(|x| x.skipped(0)).count();
                prop_assert!(2 * (candidates - skipped) >= candidates);
            }
        }
    }
}
