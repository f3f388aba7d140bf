//! Kubernetes clients whose connections send at once: kube's own builder leaves Nagle's
//! algorithm on, so on every new connection the request, written right after the TLS
//! handshake's last message, waits for that message's (delayed) acknowledgement — about 40 ms
//! on Linux. A controller opens a new connection for every watch it starts and every read it
//! makes while its connections are all held by watches, so that wait was on the path of
//! every new export. This builds the same stack as kube's (TLS, timeouts, base URI, the
//! retry of 429/503 answers, authentication, extra headers) over a connector with
//! `TCP_NODELAY`; a kubeconfig that names a proxy gets kube's own client (built without
//! proxy support here, it refuses it as before). Left out of kube's stack: its per-request
//! debug spans.

use hyper_timeout::TimeoutConnector;
use hyper_util::{client::legacy::connect::HttpConnector, rt::TokioExecutor};
use kube::client::{ConfigExt as _, retry::RetryPolicy};
use tower::{BoxError, ServiceBuilder, retry::RetryLayer};

/// A client for `config`, its connections with `TCP_NODELAY`.
pub fn client(config: kube::Config) -> kube::Result<kube::Client> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let http_client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build::<_, kube::client::Body>(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http_client);
    Ok(kube::Client::new(service, config.default_namespace))
}
