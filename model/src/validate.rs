//! Validation of the index's input. Nothing here stops the world: an invalid field trims what
//! it concerns (an IP, a port, an endpoint) or, when nothing sensible is left, rejects the whole
//! object; every such decision is a [`Rejection`] with a reason.

use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use serde::Serialize;

use crate::{
    Affinity, Protocol,
    guard::{Guard, noncanonical},
    input::{EndpointInput, ImportInput, ServiceRef, SliceInput},
    intern::Strings,
};

/// Label of an MCS EndpointSlice naming the imported service.
pub const LABEL_SERVICE_NAME: &str = "multicluster.kubernetes.io/service-name";
/// Label of an MCS EndpointSlice naming its source cluster.
pub const LABEL_SOURCE_CLUSTER: &str = "multicluster.kubernetes.io/source-cluster";
/// Label naming the manager of an EndpointSlice.
pub const LABEL_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
/// Label of an MCS EndpointSlice naming the manager of the slice it was copied from in the
/// source cluster (`endpointslice.kubernetes.io/managed-by` there; `none` when it had none),
/// written by our MCS controller. Only [`DEFAULT_SLICE_CONTROLLER`] computes endpoints from
/// a Service's selector; slices mirrored from `Endpoints` or written by hand hold whatever
/// their writer chose, so an agent refuses them unless told otherwise
/// ([`Guard::allow_selectorless`]). Absent (another MCS controller, or ours before it wrote
/// it): the slice is taken as it is.
pub const LABEL_SOURCE_MANAGED_BY: &str = "multicluster.x-k8s.io/source-managed-by";
/// `managed-by` value of the default Kubernetes EndpointSlice controller.
pub const DEFAULT_SLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";
/// `managed-by` value of Kubernetes' EndpointSlice mirroring controller (slices copied from
/// `Endpoints`, which anyone who may write `Endpoints` controls).
pub const MIRRORING_SLICE_CONTROLLER: &str = "endpointslicemirroring-controller.k8s.io";
/// Managers whose slices are never MCS slices.
pub const KUBERNETES_SLICE_CONTROLLERS: [&str; 2] =
    [DEFAULT_SLICE_CONTROLLER, MIRRORING_SLICE_CONTROLLER];
/// Default ClientIP affinity timeout (seconds).
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
/// Largest ClientIP affinity timeout (seconds), as for Services.
pub const MAX_AFFINITY_TIMEOUT_S: u32 = 86_400;

/// Why something was rejected. [`Reason::label`] is the metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Reason {
    /// `spec.type` is neither ClusterSetIP nor Headless.
    InvalidType,
    /// An IP does not parse.
    InvalidIp,
    /// An IP is not of the family `ipFamilies` gives, or a second IP of one family.
    WrongFamily,
    /// More than two IPs.
    TooManyIps,
    /// A VIP that is loopback, link-local, unspecified, multicast or broadcast.
    HostileVip,
    /// Port 0 or above 65535.
    InvalidPort,
    /// Protocol other than TCP, UDP, SCTP.
    UnknownProtocol,
    /// The same port and protocol twice.
    DuplicatePort,
    /// Affinity settings out of range.
    InvalidAffinity,
    /// Another, older import claims the same VIP, port and protocol.
    VipConflict,
    /// An EndpointSlice without the service-name label.
    MissingServiceLabel,
    /// An EndpointSlice without the source-cluster label.
    MissingClusterLabel,
    /// A source-cluster label that is not a DNS name (lowercase RFC 1123 labels): the
    /// slice's endpoints are used but get no DNS names of their own.
    InvalidClusterName,
    /// An EndpointSlice managed by the default Kubernetes controller (not MCS).
    DefaultController,
    /// `addressType` other than IPv4 / IPv6.
    UnsupportedAddressType,
    /// An endpoint address that does not parse or is not of the slice's family.
    InvalidEndpoint,
    /// An endpoint that is loopback, link-local, unspecified, multicast or broadcast.
    HostileEndpoint,
    /// A slice with no port that matches an import port.
    NoMatchingPort,
    /// An object the source cannot use (unknown kind, unparsable document).
    Unparsable,
    /// A VIP outside every `--clusterset-ip-cidr`.
    VipNotAllowed,
    /// A VIP or endpoint that is an address the agent depends on (node, API server).
    ProtectedAddress,
    /// An IPv4 address written as IPv6 (mapped, compatible, NAT64).
    NoncanonicalAddress,
    /// An endpoint inside a ClusterSetIP range (traffic would loop through the dataplane).
    EndpointIsClusterSetIp,
    /// A slice whose manager is not in `--trusted-managed-by`.
    UntrustedManager,
    /// An MCS slice copied from a source slice that no selector computed (mirrored from
    /// `Endpoints` or written by hand), without `--allow-selectorless-slices`.
    SelectorlessSource,
    /// More ports than allowed on one object.
    TooManyPorts,
    /// More endpoints than allowed on one slice.
    TooManyEndpoints,
    /// More backends than one frontend may have: the rest are trimmed.
    TooManyBackends,
    /// The table is full (frontends or backends in total): younger imports wait.
    OverCapacity,
    /// An object without a name.
    MissingName,
    /// The same object twice in a source; the first one is used.
    DuplicateObject,
    /// An apiVersion the agent does not know.
    UnsupportedVersion,
    /// An `internalTrafficPolicy` that is neither Cluster nor Local.
    InvalidPolicy,
    /// A file or document over the size or nesting limit.
    TooLarge,
    /// The dataplane could not program a frontend (a full map, say); the rest is programmed.
    Unprogrammable,
    /// An import whose writer says its endpoints are not EndpointSlice objects
    /// (`status.endpointSliceObjects: Absent`): the agent programs no frontend for it and
    /// leaves its ClusterSetIP to the implementation that serves it; DNS answers the
    /// ClusterSetIP. Not an alert: another implementation's import, not a broken one.
    EndpointSlicesAbsent,
}

impl Reason {
    /// Short snake_case label for metrics and events.
    pub fn label(self) -> &'static str {
        match self {
            Reason::InvalidType => "invalid_type",
            Reason::InvalidIp => "invalid_ip",
            Reason::WrongFamily => "wrong_family",
            Reason::TooManyIps => "too_many_ips",
            Reason::HostileVip => "hostile_vip",
            Reason::InvalidPort => "invalid_port",
            Reason::UnknownProtocol => "unknown_protocol",
            Reason::DuplicatePort => "duplicate_port",
            Reason::InvalidAffinity => "invalid_affinity",
            Reason::VipConflict => "vip_conflict",
            Reason::MissingServiceLabel => "missing_service_label",
            Reason::MissingClusterLabel => "missing_cluster_label",
            Reason::InvalidClusterName => "invalid_cluster_name",
            Reason::DefaultController => "default_controller",
            Reason::UnsupportedAddressType => "unsupported_address_type",
            Reason::InvalidEndpoint => "invalid_endpoint",
            Reason::HostileEndpoint => "hostile_endpoint",
            Reason::NoMatchingPort => "no_matching_port",
            Reason::Unparsable => "unparsable",
            Reason::VipNotAllowed => "vip_not_allowed",
            Reason::ProtectedAddress => "protected_address",
            Reason::NoncanonicalAddress => "noncanonical_address",
            Reason::EndpointIsClusterSetIp => "endpoint_is_clusterset_ip",
            Reason::UntrustedManager => "untrusted_manager",
            Reason::SelectorlessSource => "selectorless_source",
            Reason::TooManyPorts => "too_many_ports",
            Reason::TooManyEndpoints => "too_many_endpoints",
            Reason::TooManyBackends => "too_many_backends",
            Reason::OverCapacity => "over_capacity",
            Reason::MissingName => "missing_name",
            Reason::DuplicateObject => "duplicate_object",
            Reason::UnsupportedVersion => "unsupported_version",
            Reason::InvalidPolicy => "invalid_policy",
            Reason::TooLarge => "too_large",
            Reason::Unprogrammable => "unprogrammable",
            Reason::EndpointSlicesAbsent => "endpoint_slices_absent",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One rejected or trimmed thing, with the object it belongs to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rejection {
    /// `ServiceImport ns/name` or `EndpointSlice ns/name`.
    pub object: String,
    /// Why (metric label).
    pub reason: Reason,
    /// What exactly, for a person.
    pub message: String,
}

impl Rejection {
    /// A rejection of `object` (`Kind ns/name`).
    pub fn new(object: impl fmt::Display, reason: Reason, message: impl Into<String>) -> Self {
        Self {
            object: object.to_string(),
            reason,
            message: message.into(),
        }
    }
}

/// Parses a protocol name (default TCP).
pub fn parse_protocol(p: Option<&str>) -> Option<Protocol> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(Protocol::Tcp),
        "UDP" => Some(Protocol::Udp),
        "SCTP" => Some(Protocol::Sctp),
        _ => None,
    }
}

/// `Kind namespace/name` of an object, formatted only when a rejection needs it (a full sync
/// validates hundreds of thousands of objects, almost all fine).
#[derive(Clone, Copy)]
struct ObjectName<'a>(&'static str, &'a str, &'a str);

impl fmt::Display for ObjectName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}/{}",
            self.0,
            crate::input::escaped(self.1),
            crate::input::escaped(self.2)
        )
    }
}

/// The protocol (default TCP) and port (1..=65535) of a port entry, or a rejection. `label`
/// names the port in messages.
fn protocol_and_port(
    object: ObjectName<'_>,
    label: &dyn fmt::Display,
    protocol: Option<&str>,
    port: Option<i64>,
    out: &mut Vec<Rejection>,
) -> Option<(Protocol, u16)> {
    let Some(p) = parse_protocol(protocol) else {
        out.push(Rejection::new(
            object,
            Reason::UnknownProtocol,
            format!("port {label} has protocol {:?}", protocol.unwrap_or("")),
        ));
        return None;
    };
    match port.and_then(|n| u16::try_from(n).ok()).filter(|&n| n != 0) {
        Some(n) => Some((p, n)),
        None => {
            let shown = port.map_or("none".to_string(), |n| n.to_string());
            out.push(Rejection::new(
                object,
                Reason::InvalidPort,
                format!("port {label}: {shown} is out of 1..65535"),
            ));
            None
        }
    }
}

/// Cloud instance metadata (and platform) services outside the link-local ranges, which
/// answer the node's own identity: an endpoint there would let a tenant have the node (the
/// userspace forwarder connects from the node's network namespace) ask for its credentials.
/// AWS's IPv6 IMDS, Alibaba Cloud's, Azure's WireServer, Oracle Cloud's, Google Cloud's IPv6
/// metadata server. (169.254.169.254 and its link-local kin are refused as link-local.)
pub const CLOUD_METADATA: [IpAddr; 5] = [
    IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V4(Ipv4Addr::new(168, 63, 129, 16)),
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),
    IpAddr::V6(std::net::Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254)),
];

/// Why an address must never be programmed, if it must not.
pub fn hostile(ip: IpAddr) -> Option<&'static str> {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    if CLOUD_METADATA.contains(&ip) {
        return Some("a cloud metadata service");
    }
    match ip {
        IpAddr::V4(v4) => {
            if v4.is_unspecified() {
                Some("unspecified")
            } else if v4.is_loopback() {
                Some("loopback")
            } else if v4.is_link_local() {
                Some("link-local")
            } else if v4.is_multicast() {
                Some("multicast")
            } else if v4 == Ipv4Addr::BROADCAST {
                Some("broadcast")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_unspecified() {
                Some("unspecified")
            } else if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unicast_link_local() {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else {
                None
            }
        }
    }
}

/// Why `ip` may not be programmed as a VIP (`vip`) or as an endpoint, if it may not: a second
/// spelling of an IPv4 address, a hostile address, an address the agent depends on, a VIP
/// outside the ClusterSetIP ranges, or an endpoint inside them (a loop).
pub fn refused(ip: IpAddr, guard: &Guard, vip: bool) -> Option<(Reason, String)> {
    if let Some(why) = noncanonical(ip) {
        return Some((
            Reason::NoncanonicalAddress,
            format!("{ip} is {why}; write the IPv4 address as IPv4"),
        ));
    }
    if let Some(why) = hostile(ip) {
        let reason = if vip {
            Reason::HostileVip
        } else {
            Reason::HostileEndpoint
        };
        return Some((reason, format!("{ip} is {why}")));
    }
    if guard.protected.contains(&ip) {
        return Some((
            Reason::ProtectedAddress,
            format!("{ip} is an address this node depends on (node or API server)"),
        ));
    }
    if vip && !guard.vip_allowed(ip) {
        let ranges: Vec<String> = guard
            .clusterset_cidrs
            .iter()
            .map(ToString::to_string)
            .collect();
        return Some((
            Reason::VipNotAllowed,
            format!(
                "{ip} is outside the ClusterSetIP ranges ({})",
                ranges.join(", ")
            ),
        ));
    }
    if !vip && let Some(range) = guard.clusterset_range(ip) {
        return Some((
            Reason::EndpointIsClusterSetIp,
            format!("{ip} is inside the ClusterSetIP range {range}: it would loop"),
        ));
    }
    None
}

/// A frontend template of an import: one VIP × one port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportFrontend {
    /// VIP.
    pub vip: IpAddr,
    /// Service port.
    pub port: u16,
    /// Protocol.
    pub protocol: Protocol,
    /// Port name, matched against slice port names.
    pub port_name: Option<String>,
}

/// Conflict order of imports: `creationTimestamp` (older first; none sorts last), then the
/// uid (assigned by the API server, so nobody can choose a winning tie), then `ns/name`.
/// Shared: the index keeps it once per import and refers to it from each VIP it claims.
pub type AgeKey = Arc<(String, String, ServiceRef)>;

/// A validated ServiceImport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidImport {
    /// Conflict order (its last part is the import's `namespace/name`).
    pub age_key: AgeKey,
    /// The usable VIPs; the import owns each (all ports) unless an older import does.
    pub vips: Vec<IpAddr>,
    /// Frontends (empty for Headless).
    pub frontends: Vec<ImportFrontend>,
    /// `spec.type: Headless` (no VIPs; DNS names its endpoints).
    pub headless: bool,
    /// The valid ports: (name, protocol, port), in the import's order.
    pub ports: Vec<(Option<String>, Protocol, u16)>,
    /// ClientIP affinity.
    pub affinity: Option<Affinity>,
    /// `trafficDistribution: PreferClose`.
    pub prefer_close: bool,
    /// `internalTrafficPolicy: Local`: only endpoints on this node get connections.
    pub node_local: bool,
}

/// Validates an import against the node's `guard`. `None` when nothing of it is usable;
/// rejections either way.
pub fn import(input: &ImportInput, guard: &Guard, out: &mut Vec<Rejection>) -> Option<ValidImport> {
    let object = ObjectName("ServiceImport", &input.namespace, &input.name);
    if input.name.is_empty() {
        out.push(Rejection::new(
            object,
            Reason::MissingName,
            "metadata.name is empty",
        ));
        return None;
    }
    let service = input.service_ref();
    // A missing timestamp (file source) sorts after every real one.
    let age_key = Arc::new((
        input.created.clone().unwrap_or_else(|| "~".into()),
        input.uid.clone().unwrap_or_default(),
        service,
    ));
    let headless = match input.type_.as_str() {
        "ClusterSetIP" | "" => false,
        "Headless" => true,
        other => {
            out.push(Rejection::new(
                object,
                Reason::InvalidType,
                format!("type {other:?} is neither ClusterSetIP nor Headless"),
            ));
            return None;
        }
    };
    let node_local = match input.internal_traffic_policy.as_deref() {
        None | Some("" | "Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            out.push(Rejection::new(
                object,
                Reason::InvalidPolicy,
                format!(
                    "internalTrafficPolicy {other:?} is neither Cluster nor Local; using Cluster"
                ),
            ));
            false
        }
    };
    let mut valid = ValidImport {
        age_key,
        vips: Vec::new(),
        frontends: Vec::new(),
        headless,
        ports: Vec::new(),
        affinity: None,
        prefer_close: input.traffic_distribution.as_deref() == Some("PreferClose"),
        node_local,
    };
    if !headless && input.ips.len() > 2 {
        out.push(Rejection::new(
            object,
            Reason::TooManyIps,
            format!("{} ips; at most two (one per family)", input.ips.len()),
        ));
        return None;
    }
    let max_ports = guard.limits.ports_per_import;
    if input.ports.len() > max_ports {
        out.push(Rejection::new(
            object,
            Reason::TooManyPorts,
            format!(
                "{} ports; at most {max_ports} per import",
                input.ports.len()
            ),
        ));
        return None;
    }
    let mut vips = Vec::new();
    // A headless import's ips are not used (nor checked).
    let ips: &[String] = if headless { &[] } else { &input.ips };
    for (i, raw) in ips.iter().enumerate() {
        let Ok(ip) = raw.trim().parse::<IpAddr>() else {
            out.push(Rejection::new(
                object,
                Reason::InvalidIp,
                format!("ip {raw:?} does not parse"),
            ));
            continue;
        };
        if let Some((reason, message)) = refused(ip, guard, true) {
            out.push(Rejection::new(object, reason, format!("ip {message}")));
            continue;
        }
        let want = input.ip_families.get(i).map(String::as_str);
        let is_v4 = ip.is_ipv4();
        let family_ok = match want {
            Some("IPv4") => is_v4,
            Some("IPv6") => !is_v4,
            _ => true,
        };
        if !family_ok || vips.iter().any(|v: &IpAddr| v.is_ipv4() == is_v4) {
            out.push(Rejection::new(
                object,
                Reason::WrongFamily,
                format!(
                    "ip {ip} is not of family {} or repeats a family",
                    want.unwrap_or("?")
                ),
            ));
            continue;
        }
        vips.push(ip);
    }
    let mut seen = BTreeSet::new();
    let mut ports = Vec::new();
    for p in &input.ports {
        let Some((protocol, port)) =
            protocol_and_port(object, &p.port, p.protocol.as_deref(), Some(p.port), out)
        else {
            continue;
        };
        if !seen.insert((port, protocol)) {
            out.push(Rejection::new(
                object,
                Reason::DuplicatePort,
                format!("port {port}/{protocol} appears twice; the first is used"),
            ));
            continue;
        }
        ports.push((port, protocol, p.name.clone().filter(|n| !n.is_empty())));
    }
    valid.ports = ports
        .iter()
        .map(|(port, protocol, name)| (name.clone(), *protocol, *port))
        .collect();
    if input.endpoint_slices_absent {
        // A ClusterSetIP import keeps its VIPs claimed (one owner per VIP) and named in DNS,
        // as the import's IPs are what such an implementation serves; no frontend is
        // programmed, so connections to them pass through to it untouched.
        out.push(Rejection::new(
            object,
            Reason::EndpointSlicesAbsent,
            if headless {
                "status.endpointSliceObjects is Absent: its writer publishes no EndpointSlices, so this headless import has no endpoints here (DNS has no records for it)"
            } else {
                "status.endpointSliceObjects is Absent: its writer publishes no EndpointSlices, so this agent programs no frontend for it and leaves its ClusterSetIP to the implementation that wrote it (DNS still answers the ClusterSetIP)"
            },
        ));
    }
    if headless {
        return Some(valid);
    }
    valid.vips.clone_from(&vips);
    if input.endpoint_slices_absent {
        return Some(valid);
    }
    valid.frontends.reserve_exact(vips.len() * ports.len());
    for vip in &vips {
        for (port, protocol, name) in &ports {
            valid.frontends.push(ImportFrontend {
                vip: *vip,
                port: *port,
                protocol: *protocol,
                port_name: name.clone(),
            });
        }
    }
    if input.session_affinity.as_deref() == Some("ClientIP") {
        let timeout = match input.affinity_timeout_seconds {
            None => DEFAULT_AFFINITY_TIMEOUT_S,
            Some(t) => match u32::try_from(t) {
                Ok(t) if (1..=MAX_AFFINITY_TIMEOUT_S).contains(&t) => t,
                _ => {
                    out.push(Rejection::new(
                        object,
                        Reason::InvalidAffinity,
                        format!(
                            "timeoutSeconds {t} out of 1..{MAX_AFFINITY_TIMEOUT_S}; using {DEFAULT_AFFINITY_TIMEOUT_S}"
                        ),
                    ));
                    DEFAULT_AFFINITY_TIMEOUT_S
                }
            },
        };
        valid.affinity = Some(Affinity {
            timeout_seconds: timeout,
        });
    }
    Some(valid)
}

/// A validated endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidEndpoint {
    /// Address.
    pub address: IpAddr,
    /// Ready (nil → true).
    pub ready: bool,
    /// Serving (nil → ready).
    pub serving: bool,
    /// Terminating (nil → false).
    pub terminating: bool,
    /// Zone (interned; shared with the backends made from it).
    pub zone: Option<Arc<str>>,
    /// `nodeName` (for `internalTrafficPolicy: Local`; interned).
    pub node: Option<Arc<str>>,
    /// `hostname`, when it is a valid DNS label (its DNS name under a headless service).
    pub hostname: Option<Box<str>>,
}

/// A validated MCS EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidSlice {
    /// Source cluster (shared with the backends made from it).
    pub cluster: Arc<str>,
    /// IPv4 (else IPv6) addresses.
    pub v4: bool,
    /// Ports: (name, protocol, target port).
    pub ports: Vec<(Option<String>, Protocol, u16)>,
    /// Usable endpoints.
    pub endpoints: Vec<ValidEndpoint>,
}

/// The service an EndpointSlice names by label, if any.
pub fn slice_service(input: &SliceInput) -> Option<ServiceRef> {
    service_label(input).map(|s| ServiceRef::new(&input.namespace, s))
}

/// The name of that service, not copied.
fn service_label(input: &SliceInput) -> Option<&str> {
    input
        .labels
        .get(LABEL_SERVICE_NAME)
        .map(String::as_str)
        .filter(|s| !s.is_empty())
}

/// Validates an EndpointSlice against the node's `guard`. Cluster, zone and node names come
/// from `strings`.
pub fn slice(
    input: &SliceInput,
    guard: &Guard,
    strings: &mut Strings,
    out: &mut Vec<Rejection>,
) -> Option<ValidSlice> {
    let object = ObjectName("EndpointSlice", &input.namespace, &input.name);
    if input.name.is_empty() {
        out.push(Rejection::new(
            object,
            Reason::MissingName,
            "metadata.name is empty",
        ));
        return None;
    }
    if service_label(input).is_none() {
        out.push(Rejection::new(
            object,
            Reason::MissingServiceLabel,
            format!("no {LABEL_SERVICE_NAME} label"),
        ));
        return None;
    }
    let manager = input.labels.get(LABEL_MANAGED_BY).map(String::as_str);
    if let Some(m) = manager.filter(|m| KUBERNETES_SLICE_CONTROLLERS.contains(m)) {
        out.push(Rejection::new(
            object,
            Reason::DefaultController,
            format!("managed by {m}: a slice of an ordinary Service or of Endpoints, not MCS"),
        ));
        return None;
    }
    if let Some(source) = input.labels.get(LABEL_SOURCE_MANAGED_BY)
        && source != DEFAULT_SLICE_CONTROLLER
        && !guard.allow_selectorless
    {
        out.push(Rejection::new(
            object,
            Reason::SelectorlessSource,
            format!(
                "copied from a slice managed by {source:?} in its cluster (mirrored from Endpoints or written by hand, not computed from a Service's selector); allowed with --allow-selectorless-slices"
            ),
        ));
        return None;
    }
    if !guard.trusted_managed_by.is_empty()
        && !manager.is_some_and(|m| guard.trusted_managed_by.contains(m))
    {
        let trusted: Vec<&str> = guard
            .trusted_managed_by
            .iter()
            .map(String::as_str)
            .collect();
        out.push(Rejection::new(
            object,
            Reason::UntrustedManager,
            format!(
                "{LABEL_MANAGED_BY} is {:?}, not one of --trusted-managed-by ({})",
                manager.unwrap_or(""),
                trusted.join(", ")
            ),
        ));
        return None;
    }
    let Some(cluster) = input
        .labels
        .get(LABEL_SOURCE_CLUSTER)
        .filter(|c| !c.is_empty())
    else {
        out.push(Rejection::new(
            object,
            Reason::MissingClusterLabel,
            format!("no {LABEL_SOURCE_CLUSTER} label"),
        ));
        return None;
    };
    if !cluster.split('.').all(dns_label) {
        out.push(Rejection::new(
            object,
            Reason::InvalidClusterName,
            format!(
                "{LABEL_SOURCE_CLUSTER} {cluster:?} is not a DNS name (lowercase letters, digits, '-' and '.'): its endpoints are used but get no DNS names"
            ),
        ));
    }
    let v4 = match input.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        other => {
            out.push(Rejection::new(
                object,
                Reason::UnsupportedAddressType,
                format!("addressType {other:?}; only IPv4 and IPv6 are supported"),
            ));
            return None;
        }
    };
    let limits = &guard.limits;
    let over = [
        (
            Reason::TooManyPorts,
            "ports",
            input.ports.len(),
            limits.ports_per_slice,
        ),
        (
            Reason::TooManyEndpoints,
            "endpoints",
            input.endpoints.len(),
            limits.endpoints_per_slice,
        ),
    ]
    .into_iter()
    .find(|(_, _, n, max)| n > max);
    if let Some((reason, what, n, max)) = over {
        out.push(Rejection::new(
            object,
            reason,
            format!("{n} {what}; at most {max} per slice"),
        ));
        return None;
    }
    let mut ports = Vec::with_capacity(input.ports.len());
    for p in &input.ports {
        let name = p.name.as_deref().unwrap_or("");
        let Some((protocol, port)) = protocol_and_port(
            object,
            &format_args!("{name:?}"),
            p.protocol.as_deref(),
            p.port,
            out,
        ) else {
            continue;
        };
        ports.push((p.name.clone().filter(|n| !n.is_empty()), protocol, port));
    }
    let mut endpoints: Vec<ValidEndpoint> = Vec::with_capacity(input.endpoints.len());
    for ep in &input.endpoints {
        if let Some(e) = endpoint(object, ep, v4, guard, strings, out) {
            endpoints.push(e);
        }
    }
    // Held for as long as the slice is: no spare capacity.
    ports.shrink_to_fit();
    endpoints.shrink_to_fit();
    Some(ValidSlice {
        cluster: strings.get(cluster),
        v4,
        ports,
        endpoints,
    })
}

fn endpoint(
    object: ObjectName<'_>,
    ep: &EndpointInput,
    v4: bool,
    guard: &Guard,
    strings: &mut Strings,
    out: &mut Vec<Rejection>,
) -> Option<ValidEndpoint> {
    let Some(raw) = ep.addresses.first() else {
        out.push(Rejection::new(
            object,
            Reason::InvalidEndpoint,
            "endpoint without addresses",
        ));
        return None;
    };
    let Ok(address) = raw.trim().parse::<IpAddr>() else {
        out.push(Rejection::new(
            object,
            Reason::InvalidEndpoint,
            format!("address {raw:?} does not parse"),
        ));
        return None;
    };
    if let Some((reason, message)) = refused(address, guard, false) {
        out.push(Rejection::new(object, reason, format!("address {message}")));
        return None;
    }
    if address.is_ipv4() != v4 {
        out.push(Rejection::new(
            object,
            Reason::InvalidEndpoint,
            format!("address {address} is not of the slice's addressType"),
        ));
        return None;
    }
    let ready = ep.ready.unwrap_or(true);
    Some(ValidEndpoint {
        address,
        ready,
        serving: ep.serving.unwrap_or(ready),
        terminating: ep.terminating.unwrap_or(false),
        zone: ep
            .zone
            .as_deref()
            .filter(|z| !z.is_empty())
            .map(|z| strings.get(z)),
        node: ep
            .node_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|n| strings.get(n)),
        hostname: ep
            .hostname
            .as_deref()
            .filter(|h| dns_label(h))
            .map(Box::from),
    })
}

/// Whether `id` can be a cluster id: lowercase DNS labels (RFC 1123) joined by dots, at most
/// 63 bytes in all, so that it is a valid label value (`multicluster.kubernetes.io/source-cluster`
/// on every MCS EndpointSlice) and a DNS name part.
pub fn cluster_id(id: &str) -> bool {
    id.len() <= 63 && id.split('.').all(dns_label)
}

/// Whether `s` is a DNS label as Kubernetes allows hostnames (RFC 1123: 1–63 lowercase
/// letters, digits and dashes, not starting or ending with a dash). Anything else is not
/// published as a name (the endpoint gets its dashed-address name instead).
pub fn dns_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cluster_id_is_dns_labels_joined_by_dots_within_63_bytes() {
        for ok in ["c1", "east-1", "a.b", &"a".repeat(63)] {
            assert!(super::cluster_id(ok), "{ok}");
        }
        for bad in ["", "C1", "a..b", "a.", "-a", "a_b", &"a".repeat(64), "a b"] {
            assert!(!super::cluster_id(bad), "{bad}");
        }
    }
}
