//! A cap per source address on a pod's inbound HBONE connections that have not yet proven an
//! identity. Anyone who reaches a pod may connect to its 15008 and hold the connection through
//! the TLS handshake (up to the handshake timeout) before any credential is checked; the pod's
//! inbound cap bounds them all together, and this cap stops one source from holding all of it:
//! past `limit` unauthenticated connections from one address, another from it is closed, while
//! other peers still get slots. A connection's count is given back once its client certificate
//! has been checked (the peer is then a workload of the trust domain, attributable) or when it
//! fails.
//!
//! A source is an IPv4 address, or an IPv6 /64: one host is routinely given a whole /64, so
//! counting by exact IPv6 address would let it open a share from each of 2^64 addresses (as rate
//! limiters do, the prefix is the unit).
//!
//! The map is keyed by outside input (the peer's address) and stays bounded: a source has an
//! entry only while it holds an unauthenticated connection, and each of those holds one of the
//! pod's inbound slots, so there are never more entries than the pod's inbound cap.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

/// Counts of one pod's unauthenticated inbound connections by source address.
#[derive(Debug)]
pub struct PerSource {
    limit: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One unauthenticated connection's count; given back on drop.
#[derive(Debug)]
pub struct SourceSlot {
    owner: Arc<PerSource>,
    source: IpAddr,
}

impl PerSource {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self { limit: limit.max(1), held: Mutex::new(HashMap::new()) })
    }

    /// A count for one more connection from `source`, or `None` when its source (the address,
    /// or its IPv6 /64) holds `limit` already.
    pub fn admit(self: &Arc<Self>, source: IpAddr) -> Option<SourceSlot> {
        let source = source_of(source);
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = held.entry(source).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(SourceSlot { owner: self.clone(), source })
    }

    /// How many addresses hold a count now.
    #[cfg(test)]
    fn sources(&self) -> usize {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }
}

/// What a connection counts against: an IPv4 address as itself (also in its v4-mapped form), an
/// IPv6 address as its /64.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut held = self.owner.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn ipv6_addresses_of_one_64_share_one_count_and_another_64_has_its_own() {
        let caps = PerSource::new(3);
        let in_64 = |i: u16| IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 1, 0, 0, 0, i));
        let held: Vec<_> =
            (1..=3).map(|i| caps.admit(in_64(i)).expect("within the limit")).collect();
        assert!(caps.admit(in_64(4)).is_none(), "a fourth address of the same /64 was admitted");
        let other = IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 2, 0, 0, 0, 1));
        assert!(caps.admit(other).is_some(), "another /64 was refused");
        drop(held);
        assert!(caps.admit(in_64(9)).is_some(), "the /64's count was not given back");
    }

    #[test]
    fn an_ipv4_address_counts_the_same_in_its_v4_mapped_form() {
        let caps = PerSource::new(1);
        let _a = caps.admit(A).expect("first");
        let mapped = IpAddr::V6(std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        assert!(caps.admit(mapped).is_none(), "the v4-mapped form counted apart");
    }

    #[test]
    fn a_source_at_its_limit_is_refused_while_another_is_admitted() {
        let caps = PerSource::new(2);
        let held: Vec<_> = (0..2).map(|_| caps.admit(A).expect("within the limit")).collect();
        assert!(caps.admit(A).is_none(), "a third from one source was admitted");
        assert!(caps.admit(B).is_some(), "another source was refused");
        drop(held);
    }

    #[test]
    fn a_count_given_back_admits_again_and_an_address_with_none_leaves_the_map() {
        let caps = PerSource::new(1);
        let first = caps.admit(A).expect("admitted");
        assert!(caps.admit(A).is_none());
        drop(first);
        assert_eq!(caps.sources(), 0, "an address holding nothing kept its entry");
        let _again = caps.admit(A).expect("a count given back did not admit again");
    }
}
