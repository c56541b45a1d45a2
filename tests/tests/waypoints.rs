//! Waypoints: a destination istiod (here the workloads file) says a waypoint serves is reached
//! through the waypoint, as ztunnel sends it: HBONE to the waypoint, the CONNECT naming the
//! destination the app asked for, the waypoint's identity checked; never around it. The
//! waypoint is a stand-in (tests/waypoint-standin: Envoy cannot run here) in a netns
//! of its own between pod a and pod b, which records each CONNECT and carries it on to pod b
//! over HBONE.

use std::{
    net::{IpAddr, SocketAddr},
    sync::atomic::Ordering::SeqCst,
    time::Duration,
};

use meshpath_tests::{
    two_nodes::{Setup, TwoNodes, View, MESHED, WAYPOINT_IP},
    wait_until,
};
use meshpath_xds::workload as wl;

/// The waypoint's workload and service, and service `bw` (VIP 10.96.0.20) that it serves.
fn waypoint_yaml(bw_waypoint: &str) -> String {
    format!(
        "- uid: waypoint\n  name: waypoint\n  namespace: default\n  serviceAccount: sa-waypoint\n  protocol: HBONE\n  workloadIps: [\"{WAYPOINT_IP}\"]\n  services: {{\"default/waypoint.default.svc.cluster.local\": {{15008: 15008}}}}\n\
         services:\n\
         - {{name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: [\"/10.96.0.30\"], ports: {{15008: 15008}}}}\n\
         - {{name: bw, namespace: default, hostname: bw.default.svc.cluster.local, vips: [\"/10.96.0.20\"], ports: {{80: 8090}}{bw_waypoint}}}\n"
    )
}

const BY_HOSTNAME: &str =
    ", waypoint: {destination: {hostname: {namespace: default, hostname: waypoint.default.svc.cluster.local}}}";
const BY_ADDRESS: &str = "{destination: {address: \"/10.198.0.2\"}, hboneMtlsPort: 15008}";

const VIP: &str = "10.96.0.20:80";

fn nodes(view: View, bw_waypoint: &str) -> TwoNodes {
    TwoNodes::start(Setup { view, yaml: waypoint_yaml(bw_waypoint), ..Setup::default() })
}

fn opened(nodes: &TwoNodes, node: usize, labels: &[(&str, &str)]) -> f64 {
    nodes.proxies[node].metric("istio_tcp_connections_opened_total", labels).expect("metrics")
}

#[test]
fn a_service_with_a_waypoint_is_reached_through_the_waypoint_naming_the_vip() {
    let nodes = nodes(MESHED, BY_HOSTNAME);
    let b = nodes.b(false, 8090);
    let waypoint = nodes.waypoint(&[format!("{VIP}={b}")]);
    let server = nodes.echo_in_b(b);
    let vip: SocketAddr = VIP.parse().expect("vip");
    assert_eq!(
        nodes.app_round_trip(vip, b"via the waypoint").expect("round trip"),
        b"via the waypoint"
    );
    // The waypoint saw pod a's identity asking for the VIP (it picks the endpoint), and pod b
    // was reached from the waypoint, not from pod a.
    let seen = waypoint.process.lines();
    let connect = format!("CONNECT {VIP} FROM spiffe://cluster.local/ns/default/sa/sa-a");
    assert!(seen.iter().any(|l| l.starts_with(&connect)), "{seen:?}");
    let from = server.join().expect("server").expect("io");
    assert_eq!(from.ip(), WAYPOINT_IP.parse::<IpAddr>().expect("ip"));
    // Node 1 counts the connection to the waypoint's workload, for the service asked.
    let counted = opened(
        &nodes,
        0,
        &[
            ("reporter", "source"),
            ("destination_workload", "waypoint"),
            ("destination_principal", "spiffe://cluster.local/ns/default/sa/sa-waypoint"),
            ("destination_service", "bw.default.svc.cluster.local"),
        ],
    );
    assert_eq!(counted, 1.0);
    // Node 2 counts it from the waypoint.
    let inbound =
        opened(&nodes, 1, &[("reporter", "destination"), ("source_workload", "waypoint")]);
    assert_eq!(inbound, 1.0);
}

#[test]
fn a_waypoint_named_by_address_is_reached_there() {
    let nodes = nodes(MESHED, &format!(", waypoint: {BY_ADDRESS}"));
    let b = nodes.b(false, 8090);
    let waypoint = nodes.waypoint(&[format!("{VIP}={b}")]);
    nodes.echo_server_in_b(b);
    let vip: SocketAddr = VIP.parse().expect("vip");
    assert_eq!(nodes.app_round_trip(vip, b"by address").expect("round trip"), b"by address");
    assert!(waypoint.process.lines().iter().any(|l| l.starts_with(&format!("CONNECT {VIP} "))));
}

#[test]
fn a_workload_with_a_waypoint_is_reached_through_it_for_its_own_address() {
    let nodes = nodes(View { b_waypoint: Some(BY_ADDRESS), ..MESHED }, "");
    let b = nodes.b(false, 8090);
    let waypoint = nodes.waypoint(&[]);
    let server = nodes.echo_in_b(b);
    assert_eq!(nodes.app_round_trip(b, b"to the pod").expect("round trip"), b"to the pod");
    let connect = format!("CONNECT {b} FROM spiffe://cluster.local/ns/default/sa/sa-a");
    let seen = waypoint.process.lines();
    assert!(seen.iter().any(|l| l.starts_with(&connect)), "{seen:?}");
    assert_eq!(
        server.join().expect("server").expect("io").ip(),
        WAYPOINT_IP.parse::<IpAddr>().expect("ip")
    );
}

#[test]
fn the_waypoints_own_connection_to_the_workload_it_serves_is_not_sent_back_to_it() {
    // Pod a is pod b's waypoint (pod b names pod a's address, and pod a has its identity): a
    // connection pod a makes to pod b is the waypoint's onward hop, so it goes to pod b.
    let a_is_waypoint = "{destination: {address: \"/10.199.0.1\"}}";
    let nodes = nodes(View { b_waypoint: Some(a_is_waypoint), ..MESHED }, "");
    let b = nodes.b(false, 8090);
    let server = nodes.echo_in_b(b);
    assert_eq!(nodes.app_round_trip(b, b"onward").expect("round trip"), b"onward");
    assert_eq!(server.join().expect("server").expect("io").ip(), IpAddr::from(nodes.pods.a_ip));
    // Node 1's proxy took no HBONE connection of pod a's to itself, and node 2 one from pod a.
    assert_eq!(opened(&nodes, 0, &[("reporter", "destination")]), 0.0, "looped to the waypoint");
    let sa_a = "spiffe://cluster.local/ns/default/sa/sa-a";
    assert_eq!(opened(&nodes, 1, &[("reporter", "destination"), ("source_principal", sa_a)]), 1.0);
}

#[test]
fn a_destination_whose_waypoint_is_unknown_is_refused_and_never_reached_directly() {
    let gone = ", waypoint: {destination: {hostname: {namespace: default, hostname: gone.default.svc.cluster.local}}}";
    let nodes = nodes(MESHED, gone);
    let b = nodes.b(false, 8090);
    let accepted = nodes.counting_echo_server_in_b(b);
    let vip: SocketAddr = VIP.parse().expect("vip");
    assert!(nodes.app_round_trip(vip, b"around it?").unwrap_or_default().is_empty());
    let refused = nodes.proxies[0]
        .metric("meshpath_connection_errors_total", &[("reason", "unknown_waypoint")])
        .expect("metrics");
    assert_eq!(refused, 1.0);
    assert_eq!(accepted.load(SeqCst), 0, "pod b's app was reached around the waypoint");
    // Control: the same app is reachable where no waypoint stands in the way.
    assert_eq!(nodes.app_round_trip(b, b"direct").expect("round trip"), b"direct");
    assert_eq!(accepted.load(SeqCst), 1);
}

#[test]
fn a_destination_whose_waypoint_is_down_is_refused_and_never_reached_directly() {
    // The waypoint is known but nothing answers at its address.
    let nodes = nodes(View { b_waypoint: Some(BY_ADDRESS), ..MESHED }, "");
    let waypoint = nodes.waypoint(&[]);
    drop(waypoint);
    let b = nodes.b(false, 8090);
    let accepted = nodes.counting_echo_server_in_b(b);
    assert!(nodes.app_round_trip(b, b"around it?").unwrap_or_default().is_empty());
    assert_eq!(accepted.load(SeqCst), 0, "pod b's app was reached around the waypoint");
    let failed = nodes.proxies[0].metrics().expect("metrics");
    assert!(
        failed
            .lines()
            .any(|l| l.starts_with("meshpath_connection_errors_total{") && !l.ends_with(" 0")),
        "no connection error counted:\n{failed}"
    );
}

#[test]
fn a_waypoint_removed_from_the_file_is_no_longer_in_the_way() {
    let nodes = nodes(View { b_waypoint: Some(BY_ADDRESS), ..MESHED }, "");
    let b = nodes.b(false, 8090);
    let waypoint = nodes.waypoint(&[]);
    nodes.echo_server_in_b(b);
    assert_eq!(nodes.app_round_trip(b, b"through").expect("round trip"), b"through");
    assert_eq!(waypoint.process.lines().iter().filter(|l| l.starts_with("CONNECT ")).count(), 1);
    nodes.write_workloads(1, &nodes.workloads(&MESHED, &waypoint_yaml("")));
    let reloaded = nodes.proxies[0].wait_metrics(Duration::from_secs(10), |m| {
        m.contains("meshpath_config_reloads_total{direction=\"-\",reason=\"ok\"} 1")
    });
    assert!(reloaded, "node 1 did not reload its workload file");
    assert_eq!(nodes.app_round_trip(b, b"direct").expect("round trip"), b"direct");
    let connects = waypoint.process.lines().iter().filter(|l| l.starts_with("CONNECT ")).count();
    assert_eq!(connects, 1, "the waypoint was still in the way");
}

/// Whether node 1's proxy holds pod b with a waypoint.
fn b_has_waypoint(nodes: &TwoNodes) -> bool {
    let dump = nodes.proxies[0].config_dump().expect("config dump");
    dump["workloads"].as_array().is_some_and(|ws| {
        ws.iter().any(|w| w["uid"] == "pod-b" && w.get("waypoint").is_some_and(|v| !v.is_null()))
    })
}

#[test]
fn a_waypoint_istiod_takes_away_by_a_delta_is_no_longer_in_the_way() {
    let nodes = TwoNodes::start(Setup { istiod: true, ..Setup::default() });
    // Until ready, a proxy istiod configures may not serve its pods yet (pod b's HBONE port
    // among them: the waypoint's onward connection would be refused).
    assert!(nodes.wait_ready(Duration::from_secs(30)), "not ready");
    let istiod = nodes.istiod();
    istiod.set_workload(wl::Workload {
        uid: "waypoint".into(),
        name: "waypoint".into(),
        namespace: "default".into(),
        service_account: "sa-waypoint".into(),
        addresses: vec![vec![10, 198, 0, 2].into()],
        tunnel_protocol: wl::TunnelProtocol::Hbone as i32,
        ..Default::default()
    });
    let mut b = nodes.xds_workloads(&MESHED).remove(1);
    b.waypoint = Some(wl::GatewayAddress {
        destination: Some(wl::gateway_address::Destination::Address(wl::NetworkAddress {
            network: String::new(),
            address: vec![10, 198, 0, 2].into(),
        })),
        hbone_mtls_port: 15008,
    });
    istiod.set_workload(b.clone());
    assert!(wait_until(Duration::from_secs(20), || b_has_waypoint(&nodes)), "never pushed");
    let dst = nodes.b(false, 8090);
    let waypoint = nodes.waypoint(&[]);
    nodes.echo_server_in_b(dst);
    let through = nodes.app_round_trip(dst, b"through");
    assert_eq!(
        through.as_deref().ok(),
        Some(&b"through"[..]),
        "{through:?}: {:#?}",
        waypoint.process.lines()
    );
    let connects = || waypoint.process.lines().iter().filter(|l| l.starts_with("CONNECT ")).count();
    let through_waypoint = connects();
    assert!(through_waypoint >= 1, "not through the waypoint");
    b.waypoint = None;
    istiod.set_workload(b);
    assert!(wait_until(Duration::from_secs(20), || !b_has_waypoint(&nodes)), "never taken away");
    assert_eq!(nodes.app_round_trip(dst, b"direct").expect("round trip"), b"direct");
    assert_eq!(connects(), through_waypoint, "the waypoint was still in the way");
}
