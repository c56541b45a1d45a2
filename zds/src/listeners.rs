//! Held listeners, meshpath's first extension of ZDS: the pod's listening sockets outlive the
//! proxy that opened them.
//!
//! A proxy that says so in its hello (`ZdsHello::meshpath_held_listeners`) is asked, with each
//! `AddWorkload` (`hold_listeners`), to give the agent a duplicate of every socket it listens
//! on in the pod (15001, 15006, 15008, DNS on 15053), attached to its ack. The agent keeps
//! them. When the proxy goes (crash, `kill -9`, a rolling update), those sockets stay open, so
//! the pod's connections wait in their backlog, and DNS queries in their receive queue, instead
//! of being refused; the next proxy gets them back after the pod's netns in its `AddWorkload`
//! and accepts what waited. As systemd's socket activation keeps a service's sockets across its
//! restarts. A proxy that never says so (Istio's ztunnel) is never sent nor asked for a socket,
//! and the agent closes any it holds before that proxy's snapshot, so it binds its own as it
//! does under istio-cni. Descriptors describe themselves: either side checks each one here,
//! from the socket itself, before using it.

use std::{
    net::SocketAddr,
    os::fd::{AsFd, BorrowedFd},
};

use datapath_common::consts::ports;
use nix::sys::socket::{self, sockopt, SockType, SockaddrStorage};

/// How long the agent holds a pod's listeners, by default, while no proxy serves it
/// (`meshpath-loader agent --hold-listeners-seconds`). A peer node's proxy waits as long for a
/// new connection's handshake there (`PEER_REPLACED_WAIT` in the proxy's outbound path).
pub const DEFAULT_HOLD: std::time::Duration = std::time::Duration::from_secs(120);

/// At most this many listeners ride with one pod (ztunnel's set is seven: 15001, 15006, 15008
/// on `[::]`, and DNS over UDP and TCP on `127.0.0.1` and `[::1]`).
pub const MAX_PER_POD: usize = 8;

/// The transport of a held socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    /// A TCP socket in the listening state.
    Tcp,
    /// A bound UDP socket (DNS).
    Udp,
}

/// What a held socket is: its transport and the address it is bound to in the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenerId {
    pub transport: Transport,
    pub addr: SocketAddr,
}

impl std::fmt::Display for ListenerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = match self.transport {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
        };
        write!(f, "{t} {}", self.addr)
    }
}

/// Why a descriptor is not one of a pod's listeners.
#[derive(Debug, thiserror::Error)]
pub enum NotAListener {
    #[error("not a socket, or unreadable: {0}")]
    Socket(#[from] nix::Error),
    #[error("a socket of another network namespace (cookie {found}, the pod's is {want})")]
    OtherNetns { found: u64, want: u64 },
    #[error("netns cookie unreadable: {0}")]
    Cookie(String),
    #[error("not an IP socket")]
    NotIp,
    #[error("bound to {0}: not one of the proxy's ports")]
    NotAProxyPort(SocketAddr),
    #[error("a TCP socket on {0} that is not listening")]
    NotListening(SocketAddr),
    #[error("a socket of type {0:?}, neither TCP nor UDP")]
    Type(SockType),
}

/// Checks that `fd` is a socket of the pod whose netns cookie is `pod_netns`, bound to one of
/// the proxy's ports (listening, if TCP), and says which.
pub fn identify(fd: BorrowedFd<'_>, pod_netns: u64) -> Result<ListenerId, NotAListener> {
    let ty = socket::getsockopt(&fd, sockopt::SockType)?;
    let transport = match ty {
        SockType::Stream => Transport::Tcp,
        SockType::Datagram => Transport::Udp,
        other => return Err(NotAListener::Type(other)),
    };
    let found = meshpath_podnet::netns::socket_cookie(fd.as_fd())
        .map_err(|e| NotAListener::Cookie(e.to_string()))?;
    if found != pod_netns {
        return Err(NotAListener::OtherNetns { found, want: pod_netns });
    }
    let local: SockaddrStorage = socket::getsockname(std::os::fd::AsRawFd::as_raw_fd(&fd))?;
    let addr = if let Some(v4) = local.as_sockaddr_in() {
        SocketAddr::from((v4.ip(), v4.port()))
    } else if let Some(v6) = local.as_sockaddr_in6() {
        SocketAddr::from((v6.ip(), v6.port()))
    } else {
        return Err(NotAListener::NotIp);
    };
    if !ports::is_proxy_port(addr.port()) {
        return Err(NotAListener::NotAProxyPort(addr));
    }
    if transport == Transport::Tcp && !socket::getsockopt(&fd, sockopt::AcceptConn)? {
        return Err(NotAListener::NotListening(addr));
    }
    Ok(ListenerId { transport, addr })
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream, UdpSocket};

    use super::*;

    fn here() -> u64 {
        meshpath_podnet::netns::read_cookie().expect("netns cookie")
    }

    #[test]
    fn a_listening_socket_on_a_proxy_port_is_identified() {
        // 15001 may be taken on a shared machine: any proxy port free on loopback will do.
        let Some(l) =
            ports::PROXY_PORTS.iter().find_map(|p| TcpListener::bind(("127.0.0.1", *p)).ok())
        else {
            return;
        };
        let id = identify(l.as_fd(), here()).expect("identified");
        assert_eq!(id.transport, Transport::Tcp);
        assert_eq!(id.addr, l.local_addr().expect("addr"));
    }

    #[test]
    fn a_socket_of_another_netns_or_port_or_state_is_refused() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        assert!(matches!(identify(l.as_fd(), here()), Err(NotAListener::NotAProxyPort(_))));
        let wrong = here().wrapping_add(1);
        assert!(matches!(identify(l.as_fd(), wrong), Err(NotAListener::OtherNetns { .. })));
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        assert!(identify(c.as_fd(), here()).is_err());
        let u = UdpSocket::bind("127.0.0.1:0").expect("udp");
        assert!(matches!(identify(u.as_fd(), here()), Err(NotAListener::NotAProxyPort(_))));
        let file = std::fs::File::open("/proc/self/stat").expect("file");
        assert!(matches!(identify(file.as_fd(), here()), Err(NotAListener::Socket(_))));
    }
}
