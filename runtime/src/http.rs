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

/// Binds `addr` and serves in a background task; returns the bound address.
pub async fn spawn(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: Health,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
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
