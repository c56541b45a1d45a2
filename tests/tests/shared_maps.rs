//! The node-wide per-connection map (`ORIG_DST_BY_CONN`, a hash of `MAX_TRACKED_CONNECTIONS`
//! entries from which nothing is evicted) shared by every pod:
//!
//! - under one pod's flood of more captured connections than the map holds, it stays nearly
//!   empty (each entry leaves when the proxy's end of its connection is established, one
//!   loopback handshake after it is written), and another pod's long-lived connection, and its
//!   new connections meanwhile, keep working;
//! - a pod whose connections' proxy ends do not come holds at most its share of it
//!   (`MAX_PENDING_CONNECTIONS_PER_POD`): past that its connects are refused and counted,
//!   another pod's are not, and the entries go when the app's ends close.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::Duration,
};

use std::os::fd::AsRawFd as _;

use datapath_common::consts::{ports, MAX_PENDING_CONNECTIONS_PER_POD, MAX_TRACKED_CONNECTIONS};
use meshpath_loader::{
    decisions,
    pods::{self, EnrolOptions},
};
use meshpath_tests::{raise_open_files, read_line, sibling_bin, Mesh, TestProxy};

/// Connections the flooding pod opens: more than the map holds.
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

/// Pod a's entries in `ORIG_DST_BY_CONN`, by the map and by the pod's count.
fn pending_of_a(mesh: &Mesh) -> (usize, u64) {
    let cookie = mesh.pods.a.open().expect("netns a").cookie();
    let dp = mesh.datapath();
    let in_map =
        dp.orig_dst_by_conn().expect("map").keys().flatten().filter(|k| k.netns == cookie).count();
    let counted = dp.pending_connections().expect("counts").get(&cookie, 0).expect("a's count");
    (in_map, counted)
}

/// How often the datapath refused pod a's connections for its share.
fn refused_for_share(mesh: &Mesh) -> u64 {
    let cookie = mesh.pods.a.open().expect("netns a").cookie();
    decisions::of(&mesh.datapath(), cookie)
        .expect("decisions")
        .iter()
        .find(|d| d.why == "pod's share of pending connections")
        .map_or(0, |d| d.count)
}

#[test]
fn a_pod_holding_its_share_of_pending_connections_is_refused_and_another_pod_is_not() {
    let mesh = Mesh::capturing();
    let _proxy_b = mesh_pod_b(&mesh);
    let echo = mesh.a(false, 9100);
    echo_server(&mesh, echo);
    // Pod a's proxy listener defers every connection until data comes (TCP_DEFER_ACCEPT): its
    // end of a connection is not established while the app sends nothing, as when an
    // overflowing accept queue drops the handshake's last ACK, so each app connection holds
    // its entry. Its queue is longer than the share, so that none falls back on a syncookie.
    let ns_a = mesh.pods.a.open().expect("netns a");
    ns_a.run(|| std::fs::write("/proc/sys/net/core/somaxconn", "16384"))
        .expect("enter netns a")
        .expect("somaxconn in pod a");
    let proxy_a = mesh
        .pods
        .a
        .listen_in_cgroup(mesh.a(false, ports::OUTBOUND), &mesh.cgroup)
        .expect("pod a's proxy listener");
    let defer_secs: libc::c_int = 60;
    // SAFETY: a valid socket and an int option of the size given.
    let rc = unsafe {
        libc::setsockopt(
            proxy_a.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            std::ptr::from_ref(&defer_secs).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "TCP_DEFER_ACCEPT: {}", std::io::Error::last_os_error());
    socket2::SockRef::from(&proxy_a).listen(16384).expect("a longer queue");

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
    assert_eq!(pending_of_a(&mesh), (share / 2, (share / 2) as u64), "half closed");
    let again = mesh.connect_from_a(dst, None).expect("pod a connects again below its share");
    held.push(again);
    drop(held);
    assert_eq!(pending_of_a(&mesh), (0, 0), "every app end closed");
}
