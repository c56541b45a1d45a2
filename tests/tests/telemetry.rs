//! What the proxy tells its operator: Istio's `istio_tcp_*` metrics with the standard labels on
//! both sides of a connection, one access-log line per connection, `/config_dump`, `/logging`,
//! readiness, and `/quitquitquit`.

use std::{
    io::{Read as _, Write as _},
    time::Duration,
};

use meshpath_tests::two_nodes::{TwoNodes, MESHED};

/// One 1000-byte round trip from pod a to pod b over HBONE, waited for until both proxies
/// counted it closed.
fn one_connection() -> TwoNodes {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8095);
    nodes.echo_server_in_b(dst);
    let payload = vec![7u8; 1000];
    assert_eq!(nodes.app_round_trip(dst, &payload).expect("round trip"), payload);
    for p in &nodes.proxies {
        let closed = p.wait_metrics(Duration::from_secs(10), |m| {
            m.lines()
                .any(|l| l.starts_with("istio_tcp_connections_closed_total{") && l.ends_with(" 1"))
        });
        assert!(closed, "a proxy did not count the connection closed");
    }
    nodes
}

#[test]
fn a_connection_is_counted_by_the_source_proxy_with_istio_labels() {
    let nodes = one_connection();
    let labels = [
        ("reporter", "source"),
        ("source_workload", "app-a"),
        ("source_workload_namespace", "default"),
        ("source_principal", "spiffe://cluster.local/ns/default/sa/sa-a"),
        ("destination_workload", "app-b"),
        ("destination_principal", "spiffe://cluster.local/ns/default/sa/sa-b"),
        ("request_protocol", "tcp"),
        ("connection_security_policy", "mutual_tls"),
    ];
    let m = &nodes.proxies[0];
    assert_eq!(m.metric("istio_tcp_connections_opened_total", &labels).expect("metrics"), 1.0);
    assert_eq!(m.metric("istio_tcp_connections_closed_total", &labels).expect("metrics"), 1.0);
    assert_eq!(m.metric("istio_tcp_received_bytes_total", &labels).expect("metrics"), 1000.0);
    assert_eq!(m.metric("istio_tcp_sent_bytes_total", &labels).expect("metrics"), 1000.0);
}

#[test]
fn a_connection_is_counted_by_the_destination_proxy_with_the_client_identity() {
    let nodes = one_connection();
    let labels = [
        ("reporter", "destination"),
        ("source_workload", "app-a"),
        ("source_principal", "spiffe://cluster.local/ns/default/sa/sa-a"),
        ("destination_workload", "app-b"),
        ("connection_security_policy", "mutual_tls"),
    ];
    let m = &nodes.proxies[1];
    assert_eq!(m.metric("istio_tcp_connections_opened_total", &labels).expect("metrics"), 1.0);
    assert_eq!(m.metric("istio_tcp_received_bytes_total", &labels).expect("metrics"), 1000.0);
    assert_eq!(m.metric("meshpath_active_connections", &[]).expect("metrics"), 0.0);
}

/// Node `node`'s one access line for the connection, checked for every field of `fields`.
fn assert_one_access_line(nodes: &TwoNodes, node: usize, fields: &[&str]) {
    // The line may reach the proxy's log reader after the metrics said the connection closed.
    nodes.proxies[node].proxy.wait_for_text("connection complete", Duration::from_secs(10));
    let lines = nodes.proxies[node].proxy.lines();
    let access: Vec<&String> = lines.iter().filter(|l| l.contains("connection complete")).collect();
    assert_eq!(access.len(), 1, "node {node}'s access lines:\n{}", lines.join("\n"));
    let line = access[0];
    for field in fields {
        assert!(line.contains(field), "{field} missing from node {node}'s line: {line}");
    }
}

#[test]
fn each_connection_writes_one_access_log_line_with_both_identities() {
    let nodes = one_connection();
    assert_one_access_line(
        &nodes,
        0,
        &[
            "src.workload=app-a",
            "src.identity=spiffe://cluster.local/ns/default/sa/sa-a",
            "dst.workload=app-b",
            "dst.identity=spiffe://cluster.local/ns/default/sa/sa-b",
            &format!("dst.hbone_addr={}", nodes.b(false, 15008)),
            &format!("dst.addr={}", nodes.b(false, 8095)),
            "bytes_sent=1000",
            "bytes_recv=1000",
            "outbound",
            // The rest of the fields Kiali's and Istio's dashboards' log queries read, as
            // ztunnel writes them.
            "src.namespace=default",
            "dst.namespace=default",
            "duration=",
        ],
    );
}

/// The destination's line names the addresses as the source's does: an IPv4 pod's HBONE
/// address in IPv4 form, as the pod knows it, not as the dual-stack listener saw it.
#[test]
fn the_destination_proxy_writes_one_access_log_line_with_the_addresses_in_ipv4_form() {
    let nodes = one_connection();
    assert_one_access_line(
        &nodes,
        1,
        &[
            "src.workload=app-a",
            "src.identity=spiffe://cluster.local/ns/default/sa/sa-a",
            "dst.workload=app-b",
            &format!("dst.hbone_addr={}", nodes.b(false, 15008)),
            &format!("dst.addr={}", nodes.b(false, 8095)),
            "inbound",
        ],
    );
}

#[test]
fn config_dump_shows_the_store_the_pods_their_certificates_and_the_pool() {
    let nodes = one_connection();
    let dump = nodes.proxies[0].config_dump().expect("config_dump");
    assert_eq!(dump["workloads"].as_array().map(Vec::len), Some(2), "{dump:#}");
    let pod = &dump["pods"][0];
    assert_eq!(pod["uid"], "pod-a");
    assert_eq!(pod["identity"], "spiffe://cluster.local/ns/default/sa/sa-a");
    assert!(pod["certificate"]["expiresInSeconds"].as_i64().is_some_and(|s| s > 0), "{dump:#}");
    assert_eq!(dump["pool"].as_array().map(Vec::len), Some(1), "{dump:#}");
    assert_eq!(dump["pool"][0]["destination"], "spiffe://cluster.local/ns/default/sa/sa-b");
    assert_eq!(dump["pool"][0]["streams"], 0);
}

#[test]
fn the_log_filter_can_be_changed_at_run_time() {
    let nodes = TwoNodes::new(MESHED);
    let p = &nodes.proxies[0];
    let (status, body) = p.http("ADMIN", "POST", "/logging?level=debug").expect("POST");
    assert_eq!((status, body.trim()), (200, "debug"));
    assert_eq!(p.http("ADMIN", "GET", "/logging").expect("GET").1.trim(), "debug");
    let (status, body) = p.http("ADMIN", "POST", "/logging?level=[[[").expect("POST");
    assert_eq!(status, 400, "{body}");
    assert_eq!(p.http("ADMIN", "GET", "/logging").expect("GET").1.trim(), "debug");
}

#[test]
fn readiness_is_200_while_serving_and_503_while_draining() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8096);
    nodes.echo_server_in_b(dst);
    let p = &nodes.proxies[0];
    assert_eq!(p.http("READINESS", "GET", "/healthz/ready").expect("ready").0, 200);
    // An open connection keeps the proxy draining after SIGTERM. Its echo comes back through
    // both proxies first: a connection still in the listener's backlog when the signal lands
    // is not one the proxy carries, and it would exit at once (as it did in one CI run).
    let mut open = nodes.connect_from_a(dst).expect("connect");
    open.write_all(b"x").expect("send");
    let mut echo = [0u8; 1];
    open.read_exact(&mut echo).expect("the echo, through both proxies");
    p.proxy.signal(libc::SIGTERM).expect("SIGTERM");
    let mut status = 0;
    for _ in 0..100 {
        status = p.http("READINESS", "GET", "/healthz/ready").map(|r| r.0).unwrap_or(0);
        if status == 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(status, 503, "readiness while draining");
}

#[test]
fn quitquitquit_drains_and_exits() {
    let mut nodes = TwoNodes::new(MESHED);
    let (status, _) = nodes.proxies[0].http("ADMIN", "POST", "/quitquitquit").expect("POST");
    assert_eq!(status, 200);
    assert!(nodes.proxies[0].proxy.wait_exit(Duration::from_secs(10)), "still running");
}

/// Node 1's file with pod b as a pod (`app-b-7f9c5`) of workload `b-deploy`, or without pod b.
fn node1_sees_b_as_a_pod_of_b_deploy(nodes: &TwoNodes, present: bool) {
    let text = nodes.workloads(&MESHED, "");
    let text = text.replace("name: app-b\n", "name: app-b-7f9c5\n  workloadName: b-deploy\n");
    let text = if present {
        text
    } else {
        // Pod b's entry (the second of the list) removed.
        let (head, rest) = text.split_once("- uid: pod-b").expect("pod b's entry");
        let tail = rest.find("\n- ").map_or("", |i| &rest[i + 1..]);
        format!("{head}{tail}")
    };
    nodes.write_workloads(1, &text);
}

#[test]
fn connections_are_labelled_by_workload_not_by_pod() {
    let nodes = TwoNodes::new(MESHED);
    node1_sees_b_as_a_pod_of_b_deploy(&nodes, true);
    assert!(nodes.proxies[0]
        .proxy
        .wait_for_text("workload store reloaded", Duration::from_secs(10)));
    let dst = nodes.b(false, 8096);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"hi").expect("round trip"), b"hi");
    let node1 = &nodes.proxies[0];
    let by_workload = node1.wait_metrics(Duration::from_secs(10), |m| {
        meshpath_tests::sum_metric(
            m,
            "istio_tcp_connections_closed_total",
            &[("destination_workload", "b-deploy")],
        ) == 1.0
    });
    assert!(by_workload, "{}", node1.metrics().unwrap_or_default());
    let text = node1.metrics().expect("metrics");
    assert!(!text.contains("app-b-7f9c5"), "a pod name became a label:\n{text}");
}

#[test]
fn the_series_of_a_workload_that_left_are_removed() {
    let nodes = TwoNodes::new(MESHED);
    node1_sees_b_as_a_pod_of_b_deploy(&nodes, true);
    let node1 = &nodes.proxies[0];
    assert!(node1.proxy.wait_for_text("workload store reloaded", Duration::from_secs(10)));
    let dst = nodes.b(false, 8097);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"hi").expect("round trip"), b"hi");
    let series =
        |m: &str| m.lines().filter(|l| l.contains("destination_workload=\"b-deploy\"")).count();
    assert!(node1.wait_metrics(Duration::from_secs(10), |m| series(m) > 0), "no series");
    node1_sees_b_as_a_pod_of_b_deploy(&nodes, false);
    let gone = node1.wait_metrics(Duration::from_secs(10), |m| series(m) == 0);
    assert!(gone, "{}", node1.metrics().unwrap_or_default());
}
