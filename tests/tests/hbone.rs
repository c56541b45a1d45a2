//! The HBONE proxy on the eBPF datapath: two "nodes" (one meshpath-proxy process each, in its
//! own cgroup registered as the proxy's), pod a on node 1 with outbound capture, pod b on node 2.
//! An app in pod a reaches pod b through HTTP/2 CONNECT over mutual TLS with certificates made
//! now from a CA made now; identities are checked; bad requests get Istio's status codes.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr},
    process::Command,
    time::Duration,
};

use meshpath_proxy::{
    identity::tls,
    identity::Identity,
    proxy::hbone::{self, HboneError},
};
use meshpath_tests::two_nodes::{sa, Setup, TwoNodes, View, MESHED};

fn hbone_round_trip(v6: bool) {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(v6, 8080);
    let server = nodes.echo_in_b(dst);
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    let back = nodes.app_round_trip(dst, &payload).expect("round trip");
    assert_eq!(back, payload);
    // The app was reached through node 2's proxy (it counted the connection), which kept the
    // client's address: the app sees pod a.
    let from = server.join().expect("server").expect("server io");
    assert_eq!(from.ip(), nodes.a(v6, 0).ip(), "the client's address was not kept (v6={v6})");
    let carried = nodes.proxies[1]
        .metric("istio_tcp_connections_opened_total", &[("reporter", "destination")])
        .expect("metrics");
    assert_eq!(carried, 1.0, "the app was not reached through node 2's proxy (v6={v6})");
}

#[test]
fn an_app_reaches_a_meshed_pod_through_hbone_v4() {
    hbone_round_trip(false);
}

#[test]
fn an_app_reaches_a_meshed_pod_through_hbone_v6() {
    hbone_round_trip(true);
}

#[test]
fn an_unmeshed_destination_is_reached_by_passthrough() {
    let nodes = TwoNodes::new(View { b_protocol: "TCP", ..MESHED });
    let dst = nodes.b(false, 8081);
    let server = nodes.echo_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"plain").expect("round trip"), b"plain");
    let from = server.join().expect("server").expect("server io");
    assert_eq!(from.ip(), IpAddr::from(nodes.pods.a_ip), "passthrough leaves from pod a's address");
}

#[test]
fn a_server_with_another_identity_is_refused() {
    // Node 1 expects pod b to be sa-expected; node 2 gives it sa-b.
    let nodes = TwoNodes::new(View { b_service_account: "sa-expected", ..MESHED });
    let dst = nodes.b(false, 8082);
    let listener = nodes.pods.b.listen(dst).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let back = nodes.app_round_trip(dst, b"secret").unwrap_or_default();
    assert!(back.is_empty(), "data came back through a server with the wrong identity");
    assert!(listener.accept().is_err(), "the app was reached");
}

#[test]
fn plaintext_to_the_hbone_port_is_refused() {
    let nodes = TwoNodes::new(MESHED);
    let hbone_port = nodes.b(false, 15008);
    // From pod b itself, which is not captured outbound.
    let mut conn = nodes
        .pods
        .b
        .open()
        .expect("b")
        .run(|| std::net::TcpStream::connect(hbone_port))
        .expect("netns")
        .expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let mut buf = [0u8; 512];
    // Refused: closed (EOF, or whatever the TLS stack answered) or reset. A read that times
    // out means the proxy neither served nor refused it, which fails too.
    let n = match meshpath_tests::again_after_eintr(|| conn.read(&mut buf)) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
        Err(e) => panic!("the proxy did not close a plaintext connection to 15008: {e}"),
    };
    assert!(!String::from_utf8_lossy(&buf[..n]).contains("HTTP/1.1 200"), "plaintext was served");
}

/// A raw HBONE client in pod b's netns with a certificate from the mesh CA, as another node's
/// proxy would be.
async fn raw_connect(nodes: &TwoNodes, dst: SocketAddr) -> Result<(), HboneError> {
    let client = nodes
        .ca
        .issue(&Identity::new("cluster.local", "default", "sa-a"), Duration::from_secs(600))
        .expect("cert");
    nodes.hbone_to_b(&client, dst).await
}

#[tokio::test]
async fn connect_to_an_address_other_than_the_one_dialed_is_answered_400() {
    let nodes = TwoNodes::new(MESHED);
    let other = SocketAddr::new(nodes.pods.a_ip.into(), 8083);
    match raw_connect(&nodes, other).await {
        Err(HboneError::Status { status, .. }) => assert_eq!(status, 400),
        other => panic!("expected 400, got {other:?}"),
    }
}

/// ztunnel connects to the address dialed with the authority's port: an IPv4 address named in
/// its IPv6 form (`[::ffff:a.b.c.d]`) is the same destination, and the app still sees the
/// client's own address, not its pod's.
#[tokio::test]
async fn connect_naming_the_dialed_ipv4_address_in_its_ipv6_form_keeps_the_clients_address() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8086);
    let server = nodes.echo_in_b(dst);
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let conn = nodes.hbone_conn_from_a(&cert).await.expect("HBONE from pod a");
    let mapped = SocketAddr::new(nodes.pods.b_ip.to_ipv6_mapped().into(), dst.port());
    let stream = hbone::open_stream(conn, nodes.b(false, 15008), mapped, &Default::default())
        .await
        .expect("200");
    drop(stream);
    let from = server.join().expect("server").expect("server io");
    assert_eq!(from.ip(), IpAddr::from(nodes.pods.a_ip), "the app saw {from}, not pod a");
}

#[tokio::test]
async fn connect_to_an_app_that_is_not_listening_is_answered_503() {
    let nodes = TwoNodes::new(MESHED);
    match raw_connect(&nodes, nodes.b(false, 1)).await {
        Err(HboneError::Status { status, .. }) => assert_eq!(status, 503),
        other => panic!("expected 503, got {other:?}"),
    }
}

#[tokio::test]
async fn connect_to_a_listening_app_is_answered_200() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8084);
    let _server = nodes.echo_in_b(dst);
    raw_connect(&nodes, dst).await.expect("200");
}

#[test]
fn plaintext_to_a_pod_captured_inbound_goes_through_its_proxy() {
    // Node 1 sees pod b as unmeshed (passthrough), so pod a sends plain TCP; pod b captures
    // inbound, so node 2's proxy takes it on 15006 and connects to the app from inside pod b.
    let nodes = TwoNodes::new(View { b_protocol: "TCP", b_inbound_captured: true, ..MESHED });
    let dst = nodes.b(false, 8085);
    let server = nodes.echo_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"plain in").expect("round trip"), b"plain in");
    let from = server.join().expect("server").expect("server io");
    assert_eq!(from.ip(), IpAddr::from(nodes.pods.a_ip), "the client's address was not kept");
    let carried = nodes.proxies[1]
        .metric(
            "istio_tcp_connections_opened_total",
            &[("reporter", "destination"), ("connection_security_policy", "unknown")],
        )
        .expect("metrics");
    assert_eq!(carried, 1.0, "the app was not reached through node 2's proxy");
}

#[test]
fn without_source_preservation_the_app_sees_the_pods_own_address() {
    let nodes =
        TwoNodes::start(Setup { args: vec!["--no-preserve-source".into()], ..Setup::default() });
    let dst = nodes.b(false, 8111);
    let server = nodes.echo_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"plain src").expect("round trip"), b"plain src");
    let from = server.join().expect("server").expect("server io");
    assert_eq!(from.ip(), dst.ip());
}

#[test]
fn sigterm_stops_new_connections_and_lets_open_ones_finish() {
    let mut nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8086);
    let server = nodes.echo_in_b(dst);
    let mut open = nodes.connect_from_a(dst).expect("connect");
    let mut buf = [0u8; 5];
    open.write_all(b"one..").expect("send");
    open.read_exact(&mut buf).expect("echo before SIGTERM");

    nodes.proxies[0].proxy.signal(libc::SIGTERM).expect("SIGTERM node 1's proxy");
    // New connections are refused once the proxy has closed its listener (capture fails
    // closed): wait for that, a bounded number of tries, rather than for a fixed time.
    let refused = (0..250).any(|_| {
        let new = nodes
            .pods
            .a
            .open()
            .expect("a")
            .run(|| std::net::TcpStream::connect(nodes.b(false, 8087)))
            .expect("netns");
        match new {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => true,
            _ => {
                std::thread::sleep(Duration::from_millis(20));
                false
            }
        }
    });
    assert!(refused, "new connections were still accepted 5 s after SIGTERM");
    // ...the open one still carries data...
    open.write_all(b"two..").expect("send while draining");
    open.read_exact(&mut buf).expect("echo while draining");
    assert_eq!(&buf, b"two..");
    assert!(
        !nodes.proxies[0].proxy.wait_exit(Duration::from_millis(200)),
        "exited with a connection open"
    );
    // ...and the proxy exits once it is closed.
    drop(open);
    server.join().expect("server").expect("server io");
    assert!(
        nodes.proxies[0].proxy.wait_exit(Duration::from_secs(10)),
        "did not exit after draining"
    );
}

/// Established TCP connections to pod b's HBONE port, seen from pod b.
fn hbone_connections(nodes: &TwoNodes) -> usize {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", nodes.pods.b.path().display()))
        .args(["ss", "-Htn", "state", "established", "( sport = :15008 )"])
        .output()
        .expect("ss");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// Node 1's proxy started with `args`; five app connections from pod a to one destination in
/// pod b, opened one after another and all held open: how many HBONE connections carry them.
fn hbone_connections_for_five_streams(args: &[&str], port: u16) -> usize {
    let nodes = TwoNodes::start(Setup {
        args: args.iter().map(|a| a.to_string()).collect(),
        ..Setup::default()
    });
    let dst = nodes.b(false, port);
    nodes.echo_server_in_b(dst);
    let mut conns = Vec::new();
    for i in 0..5u8 {
        let mut c = nodes.connect_from_a(dst).expect("connect");
        c.write_all(&[i; 3]).expect("send");
        let mut back = [0u8; 3];
        c.read_exact(&mut back).expect("echo");
        assert_eq!(back, [i; 3]);
        conns.push(c);
    }
    hbone_connections(&nodes)
}

#[test]
fn concurrent_streams_to_one_destination_are_spread_over_four_hbone_connections_then_share_them() {
    assert_eq!(hbone_connections_for_five_streams(&[], 8089), 4, "5 streams, spread over 4");
}

#[test]
fn with_a_spread_of_one_concurrent_streams_share_one_hbone_connection_as_in_ztunnel() {
    assert_eq!(hbone_connections_for_five_streams(&["--pool-spread", "1"], 8090), 1);
}

#[test]
fn a_connection_at_its_stream_limit_makes_the_pool_open_another() {
    // Spread over 2 (2 streams each), then a third for the fifth stream.
    let args = ["--pool-max-streams", "2", "--pool-spread", "2"];
    assert_eq!(hbone_connections_for_five_streams(&args, 8104), 3, "5 streams at 2 per connection");
}

#[test]
fn an_idle_pooled_connection_is_released() {
    let nodes = TwoNodes::start(Setup {
        args: vec!["--pool-idle-seconds".into(), "2".into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8105);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"once").expect("round trip"), b"once");
    // Pooled first (its stream is over, the connection stays)...
    let pooled = nodes.proxies[0].metric("meshpath_pool_connections", &[]).expect("metrics");
    assert_eq!(pooled, 1.0, "the connection was not pooled");
    // ...then released once idle for 2 s.
    let released = nodes.proxies[0].wait_metrics(Duration::from_secs(15), |m| {
        m.contains("meshpath_pool_connections 0")
            && m.contains("meshpath_pool_connections_opened_total 1")
    });
    assert!(released, "the idle connection stayed in the pool");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while hbone_connections(&nodes) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(hbone_connections(&nodes), 0, "the released connection is still open");
}

/// What a peer proxy sees of one CONNECT from node 1's proxy.
#[derive(Debug)]
struct Seen {
    sni: Option<String>,
    alpn: Option<Vec<u8>>,
    version: Option<rustls::ProtocolVersion>,
    client: Vec<Identity>,
    method: http::Method,
    authority: String,
    headers: http::HeaderMap,
}

#[tokio::test]
async fn the_connect_request_is_what_ztunnel_sends() {
    let mut nodes = TwoNodes::new(MESHED);
    // Node 2's proxy stands down; a bare HTTP/2-over-TLS server takes pod b's port 15008.
    nodes.proxies[1].proxy.stop();
    let server_cert = nodes
        .ca
        .issue(&Identity::new("cluster.local", "default", "sa-b"), Duration::from_secs(600))
        .expect("cert");
    let config = tls::server_config(&server_cert, std::slice::from_ref(&nodes.ca.cert_der))
        .expect("server config");
    let listener =
        nodes.pods.b.listen_in_cgroup(nodes.b(false, 15008), &nodes.cgroup).expect("bind 15008");
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let tls = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await.expect("TLS");
        let (_, conn) = tls.get_ref();
        let (sni, alpn, version) = (
            conn.server_name().map(str::to_owned),
            conn.alpn_protocol().map(<[u8]>::to_vec),
            conn.protocol_version(),
        );
        let client = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .map(tls::spiffe_ids)
            .unwrap_or_default();
        let mut h2 = h2::server::handshake(tls).await.expect("h2");
        let (req, mut respond) = h2.accept().await.expect("a stream").expect("stream");
        let seen = Seen {
            sni,
            alpn,
            version,
            client,
            method: req.method().clone(),
            authority: req.uri().authority().map(|a| a.to_string()).unwrap_or_default(),
            headers: req.headers().clone(),
        };
        let mut send = respond.send_response(http::Response::new(()), false).expect("200");
        send.send_data(bytes::Bytes::from_static(b"hello from b"), true).expect("data");
        tokio::spawn(async move { while h2.accept().await.is_some() {} });
        seen
    });
    let dst = nodes.b(false, 8110);
    let app = tokio::task::spawn_blocking(move || {
        let mut c = nodes.connect_from_a(dst).expect("connect");
        let mut buf = [0u8; 12];
        c.read_exact(&mut buf).expect("the server's bytes");
        let local = c.local_addr().expect("local");
        (buf, local, nodes)
    });
    let seen = server.await.expect("server");
    let (buf, app_addr, nodes) = app.await.expect("app");
    assert_eq!(&buf, b"hello from b");
    assert_eq!(seen.sni, None, "SNI was sent");
    assert_eq!(seen.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(seen.version, Some(rustls::ProtocolVersion::TLSv1_3));
    assert_eq!(seen.client, vec![Identity::new("cluster.local", "default", "sa-a")]);
    assert_eq!(seen.method, http::Method::CONNECT);
    assert_eq!(seen.authority, dst.to_string());
    let header =
        |n: &str| seen.headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    // The app's address as under iptables: the pod's, with the app's port (its socket itself
    // was steered to loopback).
    assert_eq!(header("forwarded"), format!("for=\"{}:{}\"", nodes.pods.a_ip, app_addr.port()));
    let baggage = header("baggage");
    for kv in ["k8s.namespace.name=default", "k8s.cluster.name=", "service.name="] {
        assert!(baggage.contains(kv), "baggage {baggage:?} lacks {kv}");
    }
    let tp = header("traceparent");
    let parts: Vec<&str> = tp.split('-').collect();
    assert!(
        parts.len() == 4
            && parts[0] == "00"
            && parts[1].len() == 32
            && parts[2].len() == 16
            && parts[1..3].iter().all(|p| p.bytes().all(|b| b.is_ascii_hexdigit())),
        "traceparent {tp:?}"
    );
}
