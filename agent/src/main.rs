//! `mcs-agent`: the node agent of mcs-dataplane. Wiring only; the work lives in the library
//! crates (`mcs-model`, `mcs-sync`, `mcs-dns`, `mcs-proxy`).
//!
//! # Layout
//!
//! - `cli`: the flags; `commands`: which subcommand runs; `source`: the source and first
//!   full sync they share; `output`: what they print.
//! - One file per subcommand: `run` (the agent), `table`, `query` (`mcs-agent dns`),
//!   `status` (and `uninstall`), `demo`.
//! - `guard`: the guard from the flags and the node; `allocator`: the allocator's tuning.
//!   The DNS server is `mcs-dns`'s (feature `server`).
// `deny`, not `forbid`: `allocator` alone allows it, and says why.
#![deny(unsafe_code)]

mod allocator;
mod cli;
mod commands;
mod demo;
mod guard;
mod node_status;
mod output;
mod query;
mod run;
mod source;
mod status;
mod table;

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
    mcs_runtime::logging::init(filter);
    for note in tuned {
        if note.failed {
            tracing::warn!("allocator: {}", note.text);
        } else {
            tracing::debug!("allocator: {}", note.text);
        }
    }
    match commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
