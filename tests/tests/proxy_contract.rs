//! The proxy contract is istio-cni's: the datapath serves a proxy that only opens sockets in
//! the pod's netns, as ztunnel does, with no help from it. Each behaviour runs twice: with
//! `ztunnel-like` (tests/src/bin/ztunnel-like.rs: wildcard listeners in each pod from the netns
//! fd ZDS hands it, mark 0x539 on every socket, unbound upstream connects, `IP_TRANSPARENT` +
//! `IP_FREEBIND` connects to the app from the client's address, no map, pin, rule or route) and
//! with meshpath-proxy. Pods are made through the real CNI chain and enrolled by the real agent.
//! Pods are dual-stack; the paths run over IPv4 and IPv6.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread::JoinHandle,
    time::Duration,
};

use meshpath_proxy::identity::{Identity, LocalCa};
use meshpath_tests::cni_node::{CniNode, CniPod, ProxyKind as Proxy};

const WORKLOADS: &str = "workloads:\n\
- {uid: uid-web, name: web, namespace: default, serviceAccount: web, protocol: HBONE}\n\
- {uid: uid-db, name: db, namespace: default, serviceAccount: db, protocol: HBONE}\n";

/// A dual-stack node whose proxy is `proxy`.
fn node(proxy: Proxy) -> CniNode {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    node.dual_stack = true;
    node.start_agent().expect("agent");
    match proxy {
        // Two pods of one node over HBONE, as ztunnel carries them (the contract's path; the
        // node-local path is node_local.rs's).
        Proxy::Meshpath => node.start_proxy_with(&["--node-local-hbone"]),
        Proxy::ZtunnelLike => node.start_node_proxy(proxy),
    }
    .expect("the node proxy");
    node
}

/// The workloads file learns db's address (as a control plane would); meshpath-proxy reloads
/// it, ztunnel-like reads it per connection.
fn publish_db_address(node: &CniNode, proxy: Proxy, db: &CniPod) {
    let known = WORKLOADS.replace(
        "serviceAccount: db, protocol: HBONE}",
        &format!(
            "serviceAccount: db, protocol: HBONE, workloadIps: [{}, {}]}}",
            db.ip,
            ip(db, true)
        ),
    );
    std::fs::write(node.dir.join("workloads.yaml"), known).expect("workloads");
    if proxy == Proxy::Meshpath {
        let p = node.proxy.as_ref().expect("proxy");
        assert!(p.wait_for_text("workload store reloaded", Duration::from_secs(10)));
    }
}

/// An address as it prints before `:PORT` (IPv6 in brackets).
fn host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    }
}

/// The pod's address of the family.
fn ip(pod: &CniPod, v6: bool) -> IpAddr {
    if v6 {
        pod.ip6.expect("the pod has an IPv6 address")
    } else {
        pod.ip
    }
}

/// An app in `pod` on `dst` that answers one connection with what it reads, and reports the
/// address it was connected from (v4-mapped addresses as IPv4).
fn app(pod: &CniPod, dst: SocketAddr) -> JoinHandle<std::io::Result<IpAddr>> {
    let listener = pod.netns.listen(dst).expect("listen");
    std::thread::spawn(move || echo_once(&listener))
}

/// Accepts one connection on `listener`, echoes five bytes: the client's address.
fn echo_once(listener: &TcpListener) -> std::io::Result<IpAddr> {
    let (mut c, peer) = listener.accept()?;
    let mut buf = [0u8; 5];
    c.read_exact(&mut buf)?;
    c.write_all(&buf)?;
    Ok(peer.ip())
}

fn round_trip(mut c: TcpStream) -> Vec<u8> {
    c.write_all(b"hello").expect("send");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("echo");
    back.to_vec()
}

/// Evidence that the proxy carried a connection: ztunnel-like prints a line starting with
/// `line`; meshpath-proxy counts it under `labels`.
fn carried(node: &CniNode, proxy: Proxy, line: &str, labels: &[(&str, &str)]) -> bool {
    let p = node.proxy.as_ref().expect("proxy");
    let seen = match proxy {
        Proxy::ZtunnelLike => p.wait_for_line(line, Duration::from_secs(5)),
        Proxy::Meshpath => (0..50).any(|_| {
            let n = node.proxy_metric("istio_tcp_connections_opened_total", labels);
            n.is_ok_and(|n| n >= 1.0) || {
                std::thread::sleep(Duration::from_millis(100));
                false
            }
        }),
    };
    if !seen {
        eprintln!("the proxy printed:\n{}", p.lines().join("\n"));
    }
    seen
}

fn outbound_passthrough_leaves_from_the_pods_address(proxy: Proxy, v6: bool) {
    let node = node(proxy);
    let (legacy, web) =
        (node.add_pod("legacy").expect("legacy"), node.add_pod("web").expect("web"));
    let (dst, me) = (SocketAddr::new(ip(&legacy, v6), 8080), ip(&web, v6));
    let server = app(&legacy, dst);
    let conn = web.connect(dst).expect("connect");
    assert_eq!(conn.local_addr().expect("getsockname").ip(), me, "the app's own address");
    assert_eq!(round_trip(conn), b"hello");
    // The proxy saw the app at the pod's address (as under REDIRECT), and its unbound, marked
    // passthrough left the pod normally, from the pod's address.
    let line = format!("OUTBOUND {dst} FROM {}:", host(me));
    assert!(carried(&node, proxy, &line, &[("reporter", "source")]), "not through the proxy");
    assert_eq!(server.join().expect("app").expect("app io"), me);
}

#[test]
fn outbound_passthrough_leaves_from_the_pods_address_ztunnel_like_v4() {
    outbound_passthrough_leaves_from_the_pods_address(Proxy::ZtunnelLike, false);
}

#[test]
fn outbound_passthrough_leaves_from_the_pods_address_ztunnel_like_v6() {
    outbound_passthrough_leaves_from_the_pods_address(Proxy::ZtunnelLike, true);
}

#[test]
fn outbound_passthrough_leaves_from_the_pods_address_meshpath_proxy_v4() {
    outbound_passthrough_leaves_from_the_pods_address(Proxy::Meshpath, false);
}

#[test]
fn outbound_passthrough_leaves_from_the_pods_address_meshpath_proxy_v6() {
    outbound_passthrough_leaves_from_the_pods_address(Proxy::Meshpath, true);
}

fn outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address(proxy: Proxy, v6: bool) {
    let node = node(proxy);
    let (db, web) = (node.add_pod("db").expect("db"), node.add_pod("web").expect("web"));
    publish_db_address(&node, proxy, &db);
    let (dst, me) = (SocketAddr::new(ip(&db, v6), 8083), ip(&web, v6));
    let server = app(&db, dst);
    assert_eq!(round_trip(web.connect(dst).expect("connect")), b"hello");
    // Out of web over HBONE (its marked, unbound connection to db:15008 leaves the pod), into
    // db through the marked 15008 listener, to the app from web's address.
    let line = format!("HBONE {dst} FROM {}:", host(me));
    let labels = [("reporter", "destination"), ("connection_security_policy", "mutual_tls")];
    assert!(carried(&node, proxy, &line, &labels), "not over HBONE");
    assert_eq!(server.join().expect("app").expect("app io"), me, "client address");
}

#[test]
fn outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address_ztunnel_like_v4() {
    outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address(
        Proxy::ZtunnelLike,
        false,
    );
}

#[test]
fn outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address_ztunnel_like_v6() {
    outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address(
        Proxy::ZtunnelLike,
        true,
    );
}

#[test]
fn outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address_meshpath_proxy_v4() {
    outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address(Proxy::Meshpath, false);
}

#[test]
fn outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address_meshpath_proxy_v6() {
    outbound_to_a_meshed_pod_goes_over_hbone_and_keeps_the_clients_address(Proxy::Meshpath, true);
}

fn inbound_hbone_from_another_node_reaches_the_app(proxy: Proxy, v6: bool) {
    let node = node(proxy);
    let (db, legacy) = (node.add_pod("db").expect("db"), node.add_pod("legacy").expect("legacy"));
    let dst = SocketAddr::new(ip(&db, v6), 8084);
    let server = app(&db, dst);
    // A peer node's proxy: an HBONE client with a mesh certificate, from outside db.
    let ca = LocalCa::from_pem(
        &std::fs::read_to_string(node.dir.join("ca.pem")).expect("ca"),
        &std::fs::read_to_string(node.dir.join("ca-key.pem")).expect("ca key"),
    )
    .expect("CA");
    let cert = ca
        .issue(&Identity::new("cluster.local", "default", "web"), Duration::from_secs(600))
        .expect("cert");
    let gateway = SocketAddr::new(dst.ip(), 15008);
    let config = meshpath_proxy::identity::tls::client_config(
        &cert,
        std::slice::from_ref(&ca.cert_der),
        vec![Identity::new("cluster.local", "default", "db")],
    )
    .expect("TLS");
    let tcp = legacy.connect(gateway).expect("TCP to 15008");
    tcp.set_nonblocking(true).expect("nonblocking");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio");
        let headers = Default::default();
        let (mut send, mut recv) =
            meshpath_proxy::proxy::hbone::connect(tcp, gateway, dst, config, &headers)
                .await
                .expect("CONNECT answered 200");
        send.send_data(bytes::Bytes::from_static(b"hello"), true).expect("send");
        let mut back = Vec::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.expect("data");
            let _ = recv.flow_control().release_capacity(chunk.len());
            back.extend_from_slice(&chunk);
        }
        assert_eq!(back, b"hello");
    });
    let client = ip(&legacy, v6);
    assert_eq!(server.join().expect("app").expect("app io"), client, "client address");
}

#[test]
fn inbound_hbone_from_another_node_reaches_the_app_ztunnel_like_v4() {
    inbound_hbone_from_another_node_reaches_the_app(Proxy::ZtunnelLike, false);
}

#[test]
fn inbound_hbone_from_another_node_reaches_the_app_ztunnel_like_v6() {
    inbound_hbone_from_another_node_reaches_the_app(Proxy::ZtunnelLike, true);
}

#[test]
fn inbound_hbone_from_another_node_reaches_the_app_meshpath_proxy_v4() {
    inbound_hbone_from_another_node_reaches_the_app(Proxy::Meshpath, false);
}

#[test]
fn inbound_hbone_from_another_node_reaches_the_app_meshpath_proxy_v6() {
    inbound_hbone_from_another_node_reaches_the_app(Proxy::Meshpath, true);
}

fn inbound_plaintext_reaches_the_app_with_the_clients_address(proxy: Proxy, v6: bool) {
    let node = node(proxy);
    let (db, legacy) = (node.add_pod("db").expect("db"), node.add_pod("legacy").expect("legacy"));
    let (dst, client) = (SocketAddr::new(ip(&db, v6), 8081), ip(&legacy, v6));
    let server = app(&db, dst);
    // legacy is outside the mesh: its connection is steered to the proxy's 15006 in db, which
    // connects to the app transparently from legacy's address.
    assert_eq!(round_trip(legacy.connect(dst).expect("connect")), b"hello");
    let line = format!("INBOUND {dst} FROM {}:", host(client));
    let labels = [("reporter", "destination"), ("connection_security_policy", "unknown")];
    assert!(carried(&node, proxy, &line, &labels), "not through the proxy's 15006");
    assert_eq!(server.join().expect("app").expect("app io"), client, "client address");
}

#[test]
fn inbound_plaintext_reaches_the_app_with_the_clients_address_ztunnel_like_v4() {
    inbound_plaintext_reaches_the_app_with_the_clients_address(Proxy::ZtunnelLike, false);
}

#[test]
fn inbound_plaintext_reaches_the_app_with_the_clients_address_ztunnel_like_v6() {
    inbound_plaintext_reaches_the_app_with_the_clients_address(Proxy::ZtunnelLike, true);
}

#[test]
fn inbound_plaintext_reaches_the_app_with_the_clients_address_meshpath_proxy_v4() {
    inbound_plaintext_reaches_the_app_with_the_clients_address(Proxy::Meshpath, false);
}

#[test]
fn inbound_plaintext_reaches_the_app_with_the_clients_address_meshpath_proxy_v6() {
    inbound_plaintext_reaches_the_app_with_the_clients_address(Proxy::Meshpath, true);
}

fn without_the_proxy_inbound_never_reaches_the_app(proxy: Proxy) {
    let mut node = node(proxy);
    let (db, legacy) = (node.add_pod("db").expect("db"), node.add_pod("legacy").expect("legacy"));
    let dst = SocketAddr::new(db.ip, 8082);
    // One listener for both halves: binding the port again after the first connection could
    // meet a socket still holding it (the closing connection, or a copy of the listener in a
    // child another test thread is spawning) and fail with EADDRINUSE.
    let listener: TcpListener = db.netns.listen(dst).expect("listen");
    // Through the proxy first: the path works.
    let server = std::thread::scope(|s| {
        let server = s.spawn(|| echo_once(&listener));
        assert_eq!(round_trip(legacy.connect(dst).expect("connect")), b"hello");
        server.join().expect("app")
    });
    server.expect("app io");
    // The same real app behind the port, which must see nothing once the proxy is gone.
    listener.set_nonblocking(true).expect("nonblocking");
    node.proxy = None;
    match proxy {
        // A proxy written for istio-cni gives the agent nothing to hold: no listener, refused.
        Proxy::ZtunnelLike => {
            let refused = legacy.connect(dst);
            assert!(refused.is_err(), "a connection went around the stopped proxy");
        }
        // meshpath-proxy's listeners are held by the agent: the connection waits in the
        // backlog of its 15006 for the next proxy (tests/proxy_restarts.rs).
        Proxy::Meshpath => {
            let mut waiting = legacy.connect(dst).expect("refused with its listeners held");
            waiting.set_read_timeout(Some(Duration::from_secs(1))).expect("timeout");
            let mut b = [0u8; 1];
            assert!(
                meshpath_tests::again_after_eintr(|| waiting.read(&mut b)).is_err(),
                "answered with no proxy"
            );
        }
    }
    assert!(listener.accept().is_err(), "the app was reached without the proxy");
}

#[test]
fn without_the_proxy_inbound_never_reaches_the_app_ztunnel_like() {
    without_the_proxy_inbound_never_reaches_the_app(Proxy::ZtunnelLike);
}

#[test]
fn without_the_proxy_inbound_never_reaches_the_app_meshpath_proxy() {
    without_the_proxy_inbound_never_reaches_the_app(Proxy::Meshpath);
}

/// ztunnel-like answers every datagram; meshpath-proxy's DNS (store answers, forwarding from
/// the pod) is covered by tests/services.rs.
#[test]
fn dns_goes_to_the_proxys_dns_listener_ztunnel_like() {
    let node = node(Proxy::ZtunnelLike);
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
            let (n, from) = meshpath_tests::again_after_eintr(|| udp.recv_from(&mut buf))?;
            Ok((from, buf[..n].to_vec()))
        })
        .expect("run")
        .expect("dns");
    assert_eq!(answer, b"ANSWER query");
    assert_eq!(from, server, "the reply must look like the server's");
}
