//! The proxy side of ZDS: connect to the node agent (reconnecting with backoff), say hello,
//! then serve its requests — add a pod (its netns arrives as a file descriptor), keep one,
//! delete one, and after the snapshot drop the pods the agent no longer has — acking each.
//! The proxy reports ready once the first snapshot is in.

use std::{
    collections::HashSet,
    fs::File,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use meshpath_podnet::netns::Netns;
use meshpath_zds::{
    proto::{
        workload_request::Payload, Version, WorkloadInfo, WorkloadRequest, WorkloadResponse,
        ZdsHello,
    },
    SeqPacket, ZdsError,
};
use tracing::{info, warn};

use crate::{
    config::{Protocol, Workload},
    state::Proxy,
};

/// Longest wait between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Talks to the agent at `path` until the proxy shuts down.
pub fn spawn(proxy: Arc<Proxy>, path: PathBuf) {
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(50);
        loop {
            match SeqPacket::connect(&path) {
                Ok(conn) => {
                    backoff = Duration::from_millis(50);
                    info!(socket = %path.display(), "connected to the node agent");
                    match session(&proxy, &conn).await {
                        Err(ZdsError::Closed) => warn!("the node agent closed ZDS; reconnecting"),
                        Err(e) => warn!(error = %e, "ZDS session ended; reconnecting"),
                        Ok(()) => {}
                    }
                }
                Err(e) => warn!(socket = %path.display(), error = %e, "node agent not reachable"),
            }
            tokio::select! {
                () = proxy.drain.stopping() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    });
}

async fn session(proxy: &Arc<Proxy>, conn: &SeqPacket) -> Result<(), ZdsError> {
    conn.send_msg(&ZdsHello { version: Version::V1 as i32 }, None).await?;
    // Pods named since this connection began: what the snapshot keeps.
    let mut named: HashSet<String> = HashSet::new();
    loop {
        let (req, fds) = conn.recv_msg::<WorkloadRequest>().await?;
        // Adding a pod does blocking work (a certificate, a thread entering its netns, `ip`,
        // the datapath's lock): off the runtime's worker threads.
        let (p, mut owned) = (proxy.clone(), std::mem::take(&mut named));
        let (result, back) = tokio::task::spawn_blocking(move || {
            let r = handle(&p, req, fds, &mut owned);
            (r, owned)
        })
        .await
        .map_err(|e| ZdsError::Protocol(format!("request handler: {e}")))?;
        named = back;
        if let Err(e) = &result {
            warn!(error = %e, "ZDS request refused");
        }
        conn.send_msg(&WorkloadResponse::ack(result), None).await?;
    }
}

fn handle(
    proxy: &Arc<Proxy>,
    req: WorkloadRequest,
    mut fds: Vec<std::os::fd::OwnedFd>,
    named: &mut HashSet<String>,
) -> Result<(), String> {
    match req.payload {
        Some(Payload::Add(add)) => {
            if fds.len() != 1 {
                return Err(format!(
                    "AddWorkload {} came with {} descriptors, not 1",
                    add.uid,
                    fds.len()
                ));
            }
            let file = File::from(fds.remove(0));
            let label = format!("zds:{}", add.uid);
            let netns = Netns::from_file(file, Path::new(&label)).map_err(|e| e.to_string())?;
            named.insert(add.uid.clone());
            if let Some(pod) = proxy.pod(&add.uid) {
                if pod.netns.inode() == netns.inode() {
                    // Re-sent in a snapshot: already served, connections untouched.
                    return Ok(());
                }
            }
            let workload = workload_for(proxy, &add.uid, add.workload_info.as_ref())?;
            super::add(proxy, &add.uid, netns, workload).map(drop).map_err(|e| format!("{e:#}"))
        }
        Some(Payload::Keep(keep)) => {
            if proxy.pod(&keep.uid).is_none() {
                return Err(format!("KeepWorkload {}: not served here", keep.uid));
            }
            named.insert(keep.uid);
            Ok(())
        }
        Some(Payload::Del(del)) => {
            named.remove(&del.uid);
            super::remove(proxy, &del.uid);
            Ok(())
        }
        Some(Payload::SnapshotSent(_)) => {
            for pod in proxy.pods() {
                if !named.contains(&pod.uid) {
                    info!(pod = %pod.uid, "not in the agent's snapshot: removing");
                    super::remove(proxy, &pod.uid);
                }
            }
            proxy.set_ready(true);
            info!(pods = named.len(), "snapshot from the node agent applied");
            Ok(())
        }
        None => Err("empty WorkloadRequest".into()),
    }
}

/// The pod's workload: the store's entry for its uid, else one made from what the agent said
/// (a meshed pod whose addresses the store does not know).
fn workload_for(proxy: &Proxy, uid: &str, info: Option<&WorkloadInfo>) -> Result<Workload, String> {
    if let Some(w) = proxy.store().by_uid(uid) {
        return Ok(w.clone());
    }
    let info =
        info.ok_or_else(|| format!("AddWorkload {uid}: no workload info and not in the store"))?;
    if info.namespace.is_empty() || info.service_account.is_empty() {
        return Err(format!(
            "AddWorkload {uid}: workload info lacks a namespace or service account"
        ));
    }
    Ok(Workload {
        uid: uid.to_owned(),
        name: info.name.clone(),
        namespace: info.namespace.clone(),
        service_account: info.service_account.clone(),
        trust_domain: "cluster.local".into(),
        workload_ips: Vec::new(),
        protocol: Protocol::Hbone,
        status: Default::default(),
        services: Default::default(),
        authorization_policies: Vec::new(),
        canonical_name: String::new(),
        // ZDS names the pod, not its owner: telemetry labels by the pod's name until the store
        // says which workload it belongs to.
        workload_name: String::new(),
    })
}
