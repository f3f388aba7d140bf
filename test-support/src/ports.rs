//! Loopback ports for the servers a test starts (kube-apiserver, etcd, an agent's metrics).
//!
//! `bind(127.0.0.1:0)` hands out a port from the kernel's ephemeral range, then gives it
//! back: until the server binds it, any outgoing connection of any process may take it as its
//! source port (this failed CI: kube-apiserver "address already in use"). The ports here come
//! from outside that range (`ip_local_port_range`), where the kernel never picks a source
//! port: 20000–29999 (below the default range and Kubernetes' NodePorts, which kube-proxy
//! may answer on loopback), or above the range when it starts that low; they are checked
//! free for TCP and UDP and never handed out twice by one process.

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// The ports drawn from when the ephemeral range starts above them: above the well-known and
/// most registered service ports, below the NodePort range (30000–32767).
const PREFERRED: std::ops::Range<u16> = 20_000..30_000;

/// Ports this process handed out already.
static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A loopback port that was free for TCP and UDP a moment ago, below the ephemeral range, not
/// given out before by this process. Fails only when no such port is found in 2,000 draws.
pub fn unused_port() -> std::io::Result<u16> {
    let range = outside_ephemeral();
    let (lowest, span) = (range.start, u64::from(range.end - range.start));
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    let mut draw = seed();
    for _ in 0..2_000 {
        draw = next(draw);
        let port = lowest + (draw % span) as u16;
        if given.contains(&port) {
            continue;
        }
        let free = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
            && UdpSocket::bind((Ipv4Addr::LOCALHOST, port)).is_ok();
        if free {
            given.insert(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrNotAvailable,
        format!("no free loopback port in {range:?} after 2,000 draws"),
    ))
}

/// As [`unused_port`], panicking with the reason (for tests).
pub fn unused_port_or_panic() -> u16 {
    unused_port().unwrap_or_else(|e| panic!("picking a loopback port: {e}"))
}

/// The kernel's ephemeral range (32768–60999 when it cannot be read).
fn ephemeral() -> (u16, u16) {
    let text =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(a), Some(b)) if a <= b => (a, b),
        _ => (32_768, 60_999),
    }
}

/// Where ports are drawn: [`PREFERRED`] when the ephemeral range starts above it, else above
/// the range's end when 1,000 ports fit there, else [`PREFERRED`] all the same (a host whose
/// range covers almost every port leaves none the kernel never picks).
fn outside_ephemeral() -> std::ops::Range<u16> {
    let (start, end) = ephemeral();
    if start >= PREFERRED.end {
        PREFERRED
    } else if end < u16::MAX - 1_000 {
        end + 1..u16::MAX
    } else {
        PREFERRED
    }
}

/// A seed that differs between processes and calls: pid, clock.
fn seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// splitmix64: a well-spread next value.
fn next(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_outside_the_ephemeral_and_nodeport_ranges_and_never_given_twice() {
        let ports: Vec<u16> = (0..200).map(|_| unused_port_or_panic()).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        let range = outside_ephemeral();
        assert!(ports.iter().all(|p| range.contains(p)));
        let (start, end) = ephemeral();
        if start >= PREFERRED.end {
            assert!(
                ports
                    .iter()
                    .all(|&p| p < start && !(30_000..32_768).contains(&p))
            );
        } else if range != PREFERRED {
            assert!(ports.iter().all(|&p| p > end));
        }
    }
}
