//! The control plane of the node agent: from MCS objects to a live forwarding table.
//!
//! # Data flow
//!
//! ```text
//! source::kube (watchers + label selector) ─┐
//! source::file (DIR of YAML, re-read)      ─┴─▶ mpsc<SourceEvent> ─▶ SyncLoop ─▶ Dataplane
//!                                                  (convert)        (Index, coalesce, flush,
//!                                                                    metrics, events, /readyz)
//! ```
//!
//! - [`convert`]: Kubernetes objects → `mcs_model::input` (field copies).
//! - [`source`]: the [`source::SourceEvent`] stream of each source.
//! - [`sync_loop`]: the loop that coalesces bursts, flushes the index and applies diffs.
//! - [`metrics`]: Prometheus metrics; [`http`] (from `mcs-runtime`): `/metrics`, `/healthz`, `/readyz`.
//! - [`events`]: rate-limited Kubernetes Events for rejected objects.
//! - [`status`]: the node's view for the agent's `/status` (counts, rejections, one
//!   service's frontends and backends), answered by the sync loop between batches.
//! - [`owner`]: whether the agent's DaemonSet is being removed (an uninstall, not a restart).
#![forbid(unsafe_code)]

pub mod convert;
pub mod events;
pub use mcs_runtime::http;
pub mod metrics;
pub mod owner;
pub mod source;
pub mod status;
pub mod sync_loop;

pub use source::SourceEvent;
pub use sync_loop::{SyncConfig, SyncLoop};
