//! The harness's own small programs, run as `mcs-bench <tool>` inside the test namespaces:
//! a UDP echo server, a UDP request/response load generator, and a one-shot check.
//!
//! Why our own UDP generator: neither wrk nor iperf3 measures UDP request/response latency
//! (iperf3's UDP mode is one-way throughput). Each flow is one thread with one connected
//! socket and one datagram in flight (closed loop, like wrk's connections); buffers and the
//! histogram are allocated before the clock starts, so a request allocates nothing.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
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
