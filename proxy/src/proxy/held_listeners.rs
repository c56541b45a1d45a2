//! A pod's listening sockets that outlive this proxy (`meshpath_zds::listeners`): the node
//! agent holds a duplicate of each, so that while no proxy runs the pod's connections wait in
//! their backlog instead of being refused, and hands them to the next proxy with the pod.
//!
//! Here, per pod: the sockets the agent handed over, each checked to be a socket of the pod's
//! netns on one of the proxy's ports, used in place of binding a new one (`take`); and a
//! duplicate of each listener the pod serves, given back to the agent with the ack of the pod
//! (`for_agent`). Those duplicates go when the pod stops listening (`release`: removal, or
//! SIGTERM's drain), so that without an agent holding them the listeners close as before.

use std::{
    collections::HashMap,
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    sync::{Mutex, MutexGuard, PoisonError},
};

use meshpath_zds::listeners::{identify, ListenerId, MAX_PER_POD};
use tracing::{debug, warn};

/// One pod's held listeners.
#[derive(Debug, Default)]
pub struct PodListeners {
    /// Handed over by the agent and not used yet.
    inherited: Mutex<HashMap<ListenerId, OwnedFd>>,
    /// A duplicate of every listener the pod serves, for the agent.
    opened: Mutex<Vec<OwnedFd>>,
    /// Whether the agent asked for them (none are kept otherwise).
    give_back: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain data: a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PodListeners {
    /// The sockets `fds` the agent handed over for the pod whose netns cookie is `netns`:
    /// those that are not the pod's listeners are closed and logged. `give_back`: the agent
    /// asked for the pod's listeners in the ack.
    pub fn inherit(fds: Vec<OwnedFd>, netns: u64, pod: &str, give_back: bool) -> Self {
        let mut inherited = HashMap::new();
        for fd in fds.into_iter().take(MAX_PER_POD) {
            match identify(fd.as_fd(), netns) {
                Ok(id) => {
                    debug!(pod, listener = %id, "listener handed over by the node agent");
                    inherited.insert(id, fd);
                }
                Err(e) => {
                    warn!(pod, error = %e, "the node agent handed over a descriptor that is not one of the pod's listeners; closed")
                }
            }
        }
        Self { inherited: Mutex::new(inherited), opened: Mutex::new(Vec::new()), give_back }
    }

    /// The handed-over socket that is `id`, if any: the pod serves it instead of a new one
    /// (a new one could not bind while it is open).
    pub fn take(&self, id: &ListenerId) -> Option<OwnedFd> {
        lock(&self.inherited).remove(id)
    }

    /// Keeps a duplicate of a listener the pod now serves, for the agent.
    pub fn opened(&self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        if !self.give_back {
            return Ok(());
        }
        let dup = fd.try_clone_to_owned()?;
        lock(&self.opened).push(dup);
        Ok(())
    }

    /// Duplicates of the pod's listeners, to go with the ack.
    pub fn for_agent(&self) -> Vec<OwnedFd> {
        lock(&self.opened).iter().filter_map(|fd| fd.try_clone().ok()).collect()
    }

    /// The pod stopped listening: its duplicates and anything handed over but not used close.
    pub fn release(&self) {
        lock(&self.opened).clear();
        lock(&self.inherited).clear();
    }
}
