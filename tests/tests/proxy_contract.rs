//! The proxy contract is istio-cni's: the datapath serves a proxy that only opens sockets in
//! the pod's netns, as ztunnel does, with no help from it. Here the node's proxy is
//! `ztunnel-like` (tests/src/bin/ztunnel-like.rs): wildcard listeners in each pod from the
//! netns fd ZDS hands it, mark 0x539 on every socket, unbound upstream connects,
//! `IP_TRANSPARENT` + `IP_FREEBIND` connects to the app from the client's address, no map, pin,
//! rule or route. Pods are made through the real CNI chain and enrolled by the real agent.
//! IPv4 (the CNI chain here gives pods IPv4 only); meshpath-proxy's suites cover IPv6.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread::JoinHandle,
    time::Duration,
};

use meshpath_tests::cni_node::{CniNode, CniPod};

const WORKLOADS: &str = "workloads:\n\
- {uid: uid-web, name: web, namespace: default, serviceAccount: web, protocol: HBONE}\n\
- {uid: uid-db, name: db, namespace: default, serviceAccount: db, protocol: HBONE}\n";

/// A node whose proxy is ztunnel-like.
fn node() -> CniNode {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    node.start_agent().expect("agent");
    node.start_ztunnel_like().expect("ztunnel-like");
    node
}

/// An app in `pod` on `port` that answers one connection with what it reads, and reports the
/// address it was connected from.
fn app(pod: &CniPod, port: u16) -> JoinHandle<std::io::Result<SocketAddr>> {
    let listener = pod.netns.listen(SocketAddr::new(pod.ip, port)).expect("listen");
    std::thread::spawn(move || {
        let (mut c, peer) = listener.accept()?;
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf)?;
        c.write_all(&buf)?;
        Ok(peer)
    })
}

fn round_trip(mut c: TcpStream) -> Vec<u8> {
    c.write_all(b"hello").expect("send");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("echo");
    back.to_vec()
}

fn proxy_printed(node: &CniNode, prefix: &str) -> bool {
    let proxy = node.proxy.as_ref().expect("proxy");
    let seen = proxy.wait_for_line(prefix, Duration::from_secs(5));
    if !seen {
        eprintln!("ztunnel-like printed:\n{}", proxy.lines().join("\n"));
    }
    seen
}

#[test]
fn outbound_reaches_the_proxy_from_the_pods_address_and_leaves_from_it() {
    let node = node();
    let (legacy, web) =
        (node.add_pod("legacy").expect("legacy"), node.add_pod("web").expect("web"));
    let dst = SocketAddr::new(legacy.ip, 8080);
    let server = app(&legacy, 8080);
    let conn = web.connect(dst).expect("connect");
    assert_eq!(conn.local_addr().expect("getsockname").ip(), web.ip, "the app's own address");
    assert_eq!(round_trip(conn), b"hello");
    // The proxy saw the app at the pod's address (as under REDIRECT), and its unbound, marked
    // passthrough left the pod normally from the pod's address.
    assert!(proxy_printed(&node, &format!("OUTBOUND {dst} FROM {}:", web.ip)));
    assert_eq!(server.join().expect("app").expect("app io").ip(), web.ip);
}

#[test]
fn inbound_plaintext_reaches_the_app_with_the_clients_address() {
    let node = node();
    let (db, legacy) = (node.add_pod("db").expect("db"), node.add_pod("legacy").expect("legacy"));
    let dst = SocketAddr::new(db.ip, 8081);
    let server = app(&db, 8081);
    // legacy is outside the mesh: its connection is steered to the proxy's 15006 in db, which
    // connects to the app transparently from legacy's address.
    assert_eq!(round_trip(legacy.connect(dst).expect("connect")), b"hello");
    assert!(proxy_printed(&node, &format!("INBOUND {dst} FROM {}:", legacy.ip)));
    assert_eq!(server.join().expect("app").expect("app io").ip(), legacy.ip, "client address");
}

#[test]
fn the_proxys_marked_hbone_listener_answers_clients_outside_the_pod() {
    // Its SYN-ACKs carry 0x539: they must route out of the pod, not to the local table.
    let node = node();
    let (db, legacy) = (node.add_pod("db").expect("db"), node.add_pod("legacy").expect("legacy"));
    let conn = legacy.connect(SocketAddr::new(db.ip, 15008)).expect("connect to 15008");
    assert_eq!(round_trip(conn), b"hello");
    assert!(proxy_printed(&node, &format!("HBONE FROM {}:", legacy.ip)));
}

#[test]
fn dns_goes_to_the_proxys_dns_listener() {
    let node = node();
    let web = node.add_pod("web").expect("web");
    // A resolver address with nothing behind it: only the proxy can answer.
    let server: SocketAddr = "10.96.0.10:53".parse().expect("addr");
    let (from, answer) = web
        .netns
        .open()
        .expect("netns")
        .run(move || -> std::io::Result<(SocketAddr, Vec<u8>)> {
            let udp = UdpSocket::bind("0.0.0.0:0")?;
            udp.set_read_timeout(Some(Duration::from_secs(5)))?;
            udp.send_to(b"query", server)?;
            let mut buf = [0u8; 64];
            let (n, from) = udp.recv_from(&mut buf)?;
            Ok((from, buf[..n].to_vec()))
        })
        .expect("run")
        .expect("dns");
    assert_eq!(answer, b"ANSWER query");
    assert_eq!(from, server, "the reply must look like the server's");
}

#[test]
fn without_the_proxy_inbound_is_refused_and_the_app_sees_nothing() {
    let mut node = node();
    let (db, legacy) = (node.add_pod("db").expect("db"), node.add_pod("legacy").expect("legacy"));
    let dst = SocketAddr::new(db.ip, 8082);
    // Through the proxy first: the path works.
    let server = app(&db, 8082);
    assert_eq!(round_trip(legacy.connect(dst).expect("connect")), b"hello");
    server.join().expect("app").expect("app io");
    // A real app behind the port, which must see nothing once the proxy is gone.
    let listener: TcpListener = db.netns.listen(dst).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    node.proxy = None;
    let refused = legacy.connect(dst);
    assert!(refused.is_err(), "a connection went around the stopped proxy");
    assert!(listener.accept().is_err(), "the app was reached without the proxy");
}
