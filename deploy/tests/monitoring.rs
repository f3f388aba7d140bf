//! The chart's monitoring (`monitoring.enabled`): the alerts pass `promtool check rules` and
//! their unit tests (`promtool test rules deploy/tests/monitoring/alerts.test.yaml`: each fires
//! on the series that should raise it and not on the healthy ones); the chart wraps exactly
//! those rules in its PrometheusRule and the dashboard in a ConfigMap for Grafana's sidecar;
//! every dashboard query names only metrics the agent or controller exports, and every
//! alert is tested. That each query returns data from the real ClusterSet is checked by
//! `scripts/clusterset-monitoring.sh` in CI.

use std::{path::PathBuf, process::Command};

mod common;

use common::{helm_template, objects};
use mcs_test_support::{prereq, require};

fn chart() -> PathBuf {
    mcs_deploy::dir().join("helm/mcs-dataplane")
}

fn prerequisites() -> bool {
    require(prereq::all([
        prereq::program("promtool"),
        prereq::program("helm"),
    ]))
}

fn promtool(args: &[&str]) -> String {
    mcs_test_support::kubectl::stdout_of(
        Command::new("promtool")
            .args(args)
            .current_dir(mcs_deploy::dir()),
        None,
    )
    .unwrap()
}

#[test]
fn the_alerts_pass_their_promtool_unit_tests() {
    if !prerequisites() {
        return;
    }
    let check = promtool(&[
        "check",
        "rules",
        "helm/mcs-dataplane/monitoring/alerts.yaml",
    ]);
    assert!(check.contains("SUCCESS"), "{check}");
    let test = promtool(&["test", "rules", "tests/monitoring/alerts.test.yaml"]);
    assert!(test.contains("SUCCESS"), "{test}");
    // Every alert has a test that expects it to fire.
    let rules = std::fs::read_to_string(chart().join("monitoring/alerts.yaml")).unwrap();
    let tests =
        std::fs::read_to_string(mcs_deploy::dir().join("tests/monitoring/alerts.test.yaml"))
            .unwrap();
    for alert in rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        let fires = tests
            .split("alertname: ")
            .skip(1)
            .any(|t| t.starts_with(alert) && t.contains("exp_labels"));
        assert!(fires, "alert {alert} has no test in which it fires");
    }
}

#[test]
fn the_chart_ships_the_rules_and_the_dashboard_as_they_are_tested() {
    if !prerequisites() {
        return;
    }
    let render = |set: &[&str]| objects(&helm_template(set));
    let kinds = |objs: &[serde_json::Value]| {
        objs.iter()
            .map(|o| o["kind"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    // Off by default: nothing that needs the operator's CRDs.
    let off = render(&[]);
    assert!(
        !kinds(&off)
            .iter()
            .any(|k| k == "PrometheusRule" || k == "ServiceMonitor"),
        "{:?}",
        kinds(&off)
    );
    let on = render(&[
        "--set",
        "monitoring.enabled=true",
        "--set",
        "controller.enabled=true",
        "--set",
        "monitoring.labels.release=kube-prometheus",
    ]);
    let find = |kind: &str, name: &str| {
        on.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{kind} {name} in {:?}", kinds(&on)))
    };
    let rule = find("PrometheusRule", "mcs-dataplane");
    assert_eq!(rule["metadata"]["labels"]["release"], "kube-prometheus");
    let file: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart().join("monitoring/alerts.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        rule["spec"]["groups"], file["groups"],
        "the PrometheusRule holds the tested rules, unchanged"
    );
    for (name, port) in [("mcs-agent", "metrics"), ("mcs-controller", "metrics")] {
        let sm = find("ServiceMonitor", name);
        assert_eq!(sm["spec"]["endpoints"][0]["port"], port);
        assert_eq!(
            sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
            name
        );
        // The Service it selects has that port.
        let svc = on
            .iter()
            .find(|o| {
                o["kind"] == "Service"
                    && o["metadata"]["labels"]["app.kubernetes.io/name"] == name
                    && o["spec"]["ports"]
                        .as_array()
                        .is_some_and(|p| p.iter().any(|p| p["name"] == port))
            })
            .unwrap_or_else(|| panic!("a Service of {name} with port {port}"));
        assert!(
            svc["metadata"]["name"]
                .as_str()
                .unwrap()
                .ends_with("metrics")
        );
    }
    let cm = find("ConfigMap", "mcs-dataplane-dashboard");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("monitoring/dashboard.json")).unwrap(),
    )
    .unwrap();
    let rendered: serde_json::Value =
        serde_json::from_str(cm["data"]["mcs-dataplane.json"].as_str().unwrap()).unwrap();
    assert_eq!(rendered, shipped);
}

/// The metric names the agent and the controller export, read from their sources: every
/// string literal opening a call or a tuple (`register(\n "name", ...)`, the forwarder's
/// `("name", "help", ...)` families) that looks like a name, with the registry's prefix. It
/// finds a few other words too, which only makes the check below more lenient.
fn exported_metrics() -> Vec<String> {
    let root = mcs_deploy::dir().join("..");
    let mut names = Vec::new();
    for (file, prefix) in [
        ("controller/node/sync/src/metrics.rs", "mcs_"),
        ("controller/clusterset/mcs/src/lib.rs", "mcs_controller_"),
        ("controller/node/dns/src/server.rs", "mcs_dns_"),
        ("proxy/src/userspace/metrics.rs", "mcs_proxy_"),
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let is_name = |w: &str| {
            !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit())
        };
        let mut prev = "";
        for line in text.lines().map(str::trim) {
            // `register(` then `"name",` on the next line.
            if prev.ends_with('(')
                && let Some(w) = line.strip_prefix('"').and_then(|l| l.strip_suffix("\","))
                && is_name(w)
            {
                names.push(format!("{prefix}{w}"));
            }
            // `("name", ...` on one line.
            for piece in line.split("(\"").skip(1) {
                if let Some((w, _)) = piece.split_once("\",")
                    && is_name(w)
                {
                    names.push(format!("{prefix}{w}"));
                }
            }
            prev = line;
        }
    }
    names
}

#[test]
fn every_dashboard_query_and_alert_names_an_exported_metric() {
    let names = exported_metrics();
    for must in [
        "mcs_frontends",
        "mcs_rejected",
        "mcs_sync_latency_seconds",
        "mcs_controller_leader",
        "mcs_controller_member_up",
        "mcs_dns_queries",
        "mcs_proxy_active_connections",
        "mcs_proxy_connection_limit",
        "mcs_proxy_connections",
    ] {
        assert!(
            names.iter().any(|n| n == must),
            "{must} not found in {names:?}"
        );
    }
    // A series name in a query: the registered name, with a counter's `_total` or a
    // histogram's `_bucket`/`_sum`/`_count`.
    let known = |series: &str| {
        names.iter().any(|n| {
            series == n
                || ["_total", "_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| series.strip_suffix(s) == Some(n))
        })
    };
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("monitoring/dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut exprs: Vec<String> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    let rules = std::fs::read_to_string(chart().join("monitoring/alerts.yaml")).unwrap();
    exprs.extend(
        rules
            .lines()
            .filter_map(|l| l.trim().strip_prefix("expr: "))
            .map(str::to_string),
    );
    assert!(exprs.len() > 20, "{exprs:?}");
    for e in &exprs {
        let series: Vec<&str> = e
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("mcs_"))
            .collect();
        assert!(!series.is_empty(), "no mcs_ series in {e}");
        for s in series {
            assert!(known(s), "{s} (in `{e}`) is not exported: {names:?}");
        }
    }
}
