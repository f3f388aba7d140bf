//! `mcs-agent status` (what the eBPF socket LB's pinned maps hold) and `mcs-agent uninstall`
//! (both dataplanes' leftovers).

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use mcs_proxy::{
    ebpf::{SocketLb, read_pinned},
    userspace::nft::{InterceptConfig, Interception},
};

use crate::{
    cli::{Format, StatusArgs, UninstallArgs},
    output::print_out,
};

pub(crate) fn status(args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let dir = &args.pins.bpf_pin_dir;
    if !dir.exists() {
        bail!(
            "no pinned maps at {}: is an agent running with --dataplane ebpf (and this --bpf-pin-dir)?",
            dir.display()
        );
    }
    let p = read_pinned(dir)
        .with_context(|| format!("reading the pinned maps in {}", dir.display()))?;
    match args.format {
        Format::Json => print_out(&serde_json::to_string_pretty(&p)?)?,
        Format::Text => {
            use std::fmt::Write as _;
            let mut out = format!(
                "eBPF socket LB, maps pinned in {}: {} frontends\n",
                dir.display(),
                p.frontends.len()
            );
            // How full the maps sized from the caps are (a full one leaves frontends
            // unprogrammable; `uninstall` and a restart make them at the caps' size).
            let fill: Vec<String> = p
                .maps
                .iter()
                .map(|(name, f)| format!("{name} {}/{}", f.entries, f.max_entries))
                .collect();
            let _ = writeln!(out, "map entries: {}", fill.join(", "));
            for (f, backends) in &p.frontends {
                let fallback = p.fallbacks.get(f).map_or(&[][..], Vec::as_slice);
                let _ = writeln!(
                    out,
                    "{f}  ({} backends, {} fallback)",
                    backends.len(),
                    fallback.len()
                );
                for b in backends {
                    let _ = writeln!(out, "  {b}");
                }
                for b in fallback {
                    let _ = writeln!(out, "  {b}  (fallback)");
                }
            }
            print_out(out.trim_end())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Detaches the eBPF programs and removes the pinned maps and links, then the userspace
/// forwarder's interception.
pub(crate) fn uninstall(args: &UninstallArgs) -> anyhow::Result<ExitCode> {
    let dir = &args.pins.bpf_pin_dir;
    let n = SocketLb::uninstall(dir)?;
    println!(
        "removed {n} pinned objects from {} (programs detached)",
        dir.display()
    );
    let cfg = InterceptConfig {
        table: args.nft_table.clone(),
        mark: args.fwmark,
        route_table: args.fwmark,
        ..Default::default()
    };
    let had = Interception::remove_leftover(&cfg)
        .with_context(|| format!("removing nftables table inet {}", cfg.table))?;
    println!(
        "{} nftables table inet {} and the policy routing of mark {:#x}",
        if had { "removed" } else { "no" },
        cfg.table,
        cfg.mark
    );
    Ok(ExitCode::SUCCESS)
}
