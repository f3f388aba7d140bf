//! The member clusters, one per kubeconfig context, and what is read from each: always
//! through the user's credentials (read-only verbs, plus `get` on `pods/proxy` in the chart's
//! namespace for the agents' and controllers' own status).

use std::{path::Path, time::Duration};

use anyhow::{Context as _, bail};
use futures::{StreamExt as _, stream};
use k8s_openapi::{api::core::v1::Pod, apimachinery::pkg::util::intstr::IntOrString};
use kube::{
    Api, Client, Config,
    api::ListParams,
    config::{KubeConfigOptions, Kubeconfig},
};
use mcs_model::status::{AgentStatus, NodeStatus};

/// Agents asked at once.
const AGENTS_AT_ONCE: usize = 16;

/// One member: its context, and a client or why there is none.
pub struct Member {
    /// The kubeconfig context (by convention the cluster id).
    pub context: String,
    /// The API server's URL.
    pub server: String,
    /// A client with the command's timeouts.
    pub client: Result<Client, String>,
}

/// Every member named by `contexts` (all of the kubeconfig's when empty).
pub async fn members(
    kubeconfig: Option<&Path>,
    contexts: &[String],
    impersonate: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<Vec<Member>> {
    let kc = match kubeconfig {
        Some(p) => Kubeconfig::read_from(p)
            .with_context(|| format!("reading the kubeconfig {}", p.display()))?,
        None => Kubeconfig::read()
            .context("reading the kubeconfig (KUBECONFIG, or ~/.kube/config; --kubeconfig)")?,
    };
    let names: Vec<String> = if contexts.is_empty() {
        kc.contexts.iter().map(|c| c.name.clone()).collect()
    } else {
        for c in contexts {
            if !kc.contexts.iter().any(|k| &k.name == c) {
                bail!(
                    "no context {c:?} in the kubeconfig (it has: {})",
                    kc.contexts
                        .iter()
                        .map(|k| k.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        contexts.to_vec()
    };
    if names.is_empty() {
        bail!("the kubeconfig has no context: name the members with --context");
    }
    let mut out = Vec::new();
    for name in names {
        let opts = KubeConfigOptions {
            context: Some(name.clone()),
            ..Default::default()
        };
        let config = Config::from_custom_kubeconfig(kc.clone(), &opts).await;
        let (server, client) = match config {
            Ok(mut c) => {
                c.connect_timeout = Some(timeout);
                c.read_timeout = Some(timeout);
                c.write_timeout = Some(timeout);
                if let Some(user) = impersonate {
                    c.auth_info.impersonate = Some(user.to_string());
                }
                let server = c.cluster_url.to_string();
                (server, Client::try_from(c).map_err(|e| e.to_string()))
            }
            Err(e) => (String::new(), Err(format!("{e}"))),
        };
        out.push(Member {
            context: name,
            server,
            client,
        });
    }
    Ok(out)
}

/// A pod of the chart (agent or controller) and the port of its `/status` and `/metrics`.
#[derive(Clone, Debug)]
pub struct ChartPod {
    /// Pod name.
    pub name: String,
    /// Its node.
    pub node: String,
    /// Kubernetes says it is ready.
    pub ready: bool,
    /// The metrics port (the readiness probe's, or the container port named `metrics`).
    pub port: Option<i32>,
    /// The first container's image.
    pub image: String,
    /// Being deleted.
    pub terminating: bool,
}

/// The pods of the chart's component `name` (`mcs-agent`, `mcs-controller`) in `ns`.
pub async fn chart_pods(client: &Client, ns: &str, name: &str) -> kube::Result<Vec<ChartPod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = api
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={name}")))
        .await?;
    let mut pods: Vec<ChartPod> = list
        .items
        .into_iter()
        .map(|p| {
            let spec = p.spec.unwrap_or_default();
            let c = spec.containers.first();
            let port = c.and_then(|c| {
                c.ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some("metrics"))
                    .map(|p| p.container_port)
                    .or_else(
                        || match c.readiness_probe.as_ref()?.http_get.as_ref()?.port {
                            IntOrString::Int(n) => Some(n),
                            IntOrString::String(_) => None,
                        },
                    )
            });
            let ready = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            ChartPod {
                name: p.metadata.name.unwrap_or_default(),
                node: spec.node_name.unwrap_or_default(),
                ready,
                port,
                image: c.and_then(|c| c.image.clone()).unwrap_or_default(),
                terminating: p.metadata.deletion_timestamp.is_some(),
            }
        })
        .collect();
    pods.sort_by(|a, b| a.node.cmp(&b.node).then(a.name.cmp(&b.name)));
    Ok(pods)
}

/// `GET path` on a pod's port through the API server's pod proxy.
pub async fn pod_get(
    client: &Client,
    ns: &str,
    pod: &ChartPod,
    path_and_query: &str,
) -> Result<String, String> {
    let port = pod
        .port
        .ok_or("the pod declares no metrics port (readiness probe or port named metrics)")?;
    let url = format!(
        "/api/v1/namespaces/{ns}/pods/{}:{port}/proxy{path_and_query}",
        pod.name
    );
    let req = http::Request::get(&url)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let body = client.request_stream(req).await.map_err(|e| match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "forbidden: reading an agent's /status needs `get` on pods/proxy in {ns} ({})",
            s.message
        ),
        e => e.to_string(),
    })?;
    // An agent's answer is bounded (at most 1,000 backends); whatever answers at that port
    // is read no further than this.
    use futures::AsyncReadExt as _;
    let mut bytes = Vec::new();
    body.take(ANSWER_MAX as u64 + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| e.to_string())?;
    if bytes.len() > ANSWER_MAX {
        return Err(format!(
            "the answer of {}:{port}{path_and_query} is over {} MiB: not read further",
            pod.name,
            ANSWER_MAX >> 20
        ));
    }
    String::from_utf8(bytes).map_err(|e| format!("not text: {e}"))
}

/// The most of one pod's answer `kubectl mcs` reads.
const ANSWER_MAX: usize = 8 << 20;

/// One agent's `/status`: read into its types, and as it came (for `-o json`, also when it
/// does not read as this `kubectl-mcs` expects).
pub struct AgentAnswer {
    /// The answer as `mcs_model::status` reads it, or why it does not.
    pub status: Result<AgentStatus, String>,
    /// The answer as it came.
    pub raw: serde_json::Value,
}

impl AgentAnswer {
    /// Reads an answer's text: it must be JSON; whether it reads as a status is `status`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let raw: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| format!("not a status (an agent older than /status?): {e}"))?;
        let status = serde_json::from_value(raw.clone())
            .map_err(|e| format!("a status this kubectl-mcs cannot read: {e}"));
        Ok(Self { status, raw })
    }

    /// The sync loop's part: the node's view, or why there is none.
    pub fn node(&self) -> Result<&NodeStatus, String> {
        let status = self.status.as_ref().map_err(Clone::clone)?;
        match &status.error {
            Some(e) => Err(e.clone()),
            None => Ok(&status.node),
        }
    }
}

/// Every agent's `/status` (with `query`), parsed; at most [`AGENTS_AT_ONCE`] asked at once.
pub async fn agent_statuses(
    client: &Client,
    ns: &str,
    agents: &[ChartPod],
    query: &str,
) -> Vec<(ChartPod, Result<AgentAnswer, String>)> {
    stream::iter(agents.iter().cloned())
        .map(|pod| async move {
            let r = pod_get(client, ns, &pod, &format!("/status{query}"))
                .await
                .and_then(|t| AgentAnswer::parse(&t));
            (pod, r)
        })
        .buffered(AGENTS_AT_ONCE)
        .collect()
        .await
}

/// A one-line form of a kube error.
pub fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => {
            // The chain of causes, each said once (hyper's repeat their wrapper's text).
            let mut s = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(x) = src {
                let t = x.to_string();
                if !s.contains(&t) {
                    s = format!("{s}: {t}");
                }
                src = x.source();
            }
            s
        }
    }
}
