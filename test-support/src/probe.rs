//! A network client that runs as a child process, so that a test can place it in a cgroup
//! (where eBPF socket hooks apply) and a network namespace.
//!
//! The child is the test binary itself: put [`probe_entry!`](crate::probe_entry) at the root
//! of the integration test file; it defines a test `mcs_probe_entry` that does nothing in a
//! normal run and, when started by [`Probe::command`] with the probe's spec in its
//! environment, performs the probe, prints the result on a marked line and exits.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Command, Output},
    time::Duration,
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

const SPEC_ENV: &str = "MCS_PROBE_SPEC";
const MARKER: &str = "MCS-PROBE-RESULT ";
/// Bound on every probe's connect and reads.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Defines the test `mcs_probe_entry` that runs a probe when asked. Use it once, at the root
/// of an integration test file.
#[macro_export]
macro_rules! probe_entry {
    () => {
        /// Entry point of probe child processes (a no-op in a normal test run).
        #[test]
        fn mcs_probe_entry() {
            $crate::probe::entry();
        }
    };
}

/// What the probe does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Probe {
    /// TCP connect to `to`, send `send`, read until EOF.
    Tcp {
        /// Destination (e.g. a VIP).
        to: SocketAddr,
        /// Bytes to send, then half-close.
        send: String,
    },
    /// UDP `sendto` (unconnected) to `to`, one `recvfrom`; `peer` is the reply's source.
    Udp {
        /// Destination.
        to: SocketAddr,
        /// Datagram.
        send: String,
    },
    /// Connected UDP: `connect(to)`, `send`, `recv`; `peer` is `getpeername()`.
    UdpConnected {
        /// Destination.
        to: SocketAddr,
        /// Datagram.
        send: String,
    },
    /// TCP connect to `to`, send `send`, wait 100 ms, then close with a reset (SO_LINGER 0).
    TcpReset {
        /// Destination.
        to: SocketAddr,
        /// Bytes to send before the reset.
        send: String,
    },
    /// Unconnected UDP from one socket: `segments` × `per_segment` `sendto`/`recvfrom`
    /// exchanges. After each segment but the last, the probe writes the last reply to
    /// `<sync_dir>/seg<k>` and waits (bounded, 60 s) for `<sync_dir>/go<k>`, so that the test
    /// can reprogram the dataplane between segments. `replies` holds every reply in order.
    UdpSegments {
        /// Destination.
        to: SocketAddr,
        /// Exchanges per segment.
        per_segment: u32,
        /// Segments.
        segments: u32,
        /// Directory of the sync files.
        sync_dir: PathBuf,
    },
    /// `sockets` UDP sockets, each created, sending two datagrams to `to` (the second finds
    /// its reverse entry, so the kernel's LRU counts it as used) and closed, without reading
    /// replies (a pod that churns sockets); bounded by the count.
    UdpFlood {
        /// Destination.
        to: SocketAddr,
        /// Sockets to churn.
        sockets: u32,
    },
    /// One TCP connection per size in `sizes`: a pseudo-random payload of that size (from
    /// `seed` and its index) is sent while the reply is read, then the write side half-closed;
    /// an echoing backend must send it back byte for byte before EOF. `ok` counts payloads that
    /// came back exact, `failed` the others (`error`: the first).
    TcpEchoPayloads {
        /// Destination.
        to: SocketAddr,
        /// Payload sizes, in bytes.
        sizes: Vec<usize>,
        /// Seed of the payloads.
        seed: u64,
    },
    /// `count` TCP request/response exchanges, one new connection each, `interval_ms` apart;
    /// counts successes and failures (bounded: count × (interval + timeout)).
    TcpLoop {
        /// Destination.
        to: SocketAddr,
        /// Connections.
        count: u32,
        /// Pause between connections.
        interval_ms: u64,
    },
}

/// What the kernel did with the probe's socket.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProbeResult {
    /// `getsockname()` after connect.
    pub local: Option<SocketAddr>,
    /// `getpeername()` after connect.
    pub peer: Option<SocketAddr>,
    /// What came back.
    pub reply: String,
    /// The error, if the probe failed.
    pub error: Option<String>,
    /// `TcpLoop`: exchanges that worked.
    pub ok: u32,
    /// `TcpLoop`: exchanges that failed.
    pub failed: u32,
    /// `UdpSegments`: every reply, in order.
    #[serde(default)]
    pub replies: Vec<String>,
    /// `UdpSegments`: the source of every reply, in order.
    #[serde(default)]
    pub peers: Vec<SocketAddr>,
}

impl Probe {
    /// The command that runs this probe in a child process (wrap it with
    /// [`crate::cgroup::TestCgroup::command`] or [`crate::netns::Netns::command`] as needed:
    /// use [`Probe::program`] and [`Probe::args`] for that).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(Self::program());
        self.configure(&mut cmd);
        cmd
    }

    /// The test binary.
    pub fn program() -> PathBuf {
        std::env::current_exe().expect("current test binary")
    }

    /// Adds the arguments and environment of this probe to `cmd` (whose program is, possibly
    /// through wrappers, [`Probe::program`]).
    pub fn configure(&self, cmd: &mut Command) {
        cmd.args([
            "mcs_probe_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--quiet",
        ])
        .env(SPEC_ENV, serde_json::to_string(self).expect("probe spec"));
    }

    /// Parses a probe child's output.
    pub fn parse(out: &Output) -> anyhow::Result<ProbeResult> {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(MARKER))
            .with_context(|| {
                format!(
                    "probe printed no result ({}); stdout: {stdout}; stderr: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
        Ok(serde_json::from_str(line)?)
    }
}

/// Body of `mcs_probe_entry`.
pub fn entry() {
    let Ok(spec) = std::env::var(SPEC_ENV) else {
        return;
    };
    let probe: Probe = serde_json::from_str(&spec).expect("probe spec from the parent test");
    let result = run(&probe);
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(
        stdout,
        "{MARKER}{}",
        serde_json::to_string(&result).expect("json")
    );
    let _ = stdout.flush();
    std::process::exit(0);
}

fn run(probe: &Probe) -> ProbeResult {
    let mut result = ProbeResult::default();
    match probe {
        Probe::Tcp { to, send } => {
            let mut attempt = || -> std::io::Result<()> {
                let mut s = TcpStream::connect_timeout(to, PROBE_TIMEOUT)?;
                result.local = s.local_addr().ok();
                result.peer = s.peer_addr().ok();
                s.set_read_timeout(Some(PROBE_TIMEOUT))?;
                s.write_all(send.as_bytes())?;
                s.shutdown(std::net::Shutdown::Write)?;
                s.read_to_string(&mut result.reply)?;
                Ok(())
            };
            if let Err(e) = attempt() {
                result.error = Some(e.to_string());
            }
        }
        Probe::Udp { to, send } => {
            let attempt = || -> std::io::Result<(SocketAddr, String)> {
                let s = std::net::UdpSocket::bind(wildcard(*to))?;
                s.set_read_timeout(Some(PROBE_TIMEOUT))?;
                s.send_to(send.as_bytes(), to)?;
                let mut buf = [0u8; 2048];
                let (n, from) = s.recv_from(&mut buf)?;
                Ok((from, String::from_utf8_lossy(&buf[..n]).to_string()))
            };
            match attempt() {
                Ok((from, reply)) => {
                    result.peer = Some(from);
                    result.reply = reply;
                }
                Err(e) => result.error = Some(e.to_string()),
            }
        }
        Probe::UdpConnected { to, send } => {
            let attempt = || -> std::io::Result<(Option<SocketAddr>, String)> {
                let s = std::net::UdpSocket::bind(wildcard(*to))?;
                s.set_read_timeout(Some(PROBE_TIMEOUT))?;
                s.connect(to)?;
                let peer = s.peer_addr().ok();
                s.send(send.as_bytes())?;
                let mut buf = [0u8; 2048];
                let n = s.recv(&mut buf)?;
                Ok((peer, String::from_utf8_lossy(&buf[..n]).to_string()))
            };
            match attempt() {
                Ok((peer, reply)) => {
                    result.peer = peer;
                    result.reply = reply;
                }
                Err(e) => result.error = Some(e.to_string()),
            }
        }
        Probe::TcpReset { to, send } => {
            let mut attempt = || -> std::io::Result<()> {
                let mut s = TcpStream::connect_timeout(to, PROBE_TIMEOUT)?;
                result.peer = s.peer_addr().ok();
                s.write_all(send.as_bytes())?;
                std::thread::sleep(Duration::from_millis(100));
                let abort = nix::libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &abort)
                    .map_err(std::io::Error::from)?;
                drop(s);
                Ok(())
            };
            if let Err(e) = attempt() {
                result.error = Some(e.to_string());
            }
        }
        Probe::UdpSegments {
            to,
            per_segment,
            segments,
            sync_dir,
        } => {
            let mut attempt = || -> std::io::Result<()> {
                let s = std::net::UdpSocket::bind(wildcard(*to))?;
                s.set_read_timeout(Some(PROBE_TIMEOUT))?;
                let mut buf = [0u8; 2048];
                for seg in 0..*segments {
                    if seg > 0 {
                        let k = seg - 1;
                        let last = result.replies.last().cloned().unwrap_or_default();
                        std::fs::write(sync_dir.join(format!("seg{k}")), last)?;
                        let go = sync_dir.join(format!("go{k}"));
                        let deadline = std::time::Instant::now() + Duration::from_secs(60);
                        while !go.exists() {
                            if std::time::Instant::now() > deadline {
                                return Err(std::io::Error::other(format!("no {}", go.display())));
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    for i in 0..*per_segment {
                        s.send_to(format!("s{seg}.{i}").as_bytes(), to)?;
                        let (n, from) = s.recv_from(&mut buf)?;
                        result
                            .replies
                            .push(String::from_utf8_lossy(&buf[..n]).to_string());
                        result.peers.push(from);
                    }
                }
                Ok(())
            };
            if let Err(e) = attempt() {
                result.error = Some(e.to_string());
            }
        }
        Probe::UdpFlood { to, sockets } => {
            for _ in 0..*sockets {
                let sent = std::net::UdpSocket::bind(wildcard(*to)).and_then(|s| {
                    s.send_to(b"flood", to)?;
                    s.send_to(b"flood", to)
                });
                match sent {
                    Ok(_) => result.ok += 1,
                    Err(_) => result.failed += 1,
                }
            }
        }
        Probe::TcpEchoPayloads { to, sizes, seed } => {
            for (i, &len) in sizes.iter().enumerate() {
                let data = payload(seed.wrapping_add(i as u64), len);
                match echo_once(to, &data) {
                    Ok(got) if got == data => result.ok += 1,
                    Ok(got) => {
                        result.failed += 1;
                        result.error.get_or_insert_with(|| {
                            format!("a {len} B payload came back as {} B, changed", got.len())
                        });
                    }
                    Err(e) => {
                        result.failed += 1;
                        result
                            .error
                            .get_or_insert_with(|| format!("a {len} B payload: {e}"));
                    }
                }
            }
        }
        Probe::TcpLoop {
            to,
            count,
            interval_ms,
        } => {
            for i in 0..*count {
                let one = || -> std::io::Result<bool> {
                    let mut s = TcpStream::connect_timeout(to, PROBE_TIMEOUT)?;
                    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
                    write!(s, "loop{i}")?;
                    s.shutdown(std::net::Shutdown::Write)?;
                    let mut out = String::new();
                    s.read_to_string(&mut out)?;
                    Ok(!out.is_empty())
                };
                match one() {
                    Ok(true) => result.ok += 1,
                    Ok(false) => result.failed += 1,
                    Err(e) => {
                        result.failed += 1;
                        result.error.get_or_insert_with(|| e.to_string());
                    }
                }
                std::thread::sleep(Duration::from_millis(*interval_ms));
            }
        }
    }
    result
}

/// The unspecified address with port 0 of `to`'s family (to bind a client socket).
fn wildcard(to: SocketAddr) -> SocketAddr {
    if to.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    }
}

/// Payload sizes of the byte-exact tests: 1 B to 8 MiB, around the copy buffer (16 KiB) and
/// pipe (64 KiB) sizes.
pub const PAYLOAD_SIZES: [usize; 12] = [
    1,
    7,
    1_000,
    16_383,
    16_384,
    16_385,
    65_535,
    65_537,
    300_001,
    1 << 20,
    3_000_017,
    8 << 20,
];

/// An echoing backend's connection: sends back everything it reads, then half-closes after
/// the peer's EOF (5 s read timeout; any error ends it).
pub fn echo_until_eof(s: TcpStream) {
    let _ = s.set_read_timeout(Some(PROBE_TIMEOUT));
    let mut buf = vec![0u8; 65_536];
    loop {
        match (&s).read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if (&s).write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Write);
}

/// `len` pseudo-random bytes from `seed` (xorshift64).
pub fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Sends `data` to `to` on a new connection while reading the reply (so neither side's
/// buffers stall), half-closes, and returns everything read before EOF.
fn echo_once(to: &SocketAddr, data: &[u8]) -> std::io::Result<Vec<u8>> {
    let s = TcpStream::connect_timeout(to, PROBE_TIMEOUT)?;
    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
    let w = s.try_clone()?;
    std::thread::scope(|scope| {
        let writer = scope.spawn(move || -> std::io::Result<()> {
            (&w).write_all(data)?;
            w.shutdown(std::net::Shutdown::Write)
        });
        let mut got = Vec::with_capacity(data.len());
        let read = (&s).read_to_end(&mut got);
        let wrote = writer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("writer panicked")));
        read?;
        wrote?;
        Ok(got)
    })
}
