//! Sockets inside a pod's network namespace. A socket belongs to the netns it was created in, so
//! the proxy creates them on a thread that entered the pod's netns and then uses them from any
//! task: listeners on 15001/15008 live in the pod, and upstream connections leave from the pod's
//! own address.

use std::{io, net::SocketAddr};

use meshpath_loader::netns::Netns;
use tokio::net::{TcpListener, TcpSocket};

/// A TCP listener on `addr` inside `ns`.
pub fn listen(ns: &Netns, addr: SocketAddr) -> io::Result<TcpListener> {
    let std = ns
        .run(|| -> io::Result<std::net::TcpListener> {
            let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
            let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
            if addr.is_ipv6() {
                s.set_only_v6(false)?;
            }
            s.set_reuse_address(true)?;
            s.set_nonblocking(true)?;
            s.bind(&addr.into())?;
            s.listen(1024)?;
            Ok(s.into())
        })
        .map_err(io::Error::other)??;
    TcpListener::from_std(std)
}

/// An unconnected TCP socket of `addr`'s family inside `ns`.
pub fn socket(ns: &Netns, addr: SocketAddr) -> io::Result<TcpSocket> {
    let std = ns
        .run(|| -> io::Result<std::net::TcpStream> {
            let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
            let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
            s.set_nonblocking(true)?;
            s.set_nodelay(true)?;
            Ok(s.into())
        })
        .map_err(io::Error::other)??;
    Ok(TcpSocket::from_std_stream(std))
}
