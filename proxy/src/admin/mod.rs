//! The node-wide HTTP endpoints, served from the proxy's own network namespace:
//! - admin (`127.0.0.1:15000`, or a unix socket only root can reach, `--admin-socket`, which
//!   deploy uses with `--no-admin-tcp`: on a hostNetwork node any host process reaches
//!   127.0.0.1): `GET /config_dump` (`config_dump.rs`: what `istioctl ztunnel-config` reads,
//!   and meshpath's own sections), `GET /logging` (the log filter now),
//!   `POST /logging?level=FILTER` (a new one), `POST /quitquitquit` (graceful shutdown);
//! - stats (`[::]:15020`): `GET /metrics`, Prometheus text;
//! - readiness (`[::]:15021`): `GET /healthz/ready`, 200 once the pods are served, 503 while
//!   starting or draining; `GET /healthz/live`, 200 whenever the process answers at all: the
//!   liveness probe's. Not ready (istiod away at start, a refused first push, an expired
//!   certificate) is no reason to restart a proxy that carries every pod's connections.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
};
use tracing::{info, warn};

mod config_dump;

use crate::proxy::Proxy;

/// Changes the log filter; returns the filter now in force.
pub type LogControl = Arc<dyn Fn(Option<&str>) -> Result<String, String> + Send + Sync>;

/// Which endpoints a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoints {
    Admin,
    Stats,
    Readiness,
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

fn query_param<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.uri().query()?.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

fn route(
    which: Endpoints,
    proxy: &Proxy,
    log: &LogControl,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    match (which, req.method(), req.uri().path()) {
        (Endpoints::Readiness, &Method::GET, "/healthz/ready") => {
            let why = proxy.not_ready_reasons();
            if why.is_empty() {
                text(StatusCode::OK, "ready\n")
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", why.join("; ")))
            }
        }
        // Answered by the same runtime that carries the traffic: a wedged runtime answers
        // nothing and the kubelet restarts it; anything short of that is readiness's to say.
        (Endpoints::Readiness, &Method::GET, "/healthz/live") => text(StatusCode::OK, "live\n"),
        (Endpoints::Stats, &Method::GET, "/metrics") => {
            let mut r = text(StatusCode::OK, proxy.metrics.encode());
            if let Ok(v) = http::HeaderValue::from_str("text/plain; version=0.0.4; charset=utf-8") {
                r.headers_mut().insert(http::header::CONTENT_TYPE, v);
            }
            r
        }
        (Endpoints::Admin, &Method::GET, "/config_dump") => match config_dump::render(proxy) {
            Ok(json) => text(StatusCode::OK, json),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        },
        (Endpoints::Admin, &Method::GET, "/logging") => match log(None) {
            Ok(f) => text(StatusCode::OK, format!("{f}\n")),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
        },
        (Endpoints::Admin, &Method::POST, "/logging") => match query_param(req, "level") {
            None => text(StatusCode::BAD_REQUEST, "usage: POST /logging?level=FILTER\n"),
            Some(level) => match log(Some(level)) {
                Ok(f) => {
                    info!(filter = %f, "log filter changed");
                    text(StatusCode::OK, format!("{f}\n"))
                }
                Err(e) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
            },
        },
        (Endpoints::Admin, &Method::POST, "/quitquitquit") => {
            proxy.drain.begin();
            text(StatusCode::OK, "draining\n")
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// How long a client of the node-wide endpoints has to send its request headers. hyper applies
/// no such limit unless it is given a timer: a client sending headers a byte at a time (or
/// never) would otherwise hold its connection forever.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `which` on `listener` until the process ends.
pub fn serve(listener: TcpListener, which: Endpoints, proxy: Arc<Proxy>, log: LogControl) {
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((conn, peer)) => connection(conn, peer.to_string(), which, &proxy, &log),
                Err(e) => {
                    warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// Serves `which` on a unix socket `listener` until the process ends.
pub fn serve_unix(listener: UnixListener, which: Endpoints, proxy: Arc<Proxy>, log: LogControl) {
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((conn, _)) => connection(conn, "unix".into(), which, &proxy, &log),
                Err(e) => {
                    warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// One HTTP/1 connection to an endpoint.
fn connection<IO>(io: IO, peer: String, which: Endpoints, proxy: &Arc<Proxy>, log: &LogControl)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (proxy, log) = (proxy.clone(), log.clone());
    tokio::spawn(async move {
        let svc = service_fn(move |req: Request<Incoming>| {
            let resp = route(which, &proxy, &log, &req);
            async move { Ok::<_, Infallible>(resp) }
        });
        if let Err(e) = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(TokioIo::new(io), svc)
            .await
        {
            warn!(%peer, error = %e, "admin connection failed");
        }
    });
}

/// Binds a unix socket at `path` that only root can reach: its directory is made (mode 0700)
/// if missing, a stale socket is replaced, and the socket itself is mode 0600.
pub fn bind_unix(path: &std::path::Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Binds an endpoint's listener; the address actually bound is returned (port 0 picks one).
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}
