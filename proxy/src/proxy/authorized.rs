//! Inbound connections that passed an authorization check, held while they are open so that a
//! change of policy closes those it no longer allows, as ztunnel's connection manager does: a
//! DENY added, or the ALLOW that admitted a connection removed, cuts the connection within the
//! proxy's reaction to the change, not at its end.
//!
//! A connection registers after its check passed and before its bytes flow; its registration
//! ends with it (dropped). [`Authorized::recheck`] runs the check again for every registered
//! connection against the store in force and cancels the token of each that fails.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::{identity::Identity, metrics::Direction, proxy::Proxy, state::authorization};

#[derive(Debug)]
struct Entry {
    /// The destination pod (its workload's policies are looked up again at each check).
    pod: String,
    src_identity: Option<Identity>,
    src: IpAddr,
    dst: SocketAddr,
    close: CancellationToken,
}

/// The registered connections (bounded by the connection caps: one entry per open one).
#[derive(Debug, Default)]
pub struct Authorized {
    conns: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
}

/// One connection's registration; dropping it unregisters.
#[derive(Debug)]
pub struct Registration {
    id: u64,
    set: Arc<Proxy>,
    /// Cancelled when a policy change denies the connection.
    pub closed: CancellationToken,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut conns) = self.set.authorized.conns.lock() {
            conns.remove(&self.id);
        }
    }
}

impl Authorized {
    /// Registers a connection to `pod` that was just allowed.
    pub fn register(
        proxy: &Arc<Proxy>,
        pod: &str,
        src_identity: Option<&Identity>,
        src: IpAddr,
        dst: SocketAddr,
    ) -> Registration {
        let id = proxy.authorized.next.fetch_add(1, Ordering::Relaxed);
        let close = CancellationToken::new();
        let entry = Entry {
            pod: pod.to_owned(),
            src_identity: src_identity.cloned(),
            src,
            dst,
            close: close.clone(),
        };
        if let Ok(mut conns) = proxy.authorized.conns.lock() {
            conns.insert(id, entry);
        }
        Registration { id, set: proxy.clone(), closed: close }
    }

    /// How many connections are registered.
    pub fn len(&self) -> usize {
        self.conns.lock().map(|c| c.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks every registered connection against the store in force; closes and counts
    /// (`policy_denied`) each it denies. Returns how many were closed.
    pub fn recheck(proxy: &Proxy) -> usize {
        let store = proxy.store();
        let denied: Vec<(String, CancellationToken, String)> = {
            let Ok(conns) = proxy.authorized.conns.lock() else { return 0 };
            conns
                .values()
                .filter(|e| !e.close.is_cancelled())
                .filter_map(|e| {
                    let pod = proxy.pod(&e.pod)?;
                    let c = authorization::Connection {
                        src_identity: e.src_identity.as_ref(),
                        src: e.src,
                        dst: e.dst,
                    };
                    let policies = store.policies_for(pod.current_workload(&store));
                    authorization::check(&policies, &c).err().map(|why| {
                        (format!("{} → {}", e.src, e.dst), e.close.clone(), why.to_string())
                    })
                })
                .collect()
        };
        for (conn, close, why) in &denied {
            close.cancel();
            proxy.metrics.error(Direction::Inbound, "policy_denied");
            info!(connection = %conn, reason = %why, "open connection closed: a policy change denies it");
        }
        denied.len()
    }
}
