//! TCP: accept intercepted connections (TPROXY keeps the original destination as the local
//! address), pick a backend with Maglev, connect with a timeout and retry others on failure,
//! then relay both ways: small messages through a buffer (one recv and one send each; a short
//! read means the socket is drained, so no extra recv to learn it), and a direction that fills
//! the buffer — a bulk transfer — switches to `splice(2)` through a pipe (zero copy), unless
//! splice is off. Half-close is passed on; idle connections are closed; a connection whose
//! backend was removed keeps going up to the drain bound.

use std::{
    io,
    net::SocketAddr,
    os::fd::OwnedFd,
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use mcs_model::Protocol;
use nix::fcntl::{SpliceFFlags, splice};
use socket2::SockRef;
use tokio::{
    io::Interest,
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};

use super::{Shared, routes::normalize};

/// Bytes moved per splice call.
const SPLICE_CHUNK_BYTES: usize = 1 << 16;
/// Size of the copy buffer of each direction; a read that fills it switches to splice.
const COPY_BUF_BYTES: usize = 16 << 10;
/// Pause after an accept error (e.g. out of file descriptors), doubling up to a second.
const ACCEPT_BACKOFF_START_MS: u64 = 5;

/// Buckets of [`ClientCounts`].
const CLIENT_BUCKETS: usize = 16_384;

/// Open connections per client address, in buckets by hash: one atomic add on accept and one
/// subtract on close, no lock and no allocation per connection.
#[derive(Debug)]
pub struct ClientCounts {
    limit: u32,
    buckets: Box<[AtomicU32]>,
}

impl ClientCounts {
    /// At most `limit` open connections per client.
    pub fn new(limit: usize) -> Self {
        Self {
            limit: u32::try_from(limit.max(1)).unwrap_or(u32::MAX),
            buckets: (0..CLIENT_BUCKETS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Takes a slot for `client`, or `None` when it has `limit` open already.
    fn take(&self, client: SocketAddr) -> Option<ClientSlot<'_>> {
        let h = super::routes::flow_hash(client, true) as usize % CLIENT_BUCKETS;
        let b = &self.buckets[h];
        if b.fetch_add(1, Ordering::Relaxed) >= self.limit {
            b.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(ClientSlot(b))
    }
}

/// A client's slot, given back on drop.
struct ClientSlot<'a>(&'a AtomicU32);

impl Drop for ClientSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts until shutdown.
pub async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, cap: Arc<Semaphore>) {
    let mut shutdown = shared.shutdown.clone();
    let mut backoff = ACCEPT_BACKOFF_START_MS;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = super::stopped(&mut shutdown) => return,
        };
        let (stream, client) = match accepted {
            Ok(a) => {
                backoff = ACCEPT_BACKOFF_START_MS;
                a
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; backing off {backoff} ms");
                tokio::time::sleep(Duration::from_millis(backoff)).await;
                backoff = (backoff * 2).min(1000);
                continue;
            }
        };
        let Ok(dst) = stream.local_addr() else {
            continue;
        };
        let (client, dst) = (normalize(client), normalize(dst));
        let Ok(permit) = cap.clone().try_acquire_owned() else {
            // Over the cap: refuse cleanly with a reset; existing connections are untouched.
            if let Some(route) = shared.routes.load().get(dst, Protocol::Tcp) {
                route.frontend_counters.refused.inc();
            }
            reset(&stream);
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let Some(slot) = shared.per_client.take(client) else {
                // This client has its share open already: refuse it alone.
                if let Some(route) = shared.routes.load().get(dst, Protocol::Tcp) {
                    route.frontend_counters.refused.inc();
                }
                reset(&stream);
                return;
            };
            shared.metrics.active_connections.inc();
            handle(stream, client, dst, &shared).await;
            shared.metrics.active_connections.dec();
            drop(slot);
            drop(permit);
        });
    }
}

/// Close with RST (SO_LINGER 0), so the client sees a refusal, not a hang.
fn reset(stream: &TcpStream) {
    let _ = SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

/// How long a connection accepted before the first table (a restarted agent's frontends stay
/// intercepted) waits for it.
const FIRST_TABLE_WAIT: Duration = Duration::from_secs(3);

async fn handle(client_stream: TcpStream, client: SocketAddr, dst: SocketAddr, shared: &Shared) {
    let mut route = shared.routes.load().get(dst, Protocol::Tcp).cloned();
    if route.is_none() {
        let mut generation = shared.routes.subscribe();
        if *generation.borrow_and_update() == 0 {
            // No table yet: wait for the first one (bounded), then look again.
            let _ = tokio::time::timeout(FIRST_TABLE_WAIT, generation.changed()).await;
            route = shared.routes.load().get(dst, Protocol::Tcp).cloned();
        }
    }
    let Some(route) = route else {
        tracing::debug!(%dst, "no route (frontend removed?)");
        reset(&client_stream);
        return;
    };
    let attempts = shared.config.connect_attempts.min(route.backends.len());
    if attempts == 0 {
        route.frontend_counters.refused.inc();
        reset(&client_stream);
        return;
    }
    let mut upstream = None;
    for attempt in 0..attempts {
        let Some((i, backend)) = route.pick(client, attempt) else {
            break;
        };
        if attempt > 0 {
            route.frontend_counters.retries.inc();
        }
        match tokio::time::timeout(shared.config.connect_timeout, TcpStream::connect(backend)).await
        {
            Ok(Ok(s)) => {
                upstream = Some((i, backend, s));
                break;
            }
            Ok(Err(e)) => {
                route.counters[i].connect_failures.inc();
                tracing::debug!(%backend, error = %e, "connect failed");
            }
            Err(_) => {
                route.counters[i].connect_failures.inc();
                tracing::debug!(%backend, "connect timed out");
            }
        }
    }
    let Some((i, backend, up)) = upstream else {
        route.frontend_counters.refused.inc();
        tracing::info!(frontend = %route.frontend, %client, "no backend accepted the connection");
        reset(&client_stream);
        return;
    };
    let counters = &route.counters[i];
    counters.connections.inc();
    let _ = client_stream.set_nodelay(true);
    let _ = up.set_nodelay(true);

    let mut generation = shared.routes.subscribe();
    let mut shutdown = shared.shutdown.clone();
    let relay = relay(
        &client_stream,
        &up,
        counters,
        shared.config.idle_timeout,
        shared.config.splice,
    );
    tokio::pin!(relay);
    let mut drain_at: Option<tokio::time::Instant> = None;
    loop {
        let drain_sleep = async {
            match drain_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut relay => {
                if let Err(e) = r {
                    tracing::debug!(%client, %backend, error = %e, "connection ended with an error");
                    if e.kind() != io::ErrorKind::TimedOut {
                        // A reset or error on one side aborts the other with a reset, never a
                        // FIN: a cut stream must not look complete.
                        reset(&client_stream);
                        reset(&up);
                    }
                }
                return;
            }
            changed = generation.changed() => {
                if changed.is_err() { return; }
                let still = shared.routes.load().get(dst, Protocol::Tcp).is_some_and(|r| r.has_backend(backend));
                drain_at = if still { None } else {
                    drain_at.or(Some(tokio::time::Instant::now() + shared.config.drain_timeout))
                };
            }
            () = drain_sleep => {
                shared.metrics.drained.inc();
                tracing::debug!(%client, %backend, "backend removed; drain bound reached, closing");
                // Cut mid-stream: both sides learn it from a reset.
                reset(&client_stream);
                reset(&up);
                return;
            }
            () = super::stopped(&mut shutdown), if drain_at.is_none() => {
                // Graceful shutdown: let the connection finish within the drain bound.
                drain_at = Some(tokio::time::Instant::now() + shared.config.drain_timeout);
            }
        }
    }
}

/// Relays both ways until both sides closed, an error, or idleness.
async fn relay(
    a: &TcpStream,
    b: &TcpStream,
    counters: &super::metrics::BackendCounters,
    idle: Duration,
    use_splice: bool,
) -> io::Result<()> {
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let touch = || last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    let idle_watch = async {
        loop {
            let since = Duration::from_millis(last.load(Ordering::Relaxed));
            let deadline = start + since + idle;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.into()).await;
        }
    };
    let copy = async {
        tokio::try_join!(
            pump(a, b, use_splice, &counters.bytes_tx, &touch),
            pump(b, a, use_splice, &counters.bytes_rx, &touch),
        )
        .map(|_| ())
    };
    tokio::select! {
        r = copy => r,
        () = idle_watch => Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout")),
    }
}

type Pipe = (OwnedFd, OwnedFd);

/// Empty pipes and copy buffers kept per worker thread (each worker is a single-threaded
/// runtime, so its connections never migrate): a new connection reuses them instead of
/// creating them (no pipe2(2)/close(2) or allocation per connection).
const POOL_MAX: usize = 512;

thread_local! {
    static PIPE_POOL: std::cell::RefCell<Vec<Pipe>> = const { std::cell::RefCell::new(Vec::new()) };
    static BUF_POOL: std::cell::RefCell<Vec<Box<[u8]>>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn take_pipe() -> Option<Pipe> {
    PIPE_POOL.with(|p| p.borrow_mut().pop()).or_else(|| {
        let flags = nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC;
        nix::unistd::pipe2(flags).ok()
    })
}

/// Returns an empty pipe to this thread's pool (or closes it when the pool is full).
fn give_back_pipe(p: Pipe) {
    PIPE_POOL.with(|pool| {
        let mut v = pool.borrow_mut();
        if v.len() < POOL_MAX {
            v.push(p);
        }
    });
}

/// A copy buffer from this thread's pool, returned to it on drop.
struct PooledBuf(Option<Box<[u8]>>);

impl PooledBuf {
    fn take() -> Self {
        let buf = BUF_POOL
            .with(|p| p.borrow_mut().pop())
            .unwrap_or_else(|| vec![0u8; COPY_BUF_BYTES].into_boxed_slice());
        Self(Some(buf))
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.as_deref_mut().unwrap_or_default()
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.0.take() {
            BUF_POOL.with(|pool| {
                let mut v = pool.borrow_mut();
                if v.len() < POOL_MAX {
                    v.push(buf);
                }
            });
        }
    }
}

/// One direction until EOF (passed on as a half-close) or an error. Copies through a buffer
/// while messages are small; once a read fills the buffer, continues with splice if allowed
/// and a pipe is available.
async fn pump(
    src: &TcpStream,
    dst: &TcpStream,
    use_splice: bool,
    bytes: &prometheus_client::metrics::counter::Counter,
    touch: &impl Fn(),
) -> io::Result<()> {
    let mut buf = PooledBuf::take();
    loop {
        let read = read_or_eof(src, dst, || {
            nix::unistd::read(src, &mut buf).map_err(io::Error::from)
        });
        let Some(n) = read.await? else {
            return Ok(());
        };
        if n < buf.len() {
            // A short read drained the socket: forget its readiness now rather than learn
            // it from one more recv returning EAGAIN. Safe: data that arrives later raises
            // a new edge, and a pending EOF keeps the socket readable (closed states are
            // never cleared).
            let _ = src.try_io(Interest::READABLE, || {
                Err::<(), _>(io::Error::from(io::ErrorKind::WouldBlock))
            });
        }
        write_all(dst, &buf[..n]).await?;
        bytes.inc_by(n as u64);
        touch();
        if n == buf.len()
            && use_splice
            && let Some(pipe) = take_pipe()
        {
            drop(buf);
            splice_dir(src, dst, &pipe.0, &pipe.1, bytes, touch).await?;
            // Ended at EOF with every spliced byte written: the pipe is empty.
            give_back_pipe(pipe);
            return Ok(());
        }
    }
}

/// Waits until `src` is readable and runs `op` (a read from it); readiness that turns out
/// stale is waited for again. At EOF passes the half-close on to `dst` and returns `None`.
async fn read_or_eof(
    src: &TcpStream,
    dst: &TcpStream,
    mut op: impl FnMut() -> io::Result<usize>,
) -> io::Result<Option<usize>> {
    loop {
        src.readable().await?;
        match src.try_io(Interest::READABLE, &mut op) {
            Ok(0) => {
                let _ = SockRef::from(dst).shutdown(std::net::Shutdown::Write);
                return Ok(None);
            }
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        dst.writable().await?;
        match dst.try_write(data) {
            Ok(m) => data = &data[m..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One direction through a pipe: socket → pipe → socket, never through userspace memory.
async fn splice_dir(
    src: &TcpStream,
    dst: &TcpStream,
    pipe_r: &OwnedFd,
    pipe_w: &OwnedFd,
    bytes: &prometheus_client::metrics::counter::Counter,
    touch: &impl Fn(),
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        let read = read_or_eof(src, dst, || {
            splice(src, None, pipe_w, None, SPLICE_CHUNK_BYTES, flags).map_err(io::Error::from)
        });
        let Some(n) = read.await? else {
            return Ok(());
        };
        let mut left = n;
        while left > 0 {
            dst.writable().await?;
            match dst.try_io(Interest::WRITABLE, || {
                splice(pipe_r, None, dst, None, left, flags).map_err(io::Error::from)
            }) {
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        bytes.inc_by(n as u64);
        touch();
    }
}
