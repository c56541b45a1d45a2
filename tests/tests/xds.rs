//! meshpath-proxy joined to Istio's control plane, as ztunnel is: workloads, services and
//! policies over istiod's delta xDS stream, workload certificates from istiod's CA. istiod
//! cannot run here: its stand-in (tests/src/istiod.rs) serves the real protos, records what
//! the proxies send, and signs with a CA of its own. Two nodes, pods a and b, real traffic.

use std::{
    io::{Read as _, Write as _},
    time::{Duration, Instant},
};

use meshpath_tests::{
    istiod::Istiod,
    two_nodes::{Setup, TwoNodes},
    wait_until,
};
use meshpath_xds::{security as sec, workload as wl, ADDRESS_TYPE, AUTHORIZATION_TYPE};
use prost::Message as _;

const PORT: u16 = 8095;

fn istiod(before: Option<fn(&Istiod)>) -> TwoNodes {
    TwoNodes::start(Setup { istiod: true, istiod_before: before, ..Setup::default() })
}

fn ready(nodes: &TwoNodes, i: usize) -> bool {
    nodes.ready(i)
}

/// What the DaemonSet's liveness probe asks: 200 while the process answers, ready or not.
fn live(nodes: &TwoNodes, i: usize) -> bool {
    nodes.proxies[i].http("READINESS", "GET", "/healthz/live").is_ok_and(|(s, _)| s == 200)
}

fn held_uids(nodes: &TwoNodes, i: usize) -> Vec<String> {
    let dump = nodes.proxies[i].config_dump().expect("config dump");
    dump["workloads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["uid"].as_str().map(str::to_owned))
        .collect()
}

/// Pod a to pod b:PORT over HBONE (an echo server in b).
fn round_trip(nodes: &TwoNodes) -> std::io::Result<Vec<u8>> {
    nodes.app_round_trip(nodes.b(false, PORT), b"through istiod's view")
}

#[test]
fn the_proxy_turns_ready_only_once_both_types_have_been_applied() {
    let nodes = istiod(Some(|i| i.withhold(AUTHORIZATION_TYPE, true)));
    // Workloads arrive and are acknowledged, policies do not come: not ready.
    assert!(wait_until(Duration::from_secs(20), || held_uids(&nodes, 0).contains(&"pod-b".into())));
    let acked = nodes.istiod().wait_received(Duration::from_secs(20), |r| {
        r.type_url == ADDRESS_TYPE && !r.nonce.is_empty() && r.error.is_none()
    });
    assert!(acked.is_some(), "the Address response was never acknowledged");
    assert!(!ready(&nodes, 0), "ready without istiod's policies");
    let (_, why) = nodes.proxies[0].http("READINESS", "GET", "/healthz/ready").expect("readiness");
    assert!(why.contains("istiod's Authorization") && !why.contains("Address"), "{why}");
    assert!(live(&nodes, 0), "a proxy waiting for its first push is not alive to the kubelet");
    nodes.istiod().withhold(AUTHORIZATION_TYPE, false);
    assert!(wait_until(Duration::from_secs(20), || ready(&nodes, 0)), "not ready after both types");
}

#[test]
fn a_first_push_with_a_refused_resource_leaves_the_proxy_unready_until_istiod_sends_one_it_takes() {
    // As ztunnel: a type counts once a response of it is accepted whole. Serving on a first push
    // with a refused policy could let through what that policy denies.
    let nodes = istiod(Some(|i| i.set_address_raw("not-a-message", vec![0xff, 0xff, 0xff])));
    let nack = nodes.istiod().wait_received(Duration::from_secs(20), |r| r.error.is_some());
    assert!(nack.is_some_and(|n| n.type_url == ADDRESS_TYPE), "the bad resource was not NACKed");
    let policies = nodes.istiod().wait_received(Duration::from_secs(20), |r| {
        r.type_url == AUTHORIZATION_TYPE && !r.nonce.is_empty() && r.error.is_none()
    });
    assert!(policies.is_some(), "the policies were not acknowledged");
    let (code, why) =
        nodes.proxies[0].http("READINESS", "GET", "/healthz/ready").expect("readiness");
    assert_eq!(code, 503, "ready on a first push it refused part of: {why}");
    assert!(why.contains("istiod's Address"), "{why}");
    assert!(live(&nodes, 0), "a proxy that refused a resource is not alive to the kubelet");
    nodes.istiod().remove_address("not-a-message");
    assert!(
        wait_until(Duration::from_secs(20), || ready(&nodes, 0)),
        "not ready once istiod sent a response it takes"
    );
}

#[test]
fn the_stream_opens_with_one_wildcard_request_per_type_carrying_the_node_and_the_token() {
    let nodes = istiod(None);
    let first = nodes
        .istiod()
        .wait_received(Duration::from_secs(20), |r| r.type_url == ADDRESS_TYPE)
        .expect("an Address request");
    assert!(first.nonce.is_empty() && first.initial_versions.is_empty(), "{first:?}");
    let node = first.node_id.clone().unwrap_or_default();
    assert!(node.starts_with("ztunnel~") && node.ends_with(".svc.cluster.local"), "{node}");
    for key in ["NAME", "NAMESPACE", "INSTANCE_IPS", "NODE_NAME"] {
        assert!(first.node_metadata.iter().any(|k| k == key), "{key} missing: {first:?}");
    }
    assert_eq!(first.authorization.as_deref(), Some("Bearer node-token"));
    assert_eq!(first.cluster_id.as_deref(), Some("Kubernetes"));
    let policies =
        nodes.istiod().wait_received(Duration::from_secs(20), |r| r.type_url == AUTHORIZATION_TYPE);
    assert!(policies.is_some(), "no Authorization request");
}

#[test]
fn pods_reach_each_other_over_hbone_with_workloads_and_certificates_from_istiod() {
    let nodes = istiod(None);
    nodes.echo_server_in_b(nodes.b(false, PORT));
    assert!(
        wait_until(Duration::from_secs(30), || ready(&nodes, 0) && ready(&nodes, 1)),
        "not ready"
    );
    let back = round_trip(&nodes).expect("round trip");
    assert_eq!(back, b"through istiod's view");
    let m = nodes.proxies[1].metrics().expect("metrics");
    assert!(m.contains("connection_security_policy=\"mutual_tls\""), "no mTLS connection counted");
    // Each identity's key was made on its node; the CA was asked on the pod's behalf.
    let csrs = nodes.istiod().csrs();
    for sa in ["sa-a", "sa-b"] {
        let id = format!("spiffe://cluster.local/ns/default/sa/{sa}");
        assert!(
            csrs.iter().any(|c| c.impersonated.as_deref() == Some(&id) && c.sans == [id.clone()]),
            "no CSR for {id}: {csrs:?}"
        );
    }
}

fn workload(uid: &str, sa: &str) -> wl::Workload {
    wl::Workload {
        uid: uid.into(),
        name: uid.into(),
        namespace: "default".into(),
        service_account: sa.into(),
        addresses: vec![vec![10, 250, 0, 9].into()],
        tunnel_protocol: wl::TunnelProtocol::Hbone as i32,
        ..Default::default()
    }
}

#[test]
fn a_delta_adds_updates_and_removes_a_workload() {
    let nodes = istiod(None);
    assert!(wait_until(Duration::from_secs(20), || ready(&nodes, 0)));
    nodes.istiod().set_workload(workload("pod-c", "sa-c"));
    assert!(wait_until(Duration::from_secs(10), || held_uids(&nodes, 0).contains(&"pod-c".into())));
    nodes.istiod().set_workload(workload("pod-c", "sa-c2"));
    let sa_of_c = || {
        let dump = nodes.proxies[0].config_dump().expect("dump");
        dump["workloads"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| w["uid"] == "pod-c")
            .map(|w| w["serviceAccount"].as_str().unwrap_or_default().to_owned())
    };
    assert!(
        wait_until(Duration::from_secs(10), || sa_of_c().as_deref() == Some("sa-c2")),
        "not updated"
    );
    nodes.istiod().remove_address("pod-c");
    assert!(wait_until(Duration::from_secs(10), || !held_uids(&nodes, 0).contains(&"pod-c".into())));
    assert!(held_uids(&nodes, 0).contains(&"pod-a".into()), "the removal took others with it");
}

#[test]
fn a_malformed_resource_is_nacked_with_its_name_and_reason_and_the_rest_applied() {
    let nodes = istiod(None);
    assert!(wait_until(Duration::from_secs(20), || ready(&nodes, 0)));
    let mut bad = workload("pod-bad", "sa");
    bad.addresses = vec![vec![1, 2, 3, 4, 5].into()];
    let wrap = |w: wl::Workload| {
        wl::Address { r#type: Some(wl::address::Type::Workload(w)) }.encode_to_vec()
    };
    nodes.istiod().set_addresses_raw(vec![
        ("pod-bad".into(), wrap(bad)),
        ("pod-good".into(), wrap(workload("pod-good", "sa"))),
        ("not-a-message".into(), vec![0xff, 0xff, 0xff]),
    ]);
    let nack = nodes
        .istiod()
        .wait_received(Duration::from_secs(10), |r| r.error.is_some())
        .expect("a NACK");
    let msg = nack.error.unwrap_or_default();
    assert!(msg.contains("pod-bad: failed to parse address, had 5 bytes"), "{msg}");
    assert!(msg.contains("not-a-message: decode"), "{msg}");
    assert!(!msg.contains("pod-good"), "{msg}");
    assert!(
        wait_until(Duration::from_secs(10), || held_uids(&nodes, 0).contains(&"pod-good".into()))
    );
    assert!(!held_uids(&nodes, 0).contains(&"pod-bad".into()));
}

#[test]
fn on_reconnect_the_proxy_sends_the_versions_it_holds_and_keeps_serving_meanwhile() {
    let mut nodes = istiod(None);
    nodes.echo_server_in_b(nodes.b(false, PORT));
    assert!(wait_until(Duration::from_secs(30), || ready(&nodes, 0) && ready(&nodes, 1)));
    let before = nodes.istiod().received().len();
    nodes.istiod.as_mut().expect("istiod").stop();
    assert!(wait_until(Duration::from_secs(10), || {
        nodes.proxies[0].metric("meshpath_xds_connected", &[]).is_ok_and(|v| v == 0.0)
    }));
    // istiod away: the state held keeps serving.
    assert_eq!(round_trip(&nodes).expect("round trip with istiod down"), b"through istiod's view");
    assert!(ready(&nodes, 0), "unready while istiod is away");
    nodes.istiod.as_mut().expect("istiod").restart().expect("restart");
    let again = nodes
        .istiod()
        .wait_received(Duration::from_secs(30), |r| {
            r.type_url == ADDRESS_TYPE && !r.initial_versions.is_empty()
        })
        .expect("a reconnect with versions");
    assert!(nodes.istiod().received().len() > before);
    for uid in ["pod-a", "pod-b"] {
        assert!(
            again.initial_versions.contains_key(uid),
            "{uid} not in {:?}",
            again.initial_versions
        );
    }
}

#[test]
fn a_refused_token_keeps_the_proxy_unready_until_a_good_one_is_in_the_file() {
    let nodes = istiod(Some(|i| i.require_tokens(&["good-token"])));
    let refused = wait_until(Duration::from_secs(20), || {
        let log = nodes.proxies[0].proxy.lines().join("\n");
        log.contains("xDS stream failed") && log.to_lowercase().contains("token")
    });
    assert!(refused, "no refusal logged: {}", nodes.proxies[0].proxy.lines().join("\n"));
    assert!(!ready(&nodes, 0), "ready with a token istiod refuses");
    assert!(live(&nodes, 0), "a proxy istiod refuses is not alive to the kubelet");
    // The token file is read for each call: rotating it is enough.
    std::fs::write(nodes.istiod().dir().join("node1-token"), "good-token").expect("write token");
    assert!(
        wait_until(Duration::from_secs(30), || ready(&nodes, 0)),
        "not ready with a good token"
    );
}

#[test]
fn a_certificate_naming_another_identity_is_refused() {
    let nodes =
        istiod(Some(|i| i.sign_wrong_san(Some("spiffe://cluster.local/ns/default/sa/mallory"))));
    nodes.echo_server_in_b(nodes.b(false, PORT));
    assert!(
        wait_until(Duration::from_secs(20), || {
            nodes.proxies[0]
                .metric("meshpath_ca_requests_total", &[("reason", "error")])
                .is_ok_and(|v| v >= 1.0)
        }),
        "no refused answer counted"
    );
    assert!(round_trip(&nodes).is_err(), "traffic flowed with a certificate for another identity");
    let log = nodes.proxies[0].proxy.lines().join("\n");
    assert!(log.contains("mallory") && log.contains("refused"), "{log}");
}

#[test]
fn a_short_lived_certificate_is_renewed_under_a_live_connection() {
    let nodes = istiod(Some(|i| i.set_ttl(Some(Duration::from_secs(8)))));
    nodes.echo_server_in_b(nodes.b(false, PORT));
    assert!(wait_until(Duration::from_secs(30), || ready(&nodes, 0) && ready(&nodes, 1)));
    let mut live = nodes.connect_from_a(nodes.b(false, PORT)).expect("connect");
    let asked = nodes.istiod().csrs().len();
    let started = Instant::now();
    let mut buf = [0u8; 4];
    // Half of 8 s, jittered: renewals within ~5 s; the connection carries on throughout.
    while started.elapsed() < Duration::from_secs(12) {
        live.write_all(b"ping").expect("write on the live connection");
        live.read_exact(&mut buf).expect("read on the live connection");
        assert_eq!(&buf, b"ping");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(nodes.istiod().csrs().len() > asked, "no certificate renewed");
    assert!(
        nodes.proxies[0].metric("meshpath_certificate_rotations_total", &[]).expect("metric")
            >= 1.0,
        "the pod never took the renewed certificate"
    );
    assert_eq!(round_trip(&nodes).expect("a new connection"), b"through istiod's view");
}

#[test]
fn a_policy_push_closes_an_open_connection_it_denies() {
    let nodes = istiod(None);
    nodes.echo_server_in_b(nodes.b(false, PORT));
    assert!(wait_until(Duration::from_secs(30), || ready(&nodes, 0) && ready(&nodes, 1)));
    let mut live = nodes.connect_from_a(nodes.b(false, PORT)).expect("connect");
    let mut buf = [0u8; 4];
    live.write_all(b"ping").expect("write");
    live.read_exact(&mut buf).expect("allowed before the push");
    let deny = deny_from("deny-a", "sa-a");
    nodes.istiod().set_policy(deny);
    let pushed = Instant::now();
    live.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let closed = loop {
        if live.write_all(b"ping").is_err() {
            break true;
        }
        match meshpath_tests::again_after_eintr(|| live.read(&mut buf)) {
            Ok(0) | Err(_) => break true,
            Ok(_) if pushed.elapsed() > Duration::from_secs(10) => break false,
            Ok(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    assert!(closed, "the denied connection stayed open");
    let denied = nodes.proxies[1]
        .metric("meshpath_connection_errors_total", &[("reason", "policy_denied")])
        .expect("metric");
    assert!(denied >= 1.0, "the closure was not counted");
}

/// A DENY of everything from service account `sa` in namespace default.
fn deny_from(name: &str, sa: &str) -> sec::Authorization {
    meshpath_tests::istiod::deny_from(name, "default", sa)
}

/// A node run through the CNI chain whose agent knows pods p0 (sa0) and p1 (sa1), its agent
/// started; the proxy is the test's to start.
fn cni_node() -> meshpath_tests::cni_node::CniNode {
    let mut node = meshpath_tests::cni_node::CniNode::bare(
        "workloads:
- {uid: uid-p0, name: p0, namespace: default, serviceAccount: sa0, protocol: HBONE}
- {uid: uid-p1, name: p1, namespace: default, serviceAccount: sa1, protocol: HBONE}
",
    )
    .expect("node");
    node.start_agent().expect("agent");
    node
}

#[test]
fn a_csr_istiod_never_answers_holds_up_no_other_pod_and_not_the_zds_session() {
    let mut node = cni_node();
    let istiod = Istiod::start(&[node.node.path()]).expect("istiod stand-in");
    istiod.stall_identity(Some("spiffe://cluster.local/ns/default/sa/sa1"));
    node.start_proxy_xds(&istiod, &[]).expect("proxy");
    // p1's certificate never comes: its ADD fails once the request's deadline has passed,
    // within the agent's ack timeout, so the ZDS session goes on.
    let started = Instant::now();
    let p1 = node.add_pod("p1");
    assert!(p1.is_err(), "p1 added without a certificate");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    // p0's is asked for on its own, answered, and p0 served, while p1's requests keep hanging
    // (the renewal task asks again).
    let p0 = node.add_pod("p0").expect("ADD p0 while p1's CSR hangs");
    let served = node.proxy_pods().expect("pods");
    assert_eq!(served, ["uid-p0"], "p0 not served");
    let agent = node.agent.as_ref().expect("agent").lines().join("\n");
    assert!(!agent.contains("ZDS connection broken"), "{agent}");
    drop(p0);
}

#[test]
fn pods_handed_over_before_istiods_policies_arrive_are_served_only_under_them() {
    let mut node = cni_node();
    let istiod = Istiod::start(&[node.node.path()]).expect("istiod stand-in");
    // istiod's policies are late: the node's pods arrive over ZDS first.
    istiod.withhold(AUTHORIZATION_TYPE, true);
    node.start_proxy_xds(&istiod, &[]).expect("proxy");
    let p1 = node.add_pod("p1").expect("ADD p1");
    let p0 = node.add_pod("p0").expect("ADD p0");
    for (uid, sa, ip) in [("uid-p0", "sa0", p0.ip), ("uid-p1", "sa1", p1.ip)] {
        let std::net::IpAddr::V4(v4) = ip else { panic!("IPv4 pods") };
        istiod.set_workload(wl::Workload {
            addresses: vec![v4.octets().to_vec().into()],
            ..workload(uid, sa)
        });
    }
    istiod.set_policy(deny_from("deny-p0", "sa0"));
    node.echo_server(&p1, PORT).expect("echo");
    let dst = std::net::SocketAddr::new(p1.ip, PORT);
    // p0's connection waits (no listener accepts before the first push), unanswered: the
    // echo server answers whoever reaches it, and served now it would meet no policy.
    let mut c = p0.connect(dst).expect("connect");
    c.write_all(b"early").expect("send");
    let mut b = [0u8; 5];
    let early = meshpath_tests::read_within(Duration::from_secs(2), |t| {
        c.set_read_timeout(Some(t))?;
        c.read(&mut b)
    });
    assert!(early.is_err(), "served before istiod's policies: {early:?}");
    // The policies arrive: the connection that waited is judged by them, denied.
    istiod.withhold(AUTHORIZATION_TYPE, false);
    c.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    let end = c.read(&mut b);
    assert!(matches!(end, Ok(0) | Err(_)), "the DENY was bypassed: {end:?}");
    assert!(!matches!(end, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock), "{end:?}");
    let denied = node
        .proxy_metric("meshpath_connection_errors_total", &[("reason", "policy_denied")])
        .expect("metric");
    assert!(denied >= 1.0, "no denial counted");
}

#[test]
fn a_pod_istiod_has_not_described_yet_gets_the_configured_trust_domain() {
    let mut node = cni_node();
    let istiod = Istiod::start(&[node.node.path()]).expect("istiod stand-in");
    node.start_proxy_xds(&istiod, &["--trust-domain", "example.org"]).expect("proxy");
    // istiod lists no workload: p0's identity comes from ZDS and the mesh's trust domain.
    node.add_pod("p0").expect("ADD p0");
    let want = "spiffe://example.org/ns/default/sa/sa0".to_owned();
    let csrs = istiod.csrs();
    assert!(
        csrs.iter().any(|c| c.impersonated.as_ref() == Some(&want) && c.sans == [want.clone()]),
        "no CSR for {want}: {csrs:?}"
    );
    assert!(csrs.iter().all(|c| !c.sans.iter().any(|s| s.contains("cluster.local"))), "{csrs:?}");
}

/// A pod added before istiod described it is given the identity ZDS and the configured trust
/// domain make; once istiod describes it under another trust domain, the pod takes istiod's
/// identity, with a certificate for it (as a mesh whose trust domain is not cluster.local
/// needs, whatever the proxy was started with).
#[test]
fn a_pod_takes_the_identity_istiod_gives_it_after_it_was_added() {
    let mut node = cni_node();
    let istiod = Istiod::start(&[node.node.path()]).expect("istiod stand-in");
    node.start_proxy_xds(&istiod, &[]).expect("proxy");
    let p0 = node.add_pod("p0").expect("ADD p0");
    let pod_in_dump = || {
        let dump = node.proxy_config_dump().expect("config dump");
        let pods = dump["pods"].as_array().cloned().unwrap_or_default();
        pods.into_iter().find(|p| p["uid"] == "uid-p0").unwrap_or_default()
    };
    let before = pod_in_dump();
    assert_eq!(before["identity"], "spiffe://cluster.local/ns/default/sa/sa0");
    let mut w = workload("uid-p0", "sa0");
    w.trust_domain = "example.org".into();
    w.addresses = vec![match p0.ip {
        std::net::IpAddr::V4(v4) => v4.octets().to_vec().into(),
        std::net::IpAddr::V6(v6) => v6.octets().to_vec().into(),
    }];
    istiod.set_workload(w);
    let want = "spiffe://example.org/ns/default/sa/sa0";
    assert!(
        wait_until(Duration::from_secs(20), || pod_in_dump()["identity"] == want),
        "p0 kept {}",
        pod_in_dump()["identity"]
    );
    let after = pod_in_dump();
    assert_ne!(after["certificate"]["serial"], before["certificate"]["serial"], "same certificate");
    let csrs = istiod.csrs();
    assert!(
        csrs.iter().any(|c| c.impersonated.as_deref() == Some(want) && c.sans == [want]),
        "no CSR for {want}: {csrs:?}"
    );
    let log = node.proxy.as_ref().expect("proxy").lines().join("\n");
    assert!(log.contains("the pod's identity changed"), "{log}");
}

/// The proxy's log once it has tried istiod a few times, and whether any request got through.
fn refused_istiod(node: &meshpath_tests::cni_node::CniNode, istiod: &Istiod) -> (String, usize) {
    let proxy = node.proxy.as_ref().expect("proxy");
    wait_until(Duration::from_secs(20), || {
        proxy.lines().iter().filter(|l| l.contains("xDS stream failed")).count() >= 2
    });
    (proxy.lines().join("\n"), istiod.received().len())
}

/// istiod's serving certificate is checked against the root the proxy was given: a server with
/// a certificate from another CA (an impostor on istiod's address) gets no request, no token,
/// no CSR, and the proxy says why.
#[test]
fn the_proxy_refuses_an_istiod_whose_certificate_chains_to_another_root() {
    let mut node = cni_node();
    let istiod = Istiod::start(&[node.node.path()]).expect("istiod stand-in");
    let other = meshpath_proxy::identity::LocalCa::generate("another mesh").expect("CA");
    std::fs::write(&istiod.root_pem, other.to_pem().0).expect("the proxy's root for istiod");
    node.start_proxy_xds(&istiod, &[]).expect("proxy");
    let (log, received) = refused_istiod(&node, &istiod);
    assert_eq!(received, 0, "the stand-in got requests through an unverified connection");
    assert!(log.contains("UnknownIssuer") || log.contains("unknown issuer"), "{log}");
    assert!(istiod.csrs().is_empty(), "a CSR went to an unverified istiod");
}

/// And against istiod's name: a certificate from the right CA for another name is refused.
#[test]
fn the_proxy_refuses_an_istiod_whose_certificate_is_for_another_name() {
    let mut node = cni_node();
    let mut istiod = Istiod::start(&[node.node.path()]).expect("istiod stand-in");
    istiod.serve_as("istiod.elsewhere.svc").expect("serving under another name");
    node.start_proxy_xds(&istiod, &[]).expect("proxy");
    let (log, received) = refused_istiod(&node, &istiod);
    assert_eq!(received, 0, "the stand-in got requests through a connection to another name");
    assert!(log.contains("NotValidForName") || log.contains("not valid for name"), "{log}");
    assert!(istiod.csrs().is_empty(), "a CSR went to an istiod of another name");
}
