//! What both binaries (`mcs-agent`, `mcs-controller`) need around their work, so neither
//! depends on the other's crates for it.
//!
//! # Layout
//!
//! - [`client`]: Kubernetes clients whose connections send at once (`TCP_NODELAY`).
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`handover`]: the listening sockets, handed from a node's running agent to its next one.
//! - [`retry`]: the retry delays of a failed watch.
//! - [`discovery`]: which version of an MCS kind a cluster serves and we read.
//! - [`watch`]: the list+watch driver: backoff that only a completed list or a watch event resets.
//! - [`open_files`]: the open-files limit, raised as far as it may go.
//! - [`signals`]: a clean stop on SIGTERM or SIGINT.
//! - [`logging`]: the tracing subscriber.
#![forbid(unsafe_code)]

pub mod client;
pub mod discovery;
pub mod handover;
pub mod http;
pub mod logging;
pub mod open_files;
pub mod retry;
pub mod signals;
pub mod watch;
