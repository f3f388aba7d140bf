//! `/metrics`, `/healthz`, `/readyz` and (when the binary gives one) `/status` on a small
//! HTTP/1.1 server (GET only, one request per connection): enough for Prometheus, kubelet
//! probes and `kubectl mcs` through the API server's pod proxy, without a web framework.
//!
//! Every pod of a node can reach the agent's port (host network), so the server is bounded
//! against all of them at once ([`Limits`]): connections in all and per source, deadlines
//! for the head and the exchange, and a few large answers at a time, each refused with a
//! `503` at once past its bound rather than queued.

use std::{
    collections::{BTreeMap, HashMap},
    future::Future,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use prometheus_client::registry::Registry;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::{Semaphore, oneshot},
};

use crate::handover::Sockets;

/// Shared health state.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
    became_ready: Arc<tokio::sync::Notify>,
}

impl Health {
    /// Ready: the first full table has been programmed.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
        self.became_ready.notify_waiters();
    }

    /// Whether ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Returns once ready.
    pub async fn wait_ready(&self) {
        loop {
            let notified = self.became_ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_ready() {
                return;
            }
            notified.await;
        }
    }
}

/// What answers `GET /status?QUERY`: called with the decoded query parameters, it returns a
/// JSON document (the binary's own read-only view of what it does).
pub type StatusFn = Arc<
    dyn Fn(Vec<(String, String)>) -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync,
>;

/// What one listener may take. Anyone who reaches the port (on the host network: every pod of
/// the node) may connect, so each bound holds against them all: connections in all and per
/// source address, a deadline for the request head and one for the whole exchange, and a few
/// large answers (`/status`, `/metrics`) at a time, two per source. With every place taken, a new connection
/// takes the place of the oldest one still waiting for its request head (idle ones go
/// first: a real client sends its request at once); with none waiting, or past its source's
/// share, it is answered `503` at once and closed. `/healthz` and `/readyz` need no answer
/// slot, so the kubelet's probes are answered while large answers are busy.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once, in all.
    pub connections: usize,
    /// Connections open at once from one source address.
    pub per_source: usize,
    /// `/status` and `/metrics` answers being built or written at once.
    pub large_answers: usize,
    /// Of those, from one source address.
    pub large_answers_per_source: usize,
    /// How long the request head may take to arrive.
    pub head_deadline: Duration,
    /// How long a whole exchange may take (a reader too slow for its answer is cut).
    pub deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            // An idle connection costs a descriptor and a few KiB until its head deadline:
            // 1,024 are ~5 MiB, and filling them takes 64 source addresses (pods).
            connections: 1024,
            per_source: 16,
            large_answers: 4,
            large_answers_per_source: 2,
            head_deadline: Duration::from_secs(5),
            deadline: Duration::from_secs(10),
        }
    }
}

impl Limits {
    /// The defaults, with connections at most a quarter of the process's open-files limit
    /// (the agent's DNS-over-TCP keeps half of it for the rest: the two never take it all).
    pub fn sized_to_open_files() -> Self {
        let d = Self::default();
        let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .map_or(1024, |(soft, _)| soft);
        Self {
            connections: d
                .connections
                .min(usize::try_from(soft / 4).unwrap_or(usize::MAX))
                .max(16),
            ..d
        }
    }
}

/// The longest request head read (a GET needs a few hundred bytes).
const HEAD_MAX: usize = 4096;

/// Connections refused since the last log line, by why.
#[derive(Debug, Default)]
struct Refusals {
    full: u64,
    per_source: u64,
    since: Option<std::time::Instant>,
}

impl Refusals {
    /// Counts one; logs the counts at most once a minute.
    fn count(&mut self, per_source: bool, limits: &Limits) {
        if per_source {
            self.per_source += 1;
        } else {
            self.full += 1;
        }
        let now = std::time::Instant::now();
        if self
            .since
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60))
        {
            tracing::warn!(
                full = self.full,
                per_source = self.per_source,
                max_connections = limits.connections,
                max_per_source = limits.per_source,
                "metrics listener refused connections (counts since the last such line): too many open in all, or from one address"
            );
            *self = Self {
                since: Some(now),
                ..Self::default()
            };
        }
    }
}

/// The listener's open connections: how many in all and from each source, and which of
/// them still wait for their request head (the ones a new connection may push out).
#[derive(Debug, Default)]
struct Book {
    open: usize,
    per_source: HashMap<IpAddr, usize>,
    /// Large answers in progress per source.
    large: HashMap<IpAddr, usize>,
    /// By connection number (oldest first): the sender that closes it.
    waiting: BTreeMap<u64, oneshot::Sender<()>>,
    next: u64,
}

/// Why a connection was refused.
enum Refused {
    Full,
    PerSource,
}

impl Book {
    /// Admits a connection from `source`: within its source's share, and, with every place
    /// taken, in place of the oldest connection still waiting for its head (a client that
    /// has a request sends it at once; one that holds a place idle loses it first). Returns
    /// its number and what closes it early.
    fn admit(
        &mut self,
        source: IpAddr,
        limits: &Limits,
    ) -> Result<(u64, oneshot::Receiver<()>), Refused> {
        let from_source = self.per_source.get(&source).copied().unwrap_or(0);
        if from_source >= limits.per_source {
            return Err(Refused::PerSource);
        }
        if self.open >= limits.connections {
            let Some((_, close)) = self.waiting.pop_first() else {
                return Err(Refused::Full);
            };
            // Its task ends and gives its place back.
            let _ = close.send(());
        }
        self.open += 1;
        *self.per_source.entry(source).or_insert(0) += 1;
        let id = self.next;
        self.next += 1;
        let (tx, rx) = oneshot::channel();
        self.waiting.insert(id, tx);
        Ok((id, rx))
    }

    fn release(&mut self, id: u64, source: IpAddr) {
        self.waiting.remove(&id);
        self.open -= 1;
        if let Some(n) = self.per_source.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&source);
            }
        }
    }
}

/// One open connection's place in the [`Book`], given back on drop.
struct Slot {
    id: u64,
    source: IpAddr,
    book: Arc<Mutex<Book>>,
    /// It holds one of its source's large-answer places.
    large: AtomicBool,
}

impl Slot {
    /// Takes one of its source's large-answer places: false when the source holds `most`.
    fn begin_large(&self, most: usize) -> bool {
        let mut book = lock(&self.book);
        let n = book.large.entry(self.source).or_insert(0);
        if *n >= most {
            return false;
        }
        *n += 1;
        self.large.store(true, Ordering::Relaxed);
        true
    }

    /// Gives its large-answer place back (if it holds one): before the connection is closed,
    /// so a client that asks again once it has read the answer finds it free.
    fn end_large(&self) {
        if self.large.swap(false, Ordering::Relaxed) {
            let mut book = lock(&self.book);
            if let Some(n) = book.large.get_mut(&self.source) {
                *n -= 1;
                if *n == 0 {
                    book.large.remove(&self.source);
                }
            }
        }
    }

    /// Its request head arrived: no longer one a new connection may push out.
    fn head_read(&self) {
        lock(&self.book).waiting.remove(&self.id);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.end_large();
        lock(&self.book).release(self.id, self.source);
    }
}

fn lock(book: &Mutex<Book>) -> std::sync::MutexGuard<'_, Book> {
    book.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves until the listener fails, within [`Limits::sized_to_open_files`].
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    health: Health,
    status: Option<StatusFn>,
) {
    let limits = Limits::sized_to_open_files();
    tracing::debug!(?limits, "metrics listener bounds");
    serve_within(listener, registry, health, status, limits).await;
}

/// Serves until the listener fails, within `limits`.
pub async fn serve_within(
    listener: TcpListener,
    registry: Arc<Registry>,
    health: Health,
    status: Option<StatusFn>,
    limits: Limits,
) {
    let book: Arc<Mutex<Book>> = Arc::default();
    let large = Arc::new(Semaphore::new(limits.large_answers.max(1)));
    let mut refusals = Refusals::default();
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let source = canonical(peer.ip());
                let admitted = lock(&book).admit(source, &limits);
                let (id, evicted) = match admitted {
                    Ok(v) => v,
                    Err(why) => {
                        let per_source = matches!(why, Refused::PerSource);
                        refusals.count(per_source, &limits);
                        // Never waits: a full socket buffer just gets the close.
                        let _ = stream.try_write(if per_source {
                            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 39\r\nconnection: close\r\n\r\ntoo many connections from your address\n"
                        } else {
                            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 21\r\nconnection: close\r\n\r\ntoo many connections\n"
                        });
                        continue;
                    }
                };
                let slot = Slot {
                    id,
                    source,
                    book: book.clone(),
                    large: AtomicBool::new(false),
                };
                let (registry, health, status, large) = (
                    registry.clone(),
                    health.clone(),
                    status.clone(),
                    large.clone(),
                );
                tokio::spawn(async move {
                    // Pushed out (a sender dropped once the head is read is no push).
                    let pushed_out = async {
                        if evicted.await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    };
                    tokio::select! {
                        _ = tokio::time::timeout(
                            limits.deadline,
                            handle(stream, &slot, &registry, &health, status.as_ref(), &large, &limits),
                        ) => {}
                        () = pushed_out => {}
                    }
                    drop(slot);
                });
            }
            Err(e) => {
                // Out of descriptors, most likely: wait for some to close.
                tracing::warn!(error = %e, "metrics listener accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// An IPv4-mapped IPv6 source counts as its IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// How long [`bind_patiently`] retries an address in use.
pub const BIND_PATIENCE: Duration = Duration::from_secs(120);

/// `bind()` again every second while it fails with "address in use", at most
/// [`BIND_PATIENCE`]: the node's previous agent holds the port until it exits when it could
/// not hand its sockets over (a version before the handover, which shared the port by
/// `SO_REUSEPORT`; or one that did not answer at the handover path). A DaemonSet rolling
/// with maxSurge makes it exit once this one's pod is ready (its readiness probe reaches the
/// old agent on the port).
pub async fn bind_patiently<T>(
    what: &str,
    addr: SocketAddr,
    mut bind: impl FnMut() -> std::io::Result<T>,
) -> std::io::Result<T> {
    let t0 = std::time::Instant::now();
    let mut warned = false;
    loop {
        match bind() {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && t0.elapsed() < BIND_PATIENCE => {
                if !warned {
                    tracing::warn!(%addr, what, error = %e, "address in use (by the node's previous agent, which did not hand it over? or by another process); trying again every second for up to {} s", BIND_PATIENCE.as_secs());
                    warned = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(v) => {
                if warned {
                    tracing::info!(%addr, what, waited_s = t0.elapsed().as_secs(), "bound after waiting");
                }
                return Ok(v);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Binds `addr` (`SO_REUSEADDR`, never `SO_REUSEPORT`: no other process may share it;
/// [`bind_patiently`]) and serves in a background task; returns the bound address.
pub async fn spawn(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: Health,
) -> std::io::Result<SocketAddr> {
    spawn_with_status(addr, registry, health, None, &Sockets::default()).await
}

/// [`spawn`], also answering `/status` with `status`; the listener is the one `sockets`
/// inherited from the node's running agent, if any.
pub async fn spawn_with_status(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: Health,
    status: Option<StatusFn>,
    sockets: &Sockets,
) -> std::io::Result<SocketAddr> {
    let listener = bind_patiently("metrics", addr, || {
        TcpListener::from_std(sockets.tcp_listener(addr, 1024)?)
    })
    .await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener, registry, health, status));
    Ok(local)
}

/// The parameters of a query string (`a=1&b=x%2Fy`), percent-decoded; `+` is a space.
pub fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    fn hex(c: u8) -> Option<u8> {
        (c as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let decoded = match b[i] {
            b'%' if i + 2 < b.len() => hex(b[i + 1]).zip(hex(b[i + 2])).map(|(h, l)| h * 16 + l),
            _ => None,
        };
        match (decoded, b[i]) {
            (Some(v), _) => {
                out.push(v);
                i += 3;
                continue;
            }
            (None, b'+') => out.push(b' '),
            (None, c) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(
    mut stream: TcpStream,
    slot: &Slot,
    registry: &Registry,
    health: &Health,
    status_fn: Option<&StatusFn>,
    large: &Semaphore,
    limits: &Limits,
) -> std::io::Result<()> {
    let mut buf = [0u8; HEAD_MAX];
    let mut n = 0;
    // Read until the end of the request head (or the buffer is full), within its deadline.
    let head = tokio::time::timeout(limits.head_deadline, async {
        while n < buf.len() {
            let r = stream.read(&mut buf[n..]).await?;
            if r == 0 {
                break;
            }
            // Only the new bytes (and the 3 before them) can complete the blank line.
            let from = n.saturating_sub(3);
            n += r;
            if buf[from..n].windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    match head {
        Ok(r) => {
            r?;
            slot.head_read();
        }
        Err(_) => {
            return write_answer(
                &mut stream,
                "408 Request Timeout",
                "text/plain",
                "the request head did not arrive in time\n",
            )
            .await;
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let mut parts = head.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let is_large = matches!(
        (method, path, status_fn.is_some()),
        ("GET", "/metrics", _) | ("GET", "/status", true)
    );
    // A large answer waits for nobody: with every place taken (or its source's), 503 at once.
    if is_large && !slot.begin_large(limits.large_answers_per_source) {
        return write_answer(
            &mut stream,
            "503 Service Unavailable",
            "text/plain",
            "busy: your address has a /status or /metrics answer in progress; try again\n",
        )
        .await;
    }
    let _permit = match is_large.then(|| large.try_acquire()) {
        Some(Err(_)) => {
            return write_answer(
                &mut stream,
                "503 Service Unavailable",
                "text/plain",
                "busy: too many /status and /metrics answers in progress; try again\n",
            )
            .await;
        }
        Some(Ok(p)) => Some(p),
        None => None,
    };
    let (status, ctype, body) = match (method, path) {
        ("GET", "/status") if status_fn.is_some() => {
            let f = status_fn.expect("checked");
            ("200 OK", "application/json", f(query_pairs(query)).await)
        }
        ("GET", "/metrics") => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, registry) {
                Ok(()) => (
                    "200 OK",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => ("500 Internal Server Error", "text/plain", format!("{e}\n")),
            }
        }
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", "/readyz") if health.is_ready() => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", "/readyz") => (
            "503 Service Unavailable",
            "text/plain",
            "not ready: the first full table is not programmed yet\n".into(),
        ),
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            if status_fn.is_some() {
                "try /metrics, /healthz, /readyz, /status\n".into()
            } else {
                "try /metrics, /healthz, /readyz\n".into()
            },
        ),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    write_head_and_body(&mut stream, status, ctype, &body).await?;
    // The places are given back before the close the client waits for.
    drop(body);
    drop(_permit);
    slot.end_large();
    stream.shutdown().await
}

/// Writes the head, then the body as it is (no copy of it), and closes.
async fn write_answer(
    stream: &mut TcpStream,
    status: &str,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    write_head_and_body(stream, status, ctype, body).await?;
    stream.shutdown().await
}

async fn write_head_and_body(
    stream: &mut TcpStream,
    status: &str,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::{Book, Limits, Refused, query_pairs};

    #[test]
    fn a_full_book_pushes_out_the_oldest_idle_connection_and_each_source_keeps_to_its_share() {
        let limits = Limits {
            connections: 3,
            per_source: 2,
            ..Limits::default()
        };
        let (a, b, c) = (
            "198.18.0.1".parse().unwrap(),
            "198.18.0.2".parse().unwrap(),
            "198.18.0.3".parse().unwrap(),
        );
        let mut book = Book::default();
        let (a1, mut a1_out) = book.admit(a, &limits).ok().unwrap();
        let (_a2, _a2_out) = book.admit(a, &limits).ok().unwrap();
        assert!(matches!(book.admit(a, &limits), Err(Refused::PerSource)));
        let (b1, mut b1_out) = book.admit(b, &limits).ok().unwrap();
        // b1 sent its request: it is no longer one to push out.
        book.waiting.remove(&b1);
        // Full: c takes the place of the oldest idle one, a1.
        let (_c1, _c1_out) = book.admit(c, &limits).ok().unwrap();
        assert_eq!(a1_out.try_recv(), Ok(()), "a1 is told to close");
        assert!(b1_out.try_recv().is_err(), "b1 is not");
        // a1's task ends and gives its place back.
        book.release(a1, a);
        assert_eq!((book.open, book.per_source[&a]), (3, 1));
        // Every place busy with a request: refused at once.
        let mut busy = Book::default();
        for ip in [a, b, c] {
            let (id, _) = busy.admit(ip, &limits).ok().unwrap();
            busy.waiting.remove(&id);
        }
        assert!(matches!(busy.admit(a, &limits), Err(Refused::Full)));
    }

    #[test]
    fn query_strings_are_decoded() {
        assert_eq!(
            query_pairs("service=shop%2Fweb&x=a+b&flag&bad=%zz%2"),
            vec![
                ("service".into(), "shop/web".into()),
                ("x".into(), "a b".into()),
                ("flag".into(), String::new()),
                ("bad".into(), "%zz%2".into()),
            ]
        );
        assert!(query_pairs("").is_empty());
        assert_eq!(query_pairs("k=%C3%A9"), vec![("k".into(), "é".into())]);
    }
}
