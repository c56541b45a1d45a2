//! The node-local path (`proxy/src/proxy/node_local.rs`): a connection between two meshed pods
//! of one node is carried by the node's proxy directly, from the source pod's socket to one it
//! opens inside the destination pod, with no HBONE between them; under the destination's
//! policy, with both reporters' telemetry, failing closed when the proxy is gone.
//! `--node-local-hbone` sends it over HBONE instead. Each test runs real pods (Debian's CNI
//! plugins and meshpath's), the real datapath, agent and proxy.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener},
    sync::mpsc,
    time::{Duration, Instant},
};

use meshpath_tests::{
    cni_node::{CniNode, CniPod},
    wait_until,
};

const MESHED: &str = "workloads:
- {uid: uid-p0, name: p0, namespace: default, serviceAccount: sa0, protocol: HBONE}
- {uid: uid-p1, name: p1, namespace: default, serviceAccount: sa1, protocol: HBONE}
";

const DENY_8091: &str = "policies:\n- {name: no-8091, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [8091]}]]]}\n";

/// A node with meshed pods p0 and p1 (p1's address known to the proxy, as istiod would tell
/// it), its proxy started with `proxy_args`; `extra` is appended to the workloads file.
fn pair(proxy_args: &[&str], extra: &str) -> (CniNode, CniPod, CniPod) {
    let yaml = format!("{MESHED}{extra}");
    let mut node = CniNode::bare(&yaml).expect("node");
    node.start_agent().expect("agent");
    node.start_proxy_with(proxy_args).expect("proxy");
    let p1 = node.add_pod("p1").expect("ADD p1");
    node.publish_address(&yaml, "sa1", p1.ip);
    let p0 = node.add_pod("p0").expect("ADD p0");
    (node, p0, p1)
}

/// A listener in `pod` on `port` that echoes each connection and sends each one's client
/// address down the channel.
fn recording_echo(pod: &CniPod, port: u16) -> (TcpListener, mpsc::Receiver<SocketAddr>) {
    let l = pod.netns.listen(SocketAddr::new(pod.ip, port)).expect("listen in the pod");
    let serving = l.try_clone().expect("clone");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for c in serving.incoming().flatten() {
            let Ok(peer) = c.peer_addr() else { continue };
            let _ = tx.send(peer);
            std::thread::spawn(move || {
                let mut c = c;
                let mut r = c.try_clone()?;
                std::io::copy(&mut r, &mut c)?;
                c.shutdown(std::net::Shutdown::Write)
            });
        }
    });
    (l, rx)
}

/// Connections the proxy's `reporter` counted between p0 and p1 with `security`.
fn opened(node: &CniNode, reporter: &str, security: &str) -> f64 {
    let labels = [
        ("reporter", reporter),
        ("source_workload", "p0"),
        ("destination_workload", "p1"),
        ("connection_security_policy", security),
    ];
    node.proxy_metric("istio_tcp_connections_opened_total", &labels).expect("metrics")
}

/// `total` bytes of a pattern sent on `c` and read back, checked byte by byte, writing and
/// reading at once (both directions busy).
fn echo_exact(c: std::net::TcpStream, total: usize) {
    let pattern = |i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    let mut w = c.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        let data: Vec<u8> = (0..total).map(pattern).collect();
        w.write_all(&data).expect("send");
        w.shutdown(std::net::Shutdown::Write).expect("FIN");
    });
    let mut r = c;
    r.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let mut back = Vec::with_capacity(total);
    r.read_to_end(&mut back).expect("read back");
    writer.join().expect("writer");
    assert_eq!(back.len(), total, "bytes lost or added");
    assert!(back.iter().enumerate().all(|(i, b)| *b == pattern(i)), "bytes changed");
}

#[test]
fn a_same_node_pair_is_carried_directly_byte_exact_both_ways_and_the_server_sees_the_client() {
    let (node, p0, p1) = pair(&[], "");
    let (_l, peers) = recording_echo(&p1, 8080);
    let c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    echo_exact(c, 8 << 20);
    let peer = peers.recv_timeout(Duration::from_secs(5)).expect("the server saw no connection");
    assert_eq!(peer.ip(), p0.ip, "the server saw another address than the client's");
    assert_eq!(opened(&node, "source", "none"), 1.0, "not carried on the node-local path");
    assert_eq!(opened(&node, "source", "mutual_tls"), 0.0, "carried over HBONE");
}

#[test]
fn an_app_connecting_from_an_address_it_added_goes_over_hbone_and_the_server_sees_its_pod() {
    let (node, p0, p1) = pair(&[], "");
    let (_l, peers) = recording_echo(&p1, 8080);
    // CAP_NET_ADMIN in p0: an address of its own choosing, bound by its app. The node-local
    // path takes a client address only if it is the pod's; HBONE carries the pod's address.
    p0.netns.ip(&["addr", "add", "10.77.0.200/32", "dev", "eth0"]).expect("extra address");
    let added: IpAddr = "10.77.0.200".parse().expect("ip");
    let c = p0.connect_from(added, SocketAddr::new(p1.ip, 8080)).expect("connect");
    echo_exact(c, 1 << 20);
    let peer = peers.recv_timeout(Duration::from_secs(5)).expect("the server saw no connection");
    assert_eq!(peer.ip(), p0.ip, "the server saw an address the pod chose");
    assert_eq!(opened(&node, "source", "mutual_tls"), 1.0, "not carried over HBONE");
    assert_eq!(opened(&node, "source", "none"), 0.0, "carried on the node-local path");
}

#[test]
fn with_node_local_hbone_the_pair_goes_over_mutual_tls() {
    let (node, p0, p1) = pair(&["--node-local-hbone"], "");
    let (_l, peers) = recording_echo(&p1, 8080);
    let c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    echo_exact(c, 1 << 20);
    assert_eq!(peers.recv_timeout(Duration::from_secs(5)).expect("no connection").ip(), p0.ip);
    assert_eq!(opened(&node, "source", "mutual_tls"), 1.0, "not carried over HBONE");
    assert_eq!(opened(&node, "source", "none"), 0.0, "carried on the node-local path");
}

#[test]
fn both_reporters_count_and_log_a_node_local_connection_with_no_mutual_tls() {
    let (node, p0, p1) = pair(&[], "");
    let (_l, _peers) = recording_echo(&p1, 8080);
    let c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    echo_exact(c, 1000);
    let closed = || node.proxy_metric("meshpath_active_connections", &[]).ok() == Some(0.0);
    assert!(wait_until(Duration::from_secs(10), closed), "the connection is still counted open");
    for reporter in ["source", "destination"] {
        let labels = [
            ("reporter", reporter),
            ("source_workload", "p0"),
            ("source_principal", "spiffe://cluster.local/ns/default/sa/sa0"),
            ("destination_workload", "p1"),
            ("destination_principal", "spiffe://cluster.local/ns/default/sa/sa1"),
            ("connection_security_policy", "none"),
        ];
        let m = |name| node.proxy_metric(name, &labels).expect("metrics");
        assert_eq!(m("istio_tcp_connections_opened_total"), 1.0, "{reporter}");
        assert_eq!(m("istio_tcp_connections_closed_total"), 1.0, "{reporter}");
        assert_eq!(m("istio_tcp_received_bytes_total"), 1000.0, "{reporter}");
        assert_eq!(m("istio_tcp_sent_bytes_total"), 1000.0, "{reporter}");
    }
    let proxy = node.proxy.as_ref().expect("proxy");
    let two = || proxy.lines().iter().filter(|l| l.contains("connection complete")).count() == 2;
    assert!(wait_until(Duration::from_secs(10), two), "{}", proxy.lines().join("\n"));
    let lines = proxy.lines();
    for direction in ["outbound", "inbound"] {
        let line = lines
            .iter()
            .find(|l| l.contains("connection complete") && l.contains(direction))
            .unwrap_or_else(|| panic!("no {direction} access line:\n{}", lines.join("\n")));
        for field in [
            "src.identity=spiffe://cluster.local/ns/default/sa/sa0",
            "dst.identity=spiffe://cluster.local/ns/default/sa/sa1",
            &format!("dst.addr={}", SocketAddr::new(p1.ip, 8080)),
            "dst.hbone_addr=-",
            "bytes_sent=1000",
            "bytes_recv=1000",
        ] {
            assert!(line.contains(field), "{field} missing from the {direction} line: {line}");
        }
    }
}

/// Whether `l` was connected to (non-blocking check).
fn reached(l: &TcpListener) -> bool {
    l.set_nonblocking(true).expect("nonblocking");
    l.accept().is_ok()
}

#[test]
fn a_deny_for_the_pair_refuses_it_and_the_app_is_never_reached() {
    let (node, p0, p1) = pair(&[], DENY_8091);
    let l = p1.netns.listen(SocketAddr::new(p1.ip, 8091)).expect("listen");
    let mut c = p0.connect(SocketAddr::new(p1.ip, 8091)).expect("connect");
    let _ = c.write_all(b"denied?");
    let mut b = [0u8; 16];
    let answer = meshpath_tests::again_after_eintr(|| c.read(&mut b));
    assert!(matches!(answer, Ok(0) | Err(_)), "data came back: {answer:?}");
    assert!(!reached(&l), "the app was reached through a denied connection");
    // Counted by both sides as the node-local path counts it (over HBONE the source side would
    // count the 401 as `hbone_denied`).
    for direction in ["inbound", "outbound"] {
        let labels = [("reason", "policy_denied"), ("direction", direction)];
        let denied =
            node.proxy_metric("meshpath_connection_errors_total", &labels).expect("metrics");
        assert_eq!(denied, 1.0, "the denial was not counted {direction}");
    }
    // The other ports of the pair are not covered.
    let (_l, _) = recording_echo(&p1, 8080);
    echo_exact(p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect"), 100);
}

#[test]
fn a_deny_written_while_a_node_local_connection_is_open_closes_it() {
    let (node, p0, p1) = pair(&[], "");
    let (_l, _) = recording_echo(&p1, 8091);
    let mut live = p0.connect(SocketAddr::new(p1.ip, 8091)).expect("connect");
    let mut buf = [0u8; 4];
    live.write_all(b"ping").expect("write");
    live.read_exact(&mut buf).expect("allowed before the change");
    assert_eq!(opened(&node, "source", "none"), 1.0, "not on the node-local path");
    let known = format!("{MESHED}{DENY_8091}").replace(
        "sa1, protocol: HBONE}",
        &format!("sa1, protocol: HBONE, workloadIps: [{}]}}", p1.ip),
    );
    std::fs::write(node.dir.join("workloads.yaml"), known).expect("workloads");
    let changed = Instant::now();
    let closed = loop {
        if live.write_all(b"ping").is_err() {
            break true;
        }
        live.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        match meshpath_tests::again_after_eintr(|| live.read(&mut buf)) {
            Ok(0) => break true,
            Err(e)
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break true
            }
            _ if changed.elapsed() > Duration::from_secs(10) => break false,
            _ => {}
        }
    };
    assert!(closed, "the connection the new DENY covers stayed open");
    let proxy = node.proxy.as_ref().expect("proxy");
    assert!(
        proxy.wait_for_text(
            "open connection closed: a policy change denies it",
            Duration::from_secs(5)
        ),
        "{}",
        proxy.lines().join("\n")
    );
}

#[test]
fn a_destination_outside_the_mesh_on_the_node_is_passed_through_not_carried_node_local() {
    let (node, p0, _p1) = pair(&[], "");
    // A server in the node's netns, on the pods' gateway address: no workload of the mesh.
    let gateway = IpAddr::V4(Ipv4Addr::new(10, node.subnet, 0, 1));
    let l = node.node.listen(SocketAddr::new(gateway, 0)).expect("listen in the node netns");
    let dst = l.local_addr().expect("addr");
    let mut c = p0.connect(dst).expect("connect");
    c.write_all(b"hello").expect("write");
    let (_s, peer) = l.accept().expect("the server outside the mesh was not reached");
    assert_eq!(peer.ip(), p0.ip);
    let none = node
        .proxy_metric(
            "istio_tcp_connections_opened_total",
            &[("connection_security_policy", "none")],
        )
        .expect("metrics");
    assert_eq!(none, 0.0, "a destination outside the mesh was counted as node-local");
}

#[test]
fn killing_the_proxy_ends_a_node_local_connection_and_new_ones_wait_for_the_next_proxy() {
    let (mut node, p0, p1) = pair(&[], "");
    let (l, peers) = recording_echo(&p1, 8080);
    let mut c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    let mut buf = [0u8; 4];
    c.write_all(b"ping").expect("write");
    c.read_exact(&mut buf).expect("before");
    peers.recv_timeout(Duration::from_secs(5)).expect("the first connection");
    let proxy = node.proxy.as_mut().expect("proxy");
    proxy.signal(libc::SIGKILL).expect("kill -9");
    assert!(proxy.wait_exit(Duration::from_secs(10)), "the proxy did not die");
    // The connection's sockets were the proxy's: the kernel ends them with it.
    c.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let after =
        c.write_all(b"ping").and_then(|()| meshpath_tests::again_after_eintr(|| c.read(&mut buf)));
    assert!(matches!(after, Ok(0) | Err(_)), "the connection outlived kill -9: {after:?}");
    // No proxy: a new connection waits (the agent holds the pod's listeners), and never goes
    // around the mesh to the app.
    let waiting = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect with no proxy");
    std::thread::sleep(Duration::from_secs(2));
    assert!(peers.try_recv().is_err(), "the app was reached with no proxy running");
    node.start_proxy().expect("the next proxy");
    let mut waiting = waiting;
    waiting.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    waiting.write_all(b"pong").expect("write");
    waiting.read_exact(&mut buf).expect("the waiting connection was not carried by the next proxy");
    assert_eq!(&buf, b"pong");
    // (Over HBONE or not, as the next proxy had p1 or not yet when it took it.) New ones are
    // node-local again.
    let (_l2, _) = recording_echo(&p1, 8081);
    echo_exact(p0.connect(SocketAddr::new(p1.ip, 8081)).expect("connect"), 100);
    assert!(opened(&node, "source", "none") >= 1.0, "the next proxy carries nothing node-local");
    drop(l);
}

#[test]
fn a_destination_with_a_waypoint_is_reached_through_the_waypoint_not_node_local() {
    // p1 names a waypoint (the stand-in, in a netns of its own beside the node): p0's
    // connection to it goes there over HBONE, as on any other node, never straight to p1.
    let wp = meshpath_tests::two_nodes::WAYPOINT_IP;
    let yaml = format!(
        "{}- {{uid: waypoint, name: waypoint, namespace: default, serviceAccount: sa-waypoint, protocol: HBONE, workloadIps: [\"{wp}\"]}}\n",
        MESHED.replace(
            "sa1, protocol: HBONE}",
            &format!("sa1, protocol: HBONE, waypoint: {{destination: {{address: \"/{wp}\"}}, hboneMtlsPort: 15008}}}}")
        )
    );
    let mut node = CniNode::bare(&yaml).expect("node");
    node.start_agent().expect("agent");
    node.start_proxy().expect("proxy");
    let p1 = node.add_pod("p1").expect("ADD p1");
    let known = yaml.replace(
        "sa1, protocol: HBONE,",
        &format!("sa1, protocol: HBONE, workloadIps: [{}],", p1.ip),
    );
    std::fs::write(node.dir.join("workloads.yaml"), known).expect("workloads");
    let proxy = node.proxy.as_ref().expect("proxy");
    assert!(proxy.wait_for_text("workload store reloaded", Duration::from_secs(10)));
    let p0 = node.add_pod("p0").expect("ADD p0");
    let waypoint = node.waypoint("sa1").expect("the waypoint stand-in");
    // The pods reach the waypoint's subnet through the node, as a cluster's routing would.
    for p in [&p0, &p1] {
        let gateway = format!("10.{}.0.1", node.subnet);
        p.netns.ip(&["route", "add", "10.198.0.0/24", "via", &gateway]).expect("route");
    }
    let (_l, peers) = recording_echo(&p1, 8090);
    let dst = SocketAddr::new(p1.ip, 8090);
    echo_exact(p0.connect(dst).expect("connect"), 1000);
    let seen = waypoint.process.lines();
    let connect = format!("CONNECT {dst} FROM spiffe://cluster.local/ns/default/sa/sa0");
    assert!(seen.iter().any(|l| l.starts_with(&connect)), "the waypoint saw: {seen:?}");
    let from = peers.recv_timeout(Duration::from_secs(5)).expect("p1 was not reached");
    assert_eq!(from.ip(), wp.parse::<IpAddr>().expect("ip"), "p1 reached not from the waypoint");
    assert_eq!(opened(&node, "source", "none"), 0.0, "carried around the waypoint");
}
