//! The node proxy: what every pod's paths share (the workload store, swapped whole when
//! istiod or the workloads file changes it; the certificate source; the connection pool;
//! telemetry; the shutdown switch and its caps) and the pods served now.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError, RwLock, Weak,
    },
};

use crate::{
    certs::Certs,
    metrics::Metrics,
    proxy::{authorized::Authorized, drain::Drain, pod::Pod, pool::Pool, transparent, Settings},
    state::{store::WorkloadStore, Synced},
};

/// Everything the pods' paths share.
#[derive(Debug)]
pub struct Proxy {
    store: RwLock<Arc<WorkloadStore>>,
    pub certs: Certs,
    pub drain: Drain,
    /// At shutdown, the plain connections go to the next proxy through the agent.
    pub handover: super::handover::HandOver,
    pub pool: Pool,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    pods: Mutex<BTreeMap<String, Arc<Pod>>>,
    ready: AtomicBool,
    /// The transparent connections to apps being opened now (see `transparent`).
    pub transparent: transparent::InFlight,
    /// The open inbound connections policy allowed, re-checked when policy changes.
    pub authorized: Authorized,
    /// In xDS mode: whether istiod's first responses have been applied (readiness waits).
    xds: std::sync::OnceLock<Arc<Synced>>,
    /// The identities of the HBONE workloads the store places on this node, and the store they
    /// were read from: walked again only when the store is another (the renewal task asks
    /// every 500 ms; a walk is as long as the mesh). A weak reference: the old store is not
    /// kept, and its address not reused while this names it.
    node_identities: Mutex<(Weak<WorkloadStore>, Vec<crate::identity::Identity>)>,
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
            handover: Default::default(),
            pool: Pool::new(metrics.clone(), settings.pool_max_streams, settings.pool_spread),
            metrics,
            settings,
            pods: Mutex::new(BTreeMap::new()),
            ready: AtomicBool::new(false),
            transparent: Default::default(),
            authorized: Default::default(),
            xds: std::sync::OnceLock::new(),
            node_identities: Mutex::new((Weak::new(), Vec::new())),
        }))
    }

    /// Makes readiness, and every listener's first accept, wait for istiod's first responses.
    pub fn expect_xds(&self, synced: Arc<Synced>) {
        self.drain.gate_on(synced.clone());
        let _ = self.xds.set(synced);
    }

    /// The identities whose certificates are kept: those of the pods served, and those of the
    /// HBONE workloads the store places on `node` (their pods are about to arrive).
    pub fn wanted_identities(&self, node: &str) -> Vec<crate::identity::Identity> {
        let mut ids: std::collections::HashSet<crate::identity::Identity> =
            self.pods().iter().map(|p| p.identity().as_ref().clone()).collect();
        if !node.is_empty() {
            let store = self.store();
            let mut cached = self.node_identities.lock().unwrap_or_else(PoisonError::into_inner);
            if !Weak::ptr_eq(&cached.0, &Arc::downgrade(&store)) {
                let on_node = store
                    .workloads()
                    .filter(|w| {
                        w.node == node && w.protocol == crate::state::workloads::Protocol::Hbone
                    })
                    .map(|w| w.identity())
                    .collect::<std::collections::HashSet<_>>();
                *cached = (Arc::downgrade(&store), on_node.into_iter().collect());
            }
            ids.extend(cached.1.iter().cloned());
        }
        ids.into_iter().collect()
    }

    /// The workload store now (a snapshot: a reload does not change it under a connection).
    pub fn store(&self) -> Arc<WorkloadStore> {
        // A poisoned lock still holds the last store written (never an empty, policy-less one).
        self.store.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Replaces the workload store. If `workloads_left` (a workload was removed, or now
    /// counts under another workload; a new file always says so), telemetry of workloads no
    /// longer in it is removed: that walks every workload, which istiod's delta of one new pod
    /// need not pay. If the policies changed, open connections the new ones deny are closed.
    pub fn set_store(&self, store: WorkloadStore, workloads_left: bool) {
        let before = self.store();
        // A store made from the one before shares its policies unless they changed.
        let policies_changed = !before.same_policies(&store);
        let live: Option<std::collections::HashSet<(String, String)>> = workloads_left.then(|| {
            store
                .workloads()
                .map(|w| (w.namespace.clone(), w.workload_label().to_owned()))
                // Pods served here (the agent describes them over ZDS) count even if the store
                // does not list them.
                .chain(self.pods().iter().map(|p| {
                    (p.workload.namespace.clone(), p.workload.workload_label().to_owned())
                }))
                .collect()
        });
        *self.store.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(store);
        // The old store is dropped here, or by the last connection holding it.
        drop(before);
        if let Some(live) = live {
            let expired = self.metrics.expire_workloads(&live);
            if expired > 0 {
                tracing::info!(series = expired, "telemetry of workloads that left removed");
            }
        }
        if policies_changed {
            let closed = Authorized::recheck(self);
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
        self.metrics.set_pods(pods.len() as i64);
        old
    }

    pub(crate) fn take_pod(&self, uid: &str) -> Option<Arc<Pod>> {
        let mut pods = self.pods.lock().ok()?;
        let old = pods.remove(uid);
        self.metrics.set_pods(pods.len() as i64);
        old
    }

    /// Ready: the pods are served (the agent's snapshot applied), not draining, and no served
    /// pod's certificate has expired (its peers would refuse every connection).
    pub fn is_ready(&self) -> bool {
        self.not_ready_reasons().is_empty()
    }

    /// Why the proxy is not ready (none: it is), for its readiness answer: what an operator
    /// who reads it needs to act on.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        let mut why = Vec::new();
        if !self.ready.load(Ordering::Relaxed) {
            why.push("the node agent's pods (ZDS snapshot) not applied yet".to_owned());
        }
        if let Some(missing) = self.xds.get().map(|s| s.missing()).filter(|m| !m.is_empty()) {
            why.push(format!(
                "no response of istiod's {} accepted whole yet (istiod unreachable, or a \
                 resource refused: see meshpath_xds_responses_total and the log)",
                missing.join(" and ")
            ));
        }
        if self.drain.is_stopping() {
            why.push("draining".to_owned());
        }
        let expired = self.expired_certificates();
        if !expired.is_empty() {
            why.push(format!(
                "{} pod(s) without a valid certificate (istiod's CA unreachable or refusing), \
                 first {}",
                expired.len(),
                expired[0]
            ));
        }
        why
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
