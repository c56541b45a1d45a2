//! The agent's view of the Kubernetes API, as istio-cni's node agent has it: a reflector of the
//! Pods of this node (field selector `spec.nodeName`) and one of all Namespaces, kept by
//! kube-runtime watchers that relist at once after a 410 Gone and retry with a short backoff
//! while the API server is unreachable (the caches keep their last state meanwhile; `Retry`). Also what the
//! agent writes back: the `ambient.istio.io/redirection` annotation, and an Event on a pod
//! whose annotations do not parse.

use std::{
    collections::HashSet,
    future::Future,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use datapath_common::consts::k8s;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Event, EventSource, Namespace, ObjectReference, Pod};
use kube::{
    api::{ListParams, Patch, PatchParams, PostParams},
    runtime::{reflector, reflector::ObjectRef, watcher, WatchStreamExt as _},
    Api, Client,
};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::enablement::{decide, Decision};

/// How long any one request to the API server may take (the watches aside). kube-rs sets no
/// read timeout, and these requests are made holding the lock every CNI request takes: one
/// that never came back would hold up every ADD on the node, and the readiness probe with it.
pub const API_TIMEOUT: Duration = Duration::from_secs(5);

/// `call`, given up after [`API_TIMEOUT`].
async fn bounded<T>(
    what: &str,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(API_TIMEOUT, call).await {
        Ok(r) => r.map_err(|e| anyhow::anyhow!("{what}: {e}")),
        Err(_) => {
            anyhow::bail!("{what}: the Kubernetes API server did not answer within {API_TIMEOUT:?}")
        }
    }
}

/// Whether `pod` is the pod a runtime's `K8S_POD_UID` names (any, when it passed none): its
/// uid, or for a static pod's mirror the static pod's.
fn is_pod(pod: &Pod, uid: &str) -> bool {
    uid.is_empty()
        || pod.metadata.uid.as_deref() == Some(uid)
        || pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(k8s::CONFIG_MIRROR))
            .map(String::as_str)
            == Some(uid)
}

/// How soon a watch is polled again after an event. After a success, at once. After 410 Gone
/// (its resource version is too old for the server, as after an outage), at once too: the
/// watcher relists, and a relist is what a 410 asks for. After any other failure, with a
/// backoff from 100 ms doubling to [`Retry::MAX`]: short enough that a change made right after
/// the API server returns applies within seconds (kube-runtime's default backoff grew to tens
/// of seconds over an outage, and a label change then waited it out), and the two-second
/// reachability probe cuts it short anyway.
#[derive(Debug, Default)]
struct Retry {
    next: Option<Duration>,
}

impl Retry {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(2);

    fn after<K>(&mut self, ev: &Result<watcher::Event<K>, watcher::Error>) -> Option<Duration> {
        match ev {
            Ok(_) => {
                self.next = None;
                None
            }
            Err(watcher::Error::WatchError(status)) if status.code == 410 => None,
            Err(_) => {
                let d = self.next.map_or(Self::FIRST, |d| (d * 2).min(Self::MAX));
                self.next = Some(d);
                Some(d)
            }
        }
    }
}

/// How the agent reaches the API and which pods are its node's.
#[derive(Debug, Clone)]
pub struct KubeConfig {
    /// A kubeconfig file; none: the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    /// This node's name (`spec.nodeName` of its pods; the downward API's `NODE_NAME`).
    pub node_name: String,
    /// Namespaces never meshed.
    pub excluded_namespaces: Vec<String>,
}

/// The watched state.
pub struct Kube {
    pub client: Client,
    pub cfg: KubeConfig,
    pods: reflector::Store<Pod>,
    namespaces: reflector::Store<Namespace>,
    /// Each cache has been filled at least once (a watcher's `InitDone`).
    pods_synced: AtomicBool,
    namespaces_synced: AtomicBool,
    /// The API server answered the last probe and no watch has failed since.
    reachable: AtomicBool,
    /// Signalled on every change the watchers see.
    pub changed: Notify,
    /// Signalled when the API server answers again after it did not.
    api_back: Notify,
    /// Pods an Event was already written for (uid and message): one Event per problem.
    reported: Mutex<HashSet<(String, String)>>,
}

impl std::fmt::Debug for Kube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kube").field("node", &self.cfg.node_name).finish_non_exhaustive()
    }
}

impl Kube {
    /// Connects (no request is made yet) and starts both watches.
    pub async fn start(cfg: KubeConfig) -> anyhow::Result<Arc<Self>> {
        let config = match &cfg.kubeconfig {
            Some(path) => {
                let file = kube::config::Kubeconfig::read_from(path)?;
                kube::Config::from_custom_kubeconfig(file, &Default::default()).await?
            }
            None => kube::Config::incluster()?,
        };
        let client = Client::try_from(config)?;
        let (pods, pods_writer) = reflector::store::<Pod>();
        let (namespaces, ns_writer) = reflector::store::<Namespace>();
        let kube = Arc::new(Self {
            client: client.clone(),
            cfg: cfg.clone(),
            pods,
            namespaces,
            pods_synced: AtomicBool::new(false),
            namespaces_synced: AtomicBool::new(false),
            reachable: AtomicBool::new(false),
            changed: Notify::new(),
            api_back: Notify::new(),
            reported: Mutex::new(HashSet::new()),
        });
        let selector = format!("spec.nodeName={}", cfg.node_name);
        let pod_watch =
            watcher(Api::<Pod>::all(client.clone()), watcher::Config::default().fields(&selector))
                .reflect(pods_writer);
        let ns_watch =
            watcher(Api::<Namespace>::all(client), watcher::Config::default()).reflect(ns_writer);
        let k = kube.clone();
        tokio::spawn(async move {
            let mut s = std::pin::pin!(pod_watch);
            let mut pace = Retry::default();
            while let Some(ev) = s.next().await {
                let after = pace.after(&ev);
                k.observe(&k.pods_synced, "pods", ev);
                k.retry_after(after).await;
            }
        });
        let k = kube.clone();
        tokio::spawn(async move {
            let mut s = std::pin::pin!(ns_watch);
            let mut pace = Retry::default();
            while let Some(ev) = s.next().await {
                let after = pace.after(&ev);
                k.observe(&k.namespaces_synced, "namespaces", ev);
                k.retry_after(after).await;
            }
        });
        // A watch that resumes after an outage says nothing until something changes: whether
        // the API server answers is asked every two seconds.
        let k = kube.clone();
        tokio::spawn(async move {
            let namespaces = Api::<Namespace>::all(k.client.clone());
            loop {
                let one = ListParams::default().limit(1);
                let up = bounded("probe", namespaces.list_metadata(&one)).await.is_ok();
                if k.reachable.swap(up, Ordering::Relaxed) != up {
                    if up {
                        info!("Kubernetes API server reachable");
                        // Watches waiting out a failure retry now, not at their next step.
                        k.api_back.notify_waiters();
                    } else {
                        warn!("Kubernetes API server unreachable; serving the pods already known");
                    }
                    k.changed.notify_one();
                }
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        });
        Ok(kube)
    }

    /// Waits before a watch is polled again after a failure: `after`, cut short when the API
    /// server is seen answering again.
    async fn retry_after(&self, after: Option<Duration>) {
        if let Some(d) = after {
            tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = self.api_back.notified() => {}
            }
        }
    }

    fn observe<K>(
        &self,
        synced: &AtomicBool,
        what: &str,
        ev: Result<watcher::Event<K>, watcher::Error>,
    ) {
        if ev.is_ok() && !self.reachable.swap(true, Ordering::Relaxed) {
            // The server answered the watch: it is reachable, whatever the last probe said.
            info!(watch = what, "Kubernetes API server reachable");
            self.api_back.notify_waiters();
        }
        match ev {
            Ok(watcher::Event::InitDone) => {
                if !synced.swap(true, Ordering::Relaxed) {
                    info!(watch = what, "Kubernetes watch synced");
                }
                self.changed.notify_one();
            }
            Ok(_) => self.changed.notify_one(),
            // The server answered: its history no longer reaches our resource version. The
            // watcher relists (Retry lets it at once); nothing says the server is away.
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                info!(watch = what, "Kubernetes watch expired (410 Gone); relisting");
            }
            Err(e) => {
                if self.reachable.swap(false, Ordering::Relaxed) {
                    warn!(watch = what, error = %e, "Kubernetes watch failed; retrying with backoff");
                }
            }
        }
    }

    /// Both caches have been filled and the API server answers.
    pub fn healthy(&self) -> bool {
        self.pods_synced.load(Ordering::Relaxed)
            && self.namespaces_synced.load(Ordering::Relaxed)
            && self.reachable.load(Ordering::Relaxed)
    }

    /// Whether the API server answered the last probe.
    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// The decision for a pod of this node, from the caches: only for the pod with the
    /// runtime's `uid` (a recreated pod, a StatefulSet's, has the old one's name, and the
    /// cache may not have seen it replaced yet).
    pub fn decide_cached(&self, uid: &str, namespace: &str, name: &str) -> Option<Decision> {
        let pod = self.pods.get(&ObjectRef::new(name).within(namespace))?;
        is_pod(&pod, uid).then(|| self.decide(&pod))
    }

    /// The decision for a pod, read from the API (a pod the cache has not seen yet: CNI ADD
    /// can come before its watch event). A sandbox for a pod the API no longer has (another
    /// pod of that name has replaced it) is refused.
    pub async fn decide_live(
        &self,
        uid: &str,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Decision> {
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let pod = bounded(&format!("reading pod {namespace}/{name}"), api.get(name)).await?;
        anyhow::ensure!(
            is_pod(&pod, uid),
            "pod {namespace}/{name} is {:?} in the API, not the runtime's {uid}: it was replaced",
            pod.metadata.uid.as_deref().unwrap_or_default()
        );
        Ok(self.decide(&pod))
    }

    fn decide(&self, pod: &Pod) -> Decision {
        let ns =
            pod.metadata.namespace.as_deref().and_then(|n| self.namespaces.get(&ObjectRef::new(n)));
        decide(pod, ns.as_deref(), &self.cfg.excluded_namespaces)
    }

    /// Every pod of this node the cache holds, with its decision.
    pub fn decisions(&self) -> Vec<(Arc<Pod>, Decision)> {
        self.pods
            .state()
            .into_iter()
            .map(|p| {
                let d = self.decide(&p);
                (p, d)
            })
            .collect()
    }

    /// Whether the API server still has the pod `namespace/name` with this uid, asked live: the
    /// cache can lag behind a CNI ADD (the pod's watch event not in yet) or behind the API
    /// server's return after an outage (the watch still waiting out its backoff).
    pub async fn still_has(&self, namespace: &str, name: &str, uid: &str) -> anyhow::Result<bool> {
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let pod = bounded(&format!("reading pod {namespace}/{name}"), api.get_opt(name)).await?;
        Ok(pod.is_some_and(|p| p.metadata.uid.as_deref() == Some(uid)))
    }

    /// Whether the cache holds a pod with this uid.
    pub fn has_pod_uid(&self, uid: &str) -> bool {
        self.pods.state().iter().any(|p| p.metadata.uid.as_deref() == Some(uid))
    }

    /// Sets (`true`) or removes the `ambient.istio.io/redirection: enabled` annotation.
    pub async fn annotate(&self, namespace: &str, name: &str, on: bool) -> anyhow::Result<()> {
        let value =
            if on { serde_json::json!(k8s::REDIRECTION_ENABLED) } else { serde_json::Value::Null };
        let patch = serde_json::json!({"metadata": {"annotations": {k8s::REDIRECTION: value}}});
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
        // Through the status subresource, as istio-cni writes it: the agent's role may patch
        // pods/status and nothing of a pod's spec or labels.
        bounded(
            &format!("annotating pod {namespace}/{name}"),
            api.patch_status(name, &params, &patch),
        )
        .await?;
        Ok(())
    }

    /// Writes a Warning Event on the pod, once per pod and message.
    pub async fn warn_pod(&self, pod: &Pod, reason: &str, message: &str) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let key = (uid.clone(), message.to_owned());
        if let Ok(mut seen) = self.reported.lock() {
            // Bounded by the pods of this node: entries of pods that are gone are dropped
            // (the node's own entry, keyed by its name, is not a pod's and stays).
            let live: HashSet<String> =
                self.pods.state().iter().filter_map(|p| p.metadata.uid.clone()).collect();
            seen.retain(|(u, _)| live.contains(u) || u == &self.node_key());
            if !seen.insert(key) {
                return;
            }
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let involved = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: pod.metadata.name.clone(),
            namespace: Some(namespace.clone()),
            uid: Some(uid),
            ..Default::default()
        };
        self.write_event(&namespace, involved, reason, message).await;
    }

    fn node_key(&self) -> String {
        format!("node/{}", self.cfg.node_name)
    }

    /// Writes a Warning Event on this agent's Node (what `kubectl describe node` shows), once
    /// per message: the node cannot run the datapath, and why.
    pub async fn warn_node(&self, reason: &str, message: &str) {
        if let Ok(mut seen) = self.reported.lock() {
            // One message for the node at a time: a new reason replaces the last.
            let key = (self.node_key(), message.to_owned());
            if seen.contains(&key) {
                return;
            }
            seen.retain(|(u, _)| u != &key.0);
            seen.insert(key);
        }
        let involved = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.cfg.node_name.clone()),
            // Events about cluster-scoped objects live in `default`, as kubelet's do.
            namespace: None,
            ..Default::default()
        };
        self.write_event("default", involved, reason, message).await;
    }

    async fn write_event(
        &self,
        namespace: &str,
        involved: ObjectReference,
        reason: &str,
        message: &str,
    ) {
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        );
        let name = involved.name.clone().unwrap_or_default();
        let event = Event {
            metadata: kube::api::ObjectMeta {
                generate_name: Some(format!("{name}.meshpath.")),
                namespace: Some(namespace.to_owned()),
                ..Default::default()
            },
            involved_object: involved,
            reason: Some(reason.into()),
            message: Some(message.into()),
            type_: Some("Warning".into()),
            source: Some(EventSource {
                component: Some(k8s::AGENT_COMPONENT.into()),
                host: Some(self.cfg.node_name.clone()),
            }),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            ..Default::default()
        };
        let events = Api::<Event>::namespaced(self.client.clone(), namespace);
        if let Err(e) =
            bounded("writing an Event", events.create(&PostParams::default(), &event)).await
        {
            warn!(error = %e, "could not write an Event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gone() -> Result<watcher::Event<Pod>, watcher::Error> {
        Err(watcher::Error::WatchError(Box::new(
            kube::core::Status::failure("too old resource version", "Expired").with_code(410),
        )))
    }

    fn unreachable() -> Result<watcher::Event<Pod>, watcher::Error> {
        Err(watcher::Error::NoResourceVersion)
    }

    #[test]
    fn a_410_is_relisted_at_once_even_in_the_middle_of_failures() {
        let mut r = Retry::default();
        assert_eq!(r.after(&unreachable()), Some(Retry::FIRST));
        assert_eq!(r.after(&gone()), None);
    }

    #[test]
    fn failures_back_off_from_100_ms_to_at_most_2_s_and_a_success_resets() {
        let mut r = Retry::default();
        let waits: Vec<_> = (0..8).filter_map(|_| r.after(&unreachable())).collect();
        assert_eq!(waits[0], Duration::from_millis(100));
        assert_eq!(waits[1], Duration::from_millis(200));
        assert_eq!(*waits.last().expect("waits"), Retry::MAX);
        assert!(waits.iter().all(|w| *w <= Retry::MAX));
        assert_eq!(r.after(&Ok(watcher::Event::<Pod>::InitDone)), None);
        assert_eq!(r.after(&unreachable()), Some(Retry::FIRST));
    }
}
