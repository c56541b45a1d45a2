//! Connection hand-over (`meshpath_zds::connections`): on SIGTERM, the plain connections this
//! proxy carries (passthrough to destinations outside the mesh, inbound plaintext from clients
//! outside it) are not drained but handed to the node agent, which outlives the proxy, and by
//! it to the next proxy, which carries them on. Open connections survive a proxy upgrade.
//!
//! Giving: each plain relay also watches [`HandOver::now`]. When it fires, both directions stop
//! at their next read with everything read written out, so every byte not yet carried is in the
//! kernel's buffers of the two sockets; the two descriptors go to the agent with what the
//! connection is (`HeldConnection`), on a connection of their own to the ZDS socket. Acked: this
//! proxy closes its descriptors (the agent's keep the sockets open). Not acked (no agent, a
//! refusal, the agent's caps): the relay carries on and the drain waits for it, as before.
//!
//! Taking: the agent sends each held connection after its pod's `AddWorkload`; the connection
//! is checked (both sockets TCP, connected, of the pod's netns), an inbound one against the
//! pod's policy as it is now, and carried on under the pod's caps, with telemetry of its own:
//! the access log shows such a connection in two parts, one per proxy.
//!
//! Only what the agent offered is handed over (`AddWorkload::hold_connections`): an agent that
//! does not know the extension never sees a hand-over connection. HBONE streams between two
//! meshpath proxies are paused and handed over too, the app's side only (`resume`, where an
//! agent offered `hold_streams`); streams with any other peer end with the drain as before:
//! their TLS and HTTP/2 state lives in this process.

use std::{
    io,
    net::SocketAddr,
    os::fd::{AsFd as _, OwnedFd},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, OnceLock,
    },
    time::{Duration, SystemTime},
};

use meshpath_zds::{
    connections,
    proto::{workload_response, ConnectionDirection, HeldConnection, WorkloadResponse, ZdsHello},
    SeqPacket,
};
use tokio::net::TcpStream;
use tracing::{info, info_span, warn, Instrument as _};

use crate::{
    metrics::{ConnGuard, ConnInfo, Direction, Meter},
    proxy::{
        authorized::Authorized,
        copy,
        pod::Pod,
        stop::{when_woken, Stop},
        Proxy,
    },
    state::authorization,
};

/// How long the agent has to ack one handed-over connection.
const ACK_WITHIN: Duration = Duration::from_secs(5);

/// The proxy's side of hand-over.
#[derive(Debug, Default)]
pub struct HandOver {
    /// Fired when the plain connections are to be handed over.
    now: Stop,
    /// Fired when the resumable HBONE streams are to be paused and handed over (`resume`).
    pub streams: Stop,
    /// The agent offered to hold connections (its last `AddWorkload` said so).
    offered: AtomicBool,
    /// And paused streams.
    offered_streams: AtomicBool,
    /// And node-local connections.
    offered_node_local: AtomicBool,
    /// The agent's ZDS socket.
    agent: OnceLock<PathBuf>,
    /// The connection to the agent the hand-over goes on, made at the first one.
    conn: tokio::sync::Mutex<Option<SeqPacket>>,
    /// The ZDS session's agent has applied its snapshot: it holds what it offered, this
    /// proxy's listeners among them. False until then and once the session ends.
    agent_synced: AtomicBool,
    /// Told when `agent_synced` turns true.
    agent_back: tokio::sync::Notify,
}

/// How long a proxy told to stop while no node agent is in sync with it (one restarting: a
/// release's rollout replaces both) waits for one before it drains, serving meanwhile. Its
/// listeners survive it only in an agent's hands: draining first, it would close them, and
/// until the next proxy listens every captured connection would be refused (a peer's HBONE
/// connect reset). Taken from the drain's deadline, within the kubelet's grace period.
pub const AGENT_WAIT: Duration = Duration::from_secs(15);

impl HandOver {
    /// The agent at `path` is the one to hand over to.
    pub fn set_agent(&self, path: PathBuf) {
        let _ = self.agent.set(path);
    }

    /// The ZDS session's state: `true` once the agent's snapshot is applied, `false` when the
    /// session ends.
    pub fn agent_synced(&self, yes: bool) {
        self.agent_synced.store(yes, Ordering::Relaxed);
        if yes {
            self.agent_back.notify_waiters();
        }
    }

    /// At shutdown: waits up to `limit` for an agent in sync, if there is an agent to wait for
    /// and none is. Returns how long it waited.
    pub async fn wait_for_agent(&self, limit: Duration) -> Duration {
        let start = std::time::Instant::now();
        if self.agent.get().is_none() {
            return Duration::ZERO;
        }
        let back = async {
            loop {
                let notified = self.agent_back.notified();
                if self.agent_synced.load(Ordering::Relaxed) {
                    return;
                }
                notified.await;
            }
        };
        if !self.agent_synced.load(Ordering::Relaxed) {
            info!(limit_s = limit.as_secs(), "no node agent holds this proxy's listeners (one restarting?): waiting for it before draining");
            match tokio::time::timeout(limit, back).await {
                Ok(()) => info!(
                    waited_ms = start.elapsed().as_millis() as u64,
                    "the node agent is back: draining"
                ),
                Err(_) => warn!(
                    limit_s = limit.as_secs(),
                    "no node agent came back: draining without one"
                ),
            }
        }
        start.elapsed()
    }

    /// What the agent's last `AddWorkload` said of holding connections, paused streams and
    /// node-local connections.
    pub fn offered(&self, connections: bool, streams: bool, node_local: bool) {
        self.offered.store(connections, Ordering::Relaxed);
        self.offered_streams.store(connections && streams, Ordering::Relaxed);
        self.offered_node_local.store(connections && node_local, Ordering::Relaxed);
    }

    /// Whether a node-local connection outlives this proxy wherever an HBONE stream between
    /// two of its pods would: the agent holds both, or neither. An agent that holds streams
    /// but not node-local connections (an older one) keeps the node on HBONE.
    pub fn keeps_node_local(&self) -> bool {
        self.offered_node_local.load(Ordering::Relaxed)
            || !self.offered_streams.load(Ordering::Relaxed)
    }

    /// Shutdown: the plain connections are handed over, and the resumable streams paused and
    /// handed over, if the agent offered to hold them. Returns whether the connections are.
    pub fn begin(&self) -> bool {
        let agent = self.agent.get().is_some();
        if agent && self.offered_streams.load(Ordering::Relaxed) {
            self.streams.fire();
        }
        let yes = agent && self.offered.load(Ordering::Relaxed);
        if yes {
            self.now.fire();
        }
        yes
    }

    /// Sends `held` with its sockets to the agent and waits for its ack.
    pub async fn give(
        &self,
        held: &HeldConnection,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(), String> {
        let path = self.agent.get().ok_or("no node agent")?;
        let mut guard = self.conn.lock().await;
        if guard.is_none() {
            let conn = SeqPacket::connect(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let hello = ZdsHello {
                version: meshpath_zds::proto::Version::V1 as i32,
                meshpath_hand_over: true,
                ..Default::default()
            };
            conn.send_msg(&hello, &[]).await.map_err(|e| e.to_string())?;
            *guard = Some(conn);
        }
        let Some(conn) = guard.as_ref() else { return Err("no connection to the agent".into()) };
        let exchange = async {
            conn.send_msg(held, fds).await?;
            conn.recv_msg::<WorkloadResponse>().await
        };
        let answer = match tokio::time::timeout(ACK_WITHIN, exchange).await {
            Ok(Ok((answer, _))) => answer,
            Ok(Err(e)) => {
                *guard = None;
                return Err(e.to_string());
            }
            Err(_) => {
                // A late ack would be read as the next one's: this connection is done.
                *guard = None;
                return Err(format!("no ack from the agent within {ACK_WITHIN:?}"));
            }
        };
        match answer.payload {
            Some(workload_response::Payload::Ack(a)) if a.error.is_empty() => Ok(()),
            Some(workload_response::Payload::Ack(a)) => Err(a.error),
            None => Err("the agent answered without an ack".into()),
        }
    }
}

/// A plain connection, as hand-over describes it.
#[derive(Debug, Clone)]
pub struct Plain {
    pub direction: Direction,
    /// The client's address.
    pub src: SocketAddr,
    /// Where it was going.
    pub dst: SocketAddr,
    /// When the first proxy accepted it.
    pub opened: SystemTime,
    /// A node-local connection's destination pod: the socket the proxy opened is of its netns.
    pub peer: Option<String>,
}

/// How a plain connection left this proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// It ended.
    Closed,
    /// The agent holds it for the next proxy.
    HandedOver,
}

/// Carries `a` (the socket the proxy accepted) and `b` (the one it opened) both ways until
/// both directions end, or hands them over at shutdown (carrying on if that fails).
pub async fn relay(
    pod: &Pod,
    plain: &Plain,
    a: TcpStream,
    b: TcpStream,
    meters: (&Meter, &Meter),
) -> io::Result<Carried> {
    let proxy = &pod.proxy;
    let idle = proxy.settings.idle_timeout;
    let (a, b) = match copy::relay(a, b, meters, idle, &proxy.handover.now).await? {
        copy::Relayed::Done(..) => return Ok(Carried::Closed),
        copy::Relayed::Stopped(a, b) => (a, b),
    };
    let held = HeldConnection {
        uid: pod.uid.clone(),
        direction: match plain.direction {
            Direction::Outbound => ConnectionDirection::Outbound,
            Direction::Inbound => ConnectionDirection::Inbound,
        } as i32,
        src: plain.src.to_string(),
        dst: plain.dst.to_string(),
        sent: meters.0.get(),
        received: meters.1.get(),
        opened_unix_ms: unix_ms(plain.opened),
        stream: None,
        peer_uid: plain.peer.clone().unwrap_or_default(),
    };
    // Boxed, as what follows: a relay's task is sized for its copy loops, not for the
    // hand-over that happens once (tests/tests/idle_connections.rs bounds an idle one).
    match Box::pin(proxy.handover.give(&held, &[a.as_fd(), b.as_fd()])).await {
        Ok(()) => {
            info!(sent = held.sent, received = held.received, "handed over to the node agent");
            Ok(Carried::HandedOver)
        }
        Err(e) => {
            warn!(error = %e, "not handed over: carried on until it ends or the drain's deadline");
            let never = Stop::default();
            match Box::pin(copy::relay(a, b, meters, idle, &never)).await? {
                copy::Relayed::Done(..) => Ok(Carried::Closed),
                copy::Relayed::Stopped(..) => Err(io::Error::other("stopped without a stop")),
            }
        }
    }
}

/// A handed-over socket as the runtime's (it was checked to be a connected TCP socket).
pub fn tcp_of(fd: OwnedFd) -> Result<TcpStream, String> {
    let s = std::net::TcpStream::from(fd);
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    TcpStream::from_std(s).map_err(|e| e.to_string())
}

/// Milliseconds since the Unix epoch, as `HeldConnection` carries times.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or_default()
}

/// Takes a connection a previous proxy handed over: `fds` are its accepted and opened sockets
/// (a paused stream: its app's side, `resume`). Checked here; carried on a task of the pod's.
pub fn take(proxy: &Arc<Proxy>, held: HeldConnection, fds: Vec<OwnedFd>) -> Result<(), String> {
    let pod = proxy.pod(&held.uid).ok_or_else(|| format!("pod {} is not served", held.uid))?;
    if held.stream.is_some() {
        return crate::proxy::resume::take(&pod, held, fds);
    }
    if !held.peer_uid.is_empty() {
        return crate::proxy::node_local::take(pod, held, fds);
    }
    let [a, b]: [OwnedFd; connections::FDS_PER_CONNECTION] =
        fds.try_into().map_err(|v: Vec<OwnedFd>| format!("{} descriptors, not 2", v.len()))?;
    for fd in [&a, &b] {
        connections::identify(fd.as_fd(), pod.netns.cookie()).map_err(|e| e.to_string())?;
    }
    let direction = match ConnectionDirection::try_from(held.direction) {
        Ok(ConnectionDirection::Outbound) => Direction::Outbound,
        Ok(ConnectionDirection::Inbound) => Direction::Inbound,
        _ => return Err(format!("direction {} unknown", held.direction)),
    };
    let addr = |s: &str| s.parse::<SocketAddr>().map_err(|e| format!("address {s:?}: {e}"));
    let plain = Plain {
        direction,
        src: addr(&held.src)?,
        dst: addr(&held.dst)?,
        opened: SystemTime::UNIX_EPOCH + Duration::from_millis(held.opened_unix_ms),
        peer: None,
    };
    let (a, b) = (tcp_of(a)?, tcp_of(b)?);
    let permits = proxy
        .drain
        .admit(&pod.scope(direction, false).limit)
        .ok_or("the pod's or the node's connection cap is reached")?;
    let kill = pod.gone.clone();
    let span = info_span!("resumed", pod = %pod.uid, src = %plain.src, dst = %plain.dst);
    info!(parent: &span, sent = held.sent, received = held.received, "connection taken over from the previous proxy");
    proxy.drain.spawn(
        async move {
            let _permits = permits;
            tokio::select! {
                r = resume(&pod, &plain, a, b) => if let Err(e) = r {
                    warn!(error = %format!("{e:#}"), "resumed connection failed");
                },
                () = when_woken(kill.cancelled()) => {}
            }
        }
        .instrument(span),
    );
    Ok(())
}

/// Carries on a taken connection with telemetry of its own; an inbound one only if the pod's
/// policy allows it now.
async fn resume(pod: &Arc<Pod>, plain: &Plain, a: TcpStream, b: TcpStream) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let store = proxy.store();
    let workload = pod.current_workload(&store).clone();
    let (info, allowed) = match plain.direction {
        Direction::Outbound => (
            ConnInfo {
                direction: Direction::Outbound,
                src_addr: plain.src,
                src_workload: Some(workload),
                src_identity: Some(pod.identity().as_ref().clone()),
                dst_addr: plain.dst,
                hbone_addr: None,
                dst_workload: None,
                dst_identity: None,
                dst_service: None,
                node_local: false,
            },
            None,
        ),
        Direction::Inbound => {
            let c = authorization::Connection {
                src_identity: None,
                src: plain.src.ip(),
                dst: plain.dst,
            };
            if let Err(denied) = authorization::check(&store.policies_for(&workload), &c) {
                proxy.metrics.error(Direction::Inbound, "policy_denied");
                anyhow::bail!("the pod's policy denies it now: {denied}");
            }
            let allowed = Authorized::register(proxy, &pod.uid, None, plain.src.ip(), plain.dst);
            let info = ConnInfo {
                direction: Direction::Inbound,
                src_addr: plain.src,
                src_workload: store.by_ip(plain.src.ip()).cloned(),
                src_identity: None,
                dst_addr: plain.dst,
                hbone_addr: None,
                dst_workload: Some(workload),
                dst_identity: Some(pod.identity().as_ref().clone()),
                dst_service: None,
                node_local: false,
            };
            (info, Some(allowed))
        }
    };
    let guard = ConnGuard::open(&proxy.metrics, info);
    let _listed = pod.open.list(crate::proxy::open_connections::Entry {
        direction: plain.direction,
        src: plain.src,
        original_dst: plain.dst,
        actual_dst: plain.dst,
        protocol: "TCP",
    });
    let meters = (&guard.from_client, &guard.to_client);
    let denied = async {
        match &allowed {
            Some(a) => a.closed.cancelled().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = relay(pod, plain, a, b, meters) => match r {
            Ok(_) => guard.finish(None),
            Err(e) => guard.finish(Some(&e.to_string())),
        },
        () = when_woken(denied) => guard.finish(Some("a policy change denies it")),
    }
    Ok(())
}
