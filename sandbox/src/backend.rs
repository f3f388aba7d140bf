//! A request/reply backend in a network namespace, as a pod that serves one request per
//! connection: the demo's and the fault suite's backends.
//!
//! Each TCP connection is read to the client's half-close (at most [`MAX_REQUEST_BYTES`],
//! within the read timeout), then answered in one write with `<prefix><request>\n` and
//! closed; with UDP on, each datagram is answered the same way. Dropping the [`Backend`]
//! closes its sockets within [`STOP_WITHIN`], after which connections are refused, as from a
//! pod that is gone.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, UdpSocket},
    os::fd::AsFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use crate::netns::Netns;

/// The longest request read; the rest is left unread.
pub const MAX_REQUEST_BYTES: u64 = 4096;
/// How soon a dropped backend's sockets close.
pub const STOP_WITHIN: Duration = Duration::from_millis(10);

/// A running backend; stops when dropped.
#[derive(Debug)]
pub struct Backend {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Backend {
    /// Serves TCP (and UDP when `udp`) on `addr` inside `ns`, answering `<prefix><request>\n`;
    /// `read_timeout` bounds how long a connection may take to send its request.
    pub fn start(
        ns: &Netns,
        addr: SocketAddr,
        prefix: String,
        udp: bool,
        read_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let tcp = ns.run(|| TcpListener::bind(addr))??;
        let udp = if udp {
            Some(ns.run(|| UdpSocket::bind(addr))??)
        } else {
            None
        };
        Self::serve(addr, tcp, udp, prefix, read_timeout)
    }

    /// As [`Backend::start`], in this process's own network namespace (a pod's: the lifecycle
    /// suite's backends, `mcs-bench serve`).
    pub fn start_here(
        addr: SocketAddr,
        prefix: String,
        udp: bool,
        read_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let tcp = TcpListener::bind(addr)?;
        let udp = if udp {
            Some(UdpSocket::bind(addr)?)
        } else {
            None
        };
        Self::serve(addr, tcp, udp, prefix, read_timeout)
    }

    fn serve(
        addr: SocketAddr,
        tcp: TcpListener,
        udp: Option<UdpSocket>,
        prefix: String,
        read_timeout: Duration,
    ) -> anyhow::Result<Self> {
        if let Some(u) = &udp {
            u.set_read_timeout(Some(STOP_WITHIN))?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let prefix: Arc<str> = prefix.into();
        let (s, p) = (stop.clone(), prefix.clone());
        std::thread::spawn(move || {
            // poll(2) with a timeout: accept at once when a connection waits, and notice a
            // stop within STOP_WITHIN (the listener then closes and connects are refused).
            let ms = STOP_WITHIN.as_millis() as u16;
            while !s.load(Ordering::Acquire) {
                let mut fds = [nix::poll::PollFd::new(
                    tcp.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                if !matches!(nix::poll::poll(&mut fds, ms), Ok(n) if n > 0) {
                    continue;
                }
                let Ok((c, _)) = tcp.accept() else { continue };
                let p = p.clone();
                std::thread::spawn(move || {
                    let _ = c.set_read_timeout(Some(read_timeout));
                    // The whole request, then the whole reply in one write: closing with
                    // unread bytes would send a reset.
                    let mut req = Vec::new();
                    if (&c).take(MAX_REQUEST_BYTES).read_to_end(&mut req).is_ok() {
                        let _ = (&c).write_all(reply(&p, &req).as_bytes());
                    }
                });
            }
        });
        if let Some(udp) = udp {
            let s = stop.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while !s.load(Ordering::Acquire) {
                    if let Ok((n, from)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(reply(&prefix, &buf[..n]).as_bytes(), from);
                    }
                }
            });
        }
        Ok(Backend { addr, stop })
    }

    /// The address it serves.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn reply(prefix: &str, request: &[u8]) -> String {
    format!("{prefix}{}\n", String::from_utf8_lossy(request))
}
