//! The node's listening sockets, handed from its running agent to the next one.
//!
//! An agent's metrics and DNS sockets are bound without `SO_REUSEPORT`, so no other process
//! may join them (with `SO_REUSEPORT`, any process of the host network with the agent's UID
//! could, and took a share of the answers). The next agent of the node (the userspace
//! DaemonSet rolls with maxSurge) does not bind beside the running one: it asks it for the
//! sockets themselves, over a Unix socket at `--handover-socket` (a host directory only the
//! agent's pods mount), and gets them as `SCM_RIGHTS`: the same sockets, with the same
//! queues. Both serve them until the old agent stops; whatever waits in a queue then is the
//! next agent's, so nothing is refused or lost.
//!
//! - [`Sockets::inherit`] asks the agent listening at the path (none: every socket is bound
//!   afresh) and checks each socket it is given: its type, that a stream socket listens, and
//!   its address, which names it.
//! - [`Sockets::tcp_listener`] and [`Sockets::udp`] take an inherited socket of that address,
//!   else bind one; either way a duplicate is kept to be handed on.
//! - [`Sockets::serve`] then takes the path over (bound beside it and renamed onto it, so a
//!   next agent always finds a socket) and hands every socket it holds to each agent that
//!   connects with the same user id, one at a time, each within [`EXCHANGE_DEADLINE`].

use std::{
    collections::HashMap,
    io::{self, IoSlice, IoSliceMut},
    mem::MaybeUninit,
    net::SocketAddr,
    os::{
        fd::{AsFd, OwnedFd},
        unix::{
            fs::{MetadataExt as _, PermissionsExt as _},
            net::UnixStream,
        },
    },
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketType, recvmsg, sendmsg, sockopt,
};

/// How long one exchange (every socket, both ways) may take before it is given up.
pub const EXCHANGE_DEADLINE: Duration = Duration::from_secs(5);

/// Most sockets taken in one exchange (more: the rest are refused, and bound afresh). An
/// agent hands over its metrics socket and two per DNS address.
pub const MAX_SOCKETS: usize = 1024;

/// How often a serving agent checks that the path still leads to it or to a live successor
/// (a successor that took the path and died leaves a socket nobody answers).
const PATH_CHECK: Duration = Duration::from_secs(5);

/// A message with one socket.
const SOCKET: u8 = b's';
/// The last message of an exchange.
const END: u8 = b'e';
/// What a next agent asks first: every socket.
const ASK: u8 = b'h';
/// What an agent checking the path asks: nothing (answered by closing).
const PROBE: u8 = b'p';

/// What a socket is, as far as the handover goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A listening TCP socket.
    TcpListener,
    /// A UDP socket.
    Udp,
}

/// The sockets this agent took from the one before it and holds for the one after it.
#[derive(Debug, Default)]
pub struct Sockets {
    inherited: Mutex<HashMap<(Kind, SocketAddr), OwnedFd>>,
    /// A duplicate of each socket this agent serves, handed to each next agent.
    held: Mutex<Vec<OwnedFd>>,
}

impl Sockets {
    /// Takes the sockets of the agent serving at `path`, if one does; otherwise (no such
    /// path, nobody answers it, an exchange that fails) none, with the reason logged, and
    /// every socket is bound afresh.
    pub fn inherit(path: &Path) -> Self {
        let inherited = match receive(path) {
            Ok(got) => {
                if !got.is_empty() {
                    tracing::info!(path = %path.display(), sockets = got.len(), "took the listening sockets of the node's running agent: both serve them until it stops");
                }
                got
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                tracing::debug!(path = %path.display(), error = %e, "no running agent to take sockets from");
                HashMap::new()
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not take the running agent's sockets; binding afresh (an address it holds waits until it stops)");
                HashMap::new()
            }
        };
        Self {
            inherited: Mutex::new(inherited),
            held: Mutex::default(),
        }
    }

    /// A listening TCP socket on `addr`: the inherited one, else bound afresh
    /// (`SO_REUSEADDR`, not `SO_REUSEPORT`) with `backlog`. Non-blocking.
    pub fn tcp_listener(
        &self,
        addr: SocketAddr,
        backlog: u32,
    ) -> io::Result<std::net::TcpListener> {
        let listener = match self.take(Kind::TcpListener, addr) {
            Some(fd) => std::net::TcpListener::from(fd),
            None => {
                let s = if addr.is_ipv4() {
                    tokio::net::TcpSocket::new_v4()?
                } else {
                    tokio::net::TcpSocket::new_v6()?
                };
                s.set_reuseaddr(true)?;
                s.bind(addr)?;
                s.listen(backlog)?.into_std()?
            }
        };
        listener.set_nonblocking(true)?;
        self.hold(listener.as_fd())?;
        Ok(listener)
    }

    /// A UDP socket on `addr`: the inherited one, else `bind()`'s (which must not set
    /// `SO_REUSEPORT` or `SO_REUSEADDR`, either of which would let another process share
    /// it). Non-blocking.
    pub fn udp(
        &self,
        addr: SocketAddr,
        bind: impl FnOnce(SocketAddr) -> io::Result<std::net::UdpSocket>,
    ) -> io::Result<std::net::UdpSocket> {
        let socket = match self.take(Kind::Udp, addr) {
            Some(fd) => std::net::UdpSocket::from(fd),
            None => bind(addr)?,
        };
        socket.set_nonblocking(true)?;
        self.hold(socket.as_fd())?;
        Ok(socket)
    }

    /// Whether a socket of `kind` on `addr` was inherited and not taken yet.
    pub fn inherits(&self, kind: Kind, addr: SocketAddr) -> bool {
        lock(&self.inherited).contains_key(&(kind, addr))
    }

    /// Inherited sockets no address of this agent asked for. They are closed here (the
    /// agent before keeps serving them until it stops).
    pub fn close_unused(&self) -> usize {
        let mut inherited = lock(&self.inherited);
        let n = inherited.len();
        if n > 0 {
            let addrs: Vec<String> = inherited
                .keys()
                .take(8)
                .map(|(k, a)| format!("{k:?} {a}"))
                .collect();
            tracing::info!(sockets = n, first = ?addrs, "closed the running agent's sockets this agent does not serve");
        }
        inherited.clear();
        n
    }

    /// Lets every held socket go: this agent hands nothing over any more (its copies in
    /// use close with their servers).
    pub fn let_go(&self) {
        lock(&self.held).clear();
        lock(&self.inherited).clear();
    }

    fn take(&self, kind: Kind, addr: SocketAddr) -> Option<OwnedFd> {
        lock(&self.inherited).remove(&(kind, addr))
    }

    fn hold(&self, fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
        lock(&self.held).push(fd.try_clone_to_owned()?);
        Ok(())
    }

    /// Serves the held sockets at `path` from now on, in a background task: bound beside it
    /// and renamed onto it (mode 0600), so the path always leads to a socket. Must run
    /// inside the tokio runtime. The returned guard removes the path at drop if it is still
    /// this agent's.
    pub fn serve(self: &Arc<Self>, path: &Path) -> io::Result<Serving> {
        let (listener, ino) = take_path(path)?;
        let inode = Arc::new(AtomicU64::new(ino));
        let task = tokio::spawn(serve_loop(
            self.clone(),
            listener,
            path.to_path_buf(),
            inode.clone(),
        ));
        tracing::info!(path = %path.display(), sockets = lock(&self.held).len(), "handing this agent's sockets to the node's next agent on request");
        Ok(Serving {
            path: path.to_path_buf(),
            inode,
            task,
        })
    }

    fn held_copies(&self) -> io::Result<Vec<OwnedFd>> {
        lock(&self.held).iter().map(OwnedFd::try_clone).collect()
    }
}

/// The handover path served by this agent (see [`Sockets::serve`]).
#[derive(Debug)]
pub struct Serving {
    path: PathBuf,
    /// The inode of the socket this agent bound at the path.
    inode: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Serving {
    /// Stops answering, and removes the path unless a next agent took it over.
    fn drop(&mut self) {
        self.task.abort();
        if std::fs::metadata(&self.path)
            .is_ok_and(|m| m.ino() == self.inode.load(Ordering::Relaxed))
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A Unix listener at `path`: bound at a name beside it, made 0600, renamed onto it.
/// Returns it and its inode.
fn take_path(path: &Path) -> io::Result<(tokio::net::UnixListener, u64)> {
    let mut beside = path.as_os_str().to_owned();
    // Unique even between two agents that are both pid 1 of their containers.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    beside.push(format!(".{}.{nanos}.new", std::process::id()));
    let beside = PathBuf::from(beside);
    let _ = std::fs::remove_file(&beside);
    let listener = std::os::unix::net::UnixListener::bind(&beside)?;
    let placed = std::fs::set_permissions(&beside, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&beside, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&beside);
        return Err(e);
    }
    let inode = std::fs::metadata(path)?.ino();
    listener.set_nonblocking(true)?;
    Ok((tokio::net::UnixListener::from_std(listener)?, inode))
}

/// Answers each next agent at the path, one at a time; takes the path back when it leads
/// to a socket nobody listens on (a successor that took it and died).
async fn serve_loop(
    sockets: Arc<Sockets>,
    mut listener: tokio::net::UnixListener,
    path: PathBuf,
    inode: Arc<AtomicU64>,
) {
    let mut check = tokio::time::interval(PATH_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let sockets = sockets.clone();
                    let done = tokio::task::spawn_blocking(move || {
                        let stream = stream.into_std()?;
                        stream.set_nonblocking(false)?;
                        hand_over(&stream, &sockets)
                    })
                    .await;
                    match done {
                        Ok(Ok(None)) => {}
                        Ok(Ok(Some((n, pid)))) => tracing::info!(sockets = n, pid, "handed this agent's sockets to the node's next agent; both serve them until this one stops"),
                        Ok(Err(e)) => tracing::warn!(error = %e, "a handover of this agent's sockets failed (the next agent binds afresh)"),
                        Err(e) => tracing::warn!(error = %e, "the handover task failed"),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting on the handover socket failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = check.tick() => {
                let ours = std::fs::metadata(&path).is_ok_and(|m| m.ino() == inode.load(Ordering::Relaxed));
                // A probe, not an exchange: the successor sends nothing back.
                let dead = !ours && connect(&path).and_then(|s| send(&s, PROBE, None)).is_err_and(|e| {
                    matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound)
                });
                if dead {
                    match take_path(&path) {
                        Ok((l, i)) => {
                            tracing::warn!(path = %path.display(), "the handover path led to no agent (a next agent took it and stopped): serving it again");
                            listener = l;
                            inode.store(i, Ordering::Relaxed);
                        }
                        Err(e) => tracing::warn!(path = %path.display(), error = %e, "could not take the handover path back"),
                    }
                }
            }
        }
    }
}

/// Sends every held socket to the agent on `stream`, if it runs with our user id and asks.
/// Returns how many, and its pid; `None` for a probe of the path.
fn hand_over(stream: &UnixStream, sockets: &Sockets) -> io::Result<Option<(usize, i32)>> {
    stream.set_write_timeout(Some(EXCHANGE_DEADLINE))?;
    stream.set_read_timeout(Some(EXCHANGE_DEADLINE))?;
    let peer = same_user(stream)?;
    let mut asked = [0u8; 1];
    match io::Read::read(&mut &*stream, &mut asked)? {
        1 if asked[0] == ASK => {}
        // A probe of the path, or a peer that closed: nothing to hand over.
        _ => return Ok(None),
    }
    let fds = sockets.held_copies()?;
    for fd in &fds {
        send(stream, SOCKET, Some(fd))?;
    }
    send(stream, END, None)?;
    Ok(Some((fds.len(), peer)))
}

/// The peer's pid (0 when it runs in a PID namespace this process cannot see, as another
/// pod's agent does), if it runs with this process's effective user id; else an error.
fn same_user(stream: &UnixStream) -> io::Result<i32> {
    // nix's credentials, not rustix's: rustix holds the pid as non-zero, and across PID
    // namespaces the kernel reports 0.
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)?;
    let ours = nix::unistd::geteuid().as_raw();
    if cred.uid() != ours {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the peer (pid {}) runs as uid {}, not {ours}",
                cred.pid(),
                cred.uid()
            ),
        ));
    }
    Ok(cred.pid())
}

fn send(stream: &UnixStream, what: u8, fd: Option<&OwnedFd>) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let borrowed = fd.map(AsFd::as_fd);
    let fds = borrowed.as_slice();
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("no room for a descriptor in the message"));
    }
    let sent = sendmsg(
        stream,
        &[IoSlice::new(&[what])],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != 1 {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "handover message not sent",
        ));
    }
    Ok(())
}

/// A connection to the agent at `path`, refused at once rather than waited for when its
/// queue is full (a hung agent). Blocking afterwards.
fn connect(path: &Path) -> io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, socket_with};
    let fd = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Takes every socket the agent at `path` hands over, checked and keyed by what it is.
fn receive(path: &Path) -> io::Result<HashMap<(Kind, SocketAddr), OwnedFd>> {
    let stream = connect(path)?;
    stream.set_write_timeout(Some(EXCHANGE_DEADLINE))?;
    let deadline = std::time::Instant::now() + EXCHANGE_DEADLINE;
    let pid = same_user(&stream)?;
    send(&stream, ASK, None)?;
    let mut got = HashMap::new();
    let mut refused = 0usize;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the agent (pid {pid}) took longer than {} s",
                    EXCHANGE_DEADLINE.as_secs()
                ),
            ));
        }
        stream.set_read_timeout(Some(left))?;
        let mut byte = [0u8; 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = recvmsg(
            &stream,
            &mut [IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        match (msg.bytes, byte[0], fds.len()) {
            (0, _, _) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the agent (pid {pid}) closed before the end of the exchange"),
                ));
            }
            (1, END, 0) => break,
            (1, SOCKET, 1) => {
                let fd = fds.pop().expect("one descriptor");
                if got.len() >= MAX_SOCKETS {
                    refused += 1;
                    continue;
                }
                match classify(&fd) {
                    Ok(key) => {
                        got.insert(key, fd);
                    }
                    Err(e) => {
                        tracing::warn!(pid, error = %e, "refused a socket handed over");
                        refused += 1;
                    }
                }
            }
            (n, b, f) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "unexpected handover message from pid {pid}: {n} bytes ({b:#x}), {f} descriptors"
                    ),
                ));
            }
        }
    }
    if refused > 0 {
        tracing::warn!(
            pid,
            refused,
            "some handed-over sockets were refused; their addresses are bound afresh"
        );
    }
    Ok(got)
}

/// What a handed-over socket is: a listening TCP socket or a UDP socket, and its address.
fn classify(fd: &OwnedFd) -> io::Result<(Kind, SocketAddr)> {
    let addr = SocketAddr::try_from(rustix::net::getsockname(fd)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not an IP socket"))?;
    let kind = match sockopt::socket_type(fd)? {
        SocketType::STREAM if sockopt::socket_acceptconn(fd)? => Kind::TcpListener,
        SocketType::DGRAM => Kind::Udp,
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{addr}: a socket of type {other:?} that is neither a TCP listener nor UDP"
                ),
            ));
        }
    };
    // A stream socket may be SCTP, a datagram socket raw-ish: only TCP and UDP are taken.
    let protocol = sockopt::socket_protocol(fd)?;
    let want = match kind {
        Kind::TcpListener => rustix::net::ipproto::TCP,
        Kind::Udp => rustix::net::ipproto::UDP,
    };
    if protocol != Some(want) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{addr}: protocol {protocol:?}, not {want:?}"),
        ));
    }
    // Shared sockets are what the handover replaces; a connected UDP socket hears one peer.
    if sockopt::socket_reuseport(fd)? {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{addr}: SO_REUSEPORT is set (another process could share it)"),
        ));
    }
    if kind == Kind::Udp && rustix::net::getpeername(fd).is_ok_and(|a| a.is_some()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{addr}: a connected UDP socket"),
        ));
    }
    Ok((kind, addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two `Sockets` in one process stand for two agents: the next one takes the first's
    /// TCP listener and UDP socket (the same sockets: a connection queued before the
    /// handover is accepted by the next), binds what it was not given, and the first's
    /// addresses are not open to another bind.
    #[tokio::test]
    async fn the_next_agent_takes_the_same_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        let first = Arc::new(Sockets::inherit(&path));
        let tcp = first
            .tcp_listener("127.0.0.1:0".parse().unwrap(), 16)
            .unwrap();
        let tcp_addr = tcp.local_addr().unwrap();
        let udp = first
            .udp("127.0.0.1:0".parse().unwrap(), std::net::UdpSocket::bind)
            .unwrap();
        let udp_addr = udp.local_addr().unwrap();
        // Nobody else binds them (no SO_REUSEPORT): the intruder of issue 52.
        for kind in [Kind::TcpListener, Kind::Udp] {
            let addr = if kind == Kind::Udp {
                udp_addr
            } else {
                tcp_addr
            };
            let err = intruder(kind, addr).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{kind:?} {addr}");
        }
        let serving = first.serve(&path).unwrap();
        // A connection queued on the first agent's listener before the handover...
        let mut queued = std::net::TcpStream::connect(tcp_addr).unwrap();
        let path2 = path.clone();
        let next = tokio::task::spawn_blocking(move || Sockets::inherit(&path2))
            .await
            .unwrap();
        let next = Arc::new(next);
        let tcp2 = next.tcp_listener(tcp_addr, 16).unwrap();
        let udp2 = next.udp(udp_addr, |_| panic!("bound afresh")).unwrap();
        let other = next
            .tcp_listener("127.0.0.1:0".parse().unwrap(), 16)
            .unwrap();
        assert_ne!(other.local_addr().unwrap(), tcp_addr);
        assert_eq!(next.close_unused(), 0);
        // ...is the next agent's once the first closes its copies.
        drop((tcp, udp));
        drop(serving);
        drop(first);
        tcp2.set_nonblocking(false).unwrap();
        let (mut accepted, _) = tcp2.accept().unwrap();
        use std::io::{Read as _, Write as _};
        queued.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        accepted.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        client.send_to(b"q", udp_addr).unwrap();
        udp2.set_nonblocking(false).unwrap();
        let mut buf = [0u8; 4];
        let (n, from) = udp2.recv_from(&mut buf).unwrap();
        assert_eq!((&buf[..n], from), (&b"q"[..], client.local_addr().unwrap()));
        // The next agent serves the path now; the first, gone, left it to it.
        let _serving2 = next.serve(&path).unwrap();
        let third = tokio::task::spawn_blocking(move || Sockets::inherit(&path))
            .await
            .unwrap();
        assert_eq!(lock(&third.inherited).len(), 3);
    }

    /// No path, or a path nobody answers: nothing inherited, and no error.
    #[test]
    fn no_running_agent_means_nothing_inherited() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        assert!(lock(&Sockets::inherit(&path).inherited).is_empty());
        let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(stale);
        assert!(lock(&Sockets::inherit(&path).inherited).is_empty());
    }

    /// A process of the host network binding the address with both reuse options.
    fn intruder(kind: Kind, addr: SocketAddr) -> io::Result<()> {
        use nix::sys::socket::{
            AddressFamily, SockFlag, SockType, SockaddrIn, bind, setsockopt, socket, sockopt,
        };
        let ty = if kind == Kind::Udp {
            SockType::Datagram
        } else {
            SockType::Stream
        };
        let fd = socket(AddressFamily::Inet, ty, SockFlag::SOCK_CLOEXEC, None)?;
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
        setsockopt(&fd, sockopt::ReusePort, &true)?;
        let SocketAddr::V4(v4) = addr else {
            unreachable!()
        };
        bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(v4))?;
        Ok(())
    }
}
