//! Inbound HBONE: each pod's `[::]:15008` in its netns terminates mutual TLS with the pod's own
//! certificate (the client must present one that verifies, from our trust domain), then serves
//! HTTP/2 CONNECT streams: 400 for anything but CONNECT, an unparseable authority, or an
//! authority whose IP is not the one the client dialed; 401 when authorization policy denies;
//! 503 when the app cannot be reached; 200 only once the connection to the app is up. The
//! connection to the app is made from inside the pod's netns.
//!
//! Limits: the TLS and HTTP/2 handshakes, and then the first CONNECT's headers, must each come
//! within the handshake timeout; one source address may hold at most
//! `--max-handshakes-per-source` connections whose client certificate is not yet checked
//! (`per_source`); at most 200 concurrent streams and 64 KiB of headers per
//! connection; h2's reset-flood protections on. The connection holds a slot under the pod's and
//! the node's connection caps, and so does each stream (it has a connection to the app of its
//! own): a stream over a cap is answered 503 and counted (`connection_limit`). A connection
//! with no stream for the HBONE idle time (`--hbone-idle-seconds`) is sent GOAWAY and closed,
//! and one whose peer stops answering PINGs is closed, so no peer holds a slot for ever.

use std::{io, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context as _;
use bytes::Bytes;
use datapath_common::consts::ports;
use h2::server::SendResponse;
use http::StatusCode;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info_span, warn, Instrument as _};

use crate::{
    identity::tls,
    identity::Identity,
    metrics::{ConnGuard, ConnInfo, Direction},
    proxy::pod::Pod,
    proxy::{authorized::Authorized, copy, hbone, read_ahead::ReadAhead, resume, stop::when_woken},
    state::{authorization, canonical},
};

/// Serves one pod's HBONE listener.
pub fn start(pod: Arc<Pod>) -> anyhow::Result<()> {
    let listener = pod.sockets.listen(SocketAddr::from(([0u16; 8], ports::HBONE)))?;
    let proxy = pod.proxy.clone();
    proxy.drain.serve(listener, pod.hbone_scope(), pod, "HBONE", |tcp, peer, pod, _| async move {
        // The dual-stack listener reports an IPv4 peer in its IPv6 form.
        let peer = SocketAddr::new(canonical(peer.ip()), peer.port());
        let span = info_span!("inbound", pod = %pod.uid, %peer);
        serve_connection(tcp, peer, &pod).instrument(span).await
    });
    Ok(())
}

async fn serve_connection(tcp: TcpStream, peer: SocketAddr, pod: &Arc<Pod>) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let dialed = tcp.local_addr()?;
    // HTTP/2 writes small frames (responses, window updates): no Nagle delay on them.
    tcp.set_nodelay(true)?;
    // Until its certificate is checked the peer is anyone who can reach the pod: one source
    // address may hold only its share of the pod's inbound cap so. A refusal is counted and
    // logged at debug, as one over a cap is: the address could send one a connection.
    let Some(unauthenticated) = pod.admit_unauthenticated(peer.ip()) else {
        proxy.metrics.error(Direction::Inbound, "handshake_limit");
        debug!(
            limit = proxy.settings.max_handshakes_per_source,
            "this address holds its share of the pod's connections in their handshake; closed"
        );
        return Ok(());
    };
    let config = pod.server_tls().context("pod has no certificate")?;
    let limit = proxy.settings.handshake_timeout;
    let tls =
        match tokio::time::timeout(limit, TlsAcceptor::from(config).accept(ReadAhead::new(tcp)))
            .await
        {
            Ok(Ok(mut tls)) => {
                tls.get_mut().1.set_buffer_limit(Some(hbone::TLS_BUFFER_LIMIT));
                tls
            }
            Ok(Err(e)) => {
                proxy.metrics.error(Direction::Inbound, "tls_handshake");
                return Err(anyhow::Error::new(e).context("TLS handshake"));
            }
            Err(_) => {
                proxy.metrics.error(Direction::Inbound, "handshake_timeout");
                anyhow::bail!("TLS handshake not done within {limit:?}");
            }
        };
    let client = match tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
        Some(cert) => tls::peer_identity(cert),
        None => Err("no client certificate".into()),
    };
    let client = match client {
        Ok(id) => id,
        Err(why) => {
            proxy.metrics.error(Direction::Inbound, "no_identity");
            anyhow::bail!("the client certificate names no identity: {why}");
        }
    };
    let me = pod.identity();
    if client.trust_domain != me.trust_domain {
        proxy.metrics.error(Direction::Inbound, "trust_domain");
        anyhow::bail!("client {client} is not in trust domain {}", me.trust_domain);
    }
    // A workload of the trust domain: what it holds from here is its own to answer for.
    drop(unauthenticated);
    let handshake = hbone::server_builder()
        .max_concurrent_streams(200)
        .max_header_list_size(64 * 1024)
        .max_concurrent_reset_streams(100)
        .max_pending_accept_reset_streams(50)
        .max_local_error_reset_streams(Some(100))
        .handshake(tls);
    let mut conn = match tokio::time::timeout(limit, handshake).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            proxy.metrics.error(Direction::Inbound, "http2_handshake");
            return Err(anyhow::Error::new(e).context("HTTP/2 handshake (not HTTP/2?)"));
        }
        Err(_) => {
            proxy.metrics.error(Direction::Inbound, "handshake_timeout");
            anyhow::bail!("HTTP/2 handshake not done within {limit:?}");
        }
    };
    // A peer opens an HBONE connection to send a CONNECT: the first one must come within the
    // handshake timeout too (a connection that never asks for anything is closed). When the
    // proxy drains, or the connection has had no stream for the HBONE idle time, the peer is
    // told with GOAWAY to open no new stream here; the streams it has finish. A peer that stops
    // answering PINGs is gone: its connection is closed.
    let mut first = true;
    // Each wake of this task is the connection's bytes moving: the branches beside them are
    // polled only when they woke it (`when_woken`).
    let stopping = when_woken(proxy.drain.hbone_stopping());
    tokio::pin!(stopping);
    let dead = when_woken(hbone::stopped_answering(conn.ping_pong(), proxy.settings.keepalive));
    tokio::pin!(dead);
    // The connection's open streams; never "open" for new ones, so that `wait` resolves
    // whenever none is left.
    let streams = tokio_util::task::TaskTracker::new();
    streams.close();
    let mut going_away = false;
    loop {
        let accept = async {
            if first {
                tokio::time::timeout(limit, conn.accept()).await.ok()
            } else {
                Some(conn.accept().await)
            }
        };
        // Made anew with every stream accepted: it counts from the last stream's end.
        let idle = when_woken(idle_for(&streams, proxy.settings.hbone_idle));
        let next = tokio::select! {
            n = accept => Some(n),
            () = &mut stopping, if !going_away => None,
            () = idle, if !going_away && !first => {
                debug!("no stream for the HBONE idle time: GOAWAY");
                None
            }
            why = &mut dead => {
                proxy.metrics.error(Direction::Inbound, "peer_unresponsive");
                anyhow::bail!("HBONE connection closed: {why}");
            }
        };
        let Some(next) = next else {
            conn.graceful_shutdown();
            going_away = true;
            continue;
        };
        let Some(next) = next else {
            proxy.metrics.error(Direction::Inbound, "header_timeout");
            anyhow::bail!("no CONNECT within {limit:?} of the handshake");
        };
        first = false;
        let Some(stream) = next else { break };
        let (req, mut respond) = match stream {
            Ok(s) => s,
            // The peer closed its connection after this side sent GOAWAY, or with no stream
            // open (a client side that dialed again to resume a stream closes it once the
            // stream pauses again: `resume`): an end, not a failure. Its streams' tasks see
            // their own ends.
            Err(e) if e.is_io() && (going_away || streams.is_empty()) => {
                debug!(error = %e, "the peer closed its HBONE connection");
                break;
            }
            Err(e) => {
                proxy.metrics.error(Direction::Inbound, "http2_protocol");
                return Err(anyhow::Error::new(e).context("HTTP/2"));
            }
        };
        // Each stream has a connection to the app of its own: it counts under the pod's and
        // the node's caps like any connection, or is refused.
        let Some(permits) = pod.admit_inbound() else {
            proxy.metrics.error(Direction::Inbound, "connection_limit");
            // Counted; logged only at debug, as refusals at accept are: a peer could flood it.
            debug!(src = %client, "HBONE request refused: 503 (connection limit)");
            if let Err(e) = reply(&mut respond, StatusCode::SERVICE_UNAVAILABLE) {
                debug!(error = %e, "the 503 could not be sent");
            }
            continue;
        };
        let (p, client) = (pod.clone(), client.clone());
        pod.spawn(
            streams.track_future(
                async move {
                    let _permits = permits;
                    if let Err(e) = serve_stream(req, respond, dialed, peer, &client, &p).await {
                        debug!(error = %e, "HBONE stream ended with an error");
                    }
                }
                .in_current_span(),
            ),
        );
    }
    Ok(())
}

/// Resolves once the connection has had no open stream for `idle` (never without one).
async fn idle_for(streams: &tokio_util::task::TaskTracker, idle: Option<Duration>) {
    let Some(idle) = idle else { return std::future::pending().await };
    loop {
        streams.wait().await;
        tokio::time::sleep(idle).await;
        if streams.is_empty() {
            return;
        }
    }
}

fn reply(respond: &mut SendResponse<Bytes>, status: StatusCode) -> io::Result<()> {
    let resp = http::Response::builder().status(status).body(()).map_err(io::Error::other)?;
    respond.send_response(resp, true).map(drop).map_err(io::Error::other)
}

async fn serve_stream(
    req: http::Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    dialed: SocketAddr,
    peer: SocketAddr,
    client: &Identity,
    pod: &Arc<Pod>,
) -> io::Result<()> {
    let proxy = &pod.proxy;
    let bad = |respond: &mut SendResponse<Bytes>, why: &str| {
        proxy.metrics.error(Direction::Inbound, "bad_request");
        warn!(src = %client, why, "HBONE request refused: 400");
        reply(respond, StatusCode::BAD_REQUEST)
    };
    if req.method() != http::Method::CONNECT {
        return bad(&mut respond, "method is not CONNECT");
    }
    let target: Option<SocketAddr> = req.uri().authority().and_then(|a| a.as_str().parse().ok());
    let Some(target) = target else {
        return bad(&mut respond, "authority is not IP:PORT");
    };
    let dialed_ip = canonical(dialed.ip());
    if canonical(target.ip()) != dialed_ip {
        return bad(&mut respond, "authority is not the address dialed");
    }
    // From here the target is the address dialed, as the pod knows it, with the authority's
    // port (as ztunnel's): an IPv4 address named in its IPv6 form (`[::ffff:a.b.c.d]`) would
    // otherwise be reached over IPv6, from the pod's own address rather than the client's.
    let target = SocketAddr::new(dialed_ip, target.port());
    // Before policy: CONNECT to one of the proxy's own ports would have the proxy dial itself.
    if ports::is_proxy_port(target.port()) {
        proxy.metrics.error(Direction::Inbound, crate::proxy::outbound::SELF_CALL);
        warn!(src = %client, dst = %target, "HBONE request refused: 400 (a proxy port)");
        return reply(&mut respond, StatusCode::BAD_REQUEST);
    }
    // The peer's address (canonical: see `start`) is the source pod's own (its proxy connects
    // from inside the pod), so policy and telemetry trust it; `forwarded: for=` only adds the
    // app's port, when it agrees.
    let src = forwarded_for(&req).filter(|f| canonical(f.ip()) == peer.ip()).unwrap_or(peer);
    // A CONNECT that resumes a paused stream (`resume`) takes its app's socket, if it is the
    // one that held the stream; then policy decides as for a new one.
    let resumed = match req.headers().get(hbone::RESUME) {
        None => None,
        Some(value) => match resume::claim(pod, value, client, peer.ip(), target) {
            Ok(claimed) => Some(claimed),
            Err((status, why)) => {
                proxy.metrics.error(Direction::Inbound, "resume_refused");
                debug!(src = %client, %src, dst = %target, why, "HBONE resume refused: {status}");
                return reply(&mut respond, status);
            }
        },
    };
    let store = proxy.store();
    let src_workload = store.by_ip(src.ip()).cloned();
    if let Err(denied) = authorize(pod, &store, client, src, target) {
        warn!(src = %client, %src, dst = %target, reason = %denied, "connection denied: 401");
        return reply(&mut respond, StatusCode::UNAUTHORIZED);
    }
    let info = ConnInfo {
        direction: Direction::Inbound,
        src_addr: src,
        src_workload,
        src_identity: Some(client.clone()),
        dst_addr: target,
        hbone_addr: Some(SocketAddr::new(dialed_ip, ports::HBONE)),
        dst_workload: Some(pod.current_workload(&store).clone()),
        dst_identity: Some(pod.identity().as_ref().clone()),
        dst_service: None,
        node_local: false,
    };
    let guard = ConnGuard::open(&proxy.metrics, info);
    let _listed = pod.open.list(crate::proxy::open_connections::Entry {
        direction: Direction::Inbound,
        src,
        original_dst: target,
        actual_dst: target,
        protocol: "HBONE",
    });
    // Held until the stream ends: a policy change that denies it closes it.
    let allowed = Authorized::register(proxy, &pod.uid, Some(client), src.ip(), target);
    let limit = proxy.settings.connect_timeout;
    let opened = std::time::SystemTime::now();
    let (app, base) = match resumed {
        Some((app, stream, opened)) => (Ok(app), Some((stream, opened))),
        None => (crate::proxy::transparent::connect_app(pod, src.ip(), target, limit).await, None),
    };
    let app = match app {
        Ok(s) => s,
        Err(e) => {
            let timeout = e.kind() == io::ErrorKind::TimedOut;
            proxy.metrics.error(
                Direction::Inbound,
                if timeout { "upstream_timeout" } else { "upstream_refused" },
            );
            warn!(%target, error = %e, "app unreachable: 503");
            guard.finish(Some(&e.to_string()));
            return reply(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    // A client that can resume the stream gets its token (`resume`).
    let token = resume::issue(req.headers());
    let mut resp = http::Response::builder().status(StatusCode::OK);
    if let Some(t) = &token {
        // A secret, unique per stream: never in HPACK's tables (see `hbone::open_stream`).
        let mut value = http::HeaderValue::from_str(&t.hex()).map_err(io::Error::other)?;
        value.set_sensitive(true);
        resp = resp.header(hbone::STREAM_TOKEN, value);
    }
    let resp = resp.body(()).map_err(io::Error::other)?;
    let send = respond.send_response(resp, false).map_err(io::Error::other)?;
    // The app's bytes go towards the client; the stream's come from it.
    let meters = (&guard.to_client, &guard.from_client);
    let stop = token.is_some().then_some(&proxy.handover.streams);
    let idle = proxy.settings.idle_timeout;
    let copy = copy::splice_resumable(app, send, req.into_body(), meters, idle, stop);
    tokio::select! {
        r = copy => match r {
            Ok(copy::Spliced::Done(..)) => guard.finish(None),
            Ok(copy::Spliced::Paused { tcp, out, back }) => {
                guard.finish(None);
                let (to_client, to_server) = match &base {
                    Some((b, _)) => (b.to_client + out, b.to_server + back),
                    None => (out, back),
                };
                let Some(token) = token else { return Err(io::Error::other("paused without a token")) };
                let side = resume::ServerSide {
                    stream: resume::Resumable { token, to_server, to_client },
                    client: client.clone(),
                    src,
                    target,
                    opened: base.map_or(opened, |(_, at)| at),
                };
                resume::park(pod, tcp, side);
            }
            Err(e) => {
                guard.finish(Some(&e.to_string()));
                return Err(e);
            }
        },
        () = when_woken(allowed.closed.cancelled()) => guard.finish(Some("a policy change denies it")),
    }
    Ok(())
}

/// The pod's inbound authorization of a connection from `client` (an identity this proxy
/// trusts: proven by its certificate, or a pod of its own on the node-local path) at `src` to
/// `target`, against its policies in `store`; a denial is counted (`policy_denied`).
pub fn authorize(
    pod: &Pod,
    store: &crate::state::store::WorkloadStore,
    client: &Identity,
    src: SocketAddr,
    target: SocketAddr,
) -> Result<(), authorization::Denied> {
    let conn = authorization::Connection { src_identity: Some(client), src: src.ip(), dst: target };
    let checked = authorization::check(&store.policies_for(pod.current_workload(store)), &conn);
    if checked.is_err() {
        pod.proxy.metrics.error(Direction::Inbound, "policy_denied");
    }
    checked
}

/// `forwarded: for="IP:PORT"` (or `for=IP`).
fn forwarded_for<B>(req: &http::Request<B>) -> Option<SocketAddr> {
    parse_forwarded_for(req.headers().get("forwarded")?.to_str().ok()?)
}

/// The `for=` of a `forwarded` header value (RFC 7239): `"IP:PORT"`, `"[V6]:PORT"`, or an
/// address alone (port 0). Anything else: `None`.
pub fn parse_forwarded_for(value: &str) -> Option<SocketAddr> {
    let f = value.split(';').find_map(|p| p.trim().strip_prefix("for="))?.trim_matches('"');
    f.parse()
        .ok()
        .or_else(|| f.trim_matches(['[', ']']).parse().ok().map(|ip| SocketAddr::new(ip, 0)))
}
