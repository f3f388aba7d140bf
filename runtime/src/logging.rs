//! Logging set-up of both binaries: `tracing` to stderr, colours only on a terminal.

/// Installs the global subscriber with `filter`.
pub fn init(filter: tracing_subscriber::EnvFilter) {
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
