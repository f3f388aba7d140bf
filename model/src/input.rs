//! The index's input: the fields of ServiceImports, MCS EndpointSlices and the cluster id that
//! the forwarding table depends on, as plain data. The agent's sync converts Kubernetes objects
//! into these (a field-by-field copy); keeping them free of kube types keeps this crate pure.
//! Values are kept raw (strings, wide integers) so that validation happens here, in one place.

use std::{borrow::Cow, collections::BTreeMap};

/// `namespace/name` of a ServiceImport (the service an EndpointSlice belongs to).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl ServiceRef {
    /// `namespace/name`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Escaped: a name from a file source may hold a newline or an escape sequence.
        write!(f, "{}/{}", escaped(&self.namespace), escaped(&self.name))
    }
}

/// A ServiceImport.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ImportInput {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `metadata.creationTimestamp` (RFC 3339); the older import wins a VIP conflict.
    pub created: Option<String>,
    /// `metadata.uid`: breaks ties between imports created in the same second.
    pub uid: Option<String>,
    /// `spec.type`: `ClusterSetIP` or `Headless` (anything else is rejected).
    pub type_: String,
    /// `spec.ips`.
    pub ips: Vec<String>,
    /// `spec.ipFamilies`.
    pub ip_families: Vec<String>,
    /// `spec.ports`.
    pub ports: Vec<ImportPortInput>,
    /// `spec.sessionAffinity`.
    pub session_affinity: Option<String>,
    /// `spec.sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout_seconds: Option<i64>,
    /// `spec.trafficDistribution`.
    pub traffic_distribution: Option<String>,
    /// `spec.internalTrafficPolicy` (`Cluster` or `Local`).
    pub internal_traffic_policy: Option<String>,
    /// `status.endpointSliceObjects` is `Absent`: the import's writer publishes no
    /// EndpointSlices for it (`Present` or unset: the agent reads the MCS slices).
    pub endpoint_slices_absent: bool,
}

impl ImportInput {
    /// Its `namespace/name`.
    pub fn service_ref(&self) -> ServiceRef {
        ServiceRef::new(&self.namespace, &self.name)
    }
}

/// A port of a ServiceImport.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ImportPortInput {
    /// `name`.
    pub name: Option<String>,
    /// `protocol` (default TCP).
    pub protocol: Option<String>,
    /// `port`.
    pub port: i64,
}

/// An EndpointSlice (only MCS slices reach the index; others are rejected with a reason).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SliceInput {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `addressType`: `IPv4`, `IPv6` (`FQDN` is rejected).
    pub address_type: String,
    /// `ports`.
    pub ports: Vec<SlicePortInput>,
    /// `endpoints`.
    pub endpoints: Vec<EndpointInput>,
}

/// A port of an EndpointSlice: the real target port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SlicePortInput {
    /// `name`.
    pub name: Option<String>,
    /// `protocol` (default TCP).
    pub protocol: Option<String>,
    /// `port` (a slice port without one means "all ports": unusable for us).
    pub port: Option<i64>,
}

/// An endpoint of an EndpointSlice.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct EndpointInput {
    /// `addresses` (one endpoint; only the first one is used, as kube-proxy does).
    pub addresses: Vec<String>,
    /// `conditions.ready` (nil means ready).
    pub ready: Option<bool>,
    /// `conditions.serving` (nil means the value of ready).
    pub serving: Option<bool>,
    /// `conditions.terminating` (nil means false).
    pub terminating: Option<bool>,
    /// `zone`.
    pub zone: Option<String>,
    /// `nodeName`.
    pub node_name: Option<String>,
    /// `hostname` (its name under a headless service's DNS name).
    pub hostname: Option<String>,
}

/// `s` with control characters (newlines, escape sequences) written as escapes (`\n`,
/// `\u{1b}`): a name from an object can neither forge a line of a log or of `table`'s
/// output nor send a terminal escape sequence. Borrowed when there is nothing to escape.
pub fn escaped(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}
