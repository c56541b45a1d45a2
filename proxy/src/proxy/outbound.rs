//! Outbound: a pod's captured TCP arrives on its 15001 listener; the original destination
//! (`SO_ORIGINAL_DST`, as under iptables) decides where it goes (`resolve.rs`: a service's
//! endpoint, a waypoint): a workload that speaks HBONE, or a waypoint, is reached by HTTP/2
//! CONNECT over mTLS to its HBONE address, verifying its SPIFFE identity; anything else is
//! passed through as plain TCP; a workload of this node is reached directly (`node_local`).
//! Upstream sockets are made in the pod's netns, so traffic leaves
//! from the pod's own address.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    sync::Arc,
};

use anyhow::Context as _;
use bytes::Bytes;
use datapath_common::consts::{ports, sockopt};
use h2::{RecvStream, SendStream};
use tokio::net::TcpStream;
use tracing::{info_span, Instrument as _};

use crate::{
    metrics::{ConnGuard, ConnInfo, Direction, Meter},
    proxy::copy,
    proxy::drain::HboneHold,
    proxy::handover,
    proxy::hbone::{self, StreamHeaders},
    proxy::node_local,
    proxy::pod::Pod,
    proxy::pool::{PoolKey, StreamPermit},
    proxy::resolve::{resolve, Target},
    proxy::resume,
    state::workloads::Workload,
};

/// Serves one pod's outbound listener, `[::]:15001` (dual-stack) in its netns, as ztunnel: the
/// datapath sends the app's connections to the pod's own address on that port.
pub fn start(pod: Arc<Pod>) -> io::Result<()> {
    let listener =
        pod.sockets.listen(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), ports::OUTBOUND))?;
    pod.proxy.drain.serve(
        listener,
        pod.scope(crate::metrics::Direction::Outbound, true),
        pod.clone(),
        "outbound",
        |conn, peer, pod: Arc<Pod>, hold| async move {
            let span = info_span!("outbound", pod = %pod.uid, %peer);
            handle(conn, peer, &pod, hold).instrument(span).await
        },
    );
    Ok(())
}

/// The `reason` label of connections refused because their destination is one of the proxy's
/// own ports (`ports::PROXY_PORTS`), on every path.
pub const SELF_CALL: &str = "self_call";

/// `hold` keeps a draining proxy's HBONE side up until this connection has its stream
/// (`drain`): released as soon as the connection needs HBONE no longer.
async fn handle(
    conn: TcpStream,
    peer: SocketAddr,
    pod: &Pod,
    mut hold: HboneHold,
) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let orig = original_dst(&conn)?;
    // The app's address, as under REDIRECT: the datapath steered it to the pod's own address,
    // so the source is the pod's, or the one the app bound (then it came over loopback). The
    // listener is dual-stack: IPv4 arrives v4-mapped.
    let peer = SocketAddr::new(crate::state::canonical(peer.ip()), peer.port());
    if ports::is_proxy_port(orig.port()) {
        proxy.metrics.error(Direction::Outbound, SELF_CALL);
        anyhow::bail!("refusing {orig}: a proxy port as destination would loop");
    }
    conn.set_nodelay(true)?;
    let store = proxy.store();
    let target = match resolve(&store, orig, (&*pod.identity(), peer.ip())) {
        Ok(t) => t,
        Err((reason, why)) => {
            proxy.metrics.error(Direction::Outbound, reason);
            anyhow::bail!("{orig}: {why}");
        }
    };
    if let Some(dst) = node_local::destination(pod, &store, peer, &target) {
        hold.release();
        // Boxed: the other paths' tasks are not sized for this one's state (an idle
        // connection costs what its task holds: tests/tests/idle_connections.rs).
        return Box::pin(node_local::carry(conn, peer, pod, &dst, &target)).await;
    }
    let hbone = target.hbone.is_some();
    if let Some(wp) = &target.waypoint {
        tracing::debug!(%wp, "through the waypoint");
    }
    let info = ConnInfo {
        direction: Direction::Outbound,
        src_addr: peer,
        src_workload: Some(pod.current_workload(&store).clone()),
        src_identity: Some(pod.identity().as_ref().clone()),
        dst_addr: target.addr,
        hbone_addr: target.hbone,
        dst_workload: target.workload.clone(),
        dst_identity: target.workload.as_ref().filter(|_| hbone).map(Workload::identity),
        dst_service: target.service.clone(),
        node_local: false,
    };
    let guard = ConnGuard::open(&proxy.metrics, info);
    let _listed = pod.open.list(crate::proxy::open_connections::Entry {
        direction: Direction::Outbound,
        src: peer,
        original_dst: orig,
        actual_dst: target.hbone.unwrap_or(target.addr),
        protocol: if hbone { "HBONE" } else { "TCP" },
    });
    let meters = (&guard.from_client, &guard.to_client);
    let result = if hbone {
        via_hbone(conn, peer, pod, &target, meters, hold).await
    } else {
        hold.release();
        passthrough(conn, peer, pod, target.addr, meters).await
    };
    match result {
        Ok(()) => guard.finish(None),
        Err(e) => {
            guard.finish(Some(&format!("{e:#}")));
            return Err(e);
        }
    }
    Ok(())
}

async fn via_hbone(
    conn: TcpStream,
    peer: SocketAddr,
    pod: &Pod,
    target: &Target,
    meters: (&Meter, &Meter),
    mut hold: HboneHold,
) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let opened = std::time::SystemTime::now();
    let dst = target.workload.as_ref().context("HBONE needs a destination workload")?;
    let gateway = target.hbone.context("HBONE needs an address to dial")?;
    let key = PoolKey {
        src: pod.identity().as_ref().clone(),
        dst: dst.identity(),
        src_workload: pod.uid.clone(),
        gateway,
    };
    let mut headers = StreamHeaders::for_source(peer, pod.current_workload(&proxy.store()));
    headers.extra.push(resume::offer());
    // A stream the peer never processed (it was going away, or refused it) is opened again on
    // another connection: RFC 9113 §8.7 lets a client retry such a request. A peer proxy that
    // drains sends GOAWAY; a stream opened on the pooled connection in the instant before it
    // arrived is refused, and a new connection reaches the peer's next proxy. So is one whose
    // new connection's handshake went unanswered: the peer's proxy is being replaced and the
    // connection waits in the backlog its agent holds (the app waits too, as it would for the
    // next proxy on its own node), dialed again each connect timeout for up to
    // PEER_REPLACED_WAIT; so is one that waited behind others dialing it in turn.
    let mut attempt = 1;
    let mut away_since = None;
    let (send, recv, token, permit) = loop {
        let result = open(pod, &key, dst, gateway, target.addr, &headers).await;
        match result {
            Ok(opened) => break opened,
            Err(e) if e.is_unprocessed() && attempt < OPEN_ATTEMPTS => {
                tracing::debug!(error = %e, attempt, "CONNECT not processed by the peer; again on another connection");
                attempt += 1;
            }
            Err(e)
                if e.is_peer_away()
                    && away_since.get_or_insert_with(tokio::time::Instant::now).elapsed()
                        < PEER_REPLACED_WAIT =>
            {
                tracing::info!(error = %e, "the peer's proxy is not answering; trying again");
            }
            Err(e) => {
                proxy.metrics.error(Direction::Outbound, e.reason());
                return Err(e.into());
            }
        }
    };
    hold.release();
    let idle = proxy.settings.idle_timeout;
    // A peer that can resume the stream (a meshpath proxy) answered with its token: the stream
    // outlives an upgrade of either proxy (`resume`).
    let Some(token) = token else {
        let _permit = permit;
        copy::splice(conn, send, recv, meters, idle).await?;
        return Ok(());
    };
    let stop = Some(&proxy.handover.streams);
    let (tcp, out, back) =
        match copy::splice_resumable(conn, send, recv, meters, idle, stop).await? {
            copy::Spliced::Done(..) => return Ok(()),
            copy::Spliced::Paused { tcp, out, back } => (tcp, out, back),
        };
    // The stream is over: its pooled connection's slot is free for another.
    drop(permit);
    let side = resume::ClientSide {
        stream: resume::Resumable { token, to_server: out, to_client: back },
        gateway,
        dst: target.addr,
        dst_identity: dst.identity(),
        src: peer,
        opened,
    };
    Box::pin(resume::carry_client(pod, tcp, side, meters)).await
}

/// How many times a CONNECT the peer did not process is sent, on as many connections.
const OPEN_ATTEMPTS: u32 = 3;

/// How long a new connection waits for a peer node whose proxy is being replaced: its TCP
/// connection taken into the backlog of the listener the peer's agent holds, no handshake
/// answered, dialed again each connect timeout. The agent's default hold of those listeners
/// (`meshpath-loader agent --hold-listeners-seconds`), past which the peer refuses and the
/// dial fails at once. Three connect timeouts (30 s) were not enough: a rolling update on a
/// busy two-node cluster kept a node without a proxy longer, and 1216 of 4227 connections
/// across it were reset (after 30 s of dialing, or 20 s waiting behind the dials of others).
/// A connection can wait a few connect timeouts longer: this wait starts at its first
/// unanswered attempt (one connect timeout in, or two for a turn waited for in the pool), and
/// its last attempt, started before the wait ends, runs its course (a turn and a dial).
const PEER_REPLACED_WAIT: std::time::Duration = meshpath_zds::listeners::DEFAULT_HOLD;

/// A CONNECT stream to `dst` through `gateway`, on a pooled HBONE connection or a new one; a
/// connection that failed to answer it is evicted from the pool.
async fn open(
    pod: &Pod,
    key: &PoolKey,
    dst: &Workload,
    gateway: SocketAddr,
    addr: SocketAddr,
    headers: &StreamHeaders,
) -> Result<(SendStream<Bytes>, RecvStream, Option<resume::Token>, StreamPermit), hbone::HboneError>
{
    let proxy = &pod.proxy;
    let timeout = proxy.settings.connect_timeout;
    // Boxed, as is the CONNECT below: the connect phase's state (TLS and HTTP/2 handshakes) is
    // freed once done instead of sizing the task that then carries the connection for its
    // whole life (an idle connection costs what its task holds). A stream waiting for its turn
    // to open a connection (every pooled one full) waits as long as the stream before it may
    // take to open one: a TCP connect and a handshake, each up to the connect timeout.
    let (h2conn, permit) = Box::pin(proxy.pool.get(key, 2 * timeout, || async {
        let connect = async { pod.sockets.socket(gateway)?.connect(gateway).await };
        let tcp = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| hbone::HboneError::Connect(gateway, io::ErrorKind::TimedOut.into()))?
            .map_err(|e| hbone::HboneError::Connect(gateway, e))?;
        let config = pod
            .client_tls(&dst.identity())
            .map_err(|e| hbone::HboneError::Tls(gateway, io::Error::other(e)))?;
        // A peer that takes the TCP connection and then stalls must not hold the app.
        let keepalive = proxy.settings.keepalive;
        tokio::time::timeout(timeout, hbone::handshake_with(tcp, gateway, config, keepalive))
            .await
            .map_err(|_| hbone::HboneError::Tls(gateway, io::ErrorKind::TimedOut.into()))?
    }))
    .await?;
    let stream = Box::pin(tokio::time::timeout(
        timeout,
        hbone::open_stream_answered(h2conn, gateway, addr, headers),
    ))
    .await
    .unwrap_or_else(|_| {
        Err(hbone::HboneError::Connect(
            gateway,
            io::Error::new(io::ErrorKind::TimedOut, "no answer to CONNECT"),
        ))
    });
    match stream {
        Ok((send, recv, answer)) => Ok((send, recv, resume::token_of(&answer), permit)),
        Err(e) => {
            if e.is_timeout() || e.is_unprocessed() {
                // A connection whose peer does not answer a CONNECT, or is going away, takes
                // no more streams.
                permit.evict();
            }
            Err(e)
        }
    }
}

async fn passthrough(
    conn: TcpStream,
    peer: SocketAddr,
    pod: &Pod,
    dst: SocketAddr,
    meters: (&Meter, &Meter),
) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let connect = async { pod.sockets.socket(dst)?.connect(dst).await };
    let upstream = match tokio::time::timeout(proxy.settings.connect_timeout, connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            proxy.metrics.error(Direction::Outbound, "upstream_refused");
            return Err(anyhow::Error::new(e).context(format!("connecting to {dst}")));
        }
        Err(_) => {
            proxy.metrics.error(Direction::Outbound, "upstream_timeout");
            anyhow::bail!("connecting to {dst}: timed out");
        }
    };
    let plain = handover::Plain {
        direction: Direction::Outbound,
        src: peer,
        dst,
        opened: std::time::SystemTime::now(),
        peer: None,
    };
    handover::relay(pod, &plain, conn, upstream, meters).await?;
    Ok(())
}

/// The original destination, asked as under iptables: SOL_IP/SO_ORIGINAL_DST for an IPv4
/// socket, SOL_IPV6/IP6T_SO_ORIGINAL_DST for an IPv6 one; falls back to the local address.
pub fn original_dst(conn: &TcpStream) -> io::Result<SocketAddr> {
    // A v4-mapped address on a dual-stack listener is an IPv4 connection: netfilter answers
    // it at SOL_IP only (the IPv6 level says ENOENT), as ztunnel asks.
    let v6 = match conn.local_addr()?.ip() {
        std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped().is_none(),
        std::net::IpAddr::V4(_) => false,
    };
    let mut buf = [0u8; 28];
    let mut len = buf.len() as libc::socklen_t;
    let (level, name) = if v6 {
        (sockopt::SOL_IPV6, sockopt::IP6T_SO_ORIGINAL_DST)
    } else {
        (sockopt::SOL_IP, sockopt::SO_ORIGINAL_DST)
    };
    // SAFETY: buf and len describe a writable buffer of len bytes.
    let rc = unsafe {
        libc::getsockopt(conn.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &mut len)
    };
    if rc != 0 {
        return conn.local_addr();
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    match i32::from(u16::from_ne_bytes([buf[0], buf[1]])) {
        libc::AF_INET => {
            Ok(SocketAddr::from((Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]), port)))
        }
        libc::AF_INET6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&buf[8..24]);
            let ip = Ipv6Addr::from(a);
            Ok(SocketAddr::new(crate::state::canonical(IpAddr::V6(ip)), port))
        }
        f => Err(io::Error::other(format!("SO_ORIGINAL_DST answered family {f}"))),
    }
}
