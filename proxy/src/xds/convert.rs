//! istiod's resources, as they arrive over xDS, made into the store's workloads, services and
//! policies, or refused with the reason the NACK carries. Checked here, once, so that nothing
//! past this point meets a malformed address or an enum value it does not know.
//!
//! Stricter than ztunnel in one respect: where ztunnel drops a malformed part of a policy (a
//! string match with no kind, an address of the wrong length) and keeps the rest, which can
//! leave a DENY matching less than it says, such a policy is refused whole; the one held before
//! stays in force.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;
use meshpath_xds::{security as pb_sec, workload as pb};

use crate::state::{
    authorization::{Action, Cidr, Match, Policy, Scope, ServiceAccountMatch, StringMatch},
    workloads::{HealthStatus, NetworkMode, Protocol, Service, Waypoint, WaypointAt, Workload},
};

/// Why a resource was refused (what the NACK says after its name).
pub type Refusal = String;

/// One Address resource: a workload or a service.
#[derive(Debug, Clone)]
pub enum Address {
    Workload(Workload),
    Service(Service),
}

/// Raw address bytes: 4 (IPv4) or 16 (IPv6).
pub fn ip(bytes: &[u8]) -> Result<IpAddr, Refusal> {
    match bytes.len() {
        4 => Ok(IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))),
        16 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(bytes);
            Ok(IpAddr::V6(Ipv6Addr::from(a)))
        }
        n => Err(format!("failed to parse address, had {n} bytes")),
    }
}

fn port(v: u32, what: &str) -> Result<u16, Refusal> {
    u16::try_from(v).map_err(|_| format!("{what} {v} is not a port"))
}

fn known<T>(v: Result<T, prost::UnknownEnumValue>, what: &str) -> Result<T, Refusal> {
    v.map_err(|e| format!("unknown enum: {what}: {}", e.0))
}

/// A waypoint or gateway, checked.
fn gateway(g: Option<&pb::GatewayAddress>, what: &str) -> Result<Option<Waypoint>, Refusal> {
    let Some(g) = g else { return Ok(None) };
    let destination = match &g.destination {
        None => return Err(format!("nonempty {what} is missing address")),
        Some(pb::gateway_address::Destination::Address(a)) => {
            WaypointAt::Address(format!("{}/{}", a.network, ip(&a.address)?))
        }
        Some(pb::gateway_address::Destination::Hostname(h)) => {
            if h.hostname.is_empty() {
                return Err(format!("{what} names an empty hostname"));
            }
            WaypointAt::Hostname { namespace: h.namespace.clone(), hostname: h.hostname.clone() }
        }
    };
    let hbone_mtls_port = port(g.hbone_mtls_port, &format!("{what}'s HBONE port"))?;
    Ok(Some(Waypoint { destination, hbone_mtls_port }))
}

/// An Address resource named `name`: a workload must be named by its uid, a service by
/// `NAMESPACE/HOSTNAME`.
pub fn address(name: &str, a: &pb::Address) -> Result<Address, Refusal> {
    match &a.r#type {
        Some(pb::address::Type::Workload(w)) => {
            let w = workload(w)?;
            if w.uid != name {
                return Err(format!("a workload's resource name must be its uid ({:?})", w.uid));
            }
            Ok(Address::Workload(w))
        }
        Some(pb::address::Type::Service(s)) => {
            let s = service(s)?;
            if s.key() != name {
                return Err(format!(
                    "a service's resource name must be NAMESPACE/HOSTNAME ({:?})",
                    s.key()
                ));
            }
            Ok(Address::Service(s))
        }
        None => Err("unknown address type".into()),
    }
}

pub fn workload(w: &pb::Workload) -> Result<Workload, Refusal> {
    if w.uid.is_empty() {
        return Err("workload without a uid".into());
    }
    let workload_ips = w.addresses.iter().map(|a| ip(a)).collect::<Result<Vec<_>, _>>()?;
    let protocol = match known(pb::TunnelProtocol::try_from(w.tunnel_protocol), "tunnel protocol")?
    {
        pb::TunnelProtocol::Hbone => Protocol::Hbone,
        pb::TunnelProtocol::None => Protocol::Tcp,
        pb::TunnelProtocol::LegacyIstioMtls => {
            return Err("unsupported tunnel protocol: legacy istio mtls".into())
        }
    };
    let status = match known(pb::WorkloadStatus::try_from(w.status), "workload status")? {
        pb::WorkloadStatus::Healthy => HealthStatus::Healthy,
        pb::WorkloadStatus::Unhealthy => HealthStatus::Unhealthy,
    };
    let network_mode = match known(pb::NetworkMode::try_from(w.network_mode), "network mode")? {
        pb::NetworkMode::Standard => NetworkMode::Standard,
        pb::NetworkMode::HostNetwork => NetworkMode::HostNetwork,
    };
    if let Some(t) = &w.application_tunnel {
        known(pb::application_tunnel::Protocol::try_from(t.protocol), "application tunnel")?;
    }
    let waypoint = gateway(w.waypoint.as_ref(), "waypoint")?;
    gateway(w.network_gateway.as_ref(), "network gateway")?;
    let mut services = BTreeMap::new();
    for (key, list) in &w.services {
        if !key.contains('/') {
            return Err(format!("failed to parse namespaced hostname: {key}"));
        }
        let mut ports = BTreeMap::new();
        for p in &list.ports {
            ports
                .insert(port(p.service_port, "service port")?, port(p.target_port, "target port")?);
        }
        services.insert(key.clone(), ports);
    }
    Ok(Workload {
        uid: w.uid.clone(),
        name: w.name.clone(),
        namespace: w.namespace.clone(),
        service_account: if w.service_account.is_empty() {
            "default".into()
        } else {
            w.service_account.clone()
        },
        trust_domain: if w.trust_domain.is_empty() {
            "cluster.local".into()
        } else {
            w.trust_domain.clone()
        },
        workload_ips,
        network_mode,
        protocol,
        status,
        services,
        authorization_policies: w.authorization_policies.clone(),
        canonical_name: w.canonical_name.clone(),
        workload_name: w.workload_name.clone(),
        node: w.node.clone(),
        waypoint,
    })
}

pub fn service(s: &pb::Service) -> Result<Service, Refusal> {
    if s.hostname.is_empty() {
        return Err("service without a hostname".into());
    }
    let vips = s
        .addresses
        .iter()
        .map(|a| ip(&a.address).map(|ip| format!("{}/{ip}", a.network)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = BTreeMap::new();
    for p in &s.ports {
        ports.insert(port(p.service_port, "service port")?, port(p.target_port, "target port")?);
    }
    if let Some(lb) = &s.load_balancing {
        for r in &lb.routing_preference {
            if known(pb::load_balancing::Scope::try_from(*r), "routing preference")?
                == pb::load_balancing::Scope::UnspecifiedScope
            {
                return Err("unknown enum: invalid target".into());
            }
        }
        known(pb::load_balancing::Mode::try_from(lb.mode), "load balancing mode")?;
        known(pb::load_balancing::HealthPolicy::try_from(lb.health_policy), "health policy")?;
    }
    known(pb::IpFamilies::try_from(s.ip_families), "ip families")?;
    let waypoint = gateway(s.waypoint.as_ref(), "waypoint")?;
    Ok(Service {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        hostname: s.hostname.clone(),
        vips,
        ports,
        waypoint,
    })
}

/// An Authorization resource named `name` (istiod: `NAMESPACE/NAME`, what workloads refer to).
pub fn policy(name: &str, a: &pb_sec::Authorization) -> Result<Policy, Refusal> {
    let scope = match known(pb_sec::Scope::try_from(a.scope), "scope")? {
        pb_sec::Scope::Global => Scope::Global,
        pb_sec::Scope::Namespace => Scope::Namespace,
        pb_sec::Scope::WorkloadSelector => Scope::WorkloadSelector,
    };
    let action = match known(pb_sec::Action::try_from(a.action), "action")? {
        pb_sec::Action::Allow => Action::Allow,
        pb_sec::Action::Deny => Action::Deny,
    };
    let p = Policy {
        name: a.name.clone(),
        namespace: a.namespace.clone(),
        scope,
        action,
        rules: a
            .rules
            .iter()
            .map(|r| {
                r.clauses
                    .iter()
                    .map(|c| c.matches.iter().map(matches).collect::<Result<Vec<_>, _>>())
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?,
        dry_run: a.dry_run,
    };
    if p.key() != name {
        return Err(format!("a policy's resource name must be NAMESPACE/NAME ({:?})", p.key()));
    }
    Ok(p)
}

fn strings(v: &[pb_sec::StringMatch]) -> Result<Vec<StringMatch>, Refusal> {
    v.iter()
        .map(|m| match &m.match_type {
            Some(pb_sec::string_match::MatchType::Exact(s)) => Ok(StringMatch::Exact(s.clone())),
            Some(pb_sec::string_match::MatchType::Prefix(s)) => Ok(StringMatch::Prefix(s.clone())),
            Some(pb_sec::string_match::MatchType::Suffix(s)) => Ok(StringMatch::Suffix(s.clone())),
            Some(pb_sec::string_match::MatchType::Presence(())) => Ok(StringMatch::Presence()),
            None => Err("a string match of no kind".to_owned()),
        })
        .collect()
}

fn cidrs(v: &[pb_sec::Address]) -> Result<Vec<Cidr>, Refusal> {
    v.iter()
        .map(|a| {
            let ip = ip(&a.address)?;
            let len = u8::try_from(a.length).map_err(|_| format!("invalid cidr: /{}", a.length))?;
            IpNet::new(ip, len).map(Cidr).map_err(|_| format!("invalid cidr: {ip}/{len}"))
        })
        .collect()
}

fn accounts(v: &[pb_sec::ServiceAccountMatch]) -> Vec<ServiceAccountMatch> {
    v.iter()
        .map(|s| ServiceAccountMatch {
            namespace: s.namespace.clone(),
            service_account: s.service_account.clone(),
        })
        .collect()
}

fn ports(v: &[u32]) -> Result<Vec<u16>, Refusal> {
    v.iter().map(|p| port(*p, "destination port")).collect()
}

fn matches(m: &pb_sec::Match) -> Result<Match, Refusal> {
    Ok(Match {
        namespaces: strings(&m.namespaces)?,
        not_namespaces: strings(&m.not_namespaces)?,
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: strings(&m.principals)?,
        not_principals: strings(&m.not_principals)?,
        source_ips: cidrs(&m.source_ips)?,
        not_source_ips: cidrs(&m.not_source_ips)?,
        destination_ips: cidrs(&m.destination_ips)?,
        not_destination_ips: cidrs(&m.not_destination_ips)?,
        destination_ports: ports(&m.destination_ports)?,
        not_destination_ports: ports(&m.not_destination_ports)?,
    })
}
