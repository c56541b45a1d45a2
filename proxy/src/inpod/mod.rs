//! The pods this proxy serves: their lifecycle. Adding a pod (`add`) makes it (`crate::proxy::pod`:
//! its network namespace, certificate, caps) and opens its listeners inside its netns, as
//! ztunnel does: `[::]:15001` outbound, `[::]:15006` inbound plaintext, `[::]:15008` HBONE,
//! 15053 DNS on loopback. That is all the datapath needs of the proxy: it finds the listeners
//! and the proxy's transparent connections itself (no map, rule or route is written here).
//! Removing a pod (`remove`) closes its listeners and ends its connections; other pods are not
//! touched. Pods come from the command line or, at run time, from the node agent over ZDS
//! (`zds`).

pub mod zds;

use std::sync::Arc;

use meshpath_podnet::netns::Netns;
use tracing::{info, warn};

use crate::{
    proxy::{
        dns, held_listeners::PodListeners, inbound, inbound_plaintext, outbound, pod::Pod, Proxy,
    },
    state::workloads::Workload,
};

/// Starts serving a pod: `workload` is what the store (or the node agent) says about it,
/// `netns` its network namespace, `held` the listeners the agent held for it (served instead of
/// new ones). A pod already served under `uid` is replaced.
pub fn add(
    proxy: &Arc<Proxy>,
    uid: &str,
    netns: Netns,
    workload: Workload,
    held: PodListeners,
) -> anyhow::Result<Arc<Pod>> {
    proxy.metrics.pending_proxies.inc();
    let added = add_pod(proxy, uid, netns, workload, held);
    proxy.metrics.pending_proxies.dec();
    added
}

fn add_pod(
    proxy: &Arc<Proxy>,
    uid: &str,
    netns: Netns,
    workload: Workload,
    held: PodListeners,
) -> anyhow::Result<Arc<Pod>> {
    let pod = Arc::new(Pod::new(proxy, uid, netns, workload, held)?);
    if let Some(old) = proxy.take_pod(uid) {
        old.stop();
    }
    let started = (|| -> anyhow::Result<()> {
        outbound::start(pod.clone())?;
        inbound::start(pod.clone())?;
        dns::start(pod.clone())?;
        inbound_plaintext::start(pod.clone())?;
        Ok(())
    })();
    if let Err(e) = started {
        pod.stop();
        return Err(e.context(format!("opening the listeners of pod {uid}")));
    }
    // The duplicates kept for the agent close with the listeners (SIGTERM's drain too), so
    // that with no agent holding them the pod's listeners close as the proxy stops accepting.
    let stopping = pod.clone();
    tokio::spawn(async move {
        stopping.listening.cancelled().await;
        stopping.sockets.held.release();
    });
    proxy.insert_pod(pod.clone());
    info!(pod = %pod.uid, identity = %pod.identity(), netns = pod.netns.cookie(), "serving pod");
    Ok(pod)
}

/// Stops serving a pod: its listeners close, its connections end. Returns whether it was served.
pub fn remove(proxy: &Proxy, uid: &str) -> bool {
    match proxy.take_pod(uid) {
        Some(pod) => {
            pod.stop();
            info!(pod = %uid, "pod removed");
            true
        }
        None => {
            warn!(pod = %uid, "asked to remove a pod that is not served");
            false
        }
    }
}
