//! The pods' listening sockets, held by the agent so that they outlive the proxy
//! (`meshpath_zds::listeners`, meshpath's one extension of ZDS).
//!
//! A proxy that offers it gives the agent a duplicate of each socket it listens on in a pod
//! with its ack of the pod. While that proxy runs, the sockets are open twice. When it goes
//! (a crash, `kill -9`, SIGTERM in a rolling update), the agent's copies keep them open and
//! listening: the kernel keeps completing the pod's connections into their backlogs (the
//! datapath still steers to them: an open listener stays filed), and DNS queries wait in the
//! receive queue. The next proxy gets the same sockets after the pod's netns and accepts what
//! waited: a proxy restart refuses nothing. Fail closed still holds: nothing is carried by
//! anyone but a proxy, and the sockets of a pod that no proxy has taken for `hold` (the agent's
//! `--hold-listeners-seconds`) are closed, so its connections are refused from then on, as they
//! were with no proxy before.
//!
//! Bounded: one entry per pod the agent serves, at most [`MAX_PER_POD`] sockets each, each
//! checked to be a socket of that pod's netns on one of the proxy's ports.

use std::{
    collections::HashMap,
    os::fd::{AsFd as _, OwnedFd},
    sync::Mutex,
    time::{Duration, Instant},
};

use meshpath_zds::listeners::{identify, ListenerId, MAX_PER_POD};
use tracing::{info, warn};

/// The sockets held for one pod.
#[derive(Debug)]
struct Held {
    fds: Vec<(ListenerId, OwnedFd)>,
    /// Whether the connected proxy serves the pod (it took these sockets).
    served: bool,
    /// Since when no proxy serves the pod (meaningful while `!served`).
    since: Instant,
}

/// Every pod's held sockets.
#[derive(Debug)]
pub struct HeldListeners {
    /// How long a pod's sockets are held with no proxy serving it; zero: never held.
    hold: Duration,
    pods: Mutex<HashMap<String, Held>>,
}

impl HeldListeners {
    pub fn new(hold: Duration) -> Self {
        Self { hold, pods: Mutex::new(HashMap::new()) }
    }

    /// Whether sockets are held at all (`--hold-listeners-seconds` not 0).
    pub fn enabled(&self) -> bool {
        !self.hold.is_zero()
    }

    fn pods(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        // A panic while holding the lock leaves plain data behind: go on with it.
        self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Duplicates of the sockets held for `uid`, to go with its `AddWorkload`.
    pub fn for_add(&self, uid: &str) -> Vec<OwnedFd> {
        let pods = self.pods();
        let Some(held) = pods.get(uid) else { return Vec::new() };
        held.fds
            .iter()
            .filter_map(|(id, fd)| match fd.try_clone() {
                Ok(d) => Some(d),
                Err(e) => {
                    warn!(pod = %uid, listener = %id, error = %e, "a held listener could not be duplicated; the proxy binds a new one");
                    None
                }
            })
            .collect()
    }

    /// The proxy acked `uid` with `fds`: each one that is a listener of the pod (netns cookie
    /// `cookie`) is held from now on, in place of what was held. The pod is served.
    pub fn taken(&self, uid: &str, cookie: u64, fds: Vec<OwnedFd>) {
        let mut checked: Vec<(ListenerId, OwnedFd)> = Vec::new();
        for fd in fds.into_iter().take(MAX_PER_POD) {
            match identify(fd.as_fd(), cookie) {
                Ok(id) if checked.iter().all(|(seen, _)| *seen != id) => checked.push((id, fd)),
                Ok(id) => {
                    warn!(pod = %uid, listener = %id, "the proxy gave the same listener twice; one kept")
                }
                Err(e) => {
                    warn!(pod = %uid, error = %e, "the proxy gave a descriptor that is not one of the pod's listeners; not held")
                }
            }
        }
        let mut pods = self.pods();
        match pods.get_mut(uid) {
            Some(held) if checked.is_empty() => held.served = true,
            _ => {
                pods.insert(
                    uid.to_owned(),
                    Held { fds: checked, served: true, since: Instant::now() },
                );
            }
        }
    }

    /// The connected proxy did not take `uid`: its sockets wait for the hold from now.
    pub fn not_served(&self, uid: &str) {
        if let Some(held) = self.pods().get_mut(uid) {
            if held.served {
                held.served = false;
                held.since = Instant::now();
            }
        }
    }

    /// The proxy is gone: every pod's sockets wait for the hold from now.
    pub fn proxy_gone(&self) {
        let now = Instant::now();
        for held in self.pods().values_mut().filter(|h| h.served) {
            held.served = false;
            held.since = now;
        }
    }

    /// Closes every pod's sockets: the proxy that connected binds its own (`why` is logged).
    pub fn release_all(&self, why: &str) {
        let released = std::mem::take(&mut *self.pods());
        if !released.is_empty() {
            info!(pods = released.len(), why, "closing the pods' held listeners");
        }
    }

    /// The pod left the mesh: its sockets are closed.
    pub fn forget(&self, uid: &str) {
        self.pods().remove(uid);
    }

    /// Closes the sockets of every pod that no proxy has served for longer than the hold, as of
    /// `now`: their connections are refused from then on (fail closed). Returns those pods.
    pub fn expire(&self, now: Instant) -> Vec<String> {
        let mut pods = self.pods();
        let expired: Vec<String> = pods
            .iter()
            .filter(|(_, h)| !h.served && now.saturating_duration_since(h.since) >= self.hold)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in &expired {
            pods.remove(uid);
            warn!(pod = %uid, hold = ?self.hold, "no proxy took the pod's listeners in time: closed, its connections are refused until a proxy serves it");
        }
        expired
    }

    /// How many pods have sockets held, and how many of those no proxy serves.
    pub fn counts(&self) -> (usize, usize) {
        let pods = self.pods();
        (pods.len(), pods.values().filter(|h| !h.served).count())
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// The tests here bind the proxy's ports: one at a time, so that one does not take the
    /// port another just closed and checks is free.
    static PORTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A listener on a proxy port of this netns, if one is free (a shared machine may hold
    /// them all).
    fn proxy_port_listener() -> Option<TcpListener> {
        datapath_common::consts::ports::PROXY_PORTS
            .iter()
            .find_map(|p| TcpListener::bind(("127.0.0.1", *p)).ok())
    }

    fn cookie() -> u64 {
        meshpath_podnet::netns::read_cookie().expect("cookie")
    }

    #[test]
    fn a_pod_no_proxy_serves_is_released_after_the_hold_and_not_before() {
        let _one = PORTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(l) = proxy_port_listener() else { return };
        let held = HeldListeners::new(Duration::from_secs(30));
        held.taken("p", cookie(), vec![OwnedFd::from(l)]);
        assert_eq!(held.counts(), (1, 0));
        let start = Instant::now();
        held.proxy_gone();
        assert!(held.expire(start + Duration::from_secs(29)).is_empty());
        assert_eq!(held.counts(), (1, 1));
        assert_eq!(held.expire(Instant::now() + Duration::from_secs(30)), vec!["p".to_owned()]);
        assert_eq!(held.counts(), (0, 0));
    }

    #[test]
    fn a_served_pod_is_never_released_and_a_descriptor_of_another_kind_is_not_held() {
        let _one = PORTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(l) = proxy_port_listener() else { return };
        let held = HeldListeners::new(Duration::from_secs(1));
        let other = TcpListener::bind("127.0.0.1:0").expect("bind");
        held.taken("p", cookie(), vec![OwnedFd::from(l), OwnedFd::from(other)]);
        assert_eq!(held.for_add("p").len(), 1, "a socket on no proxy port was held");
        assert!(held.expire(Instant::now() + Duration::from_secs(3600)).is_empty());
        held.not_served("p");
        assert_eq!(held.expire(Instant::now() + Duration::from_secs(2)).len(), 1);
    }

    #[test]
    fn a_pod_that_leaves_or_a_proxy_that_holds_nothing_closes_the_sockets() {
        let _one = PORTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(l) = proxy_port_listener() else { return };
        let addr = l.local_addr().expect("addr");
        let held = HeldListeners::new(Duration::from_secs(60));
        held.taken("p", cookie(), vec![OwnedFd::from(l)]);
        held.forget("p");
        // Closed: the port can be bound again.
        let again = TcpListener::bind(addr).expect("the port is still held");
        held.taken("q", cookie(), vec![OwnedFd::from(again)]);
        held.release_all("test");
        assert_eq!(held.counts(), (0, 0));
        TcpListener::bind(addr).expect("released sockets are closed");
    }
}
