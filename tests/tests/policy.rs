//! L4 authorization at the destination's proxy, on real traffic between two nodes: DENY and
//! ALLOW policies over HBONE (answered 401, the app never reached), plaintext refused where mTLS
//! is required, and policies changed at run time by rewriting the workload file.

use std::{net::TcpListener, time::Duration};

use meshpath_tests::two_nodes::{Setup, TwoNodes, View, MESHED};

fn with_policy(policy: &str) -> TwoNodes {
    TwoNodes::start(Setup { yaml: format!("policies:\n{policy}"), ..Setup::default() })
}

/// Whether a listener was connected to (non-blocking check).
fn reached(listener: &TcpListener) -> bool {
    listener.set_nonblocking(true).expect("nonblocking");
    listener.accept().is_ok()
}

const DENY_8091: &str = "- {name: no-8091, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [8091]}]]]}\n";

#[test]
fn a_deny_policy_refuses_the_connection_with_401_and_counts_it() {
    let nodes = with_policy(DENY_8091);
    let listener = nodes.pods.b.listen(nodes.b(false, 8091)).expect("bind");
    let back = nodes.app_round_trip(nodes.b(false, 8091), b"denied?").unwrap_or_default();
    assert!(back.is_empty(), "data came back through a denied connection");
    assert!(!reached(&listener), "the app was reached");
    let denied = nodes.proxies[1]
        .metric("meshpath_connection_errors_total", &[("reason", "policy_denied")])
        .expect("metrics");
    assert_eq!(denied, 1.0, "node 2 did not count the denial");
    let told = nodes.proxies[0]
        .metric("meshpath_connection_errors_total", &[("reason", "hbone_denied")])
        .expect("metrics");
    assert_eq!(told, 1.0, "node 1 did not see the 401");
}

#[test]
fn a_deny_policy_leaves_other_ports_alone() {
    let nodes = with_policy(DENY_8091);
    let dst = nodes.b(false, 8092);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"allowed").expect("round trip"), b"allowed");
}

#[test]
fn an_allow_policy_admits_the_principals_it_names_and_no_other() {
    let allow = |sa: &str| {
        format!("- {{name: only, namespace: default, scope: Global, action: Allow, rules: [[[{{principals: [\"cluster.local/ns/default/sa/{sa}\"]}}]]]}}\n")
    };
    let nodes = with_policy(&allow("sa-a"));
    let dst = nodes.b(false, 8093);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"sa-a ok").expect("round trip"), b"sa-a ok");

    let nodes = with_policy(&allow("someone-else"));
    let dst = nodes.b(false, 8093);
    let listener = nodes.pods.b.listen(dst).expect("bind");
    assert!(nodes.app_round_trip(dst, b"no").unwrap_or_default().is_empty());
    assert!(!reached(&listener), "the app was reached by a principal not allowed");
}

#[test]
fn plaintext_is_refused_when_the_destination_requires_mtls() {
    // Node 1 sends plain TCP (pod b unmeshed in its view); pod b is captured inbound and its
    // namespace requires mTLS (Istio's STRICT, as a DENY of "no principal").
    let strict = "policies:\n- {name: strict, namespace: default, scope: Namespace, action: Deny, rules: [[[{notPrincipals: [\"*\"]}]]]}\n";
    let nodes = TwoNodes::start(Setup {
        view: View { b_protocol: "TCP", b_inbound_captured: true, ..MESHED },
        yaml: strict.into(),
        ..Setup::default()
    });
    let dst = nodes.b(false, 8094);
    let listener = nodes.pods.b.listen(dst).expect("bind");
    let back = nodes.app_round_trip(dst, b"plain");
    assert!(back.unwrap_or_default().is_empty(), "plaintext was carried");
    assert!(!reached(&listener), "the app was reached in plaintext");
    let denied = nodes.proxies[1]
        .metric("meshpath_connection_errors_total", &[("reason", "policy_denied")])
        .expect("metrics");
    assert_eq!(denied, 1.0);
}

/// node 2's count of connections its policy denied.
fn denied(nodes: &TwoNodes) -> f64 {
    nodes.proxies[1]
        .metric("meshpath_connection_errors_total", &[("reason", "policy_denied")])
        .expect("metrics")
}

#[test]
fn a_policy_written_while_running_applies_to_new_connections() {
    use std::sync::atomic::Ordering::SeqCst;
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8091);
    let accepted = nodes.counting_echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"before").expect("round trip"), b"before");
    assert_eq!(accepted.load(SeqCst), 1);
    nodes.write_workloads(2, &nodes.workloads(&MESHED, &format!("policies:\n{DENY_8091}")));
    let reloaded = nodes.proxies[1].wait_metrics(Duration::from_secs(10), |m| {
        m.contains("meshpath_config_reloads_total{direction=\"-\",reason=\"ok\"} 1")
    });
    assert!(reloaded, "node 2 did not reload its workload file");
    assert!(nodes.app_round_trip(dst, b"after").unwrap_or_default().is_empty(), "still allowed");
    assert_eq!(accepted.load(SeqCst), 1, "the app was reached after the DENY was written");
    assert_eq!(denied(&nodes), 1.0, "node 2 did not count the denial");
}

#[test]
fn a_workload_file_that_does_not_parse_is_reported_and_the_previous_one_kept() {
    let nodes = with_policy(DENY_8091);
    nodes.write_workloads(2, "workloads:\n- uid: broken\n  namespace: default\n");
    let reported = nodes.proxies[1].wait_metrics(Duration::from_secs(10), |m| {
        m.contains("meshpath_config_reloads_total{direction=\"-\",reason=\"error\"} 1")
    });
    assert!(reported, "the bad file was not reported");
    // The metric can be counted a moment before the proxy's log line reaches the test.
    let proxy = &nodes.proxies[1].proxy;
    let named = proxy.wait_for_text(
        "line 2, column 3: workloads[0]: missing field `serviceAccount`",
        Duration::from_secs(5),
    );
    assert!(named, "the error does not name the line and field:\n{}", proxy.lines().join("\n"));
    // The previous store is still in force: pod b is known, and the policy still denies.
    let allowed = nodes.b(false, 8092);
    nodes.echo_server_in_b(allowed);
    assert_eq!(nodes.app_round_trip(allowed, b"still").expect("round trip"), b"still");
    let denied = nodes.pods.b.listen(nodes.b(false, 8091)).expect("bind");
    assert!(nodes.app_round_trip(nodes.b(false, 8091), b"x").unwrap_or_default().is_empty());
    assert!(!reached(&denied), "the policy from before the bad file was dropped");
}

#[test]
fn a_workload_selecting_a_policy_after_a_reload_is_held_to_it() {
    let policy = "policies:\n- {name: nobody, namespace: default, scope: WorkloadSelector, action: Allow, rules: [[[{principals: [\"cluster.local/ns/default/sa/nobody\"]}]]]}\n";
    let nodes = with_policy(policy.trim_start_matches("policies:\n"));
    let dst = nodes.b(false, 8096);
    let accepted = nodes.counting_echo_server_in_b(dst);
    // Pod b does not select the policy yet: allowed.
    assert_eq!(nodes.app_round_trip(dst, b"before").expect("round trip"), b"before");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Now it does (the store changed, the pod was not re-added): only `nobody` may connect.
    let selecting = nodes.workloads(&MESHED, policy).replace(
        "  services: {\"default/b.default.svc.cluster.local\": {80: 8090}}\n",
        "  services: {\"default/b.default.svc.cluster.local\": {80: 8090}}\n  authorizationPolicies: [default/nobody]\n",
    );
    assert!(selecting.contains("authorizationPolicies"), "{selecting}");
    nodes.write_workloads(2, &selecting);
    let reloaded = nodes.proxies[1].wait_metrics(Duration::from_secs(10), |m| {
        m.contains("meshpath_config_reloads_total{direction=\"-\",reason=\"ok\"} 1")
    });
    assert!(reloaded, "node 2 did not reload its workload file");
    assert!(nodes.app_round_trip(dst, b"after").unwrap_or_default().is_empty(), "still allowed");
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the app was reached by a principal the selected policy does not allow"
    );
    assert_eq!(denied(&nodes), 1.0, "node 2 did not count the denial");
}

#[test]
fn a_deny_written_into_the_workload_file_closes_an_open_connection_it_denies() {
    use std::io::{Read as _, Write as _};
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8094);
    nodes.echo_server_in_b(dst);
    let mut live = nodes.connect_from_a(dst).expect("connect");
    let mut buf = [0u8; 4];
    live.write_all(b"ping").expect("write");
    live.read_exact(&mut buf).expect("allowed before the change");
    let deny = "- {name: no-8094, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [8094]}]]]}\n";
    nodes.write_workloads(2, &nodes.workloads(&MESHED, &format!("policies:\n{deny}")));
    let changed = std::time::Instant::now();
    let closed = loop {
        if live.write_all(b"ping").is_err() {
            break true;
        }
        match meshpath_tests::again_after_eintr(|| live.read(&mut buf)) {
            Ok(0) | Err(_) => break true,
            Ok(_) if changed.elapsed() > Duration::from_secs(10) => break false,
            Ok(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    assert!(closed, "the connection the new DENY covers stayed open");
    let denied = nodes.proxies[1]
        .metric("meshpath_connection_errors_total", &[("reason", "policy_denied")])
        .expect("metrics");
    assert_eq!(denied, 1.0, "the closure was not counted once");
}

#[test]
fn a_policy_change_leaves_open_connections_it_still_allows() {
    use std::io::{Read as _, Write as _};
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8096);
    nodes.echo_server_in_b(dst);
    let mut live = nodes.connect_from_a(dst).expect("connect");
    let mut buf = [0u8; 4];
    // A DENY for another port: the connection must survive the recheck.
    nodes.write_workloads(2, &nodes.workloads(&MESHED, &format!("policies:\n{DENY_8091}")));
    let reloaded = nodes.proxies[1].wait_metrics(Duration::from_secs(10), |m| {
        meshpath_tests::sum_metric(m, "meshpath_config_reloads_total", &[("reason", "ok")]) >= 1.0
    });
    assert!(reloaded, "node 2 never reloaded its file");
    live.write_all(b"ping").expect("write after the change");
    live.read_exact(&mut buf).expect("still open after the change");
    assert_eq!(&buf, b"ping");
}
