//! The `mcs-agent table` output: JSON (the shape of DESIGN §6, a stable interface) and text.

use std::fmt::Write as _;

use serde::Serialize;

use crate::{ForwardingTable, input::escaped, validate::Rejection};

#[derive(Serialize)]
struct TableJson<'a> {
    frontends: Vec<FrontendJson<'a>>,
    rejected: Vec<RejectedJson<'a>>,
}

#[derive(Serialize)]
struct FrontendJson<'a> {
    vip: String,
    port: u16,
    protocol: String,
    service: &'a str,
    affinity: Option<AffinityJson>,
    backends: Vec<BackendJson<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AffinityJson {
    #[serde(rename = "clientIP")]
    client_ip: bool,
    timeout_seconds: u32,
}

#[derive(Serialize)]
struct BackendJson<'a> {
    address: String,
    port: u16,
    cluster: &'a str,
    zone: Option<&'a str>,
    ready: bool,
    serving: bool,
    terminating: bool,
    selected: bool,
}

#[derive(Serialize)]
struct RejectedJson<'a> {
    object: &'a str,
    reason: String,
}

/// The table as JSON: frontends sorted by (vip, port, protocol), backends by (cluster,
/// address, port), then `rejected`.
pub fn json(table: &ForwardingTable, rejected: &[Rejection]) -> String {
    let doc = TableJson {
        frontends: table
            .frontends
            .iter()
            .map(|(f, s)| FrontendJson {
                vip: f.vip.to_string(),
                port: f.port,
                protocol: f.protocol.to_string(),
                service: &s.service,
                affinity: s.affinity.map(|a| AffinityJson {
                    client_ip: true,
                    timeout_seconds: a.timeout_seconds,
                }),
                backends: s
                    .backends
                    .iter()
                    .map(|b| BackendJson {
                        address: b.address.to_string(),
                        port: b.port,
                        cluster: &b.cluster,
                        zone: b.zone.as_deref(),
                        ready: b.ready,
                        serving: b.serving,
                        terminating: b.terminating,
                        selected: b.selected,
                    })
                    .collect(),
            })
            .collect(),
        rejected: rejected
            .iter()
            .map(|r| RejectedJson {
                object: &r.object,
                reason: format!("{}: {}", r.reason.label(), r.message),
            })
            .collect(),
    };
    serde_json::to_string_pretty(&doc).expect("table serializes")
}

/// The table for a person (names from objects [`escaped`]).
pub fn text(table: &ForwardingTable, rejected: &[Rejection]) -> String {
    let mut s = String::new();
    if table.frontends.is_empty() {
        s.push_str("no frontends\n");
    }
    for (f, svc) in &table.frontends {
        let affinity = svc
            .affinity
            .map(|a| format!(" affinity=ClientIP/{}s", a.timeout_seconds))
            .unwrap_or_default();
        let selected = svc.selected().count();
        let _ = writeln!(
            s,
            "{f}  {}{affinity}  ({selected}/{} backends selected)",
            escaped(&svc.service),
            svc.backends.len()
        );
        for b in &svc.backends {
            let mark = if b.selected { "*" } else { " " };
            let state = match (b.ready, b.serving, b.terminating) {
                (true, _, _) => "ready",
                (false, true, true) => "serving,terminating",
                (false, _, true) => "terminating",
                _ => "not-ready",
            };
            let addr = match b.address {
                std::net::IpAddr::V4(a) => format!("{a}:{}", b.port),
                std::net::IpAddr::V6(a) => format!("[{a}]:{}", b.port),
            };
            let _ = writeln!(
                s,
                "  {mark} {addr:<24} cluster={:<10} zone={:<8} {state}",
                escaped(&b.cluster),
                escaped(b.zone.as_deref().unwrap_or("-"))
            );
        }
    }
    if !rejected.is_empty() {
        let _ = writeln!(s, "\nrejected:");
        for r in rejected {
            let _ = writeln!(
                s,
                "  {}: {}: {}",
                escaped(&r.object),
                r.reason.label(),
                escaped(&r.message)
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert!(matches!(
            escaped("shop/web"),
            std::borrow::Cow::Borrowed("shop/web")
        ));
        assert_eq!(escaped("a\nb\u{1b}[31mc\r"), "a\\nb\\u{1b}[31mc\\r");
        assert_eq!(escaped("ünï"), "ünï");
    }
}
