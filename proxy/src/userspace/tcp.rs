//! TCP: accept intercepted connections (on listeners bound to each frontend's ClusterSetIP
//! and port, so the local address names the frontend), pick a backend with Maglev, connect with a timeout and retry others on failure,
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
    collections::HashMap,
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
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

use super::{
    Shared,
    conn::{FIRST_TABLE_WAIT, Pipe, PooledBuf, give_back_pipe, reset, take_pipe},
    listen::{Feed, FeedRx},
    routes::normalize,
};

/// Pause after an accept error (e.g. out of file descriptors), doubling up to a second.
const ACCEPT_BACKOFF_START_MS: u64 = 5;

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

/// Accepts on each listener `feed` hands over, until it is taken back or shutdown; returns
/// once every listener is closed.
pub async fn accept_feed(
    feed: FeedRx,
    shared: Arc<Shared>,
    cap: Arc<Semaphore>,
    signals: WorkerSignals,
) {
    let mut stop = signals.0.clone();
    let mut accepting: HashMap<u64, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| s.stopping) => break,
            () = feed.sent() => {}
        }
        for f in feed.drain() {
            match f {
                Feed::Add(id, l) => match TcpListener::from_std(l) {
                    Ok(l) => {
                        let task = accept_loop(l, shared.clone(), cap.clone(), signals.clone());
                        accepting.insert(id, tokio::spawn(task));
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot accept on a frontend listener"),
                },
                Feed::Remove(id) => {
                    if let Some(t) = accepting.remove(&id) {
                        // Closes the listener; its accepted connections go on.
                        t.abort();
                    }
                }
            }
        }
    }
    // Each stops at shutdown by itself (closing its listener).
    for (_, t) in accepting {
        let _ = t.await;
    }
}

/// Accepts on one listener until shutdown. The listener is bound to its frontend's address,
/// which is each accepted connection's local address: read once here, not per connection.
async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    cap: Arc<Semaphore>,
    signals: WorkerSignals,
) {
    let Ok(dst) = listener.local_addr().map(normalize) else {
        return;
    };
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
        let client = normalize(client);
        let Ok(permit) = cap.clone().try_acquire_owned() else {
            // Over the cap: refuse cleanly with a reset; existing connections are untouched.
            if let Some(route) = shared.routes.load().get(dst, Protocol::Tcp) {
                route.frontend_counters.refused.inc();
            }
            reset(&stream);
            continue;
        };
        // Past three quarters of the cap, only clients holding few are taken.
        let scarce = shared.per_client.scarce(cap.available_permits());
        let shared = shared.clone();
        let signals = signals.0.clone();
        tokio::spawn(async move {
            let Some(slot) = shared.per_client.take(client, scarce) else {
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
    let tries = shared.config.connect_attempts;
    let attempts = route.attempts(tries);
    if attempts == 0 {
        route.frontend_counters.refused.inc();
        reset(&client_stream);
        return;
    }
    let mut upstream = None;
    let mut tried = super::routes::Tried::new();
    for attempt in 0..attempts {
        let Some((i, backend)) = route.pick(client, attempt, tries, &tried) else {
            break;
        };
        tried.push(i);
        if attempt > 0 {
            route.frontend_counters.retries.inc();
        }
        match tokio::time::timeout(shared.config.connect_timeout, connect(backend)).await {
            Ok(Ok(s)) => {
                route.backends.connected(i);
                if route.is_fallback(i) {
                    route.frontend_counters.fallbacks.inc();
                    tracing::debug!(frontend = %route.frontend, %client, %backend, "every selected backend refused or is skipped; a fallback backend took the connection");
                }
                upstream = Some((i, backend, s));
                break;
            }
            Ok(Err(e)) => {
                route.backends.cells(i).connect_failures.inc();
                // Only what the backend's side answered marks it; the node's own failures
                // (no descriptor, no ephemeral port, no buffer) say nothing about it.
                let skipped = super::backend_failed(e.raw_os_error())
                    && route.backends.connect_failed(i, route.selected());
                tracing::debug!(%backend, error = %e, skipped, "connect failed");
            }
            Err(_) => {
                route.backends.cells(i).connect_failures.inc();
                let skipped = route.backends.connect_failed(i, route.selected());
                tracing::debug!(%backend, skipped, "connect timed out");
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
}
