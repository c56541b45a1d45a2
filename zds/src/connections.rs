//! Held connections, meshpath's second extension of ZDS: a proxy upgrade keeps the open plain
//! connections (to destinations outside the mesh, and from clients outside it), and the open
//! HBONE streams between two meshpath proxies, paused (`HeldConnection::stream`: the app's side
//! only; the peer proxy holds the other and resumes the stream with the next proxy).
//!
//! The app's side of such a connection is a TCP socket in the pod's netns, and so is the
//! proxy's other side; a process can give both to another (SCM_RIGHTS) and the kernel keeps
//! every byte not yet read in their buffers. On SIGTERM a proxy whose agent offered it
//! (`AddWorkload::hold_connections`) stops reading each such connection, writes out what it had
//! read, and hands the two sockets to the agent on a connection of its own to the ZDS socket
//! (`ZdsHello::meshpath_hand_over`, then one `HeldConnection` per open connection, each acked).
//! The agent, which outlives the proxy, holds them; the next proxy that says
//! `meshpath_takes_connections` gets them after their pod's `AddWorkload`
//! (`TakeConnection`) and carries on where the first stopped: nothing lost, nothing twice.
//! Connections the agent holds for longer than its hold are closed. Istio's ztunnel neither
//! offers nor takes: its connections end on SIGTERM as they do under istio-cni.
//!
//! A node-local connection (`HeldConnection::peer_uid`: the proxy carries it between two of
//! its pods, with no HBONE between them) is held too, where the proxy said it takes them
//! (`ZdsHello::meshpath_takes_node_local`): its accepted socket is of the source pod's netns,
//! its opened one of the destination pod's.
//!
//! Descriptors describe themselves: both sides check each one here, from the socket itself.

use std::os::fd::{AsFd, BorrowedFd};

use nix::sys::socket::{self, sockopt, SockType};

/// How long the agent holds a draining proxy's connections, by default, for the next proxy
/// (`meshpath-loader agent --hold-connections-seconds`).
pub const DEFAULT_HOLD: std::time::Duration = std::time::Duration::from_secs(120);

/// Descriptors one held plain connection comes with: the accepted socket, then the opened one.
pub const FDS_PER_CONNECTION: usize = 2;

/// Descriptors one held HBONE stream comes with: the app's side (the peer proxy holds the other).
pub const FDS_PER_STREAM: usize = 1;

/// How many descriptors `held` comes with.
pub fn fds_of(held: &crate::proto::HeldConnection) -> usize {
    if held.stream.is_some() {
        FDS_PER_STREAM
    } else {
        FDS_PER_CONNECTION
    }
}

/// At most this many connections of one pod are held at once; more are not taken (they end).
pub const MAX_PER_POD: usize = 1024;

/// At most this many connections of the whole node are held at once.
pub const MAX_PER_NODE: usize = 16 * 1024;

/// Checks each of `held`'s descriptors (`identify`): all of the pod whose netns cookie is
/// `pod`, but a node-local connection's opened socket, which is of its peer pod's (`peer`,
/// `None` if that pod is unknown, which refuses it).
pub fn identify_held(
    held: &crate::proto::HeldConnection,
    fds: &[BorrowedFd<'_>],
    pod: u64,
    peer: Option<u64>,
) -> Result<(), String> {
    let want = fds_of(held);
    if fds.len() != want {
        return Err(format!("{} descriptors, not {want}", fds.len()));
    }
    for (i, fd) in fds.iter().enumerate() {
        let netns = if i == 1 && !held.peer_uid.is_empty() {
            peer.ok_or_else(|| format!("its peer pod {} is not known", held.peer_uid))?
        } else {
            pod
        };
        identify(fd.as_fd(), netns).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Why a descriptor is not one side of a pod's open connection.
#[derive(Debug, thiserror::Error)]
pub enum NotAConnection {
    #[error("not a socket, or unreadable: {0}")]
    Socket(#[from] nix::Error),
    #[error("a socket of another network namespace (cookie {found}, the pod's is {want})")]
    OtherNetns { found: u64, want: u64 },
    #[error("netns cookie unreadable: {0}")]
    Cookie(String),
    #[error("a socket of type {0:?}, not TCP")]
    Type(SockType),
    #[error("a listening socket")]
    Listening,
    #[error("a TCP socket with no peer: {0}")]
    NotConnected(nix::Error),
}

/// Checks that `fd` is a connected TCP socket of the pod whose netns cookie is `pod_netns`.
pub fn identify(fd: BorrowedFd<'_>, pod_netns: u64) -> Result<(), NotAConnection> {
    let ty = socket::getsockopt(&fd, sockopt::SockType)?;
    if ty != SockType::Stream {
        return Err(NotAConnection::Type(ty));
    }
    let found = meshpath_podnet::netns::socket_cookie(fd.as_fd())
        .map_err(|e| NotAConnection::Cookie(e.to_string()))?;
    if found != pod_netns {
        return Err(NotAConnection::OtherNetns { found, want: pod_netns });
    }
    if socket::getsockopt(&fd, sockopt::AcceptConn)? {
        return Err(NotAConnection::Listening);
    }
    match socket::getpeername::<socket::SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(&fd)) {
        Ok(_) => Ok(()),
        Err(_) if closed_after_its_peer(fd) => Ok(()),
        Err(e) => Err(NotAConnection::NotConnected(e)),
    }
}

/// Whether `fd` is a TCP socket that had a peer and is closed now, with what the peer sent last
/// perhaps unread: when the peer ends a connection whose other direction has ended already,
/// the kernel moves it to TIME_WAIT and the socket itself to CLOSE, so it has no peer to name,
/// yet what the peer sent before its end is still to be read (a server's answer to a client
/// that half-closed). It is handed over like any other: the next proxy delivers the rest.
fn closed_after_its_peer(fd: BorrowedFd<'_>) -> bool {
    // SAFETY: tcp_info is plain old data; the kernel writes at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` describe a writable buffer of `len` bytes; `fd` is open.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::addr_of_mut!(info).cast(),
            &mut len,
        )
    };
    // TCP_CLOSE is 7; a socket that never had a peer has received no segment.
    rc == 0 && info.tcpi_state == 7 && info.tcpi_segs_in > 0
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream, UdpSocket};

    use super::*;

    fn here() -> u64 {
        meshpath_podnet::netns::read_cookie().expect("netns cookie")
    }

    #[test]
    fn both_ends_of_a_connection_of_the_pods_netns_are_taken() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        identify(c.as_fd(), here()).expect("the opened side");
        identify(s.as_fd(), here()).expect("the accepted side");
    }

    #[test]
    fn a_socket_whose_peer_closed_after_it_half_closed_is_taken_with_its_unread_answer() {
        use std::io::{Read as _, Write as _};
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (mut s, _) = l.accept().expect("accept");
        c.shutdown(std::net::Shutdown::Write).expect("half close");
        s.write_all(b"the answer").expect("answer");
        drop(s);
        // The peer's FIN moves `c` to TIME_WAIT: the socket itself is CLOSE, with no peer.
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(socket::getpeername::<socket::SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(
            &c
        ))
        .is_err());
        identify(c.as_fd(), here()).expect("closed after its peer, its answer unread");
        let mut got = String::new();
        (&c).read_to_string(&mut got).expect("read");
        assert_eq!(got, "the answer");
        // A socket that never had a peer is still refused.
        let fresh = nix::sys::socket::socket(
            socket::AddressFamily::Inet,
            SockType::Stream,
            socket::SockFlag::empty(),
            None,
        )
        .expect("socket");
        assert!(matches!(identify(fresh.as_fd(), here()), Err(NotAConnection::NotConnected(_))));
    }

    #[test]
    fn a_listener_another_netns_a_udp_socket_or_a_file_is_refused() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        assert!(matches!(identify(l.as_fd(), here()), Err(NotAConnection::Listening)));
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let wrong = here().wrapping_add(1);
        assert!(matches!(identify(c.as_fd(), wrong), Err(NotAConnection::OtherNetns { .. })));
        let u = UdpSocket::bind("127.0.0.1:0").expect("udp");
        assert!(matches!(identify(u.as_fd(), here()), Err(NotAConnection::Type(_))));
        let file = std::fs::File::open("/proc/self/stat").expect("file");
        assert!(matches!(identify(file.as_fd(), here()), Err(NotAConnection::Socket(_))));
    }
}
