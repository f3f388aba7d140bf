//! `mcs-agent`: the node agent of mcs-dataplane. Wiring only; the work lives in the library
//! crates (`mcs-model`, `mcs-controller`, `mcs-proxy`).
// `deny`, not `forbid`: `allocator` alone allows it, and says why.
#![deny(unsafe_code)]

mod allocator;
mod cli;
mod commands;
mod demo;
mod dns;
mod guard;

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    let tuned = allocator::tune();
    let cli = cli::Cli::parse();
    // `table` prints a result: only warnings and errors go to stderr unless asked.
    let default_level = match cli.command {
        cli::Command::Table(_) | cli::Command::Dns(_) => "warn",
        _ => "info",
    };
    let level = cli.log_level.as_deref().unwrap_or(default_level);
    let mut spec = std::env::var("MCS_LOG").unwrap_or_else(|_| level.to_string());
    // hickory-server logs every DNS query and response at info: only its warnings unless
    // the filter names it (MCS_LOG=info,hickory_server=info shows them).
    if !spec.contains("hickory") {
        spec.push_str(",hickory_server=warn");
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&spec).unwrap_or_else(|e| {
        eprintln!("warning: log filter {spec:?} does not parse ({e}); using {level}");
        tracing_subscriber::EnvFilter::new(level)
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    for note in tuned {
        tracing::debug!("allocator: {note}");
    }
    match commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
