//! A STAND-IN for an Istio waypoint (Envoy cannot run here), for the waypoint tests and the
//! demo, never shipped: it speaks HBONE both ways as a waypoint does and nothing of L7.
//!
//! - Listens on `LISTEN` (its netns is the caller's: run it with `ip netns exec`), mutual TLS
//!   with a certificate for `spiffe://cluster.local/ns/default/sa/OWN_SA` minted from the CA
//!   (client certificate required, from the same CA).
//! - Each CONNECT is printed, `CONNECT <authority> FROM <client identity> <client address>`,
//!   then carried on over a new HBONE connection, as a waypoint sends its traffic on: to the
//!   address a `FROM=TO` route maps the authority to (a VIP to the endpoint it picked), else to
//!   the authority itself, at `TO`'s address and port 15008, the server verified as
//!   `UPSTREAM_SA`'s identity.
//!
//! Prints `READY` once listening. Usage:
//! `waypoint-standin LISTEN CA_CERT CA_KEY OWN_SA UPSTREAM_SA [FROM=TO ...]`

use std::{
    collections::HashMap,
    io::{self, Write as _},
    net::SocketAddr,
    sync::Arc,
};

use anyhow::{bail, Context as _, Result};
use datapath_common::consts::ports;
use meshpath_proxy::{
    identity::{tls, Identity, LocalCa, WorkloadCert},
    proxy::hbone,
};
use tokio::net::{TcpListener, TcpStream};

struct Waypoint {
    cert: WorkloadCert,
    roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    upstream: Identity,
    routes: HashMap<SocketAddr, SocketAddr>,
}

fn say(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, listen, ca_cert, ca_key, own_sa, upstream_sa, routes @ ..] = args.as_slice() else {
        bail!("usage: waypoint-standin LISTEN CA_CERT CA_KEY OWN_SA UPSTREAM_SA [FROM=TO ...]");
    };
    let listen: SocketAddr = listen.parse().context("LISTEN")?;
    let ca =
        LocalCa::from_pem(&std::fs::read_to_string(ca_cert)?, &std::fs::read_to_string(ca_key)?)?;
    let id = |sa: &str| Identity::new("cluster.local", "default", sa);
    let cert = ca.issue(&id(own_sa), std::time::Duration::from_secs(3600))?;
    let mut table = HashMap::new();
    for r in routes {
        let (from, to) = r.split_once('=').context("a route is FROM=TO")?;
        table.insert(from.parse()?, to.parse()?);
    }
    let waypoint = Arc::new(Waypoint {
        cert,
        roots: vec![ca.cert_der.clone()],
        upstream: id(upstream_sa),
        routes: table,
    });
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(serve(listen, waypoint))
}

async fn serve(listen: SocketAddr, waypoint: Arc<Waypoint>) -> Result<()> {
    let listener = TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
    let server = tls::server_config(&waypoint.cert, &waypoint.roots)?;
    say("READY");
    loop {
        let (tcp, peer) = listener.accept().await?;
        let (server, waypoint) = (server.clone(), waypoint.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(tcp, peer, server, waypoint).await {
                say(&format!("ERROR {peer}: {e:#}"));
            }
        });
    }
}

/// One HBONE connection from a client: each CONNECT carried on.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    server: Arc<rustls::ServerConfig>,
    waypoint: Arc<Waypoint>,
) -> Result<()> {
    let tls = tokio_rustls::TlsAcceptor::from(server).accept(tcp).await?;
    let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
    let client = tls::peer_identity(cert.context("no client certificate")?)
        .map_err(|e| anyhow::anyhow!("client identity: {e}"))?;
    let mut conn = hbone::server_builder().handshake(tls).await?;
    while let Some(stream) = conn.accept().await {
        let (req, mut respond) = stream?;
        let (waypoint, client) = (waypoint.clone(), client.clone());
        tokio::spawn(async move {
            let reply = |status: http::StatusCode| {
                http::Response::builder().status(status).body(()).unwrap_or_default()
            };
            let authority =
                req.uri().authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
            say(&format!("CONNECT {authority} FROM {client} {}", peer.ip()));
            let Ok(dst) = authority.parse::<SocketAddr>() else {
                let _ = respond.send_response(reply(http::StatusCode::BAD_REQUEST), true);
                return;
            };
            let to = waypoint.routes.get(&dst).copied().unwrap_or(dst);
            let onward = async {
                let gateway = SocketAddr::new(to.ip(), ports::HBONE);
                let config = tls::client_config(
                    &waypoint.cert,
                    &waypoint.roots,
                    vec![waypoint.upstream.clone()],
                )?;
                let tcp = TcpStream::connect(gateway).await?;
                let headers = hbone::StreamHeaders::default();
                anyhow::Ok(hbone::connect(tcp, gateway, to, config, &headers).await?)
            };
            let (send_up, recv_up) = match onward.await {
                Ok(s) => s,
                Err(e) => {
                    say(&format!("ONWARD FAILED {to}: {e:#}"));
                    let _ =
                        respond.send_response(reply(http::StatusCode::SERVICE_UNAVAILABLE), true);
                    return;
                }
            };
            let Ok(send_down) = respond.send_response(reply(http::StatusCode::OK), false) else {
                return;
            };
            let (up, down) = tokio::join!(pump(req.into_body(), send_up), pump(recv_up, send_down));
            if let Err(e) = up.and(down) {
                say(&format!("STREAM {to}: {e:#}"));
            }
        });
    }
    Ok(())
}

/// Carries one direction's bytes from an HTTP/2 stream into another, then ends it.
async fn pump(mut from: h2::RecvStream, mut to: h2::SendStream<bytes::Bytes>) -> Result<()> {
    while let Some(chunk) = from.data().await {
        let chunk = chunk?;
        let n = chunk.len();
        to.send_data(chunk, false)?;
        let _ = from.flow_control().release_capacity(n);
    }
    to.send_data(bytes::Bytes::new(), true)?;
    Ok(())
}
