//! Every label name (and shared label value) the crates use, in one place. The MCS and
//! EndpointSlice ones are defined in `mcs-model`, with the validation that reads them (the
//! pure core may not depend on this crate's kube types), and re-exported here; the others are
//! defined here.

pub use mcs_model::validate::{
    DEFAULT_SLICE_CONTROLLER, LABEL_MANAGED_BY, LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER,
    LABEL_SOURCE_MANAGED_BY, MIRRORING_SLICE_CONTROLLER,
};

/// The label Kubernetes puts on a Service's own EndpointSlices (the source slices the MCS
/// controller copies).
pub const LABEL_K8S_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The recommended label naming an object's manager (on the ServiceImports our controller
/// writes).
pub const LABEL_APP_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The recommended label naming the application an object is part of (on our CRDs).
pub const LABEL_PART_OF: &str = "app.kubernetes.io/part-of";
