//! `/metrics`, `/healthz` and `/readyz` on a small HTTP/1.1 server (GET only, one request per
//! connection): enough for Prometheus and kubelet probes, without a web framework.

use std::{
    net::SocketAddr,
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

/// Serves until the listener fails.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>, health: Health) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let (registry, health) = (registry.clone(), health.clone());
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(10),
                        handle(stream, &registry, &health),
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
    let listener = bind_patiently("metrics", addr, || listen_shared(addr)).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener, registry, health));
    Ok(local)
}

async fn handle(
    mut stream: TcpStream,
    registry: &Registry,
    health: &Health,
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
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path) {
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
            "try /metrics, /healthz, /readyz\n".into(),
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
