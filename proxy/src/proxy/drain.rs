//! Graceful shutdown: on SIGTERM (or Ctrl-C, or the admin's /quitquitquit) the proxy stops
//! accepting — its listeners close, so the datapath refuses new captured connections (fail
//! closed), or they wait in the backlog of the listeners the node agent holds for the next
//! proxy — and lets the connections it carries finish, up to a deadline.
//!
//! In two steps. First the capture listeners close (outbound 15001, inbound plaintext 15006,
//! DNS 15053) and the proxy turns unready; the HBONE listeners (15008) keep accepting until
//! every outbound connection this proxy accepted has its CONNECT stream open (or has failed).
//! Only then do the HBONE listeners close and the HBONE connections get GOAWAY. A connection
//! the proxy accepted an instant before the signal, to a pod of this same node, would
//! otherwise find that pod's HBONE side gone away: its pooled connection refuses new streams
//! and a new one waits in a backlog that only the next proxy (which starts when this one has
//! exited) serves.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use meshpath_loglimit::PerSecond;

use crate::{proxy::stop::when_woken, state::Synced};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// Failed connections logged (at warn) per second at most, over the node: anyone who reaches a
/// pod can open connections to its HBONE port and fail them before any credential is checked
/// (each is counted in `meshpath_connection_errors_total` all the same).
pub const FAILED_CONNECTIONS_LOGGED_PER_SECOND: u32 = 20;

/// The proxy's shutdown switch and the connections it waits for; and the cap on how many it
/// carries at once, node-wide.
#[derive(Debug, Clone)]
pub struct Drain {
    /// The first step: the capture listeners close, the proxy is unready.
    stop: CancellationToken,
    /// The second step: the HBONE listeners close and HBONE connections are told to go away.
    stop_hbone: CancellationToken,
    /// Outbound connections that have no stream yet (their `HboneHold`s).
    opening: TaskTracker,
    tasks: TaskTracker,
    global: Arc<Semaphore>,
    /// The log's budget for failed connections.
    failed_logged: Arc<Mutex<PerSecond>>,
    /// In xDS mode, the control plane's first push: no listener accepts before it is applied
    /// (connections wait in the backlog), so none is served without istiod's policies.
    first_push: Arc<std::sync::OnceLock<Arc<Synced>>>,
}

impl Default for Drain {
    fn default() -> Self {
        Self::new(super::Settings::default().max_connections)
    }
}

/// One connection's (or one HBONE stream's) slots under the caps: one of the node's, one of its
/// pod's; given back when dropped.
#[derive(Debug)]
pub struct Permits {
    _node: OwnedSemaphorePermit,
    _pod: OwnedSemaphorePermit,
}

/// What one listener's connections belong to: stopped with `stop` (the listener) and `kill`
/// (its connections), counted against `limit` (the pod's cap) and the node-wide one; a
/// connection over either cap is closed at once and counted as a `direction` error,
/// `connection_limit`. With `holds_hbone`, each connection gets an `HboneHold`.
#[derive(Debug, Clone)]
pub struct Scope {
    pub stop: CancellationToken,
    pub kill: CancellationToken,
    pub limit: Arc<Semaphore>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub direction: crate::metrics::Direction,
    pub holds_hbone: bool,
}

/// Held by an outbound connection from its accept until its CONNECT stream is open (or it
/// failed, or took another way): while any is held, a draining proxy keeps its HBONE
/// listeners and connections (see the module's doc). Empty for other listeners' connections.
#[derive(Debug, Default)]
pub struct HboneHold(Option<tokio_util::task::task_tracker::TaskTrackerToken>);

impl HboneHold {
    /// The connection needs the HBONE side no longer.
    pub fn release(&mut self) {
        self.0 = None;
    }
}

impl Drain {
    /// At most `max_connections` connections at once, over all pods.
    pub fn new(max_connections: usize) -> Self {
        Self {
            stop: CancellationToken::new(),
            stop_hbone: CancellationToken::new(),
            opening: TaskTracker::new(),
            tasks: TaskTracker::new(),
            global: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            failed_logged: Arc::new(Mutex::new(PerSecond::new(
                FAILED_CONNECTIONS_LOGGED_PER_SECOND,
            ))),
            first_push: Arc::default(),
        }
    }

    /// Accept nothing until `synced` says the control plane's first push is applied.
    pub fn gate_on(&self, synced: Arc<Synced>) {
        let _ = self.first_push.set(synced);
    }

    /// A slot under the node-wide cap and one under `pod` (a pod's cap), or `None` when either
    /// is reached.
    pub fn admit(&self, pod: &Arc<Semaphore>) -> Option<Permits> {
        let node = self.global.clone().try_acquire_owned().ok()?;
        let pod = pod.clone().try_acquire_owned().ok()?;
        Some(Permits { _node: node, _pod: pod })
    }

    /// A token cancelled when shutdown begins (and cancellable on its own: a pod's capture
    /// listeners).
    pub fn child_token(&self) -> CancellationToken {
        self.stop.child_token()
    }

    /// A token cancelled at shutdown's second step (and cancellable on its own: a pod's HBONE
    /// listener).
    pub fn hbone_child_token(&self) -> CancellationToken {
        self.stop_hbone.child_token()
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Resolves when shutdown begins.
    pub async fn stopping(&self) {
        self.stop.cancelled().await;
    }

    /// Resolves at shutdown's second step: HBONE connections are to go away.
    pub async fn hbone_stopping(&self) {
        self.stop_hbone.cancelled().await;
    }

    /// Begins shutdown without waiting.
    pub fn begin(&self) {
        self.stop.cancel();
    }

    /// Serves `listener` on a tracked task until `stop` is cancelled: each connection goes to
    /// `handle` with a clone of `ctx`, on a task that `kill` ends; a failed connection is logged
    /// as a `what` connection. The listener is closed when `stop` fires.
    pub fn serve<C, F, Fut>(
        &self,
        listener: TcpListener,
        scope: Scope,
        ctx: C,
        what: &'static str,
        handle: F,
    ) where
        C: Clone + Send + 'static,
        F: Fn(TcpStream, std::net::SocketAddr, C, HboneHold) -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let drain = self.clone();
        let Scope { stop, kill, limit, metrics, direction, holds_hbone } = scope;
        self.spawn(async move {
            if let Some(first_push) = drain.first_push.get().cloned() {
                if !first_push.all() {
                    tracing::debug!("{what}: waiting for the control plane's first push");
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = first_push.wait() => {}
                }
            }
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((conn, peer)) => {
                            let Some(permits) = drain.admit(&limit) else {
                                // Over a cap: closed now, before any buffer or task is spent on it.
                                metrics.error(direction, "connection_limit");
                                let peer = canonical_peer(peer);
                                tracing::debug!(%peer, "{what}: connection limit reached; closed");
                                drop(conn);
                                continue;
                            };
                            // Taken here, not in the connection's task: shutdown must not find
                            // none held while an accepted connection's task has yet to run.
                            let hold = HboneHold(holds_hbone.then(|| drain.opening.token()));
                            let fut = handle(conn, peer, ctx.clone(), hold);
                            let kill = kill.clone();
                            let failed_logged = drain.failed_logged.clone();
                            drain.spawn(async move {
                                let _permits = permits;
                                tokio::select! {
                                    r = fut => if let Err(e) = r {
                                        log_failed(&failed_logged, what, peer, &e);
                                    },
                                    () = when_woken(kill.cancelled()) => {}
                                }
                            });
                        }
                        Err(e) => {
                            // EMFILE and the like: retry after a pause, not in a hot loop.
                            tracing::warn!(error = %e, "{what}: accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        }
                    },
                }
            }
        });
    }

    /// Spawns a tracked task (the shutdown waits for it).
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Stops accepting, in the two steps of the module's doc, and waits up to `deadline` for
    /// open connections. Returns how many were still open at the deadline.
    pub async fn shutdown(&self, deadline: Duration) -> usize {
        let until = tokio::time::Instant::now() + deadline;
        self.stop.cancel();
        self.tasks.close();
        self.opening.close();
        // Each hold is released when its stream is open or has failed (a peer whose proxy is
        // being replaced can hold it for minutes); bounded by the deadline.
        let _ = tokio::time::timeout_at(until, self.opening.wait()).await;
        self.stop_hbone.cancel();
        if tokio::time::timeout_at(until, self.tasks.wait()).await.is_err() {
            return self.tasks.len();
        }
        0
    }
}

/// The peer as the handlers name it: an IPv4 client as itself, not in the `::ffff:a.b.c.d`
/// form a dual-stack listener reports it in. Used only where a connection is refused or failed.
fn canonical_peer(peer: std::net::SocketAddr) -> std::net::SocketAddr {
    std::net::SocketAddr::new(crate::state::canonical(peer.ip()), peer.port())
}

/// Logs a failed `what` connection from `peer` at warn, within the node's budget; past it, only
/// at debug, and the next line logged says how many were left out (`left_out=`).
fn log_failed(
    budget: &Mutex<PerSecond>,
    what: &str,
    peer: std::net::SocketAddr,
    e: &anyhow::Error,
) {
    let (logged, left_out) =
        budget.lock().unwrap_or_else(std::sync::PoisonError::into_inner).admit(Instant::now());
    let peer = canonical_peer(peer);
    let error = format!("{e:#}");
    match (logged, left_out) {
        (true, 0) => tracing::warn!(%peer, error, "{what} connection failed"),
        (true, n) => tracing::warn!(%peer, error, left_out = n, "{what} connection failed"),
        (false, _) => tracing::debug!(%peer, error, "{what} connection failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hbone_stops_only_once_every_outbound_connection_has_its_stream() {
        let drain = Drain::new(10);
        let mut hold = HboneHold(Some(drain.opening.token()));
        let shutdown = tokio::spawn({
            let drain = drain.clone();
            async move { drain.shutdown(Duration::from_secs(60)).await }
        });
        drain.stopping().await;
        assert!(drain.is_stopping());
        // The hold is never released here: HBONE must not stop, whatever the wait.
        let early = tokio::time::timeout(Duration::from_millis(100), drain.hbone_stopping()).await;
        assert!(early.is_err(), "HBONE stopped while a connection was opening its stream");
        hold.release();
        tokio::time::timeout(Duration::from_secs(10), drain.hbone_stopping())
            .await
            .expect("HBONE stopped once the stream was open");
        assert_eq!(shutdown.await.expect("shutdown"), 0);
    }

    #[tokio::test]
    async fn a_hold_never_released_keeps_hbone_up_to_the_deadline_only() {
        let drain = Drain::new(10);
        let _hold = HboneHold(Some(drain.opening.token()));
        let left = drain.shutdown(Duration::from_millis(200)).await;
        assert_eq!(left, 0, "no task was running");
        assert!(drain.stop_hbone.is_cancelled());
    }
}
