//! Connection pooling: CONNECT streams from one workload to one destination share HTTP/2
//! connections, keyed as ztunnel keys them — (source identity, destination identity, source
//! workload, destination `ip:15008`). A connection at its stream limit (the peer's
//! `max_concurrent_streams`, at most 100 of ours) is not used; a new one is opened beside it.
//! Closed connections are dropped from the pool when next looked at.

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
    task::{Context, Poll, Waker},
};

use crate::{
    hbone::{Connection, HboneError},
    identity::Identity,
};

/// What a pooled connection may be shared for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub src: Identity,
    pub dst: Identity,
    /// The source workload (its uid): connections leave from its address.
    pub src_workload: String,
    pub gateway: SocketAddr,
}

/// The pool.
#[derive(Debug, Default)]
pub struct Pool {
    conns: Mutex<HashMap<PoolKey, Vec<Connection>>>,
    opened: AtomicU64,
}

impl Pool {
    pub fn new() -> Self {
        Self::default()
    }

    /// A connection for `key` with room for one more stream: a pooled one, or a new one from
    /// `open`.
    pub async fn get<F, Fut>(&self, key: &PoolKey, open: F) -> Result<Connection, HboneError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Connection, HboneError>>,
    {
        if let Some(c) = self.take_ready(key) {
            return Ok(c);
        }
        let conn = open().await?;
        self.opened.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = self.conns.lock() {
            map.entry(key.clone()).or_default().push(conn.clone());
        }
        Ok(conn)
    }

    /// A pooled connection that can take a stream now; drops closed ones.
    fn take_ready(&self, key: &PoolKey) -> Option<Connection> {
        let mut map = self.conns.lock().ok()?;
        let list = map.get_mut(key)?;
        let mut cx = Context::from_waker(Waker::noop());
        let mut found = None;
        list.retain_mut(|c| match c.poll_ready(&mut cx) {
            Poll::Ready(Ok(())) => {
                if found.is_none() {
                    found = Some(c.clone());
                }
                true
            }
            // Closed or broken: forget it.
            Poll::Ready(Err(_)) => false,
            // At its stream limit: keep it for later.
            Poll::Pending => true,
        });
        if list.is_empty() {
            map.remove(key);
        }
        found
    }

    /// How many connections were opened so far.
    pub fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }
}
