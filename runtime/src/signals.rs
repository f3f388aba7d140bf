//! A clean stop on SIGTERM (kubelet) or SIGINT (a terminal).

/// Returns at the first SIGTERM or SIGINT (never, if their handlers cannot be installed).
pub async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
