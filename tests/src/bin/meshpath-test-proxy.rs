//! A minimal capture-side proxy for the datapath tests, written the way a proxy written for
//! iptables REDIRECT is: listen on the outbound port inside the pod's netns, read each accepted
//! connection's original destination with `getsockopt(SO_ORIGINAL_DST)`, then either
//! - `echo`: answer `ORIG_DST <addr>\n` and close, or
//! - `forward`: connect to the original destination and copy both ways.
//!
//! It also answers DNS on 15053: every UDP datagram with `ANSWER <datagram>`, TCP like any
//! outbound connection.
//!
//! Given a pin root it also listens on the inbound port (`[::]:15006`, dual-stack) and inserts
//! that listener into the datapath's INBOUND_LISTENERS map for the pod, as a real proxy must;
//! inbound connections are answered or forwarded the same way (echo: `INBOUND <orig dst> FROM
//! <peer>`).
//!
//! It prints `READY` once listening, `ACCEPTED <orig dst>` per connection, and one `FORWARDED <bytes up> <bytes down>` line per closed
//! forwarded connection. Usage: `meshpath-test-proxy NETNS_PATH echo|forward [PIN_ROOT]`.

use std::{
    io::{self, Write as _},
    net::{
        Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream,
        UdpSocket,
    },
    os::fd::AsRawFd as _,
};

use anyhow::{bail, Context as _, Result};
use datapath_common::consts::{ports, sockopt};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(netns), Some(mode)) = (args.get(1), args.get(2)) else {
        bail!("usage: meshpath-test-proxy NETNS_PATH echo|forward [PIN_ROOT]");
    };
    let forward = match mode.as_str() {
        "echo" => false,
        "forward" => true,
        other => bail!("unknown mode {other}"),
    };
    let pin_root = args.get(3);
    let cookie = meshpath_loader::netns::Netns::open(netns.as_ref())?.cookie();
    // Single-threaded here, so the whole process (and every thread it starts) enters the netns.
    let ns = std::fs::File::open(netns).with_context(|| format!("opening {netns}"))?;
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;

    let mut listeners = vec![
        (TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, ports::OUTBOUND))?, false),
        (bind_v6_only(ports::OUTBOUND)?, false),
        // DNS over TCP is answered like any outbound connection.
        (TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, ports::DNS))?, false),
        (bind_v6_only(ports::DNS)?, false),
    ];
    // DNS over UDP: every datagram is answered with `ANSWER <datagram>`.
    let v6_udp = {
        use nix::sys::socket::{
            bind, setsockopt, socket, sockopt::Ipv6V6Only, AddressFamily, SockFlag, SockType,
            SockaddrIn6,
        };
        let fd = socket(AddressFamily::Inet6, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
        setsockopt(&fd, Ipv6V6Only, &true)?;
        bind(
            fd.as_raw_fd(),
            &SockaddrIn6::from(SocketAddrV6::new(Ipv6Addr::LOCALHOST, ports::DNS, 0, 0)),
        )?;
        UdpSocket::from(fd)
    };
    for udp in [UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, ports::DNS))?, v6_udp] {
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = udp.recv_from(&mut buf) {
                let mut reply = b"ANSWER ".to_vec();
                reply.extend_from_slice(&buf[..n]);
                let _ = udp.send_to(&reply, from);
            }
        });
    }
    if let Some(root) = pin_root {
        let inbound = TcpListener::bind((Ipv6Addr::UNSPECIFIED, ports::INBOUND_PLAINTEXT))?;
        let dp = meshpath_loader::datapath::Datapath::open_or_load(root.as_ref())?;
        dp.register_inbound_listener(cookie, &inbound)?;
        listeners.push((inbound, true));
    }
    println!("READY");
    io::stdout().flush()?;
    for (listener, inbound) in listeners {
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    if let Err(e) = serve(conn, forward, inbound) {
                        eprintln!("meshpath-test-proxy: {e:#}");
                    }
                });
            }
        });
    }
    loop {
        std::thread::park();
    }
}

fn bind_v6_only(port: u16) -> Result<TcpListener> {
    use nix::sys::socket::{
        bind, listen, setsockopt, socket, sockopt::Ipv6V6Only, AddressFamily, Backlog, SockFlag,
        SockType, SockaddrIn6,
    };
    let fd = socket(AddressFamily::Inet6, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, Ipv6V6Only, &true)?;
    bind(fd.as_raw_fd(), &SockaddrIn6::from(SocketAddrV6::new(Ipv6Addr::LOCALHOST, port, 0, 0)))?;
    listen(&fd, Backlog::new(128)?)?;
    Ok(TcpListener::from(fd))
}

/// The original destination, asked exactly as under iptables: SOL_IP/SO_ORIGINAL_DST for an
/// IPv4 socket, SOL_IPV6/IP6T_SO_ORIGINAL_DST for an IPv6 one.
fn original_dst(conn: &TcpStream) -> io::Result<SocketAddr> {
    let v6 = conn.local_addr()?.is_ipv6();
    let mut buf = [0u8; 28];
    let mut len = buf.len() as libc::socklen_t;
    let (level, name) = if v6 {
        (sockopt::SOL_IPV6, sockopt::IP6T_SO_ORIGINAL_DST)
    } else {
        (sockopt::SOL_IP, sockopt::SO_ORIGINAL_DST)
    };
    // SAFETY: buf and len describe a writable buffer of len bytes.
    let rc = unsafe {
        libc::getsockopt(conn.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &mut len)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    let family = u16::from_ne_bytes([buf[0], buf[1]]);
    match (family as i32, len) {
        // netfilter writes a sockaddr_in but leaves the length as passed: go by the family.
        (libc::AF_INET, 16..) => {
            Ok(SocketAddr::from((Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]), port)))
        }
        (libc::AF_INET6, 28) => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&buf[8..24]);
            let ip = Ipv6Addr::from(a);
            Ok(match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::from((v4, port)),
                None => SocketAddr::from((ip, port)),
            })
        }
        _ => Err(io::Error::other(format!("unexpected answer: family {family}, {len} bytes"))),
    }
}

/// Connects to the original destination. Under iptables capture the proxy's sockets must carry
/// istio's mark to escape the REDIRECT rules: `MESHPATH_TEST_PROXY_MARK=0x539` sets it (the
/// benchmark's iptables scenario). meshpath capture needs no mark: the proxy's cgroup bypasses.
fn connect_upstream(to: SocketAddr) -> io::Result<TcpStream> {
    let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    if let Ok(mark) = std::env::var("MESHPATH_TEST_PROXY_MARK") {
        let mark =
            u32::from_str_radix(mark.trim_start_matches("0x"), 16).map_err(io::Error::other)?;
        sock.set_mark(mark)?;
    }
    sock.set_nodelay(true)?;
    sock.connect(&to.into())?;
    Ok(sock.into())
}

fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())),
            None => a,
        },
        v4 => v4,
    }
}

fn serve(mut conn: TcpStream, forward: bool, inbound: bool) -> Result<()> {
    let orig = original_dst(&conn).context("getsockopt(SO_ORIGINAL_DST)")?;
    conn.set_nodelay(true)?;
    println!("ACCEPTED {orig}");
    io::stdout().flush()?;
    if !forward {
        if inbound {
            // The same answer two ways: SO_ORIGINAL_DST and the socket's own address.
            let local = canonical(conn.local_addr()?);
            anyhow::ensure!(local == orig, "getsockname {local} != SO_ORIGINAL_DST {orig}");
            writeln!(conn, "INBOUND {orig} FROM {}", canonical(conn.peer_addr()?))?;
        } else {
            writeln!(conn, "ORIG_DST {orig}")?;
        }
        return Ok(());
    }
    let upstream = connect_upstream(orig).with_context(|| format!("connecting to {orig}"))?;
    let (mut up_r, mut up_w) = (upstream.try_clone()?, upstream);
    let (mut down_r, mut down_w) = (conn.try_clone()?, conn);
    let up = std::thread::spawn(move || -> io::Result<u64> {
        let n = io::copy(&mut down_r, &mut up_w)?;
        up_w.shutdown(std::net::Shutdown::Write)?;
        Ok(n)
    });
    let down = io::copy(&mut up_r, &mut down_w)?;
    let _ = down_w.shutdown(std::net::Shutdown::Write);
    let up = up.join().map_err(|_| anyhow::anyhow!("copy thread panicked"))??;
    println!("FORWARDED {up} {down}");
    io::stdout().flush()?;
    Ok(())
}
