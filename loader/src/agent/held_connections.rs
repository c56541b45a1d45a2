//! Open connections a draining proxy handed over, held by the agent until the next proxy takes
//! them (`meshpath_zds::connections`): a proxy upgrade keeps its plain connections.
//!
//! A proxy the agent offered it to (`AddWorkload::hold_connections`) connects to the ZDS socket
//! on SIGTERM with `ZdsHello::meshpath_hand_over` and sends one `HeldConnection` per open plain
//! connection, with its two sockets; each is checked here (both connected TCP sockets of the
//! pod's netns, the pod one the agent serves) and acked. The next proxy that says
//! `meshpath_takes_connections` gets them after their pod's `AddWorkload` (`TakeConnection`).
//! Meanwhile the kernel keeps every byte not yet carried in the sockets' buffers, and the apps
//! see a connection that is slow for a moment.
//!
//! Bounded: at most [`MAX_PER_POD`] per pod and [`MAX_PER_NODE`] in all; held at most `hold`
//! (the agent's `--hold-connections-seconds`), then closed, as is every one of a pod that
//! leaves, and every one when a proxy that does not take them (Istio's ztunnel) connects.

use std::{
    collections::HashMap,
    os::fd::{AsFd as _, OwnedFd},
    sync::Mutex,
    time::{Duration, Instant},
};

use meshpath_zds::{
    connections::{identify_held, MAX_PER_NODE, MAX_PER_POD},
    proto::HeldConnection,
};
use tracing::{info, warn};

/// One connection held: what it is, its sockets (a plain connection's accepted and opened
/// ones; a paused stream's app side), since when.
#[derive(Debug)]
pub struct Held {
    pub what: HeldConnection,
    pub fds: Vec<OwnedFd>,
    since: Instant,
}

/// Every pod's held connections.
#[derive(Debug)]
pub struct HeldConnections {
    /// How long a connection is held; zero: none is.
    hold: Duration,
    pods: Mutex<HashMap<String, Vec<Held>>>,
}

impl HeldConnections {
    pub fn new(hold: Duration) -> Self {
        Self { hold, pods: Mutex::new(HashMap::new()) }
    }

    /// Whether connections are held at all (`--hold-connections-seconds` not 0).
    pub fn enabled(&self) -> bool {
        !self.hold.is_zero()
    }

    fn pods(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Held>>> {
        // A panic while holding the lock leaves plain data behind: go on with it.
        self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A draining proxy hands over `what` with `fds`, for a pod whose netns cookie is `cookie`.
    pub fn hold(
        &self,
        what: HeldConnection,
        fds: Vec<OwnedFd>,
        cookie: u64,
        peer_cookie: Option<u64>,
        now: Instant,
    ) -> Result<(), String> {
        if !self.enabled() {
            return Err("this agent holds no connections".into());
        }
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        identify_held(&what, &borrowed, cookie, peer_cookie)?;
        drop(borrowed);
        let mut pods = self.pods();
        let total: usize = pods.values().map(Vec::len).sum();
        if total >= MAX_PER_NODE {
            return Err(format!("the node's {MAX_PER_NODE} held connections are reached"));
        }
        let held = pods.entry(what.uid.clone()).or_default();
        if held.len() >= MAX_PER_POD {
            return Err(format!("the pod's {MAX_PER_POD} held connections are reached"));
        }
        held.push(Held { what, fds, since: now });
        Ok(())
    }

    /// Every connection held for `uid`, for the proxy that now serves it.
    pub fn take(&self, uid: &str) -> Vec<Held> {
        self.pods().remove(uid).unwrap_or_default()
    }

    /// A proxy that takes plain connections but no streams is the proxy now: the paused
    /// streams held close (their peers close their sides when the resume time is up).
    pub fn release_streams(&self, why: &str) {
        let n = self.release(|h| h.stream.is_some());
        if n > 0 {
            warn!(streams = n, "held HBONE streams closed: {why}");
        }
    }

    /// A proxy that takes no node-local connections is the proxy now: those held close.
    pub fn release_node_local(&self, why: &str) {
        let n = self.release(|h| !h.peer_uid.is_empty());
        if n > 0 {
            warn!(connections = n, "held node-local connections closed: {why}");
        }
    }

    /// Closes every held connection `this` picks; returns how many.
    fn release(&self, this: impl Fn(&HeldConnection) -> bool) -> usize {
        let mut pods = self.pods();
        let mut n = 0;
        for held in pods.values_mut() {
            let before = held.len();
            held.retain(|h| !this(&h.what));
            n += before - held.len();
        }
        pods.retain(|_, held| !held.is_empty());
        n
    }

    /// `held` were not given after all (the proxy's session broke): they wait for the next.
    pub fn put_back(&self, uid: &str, held: Vec<Held>) {
        if !held.is_empty() {
            self.pods().entry(uid.to_owned()).or_default().extend(held);
        }
    }

    /// The pod left: its connections close.
    pub fn forget(&self, uid: &str) {
        if let Some(gone) = self.pods().remove(uid) {
            info!(pod = %uid, connections = gone.len(), "the pod left: its held connections closed");
        }
    }

    /// A proxy that takes no connections is the proxy now: every one held closes.
    pub fn release_all(&self, why: &str) {
        let mut pods = self.pods();
        let n: usize = pods.values().map(Vec::len).sum();
        pods.clear();
        if n > 0 {
            warn!(connections = n, "held connections closed: {why}");
        }
    }

    /// Closes every connection held for longer than the hold, as of `now`.
    pub fn expire(&self, now: Instant) {
        let mut pods = self.pods();
        for (uid, held) in pods.iter_mut() {
            let before = held.len();
            held.retain(|h| now.saturating_duration_since(h.since) < self.hold);
            if held.len() < before {
                warn!(pod = %uid, closed = before - held.len(), hold = ?self.hold, "no proxy took the pod's handed-over connections in time: closed");
            }
        }
        pods.retain(|_, held| !held.is_empty());
    }

    /// How many are held.
    pub fn count(&self) -> usize {
        self.pods().values().map(Vec::len).sum()
    }

    /// How many are held: plain connections, paused HBONE streams.
    pub fn counts(&self) -> (usize, usize) {
        let pods = self.pods();
        let streams = pods.values().flatten().filter(|h| h.what.stream.is_some()).count();
        let all: usize = pods.values().map(Vec::len).sum();
        (all - streams, streams)
    }

    /// `/metrics` lines: how many are held, by kind (plain, stream).
    pub fn prometheus(&self) -> String {
        let (plain, streams) = self.counts();
        format!(
            "# HELP meshpath_agent_held_connections Open connections a stopped proxy handed over, held for the next: plain ones (both sockets) and paused HBONE streams (the app's socket).\n\
             # TYPE meshpath_agent_held_connections gauge\n\
             meshpath_agent_held_connections{{kind=\"plain\"}} {plain}\n\
             meshpath_agent_held_connections{{kind=\"stream\"}} {streams}\n"
        )
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn here() -> u64 {
        meshpath_podnet::netns::read_cookie().expect("netns cookie")
    }

    /// Both ends of a loopback connection, as descriptors (and the listener, kept open).
    fn pair() -> (TcpListener, Vec<OwnedFd>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (l, vec![OwnedFd::from(s), OwnedFd::from(c)])
    }

    fn what(uid: &str) -> HeldConnection {
        HeldConnection { uid: uid.into(), ..Default::default() }
    }

    #[test]
    fn a_connection_is_held_until_taken_and_then_is_gone() {
        let held = HeldConnections::new(Duration::from_secs(30));
        let (_l, fds) = pair();
        held.hold(what("p"), fds, here(), None, Instant::now()).expect("held");
        assert_eq!(held.count(), 1);
        assert_eq!(held.take("p").len(), 1);
        assert!(held.take("p").is_empty());
    }

    #[test]
    fn a_descriptor_of_another_netns_or_a_listener_is_refused() {
        let held = HeldConnections::new(Duration::from_secs(30));
        let (_l, fds) = pair();
        let err = held.hold(what("p"), fds, here().wrapping_add(1), None, Instant::now());
        assert!(err.expect_err("held").contains("another network namespace"));
        let (l, mut fds) = pair();
        fds[1] = OwnedFd::from(l);
        assert!(held.hold(what("p"), fds, here(), None, Instant::now()).is_err());
        let (_l, mut fds) = pair();
        fds.pop();
        assert!(held.hold(what("p"), fds, here(), None, Instant::now()).is_err());
        assert_eq!(held.count(), 0);
    }

    #[test]
    fn a_connection_no_proxy_takes_is_closed_after_the_hold_and_not_before() {
        let held = HeldConnections::new(Duration::from_secs(1));
        let (_l, fds) = pair();
        let t0 = Instant::now();
        held.hold(what("p"), fds, here(), None, t0).expect("held");
        held.expire(t0 + Duration::from_millis(900));
        assert_eq!(held.count(), 1);
        held.expire(t0 + Duration::from_secs(1));
        assert_eq!(held.count(), 0);
    }

    #[test]
    fn a_paused_stream_comes_with_its_app_side_only_and_a_proxy_without_streams_closes_it() {
        let held = HeldConnections::new(Duration::from_secs(30));
        let stream = |uid: &str| HeldConnection {
            stream: Some(meshpath_zds::proto::HeldStream::default()),
            ..what(uid)
        };
        let (_l, fds) = pair();
        assert!(
            held.hold(stream("p"), fds, here(), None, Instant::now()).is_err(),
            "two descriptors"
        );
        let (_l, mut fds) = pair();
        fds.pop();
        held.hold(stream("p"), fds, here(), None, Instant::now()).expect("the app's side");
        let (_l, fds) = pair();
        held.hold(what("p"), fds, here(), None, Instant::now()).expect("a plain one");
        assert_eq!(held.counts(), (1, 1));
        assert!(held.prometheus().contains("meshpath_agent_held_connections{kind=\"stream\"} 1\n"));
        held.release_streams("test");
        let left = held.take("p");
        assert_eq!(left.len(), 1);
        assert!(left[0].what.stream.is_none());
    }

    #[test]
    fn a_node_local_connections_opened_side_must_be_of_its_peer_pod_and_a_proxy_without_them_closes_it(
    ) {
        let held = HeldConnections::new(Duration::from_secs(30));
        let node_local = || HeldConnection { peer_uid: "q".into(), ..what("p") };
        let (_l, fds) = pair();
        let err = held.hold(node_local(), fds, here(), None, Instant::now());
        assert!(err.expect_err("held").contains("peer pod q is not known"));
        let (_l, fds) = pair();
        let err =
            held.hold(node_local(), fds, here(), Some(here().wrapping_add(1)), Instant::now());
        assert!(err.expect_err("held").contains("another network namespace"));
        let (_l, fds) = pair();
        held.hold(node_local(), fds, here(), Some(here()), Instant::now()).expect("held");
        let (_l, fds) = pair();
        held.hold(what("p"), fds, here(), None, Instant::now()).expect("a plain one");
        held.release_node_local("test");
        let left = held.take("p");
        assert_eq!(left.len(), 1);
        assert!(left[0].what.peer_uid.is_empty());
    }

    #[test]
    fn with_no_hold_nothing_is_held() {
        let held = HeldConnections::new(Duration::ZERO);
        let (_l, fds) = pair();
        assert!(held.hold(what("p"), fds, here(), None, Instant::now()).is_err());
    }
}
