//! Connecting to the app with the client's own address as the source, as ztunnel does: the
//! socket is made inside the pod, `IP_TRANSPARENT`, bound to the client's address, marked
//! `0x539`. The proxy does nothing else: the datapath recognises the connection by itself (a
//! connect inside the pod to the pod from an address that is not the pod's), lets its SYN reach
//! the app, and marks it so that the pod's reply rule, written by the node agent at enrolment,
//! brings the app's replies back here. A client of another family, or a client address that is
//! the pod's own, gets a plain connection from the pod's address.
//!
//! [`InFlight`] remembers the transparent connects under way, so that a datapath that steers
//! one back to the proxy's inbound listener anyway (an older one, or its map full) gets a
//! refusal, not a loop.

use std::{collections::HashSet, io, net::SocketAddr, sync::Mutex, time::Duration};

use tokio::net::TcpStream;
use tracing::warn;

use crate::proxy::pod::Pod;

/// Connects to the app at `target` inside the pod, from `client`'s address when the pod allows.
pub async fn connect_app(
    pod: &Pod,
    client: std::net::IpAddr,
    target: SocketAddr,
    limit: Duration,
) -> io::Result<TcpStream> {
    let plain = || async { pod.sockets.socket(target)?.connect(target).await };
    let transparent = pod.preserves_source()
        && client.is_ipv4() == target.is_ipv4()
        && !pod.workload.workload_ips.contains(&client);
    if !transparent {
        return timed(limit, plain()).await;
    }
    let socket = match pod.sockets.transparent(client) {
        Ok(s) => s,
        Err(e) => {
            warn!(pod = %pod.uid, %client, error = %e, "no transparent socket; connecting from the pod's address");
            return timed(limit, plain()).await;
        }
    };
    let from = socket.local_addr()?;
    let _entry = pod.proxy.transparent.enter(target, from);
    timed(limit, socket.connect(target)).await
}

/// The transparent connects under way: (app, client address the proxy connects from). Each
/// lives as long as its connect, so the set is bounded by the connections being opened.
#[derive(Debug, Default)]
pub struct InFlight(Mutex<HashSet<(SocketAddr, SocketAddr)>>);

impl InFlight {
    fn enter(&self, app: SocketAddr, from: SocketAddr) -> Entry<'_> {
        self.lock().insert((app, from));
        Entry { set: self, key: (app, from) }
    }

    /// Whether a connection from `from` to `app` is one the proxy is opening itself.
    pub fn contains(&self, app: SocketAddr, from: SocketAddr) -> bool {
        self.lock().contains(&(app, from))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<(SocketAddr, SocketAddr)>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An [`InFlight`] entry, removed on drop (also if the connect's task is cancelled).
struct Entry<'a> {
    set: &'a InFlight,
    key: (SocketAddr, SocketAddr),
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.set.lock().remove(&self.key);
    }
}

async fn timed(
    limit: Duration,
    f: impl std::future::Future<Output = io::Result<TcpStream>>,
) -> io::Result<TcpStream> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
}
