//! `/metrics`, `/healthz`, `/readyz` and (when the binary gives one) `/status` on a small
//! HTTP/1.1 server (GET only, one request per connection): enough for Prometheus, kubelet
//! probes and `kubectl mcs` through the API server's pod proxy, without a web framework.

use std::{
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use prometheus_client::registry::Registry;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};

/// Shared health state.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    /// Ready: the first full table has been programmed.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// Whether ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}

/// What answers `GET /status?QUERY`: called with the decoded query parameters, it returns a
/// JSON document (the binary's own read-only view of what it does).
pub type StatusFn = Arc<
    dyn Fn(Vec<(String, String)>) -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync,
>;

/// Serves until the listener fails.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    health: Health,
    status: Option<StatusFn>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let (registry, health, status) = (registry.clone(), health.clone(), status.clone());
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(10),
                        handle(stream, &registry, &health, status.as_ref()),
                    )
                    .await;
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A TCP listener on `addr` with SO_REUSEADDR and SO_REUSEPORT: the next agent of a node
/// (a DaemonSet rolling with maxSurge, host network) binds the same port while this one
/// still serves, and takes over its connections when it closes.
pub fn listen_shared(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    s.set_reuseport(true)?;
    s.bind(addr)?;
    s.listen(1024)
}

/// How long [`bind_patiently`] retries an address in use.
pub const BIND_PATIENCE: Duration = Duration::from_secs(120);

/// `bind()` again every second while it fails with "address in use", at most
/// [`BIND_PATIENCE`]: the node's previous agent of a version before SO_REUSEPORT holds
/// the port until it exits, which a DaemonSet rolling with maxSurge makes it do once this
/// one's pod is ready (its readiness probe reaches the old agent on the shared port).
pub async fn bind_patiently<T>(
    what: &str,
    addr: SocketAddr,
    mut bind: impl FnMut() -> std::io::Result<T>,
) -> std::io::Result<T> {
    let t0 = std::time::Instant::now();
    let mut warned = false;
    loop {
        match bind() {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && t0.elapsed() < BIND_PATIENCE => {
                if !warned {
                    tracing::warn!(%addr, what, error = %e, "address in use (the node's previous agent, of a version that does not share it?); trying again every second for up to {} s", BIND_PATIENCE.as_secs());
                    warned = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(v) => {
                if warned {
                    tracing::info!(%addr, what, waited_s = t0.elapsed().as_secs(), "bound after waiting");
                }
                return Ok(v);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Binds `addr` ([`listen_shared`], [`bind_patiently`]) and serves in a background task;
/// returns the bound address.
pub async fn spawn(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: Health,
) -> std::io::Result<SocketAddr> {
    spawn_with_status(addr, registry, health, None).await
}

/// [`spawn`], also answering `/status` with `status`.
pub async fn spawn_with_status(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: Health,
    status: Option<StatusFn>,
) -> std::io::Result<SocketAddr> {
    let listener = bind_patiently("metrics", addr, || listen_shared(addr)).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener, registry, health, status));
    Ok(local)
}

/// The parameters of a query string (`a=1&b=x%2Fy`), percent-decoded; `+` is a space.
pub fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    fn hex(c: u8) -> Option<u8> {
        (c as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let decoded = match b[i] {
            b'%' if i + 2 < b.len() => hex(b[i + 1]).zip(hex(b[i + 2])).map(|(h, l)| h * 16 + l),
            _ => None,
        };
        match (decoded, b[i]) {
            (Some(v), _) => {
                out.push(v);
                i += 3;
                continue;
            }
            (None, b'+') => out.push(b' '),
            (None, c) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(
    mut stream: TcpStream,
    registry: &Registry,
    health: &Health,
    status_fn: Option<&StatusFn>,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut n = 0;
    // Read until the end of the request head (or the buffer is full).
    while n < buf.len() {
        let r = stream.read(&mut buf[n..]).await?;
        if r == 0 {
            break;
        }
        n += r;
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let mut parts = head.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let (status, ctype, body) = match (method, path) {
        ("GET", "/status") if status_fn.is_some() => {
            let f = status_fn.expect("checked");
            ("200 OK", "application/json", f(query_pairs(query)).await)
        }
        ("GET", "/metrics") => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, registry) {
                Ok(()) => (
                    "200 OK",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => ("500 Internal Server Error", "text/plain", format!("{e}\n")),
            }
        }
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", "/readyz") if health.is_ready() => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", "/readyz") => (
            "503 Service Unavailable",
            "text/plain",
            "not ready: the first full table is not programmed yet\n".into(),
        ),
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            if status_fn.is_some() {
                "try /metrics, /healthz, /readyz, /status\n".into()
            } else {
                "try /metrics, /healthz, /readyz\n".into()
            },
        ),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::query_pairs;

    #[test]
    fn query_strings_are_decoded() {
        assert_eq!(
            query_pairs("service=shop%2Fweb&x=a+b&flag&bad=%zz%2"),
            vec![
                ("service".into(), "shop/web".into()),
                ("x".into(), "a b".into()),
                ("flag".into(), String::new()),
                ("bad".into(), "%zz%2".into()),
            ]
        );
        assert!(query_pairs("").is_empty());
        assert_eq!(query_pairs("k=%C3%A9"), vec![("k".into(), "é".into())]);
    }
}
