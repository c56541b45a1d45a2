//! A proxy restart refuses nothing: the node agent holds each pod's listening sockets
//! (`loader/src/agent/held_listeners.rs`), so while no proxy runs the pods' connections wait in
//! the backlog of the listener the datapath steers them to, and the next proxy accepts them.
//! Fail closed still holds: nothing answers a connection but a proxy (an echo server behind it
//! would answer anyone who reached it), and a pod whose proxy never comes back is refused once
//! the hold has passed. A proxy written for istio-cni (ztunnel-like) is never handed a socket
//! and binds its own, as under istio-cni.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use meshpath_tests::cni_node::{CniNode, CniPod};

const WORKLOADS: &str = "workloads:
- {uid: uid-p0, name: p0, namespace: default, serviceAccount: sa0, protocol: HBONE}
- {uid: uid-p1, name: p1, namespace: default, serviceAccount: sa1, protocol: HBONE}
";

/// Meshed pods p0 → p1 with an echo server in p1 on 8080; the agent started with `agent_args`.
fn node_with(agent_args: &[&str]) -> (CniNode, CniPod, CniPod) {
    node_with_proxy(agent_args, &[])
}

/// `node_with`, the proxy started with `proxy_args`.
fn node_with_proxy(agent_args: &[&str], proxy_args: &[&str]) -> (CniNode, CniPod, CniPod) {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    let args: Vec<String> = agent_args.iter().map(|a| a.to_string()).collect();
    node.start_agent_with(&args).expect("agent");
    node.start_proxy_with(proxy_args).expect("proxy");
    let p1 = node.add_pod("p1").expect("ADD p1");
    node.echo_server(&p1, 8080).expect("echo");
    let p0 = node.add_pod("p0").expect("ADD p0");
    (node, p0, p1)
}

/// One round trip from `from` to `dst`: connect, send, read the echo back within `wait`.
fn round_trip(from: &CniPod, dst: SocketAddr, wait: Duration) -> std::io::Result<()> {
    let mut c = from.connect(dst)?;
    c.set_read_timeout(Some(wait))?;
    c.write_all(b"ping-pong")?;
    let mut back = [0u8; 9];
    c.read_exact(&mut back)?;
    if &back != b"ping-pong" {
        return Err(std::io::Error::other(format!("echo changed the bytes: {back:?}")));
    }
    Ok(())
}

/// A connection made while no proxy runs: connected (the held listener's backlog took it),
/// its bytes sent, and no answer within a second (nothing but a proxy may answer).
fn waiting_connection(from: &CniPod, dst: SocketAddr) -> TcpStream {
    let mut c = from.connect(dst).expect("refused with the pod's listeners held");
    c.write_all(b"waited...").expect("send");
    meshpath_tests::assert_unanswered_within(
        &mut c,
        Duration::from_secs(1),
        "a connection was answered with no proxy running",
    );
    c
}

/// The waiting connection `c` is answered by the proxy that came back.
fn answered(mut c: TcpStream) {
    c.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let mut back = [0u8; 9];
    c.read_exact(&mut back).expect("the waiting connection was not served by the new proxy");
    assert_eq!(&back, b"waited...");
}

#[test]
fn a_connection_made_while_the_proxy_is_killed_waits_and_the_next_proxy_serves_it() {
    let (mut node, p0, p1) = node_with(&[]);
    let dst = SocketAddr::new(p1.ip, 8080);
    round_trip(&p0, dst, Duration::from_secs(10)).expect("before");
    node.proxy.as_ref().expect("proxy").signal(libc::SIGKILL).expect("kill -9");
    assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(10)));
    let c = waiting_connection(&p0, dst);
    node.start_proxy().expect("proxy restarted");
    answered(c);
    round_trip(&p0, dst, Duration::from_secs(10)).expect("after");
}

#[test]
fn a_pod_whose_proxy_never_comes_back_is_refused_once_the_hold_has_passed() {
    let (mut node, p0, p1) = node_with(&["--hold-listeners-seconds", "2"]);
    let dst = SocketAddr::new(p1.ip, 8080);
    round_trip(&p0, dst, Duration::from_secs(10)).expect("before");
    node.proxy.as_ref().expect("proxy").signal(libc::SIGKILL).expect("kill -9");
    assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(10)));
    let mut waiting = waiting_connection(&p0, dst);
    // The hold passes: the connection that waited is reset, and the pod's connections are
    // refused from then on (fail closed, as with no proxy before), never carried around it.
    let deadline = Instant::now() + Duration::from_secs(15);
    let refused = loop {
        match p0.connect(dst) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => break true,
            Err(e) => panic!("neither held nor refused: {e}"),
            Ok(c) => drop(c),
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let agent = node.agent.as_ref().expect("agent").lines().join("\n");
    assert!(refused, "still not refused 15 s after a 2 s hold:\n{agent}");
    let mut b = [0u8; 9];
    let end = meshpath_tests::read_within(Duration::from_secs(5), |t| {
        waiting.set_read_timeout(Some(t))?;
        waiting.read(&mut b)
    });
    assert!(matches!(end, Ok(0) | Err(_)), "the waiting connection was answered: {end:?}");
    assert!(agent.contains("no proxy took the pod's listeners in time"), "{agent}");
}

/// A client in p0 opening a connection every 20 ms (each a round trip through both pods'
/// proxies to p1's echo server) while `restart` runs; returns (failures, the slowest round trip).
fn connect_loop_across(
    node: &mut CniNode,
    p0: &CniPod,
    dst: SocketAddr,
    restart: impl FnOnce(&mut CniNode),
) -> (Vec<String>, Duration, usize) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            let mut failures = Vec::new();
            let mut slowest = Duration::ZERO;
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let start = Instant::now();
                if let Err(e) = round_trip(p0, dst, Duration::from_secs(30)) {
                    failures.push(format!("{:?}: {e}", e.kind()));
                }
                slowest = slowest.max(start.elapsed());
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            (failures, slowest, n)
        });
        std::thread::sleep(Duration::from_secs(1));
        restart(node);
        std::thread::sleep(Duration::from_secs(1));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        client.join().expect("client")
    })
}

#[test]
fn a_connect_loop_across_kill_9_and_a_restart_of_the_proxy_is_never_refused() {
    let (mut node, p0, p1) = node_with(&[]);
    let dst = SocketAddr::new(p1.ip, 8080);
    let (failures, slowest, n) = connect_loop_across(&mut node, &p0, dst, |node| {
        node.proxy.as_ref().expect("proxy").signal(libc::SIGKILL).expect("kill -9");
        assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(500));
        node.start_proxy().expect("proxy restarted");
    });
    println!("kill -9: {n} round trips, slowest {slowest:?}");
    // None refused. The one round trip the killed proxy may have been carrying at that instant
    // ends with it (a crash hands nothing over): seen in about one run in eight.
    let refused = failures.iter().filter(|f| f.starts_with("ConnectionRefused")).count();
    assert_eq!(refused, 0, "{failures:?}");
    assert!(failures.len() <= 1, "{} of {n} failed: {failures:?}", failures.len());
}

#[test]
fn a_connect_loop_across_sigterm_and_a_new_proxy_is_never_refused() {
    let (mut node, p0, p1) = node_with(&[]);
    let dst = SocketAddr::new(p1.ip, 8080);
    let (failures, slowest, n) = connect_loop_across(&mut node, &p0, dst, |node| {
        node.proxy.as_ref().expect("proxy").signal(libc::SIGTERM).expect("SIGTERM");
        assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(30)));
        node.start_proxy().expect("a new proxy");
    });
    println!("SIGTERM: {n} round trips, slowest {slowest:?}");
    assert!(failures.is_empty(), "{} of {n} failed: {failures:?}", failures.len());
}

/// Runs `args` in `pod`'s netns; panics with its output if it fails.
fn in_pod(pod: &CniPod, args: &[&str]) -> String {
    let net = format!("--net={}", pod.netns.path().display());
    let out = std::process::Command::new(meshpath_tests::cni_node::nsenter())
        .arg(&net)
        .args(args)
        .output()
        .expect("nsenter");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_connection_the_proxy_took_just_before_sigterm_still_reaches_a_pod_of_the_same_node() {
    // The draining proxy carries it to its end: with the agent's hold on, its stream, once
    // open, would be paused and handed to the next proxy instead (connection_handover.rs).
    // Over HBONE: the proxy's connect to p1 is one to p1's HBONE port, which p1's qdisc below
    // can hold up (on the node-local path it connects inside p1, on no link).
    let over_hbone = ["--node-local-hbone"];
    let (mut node, p0, p1) = node_with_proxy(&["--hold-connections-seconds", "0"], &over_hbone);
    node.publish_address(WORKLOADS, "sa1", p1.ip);
    let dst = SocketAddr::new(p1.ip, 8080);
    // p1 sends nothing for now (a FIFO of length 0 drops every frame it sends, its SYN-ACKs
    // too), so the proxy, once it has taken p0's connection, is still connecting to p1's HBONE
    // port (a SYN sent from p0's netns) when SIGTERM comes.
    in_pod(&p1, &["tc", "qdisc", "add", "dev", "eth0", "root", "pfifo", "limit", "0"]);
    let mut c = p0.connect(dst).expect("connect (the proxy's listener takes it)");
    c.write_all(b"draining.").expect("send");
    let connecting = meshpath_tests::wait_until(Duration::from_secs(10), || {
        let ss = in_pod(&p0, &["ss", "-Htn", "state", "syn-sent"]);
        ss.contains(&format!("{}:15008", p1.ip))
    });
    assert!(connecting, "the proxy never tried p1's HBONE port");
    let proxy = node.proxy.as_ref().expect("proxy");
    proxy.signal(libc::SIGTERM).expect("SIGTERM");
    assert!(proxy.wait_for_text("draining", Duration::from_secs(10)), "not draining");
    // p1 answers again: TCP sends the SYN again, and the draining proxy (which no longer takes
    // new connections from its pods) must still serve its own connection's HBONE stream. It
    // would otherwise wait in p1's HBONE backlog for the next proxy, which starts only once
    // this one has exited: the connect timeout would pass and the app's connection be reset.
    in_pod(&p1, &["tc", "qdisc", "del", "dev", "eth0", "root"]);
    c.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let mut back = [0u8; 9];
    let answered = c.read_exact(&mut back);
    assert!(
        answered.is_ok(),
        "{answered:?}\n{}",
        node.proxy.as_ref().expect("proxy").lines().join("\n")
    );
    assert_eq!(&back, b"draining.");
    drop(c);
    assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(30)), "no exit");
    node.start_proxy_with(&over_hbone).expect("a new proxy");
    round_trip(&p0, dst, Duration::from_secs(10)).expect("after");
}

#[test]
fn after_an_agent_restart_the_proxy_gives_the_listeners_back_to_hold() {
    let (mut node, p0, p1) = node_with(&[]);
    let dst = SocketAddr::new(p1.ip, 8080);
    node.agent.as_ref().expect("agent").signal(libc::SIGKILL).expect("kill -9 agent");
    assert!(node.agent.as_mut().expect("agent").wait_exit(Duration::from_secs(10)));
    node.start_agent().expect("agent restarted");
    // The proxy reconnects, and with the snapshot gives the new agent its pods' listeners.
    let proxy = node.proxy.as_ref().expect("proxy");
    let applied = "snapshot from the node agent applied";
    let deadline = Instant::now() + Duration::from_secs(15);
    while proxy.lines().iter().filter(|l| l.contains(applied)).count() < 2 {
        assert!(Instant::now() < deadline, "no second snapshot:\n{}", proxy.lines().join("\n"));
        std::thread::sleep(Duration::from_millis(100));
    }
    node.proxy.as_ref().expect("proxy").signal(libc::SIGKILL).expect("kill -9 proxy");
    assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(10)));
    let c = waiting_connection(&p0, dst);
    node.start_proxy().expect("proxy restarted");
    answered(c);
}

#[test]
fn a_proxy_written_for_istio_cni_binds_its_own_listeners_after_one_that_handed_them_over() {
    let (mut node, p0, p1) = node_with(&[]);
    let dst = SocketAddr::new(p1.ip, 8080);
    node.proxy.as_ref().expect("proxy").signal(libc::SIGKILL).expect("kill -9");
    assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(10)));
    // ztunnel-like never offers to hold: the agent closes what it held before its snapshot,
    // so its binds succeed, and it serves the pods (plain TCP between them).
    node.start_ztunnel_like().expect("ztunnel-like");
    let proxy = node.proxy.as_ref().expect("proxy");
    let deadline = Instant::now() + Duration::from_secs(15);
    let served = loop {
        if round_trip(&p0, dst, Duration::from_secs(5)).is_ok() {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let agent = node.agent.as_ref().expect("agent").lines().join("\n");
    assert!(served, "ztunnel-like did not serve:\n{}\n{agent}", proxy.lines().join("\n"));
    assert!(agent.contains("closing the pods' held listeners"), "{agent}");
}
