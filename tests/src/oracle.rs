//! What the test proxies (`meshpath-test-proxy`, `ztunnel-like`) share.

/// Written here rather than taken from meshpath-proxy on purpose: the test proxies
/// (`meshpath-test-proxy`, `ztunnel-like`) are the datapath tests' independent oracle, and must
/// not share a bug with the proxy they check.
///
/// The original destination, asked exactly as under iptables: SOL_IP/SO_ORIGINAL_DST for an
/// IPv4 socket, SOL_IPV6/IP6T_SO_ORIGINAL_DST for an IPv6 one.
pub fn original_dst(
    conn: &(impl std::os::fd::AsRawFd + LocalAddr),
) -> std::io::Result<std::net::SocketAddr> {
    // A v4-mapped address on a dual-stack listener is an IPv4 connection: netfilter answers
    // it at SOL_IP only (the IPv6 level says ENOENT), as ztunnel asks.
    let v6 = match conn.local_addr()?.ip() {
        std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped().is_none(),
        std::net::IpAddr::V4(_) => false,
    };
    let mut buf = [0u8; 28];
    let mut len = buf.len() as libc::socklen_t;
    let (level, name) = if v6 {
        (
            datapath_common::consts::sockopt::SOL_IPV6,
            datapath_common::consts::sockopt::IP6T_SO_ORIGINAL_DST,
        )
    } else {
        (
            datapath_common::consts::sockopt::SOL_IP,
            datapath_common::consts::sockopt::SO_ORIGINAL_DST,
        )
    };
    // SAFETY: buf and len describe a writable buffer of len bytes.
    let rc = unsafe {
        libc::getsockopt(conn.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    let family = u16::from_ne_bytes([buf[0], buf[1]]);
    match (family as i32, len) {
        // netfilter writes a sockaddr_in but leaves the length as passed: go by the family.
        (libc::AF_INET, 16..) => Ok(std::net::SocketAddr::from((
            std::net::Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]),
            port,
        ))),
        (libc::AF_INET6, 28) => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&buf[8..24]);
            let ip = std::net::Ipv6Addr::from(a);
            Ok(match ip.to_ipv4_mapped() {
                Some(v4) => std::net::SocketAddr::from((v4, port)),
                None => std::net::SocketAddr::from((ip, port)),
            })
        }
        _ => Err(std::io::Error::other(format!("unexpected answer: family {family}, {len} bytes"))),
    }
}

/// What `original_dst` needs of a socket besides its fd.
pub trait LocalAddr {
    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr>;
}

impl LocalAddr for tokio::net::TcpStream {
    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        tokio::net::TcpStream::local_addr(self)
    }
}

/// The test proxies' DNS: every datagram on `udp` is answered with `ANSWER <datagram>`, until
/// the socket fails.
pub async fn answer_dns(udp: tokio::net::UdpSocket) {
    let mut buf = [0u8; 1500];
    while let Ok((n, from)) = udp.recv_from(&mut buf).await {
        let mut reply = b"ANSWER ".to_vec();
        reply.extend_from_slice(&buf[..n]);
        let _ = udp.send_to(&reply, from).await;
    }
}
