//! Inbound HBONE: each pod's `[::]:15008` in its netns terminates mutual TLS with the pod's own
//! certificate (the client must present one that verifies, from our trust domain), then serves
//! HTTP/2 CONNECT streams: 400 for anything but CONNECT, an unparseable authority, or an
//! authority whose IP is not the one the client dialed; 503 when the app cannot be reached; 200
//! only once the connection to the app is up. The connection to the app is made from inside the
//! pod's netns.

use std::{io, net::SocketAddr, sync::Arc};

use anyhow::Context as _;
use bytes::Bytes;
use datapath_common::consts::ports;
use h2::server::SendResponse;
use meshpath_loader::netns::Netns;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::{
    config::{Workload, WorkloadStore},
    hbone,
    identity::{Identity, LocalCa, WorkloadCert},
    netns::SocketFactory,
    tls,
};

/// What every pod's paths share.
#[derive(Debug)]
pub struct Shared {
    pub store: WorkloadStore,
    pub ca: LocalCa,
    pub roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// Shutdown switch and the connections it waits for.
    pub drain: crate::drain::Drain,
    /// Outbound HBONE connections, shared between streams.
    pub pool: crate::pool::Pool,
}

/// One pod served by this proxy.
#[derive(Debug)]
pub struct Pod {
    pub uid: String,
    pub netns: Netns,
    /// Creates the pod's sockets inside its netns.
    pub sockets: SocketFactory,
    pub workload: Workload,
    pub identity: Identity,
    pub cert: WorkloadCert,
    pub proxy: Arc<Shared>,
}

/// Serves one pod's HBONE listener.
pub fn start(pod: Arc<Pod>) -> anyhow::Result<()> {
    let listener = pod.sockets.listen(SocketAddr::from(([0u16; 8], ports::HBONE)))?;
    let acceptor = TlsAcceptor::from(tls::server_config(&pod.cert, &pod.proxy.roots)?);
    let proxy = pod.proxy.clone();
    proxy.drain.serve(
        listener,
        (acceptor, pod),
        "HBONE",
        |tcp, peer, (acceptor, pod)| async move {
            serve_connection(tcp, peer, acceptor, &pod)
                .await
                .with_context(|| format!("pod {}", pod.uid))
        },
    );
    Ok(())
}

async fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    pod: &Arc<Pod>,
) -> anyhow::Result<()> {
    let dialed = tcp.local_addr()?;
    // HTTP/2 writes small frames (responses, window updates): no Nagle delay on them.
    tcp.set_nodelay(true)?;
    let tls = acceptor.accept(tcp).await?;
    let client = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(tls::spiffe_ids)
        .unwrap_or_default();
    let Some(client) = client.into_iter().next() else {
        anyhow::bail!("client certificate has no SPIFFE identity");
    };
    if client.trust_domain != pod.identity.trust_domain {
        anyhow::bail!("client {client} is not in trust domain {}", pod.identity.trust_domain);
    }
    let mut conn = h2::server::Builder::new()
        .initial_window_size(hbone::STREAM_WINDOW)
        .initial_connection_window_size(hbone::CONNECTION_WINDOW)
        .max_frame_size(hbone::MAX_FRAME)
        .max_concurrent_streams(200)
        .max_header_list_size(64 * 1024)
        .handshake(tls)
        .await?;
    while let Some(stream) = conn.accept().await {
        let (req, respond) = stream?;
        let (pod, client) = (pod.clone(), client.clone());
        pod.proxy.drain.clone().spawn(async move {
            if let Err(e) = serve_stream(req, respond, dialed, peer, &client, &pod).await {
                debug!(error = %e, "HBONE stream ended with an error");
            }
        });
    }
    Ok(())
}

fn reply(respond: &mut SendResponse<Bytes>, status: http::StatusCode) -> io::Result<()> {
    let resp = http::Response::builder().status(status).body(()).map_err(io::Error::other)?;
    respond.send_response(resp, true).map(drop).map_err(io::Error::other)
}

async fn serve_stream(
    req: http::Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    dialed: SocketAddr,
    peer: SocketAddr,
    client: &Identity,
    pod: &Pod,
) -> io::Result<()> {
    use http::StatusCode;
    if req.method() != http::Method::CONNECT {
        return reply(&mut respond, StatusCode::BAD_REQUEST);
    }
    let target: Option<SocketAddr> = req.uri().authority().and_then(|a| a.as_str().parse().ok());
    let Some(target) = target else {
        return reply(&mut respond, StatusCode::BAD_REQUEST);
    };
    if canonical(target.ip()) != canonical(dialed.ip()) {
        return reply(&mut respond, StatusCode::BAD_REQUEST);
    }
    let app = match pod.sockets.socket(target)?.connect(target).await {
        Ok(s) => s,
        Err(e) => {
            warn!(pod = %pod.uid, %target, error = %e, "app unreachable");
            return reply(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    let resp =
        http::Response::builder().status(StatusCode::OK).body(()).map_err(io::Error::other)?;
    let send = respond.send_response(resp, false).map_err(io::Error::other)?;
    let (up, down) = hbone::splice(app, send, req.into_body()).await?;
    info!(src = %client, %peer, dst = %target, dst_identity = %pod.identity, up, down, "inbound hbone connection closed");
    Ok(())
}

fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}
