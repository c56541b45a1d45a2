//! The proxy caps the connections it carries, per pod and node-wide: one beyond the cap is
//! closed at once (before a buffer or a task is spent on it) and counted; the connections
//! within the cap are untouched, and a slot freed is usable again.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use meshpath_tests::two_nodes::{Setup, TwoNodes};

fn round_trip(c: &mut TcpStream, byte: u8) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(&[byte; 3])?;
    let mut back = [0u8; 3];
    c.read_exact(&mut back)?;
    assert_eq!(back, [byte; 3]);
    Ok(())
}

#[test]
fn a_connection_over_the_pods_cap_is_closed_and_counted_and_a_freed_slot_serves_again() {
    let nodes = TwoNodes::start(Setup {
        args: vec!["--max-connections-per-pod".into(), "3".into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8120);
    // The app behind: counts every connection that reaches it.
    let reached = Arc::new(AtomicUsize::new(0));
    let listener = nodes.pods.b.listen(dst).expect("bind");
    let seen = reached.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            seen.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut conn = conn;
                let mut buf = [0u8; 64];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
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
