//! Kubernetes mode: keeps the node's pods in the mesh as the API says, between CNI requests.
//! A pod that becomes meshed while it runs (its namespace or itself labelled later, or a pod
//! that was running before the agent started) is found on the node by its IP addresses (every
//! network namespace under /var/run/netns and of every process) and joins, unless it has
//! finished or is being deleted (its addresses may be another pod's by then);
//! a pod that leaves the mesh (label removed, opt-out label) or is deleted is taken out; the
//! redirection annotation is made to match. Nothing is done while the watches are down: the
//! caches may be stale, and the pods the agent has keep their capture (fail closed).

use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use datapath_common::consts::k8s;
use k8s_openapi::api::core::v1::Pod;
use tracing::{info, warn};

use super::{
    directory::{kube::Kube, Decision},
    membership::{self, Sandbox},
    Agent,
};
use crate::netns::Netns;

/// Runs until the process ends: after every change the watches see, and every few seconds.
pub async fn run(agent: Arc<Agent>, kube: Arc<Kube>) {
    loop {
        tokio::select! {
            () = kube.changed.notified() => {}
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        if !kube.healthy() {
            continue;
        }
        if let Err(e) = reconcile(&agent, &kube).await {
            warn!(error = %format!("{e:#}"), "Kubernetes reconcile failed; trying again");
        }
    }
}

/// One pass: what the caches say against what the agent serves.
pub async fn reconcile(agent: &Arc<Agent>, kube: &Kube) -> anyhow::Result<()> {
    // One membership change at a time, CNI requests included.
    let _one_at_a_time = agent.cni_lock.lock().await;
    let live: BTreeMap<String, (String, String)> = agent
        .pods
        .lock()
        .map_err(|_| anyhow::anyhow!("pods lock"))?
        .iter()
        .map(|(uid, p)| (uid.clone(), (p.record.namespace.clone(), p.record.name.clone())))
        .collect();
    let mut seen = HashSet::new();
    for (pod, decision) in kube.decisions() {
        let Some(uid) = pod.metadata.uid.clone() else { continue };
        seen.insert(uid.clone());
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let annotated = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(k8s::REDIRECTION))
            .is_some_and(|v| v == k8s::REDIRECTION_ENABLED);
        let serving = live.contains_key(&uid);
        match decision {
            Decision::Meshed(m) if !serving => {
                // Found by address only while it runs: a finished pod keeps its addresses in
                // its status, and IPAM may have given them to another pod since.
                if !may_join_by_address(&pod) {
                    continue;
                }
                // Not started yet (no address): its CNI ADD will bring it in.
                let Some((path, netns)) = find_netns(&m.ips) else { continue };
                info!(pod = %format!("{namespace}/{name}"), netns = %path.display(), "running pod joins the mesh");
                let sandbox = Sandbox { netns, netns_path: path, container_id: String::new() };
                if let Err(e) = membership::join(agent, &m, sandbox).await {
                    warn!(pod = %format!("{namespace}/{name}"), error = %format!("{e:#}"), "running pod not added to the mesh");
                }
            }
            Decision::Meshed(_) if !annotated => {
                agent.directory.set_redirected(&namespace, &name, true).await;
            }
            Decision::Meshed(_) => {}
            Decision::Invalid(why) => {
                kube.warn_pod(&pod, "MeshpathInvalidAnnotation", &why).await;
                if serving {
                    warn!(pod = %format!("{namespace}/{name}"), %why, "pod leaves the mesh");
                    membership::leave(agent, &uid).await?;
                }
            }
            Decision::NotMeshed(why) if serving => {
                info!(pod = %format!("{namespace}/{name}"), why, "pod leaves the mesh");
                membership::leave(agent, &uid).await?;
            }
            Decision::NotMeshed(_) if annotated => {
                agent.directory.set_redirected(&namespace, &name, false).await;
            }
            Decision::NotMeshed(_) => {}
        }
    }
    // Served pods the cache does not have: deleted, once the API server says so itself (the
    // cache can lag behind a CNI ADD or behind the API server's return; taking such a pod out
    // would leave it running uncaptured). Unconfirmed, a pod keeps its capture.
    for (uid, (namespace, name)) in live.iter().filter(|(u, _)| !seen.contains(*u)) {
        let pod = format!("{namespace}/{name}");
        match kube.still_has(namespace, name, uid).await {
            Ok(true) => continue,
            Ok(false) => {}
            Err(e) => {
                warn!(%pod, error = %format!("{e:#}"), "not in the cache and the API server did not say whether it exists; it keeps its capture");
                continue;
            }
        }
        info!(%pod, %uid, "pod deleted from the API: leaves the mesh");
        membership::leave(agent, uid).await?;
    }
    Ok(())
}

/// Whether a meshed pod the agent does not serve may be looked for on the node by its
/// addresses: not when it has finished (phase Succeeded or Failed: Kubernetes keeps
/// `status.podIPs` on such pods, and the addresses may belong to a new pod by now, which would
/// then be captured under the finished pod's identity) nor while it is being deleted. A pod the
/// agent serves is not affected: it keeps its capture until its CNI DEL.
fn may_join_by_address(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let finished = matches!(phase, Some("Succeeded" | "Failed"));
    !finished && pod.metadata.deletion_timestamp.is_none()
}

/// The network namespace on this node that holds one of `ips`, and a path to it: a bind mount
/// under /var/run/netns (what runtimes make) or a process's /proc/PID/ns/net. The node's own
/// namespace is never a pod's.
pub fn find_netns(ips: &[IpAddr]) -> Option<(PathBuf, Netns)> {
    if ips.is_empty() {
        return None;
    }
    let own = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).ok();
    let mut tried = HashSet::new();
    let candidates = ["/var/run/netns", "/run/netns"]
        .into_iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten().map(|e| e.path()))
        .chain(
            std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
                .map(|e| e.path().join("ns/net")),
        );
    for path in candidates {
        let Ok(ino) = std::fs::metadata(&path).map(|m| m.ino()) else { continue };
        if Some(ino) == own || !tried.insert(ino) {
            continue;
        }
        let Ok(ns) = Netns::open(Path::new(&path)) else { continue };
        let holds = ns.run(|| addresses().is_ok_and(|a| a.iter().any(|ip| ips.contains(ip))));
        if matches!(holds, Ok(true)) {
            return Some((path, ns));
        }
    }
    None
}

/// The calling thread's netns addresses.
fn addresses() -> std::io::Result<Vec<IpAddr>> {
    Ok(nix::ifaddrs::getifaddrs()
        .map_err(std::io::Error::from)?
        .filter_map(|a| {
            let sa = a.address?;
            if let Some(v4) = sa.as_sockaddr_in() {
                return Some(IpAddr::V4(v4.ip()));
            }
            sa.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        })
        .collect())
}
