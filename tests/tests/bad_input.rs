//! Bad input at the HBONE port and on the outbound path: each case refused with a clear log line
//! and a metric, the proxy keeps serving, and nothing is left behind (no socket, no task).

use std::{
    io::Write as _,
    net::TcpStream,
    sync::Arc,
    time::{Duration, Instant},
};

use meshpath_proxy::{
    identity::tls,
    proxy::hbone::{self, HboneError},
};
use meshpath_tests::{
    sum_metric,
    two_nodes::{sa, Setup, TwoNodes, View, MESHED},
};

fn nodes() -> TwoNodes {
    TwoNodes::start(Setup {
        args: vec!["--handshake-timeout-seconds".into(), "1".into()],
        ..Setup::default()
    })
}

/// The proxy's count of errors for `reason`, once it has counted one (up to 5 s): the peer
/// can see the connection end (the GOAWAY, the reset) before the proxy's task that ends it has
/// counted it. Read again after that, so a second count would show.
fn errors(nodes: &TwoNodes, node: usize, reason: &str) -> f64 {
    let proxy = &nodes.proxies[node];
    let labels = [("reason", reason)];
    proxy.wait_metrics(Duration::from_secs(5), |m| {
        sum_metric(m, "meshpath_connection_errors_total", &labels) >= 1.0
    });
    proxy.metric("meshpath_connection_errors_total", &labels).expect("metrics")
}

/// A TCP connection to pod b's HBONE port, from pod b's netns (not captured).
fn tcp_to_hbone(nodes: &TwoNodes) -> TcpStream {
    let c = nodes
        .pods
        .b
        .open()
        .expect("b")
        .run(|| TcpStream::connect(nodes.b(false, 15008)))
        .expect("netns")
        .expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    c
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// A client TLS configuration with a valid sa-a certificate, offering `alpn`.
fn client_tls(nodes: &TwoNodes, alpn: &[u8]) -> Arc<rustls::ClientConfig> {
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let config =
        tls::client_config(&cert, std::slice::from_ref(&nodes.ca.cert_der), vec![sa("sa-b")])
            .expect("config");
    let mut c = (*config).clone();
    c.alpn_protocols = vec![alpn.to_vec()];
    Arc::new(c)
}

/// An HBONE connection to pod b, as a peer proxy would open it.
async fn hbone_conn(nodes: &TwoNodes) -> Result<hbone::Connection, HboneError> {
    let tcp = tcp_to_hbone(nodes);
    tcp.set_nonblocking(true).expect("nonblocking");
    let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio");
    hbone::handshake(tcp, nodes.b(false, 15008), client_tls(nodes, b"h2")).await
}

/// Whether pod b still serves HBONE: one CONNECT answered 200 and echoed.
fn still_serves(nodes: &TwoNodes) -> bool {
    rt().block_on(async {
        let Ok(conn) = hbone_conn(nodes).await else { return false };
        hbone::open_stream(conn, nodes.b(false, 15008), nodes.b(false, 8101), &Default::default())
            .await
            .is_ok()
    })
}

/// `n` CONNECT streams to `dst`, each sent and dropped at once (the client resets it), until
/// the server stops taking them.
async fn reset_flood(conn: hbone::Connection, dst: std::net::SocketAddr, n: usize) {
    for _ in 0..n {
        let Ok(mut c) = conn.clone().ready().await else { break };
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(dst.to_string())
            .body(())
            .expect("request");
        let Ok(sent) = c.send_request(req, false) else { break };
        drop(sent);
    }
}

/// Whether the proxy closed the connection (an end of stream, a reset) without an HTTP/1
/// answer. A read that times out is not a close: the connection was left open.
fn closed_without_answer(mut c: impl std::io::Read) -> bool {
    let mut buf = [0u8; 256];
    match meshpath_tests::again_after_eintr(|| c.read(&mut buf)) {
        Ok(0) => true,
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::ConnectionAborted
        ),
        Ok(n) => !String::from_utf8_lossy(&buf[..n]).contains("HTTP/1"),
    }
}

#[test]
fn http1_inside_tls_to_the_hbone_port_is_refused() {
    let nodes = nodes();
    nodes.echo_server_in_b(nodes.b(false, 8101));
    let closed = rt().block_on(async {
        let tcp = tcp_to_hbone(&nodes);
        tcp.set_nonblocking(true).expect("nonblocking");
        let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio");
        let name = rustls::pki_types::ServerName::IpAddress(nodes.b(false, 0).ip().into());
        let mut tls = tokio_rustls::TlsConnector::from(client_tls(&nodes, b"h2"))
            .connect(name, tcp)
            .await
            .expect("TLS handshake");
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        tls.write_all(b"GET / HTTP/1.1\r\nHost: b\r\n\r\n").await.expect("send");
        let mut buf = vec![0u8; 256];
        match tls.read(&mut buf).await {
            Ok(0) | Err(_) => true,
            Ok(n) => !String::from_utf8_lossy(&buf[..n]).contains("HTTP/1"),
        }
    });
    assert!(closed, "HTTP/1 was answered");
    assert_eq!(errors(&nodes, 1, "http2_handshake"), 1.0);
    assert!(still_serves(&nodes));
}

#[test]
fn a_client_offering_only_http1_alpn_is_refused_at_the_handshake() {
    let nodes = nodes();
    nodes.echo_server_in_b(nodes.b(false, 8101));
    let result = rt().block_on(async {
        let tcp = tcp_to_hbone(&nodes);
        tcp.set_nonblocking(true).expect("nonblocking");
        let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio");
        let name = rustls::pki_types::ServerName::IpAddress(nodes.b(false, 0).ip().into());
        tokio_rustls::TlsConnector::from(client_tls(&nodes, b"http/1.1")).connect(name, tcp).await
    });
    assert!(result.is_err(), "a handshake without h2 succeeded");
    assert_eq!(errors(&nodes, 1, "tls_handshake"), 1.0);
    assert!(still_serves(&nodes));
}

#[test]
fn a_client_that_never_finishes_its_handshake_is_disconnected() {
    let nodes = nodes();
    // Connected, a few bytes that are not a ClientHello's end, then silence.
    let mut c = tcp_to_hbone(&nodes);
    c.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).expect("send");
    assert!(closed_without_answer(&mut c), "the silent client was answered");
    let timed_out = nodes.proxies[1]
        .wait_metrics(Duration::from_secs(10), |m| m.contains("reason=\"handshake_timeout\"} 1"));
    assert!(timed_out, "the handshake timeout was not counted");
}

#[test]
fn a_connect_with_oversized_headers_is_refused_and_the_proxy_keeps_serving() {
    let nodes = nodes();
    nodes.echo_server_in_b(nodes.b(false, 8101));
    let result = rt().block_on(async {
        let conn = hbone_conn(&nodes).await.expect("HBONE");
        let mut conn = conn.ready().await.expect("ready");
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(nodes.b(false, 8101).to_string())
            .header("x-big", "a".repeat(100 * 1024))
            .body(())
            .expect("request");
        // The refusal must be the server's (a status, or a reset it sent): an error the client
        // made up itself would show nothing about the proxy.
        match conn.send_request(req, false) {
            Ok((resp, _send)) => match resp.await {
                Ok(r) => Ok(r.status()),
                Err(e) if e.is_remote() => Err(format!("the server reset it: {e}")),
                Err(e) => panic!("the client failed on its own, the server was never asked: {e}"),
            },
            Err(e) => panic!("the client refused to send it, the server was never asked: {e}"),
        }
    });
    assert!(
        result.is_err() || matches!(&result, Ok(s) if s.is_client_error()),
        "answered {result:?}"
    );
    assert!(still_serves(&nodes));
}

#[test]
fn a_flood_of_reset_streams_does_not_take_the_proxy_down() {
    let nodes = nodes();
    nodes.echo_server_in_b(nodes.b(false, 8101));
    rt().block_on(async {
        let conn = hbone_conn(&nodes).await.expect("HBONE connection");
        reset_flood(conn, nodes.b(false, 8101), 500).await;
    });
    assert!(still_serves(&nodes), "the proxy stopped serving after the flood");
}

#[test]
fn bad_input_is_refused_and_leaves_no_socket_or_connection_behind() {
    let nodes = nodes();
    nodes.echo_server_in_b(nodes.b(false, 8101));
    assert!(still_serves(&nodes));
    let p = &nodes.proxies[1];
    let settle = |want: usize| {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if p.open_fds() <= want
                && p.metric("meshpath_active_connections", &[]).ok() == Some(0.0)
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    };
    let baseline = p.open_fds();
    // Plaintext, a silent client, a bad ALPN, a reset flood: each refused as it should be.
    let mut plain = tcp_to_hbone(&nodes);
    let _ = plain.write_all(b"GET / HTTP/1.1\r\n\r\n");
    assert!(closed_without_answer(&mut plain), "plaintext HTTP/1 to 15008 was answered");
    let mut silent = tcp_to_hbone(&nodes);
    assert!(closed_without_answer(&mut silent), "a silent client was answered");
    let (alpn, flooded) = rt().block_on(async {
        let tcp = tokio::net::TcpStream::from_std({
            let t = tcp_to_hbone(&nodes);
            t.set_nonblocking(true).expect("nonblocking");
            t
        })
        .expect("tokio");
        let name = rustls::pki_types::ServerName::IpAddress(nodes.b(false, 0).ip().into());
        let alpn = tokio_rustls::TlsConnector::from(client_tls(&nodes, b"http/1.1"))
            .connect(name, tcp)
            .await;
        let flooded = match hbone_conn(&nodes).await {
            Ok(conn) => {
                reset_flood(conn, nodes.b(false, 8101), 200).await;
                true
            }
            Err(_) => false,
        };
        (alpn.is_err(), flooded)
    });
    assert!(alpn, "a TLS client offering only http/1.1 was accepted");
    assert!(flooded, "no HBONE connection to flood");
    drop((plain, silent));
    assert!(
        settle(baseline),
        "the proxy holds {} fds (baseline {baseline}) and {:?} active connections",
        p.open_fds(),
        p.metric("meshpath_active_connections", &[])
    );
}

#[test]
fn a_refused_upstream_closes_the_app_connection_and_is_counted() {
    // Passthrough to a port nobody listens on.
    let nodes = TwoNodes::new(View { b_protocol: "TCP", ..MESHED });
    let back = nodes.app_round_trip(nodes.b(false, 8102), b"anyone?");
    assert!(back.unwrap_or_default().is_empty());
    assert_eq!(errors(&nodes, 0, "upstream_refused"), 1.0);
}

#[test]
fn an_hbone_destination_whose_app_is_down_closes_the_app_connection_and_is_counted() {
    let nodes = TwoNodes::new(MESHED);
    let back = nodes.app_round_trip(nodes.b(false, 8103), b"anyone?");
    assert!(back.unwrap_or_default().is_empty());
    assert_eq!(errors(&nodes, 0, "hbone_status"), 1.0);
    assert_eq!(errors(&nodes, 1, "upstream_refused"), 1.0);
}

#[test]
fn a_client_that_never_sends_a_connect_is_disconnected() {
    let nodes = nodes();
    let closed = rt().block_on(async {
        let conn = hbone_conn(&nodes).await.expect("TLS and HTTP/2 handshakes");
        // Nothing asked; the proxy closes the connection after its timeout (1 s here).
        tokio::time::sleep(Duration::from_secs(3)).await;
        conn.ready().await.is_err()
    });
    assert!(closed, "an idle connection that never sent a CONNECT stayed open");
    assert_eq!(errors(&nodes, 1, "header_timeout"), 1.0);
}

#[tokio::test]
async fn a_client_certificate_with_two_identities_is_refused() {
    // Both identities are allowed by pod b's (empty) policy: only the two-SAN rule refuses it.
    let nodes = nodes();
    let now = time::OffsetDateTime::now_utc();
    let two = vec![sa("sa-a").to_string(), sa("sa-c").to_string()];
    let cert = nodes
        .ca
        .issue_with_uris(&two, now - time::Duration::minutes(1), now + time::Duration::hours(1))
        .expect("cert");
    let dst = nodes.b(false, 8120);
    let _app = nodes.echo_in_b(dst);
    let refused = nodes.hbone_to_b(&cert, dst).await;
    assert!(refused.is_err(), "a client with two identities was served");
    assert_eq!(errors(&nodes, 1, "no_identity"), 1.0);
    // The same client with one identity is served.
    let one = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    nodes.hbone_to_b(&one, dst).await.expect("one identity is served");
}

/// A connection that fails is logged with its peer as the handlers name it: an IPv4 client in
/// IPv4 form, not as the dual-stack listener reports it (`[::ffff:a.b.c.d]`).
#[test]
fn a_failed_connections_log_line_names_an_ipv4_peer_in_its_ipv4_form() {
    let nodes = nodes();
    let node2 = &nodes.proxies[1];
    let tcp = tcp_to_hbone(&nodes);
    let peer = tcp.local_addr().expect("local address");
    drop(tcp);
    let line = format!("peer={peer}");
    assert!(
        node2.proxy.wait_for_text(&line, Duration::from_secs(10)),
        "no failure line with {line}: {:?}",
        node2.proxy.lines().iter().filter(|l| l.contains("connection failed")).collect::<Vec<_>>()
    );
}

/// Anyone who reaches a pod can open connections to its HBONE port and drop them before the
/// handshake, as fast as they like: each is counted, and the log gets at most its budget of
/// lines a second, the rest counted in the next line logged (`left_out=`).
#[test]
fn a_peer_opening_and_dropping_connections_writes_a_bounded_number_of_log_lines() {
    use meshpath_proxy::proxy::drain::FAILED_CONNECTIONS_LOGGED_PER_SECOND as LIMIT;
    const N: usize = 1000;
    let nodes = nodes();
    let node2 = &nodes.proxies[1];
    let failed = [("reason", "tls_handshake")];
    let start = Instant::now();
    for _ in 0..N {
        drop(tcp_to_hbone(&nodes));
    }
    let counted = node2.wait_metrics(Duration::from_secs(30), |m| {
        sum_metric(m, "meshpath_connection_errors_total", &failed) >= N as f64
    });
    assert!(counted, "not every dropped connection was counted");
    let secs = start.elapsed().as_secs() as usize;
    // One more a second later: logged, with how many were left out before it.
    std::thread::sleep(Duration::from_millis(1100));
    drop(tcp_to_hbone(&nodes));
    assert!(node2.proxy.wait_for_text("left_out=", Duration::from_secs(10)), "no left_out= line");
    let logged =
        node2.proxy.lines().iter().filter(|l| l.contains("HBONE connection failed")).count();
    let bound = LIMIT as usize * (secs + 2) + 1;
    assert!(
        logged <= bound,
        "{logged} lines for {N} failed connections in {secs} s (at most {bound})"
    );
}
