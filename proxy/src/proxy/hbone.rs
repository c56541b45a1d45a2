//! HBONE: one TCP connection carried as an HTTP/2 CONNECT stream over mutual TLS to port 15008,
//! as Istio ambient's ztunnel speaks it. HTTP/2 settings: stream window 4 MiB, connection window
//! 16 MiB, max frame 1 MiB — ztunnel's, and the best of those measured (results/README.md, "Why
//! the proxy has its shape"). The bytes are moved by `copy`.

use std::{io, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use tokio::net::TcpStream;

use super::stop::when_woken;

/// HTTP/2 stream window.
pub const STREAM_WINDOW: u32 = 4 << 20;
/// HTTP/2 connection window.
pub const CONNECTION_WINDOW: u32 = 16 << 20;
/// HTTP/2 max frame size.
pub const MAX_FRAME: u32 = 1 << 20;
/// How much encrypted output rustls may hold for an HBONE connection before a write waits for
/// the socket (rustls' default: 64 KiB, with which a bulk transfer reached the socket in small
/// `writev`s): larger writes cost less CPU per byte, and more than this bought nothing
/// (results/README.md, "Why the proxy has its shape"). It is held only while the peer reads
/// more slowly than we write, once per HTTP/2 connection (not per stream).
pub const TLS_BUFFER_LIMIT: usize = 256 << 10;

/// The HTTP/2 server side of HBONE with the windows and frame size above (h2's defaults, a
/// 64 KiB window, would throttle a stream to a trickle); callers add their own limits.
pub fn server_builder() -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME);
    builder
}

/// Why an HBONE connection failed.
#[derive(Debug, thiserror::Error)]
pub enum HboneError {
    #[error("connecting to {0}: {1}")]
    Connect(SocketAddr, io::Error),
    /// Every pooled connection to the peer was full and the streams before this one, each
    /// opening a new one in turn, had not done so within the wait (`pool::Pool::get`).
    #[error("connecting to {0}: no pooled connection had room in time")]
    NoTurn(SocketAddr),
    #[error("TLS to {0}: {1}")]
    Tls(SocketAddr, io::Error),
    #[error("HTTP/2 with {0}: {1}")]
    H2(SocketAddr, h2::Error),
    #[error("{peer} answered CONNECT {authority} with {status}")]
    Status { peer: SocketAddr, authority: String, status: http::StatusCode },
    #[error("building the CONNECT request: {0}")]
    Request(#[from] http::Error),
}

impl HboneError {
    /// Whether this is a timeout (no answer), rather than a refusal.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::NoTurn(_))
            || matches!(self, Self::Connect(_, e) | Self::Tls(_, e) if e.kind() == io::ErrorKind::TimedOut)
    }

    /// Whether the peer never processed the stream, so that it may be sent again on another
    /// connection (RFC 9113 §8.7): the connection was going away when it was sent (a GOAWAY,
    /// with no error, whose last stream is below it: h2 fails exactly those streams, and every
    /// new one, with the GOAWAY), or the peer refused it (`REFUSED_STREAM`).
    pub fn is_unprocessed(&self) -> bool {
        match self {
            Self::H2(_, e) => {
                (e.is_go_away() && e.is_remote() && e.reason() == Some(h2::Reason::NO_ERROR))
                    || (e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM))
            }
            _ => false,
        }
    }

    /// Whether the peer took the TCP connection and never answered the TLS handshake: nothing
    /// but a ClientHello was sent, so the CONNECT may go on a new connection. A peer node whose
    /// proxy is being replaced does this: its agent holds the HBONE listener, whose backlog
    /// keeps the connection until the next proxy runs, and that can take longer than one
    /// connect timeout (10 to 14 s between the old proxy's drain and the next one serving, in a
    /// rolling update on two nodes).
    pub fn is_unanswered_handshake(&self) -> bool {
        matches!(self, Self::Tls(_, e) if e.kind() == io::ErrorKind::TimedOut)
    }

    /// Whether the peer looks like a node whose proxy is being replaced: this connection's
    /// handshake went unanswered, or it waited behind others' connections to the peer that did
    /// not open in time (each of those dialing a handshake that goes unanswered).
    pub fn is_peer_away(&self) -> bool {
        self.is_unanswered_handshake() || matches!(self, Self::NoTurn(_))
    }

    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Connect(..) | Self::NoTurn(_) => "hbone_connect",
            Self::Tls(..) => "hbone_tls",
            Self::H2(..) => "hbone_http2",
            Self::Status { status, .. } if *status == http::StatusCode::UNAUTHORIZED => {
                "hbone_denied"
            }
            Self::Status { .. } => "hbone_status",
            Self::Request(..) => "hbone_request",
        }
    }
}

/// meshpath's extension of HBONE (`resume`), in headers a peer that does not know them (Istio's
/// ztunnel) ignores: a client that can pause and resume a stream says so on its CONNECT ...
pub const RESUMABLE: &str = "meshpath-resumable";
/// ... and a server that can answers 200 with the stream's resume token (32 hex digits).
pub const STREAM_TOKEN: &str = "meshpath-stream";
/// The trailers that end one direction of a resumable stream without ending the connection:
/// the sender stopped reading its app, and everything it read is in the stream (the value: the
/// bytes it sent on this stream).
pub const PAUSED: &str = "meshpath-paused";
/// A CONNECT that resumes a paused stream: `<token>; to-server=<n>; to-client=<n>`.
pub const RESUME: &str = "meshpath-resume";

/// The optional headers of a CONNECT request, as ztunnel sends them.
#[derive(Debug, Clone, Default)]
pub struct StreamHeaders {
    /// `forwarded: for="<src ip:port>"`.
    pub forwarded_for: Option<SocketAddr>,
    /// W3C `baggage` describing the source workload.
    pub baggage: Option<String>,
    /// W3C `traceparent`.
    pub traceparent: Option<String>,
    /// meshpath's (`RESUMABLE`, `RESUME`).
    pub extra: Vec<(&'static str, String)>,
}

impl StreamHeaders {
    /// The headers for a connection from `src` in workload `w`: its address, its baggage, and a
    /// new trace.
    pub fn for_source(src: SocketAddr, w: &crate::state::workloads::Workload) -> Self {
        let service = if w.canonical_name.is_empty() { &w.name } else { &w.canonical_name };
        let baggage = format!(
            "k8s.cluster.name=Kubernetes,k8s.namespace.name={},k8s.pod.name={},service.name={},service.version=latest",
            w.namespace, w.name, service
        );
        Self {
            forwarded_for: Some(src),
            baggage: Some(baggage),
            traceparent: Some(traceparent()),
            extra: Vec::new(),
        }
    }
}

/// A new W3C trace context: version 00, random trace and span ids, not sampled.
fn traceparent() -> String {
    use ring::rand::SecureRandom as _;
    let mut ids = [0u8; 24];
    let _ = ring::rand::SystemRandom::new().fill(&mut ids);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("00-{}-{}-00", hex(&ids[..16]), hex(&ids[16..]))
}

/// `:authority` for a destination: `ip:port`, IPv6 in brackets.
pub fn authority(dst: SocketAddr) -> String {
    dst.to_string()
}

/// An HTTP/2 connection to a peer's HBONE port, on which CONNECT streams are opened.
pub type Connection = h2::client::SendRequest<Bytes>;

/// HTTP/2 PING on an HBONE connection: how often, and how long the peer has to answer before
/// the connection is closed (so the pool drops it). ztunnel's values by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    pub interval: std::time::Duration,
    pub timeout: std::time::Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Self {
            interval: std::time::Duration::from_secs(10),
            timeout: std::time::Duration::from_secs(20),
        }
    }
}

/// PINGs the peer every `keepalive.interval` and resolves, with why, once it stops answering
/// within `keepalive.timeout` (never without `pings`: h2 hands them out once per connection).
/// Both ends of an HBONE connection run it: the client to drop a dead pooled connection, the
/// server to close one whose peer is gone (ztunnel's server PINGs too).
pub async fn stopped_answering(pings: Option<h2::PingPong>, keepalive: Keepalive) -> String {
    let Some(mut pings) = pings else { return std::future::pending().await };
    loop {
        tokio::time::sleep(keepalive.interval).await;
        let pong = tokio::time::timeout(keepalive.timeout, pings.ping(h2::Ping::opaque()));
        match pong.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return format!("PING failed: {e}"),
            Err(_) => return format!("no PING answer in {:?}", keepalive.timeout),
        }
    }
}

/// Opens an HBONE connection to `gateway` (a destination's `ip:15008`) over the connected TCP
/// socket `tcp`, with `tls` (which verifies the peer's identity), and the default keepalive.
pub async fn handshake(
    tcp: TcpStream,
    gateway: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
) -> Result<Connection, HboneError> {
    handshake_with(tcp, gateway, tls, Keepalive::default()).await
}

/// As [`handshake`], with `keepalive`: a peer that stops answering PINGs (its TCP connection
/// still up, so nothing else would notice) has its connection closed.
pub async fn handshake_with(
    tcp: TcpStream,
    gateway: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    keepalive: Keepalive,
) -> Result<Connection, HboneError> {
    let name = rustls::pki_types::ServerName::IpAddress(gateway.ip().into());
    let mut tls = tokio_rustls::TlsConnector::from(tls)
        .connect(name, super::read_ahead::ReadAhead::new(tcp))
        .await
        .map_err(|e| HboneError::Tls(gateway, e))?;
    tls.get_mut().1.set_buffer_limit(Some(TLS_BUFFER_LIMIT));
    let (client, mut conn) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(100)
        .max_header_list_size(16 * 1024)
        .enable_push(false)
        .handshake(tls)
        .await
        .map_err(|e| HboneError::H2(gateway, e))?;
    let dead = when_woken(stopped_answering(conn.ping_pong(), keepalive));
    tokio::spawn(async move {
        tokio::select! {
            ended = &mut conn => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "HBONE client connection ended");
                }
            }
            // Dropping the connection closes it: the pool finds it closed and drops it.
            why = dead => tracing::warn!(peer = %gateway, %why, "HBONE connection closed: its peer stopped answering"),
        }
    });
    Ok(client)
}

/// Opens a CONNECT stream to `dst` on `conn`; returns its two halves once the peer answered 200.
pub async fn open_stream(
    conn: Connection,
    gateway: SocketAddr,
    dst: SocketAddr,
    headers: &StreamHeaders,
) -> Result<(SendStream<Bytes>, RecvStream), HboneError> {
    let (send, recv, _) = open_stream_answered(conn, gateway, dst, headers).await?;
    Ok((send, recv))
}

/// As [`open_stream`], with the headers of the peer's answer.
pub async fn open_stream_answered(
    conn: Connection,
    gateway: SocketAddr,
    dst: SocketAddr,
    headers: &StreamHeaders,
) -> Result<(SendStream<Bytes>, RecvStream, http::HeaderMap), HboneError> {
    let mut client = conn.ready().await.map_err(|e| HboneError::H2(gateway, e))?;
    let mut req = http::Request::builder().method(http::Method::CONNECT).uri(authority(dst));
    if let Some(src) = headers.forwarded_for {
        req = req.header("forwarded", format!("for=\"{src}\""));
    }
    if let Some(b) = &headers.baggage {
        req = req.header("baggage", b);
    }
    if let Some(t) = &headers.traceparent {
        req = req.header("traceparent", t);
    }
    for (name, value) in &headers.extra {
        let mut value = http::HeaderValue::from_str(value).map_err(http::Error::from)?;
        // A resume token is a secret: never in HPACK's tables (a compression side channel),
        // and a table of unique tokens would cost each pooled connection its full 4 KiB.
        value.set_sensitive(*name == RESUME);
        req = req.header(*name, value);
    }
    let (resp, send) =
        client.send_request(req.body(())?, false).map_err(|e| HboneError::H2(gateway, e))?;
    let resp = resp.await.map_err(|e| HboneError::H2(gateway, e))?;
    if resp.status() != http::StatusCode::OK {
        return Err(HboneError::Status {
            peer: gateway,
            authority: authority(dst),
            status: resp.status(),
        });
    }
    let (parts, body) = resp.into_parts();
    Ok((send, body, parts.headers))
}

/// A new connection and one stream on it (no pooling).
pub async fn connect(
    tcp: TcpStream,
    gateway: SocketAddr,
    dst: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    headers: &StreamHeaders,
) -> Result<(SendStream<Bytes>, RecvStream), HboneError> {
    let conn = handshake(tcp, gateway, tls).await?;
    open_stream(conn, gateway, dst, headers).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real HTTP/2 client connection to an in-memory server that runs `serve` on its side.
    async fn connection_to<F, Fut>(serve: F) -> Connection
    where
        F: FnOnce(h2::server::Connection<tokio::io::DuplexStream, Bytes>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let (client, server) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            if let Ok(conn) = h2::server::handshake(server).await {
                serve(conn).await;
            }
        });
        let (send, conn) = h2::client::handshake(client).await.expect("h2 handshake");
        tokio::spawn(conn);
        send
    }

    fn addrs() -> (SocketAddr, SocketAddr) {
        ("10.0.0.2:15008".parse().expect("addr"), "10.0.0.2:8080".parse().expect("addr"))
    }

    #[tokio::test]
    async fn a_stream_sent_to_a_peer_going_away_is_unprocessed() {
        // The peer answers every stream it takes, but is going away from the start: the
        // streams opened once its GOAWAY has arrived fail as never processed.
        let conn = connection_to(|mut conn| async move {
            conn.graceful_shutdown();
            while let Some(Ok((_req, mut respond))) = conn.accept().await {
                let _ = respond.send_response(http::Response::new(()), false);
            }
        })
        .await;
        let (gateway, dst) = addrs();
        let mut answered = 0;
        let failed = loop {
            match open_stream(conn.clone(), gateway, dst, &StreamHeaders::default()).await {
                Ok(_) => answered += 1,
                Err(e) => break e,
            }
            assert!(answered < 1000, "the GOAWAY never arrived");
        };
        assert!(failed.is_unprocessed(), "{failed:?}");
    }

    #[tokio::test]
    async fn a_stream_the_peer_took_and_then_closed_its_connection_on_is_not_unprocessed() {
        // The peer took the stream (it may have connected to the app): not sent again.
        let conn = connection_to(|mut conn| async move {
            let taken = conn.accept().await;
            drop(taken);
            drop(conn);
        })
        .await;
        let (gateway, dst) = addrs();
        let failed =
            open_stream(conn, gateway, dst, &StreamHeaders::default()).await.expect_err("answered");
        assert!(!failed.is_unprocessed(), "{failed:?}");
    }

    #[tokio::test]
    async fn a_stream_the_peer_refused_is_unprocessed_and_one_it_cancelled_is_not() {
        let conn = connection_to(|mut conn| async move {
            let mut reasons = [h2::Reason::REFUSED_STREAM, h2::Reason::CANCEL].into_iter();
            while let Some(Ok((_req, mut respond))) = conn.accept().await {
                match reasons.next() {
                    Some(reason) => respond.send_reset(reason),
                    None => return,
                }
            }
        })
        .await;
        let (gateway, dst) = addrs();
        let headers = StreamHeaders::default();
        let refused = open_stream(conn.clone(), gateway, dst, &headers).await.expect_err("refused");
        assert!(refused.is_unprocessed(), "{refused:?}");
        let cancelled = open_stream(conn, gateway, dst, &headers).await.expect_err("cancelled");
        assert!(!cancelled.is_unprocessed(), "{cancelled:?}");
    }
}
