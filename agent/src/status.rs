//! `mcs-agent status` (what the eBPF socket LB's pinned maps hold) and `mcs-agent uninstall`.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use mcs_proxy::ebpf::{SocketLb, read_pinned};

use crate::{
    cli::{Format, PinArgs, StatusArgs},
    commands::print_out,
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
                let _ = writeln!(out, "{f}  ({} backends)", backends.len());
                for b in backends {
                    let _ = writeln!(out, "  {b}");
                }
            }
            print_out(out.trim_end())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Detaches the eBPF programs and removes the pinned maps and links.
pub(crate) fn uninstall(args: &PinArgs) -> anyhow::Result<ExitCode> {
    let n = SocketLb::uninstall(&args.bpf_pin_dir)?;
    println!(
        "removed {n} pinned objects from {} (programs detached)",
        args.bpf_pin_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
