//! The fixture of the eBPF socket LB's tests: a pin directory of its own under bpffs, a
//! network namespace for the backends and the clients, and a cgroup the clients run in
//! (probe children, [`crate::probe`]). Every part is removed on drop, in reverse order.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    thread,
};

use crate::{
    cgroup::TestCgroup,
    netns::Netns,
    prereq,
    probe::{Probe, ProbeResult},
};

/// A pin directory under bpffs, removed with what is pinned in it on drop: unpinning the
/// links detaches the programs (nothing else holds them once the loader is gone).
#[derive(Debug)]
pub struct PinDir(pub PathBuf);

impl PinDir {
    pub fn new() -> Self {
        PinDir(Path::new("/sys/fs/bpf").join(crate::unique_name("pin")))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Default for PinDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Pins, the clients' cgroup and the namespace (fields drop in this order).
#[derive(Debug)]
pub struct Fixture {
    pub pins: PinDir,
    pub cg: TestCgroup,
    pub ns: Netns,
}

impl Fixture {
    /// A fresh fixture tagged `tag`, or `None` (skipped with the reason printed; a failure
    /// with `CI=true`) where the socket LB's prerequisites are missing.
    pub fn new(tag: &str) -> Option<Self> {
        if !crate::require(prereq::socket_lb()) {
            return None;
        }
        Some(Fixture {
            pins: PinDir::new(),
            cg: TestCgroup::new(tag).expect("test cgroup"),
            ns: Netns::new(tag).expect("test netns"),
        })
    }

    /// Runs `p` as a probe child inside the cgroup and the namespace.
    pub fn probe(&self, p: &Probe) -> ProbeResult {
        probe_in(&self.cg, &self.ns, p)
    }

    /// A TCP backend in the namespace on `addr` (port 0: any) answering
    /// `backend <port> got <request>` after the client's half-close.
    pub fn tcp_backend(&self, addr: &str) -> SocketAddr {
        tcp_backend(&self.ns, addr)
    }

    /// A UDP backend in the namespace answering each datagram `backend <port> got <datagram>`.
    pub fn udp_backend(&self, addr: &str) -> SocketAddr {
        udp_backend(&self.ns, addr)
    }

    /// A TCP backend on 127.0.0.1 in the namespace that runs `serve` on each connection.
    pub fn special_tcp_backend(&self, serve: fn(TcpStream)) -> SocketAddr {
        let l = self
            .ns
            .run(|| TcpListener::bind("127.0.0.1:0"))
            .unwrap()
            .expect("bind backend");
        let local = l.local_addr().unwrap();
        thread::spawn(move || {
            for s in l.incoming().flatten() {
                thread::spawn(move || serve(s));
            }
        });
        local
    }
}

/// Runs `p` as a probe child inside `cg` and `ns`.
pub fn probe_in(cg: &TestCgroup, ns: &Netns, p: &Probe) -> ProbeResult {
    let mut cmd = cg.command(Some(ns), &Probe::program());
    p.configure(&mut cmd);
    Probe::parse(&cmd.output().expect("run probe")).expect("probe result")
}

/// A TCP probe that sends `hi`, half-closes and reads the answer.
pub fn tcp(to: &str) -> Probe {
    Probe::Tcp {
        to: to.parse().unwrap(),
        send: "hi".into(),
    }
}

/// A TCP backend in `ns` on `addr` answering `backend <port> got <request>` after the client's
/// half-close, until the test ends.
pub fn tcp_backend(ns: &Netns, addr: &str) -> SocketAddr {
    let l = ns
        .run(|| TcpListener::bind(addr))
        .unwrap()
        .expect("bind backend");
    let local = l.local_addr().unwrap();
    thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut req = String::new();
            let _ = s.read_to_string(&mut req);
            let _ = write!(s, "backend {} got {req}", local.port());
        }
    });
    local
}

/// A UDP backend in `ns` on `addr` answering each datagram `backend <port> got <datagram>`.
pub fn udp_backend(ns: &Netns, addr: &str) -> SocketAddr {
    let u = ns
        .run(|| UdpSocket::bind(addr))
        .unwrap()
        .expect("bind udp backend");
    let local = u.local_addr().unwrap();
    thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = u.recv_from(&mut buf) {
            let reply = format!(
                "backend {} got {}",
                local.port(),
                String::from_utf8_lossy(&buf[..n])
            );
            let _ = u.send_to(reply.as_bytes(), from);
        }
    });
    local
}
