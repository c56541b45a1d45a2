//! The node-local path: a connection from one pod this proxy serves to another it serves (no
//! waypoint between them) is carried directly, from the socket accepted on the source pod's
//! 15001 to a socket opened inside the destination pod to its app, with the client's address
//! kept (`transparent`), as the destination's inbound would connect to it. No HBONE: the
//! bytes never leave the node's memory, and both ends' identities are this proxy's own to
//! know. Two TCP hops instead of three, and no TLS.
//!
//! The same decisions as over HBONE: the destination's inbound authorization
//! (`inbound::authorize`, with the source pod's identity), registered so that a policy change
//! closes the connection; the destination pod's inbound cap; both reporters' telemetry, with
//! `connection_security_policy="none"` (no mutual TLS on the wire). A connection to a pod
//! whose address is not its own on the HBONE path (another network's gateway, a waypoint)
//! goes over HBONE. `--node-local-hbone` turns the path off.
//!
//! At an upgrade the connection is handed over like a plain one (`handover`), with its
//! destination pod named (`HeldConnection::peer_uid`): the path is taken only where the node
//! agent holds such connections, or holds no HBONE streams either, so that a connection kept
//! over HBONE is kept here too.

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::{AsFd as _, OwnedFd},
    sync::Arc,
    time::{Duration, SystemTime},
};

use datapath_common::consts::ports;
use meshpath_zds::{connections, proto::HeldConnection};
use tokio::net::TcpStream;
use tracing::{info, info_span, warn, Instrument as _};

use crate::{
    metrics::{ConnGuard, ConnInfo, Direction},
    proxy::{
        authorized::Authorized, handover, inbound, open_connections, pod::Pod, resolve::Target,
        stop::when_woken, transparent, Proxy,
    },
    state::store::WorkloadStore,
};

/// The destination pod, if `target` is one this proxy serves and may reach directly from
/// `pod`'s app at `peer`: HBONE to the destination's own address (no waypoint, no gateway)
/// naming that address, the path on, the agent keeping such connections wherever it keeps
/// HBONE ones, and the app's address one of its pod's own.
pub fn destination(
    pod: &Pod,
    store: &WorkloadStore,
    peer: SocketAddr,
    target: &Target,
) -> Option<Arc<Pod>> {
    let proxy = &pod.proxy;
    if !proxy.settings.node_local || target.waypoint.is_some() {
        return None;
    }
    let gateway = target.hbone?;
    let workload = target.workload.as_ref()?;
    if gateway.port() != ports::HBONE || gateway.ip() != target.addr.ip() {
        return None;
    }
    if !proxy.handover.keeps_node_local() {
        return None;
    }
    // The app's address is the source the destination's policy and app see. Over HBONE they
    // see the pod's routed address whatever the app bound; here, only an address of the pod's
    // own is taken as it is (an app with CAP_NET_ADMIN could bind another pod's, or one it
    // added: the datapath sends such a connect to 15001 on loopback, from the address bound).
    let own = |p: &Pod| {
        p.workload.workload_ips.contains(&peer.ip())
            || p.current_workload(store).workload_ips.contains(&peer.ip())
    };
    if !own(pod) {
        return None;
    }
    let dst = proxy.pod(&workload.uid)?;
    // The pod that owns the address HBONE would dial is the one it would reach.
    dst.current_workload(store).workload_ips.contains(&gateway.ip()).then_some(dst)
}

/// Carries `conn`, accepted on `src`'s outbound listener from `peer`, to `target` in `dst`.
pub async fn carry(
    conn: TcpStream,
    peer: SocketAddr,
    src: &Pod,
    dst: &Arc<Pod>,
    target: &Target,
) -> anyhow::Result<()> {
    let proxy = &src.proxy;
    let addr = target.addr;
    tracing::debug!(dst_pod = %dst.uid, "node-local");
    // Before policy, as the inbound path: the proxy would connect to itself.
    if ports::is_proxy_port(addr.port()) {
        proxy.metrics.error(Direction::Inbound, crate::proxy::outbound::SELF_CALL);
        anyhow::bail!("refusing {addr}: a proxy port of the destination pod");
    }
    // The destination's inbound cap, as an HBONE stream to it would hold.
    let Some(_permits) = dst.admit_inbound() else {
        proxy.metrics.error(Direction::Inbound, "connection_limit");
        anyhow::bail!("{addr}: the destination pod's inbound connection cap is reached");
    };
    let store = proxy.store();
    let client = src.identity();
    if let Err(denied) = inbound::authorize(dst, &store, &client, peer, addr) {
        proxy.metrics.error(Direction::Outbound, "policy_denied");
        warn!(src = %client, %peer, dst = %addr, reason = %denied, "node-local connection denied");
        return Ok(());
    }
    let (from, to) = infos(src, dst, peer, addr, target.service.clone(), &store);
    drop(store);
    let (out, inb) = ConnGuard::open_node_local(&proxy.metrics, from, to);
    let allowed = Authorized::register(proxy, &dst.uid, Some(&client), peer.ip(), addr);
    let limit = proxy.settings.connect_timeout;
    let app = match transparent::connect_app(dst, peer.ip(), addr, limit).await {
        Ok(a) => a,
        Err(e) => {
            let timeout = e.kind() == std::io::ErrorKind::TimedOut;
            let reason = if timeout { "upstream_timeout" } else { "upstream_refused" };
            proxy.metrics.error(Direction::Inbound, reason);
            inb.finish(Some(&e.to_string()));
            out.finish(Some(&e.to_string()));
            return Err(anyhow::Error::new(e).context(format!("connecting to {addr}")));
        }
    };
    let plain = handover::Plain {
        direction: Direction::Outbound,
        src: peer,
        dst: addr,
        opened: SystemTime::now(),
        peer: Some(dst.uid.clone()),
    };
    relay(src, dst, &plain, conn, app, (out, inb), &allowed).await;
    Ok(())
}

/// The two reporters' views of a node-local connection: the source's and the destination's.
fn infos(
    src: &Pod,
    dst: &Pod,
    peer: SocketAddr,
    addr: SocketAddr,
    service: Option<String>,
    store: &crate::state::store::WorkloadStore,
) -> (ConnInfo, ConnInfo) {
    let src_workload = Some(src.current_workload(store).clone());
    let dst_workload = Some(dst.current_workload(store).clone());
    let (src_identity, dst_identity) =
        (Some(src.identity().as_ref().clone()), Some(dst.identity().as_ref().clone()));
    let from = ConnInfo {
        direction: Direction::Outbound,
        src_addr: peer,
        src_workload: src_workload.clone(),
        src_identity: src_identity.clone(),
        dst_addr: addr,
        hbone_addr: None,
        dst_workload: dst_workload.clone(),
        dst_identity: dst_identity.clone(),
        dst_service: service,
        node_local: true,
    };
    let to = ConnInfo {
        direction: Direction::Inbound,
        src_addr: peer,
        src_workload,
        src_identity,
        dst_addr: addr,
        hbone_addr: None,
        dst_workload,
        dst_identity,
        dst_service: None,
        node_local: true,
    };
    (from, to)
}

/// Carries the two sockets until the connection ends, a policy change denies it, the
/// destination pod leaves, or the proxy hands it over; records both reporters' ends.
async fn relay(
    src: &Pod,
    dst: &Pod,
    plain: &handover::Plain,
    a: TcpStream,
    b: TcpStream,
    (out, inb): (ConnGuard<'_>, ConnGuard<'_>),
    allowed: &crate::proxy::authorized::Registration,
) {
    let entry = |direction| open_connections::Entry {
        direction,
        src: plain.src,
        original_dst: plain.dst,
        actual_dst: plain.dst,
        protocol: "TCP",
    };
    let _listed =
        (src.open.list(entry(Direction::Outbound)), dst.open.list(entry(Direction::Inbound)));
    let meters = (&out.from_client, &out.to_client);
    let end = tokio::select! {
        r = handover::relay(src, plain, a, b, meters) => r.err().map(|e| e.to_string()),
        () = when_woken(allowed.closed.cancelled()) => Some("a policy change denies it".to_owned()),
        () = when_woken(dst.gone.cancelled()) => Some("the destination pod left".to_owned()),
    };
    inb.finish(end.as_deref());
    out.finish(end.as_deref());
}

/// How long a handed-over node-local connection waits for its destination pod to be added
/// (the agent's snapshot names every pod within moments).
const PEER_WITHIN: Duration = Duration::from_secs(10);

/// Takes a node-local connection a previous proxy handed over (`src`'s accepted socket, then
/// the one opened in its peer pod), once the peer pod is served; carried on with the peer's
/// policy as it is now and telemetry of its own.
pub fn take(src: Arc<Pod>, held: HeldConnection, fds: Vec<OwnedFd>) -> Result<(), String> {
    let proxy = src.proxy.clone();
    let [a, b]: [OwnedFd; connections::FDS_PER_CONNECTION] =
        fds.try_into().map_err(|v: Vec<OwnedFd>| format!("{} descriptors, not 2", v.len()))?;
    connections::identify(a.as_fd(), src.netns.cookie()).map_err(|e| e.to_string())?;
    let addr = |s: &str| s.parse::<SocketAddr>().map_err(|e| format!("address {s:?}: {e}"));
    let plain = handover::Plain {
        direction: Direction::Outbound,
        src: addr(&held.src)?,
        dst: addr(&held.dst)?,
        opened: SystemTime::UNIX_EPOCH + Duration::from_millis(held.opened_unix_ms),
        peer: Some(held.peer_uid.clone()),
    };
    let permits = proxy
        .drain
        .admit(&src.scope(Direction::Outbound, false).limit)
        .ok_or("the pod's or the node's connection cap is reached")?;
    let span = info_span!("resumed", pod = %src.uid, dst_pod = %held.peer_uid, src = %plain.src, dst = %plain.dst);
    info!(parent: &span, sent = held.sent, received = held.received, "node-local connection taken over from the previous proxy");
    let kill = src.gone.clone();
    proxy.clone().drain.spawn(
        async move {
            let _permits = permits;
            tokio::select! {
                r = resume(&proxy, &src, &plain, a, b) => if let Err(e) = r {
                    warn!(error = %e, "resumed node-local connection ended");
                },
                () = when_woken(kill.cancelled()) => {}
            }
        }
        .instrument(span),
    );
    Ok(())
}

async fn resume(
    proxy: &Arc<Proxy>,
    src: &Pod,
    plain: &handover::Plain,
    a: OwnedFd,
    b: OwnedFd,
) -> Result<(), String> {
    let uid = plain.peer.as_deref().unwrap_or_default();
    let dst = wait_for_pod(proxy, uid)
        .await
        .ok_or(format!("pod {uid} not served within {PEER_WITHIN:?}"))?;
    connections::identify(b.as_fd(), dst.netns.cookie()).map_err(|e| e.to_string())?;
    let (a, b) = (handover::tcp_of(a)?, handover::tcp_of(b)?);
    let _permits = dst.admit_inbound().ok_or("the destination pod's inbound cap is reached")?;
    let store = proxy.store();
    let client = src.identity();
    inbound::authorize(&dst, &store, &client, plain.src, plain.dst)
        .map_err(|denied| format!("the destination's policy denies it now: {denied}"))?;
    let (from, to) = infos(src, &dst, plain.src, plain.dst, None, &store);
    drop(store);
    let guards = ConnGuard::open_node_local(&proxy.metrics, from, to);
    let ip: IpAddr = plain.src.ip();
    let allowed = Authorized::register(proxy, &dst.uid, Some(&client), ip, plain.dst);
    relay(src, &dst, plain, a, b, guards, &allowed).await;
    Ok(())
}

/// The pod `uid` once this proxy serves it, within [`PEER_WITHIN`].
async fn wait_for_pod(proxy: &Proxy, uid: &str) -> Option<Arc<Pod>> {
    let deadline = tokio::time::Instant::now() + PEER_WITHIN;
    loop {
        if let Some(pod) = proxy.pod(uid) {
            return Some(pod);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
