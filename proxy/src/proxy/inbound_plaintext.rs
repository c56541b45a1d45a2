//! Inbound plaintext: TCP that the datapath steered to the pod's `[::]:15006` (sk_lookup, any
//! port but 15008) is authorized — with no peer identity, so a pod whose policy requires mTLS
//! refuses it — and forwarded to the app it was addressed to, connecting from inside the pod.
//! The datapath finds the listener by itself when it starts listening; while no proxy listens,
//! the pod refuses such connections (fail closed).

use std::{net::SocketAddr, sync::Arc};

use datapath_common::consts::ports;
use tokio::net::TcpStream;
use tracing::{info_span, warn, Instrument as _};

use crate::{
    metrics::{ConnGuard, ConnInfo, Direction},
    proxy::pod::Pod,
    proxy::{authorized::Authorized, handover, outbound::original_dst, stop::when_woken},
    state::authorization,
};

/// Opens the pod's `[::]:15006` listener and serves it.
pub fn start(pod: Arc<Pod>) -> anyhow::Result<()> {
    let listener = pod.sockets.listen(SocketAddr::from(([0u16; 8], ports::INBOUND_PLAINTEXT)))?;
    let proxy = pod.proxy.clone();
    proxy.drain.serve(
        listener,
        pod.scope(crate::metrics::Direction::Inbound, false),
        pod,
        "inbound plaintext",
        |conn, peer, pod: Arc<Pod>, _| async move {
            // The dual-stack listener reports an IPv4 peer in its IPv6 form.
            let peer = SocketAddr::new(crate::state::canonical(peer.ip()), peer.port());
            let span = info_span!("inbound_plaintext", pod = %pod.uid, %peer);
            handle(conn, peer, &pod).instrument(span).await
        },
    );
    Ok(())
}

async fn handle(conn: TcpStream, peer: SocketAddr, pod: &Pod) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    // sk_lookup does not rewrite: the original destination is the accepted socket's address
    // (SO_ORIGINAL_DST, answered by the datapath, agrees).
    let dst = original_dst(&conn)?;
    if proxy.transparent.contains(dst, peer) {
        // Our own transparent connection to the app, steered back here by a datapath that did
        // not recognise it (an older one, or its map full): refuse rather than loop.
        proxy.metrics.error(Direction::Inbound, "loop");
        anyhow::bail!("refusing {peer} → {dst}: the proxy's own connection to the app came back");
    }
    // Checked before policy: a connection to one of the proxy's own ports would be proxied
    // to that port, inside the pod, and so come back here (a pod connecting to its own
    // address on 15006 needs only one connection to exhaust the proxy's descriptors).
    if ports::is_proxy_port(dst.port()) {
        proxy.metrics.error(Direction::Inbound, crate::proxy::outbound::SELF_CALL);
        warn!(src = %peer, %dst, "refused: the destination is one of the proxy's own ports");
        let _ = socket2::SockRef::from(&conn).set_linger(Some(std::time::Duration::ZERO));
        return Ok(());
    }
    let store = proxy.store();
    let c = authorization::Connection { src_identity: None, src: peer.ip(), dst };
    if let Err(denied) = authorization::check(&store.policies_for(pod.current_workload(&store)), &c)
    {
        proxy.metrics.error(Direction::Inbound, "policy_denied");
        warn!(src = %peer, %dst, reason = %denied, "plaintext connection denied");
        // SO_LINGER 0: the close below sends RST, so the client sees a reset, not an EOF.
        let _ = socket2::SockRef::from(&conn).set_linger(Some(std::time::Duration::ZERO));
        return Ok(());
    }
    conn.set_nodelay(true)?;
    let info = ConnInfo {
        direction: Direction::Inbound,
        src_addr: peer,
        src_workload: store.by_ip(peer.ip()).cloned(),
        src_identity: None,
        dst_addr: dst,
        hbone_addr: None,
        dst_workload: Some(pod.current_workload(&store).clone()),
        dst_identity: Some(pod.identity().as_ref().clone()),
        dst_service: None,
        node_local: false,
    };
    let guard = ConnGuard::open(&proxy.metrics, info);
    let _listed = pod.open.list(crate::proxy::open_connections::Entry {
        direction: Direction::Inbound,
        src: peer,
        original_dst: dst,
        actual_dst: dst,
        protocol: "TCP",
    });
    // Held until the connection ends: a policy change that denies it closes it.
    let allowed = Authorized::register(&pod.proxy, &pod.uid, None, peer.ip(), dst);
    let limit = proxy.settings.connect_timeout;
    let app = match crate::proxy::transparent::connect_app(pod, peer.ip(), dst, limit).await {
        Ok(a) => a,
        Err(e) => {
            proxy.metrics.error(Direction::Inbound, "upstream_refused");
            guard.finish(Some(&e.to_string()));
            return Err(anyhow::Error::new(e).context(format!("connecting to {dst}")));
        }
    };
    let meters = (&guard.from_client, &guard.to_client);
    let plain = handover::Plain {
        direction: Direction::Inbound,
        src: peer,
        dst,
        opened: std::time::SystemTime::now(),
        peer: None,
    };
    tokio::select! {
        r = handover::relay(pod, &plain, conn, app, meters) => match r {
            Ok(_) => guard.finish(None),
            Err(e) => guard.finish(Some(&e.to_string())),
        },
        () = when_woken(allowed.closed.cancelled()) => guard.finish(Some("a policy change denies it")),
    }
    Ok(())
}
