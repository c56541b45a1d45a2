//! Graceful shutdown: on SIGTERM (or Ctrl-C) the proxy stops accepting — its listeners close,
//! so the datapath refuses new captured connections (fail closed) — and lets the connections
//! it carries finish, up to a deadline.

use std::{future::Future, time::Duration};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// The proxy's shutdown switch and the connections it waits for.
#[derive(Debug, Clone, Default)]
pub struct Drain {
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl Drain {
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts on `listener` until shutdown, handling each connection on a tracked task. The
    /// listener is closed when this returns.
    pub async fn accept_loop<F, Fut>(&self, listener: TcpListener, mut handle: F)
    where
        F: FnMut(TcpStream, std::net::SocketAddr) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok((conn, peer)) => {
                        self.tasks.spawn(handle(conn, peer));
                    }
                    Err(e) => tracing::warn!(error = %e, "accept failed"),
                },
            }
        }
    }

    /// Serves `listener` on a tracked task until shutdown: each connection goes to `handle` with
    /// a clone of `ctx`; a failed connection is logged as a `what` connection.
    pub fn serve<C, F, Fut>(&self, listener: TcpListener, ctx: C, what: &'static str, handle: F)
    where
        C: Clone + Send + 'static,
        F: Fn(TcpStream, std::net::SocketAddr, C) -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let drain = self.clone();
        self.spawn(async move {
            drain
                .accept_loop(listener, move |conn, peer| {
                    let fut = handle(conn, peer, ctx.clone());
                    async move {
                        if let Err(e) = fut.await {
                            tracing::warn!(%peer, error = %format!("{e:#}"), "{what} connection failed");
                        }
                    }
                })
                .await;
        });
    }

    /// Spawns a tracked task (the shutdown waits for it).
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Stops accepting and waits up to `deadline` for open connections. Returns how many were
    /// still open at the deadline.
    pub async fn shutdown(&self, deadline: Duration) -> usize {
        self.stop.cancel();
        self.tasks.close();
        if tokio::time::timeout(deadline, self.tasks.wait()).await.is_err() {
            return self.tasks.len();
        }
        0
    }
}
