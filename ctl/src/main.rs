//! `kubectl-mcs` (run as `kubectl mcs` when on PATH): the operator's view of an
//! mcs-dataplane ClusterSet, read through the user's kubeconfig contexts only.
//!
//! - `status`: is the ClusterSet healthy? Exit 1 when something is wrong, the reason on its
//!   line.
//! - `explain NAME -n NS`: why a service is (not) reachable, per cluster and per node, and
//!   what to fix.
//!
//! It needs no server of its own: the agents' and controllers' own views come from their
//! read-only `/status` and `/metrics`, through the API server's pod proxy.
#![forbid(unsafe_code)]

mod explain;
mod member;
mod report;
mod status;

use std::{io::Write as _, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};

/// The operator's view of an mcs-dataplane ClusterSet: `status` (is it healthy?) and
/// `explain` (why is this service not reachable?). Reads every member through a context of
/// the kubeconfig (by default every context), with read-only verbs plus `get pods/proxy` in
/// the chart's namespace (the agents' /status, the controller's /metrics).
#[derive(Parser, Debug)]
#[command(name = "kubectl-mcs", version)]
struct Cli {
    /// The kubeconfig (default: KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// A member cluster's context (repeatable). Default: every context of the kubeconfig.
    #[arg(long = "context", global = true, value_name = "CONTEXT")]
    contexts: Vec<String>,
    /// The namespace the chart is installed in.
    #[arg(
        long,
        global = true,
        env = "MCS_NAMESPACE",
        default_value = "mcs-system"
    )]
    mcs_namespace: String,
    /// `text` (fits a terminal) or `json` (for scripts; also holds every agent's /status).
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    /// Act as this user (impersonation, as kubectl's --as): e.g. to check what an operator
    /// bound to the chart's mcs-dataplane-operator roles sees.
    #[arg(long = "as", global = true, value_name = "USER")]
    impersonate: Option<String>,
    /// Seconds one request to an API server may take.
    #[arg(long, global = true, default_value_t = 10)]
    timeout_s: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Per member: API server reachable, cluster id, controller leader and version and the
    /// members it reaches, agents ready (each one's own view) and DNS answering, imports,
    /// exports; exit 1 when something is wrong.
    Status,
    /// Why SERVICE is (not) reachable: per member the export and its conditions, the
    /// Service's ports, the import, endpoints per source cluster; per node what its agent
    /// programmed (or rejected, and why) and what its DNS answers. Exit 1 when something is
    /// wrong.
    Explain {
        /// `NAME`, `svc/NAME`, `service/NAME` or `NAMESPACE/NAME`.
        service: String,
        /// The service's namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kubectl-mcs: starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kubectl-mcs: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let timeout = Duration::from_secs(cli.timeout_s.max(1));
    let members = member::members(
        cli.kubeconfig.as_deref(),
        &cli.contexts,
        cli.impersonate.as_deref(),
        timeout,
    )
    .await?;
    let report = match &cli.command {
        Command::Status => status::status(&members, &cli.mcs_namespace).await,
        Command::Explain { service, namespace } => {
            let (ns, name) = parse_service(service, namespace)?;
            explain::explain(&members, &cli.mcs_namespace, &ns, &name).await
        }
    };
    let text = match cli.output {
        Output::Text => report.text(),
        Output::Json => serde_json::to_string_pretty(&report)? + "\n",
    };
    let mut out = std::io::stdout().lock();
    // A closed pipe (`| head`) is no error of ours.
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        return Err(e.into());
    }
    Ok(if report.level == report::Level::Fail {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `NAME`, `svc/NAME`, `service/NAME`, `services/NAME` or `NS/NAME`.
fn parse_service(arg: &str, namespace: &str) -> anyhow::Result<(String, String)> {
    let (ns, name) = match arg.split_once('/') {
        None => (namespace, arg),
        Some(("svc" | "service" | "services", n)) => (namespace, n),
        Some((ns, n)) => (ns, n),
    };
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    if !ok(ns) || !ok(name) {
        anyhow::bail!(
            "{arg:?} (namespace {ns:?}) is not a service: NAME, svc/NAME or NAMESPACE/NAME, DNS labels"
        );
    }
    Ok((ns.to_string(), name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::parse_service;

    #[test]
    fn services_are_named_as_kubectl_names_them() {
        let p = |a, n| parse_service(a, n).unwrap();
        assert_eq!(p("web", "shop"), ("shop".into(), "web".into()));
        assert_eq!(p("svc/web", "shop"), ("shop".into(), "web".into()));
        assert_eq!(p("service/web", "shop"), ("shop".into(), "web".into()));
        assert_eq!(p("other/web", "shop"), ("other".into(), "web".into()));
        assert!(parse_service("Web", "shop").is_err());
        assert!(parse_service("a/b/c", "shop").is_err());
        assert!(parse_service("web", "").is_err());
    }
}
