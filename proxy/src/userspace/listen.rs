//! The forwarder's listening sockets: one set per frontend, bound to its ClusterSetIP and port
//! (`IP_TRANSPARENT`, as the address is on no interface). Packets for a frontend are marked in
//! prerouting (and in output, for the node's own processes) and the agent's policy route makes
//! their destination local, so the kernel's ordinary socket lookup finds these sockets. Nothing
//! is assigned to a packet on its way, so it does not matter where the prerouting hooks run:
//! on a routed interface, on a bridge, or while the frame is still being bridged under
//! br_netfilter (where a socket TPROXY assigned is dropped again by `ip_rcv`).
//!
//! - TCP: one listener per frontend and TCP worker, in one `SO_REUSEPORT` group, so the kernel
//!   spreads a frontend's connections over the workers; on nodes with more workers than
//!   [`LISTENERS_PER_FRONTEND`], each frontend gets that many, on workers taken in turn, so
//!   10,000 frontends on a 64-core node cost 40,000 listening sockets, not 640,000. A worker hears of its listeners
//!   through a [`Feed`]: a channel, an eventfd that wakes an io_uring worker's ring and a
//!   `Notify` that wakes an epoll worker's runtime.
//! - UDP: one socket per frontend, read by a task of its own; sessions bind their
//!   client-facing sockets to the same address, connected (see [`super::udp`]).
//!
//! A frontend's sockets are opened before its packets are marked and closed after they no
//! longer are.

use std::{
    collections::HashMap,
    io,
    net::SocketAddr,
    sync::{Arc, mpsc},
};

use mcs_model::Protocol;
use nix::sys::eventfd::{EfdFlags, EventFd};
use socket2::{Domain, Socket, Type};

use super::{Shared, nft::SetElement, udp};

/// Most listeners (so workers) of one TCP frontend.
pub const LISTENERS_PER_FRONTEND: usize = 4;

/// Descriptors the frontends' sockets leave to connections and the rest of the agent.
const RESERVED_FDS: u64 = 4096;

/// The frontends' sockets may take the open-files limit less [`RESERVED_FDS`] (at least half
/// of it); past half of that, a TCP frontend gets one listener instead of one per worker.
/// Frontends beyond it are not intercepted (with a warning), so a low limit costs the
/// interception of the last frontends, never the agent's own metrics and DNS sockets. At
/// 20,000 (this machine) that is 11,928 frontends on 2 workers; containers usually get
/// 1,048,576.
fn socket_budget() -> usize {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_or(
        1024,
        |(soft, _)| {
            let n = soft.saturating_sub(RESERVED_FDS).max(soft / 2);
            usize::try_from(n).unwrap_or(usize::MAX)
        },
    )
}

/// What a TCP worker is told.
#[derive(Debug)]
pub enum Feed {
    /// Accept on this listener (id, socket).
    Add(u64, std::net::TcpListener),
    /// Stop accepting on listener `id` and close it.
    Remove(u64),
}

/// A TCP worker's end of its feed.
#[derive(Debug)]
pub struct FeedRx {
    rx: mpsc::Receiver<Feed>,
    wake: Arc<EventFd>,
    notify: Arc<tokio::sync::Notify>,
}

impl FeedRx {
    /// The eventfd that becomes readable when something was sent.
    pub fn wake(&self) -> &Arc<EventFd> {
        &self.wake
    }

    /// Resolves when something was sent since the last [`FeedRx::drain`] began (or ever).
    pub async fn sent(&self) {
        self.notify.notified().await;
    }

    /// Everything sent so far (clears the wake-up first, so nothing sent later is missed).
    pub fn drain(&self) -> Vec<Feed> {
        // Non-blocking: EAGAIN when it was cleared already.
        let _ = self.wake.read();
        self.rx.try_iter().collect()
    }
}

/// The agent's end of a worker's feed.
#[derive(Debug)]
pub struct FeedTx {
    tx: mpsc::Sender<Feed>,
    wake: Arc<EventFd>,
    notify: Arc<tokio::sync::Notify>,
}

impl FeedTx {
    fn send(&self, feed: Feed) {
        // A worker that is gone (it stopped after shutdown) needs nothing more.
        if self.tx.send(feed).is_ok() {
            let _ = self.wake.write(1);
            self.notify.notify_one();
        }
    }
}

/// A feed for one TCP worker.
pub fn feed() -> io::Result<(FeedTx, FeedRx)> {
    let wake = Arc::new(
        EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(io::Error::from)?,
    );
    let notify = Arc::new(tokio::sync::Notify::new());
    let (tx, rx) = mpsc::channel();
    Ok((
        FeedTx {
            tx,
            wake: wake.clone(),
            notify: notify.clone(),
        },
        FeedRx { rx, wake, notify },
    ))
}

/// The frontends' sockets.
#[derive(Debug)]
pub struct FrontendSockets {
    workers: Vec<FeedTx>,
    /// TCP frontends: id and how many listeners (workers) it has.
    tcp: HashMap<SocketAddr, (u64, usize)>,
    udp: HashMap<SocketAddr, tokio::task::JoinHandle<()>>,
    next_id: u64,
    /// Sockets open, and the most that may be ([`socket_budget`]).
    sockets: usize,
    budget: usize,
    shared: Arc<Shared>,
    sessions: Arc<udp::Sessions>,
    runtime: tokio::runtime::Handle,
}

impl FrontendSockets {
    /// Sockets handed to `workers` (TCP) and to tasks on `runtime` (UDP).
    pub fn new(
        workers: Vec<FeedTx>,
        shared: Arc<Shared>,
        sessions: Arc<udp::Sessions>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Self {
            workers,
            tcp: HashMap::new(),
            udp: HashMap::new(),
            next_id: 1,
            sockets: 0,
            budget: socket_budget(),
            shared,
            sessions,
            runtime,
        }
    }

    /// Opens the sockets of `e` (nothing when they are open already).
    /// TCP frontends listening, UDP frontends listening, sockets open, and the most there may be.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (self.tcp.len(), self.udp.len(), self.sockets, self.budget)
    }

    pub fn open(&mut self, e: &SetElement) -> io::Result<()> {
        let addr = SocketAddr::new(e.vip, e.port);
        match e.protocol {
            Protocol::Tcp if !self.tcp.contains_key(&addr) => {
                let id = self.next_id;
                let mut n = workers_for(id, self.workers.len()).count();
                if self.sockets + n > self.budget / 2 {
                    n = 1;
                }
                self.spend(n)?;
                let workers = workers_for(id, self.workers.len()).take(n);
                let listeners = workers
                    .clone()
                    .map(|_| tcp_listener(addr))
                    .collect::<io::Result<Vec<_>>>()?;
                self.next_id += 1;
                self.sockets += n;
                for (w, l) in workers.zip(listeners) {
                    self.workers[w].send(Feed::Add(id, l));
                }
                self.tcp.insert(addr, (id, n));
            }
            Protocol::Udp if !self.udp.contains_key(&addr) => {
                self.spend(1)?;
                let sock = udp_socket(addr)?;
                self.sockets += 1;
                let (shared, sessions) = (self.shared.clone(), self.sessions.clone());
                let task = self.runtime.spawn(async move {
                    match tokio::net::UdpSocket::from_std(sock.into()) {
                        Ok(sock) => udp::listen_loop(sock, shared, sessions).await,
                        Err(e) => tracing::warn!(%addr, error = %e, "udp frontend socket"),
                    }
                });
                self.udp.insert(addr, task);
            }
            _ => return Ok(()),
        }
        self.shared.metrics.listening_frontends.inc();
        Ok(())
    }

    /// Closes the sockets of `e`; its open connections and sessions go on.
    pub fn close(&mut self, e: &SetElement) {
        let addr = SocketAddr::new(e.vip, e.port);
        let closed = match e.protocol {
            Protocol::Tcp => self.tcp.remove(&addr).map(|(id, n)| {
                for w in workers_for(id, self.workers.len()).take(n) {
                    self.workers[w].send(Feed::Remove(id));
                }
                self.sockets -= n;
            }),
            Protocol::Udp => self.udp.remove(&addr).map(|task| {
                task.abort();
                self.sockets -= 1;
            }),
            Protocol::Sctp => None,
        };
        if closed.is_some() {
            self.shared.metrics.listening_frontends.dec();
        }
    }

    /// How many of the open frontends another process (the next agent) also waits on, out of
    /// how many: more TCP listeners on the address than this forwarder's, a second
    /// unconnected UDP socket.
    pub fn taken_over(&self) -> (usize, usize) {
        let waiting = waiting_sockets();
        let count = |p, a: &SocketAddr| waiting.get(&(p, *a)).copied().unwrap_or(0);
        let tcp = self
            .tcp
            .iter()
            .filter(|(a, (_, n))| count(Protocol::Tcp, a) > *n)
            .count();
        let udp = self
            .udp
            .keys()
            .filter(|a| count(Protocol::Udp, a) > 1)
            .count();
        (tcp + udp, self.tcp.len() + self.udp.len())
    }

    /// Whether `n` more sockets fit the budget.
    fn spend(&self, n: usize) -> io::Result<()> {
        if self.sockets + n > self.budget {
            return Err(io::Error::other(format!(
                "the frontends' sockets are at their budget ({} open; the open-files limit less {RESERVED_FDS}): raise the agent's LimitNOFILE",
                self.sockets
            )));
        }
        Ok(())
    }

    /// Opens the sockets of each of `elements`; returns those that have them. Each that
    /// cannot is counted (`listen_failures`), the first five named in a warning with the
    /// reason, the rest in one line: its packets are not intercepted.
    pub fn open_all(&mut self, elements: impl IntoIterator<Item = SetElement>) -> Vec<SetElement> {
        let mut failed = 0usize;
        let opened = elements
            .into_iter()
            .filter(|e| match self.open(e) {
                Ok(()) => true,
                Err(error) => {
                    self.shared.metrics.listen_failures.inc();
                    failed += 1;
                    if failed <= 5 {
                        let hint = listen_hint(e, &error);
                        tracing::warn!(frontend = ?e, %error, hint, "cannot listen on the frontend's address; not intercepted");
                    }
                    false
                }
            })
            .collect();
        if failed > 5 {
            tracing::warn!(
                frontends = failed,
                "frontends not intercepted: no listening socket (the first five are named above)"
            );
        }
        opened
    }
}

/// The workers (indices) that accept for TCP frontend `id` out of `all`: every one, or
/// [`LISTENERS_PER_FRONTEND`] taken in turn from where the previous frontend's began.
fn workers_for(id: u64, all: usize) -> impl Iterator<Item = usize> + Clone {
    let n = all.min(LISTENERS_PER_FRONTEND);
    let start = if all == 0 {
        0
    } else {
        (id % all as u64) as usize
    };
    (0..n).map(move |j| (start + j) % all)
}

fn transparent(s: &Socket, addr: SocketAddr) -> io::Result<()> {
    if addr.is_ipv4() {
        s.set_ip_transparent_v4(true)
    } else {
        s.set_ip_transparent_v6(true)
    }
}

/// A listener on `addr`, one of its `SO_REUSEPORT` group.
fn tcp_listener(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    transparent(&s, addr)?;
    // Accepted sockets inherit it: no setsockopt per connection.
    s.set_tcp_nodelay(true)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(4096)?;
    Ok(s.into())
}

/// The socket first datagrams of a UDP frontend arrive on. `IP_RECVORIGDSTADDR` names the
/// frontend in each datagram, as for any socket; `SO_REUSEADDR` lets the sessions bind their
/// connected client-facing sockets to the same address.
fn udp_socket(addr: SocketAddr) -> io::Result<Socket> {
    use nix::sys::socket::{setsockopt, sockopt};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, None)?;
    if addr.is_ipv4() {
        setsockopt(&s, sockopt::Ipv4OrigDstAddr, &true)?;
    } else {
        setsockopt(&s, sockopt::Ipv6OrigDstAddr, &true)?;
    }
    transparent(&s, addr)?;
    s.set_reuse_address(true)?;
    // As the TCP listeners: the next agent of the node binds beside this one and takes the
    // new flows when this one closes (flows with a session stay on their connected socket).
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    Ok(s)
}

/// Sockets waiting for new flows in this network namespace, per protocol and address: TCP
/// listeners and unconnected UDP sockets (`/proc/net/{tcp,tcp6,udp,udp6}`; what cannot be
/// read counts as none).
pub fn waiting_sockets() -> HashMap<(Protocol, SocketAddr), usize> {
    let mut out = HashMap::new();
    for (file, protocol) in [
        ("/proc/net/tcp", Protocol::Tcp),
        ("/proc/net/tcp6", Protocol::Tcp),
        ("/proc/net/udp", Protocol::Udp),
        ("/proc/net/udp6", Protocol::Udp),
    ] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        count_waiting(&text, protocol, &mut out);
    }
    out
}

/// [`waiting_sockets`] of one `/proc/net` table: TCP in LISTEN (0A), UDP unconnected (07,
/// no remote address).
fn count_waiting(text: &str, protocol: Protocol, out: &mut HashMap<(Protocol, SocketAddr), usize>) {
    let want = if protocol == Protocol::Tcp {
        "0A"
    } else {
        "07"
    };
    for line in text.lines().skip(1) {
        let mut f = line.split_whitespace().skip(1);
        let (Some(local), Some(remote), Some(st)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        // A connected UDP socket (a session's) has a remote address.
        if st != want || remote.chars().any(|c| c != '0' && c != ':') {
            continue;
        }
        if let Some(a) = proc_addr(local) {
            *out.entry((protocol, a)).or_default() += 1;
        }
    }
}

/// An address as `/proc/net` prints it: the address as native-endian 32-bit words in hex,
/// `:`, the port in hex.
fn proc_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for i in (0..ip.len()).step_by(8) {
        let word = u32::from_str_radix(ip.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The lowest port this process may not bind, when it lacks `CAP_NET_BIND_SERVICE`
/// (`net.ipv4.ip_unprivileged_port_start`); `None` when it may bind any.
pub fn privileged_ports_below() -> Option<u16> {
    const CAP_NET_BIND_SERVICE: u32 = 10;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    let eff = u64::from_str_radix(eff.trim(), 16).ok()?;
    if eff & (1 << CAP_NET_BIND_SERVICE) != 0 {
        return None;
    }
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start").ok()?;
    start.trim().parse().ok().filter(|p| *p > 0)
}

/// Why a frontend's socket could not be opened, with what to do about it.
fn listen_hint(e: &SetElement, error: &io::Error) -> &'static str {
    match error.kind() {
        io::ErrorKind::PermissionDenied if e.port < 1024 => {
            "ports below net.ipv4.ip_unprivileged_port_start need CAP_NET_BIND_SERVICE (the DaemonSet grants it)"
        }
        io::ErrorKind::AddrNotAvailable if e.vip.is_ipv6() => "is IPv6 disabled on this node?",
        _ => "",
    }
}

/// Whether this process may open transparent sockets (`CAP_NET_ADMIN`): checked at start, so
/// a missing capability is an error then, not a warning per frontend later.
pub fn can_open_transparent() -> io::Result<()> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    s.set_ip_transparent_v4(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_sockets_are_read_from_proc_net_tables() {
        let word = |b: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(b));
        let v4 = format!("{}:0050", word([198, 18, 100, 10]));
        let v6 = [
            [0x20, 0x01, 0, 2],
            [0, 0, 0, 0],
            [0, 0, 0, 0],
            [0, 0, 0, 0x10],
        ]
        .map(word)
        .concat()
            + ":1F90";
        let zero4 = "00000000:0000";
        let zero6 = format!("{}:0000", "0".repeat(32));
        let head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let tcp = format!(
            "{head}   0: {v4} {zero4} 0A 00000000:00000000 00:00000000 00000000     0        0 1\n   1: {v4} {zero4} 0A 0\n   2: {v4} {} 01 0\n   3: {v6} {zero6} 0A 0\n",
            word([198, 18, 0, 2]) + ":9C40"
        );
        let udp = format!(
            "{head}   0: {v4} {zero4} 07 0\n   1: {v4} {} 01 0\n   2: {v4} {} 07 0\n",
            word([198, 18, 0, 2]) + ":9C40",
            word([198, 18, 0, 3]) + ":9C41"
        );
        let mut out = HashMap::new();
        count_waiting(&tcp, Protocol::Tcp, &mut out);
        count_waiting(&udp, Protocol::Udp, &mut out);
        let a4: SocketAddr = "198.18.100.10:80".parse().unwrap();
        let a6: SocketAddr = "[2001:2::10]:8080".parse().unwrap();
        // Two listeners (the established connection is not one); one unconnected UDP socket
        // (the connected ones, even in state 07, are sessions).
        assert_eq!(out.get(&(Protocol::Tcp, a4)), Some(&2));
        assert_eq!(out.get(&(Protocol::Tcp, a6)), Some(&1));
        assert_eq!(out.get(&(Protocol::Udp, a4)), Some(&1));
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(proc_addr("zz:0050"), None);
    }

    #[test]
    fn a_frontend_listens_on_every_worker_or_on_four_taken_in_turn() {
        let of = |id, all| workers_for(id, all).collect::<Vec<_>>();
        assert_eq!(of(1, 2), [1, 0]);
        assert_eq!(of(2, 2), [0, 1]);
        assert_eq!(of(1, 1), [0]);
        assert!(of(1, 0).is_empty());
        assert_eq!(of(1, 64), [1, 2, 3, 4]);
        assert_eq!(of(63, 64), [63, 0, 1, 2]);
        // Over many frontends every worker gets its share.
        let mut per_worker = [0usize; 6];
        for id in 1..=600 {
            for w in workers_for(id, 6) {
                per_worker[w] += 1;
            }
        }
        assert_eq!(per_worker, [400; 6]);
    }

    #[test]
    fn a_feed_wakes_its_worker_and_hands_over_in_order() {
        let (tx, rx) = feed().unwrap();
        assert!(rx.drain().is_empty());
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        tx.send(Feed::Add(7, l));
        tx.send(Feed::Remove(7));
        // The eventfd counts the two sends.
        let mut fds = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(&**rx.wake()),
            nix::poll::PollFlags::POLLIN,
        )];
        assert_eq!(nix::poll::poll(&mut fds, 0u16).unwrap(), 1);
        let got = rx.drain();
        assert!(matches!(got.as_slice(), [Feed::Add(7, _), Feed::Remove(7)]));
        // Drained: no longer readable.
        assert_eq!(nix::poll::poll(&mut fds, 0u16).unwrap(), 0);
        drop(rx);
        // A worker that is gone: sending is a no-op.
        tx.send(Feed::Remove(8));
    }
}
