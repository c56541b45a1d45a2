//! The agent's side of ZDS. It listens; a proxy connects and says hello; the agent then sends
//! its full set of pods (each with its netns fd) and `SnapshotSent`, waiting for each ack. From
//! then on each pod added or deleted is sent as it happens. One proxy at a time: a new
//! connection replaces the old one (a restarted proxy). With no proxy connected, adding a pod
//! fails: the CNI ADD fails and the runtime retries, rather than a pod starting with nobody to
//! serve it.

use std::{os::fd::AsFd as _, path::PathBuf, sync::Arc, time::Duration};

use meshpath_zds::{
    proto::{
        workload_request::Payload, AddWorkload, DelWorkload, SnapshotSent, Version, WorkloadInfo,
        WorkloadRequest, WorkloadResponse, ZdsHello,
    },
    Listener, SeqPacket,
};
use tokio::sync::Mutex;
use tracing::{info, warn};

use super::{Agent, LivePod};

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

/// The proxy connection, if any.
#[derive(Debug)]
pub struct ZdsHub {
    conn: Mutex<Option<SeqPacket>>,
    ack_timeout: Duration,
    /// The cgroup registered for the connected proxy (`--proxy-cgroup-from-zds-peer`): a
    /// restarted proxy's replaces it, so restarts do not fill `PROXY_CGROUPS`.
    peer_cgroup: std::sync::Mutex<Option<u64>>,
}

impl ZdsHub {
    pub fn new(ack_timeout: Duration) -> Self {
        Self { conn: Mutex::new(None), ack_timeout, peer_cgroup: std::sync::Mutex::new(None) }
    }

    /// Whether a proxy is connected (and took its snapshot).
    pub async fn connected(&self) -> bool {
        self.conn.lock().await.is_some()
    }

    async fn exchange(
        &self,
        conn: &SeqPacket,
        req: &WorkloadRequest,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<(), RequestError> {
        conn.send_msg(req, fd).await?;
        let (resp, _) = tokio::time::timeout(self.ack_timeout, conn.recv_msg::<WorkloadResponse>())
            .await
            .map_err(|_| RequestError::NoAck(self.ack_timeout))??;
        match resp.payload {
            Some(meshpath_zds::proto::workload_response::Payload::Ack(a)) if a.error.is_empty() => {
                Ok(())
            }
            Some(meshpath_zds::proto::workload_response::Payload::Ack(a)) => {
                Err(RequestError::Refused(a.error))
            }
            None => Err(RequestError::NotAnAck),
        }
    }

    /// Sends one request to the connected proxy and waits for its ack. A connection that failed
    /// in any way but a refusal is dropped (the proxy will reconnect and get a snapshot).
    async fn request(
        &self,
        req: WorkloadRequest,
        pod: Option<&LivePod>,
    ) -> Result<(), RequestError> {
        let mut guard = self.conn.lock().await;
        let Some(conn) = guard.as_ref() else {
            return Err(RequestError::NotConnected);
        };
        let fd = pod.map(|p| p.netns.file().as_fd());
        let result = self.exchange(conn, &req, fd).await;
        if let Err(e) = &result {
            if e.ends_session() {
                warn!(error = %e, "ZDS connection broken; waiting for the proxy to reconnect");
                *guard = None;
            }
        }
        result
    }

    /// Tells the proxy to serve a pod.
    pub async fn add(&self, pod: &LivePod) -> Result<(), RequestError> {
        self.request(add_request(&pod.record), Some(pod)).await
    }

    /// Tells the proxy to stop serving a pod.
    pub async fn del(&self, uid: &str) -> Result<(), RequestError> {
        let req = WorkloadRequest { payload: Some(Payload::Del(DelWorkload { uid: uid.into() })) };
        self.request(req, None).await
    }
}

fn add_request(r: &super::records::PodRecord) -> WorkloadRequest {
    WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: r.uid.clone(),
            workload_info: Some(WorkloadInfo {
                name: r.name.clone(),
                namespace: r.namespace.clone(),
                service_account: r.service_account.clone(),
            }),
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
    *guard = None;
    let snapshot: Vec<(super::records::PodRecord, Arc<crate::netns::Netns>)> = agent
        .pods
        .lock()
        .map_err(|_| anyhow::anyhow!("pods lock"))?
        .values()
        .map(|p| (p.record.clone(), p.netns.clone()))
        .collect();
    let acked = send_snapshot(hub, &conn, &snapshot).await;
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
    info!(pods = snapshot.len(), "snapshot sent to the node proxy");
    *guard = Some(conn);
    Ok(())
}

/// Each pod with its netns, then `SnapshotSent`. A pod the proxy refuses stays captured and
/// fails closed while the others go on; any other failure ends the session, since a late ack
/// would be taken for the next request's (the proxy reconnects and gets a new snapshot).
async fn send_snapshot(
    hub: &ZdsHub,
    conn: &SeqPacket,
    snapshot: &[(super::records::PodRecord, Arc<crate::netns::Netns>)],
) -> Result<(), RequestError> {
    for (record, netns) in snapshot {
        match hub.exchange(conn, &add_request(record), Some(netns.file().as_fd())).await {
            Ok(()) => {}
            Err(e @ RequestError::Refused(_)) => {
                warn!(pod = %record.uid, error = %e, "the proxy did not take a pod of the snapshot");
            }
            Err(e) => return Err(e),
        }
    }
    let sent = WorkloadRequest { payload: Some(Payload::SnapshotSent(SnapshotSent {})) };
    hub.exchange(conn, &sent, None).await
}
