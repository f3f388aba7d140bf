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
//! A single failure does not leave a stage (a route's selected backends, or its fallback
//! ones) with fewer than half of its backends: the first failure of a backend marks it only
//! while at least half of its stage would stay unmarked, and never in a stage of two or
//! fewer; a second failure in a row marks it regardless. Failures while a backend is marked
//! (connects that were in flight) change nothing. [`next_candidate`] orders a connection's
//! attempts around skipped backends, spreading their flows over the others.

/// A backend a dataplane skips now (the agent's `/status`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
        // Connects that were in flight when it was marked fail too: they say nothing new,
        // and must not push its wait up (nor count as a second failure in a row).
        if self.skipped(now_ms) {
            return true;
        }
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

/// Whether a first failure may mark a backend of a stage (a route's selected backends, or
/// its fallback ones) of `candidates` backends, `skipped` of them skipped now: at least half
/// stay unmarked, and never in a stage of two or fewer (there one flaky connect would send
/// every connection to one backend; a second failure in a row marks it all the same).
pub fn may_mark_first(candidates: usize, skipped: usize) -> bool {
    let left = candidates.saturating_sub(skipped + 1);
    candidates > 2 && 2 * left >= candidates
}

/// A route's candidates as [`next_candidate`] sees them: `selected` ones (indices
/// `0..selected`) then `spare` fallback ones, at most `tries` tried per stage.
#[derive(Clone, Copy, Debug)]
pub struct Stages {
    /// Selected backends.
    pub selected: usize,
    /// Fallback backends (after the selected ones).
    pub spare: usize,
    /// Attempts per stage (`--connect-attempts`).
    pub tries: usize,
}

/// What a connection tried so far: how many of each stage, and which ones.
pub struct TriedSoFar<F: Fn(usize) -> bool> {
    /// Selected backends tried.
    pub selected: usize,
    /// Fallback backends tried.
    pub spare: usize,
    /// Whether backend `i` was tried.
    pub contains: F,
}

impl<F: Fn(usize) -> bool> std::fmt::Debug for TriedSoFar<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TriedSoFar")
            .field("selected", &self.selected)
            .field("spare", &self.spare)
            .finish_non_exhaustive()
    }
}

/// The backend a connection's next attempt tries, or `None` when its attempts are spent.
///
/// `first` is the policy's pick among the selected backends (Maglev); `spread` is a value
/// of the flow's hash that spreads the flows of a skipped or failed backend over all the
/// others (walking from the next index would pile them all onto one). In order: `first`,
/// then the other selected backends from `spread`, then the fallback ones from `spread`;
/// those not `skipped` before those that are, and never one the connection `tried`; at most
/// `tries` of each stage in all (counting the ones tried).
pub fn next_candidate(
    stages: Stages,
    first: usize,
    spread: u64,
    skipped: impl Fn(usize) -> bool,
    tried: TriedSoFar<impl Fn(usize) -> bool>,
) -> Option<usize> {
    let Stages {
        selected: n,
        spare,
        tries,
    } = stages;
    if n == 0 || first >= n {
        return None;
    }
    let selected_left = tries.min(n) > tried.selected;
    let spare_left = tries.min(spare) > tried.spare;
    let tried = tried.contains;
    let start = (spread % n as u64) as usize;
    let selected_order = std::iter::once(first)
        .chain(
            (0..n)
                .map(move |k| (start + k) % n)
                .filter(move |&i| i != first),
        )
        .filter(move |_| selected_left);
    let spare_start = if spare == 0 {
        0
    } else {
        ((spread >> 32) % spare as u64) as usize
    };
    let spare_order = (0..spare)
        .map(move |k| n + (spare_start + k) % spare)
        .filter(move |_| spare_left);
    let fresh = |i: &usize| !tried(*i);
    let ok = |i: &usize| !skipped(*i);
    let bad = |i: &usize| skipped(*i);
    selected_order
        .clone()
        .filter(fresh)
        .filter(ok)
        .chain(spare_order.clone().filter(fresh).filter(ok))
        .chain(selected_order.filter(fresh).filter(bad))
        .chain(spare_order.filter(fresh).filter(bad))
        .next()
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
        // Failures while it is skipped (connects in flight when it was marked) change nothing.
        assert!(h.failed(12_000, true));
        assert_eq!((h.failures, h.until_ms), (2, 13_000));
        // Each half-open try that fails doubles the wait, up to 30 s.
        let mut t = 13_000;
        for _ in 0..20 {
            t = t.max(h.until_ms);
            h.failed(t, true);
        }
        assert_eq!(h.until_ms, t + MAX_WAIT_MS);
        h.succeeded();
        assert_eq!(h, Health::default());
        assert!(!h.skipped(t + 1));
    }

    #[test]
    fn a_first_failure_marks_only_while_half_the_candidates_stay_and_a_second_marks_anyway() {
        assert!(
            !may_mark_first(2, 0),
            "one of two: one flaky connect would send everything to the other"
        );
        assert!(!may_mark_first(1, 0), "a lone backend");
        assert!(may_mark_first(3, 0));
        assert!(!may_mark_first(3, 1));
        assert!(may_mark_first(4, 1));
        assert!(!may_mark_first(4, 2));
        let mut h = Health::default();
        assert!(!h.failed(0, false));
        assert!(!h.skipped(0));
        assert!(h.failed(5, false), "a second failure in a row marks it");
        assert!(h.skipped(5));
    }

    /// What a connection tried, from the backends it tried (the stages of `st`).
    fn so_far(st: Stages, tried: &[usize]) -> TriedSoFar<impl Fn(usize) -> bool + '_> {
        TriedSoFar {
            selected: tried.iter().filter(|&&i| i < st.selected).count(),
            spare: tried.iter().filter(|&&i| i >= st.selected).count(),
            contains: move |i| tried.contains(&i),
        }
    }

    #[test]
    fn the_pick_stands_unless_skipped_then_selected_then_fallback_then_skipped_ones() {
        let st = Stages {
            selected: 3,
            spare: 2,
            tries: 3,
        };
        let none = |_: usize| false;
        assert_eq!(next_candidate(st, 1, 0, none, so_far(st, &[])), Some(1));
        assert_eq!(
            next_candidate(st, 1, 0, |i| i == 1, so_far(st, &[])),
            Some(0)
        );
        assert_eq!(
            next_candidate(st, 1, 0, |i| i < 3, so_far(st, &[])),
            Some(3)
        );
        assert_eq!(next_candidate(st, 1, 0, |_| true, so_far(st, &[])), Some(1));
        // Tried ones never again; then the skipped ones; then nothing.
        assert_eq!(
            next_candidate(st, 1, 0, |i| i < 3, so_far(st, &[3])),
            Some(4)
        );
        assert_eq!(
            next_candidate(st, 1, 0, |i| i < 3, so_far(st, &[3, 4])),
            Some(1)
        );
        assert_eq!(
            next_candidate(st, 1, 0, none, so_far(st, &[0, 1, 2, 3, 4])),
            None
        );
        // One try a stage: a selected one (the pick), then one fallback one.
        let one = Stages { tries: 1, ..st };
        assert_eq!(next_candidate(one, 1, 0, none, so_far(one, &[1])), Some(3));
        assert_eq!(next_candidate(one, 1, 0, none, so_far(one, &[1, 3])), None);
    }

    proptest! {
        /// A connection's attempts: never one tried twice, at most `tries` per stage; a
        /// skipped backend only once no untried one is left that is not skipped within the
        /// stages' budgets; a fallback one only once no untried selected one that is not
        /// skipped is left within budget; the pick first when it is not skipped.
        #[test]
        fn attempts_follow_the_stages_and_go_around_skipped_backends(
            selected in 1usize..8,
            spare in 0usize..8,
            tries in 1usize..5,
            first in 0usize..8,
            spread in any::<u64>(),
            mask in any::<u16>(),
        ) {
            let st = Stages { selected, spare, tries };
            let first = first % selected;
            let skipped = |i: usize| mask & (1 << i) != 0;
            let mut tried: Vec<usize> = Vec::new();
            while let Some(i) = next_candidate(st, first, spread, skipped, so_far(st, &tried)) {
                prop_assert!(i < selected + spare);
                prop_assert!(!tried.contains(&i));
                let sel_used = tried.iter().filter(|&&j| j < selected).count();
                let spare_used = tried.len() - sel_used;
                let budget = |j: usize| if j < selected { sel_used < tries.min(selected) } else { spare_used < tries.min(spare) };
                prop_assert!(budget(i));
                let usable = |j: usize| !tried.contains(&j) && budget(j) && !skipped(j);
                if (0..selected + spare).any(usable) {
                    prop_assert!(!skipped(i), "skipped {i} while one is usable");
                }
                if (0..selected).any(usable) {
                    prop_assert!(i < selected, "fallback {i} while a selected one is usable");
                }
                if tried.is_empty() && !skipped(first) {
                    prop_assert_eq!(i, first);
                }
                tried.push(i);
            }
            prop_assert_eq!(tried.len(), tries.min(selected) + tries.min(spare));
        }

        /// Any sequence of single failures spread over a frontend's backends leaves at least
        /// half of them unskipped (only repeated failures of one backend mark past that).
        #[test]
        fn single_failures_never_skip_more_than_half_of_a_stage(
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
