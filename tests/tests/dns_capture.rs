//! DNS capture without netfilter: a pod's DNS (UDP, connected UDP, TCP, to port 53) reaches the
//! proxy's DNS listener (15053) inside the pod, and UDP replies reach the app from the server it
//! queried. IPv4 and IPv6, real kernel, real namespaces, real sockets.

use std::{
    net::{SocketAddr, UdpSocket},
    time::Duration,
};

use datapath_common::consts::ports;
use meshpath_loader::pods::EnrolOptions;
use meshpath_tests::{read_line, Mesh, Sentinel};

fn dns(capture_outbound: bool) -> Mesh {
    Mesh::new(EnrolOptions { capture_dns: true, capture_outbound, ..EnrolOptions::default() })
}

/// A UDP socket in pod a, bound to the wildcard of `to`'s family.
fn udp_in_a(mesh: &Mesh, to: SocketAddr) -> UdpSocket {
    let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("addr");
    let sock = mesh.pods.a.open().expect("netns").run(|| UdpSocket::bind(any)).expect("netns");
    let sock = sock.expect("bind");
    sock.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    sock
}

fn udp_query_is_answered_from_the_server_queried(v6: bool) {
    let mesh = dns(false).with_proxy("echo");
    // No DNS server runs in pod b: only the proxy can answer.
    let server = mesh.b(v6, ports::DNS_UPSTREAM);
    let sock = udp_in_a(&mesh, server);
    sock.send_to(b"query-1", server).expect("sendto");
    let mut buf = [0u8; 512];
    let (n, from) = meshpath_tests::again_after_eintr(|| sock.recv_from(&mut buf)).expect("reply");
    assert_eq!(&buf[..n], b"ANSWER query-1");
    assert_eq!(from, server, "the reply must come from the server the app queried");
}

#[test]
fn udp_dns_reaches_the_dns_proxy_and_the_reply_comes_from_the_server_queried_v4() {
    udp_query_is_answered_from_the_server_queried(false);
}

#[test]
fn udp_dns_reaches_the_dns_proxy_and_the_reply_comes_from_the_server_queried_v6() {
    udp_query_is_answered_from_the_server_queried(true);
}

#[test]
fn connected_udp_dns_reaches_the_dns_proxy() {
    let mesh = dns(false).with_proxy("echo");
    for v6 in [false, true] {
        let server = mesh.b(v6, ports::DNS_UPSTREAM);
        let sock = udp_in_a(&mesh, server);
        mesh.pods
            .a
            .open()
            .expect("netns")
            .run(|| sock.connect(server))
            .expect("netns")
            .expect("connect");
        assert_eq!(sock.peer_addr().expect("getpeername"), server);
        sock.send(b"query-2").expect("send");
        let mut buf = [0u8; 512];
        let n = meshpath_tests::again_after_eintr(|| sock.recv(&mut buf)).expect("reply");
        assert_eq!(&buf[..n], b"ANSWER query-2", "v6={v6}");
    }
}

#[test]
fn tcp_dns_reaches_the_dns_proxy() {
    // Outbound capture off: port 53 alone is steered, to 15053, not 15001 (the proxy says
    // which of its listeners accepted it).
    let mesh = dns(false).with_proxy("echo");
    let proxy = mesh.proxy.as_ref().expect("proxy");
    for v6 in [false, true] {
        let server = mesh.b(v6, ports::DNS_UPSTREAM);
        let conn = mesh.connect_from_a(server, None).expect("tcp dns connect");
        assert_eq!(read_line(&conn), format!("ORIG_DST {server}"));
        let accepted = format!("ACCEPTED {server} FROM ");
        assert!(proxy.wait_for_line(&accepted, Duration::from_secs(5)), "no ACCEPTED line");
        let lines = proxy.lines();
        let line = lines.iter().find(|l| l.starts_with(&accepted)).expect("the proxy's line");
        assert!(line.ends_with(&format!(":{}", ports::DNS)), "not the DNS listener: {line}");
    }
}

#[test]
fn dns_is_refused_when_the_proxy_is_not_running() {
    let mesh = dns(false);
    let server = mesh.b(false, ports::DNS_UPSTREAM);
    let tcp_server = Sentinel::new(&mesh.pods.b, server);
    assert!(mesh.connect_from_a(server, None).is_err(), "tcp dns leaked");
    tcp_server.assert_untouched("TCP DNS without a proxy");
    let sock = udp_in_a(&mesh, server);
    sock.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
    // A real DNS server in pod b would answer a leaked query.
    let real = mesh.pods.b.open().expect("netns").run(|| UdpSocket::bind(server)).expect("netns");
    let real = real.expect("bind");
    real.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
    let _ = sock.send_to(b"query-3", server);
    let mut buf = [0u8; 64];
    assert!(
        meshpath_tests::again_after_eintr(|| real.recv_from(&mut buf)).is_err(),
        "the query leaked around the proxy"
    );
}

#[test]
fn dns_is_not_captured_when_dns_capture_is_off() {
    let mesh = Mesh::new(EnrolOptions { capture_outbound: true, ..EnrolOptions::default() });
    let server = mesh.b(false, ports::DNS_UPSTREAM);
    let real = mesh.pods.b.open().expect("netns").run(|| UdpSocket::bind(server)).expect("netns");
    let real = real.expect("bind");
    real.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let sock = udp_in_a(&mesh, server);
    sock.send_to(b"query-4", server).expect("sendto");
    let mut buf = [0u8; 64];
    let (n, _) = meshpath_tests::again_after_eintr(|| real.recv_from(&mut buf))
        .expect("the real server got the query");
    assert_eq!(&buf[..n], b"query-4");
}

/// A UDP socket connected to a DNS server (captured), disconnected, and connected elsewhere
/// (not captured) shows its new peer and talks to it: the destination it was steered to before
/// is forgotten, as a new connect() replaces REDIRECT's NAT mapping. (Disconnected first: the
/// steered connect bound the socket to loopback, the DNS listener's address, and a socket bound
/// there cannot connect off the host; disconnecting unbinds an address the kernel chose.)
#[test]
fn a_udp_socket_connected_again_elsewhere_shows_and_reaches_its_new_peer() {
    let mesh = dns(false).with_proxy("echo");
    for v6 in [false, true] {
        let dns_server = mesh.b(v6, ports::DNS_UPSTREAM);
        let other = mesh.b(v6, 5300);
        // A real UDP echo server at the second destination, in pod b.
        let echo = mesh.pods.b.open().expect("netns b").run(|| UdpSocket::bind(other));
        let echo = echo.expect("netns b").expect("bind echo");
        echo.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let server = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            let (n, from) = meshpath_tests::again_after_eintr(|| echo.recv_from(&mut buf))?;
            echo.send_to(&buf[..n], from)
        });

        let sock = udp_in_a(&mesh, dns_server);
        let a = mesh.pods.a.open().expect("netns a");
        a.run(|| sock.connect(dns_server)).expect("netns").expect("connect to the DNS server");
        assert_eq!(sock.peer_addr().expect("getpeername"), dns_server);
        disconnect(&sock);
        a.run(|| sock.connect(other)).expect("netns").expect("connect elsewhere");
        assert_eq!(sock.peer_addr().expect("getpeername"), other, "v6={v6}");
        sock.send(b"hello").expect("send");
        let mut buf = [0u8; 64];
        let n = meshpath_tests::again_after_eintr(|| sock.recv(&mut buf))
            .expect("the real server's echo");
        assert_eq!(&buf[..n], b"hello", "v6={v6}");
        server.join().expect("echo server").expect("echo io");
    }
}

/// connect(2) with an `AF_UNSPEC` address: the socket's association (and a local address the
/// kernel chose for it) is dissolved.
fn disconnect(sock: &UdpSocket) {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a zeroed sockaddr of family AF_UNSPEC, passed with its own size, to an open socket.
    let rc = unsafe {
        let mut unspec: libc::sockaddr = std::mem::zeroed();
        unspec.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
        libc::connect(sock.as_raw_fd(), &unspec, size_of::<libc::sockaddr>() as libc::socklen_t)
    };
    assert_eq!(rc, 0, "disconnect: {}", std::io::Error::last_os_error());
}
