//! The lifecycle suite's load (`scripts/clusterset-lifecycle.sh`), run inside the pods of the
//! real ClusterSet. `mcs-bench probe` opens new TCP connections to a service at a fixed rate
//! (each one request, the whole reply checked, as the fault suite's), sends UDP requests on
//! one flow at the same rate and asks a node agent's `clusterset.local` DNS at the same rate,
//! until a stop file appears or a time bound passes, and prints one JSON line: what the client
//! saw on each. `mcs-bench serve` is the service's backend (the
//! fault suite's request/reply backend, in the pod's own network namespace).

use std::{
    net::{SocketAddr, UdpSocket},
    path::PathBuf,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::faults::LoadResult;

/// How long a UDP request waits for its answer before it counts as lost.
pub const UDP_WAIT: Duration = Duration::from_millis(500);

/// How long a DNS query waits for its answer before it counts as lost (a stub resolver asks
/// again after 5 s by default; a query waiting in the socket for an agent becoming ready is
/// answered, not lost).
pub const DNS_WAIT: Duration = Duration::from_secs(2);

/// What the DNS side asks: always answered (NOERROR, TXT `1.0.0`) by a ready agent.
const DNS_QUESTION: &str = "dns-version.clusterset.local";

/// What to probe and for how long.
#[derive(Clone, Debug)]
pub struct Probe {
    /// TCP service address (new connection per request).
    pub tcp: Option<SocketAddr>,
    /// UDP service address (one connected flow).
    pub udp: Option<SocketAddr>,
    /// A `clusterset.local` DNS server (an agent's DNS address), asked over UDP.
    pub dns: Option<SocketAddr>,
    /// Requests per second, each of TCP and UDP.
    pub rate: f64,
    /// Stop once this file exists.
    pub stop_file: Option<PathBuf>,
    /// Stop after this long whatever happens.
    pub max_seconds: f64,
}

/// What the UDP flow saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UdpResult {
    /// Requests sent (or tried).
    pub tried: u64,
    /// Requests answered with their own reply.
    pub answered: u64,
    /// Requests with no answer within [`UDP_WAIT`].
    pub lost: u64,
    /// Requests whose send or receive failed (e.g. ICMP port unreachable: refused).
    pub refused: u64,
    /// Answers that were not a backend's reply to a request of this flow.
    pub wrong: u64,
    /// Longest time between two answered requests, in milliseconds.
    pub longest_gap_ms: f64,
    /// The first problem seen.
    pub first_error: Option<String>,
}

/// One probe's report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProbeReport {
    /// How long it ran.
    pub seconds: f64,
    /// The TCP side (new connections).
    pub tcp: Option<LoadResult>,
    /// The UDP side (one flow).
    pub udp: Option<UdpResult>,
    /// The DNS side: `wrong` counts answers other than NOERROR (SERVFAIL from an agent not
    /// ready, ...).
    #[serde(default)]
    pub dns: Option<UdpResult>,
}

/// Fixed-rate ticks; a late tick is not made up for by a burst.
struct Pace {
    period: Duration,
    next: Instant,
}

impl Pace {
    fn new(rate: f64) -> Self {
        Pace {
            period: Duration::from_secs_f64(1.0 / rate.max(0.1)),
            next: Instant::now(),
        }
    }

    fn wait(&mut self) {
        let now = Instant::now();
        if self.next > now {
            std::thread::sleep(self.next - now);
        } else if now - self.next > self.period {
            self.next = now;
        }
        self.next += self.period;
    }
}

impl Probe {
    fn stopped(&self, end: Instant) -> bool {
        Instant::now() >= end || self.stop_file.as_ref().is_some_and(|f| f.exists())
    }

    /// Runs the probe to its stop and reports.
    pub fn run(&self) -> anyhow::Result<ProbeReport> {
        anyhow::ensure!(
            self.tcp.is_some() || self.udp.is_some() || self.dns.is_some(),
            "probe needs --tcp, --udp or --dns"
        );
        let start = Instant::now();
        let end = start + Duration::from_secs_f64(self.max_seconds);
        let (tcp, udp, dns) = std::thread::scope(|s| {
            let tcp = self.tcp.map(|to| s.spawn(move || self.tcp_side(to, end)));
            let udp = self.udp.map(|to| s.spawn(move || self.udp_side(to, end)));
            let dns = self.dns.map(|to| s.spawn(move || self.dns_side(to, end)));
            (
                tcp.map(|h| h.join().expect("tcp side")),
                udp.map(|h| h.join().expect("udp side")),
                dns.map(|h| h.join().expect("dns side")),
            )
        });
        Ok(ProbeReport {
            seconds: start.elapsed().as_secs_f64(),
            tcp,
            udp: udp.transpose()?,
            dns: dns.transpose()?,
        })
    }

    /// One query a tick, each with a new id; an answer counts when it has the query's id
    /// and NOERROR.
    fn dns_side(&self, to: SocketAddr, end: Instant) -> anyhow::Result<UdpResult> {
        self.exchange_side(to, end, DNS_WAIT, |n| {
            // Ids cycle through 65,536; an answer is matched by its id.
            let id = (n % 65_536) as u16;
            let request = dns_query(id);
            let judge = move |got: &[u8]| match got {
                [a, b, flags, codes, ..] if u16::from_be_bytes([*a, *b]) == id => {
                    let rcode = codes & 0x0f;
                    if flags & 0x80 != 0 && rcode == 0 {
                        Answer::Mine
                    } else {
                        Answer::Wrong(format!("dns query {id}: rcode {rcode}"))
                    }
                }
                // A late answer to an earlier query (or too short to be one).
                _ => Answer::Earlier,
            };
            (request, judge)
        })
    }

    fn tcp_side(&self, to: SocketAddr, end: Instant) -> LoadResult {
        let mut r = LoadResult::default();
        let mut pace = Pace::new(self.rate);
        let mut last_ok = Instant::now();
        while !self.stopped(end) {
            pace.wait();
            r.crr_once(to, &mut last_ok);
        }
        r.finish(last_ok);
        r
    }

    fn udp_side(&self, to: SocketAddr, end: Instant) -> anyhow::Result<UdpResult> {
        self.exchange_side(to, end, UDP_WAIT, |n| {
            let req = format!("q{n}");
            let bytes = req.clone().into_bytes();
            let mine = format!(" {req}\n");
            let judge = move |got: &[u8]| {
                let got = String::from_utf8_lossy(got);
                if got.starts_with("backend ") && got.ends_with(&mine) {
                    Answer::Mine
                } else if got.starts_with("backend ") && got.contains(" q") {
                    // A late answer to an earlier request of this flow: keep waiting.
                    Answer::Earlier
                } else {
                    Answer::Wrong(format!("{req}: answer {got:?}"))
                }
            };
            (bytes, judge)
        })
    }

    /// One flow (a connected UDP socket to `to`): a request a tick, made by `request` from
    /// its number (from 1) with the judge of its answers; each waits at most `wait` for an
    /// answer the judge calls its own, past answers to earlier requests.
    fn exchange_side<J: Fn(&[u8]) -> Answer>(
        &self,
        to: SocketAddr,
        end: Instant,
        wait: Duration,
        request: impl Fn(u64) -> (Vec<u8>, J),
    ) -> anyhow::Result<UdpResult> {
        let any: SocketAddr = if to.is_ipv4() {
            "0.0.0.0:0".parse()?
        } else {
            "[::]:0".parse()?
        };
        let sock = UdpSocket::bind(any)?;
        sock.connect(to)?;
        let mut r = UdpResult::default();
        let mut pace = Pace::new(self.rate);
        let mut last_ok = Instant::now();
        let mut buf = [0u8; 1500];
        while !self.stopped(end) {
            pace.wait();
            r.tried += 1;
            let (req, judge) = request(r.tried);
            let name = format!("request {}", r.tried);
            if let Err(e) = sock.send(&req) {
                r.refused += 1;
                r.first_error.get_or_insert(format!("send: {e}"));
                continue;
            }
            let deadline = Instant::now() + wait;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    r.lost += 1;
                    r.first_error.get_or_insert(format!("{name}: no answer"));
                    break;
                }
                sock.set_read_timeout(Some(left))?;
                match sock.recv(&mut buf) {
                    Ok(n) => match judge(&buf[..n]) {
                        Answer::Mine => {
                            r.answered += 1;
                            let now = Instant::now();
                            let gap = now.duration_since(last_ok).as_secs_f64() * 1e3;
                            r.longest_gap_ms = r.longest_gap_ms.max(gap);
                            last_ok = now;
                            break;
                        }
                        Answer::Earlier => continue,
                        Answer::Wrong(why) => {
                            r.wrong += 1;
                            r.first_error.get_or_insert(why);
                            break;
                        }
                    },
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        continue;
                    }
                    Err(e) => {
                        r.refused += 1;
                        r.first_error.get_or_insert(format!("{name}: {e}"));
                        break;
                    }
                }
            }
        }
        let tail = Instant::now().duration_since(last_ok).as_secs_f64() * 1e3;
        r.longest_gap_ms = r.longest_gap_ms.max(tail);
        Ok(r)
    }
}

/// What an answer on a flow is to the request waiting for one.
enum Answer {
    /// Its own answer.
    Mine,
    /// An answer to an earlier request: keep waiting.
    Earlier,
    /// Not an answer it may get (said why).
    Wrong(String),
}

/// A query for [`DNS_QUESTION`] TXT, class IN, recursion desired, with `id`.
fn dns_query(id: u16) -> Vec<u8> {
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    // Flags (RD), one question, no other records.
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in DNS_QUESTION.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    // The root, TXT (16), IN (1).
    q.extend_from_slice(&[0, 0, 16, 0, 1]);
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dns_query_is_one_well_formed_question() {
        let q = dns_query(0x1234);
        assert_eq!(&q[..4], &[0x12, 0x34, 0x01, 0x00]);
        assert_eq!(u16::from_be_bytes([q[4], q[5]]), 1);
        assert_eq!(q.len(), 12 + DNS_QUESTION.len() + 2 + 4);
        assert!(q.ends_with(&[0, 0, 16, 0, 1]));
    }

    #[test]
    fn pace_does_not_burst_after_a_stall() {
        let mut p = Pace::new(1000.0);
        let before = Instant::now();
        p.next = before - Duration::from_secs(1);
        p.wait();
        // A second late: the next tick is one period after the call, not a thousand ticks
        // owed from the past.
        assert!(p.next >= before + p.period);
    }
}
