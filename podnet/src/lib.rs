//! The network-namespace plumbing that meshpath's node agent, CNI plugin and proxy share, and
//! nothing else (no eBPF, no async runtime):
//!
//! - `netns`: open a pod's netns and check it is one, run code inside it on the calling
//!   thread, read its cookie (the key of every per-pod map);
//! - `reply_routing`: the rule, route and sysctls a meshed pod's netns needs so that the app's
//!   replies to the proxy's transparent connections come back to the proxy;
//! - `rtnetlink`: the few route-netlink requests that takes, sent without spawning `ip`.

pub mod netns;
pub mod reply_routing;
pub mod rtnetlink;

use std::path::PathBuf;

/// What can go wrong with a pod's network namespace.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The path is not a network namespace.
    #[error("{path} is not a network namespace ({reason})")]
    NotANetns { path: PathBuf, reason: String },

    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An I/O error with what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io { what: what.into(), source }
    }
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
