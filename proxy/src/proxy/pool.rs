//! Connection pooling: CONNECT streams from one workload to one destination share HTTP/2
//! connections, keyed as ztunnel keys them — (source identity, destination identity, source
//! workload, destination `ip:15008`). A connection carrying `max_streams` streams (or at the
//! peer's own limit) takes no more; a new one is opened beside it. A connection without streams
//! for the idle timeout is released (dropping our handle makes h2 send GOAWAY and close), as are
//! a removed pod's connections. Closed connections are dropped when next looked at.
//!
//! Spreading: streams to one destination are spread over up to `spread` connections before they
//! share one: a new stream that would join a busy connection opens another instead while the
//! destination has fewer (and no other is being opened), and each stream takes the least busy
//! of the first `spread` connections. One HTTP/2 connection is one task, one TLS session and one
//! lock over all its streams' state; with several, concurrent streams are encrypted on several
//! cores and do not queue behind each other (`cargo xtask bench proxy`, 4 iperf3 streams).
//!
//! Full: when no connection to a destination can take a stream (each at `max_streams` or the
//! peer's limit), new streams open one connection at a time: each waits its turn for the
//! destination's open lock and looks again when it has it, so a burst of streams takes the room
//! the connection opened before it rather than opening one connection each (ztunnel keeps one
//! connection attempt per key the same way). A stream that finds, on its turn, room to spread
//! lets the turn go before it opens, so spread connections still open in parallel. The turn is
//! waited for at most `wait`; a stream that is not served by then fails as a connect timeout
//! would.
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

/// A connection being opened for a destination, counted until it is pooled or has failed.
struct Opening<'a> {
    pool: &'a Pool,
    key: &'a PoolKey,
}

impl Opening<'_> {
    /// The connection opened: pooled, and no longer counted as being opened, under one lock.
    fn pooled(self, conn: Pooled) {
        if let Ok(mut guard) = self.pool.conns.lock() {
            let conns = &mut *guard;
            // The destination is there (counted as opening since `pick`): the key is copied
            // again only if it went missing.
            if !conns.by_key.contains_key(self.key) {
                conns.by_key.insert(self.key.clone(), Destination::default());
            }
            if let Some(dest) = conns.by_key.get_mut(self.key) {
                dest.opening = dest.opening.saturating_sub(1);
                dest.conns.push(conn);
                conns.total += 1;
            }
            self.pool.metrics.pool_connections.set(conns.total as i64);
        }
        std::mem::forget(self);
    }
}

impl Drop for Opening<'_> {
    /// The connection could not be opened (or the caller went away).
    fn drop(&mut self) {
        let Ok(mut conns) = self.pool.conns.lock() else { return };
        if let Some(dest) = conns.by_key.get_mut(self.key) {
            dest.opening = dest.opening.saturating_sub(1);
            if dest.is_unused() {
                conns.by_key.remove(self.key);
            }
        }
    }
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

/// The connections to one destination, how many are being opened, and the turn to open one
/// when all are full.
#[derive(Debug, Default)]
struct Destination {
    conns: Vec<Pooled>,
    opening: usize,
    open_turn: Arc<tokio::sync::Mutex<()>>,
}

impl Destination {
    /// No connection, none being opened, and no stream holding or waiting for the turn.
    fn is_unused(&self) -> bool {
        self.conns.is_empty() && self.opening == 0 && Arc::strong_count(&self.open_turn) == 1
    }
}

/// What [`Pool::pick`] found for a new stream; `T` is what its `full` step made of a
/// destination where no connection can take it.
enum Pick<T> {
    /// Take this connection (the stream is already counted on it).
    Use(Connection, StreamPermit),
    /// Open another beside busy ones (counted as being opened): the destination has fewer than
    /// `spread`. Needs no turn: spread connections are opened in parallel.
    Spread,
    /// None can take the stream. Without the turn: the turn to wait for, then look again. On
    /// the turn: nothing (the open is counted); open one, keeping the turn until it is pooled.
    Full(T),
}

/// Every destination's connections, and how many there are in all (the gauge, kept as they
/// come and go rather than counted over every destination on each stream).
#[derive(Debug, Default)]
struct Conns {
    by_key: HashMap<PoolKey, Destination>,
    total: usize,
}

impl Conns {
    /// Keeps the connections of each destination `keep` says to keep, drops destinations left
    /// unused; how many connections went.
    fn retain(&mut self, mut keep: impl FnMut(&PoolKey, &mut Pooled) -> bool) -> usize {
        let mut gone = 0;
        self.by_key.retain(|k, dest| {
            let before = dest.conns.len();
            dest.conns.retain_mut(|p| keep(k, p));
            gone += before - dest.conns.len();
            !dest.is_unused()
        });
        self.total -= gone;
        gone
    }
}

/// The pool.
#[derive(Debug)]
pub struct Pool {
    conns: Mutex<Conns>,
    metrics: Arc<Metrics>,
    max_streams: usize,
    spread: usize,
}

impl Pool {
    /// A pool putting at most `max_streams` streams on a connection, spread over up to `spread`
    /// connections per destination first (see the module docs).
    pub fn new(metrics: Arc<Metrics>, max_streams: usize, spread: usize) -> Self {
        Self {
            conns: Mutex::new(Conns::default()),
            metrics,
            max_streams: max_streams.max(1),
            spread: spread.max(1),
        }
    }

    /// A connection for `key` with room for one more stream, and the permit for that stream:
    /// a pooled connection, or a new one from `open`. `wait` bounds the wait for the turn to
    /// open one when every connection to `key` is full.
    pub async fn get<F, Fut>(
        &self,
        key: &PoolKey,
        wait: Duration,
        open: F,
    ) -> Result<(Connection, StreamPermit), HboneError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Connection, HboneError>>,
    {
        // Held while this stream opens a connection for a full destination; released after
        // the connection is pooled (or has failed), so the next stream finds it.
        let turn = match self.pick(key, |dest| dest.open_turn.clone()) {
            Pick::Use(conn, permit) => return Ok((conn, permit)),
            Pick::Spread => None,
            Pick::Full(turn) => {
                let held = tokio::time::timeout(wait, turn.lock_owned())
                    .await
                    .map_err(|_| HboneError::NoTurn(key.gateway))?;
                // The stream before this one may have opened a connection with room.
                match self.pick(key, |dest| dest.opening += 1) {
                    Pick::Use(conn, permit) => return Ok((conn, permit)),
                    // Beside busy ones: others need not wait for it.
                    Pick::Spread => None,
                    Pick::Full(()) => Some(held),
                }
            }
        };
        let opening = Opening { pool: self, key };
        let conn = open().await?;
        self.metrics.pool_opened.inc();
        let usage = Arc::new(Usage {
            streams: AtomicUsize::new(0),
            idle_since: Mutex::new(None),
            evicted: std::sync::atomic::AtomicBool::new(false),
        });
        let permit = claim(&usage);
        opening.pooled(Pooled { conn: conn.clone(), usage });
        drop(turn);
        Ok((conn, permit))
    }

    /// Where a new stream to `key` goes; drops closed connections on the way. `full` runs, under
    /// the pool's lock, on a destination (new or not) where no connection can take the stream:
    /// without the turn it hands out the turn, on the turn it counts the open.
    fn pick<T>(&self, key: &PoolKey, full: impl FnOnce(&mut Destination) -> T) -> Pick<T> {
        let Ok(mut guard) = self.conns.lock() else { return Pick::Spread };
        let conns = &mut *guard;
        let Some(dest) = conns.by_key.get_mut(key) else {
            // The first connection to this destination: the key is copied only here.
            let mut dest = Destination::default();
            let pick = Pick::Full(full(&mut dest));
            conns.by_key.insert(key.clone(), dest);
            return pick;
        };
        let before = dest.conns.len();
        let mut cx = Context::from_waker(Waker::noop());
        // Whether each kept connection can take a stream now (not at the peer's limit).
        let mut ready = Vec::with_capacity(dest.conns.len());
        dest.conns.retain_mut(|p| {
            if p.usage.evicted.load(Ordering::Acquire) {
                return false;
            }
            match p.conn.poll_ready(&mut cx) {
                // Closed or broken: forget it.
                Poll::Ready(Err(_)) => false,
                Poll::Ready(Ok(())) => {
                    ready.push(true);
                    true
                }
                // At the peer's stream limit: kept for later.
                Poll::Pending => {
                    ready.push(false);
                    true
                }
            }
        });
        conns.total -= before - dest.conns.len();
        let at_spread = dest.conns.len() + dest.opening >= self.spread;
        // The least busy of the first `spread` connections that can take a stream now.
        let best = dest
            .conns
            .iter()
            .zip(&ready)
            .filter(|(p, ready)| {
                **ready && p.usage.streams.load(Ordering::Acquire) < self.max_streams
            })
            .map(|(p, _)| p)
            .take(self.spread)
            .min_by_key(|p| p.usage.streams.load(Ordering::Acquire));
        let pick = match best {
            Some(p) if p.usage.streams.load(Ordering::Acquire) == 0 || at_spread => {
                Pick::Use(p.conn.clone(), claim(&p.usage))
            }
            // Busy, below `spread`: another connection beside it.
            Some(_) => {
                dest.opening += 1;
                Pick::Spread
            }
            // None has room: one stream at a time opens one.
            None => Pick::Full(full(dest)),
        };
        self.metrics.pool_connections.set(conns.total as i64);
        pick
    }

    /// Releases connections that have had no stream for `idle`, and those closed (a peer that
    /// stopped answering PINGs, a GOAWAY) or evicted. Returns how many.
    pub fn release_idle(&self, idle: Duration) -> usize {
        let Ok(mut conns) = self.conns.lock() else { return 0 };
        let mut cx = Context::from_waker(Waker::noop());
        let released = conns.retain(|_, p| {
            let u = &p.usage;
            let idle_out = u.streams.load(Ordering::Acquire) == 0
                && u.idle_since.lock().ok().and_then(|t| *t).is_some_and(|t| t.elapsed() >= idle);
            let closed = matches!(p.conn.poll_ready(&mut cx), Poll::Ready(Err(_)));
            !(idle_out || closed || u.evicted.load(Ordering::Acquire))
        });
        self.metrics.pool_connections.set(conns.total as i64);
        released
    }

    /// Releases the connections of a source workload (a removed pod).
    pub fn forget_workload(&self, uid: &str) -> usize {
        self.release(|k, _| k.src_workload == uid)
    }

    fn release(&self, drop_it: impl Fn(&PoolKey, &Usage) -> bool) -> usize {
        let Ok(mut conns) = self.conns.lock() else { return 0 };
        let released = conns.retain(|k, p| !drop_it(k, &p.usage));
        self.metrics.pool_connections.set(conns.total as i64);
        released
    }

    /// What is pooled now.
    pub fn dump(&self) -> Vec<PoolEntry> {
        let Ok(conns) = self.conns.lock() else { return Vec::new() };
        conns
            .by_key
            .iter()
            .flat_map(|(k, dest)| {
                dest.conns.iter().map(|p| PoolEntry {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A real HTTP/2 client connection to an in-memory server that accepts every stream.
    async fn h2_connection() -> Connection {
        let (client, server) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            let Ok(mut conn) = h2::server::handshake(server).await else { return };
            while let Some(Ok(_request)) = conn.accept().await {}
        });
        let (send, conn) = h2::client::handshake(client).await.expect("h2 handshake");
        tokio::spawn(conn);
        send
    }

    fn key() -> PoolKey {
        PoolKey {
            src: Identity::new("cluster.local", "default", "a"),
            dst: Identity::new("cluster.local", "default", "b"),
            src_workload: "pod-a".into(),
            gateway: "10.0.0.2:15008".parse().expect("addr"),
        }
    }

    #[tokio::test]
    async fn a_burst_of_streams_to_a_full_destination_opens_one_connection_per_max_streams() {
        let pool = Arc::new(Pool::new(Arc::new(Metrics::new()), 2, 1));
        let opens = Arc::new(AtomicUsize::new(0));
        let open = |opens: Arc<AtomicUsize>| async move {
            opens.fetch_add(1, Ordering::SeqCst);
            // A handshake takes a while: the burst arrives while a connection is being opened.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(h2_connection().await)
        };
        let wait = Duration::from_secs(10);
        // Two streams fill the first connection.
        let mut permits = Vec::new();
        for _ in 0..2 {
            permits.push(pool.get(&key(), wait, || open(opens.clone())).await.expect("get").1);
        }
        assert_eq!(opens.load(Ordering::SeqCst), 1);

        // Six more at once: three connections' worth, not six connections.
        let mut burst = tokio::task::JoinSet::new();
        for _ in 0..6 {
            let (pool, opens) = (pool.clone(), opens.clone());
            burst.spawn(async move { pool.get(&key(), wait, || open(opens)).await.map(|c| c.1) });
        }
        while let Some(got) = burst.join_next().await {
            permits.push(got.expect("task").expect("get"));
        }
        assert_eq!(opens.load(Ordering::SeqCst), 4, "one connection per two streams");
        let streams: Vec<usize> = pool.dump().iter().map(|e| e.streams).collect();
        assert_eq!(streams, [2, 2, 2, 2]);
    }

    #[tokio::test]
    async fn a_burst_to_a_new_destination_opens_its_spread_connections_in_parallel() {
        let pool = Arc::new(Pool::new(Arc::new(Metrics::new()), 100, 4));
        let (opens, in_flight, most) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let mut burst = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (pool, opens, in_flight, most) =
                (pool.clone(), opens.clone(), in_flight.clone(), most.clone());
            burst.spawn(async move {
                let open = || async move {
                    opens.fetch_add(1, Ordering::SeqCst);
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    Ok(h2_connection().await)
                };
                pool.get(&key(), Duration::from_secs(10), open).await.map(|c| c.1)
            });
        }
        let mut permits = Vec::new();
        while let Some(got) = burst.join_next().await {
            permits.push(got.expect("task").expect("get"));
        }
        // The first connection on its own (the others wait for it), then the other three of the
        // spread at once; the last four streams share them.
        assert_eq!(opens.load(Ordering::SeqCst), 4);
        assert_eq!(most.load(Ordering::SeqCst), 3, "spread connections opened one at a time");
    }

    #[tokio::test]
    async fn a_stream_waiting_for_its_turn_to_open_fails_after_the_wait() {
        let pool = Arc::new(Pool::new(Arc::new(Metrics::new()), 1, 1));
        let wait = Duration::from_millis(200);
        let _held = pool.get(&key(), wait, || async { Ok(h2_connection().await) }).await;
        // A connection that takes longer to open than the wait: the next stream holds the turn.
        let (p, slow) = (pool.clone(), async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(h2_connection().await)
        });
        let opener = tokio::spawn(async move { p.get(&key(), wait, || slow).await.map(|c| c.1) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let waited = pool.get(&key(), wait, || async { Ok(h2_connection().await) }).await;
        let err = waited.expect_err("no turn within the wait");
        assert!(err.is_timeout(), "{err}");
        opener.abort();
    }
}
