//! The proxy's tunables: their defaults and what the command line may set
//! (`meshpath-proxy --help`); the node-wide connection cap's default comes from the proxy's
//! memory limit (`memory`).

use std::{net::SocketAddr, time::Duration};

/// Pooled connections per destination before streams share one: concurrent bulk streams on
/// separate TCP connections do not queue behind each other's flow control, and few enough that
/// an idle pool stays small (the measurements: results/README.md, "Why the proxy has its
/// shape").
pub const POOL_SPREAD: usize = 4;
/// The proxy's tokio worker threads by default (ztunnel's default too; `--worker-threads`).
pub const WORKER_THREADS: u16 = 2;

/// How long an inbound HBONE connection may have no stream (`--hbone-idle-seconds`).
pub const HBONE_IDLE_SECONDS: u64 = 600;
/// Unauthenticated connections one source may hold to a pod's HBONE port
/// (`--max-handshakes-per-source`). A client's pool opens a few connections to a pod at once
/// (ours up to `POOL_SPREAD`, ztunnel one per key); a gateway or waypoint carrying many
/// clients' traffic may open more in a burst, and each handshake takes milliseconds.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 64;
/// How long a paused HBONE stream waits to be resumed (`--resume-within-seconds`): as long as
/// the node agent holds the other side's socket for the peer's next proxy
/// (`--hold-connections-seconds`), so that a side that stays outwaits the one whose proxy is
/// replaced. It was 60 s, half the agent's hold: a next proxy that started 65 s after the last
/// one (a busy two-node cluster; a slow image pull does as much) took its paused stream from
/// the agent, dialed, and was answered 404: the side that stayed had closed it 5 s before.
pub const RESUME_WITHIN_SECONDS: u64 = meshpath_zds::connections::DEFAULT_HOLD.as_secs();

/// Tunables, from the command line.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where DNS queries not answered from the store go.
    pub dns_upstreams: Vec<SocketAddr>,
    /// Streams per pooled HBONE connection before another is opened.
    pub pool_max_streams: usize,
    /// Pooled connections per destination that streams are spread over before they share one.
    pub pool_spread: usize,
    /// How long a pooled connection without streams is kept.
    pub pool_idle: Duration,
    /// Limit on the TLS and HTTP/2 handshakes of an inbound connection.
    pub handshake_timeout: Duration,
    /// Limit on an upstream TCP connect.
    pub connect_timeout: Duration,
    /// Connect to apps with the client's address as source (`IP_TRANSPARENT`, as ztunnel).
    pub preserve_source: bool,
    /// HTTP/2 PING on pooled HBONE connections.
    pub keepalive: super::hbone::Keepalive,
    /// Connections carried at once, over all pods (each takes two file descriptors or so).
    pub max_connections: usize,
    /// Connections carried at once for one pod in each direction: inbound (15008, 15006 and
    /// each inbound HBONE stream) and outbound (15001 and TCP 15053) have a cap each.
    pub max_connections_per_pod: usize,
    /// Connections one source address may hold open to a pod's HBONE port before they have
    /// proven an identity (through the TLS handshake), out of the pod's inbound cap.
    pub max_handshakes_per_source: usize,
    /// A connection that carries nothing either way for this long is closed (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// An inbound HBONE connection with no stream for this long is told to go away (GOAWAY)
    /// and closed, giving back its slot under the caps (`None`: never). Longer than a client's
    /// pool idle time (ours and ztunnel's: 5 minutes), so that normally the client closes first.
    pub hbone_idle: Option<Duration>,
    /// How long a paused HBONE stream waits to be resumed (`proxy::resume`): its client side
    /// dials again for this long, its server side holds the app's socket for this long.
    pub resume_within: Duration,
    /// Connections between two pods this proxy serves go directly from one to the other
    /// (`proxy::node_local`), not over HBONE (`--node-local-hbone` turns it off).
    pub node_local: bool,
    /// The mesh's trust domain (`TRUST_DOMAIN`), for a pod handed over ZDS that the store does
    /// not know yet (the store's workloads carry their own, from istiod).
    pub trust_domain: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            dns_upstreams: Vec::new(),
            pool_max_streams: 100,
            pool_spread: POOL_SPREAD,
            pool_idle: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            preserve_source: true,
            keepalive: super::hbone::Keepalive::default(),
            max_connections: 200_000,
            max_connections_per_pod: 20_000,
            max_handshakes_per_source: MAX_HANDSHAKES_PER_SOURCE,
            idle_timeout: Some(Duration::from_secs(3600)),
            hbone_idle: Some(Duration::from_secs(HBONE_IDLE_SECONDS)),
            resume_within: Duration::from_secs(RESUME_WITHIN_SECONDS),
            node_local: true,
            trust_domain: "cluster.local".into(),
        }
    }
}
