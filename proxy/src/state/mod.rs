//! The node proxy's state: the workload store (swapped whole on reload), the certificate source,
//! the connection pool, telemetry, the shutdown switch, and the pods served now.

pub mod authorization;
pub mod memory;
pub mod reload;
pub mod workloads;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, RwLock,
    },
    time::Duration,
};

use crate::{
    identity::certs::Certs, inpod::Pod, metrics::Metrics, proxy::drain::Drain, proxy::pool::Pool,
    state::workloads::WorkloadStore,
};

/// Pooled connections per destination before streams share one: concurrent bulk streams on
/// separate TCP connections do not queue behind each other's flow control, and few enough that
/// an idle pool stays small (the measurements: results/README.md, "Why the proxy has its
/// shape").
pub const POOL_SPREAD: usize = 4;
/// The proxy's tokio worker threads by default (ztunnel's default too; `--worker-threads`).
pub const WORKER_THREADS: u16 = 2;

/// How long an inbound HBONE connection may have no stream (`--hbone-idle-seconds`).
pub const HBONE_IDLE_SECONDS: u64 = 600;
/// Unauthenticated connections one source may hold to a pod's HBONE port
/// (`--max-handshakes-per-source`). A client's pool opens a few connections to a pod at once
/// (ours up to `POOL_SPREAD`, ztunnel one per key); a gateway or waypoint carrying many
/// clients' traffic may open more in a burst, and each handshake takes milliseconds.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 64;

/// Tunables, from the command line.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where DNS queries not answered from the store go.
    pub dns_upstreams: Vec<SocketAddr>,
    /// Streams per pooled HBONE connection before another is opened.
    pub pool_max_streams: usize,
    /// Pooled connections per destination that streams are spread over before they share one.
    pub pool_spread: usize,
    /// How long a pooled connection without streams is kept.
    pub pool_idle: Duration,
    /// Limit on the TLS and HTTP/2 handshakes of an inbound connection.
    pub handshake_timeout: Duration,
    /// Limit on an upstream TCP connect.
    pub connect_timeout: Duration,
    /// Connect to apps with the client's address as source (`IP_TRANSPARENT`, as ztunnel).
    pub preserve_source: bool,
    /// HTTP/2 PING on pooled HBONE connections.
    pub keepalive: crate::proxy::hbone::Keepalive,
    /// Connections carried at once, over all pods (each takes two file descriptors or so).
    pub max_connections: usize,
    /// Connections carried at once for one pod in each direction: inbound (15008, 15006 and
    /// each inbound HBONE stream) and outbound (15001 and TCP 15053) have a cap each.
    pub max_connections_per_pod: usize,
    /// Connections one source address may hold open to a pod's HBONE port before they have
    /// proven an identity (through the TLS handshake), out of the pod's inbound cap.
    pub max_handshakes_per_source: usize,
    /// A connection that carries nothing either way for this long is closed (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// An inbound HBONE connection with no stream for this long is told to go away (GOAWAY)
    /// and closed, giving back its slot under the caps (`None`: never). Longer than a client's
    /// pool idle time (ours and ztunnel's: 5 minutes), so that normally the client closes first.
    pub hbone_idle: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            dns_upstreams: Vec::new(),
            pool_max_streams: 100,
            pool_spread: POOL_SPREAD,
            pool_idle: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            preserve_source: true,
            keepalive: crate::proxy::hbone::Keepalive::default(),
            max_connections: 200_000,
            max_connections_per_pod: 20_000,
            max_handshakes_per_source: MAX_HANDSHAKES_PER_SOURCE,
            idle_timeout: Some(Duration::from_secs(3600)),
            hbone_idle: Some(Duration::from_secs(HBONE_IDLE_SECONDS)),
        }
    }
}

/// Everything the pods' paths share.
#[derive(Debug)]
pub struct Proxy {
    store: RwLock<Arc<WorkloadStore>>,
    pub certs: Certs,
    pub drain: Drain,
    pub pool: Pool,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    pods: Mutex<BTreeMap<String, Arc<Pod>>>,
    ready: AtomicBool,
    /// The transparent connections to apps being opened now (see `transparent`).
    pub transparent: crate::proxy::transparent::InFlight,
    /// The open inbound connections policy allowed, re-checked when policy changes.
    pub authorized: crate::proxy::authorized::Authorized,
    /// In xDS mode: whether istiod's first responses have been applied (readiness waits).
    xds: std::sync::OnceLock<Arc<crate::xds::Synced>>,
}

impl Proxy {
    /// The proxy.
    pub fn new(
        store: WorkloadStore,
        certs: Certs,
        settings: Settings,
    ) -> anyhow::Result<Arc<Self>> {
        Self::with_metrics(store, certs, settings, Arc::new(Metrics::new()))
    }

    /// The proxy, with telemetry made before it (the CA client counts into it).
    pub fn with_metrics(
        store: WorkloadStore,
        certs: Certs,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            store: RwLock::new(Arc::new(store)),
            certs,
            drain: Drain::new(settings.max_connections),
            pool: Pool::new(metrics.clone(), settings.pool_max_streams, settings.pool_spread),
            metrics,
            settings,
            pods: Mutex::new(BTreeMap::new()),
            ready: AtomicBool::new(false),
            transparent: Default::default(),
            authorized: Default::default(),
            xds: std::sync::OnceLock::new(),
        }))
    }

    /// Makes readiness wait for istiod's first responses.
    pub fn expect_xds(&self, synced: Arc<crate::xds::Synced>) {
        let _ = self.xds.set(synced);
    }

    /// The identities whose certificates are kept: those of the pods served, and those of the
    /// HBONE workloads the store places on `node` (their pods are about to arrive).
    pub fn wanted_identities(&self, node: &str) -> Vec<crate::identity::Identity> {
        let mut ids: std::collections::HashSet<crate::identity::Identity> =
            self.pods().iter().map(|p| p.identity.clone()).collect();
        if !node.is_empty() {
            let store = self.store();
            ids.extend(
                store
                    .workloads()
                    .iter()
                    .filter(|w| w.node == node && w.protocol == workloads::Protocol::Hbone)
                    .map(|w| w.identity()),
            );
        }
        ids.into_iter().collect()
    }

    /// The workload store now (a snapshot: a reload does not change it under a connection).
    pub fn store(&self) -> Arc<WorkloadStore> {
        // A poisoned lock still holds the last store written (never an empty, policy-less one).
        self.store.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Replaces the workload store; telemetry of workloads no longer in it is removed, and
    /// open connections the new policies deny are closed.
    pub fn set_store(&self, store: WorkloadStore) {
        // Entries are shared between stores made from the same xDS state: an unchanged policy
        // is the same allocation.
        let before = self.store();
        let policies_changed = before.policies().len() != store.policies().len()
            || before.policies().iter().zip(store.policies()).any(|(a, b)| !Arc::ptr_eq(a, b));
        let live: std::collections::HashSet<(String, String)> =
            store
                .workloads()
                .iter()
                .map(|w| (w.namespace.clone(), w.workload_label().to_owned()))
                // Pods served here (the agent describes them over ZDS) count even if the store
                // does not list them.
                .chain(self.pods().iter().map(|p| {
                    (p.workload.namespace.clone(), p.workload.workload_label().to_owned())
                }))
                .collect();
        *self.store.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(store);
        let expired = self.metrics.expire_workloads(&live);
        if expired > 0 {
            tracing::info!(series = expired, "telemetry of workloads that left removed");
        }
        if policies_changed {
            let closed = crate::proxy::authorized::Authorized::recheck(self);
            if closed > 0 {
                tracing::info!(closed, "open connections the new policies deny closed");
            }
        }
    }

    /// The pods served now.
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.pods.lock().map(|p| p.values().cloned().collect()).unwrap_or_default()
    }

    /// The pod with this uid.
    pub fn pod(&self, uid: &str) -> Option<Arc<Pod>> {
        self.pods.lock().ok()?.get(uid).cloned()
    }

    pub(crate) fn insert_pod(&self, pod: Arc<Pod>) -> Option<Arc<Pod>> {
        let mut pods = self.pods.lock().ok()?;
        let old = pods.insert(pod.uid.clone(), pod);
        self.metrics.pods.set(pods.len() as i64);
        old
    }

    pub(crate) fn take_pod(&self, uid: &str) -> Option<Arc<Pod>> {
        let mut pods = self.pods.lock().ok()?;
        let old = pods.remove(uid);
        self.metrics.pods.set(pods.len() as i64);
        old
    }

    /// Ready: the pods are served (the agent's snapshot applied), not draining, and no served
    /// pod's certificate has expired (its peers would refuse every connection).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
            && self.xds.get().is_none_or(|s| s.all())
            && !self.drain.is_stopping()
            && self.expired_certificates().is_empty()
    }

    /// The served pods whose certificate has expired.
    pub fn expired_certificates(&self) -> Vec<String> {
        let now = time::OffsetDateTime::now_utc();
        self.pods()
            .iter()
            .filter(|p| p.cert().is_none_or(|c| c.not_after <= now))
            .map(|p| p.uid.clone())
            .collect()
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }
}
