//! What the proxy knows about the mesh, as data: the workloads, services and L4 authorization
//! policies (`workloads`: workloads and services; `authorization`: the policies and how they
//! decide; `store`: all of them, indexed for what connections look up), and whether the control plane's first state has
//! arrived (`Synced`). Nothing here opens a socket or serves a pod: the traffic paths
//! (`crate::proxy`) read it, and the control plane (`crate::xds`) or the workloads file
//! (`crate::reload`) write it.

pub mod authorization;
pub mod store;
pub mod workloads;

use std::sync::atomic::{AtomicBool, Ordering};

/// An address as the store keeps and compares it: an IPv4-mapped IPv6 address (what a dual-stack
/// socket reports for an IPv4 peer) as the IPv4 address.
pub fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// Whether the control plane's first response of each type (addresses, authorization) has been
/// applied: the proxy is not ready before (in xDS mode).
#[derive(Debug, Default)]
pub struct Synced {
    addresses: AtomicBool,
    authorization: AtomicBool,
}

impl Synced {
    pub fn all(&self) -> bool {
        self.addresses.load(Ordering::Relaxed) && self.authorization.load(Ordering::Relaxed)
    }

    pub fn set_addresses(&self) {
        self.addresses.store(true, Ordering::Relaxed);
    }

    pub fn set_authorization(&self) {
        self.authorization.store(true, Ordering::Relaxed);
    }
}
