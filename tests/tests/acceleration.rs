//! The same-node app↔proxy shortcut (sockops + sk_msg): with it on, captured traffic still
//! arrives through the proxy, both ends of the hop are paired in LOCAL_SOCKS, capture still
//! fails closed, and turning it off stops pairing new connections.
//!
//! Not covered, because the kernel gets them wrong on 6.1, 6.12 and 6.18, which is why the
//! shortcut is off on every kernel (docs/datapath.md, "the sockops + sk_msg shortcut"): a
//! blocking read ending in EAGAIN after the socket's own shutdown(SHUT_WR), and a sender to a
//! proxy that forwards slower than it writes, which the kernel queues without bound until the
//! node's TCP memory runs out (ENOMEM).

use std::io::{Read as _, Write as _};

use meshpath_loader::pods::EnrolOptions;
use meshpath_tests::{read_line, Mesh, Sentinel};

fn accelerated() -> Mesh {
    let mesh = Mesh::new(EnrolOptions { capture_outbound: true, ..EnrolOptions::default() });
    mesh.datapath().set_acceleration(true).expect("turn the shortcut on");
    mesh
}

fn paired(mesh: &Mesh) -> usize {
    mesh.datapath().local_socks().expect("LOCAL_SOCKS").keys().flatten().count()
}

/// Bulk data through the shortcut, both ends paired while the connection is open.
#[test]
fn both_ends_of_the_hop_are_paired_while_a_connection_is_open() {
    let mut mesh = accelerated();
    mesh.start_proxy("forward");
    let dst = mesh.b(false, 8100);
    let _server = mesh.echo_server_in_b(dst);
    let mut conn = mesh.connect_from_a(dst, None).expect("connect");
    conn.write_all(&[9u8; 1000]).expect("send");
    let mut back = [0u8; 1000];
    conn.read_exact(&mut back).expect("echo through the shortcut");
    assert_eq!(back, [9u8; 1000]);
    assert!(paired(&mesh) >= 2, "{} sockets paired", paired(&mesh));
}

#[test]
fn the_original_destination_is_still_reported_with_the_shortcut_on() {
    let mut mesh = accelerated();
    mesh.start_proxy("echo");
    let dst = mesh.b(false, 8101);
    let conn = mesh.connect_from_a(dst, None).expect("connect");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
}

#[test]
fn capture_still_fails_closed_with_the_shortcut_on() {
    let mesh = accelerated();
    let sentinel = Sentinel::new(&mesh.pods.b, mesh.b(false, 8102));
    assert!(mesh.connect_from_a(mesh.b(false, 8102), None).is_err());
    sentinel.assert_untouched("with the shortcut on and no proxy");
}

#[test]
fn turning_the_shortcut_off_stops_pairing_new_connections() {
    let mut mesh = accelerated();
    mesh.start_proxy("echo");
    mesh.datapath().set_acceleration(false).expect("off");
    assert!(!mesh.datapath().acceleration().expect("flag"));
    let dst = mesh.b(false, 8103);
    let conn = mesh.connect_from_a(dst, None).expect("connect");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    assert_eq!(paired(&mesh), 0);
}
