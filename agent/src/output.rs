//! What the subcommands print.

/// Writes `text` and a newline to stdout. A reader that went away (`mcs-agent status | head`)
/// ends the output quietly instead of a panic in `println!`.
pub(crate) fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.write_all(b"\n"))
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
