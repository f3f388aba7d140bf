//! The harness's own small programs, run as `mcs-bench <tool>` inside the test namespaces:
//! a UDP echo server, a UDP request/response load generator, a TCP bulk sender and its
//! sink, and a one-shot check.
//!
//! Why our own UDP generator: neither wrk nor iperf3 measures UDP request/response latency
//! (iperf3's UDP mode is one-way throughput). Each flow is one thread with one connected
//! socket and one datagram in flight (closed loop, like wrk's connections); buffers and the
//! histogram are allocated before the clock starts, so a request allocates nothing.
//!
//! Why our own bulk sender: iperf3 3.12 (Debian 12) runs all its streams on one thread. With
//! 8 streams through a proxy its client sat at 87–98% of a core while the proxy had CPU to
//! spare, so the figure was the client's ceiling, not the proxy's (`top` during
//! `--workloads bulk-n`, 2026-12-02). `tcp-bulk` runs each stream on a thread of its own
//! writing 128 KiB at a time (iperf3's default), and the sink says how many bytes it
//! received on each connection: a stream whose bytes did not all arrive fails the run.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Barrier,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use super::stats::{Histogram, PERCENTILES};

/// Echoes every datagram back to its sender, forever.
pub fn udp_echo(listen: SocketAddr) -> anyhow::Result<()> {
    let sock = UdpSocket::bind(listen).with_context(|| format!("binding {listen}"))?;
    let mut buf = [0u8; 2048];
    loop {
        let (n, from) = sock.recv_from(&mut buf)?;
        // A send error (e.g. the client went away) is not fatal for the server.
        let _ = sock.send_to(&buf[..n], from);
    }
}

/// What `udp-rr` prints (one JSON line).
#[derive(Debug, Serialize, Deserialize)]
pub struct UdpReport {
    /// Answered requests.
    pub requests: u64,
    /// Requests without an answer within the timeout.
    pub lost: u64,
    /// Measured wall time.
    pub seconds: f64,
    /// (percentile, microseconds) of the answered requests.
    pub percentiles: Vec<(f64, f64)>,
}

/// Runs `flows` closed-loop flows of `size`-byte datagrams for `seconds`, spread over
/// `targets` round-robin; a request unanswered within 200 ms counts as lost.
pub fn udp_rr(
    targets: &[SocketAddr],
    flows: usize,
    seconds: f64,
    size: usize,
) -> anyhow::Result<UdpReport> {
    if targets.is_empty() || flows == 0 || !(8..=1400).contains(&size) {
        bail!("udp-rr needs targets, flows > 0 and 8 <= size <= 1400");
    }
    let duration = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let results: Vec<anyhow::Result<(Histogram, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..flows)
            .map(|i| {
                let target = targets[i % targets.len()];
                s.spawn(move || flow(target, duration, size))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("flow panicked")))
            })
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut hist = Histogram::default();
    let mut lost = 0;
    for r in results {
        let (h, l) = r?;
        hist.merge(&h);
        lost += l;
    }
    Ok(UdpReport {
        requests: hist.count(),
        lost,
        seconds: elapsed,
        percentiles: PERCENTILES
            .iter()
            .map(|&p| (p, hist.percentile(p) as f64 / 1000.0))
            .collect(),
    })
}

fn flow(target: SocketAddr, duration: Duration, size: usize) -> anyhow::Result<(Histogram, u64)> {
    let bind: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let sock = UdpSocket::bind(bind)?;
    sock.connect(target)
        .with_context(|| format!("connecting to {target}"))?;
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut hist = Histogram::default();
    let mut out = vec![0u8; size];
    let mut back = vec![0u8; 2048];
    let mut lost = 0u64;
    let end = Instant::now() + duration;
    let mut seq = 0u64;
    while Instant::now() < end {
        seq += 1;
        out[..8].copy_from_slice(&seq.to_le_bytes());
        let t0 = Instant::now();
        if sock.send(&out).is_err() {
            lost += 1;
            continue;
        }
        loop {
            match sock.recv(&mut back) {
                // A late answer to an earlier request is skipped, not counted twice.
                Ok(n) if n >= 8 && back[..8] == seq.to_le_bytes() => {
                    hist.record(t0.elapsed().as_nanos() as u64);
                    break;
                }
                Ok(_) => continue,
                Err(_) => {
                    lost += 1;
                    break;
                }
            }
        }
    }
    Ok((hist, lost))
}

/// Bytes a bulk stream writes (and the sink reads) per system call: iperf3's default.
const BULK_CHUNK: usize = 128 * 1024;

/// Most connections the sink serves at once (each on a thread of its own).
const SINK_MAX_CONNECTIONS: usize = 256;

/// What `tcp-bulk` prints (one JSON line).
#[derive(Debug, Serialize, Deserialize)]
pub struct BulkReport {
    /// Streams, each on a thread of its own.
    pub streams: usize,
    /// Bytes received by the sink, over all streams (each stream's equal to what it sent).
    pub bytes: u64,
    /// From the first stream's first write until the sink had confirmed every stream.
    pub seconds: f64,
    /// TCP segments this network namespace retransmitted meanwhile (`/proc/net/snmp`).
    pub retransmits: u64,
}

/// Receives TCP streams, forever: each connection is read to its end on a thread of its own,
/// then told how many bytes arrived (8 bytes, little-endian) and closed.
pub fn tcp_sink(listen: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
    serve_sink(&listener)
}

fn serve_sink(listener: &TcpListener) -> ! {
    static OPEN: AtomicUsize = AtomicUsize::new(0);
    loop {
        let Ok((mut conn, _)) = listener.accept() else {
            continue;
        };
        if OPEN.fetch_add(1, Ordering::Relaxed) >= SINK_MAX_CONNECTIONS {
            OPEN.fetch_sub(1, Ordering::Relaxed);
            eprintln!("tcp-sink: over {SINK_MAX_CONNECTIONS} connections; closing one");
            continue;
        }
        std::thread::spawn(move || {
            let mut buf = vec![0u8; BULK_CHUNK];
            let mut received = 0u64;
            let ended = conn
                .set_read_timeout(Some(Duration::from_secs(30)))
                .and_then(|()| {
                    loop {
                        match conn.read(&mut buf) {
                            Ok(0) => break Ok(()),
                            Ok(n) => received += n as u64,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => break Err(e),
                        }
                    }
                });
            // A connection that did not end cleanly gets no count: its sender fails.
            if ended.is_ok() {
                let _ = conn.write_all(&received.to_le_bytes());
            }
            OPEN.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Sends `streams` TCP streams to the sink at `target` for `seconds`, each from a thread of
/// its own, and reports the bytes the sink received. Fails when a stream cannot connect,
/// stalls for 10 s, or the sink received other than what it sent.
pub fn tcp_bulk(target: SocketAddr, streams: usize, seconds: f64) -> anyhow::Result<BulkReport> {
    let valid = (1..=SINK_MAX_CONNECTIONS).contains(&streams) && seconds > 0.0 && seconds <= 600.0;
    if !valid {
        bail!("tcp-bulk needs 1 to {SINK_MAX_CONNECTIONS} streams and 0 < seconds <= 600");
    }
    let duration = Duration::from_secs_f64(seconds);
    let retransmitted = tcp_retransmits()?;
    // Every stream connects, then all start together (the clock starts then).
    let barrier = Barrier::new(streams + 1);
    let results: Vec<anyhow::Result<Sent>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..streams)
            .map(|_| s.spawn(|| bulk_stream(target, duration, &barrier)))
            .collect();
        barrier.wait();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("stream panicked")))
            })
            .collect()
    });
    let mut bytes = 0;
    let mut span: Option<(Instant, Instant)> = None;
    for (i, r) in results.into_iter().enumerate() {
        let sent = r.with_context(|| format!("stream {} of {streams} to {target}", i + 1))?;
        bytes += sent.bytes;
        span = Some(span.map_or((sent.start, sent.end), |(a, b)| {
            (a.min(sent.start), b.max(sent.end))
        }));
    }
    let seconds = span.map_or(0.0, |(a, b)| (b - a).as_secs_f64());
    Ok(BulkReport {
        streams,
        bytes,
        seconds,
        retransmits: tcp_retransmits()?.saturating_sub(retransmitted),
    })
}

/// What one stream sent, from its first write until the sink confirmed it.
struct Sent {
    bytes: u64,
    start: Instant,
    end: Instant,
}

fn bulk_stream(target: SocketAddr, duration: Duration, barrier: &Barrier) -> anyhow::Result<Sent> {
    let conn = TcpStream::connect_timeout(&target, Duration::from_secs(3));
    let buf = vec![0x5a_u8; BULK_CHUNK];
    // Waited for even when the connect failed, so the others are not held.
    barrier.wait();
    let mut conn = conn.with_context(|| format!("connecting to {target}"))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < duration {
        sent += conn.write(&buf).context("sending")? as u64;
    }
    conn.shutdown(std::net::Shutdown::Write)?;
    let mut count = [0u8; 8];
    conn.read_exact(&mut count)
        .context("reading the sink's count of bytes received")?;
    let received = u64::from_le_bytes(count);
    if received != sent {
        bail!("sent {sent} bytes, the sink received {received}");
    }
    Ok(Sent {
        bytes: sent,
        start,
        end: Instant::now(),
    })
}

/// `RetransSegs` of this network namespace's TCP (`/proc/net/snmp`).
fn tcp_retransmits() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/net/snmp")?;
    retrans_segs(&text).context("no Tcp RetransSegs in /proc/net/snmp")
}

/// `RetransSegs` from the text of `/proc/net/snmp` (a `Tcp:` header line, then its values).
fn retrans_segs(snmp: &str) -> Option<u64> {
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next()?, tcp.next()?);
    let at = names.split_whitespace().position(|n| n == "RetransSegs")?;
    values.split_whitespace().nth(at)?.parse().ok()
}

/// One HTTP/1.0 GET (expects a 200) and, if `udp` is given, one UDP echo; for checking that
/// a mode forwards before measuring it.
pub fn check(http: SocketAddr, udp: Option<SocketAddr>) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(3);
    let mut s = TcpStream::connect_timeout(&http, timeout)
        .with_context(|| format!("connecting to {http}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(b"GET / HTTP/1.0\r\nHost: bench\r\n\r\n")?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .with_context(|| format!("reading from {http}"))?;
    if !answer.starts_with("HTTP/1.1 200") {
        bail!("unexpected answer from {http}: {answer:?}");
    }
    if let Some(udp) = udp {
        let r = udp_rr(&[udp], 1, 0.2, 64)?;
        if r.requests == 0 {
            bail!("no UDP echo through {udp} ({} lost)", r.lost);
        }
    }
    Ok(())
}

/// The A records of `name` and the response code, asked once (UDP) of the DNS server at
/// `server`; an error when no answer comes within `timeout`.
pub fn resolve_a(
    server: SocketAddr,
    name: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<(hickory_proto::op::ResponseCode, Vec<std::net::IpAddr>)> {
    use hickory_proto::{
        op::{Message, Query},
        rr::{Name, RData, RecordType},
    };
    let mut q = Message::query();
    q.add_query(Query::query(Name::from_ascii(name)?, RecordType::A));
    let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
    s.set_read_timeout(Some(timeout))?;
    s.send_to(&q.to_vec()?, server)?;
    let mut buf = [0u8; 4096];
    let (n, _) = s
        .recv_from(&mut buf)
        .with_context(|| format!("no DNS answer from {server}"))?;
    let m = Message::from_vec(&buf[..n])?;
    let ips = m
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(std::net::IpAddr::V4(a.0)),
            _ => None,
        })
        .collect();
    Ok((m.metadata.response_code, ips))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retransmits_are_read_from_snmp() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm RtoMin RetransSegs InErrs\nTcp: 1 200 42 0\n";
        assert_eq!(retrans_segs(snmp), Some(42));
        assert_eq!(retrans_segs("Tcp: RtoAlgorithm\nTcp: 1\n"), None);
    }

    /// Streams through loopback to a real sink: every byte sent is confirmed.
    #[test]
    fn bulk_streams_are_confirmed_by_the_sink() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve_sink(&listener));
        let r = tcp_bulk(addr, 3, 0.2).unwrap();
        assert_eq!(r.streams, 3);
        assert!(r.bytes > 0 && r.seconds >= 0.2, "{r:?}");
    }

    /// A sink that received fewer bytes than were sent fails the run.
    #[test]
    fn bytes_that_did_not_arrive_fail_the_run() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut buf = vec![0u8; BULK_CHUNK];
            let mut n = 0u64;
            while let Ok(k @ 1..) = c.read(&mut buf) {
                n += k as u64;
            }
            let _ = c.write_all(&(n - 1).to_le_bytes());
        });
        let e = tcp_bulk(addr, 1, 0.1).unwrap_err();
        assert!(format!("{e:#}").contains("the sink received"), "{e:#}");
    }
}
