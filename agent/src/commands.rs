//! The subcommands: which one runs, on which runtime. Each subcommand has its own file:
//! [`crate::run`], [`crate::table`], [`crate::query`], [`crate::status`], [`crate::demo`];
//! what several share is in [`crate::source`] (the source and the first full sync) and
//! [`crate::output`].

use std::process::ExitCode;

use crate::cli::{Cli, Command};

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Table(args) => runtime()?.block_on(crate::table::table(args)),
        Command::Dns(args) => runtime()?.block_on(crate::query::dns_query(args)),
        Command::Run(args) => runtime()?.block_on(crate::run::run(*args)),
        Command::Status(args) => crate::status::status(&args),
        Command::Uninstall(args) => crate::status::uninstall(&args),
        Command::Demo(args) => crate::demo::run(&args),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}
