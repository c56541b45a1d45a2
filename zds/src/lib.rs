//! ZDS, the protocol between the node agent (which owns the pods' lifecycle) and the node proxy
//! (which serves them), exactly as Istio's CNI agent speaks it to ztunnel:
//!
//! - a unix `SOCK_SEQPACKET` socket (default `/var/run/ztunnel/ztunnel.sock`): the agent
//!   listens, the proxy connects and sends `ZdsHello { version: V1 }` first;
//! - agent → proxy: `WorkloadRequest` (add with the pod's netns as one SCM_RIGHTS fd, keep, del,
//!   snapshot sent); proxy → agent: one `WorkloadResponse { ack }` per request;
//! - meshpath's two extensions, negotiated in the hello and the add: the pods' listening sockets
//!   held by the agent across proxy restarts (`listeners`), and the open plain connections a
//!   draining proxy hands to the next one through the agent (`connections`);
//! - on every (re)connect the agent sends its full set and then `SnapshotSent`.
//!
//! The messages (`proto`) are derived with prost from `zds.proto` by hand, field numbers as
//! Istio's; `transport` moves one message (and at most a few fds) per datagram.

pub mod connections;
pub mod listeners;
pub mod proto;
pub mod transport;

pub use transport::{Listener, SeqPacket};

/// Where Istio's agent and proxy meet by default.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// What can go wrong on a ZDS connection.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("ZDS socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("ZDS message does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("ZDS peer closed the connection")]
    Closed,
    #[error("ZDS protocol: {0}")]
    Protocol(String),
}
