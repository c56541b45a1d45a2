//! Workloads and services: which exist, their addresses, identities, whether they speak HBONE,
//! the services they back. The store that holds them with the L4 authorization policies is
//! `store`; its YAML file has the camelCase shape of ztunnel's local configuration:
//!
//! ```yaml
//! workloads: [{uid, name, namespace, serviceAccount, trustDomain, workloadIps, protocol,
//!              status, services: {"NS/HOST": {PORT: TARGET_PORT}}, authorizationPolicies,
//!              waypoint}]
//! services:  [{name, namespace, hostname, vips: ["NET/IP"], ports: {PORT: TARGET_PORT},
//!              waypoint}]
//! waypoint:  {destination: {address: "NET/IP"} or {hostname: {namespace, hostname}},
//!             hboneMtlsPort: 15008}
//! policies:  [{name, namespace, scope, action, rules: [[[match]]]}]   (see `authorization`)
//! ```
//!
//! Fields this proxy does not use (node, network, subjectAltNames, ...) are accepted and ignored,
//! so one file can describe a mixed mesh.

use std::{collections::BTreeMap, net::IpAddr};

use serde::{Deserialize, Serialize};

use crate::identity::Identity;

/// How a workload is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// HTTP/2 CONNECT over mTLS to its port 15008.
    Hbone,
    /// Plain TCP (not in the mesh).
    #[default]
    Tcp,
}

/// Whose network a workload uses: its own, or its node's (`hostNetwork` pods, which share the
/// node's addresses). Named as ztunnel names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum NetworkMode {
    #[default]
    Standard,
    HostNetwork,
}

impl NetworkMode {
    fn is_standard(&self) -> bool {
        *self == Self::Standard
    }
}

/// Whether a workload may be picked as a service endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum HealthStatus {
    #[default]
    #[serde(alias = "HEALTHY")]
    Healthy,
    #[serde(alias = "UNHEALTHY")]
    Unhealthy,
}

/// One workload.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    pub uid: String,
    #[serde(default)]
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    /// A host-network workload's addresses are its node's: it is never found by them (every
    /// host-network pod of the node, and the node itself, has them), as in ztunnel.
    #[serde(default, skip_serializing_if = "NetworkMode::is_standard")]
    pub network_mode: NetworkMode,
    #[serde(default)]
    pub protocol: Protocol,
    #[serde(default)]
    pub status: HealthStatus,
    /// The services it backs: `"NS/HOSTNAME"` → service port → target port.
    #[serde(default)]
    pub services: BTreeMap<String, BTreeMap<u16, u16>>,
    /// WORKLOAD_SELECTOR policies that select it, as `"NS/NAME"`.
    #[serde(default)]
    pub authorization_policies: Vec<String>,
    /// Its canonical service (`service.istio.io/canonical-name`), for telemetry.
    #[serde(default)]
    pub canonical_name: String,
    /// The workload it belongs to (its owner: a Deployment's name, as ztunnel's `workloadName`):
    /// what telemetry labels by, so pods coming and going add no series.
    #[serde(default)]
    pub workload_name: String,
    /// The node it runs on (a proxy fetches certificates ahead for its own node's workloads).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// The waypoint istiod says every connection to it goes through (`proxy/resolve.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<Waypoint>,
}

/// A waypoint, as istiod names one (its `GatewayAddress`): an address, or a service by
/// hostname, and the port it takes HBONE on.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Waypoint {
    pub destination: WaypointAt,
    #[serde(default = "default_hbone_port")]
    pub hbone_mtls_port: u16,
}

/// Where a waypoint is.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "WaypointAtFields", into = "WaypointAtFields")]
pub enum WaypointAt {
    /// `NETWORK/IP` or `IP`: a waypoint workload's address, or its service's VIP.
    Address(String),
    /// A service: one of its endpoints.
    Hostname { namespace: String, hostname: String },
}

/// [`WaypointAt`] as the file writes it (istiod's oneof): `{address: …}` or `{hostname:
/// {namespace, hostname}}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct WaypointAtFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hostname: Option<NamespacedHostname>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct NamespacedHostname {
    namespace: String,
    hostname: String,
}

impl TryFrom<WaypointAtFields> for WaypointAt {
    type Error = &'static str;

    fn try_from(f: WaypointAtFields) -> Result<Self, Self::Error> {
        match (f.address, f.hostname) {
            (Some(a), None) => Ok(Self::Address(a)),
            (None, Some(h)) => Ok(Self::Hostname { namespace: h.namespace, hostname: h.hostname }),
            _ => Err("a waypoint's destination is one of `address` or `hostname`"),
        }
    }
}

impl From<WaypointAt> for WaypointAtFields {
    fn from(w: WaypointAt) -> Self {
        match w {
            WaypointAt::Address(a) => Self { address: Some(a), hostname: None },
            WaypointAt::Hostname { namespace, hostname } => {
                Self { address: None, hostname: Some(NamespacedHostname { namespace, hostname }) }
            }
        }
    }
}

fn default_hbone_port() -> u16 {
    datapath_common::consts::ports::HBONE
}

impl std::fmt::Display for Waypoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.destination {
            WaypointAt::Address(a) => write!(f, "{a}:{}", self.hbone_mtls_port),
            WaypointAt::Hostname { namespace, hostname } => {
                write!(f, "{namespace}/{hostname}:{}", self.hbone_mtls_port)
            }
        }
    }
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}

impl Workload {
    /// The workload label telemetry uses: its owner's name, or the pod's when it has none.
    pub fn workload_label(&self) -> &str {
        if self.workload_name.is_empty() {
            &self.name
        } else {
            &self.workload_name
        }
    }

    /// Its SPIFFE identity.
    pub fn identity(&self) -> Identity {
        Identity::new(&self.trust_domain, &self.namespace, &self.service_account)
    }
}

/// A service: virtual IPs in front of the workloads that back it.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Service {
    pub name: String,
    pub namespace: String,
    pub hostname: String,
    /// `"NETWORK/IP"` or `"IP"`.
    #[serde(default)]
    pub vips: Vec<String>,
    /// Service port → target port (used when the endpoint does not say).
    #[serde(default)]
    pub ports: BTreeMap<u16, u16>,
    /// The waypoint istiod says every connection to its VIPs goes through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<Waypoint>,
}

impl Service {
    /// `NS/HOSTNAME`, the key workloads use to name it.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname)
    }

    /// Its virtual IPs (the network prefix dropped); an entry that is not an IP is an error
    /// caught when the store is parsed.
    pub fn vip_addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.vips.iter().filter_map(|v| parse_vip(v).ok())
    }
}

pub(crate) fn parse_vip(v: &str) -> Result<IpAddr, String> {
    let ip = v.rsplit_once('/').map_or(v, |(_, ip)| ip);
    ip.parse().map_err(|_| format!("vip {v:?} is not NETWORK/IP or IP"))
}
