//! `mcs-agent`: the node agent of mcs-dataplane. Wiring only; the work lives in the library
//! crates (`mcs-model`, `mcs-api`, `mcs-proxy`).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The mcs-dataplane node agent: makes Kubernetes Multi-Cluster Services ClusterSetIPs
/// reachable from every pod of the node, with an eBPF socket load balancer or a userspace
/// transparent proxy.
#[derive(Debug, Parser)]
#[command(name = "mcs-agent", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Watch ServiceImports and MCS EndpointSlices and program the dataplane.
    Run,
    /// Compute and print the forwarding table from a source without touching the system.
    Table,
    /// Print what a running agent has programmed.
    Status,
    /// Build a sandbox of network namespaces with two clusters and show the dataplane at work.
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (what, issue) = match cli.command {
        Command::Run => ("`mcs-agent run` (the controller)", 3),
        Command::Table => ("`mcs-agent table`", 3),
        Command::Status => ("`mcs-agent status`", 5),
        Command::Demo => {
            println!(
                "mcs-agent demo will:\n  \
                 1. build a sandbox of network namespaces: a client pod, a node running the agent,\n     \
                 two clusters (c1, c2) of two backends each, addresses in 198.18.0.0/15;\n  \
                 2. start the agent with --source file:examples/ and program the ClusterSetIP;\n  \
                 3. send TCP and UDP traffic to the ClusterSetIP and print per-cluster distribution\n     \
                 and latency;\n  \
                 4. stop the local cluster's backends and show failover to the remote cluster;\n  \
                 5. remove everything it created."
            );
            ("`mcs-agent demo` (needs the userspace forwarder)", 4)
        }
    };
    eprintln!(
        "error: {what} is not implemented yet in this build (tracked as issue {issue}); \
         nothing was changed on this machine"
    );
    ExitCode::from(2)
}
