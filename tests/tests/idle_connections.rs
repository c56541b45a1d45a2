//! Idle connections: they cost the proxy a bounded amount of memory (no read buffer is held
//! while a socket is idle), the global cap refuses one beyond it cleanly, and a connection that
//! carries nothing either way for the idle timeout is closed — while one that carries data
//! outlives it.

use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::{Command, Stdio},
    time::Duration,
};

use meshpath_tests::{
    sibling_bin,
    two_nodes::{Setup, TwoNodes, View, MESHED},
    wait_until, ChildGuard,
};

/// What an idle connection may add to each proxy's resident memory (README, "Limits").
/// Measured (debug build, kernel 6.18, the proxies on jemalloc with [`HELD_MEMORY_ONLY`]):
/// HBONE 14.6 KiB on the sending node, 13.2 on the receiving one; plain relays 13.3 and 9.5.
/// On glibc's malloc, before jemalloc: 13.9, 12.2, 12.1 and 9.7. With read buffers taken up
/// front (before copy.rs) they were 20.6, 13.9, 42.5 and 31.4: both tests failed.
const MAX_KIB_PER_IDLE_CONNECTION: f64 = 16.0;
/// jemalloc keeps freed pages resident for 10 s by default, and what the connections' set-up
/// freed would then count as theirs (14.9 to 15.3 KiB on the sending node without this): the
/// proxies measured here give freed pages back at once.
const HELD_MEMORY_ONLY: (&str, &str) = ("MALLOC_CONF", "dirty_decay_ms:0");
const IDLE: usize = 10_000;

fn rss_kib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS value")
}

/// The app in pod b, in its own process (this one holds the 10,000 client ends; its descriptor
/// limit is not enough for both, and the container may not raise it).
struct HoldingApp {
    _child: ChildGuard,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl HoldingApp {
    fn start(nodes: &TwoNodes, addr: SocketAddr) -> Self {
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", nodes.pods.b.path().display()))
            .arg(sibling_bin("hold-connections"))
            .arg(addr.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("hold-connections");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("hold-connections' first line");
        assert_eq!(line.trim(), "listening");
        Self { _child: ChildGuard(child), stdin, stdout }
    }

    /// (connections held, connections that had bytes arrive)
    fn counts(&mut self) -> (usize, usize) {
        writeln!(self.stdin).expect("ask");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("answer");
        let mut it = line.split_whitespace().map(|n| n.parse().expect("count"));
        (it.next().expect("held"), it.next().expect("with data"))
    }
}

/// Opens `n` connections from pod a to `dst` (one first, so pooled HBONE connections, TLS
/// state and certificates exist before the baseline), waits until the app holds them all, and
/// returns them with what each added to node 1's and node 2's proxy, in KiB.
fn open_idle(
    nodes: &TwoNodes,
    app: &mut HoldingApp,
    dst: SocketAddr,
    n: usize,
) -> (Vec<TcpStream>, f64, f64) {
    let first = nodes.connect_from_a(dst).expect("first connection");
    assert!(
        wait_until(Duration::from_secs(10), || app.counts().0 == 1),
        "the first connection never arrived"
    );
    let (out_pid, in_pid) = (nodes.proxies[0].proxy.pid(), nodes.proxies[1].proxy.pid());
    let (out_before, in_before) = (rss_kib(out_pid), rss_kib(in_pid));
    let mut clients: Vec<TcpStream> = nodes
        .pods
        .a
        .open()
        .expect("pod a")
        .run(|| {
            (1..n)
                .map(|i| {
                    TcpStream::connect_timeout(&dst, Duration::from_secs(10))
                        .unwrap_or_else(|e| panic!("connection {i}: {e}"))
                })
                .collect()
        })
        .expect("netns");
    clients.insert(0, first);
    let all_through = wait_until(Duration::from_secs(120), || app.counts().0 == n);
    if !all_through {
        // Refusals at a cap are logged only at debug: say whether the missing ones were refused.
        let refused = |node: usize, direction: &str| {
            let limit = [("reason", "connection_limit"), ("direction", direction)];
            nodes.proxies[node].metric("meshpath_connection_errors_total", &limit).ok()
        };
        panic!(
            "the app holds {} of {n} connections; refused at a connection cap: node 1 outbound {:?}, node 2 inbound {:?}",
            app.counts().0,
            refused(0, "outbound"),
            refused(1, "inbound")
        );
    }
    // Let the proxies settle (tasks parked, nothing pending), then measure.
    std::thread::sleep(Duration::from_secs(2));
    let per_conn = |before: f64, after: f64| (after - before) / n as f64;
    let (out_kib, in_kib) =
        (per_conn(out_before, rss_kib(out_pid)), per_conn(in_before, rss_kib(in_pid)));
    let pooled = nodes.proxies[0].metric("meshpath_pool_connections", &[]).unwrap_or(-1.0);
    println!("idle connections: {n}; node 1's proxy {out_kib:.1} KiB each, node 2's {in_kib:.1} KiB each; {pooled} pooled HBONE connections");
    (clients, out_kib, in_kib)
}

/// Data on the first and last of `clients` reaches the app: they are still carried.
fn still_carried(app: &mut HoldingApp, clients: Vec<TcpStream>) {
    let before = app.counts().1;
    let mut ends = [clients.first().expect("one"), clients.last().expect("one")];
    for c in ends.iter_mut() {
        c.write_all(b"still here").expect("write");
    }
    let got = wait_until(Duration::from_secs(10), || app.counts().1 == before + 2);
    assert!(got, "data on held connections did not reach the app: {:?}", app.counts());
}

#[test]
fn ten_thousand_idle_hbone_connections_stay_under_the_memory_bound_and_the_cap_refuses_one_more() {
    // Node 1's caps: it carries the app's connections. Node 2 keeps its defaults: each stream
    // counts there as a connection (it has one to the app), and so does each pooled HBONE
    // connection the streams arrive on.
    let cap = IDLE.to_string();
    let nodes = TwoNodes::start(Setup {
        node1_args: vec![
            "--max-connections".into(),
            cap.clone(),
            "--max-connections-per-pod".into(),
            cap,
        ],
        proxy_env: vec![HELD_MEMORY_ONLY],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8130);
    let mut app = HoldingApp::start(&nodes, dst);
    let (clients, out_kib, in_kib) = open_idle(&nodes, &mut app, dst, IDLE);
    assert!(
        out_kib <= MAX_KIB_PER_IDLE_CONNECTION,
        "node 1 (outbound): {out_kib:.1} KiB per idle connection"
    );
    assert!(
        in_kib <= MAX_KIB_PER_IDLE_CONNECTION,
        "node 2 (inbound): {in_kib:.1} KiB per idle connection"
    );

    // One more: over the node's cap, closed by the proxy, never reaching the app. The proxy
    // closes it (EOF or reset); a connection left open (carried, to an app that says nothing)
    // would only time out, which is not a refusal.
    let mut over = nodes.connect_from_a(dst).expect("the kernel accepts it for the proxy");
    over.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let _ = over.write_all(b"x");
    let mut byte = [0u8; 1];
    let read = meshpath_tests::again_after_eintr(|| over.read(&mut byte));
    let refused = matches!(&read, Ok(0))
        || matches!(&read, Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe));
    assert!(refused, "a connection over the cap was not closed by the proxy: {read:?}");
    let limit = [("reason", "connection_limit"), ("direction", "outbound")];
    let counted =
        nodes.proxies[0].metric("meshpath_connection_errors_total", &limit).expect("metrics");
    assert_eq!(counted, 1.0, "the refusal was not counted");
    // Refused at accept: the proxy never connected on, so the app's count is final now.
    assert_eq!(app.counts().0, IDLE, "the app saw a connection over the cap");

    still_carried(&mut app, clients);
}

#[test]
fn idle_plain_tcp_connections_hold_no_read_buffers() {
    // Pod b outside the mesh as node 1 sees it (passthrough) and captured inbound on node 2
    // (15006): both plain relays.
    let nodes = TwoNodes::start(Setup {
        view: View { b_protocol: "TCP", b_inbound_captured: true, ..MESHED },
        proxy_env: vec![HELD_MEMORY_ONLY],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8132);
    let mut app = HoldingApp::start(&nodes, dst);
    let (clients, out_kib, in_kib) = open_idle(&nodes, &mut app, dst, 2_000);
    assert!(
        out_kib <= MAX_KIB_PER_IDLE_CONNECTION,
        "node 1 (passthrough): {out_kib:.1} KiB per idle connection"
    );
    assert!(
        in_kib <= MAX_KIB_PER_IDLE_CONNECTION,
        "node 2 (15006): {in_kib:.1} KiB per idle connection"
    );
    still_carried(&mut app, clients);
}

fn idle_nodes(seconds: &str) -> (TwoNodes, SocketAddr, TcpListener) {
    let nodes = TwoNodes::start(Setup {
        args: vec!["--idle-timeout-seconds".into(), seconds.into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8131);
    let listener = nodes.pods.b.listen(dst).expect("bind");
    (nodes, dst, listener)
}

#[test]
fn a_connection_idle_for_the_timeout_is_closed_at_both_ends() {
    let (nodes, dst, listener) = idle_nodes("2");
    let mut client = nodes.connect_from_a(dst).expect("connect");
    client.write_all(b"hi").expect("write");
    let (mut server, _) = listener.accept().expect("accept");
    let mut buf = [0u8; 2];
    server.read_exact(&mut buf).expect("the app got the first bytes");
    // Then nothing either way: both ends see the connection end (EOF or reset) without sending.
    client.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    server.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let ended =
        |s: &mut TcpStream| match meshpath_tests::again_after_eintr(|| s.read(&mut [0u8; 1])) {
            Ok(0) => true,
            Err(e) => {
                !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
            }
            Ok(_) => false,
        };
    assert!(ended(&mut client), "the client's idle connection was not closed");
    assert!(ended(&mut server), "the app's idle connection was not closed");
}

#[test]
fn a_connection_carrying_data_outlives_the_idle_timeout() {
    let (nodes, dst, listener) = idle_nodes("2");
    let mut client = nodes.connect_from_a(dst).expect("connect");
    client.write_all(b"0").expect("write");
    let (mut server, _) = listener.accept().expect("accept");
    server.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    // Six seconds of one byte every half second, one way only: three idle timeouts long.
    for i in 0..12u8 {
        let mut b = [0u8; 1];
        server.read_exact(&mut b).unwrap_or_else(|e| panic!("byte {i}: {e}"));
        std::thread::sleep(Duration::from_millis(500));
        client.write_all(&[b'a' + i]).unwrap_or_else(|e| panic!("write {i}: {e}"));
    }
    server.write_all(b"back").expect("app writes");
    let mut back = [0u8; 4];
    client.read_exact(&mut back).expect("the connection still carries data back");
    assert_eq!(&back, b"back");
}
