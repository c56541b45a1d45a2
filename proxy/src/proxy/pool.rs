//! Connection pooling: CONNECT streams from one workload to one destination share HTTP/2
//! connections, keyed as ztunnel keys them — (source identity, destination identity, source
//! workload, destination `ip:15008`). A connection carrying `max_streams` streams (or at the
//! peer's own limit) takes no more; a new one is opened beside it. A connection without streams
//! for the idle timeout is released (dropping our handle makes h2 send GOAWAY and close), as are
//! a removed pod's connections. Closed connections are dropped when next looked at.

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::{
    identity::Identity,
    metrics::Metrics,
    proxy::hbone::{Connection, HboneError},
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

#[derive(Debug)]
struct Usage {
    streams: AtomicUsize,
    idle_since: Mutex<Option<Instant>>,
    /// Evicted: takes no more streams and goes at the next look.
    evicted: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
struct Pooled {
    conn: Connection,
    usage: Arc<Usage>,
}

/// One stream's claim on a pooled connection; dropping it (when the stream ends) frees the slot.
#[derive(Debug)]
pub struct StreamPermit(Arc<Usage>);

impl StreamPermit {
    /// Takes this stream's connection out of the pool (it did not answer a CONNECT in time):
    /// streams open on it go on; no new one is put on it.
    pub fn evict(&self) {
        self.0.evicted.store(true, Ordering::Release);
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        if self.0.streams.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Ok(mut t) = self.0.idle_since.lock() {
                *t = Some(Instant::now());
            }
        }
    }
}

fn claim(usage: &Arc<Usage>) -> StreamPermit {
    usage.streams.fetch_add(1, Ordering::AcqRel);
    if let Ok(mut t) = usage.idle_since.lock() {
        *t = None;
    }
    StreamPermit(usage.clone())
}

/// A pooled connection as the admin dump shows it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolEntry {
    pub source: String,
    pub destination: String,
    pub source_workload: String,
    pub gateway: SocketAddr,
    pub streams: usize,
    pub idle_seconds: Option<u64>,
}

/// The pool.
#[derive(Debug)]
pub struct Pool {
    conns: Mutex<HashMap<PoolKey, Vec<Pooled>>>,
    metrics: Arc<Metrics>,
    max_streams: usize,
}

impl Pool {
    pub fn new(metrics: Arc<Metrics>, max_streams: usize) -> Self {
        Self { conns: Mutex::new(HashMap::new()), metrics, max_streams: max_streams.max(1) }
    }

    /// A connection for `key` with room for one more stream, and the permit for that stream:
    /// a pooled connection, or a new one from `open`.
    pub async fn get<F, Fut>(
        &self,
        key: &PoolKey,
        open: F,
    ) -> Result<(Connection, StreamPermit), HboneError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Connection, HboneError>>,
    {
        if let Some(c) = self.take_ready(key) {
            return Ok(c);
        }
        let conn = open().await?;
        self.metrics.pool_opened.inc();
        let usage = Arc::new(Usage {
            streams: AtomicUsize::new(0),
            idle_since: Mutex::new(None),
            evicted: std::sync::atomic::AtomicBool::new(false),
        });
        let permit = claim(&usage);
        if let Ok(mut map) = self.conns.lock() {
            map.entry(key.clone()).or_default().push(Pooled { conn: conn.clone(), usage });
            self.metrics.pool_connections.set(count(&map));
        }
        Ok((conn, permit))
    }

    /// A pooled connection that can take a stream now; drops closed ones.
    fn take_ready(&self, key: &PoolKey) -> Option<(Connection, StreamPermit)> {
        let mut map = self.conns.lock().ok()?;
        let list = map.get_mut(key)?;
        let mut cx = Context::from_waker(Waker::noop());
        let mut found = None;
        list.retain_mut(|p| match p.conn.poll_ready(&mut cx) {
            _ if p.usage.evicted.load(Ordering::Acquire) => false,
            Poll::Ready(Ok(())) => {
                if found.is_none() && p.usage.streams.load(Ordering::Acquire) < self.max_streams {
                    found = Some((p.conn.clone(), claim(&p.usage)));
                }
                true
            }
            // Closed or broken: forget it.
            Poll::Ready(Err(_)) => false,
            // At the peer's stream limit: keep it for later.
            Poll::Pending => true,
        });
        if list.is_empty() {
            map.remove(key);
        }
        self.metrics.pool_connections.set(count(&map));
        found
    }

    /// Releases connections that have had no stream for `idle`, and those closed (a peer that
    /// stopped answering PINGs, a GOAWAY) or evicted. Returns how many.
    pub fn release_idle(&self, idle: Duration) -> usize {
        let Ok(mut map) = self.conns.lock() else { return 0 };
        let mut cx = Context::from_waker(Waker::noop());
        let mut released = 0;
        map.retain(|_, list| {
            let before = list.len();
            list.retain_mut(|p| {
                let u = &p.usage;
                let idle_out = u.streams.load(Ordering::Acquire) == 0
                    && u.idle_since
                        .lock()
                        .ok()
                        .and_then(|t| *t)
                        .is_some_and(|t| t.elapsed() >= idle);
                let closed = matches!(p.conn.poll_ready(&mut cx), Poll::Ready(Err(_)));
                !(idle_out || closed || u.evicted.load(Ordering::Acquire))
            });
            released += before - list.len();
            !list.is_empty()
        });
        self.metrics.pool_connections.set(count(&map));
        released
    }

    /// Releases the connections of a source workload (a removed pod).
    pub fn forget_workload(&self, uid: &str) -> usize {
        self.release(|k, _| k.src_workload == uid)
    }

    fn release(&self, drop_it: impl Fn(&PoolKey, &Usage) -> bool) -> usize {
        let Ok(mut map) = self.conns.lock() else { return 0 };
        let mut released = 0;
        map.retain(|k, list| {
            let before = list.len();
            list.retain(|p| !drop_it(k, &p.usage));
            released += before - list.len();
            !list.is_empty()
        });
        self.metrics.pool_connections.set(count(&map));
        released
    }

    /// What is pooled now.
    pub fn dump(&self) -> Vec<PoolEntry> {
        let Ok(map) = self.conns.lock() else { return Vec::new() };
        map.iter()
            .flat_map(|(k, list)| {
                list.iter().map(|p| PoolEntry {
                    source: k.src.to_string(),
                    destination: k.dst.to_string(),
                    source_workload: k.src_workload.clone(),
                    gateway: k.gateway,
                    streams: p.usage.streams.load(Ordering::Acquire),
                    idle_seconds: p
                        .usage
                        .idle_since
                        .lock()
                        .ok()
                        .and_then(|t| *t)
                        .map(|t| t.elapsed().as_secs()),
                })
            })
            .collect()
    }
}

fn count(map: &HashMap<PoolKey, Vec<Pooled>>) -> i64 {
    map.values().map(Vec::len).sum::<usize>() as i64
}
