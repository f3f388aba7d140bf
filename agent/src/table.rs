//! `mcs-agent table`: the forwarding table the agent would program, as text or JSON.

use std::process::ExitCode;

use mcs_model::{Index, NodeConfig, render};
use mcs_sync::source::{self, file::FileSource};

use crate::{
    cli::{Format, TableArgs},
    output::print_out,
    source::first_sync,
};

pub(crate) async fn table(args: TableArgs) -> anyhow::Result<ExitCode> {
    let (index, unreadable) = first_sync(&args.source, args.timeout_s, false).await?;
    let mut rejected = index.rejections();
    rejected.extend(unreadable);
    rejected.sort();
    let out = match args.format {
        Format::Json => render::json(index.table(), &rejected),
        Format::Text => render::text(index.table(), &rejected),
    };
    print_out(out.trim_end())?;
    Ok(ExitCode::SUCCESS)
}

/// The table of a directory source as text (for the demo).
pub fn table_text(
    dir: &std::path::Path,
    cluster_id: &str,
    guard: mcs_model::Guard,
) -> anyhow::Result<String> {
    let mut src = FileSource::new(dir);
    let mut index = Index::new(NodeConfig {
        cluster_id: cluster_id.into(),
        guard,
        ..Default::default()
    });
    let mut unreadable = std::collections::BTreeMap::new();
    for ev in src.scan()? {
        source::apply(&mut index, &mut unreadable, ev, true);
    }
    index.flush();
    Ok(render::text(index.table(), &index.rejections()))
}
