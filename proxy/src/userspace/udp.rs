//! UDP: per-client-flow sessions. The first datagram of a flow arrives on the TPROXY listener
//! with its original destination (IP_RECVORIGDSTADDR); the session then opens
//!
//! - an upstream socket connected to the backend (picked with Maglev), and
//! - a transparent downstream socket bound to the VIP:port and connected to the client, so
//!   the client's next datagrams go straight to it (the kernel prefers the connected socket)
//!   and replies leave with the VIP as their source.
//!
//! Sessions expire when idle; the table is bounded, in total and per client address, and a
//! session holds no buffer of its own: datagrams are relayed through one 64 KiB buffer per
//! thread (a session costs its two sockets and a task, not 128 KiB).

use std::{
    cell::RefCell,
    collections::HashMap,
    io::{self, IoSliceMut},
    net::{SocketAddr, SocketAddrV4, SocketAddrV6},
    os::fd::AsRawFd as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use mcs_model::Protocol;
use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg};
use socket2::{Domain, Socket, Type};
use tokio::{io::Interest, net::UdpSocket};

use super::{Shared, routes::normalize};

/// Largest datagram relayed.
const MAX_DATAGRAM_BYTES: usize = 65_535;

type SessionKey = (SocketAddr, SocketAddr);

/// Live sessions: (client, VIP) → upstream socket, and sessions per client address.
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<SessionTable>,
}

#[derive(Debug, Default)]
struct SessionTable {
    by_flow: HashMap<SessionKey, Arc<UdpSocket>>,
    per_client: HashMap<std::net::IpAddr, usize>,
}

thread_local! {
    /// The relay buffer of this thread: borrowed only between a `try_recv` and its
    /// `try_send`, never across an await.
    static RELAY_BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; MAX_DATAGRAM_BYTES].into_boxed_slice());
}

/// Receives first datagrams of a frontend's flows until shutdown. Each frontend has its own
/// socket and loop, so the datagram is read into the thread's relay buffer and only its bytes
/// are kept (a loop holds no 64 KiB buffer of its own while it waits).
pub async fn listen_loop(sock: UdpSocket, shared: Arc<Shared>, sessions: Arc<Sessions>) {
    let mut shutdown = shared.shutdown.clone();
    loop {
        tokio::select! {
            r = sock.readable() => if r.is_err() { return },
            () = super::stopped(&mut shutdown) => return,
        }
        let got = sock.try_io(Interest::READABLE, || {
            RELAY_BUF.with_borrow_mut(|buf| {
                Ok(recv_with_orig_dst(&sock, buf)?.map(|(n, c, v)| (buf[..n].to_vec(), c, v)))
            })
        });
        let (buf, client, vip) = match got {
            Ok(Some(x)) => x,
            Ok(None) => {
                tracing::debug!("udp datagram without source or original destination; dropped");
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::debug!(error = %e, "udp receive failed");
                continue;
            }
        };
        tracing::trace!(%client, %vip, bytes = buf.len(), "udp datagram on the listener");
        let existing = sessions
            .map
            .lock()
            .expect("sessions lock")
            .by_flow
            .get(&(client, vip))
            .cloned();
        if let Some(up) = existing {
            let _ = up.send(&buf).await;
            continue;
        }
        open_session(&shared, &sessions, client, vip, &buf).await;
    }
}

fn recv_with_orig_dst(
    sock: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<Option<(usize, SocketAddr, SocketAddr)>> {
    let mut cmsg = nix::cmsg_space!(libc::sockaddr_in6);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::empty(),
    )
    .map_err(io::Error::from)?;
    let n = msg.bytes;
    let client = msg.address.and_then(|a| {
        a.as_sockaddr_in()
            .map(|v4| SocketAddr::V4(SocketAddrV4::new(v4.ip(), v4.port())))
            .or_else(|| {
                a.as_sockaddr_in6()
                    .map(|v6| SocketAddr::V6(SocketAddrV6::new(v6.ip(), v6.port(), 0, 0)))
            })
    });
    let mut dst = None;
    for c in msg.cmsgs().map_err(io::Error::from)? {
        match c {
            ControlMessageOwned::Ipv4OrigDstAddr(a) => {
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                dst = Some(SocketAddr::V4(SocketAddrV4::new(
                    ip,
                    u16::from_be(a.sin_port),
                )));
            }
            ControlMessageOwned::Ipv6OrigDstAddr(a) => {
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                dst = Some(SocketAddr::V6(SocketAddrV6::new(
                    ip,
                    u16::from_be(a.sin6_port),
                    0,
                    0,
                )));
            }
            _ => {}
        }
    }
    Ok(match (client, dst) {
        (Some(c), Some(d)) => Some((n, normalize(c), normalize(d))),
        _ => None,
    })
}

async fn open_session(
    shared: &Arc<Shared>,
    sessions: &Arc<Sessions>,
    client: SocketAddr,
    vip: SocketAddr,
    first: &[u8],
) {
    let Some(route) = shared.routes.load().get(vip, Protocol::Udp).cloned() else {
        tracing::debug!(%vip, "udp: no route");
        return;
    };
    {
        let t = sessions.map.lock().expect("sessions lock");
        let of_client = t.per_client.get(&client.ip()).copied().unwrap_or(0);
        if t.by_flow.len() >= shared.config.max_udp_sessions
            || of_client >= shared.config.max_udp_sessions_per_client
        {
            drop(t);
            route.frontend_counters.refused.inc();
            tracing::debug!(%client, of_client, "udp: session table full (in total or for this client); datagram dropped");
            return;
        }
    }
    let Some((i, backend)) = route.pick(client, 0, 1, &super::routes::Tried::new()) else {
        route.frontend_counters.refused.inc();
        return;
    };
    let opened = (|| -> io::Result<(UdpSocket, UdpSocket)> {
        let bind_any: SocketAddr = if backend.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let up = std::net::UdpSocket::bind(bind_any)?;
        up.connect(backend)?;
        up.set_nonblocking(true)?;
        let down = Socket::new(Domain::for_address(vip), Type::DGRAM, None)?;
        if vip.is_ipv4() {
            down.set_ip_transparent_v4(true)?;
        } else {
            down.set_ip_transparent_v6(true)?;
        }
        down.set_reuse_address(true)?;
        down.bind(&vip.into())?;
        down.connect(&client.into())?;
        down.set_nonblocking(true)?;
        Ok((UdpSocket::from_std(up)?, UdpSocket::from_std(down.into())?))
    })();
    let (up, down) = match opened {
        Ok(s) => s,
        Err(e) => {
            route.backends.cells(i).connect_failures.inc();
            tracing::debug!(%client, %backend, error = %e, "cannot open udp session");
            return;
        }
    };
    let up = Arc::new(up);
    // Not `try_send`: a new socket's write readiness is not known yet.
    if let Err(e) = up.send(first).await {
        tracing::debug!(%backend, error = %e, "udp send to backend failed");
    }
    // The session holds its route's backends (one allocation shared with the route), not the
    // route with its Maglev table.
    let backends = route.backends.clone();
    let selected = route.selected();
    drop(route);
    let counters = backends.cells(i);
    counters.connections.inc();
    counters.bytes_tx.inc_by(first.len() as u64);
    {
        let mut t = sessions.map.lock().expect("sessions lock");
        t.by_flow.insert((client, vip), up.clone());
        *t.per_client.entry(client.ip()).or_insert(0) += 1;
    }
    shared.metrics.udp_sessions.inc();
    let (shared, sessions) = (shared.clone(), sessions.clone());
    tokio::spawn(async move {
        relay(&up, &down, (&backends, i, selected), &shared, vip, backend).await;
        {
            let mut t = sessions.map.lock().expect("sessions lock");
            if t.by_flow.remove(&(client, vip)).is_some()
                && let Some(n) = t.per_client.get_mut(&client.ip())
            {
                *n -= 1;
                if *n == 0 {
                    t.per_client.remove(&client.ip());
                }
            }
        }
        shared.metrics.udp_sessions.dec();
    });
}

/// Moves every datagram waiting on `from` to `to` through this thread's buffer (`Ok(true)`
/// when at least one moved); `Err` when `from` failed (the session ends). A datagram `to`
/// cannot take now is dropped, as UDP may.
/// An ICMP port unreachable on `from` (`ConnectionRefused`) is an error only with
/// `refused_ends` (from the backend: nothing listens there any more).
fn drain(
    from: &UdpSocket,
    to: &UdpSocket,
    bytes: &super::metrics::Count,
    refused_ends: bool,
) -> io::Result<bool> {
    RELAY_BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        let mut moved = false;
        loop {
            match from.try_recv(&mut buf) {
                Ok(n) => {
                    let _ = to.try_send(&buf[..n]);
                    bytes.inc_by(n as u64);
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(moved),
                // ICMP port unreachable shows up here: from the client, keep the session.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused && !refused_ends => {}
                Err(e) => return Err(e),
            }
        }
    })
}

/// The error pending on `s` (`SO_ERROR`), as an `Err`; none: `Ok`, and the error readiness
/// cleared (a spurious wake-up must not make the relay spin).
fn pending_error(s: &UdpSocket) -> io::Result<()> {
    let taken = s.try_io(tokio::io::Interest::ERROR, || match s.take_error() {
        Ok(Some(e)) => Ok(Err(e)),
        Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
        Err(e) => Ok(Err(e)),
    });
    match taken {
        Ok(pending) => pending,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(e),
    }
}

/// Relays a session until it is idle, fails, the forwarder stops, or its backend is no longer
/// selected for the VIP (then the session ends, and the client's next datagram opens a new
/// one to a selected backend: a flow never stays pinned to a removed backend). A backend that
/// answers with ICMP port unreachable (its pod died while its slice still says ready) ends
/// the session too and is skipped on this node (passive health), so the next datagram goes
/// to a backend that listens.
async fn relay(
    up: &UdpSocket,
    down: &UdpSocket,
    (backends, i, selected): (&super::metrics::Backends, usize, usize),
    shared: &Shared,
    vip: SocketAddr,
    backend: SocketAddr,
) {
    let counters = backends.cells(i);
    let mut answered = false;
    let idle: Duration = shared.config.udp_idle_timeout;
    let mut shutdown = shared.shutdown.clone();
    let mut generation = shared.routes.subscribe();
    loop {
        let moved = tokio::select! {
            // The client's side: its errors end the session but say nothing of the backend.
            r = down.readable() => r
                .and_then(|()| drain(down, up, &counters.bytes_tx, false).map(drop))
                .map_err(io::Error::other),
            r = up.readable() => r.and_then(|()| {
                if drain(up, down, &counters.bytes_rx, true)? {
                    // The backend answered: it is healthy (one load when it was).
                    answered = true;
                    backends.connected(i);
                }
                Ok(())
            }),
            // An ICMP error (port unreachable) wakes no reader: epoll says only EPOLLERR.
            r = up.ready(tokio::io::Interest::ERROR) => r.and_then(|_| pending_error(up)),
            changed = generation.changed() => {
                let still = changed.is_ok()
                    && shared
                        .routes
                        .load()
                        .get(vip, Protocol::Udp)
                        .is_some_and(|r| r.has_backend(backend));
                if still { Ok(()) } else { return }
            }
            () = tokio::time::sleep(idle) => return,
            () = super::stopped(&mut shutdown) => return,
        };
        match moved {
            Ok(()) => {}
            // ICMP port, host or network unreachable: the backend is gone.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::HostUnreachable
                        | io::ErrorKind::NetworkUnreachable
                ) =>
            {
                // Only a backend that never answered this session is blamed: an ICMP error
                // after replies ends the session (its flow starts again) without marking,
                // so a forged one cannot take a healthy backend out for everyone.
                counters.connect_failures.inc();
                let skipped = !answered && backends.connect_failed(i, selected);
                tracing::debug!(%vip, %backend, skipped, error = %e, "udp: the backend is unreachable (ICMP); session ended");
                return;
            }
            Err(_) => return,
        }
    }
}
