//! One pod served by the proxy, as its traffic paths see it: its network namespace (its
//! sockets are made inside it: `netns`), its workload and identity, its certificate and TLS
//! configurations, its connection caps, and the switches that close its listeners and end its
//! connections. Serving and removing pods is `crate::inpod`'s.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, RwLock},
    time::SystemTime,
};

use anyhow::Context as _;
use meshpath_podnet::netns::Netns;
use rustls::{pki_types::CertificateDer, ClientConfig, ServerConfig};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    identity::tls,
    identity::{Identity, WorkloadCert},
    metrics::Direction,
    proxy::{
        drain::{Permits, Scope},
        held_listeners::PodListeners,
        netns::SocketFactory,
        per_source::{PerSource, SourceSlot},
        stop::when_woken,
        Proxy,
    },
    state::{store::WorkloadStore, workloads::Workload},
};

struct PodTls {
    /// Whom the certificate names: the pod's identity, changed with it (istiod describing a
    /// pod added before, under another trust domain or service account than assumed).
    identity: Arc<Identity>,
    cert: Arc<WorkloadCert>,
    fetched: SystemTime,
    stamp: Vec<Option<crate::certs::FileStamp>>,
    /// The trust roots its configurations check peers with: the proxy's when they were made.
    /// Other roots now (a bundle changed) make them stale until a refresh succeeds.
    roots: Arc<Vec<CertificateDer<'static>>>,
    server: Arc<ServerConfig>,
    /// Client configurations by expected peer identity, made once per certificate: every
    /// pooled connection holds its configuration, so sharing it is memory each connection
    /// does not cost (and a key not parsed per connection).
    clients: HashMap<Identity, Arc<ClientConfig>>,
}

/// One pod served by this proxy.
pub struct Pod {
    pub uid: String,
    pub netns: Netns,
    /// Creates the pod's sockets inside its netns.
    pub sockets: SocketFactory,
    pub workload: Workload,
    tls: RwLock<PodTls>,
    pub proxy: Arc<Proxy>,
    /// Cancelled to close the pod's capture listeners, 15001, 15006 and 15053 (removal, or
    /// the first step of the proxy's shutdown).
    pub listening: CancellationToken,
    /// Cancelled to close the pod's HBONE listener, 15008, and send its HBONE connections
    /// GOAWAY (removal, or the second step of the proxy's shutdown: `drain`).
    pub listening_hbone: CancellationToken,
    /// Cancelled to end the pod's connections (removal only: shutdown lets them drain).
    pub gone: CancellationToken,
    /// Its open connections, for the admin dump.
    pub open: super::open_connections::OpenConnections,
    /// Its paused HBONE streams whose client side is to dial again (`resume`).
    pub waiting: super::resume::Waiting,
    /// Whether connections to its apps keep the client's address (see `Pod::new`).
    transparent: bool,
    /// Its caps on connections carried at once, one per direction, so that connections opened
    /// to the pod (by anyone who can reach it, before any credential is checked) cannot take
    /// the slots of its own outbound connections, nor these the slots of its inbound.
    conns: PodCaps,
}

/// A pod's connection caps. Inbound counts its 15008 and 15006 connections and each inbound
/// HBONE stream (it has a connection to the app of its own); outbound its 15001 and TCP 15053.
#[derive(Debug)]
struct PodCaps {
    inbound: Arc<tokio::sync::Semaphore>,
    outbound: Arc<tokio::sync::Semaphore>,
    /// The share of `inbound` one source may hold on 15008 before it has proven an identity.
    unauthenticated: Arc<PerSource>,
}

impl PodCaps {
    fn new(per_direction: usize, unauthenticated_per_source: usize) -> Self {
        let cap = || {
            Arc::new(tokio::sync::Semaphore::new(
                per_direction.min(tokio::sync::Semaphore::MAX_PERMITS),
            ))
        };
        Self {
            inbound: cap(),
            outbound: cap(),
            unauthenticated: PerSource::new(unauthenticated_per_source),
        }
    }

    fn of(&self, direction: Direction) -> &Arc<tokio::sync::Semaphore> {
        match direction {
            Direction::Inbound => &self.inbound,
            Direction::Outbound => &self.outbound,
        }
    }
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pod").field("uid", &self.uid).field("identity", &self.identity()).finish()
    }
}

impl Pod {
    /// The pod's identity now (what its certificate names).
    pub fn identity(&self) -> Arc<Identity> {
        match self.tls.read() {
            Ok(t) => t.identity.clone(),
            Err(poisoned) => poisoned.into_inner().identity.clone(),
        }
    }

    /// The pod's certificate now.
    pub fn cert(&self) -> Option<Arc<WorkloadCert>> {
        self.tls.read().ok().map(|t| t.cert.clone())
    }

    /// The TLS client configuration for connections to a peer that must be `peer`.
    pub fn client_tls(&self, peer: &Identity) -> anyhow::Result<Arc<ClientConfig>> {
        if let Some(c) = self.tls.read().ok().and_then(|t| t.clients.get(peer).cloned()) {
            return Ok(c);
        }
        let mut t = self.tls.write().map_err(|_| anyhow::anyhow!("TLS state lock poisoned"))?;
        if let Some(c) = t.clients.get(peer) {
            return Ok(c.clone());
        }
        let c = tls::client_config(&t.cert, &t.roots, vec![peer.clone()])?;
        t.clients.insert(peer.clone(), c.clone());
        Ok(c)
    }

    /// The TLS server configuration of its HBONE port now.
    pub fn server_tls(&self) -> Option<Arc<ServerConfig>> {
        self.tls.read().ok().map(|t| t.server.clone())
    }

    /// Replaces the pod's certificate and TLS settings if the source says the certificate is
    /// stale, the pod's identity changed, or the proxy trusts other roots than those the
    /// settings were made with (a bundle changed; if making them again fails, the next refresh
    /// tries again). Returns whether it did.
    pub fn refresh_cert(&self) -> anyhow::Result<bool> {
        // The identity istiod gives the pod now: another than the one held (a pod added before
        // istiod described it, whose trust domain or service account was assumed) gets a
        // certificate for the new one, and the pod takes both together.
        let wanted = self.current_workload(&self.proxy.store()).identity();
        let roots = self.proxy.certs.roots();
        let (held, stale, other_roots) = self
            .tls
            .read()
            .map(|t| {
                let stale = self.proxy.certs.stale(&t.identity, &t.cert, t.fetched, &t.stamp);
                let other_roots = !Arc::ptr_eq(&t.roots, &roots) && *t.roots != *roots;
                (t.identity.clone(), stale, other_roots)
            })
            .map_err(|_| anyhow::anyhow!("TLS state lock poisoned"))?;
        let changed = *held != wanted;
        if !stale && !changed && !other_roots {
            return Ok(false);
        }
        let next = fetch_tls(&self.proxy, &wanted)?;
        let serial = next.cert.serial();
        if let Ok(mut t) = self.tls.write() {
            *t = next;
        }
        self.proxy.metrics.cert_rotations.inc();
        if changed {
            info!(pod = %self.uid, from = %held, identity = %wanted, serial, "the pod's identity changed; certificate replaced");
        } else if stale {
            info!(pod = %self.uid, identity = %wanted, serial, "certificate renewed");
        } else {
            info!(pod = %self.uid, identity = %wanted, serial, roots = roots.len(), "the trust roots changed; TLS settings made again");
        }
        Ok(true)
    }

    /// What the store says about the pod now (policies select workloads by what the store
    /// says, and it may have changed since the pod was added), else what it was added with.
    pub fn current_workload<'a>(&'a self, store: &'a WorkloadStore) -> &'a Workload {
        store.by_uid(&self.uid).unwrap_or(&self.workload)
    }

    /// Whether connections to its app keep the client's address.
    pub fn preserves_source(&self) -> bool {
        self.transparent
    }

    /// What a capture listener of this pod serves under: its stop and removal, its connection
    /// cap; `holds_hbone` for the outbound listener, whose connections may need HBONE.
    pub fn scope(&self, direction: Direction, holds_hbone: bool) -> Scope {
        Scope {
            stop: self.listening.clone(),
            kill: self.gone.clone(),
            limit: self.conns.of(direction).clone(),
            metrics: self.proxy.metrics.clone(),
            direction,
            holds_hbone,
        }
    }

    /// What the pod's HBONE listener serves under: as an inbound capture listener, but stopped
    /// at the second step of the proxy's shutdown.
    pub fn hbone_scope(&self) -> Scope {
        Scope { stop: self.listening_hbone.clone(), ..self.scope(Direction::Inbound, false) }
    }

    /// A slot for one more inbound connection of this pod (an inbound HBONE stream), under its
    /// inbound cap and the node's; `None` when either is reached.
    pub fn admit_inbound(&self) -> Option<Permits> {
        self.proxy.drain.admit(&self.conns.inbound)
    }

    /// A count for one more connection from `source` to the pod's HBONE port that has not yet
    /// proven an identity; `None` when `source` holds its share of the inbound cap already.
    pub fn admit_unauthenticated(&self, source: std::net::IpAddr) -> Option<SourceSlot> {
        self.conns.unauthenticated.admit(source)
    }

    /// Runs `task` as one of the pod's connections: tracked by the drain, ended if the pod is
    /// removed.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let gone = self.gone.clone();
        self.proxy.drain.spawn(async move {
            tokio::select! {
                () = task => {}
                () = when_woken(gone.cancelled()) => {}
            }
        });
    }
}

fn fetch_tls(proxy: &Proxy, id: &Identity) -> anyhow::Result<PodTls> {
    let stamp = proxy.certs.stamp(id);
    let cert = proxy
        .certs
        .fetch(id)
        .with_context(|| format!("certificate for {id} ({})", proxy.certs.mode()))?;
    let roots = proxy.certs.roots();
    // Fails if the key does not match the certificate (files caught between two writes).
    let server =
        tls::server_config(&cert, &roots).with_context(|| format!("certificate for {id}"))?;
    Ok(PodTls {
        identity: Arc::new(id.clone()),
        cert: Arc::new(cert),
        fetched: SystemTime::now(),
        stamp,
        roots,
        server,
        clients: HashMap::new(),
    })
}

impl Pod {
    /// A pod to serve: `workload` is what the store (or the node agent) says about it, `netns`
    /// its network namespace, `held` its listeners the node agent handed over. Fetches its
    /// certificate and checks whether its reply routing is in place; it opens no listener
    /// (`crate::inpod::add` does).
    pub fn new(
        proxy: &Arc<Proxy>,
        uid: &str,
        netns: Netns,
        mut workload: Workload,
        held: PodListeners,
    ) -> anyhow::Result<Self> {
        let tls = fetch_tls(proxy, &workload.identity())?;
        let sockets = SocketFactory::new(&netns, held)
            .with_context(|| format!("a socket factory for the netns of pod {uid}"))?;
        if workload.workload_ips.is_empty() {
            // Not in the store (a pod the agent just added): its addresses are in its netns.
            workload.workload_ips = sockets
                .addresses()
                .with_context(|| format!("reading the addresses in the netns of pod {uid}"))?;
        }
        // The client's address is kept only where the pod's reply routing is in place (the node
        // agent writes it when it enrols the pod): a pod added by hand (`--pod`) to a node whose
        // agent did not enrol it gets connections from its own address instead of broken ones.
        let transparent = proxy.settings.preserve_source
            && sockets
                .run(|| Ok(meshpath_podnet::reply_routing::is_set_up()))
                .with_context(|| format!("checking the reply routing in the netns of pod {uid}"))?;
        if proxy.settings.preserve_source && !transparent {
            warn!(pod = %uid, "no reply routing in the pod (not enrolled by a node agent?): its apps will see the pod's own address as the client's");
        }
        Ok(Self {
            uid: uid.to_owned(),
            netns,
            sockets,
            workload,
            tls: RwLock::new(tls),
            proxy: proxy.clone(),
            listening: proxy.drain.child_token(),
            listening_hbone: proxy.drain.hbone_child_token(),
            gone: CancellationToken::new(),
            open: Default::default(),
            waiting: Default::default(),
            transparent,
            conns: PodCaps::new(
                proxy.settings.max_connections_per_pod,
                proxy.settings.max_handshakes_per_source,
            ),
        })
    }

    /// Closes its listeners and ends its connections.
    pub fn stop(&self) {
        self.listening.cancel();
        self.listening_hbone.cancel();
        self.sockets.held.release();
        self.gone.cancel();
        self.proxy.pool.forget_workload(&self.uid);
    }
}
