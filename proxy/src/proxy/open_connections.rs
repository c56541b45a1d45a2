//! The connections a pod has open, for the admin dump (`workloadState[UID].connections`, what
//! `istioctl ztunnel-config connections` lists): an entry when a connection's telemetry opens,
//! gone when its guard drops. Bounded by the pod's connection caps (a connection is counted
//! against them before it is listed).

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, PoisonError,
    },
};

use crate::metrics::Direction;

/// One open connection, as ztunnel names its ends.
#[derive(Debug, Clone)]
pub struct Entry {
    pub direction: Direction,
    /// The client's address.
    pub src: SocketAddr,
    /// Where the client was going.
    pub original_dst: SocketAddr,
    /// Where the proxy connected (a peer's HBONE port, or the app).
    pub actual_dst: SocketAddr,
    /// `HBONE` or `TCP`.
    pub protocol: &'static str,
}

/// A pod's open connections.
#[derive(Debug, Default)]
pub struct OpenConnections {
    next: AtomicU64,
    entries: Mutex<HashMap<u64, Entry>>,
}

/// A listed connection: unlisted on drop.
#[derive(Debug)]
pub struct Listed<'a> {
    list: &'a OpenConnections,
    id: u64,
}

impl OpenConnections {
    /// Lists `entry` until the returned guard drops.
    pub fn list(&self, entry: Entry) -> Listed<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.entries.lock().unwrap_or_else(PoisonError::into_inner).insert(id, entry);
        Listed { list: self, id }
    }

    /// The connections open now, in the order they opened.
    pub fn snapshot(&self) -> Vec<Entry> {
        let entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let mut by_id: Vec<(&u64, &Entry)> = entries.iter().collect();
        by_id.sort_by_key(|(id, _)| **id);
        by_id.into_iter().map(|(_, e)| e.clone()).collect()
    }
}

impl Drop for Listed<'_> {
    fn drop(&mut self) {
        self.list.entries.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(port: u16) -> Entry {
        let a: SocketAddr = ([10, 0, 0, 1], port).into();
        Entry {
            direction: Direction::Outbound,
            src: a,
            original_dst: a,
            actual_dst: a,
            protocol: "TCP",
        }
    }

    #[test]
    fn a_connection_is_listed_while_its_guard_lives() {
        let open = OpenConnections::default();
        let first = open.list(entry(1));
        let second = open.list(entry(2));
        let ports: Vec<u16> = open.snapshot().iter().map(|e| e.src.port()).collect();
        assert_eq!(ports, [1, 2]);
        drop(first);
        let ports: Vec<u16> = open.snapshot().iter().map(|e| e.src.port()).collect();
        assert_eq!(ports, [2]);
        drop(second);
        assert!(open.snapshot().is_empty());
    }
}
