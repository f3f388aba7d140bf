//! The route table of the userspace forwarder: frontend (VIP:port, protocol) → the selected
//! backends with their Maglev table. Readers load it through `ArcSwap` without locking; a diff
//! builds a new table (sharing every unchanged route by `Arc`) and swaps it in.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, OnceLock},
    time::Duration,
};

use arc_swap::ArcSwap;
use mcs_model::{Frontend, Protocol, Service, TableDiff};

use super::metrics::{Backends, FrontendCounters, ProxyMetrics};
use crate::maglev::{self, Maglev};

/// The backends one connection tried, in order: at most [`Tried::MAX`] remembered, inline
/// (no allocation per connection). Once a backend of the route failed a connect, the order
/// of the rest changes under a connection's retries; this keeps them from trying one twice.
#[derive(Clone, Copy, Debug)]
pub struct Tried {
    len: u8,
    at: [u32; Tried::MAX],
}

impl Tried {
    /// How many are remembered.
    pub const MAX: usize = 16;

    /// None yet.
    pub const fn new() -> Self {
        Self {
            len: 0,
            at: [0; Self::MAX],
        }
    }

    /// Backend `i` was tried (forgotten past [`Self::MAX`]).
    #[inline]
    pub fn push(&mut self, i: usize) {
        if usize::from(self.len) < Self::MAX {
            self.at[usize::from(self.len)] = i as u32;
            self.len += 1;
        }
    }

    /// Whether backend `i` was tried.
    #[inline]
    pub fn contains(&self, i: usize) -> bool {
        self.at[..usize::from(self.len)].contains(&(i as u32))
    }

    /// How many of the tried ones are below `n` (a route's selected backends).
    #[inline]
    pub fn below(&self, n: usize) -> usize {
        self.at[..usize::from(self.len)]
            .iter()
            .filter(|&&i| (i as usize) < n)
            .count()
    }
}

impl Default for Tried {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a frontend's connections go.
#[derive(Debug)]
pub struct Route {
    /// The frontend, as text (metric label).
    pub frontend: Arc<str>,
    /// Selected backends in the table's order, then the fallback ones (usable, not
    /// selected: another cluster's or zone's, tried when every selected one refuses), each
    /// with its counters.
    pub backends: Backends,
    /// How many of `backends` are selected (the first ones).
    selected: usize,
    /// Maglev table over the selected backends, built at the route's first connection: on a node with
    /// many services most are never used from it, and a route is rebuilt at every change of
    /// its backends. Read lock-free once built.
    maglev: OnceLock<Maglev>,
    /// Its size.
    maglev_size: usize,
    /// ClientIP affinity: flows of one client IP go to one backend.
    pub affinity: Option<Duration>,
    /// Counters of the frontend.
    pub frontend_counters: FrontendCounters,
}

impl Route {
    /// Builds the route of a service (selected backends get traffic; the fallback ones only
    /// when every selected one refused).
    pub fn new(
        frontend: &Frontend,
        service: &Service,
        table_size: usize,
        metrics: &ProxyMetrics,
    ) -> Self {
        let addr = |b: &mcs_model::Backend| SocketAddr::new(b.address, b.port);
        let mut backends: Vec<SocketAddr> = service.selected().map(addr).collect();
        let selected = backends.len();
        backends.extend(service.fallback().map(addr));
        let (frontend_label, frontend_counters, backends) =
            metrics.route(&frontend.to_string(), &backends);
        Self {
            maglev_size: maglev::table_size_for(selected, table_size),
            selected,
            maglev: OnceLock::new(),
            frontend_counters,
            frontend: frontend_label,
            backends,
            affinity: service
                .affinity
                .map(|a| Duration::from_secs(u64::from(a.timeout_seconds))),
        }
    }

    /// How many connects a client's connection may try with at most `tries` per stage: up
    /// to `tries` selected backends, then (when a backend is selected at all) up to `tries`
    /// fallback ones.
    #[inline]
    pub fn attempts(&self, tries: usize) -> usize {
        if self.selected == 0 {
            return 0;
        }
        // A connection remembers the backends it tried: at most `Tried::MAX` attempts.
        (tries.min(self.selected) + tries.min(self.backends.len() - self.selected)).min(Tried::MAX)
    }

    /// How many of its backends are selected (the first ones; the rest are fallback).
    #[inline]
    pub fn selected(&self) -> usize {
        self.selected
    }

    /// The backend of attempt `attempt` (of [`Self::attempts`]`(tries)`) for a client:
    /// attempt 0 is the Maglev pick among the selected backends and the next ones walk them
    /// from there; past `tries` (or all of them) the fallback backends are walked from a
    /// place set by the client's flow hash. Once a backend of the route failed a connect,
    /// [`mcs_model::health::next_candidate`] orders the attempts instead: skipped backends
    /// last, a dead backend's flows spread over the others, none this connection `tried`.
    #[inline]
    pub fn pick(
        &self,
        client: SocketAddr,
        attempt: usize,
        tries: usize,
        tried: &Tried,
    ) -> Option<(usize, SocketAddr)> {
        let n = self.selected;
        let stage = tries.min(n);
        let hash = flow_hash(client, self.affinity.is_some());
        if self.backends.has_health() && n > 0 {
            return self.pick_around_failed(hash, attempt, tries, tried);
        }
        let i = if attempt < stage {
            (self.maglev().pick(hash)? + attempt) % n
        } else {
            let spare = self.backends.len() - n;
            if n == 0 || spare == 0 {
                return None;
            }
            n + (hash as usize).wrapping_add(attempt - stage) % spare
        };
        Some((i, self.backends.addr(i)))
    }

    /// [`Self::pick`] once a backend of the route failed a connect: the first not `tried` of
    /// the selected backends not skipped (walked from the Maglev pick), the fallback ones not
    /// skipped (walked from the flow hash), then the skipped selected and fallback ones.
    /// Out of line: the common path (no backend ever failed) stays small.
    #[cold]
    #[inline(never)]
    fn pick_around_failed(
        &self,
        hash: u64,
        attempt: usize,
        tries: usize,
        tried: &Tried,
    ) -> Option<(usize, SocketAddr)> {
        if attempt >= self.attempts(tries) {
            return None;
        }
        let n = self.selected;
        let stages = mcs_model::health::Stages {
            selected: n,
            spare: self.backends.len() - n,
            tries,
        };
        let first = self.maglev().pick(hash)?;
        let now = super::metrics::now_ms();
        let i = mcs_model::health::next_candidate(
            stages,
            first,
            hash.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            |i| self.backends.skipped(i, now),
            mcs_model::health::TriedSoFar {
                selected: tried.below(n),
                spare: usize::from(tried.len) - tried.below(n),
                contains: |i| tried.contains(i),
            },
        )?;
        if attempt == 0 && i != first {
            // The policy's pick failed lately: another backend takes the connection.
            self.frontend_counters.skipped.inc();
        }
        Some((i, self.backends.addr(i)))
    }

    /// Whether backend `i` (an index from [`Self::pick`]) is a fallback backend.
    #[inline]
    pub fn is_fallback(&self, i: usize) -> bool {
        i >= self.selected
    }

    /// The route's Maglev table (built now if this is its first use).
    #[inline]
    pub fn maglev(&self) -> &Maglev {
        self.maglev.get_or_init(|| {
            // Keyed by the backends' `addr:port` text, as the metric labels spell them.
            let labels: Vec<String> = self
                .backends
                .addrs()
                .take(self.selected)
                .map(|a| a.to_string())
                .collect();
            let keys: Vec<&[u8]> = labels.iter().map(|l| l.as_bytes()).collect();
            Maglev::new(&keys, self.maglev_size)
        })
    }

    /// Whether `backend` is still a backend of this route (selected or fallback: still
    /// usable, so a connection to it is not drained).
    pub fn has_backend(&self, backend: SocketAddr) -> bool {
        self.backends.addrs().any(|a| a == backend)
    }
}

/// Hash of a flow: the client address and port, or only the address with affinity.
#[inline]
pub fn flow_hash(client: SocketAddr, affinity: bool) -> u64 {
    let ip = match client.ip() {
        std::net::IpAddr::V4(v4) => u64::from(u32::from(v4)),
        std::net::IpAddr::V6(v6) => {
            let x = u128::from(v6);
            (x as u64) ^ ((x >> 64) as u64)
        }
    };
    let port = if affinity {
        0
    } else {
        u64::from(client.port())
    };
    maglev::mix(ip.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (port << 48 | port))
}

/// Key of a route: the VIP and port as the kernel reports the original destination.
pub type RouteKey = (SocketAddr, Protocol);

/// All routes.
#[derive(Debug, Default)]
pub struct Routes {
    map: HashMap<RouteKey, Arc<Route>>,
}

impl Routes {
    /// The route of a destination.
    #[inline]
    pub fn get(&self, dst: SocketAddr, proto: Protocol) -> Option<&Arc<Route>> {
        self.map.get(&(normalize(dst), proto))
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// No routes.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// All routes.
    pub fn iter(&self) -> impl Iterator<Item = (&RouteKey, &Arc<Route>)> {
        self.map.iter()
    }
}

/// IPv4-mapped IPv6 (from dual-stack sockets) as plain IPv4.
pub fn normalize(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

/// The route table shared by the forwarder's tasks.
#[derive(Debug, Default)]
pub struct SharedRoutes {
    current: ArcSwap<Routes>,
    generation: tokio::sync::watch::Sender<u64>,
}

impl SharedRoutes {
    /// An empty table.
    pub fn new() -> Self {
        Self {
            current: ArcSwap::from_pointee(Routes::default()),
            generation: tokio::sync::watch::Sender::new(0),
        }
    }

    /// The current routes (lock-free).
    #[inline]
    pub fn load(&self) -> arc_swap::Guard<Arc<Routes>> {
        self.current.load()
    }

    /// Notified on every swap (connections check whether their backend is still there).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Applies a diff: unchanged routes are shared, changed ones rebuilt.
    pub fn apply(&self, diff: &TableDiff, table_size: usize, metrics: &ProxyMetrics) {
        let old = self.current.load_full();
        let mut map = old.map.clone();
        for f in &diff.remove {
            if let Some(r) = map.remove(&(SocketAddr::new(f.vip, f.port), f.protocol)) {
                metrics.forget_frontend(&r.frontend);
            }
        }
        let mut changed = Vec::new();
        for (f, s) in &diff.upsert {
            let route = Arc::new(Route::new(f, s, table_size, metrics));
            let label = route.frontend.clone();
            if map
                .insert((SocketAddr::new(f.vip, f.port), f.protocol), route)
                .is_some()
            {
                changed.push(label);
            }
        }
        self.current.store(Arc::new(Routes { map }));
        drop(old);
        self.generation.send_modify(|g| *g += 1);
        // The replaced routes are gone now unless a reader or a connection still holds one:
        // the counters of their backends that nothing uses any more are folded.
        metrics.settle(changed.iter().map(|l| &**l));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(backends: &[&str]) -> Service {
        Service {
            service: "ns/web".into(),
            affinity: None,
            backends: backends
                .iter()
                .map(|b| {
                    let a: SocketAddr = b.parse().unwrap();
                    mcs_model::Backend {
                        address: a.ip(),
                        port: a.port(),
                        cluster: "c1".into(),
                        zone: None,
                        ready: true,
                        serving: true,
                        terminating: false,
                        selected: true,
                        fallback: false,
                    }
                })
                .collect(),
        }
    }

    #[test]
    fn a_connection_tries_the_selected_backends_then_the_fallback_ones() {
        let (metrics, _registry, _routes, f) = bed();
        let mut svc = service(&[
            "198.18.1.2:80",
            "198.18.1.3:80",
            "198.18.2.2:80",
            "198.18.2.3:80",
            "198.18.2.4:80",
        ]);
        for b in &mut svc.backends[2..] {
            (b.selected, b.fallback) = (false, true);
        }
        let route = Route::new(&f, &svc, 1021, &metrics);
        assert_eq!(route.attempts(3), 2 + 3);
        assert_eq!(route.attempts(1), 1 + 1);
        for port in 1000..1100 {
            let client: SocketAddr = format!("198.18.9.9:{port}").parse().unwrap();
            let tried: Vec<(usize, SocketAddr)> = (0..route.attempts(3))
                .map(|a| route.pick(client, a, 3, &Tried::new()).unwrap())
                .collect();
            let mut seen: Vec<usize> = tried.iter().map(|t| t.0).collect();
            assert!(seen[..2].iter().all(|&i| i < 2 && !route.is_fallback(i)));
            assert!(seen[2..].iter().all(|&i| route.is_fallback(i)));
            assert!(
                tried[2..]
                    .iter()
                    .all(|t| t.1.to_string().starts_with("198.18.2."))
            );
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), 5, "each backend once: {tried:?}");
            // One try a stage: the Maglev pick, then one fallback backend.
            let one: Vec<usize> = (0..route.attempts(1))
                .map(|a| route.pick(client, a, 1, &Tried::new()).unwrap().0)
                .collect();
            assert!(one[0] < 2 && one[1] >= 2, "{one:?}");
        }
        // Nothing selected: nothing tried (the fallback only backs up a selection).
        for b in &mut svc.backends {
            b.selected = false;
        }
        let none = Route::new(&f, &svc, 1021, &metrics);
        assert_eq!(none.attempts(3), 0);
    }

    #[test]
    fn backends_that_failed_a_connect_are_tried_last_until_one_succeeds() {
        let (metrics, _registry, _routes, f) = bed();
        let mut svc = service(&[
            "198.18.1.2:80",
            "198.18.1.3:80",
            "198.18.1.4:80",
            "198.18.2.2:80",
            "198.18.2.3:80",
        ]);
        for b in &mut svc.backends[3..] {
            (b.selected, b.fallback) = (false, true);
        }
        let route = Route::new(&f, &svc, 1021, &metrics);
        let clients: Vec<SocketAddr> = (1000..1200)
            .map(|p| format!("198.18.9.9:{p}").parse().unwrap())
            .collect();
        let firsts = |route: &Route| -> Vec<usize> {
            clients
                .iter()
                .map(|&c| route.pick(c, 0, 3, &Tried::new()).unwrap().0)
                .collect()
        };
        // Backend 0 dies: its first failure marks it (two of three selected stay).
        assert_eq!(
            route.frontend_counters.skipped.get(),
            0,
            "nothing skipped before"
        );
        assert!(route.backends.connect_failed(0, 3));
        let picks = firsts(&route);
        assert!(picks.iter().all(|&i| i == 1 || i == 2), "{picks:?}");
        // Each client whose first choice was backend 0 is counted once, the others not.
        let was_first = clients
            .iter()
            .filter(|&&c| route.maglev().pick(flow_hash(c, false)) == Some(0))
            .count() as u64;
        assert!(was_first > 0);
        assert_eq!(route.frontend_counters.skipped.get(), was_first);
        // Every attempt still covers every backend, the skipped one last.
        for &c in &clients[..20] {
            let mut tried = Tried::new();
            let order: Vec<usize> = (0..route.attempts(3))
                .map(|a| {
                    let i = route.pick(c, a, 3, &tried).unwrap().0;
                    tried.push(i);
                    i
                })
                .collect();
            assert_eq!(order.len(), 5);
            assert_eq!(*order.last().unwrap(), 0, "{order:?}");
        }
        // Backend 0's flows are spread over the others, not all given to its neighbour.
        let moved: Vec<usize> = clients
            .iter()
            .filter(|&&c| route.maglev().pick(flow_hash(c, false)) == Some(0))
            .map(|&c| route.pick(c, 0, 3, &Tried::new()).unwrap().0)
            .collect();
        assert!(moved.contains(&1) && moved.contains(&2), "{moved:?}");
        // A second one fails once: marking it would leave one of the three selected, so
        // not yet; a second failure in a row marks it, and the third takes the connections.
        assert!(!route.backends.connect_failed(1, 3));
        assert!(firsts(&route).iter().all(|&i| i == 1 || i == 2));
        assert!(route.backends.connect_failed(1, 3));
        assert!(firsts(&route).iter().all(|&i| i == 2));
        // Failures while it is marked (connects in flight) change nothing.
        assert!(route.backends.connect_failed(1, 3));
        // The last selected one: twice too; then the fallback backends take the connections.
        assert!(!route.backends.connect_failed(2, 3));
        assert!(route.backends.connect_failed(2, 3));
        assert!(firsts(&route).iter().all(|&i| i >= 3));
        // Backend 1 answers again (a connect succeeded): it is picked again.
        route.backends.connected(1);
        assert!(firsts(&route).iter().all(|&i| i == 1));
        // What the node saw stays when the route's backends change.
        let (_, _, next) = metrics.route(
            &route.frontend,
            &route.backends.addrs().take(4).collect::<Vec<_>>(),
        );
        assert!(next.skipped(0, super::super::metrics::now_ms()));
        assert!(!next.skipped(1, super::super::metrics::now_ms()));
    }

    fn exposed(registry: &prometheus_client::registry::Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    /// Metrics registered in a registry (per backend: most tests look at one backend's
    /// series), empty routes, and the frontend the tests use.
    fn bed() -> (
        ProxyMetrics,
        prometheus_client::registry::Registry,
        SharedRoutes,
        Frontend,
    ) {
        let (metrics, registry, routes, f) = bed_per_frontend();
        metrics.set_per_backend(true);
        (metrics, registry, routes, f)
    }

    /// As [`bed`], with the default series: per frontend only.
    fn bed_per_frontend() -> (
        ProxyMetrics,
        prometheus_client::registry::Registry,
        SharedRoutes,
        Frontend,
    ) {
        let metrics = ProxyMetrics::default();
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let f = Frontend {
            vip: "198.18.0.10".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
        };
        (metrics, registry, SharedRoutes::new(), f)
    }

    /// The value of `family`'s series for `backend` in an exposition.
    fn value(text: &str, family: &str, backend: &str) -> Option<u64> {
        let series = format!("mcs_proxy_{family}_total{{");
        let label = format!("backend=\"{backend}\"");
        text.lines()
            .find(|l| l.starts_with(&series) && l.contains(&label))
            .and_then(|l| l.rsplit(' ').next())
            .map(|v| v.parse().unwrap())
    }

    /// Sets `f`'s backends and returns its route as built.
    fn upsert(
        routes: &SharedRoutes,
        metrics: &ProxyMetrics,
        f: Frontend,
        backends: &[&str],
    ) -> Arc<Route> {
        let mut d = TableDiff::default();
        d.upsert.insert(f, service(backends).into());
        routes.apply(&d, 1021, metrics);
        routes
            .load()
            .get(SocketAddr::new(f.vip, f.port), f.protocol)
            .cloned()
            .unwrap()
    }

    /// A route rebuilt with the same backends keeps their counters; one whose backends change
    /// gets new ones, while a connection of the old route still counts into the same series,
    /// before and after the old route's counters are folded in.
    #[test]
    fn counters_survive_route_changes_and_connections_that_outlive_them() {
        let (metrics, registry, routes, f) = bed();
        let set = |backends: &[&str]| upsert(&routes, &metrics, f, backends);
        let a = "198.18.1.2:8080";
        let first = set(&[a, "198.18.1.3:8080"]);
        first.backends.cells(0).bytes_tx.inc_by(100);
        // Same backends (another field of the service changed): the same counters.
        let again = set(&[a, "198.18.1.3:8080"]);
        assert!(Arc::ptr_eq(&first.backends, &again.backends));
        drop(again);
        // A backend leaves and another joins while `first` (a connection) is still open.
        let second = set(&[a, "198.18.1.4:8080"]);
        assert!(!Arc::ptr_eq(&first.backends, &second.backends));
        first.backends.cells(0).bytes_tx.inc_by(50);
        second.backends.cells(0).bytes_tx.inc_by(1);
        let text = exposed(&registry);
        assert_eq!(value(&text, "bytes_tx", a), Some(151), "{text}");
        assert_eq!(
            value(&text, "bytes_tx", "198.18.1.4:8080"),
            Some(0),
            "{text}"
        );
        assert_eq!(value(&text, "bytes_tx", "198.18.1.3:8080"), None, "{text}");
        // The connection ends; at the next change its counts are folded into the live ones.
        drop(first);
        drop(second);
        let third = set(&[a, "198.18.1.4:8080", "198.18.1.5:8080"]);
        assert_eq!(
            metrics.retired_slabs(&third.frontend),
            0,
            "the slab nothing holds was folded"
        );
        drop(third);
        let fourth = set(&[a]);
        assert_eq!(metrics.retired_slabs(&fourth.frontend), 0);
        fourth.backends.cells(0).bytes_tx.inc_by(1);
        let text = exposed(&registry);
        assert_eq!(value(&text, "bytes_tx", a), Some(152), "{text}");
        assert_eq!(value(&text, "bytes_tx", "198.18.1.4:8080"), None, "{text}");
    }

    /// A route nothing has used holds no counters (a node with 100k frontends carries
    /// connections on few of them), yet its series are exposed at 0; the first count
    /// allocates them and shows.
    #[test]
    fn counters_are_allocated_at_the_first_count() {
        let (metrics, registry, routes, f) = bed();
        let route = upsert(
            &routes,
            &metrics,
            f,
            &["198.18.1.2:8080", "198.18.1.3:8080"],
        );
        assert!(!route.backends.counted());
        let text = exposed(&registry);
        assert_eq!(
            value(&text, "connections", "198.18.1.3:8080"),
            Some(0),
            "{text}"
        );
        assert!(!route.backends.counted(), "a scrape allocates nothing");
        route.backends.cells(1).connections.inc();
        assert!(route.backends.counted());
        let text = exposed(&registry);
        assert_eq!(
            value(&text, "connections", "198.18.1.3:8080"),
            Some(1),
            "{text}"
        );
        assert_eq!(
            value(&text, "connections", "198.18.1.2:8080"),
            Some(0),
            "{text}"
        );
    }

    /// By default the backend counters are one series per frontend, their sum over its
    /// backends, which never goes down: not when a backend that counted leaves, nor while a
    /// connection of an old route still counts, nor after its slab is folded.
    #[test]
    fn per_frontend_series_sum_the_backends_and_never_go_down() {
        let (metrics, registry, routes, f) = bed_per_frontend();
        let set = |backends: &[&str]| upsert(&routes, &metrics, f, backends);
        let total = |family: &str| -> Option<u64> {
            let text = exposed(&registry);
            assert!(!text.contains("backend="), "{text}");
            let series = format!("mcs_proxy_{family}_total{{frontend=\"198.18.0.10:80/TCP\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&series))
                .map(|v| v.parse().unwrap())
        };
        let first = set(&["198.18.1.2:8080", "198.18.1.3:8080"]);
        assert_eq!(total("connections"), Some(0), "shown before any count");
        first.backends.cells(0).connections.inc();
        first.backends.cells(1).connections.inc_by(2);
        first.backends.cells(1).bytes_rx.inc_by(10);
        assert_eq!(total("connections"), Some(3));
        // The backend that counted 2 leaves while `first` (a connection) still counts into it.
        let second = set(&["198.18.1.2:8080"]);
        first.backends.cells(1).connections.inc();
        second.backends.cells(0).connections.inc();
        assert_eq!(total("connections"), Some(5));
        drop(first);
        drop(second);
        // Folded at the next change: what the departed backend counted stays in the sum.
        let third = set(&["198.18.1.2:8080", "198.18.1.4:8080"]);
        assert_eq!(metrics.retired_slabs(&third.frontend), 0);
        assert_eq!(total("connections"), Some(5));
        assert_eq!(total("bytes_rx"), Some(10));
        third.backends.cells(1).connections.inc();
        assert_eq!(total("connections"), Some(6));
    }

    /// The series budget of a scrape, by default: seven per frontend whatever its backends,
    /// plus the forwarder's seven gauges and counters. At 100k imports of 10 endpoints each
    /// (1M backends), per backend it would be over four million.
    #[test]
    fn a_scrape_at_100k_frontends_keeps_to_seven_series_per_frontend() {
        const FRONTENDS: usize = 100_000;
        const BUDGET: usize = 7 * FRONTENDS + 7;
        let metrics = ProxyMetrics::default();
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let backends: Vec<SocketAddr> = (0..10u16)
            .map(|i| SocketAddr::from(([198, 18, 1, 2], 8000 + i)))
            .collect();
        let routes: Vec<_> = (0..FRONTENDS)
            .map(|i| {
                let [a, b, c] = [(i >> 16) as u8, (i >> 8) as u8, i as u8];
                metrics.route(&format!("198.{}.{b}.{c}:80/TCP", 18 + a), &backends)
            })
            .collect();
        routes[7].2.cells(3).connections.inc();
        let text = exposed(&registry);
        let series = text.lines().filter(|l| !l.starts_with('#')).count();
        assert!(
            series <= BUDGET,
            "{series} series at {FRONTENDS} frontends, budget {BUDGET}"
        );
        assert!(
            series >= 7 * FRONTENDS,
            "every frontend has its series: {series}"
        );
    }

    /// Label sets of backends that left and of frontends that went are dropped: churn does not
    /// grow the registry.
    #[test]
    fn metric_label_sets_follow_the_routes() {
        let (metrics, registry, routes, f) = bed();
        upsert(
            &routes,
            &metrics,
            f,
            &["198.18.1.2:8080", "198.18.1.3:8080"],
        );
        let text = exposed(&registry);
        assert!(text.contains("backend=\"198.18.1.3:8080\""), "{text}");
        upsert(&routes, &metrics, f, &["198.18.1.2:8080"]);
        let text = exposed(&registry);
        assert!(!text.contains("198.18.1.3:8080"), "{text}");
        assert!(text.contains("198.18.1.2:8080"), "{text}");
        let d = TableDiff {
            remove: vec![f],
            ..Default::default()
        };
        routes.apply(&d, 1021, &metrics);
        let text = exposed(&registry);
        assert!(!text.contains("198.18.0.10:80"), "{text}");
    }
}
