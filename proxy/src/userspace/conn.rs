//! What both TCP workers (the epoll one in [`super::tcp`], the io_uring one in
//! [`super::uring`]) share: per-client connection counts, the wait for the first table,
//! resets, and the per-thread pools of splice pipes and copy buffers.

use std::{
    net::SocketAddr,
    os::fd::OwnedFd,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use socket2::SockRef;

/// Most a bulk pipe is grown to (bounded further by `/proc/sys/fs/pipe-max-size`).
const BULK_PIPE_MAX_BYTES: usize = 1 << 20;
/// A pipe's size when it is not in use (the kernel's default), so pooled pipes do not hold
/// the user's pipe-page quota.
const IDLE_PIPE_BYTES: usize = 1 << 16;
/// Size of the copy buffer of each direction; a read that fills it switches to splice.
pub(super) const COPY_BUF_BYTES: usize = 16 << 10;
/// Buckets of [`ClientCounts`].
const CLIENT_BUCKETS: usize = 16_384;

/// Open connections per client address, in buckets by hash: one atomic add on accept and one
/// subtract on close, no lock and no allocation per connection.
///
/// Two limits: `limit` always, and, once the forwarder's whole cap is nearly spent (less
/// than its last quarter left, [`ClientCounts::scarce`]), `reserved`: the last quarter is kept
/// for clients holding fewer than that many, a sixteenth of it each, so a handful of
/// clients at their own cap (four at the defaults: 4 × 16,384 = 65,536) cannot leave every
/// other pod of the node refused.
#[derive(Debug)]
pub struct ClientCounts {
    limit: u32,
    reserved: u32,
    /// Free places of the whole cap below which only `reserved` holds.
    reserve: usize,
    buckets: Box<[AtomicU32]>,
}

impl ClientCounts {
    /// At most `limit` open connections per client, of a forwarder holding at most `total`.
    pub fn new(limit: usize, total: usize) -> Self {
        let limit = u32::try_from(limit.max(1)).unwrap_or(u32::MAX);
        let reserve = total / 4;
        Self {
            limit,
            reserved: u32::try_from(reserve / 16)
                .unwrap_or(u32::MAX)
                .clamp(1, limit),
            reserve,
            buckets: (0..CLIENT_BUCKETS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Whether `free` places left of the whole cap (after this connection took its own) are
    /// within its last quarter.
    pub(super) fn scarce(&self, free: usize) -> bool {
        free < self.reserve
    }

    /// Takes a slot for `client`, or `None` when it has `limit` open already, or, with the
    /// cap `scarce`, `reserved`.
    pub(super) fn take(&self, client: SocketAddr, scarce: bool) -> Option<ClientSlot<'_>> {
        let h = super::routes::flow_hash(client, true) as usize % CLIENT_BUCKETS;
        let b = &self.buckets[h];
        let limit = if scarce { self.reserved } else { self.limit };
        if b.fetch_add(1, Ordering::Relaxed) >= limit {
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

/// Close with RST (SO_LINGER 0), so the client sees a refusal, not a hang.
pub(super) fn reset(socket: &impl std::os::fd::AsFd) {
    let _ = SockRef::from(socket).set_linger(Some(Duration::ZERO));
}

/// How long a connection accepted before the first table (a restarted agent's frontends stay
/// intercepted) waits for it.
pub(super) const FIRST_TABLE_WAIT: Duration = Duration::from_secs(3);

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

#[cfg(test)]
mod tests {
    use super::ClientCounts;

    /// Issue 52: four clients at their own cap used to fill the whole cap; now the last
    /// quarter is kept for clients that hold few, and a fifth client is served.
    #[test]
    fn clients_at_their_cap_leave_the_last_quarter_to_the_others() {
        let (total, per_client) = (64usize, 16usize);
        let counts = ClientCounts::new(per_client, total);
        let mut free = total;
        let mut held = Vec::new();
        let accept = |client: &str, free: &mut usize| {
            if *free == 0 {
                return None;
            }
            let slot = counts.take(client.parse().unwrap(), counts.scarce(*free - 1))?;
            *free -= 1;
            Some(slot)
        };
        let mut served = [0; 5];
        for (i, c) in [
            "198.18.9.1:1",
            "198.18.9.2:1",
            "198.18.9.3:1",
            "198.18.9.4:1",
        ]
        .iter()
        .enumerate()
        {
            for _ in 0..per_client {
                if let Some(s) = accept(c, &mut free) {
                    held.push(s);
                    served[i] += 1;
                }
            }
        }
        // Three took their 16 each; the fourth got one of the reserve (a sixteenth of 16).
        assert_eq!(served[..4], [16, 16, 16, 1]);
        // A fifth client is served, as are more newcomers, one each, while the reserve lasts.
        let fifth = accept("198.18.9.5:1", &mut free);
        assert!(fifth.is_some());
        assert!(accept("198.18.9.5:1", &mut free).is_none());
        let sixth = accept("[2001:2::9:6]:1", &mut free);
        assert!(sixth.is_some());
        drop((fifth, sixth, held));
        // Without the reserve (a cap of 2), the per-client cap alone.
        let small = ClientCounts::new(16, 2);
        assert!(!small.scarce(0) && small.take("198.18.9.1:1".parse().unwrap(), false).is_some());
    }

    use super::*;

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
