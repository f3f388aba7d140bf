//! The list+watch driver both binaries run their watchers through: it pulls a kube-runtime
//! `watcher` stream (or any stream of the same events) and waits out failures with
//! [`WatchRetry`], so that an API server failing lists is asked at most once per backoff step.
//!
//! What resets the backoff is what proves the watch works: a **watch event** (`Apply`,
//! `Delete`), or a failure long after the last one (more than [`ListWatch::QUIET`] or three
//! times the cap: a new streak, retried at once again). Not `Init`: kube-runtime's watcher
//! yields `Ok(Init)` before every list attempt, so a loop that resets on any `Ok` retries a
//! failing list every 100 ms for ever. Not `InitApply`: a list that fails on its second page
//! has not completed. Not even `InitDone`: a list that completes and a watch that fails at
//! once (an API server that answers lists but expires or refuses every watch) would be listed
//! again every 100 ms, each list a full copy. A completed list does prove that the API server
//! answers ([`Next::Event::proof`], for a member's health).
//!
//! `410 Gone` (the resource version expired: an API server restarted, history compacted)
//! re-lists at once the first time; a second `410` with no watch event in between counts as a
//! failure.

use std::time::Duration;

use tokio::time::Instant;

use futures::{Stream, StreamExt as _, stream::BoxStream};
use kube::runtime::{utils::Backoff as _, watcher};

use crate::retry::WatchRetry;

/// One failed attempt, handed to the caller before the driver waits `delay`.
#[derive(Debug)]
pub struct Failure {
    /// What failed.
    pub error: watcher::Error,
    /// Failures in a row, this one included (1: the first since the last success).
    pub streak: u32,
    /// When the first failure of the streak happened.
    pub since: Instant,
    /// How long the driver waits before the next attempt.
    pub delay: Duration,
}

impl Failure {
    /// The HTTP status code the API server answered with, when it answered.
    pub fn code(&self) -> Option<u16> {
        match &self.error {
            watcher::Error::InitialListFailed(kube::Error::Api(s))
            | watcher::Error::WatchStartFailed(kube::Error::Api(s))
            | watcher::Error::WatchFailed(kube::Error::Api(s))
            | watcher::Error::WatchError(s) => Some(s.code),
            _ => None,
        }
    }

    /// Whether the API server refused our credentials (401 Unauthorized, 403 Forbidden).
    pub fn refused(&self) -> Option<u16> {
        self.code().filter(|c| matches!(c, 401 | 403))
    }
}

/// What [`ListWatch::next`] yields.
#[derive(Debug)]
pub enum Next<K> {
    /// An event of the stream. `proof`: it shows the API server answers (a completed list
    /// or a watch event; only a watch event resets the backoff).
    Event {
        /// The event.
        event: watcher::Event<K>,
        /// A completed list or a watch event.
        proof: bool,
    },
    /// An attempt failed; the next call waits [`Failure::delay`] first.
    Failed(Failure),
}

/// A list+watch stream driven with a backoff that only a success resets. See the module docs.
pub struct ListWatch<K> {
    stream: BoxStream<'static, watcher::Result<watcher::Event<K>>>,
    retry: WatchRetry,
    /// Failures since the last watch event, when the first of them happened, and when the
    /// last one did.
    streak: Option<(u32, Instant, Instant)>,
    /// Waited at the start of the next call (after a failure).
    wait: Option<Duration>,
    /// A `410 Gone` was re-listed at once since the last watch event.
    expired_once: bool,
}

impl<K> std::fmt::Debug for ListWatch<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListWatch")
            .field("retry", &self.retry)
            .field("streak", &self.streak)
            .finish_non_exhaustive()
    }
}

impl<K: Send + 'static> ListWatch<K> {
    /// A failure this long after the previous one (or three times the cap, if longer) starts
    /// a new streak: the watch worked in between.
    pub const QUIET: Duration = Duration::from_secs(60);

    /// Drives `stream`, waiting at most `retry_max` between two failed attempts.
    pub fn new(
        stream: impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send + 'static,
        retry_max: Duration,
    ) -> Self {
        Self {
            stream: stream.boxed(),
            retry: WatchRetry::new(retry_max),
            streak: None,
            wait: None,
            expired_once: false,
        }
    }

    /// Failures in a row now (0: the last attempt succeeded or none failed yet).
    pub fn streak(&self) -> u32 {
        self.streak.map_or(0, |(n, _, _)| n)
    }

    /// The next event or failure; `None` when the stream ends. Cancel-safe between events:
    /// a wait cut short is waited again by the next call.
    pub async fn next(&mut self) -> Option<Next<K>> {
        loop {
            if let Some(d) = self.wait {
                tokio::time::sleep(d).await;
                self.wait = None;
            }
            let item = self.stream.next().await?;
            return Some(match item {
                Ok(event) => {
                    let watched =
                        matches!(event, watcher::Event::Apply(_) | watcher::Event::Delete(_));
                    if watched {
                        self.retry.reset();
                        self.streak = None;
                        self.expired_once = false;
                    }
                    let proof = watched || matches!(event, watcher::Event::InitDone);
                    Next::Event { event, proof }
                }
                Err(watcher::Error::WatchError(s)) if s.code == 410 && !self.expired_once => {
                    self.expired_once = true;
                    tracing::debug!(reason = %s.message, "watch expired (410 Gone); re-listing");
                    continue;
                }
                Err(error) => {
                    let now = Instant::now();
                    let quiet = Self::QUIET.max(self.retry.cap() * 3);
                    if self
                        .streak
                        .is_some_and(|(_, _, last)| now.duration_since(last) > quiet)
                    {
                        self.retry.reset();
                        self.streak = None;
                    }
                    let delay = self.retry.next().unwrap_or(self.retry.cap());
                    let (n, since, _) = self.streak.unwrap_or((0, now, now));
                    let streak = n.saturating_add(1);
                    self.streak = Some((streak, since, now));
                    self.wait = Some(delay);
                    Next::Failed(Failure {
                        error,
                        streak,
                        since,
                        delay,
                    })
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;
    use std::sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    };

    fn list_failed(code: u16) -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(
            Status::failure("no", "InternalError")
                .with_code(code)
                .boxed(),
        ))
    }

    fn gone() -> watcher::Error {
        watcher::Error::WatchError(
            Status::failure("too old resource version", "Expired")
                .with_code(410)
                .boxed(),
        )
    }

    /// A stream as kube-runtime's watcher yields it against a server failing every list:
    /// `Init`, then the error, again and again (counting the list attempts).
    fn failing_lists(
        attempts: Arc<AtomicU32>,
    ) -> impl Stream<Item = watcher::Result<watcher::Event<u32>>> {
        futures::stream::iter(0..).flat_map(move |_| {
            attempts.fetch_add(1, Ordering::Relaxed);
            futures::stream::iter([Ok(watcher::Event::Init), Err(list_failed(500))])
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_list_is_retried_once_per_backoff_step_whatever_init_says() {
        let attempts = Arc::new(AtomicU32::new(0));
        let mut lw = ListWatch::new(failing_lists(attempts.clone()), Duration::from_secs(20));
        let t0 = tokio::time::Instant::now();
        let mut delays = Vec::new();
        while t0.elapsed() < Duration::from_secs(60) {
            match lw.next().await.unwrap() {
                Next::Event { event, proof } => {
                    assert!(matches!(event, watcher::Event::Init));
                    assert!(!proof, "Init proves nothing");
                }
                Next::Failed(f) => {
                    assert_eq!(f.streak as usize, delays.len() + 1, "the streak counts on");
                    assert_eq!(f.code(), Some(500));
                    assert_eq!(f.refused(), None);
                    delays.push(f.delay);
                }
            }
        }
        // 100 ms doubling to the 20 s cap, each drawn in [d/2, d]: never reset by Init.
        let mut nominal = WatchRetry::MIN;
        for d in &delays {
            assert!(*d >= nominal / 2 && *d <= nominal, "{d:?} vs {nominal:?}");
            nominal = (nominal * 2).min(Duration::from_secs(20));
        }
        let n = attempts.load(Ordering::Relaxed);
        assert!(n <= 15, "{n} list attempts in 60 s");
    }

    /// A server that answers lists but expires every watch at once (410): one list per
    /// backoff step, not one every 100 ms (a completed list does not reset the backoff).
    #[tokio::test(start_paused = true)]
    async fn a_server_expiring_every_watch_is_listed_once_per_backoff_step() {
        let lists = Arc::new(AtomicU32::new(0));
        let counted = lists.clone();
        let stream = futures::stream::iter(0..).flat_map(move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
            futures::stream::iter([
                Ok(watcher::Event::Init),
                Ok(watcher::Event::InitDone),
                Err(gone()),
            ])
        });
        let mut lw = ListWatch::<u32>::new(stream, Duration::from_secs(20));
        let t0 = tokio::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(60) {
            if let Next::Event { event, proof } = lw.next().await.unwrap() {
                assert_eq!(proof, matches!(event, watcher::Event::InitDone));
            }
        }
        let n = lists.load(Ordering::Relaxed);
        assert!(n <= 16, "{n} lists in 60 s");
    }

    /// A failure long after the last one starts a new streak, retried at once.
    #[tokio::test(start_paused = true)]
    async fn a_failure_after_a_quiet_minute_starts_a_new_streak() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<watcher::Result<watcher::Event<u32>>>();
        let mut lw = ListWatch::new(rx, Duration::from_secs(20));
        for _ in 0..8 {
            tx.unbounded_send(Err(list_failed(500))).unwrap();
            let Some(Next::Failed(_)) = lw.next().await else {
                panic!()
            };
        }
        assert_eq!(lw.streak(), 8);
        // The watch then works, quietly, for two minutes.
        tokio::time::sleep(Duration::from_secs(120)).await;
        tx.unbounded_send(Err(list_failed(500))).unwrap();
        let Some(Next::Failed(f)) = lw.next().await else {
            panic!()
        };
        assert_eq!(f.streak, 1);
        assert!(f.delay <= WatchRetry::MIN, "{:?}", f.delay);
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_event_resets_the_backoff_and_the_streak_a_list_proves_only_an_answer() {
        let events: Vec<watcher::Result<watcher::Event<u32>>> = vec![
            Ok(watcher::Event::Init),
            Err(list_failed(401)),
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(1)),
            Err(list_failed(500)),
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(1)),
            Ok(watcher::Event::InitDone),
            Err(list_failed(500)),
            Ok(watcher::Event::Apply(2)),
            Err(gone()),
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitDone),
            Err(gone()),
        ];
        let mut lw = ListWatch::new(futures::stream::iter(events), Duration::from_secs(20));
        let mut seen = Vec::new();
        while let Some(n) = lw.next().await {
            seen.push(match n {
                Next::Event { event, proof } => format!(
                    "{}{}",
                    match event {
                        watcher::Event::Init => "Init",
                        watcher::Event::InitApply(_) => "InitApply",
                        watcher::Event::InitDone => "InitDone",
                        watcher::Event::Apply(_) => "Apply",
                        watcher::Event::Delete(_) => "Delete",
                    },
                    if proof { "!" } else { "" }
                ),
                Next::Failed(f) => format!(
                    "fail{}:{}{}",
                    f.streak,
                    f.code().unwrap_or(0),
                    if f.refused().is_some() { "refused" } else { "" }
                ),
            });
        }
        assert_eq!(
            seen,
            [
                "Init",
                "fail1:401refused",
                "Init",
                "InitApply",
                // A list that failed part-way is no success: the streak goes on.
                "fail2:500",
                "Init",
                "InitApply",
                // A completed list proves an answer, but the backoff goes on until a watch
                // event.
                "InitDone!",
                "fail3:500",
                "Apply!",
                // The first 410 re-lists at once; the second one, with no watch event
                // since, is a failure.
                "Init",
                "InitDone!",
                "fail1:410",
            ]
        );
    }
}
