//! `mcs-agent dns`: the answer the agent would give to one query, without a socket.

use std::{process::ExitCode, sync::Arc};

use anyhow::Context as _;

use crate::{cli::DnsQueryArgs, output::print_out, source::first_sync};

/// `mcs-agent dns`: the answer, printed as a DNS response (dig-like sections). Exit 0 for
/// NOERROR (answers or NODATA), 1 otherwise.
pub(crate) async fn dns_query(args: DnsQueryArgs) -> anyhow::Result<ExitCode> {
    use hickory_proto::{
        op::{Message, Query, ResponseCode},
        rr::{Name, RecordType},
    };
    let mut text = args.name.trim().to_string();
    if !text.ends_with('.') {
        text.push('.');
    }
    let name =
        Name::from_ascii(&text).with_context(|| format!("{:?} is not a DNS name", args.name))?;
    let qtype: RecordType = args
        .record_type
        .to_ascii_uppercase()
        .parse()
        .with_context(|| format!("{:?} is not a DNS record type", args.record_type))?;
    let (mut index, _) = first_sync(&args.source, args.timeout_s, true).await?;
    let zone = Arc::new(mcs_model::dns::Zone::new());
    for (svc, records) in index.take_dns_changes() {
        zone.set(&svc, records);
    }
    let answerer = mcs_dns::Answerer::new(zone, args.answers.ttl);
    let mut q = Message::query();
    q.add_query(Query::query(name, qtype));
    let resp = answerer.respond(&q);
    print_out(resp.to_string().trim_end())?;
    Ok(if resp.metadata.response_code == ResponseCode::NoError {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
