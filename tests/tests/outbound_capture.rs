//! Outbound capture without netfilter: an enrolled pod's TCP goes to the proxy's outbound
//! listener inside the pod; the proxy reads the original destination with SO_ORIGINAL_DST as it
//! would under iptables; the app still sees the peer it asked for; the proxy's own sockets, and
//! excluded ports, are left alone; without a proxy, connections are refused, not leaked.
//! IPv4 and IPv6, real kernel, real namespaces, real TCP, real iperf3.

use std::{
    io::{Read as _, Write as _},
    net::IpAddr,
    process::Command,
    time::Duration,
};

use datapath_common::consts::marks;
use meshpath_loader::pods::{self, EnrolOptions};
use meshpath_tests::{read_line, Mesh, Sentinel};

fn proxy_reports_the_original_destination(v6: bool) {
    let mesh = Mesh::capturing().with_proxy("echo");
    // Nothing listens on pod b's port 8080: only capture can answer.
    let dst = mesh.b(v6, 8080);
    let conn = mesh.connect_from_a(dst, None).expect("connect through capture");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
}

#[test]
fn outbound_tcp_reaches_the_proxy_with_its_original_destination_v4() {
    proxy_reports_the_original_destination(false);
}

#[test]
fn outbound_tcp_reaches_the_proxy_with_its_original_destination_v6() {
    proxy_reports_the_original_destination(true);
}

fn app_sees_the_peer_it_asked_for(v6: bool) {
    let mesh = Mesh::capturing().with_proxy("echo");
    let dst = mesh.b(v6, 8081);
    let conn = mesh.connect_from_a(dst, None).expect("connect");
    assert_eq!(conn.peer_addr().expect("getpeername"), dst);
}

#[test]
fn app_getpeername_shows_the_destination_it_asked_for_v4() {
    app_sees_the_peer_it_asked_for(false);
}

#[test]
fn app_getpeername_shows_the_destination_it_asked_for_v6() {
    app_sees_the_peer_it_asked_for(true);
}

/// The original destination lives as long as the app's socket, as REDIRECT's NAT does: it is
/// not lost to the connections made after it (the node-wide record of them once kept 65,536,
/// evicting the oldest, so a long-lived connection's getpeername came to show the proxy).
#[test]
fn a_long_lived_connection_keeps_its_destination_after_many_newer_connections() {
    let mesh = Mesh::capturing().with_proxy("forward");
    let dst = mesh.b(false, 8089);
    let server = mesh.echo_server_in_b(dst);
    let mut conn = mesh.connect_from_a(dst, None).expect("connect");
    assert_eq!(conn.peer_addr().expect("getpeername"), dst);

    // Three times the old record's size in captured sockets of another pod of the node, each
    // one looked at once as an app would: connected UDP to port 53 (DNS capture), getpeername.
    // No datagram is sent.
    let churn = 3 * datapath_common::consts::MAX_TRACKED_CONNECTIONS as usize;
    let b = mesh.pods.b.open().expect("netns b");
    let opts = EnrolOptions { capture_dns: true, ..EnrolOptions::default() };
    pods::enrol(&mesh.datapath(), &b, &opts).expect("enrol b");
    let resolver = mesh.a(false, 53);
    let shown = b
        .run(|| {
            (0..churn)
                .filter(|_| {
                    let udp = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp socket");
                    udp.connect(resolver).expect("udp connect");
                    udp.peer_addr().is_ok_and(|p| p == resolver)
                })
                .count()
        })
        .expect("run in pod b");
    assert_eq!(shown, churn, "every socket of pod b is captured and shows its destination");

    assert_eq!(conn.peer_addr().expect("getpeername"), dst, "after {churn} newer connections");
    conn.write_all(b"still here").expect("send");
    let mut echoed = [0u8; 10];
    conn.read_exact(&mut echoed).expect("echo");
    assert_eq!(&echoed, b"still here");
    drop(conn);
    server.join().expect("server").expect("server io");
}

/// The proxy's end of a captured connection takes the original destination onto its own
/// socket when it is established: the proxy reads it from there, and nothing is left filed by
/// connection (so that record holds only connections not yet accepted, and never fills).
#[test]
fn the_proxys_socket_takes_the_original_destination_leaving_no_record_by_connection() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let cookie = mesh.pods.a.open().expect("netns a").cookie();
    for (i, v6) in [false, true].into_iter().cycle().take(20).enumerate() {
        let dst = mesh.b(v6, 8100 + i as u16);
        let conn = mesh.connect_from_a(dst, None).expect("connect through capture");
        assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    }
    let by_conn = mesh.datapath().orig_dst_by_conn().expect("ORIG_DST_BY_CONN");
    let left: Vec<_> = by_conn.keys().flatten().filter(|k| k.netns == cookie).collect();
    assert!(left.is_empty(), "filed by connection after the proxy accepted them: {left:?}");
}

/// As under istio-cni's REDIRECT, the app's connection to the proxy carries the pod's own
/// address as its source: the app's getsockname() and the proxy's peer both show the pod,
/// never loopback.
fn the_hop_to_the_proxy_carries_the_pods_address(v6: bool) {
    let mesh = Mesh::capturing().with_proxy("echo");
    let dst = mesh.b(v6, 8086);
    let conn = mesh.connect_from_a(dst, None).expect("connect");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    let local = conn.local_addr().expect("getsockname");
    assert_eq!(local.ip(), mesh.a(v6, 0).ip(), "the app's own address (v6={v6})");
    let proxy = mesh.proxy.as_ref().expect("proxy");
    let seen = format!("ACCEPTED {dst} FROM {local} AT ");
    assert!(
        proxy.wait_for_line(&seen, Duration::from_secs(5)),
        "the proxy did not see the app at {local} (v6={v6}): {:?}",
        proxy.lines()
    );
}

#[test]
fn the_app_and_the_proxy_see_the_pods_address_as_the_apps_v4() {
    the_hop_to_the_proxy_carries_the_pods_address(false);
}

#[test]
fn the_app_and_the_proxy_see_the_pods_address_as_the_apps_v6() {
    the_hop_to_the_proxy_carries_the_pods_address(true);
}

fn forwarded_round_trip(v6: bool) {
    let mesh = Mesh::capturing().with_proxy("forward");
    let dst = mesh.b(v6, 8082);
    let server = mesh.echo_server_in_b(dst);
    let mut conn = mesh.connect_from_a(dst, None).expect("connect");
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let writer = {
        let mut w = conn.try_clone().expect("clone");
        let p = payload.clone();
        std::thread::spawn(move || {
            w.write_all(&p).expect("send");
            w.shutdown(std::net::Shutdown::Write).expect("shutdown");
        })
    };
    let mut echoed = Vec::new();
    conn.read_to_end(&mut echoed).expect("read echo");
    writer.join().expect("writer");
    assert_eq!(echoed, payload);
    // The server saw the proxy's upstream connection, made from pod a's own address: the
    // proxy's socket was not captured again (it would have looped back to the proxy).
    let peer = server.join().expect("server").expect("server io");
    let a_ip: IpAddr = if v6 { mesh.pods.a_ip6.into() } else { mesh.pods.a_ip.into() };
    assert_eq!(peer.ip(), a_ip);
    let proxy = mesh.proxy.as_ref().expect("proxy");
    proxy.wait_for_line("FORWARDED", Duration::from_secs(5));
    assert!(
        proxy.lines().contains(&format!("FORWARDED {} {}", payload.len(), payload.len())),
        "proxy did not carry the bytes: {:?}",
        proxy.lines()
    );
}

#[test]
fn forwarding_proxy_carries_a_round_trip_to_the_original_destination_v4() {
    forwarded_round_trip(false);
}

#[test]
fn forwarding_proxy_carries_a_round_trip_to_the_original_destination_v6() {
    forwarded_round_trip(true);
}

#[test]
fn an_app_that_sets_the_proxy_socket_mark_is_still_captured() {
    let mesh = Mesh::capturing().with_proxy("echo");
    // istio-cni lets sockets marked 0x539 through; any app with CAP_NET_ADMIN can set it.
    for v6 in [false, true] {
        let dst = mesh.b(v6, 8083);
        let conn = mesh.connect_from_a(dst, Some(marks::PROXY_SOCKET)).expect("connect with mark");
        assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"), "mark escaped capture (v6={v6})");
    }
}

#[test]
fn an_app_connecting_from_an_address_not_its_pods_is_still_captured() {
    // Both ways captured, as a meshed pod is: the mistake was the inbound steering's.
    let opts = EnrolOptions { capture_outbound: true, capture_inbound: true, ..Default::default() };
    let mesh = Mesh::new(opts).with_proxy("echo");
    // CAP_NET_ADMIN in the pod: it adds addresses the datapath does not know and binds to them,
    // or binds to loopback. Its connection to the proxy at the pod's own address once looked
    // like a client's to the inbound steering, and went to the pod's inbound listener instead.
    mesh.pods.a.ip(&["addr", "add", "10.77.0.200/32", "dev", "eth0"]).expect("extra address");
    mesh.pods.a.ip(&["addr", "add", "fd00:77::200/128", "dev", "eth0", "nodad"]).expect("v6");
    for src in ["10.77.0.200", "fd00:77::200", "127.0.0.1", "::1"] {
        let src: IpAddr = src.parse().expect("ip");
        let dst = mesh.b(src.is_ipv6(), 8092);
        // A real server is there: a leak around the proxy would reach it.
        let sentinel = Sentinel::new(&mesh.pods.b, dst);
        let conn = mesh.connect_from_a_at(dst, src).expect("connect from the bound address");
        assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"), "not captured (from {src})");
        assert_eq!(conn.local_addr().expect("getsockname").ip(), src, "the app's own address");
        assert_eq!(conn.peer_addr().expect("getpeername"), dst);
        drop(conn);
        sentinel.assert_untouched("a connection from an address not the pod's");
    }
}

#[test]
fn outbound_connections_are_refused_when_the_proxy_is_not_running() {
    let mesh = Mesh::capturing();
    for v6 in [false, true] {
        let dst = mesh.b(v6, 8084);
        // A real server is there: a leak around the proxy would reach it.
        let listener = mesh.pods.b.listen(dst).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let err = mesh.connect_from_a(dst, None).expect_err("connected without a proxy");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        assert!(listener.accept().is_err(), "the connection leaked around the proxy (v6={v6})");
    }
}

#[test]
fn service_resumes_when_the_proxy_comes_back() {
    let mut mesh = Mesh::capturing();
    let dst = mesh.b(false, 8085);
    // The destination listens: a connection that went around the proxy would reach it.
    let sentinel = Sentinel::new(&mesh.pods.b, dst);
    assert!(mesh.connect_from_a(dst, None).is_err());
    sentinel.assert_untouched("before the proxy started");
    mesh.start_proxy("echo");
    let conn = mesh.connect_from_a(dst, None).expect("connect after the proxy started");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    mesh.proxy.as_mut().expect("proxy").stop();
    assert!(mesh.connect_from_a(dst, None).is_err(), "connected after the proxy stopped");
    sentinel.assert_untouched("after the proxy stopped");
}

#[test]
fn excluded_outbound_ports_bypass_the_proxy() {
    let mesh = Mesh::new(EnrolOptions {
        capture_outbound: true,
        exclude_outbound_ports: vec![9090],
        ..EnrolOptions::default()
    });
    // No proxy runs: an excluded port connects directly, any other port is refused.
    for v6 in [false, true] {
        let server = mesh.echo_server_in_b(mesh.b(v6, 9090));
        let conn =
            mesh.connect_from_a(mesh.b(v6, 9090), None).expect("excluded port connects directly");
        drop(conn);
        server.join().expect("server").expect("server io");
        let sentinel = Sentinel::new(&mesh.pods.b, mesh.b(v6, 9091));
        assert!(mesh.connect_from_a(mesh.b(v6, 9091), None).is_err());
        sentinel.assert_untouched("a port that is not excluded");
    }
}

#[test]
fn pods_enrolled_without_capture_connect_directly() {
    let mesh = Mesh::new(EnrolOptions::default());
    let dst = mesh.b(false, 8086);
    let server = mesh.echo_server_in_b(dst);
    let conn = mesh.connect_from_a(dst, None).expect("direct connect");
    drop(conn);
    let peer = server.join().expect("server").expect("server io");
    assert_eq!(peer.ip(), IpAddr::from(mesh.pods.a_ip));
}

#[test]
fn unenrolled_pods_are_no_longer_captured() {
    let mesh = Mesh::capturing();
    let dst = mesh.b(false, 8087);
    let sentinel = Sentinel::new(&mesh.pods.b, dst);
    assert!(mesh.connect_from_a(dst, None).is_err(), "captured pod without proxy connected");
    sentinel.assert_untouched("while enrolled");
    drop(sentinel);
    let dp = mesh.datapath();
    let cookie = mesh.pods.a.open().expect("netns").cookie();
    pods::unenrol(&dp, cookie).expect("unenrol");
    drop(dp);
    let server = mesh.echo_server_in_b(dst);
    drop(mesh.connect_from_a(dst, None).expect("direct after unenrol"));
    server.join().expect("server").expect("server io");
}

#[test]
fn iperf3_runs_to_completion_through_the_capture() {
    let mesh = Mesh::capturing().with_proxy("forward");
    let b_ip = IpAddr::from(mesh.pods.b_ip);
    let _server = mesh.pods.b.iperf3_server(b_ip, 5299, true).expect("iperf3 -s");
    let report = mesh.pods.a.iperf3_client(b_ip, 5299, &["-t", "2"]).expect("iperf3 -c");
    // A proxy buffers: iperf3 may end the test while the last bytes are still in flight, so
    // the receiver's total is checked to be substantial, not equal to the sender's.
    let received = report["end"]["sum_received"]["bytes"].as_u64().expect("bytes received");
    assert!(received > 10 * 1024 * 1024, "only {received} bytes received in 2 s");
    let proxy = mesh.proxy.as_ref().expect("proxy");
    assert!(
        proxy.wait_for_line("ACCEPTED", Duration::from_secs(5)),
        "no connection went through the proxy"
    );
}

#[test]
fn no_netfilter_rule_exists_in_the_pod_or_node_while_capture_works() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let dst = mesh.b(false, 8088);
    let conn = mesh.connect_from_a(dst, None).expect("captured connect");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    let nsenter = |ns: &str, args: &[&str]| {
        let out =
            Command::new("nsenter").arg(format!("--net={ns}")).args(args).output().expect(args[0]);
        assert!(
            out.status.success(),
            "{} failed: {}",
            args[0],
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let dump = |ns: &str| {
        ["iptables-save", "ip6tables-save"]
            .iter()
            .map(|t| nsenter(ns, &[t]))
            .chain([nsenter(ns, &["nft", "list", "ruleset"])])
            .collect::<Vec<_>>()
            .join("\n")
    };
    // The pods' namespaces: no rule at all.
    for ns in [&mesh.pods.a, &mesh.pods.b] {
        let rules = dump(&ns.path().display().to_string());
        assert!(
            !rules.lines().any(|l| l.starts_with("-A") || l.trim_start().starts_with("chain")),
            "rules in {}:\n{rules}",
            ns.name()
        );
    }
    // The node (the machine's root netns may carry other software's rules): none of ours.
    // /proc/self/ns/net as nsenter opens it: nsenter's own, i.e. this test's node netns.
    let node = dump("/proc/self/ns/net");
    for needle in ["REDIRECT", "TPROXY", "tproxy", "redirect", "15001", "15006", "0x539"] {
        assert!(!node.contains(needle), "node netns has a capture rule ({needle}):\n{node}");
    }
}

#[test]
fn excluded_outbound_cidrs_bypass_the_proxy_by_longest_prefix() {
    let mesh = Mesh::new(EnrolOptions {
        capture_outbound: true,
        // 10.199.0.0/24 and fd00:199::/64 excluded, but pod b's own /32 and /128 captured again.
        exclude_outbound_cidrs: vec![
            "10.199.0.0/24".parse().expect("cidr"),
            "fd00:199::/64".parse().expect("cidr"),
        ],
        capture_outbound_cidrs: vec![
            "10.199.0.2/32".parse().expect("cidr"),
            "fd00:199::2/128".parse().expect("cidr"),
        ],
        ..EnrolOptions::default()
    });
    // No proxy runs: captured connections are refused, excluded ones connect directly.
    for v6 in [false, true] {
        let other: IpAddr =
            if v6 { "fd00:199::3".parse().expect("ip") } else { "10.199.0.3".parse().expect("ip") };
        let plen = if v6 { "128" } else { "32" };
        mesh.pods
            .b
            .ip(&["addr", "add", &format!("{other}/{plen}"), "dev", "eth0", "nodad"]
                [..if v6 { 6 } else { 5 }])
            .expect("second address on pod b");
        let excluded = std::net::SocketAddr::new(other, 8090);
        let server = mesh.echo_server_in_b(excluded);
        drop(mesh.connect_from_a(excluded, None).expect("excluded prefix connects directly"));
        server.join().expect("server").expect("server io");
        let sentinel = Sentinel::new(&mesh.pods.b, mesh.b(v6, 8090));
        assert!(
            mesh.connect_from_a(mesh.b(v6, 8090), None).is_err(),
            "the longer captured prefix must win (v6={v6})"
        );
        sentinel.assert_untouched("the longer captured prefix");
    }
}

#[test]
fn an_ipv6_exclusion_of_every_address_leaves_ipv4_captured() {
    // `::/0` as ip6tables has it: all of IPv6, none of IPv4 (whose keys are v4-mapped IPv6).
    let mesh = Mesh::new(EnrolOptions {
        capture_outbound: true,
        exclude_outbound_cidrs: vec!["::/0".parse().expect("cidr")],
        ..EnrolOptions::default()
    });
    // No proxy runs: a captured connection is refused, an excluded one connects directly.
    let v6 = mesh.b(true, 8090);
    let server = mesh.echo_server_in_b(v6);
    drop(mesh.connect_from_a(v6, None).expect("IPv6 is excluded: it connects directly"));
    server.join().expect("server").expect("server io");
    let sentinel = Sentinel::new(&mesh.pods.b, mesh.b(false, 8090));
    assert!(mesh.connect_from_a(mesh.b(false, 8090), None).is_err(), "IPv4 left the mesh");
    sentinel.assert_untouched("an IPv4 destination under an IPv6 exclusion");
}

#[test]
fn a_pod_reaching_its_own_address_is_not_captured() {
    let mesh = Mesh::capturing();
    // No proxy runs: only an uncaptured connection can succeed.
    let own = std::net::SocketAddr::new(mesh.pods.a_ip.into(), 8091);
    let listener = mesh.pods.a.listen(own).expect("bind");
    drop(mesh.connect_from_a(own, None).expect("connect to own address"));
    listener.accept().expect("the pod's own listener got it");
}
