//! Resumable HBONE streams: between two meshpath proxies, an open HBONE stream outlives the
//! upgrade of either one. Istio's ztunnel resets every such connection when it is upgraded.
//!
//! Negotiated per stream (`hbone::RESUMABLE` on the CONNECT, `hbone::STREAM_TOKEN` on the 200):
//! a peer that does not know the extension (Istio's ztunnel) ignores the header, answers no
//! token, and the stream ends with the drain as before.
//!
//! Pausing (`copy::splice_resumable`): the side whose proxy is going away (SIGTERM, with an agent
//! that offered to hold streams: `HandOver::streams`) stops reading its app, sends what it read,
//! and ends its direction of the stream with `hbone::PAUSED` trailers instead of an end; the
//! peer, seeing them, does the same for the other direction. Then every byte either app sent is
//! either delivered or still unread in its own socket, both ends know the counts, and each holds
//! its app's socket open: the apps see a connection that is slow for a moment, never an end.
//!
//! Resuming: the client side dials the server side's HBONE address again, on a connection of its
//! own, with `hbone::RESUME` (the token and the bytes carried each way); the server side finds
//! the paused stream by its token and carries on. The side going away hands its app's socket to
//! the node agent (`handover`, `HeldConnection::stream`), which gives it to the next proxy: a
//! client side dials from there, a server side waits there. A paused stream waits at most
//! `Settings::resume_within` (by default 120 s, the agent's hold of the other side; each from
//! when it paused or from when the next proxy took it): the client side stops dialing, the
//! server side closes its app's socket.
//!
//! Security: a paused stream resumes only with the identity that held it (its mTLS peer), from
//! the same source address, to the same destination, with its token (128 random bits, sent only
//! inside mutual TLS, replaced at each resume), and only if both ends agree on the bytes carried;
//! the resumed stream is authorized against the destination's policy as it is then. At most
//! [`MAX_WAITING_PER_POD`] streams wait in a pod.
//!
//! Not kept: a stream whose own side had already ended its direction when the stop came (it
//! cannot pause what it has ended; it drains as before), and anything after kill -9.

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, SocketAddr},
    os::fd::{AsFd as _, OwnedFd},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use bytes::Bytes;
use h2::{RecvStream, SendStream};
use http::StatusCode;
use meshpath_zds::proto::{ConnectionDirection, HeldConnection, HeldStream};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument as _};

use crate::{
    identity::Identity,
    metrics::{ConnGuard, ConnInfo, Direction, Meter},
    proxy::{
        copy::{self, Spliced},
        handover,
        hbone::{self, StreamHeaders},
        pod::Pod,
    },
};

/// At most this many paused streams wait in one pod at once; more are closed.
pub const MAX_WAITING_PER_POD: usize = meshpath_zds::connections::MAX_PER_POD;

/// The longest wait between two of the client side's dials.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A stream's resume token: 128 random bits, issued by the server side.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 16]);

impl Token {
    fn new() -> Self {
        use ring::rand::SecureRandom as _;
        let mut b = [0u8; 16];
        // The system's generator does not fail on Linux; a zero token would still be unique
        // to nobody, and only its holder's identity can use it.
        let _ = ring::rand::SystemRandom::new().fill(&mut b);
        Self(b)
    }

    fn from_bytes(b: &[u8]) -> Option<Self> {
        b.try_into().ok().map(Self)
    }

    fn parse(hex: &str) -> Option<Self> {
        if hex.len() != 32 || !hex.is_ascii() {
            return None;
        }
        let mut b = [0u8; 16];
        for (i, byte) in b.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(b))
    }

    /// As `hbone::STREAM_TOKEN` carries it.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for Token {
    // A secret: logs show only that there is one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// A resumable stream as both ends know it: its token, and the bytes carried each way since
/// it opened (over every proxy that carried it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumable {
    pub token: Token,
    pub to_server: u64,
    pub to_client: u64,
}

impl Resumable {
    fn header(&self) -> String {
        format!("{}; to-server={}; to-client={}", self.token.hex(), self.to_server, self.to_client)
    }

    fn parse_header(v: &str) -> Option<Self> {
        let mut parts = v.split(';').map(str::trim);
        let token = Token::parse(parts.next()?)?;
        let (mut to_server, mut to_client) = (None, None);
        for p in parts {
            let (k, n) = p.split_once('=')?;
            let n: u64 = n.parse().ok()?;
            match k {
                "to-server" => to_server = Some(n),
                "to-client" => to_client = Some(n),
                _ => return None,
            }
        }
        Some(Self { token, to_server: to_server?, to_client: to_client? })
    }
}

/// The token a server answered a CONNECT with, if it did (it can resume the stream).
pub fn token_of(answer: &http::HeaderMap) -> Option<Token> {
    Token::parse(answer.get(hbone::STREAM_TOKEN)?.to_str().ok()?)
}

/// The header a client offers resumable streams with (`StreamHeaders::extra`).
pub fn offer() -> (&'static str, String) {
    (hbone::RESUMABLE, "1".into())
}

/// A server side: whether the CONNECT offered a resumable stream; if so, the token to answer.
pub fn issue(req: &http::HeaderMap) -> Option<Token> {
    req.contains_key(hbone::RESUMABLE).then(Token::new)
}

/// The client side of a resumable stream: what dialing the server side again takes.
#[derive(Debug, Clone)]
pub struct ClientSide {
    pub stream: Resumable,
    /// The server side's HBONE address.
    pub gateway: SocketAddr,
    /// The CONNECT's authority.
    pub dst: SocketAddr,
    /// The only identity the stream resumes with.
    pub dst_identity: Identity,
    /// The app's address.
    pub src: SocketAddr,
    pub opened: SystemTime,
}

/// The server side of a resumable stream: what a resume must match.
#[derive(Debug, Clone)]
pub struct ServerSide {
    pub stream: Resumable,
    /// The only identity the stream resumes with.
    pub client: Identity,
    /// The client app's address (its proxy dials from it).
    pub src: SocketAddr,
    /// The app's address in this pod.
    pub target: SocketAddr,
    pub opened: SystemTime,
}

/// A pod's paused streams whose client side is to dial again, by token.
#[derive(Debug, Default)]
pub struct Waiting(Mutex<HashMap<Token, Parked>>);

#[derive(Debug)]
struct Parked {
    app: TcpStream,
    side: ServerSide,
    /// Cancelled when resumed: its timer ends.
    claimed: CancellationToken,
}

impl Waiting {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Token, Parked>> {
        // Plain data behind the lock: a panic while holding it leaves nothing half done.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn remove(&self, token: &Token) -> Option<Parked> {
        self.lock().remove(token)
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A server side paused: its app's socket waits in the pod for the client side to dial again,
/// up to `Settings::resume_within`; if this proxy is going away meanwhile, it goes to the node agent.
pub fn park(pod: &Arc<Pod>, app: TcpStream, side: ServerSide) {
    let token = side.stream.token;
    let claimed = CancellationToken::new();
    {
        let mut waiting = pod.waiting.lock();
        if waiting.len() >= MAX_WAITING_PER_POD {
            warn!(src = %side.src, dst = %side.target, "paused HBONE stream closed: {MAX_WAITING_PER_POD} already wait in the pod");
            return;
        }
        debug!(src = %side.src, dst = %side.target, "paused HBONE stream waits for its client side");
        waiting.insert(token, Parked { app, side, claimed: claimed.clone() });
    }
    let pod = pod.clone();
    let proxy = pod.proxy.clone();
    let within = proxy.settings.resume_within;
    // A drain task: a proxy going away hands it over before it exits.
    proxy.drain.spawn(
        async move {
            let why = tokio::select! {
                () = claimed.cancelled() => return,
                () = tokio::time::sleep(within) => "its client side did not dial again in time",
                () = pod.gone.cancelled() => "the pod left",
                () = pod.proxy.drain.stopping() => {
                    if !pod.proxy.handover.streams.is_fired() {
                        "the proxy stops and the node agent holds no streams"
                    } else if let Some(p) = pod.waiting.remove(&token) {
                        let held = held_server(&pod.uid, &p.side);
                        match Box::pin(pod.proxy.handover.give(&held, &[p.app.as_fd()])).await {
                            Ok(()) => info!(src = %p.side.src, dst = %p.side.target, "paused HBONE stream handed over to the node agent"),
                            Err(e) => warn!(error = %e, "paused HBONE stream not handed over: closed"),
                        }
                        return;
                    } else {
                        return;
                    }
                }
            };
            if let Some(p) = pod.waiting.remove(&token) {
                warn!(src = %p.side.src, dst = %p.side.target, "paused HBONE stream closed: {why}");
            }
        }
        .in_current_span(),
    );
}

/// A CONNECT with `hbone::RESUME` (`value`) from `client` at `peer`, to `target`: the paused
/// stream it names (its app's socket, the bytes carried so far, when it opened), or the status
/// to refuse it with and why.
pub fn claim(
    pod: &Pod,
    value: &http::HeaderValue,
    client: &Identity,
    peer: IpAddr,
    target: SocketAddr,
) -> Result<(TcpStream, Resumable, SystemTime), (StatusCode, &'static str)> {
    let asked = value
        .to_str()
        .ok()
        .and_then(Resumable::parse_header)
        .ok_or((StatusCode::BAD_REQUEST, "malformed resume header"))?;
    let mut waiting = pod.waiting.lock();
    // Not found: its side may not have reached this proxy yet (the agent gives it after the
    // pod's AddWorkload); the client dials again.
    let p = waiting
        .get(&asked.token)
        .ok_or((StatusCode::NOT_FOUND, "no paused stream has this token (yet)"))?;
    if p.side.client != *client || p.side.src.ip() != peer || p.side.target != target {
        // Left waiting: whoever holds the token is not who held the stream.
        return Err((StatusCode::FORBIDDEN, "another identity, address or destination"));
    }
    let p = waiting.remove(&asked.token).ok_or((StatusCode::NOT_FOUND, "resumed meanwhile"))?;
    p.claimed.cancel();
    if p.side.stream.to_server != asked.to_server || p.side.stream.to_client != asked.to_client {
        // Bytes lost or doubled somewhere: an app must not see that; the stream ends.
        return Err((StatusCode::CONFLICT, "the two ends disagree on the bytes carried: closed"));
    }
    // What the caller needs of it: the rest is what it checked.
    Ok((p.app, p.side.stream, p.side.opened))
}

/// Carries a paused client side on: dials the server side again (for up to `Settings::resume_within`)
/// and splices the app's socket into the resumed stream, as often as it is paused; or, when
/// this proxy is going away, hands it to the node agent. `meters` count as the connection's.
pub async fn carry_client(
    pod: &Pod,
    mut app: TcpStream,
    mut side: ClientSide,
    meters: (&Meter, &Meter),
) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let streams = &proxy.handover.streams;
    // Cleared if the agent refuses it: then carried on here, until it ends or the drain's
    // deadline, as a plain connection is.
    let mut may_give = true;
    loop {
        if may_give && streams.is_fired() {
            let held = held_client(&pod.uid, &side);
            match Box::pin(proxy.handover.give(&held, &[app.as_fd()])).await {
                Ok(()) => {
                    info!(
                        to_server = side.stream.to_server,
                        to_client = side.stream.to_client,
                        "paused HBONE stream handed over to the node agent"
                    );
                    return Ok(());
                }
                Err(e) => {
                    warn!(error = %e, "paused HBONE stream not handed over: resumed here");
                    may_give = false;
                }
            }
        }
        let Some((send, recv, token)) = Box::pin(reopen(pod, &side, may_give)).await? else {
            continue;
        };
        side.stream.token = token;
        debug!("HBONE stream resumed");
        let stop = may_give.then_some(streams);
        match copy::splice_resumable(app, send, recv, meters, proxy.settings.idle_timeout, stop)
            .await?
        {
            Spliced::Done(..) => return Ok(()),
            Spliced::Paused { tcp, out, back } => {
                app = tcp;
                side.stream.to_server += out;
                side.stream.to_client += back;
            }
        }
    }
}

/// Why one dial of the server side failed.
enum Attempt {
    /// It may answer later (not up yet, the paused stream not there yet).
    Again(String),
    Never(String),
}

type Opened = (SendStream<Bytes>, RecvStream, Token);

/// The resumed stream; `None` if this proxy started going away meanwhile (and `may_stop`).
async fn reopen(pod: &Pod, side: &ClientSide, may_stop: bool) -> anyhow::Result<Option<Opened>> {
    let streams = &pod.proxy.handover.streams;
    let within = pod.proxy.settings.resume_within;
    let deadline = Instant::now() + within;
    let mut backoff = Duration::from_millis(20);
    loop {
        if may_stop && streams.is_fired() {
            return Ok(None);
        }
        // A dial is bounded by what is left of the window: a server side that takes the
        // connection but never answers (its node's agent holding its listener while no proxy
        // runs there) would otherwise hold the stream for the handshake's own timeout past it.
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(left, dial(pod, side))
            .await
            .unwrap_or_else(|_| Err(Attempt::Again("a dial outlasted the window".into())));
        let why = match attempt {
            Ok(opened) => return Ok(Some(opened)),
            Err(Attempt::Never(why)) => anyhow::bail!("not resumed: {why}"),
            Err(Attempt::Again(why)) => why,
        };
        if Instant::now() + backoff >= deadline {
            anyhow::bail!("not resumed within {within:?}: {why}");
        }
        debug!(why, "the paused stream's server side is not there yet; again");
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = streams.fired(), if may_stop => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One dial: a connection of its own to the server side, and the CONNECT that resumes.
async fn dial(pod: &Pod, side: &ClientSide) -> Result<Opened, Attempt> {
    let proxy = &pod.proxy;
    let timeout = proxy.settings.connect_timeout;
    let gateway = side.gateway;
    let again = |e: &dyn fmt::Display| Attempt::Again(e.to_string());
    let connect = async { pod.sockets.socket(gateway)?.connect(gateway).await };
    let tcp = tokio::time::timeout(timeout, connect)
        .await
        .map_err(|_| Attempt::Again(format!("connecting to {gateway}: timed out")))?
        .map_err(|e| again(&format!("connecting to {gateway}: {e}")))?;
    let config = pod.client_tls(&side.dst_identity).map_err(|e| again(&format!("{e:#}")))?;
    let conn = tokio::time::timeout(
        timeout,
        hbone::handshake_with(tcp, gateway, config, proxy.settings.keepalive),
    )
    .await
    .map_err(|_| Attempt::Again("TLS handshake: timed out".into()))?
    .map_err(|e| again(&e))?;
    let mut headers = StreamHeaders::for_source(side.src, pod.current_workload(&proxy.store()));
    headers.extra = vec![offer(), (hbone::RESUME, side.stream.header())];
    let answer = tokio::time::timeout(
        timeout,
        hbone::open_stream_answered(conn, gateway, side.dst, &headers),
    )
    .await
    .map_err(|_| Attempt::Again("no answer to CONNECT".into()))?;
    let (send, recv, answer) = match answer {
        Ok(a) => a,
        Err(hbone::HboneError::Status { status, .. })
            if status == StatusCode::NOT_FOUND || status == StatusCode::SERVICE_UNAVAILABLE =>
        {
            return Err(Attempt::Again(format!("answered {status}")));
        }
        Err(e @ hbone::HboneError::Status { .. }) => return Err(Attempt::Never(e.to_string())),
        Err(e) => return Err(again(&e)),
    };
    let token = token_of(&answer).ok_or(Attempt::Never("resumed without a token".into()))?;
    Ok((send, recv, token))
}

/// A paused side as the agent holds it: `client` sides dial `gateway` again; `peer` is the only
/// identity it resumes with.
#[allow(clippy::too_many_arguments)]
fn held(
    uid: &str,
    direction: ConnectionDirection,
    (src, dst): (SocketAddr, SocketAddr),
    stream: &Resumable,
    opened: SystemTime,
    client: bool,
    gateway: String,
    peer: &Identity,
) -> HeldConnection {
    HeldConnection {
        uid: uid.into(),
        direction: direction as i32,
        src: src.to_string(),
        dst: dst.to_string(),
        sent: stream.to_server,
        received: stream.to_client,
        opened_unix_ms: handover::unix_ms(opened),
        stream: Some(HeldStream {
            token: stream.token.0.to_vec(),
            client,
            gateway,
            peer_identity: peer.to_string(),
            to_server: stream.to_server,
            to_client: stream.to_client,
        }),
        peer_uid: String::new(),
    }
}

fn held_client(uid: &str, s: &ClientSide) -> HeldConnection {
    let gateway = s.gateway.to_string();
    let (ends, dir) = ((s.src, s.dst), ConnectionDirection::Outbound);
    held(uid, dir, ends, &s.stream, s.opened, true, gateway, &s.dst_identity)
}

fn held_server(uid: &str, s: &ServerSide) -> HeldConnection {
    let (ends, dir) = ((s.src, s.target), ConnectionDirection::Inbound);
    held(uid, dir, ends, &s.stream, s.opened, false, String::new(), &s.client)
}

/// Takes a paused stream a previous proxy handed over (`fds`: its app's side): a client side is
/// dialed again from here, a server side waits here.
pub fn take(pod: &Arc<Pod>, held: HeldConnection, fds: Vec<OwnedFd>) -> Result<(), String> {
    let stream = held.stream.as_ref().ok_or("not a stream")?;
    let [fd]: [OwnedFd; meshpath_zds::connections::FDS_PER_STREAM] =
        fds.try_into().map_err(|v: Vec<OwnedFd>| format!("{} descriptors, not 1", v.len()))?;
    meshpath_zds::connections::identify(fd.as_fd(), pod.netns.cookie())
        .map_err(|e| e.to_string())?;
    let app = handover::tcp_of(fd)?;
    let token = Token::from_bytes(&stream.token).ok_or("a token of another length")?;
    let resumable = Resumable { token, to_server: stream.to_server, to_client: stream.to_client };
    let peer = Identity::parse(&stream.peer_identity).map_err(|e| e.to_string())?;
    let addr = |s: &str| s.parse::<SocketAddr>().map_err(|e| format!("address {s:?}: {e}"));
    let (src, dst) = (addr(&held.src)?, addr(&held.dst)?);
    let opened = SystemTime::UNIX_EPOCH + Duration::from_millis(held.opened_unix_ms);
    if !stream.client {
        let span = info_span!("inbound", pod = %pod.uid, %src);
        let _entered = span.enter();
        info!(dst = %dst, "paused HBONE stream taken over from the previous proxy");
        park(pod, app, ServerSide { stream: resumable, client: peer, src, target: dst, opened });
        return Ok(());
    }
    let side = ClientSide {
        stream: resumable,
        gateway: addr(&stream.gateway)?,
        dst,
        dst_identity: peer,
        src,
        opened,
    };
    let proxy = &pod.proxy;
    let permits = proxy
        .drain
        .admit(&pod.scope(Direction::Outbound, false).limit)
        .ok_or("the pod's or the node's connection cap is reached")?;
    let span = info_span!("outbound", pod = %pod.uid, peer = %src, resumed = true);
    info!(parent: &span, dst = %dst, "paused HBONE stream taken over from the previous proxy");
    let p = pod.clone();
    pod.spawn(
        async move {
            let _permits = permits;
            if let Err(e) = carry_taken(&p, app, side).await {
                warn!(error = %format!("{e:#}"), "resumed HBONE stream failed");
            }
        }
        .instrument(span),
    );
    Ok(())
}

/// A client side taken over, carried on with telemetry of its own (as a plain connection taken
/// over: the access log shows it in two parts, one per proxy).
async fn carry_taken(pod: &Pod, app: TcpStream, side: ClientSide) -> anyhow::Result<()> {
    let proxy = &pod.proxy;
    let store = proxy.store();
    let info = ConnInfo {
        direction: Direction::Outbound,
        src_addr: side.src,
        src_workload: Some(pod.current_workload(&store).clone()),
        src_identity: Some(pod.identity().as_ref().clone()),
        dst_addr: side.dst,
        hbone_addr: Some(side.gateway),
        dst_workload: store.by_ip(side.dst.ip()).cloned(),
        dst_identity: Some(side.dst_identity.clone()),
        dst_service: None,
        node_local: false,
    };
    drop(store);
    let guard = ConnGuard::open(&proxy.metrics, info);
    let _listed = pod.open.list(crate::proxy::open_connections::Entry {
        direction: Direction::Outbound,
        src: side.src,
        original_dst: side.dst,
        actual_dst: side.gateway,
        protocol: "HBONE",
    });
    let result = carry_client(pod, app, side, (&guard.from_client, &guard.to_client))
        .await
        .context("resumed HBONE stream");
    match &result {
        Ok(()) => guard.finish(None),
        Err(e) => guard.finish(Some(&format!("{e:#}"))),
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_header_round_trips_and_anything_else_is_refused() {
        let r = Resumable { token: Token::new(), to_server: 7, to_client: 1 << 40 };
        assert_eq!(Resumable::parse_header(&r.header()), Some(r));
        let hex = r.token.hex();
        for bad in [
            String::new(),
            hex.clone(),
            format!("{hex}; to-server=1"),
            format!("{hex}; to-server=1; to-client=x"),
            format!("{hex}; to-server=1; to-client=2; more=3"),
            format!("{}; to-server=1; to-client=2", &hex[1..]),
            format!("{}g; to-server=1; to-client=2", &hex[1..]),
            "é".repeat(16) + "; to-server=1; to-client=2",
        ] {
            assert_eq!(Resumable::parse_header(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tokens_differ_and_do_not_show_in_logs() {
        let (a, b) = (Token::new(), Token::new());
        assert_ne!(a, b);
        assert!(!format!("{a:?}").contains(&a.hex()[..8]));
    }
}
