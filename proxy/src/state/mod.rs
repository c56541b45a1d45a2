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
/// accepted whole (ACKed, as ztunnel counts it; one with a refused resource leaves the type
/// waiting for the next): the proxy is not ready before (in xDS mode), and accepts no connection before
/// (`crate::proxy::drain`): a connection served then would meet no policy, so a DENY istiod
/// has not sent yet would not apply.
#[derive(Debug)]
pub struct Synced {
    addresses: AtomicBool,
    authorization: AtomicBool,
    /// Turns true, once, when both have been applied.
    all: tokio::sync::watch::Sender<bool>,
}

impl Default for Synced {
    fn default() -> Self {
        Self {
            addresses: AtomicBool::new(false),
            authorization: AtomicBool::new(false),
            all: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Synced {
    pub fn all(&self) -> bool {
        self.addresses.load(Ordering::Relaxed) && self.authorization.load(Ordering::Relaxed)
    }

    /// The types still waiting for a response accepted whole, for the readiness answer.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if !self.addresses.load(Ordering::Relaxed) {
            missing.push("Address");
        }
        if !self.authorization.load(Ordering::Relaxed) {
            missing.push("Authorization");
        }
        missing
    }

    pub fn set_addresses(&self) {
        self.addresses.store(true, Ordering::Relaxed);
        self.announce();
    }

    pub fn set_authorization(&self) {
        self.authorization.store(true, Ordering::Relaxed);
        self.announce();
    }

    fn announce(&self) {
        if self.all() {
            self.all.send_replace(true);
        }
    }

    /// Resolves once both types have been applied.
    pub async fn wait(&self) {
        let mut rx = self.all.subscribe();
        // The sender lives as long as `self`: wait_for fails only if it is dropped.
        let _ = rx.wait_for(|all| *all).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waiting_ends_only_once_both_types_are_applied() {
        let s = std::sync::Arc::new(Synced::default());
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.wait().await }
        });
        s.set_authorization();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "done with policies alone");
        s.set_addresses();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("still waiting with both applied")
            .expect("task");
        // Already synced: no wait.
        tokio::time::timeout(std::time::Duration::from_secs(1), s.wait()).await.expect("waited");
    }
}
