//! The proxy caps the connections it carries, per pod and node-wide: one beyond the cap is
//! closed at once (before a buffer or a task is spent on it) and counted; the connections
//! within the cap are untouched, and a slot freed is usable again. An inbound HBONE stream
//! counts like a connection (it has one to the app), and an HBONE connection that carries no
//! stream gives its slot back after the HBONE idle time. A pod's inbound and outbound
//! connections have a cap each, and one source may hold only a share of a pod's inbound
//! before its connections have proven an identity.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::TcpStream,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use meshpath_proxy::proxy::hbone::{self, HboneError};
use meshpath_tests::{
    sum_metric,
    two_nodes::{sa, Setup, TwoNodes},
    wait_until_async,
};

/// How long a test waits for the app or the proxy to count what it was sent.
const APP_WAIT: Duration = Duration::from_secs(10);

fn round_trip(c: &mut TcpStream, byte: u8) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(&[byte; 3])?;
    let mut back = [0u8; 3];
    c.read_exact(&mut back)?;
    assert_eq!(back, [byte; 3]);
    Ok(())
}

/// An echo app in pod b at `dst` that counts every connection reaching it.
fn counting_echo(nodes: &TwoNodes, dst: std::net::SocketAddr) -> Arc<AtomicUsize> {
    nodes.counting_echo_server_in_b(dst)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

#[test]
fn a_connection_over_the_pods_cap_is_closed_and_counted_and_a_freed_slot_serves_again() {
    // Node 1's cap (pod a's outbound); node 2 counts each stream and each pooled connection the
    // streams arrive on, and keeps its default.
    let nodes = TwoNodes::start(Setup {
        node1_args: vec!["--max-connections-per-pod".into(), "3".into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8120);
    let reached = counting_echo(&nodes, dst);
    let mut open = Vec::new();
    for i in 0..3u8 {
        let mut c = nodes.connect_from_a(dst).expect("connect within the cap");
        round_trip(&mut c, i).expect("round trip within the cap");
        open.push(c);
    }
    // The fourth: the proxy closes it; the app never sees it.
    let mut over = nodes.connect_from_a(dst).expect("the kernel accepts it for the proxy");
    assert!(round_trip(&mut over, 9).is_err(), "a connection over the cap was carried");
    assert_eq!(reached.load(Ordering::SeqCst), 3, "the app saw a connection over the cap");
    let node1 = &nodes.proxies[0];
    let limit = [("reason", "connection_limit"), ("direction", "outbound")];
    assert_eq!(node1.metric("meshpath_connection_errors_total", &limit).expect("metrics"), 1.0);
    // The three within the cap still work.
    for (i, c) in open.iter_mut().enumerate() {
        round_trip(c, 20 + i as u8).expect("a connection within the cap was disturbed");
    }
    // One closed: its slot serves a new connection.
    drop(open.pop());
    let freed = node1.wait_metrics(Duration::from_secs(10), |m| {
        meshpath_tests::sum_metric(m, "istio_tcp_connections_closed_total", &[]) >= 1.0
    });
    assert!(freed, "the closed connection was never counted closed");
    let mut again = nodes.connect_from_a(dst).expect("connect after a slot was freed");
    round_trip(&mut again, 42).expect("a freed slot did not serve");
}

/// Anyone who reaches a pod can open connections to its HBONE port and hold them, before any
/// credential is checked, until the handshake times out: from enough addresses (or, as here, with
/// a cap below one address's share) they fill the pod's inbound cap, and the pod's own
/// connections out keep theirs.
#[test]
fn connections_held_open_to_a_pods_hbone_port_leave_its_outbound_connections_their_slots() {
    let nodes = TwoNodes::start(Setup {
        node1_args: vec![
            "--max-connections-per-pod".into(),
            "3".into(),
            "--handshake-timeout-seconds".into(),
            "120".into(),
        ],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8122);
    let reached = counting_echo(&nodes, dst);
    // Plain TCP to pod a's 15008 from pod b's address, as a peer proxy connects, never starting
    // TLS: three fill pod a's inbound cap, and node 1 closes the fourth.
    let node1 = &nodes.proxies[0];
    let held: Vec<TcpStream> = (0..4)
        .map(|_| nodes.pods.b.connect_in_cgroup(nodes.a(false, 15008), &nodes.cgroup))
        .collect::<Result<_, _>>()
        .expect("TCP to pod a's 15008");
    let limit = [("reason", "connection_limit"), ("direction", "inbound")];
    let full = node1.wait_metrics(Duration::from_secs(10), |m| {
        sum_metric(m, "meshpath_connection_errors_total", &limit) >= 1.0
    });
    assert!(full, "node 1 never refused an inbound connection over pod a's cap");
    let mut out = nodes.connect_from_a(dst).expect("pod a connects out");
    round_trip(&mut out, 7).expect("pod a's outbound connection was not carried");
    assert_eq!(reached.load(Ordering::SeqCst), 1);
    let outbound = [("reason", "connection_limit"), ("direction", "outbound")];
    assert_eq!(node1.metric("meshpath_connection_errors_total", &outbound).expect("metrics"), 0.0);
    drop(held);
}

#[test]
fn an_hbone_stream_over_the_pods_cap_is_answered_503_and_never_reaches_the_app() {
    let nodes = TwoNodes::start(Setup {
        args: vec!["--max-connections-per-pod".into(), "3".into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8121);
    let reached = counting_echo(&nodes, dst);
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let gateway = nodes.b(false, 15008);
    let node2 = &nodes.proxies[1];
    rt().block_on(async {
        // Node 2 holds the connection (one slot) and two streams, each with its own
        // connection to the app (two more): pod b's cap of 3 is full.
        let conn = nodes.hbone_conn_to_b(&cert).await.expect("HBONE connection");
        let first = hbone::open_stream(conn.clone(), gateway, dst, &Default::default()).await;
        let first = first.expect("a stream within the cap");
        let second = hbone::open_stream(conn.clone(), gateway, dst, &Default::default()).await;
        let _second = second.expect("a stream within the cap");
        let over = hbone::open_stream(conn.clone(), gateway, dst, &Default::default()).await;
        match over {
            Err(HboneError::Status { status, .. }) => assert_eq!(status, 503),
            other => panic!("a stream over the cap was not answered 503: {:?}", other.map(drop)),
        }
        assert!(
            wait_until_async(APP_WAIT, || async { reached.load(Ordering::SeqCst) >= 2 }).await,
            "the app saw no stream"
        );
        let limit = [("reason", "connection_limit"), ("direction", "inbound")];
        assert_eq!(node2.metric("meshpath_connection_errors_total", &limit).expect("metrics"), 1.0);
        assert_eq!(reached.load(Ordering::SeqCst), 2, "the app saw a stream over the cap");
        // One stream reset by the client: its slot (and its connection to the app) is given
        // back, and a new stream is served.
        drop(first);
        let closed = wait_until_async(APP_WAIT, || async {
            node2
                .metrics()
                .is_ok_and(|m| sum_metric(&m, "istio_tcp_connections_closed_total", &[]) >= 1.0)
        });
        assert!(closed.await, "the reset stream was never closed");
        let again = hbone::open_stream(conn, gateway, dst, &Default::default()).await;
        assert!(again.is_ok(), "a freed slot did not serve: {:?}", again.map(drop));
        // The app's accept may come just after the 200 (sent once the connect is done).
        assert!(
            wait_until_async(APP_WAIT, || async { reached.load(Ordering::SeqCst) == 3 }).await,
            "the app saw no stream"
        );
        assert_eq!(reached.load(Ordering::SeqCst), 3);
    });
}

#[test]
fn an_hbone_connection_left_without_streams_is_closed_after_the_idle_time_and_frees_its_slot() {
    let nodes = TwoNodes::start(Setup {
        args: vec![
            "--max-connections-per-pod".into(),
            "2".into(),
            "--hbone-idle-seconds".into(),
            "1".into(),
        ],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8122);
    nodes.echo_server_in_b(dst);
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let gateway = nodes.b(false, 15008);
    rt().block_on(async {
        // A peer that opened a connection, used it once and then holds it, sending nothing.
        let held = nodes.hbone_conn_to_b(&cert).await.expect("HBONE connection");
        let once = hbone::open_stream(held.clone(), gateway, dst, &Default::default()).await;
        drop(once.expect("the first stream"));
        // Another connection and its stream need two slots: with the held one keeping its slot
        // there is one, so they are served only once the held one is closed for idleness.
        let mut served = false;
        for _ in 0..60 {
            if nodes.hbone_to_b(&cert, dst).await.is_ok() {
                served = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(served, "the idle HBONE connection kept its slot");
        // The held connection was told to go away: no new stream on it.
        let late = hbone::open_stream(held, gateway, dst, &Default::default()).await;
        assert!(late.is_err(), "a stream was served on the connection closed for idleness");
    });
}

/// How many of `held`, clients that never started TLS, node 2 keeps open: a read on one waits,
/// on one it closed the read ends at once.
fn still_open(held: &mut [TcpStream]) -> usize {
    let mut open = 0;
    for c in held {
        c.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
        match meshpath_tests::again_after_eintr(|| c.read(&mut [0u8; 1])) {
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => open += 1,
            Ok(0) | Err(_) => {}
            Ok(_) => panic!("node 2 sent bytes to a client that never started TLS"),
        }
    }
    open
}

/// A source that opens connections to a pod's HBONE port and never starts TLS holds at most
/// its share of the pod's inbound cap: its connections beyond it are closed and counted, the
/// ones within it stay open, and another peer still gets a slot and is served.
#[test]
fn a_source_holding_connections_in_their_handshake_leaves_other_peers_slots_on_the_pod() {
    let nodes = TwoNodes::start(Setup {
        args: vec![
            "--max-connections-per-pod".into(),
            "6".into(),
            "--max-handshakes-per-source".into(),
            "2".into(),
            "--handshake-timeout-seconds".into(),
            "120".into(),
        ],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8123);
    let reached = counting_echo(&nodes, dst);
    let node2 = &nodes.proxies[1];
    // From pod a's address, as a peer proxy connects, sending nothing: six would fill pod b's
    // inbound cap.
    let mut held: Vec<TcpStream> = (0..6)
        .map(|_| nodes.pods.a.connect_in_cgroup(nodes.b(false, 15008), &nodes.cgroup))
        .collect::<Result<_, _>>()
        .expect("TCP to pod b's 15008");
    let over = [("reason", "handshake_limit"), ("direction", "inbound")];
    let refused = node2.wait_metrics(Duration::from_secs(10), |m| {
        sum_metric(m, "meshpath_connection_errors_total", &over) >= 4.0
    });
    assert!(refused, "node 2 did not close the connections beyond the source's share");
    let open = still_open(&mut held);
    assert_eq!(open, 2, "the source kept other than its share of pod b's inbound");
    // Another peer (pod b's own address here) connects, and its stream reaches the app.
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    rt().block_on(nodes.hbone_to_b(&cert, dst)).expect("another peer was refused a slot");
    // The app's accept may come just after the 200 (sent once the connect is done).
    assert!(
        rt().block_on(wait_until_async(APP_WAIT, || async { reached.load(Ordering::SeqCst) == 1 })),
        "the app saw none"
    );
    let limit = [("reason", "connection_limit"), ("direction", "inbound")];
    assert_eq!(node2.metric("meshpath_connection_errors_total", &limit).expect("metrics"), 0.0);
    assert_eq!(node2.metric("meshpath_connection_errors_total", &over).expect("metrics"), 4.0);
    drop(held);
}

/// An IPv6 source is its /64 (one host is routinely given a whole /64): connections from six
/// addresses of one /64 that never start TLS hold the /64's share, two, and the other four are
/// closed; a peer from another /64 still completes its handshake.
#[test]
fn ipv6_addresses_of_one_64_share_one_handshake_share_and_another_64_is_served() {
    let nodes = TwoNodes::start(Setup {
        args: vec![
            "--max-handshakes-per-source".into(),
            "2".into(),
            "--handshake-timeout-seconds".into(),
            "120".into(),
        ],
        ..Setup::default()
    });
    let (a, b) = (&nodes.pods.a, &nodes.pods.b);
    // Six more addresses of pod a's /64, and a second /64 on both pods.
    let ours: Vec<String> = (0x100..0x106).map(|i| format!("fd00:199::{i:x}")).collect();
    for ip in &ours {
        a.ip(&["addr", "add", &format!("{ip}/64"), "dev", "eth0", "nodad"]).expect("address");
    }
    a.ip(&["addr", "add", "fd00:299::1/64", "dev", "eth0", "nodad"]).expect("other /64");
    b.ip(&["addr", "add", "fd00:299::2/64", "dev", "eth0", "nodad"]).expect("other /64");
    let gateway = nodes.b(true, 15008);
    // As a peer proxy connects (the proxies' cgroup: not captured), sending nothing.
    let connect = |from: &str| -> TcpStream {
        let from = std::net::SocketAddr::new(from.parse().expect("ip"), 0);
        a.connect_from_in_cgroup(Some(from), gateway, &nodes.cgroup).expect("connect")
    };
    let mut held: Vec<TcpStream> = ours.iter().map(|ip| connect(ip)).collect();
    let over = [("reason", "handshake_limit"), ("direction", "inbound")];
    let node2 = &nodes.proxies[1];
    let refused = node2.wait_metrics(Duration::from_secs(10), |m| {
        sum_metric(m, "meshpath_connection_errors_total", &over) >= 4.0
    });
    assert!(refused, "six addresses of one /64 were not held to one share");
    let open = still_open(&mut held);
    assert_eq!(open, 2, "the /64 kept other than its share");
    // A peer from the other /64 completes TLS and HTTP/2 with node 2.
    let other = connect("fd00:299::1");
    other.set_nonblocking(true).expect("nonblocking");
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let roots = std::slice::from_ref(&nodes.ca.cert_der);
    let config = meshpath_proxy::identity::tls::client_config(&cert, roots, vec![sa("sa-b")])
        .expect("client config");
    rt().block_on(async {
        let tcp = tokio::net::TcpStream::from_std(other).expect("tokio");
        hbone::handshake(tcp, gateway, config).await.expect("the other /64 was refused")
    });
    assert_eq!(node2.metric("meshpath_connection_errors_total", &over).expect("metrics"), 4.0);
    drop(held);
}

/// The per-source share counts connections only until their client certificate is checked:
/// a peer that has proven its identity holds more connections from one address than the share.
#[test]
fn connections_whose_client_certificate_was_checked_no_longer_count_against_the_sources_share() {
    let nodes = TwoNodes::start(Setup {
        args: vec!["--max-handshakes-per-source".into(), "1".into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8124);
    let reached = counting_echo(&nodes, dst);
    let cert = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let gateway = nodes.b(false, 15008);
    rt().block_on(async {
        // Each connection is held, and carries a stream (its 200 says the server has checked
        // the certificate: the client's side of the handshake ends before that), before the
        // next is opened from the same address.
        let mut held = Vec::new();
        for i in 0..3 {
            let conn = nodes.hbone_conn_to_b(&cert).await;
            let conn = conn.unwrap_or_else(|e| panic!("connection {i} from one address: {e}"));
            let s = hbone::open_stream(conn.clone(), gateway, dst, &Default::default()).await;
            let s = s.unwrap_or_else(|e| panic!("a stream on connection {i}: {e}"));
            held.push((conn, s));
        }
        assert!(
            wait_until_async(APP_WAIT, || async { reached.load(Ordering::SeqCst) == 3 }).await,
            "the app saw no stream"
        );
    });
    let over = [("reason", "handshake_limit"), ("direction", "inbound")];
    assert_eq!(nodes.proxies[1].metric("meshpath_connection_errors_total", &over).expect("m"), 0.0);
}

#[test]
fn under_a_memory_limit_the_cap_refuses_the_excess_before_the_proxy_runs_out() {
    // 200 MiB: the cap the proxy derives, (200 - 64) MiB × 3/4 at 64 KiB a connection.
    const LIMIT: u64 = 200 << 20;
    let cap = meshpath_proxy::proxy::memory::cap_for(Some(LIMIT));
    assert_eq!(cap, 1632);
    let nodes = TwoNodes::start(Setup { memory_limit: Some(LIMIT), ..Setup::default() });
    let logged = format!("max_connections={cap}");
    let proxy = &nodes.proxies[0].proxy;
    assert!(
        proxy.wait_for_text(&logged, Duration::from_secs(10)),
        "the proxy did not take its cap from the memory limit: {:#?}",
        proxy.lines()
    );
    let dst = nodes.b(false, 8098);
    let reached = counting_echo(&nodes, dst);
    // The cap, filled: every connection carried (each round trip proves it).
    let mut held = Vec::with_capacity(cap);
    for i in 0..cap {
        let mut c = nodes.connect_from_a(dst).expect("connect");
        round_trip(&mut c, (i % 251) as u8).unwrap_or_else(|e| panic!("connection {i}: {e}"));
        held.push(c);
    }
    // One more: refused at node 1, counted, never reaching the app.
    let mut over = nodes.connect_from_a(dst).expect("the kernel accepts it for the proxy");
    assert!(round_trip(&mut over, 7).is_err(), "a connection over the cap was carried");
    let limit = [("reason", "connection_limit")];
    let counted =
        nodes.proxies[0].metric("meshpath_connection_errors_total", &limit).expect("metrics");
    assert_eq!(counted, 1.0);
    assert_eq!(reached.load(Ordering::SeqCst), cap, "the app saw a connection over the cap");
    // Alive and serving under its limit: ready, and the first connection still echoes.
    let (status, _) = nodes.proxies[0].http("READINESS", "GET", "/healthz/ready").expect("ready");
    assert_eq!(status, 200);
    round_trip(&mut held[0], 9).expect("a held connection after the refusal");
}
