//! The node-wide per-connection map (`ORIG_DST_BY_CONN`, a hash of `ORIG_DST_BY_CONN_ENTRIES`
//! entries from which nothing is evicted) shared by every pod:
//!
//! - under one pod's flood of more captured connections than 16 pods' shares (what the map
//!   held in meshpath 0.1.0), it stays nearly
//!   empty (each entry leaves when the proxy's end of its connection is established, one
//!   loopback handshake after it is written), and another pod's long-lived connection, and its
//!   new connections meanwhile, keep working;
//! - a pod whose connections' proxy ends do not come holds at most its share of it
//!   (`MAX_PENDING_CONNECTIONS_PER_POD`): past that its connects are refused and counted,
//!   another pod's are not, and the entries go when the app's ends close.
//!
//! And the one for the proxy's transparent connects to the apps (`PROXY_TRANSPARENT`, a hash
//! of as many): a pod whose app accepts none of them holds at most its share, past which the
//! proxy's next one to it is refused and counted, while one to another pod's app, over IPv4
//! and IPv6, goes through, is accepted, leaves no entry behind and carries data both ways; and
//! a pod that takes another pod's address cannot take that pod's entries.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::Duration,
};

use datapath_common::consts::{ports, MAX_PENDING_CONNECTIONS_PER_POD, MAX_TRACKED_CONNECTIONS};
use meshpath_loader::{
    decisions,
    pods::{self, EnrolOptions},
};
use meshpath_tests::{raise_open_files, read_line, sibling_bin, Mesh, NetnsGuard, TestProxy};

/// Connections the flooding pod opens: more than 16 pods' shares.
const FLOOD: usize = MAX_TRACKED_CONNECTIONS as usize + 4_464;
/// Destination ports the flood cycles through, so that its source ports never run out.
const FLOOD_PORTS: u16 = 8;
/// Threads opening the flood's connections.
const FLOODERS: usize = 4;

/// An echo server in pod a at `addr` for any number of connections, until the test ends.
fn echo_server(mesh: &Mesh, addr: SocketAddr) {
    let listener = mesh.pods.a.listen(addr).expect("echo listener in a");
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let (mut r, mut w) = (conn.try_clone().expect("clone"), conn);
                let _ = std::io::copy(&mut r, &mut w);
            });
        }
    });
}

/// One echo round trip of `n` bytes on `conn`.
fn echoes(conn: &mut TcpStream, n: usize) -> bool {
    let sent = vec![7u8; n];
    let mut back = vec![0u8; n];
    conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    conn.write_all(&sent).is_ok() && conn.read_exact(&mut back).is_ok() && back == sent
}

/// Enrols pod b with outbound capture and starts its own proxy, forwarding each connection
/// to its original destination.
fn mesh_pod_b(mesh: &Mesh) -> TestProxy {
    pods::enrol(
        &mesh.datapath(),
        &mesh.pods.b.open().expect("netns b"),
        &EnrolOptions { capture_outbound: true, ..EnrolOptions::default() },
    )
    .expect("enrol b");
    TestProxy::start(
        &sibling_bin("meshpath-test-proxy"),
        &mesh.pods.b.path(),
        &mesh.cgroup,
        "forward",
        false,
        &[],
    )
    .expect("pod b's proxy")
}

#[test]
fn one_pods_flood_of_connections_leaves_the_map_empty_and_another_pods_connections_working() {
    // Pod a floods: its proxy answers every connection itself with its original destination.
    let mut mesh = Mesh::capturing();
    mesh.start_proxy("echo");
    // Pod b is in the mesh too, with its own proxy forwarding to pod a's echo server.
    let _proxy_b = mesh_pod_b(&mesh);
    let echo = mesh.a(false, 9100);
    echo_server(&mesh, echo);
    let mut long_lived = mesh.connect_from_b(echo, None).expect("pod b's long-lived connection");
    assert!(echoes(&mut long_lived, 1000), "before the flood");

    let (done, opened, wrong) = (AtomicBool::new(false), AtomicUsize::new(0), AtomicUsize::new(0));
    let (mut b_new, mut b_failed) = (0usize, Vec::new());
    let ns_a = mesh.pods.a.open().expect("netns a");
    std::thread::scope(|s| {
        for t in 0..FLOODERS {
            let (ns_a, opened, wrong, mesh) = (&ns_a, &opened, &wrong, &mesh);
            s.spawn(move || {
                ns_a.run(|| {
                    for i in (t..FLOOD).step_by(FLOODERS) {
                        let port = 20_000 + (i % usize::from(FLOOD_PORTS)) as u16;
                        let dst = mesh.b(false, port);
                        let conn = TcpStream::connect(dst).expect("a flood connection");
                        if read_line(&conn) != format!("ORIG_DST {dst}") {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                        // A reset, not a FIN: no TIME_WAIT left on either end.
                        socket2::SockRef::from(&conn).set_linger(Some(Duration::ZERO)).ok();
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .expect("enter netns a");
            });
        }
        let (done, opened) = (&done, &opened);
        s.spawn(move || {
            while opened.load(Ordering::Relaxed) < FLOOD {
                std::thread::sleep(Duration::from_millis(200));
            }
            done.store(true, Ordering::Relaxed);
        });
        // Meanwhile pod b keeps making new connections; each needs its original destination.
        while !done.load(Ordering::Relaxed) {
            b_new += 1;
            match mesh.connect_from_b(echo, None) {
                Ok(mut c) => {
                    if !echoes(&mut c, 100) {
                        b_failed.push(format!("connection {b_new}: no echo"));
                    }
                }
                Err(e) => b_failed.push(format!("connection {b_new}: {e}")),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });

    assert_eq!(opened.load(Ordering::Relaxed), FLOOD);
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "flood connections with a wrong original destination"
    );
    assert!(b_new >= 10, "pod b made only {b_new} connections during the flood");
    assert!(b_failed.is_empty(), "pod b's new connections failed during the flood: {b_failed:?}");
    assert!(echoes(&mut long_lived, 1000), "pod b's long-lived connection after the flood");
    let left = mesh.datapath().orig_dst_by_conn().expect("map").keys().count();
    assert!(left < 100, "{left} of the flood's {FLOOD} entries are still in ORIG_DST_BY_CONN");
}

/// What `read` gives once it gives `want` (10 s at most), else its last answer: entries leave
/// at a close, but a close can come late (a child process another test forks holds a copy of
/// every socket for a moment; a FIN is handled after `close()` returns), and a map's keys
/// may repeat in a walk while it changes.
fn settled<T: PartialEq + Copy>(read: impl Fn() -> T, want: T) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = read();
        if got == want || std::time::Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pod a's entries in `ORIG_DST_BY_CONN`, by the map and by the pod's count.
fn pending_of_a(mesh: &Mesh) -> (usize, u64) {
    let cookie = mesh.pods.a.open().expect("netns a").cookie();
    let dp = mesh.datapath();
    let in_map =
        dp.orig_dst_by_conn().expect("map").keys().flatten().filter(|k| k.netns == cookie).count();
    let counted = dp.pending_connections().expect("counts").get(&cookie, 0).expect("a's count");
    (in_map, counted)
}

/// How often the datapath counted a decision for `why` in `pod`.
fn counted(mesh: &Mesh, pod: &NetnsGuard, why: &str) -> u64 {
    let cookie = pod.open().expect("the pod's netns").cookie();
    decisions::of(&mesh.datapath(), cookie)
        .expect("decisions")
        .iter()
        .find(|d| d.why == why)
        .map_or(0, |d| d.count)
}

/// How often the datapath refused pod a's connections for its share.
fn refused_for_share(mesh: &Mesh) -> u64 {
    counted(mesh, &mesh.pods.a, "pod's share of pending connections")
}

#[test]
fn a_pod_holding_its_share_of_pending_connections_is_refused_and_another_pod_is_not() {
    let mesh = Mesh::capturing();
    let _proxy_b = mesh_pod_b(&mesh);
    let echo = mesh.a(false, 9100);
    echo_server(&mesh, echo);
    // Pod a's proxy listener defers every connection until data comes: its end of a connection
    // is not established while the app sends nothing, so each app connection holds its entry.
    let _proxy_a = mesh
        .pods
        .a
        .deferring_listener(mesh.a(false, ports::OUTBOUND), Some(&mesh.cgroup), 16384)
        .expect("pod a's proxy listener");

    let share = MAX_PENDING_CONNECTIONS_PER_POD as usize;
    // The app's ends of the share, and as many again for the proxy's and pod b's.
    raise_open_files(2 * share as u64 + 1024);
    let dst = mesh.b(false, 8080);
    let mut held = Vec::with_capacity(share);
    for i in 0..share {
        held.push(mesh.connect_from_a(dst, None).unwrap_or_else(|e| panic!("connection {i}: {e}")));
    }
    assert_eq!(pending_of_a(&mesh), (share, share as u64), "pod a's share, filled");

    // Past its share: refused at connect, and counted.
    let refused = mesh.connect_from_a(dst, None).expect_err("a connection past the share");
    assert_eq!(refused.kind(), std::io::ErrorKind::PermissionDenied, "{refused}");
    assert_eq!(refused_for_share(&mesh), 1);
    // Pod b's connections still have room.
    for i in 0..10 {
        let mut c = mesh.connect_from_b(echo, None).unwrap_or_else(|e| panic!("b's {i}: {e}"));
        assert!(echoes(&mut c, 100), "pod b's connection {i} echoes");
    }

    // The app's ends closing take their entries: room again for pod a.
    for conn in held.drain(..share / 2) {
        socket2::SockRef::from(&conn).set_linger(Some(Duration::ZERO)).ok();
    }
    let half = (share / 2, (share / 2) as u64);
    assert_eq!(settled(|| pending_of_a(&mesh), half), half, "half closed");
    let again = mesh.connect_from_a(dst, None).expect("pod a connects again below its share");
    held.push(again);
    // Closed with a FIN: each entry goes when the FIN has reached the proxy's listener (which
    // then establishes its end and takes it), not within the close.
    drop(held);
    assert_eq!(settled(|| pending_of_a(&mesh), (0, 0)), (0, 0), "every app end closed");
}

/// A pod's entries in `PROXY_TRANSPARENT` (those to its address `ip`), by the map and by the
/// pod's count (over both families).
fn transparent_of(mesh: &Mesh, pod: &NetnsGuard, ip: impl Into<IpAddr>) -> (usize, u64) {
    let cookie = pod.open().expect("netns").cookie();
    let dp = mesh.datapath();
    let local = meshpath_loader::pods::ip_key(ip.into()).addr;
    let in_map =
        dp.proxy_transparent().expect("map").keys().flatten().filter(|k| k.local == local).count();
    let counted = dp.pending_transparent().expect("counts").get(&cookie, 0).expect("the count");
    (in_map, counted)
}

#[test]
fn a_pod_holding_its_share_of_unaccepted_transparent_connects_is_refused_more_and_another_pod_is_not(
) {
    let mesh = Mesh::new(EnrolOptions { capture_inbound: true, ..EnrolOptions::default() });
    pods::enrol(
        &mesh.datapath(),
        &mesh.pods.b.open().expect("netns b"),
        &EnrolOptions { capture_inbound: true, ..EnrolOptions::default() },
    )
    .expect("enrol b");
    let a_ip = mesh.pods.a_ip;
    // Pod a's app defers every connection until data comes: its end of the proxy's connection
    // is not accepted while the proxy sends nothing, so each holds its entry.
    let _app_a = mesh.pods.a.deferring_listener(mesh.a(false, 8080), None, 16384).expect("app a");
    // What a proxy opens to reach an app: inside the pod, from a client's address, bound from
    // the proxy's cgroup.
    let client = SocketAddr::new(IpAddr::from([10, 199, 0, 2]), 0);
    let share = MAX_PENDING_CONNECTIONS_PER_POD as usize;
    raise_open_files(share as u64 + 1024);
    let mut held = mesh
        .pods
        .a
        .transparent_connects(client, mesh.a(false, 8080), share, Some(&mesh.cgroup))
        .expect("the proxy's transparent connects to pod a's app");
    assert_eq!(transparent_of(&mesh, &mesh.pods.a, a_ip), (share, share as u64), "a's share");

    // Past its share: the proxy's next connect to pod a is refused, and counted.
    let refused = mesh
        .pods
        .a
        .transparent_connect(client, mesh.a(false, 8080), Some(&mesh.cgroup))
        .expect_err("a transparent connect past the share");
    let kind = refused.downcast_ref::<std::io::Error>().map(std::io::Error::kind);
    assert_eq!(kind, Some(std::io::ErrorKind::PermissionDenied), "{refused:#}");
    let refusals = counted(&mesh, &mesh.pods.a, "pod's share of pending transparent connections");
    assert_eq!(refusals, 1, "the refusal was not counted");

    // Pod b's app gets the proxy's connections, over either family.
    proxy_connection_to_b_is_accepted_and_leaves_no_entry(&mesh, false);
    proxy_connection_to_b_is_accepted_and_leaves_no_entry(&mesh, true);

    // The proxy's ends closing before the app accepted them take their entries: room again.
    for conn in held.drain(..share / 2) {
        conn.set_linger(Some(Duration::ZERO)).ok();
    }
    let half = (share / 2, (share / 2) as u64);
    assert_eq!(settled(|| transparent_of(&mesh, &mesh.pods.a, a_ip), half), half, "half closed");
    held.push(
        mesh.pods
            .a
            .transparent_connect(client, mesh.a(false, 8080), Some(&mesh.cgroup))
            .expect("a transparent connect below the share again"),
    );
    for conn in held.drain(..) {
        conn.set_linger(Some(Duration::ZERO)).ok();
    }
    let none = settled(|| transparent_of(&mesh, &mesh.pods.a, a_ip), (0, 0));
    assert_eq!(none, (0, 0), "every proxy end closed");
}

/// The proxy's transparent connection to pod b's app (from pod a's address: pod b's own is not a
/// transparent source there), over IPv6 when `v6`: filed (the app gets it by its entry),
/// accepted, its entry gone at once, data both ways afterwards (every segment finds the
/// accepted socket), and nothing counted twice when both ends close.
fn proxy_connection_to_b_is_accepted_and_leaves_no_entry(mesh: &Mesh, v6: bool) {
    let family = if v6 { "IPv6" } else { "IPv4" };
    let client = SocketAddr::new(mesh.a(v6, 0).ip(), 0);
    let app = mesh.pods.b.listen(mesh.b(v6, 8081)).expect("app b");
    let conn = mesh
        .pods
        .b
        .transparent_connect(client, mesh.b(v6, 8081), Some(&mesh.cgroup))
        .expect("the proxy's connection to pod b's app");
    let (mut accepted, from) = accept_within(&app, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{family}: pod b's app did not accept it: {e}"));
    assert_eq!(from.ip(), client.ip());
    let passed = counted(mesh, &mesh.pods.b, "proxy connection");
    assert_eq!(passed, 1 + u64::from(v6), "{family}: pod b's app got it by its entry");
    let b = mesh.b(v6, 0).ip();
    assert_eq!(transparent_of(mesh, &mesh.pods.b, b), (0, 0), "{family}: once accepted");
    conn.set_nonblocking(false).expect("blocking");
    let mut conn = TcpStream::from(conn);
    accepted.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    for round in 0..3 {
        conn.write_all(b"ping").expect("proxy → app");
        let mut got = [0u8; 4];
        accepted.read_exact(&mut got).unwrap_or_else(|e| panic!("{family} {round}, app: {e}"));
        accepted.write_all(b"pong").expect("app → proxy");
        assert!(echoes_back(&mut conn, b"pong"), "{family} round {round}: the app's reply");
    }
    drop((conn, accepted));
    let left = settled(|| transparent_of(mesh, &mesh.pods.b, b), (0, 0));
    assert_eq!(left, (0, 0), "{family}: both ends closed");
}

/// `listener.accept()`, waiting `within` at most.
fn accept_within(
    listener: &std::net::TcpListener,
    within: Duration,
) -> std::io::Result<(TcpStream, SocketAddr)> {
    listener.set_nonblocking(true)?;
    let deadline = std::time::Instant::now() + within;
    loop {
        match listener.accept() {
            Ok((conn, from)) => {
                conn.set_nonblocking(false)?;
                return Ok((conn, from));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() > deadline {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Reads `want.len()` bytes from `conn` (5 s at most) and tells whether they are `want`.
fn echoes_back(conn: &mut TcpStream, want: &[u8]) -> bool {
    let mut got = vec![0u8; want.len()];
    conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    conn.read_exact(&mut got).is_ok() && got == want
}

#[test]
fn a_pod_accepting_connections_at_another_pods_address_takes_none_of_its_entries() {
    // Pod a is in the mesh with nothing captured; pod b is captured inbound.
    let mesh = Mesh::new(EnrolOptions::default());
    pods::enrol(
        &mesh.datapath(),
        &mesh.pods.b.open().expect("netns b"),
        &EnrolOptions { capture_inbound: true, ..EnrolOptions::default() },
    )
    .expect("enrol b");
    let b_app = mesh.b(false, 8082);
    let _app_b = mesh.pods.b.deferring_listener(b_app, None, 128).expect("app b");
    // The proxy's connection to pod b's app, not accepted yet: pod b's entry.
    let outside: IpAddr = "10.199.0.77".parse().expect("ip");
    let held = mesh
        .pods
        .b
        .transparent_connect(SocketAddr::new(outside, 0), b_app, Some(&mesh.cgroup))
        .expect("the proxy's connection to pod b's app");
    let from = held.local_addr().expect("bound").as_socket().expect("inet");
    assert_eq!(transparent_of(&mesh, &mesh.pods.b, b_app.ip()), (1, 1), "pod b's entry");

    // Pod a (CAP_NET_ADMIN in its netns) puts pod b's address and the client's on its own
    // loopback and accepts a connection of exactly that 4-tuple.
    for addr in [format!("{}/32", b_app.ip()), format!("{outside}/32")] {
        mesh.pods.a.ip(&["addr", "add", &addr, "dev", "lo"]).expect("address on pod a");
    }
    let listener = mesh.pods.a.listen(b_app).expect("pod a listening at pod b's address");
    let _twin = mesh
        .pods
        .a
        .transparent_connect(from, b_app, None)
        .expect("pod a's connection of pod b's 4-tuple");
    let (_accepted, peer) =
        accept_within(&listener, Duration::from_secs(5)).expect("pod a accepted it");
    assert_eq!(peer, from);

    assert_eq!(
        transparent_of(&mesh, &mesh.pods.b, b_app.ip()),
        (1, 1),
        "pod a's accepted connection took pod b's entry"
    );
    held.set_linger(Some(Duration::ZERO)).ok();
    drop(held);
    let left = settled(|| transparent_of(&mesh, &mesh.pods.b, b_app.ip()), (0, 0));
    assert_eq!(left, (0, 0), "pod b's proxy end closed");
}
