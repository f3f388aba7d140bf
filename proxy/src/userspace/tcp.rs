//! TCP: accept intercepted connections (TPROXY keeps the original destination as the local
//! address), pick a backend with Maglev, connect with a timeout and retry others on failure,
//! then relay both ways: small messages through a buffer (one recv and one send each; a short
//! read means the socket is drained, so no extra recv to learn it), and a direction that fills
//! the buffer — a bulk transfer — switches to `splice(2)` through a pipe (zero copy), unless
//! splice is off. Half-close is passed on; idle connections are closed; a connection whose
//! backend was removed keeps going up to the drain bound.
//!
//! Per connection the path does as little as the kernel lets it (measured in issue 16):
//! - `TCP_NODELAY` is set once on the listener; accepted sockets inherit it.
//! - The backend connect is judged by its first readiness: an error or hang-up means it
//!   failed (only then is `SO_ERROR` read, for the message), so a good connect costs no
//!   `getsockopt`.
//! - When the peer's FIN came with its last data (the readiness says read-closed), the data
//!   is sent corked (`MSG_MORE`) and the FIN follows at once, so both leave in one segment and
//!   the other side answers both with one ACK: two packets fewer per short connection.
//! - The direction that ends second leaves its FIN to `close(2)`, which follows at once,
//!   instead of a `shutdown(2)` first.
//! - Bulk transfers splice through pipes grown to the system's `pipe-max-size` (at most
//!   1 MiB), in chunks of the pipe's size, and shrunk again before they go back to the pool.

use std::{
    io,
    net::SocketAddr,
    os::fd::OwnedFd,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use mcs_model::Protocol;
use nix::fcntl::{SpliceFFlags, splice};
use socket2::{Domain, SockRef, Socket, Type};
use tokio::{
    io::Interest,
    net::{TcpListener, TcpStream},
    sync::{Semaphore, watch},
};

use super::{Shared, routes::normalize};

/// Most a bulk pipe is grown to (bounded further by `/proc/sys/fs/pipe-max-size`).
const BULK_PIPE_MAX_BYTES: usize = 1 << 20;
/// A pipe's size when it is not in use (the kernel's default), so pooled pipes do not hold
/// the user's pipe-page quota.
const IDLE_PIPE_BYTES: usize = 1 << 16;
/// Size of the copy buffer of each direction; a read that fills it switches to splice.
pub(super) const COPY_BUF_BYTES: usize = 16 << 10;
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
    pub(super) fn take(&self, client: SocketAddr) -> Option<ClientSlot<'_>> {
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
pub(super) struct ClientSlot<'a>(&'a AtomicU32);

impl Drop for ClientSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a worker's connections watch: the route generation and whether the forwarder is
/// stopping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signal {
    /// Bumped by every route swap.
    pub generation: u64,
    /// Shutdown began.
    pub stopping: bool,
}

/// One worker thread's copy of the shared route generation and shutdown flag. A single task
/// per worker watches the shared channels and republishes into this one, so a connection's
/// wake-ups only ever touch its own thread's channel (no lock shared across cores on every
/// wake-up).
#[derive(Clone, Debug)]
pub struct WorkerSignals(watch::Receiver<Signal>);

impl WorkerSignals {
    /// Starts this worker's watcher task (on the current runtime).
    pub fn start(shared: &Shared) -> Self {
        let mut generation = shared.routes.subscribe();
        let mut shutdown = shared.shutdown.clone();
        let first = Signal {
            generation: *generation.borrow_and_update(),
            stopping: *shutdown.borrow_and_update(),
        };
        let (tx, rx) = watch::channel(first);
        // It lives as long as a connection of this worker does (they drain after shutdown and
        // still need route changes), ending when the last receiver is gone.
        tokio::spawn(async move {
            let mut stopping = first.stopping;
            loop {
                tokio::select! {
                    changed = generation.changed() => {
                        if changed.is_err() { return; }
                        let g = *generation.borrow_and_update();
                        tx.send_modify(|s| s.generation = g);
                    }
                    changed = shutdown.changed(), if !stopping => {
                        stopping = changed.is_err() || *shutdown.borrow_and_update();
                        if stopping {
                            tx.send_modify(|s| s.stopping = true);
                        }
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Self(rx)
    }
}

/// Accepts until shutdown.
pub async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    cap: Arc<Semaphore>,
    signals: WorkerSignals,
) {
    let mut stop = signals.0.clone();
    let mut backoff = ACCEPT_BACKOFF_START_MS;
    loop {
        let accepted = tokio::select! {
            biased;
            r = listener.accept() => r,
            _ = stop.wait_for(|s| s.stopping) => return,
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
        let signals = signals.0.clone();
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
            handle(stream, client, dst, &shared, signals).await;
            shared.metrics.active_connections.dec();
            drop(slot);
            drop(permit);
        });
    }
}

/// Close with RST (SO_LINGER 0), so the client sees a refusal, not a hang.
pub(super) fn reset(socket: &impl std::os::fd::AsFd) {
    let _ = SockRef::from(socket).set_linger(Some(Duration::ZERO));
}

/// How long a connection accepted before the first table (a restarted agent's frontends stay
/// intercepted) waits for it.
pub(super) const FIRST_TABLE_WAIT: Duration = Duration::from_secs(3);

async fn handle(
    client_stream: TcpStream,
    client: SocketAddr,
    dst: SocketAddr,
    shared: &Shared,
    mut signals: watch::Receiver<Signal>,
) {
    let mut route = shared.routes.load().get(dst, Protocol::Tcp).cloned();
    if route.is_none() && signals.borrow().generation == 0 {
        // No table yet: wait for the first one (bounded), then look again.
        let first = signals.wait_for(|s| s.generation != 0);
        let _ = tokio::time::timeout(FIRST_TABLE_WAIT, first).await;
        route = shared.routes.load().get(dst, Protocol::Tcp).cloned();
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
        match tokio::time::timeout(shared.config.connect_timeout, connect(backend)).await {
            Ok(Ok(s)) => {
                upstream = Some((i, backend, s));
                break;
            }
            Ok(Err(e)) => {
                route.backends.cells(i).connect_failures.inc();
                tracing::debug!(%backend, error = %e, "connect failed");
            }
            Err(_) => {
                route.backends.cells(i).connect_failures.inc();
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
    let counters = route.backends.cells(i);
    counters.connections.inc();

    let mut seen = *signals.borrow_and_update();
    let relay = relay(
        &client_stream,
        &up,
        counters,
        shared.config.idle_timeout,
        shared.config.splice,
    );
    tokio::pin!(relay);
    let mut drain_at: Option<tokio::time::Instant> = None;
    if seen.stopping {
        drain_at = Some(tokio::time::Instant::now() + shared.config.drain_timeout);
    }
    loop {
        let drain_sleep = async {
            match drain_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        // Biased: a wake-up is nearly always the relay's; the others are only looked at after.
        tokio::select! {
            biased;
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
            changed = signals.changed() => {
                if changed.is_err() { return; }
                let now = *signals.borrow_and_update();
                if now.generation != seen.generation {
                    let still = shared.routes.load().get(dst, Protocol::Tcp).is_some_and(|r| r.has_backend(backend));
                    drain_at = if still { None } else {
                        drain_at.or(Some(tokio::time::Instant::now() + shared.config.drain_timeout))
                    };
                }
                if now.stopping {
                    // Graceful shutdown: let the connection finish within the drain bound.
                    drain_at = drain_at.or(Some(tokio::time::Instant::now() + shared.config.drain_timeout));
                }
                seen = now;
            }
            () = drain_sleep => {
                shared.metrics.drained.inc();
                tracing::debug!(%client, %backend, "backend removed; drain bound reached, closing");
                // Cut mid-stream: both sides learn it from a reset.
                reset(&client_stream);
                reset(&up);
                return;
            }
        }
    }
}

/// Connects to `backend` with `TCP_NODELAY` set. A connect that fails shows as an error or
/// hang-up in its first readiness (the kernel reports `EPOLLERR | EPOLLHUP` with `EPOLLOUT`);
/// only then is `SO_ERROR` read, for the reason.
async fn connect(backend: SocketAddr) -> io::Result<TcpStream> {
    let s = Socket::new(
        Domain::for_address(backend),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    s.set_tcp_nodelay(true)?;
    match s.connect(&backend.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(nix::libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(s))?;
    let ready = stream.ready(Interest::WRITABLE | Interest::ERROR).await?;
    if ready.is_error() || ready.is_write_closed() {
        return Err(stream.take_error()?.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionRefused, "connect failed")
        }));
    }
    Ok(stream)
}

/// Which directions of a connection reached EOF: the one that ends second does not shut its
/// destination down, because both sockets are closed as soon as it returns and `close(2)`
/// sends the FIN (nothing is left unread on it: its own direction ended first).
struct Ends([AtomicBool; 2]);

impl Ends {
    /// Direction `me` reached EOF: passes the half-close on to `dst` unless the other
    /// direction ended already.
    fn finish(&self, me: usize, dst: &TcpStream) {
        self.0[me].store(true, Ordering::Relaxed);
        if !self.0[1 - me].load(Ordering::Relaxed) {
            let _ = SockRef::from(dst).shutdown(std::net::Shutdown::Write);
        }
    }
}

/// Relays both ways until both sides closed, an error, or idleness.
async fn relay(
    a: &TcpStream,
    b: &TcpStream,
    counters: &super::metrics::BackendCells,
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
    let ends = Ends([AtomicBool::new(false), AtomicBool::new(false)]);
    let copy = async {
        tokio::try_join!(
            pump(a, b, 0, &ends, use_splice, &counters.bytes_tx, &touch),
            pump(b, a, 1, &ends, use_splice, &counters.bytes_rx, &touch),
        )
        .map(|_| ())
    };
    tokio::select! {
        r = copy => r,
        () = idle_watch => Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout")),
    }
}

/// A pipe for splicing: read end, write end, and its size now.
pub(super) struct Pipe {
    pub(super) r: OwnedFd,
    pub(super) w: OwnedFd,
    pub(super) size: usize,
}

/// Empty pipes and copy buffers kept per worker thread (each worker is a single-threaded
/// runtime, so its connections never migrate): a new connection reuses them instead of
/// creating them (no pipe2(2)/close(2) or allocation per connection).
const POOL_MAX: usize = 512;

thread_local! {
    static PIPE_POOL: std::cell::RefCell<Vec<Pipe>> = const { std::cell::RefCell::new(Vec::new()) };
    static BUF_POOL: std::cell::RefCell<Vec<Box<[u8]>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The size bulk pipes are grown to: the system's `pipe-max-size`, at most 1 MiB.
fn bulk_pipe_bytes() -> usize {
    static SIZE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SIZE.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
            .ok()
            .and_then(|t| t.trim().parse::<usize>().ok())
            .unwrap_or(IDLE_PIPE_BYTES)
            .clamp(IDLE_PIPE_BYTES, BULK_PIPE_MAX_BYTES)
    })
}

/// Sets the pipe's size (the kernel rounds it up to pages); returns the size it has now.
fn resize_pipe(p: &mut Pipe, bytes: usize) {
    let arg = nix::fcntl::FcntlArg::F_SETPIPE_SZ(i32::try_from(bytes).unwrap_or(i32::MAX));
    match nix::fcntl::fcntl(&p.w, arg) {
        Ok(size) => p.size = usize::try_from(size).unwrap_or(p.size),
        // Over the user's pipe-page quota (pipe-user-pages-soft) without CAP_SYS_RESOURCE:
        // the pipe keeps its size.
        Err(e) => tracing::debug!(error = %e, bytes, "resizing a splice pipe"),
    }
}

/// An empty pipe grown for bulk: from this thread's pool or new.
pub(super) fn take_pipe() -> Option<Pipe> {
    let mut p = PIPE_POOL.with(|p| p.borrow_mut().pop()).or_else(|| {
        let flags = nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC;
        let (r, w) = nix::unistd::pipe2(flags).ok()?;
        Some(Pipe {
            r,
            w,
            size: IDLE_PIPE_BYTES,
        })
    })?;
    let want = bulk_pipe_bytes();
    if p.size < want {
        resize_pipe(&mut p, want);
    }
    Some(p)
}

/// Returns an empty pipe, shrunk to the default size, to this thread's pool (or closes it when
/// the pool is full).
pub(super) fn give_back_pipe(mut p: Pipe) {
    if p.size > IDLE_PIPE_BYTES {
        resize_pipe(&mut p, IDLE_PIPE_BYTES);
    }
    PIPE_POOL.with(|pool| {
        let mut v = pool.borrow_mut();
        if v.len() < POOL_MAX {
            v.push(p);
        }
    });
}

/// A copy buffer from this thread's pool, returned to it on drop.
pub(super) struct PooledBuf(Option<Box<[u8]>>);

impl PooledBuf {
    pub(super) fn take() -> Self {
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
/// and a pipe is available. `me` is this direction's index in `ends`.
async fn pump(
    src: &TcpStream,
    dst: &TcpStream,
    me: usize,
    ends: &Ends,
    use_splice: bool,
    bytes: &super::metrics::Count,
    touch: &impl Fn(),
) -> io::Result<()> {
    let mut buf = PooledBuf::take();
    loop {
        let read = read_some(src, || {
            nix::unistd::read(src, &mut buf).map_err(io::Error::from)
        });
        let Got::Data { n, peer_closed } = read.await? else {
            ends.finish(me, dst);
            return Ok(());
        };
        // The peer's FIN arrived before this wake-up (read-closed without an error: not a
        // reset), and it follows all of the peer's data in the receive queue; a short read took
        // all of that, so this is the last data. Send it corked so that our FIN leaves in the
        // same segment, without one more read to learn the EOF.
        let eof = n < buf.len() && peer_closed;
        if n < buf.len() && !peer_closed {
            // A short read drained the socket: forget its readiness now rather than learn it
            // from one more recv returning EAGAIN. Safe: data that arrives later raises a new
            // edge, and a pending EOF keeps the socket readable (closed states are never
            // cleared).
            let _ = src.try_io(Interest::READABLE, || {
                Err::<(), _>(io::Error::from(io::ErrorKind::WouldBlock))
            });
        }
        write_all(dst, &buf[..n], eof).await?;
        bytes.inc_by(n as u64);
        touch();
        if eof {
            ends.finish(me, dst);
            return Ok(());
        }
        if n == buf.len()
            && use_splice
            && let Some(pipe) = take_pipe()
        {
            drop(buf);
            splice_dir(src, dst, me, ends, &pipe, bytes, touch).await?;
            // Ended at EOF with every spliced byte written: the pipe is empty.
            give_back_pipe(pipe);
            return Ok(());
        }
    }
}

/// What a read got.
enum Got {
    /// `n` bytes; `peer_closed`: the readiness it ran on said the peer had sent its FIN (read
    /// closed, no error: a reset also closes the read side, but sets the error first).
    Data { n: usize, peer_closed: bool },
    /// End of stream.
    Eof,
}

/// Waits until `src` is readable and runs `op` (a read from it); readiness that turns out
/// stale is waited for again.
async fn read_some(src: &TcpStream, mut op: impl FnMut() -> io::Result<usize>) -> io::Result<Got> {
    loop {
        let ready = src.ready(Interest::READABLE | Interest::ERROR).await?;
        // An error alone (no read readiness) is read as well, so that it is reported; trying
        // it under ERROR clears it if it was stale.
        let interest = if ready.is_readable() || ready.is_read_closed() {
            Interest::READABLE
        } else {
            Interest::ERROR
        };
        match src.try_io(interest, &mut op) {
            Ok(0) => return Ok(Got::Eof),
            Ok(n) => {
                return Ok(Got::Data {
                    n,
                    peer_closed: ready.is_read_closed() && !ready.is_error(),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Sends all of `data`; `more`: corked (`MSG_MORE`), because a FIN follows at once and should
/// leave in the same segment.
async fn write_all(dst: &TcpStream, mut data: &[u8], more: bool) -> io::Result<()> {
    // socket2 adds MSG_NOSIGNAL.
    let flags = if more { nix::libc::MSG_MORE } else { 0 };
    while !data.is_empty() {
        dst.writable().await?;
        match dst.try_io(Interest::WRITABLE, || {
            SockRef::from(dst).send_with_flags(data, flags)
        }) {
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
    me: usize,
    ends: &Ends,
    pipe: &Pipe,
    bytes: &super::metrics::Count,
    touch: &impl Fn(),
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        let read = read_some(src, || {
            splice(src, None, &pipe.w, None, pipe.size, flags).map_err(io::Error::from)
        });
        let Got::Data { n, .. } = read.await? else {
            ends.finish(me, dst);
            return Ok(());
        };
        let mut left = n;
        while left > 0 {
            dst.writable().await?;
            match dst.try_io(Interest::WRITABLE, || {
                splice(&pipe.r, None, dst, None, left, flags).map_err(io::Error::from)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The forwarder sets TCP_NODELAY only on its listeners: accepted sockets must inherit it.
    #[test]
    fn accepted_sockets_inherit_nodelay_from_the_listener() {
        let l = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        l.set_tcp_nodelay(true).unwrap();
        l.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        l.listen(1).unwrap();
        let addr = l.local_addr().unwrap().as_socket().unwrap();
        let _c = std::net::TcpStream::connect(addr).unwrap();
        let (accepted, _) = l.accept().unwrap();
        assert!(accepted.tcp_nodelay().unwrap());
    }

    /// A bulk pipe is grown when taken and shrunk to the default when given back.
    #[test]
    fn bulk_pipes_grow_when_taken_and_shrink_when_pooled() {
        let p = take_pipe().unwrap();
        let size = |p: &Pipe| nix::fcntl::fcntl(&p.w, nix::fcntl::FcntlArg::F_GETPIPE_SZ).unwrap();
        assert_eq!(p.size, bulk_pipe_bytes());
        assert_eq!(size(&p) as usize, p.size);
        give_back_pipe(p);
        let pooled = PIPE_POOL.with(|pool| pool.borrow_mut().pop()).unwrap();
        assert_eq!(pooled.size, IDLE_PIPE_BYTES);
        assert_eq!(size(&pooled) as usize, IDLE_PIPE_BYTES);
    }
}
