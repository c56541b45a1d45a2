//! The agent's side of ZDS. It listens; a proxy connects and says hello; the agent then sends
//! its full set of pods (each with its netns fd) and `SnapshotSent`, waiting for each ack. From
//! then on each pod added or deleted is sent as it happens. One proxy at a time: a new
//! connection replaces the old one (a restarted proxy). With no proxy connected, adding a pod
//! fails: the CNI ADD fails and the runtime retries, rather than a pod starting with nobody to
//! serve it. A proxy that offers it gives the agent its pods' listeners to hold across its
//! restarts (`held_listeners`), and on SIGTERM its open plain connections, on a second
//! connection of its own, for the next proxy (`held_connections`); a proxy that does not
//! (Istio's ztunnel) gets plain ZDS.

use std::{
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use meshpath_zds::{
    proto::{
        workload_request::Payload, AddWorkload, DelWorkload, HeldConnection, SnapshotSent, Version,
        WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
    },
    Listener, SeqPacket,
};
use tokio::sync::Mutex;
use tracing::{info, warn};

use super::{held_connections::HeldConnections, held_listeners::HeldListeners, Agent, LivePod};

/// How often the agent looks whether the proxy closed its end, and for held listeners past
/// their hold.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Why a request to the proxy failed.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("no node proxy is connected")]
    NotConnected,
    /// The proxy answered and said no: the session is sound, the pod is not served.
    #[error("the proxy refused: {0}")]
    Refused(String),
    /// No answer in time. Acks carry no id, so a late one would be read as the next request's:
    /// the session cannot go on.
    #[error("the proxy did not ack within {0:?}")]
    NoAck(Duration),
    #[error(transparent)]
    Transport(#[from] meshpath_zds::ZdsError),
    #[error("the proxy answered without an ack")]
    NotAnAck,
}

impl RequestError {
    /// Whether the connection must be given up (anything but a refusal), as istio-cni does.
    fn ends_session(&self) -> bool {
        !matches!(self, Self::Refused(_) | Self::NotConnected)
    }
}

/// The connected proxy.
#[derive(Debug)]
struct Session {
    conn: SeqPacket,
    /// It takes and gives back the pods' listeners (its hello said so, and the agent holds them).
    holds: bool,
    /// It takes the connections a previous proxy handed over, and may hand its own over.
    takes_connections: bool,
    /// It resumes paused HBONE streams too, and may pause its own (`HeldConnection::stream`).
    takes_streams: bool,
    /// It takes node-local connections too, and may hand its own over
    /// (`HeldConnection::peer_uid`).
    takes_node_local: bool,
}

/// The proxy connection, if any.
#[derive(Debug)]
pub struct ZdsHub {
    conn: Mutex<Option<Session>>,
    ack_timeout: Duration,
    /// The pods' listeners, kept open while no proxy runs.
    pub held: HeldListeners,
    /// The open connections a draining proxy handed over, for the next one.
    pub connections: HeldConnections,
    /// The cgroup registered for the connected proxy (`--proxy-cgroup-from-zds-peer`): a
    /// restarted proxy's replaces it, so restarts do not fill `PROXY_CGROUPS`.
    peer_cgroup: std::sync::Mutex<Option<u64>>,
}

impl ZdsHub {
    pub fn new(
        ack_timeout: Duration,
        hold_listeners: Duration,
        hold_connections: Duration,
    ) -> Self {
        Self {
            conn: Mutex::new(None),
            ack_timeout,
            held: HeldListeners::new(hold_listeners),
            connections: HeldConnections::new(hold_connections),
            peer_cgroup: std::sync::Mutex::new(None),
        }
    }

    /// Whether a proxy is connected (and took its snapshot).
    pub async fn connected(&self) -> bool {
        self.conn.lock().await.is_some()
    }

    /// Sends `req` with `fds` and waits for the ack; returns the descriptors the ack carried.
    async fn exchange(
        &self,
        conn: &SeqPacket,
        req: &WorkloadRequest,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Vec<OwnedFd>, RequestError> {
        conn.send_msg(req, fds).await?;
        let (resp, fds) =
            tokio::time::timeout(self.ack_timeout, conn.recv_msg::<WorkloadResponse>())
                .await
                .map_err(|_| RequestError::NoAck(self.ack_timeout))??;
        match resp.payload {
            Some(meshpath_zds::proto::workload_response::Payload::Ack(a)) if a.error.is_empty() => {
                Ok(fds)
            }
            Some(meshpath_zds::proto::workload_response::Payload::Ack(a)) => {
                Err(RequestError::Refused(a.error))
            }
            None => Err(RequestError::NotAnAck),
        }
    }

    /// The session ended: no proxy from now on, and the held listeners wait for the next.
    fn end(&self, guard: &mut Option<Session>) {
        if guard.take().is_some_and(|s| s.holds) {
            self.held.proxy_gone();
        }
    }

    /// Sends one request to the connected proxy and waits for its ack. A connection that failed
    /// in any way but a refusal is dropped (the proxy will reconnect and get a snapshot).
    async fn request(&self, req: WorkloadRequest) -> Result<(), RequestError> {
        let mut guard = self.conn.lock().await;
        let Some(session) = guard.as_ref() else {
            return Err(RequestError::NotConnected);
        };
        let result = self.exchange(&session.conn, &req, &[]).await.map(drop);
        if let Err(e) = &result {
            if e.ends_session() {
                warn!(error = %e, "ZDS connection broken; waiting for the proxy to reconnect");
                self.end(&mut guard);
            }
        }
        result
    }

    /// Tells the proxy to serve a pod (with the listeners held for it, if it takes them).
    pub async fn add(&self, pod: &LivePod) -> Result<(), RequestError> {
        let mut guard = self.conn.lock().await;
        let Some(session) = guard.as_ref() else {
            return Err(RequestError::NotConnected);
        };
        let result = self.add_on(session, &pod.record, &pod.netns).await;
        if let Err(e) = &result {
            if e.ends_session() {
                warn!(error = %e, "ZDS connection broken; waiting for the proxy to reconnect");
                self.end(&mut guard);
            }
        }
        result
    }

    /// One `AddWorkload` on `session`: the netns, then (to a proxy that holds) the pod's held
    /// listeners; the listeners its ack carries are held from then on.
    async fn add_on(
        &self,
        session: &Session,
        record: &super::records::PodRecord,
        netns: &crate::netns::Netns,
    ) -> Result<(), RequestError> {
        let held = if session.holds { self.held.for_add(&record.uid) } else { Vec::new() };
        let mut fds: Vec<BorrowedFd<'_>> = vec![netns.file().as_fd()];
        fds.extend(held.iter().map(|f| f.as_fd()));
        let req = add_request(record, session);
        match self.exchange(&session.conn, &req, &fds).await {
            Ok(given) => {
                if session.holds {
                    self.held.taken(&record.uid, record.cookie, given);
                }
                if session.takes_connections {
                    self.give_connections(session, &record.uid).await?;
                }
                Ok(())
            }
            Err(e) => {
                self.held.not_served(&record.uid);
                Err(e)
            }
        }
    }

    /// The connections held for `uid`, to the proxy that now serves it, one `TakeConnection`
    /// each. One it refuses closes; if the session breaks, the rest wait for the next proxy.
    async fn give_connections(&self, session: &Session, uid: &str) -> Result<(), RequestError> {
        let mut held = self.connections.take(uid).into_iter();
        let mut given = 0usize;
        while let Some(h) = held.next() {
            let req = WorkloadRequest { payload: Some(Payload::TakeConnection(h.what.clone())) };
            let fds: Vec<BorrowedFd<'_>> = h.fds.iter().map(|f| f.as_fd()).collect();
            match self.exchange(&session.conn, &req, &fds).await {
                Ok(_) => given += 1,
                Err(RequestError::Refused(why)) => {
                    warn!(pod = %uid, src = %h.what.src, dst = %h.what.dst, why, "the proxy did not take a handed-over connection: closed");
                }
                Err(e) => {
                    let mut rest = vec![h];
                    rest.extend(held);
                    self.connections.put_back(uid, rest);
                    return Err(e);
                }
            }
        }
        if given > 0 {
            info!(pod = %uid, connections = given, "handed-over connections given to the proxy");
        }
        Ok(())
    }

    /// Tells the proxy to stop serving a pod; the listeners and connections held for it are
    /// closed.
    pub async fn del(&self, uid: &str) -> Result<(), RequestError> {
        self.held.forget(uid);
        self.connections.forget(uid);
        let req = WorkloadRequest { payload: Some(Payload::Del(DelWorkload { uid: uid.into() })) };
        self.request(req).await
    }

    /// Every [`WATCH_EVERY`]: a proxy that closed its end is gone (its pods' held listeners
    /// start waiting for the next one, not for the next request to find out), and listeners
    /// held past their hold are closed.
    async fn watch(&self) {
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            // Busy (a request or a snapshot under way): that exchange finds out itself.
            if let Ok(mut guard) = self.conn.try_lock() {
                if guard.as_ref().is_some_and(|s| s.conn.peer_closed()) {
                    warn!("the node proxy closed ZDS; waiting for it to reconnect");
                    self.end(&mut guard);
                }
            }
            self.held.expire(std::time::Instant::now());
            self.connections.expire(std::time::Instant::now());
        }
    }
}

fn add_request(r: &super::records::PodRecord, session: &Session) -> WorkloadRequest {
    WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: r.uid.clone(),
            workload_info: Some(WorkloadInfo {
                name: r.name.clone(),
                namespace: r.namespace.clone(),
                service_account: r.service_account.clone(),
            }),
            hold_listeners: session.holds,
            hold_connections: session.takes_connections,
            hold_streams: session.takes_streams,
            hold_node_local: session.takes_node_local,
        })),
    }
}

/// The cgroup v2 directory of process `pid`.
fn cgroup_of(pid: i32) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| anyhow::anyhow!("process {pid} has no cgroup v2 membership"))?;
    Ok(crate::datapath::cgroup2_root()?.join(rel.trim_start_matches('/')))
}

/// Accepts proxies until the agent stops.
pub fn spawn(agent: Arc<Agent>, listener: Listener) {
    let watched = agent.clone();
    tokio::spawn(async move { watched.zds.watch().await });
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok(conn) => {
                    if let Err(e) = welcome(&agent, conn).await {
                        warn!(error = %format!("{e:#}"), "a node proxy connected but its session failed");
                    }
                }
                Err(e) => {
                    warn!(error = %e, "ZDS accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// Hello, the proxy's cgroup (if so configured), then the snapshot; then the connection is the
/// one requests go to.
async fn welcome(agent: &Arc<Agent>, conn: SeqPacket) -> anyhow::Result<()> {
    let hub = &agent.zds;
    let (hello, _) = tokio::time::timeout(hub.ack_timeout, conn.recv_msg::<ZdsHello>()).await??;
    if hello.version != Version::V1 as i32 {
        anyhow::bail!("the proxy speaks ZDS version {}, not V1", hello.version);
    }
    if hello.meshpath_hand_over {
        // Not a session: a draining proxy handing its connections over. Served on a task of
        // its own, so the next proxy is accepted meanwhile.
        let agent = agent.clone();
        tokio::spawn(async move { receive_hand_over(&agent, conn).await });
        return Ok(());
    }
    let holds = hello.meshpath_held_listeners && hub.held.enabled();
    let takes_connections = hello.meshpath_takes_connections && hub.connections.enabled();
    let takes_streams = takes_connections && hello.meshpath_takes_streams;
    let takes_node_local = takes_connections && hello.meshpath_takes_node_local;
    // The new proxy's cgroup is registered now; the previous proxy's stays registered until the
    // new one has acknowledged the snapshot: during a proxy upgrade the old one keeps serving,
    // and its own connections must not be captured meanwhile.
    let mut registered = None;
    if agent.cfg.proxy_cgroup_from_zds_peer {
        let pid = conn.peer_pid()?;
        let cg = cgroup_of(pid)?;
        registered = Some(agent.with_datapath(|dp| Ok(dp.register_proxy_cgroup(&cg)?))?);
        info!(pid, cgroup = %cg.display(), "registered the connected proxy's cgroup");
    }
    // Holding the connection lock for the whole snapshot: no add or delete interleaves.
    let mut guard = hub.conn.lock().await;
    hub.end(&mut guard);
    if !holds {
        // It binds its own listeners in each pod, which the held ones would keep it from.
        hub.held.release_all("the proxy that connected does not take held listeners");
    }
    if !takes_connections {
        hub.connections
            .release_all("the proxy that connected does not take handed-over connections");
    } else if !takes_streams {
        hub.connections.release_streams("the proxy that connected does not resume HBONE streams");
    }
    if takes_connections && !takes_node_local {
        hub.connections.release_node_local("the proxy that connected takes no node-local ones");
    }
    let session = Session { conn, holds, takes_connections, takes_streams, takes_node_local };
    let snapshot: Vec<(super::records::PodRecord, Arc<crate::netns::Netns>)> = agent
        .pods
        .lock()
        .map_err(|_| anyhow::anyhow!("pods lock"))?
        .values()
        .map(|p| (p.record.clone(), p.netns.clone()))
        .collect();
    let acked = send_snapshot(hub, &session, &snapshot).await;
    if let Some(id) = registered {
        // Acknowledged: the new proxy is the proxy; the previous one's cgroup goes. Not
        // acknowledged: the new one's goes, unless it is the current proxy's (it registers
        // again when it reconnects).
        let stale = if acked.is_ok() {
            hub.peer_cgroup.lock().ok().and_then(|mut p| p.replace(id)).filter(|old| *old != id)
        } else {
            Some(id).filter(|id| hub.peer_cgroup.lock().ok().and_then(|p| *p) != Some(*id))
        };
        if let Some(old) = stale {
            agent.with_datapath(|dp| {
                if let Err(e) = dp.unregister_proxy_cgroup_id(old) {
                    warn!(cgroup_id = old, error = %e, "proxy cgroup not unregistered");
                }
                Ok(())
            })?;
        }
    }
    acked?;
    info!(pods = snapshot.len(), holds_listeners = holds, "snapshot sent to the node proxy");
    *guard = Some(session);
    Ok(())
}

/// A draining proxy's connections, each checked, held and acked, until it closes.
async fn receive_hand_over(agent: &Agent, conn: SeqPacket) {
    let hub = &agent.zds;
    let mut held = 0usize;
    loop {
        let (what, fds) = match conn.recv_msg::<HeldConnection>().await {
            Ok(m) => m,
            Err(meshpath_zds::ZdsError::Closed) => break,
            Err(e) => {
                warn!(error = %e, "hand-over connection failed");
                break;
            }
        };
        let cookie_of = |uid: &str| {
            agent.pods.lock().ok().and_then(|pods| {
                pods.values().find(|p| p.record.uid == uid).map(|p| p.record.cookie)
            })
        };
        let peer = (!what.peer_uid.is_empty()).then(|| cookie_of(&what.peer_uid)).flatten();
        let (src, dst) = (what.src.clone(), what.dst.clone());
        let result = match cookie_of(&what.uid) {
            None => Err(format!("pod {} is not one this agent serves", what.uid)),
            Some(cookie) => {
                hub.connections.hold(what, fds, cookie, peer, std::time::Instant::now())
            }
        };
        match &result {
            Ok(()) => held += 1,
            Err(why) => warn!(
                src,
                dst, why, "a handed-over connection was not taken: the proxy carries it on"
            ),
        }
        if let Err(e) = conn.send_msg(&WorkloadResponse::ack(result), &[]).await {
            warn!(error = %e, "hand-over connection failed");
            break;
        }
    }
    info!(connections = held, "a draining proxy handed its connections over");
}

/// Each pod with its netns, then `SnapshotSent`. A pod the proxy refuses stays captured and
/// fails closed while the others go on; any other failure ends the session, since a late ack
/// would be taken for the next request's (the proxy reconnects and gets a new snapshot).
async fn send_snapshot(
    hub: &ZdsHub,
    session: &Session,
    snapshot: &[(super::records::PodRecord, Arc<crate::netns::Netns>)],
) -> Result<(), RequestError> {
    for (record, netns) in snapshot {
        match hub.add_on(session, record, netns).await {
            Ok(()) => {}
            Err(e @ RequestError::Refused(_)) => {
                warn!(pod = %record.uid, error = %e, "the proxy did not take a pod of the snapshot");
            }
            Err(e) => return Err(e),
        }
    }
    let sent = WorkloadRequest { payload: Some(Payload::SnapshotSent(SnapshotSent {})) };
    hub.exchange(&session.conn, &sent, &[]).await.map(drop)
}
