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
    let (n, from) = sock.recv_from(&mut buf).expect("reply");
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
        let n = sock.recv(&mut buf).expect("reply");
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
    assert!(real.recv_from(&mut buf).is_err(), "the query leaked around the proxy");
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
    let (n, _) = real.recv_from(&mut buf).expect("the real server got the query");
    assert_eq!(&buf[..n], b"query-4");
}
