//! Inbound capture without netfilter: TCP arriving at an enrolled pod, on any port, reaches the
//! proxy's inbound listener (15006) with the original destination (SO_ORIGINAL_DST and
//! getsockname agree) and the real client address; HBONE (15008) reaches the proxy's own 15008
//! listener; kubelet probes and excluded ports reach their sockets directly; without the proxy
//! the pod refuses, it never delivers around the proxy. IPv4 and IPv6, real kernel, real namespaces, real TCP.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use datapath_common::consts::{ports, probe};
use meshpath_loader::pods::EnrolOptions;
use meshpath_tests::{read_line, Mesh, Sentinel};

fn inbound(opts: EnrolOptions) -> Mesh {
    Mesh::new(EnrolOptions { capture_inbound: true, ..opts })
}

/// An app's listener on one of the proxy's ports in pod a, got without bind(): the pod's
/// ephemeral port range (a Kubernetes "safe" sysctl) set to that port and listen() on an
/// unbound socket, with SO_REUSEPORT when `reuse_port`. Non-blocking; with its local address.
fn app_on_a_proxy_port_through_the_port_range(
    mesh: &Mesh,
    port: u16,
    reuse_port: bool,
) -> (std::net::TcpListener, SocketAddr) {
    let ns = mesh.pods.a.open().expect("netns");
    let app = ns
        .run(|| -> std::io::Result<socket2::Socket> {
            std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", format!("{port} {port}"))?;
            let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            sock.set_reuse_address(true)?;
            sock.set_reuse_port(reuse_port)?;
            sock.listen(128)?;
            Ok(sock)
        })
        .expect("netns")
        .expect("an app listening on an ephemeral port");
    let local = app.local_addr().expect("local").as_socket().expect("inet");
    assert_eq!(local.port(), port, "the port range did not give {port}");
    app.set_nonblocking(true).expect("nonblocking");
    (app.into(), local)
}

/// Accepts on a non-blocking listener until `n` connections came or 5 s passed; how many came.
fn accept_up_to(listener: &std::net::TcpListener, n: usize) -> usize {
    // The server side is queued when the client's ACK is processed: wait for it, bounded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut got = 0;
    while got < n && std::time::Instant::now() < deadline {
        match listener.accept() {
            Ok(_) => got += 1,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    got
}

/// Asserts a non-blocking listener has nothing to accept.
fn assert_nothing_queued(listener: &std::net::TcpListener, what: &str) {
    match listener.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("{what} took inbound from {peer:?}"),
        Err(e) => panic!("accept: {e}"),
    }
}

/// An app holds `port` in SO_REUSEPORT (taken without bind(), through the pod's ephemeral port
/// range, or before the pod was enrolled) and the proxy joins its group, as ztunnel, which sets
/// SO_REUSEPORT, would: 32 connections to pod a's `dst_port` must all reach the socket the
/// proxy bound, and the app's, in the same group, must see none (spread over the group, all 32
/// missing it would be 1 in 2^32).
fn an_app_in_the_proxys_reuseport_group_gets_nothing(port: u16, dst_port: u16) {
    let mesh = inbound(EnrolOptions::default());
    let (app, local) = app_on_a_proxy_port_through_the_port_range(&mesh, port, true);
    let proxy = mesh
        .pods
        .a
        .listen_in_cgroup_with(local, &mesh.cgroup, true)
        .expect("the proxy joins the port's reuseport group");
    proxy.set_nonblocking(true).expect("nonblocking");
    let conns: Vec<_> = (0..32)
        .map(|_| mesh.connect_from_b(mesh.a(false, dst_port), None).expect("inbound connect"))
        .collect();
    let to_proxy = accept_up_to(&proxy, conns.len());
    assert_nothing_queued(&app, "the app's socket in the group");
    assert_eq!(to_proxy, conns.len(), "every inbound connection reaches the proxy's socket");
}

fn reaches_the_proxy_with_destination_and_client(v6: bool) {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    // Nothing listens on pod a's port 8080: only capture can answer.
    let dst = mesh.a(v6, 8080);
    let conn = mesh.connect_from_b(dst, None).expect("connect to pod a");
    let client = conn.local_addr().expect("local addr");
    assert_eq!(read_line(&conn), format!("INBOUND {dst} FROM {client}"));
}

#[test]
fn inbound_tcp_to_any_port_reaches_the_proxy_with_destination_and_client_v4() {
    reaches_the_proxy_with_destination_and_client(false);
}

#[test]
fn inbound_tcp_to_any_port_reaches_the_proxy_with_destination_and_client_v6() {
    reaches_the_proxy_with_destination_and_client(true);
}

#[test]
fn hbone_reaches_the_proxys_own_15008_listener() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    for v6 in [false, true] {
        let hbone = mesh.a(v6, ports::HBONE);
        let server = mesh.echo_server_as_proxy_in_a(hbone);
        drop(mesh.connect_from_b(hbone, None).expect("connect to 15008"));
        let client = server.join().expect("server").expect("accept on 15008");
        assert_eq!(client.ip(), mesh.b(v6, 0).ip(), "15008 did not see the client (v6={v6})");
    }
}

#[test]
fn inbound_connections_are_refused_when_the_proxy_is_not_running() {
    let mesh = inbound(EnrolOptions::default());
    for v6 in [false, true] {
        let dst = mesh.a(v6, 8081);
        // The app listens: delivery around the proxy would reach it.
        let app = mesh.pods.a.listen(dst).expect("bind");
        app.set_nonblocking(true).expect("nonblocking");
        let err = mesh.connect_from_b(dst, None).expect_err("connected without a proxy");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        assert!(app.accept().is_err(), "inbound leaked around the proxy (v6={v6})");
    }
}

#[test]
fn inbound_service_resumes_when_the_proxy_comes_back() {
    let mut mesh = inbound(EnrolOptions::default());
    let dst = mesh.a(false, 8082);
    // The app listens: delivery around the proxy would reach it.
    let sentinel = Sentinel::new(&mesh.pods.a, dst);
    assert!(mesh.connect_from_b(dst, None).is_err());
    sentinel.assert_untouched("before the proxy started");
    mesh.start_proxy("echo");
    let conn = mesh.connect_from_b(dst, None).expect("connect after the proxy started");
    assert!(read_line(&conn).starts_with(&format!("INBOUND {dst}")));
    mesh.proxy.as_mut().expect("proxy").stop();
    assert!(mesh.connect_from_b(dst, None).is_err(), "connected after the proxy stopped");
    sentinel.assert_untouched("after the proxy stopped");
}

/// Gives pod b the kubelet probe source address and pod a a route back to it.
fn add_probe_source(mesh: &Mesh, v6: bool) -> IpAddr {
    let (ip, plen): (IpAddr, u8) = if v6 {
        (Ipv6Addr::from(probe::SOURCE_V6).into(), 128)
    } else {
        (IpAddr::from(probe::SOURCE_V4), 32)
    };
    let mut add = vec!["addr", "add"];
    let cidr = format!("{ip}/{plen}");
    add.extend([cidr.as_str(), "dev", "eth0"]);
    if v6 {
        add.push("nodad");
    }
    mesh.pods.b.ip(&add).expect("probe address on pod b");
    mesh.pods
        .a
        .ip(&["route", "add", &ip.to_string(), "dev", "eth0"])
        .expect("route to probe source");
    ip
}

#[test]
fn kubelet_probes_reach_the_app_uncaptured() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    for v6 in [false, true] {
        let probe_ip = add_probe_source(&mesh, v6);
        let dst = mesh.a(v6, 8083);
        let app = mesh.echo_server_in_a(dst);
        drop(mesh.connect_from_b(dst, Some(probe_ip)).expect("probe connects"));
        let client = app.join().expect("app").expect("app accepted the probe");
        assert_eq!(client.ip(), probe_ip);
    }
}

#[test]
fn kubelet_probes_are_captured_when_bypass_is_off() {
    let mesh =
        inbound(EnrolOptions { probe_bypass: false, ..EnrolOptions::default() }).with_proxy("echo");
    let probe_ip = add_probe_source(&mesh, false);
    let dst = mesh.a(false, 8084);
    let conn = mesh.connect_from_b(dst, Some(probe_ip)).expect("probe connects");
    assert!(read_line(&conn).starts_with(&format!("INBOUND {dst} FROM {probe_ip}:")));
}

#[test]
fn excluded_inbound_ports_reach_the_app_directly() {
    let mesh =
        inbound(EnrolOptions { exclude_inbound_ports: vec![2222], ..EnrolOptions::default() });
    // No proxy: only the excluded port can connect.
    for v6 in [false, true] {
        let app = mesh.echo_server_in_a(mesh.a(v6, 2222));
        drop(mesh.connect_from_b(mesh.a(v6, 2222), None).expect("excluded port connects"));
        app.join().expect("app").expect("app accepted");
        let sentinel = Sentinel::new(&mesh.pods.a, mesh.a(v6, 2223));
        assert!(mesh.connect_from_b(mesh.a(v6, 2223), None).is_err());
        sentinel.assert_untouched("a port that is not excluded");
    }
}

#[test]
fn traffic_inside_the_pod_is_not_steered() {
    let mesh = inbound(EnrolOptions::default());
    // No proxy runs: the app reaching itself on its pod address must still work.
    let dst: SocketAddr = mesh.a(false, 8085);
    let app = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_a(dst, None).expect("in-pod connect"));
    app.join().expect("app").expect("app accepted");
}

#[test]
fn outbound_capture_still_works_with_inbound_capture_on() {
    let mesh = Mesh::new(EnrolOptions {
        capture_inbound: true,
        capture_outbound: true,
        ..EnrolOptions::default()
    })
    .with_proxy("echo");
    // The app→proxy hop (to 127.0.0.1:15001 / [::1]:15001) must not be steered to 15006.
    for v6 in [false, true] {
        let dst = mesh.b(v6, 8086);
        let conn = mesh.connect_from_a(dst, None).expect("outbound connect");
        assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    }
}

#[test]
fn forwarding_proxy_delivers_inbound_to_the_app() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("forward");
    for v6 in [false, true] {
        let dst = mesh.a(v6, 8087);
        let app = mesh.echo_server_in_a(dst);
        let mut conn = mesh.connect_from_b(dst, None).expect("connect");
        use std::io::{Read as _, Write as _};
        conn.write_all(b"hello through the proxy").expect("send");
        conn.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut back = String::new();
        conn.read_to_string(&mut back).expect("echo");
        assert_eq!(back, "hello through the proxy");
        // The proxy connected to the app from inside the pod (source: the pod's own address).
        let via = app.join().expect("app").expect("app io");
        assert_eq!(via.ip(), dst.ip(), "the app was not reached through the proxy (v6={v6})");
    }
}

#[test]
fn pods_enrolled_without_inbound_capture_receive_inbound_directly() {
    let mesh = Mesh::new(EnrolOptions { capture_outbound: true, ..EnrolOptions::default() });
    for v6 in [false, true] {
        let dst = mesh.a(v6, 8088);
        let app = mesh.echo_server_in_a(dst);
        drop(mesh.connect_from_b(dst, None).expect("direct inbound"));
        app.join().expect("app").expect("app accepted");
    }
}

#[test]
fn inbound_to_an_address_the_datapath_does_not_know_is_refused() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    // An address added after enrolment: the pod's owner never told the datapath about it.
    mesh.pods.a.ip(&["addr", "add", "10.199.0.77/24", "dev", "eth0"]).expect("extra address");
    let dst: SocketAddr = "10.199.0.77:8089".parse().expect("addr");
    let err = mesh.connect_from_b(dst, None).expect_err("unknown address accepted");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
}

#[test]
fn excluded_inbound_client_cidrs_reach_the_app_directly() {
    let mesh = inbound(EnrolOptions {
        exclude_inbound_cidrs: vec!["10.199.0.2/32".parse().expect("cidr")],
        ..EnrolOptions::default()
    });
    // No proxy: pod b (10.199.0.2) is excluded and reaches the app; over IPv6 it is not.
    let app = mesh.echo_server_in_a(mesh.a(false, 8092));
    drop(mesh.connect_from_b(mesh.a(false, 8092), None).expect("excluded client connects"));
    app.join().expect("app").expect("app accepted");
    let sentinel = Sentinel::new(&mesh.pods.a, mesh.a(true, 8093));
    assert!(mesh.connect_from_b(mesh.a(true, 8093), None).is_err());
    sentinel.assert_untouched("a client that is not excluded");
}

#[test]
fn a_transparent_connection_closed_after_its_pod_left_leaves_no_entry_behind() {
    let mesh = inbound(EnrolOptions::default());
    let dp = mesh.datapath();
    let filed = || dp.proxy_transparent().expect("PROXY_TRANSPARENT").keys().flatten().count();
    // The app has not accepted the connection yet (its listener defers it until data comes):
    // the entry stays until then, or until the proxy's end closes.
    let _app = mesh.pods.a.deferring_listener(mesh.a(false, 8094), None, 128).expect("app");
    // What a proxy opens to reach the app: inside the pod, from a client's address.
    let client: IpAddr = "10.199.0.2".parse().expect("ip");
    let conn = mesh
        .pods
        .a
        .transparent_connect(SocketAddr::new(client, 0), mesh.a(false, 8094), Some(&mesh.cgroup))
        .expect("transparent connection to the app, bound by the proxy");
    assert_eq!(filed(), 1, "the transparent connection was not filed");
    // The pod leaves with the connection in its handshake; then the proxy's end closes.
    let cookie = meshpath_loader::pods::list(&dp).expect("pods")[0].cookie;
    meshpath_loader::pods::unenrol(&dp, cookie).expect("unenrol");
    conn.set_linger(Some(std::time::Duration::ZERO)).expect("linger");
    drop(conn);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while filed() != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(filed(), 0, "a closed connection's 4-tuple stayed filed for the pod's address");
}

#[test]
fn an_app_cannot_bind_the_proxys_ports_in_its_pod_so_never_takes_its_inbound_traffic() {
    // No proxy runs (as while it restarts): the pod's inbound traffic is refused, and an app
    // that listens on 15006 must not get it.
    let mesh = inbound(EnrolOptions::default());
    let taken = mesh.pods.a.listen(mesh.a(false, ports::INBOUND_PLAINTEXT));
    let err = taken.expect_err("an app listened on the proxy's inbound port");
    let err = err.downcast::<std::io::Error>().expect("an io error");
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
    // The app's own port (a listener that must see nothing) stays refused too.
    let app = Sentinel::new(&mesh.pods.a, mesh.a(false, 8095));
    assert!(mesh.connect_from_b(mesh.a(false, 8095), None).is_err(), "inbound was delivered");
    app.assert_untouched("inbound with no proxy");
    // Every proxy port, either protocol, any address; other pods' ports are theirs.
    let ns = mesh.pods.a.open().expect("netns");
    for port in ports::PROXY_PORTS {
        let udp = ns.run(|| std::net::UdpSocket::bind(("127.0.0.1", port))).expect("netns");
        let tcp = ns.run(|| std::net::TcpListener::bind(("::", port))).expect("netns");
        assert!(udp.is_err() && tcp.is_err(), "port {port} was bound by an app");
    }
    drop(mesh.pods.b.listen(mesh.b(false, ports::INBOUND_PLAINTEXT)).expect("a pod not enrolled"));
}

#[test]
fn an_app_in_the_proxys_reuseport_group_on_15006_gets_none_of_the_pods_inbound() {
    an_app_in_the_proxys_reuseport_group_gets_nothing(ports::INBOUND_PLAINTEXT, 8097);
}

#[test]
fn an_app_in_the_proxys_reuseport_group_on_15006_gets_none_of_the_traffic_sent_to_15006() {
    an_app_in_the_proxys_reuseport_group_gets_nothing(
        ports::INBOUND_PLAINTEXT,
        ports::INBOUND_PLAINTEXT,
    );
}

#[test]
fn an_app_in_the_proxys_reuseport_group_on_15008_gets_none_of_the_pods_hbone() {
    an_app_in_the_proxys_reuseport_group_gets_nothing(ports::HBONE, ports::HBONE);
}

/// A pod may set its ephemeral port range (a Kubernetes "safe" sysctl) to a proxy port:
/// listen() on an unbound socket then takes it without a bind() the hook could refuse. No proxy
/// runs: TCP to pod a's `dst_port` must be refused, and that listener must see nothing.
fn a_listener_that_got_a_proxy_port_without_binding_it_gets_nothing(port: u16, dst_port: u16) {
    let mesh = inbound(EnrolOptions::default());
    let (listener, _) = app_on_a_proxy_port_through_the_port_range(&mesh, port, false);
    let dst = mesh.a(false, dst_port);
    assert!(mesh.connect_from_b(dst, None).is_err(), "inbound to {dst} was delivered");
    assert_nothing_queued(&listener, "the app's listener on a proxy port");
}

#[test]
fn a_listener_that_got_15006_without_binding_it_is_not_taken_for_the_proxys() {
    a_listener_that_got_a_proxy_port_without_binding_it_gets_nothing(
        ports::INBOUND_PLAINTEXT,
        8096,
    );
}

#[test]
fn a_listener_that_got_15006_without_binding_it_gets_none_of_the_traffic_sent_to_15006() {
    a_listener_that_got_a_proxy_port_without_binding_it_gets_nothing(
        ports::INBOUND_PLAINTEXT,
        ports::INBOUND_PLAINTEXT,
    );
}

#[test]
fn a_listener_that_got_15008_without_binding_it_gets_none_of_the_pods_hbone() {
    a_listener_that_got_a_proxy_port_without_binding_it_gets_nothing(ports::HBONE, ports::HBONE);
}

#[test]
fn an_apps_own_transparent_connect_opens_no_path_around_the_proxy() {
    // An app with CAP_NET_RAW (container runtimes grant it) connects to its own pod from an
    // outside address and port; then a peer at that address sends from that port. Neither
    // may reach the app's listener: both go to the proxy's inbound listener.
    let mesh = inbound(EnrolOptions::default());
    let proxy = mesh
        .pods
        .a
        .listen_in_cgroup(
            SocketAddr::from((Ipv6Addr::UNSPECIFIED, ports::INBOUND_PLAINTEXT)),
            &mesh.cgroup,
        )
        .expect("the proxy's inbound listener");
    proxy.set_nonblocking(true).expect("nonblocking");
    let app = mesh.pods.a.listen(mesh.a(false, 8097)).expect("the app");
    app.set_nonblocking(true).expect("nonblocking");
    let outside = SocketAddr::new(IpAddr::V4(mesh.pods.b_ip), 40_123);
    let _spoofed = mesh
        .pods
        .a
        .transparent_connect(outside, mesh.a(false, 8097), None)
        .expect("the app's transparent connect");
    let filed = || mesh.datapath().proxy_transparent().expect("map").keys().flatten().count();
    let netns = mesh.pods.a.open().expect("netns a").cookie();
    let counted = || {
        meshpath_loader::decisions::of(&mesh.datapath(), netns)
            .expect("decisions")
            .iter()
            .find(|d| d.hook == "sock_ops" && d.why == "transparent connect outside the proxy")
            .map_or(0, |d| d.count)
    };
    // sock_ops ran in the connect: the count (or, before this was closed, the filing) is
    // there by now.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while counted() == 0 && filed() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Nothing from that outside address reached the app around the proxy: not the app's own
    // connection (filed, its SYN was let through to the app's listener).
    assert_nothing_queued(&app, "the app");
    // The peer whose address the app took, from the same port: to the proxy, not the app.
    let peer =
        mesh.pods.b.open().expect("netns b").run(|| -> std::io::Result<std::net::TcpStream> {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            s.set_reuse_address(true)?;
            s.bind(&outside.into())?;
            s.connect_timeout(&mesh.a(false, 8097).into(), std::time::Duration::from_secs(5))?;
            Ok(s.into())
        });
    assert!(matches!(peer, Ok(Ok(_))), "the peer did not reach pod a: {peer:?}");
    assert_nothing_queued(&app, "the app");
    assert!(accept_up_to(&proxy, 1) >= 1, "the proxy's listener did not get the peer");
    assert_eq!(filed(), 0, "the app's transparent connect was filed as the proxy's");
    assert_eq!(counted(), 1, "the app's transparent connect was not counted");
}
