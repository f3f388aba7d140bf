//! Writes the CRDs to `deploy/crds/` and the Helm chart's `crds/` (default), or checks that
//! the files there are current.
//!
//! ```text
//! crdgen [DIR]            write DIR/<file>.yaml for each CRD
//! crdgen --check [DIR]    exit 1 if any file differs from what would be written
//! ```
use std::path::PathBuf;

use anyhow::{Context as _, bail};

fn main() -> anyhow::Result<()> {
    let mut check = false;
    let mut dir = None;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!("usage: crdgen [--check] [DIR]  (DIR defaults to deploy/crds)");
                return Ok(());
            }
            other if other.starts_with('-') => bail!("unknown flag {other}; see --help"),
            other => dir = Some(PathBuf::from(other)),
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let dirs = match dir {
        Some(d) => vec![d],
        None => vec![root.join("crds"), root.join("helm/mcs-dataplane/crds")],
    };
    let mut stale = Vec::new();
    for dir in &dirs {
        for (file, crd) in mcs_api::crds() {
            let path = dir.join(file);
            let want = mcs_api::crd_yaml(&crd);
            if check {
                let have = std::fs::read_to_string(&path).unwrap_or_default();
                if have != want {
                    stale.push(path.display().to_string());
                }
            } else {
                std::fs::create_dir_all(dir)?;
                std::fs::write(&path, want)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
    }
    if !stale.is_empty() {
        bail!(
            "generated CRDs are out of date: {}\nrun `cargo run -p mcs-api --bin crdgen`",
            stale.join(", ")
        );
    }
    Ok(())
}
