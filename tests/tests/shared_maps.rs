//! The node-wide per-connection map (`ORIG_DST_BY_CONN`, an LRU of
//! `MAX_TRACKED_CONNECTIONS` entries) under one pod's flood: a pod opening more captured
//! connections than the map holds leaves it nearly empty (each entry leaves when the proxy's end
//! of its connection is established, one loopback handshake after it is written), and another
//! pod's long-lived connection, and its new connections meanwhile, keep working.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::Duration,
};

use datapath_common::consts::MAX_TRACKED_CONNECTIONS;
use meshpath_loader::pods::{self, EnrolOptions};
use meshpath_tests::{read_line, sibling_bin, Mesh, TestProxy};

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

#[test]
fn one_pods_flood_of_connections_leaves_the_map_empty_and_another_pods_connections_working() {
    // Pod a floods: its proxy answers every connection itself with its original destination.
    let mut mesh = Mesh::capturing();
    mesh.start_proxy("echo");
    // Pod b is in the mesh too, with its own proxy forwarding to pod a's echo server.
    pods::enrol(
        &mesh.datapath(),
        &mesh.pods.b.open().expect("netns b"),
        &EnrolOptions { capture_outbound: true, ..EnrolOptions::default() },
    )
    .expect("enrol b");
    let _proxy_b = TestProxy::start(
        &sibling_bin("meshpath-test-proxy"),
        &mesh.pods.b.path(),
        &mesh.cgroup,
        "forward",
        false,
        &[],
    )
    .expect("pod b's proxy");
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
