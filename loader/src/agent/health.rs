//! `/healthz` (the agent is alive) and `/readyz` (reconciled and serving the CNI socket), for
//! the DaemonSet's probes, and `/metrics` (the datapath's decision counts, and the connections
//! held for the next proxy, for Prometheus).

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::Agent;

fn answer(agent: &Agent, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.uri().path() == "/metrics" {
        return match agent.with_datapath(|dp| Ok(crate::decisions::prometheus(dp)?)) {
            Ok(mut text) => {
                text.push_str(&agent.zds.connections.prometheus());
                let mut r = Response::new(Full::new(Bytes::from(text)));
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                r
            }
            Err(e) => {
                let mut r = Response::new(Full::new(Bytes::from(format!("{e:#}\n"))));
                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                r
            }
        };
    }
    let (status, body) = match req.uri().path() {
        "/healthz" => (StatusCode::OK, "ok\n".to_owned()),
        "/readyz" if agent.is_ready() => (StatusCode::OK, "ready\n".to_owned()),
        "/readyz" => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", agent.not_ready_reason()))
        }
        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

/// How long a probe client has to send its request headers (hyper sets no limit without a
/// timer: a client that never finishes its headers would hold the connection forever).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves the probes on `addr`; returns the address bound.
pub async fn serve(agent: Arc<Agent>, addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let agent = agent.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let r = answer(&agent, &req);
                    async move { Ok::<_, Infallible>(r) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(conn), svc)
                    .await;
            });
        }
    });
    Ok(bound)
}
