//! Services and DNS: a connection to a service VIP is carried to one of its healthy endpoints
//! (on the endpoint's target port); a pod's DNS questions for a service hostname are answered
//! with its VIPs by its node's proxy, other names are forwarded to the upstream resolver from
//! inside the pod.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use hickory_proto::{
    op::{Message, MessageType, Query},
    rr::{rdata::A, Name, RData, Record, RecordType},
    serialize::binary::{BinDecodable as _, BinEncodable as _},
};
use meshpath_tests::two_nodes::{Setup, TwoNodes};

const SERVICES: &str = "services:\n\
- {name: b, namespace: default, hostname: b.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {80: 8090}}\n\
- {name: c, namespace: default, hostname: c.default.svc.cluster.local, vips: [\"/10.96.0.11\"]}\n";

fn nodes(dns: bool, args: &[String]) -> TwoNodes {
    TwoNodes::start(Setup {
        yaml: SERVICES.into(),
        capture_dns: dns,
        args: args.to_vec(),
        ..Setup::default()
    })
}

#[test]
fn a_service_vip_is_carried_to_a_healthy_endpoint_on_its_target_port() {
    let nodes = nodes(false, &[]);
    let server = nodes.echo_in_b(nodes.b(false, 8090));
    let vip: SocketAddr = "10.96.0.10:80".parse().expect("vip");
    assert_eq!(nodes.app_round_trip(vip, b"via the VIP").expect("round trip"), b"via the VIP");
    // Reached through node 2's proxy, which kept pod a's address as the client's.
    let from = server.join().expect("server").expect("io");
    assert_eq!(from.ip(), IpAddr::from(nodes.pods.a_ip));
    let carried = nodes.proxies[1]
        .metric("istio_tcp_connections_opened_total", &[("reporter", "destination")])
        .expect("metrics");
    assert_eq!(carried, 1.0, "not reached through node 2's proxy");
    let counted = nodes.proxies[0]
        .metric(
            "istio_tcp_connections_opened_total",
            &[("destination_service", "b.default.svc.cluster.local")],
        )
        .expect("metrics");
    assert_eq!(counted, 1.0);
}

#[test]
fn a_service_without_a_healthy_endpoint_is_refused_and_counted() {
    let nodes = nodes(false, &[]);
    let vip: SocketAddr = "10.96.0.11:80".parse().expect("vip");
    assert!(nodes.app_round_trip(vip, b"anyone?").unwrap_or_default().is_empty());
    let refused = nodes.proxies[0]
        .metric("meshpath_connection_errors_total", &[("reason", "no_healthy_endpoint")])
        .expect("metrics");
    assert_eq!(refused, 1.0);
}

fn query(name: &str, ty: RecordType) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(4242).set_recursion_desired(true);
    m.add_query(Query::query(Name::from_ascii(name).expect("name"), ty));
    m.to_bytes().expect("encode")
}

fn answers(reply: &[u8]) -> Vec<String> {
    let m = Message::from_bytes(reply).expect("reply parses");
    assert_eq!(m.id(), 4242);
    m.answers().iter().filter_map(|r| r.data()).map(ToString::to_string).collect()
}

/// Pod a's resolver asking `server` over UDP (the datapath steers it to the proxy).
fn ask_udp(nodes: &TwoNodes, server: SocketAddr, q: &[u8]) -> (Vec<u8>, SocketAddr) {
    let sock = nodes
        .pods
        .a
        .open()
        .expect("a")
        .run(|| UdpSocket::bind("0.0.0.0:0"))
        .expect("netns")
        .expect("bind");
    sock.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    sock.send_to(q, server).expect("send");
    let mut buf = [0u8; 4096];
    let (n, from) =
        meshpath_tests::again_after_eintr(|| sock.recv_from(&mut buf)).expect("a DNS reply");
    (buf[..n].to_vec(), from)
}

#[test]
fn a_service_hostname_resolves_to_its_vip_inside_the_pod() {
    let nodes = nodes(true, &[]);
    let server: SocketAddr = "10.199.0.53:53".parse().expect("server");
    let (reply, from) =
        ask_udp(&nodes, server, &query("b.default.svc.cluster.local.", RecordType::A));
    assert_eq!(answers(&reply), vec!["10.96.0.10"]);
    assert_eq!(from, server, "the reply does not come from the server asked");
    // No IPv6 VIP: an empty answer, not a forward.
    let (reply, _) =
        ask_udp(&nodes, server, &query("b.default.svc.cluster.local.", RecordType::AAAA));
    assert!(answers(&reply).is_empty());
}

/// A TCP connection from pod a to a DNS server's port 53 (captured: it reaches the proxy's 15053).
fn dns_over_tcp_from_a(nodes: &TwoNodes) -> TcpStream {
    let server: SocketAddr = "10.199.0.53:53".parse().expect("server");
    nodes
        .pods
        .a
        .open()
        .expect("a")
        .run(|| TcpStream::connect_timeout(&server, Duration::from_secs(5)))
        .expect("netns")
        .expect("connect")
}

#[test]
fn a_service_hostname_resolves_over_tcp_too() {
    let nodes = nodes(true, &[]);
    let mut conn = dns_over_tcp_from_a(&nodes);
    conn.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let q = query("b.default.svc.cluster.local.", RecordType::A);
    let len = u16::try_from(q.len()).expect("len").to_be_bytes();
    conn.write_all(&[&len[..], &q].concat()).expect("send");
    let mut len = [0u8; 2];
    conn.read_exact(&mut len).expect("length");
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
    conn.read_exact(&mut reply).expect("reply");
    assert_eq!(answers(&reply), vec!["10.96.0.10"]);
}

#[test]
fn a_dns_over_tcp_client_that_sends_nothing_is_disconnected() {
    let nodes = nodes(true, &[]);
    let mut conn = dns_over_tcp_from_a(&nodes);
    // Far longer than the proxy's idle limit (10 s): the proxy must have closed it by then.
    let mut buf = [0u8; 16];
    match meshpath_tests::read_within(Duration::from_secs(40), |t| {
        conn.set_read_timeout(Some(t))?;
        conn.read(&mut buf)
    }) {
        Ok(0) => {}
        Ok(n) => panic!("answered {n} bytes to nothing"),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("still open after 40 s ({e})"),
    }
}

#[test]
fn other_names_are_forwarded_to_the_upstream_from_inside_the_pod() {
    // The upstream resolver: pod b, port 5300, answering every A question with 192.0.2.7.
    // (Every PodPair gives pod b 10.199.0.2, in namespaces of its own.)
    let upstream: SocketAddr = "10.199.0.2:5300".parse().expect("upstream");
    let nodes = nodes(true, &["--dns-upstream".into(), upstream.to_string()]);
    let sock = nodes
        .pods
        .b
        .open()
        .expect("b")
        .run(|| UdpSocket::bind(upstream))
        .expect("netns")
        .expect("bind");
    sock.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let fake = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let (n, from) = meshpath_tests::again_after_eintr(|| sock.recv_from(&mut buf))?;
        let q = Message::from_bytes(&buf[..n]).map_err(std::io::Error::other)?;
        let mut r = Message::new();
        r.set_id(q.id()).set_message_type(MessageType::Response).add_queries(q.queries().to_vec());
        if let Some(name) = q.queries().first().map(|q| q.name().clone()) {
            r.add_answer(Record::from_rdata(name, 5, RData::A(A::new(192, 0, 2, 7))));
        }
        sock.send_to(&r.to_bytes().map_err(std::io::Error::other)?, from)?;
        Ok::<_, std::io::Error>(from)
    });
    let server: SocketAddr = "10.199.0.53:53".parse().expect("server");
    let (reply, _) = ask_udp(&nodes, server, &query("example.org.", RecordType::A));
    assert_eq!(answers(&reply), vec!["192.0.2.7"]);
    let asked_from = fake.join().expect("upstream").expect("upstream io");
    assert_eq!(asked_from.ip(), IpAddr::from(nodes.pods.a_ip), "not forwarded from pod a");
}
