//! The proxy side of ZDS: connect to the node agent (reconnecting with backoff), say hello,
//! then serve its requests — add a pod (its netns arrives as a file descriptor), keep one,
//! delete one, and after the snapshot drop the pods the agent no longer has — acking each.
//! The proxy reports ready once the first snapshot is in. It offers the agent its pods'
//! listeners to hold across its restarts (`meshpath_zds::listeners`): an agent that takes the
//! offer sends them back with each pod, and gets a duplicate of each with the ack.

use std::{
    collections::HashSet,
    fs::File,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use meshpath_podnet::netns::Netns;
use meshpath_zds::{
    listeners::MAX_PER_POD,
    proto::{
        workload_request::Payload, Version, WorkloadInfo, WorkloadRequest, WorkloadResponse,
        ZdsHello,
    },
    SeqPacket, ZdsError,
};
use tracing::{info, warn};

use crate::{
    proxy::{held_listeners::PodListeners, Proxy},
    state::workloads::{Protocol, Workload},
};

/// Longest wait between two connection attempts. Short: an agent restart takes seconds, and
/// until this proxy is back in a session with the new agent no agent holds its listeners
/// (`handover::AGENT_WAIT`); a connect to a unix socket with no listener costs nothing.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Talks to the agent at `path` until the proxy shuts down.
pub fn spawn(proxy: Arc<Proxy>, path: PathBuf) {
    proxy.handover.set_agent(path.clone());
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(50);
        loop {
            match SeqPacket::connect(&path) {
                Ok(conn) => {
                    backoff = Duration::from_millis(50);
                    info!(socket = %path.display(), "connected to the node agent");
                    let ended = session(&proxy, &conn).await;
                    proxy.handover.agent_synced(false);
                    match ended {
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
    let hello = ZdsHello {
        version: Version::V1 as i32,
        meshpath_held_listeners: true,
        meshpath_takes_connections: true,
        meshpath_takes_streams: true,
        meshpath_takes_node_local: true,
        ..Default::default()
    };
    conn.send_msg(&hello, &[]).await?;
    let mut session = Session::default();
    loop {
        let (req, fds) = conn.recv_msg::<WorkloadRequest>().await?;
        // Only KeepWorkload and SnapshotSent look at what is served: an Add or a Del does not
        // copy the uid of every pod on the node.
        let served: HashSet<String> = match &req.payload {
            Some(Payload::Keep(_) | Payload::SnapshotSent(_)) => {
                proxy.pods().iter().map(|p| p.uid.clone()).collect()
            }
            _ => HashSet::new(),
        };
        let result: Result<Vec<OwnedFd>, String> = match session.step(req, fds.len(), &served) {
            Err(e) => Err(e),
            // Adding a pod does blocking work (a certificate, entering its netns, netlink
            // reads there): off the runtime's worker threads.
            Ok(step) => {
                let p = proxy.clone();
                tokio::task::spawn_blocking(move || apply(&p, step, fds))
                    .await
                    .map_err(|e| ZdsError::Protocol(format!("request handler: {e}")))?
            }
        };
        if let Err(e) = &result {
            warn!(error = %e, "ZDS request refused");
        }
        let given = result.as_ref().map(Vec::as_slice).unwrap_or_default();
        let given: Vec<BorrowedFd<'_>> = given.iter().map(AsFd::as_fd).collect();
        conn.send_msg(
            &WorkloadResponse::ack(result.as_ref().map(drop).map_err(Clone::clone)),
            &given,
        )
        .await?;
    }
}

/// What one request asks of the proxy.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Serve the pod whose netns is the request's first descriptor (or keep serving it, if it
    /// is the netns already served), with the listeners held for it that follow it.
    Add {
        uid: String,
        info: Option<WorkloadInfo>,
        /// The agent holds the pod's listeners: they came after the netns, and the ack carries
        /// a duplicate of each.
        hold_listeners: bool,
        /// The agent takes the pod's plain connections at shutdown (`proxy::handover`).
        hold_connections: bool,
        /// And its paused HBONE streams (`proxy::resume`).
        hold_streams: bool,
        /// And its node-local connections (`proxy::node_local`).
        hold_node_local: bool,
    },
    /// Carry on a connection a previous proxy handed over (its two sockets are the request's
    /// descriptors), for a pod named earlier in the session.
    Take(meshpath_zds::proto::HeldConnection),
    /// Nothing to do: the pod is served and stays.
    Keep,
    Remove(String),
    /// The snapshot is complete: stop serving these (served, but not named since the session
    /// began), then report ready.
    Sweep(Vec<String>),
}

/// One ZDS session's bookkeeping, apart from its effects (so it can be fuzzed:
/// fuzz/fuzz_targets/zds_session.rs): the pods named since the connection began are what a
/// snapshot keeps.
#[derive(Debug, Default)]
pub struct Session {
    named: HashSet<String>,
}

impl Session {
    /// Decides what `req` (which came with `fds` descriptors) asks, given the pods `served`.
    pub fn step(
        &mut self,
        req: WorkloadRequest,
        fds: usize,
        served: &HashSet<String>,
    ) -> Result<Step, String> {
        match req.payload {
            Some(Payload::Add(add)) => {
                // The netns, and the listeners held for the pod only where the agent holds them.
                let most = if add.hold_listeners { 1 + MAX_PER_POD } else { 1 };
                if fds == 0 || fds > most {
                    return Err(format!(
                        "AddWorkload {} came with {fds} descriptors, not 1{}",
                        add.uid,
                        if add.hold_listeners { " to 9" } else { "" }
                    ));
                }
                if add.uid.is_empty() {
                    return Err("AddWorkload without a uid".into());
                }
                self.named.insert(add.uid.clone());
                Ok(Step::Add {
                    uid: add.uid,
                    info: add.workload_info,
                    hold_listeners: add.hold_listeners,
                    hold_connections: add.hold_connections,
                    hold_streams: add.hold_streams,
                    hold_node_local: add.hold_node_local,
                })
            }
            Some(Payload::TakeConnection(held)) => {
                let want = meshpath_zds::connections::fds_of(&held);
                if fds != want {
                    return Err(format!(
                        "TakeConnection for {} came with {fds} descriptors, not {want}",
                        held.uid
                    ));
                }
                if !self.named.contains(&held.uid) {
                    return Err(format!(
                        "TakeConnection for {}: not added in this session",
                        held.uid
                    ));
                }
                Ok(Step::Take(held))
            }
            Some(Payload::Keep(keep)) => {
                if !served.contains(&keep.uid) {
                    return Err(format!("KeepWorkload {}: not served here", keep.uid));
                }
                self.named.insert(keep.uid);
                Ok(Step::Keep)
            }
            Some(Payload::Del(del)) => {
                self.named.remove(&del.uid);
                Ok(Step::Remove(del.uid))
            }
            Some(Payload::SnapshotSent(_)) => {
                let mut gone: Vec<String> =
                    served.iter().filter(|uid| !self.named.contains(*uid)).cloned().collect();
                gone.sort();
                Ok(Step::Sweep(gone))
            }
            None => Err("empty WorkloadRequest".into()),
        }
    }

    /// The pods named since the session began.
    pub fn named(&self) -> &HashSet<String> {
        &self.named
    }
}

/// Carries out a step on the proxy (blocking work). Returns the descriptors for the ack: the
/// pod's listeners, for an agent that holds them.
fn apply(proxy: &Arc<Proxy>, step: Step, fds: Vec<OwnedFd>) -> Result<Vec<OwnedFd>, String> {
    match step {
        Step::Add {
            uid,
            info,
            hold_listeners,
            hold_connections,
            hold_streams,
            hold_node_local,
        } => {
            proxy.handover.offered(hold_connections, hold_streams, hold_node_local);
            let mut fds = fds.into_iter();
            let file = File::from(fds.next().ok_or("AddWorkload without its netns")?);
            let label = format!("zds:{uid}");
            let netns = Netns::from_file(file, Path::new(&label)).map_err(|e| e.to_string())?;
            if let Some(pod) = proxy.pod(&uid) {
                if pod.netns.inode() == netns.inode() {
                    // Re-sent in a snapshot (an agent that restarted): already served,
                    // connections untouched; what the agent sent is the same sockets.
                    let given = if hold_listeners { pod.sockets.held.for_agent() } else { vec![] };
                    return Ok(given);
                }
            }
            let held = PodListeners::inherit(fds.collect(), netns.cookie(), &uid, hold_listeners);
            let workload = workload_for(proxy, &uid, info.as_ref())?;
            let pod =
                super::add(proxy, &uid, netns, workload, held).map_err(|e| format!("{e:#}"))?;
            Ok(pod.sockets.held.for_agent())
        }
        Step::Keep => Ok(Vec::new()),
        Step::Take(held) => {
            crate::proxy::handover::take(proxy, held, fds)?;
            Ok(Vec::new())
        }
        Step::Remove(uid) => {
            super::remove(proxy, &uid);
            Ok(Vec::new())
        }
        Step::Sweep(gone) => {
            for uid in &gone {
                info!(pod = %uid, "not in the agent's snapshot: removing");
                super::remove(proxy, uid);
            }
            proxy.set_ready(true);
            proxy.handover.agent_synced(true);
            info!(removed = gone.len(), "snapshot from the node agent applied");
            Ok(Vec::new())
        }
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
        trust_domain: proxy.settings.trust_domain.clone(),
        workload_ips: Vec::new(),
        network_mode: Default::default(),
        protocol: Protocol::Hbone,
        status: Default::default(),
        services: Default::default(),
        authorization_policies: Vec::new(),
        canonical_name: String::new(),
        // ZDS names the pod, not its owner: telemetry labels by the pod's name until the store
        // says which workload it belongs to.
        workload_name: String::new(),
        node: String::new(),
        waypoint: None,
    })
}

#[cfg(test)]
mod tests {
    use meshpath_zds::proto::{AddWorkload, DelWorkload, KeepWorkload, SnapshotSent};

    use super::*;

    fn req(p: Payload) -> WorkloadRequest {
        WorkloadRequest { payload: Some(p) }
    }
    fn add(uid: &str) -> WorkloadRequest {
        req(Payload::Add(AddWorkload { uid: uid.into(), ..Default::default() }))
    }
    fn served(uids: &[&str]) -> HashSet<String> {
        uids.iter().map(|u| u.to_string()).collect()
    }

    #[test]
    fn a_snapshot_removes_what_was_served_but_not_named_since_the_session_began() {
        let mut s = Session::default();
        let now = served(&["kept", "added", "stale", "deleted"]);
        s.step(add("added"), 1, &now).expect("add");
        s.step(req(Payload::Keep(KeepWorkload { uid: "kept".into() })), 0, &now).expect("keep");
        s.step(add("deleted"), 1, &now).expect("add");
        let del = req(Payload::Del(DelWorkload { uid: "deleted".into() }));
        assert_eq!(s.step(del, 0, &now), Ok(Step::Remove("deleted".into())));
        let swept = s.step(req(Payload::SnapshotSent(SnapshotSent {})), 0, &now);
        assert_eq!(swept, Ok(Step::Sweep(vec!["deleted".into(), "stale".into()])));
    }

    #[test]
    fn an_add_needs_exactly_one_descriptor_and_a_uid() {
        let mut s = Session::default();
        for fds in [0, 2] {
            let err = s.step(add("p"), fds, &HashSet::new()).expect_err("accepted");
            assert!(err.contains(&format!("{fds} descriptors")), "{err}");
        }
        assert!(s.step(add(""), 1, &HashSet::new()).is_err());
        assert!(s.named().is_empty(), "a refused add was named");
    }

    #[test]
    fn an_add_that_holds_listeners_takes_the_netns_and_at_most_eight_more() {
        let mut s = Session::default();
        let holding = || {
            req(Payload::Add(AddWorkload {
                uid: "p".into(),
                hold_listeners: true,
                ..Default::default()
            }))
        };
        for fds in [1, 8, 1 + MAX_PER_POD] {
            let step = s.step(holding(), fds, &HashSet::new()).expect("accepted");
            assert!(matches!(step, Step::Add { hold_listeners: true, .. }), "{step:?}");
        }
        for fds in [0, 2 + MAX_PER_POD] {
            assert!(s.step(holding(), fds, &HashSet::new()).is_err(), "{fds} accepted");
        }
    }

    #[test]
    fn keeping_a_pod_not_served_is_refused_and_names_nothing() {
        let mut s = Session::default();
        let keep = req(Payload::Keep(KeepWorkload { uid: "ghost".into() }));
        assert!(s.step(keep, 0, &HashSet::new()).is_err());
        assert!(s.step(WorkloadRequest { payload: None }, 0, &HashSet::new()).is_err());
        assert!(s.named().is_empty());
    }
}
