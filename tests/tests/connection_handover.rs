//! Open connections survive a proxy upgrade (`proxy/src/proxy/handover.rs`,
//! `loader/src/agent/held_connections.rs`): on SIGTERM the proxy hands each open plain
//! connection (passthrough to a destination outside the mesh, plaintext inbound from a client
//! outside it) to the node agent, and the next proxy carries it on; and each HBONE stream between
//! two meshpath proxies (here both of the node's proxy: two meshed pods of the node) pauses, its
//! two app sockets go to the agent, and the next proxy resumes it (`proxy/src/proxy/resume.rs`).
//! The apps see one connection that paused: every byte arrives once, in order, and neither side
//! sees an end or a reset. The control: with the agent's hold off, the same connection ends with
//! the old proxy.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use meshpath_tests::cni_node::{end_app, link_nodes, route_pod, CniNode, CniPod};

const WORKLOADS: &str = "workloads:
- {uid: uid-p0, name: p0, namespace: default, serviceAccount: sa0, protocol: HBONE}
";

/// A node with meshed pod p0, and an echo server outside the mesh in the node's netns (on the
/// pods' gateway address, reached from p0 by passthrough). `agent_args` go to the agent.
fn node_with(agent_args: &[&str]) -> (CniNode, CniPod, SocketAddr) {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    let args: Vec<String> = agent_args.iter().map(|a| a.to_string()).collect();
    node.start_agent_with(&args).expect("agent");
    node.start_proxy_with(&["--drain-seconds", "5"]).expect("proxy");
    let p0 = node.add_pod("p0").expect("ADD p0");
    let gateway = IpAddr::V4(Ipv4Addr::new(10, node.subnet, 0, 1));
    let l = node.node.listen(SocketAddr::new(gateway, 0)).expect("listen in the node netns");
    let server = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut c = c;
                let mut r = c.try_clone()?;
                std::io::copy(&mut r, &mut c)?;
                c.shutdown(std::net::Shutdown::Write)
            });
        }
    });
    (node, p0, server)
}

/// SIGTERM to the proxy, its exit awaited, then a new proxy (ready once the agent's snapshot,
/// with the connections it held, is in). Returns the old proxy's log.
fn upgrade_proxy(node: &mut CniNode) -> String {
    let old = node.proxy.as_mut().expect("proxy");
    old.signal(libc::SIGTERM).expect("SIGTERM");
    assert!(old.wait_exit(Duration::from_secs(30)), "the old proxy did not exit");
    let log = old.lines().join("\n");
    node.start_proxy_with(&["--drain-seconds", "5"]).expect("the new proxy");
    log
}

/// One echo round trip of `msg` on `c`.
fn round_trip(c: &mut TcpStream, msg: &[u8]) -> std::io::Result<()> {
    c.write_all(msg)?;
    let mut back = vec![0u8; msg.len()];
    c.read_exact(&mut back)?;
    if back != msg {
        return Err(std::io::Error::other("the echo changed the bytes"));
    }
    Ok(())
}

/// SIGTERM to the proxy and its exit awaited; bytes sent on `c` while no proxy runs wait
/// unanswered; the next proxy answers them, and the connection goes on.
fn sent_to_while_no_proxy_runs(node: &mut CniNode, c: &mut TcpStream) {
    let old = node.proxy.as_mut().expect("proxy");
    old.signal(libc::SIGTERM).expect("SIGTERM");
    assert!(old.wait_exit(Duration::from_secs(30)), "the old proxy did not exit");
    // No proxy runs: the bytes wait in the kernel's buffers, unanswered.
    c.write_all(b"while no proxy runs").expect("send");
    meshpath_tests::assert_unanswered_within(
        c,
        Duration::from_secs(1),
        "answered or ended with no proxy running",
    );
    node.start_proxy_with(&["--drain-seconds", "5"]).expect("the new proxy");
    c.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let mut back = [0u8; 19];
    c.read_exact(&mut back).expect("the waiting bytes were not carried by the new proxy");
    assert_eq!(&back, b"while no proxy runs");
    round_trip(c, b"after the upgrade").expect("after");
}

/// The byte at `offset` of the test's stream (a pattern no shift or repeat reproduces).
fn pattern(offset: u64) -> u8 {
    (offset.wrapping_mul(2_654_435_761) >> 13) as u8
}

/// A transfer of `total` bytes, echoed back and checked byte by byte, on `c`, with the proxy
/// upgraded (`upgrade_proxy`) a quarter of the way through. Returns the old proxy's log.
fn bulk_echo_across_an_upgrade(node: &mut CniNode, c: TcpStream, total: u64) -> String {
    bulk_echo_across(c, total, || upgrade_proxy(node))
}

/// A transfer of `total` bytes, echoed back and checked byte by byte, on `c`, with `upgrade`
/// run a quarter of the way through; returns what it returned.
fn bulk_echo_across<T>(c: TcpStream, total: u64, upgrade: impl FnOnce() -> T) -> T {
    c.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let mut w = c.try_clone().expect("clone");
    let mut r = c;
    let echoed = AtomicU64::new(0);
    let upgraded = AtomicBool::new(false);
    std::thread::scope(|s| {
        let writer = s.spawn(|| -> std::io::Result<()> {
            let mut off = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            while off < total {
                // Past a quarter, slowly until the upgrade is done: it must land mid-transfer.
                if off > total / 4 && !upgraded.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(2));
                }
                let n = (buf.len() as u64).min(total - off) as usize;
                for (i, b) in buf[..n].iter_mut().enumerate() {
                    *b = pattern(off + i as u64);
                }
                w.write_all(&buf[..n])?;
                off += n as u64;
            }
            w.shutdown(std::net::Shutdown::Write)
        });
        let reader = s.spawn(|| -> Result<u64, String> {
            let mut off = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match r.read(&mut buf) {
                    Ok(0) => return Ok(off),
                    Ok(n) => n,
                    Err(e) => return Err(format!("at byte {off}: {e}")),
                };
                for (i, b) in buf[..n].iter().enumerate() {
                    if *b != pattern(off + i as u64) {
                        return Err(format!("byte {} differs", off + i as u64));
                    }
                }
                off += n as u64;
                echoed.store(off, Ordering::Relaxed);
            }
        });
        // The upgrade lands mid-transfer.
        let deadline = Instant::now() + Duration::from_secs(60);
        while echoed.load(Ordering::Relaxed) < total / 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let at = echoed.load(Ordering::Relaxed);
        let done = upgrade();
        upgraded.store(true, Ordering::Relaxed);
        writer.join().expect("writer").expect("the client's upload failed");
        let got = reader.join().expect("reader");
        assert_eq!(got, Ok(total), "upgrade at byte {at}");
        done
    })
}

#[test]
fn a_bulk_transfer_through_passthrough_carries_on_byte_exact_across_sigterm_and_a_new_proxy() {
    let (mut node, p0, server) = node_with(&[]);
    let c = p0.connect(server).expect("connect");
    let old_log = bulk_echo_across_an_upgrade(&mut node, c, 256 << 20);
    assert!(old_log.contains("handed over to the node agent"), "{old_log}");
    let new_log = node.proxy.as_ref().expect("proxy").lines().join("\n");
    assert!(new_log.contains("connection taken over from the previous proxy"), "{new_log}");
}

#[test]
fn an_idle_connection_sent_to_while_no_proxy_runs_is_answered_by_the_next_proxy() {
    let (mut node, p0, server) = node_with(&[]);
    let mut c = p0.connect(server).expect("connect");
    round_trip(&mut c, b"before the upgrade").expect("before");
    sent_to_while_no_proxy_runs(&mut node, &mut c);
}

#[test]
fn a_plaintext_connection_into_a_meshed_pod_carries_on_across_sigterm_and_a_new_proxy() {
    let (mut node, p0, _) = node_with(&[]);
    node.echo_server(&p0, 8080).expect("echo in p0");
    // From the node's netns: a client outside the mesh, captured on p0's inbound plaintext.
    let dst = SocketAddr::new(p0.ip, 8080);
    let mut c = node
        .node
        .open()
        .expect("node netns")
        .run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(5)))
        .expect("enter")
        .expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    round_trip(&mut c, b"inbound, before").expect("before");
    let log = upgrade_proxy(&mut node);
    assert!(log.contains("handed over to the node agent"), "{log}");
    round_trip(&mut c, b"inbound, after the upgrade").expect("after");
}

#[test]
fn with_the_agents_hold_off_an_open_connection_ends_with_the_old_proxy() {
    // The control: the same connection, but the agent takes none (the proxy drains as before).
    let (mut node, p0, server) = node_with(&["--hold-connections-seconds", "0"]);
    let mut c = p0.connect(server).expect("connect");
    round_trip(&mut c, b"before the upgrade").expect("before");
    let log = upgrade_proxy(&mut node);
    assert!(!log.contains("handed over to the node agent"), "{log}");
    let after = round_trip(&mut c, b"after the upgrade");
    assert!(after.is_err(), "the connection outlived its proxy with no hand-over");
}

const MESHED: &str = "workloads:
- {uid: uid-p0, name: p0, namespace: default, serviceAccount: sa0, protocol: HBONE}
- {uid: uid-p1, name: p1, namespace: default, serviceAccount: sa1, protocol: HBONE}
";

/// A node with meshed pods p0 and p1 and an echo server in p1, which p0 reaches through the
/// node's proxy: over HBONE (both ends of the stream are that proxy's) if `proxy_args` say
/// `--node-local-hbone`, on the node-local path otherwise. `agent_args` go to the agent.
fn meshed_pair(agent_args: &[&str], proxy_args: &[&str]) -> (CniNode, CniPod, SocketAddr) {
    let mut node = CniNode::bare(MESHED).expect("node");
    let args: Vec<String> = agent_args.iter().map(|a| a.to_string()).collect();
    node.start_agent_with(&args).expect("agent");
    let proxy_args = [&["--drain-seconds", "5"], proxy_args].concat();
    node.start_proxy_with(&proxy_args).expect("proxy");
    let p1 = node.add_pod("p1").expect("ADD p1");
    node.echo_server(&p1, 8080).expect("echo in p1");
    node.publish_address(MESHED, "sa1", p1.ip);
    let p0 = node.add_pod("p0").expect("ADD p0");
    (node, p0, SocketAddr::new(p1.ip, 8080))
}

/// Connections p0 opened to p1 with `security` (`mutual_tls`: over HBONE; `none`: on the
/// node-local path), as the proxy's source reporter counts them.
fn opened_with(node: &CniNode, security: &str) -> f64 {
    let labels = [
        ("reporter", "source"),
        ("source_workload", "p0"),
        ("destination_workload", "p1"),
        ("connection_security_policy", security),
    ];
    node.proxy_metric("istio_tcp_connections_opened_total", &labels).expect("metrics")
}

fn hbone_opened(node: &CniNode) -> f64 {
    opened_with(node, "mutual_tls")
}

/// Carry same-node connections over HBONE, not on the node-local path.
const OVER_HBONE: &[&str] = &["--node-local-hbone"];

#[test]
fn a_bulk_transfer_over_hbone_between_two_pods_of_the_node_carries_on_byte_exact_across_sigterm_and_a_new_proxy(
) {
    let (mut node, p0, server) = meshed_pair(&[], OVER_HBONE);
    let c = p0.connect(server).expect("connect");
    let old_log = bulk_echo_across_an_upgrade(&mut node, c, 256 << 20);
    // Both sides of the stream were this proxy's: each paused and went to the agent.
    let handed = old_log.matches("paused HBONE stream handed over to the node agent").count();
    assert_eq!(handed, 2, "{old_log}");
    let new_log = node.proxy.as_ref().expect("proxy").lines().join("\n");
    let taken = new_log.matches("paused HBONE stream taken over from the previous proxy").count();
    assert_eq!(taken, 2, "{new_log}");
}

#[test]
fn an_idle_hbone_connection_sent_to_while_no_proxy_runs_is_answered_by_the_next_proxy() {
    let (mut node, p0, server) = meshed_pair(&[], OVER_HBONE);
    let mut c = p0.connect(server).expect("connect");
    round_trip(&mut c, b"before the upgrade").expect("before");
    assert_eq!(hbone_opened(&node), 1.0, "not carried over HBONE");
    sent_to_while_no_proxy_runs(&mut node, &mut c);
    // And the resumed stream pauses and resumes again at the next upgrade.
    let log = upgrade_proxy(&mut node);
    assert!(log.contains("paused HBONE stream handed over to the node agent"), "{log}");
    round_trip(&mut c, b"after the second upgrade").expect("after the second");
}

#[test]
fn with_the_agents_hold_off_an_hbone_stream_ends_with_the_old_proxy() {
    // The control: the agent offers no hold, so the proxy pauses nothing and drains as before.
    let (mut node, p0, server) = meshed_pair(&["--hold-connections-seconds", "0"], OVER_HBONE);
    let mut c = p0.connect(server).expect("connect");
    round_trip(&mut c, b"before the upgrade").expect("before");
    assert_eq!(hbone_opened(&node), 1.0, "not carried over HBONE");
    let log = upgrade_proxy(&mut node);
    assert!(!log.contains("paused HBONE stream"), "{log}");
    let after = round_trip(&mut c, b"after the upgrade");
    assert!(after.is_err(), "the stream outlived its proxy with no hand-over");
}

#[test]
fn a_bulk_transfer_on_the_node_local_path_carries_on_byte_exact_across_sigterm_and_a_new_proxy() {
    let (mut node, p0, server) = meshed_pair(&[], &[]);
    let c = p0.connect(server).expect("connect");
    let old_log = bulk_echo_across_an_upgrade(&mut node, c, 256 << 20);
    // One connection, its two sockets in two pods, went to the agent.
    assert_eq!(old_log.matches("handed over to the node agent").count(), 1, "{old_log}");
    let new_log = node.proxy.as_ref().expect("proxy").lines().join("\n");
    let taken = "node-local connection taken over from the previous proxy";
    assert_eq!(new_log.matches(taken).count(), 1, "{new_log}");
    assert_eq!(opened_with(&node, "none"), 1.0, "the next proxy did not carry it node-local");
}

#[test]
fn an_idle_node_local_connection_sent_to_while_no_proxy_runs_is_answered_by_the_next_proxy() {
    let (mut node, p0, server) = meshed_pair(&[], &[]);
    let mut c = p0.connect(server).expect("connect");
    round_trip(&mut c, b"before the upgrade").expect("before");
    assert_eq!(opened_with(&node, "none"), 1.0, "not on the node-local path");
    sent_to_while_no_proxy_runs(&mut node, &mut c);
    // And it is handed over again at the next upgrade.
    let log = upgrade_proxy(&mut node);
    assert!(log.contains("handed over to the node agent"), "{log}");
    round_trip(&mut c, b"after the second upgrade").expect("after the second");
}

#[test]
fn with_the_agents_hold_off_a_node_local_connection_ends_with_the_old_proxy() {
    // The control: the agent offers no hold, so the proxy hands nothing over and drains.
    let (mut node, p0, server) = meshed_pair(&["--hold-connections-seconds", "0"], &[]);
    let mut c = p0.connect(server).expect("connect");
    round_trip(&mut c, b"before the upgrade").expect("before");
    assert_eq!(opened_with(&node, "none"), 1.0, "not on the node-local path");
    let log = upgrade_proxy(&mut node);
    assert!(!log.contains("handed over to the node agent"), "{log}");
    let after = round_trip(&mut c, b"after the upgrade");
    assert!(after.is_err(), "the connection outlived its proxy with no hand-over");
}

/// Two nodes, each with its agent and proxy (certificates from one CA), their pod subnets
/// routed to each other over a link between the nodes' netns: meshed pod p0 on node 1, meshed
/// pod p1 with an echo server on 8080 on node 2. Returns the nodes, p0 and p1.
fn two_nodes() -> (CniNode, CniNode, CniPod, CniPod) {
    let mut n1 = CniNode::bare(MESHED).expect("node 1");
    let mut n2 = CniNode::bare(MESHED).expect("node 2");
    n2.subnet = n1.subnet + 1;
    for f in ["ca.pem", "ca-key.pem"] {
        std::fs::copy(n1.dir.join(f), n2.dir.join(f)).expect("one CA for both nodes");
    }
    link_nodes(&n1, &n2).expect("the nodes' pod subnets routed to each other");
    for n in [&mut n1, &mut n2] {
        n.start_agent().expect("agent");
        n.start_proxy_with(&["--drain-seconds", "5"]).expect("proxy");
    }
    let p1 = n2.add_pod("p1").expect("ADD p1 on node 2");
    route_pod(&p1, &n2, &n1).expect("p1's route to node 1");
    n2.echo_server(&p1, 8080).expect("echo in p1");
    n1.publish_address(MESHED, "sa1", p1.ip);
    let p0 = n1.add_pod("p0").expect("ADD p0 on node 1");
    route_pod(&p0, &n1, &n2).expect("p0's route to node 2");
    (n1, n2, p0, p1)
}

#[test]
fn an_hbone_stream_between_two_nodes_carries_on_byte_exact_across_an_upgrade_of_each_nodes_proxy_in_turn(
) {
    let (mut n1, mut n2, p0, p1) = two_nodes();
    let mut c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    round_trip(&mut c, b"across nodes").expect("before");
    assert_eq!(hbone_opened(&n1), 1.0, "not carried over HBONE");
    // Node 1's proxy holds the client side: it goes, node 2's pauses its side and waits, node
    // 1's next proxy dials again. Then node 2's goes: node 1's pauses its side and dials again
    // until node 2's next proxy has the stream.
    let (log1, log2) = bulk_echo_across(c, 128 << 20, || {
        let first = upgrade_proxy(&mut n1);
        let second = upgrade_proxy(&mut n2);
        (first, second)
    });
    for (log, which) in [(&log1, "node 1's"), (&log2, "node 2's")] {
        let handed = log.matches("paused HBONE stream handed over to the node agent").count();
        assert_eq!(handed, 1, "{which} old proxy:\n{log}");
    }
    for (n, which) in [(&n1, "node 1's"), (&n2, "node 2's")] {
        let log = n.proxy.as_ref().expect("proxy").lines().join("\n");
        let taken = log.matches("paused HBONE stream taken over from the previous proxy").count();
        assert_eq!(taken, 1, "{which} new proxy:\n{log}");
    }
}

#[test]
fn a_stream_whose_server_side_never_comes_back_ends_once_the_resume_window_has_passed() {
    let (mut n1, mut n2, p0, p1) = two_nodes();
    let window = ["--drain-seconds", "5", "--resume-within-seconds", "3"];
    n1.start_proxy_with(&window).expect("node 1's proxy, with a short window");
    let mut c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    round_trip(&mut c, b"across nodes").expect("before");
    assert_eq!(hbone_opened(&n1), 1.0, "not carried over HBONE");
    // Node 2's proxy goes and none follows: node 1's side pauses and dials again, in vain.
    let old = n2.proxy.as_mut().expect("proxy");
    old.signal(libc::SIGTERM).expect("SIGTERM");
    assert!(old.wait_exit(Duration::from_secs(30)), "node 2's proxy did not exit");
    // Within the window the app's connection is held, neither answered nor ended...
    let mut b = [0u8; 1];
    match meshpath_tests::read_within(Duration::from_secs(1), |t| {
        c.set_read_timeout(Some(t))?;
        c.read(&mut b)
    }) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("answered or ended within the window: {other:?}"),
    }
    // ...and once it has passed, ended: the client side stopped dialing and closed its socket,
    // a dial under way included (node 2's agent holds its listener: a dial there connects and
    // then waits for a TLS answer that never comes, for 10 s if nothing bounds it).
    c.set_read_timeout(Some(Duration::from_secs(6))).expect("timeout");
    match c.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("not ended 4 s after the window: {other:?}"),
    }
    // Logged as the connection ends, just after its socket is closed.
    let proxy = n1.proxy.as_ref().expect("proxy");
    let said = proxy.wait_for_text("not resumed within 3s", Duration::from_secs(5));
    assert!(said, "{}", proxy.lines().join("\n"));
}

/// A new connection to a pod of a node whose proxy is being replaced more slowly than several
/// of the client node's connect timeouts: node 1's proxy dials node 2, the connection waits in
/// the backlog node 2's agent holds, and no handshake answers until node 2's next proxy runs.
/// The CONNECT was never sent: node 1's proxy dials again each timeout, and the next proxy
/// answers. Three connections at once: one dials, the others wait their turn behind it and
/// then dial in turn, each waiting longer than a turn is waited for. Before, the app's
/// connection was reset at the first timeout (one in about 3000 in a two-node rolling update,
/// where 10 to 14 s passed between the two proxies on a node), and then at the third, or at
/// the end of the turn's wait (1216 of 4227 in a rolling update on a busy cluster).
#[test]
fn a_new_connection_to_a_node_whose_proxy_is_replaced_slower_than_several_connect_timeouts_is_answered(
) {
    let (mut n1, mut n2, p0, p1) = two_nodes();
    let short = ["--drain-seconds", "5", "--connect-timeout-seconds", "1"];
    n1.start_proxy_with(&short).expect("node 1's proxy, with a 1 s connect timeout");
    let old = n2.proxy.as_mut().expect("proxy");
    old.signal(libc::SIGTERM).expect("SIGTERM");
    assert!(old.wait_exit(Duration::from_secs(30)), "node 2's proxy did not exit");
    let mut conns: Vec<TcpStream> = (0..3)
        .map(|i| {
            let mut c = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
            c.write_all(format!("while node 2 has no proxy {i}").as_bytes()).expect("send");
            c
        })
        .collect();
    // Past five connect timeouts with no proxy on node 2: the apps' connections are still
    // open, neither answered nor ended.
    std::thread::sleep(Duration::from_secs(5));
    for c in &mut conns {
        meshpath_tests::assert_unanswered_within(
            c,
            Duration::from_millis(200),
            "answered or ended with no proxy on node 2",
        );
    }
    n2.start_proxy_with(&["--drain-seconds", "5"]).expect("node 2's next proxy");
    for (i, c) in conns.iter_mut().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut back = [0u8; 27];
        let echoed = c.read_exact(&mut back);
        let log = n1.proxy.as_ref().expect("proxy").lines().join("\n");
        assert!(echoed.is_ok(), "{i} not answered by node 2's next proxy: {echoed:?}\n{log}");
        assert_eq!(back[..], *format!("while node 2 has no proxy {i}").as_bytes());
        round_trip(c, b"after").expect("after");
    }
    let log = n1.proxy.as_ref().expect("proxy").lines().join("\n");
    assert!(log.contains("the peer's proxy is not answering; trying again"), "{log}");
    assert_eq!(hbone_opened(&n1), 3.0, "not each carried over HBONE");
}

/// The resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[test]
fn sixty_mixed_hbone_connections_between_two_nodes_are_kept_across_an_upgrade_of_each_nodes_proxy_while_new_ones_are_answered(
) {
    let (mut n1, mut n2, p0, p1) = two_nodes();
    let p1_ip = p1.ip.to_string();
    // Its echo (9100) and sink (9000); its HTTP port off 8080, where two_nodes' echo is.
    let _server = p1.cluster_app_server(8081).expect("cluster-app serve");
    // A third each bulk, request/response and idle (cluster-app's `hold`), and a new connection
    // every 20 ms to the sink (`loop`), from node 1's pod to node 2's.
    let hold = p0
        .cluster_app(&["hold", &format!("{p1_ip}:9100"), "--connections", "60", "--seconds", "120"])
        .expect("cluster-app hold");
    let new = p0
        .cluster_app(&[
            "loop",
            &format!("{p1_ip}:9000"),
            "--seconds",
            "120",
            "--until-stdin-closes",
        ])
        .expect("cluster-app loop");
    std::thread::sleep(Duration::from_secs(3));
    assert!(hbone_opened(&n1) >= 60.0, "the held connections are not HBONE");
    // Node 1's proxy goes: while no proxy runs, the agent holds each connection's app socket
    // (what that costs it is measured here); then the next one takes them.
    let agent_pid = n1.agent.as_ref().expect("agent").pid();
    let rss_before = rss_kib(agent_pid);
    let old = n1.proxy.as_mut().expect("proxy");
    old.signal(libc::SIGTERM).expect("SIGTERM");
    assert!(old.wait_exit(Duration::from_secs(30)), "the old proxy did not exit");
    let metrics = n1.agent_metrics_text().expect("agent metrics");
    let held = |kind: &str| {
        meshpath_tests::sum_metric(&metrics, "meshpath_agent_held_connections", &[("kind", kind)])
    };
    let (plain, streams) = (held("plain"), held("stream"));
    let rss_holding = rss_kib(agent_pid);
    n1.start_proxy_with(&["--drain-seconds", "5"]).expect("the new proxy");
    println!(
        "node 1's agent held {streams} streams and {plain} plain connections: RSS {rss_before} KiB before, {rss_holding} KiB holding"
    );
    assert!(streams >= 60.0, "{streams} streams held");
    std::thread::sleep(Duration::from_secs(2));
    upgrade_proxy(&mut n2);
    std::thread::sleep(Duration::from_secs(3));
    let (new, new_ok) = end_app(new);
    let (hold, hold_ok) = end_app(hold);
    println!("held: {}; new: {}", hold.trim(), new.trim());
    assert!(hold_ok && hold.contains("kept=60 "), "held connections: {hold}");
    assert!(new_ok && new.contains("refused=0 reset=0"), "new connections: {new}");
}
