//! The io_uring TCP worker (`--tcp-engine auto|io-uring`; issue 16): the same job as [`super::tcp`]'s epoll
//! worker — accept, pick, connect with a timeout and retries, relay both ways, pass
//! half-closes and resets on, idle timeout, drain, caps — with its system calls batched into
//! one `io_uring_enter` per loop: a multishot accept per listener (one per frontend, handed
//! over through the worker's feed, whose eventfd a multishot poll watches), and per connection a connect linked to
//! its timeout and one receive and one send in flight per direction. One ring per worker
//! thread, `SINGLE_ISSUER | DEFER_TASKRUN` (no SQPOLL: the cores are shared with the
//! workload).
//!
//! What stays a plain system call: `getpeername` of an accepted connection (its local address
//! is its listener's, the frontend's, known from the accept's listener id),
//! the backend socket, and the bulk path: a direction that fills its buffer switches to
//! `splice(2)` through a pipe (as the epoll worker does), woken by io_uring polls; io_uring's
//! own splice would run in kernel worker threads.
//!
//! The backend's last data leaves with our FIN: a short receive from the backend is followed
//! by one non-blocking `recv` that finds the FIN if it came right behind (one system call per
//! response); then the data is sent corked (`MSG_MORE`) with the half-close linked behind it.
//! Besides two packets, this decides who keeps the TIME_WAIT: a client that sees data and FIN
//! together closes second. Without it, clients of short connections closed first and piled up
//! TIME_WAIT sockets until their `connect` spent its time searching for a free port (measured:
//! new connections fell from 11k to 0.9k/s).
//!
//! Unsafe: an SQE carries raw pointers (buffers, the backend address, timespecs) that the
//! kernel uses until the operation's completion arrives. Connections are boxed, their buffers
//! and address are neither touched nor freed while an operation on them is in flight
//! (`inflight` counts them; a connection is dropped only at zero), and the timespecs live in
//! the worker, which outlives the ring's use: that is what makes each `push` sound.
#![allow(unsafe_code)]

use std::{
    collections::HashMap,
    io,
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    sync::Arc,
    time::{Duration, Instant},
};

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use mcs_model::Protocol;
use nix::fcntl::{SpliceFFlags, splice};
use socket2::{Domain, SockAddr, SockRef, Socket, Type};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::{
    Shared,
    conn::{ClientSlot, FIRST_TABLE_WAIT, Pipe, PooledBuf, give_back_pipe, reset, take_pipe},
    listen::{Feed, FeedRx},
    routes::{Route, normalize},
};

/// Entries of each ring's submission queue (the completion queue has twice that; the kernel
/// keeps completions that overflow it rather than drop them).
const RING_ENTRIES: u32 = 4096;
/// How often the loop wakes with nothing to do: shutdown, route changes, drain and idle
/// bounds, connections waiting for the first table are looked at then.
const TICK: Duration = Duration::from_millis(100);
/// How often connections waiting for the first table look for it (the table arrives from
/// another thread, which does not wake the ring).
const WAITING_POLL: Duration = Duration::from_millis(5);
/// Rounds of splicing one direction does before it lets the others run.
const SPLICE_ROUNDS: usize = 16;

/// What an operation was, in the low byte of its `user_data`; the rest is the connection's
/// slot. Per-direction kinds come in pairs (direction 0: client → backend, 1: backend →
/// client).
mod op {
    pub const ACCEPT: u8 = 1;
    pub const TICK: u8 = 2;
    pub const CONNECT: u8 = 3;
    pub const CONNECT_TIMEOUT: u8 = 4;
    pub const RECV0: u8 = 5;
    pub const RECV1: u8 = 6;
    pub const SEND0: u8 = 7;
    pub const SEND1: u8 = 8;
    pub const CANCEL: u8 = 9;
    pub const CANCEL_ACCEPT: u8 = 10;
    /// A half-close linked behind the last data of a direction.
    pub const SHUT0: u8 = 11;
    pub const SHUT1: u8 = 12;
    /// A spliced direction's source is readable, or its destination writable.
    pub const SPLICE0: u8 = 13;
    pub const SPLICE1: u8 = 14;
    /// A short timeout while connections wait for the first table.
    pub const WAKE: u8 = 15;
    /// The listener feed's eventfd is readable.
    pub const FEED: u8 = 16;
}

fn ud(slot: usize, op: u8) -> u64 {
    ((slot as u64) << 8) | u64::from(op)
}

fn pick(d: usize, ops: [u8; 2]) -> u8 {
    ops[d & 1]
}

/// Creates this worker's ring, on the thread that will use it (`SINGLE_ISSUER`), or says why
/// not (`kernel.io_uring_disabled`, seccomp, an old kernel).
pub fn ring() -> io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .setup_cqsize(RING_ENTRIES * 2)
        .build(RING_ENTRIES)
}

/// How a connection ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Still relaying.
    Open,
    /// Both sides get a reset once the operations in flight are back (an error or reset on
    /// one side, the drain bound): a cut stream must not look complete.
    Reset,
    /// Closed without a reset (idle timeout), as the epoll worker does.
    Quiet,
}

/// A direction that moved to splice: its pipe and the bytes in it still to be written.
struct Spliced {
    pipe: Pipe,
    left: usize,
}

/// One connection; boxed so the buffers' and the address's places are stable.
struct Conn<'s> {
    client: OwnedFd,
    up: Option<OwnedFd>,
    client_addr: SocketAddr,
    dst: SocketAddr,
    route: Arc<Route>,
    /// The backend's index in the route, and its address.
    backend: (usize, SocketAddr),
    attempt: usize,
    /// The backends its attempts tried.
    tried: super::routes::Tried,
    /// The backend address of the connect in flight.
    sockaddr: SockAddr,
    /// From the thread's pool (the epoll worker's), given back on drop.
    bufs: [PooledBuf; 2],
    /// Bytes in `bufs[d]`, and how many of them are sent.
    pending: [(usize, usize); 2],
    ended: [bool; 2],
    /// The data being sent in direction `d` is its last.
    last: [bool; 2],
    /// The half-close linked behind direction `d`'s last data was cancelled (the send came
    /// back short): it is made when the rest is out.
    shut_pending: [bool; 2],
    spliced: [Option<Spliced>; 2],
    /// The backend reset the connection right behind the data being sent to the client: the
    /// reset follows once that data is out.
    reset_after: bool,
    inflight: u32,
    end: End,
    /// The worker's clock (seconds) at the last data moved.
    active_at: u64,
    /// The backend left the route: cut at this time unless it comes back.
    drain_at: Option<Instant>,
    _slot: ClientSlot<'s>,
    _permit: OwnedSemaphorePermit,
}

impl Conn<'_> {
    /// The socket data of direction `d` comes from.
    fn src(&self, d: usize) -> Option<BorrowedFd<'_>> {
        if d == 0 {
            Some(self.client.as_fd())
        } else {
            self.up.as_ref().map(AsFd::as_fd)
        }
    }

    /// The socket direction `d` writes to.
    fn dst(&self, d: usize) -> Option<BorrowedFd<'_>> {
        self.src(1 - d)
    }

    fn raw(fd: Option<BorrowedFd<'_>>) -> i32 {
        fd.map_or(-1, |f| f.as_raw_fd())
    }

    fn log_error(&self, e: impl std::fmt::Display) {
        tracing::debug!(client = %self.client_addr, backend = %self.backend.1, error = %e, "connection ended with an error");
    }
}

/// The worker's state.
struct Worker<'s> {
    ring: IoUring,
    shared: &'s Shared,
    cap: Arc<Semaphore>,
    conns: Vec<Option<Box<Conn<'s>>>>,
    free: Vec<usize>,
    /// Accepted before the first table (with its frontend): retried when it comes, or refused
    /// at the deadline.
    waiting: Vec<(OwnedFd, SocketAddr, Instant)>,
    generation: watch::Receiver<u64>,
    start: Instant,
    /// Seconds since `start`, updated every tick.
    now_s: u64,
    connect_timeout: types::Timespec,
    tick: types::Timespec,
    waiting_poll: types::Timespec,
    /// A `WAKE` timeout is in flight.
    wake_armed: bool,
    /// Some connection has a drain bound (its backend left the route).
    draining: bool,
    /// Where listeners come from.
    feed: FeedRx,
    /// The listeners accepted on, with their frontend's address, by id (the `user_data` slot
    /// of their accepts).
    listeners: HashMap<u64, (std::net::TcpListener, SocketAddr)>,
    /// Not yet shut down: listeners are accepted on.
    accepting: bool,
    /// Multishot accepts submitted and not yet ended (their last completion has no MORE
    /// flag). One cancelled at shutdown may still complete with connections the kernel
    /// accepted meanwhile: the worker serves them before it ends, or they would be closed
    /// unserved with the ring.
    armed_accepts: usize,
}

/// Runs a worker on the listeners `feed` hands over until shutdown and its connections are
/// done (or cut at the drain bound).
pub fn run(ring: IoUring, feed: FeedRx, shared: &Shared, cap: Arc<Semaphore>) {
    shared.metrics.io_uring_workers.inc();
    let mut w = Worker {
        ring,
        shared,
        cap,
        conns: Vec::new(),
        free: Vec::new(),
        waiting: Vec::new(),
        generation: shared.routes.subscribe(),
        start: Instant::now(),
        now_s: 0,
        connect_timeout: timespec(shared.config.connect_timeout),
        tick: timespec(TICK),
        waiting_poll: timespec(WAITING_POLL),
        wake_armed: false,
        draining: false,
        feed,
        listeners: HashMap::new(),
        accepting: true,
        armed_accepts: 0,
    };
    w.event_loop();
    shared.metrics.io_uring_workers.dec();
}

fn timespec(d: Duration) -> types::Timespec {
    types::Timespec::new()
        .sec(d.as_secs())
        .nsec(d.subsec_nanos())
}

/// `n` bytes went out in direction `d` to backend `backend` of `route`: counted.
fn count_moved(route: &Route, backend: usize, d: usize, n: usize) {
    let cells = route.backends.cells(backend);
    let count = if d == 0 {
        &cells.bytes_tx
    } else {
        &cells.bytes_rx
    };
    count.inc_by(n as u64);
}

fn os_error(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

/// Reads on from `n` bytes into `buf` until the FIN or a full buffer, without blocking;
/// returns the bytes now in `buf` and whether the FIN was reached, or the error (a reset)
/// that came behind them.
fn read_to_fin(fd: BorrowedFd<'_>, buf: &mut [u8], mut n: usize) -> (usize, io::Result<bool>) {
    use nix::sys::socket::{MsgFlags, recv};
    while n < buf.len() {
        match recv(fd.as_raw_fd(), &mut buf[n..], MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return (n, Ok(true)),
            Ok(m) => n += m,
            Err(nix::errno::Errno::EAGAIN) => return (n, Ok(false)),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return (n, Err(e.into())),
        }
    }
    (n, Ok(false))
}

fn half_close(fd: Option<BorrowedFd<'_>>) {
    if let Some(fd) = fd {
        let _ = nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Write);
    }
}

impl<'s> Worker<'s> {
    fn event_loop(&mut self) {
        self.push_feed_poll();
        self.on_feed();
        self.push_tick();
        let mut drain_until: Option<Instant> = None;
        let mut cqes: Vec<(u64, i32, u32)> = Vec::with_capacity(256);
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                Err(e) => {
                    // Not expected once the ring works; the connections of this worker end
                    // with it (their sockets close), the other workers go on.
                    tracing::error!(error = %e, "io_uring_enter failed; this TCP worker stops");
                    return;
                }
            }
            cqes.clear();
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            for &(data, res, flags) in &cqes {
                let slot = (data >> 8) as usize;
                match data as u8 {
                    op::ACCEPT => {
                        if res >= 0 {
                            // SAFETY: a successful accept completion carries a new descriptor
                            // that nothing else owns.
                            let fd = unsafe { OwnedFd::from_raw_fd(res) };
                            let dst = self.listeners.get(&(data >> 8)).map(|l| l.1);
                            self.accepted(fd, dst, true);
                        } else if res != -libc::ECANCELED {
                            tracing::warn!(error = %os_error(res), "accept failed");
                        }
                        let id = data >> 8;
                        if !cqueue::more(flags) {
                            self.armed_accepts = self.armed_accepts.saturating_sub(1);
                            if let Some(lfd) = self.listeners.get(&id).map(|l| l.0.as_raw_fd()) {
                                self.push_accept(id, lfd);
                            }
                        }
                    }
                    op::FEED => {
                        self.on_feed();
                        if !cqueue::more(flags) {
                            self.push_feed_poll();
                        }
                    }
                    op::TICK => {
                        if self.accepting && *self.shared.shutdown.borrow() {
                            // Stop accepting: the listeners close, so new connections are
                            // refused, not left waiting.
                            self.accepting = false;
                            let ids: Vec<u64> = self.listeners.keys().copied().collect();
                            for id in ids {
                                self.close_listener(id);
                            }
                            drain_until = Some(Instant::now() + self.shared.config.drain_timeout);
                        }
                        self.on_tick(drain_until);
                        // Done once every connection ended and every cancelled accept has
                        // completed (or the drain bound passed).
                        let accepts_done = self.armed_accepts == 0
                            || drain_until.is_some_and(|d| Instant::now() >= d);
                        if !self.accepting && accepts_done && self.conns.iter().all(Option::is_none)
                        {
                            for (fd, _, _) in self.waiting.drain(..) {
                                self.shared.metrics.active_connections.dec();
                                reset(&fd);
                            }
                            return;
                        }
                        self.push_tick();
                    }
                    op::CANCEL_ACCEPT => {}
                    op::WAKE => {
                        self.wake_armed = false;
                        self.retry_waiting(Instant::now());
                        self.arm_wake();
                    }
                    kind => self.completed(slot, kind, res),
                }
            }
        }
    }

    /// Queues an SQE, submitting first when the queue is full.
    fn push(&mut self, e: squeue::Entry) {
        loop {
            // SAFETY: see the module documentation: whatever the entry points to lives in a
            // boxed connection or in the worker until its completion is back.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                return;
            }
            if let Err(e) = self.ring.submit() {
                tracing::warn!(error = %e, "io_uring submit failed");
            }
        }
    }

    fn push_accept(&mut self, id: u64, lfd: i32) {
        self.armed_accepts += 1;
        self.push(
            opcode::AcceptMulti::new(types::Fd(lfd))
                .flags(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK)
                .build()
                .user_data((id << 8) | u64::from(op::ACCEPT)),
        );
    }

    fn push_feed_poll(&mut self) {
        let fd = self.feed.wake().as_raw_fd();
        self.push(
            opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
                .multi(true)
                .build()
                .user_data(ud(0, op::FEED)),
        );
    }

    /// Takes the listeners handed over or taken back.
    fn on_feed(&mut self) {
        for f in self.feed.drain() {
            match f {
                // After shutdown a new listener is closed at once.
                Feed::Add(id, l) if self.accepting => {
                    let Some(dst) = l.local_addr().ok().map(normalize) else {
                        continue;
                    };
                    let lfd = l.as_raw_fd();
                    self.listeners.insert(id, (l, dst));
                    self.push_accept(id, lfd);
                }
                Feed::Add(..) => {}
                Feed::Remove(id) => self.close_listener(id),
            }
        }
    }

    /// Cancels the accepts on listener `id` and closes it; connections waiting in its queue
    /// are reset by the kernel, accepted ones go on.
    fn close_listener(&mut self, id: u64) {
        let Some((l, _)) = self.listeners.remove(&id) else {
            return;
        };
        self.push(
            opcode::AsyncCancel2::new(types::CancelBuilder::fd(types::Fd(l.as_raw_fd())).all())
                .build()
                .user_data(ud(0, op::CANCEL_ACCEPT)),
        );
        // Submitted before the listener's descriptor closes, so its number cannot name a new
        // socket by then.
        if let Err(e) = self.ring.submit() {
            tracing::warn!(error = %e, "io_uring submit failed");
        }
        drop(l);
    }

    /// While connections wait for the first table, look for it every few milliseconds.
    fn arm_wake(&mut self) {
        if self.wake_armed || self.waiting.is_empty() {
            return;
        }
        self.wake_armed = true;
        let e = opcode::Timeout::new(&self.waiting_poll)
            .build()
            .user_data(ud(0, op::WAKE));
        self.push(e);
    }

    fn push_tick(&mut self) {
        let e = opcode::Timeout::new(&self.tick)
            .build()
            .user_data(ud(0, op::TICK));
        self.push(e);
    }

    /// Shutdown, route changes, the drain and idle bounds, the connections waiting for the
    /// first table.
    fn on_tick(&mut self, drain_until: Option<Instant>) {
        let now = Instant::now();
        let now_s = self.start.elapsed().as_secs();
        let idle_check = now_s != self.now_s;
        self.now_s = now_s;
        if self.generation.has_changed().unwrap_or(false) {
            self.generation.borrow_and_update();
            let routes = self.shared.routes.load();
            let drain = self.shared.config.drain_timeout;
            self.draining = false;
            for c in self.conns.iter_mut().flatten() {
                let still = routes
                    .get(c.dst, Protocol::Tcp)
                    .is_some_and(|r| r.has_backend(c.backend.1));
                c.drain_at = if still {
                    None
                } else {
                    c.drain_at.or(Some(now + drain))
                };
                self.draining |= c.drain_at.is_some();
            }
        }
        if !self.waiting.is_empty() {
            self.retry_waiting(now);
        }
        // The connections are looked at once a second (idle), or every tick while a drain
        // bound is set.
        if !idle_check && !self.draining && drain_until.is_none() {
            return;
        }
        let idle_s = self.shared.config.idle_timeout.as_secs().max(1);
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_deref() else {
                continue;
            };
            if c.end != End::Open {
                continue;
            }
            let past_drain =
                c.drain_at.is_some_and(|t| now >= t) || drain_until.is_some_and(|t| now >= t);
            if past_drain {
                self.shared.metrics.drained.inc();
                tracing::debug!(client = %c.client_addr, backend = %c.backend.1, "drain bound reached, closing");
                self.finish(i, End::Reset);
            } else if idle_check && now_s.saturating_sub(c.active_at) >= idle_s {
                tracing::debug!(client = %c.client_addr, backend = %c.backend.1, "idle timeout");
                self.finish(i, End::Quiet);
            }
        }
    }

    /// Connections accepted before the first table: looked up again once there is one, and
    /// refused when it did not come in time.
    fn retry_waiting(&mut self, now: Instant) {
        let have_table = *self.generation.borrow() != 0;
        let waiting = std::mem::take(&mut self.waiting);
        for (fd, dst, deadline) in waiting {
            if have_table || now >= deadline {
                self.shared.metrics.active_connections.dec();
                self.accepted(fd, Some(dst), false);
            } else {
                self.waiting.push((fd, dst, deadline));
            }
        }
    }

    /// A connection accepted on the listener of frontend `dst` (`None`: its listener was
    /// closed meanwhile, so its local address is read).
    fn accepted(&mut self, fd: OwnedFd, dst: Option<SocketAddr>, may_wait: bool) {
        let sock = SockRef::from(&fd);
        let dst = dst.or_else(|| sock.local_addr().ok()?.as_socket().map(normalize));
        let (Some(dst), Some(client)) = (dst, sock.peer_addr().ok().and_then(|a| a.as_socket()))
        else {
            return;
        };
        let client = normalize(client);
        let route = self.shared.routes.load().get(dst, Protocol::Tcp).cloned();
        let Some(route) = route else {
            if may_wait && *self.generation.borrow() == 0 {
                // No table yet (a restarted agent keeps its frontends intercepted): wait for
                // the first one, bounded. It counts as open while it waits.
                self.shared.metrics.active_connections.inc();
                self.waiting
                    .push((fd, dst, Instant::now() + FIRST_TABLE_WAIT));
                self.arm_wake();
                return;
            }
            tracing::debug!(%dst, "no route (frontend removed?)");
            reset(&fd);
            return;
        };
        let Ok(permit) = self.cap.clone().try_acquire_owned() else {
            // Over the cap: refuse cleanly with a reset; open connections are untouched.
            route.frontend_counters.refused.inc();
            reset(&fd);
            return;
        };
        let scarce = self.shared.per_client.scarce(self.cap.available_permits());
        let Some(slot) = self.shared.per_client.take(client, scarce) else {
            route.frontend_counters.refused.inc();
            reset(&fd);
            return;
        };
        let bufs = [PooledBuf::take(), PooledBuf::take()];
        let conn = Box::new(Conn {
            client: fd,
            up: None,
            client_addr: client,
            dst,
            route,
            backend: (0, dst),
            attempt: 0,
            tried: super::routes::Tried::new(),
            sockaddr: SockAddr::from(dst),
            bufs,
            pending: [(0, 0); 2],
            ended: [false; 2],
            last: [false; 2],
            shut_pending: [false; 2],
            spliced: [None, None],
            reset_after: false,
            inflight: 0,
            end: End::Open,
            active_at: self.now_s,
            drain_at: None,
            _slot: slot,
            _permit: permit,
        });
        let i = match self.free.pop() {
            Some(i) => {
                self.conns[i] = Some(conn);
                i
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        };
        self.shared.metrics.active_connections.inc();
        self.connect(i);
    }

    /// Starts the next connect attempt, or refuses the client when none is left.
    fn connect(&mut self, i: usize) {
        let attempts = self.shared.config.connect_attempts;
        loop {
            let Some(c) = self.conns[i].as_deref_mut() else {
                return;
            };
            let n = c.route.attempts(attempts);
            let picked = (c.attempt < n)
                .then(|| c.route.pick(c.client_addr, c.attempt, attempts, &c.tried))
                .flatten();
            let Some((bi, backend)) = picked else {
                c.route.frontend_counters.refused.inc();
                if n > 0 {
                    tracing::info!(frontend = %c.route.frontend, client = %c.client_addr, "no backend accepted the connection");
                }
                self.finish(i, End::Reset);
                return;
            };
            if c.attempt > 0 {
                c.route.frontend_counters.retries.inc();
            }
            c.attempt += 1;
            c.tried.push(bi);
            let s = Socket::new(
                Domain::for_address(backend),
                Type::STREAM.nonblocking().cloexec(),
                None,
            )
            .and_then(|s| s.set_tcp_nodelay(true).map(|()| s));
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "creating a backend socket");
                    c.route.backends.cells(bi).connect_failures.inc();
                    continue;
                }
            };
            c.backend = (bi, backend);
            c.sockaddr = SockAddr::from(backend);
            let fd = OwnedFd::from(s);
            let raw = fd.as_raw_fd();
            c.up = Some(fd);
            c.inflight += 2;
            let connect =
                opcode::Connect::new(types::Fd(raw), c.sockaddr.as_ptr().cast(), c.sockaddr.len())
                    .build()
                    .flags(squeue::Flags::IO_LINK)
                    .user_data(ud(i, op::CONNECT));
            let timeout = opcode::LinkTimeout::new(&self.connect_timeout)
                .build()
                .user_data(ud(i, op::CONNECT_TIMEOUT));
            self.push(connect);
            self.push(timeout);
            return;
        }
    }

    fn recv(&mut self, i: usize, d: usize) {
        let Some(c) = self.conns[i].as_deref_mut() else {
            return;
        };
        c.inflight += 1;
        let fd = Conn::raw(c.src(d));
        let buf = &mut c.bufs[d];
        let e = opcode::Recv::new(types::Fd(fd), buf.as_mut_ptr(), buf.len() as u32)
            .build()
            .user_data(ud(i, pick(d, [op::RECV0, op::RECV1])));
        self.push(e);
    }

    fn send(&mut self, i: usize, d: usize) {
        let Some(c) = self.conns[i].as_deref_mut() else {
            return;
        };
        let (len, off) = c.pending[d];
        c.inflight += 1;
        let dst = Conn::raw(c.dst(d));
        // The last data of a direction whose other direction still runs is corked and the
        // half-close linked behind it, so data and FIN leave in one segment. MSG_WAITALL: a
        // send that comes back short fails the link rather than let the FIN overtake the rest.
        let link = c.last[d] && !c.ended[1 - d] && !c.shut_pending[d];
        let flags = if link {
            libc::MSG_NOSIGNAL | libc::MSG_MORE | libc::MSG_WAITALL
        } else {
            libc::MSG_NOSIGNAL
        };
        let data = &c.bufs[d][off..len];
        let e = opcode::Send::new(types::Fd(dst), data.as_ptr(), data.len() as u32)
            .flags(flags)
            .build()
            .user_data(ud(i, pick(d, [op::SEND0, op::SEND1])));
        if link {
            c.inflight += 1;
            self.push(e.flags(squeue::Flags::IO_LINK));
            self.push(
                opcode::Shutdown::new(types::Fd(dst), libc::SHUT_WR)
                    .build()
                    .user_data(ud(i, pick(d, [op::SHUT0, op::SHUT1]))),
            );
        } else {
            self.push(e);
        }
    }

    /// Waits for `fd` to be ready (`POLLIN` or `POLLOUT`) for direction `d`'s splice.
    fn poll(&mut self, i: usize, d: usize, fd: i32, events: i16) {
        let Some(c) = self.conns[i].as_deref_mut() else {
            return;
        };
        c.inflight += 1;
        self.push(
            opcode::PollAdd::new(types::Fd(fd), events as u32)
                .build()
                .user_data(ud(i, pick(d, [op::SPLICE0, op::SPLICE1]))),
        );
    }

    /// Moves direction `d` through its pipe (socket → pipe → socket) until it would block,
    /// ends, or has had its rounds; then waits for readiness.
    fn splice_step(&mut self, i: usize, d: usize) {
        let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
        let Some(c) = self.conns[i].as_deref_mut() else {
            return;
        };
        let (Some(src), Some(dst)) = (
            c.src(d).map(|f| f.as_raw_fd()),
            c.dst(d).map(|f| f.as_raw_fd()),
        ) else {
            return;
        };
        // SAFETY: both are the connection's open sockets, borrowed for this call only.
        let (src_fd, dst_fd) =
            unsafe { (BorrowedFd::borrow_raw(src), BorrowedFd::borrow_raw(dst)) };
        let Some(sp) = c.spliced[d].as_mut() else {
            return;
        };
        for _ in 0..SPLICE_ROUNDS {
            if sp.left > 0 {
                match splice(&sp.pipe.r, None, dst_fd, None, sp.left, flags) {
                    Ok(m) => {
                        sp.left -= m;
                        count_moved(&c.route, c.backend.0, d, m);
                        c.active_at = self.now_s;
                        continue;
                    }
                    Err(nix::errno::Errno::EAGAIN) => return self.poll(i, d, dst, libc::POLLOUT),
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        c.log_error(e);
                        return self.finish(i, End::Reset);
                    }
                }
            }
            match splice(src_fd, None, &sp.pipe.w, None, sp.pipe.size, flags) {
                Ok(0) => {
                    // EOF with the pipe empty: pass the half-close on.
                    c.ended[d] = true;
                    if !c.ended[1 - d] {
                        half_close(Some(dst_fd));
                    }
                    if let Some(sp) = c.spliced[d].take() {
                        give_back_pipe(sp.pipe);
                    }
                    return self.settle(i);
                }
                Ok(n) => sp.left = n,
                Err(nix::errno::Errno::EAGAIN) => return self.poll(i, d, src, libc::POLLIN),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    c.log_error(e);
                    return self.finish(i, End::Reset);
                }
            }
        }
        // Had its rounds: go round the loop (a ready socket's poll completes at once).
        if sp.left > 0 {
            self.poll(i, d, dst, libc::POLLOUT);
        } else {
            self.poll(i, d, src, libc::POLLIN);
        }
    }

    /// Ends the connection (`Reset` or `Quiet`): what is in flight is cancelled, and the
    /// sockets close when it is back.
    fn finish(&mut self, i: usize, how: End) {
        let Some(c) = self.conns[i].as_deref_mut() else {
            return;
        };
        if c.end != End::Open {
            return;
        }
        c.end = how;
        let fds = [c.src(0), c.src(1)].map(|f| {
            f.map(|f| {
                if how == End::Reset {
                    reset(&f);
                }
                f.as_raw_fd()
            })
        });
        if c.inflight > 0 {
            for fd in fds.into_iter().flatten() {
                if let Some(c) = self.conns[i].as_deref_mut() {
                    c.inflight += 1;
                }
                self.push(
                    opcode::AsyncCancel2::new(types::CancelBuilder::fd(types::Fd(fd)).all())
                        .build()
                        .user_data(ud(i, op::CANCEL)),
                );
            }
        }
        self.settle(i);
    }

    /// Drops the connection once it is over and nothing of it is in flight.
    fn settle(&mut self, i: usize) {
        let done = self.conns[i]
            .as_deref()
            .is_some_and(|c| c.inflight == 0 && (c.end != End::Open || c.ended == [true, true]));
        if !done {
            return;
        }
        let Some(c) = self.conns[i].take() else {
            return;
        };
        // Its buffers go back to the pool as it drops, and its empty pipes too.
        for sp in c.spliced.into_iter().flatten() {
            if sp.left == 0 {
                give_back_pipe(sp.pipe);
            }
        }
        self.free.push(i);
        self.shared.metrics.active_connections.dec();
    }

    fn completed(&mut self, i: usize, kind: u8, res: i32) {
        let splice = self.shared.config.splice;
        let Some(c) = self.conns.get_mut(i).and_then(|c| c.as_deref_mut()) else {
            return;
        };
        c.inflight = c.inflight.saturating_sub(1);
        let open = c.end == End::Open;
        match kind {
            op::CONNECT if open => {
                if res == 0 {
                    c.route.backends.connected(c.backend.0);
                    c.route.backends.cells(c.backend.0).connections.inc();
                    if c.route.is_fallback(c.backend.0) {
                        c.route.frontend_counters.fallbacks.inc();
                        tracing::debug!(frontend = %c.route.frontend, client = %c.client_addr, backend = %c.backend.1, "every selected backend refused or is skipped; a fallback backend took the connection");
                    }
                    self.recv(i, 0);
                    self.recv(i, 1);
                } else {
                    c.route.backends.cells(c.backend.0).connect_failures.inc();
                    // Only what the backend's side answered (or its silence: the link
                    // timeout cancels the connect) marks it.
                    let skipped = super::backend_failed(Some(-res))
                        && c.route
                            .backends
                            .connect_failed(c.backend.0, c.route.selected());
                    tracing::debug!(backend = %c.backend.1, error = %os_error(res), skipped, "connect failed");
                    // Its timeout's completion may still come; the socket closes now.
                    c.up = None;
                    self.connect(i);
                }
            }
            op::RECV0 | op::RECV1 if open => {
                let d = usize::from(kind - op::RECV0);
                if res > 0 {
                    let mut n = res as usize;
                    if d == 1 && n < c.bufs[1].len() {
                        // A short read from the backend: if its FIN came right behind, read
                        // to it, so this data leaves with our FIN.
                        let fd = Conn::raw(c.src(1));
                        // SAFETY: the connection's open backend socket, for this call only.
                        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                        let (m, got) = read_to_fin(fd, &mut c.bufs[1], n);
                        n = m;
                        match got {
                            Ok(fin) => c.last[1] = fin,
                            Err(e) => {
                                // Data, then a reset: the data goes on, then the reset.
                                c.log_error(e);
                                c.reset_after = true;
                            }
                        }
                    }
                    c.pending[d] = (n, 0);
                    self.send(i, d);
                } else if res == 0 {
                    c.ended[d] = true;
                    if !c.ended[1 - d] {
                        half_close(c.dst(d));
                    }
                } else if res == -libc::EAGAIN || res == -libc::EINTR {
                    self.recv(i, d);
                } else {
                    c.log_error(os_error(res));
                    return self.finish(i, End::Reset);
                }
            }
            op::SEND0 | op::SEND1 if open => {
                let d = usize::from(kind - op::SEND0);
                if res >= 0 || res == -libc::EAGAIN || res == -libc::EINTR {
                    let (len, off) = c.pending[d];
                    let off = off + res.max(0) as usize;
                    c.pending[d] = (len, off);
                    if off < len {
                        return self.send(i, d);
                    }
                    count_moved(&c.route, c.backend.0, d, len);
                    c.active_at = self.now_s;
                    if d == 1 && c.reset_after {
                        return self.finish(i, End::Reset);
                    }
                    if c.last[d] {
                        if c.shut_pending[d] && !c.ended[1 - d] {
                            half_close(c.dst(d));
                        }
                        c.ended[d] = true;
                    } else if len == c.bufs[d].len()
                        && splice
                        && let Some(pipe) = take_pipe()
                    {
                        // A full buffer: a bulk transfer. Go on with zero copy.
                        c.spliced[d] = Some(Spliced { pipe, left: 0 });
                        self.splice_step(i, d);
                    } else {
                        self.recv(i, d);
                    }
                } else {
                    c.log_error(os_error(res));
                    return self.finish(i, End::Reset);
                }
            }
            op::SHUT0 | op::SHUT1 if res == -libc::ECANCELED => {
                c.shut_pending[usize::from(kind - op::SHUT0)] = true;
            }
            op::SPLICE0 | op::SPLICE1 if open => {
                let d = usize::from(kind - op::SPLICE0);
                if res < 0 && res != -libc::EINTR {
                    c.log_error(os_error(res));
                    return self.finish(i, End::Reset);
                }
                self.splice_step(i, d);
            }
            _ => {}
        }
        self.settle(i);
    }
}

#[cfg(test)]
mod tests;
