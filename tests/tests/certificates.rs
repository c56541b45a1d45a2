//! Workload certificates: renewed under a running transfer (local CA), read from files and
//! re-read when they change (files mode), a CA root rotation rolled out in steps, and client
//! certificates that are expired or from another CA refused at the TLS handshake.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use meshpath_proxy::{
    identity::{LocalCa, WorkloadCert},
    proxy::hbone::HboneError,
};
use meshpath_tests::two_nodes::{sa, Setup, TwoNodes};
use meshpath_tests::wait_until;

fn serial(nodes: &TwoNodes, node: usize) -> String {
    let dump = nodes.proxies[node].config_dump().expect("config_dump");
    dump["pods"][0]["certificate"]["serial"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn certificates_are_renewed_without_breaking_a_running_transfer() {
    // 4 s certificates: renewed about every 2 s on both nodes.
    let nodes = TwoNodes::start(Setup {
        args: vec!["--cert-lifetime-seconds".into(), "4".into()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8097);
    nodes.echo_server_in_b(dst);
    let first = (serial(&nodes, 0), serial(&nodes, 1));
    let mut conn = nodes.connect_from_a(dst).expect("connect");
    let start = Instant::now();
    let mut chunk = [0u8; 4096];
    let mut back = [0u8; 4096];
    let mut i = 0u8;
    // One echo at a time on the same connection while the certificates turn over.
    while start.elapsed() < Duration::from_secs(7) {
        chunk.fill(i);
        conn.write_all(&chunk).expect("send during rotation");
        conn.read_exact(&mut back).expect("echo during rotation");
        assert_eq!(back, chunk);
        i = i.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(20));
    }
    let rotations = |n: usize| {
        nodes.proxies[n].metric("meshpath_certificate_rotations_total", &[]).expect("metrics")
    };
    assert!(rotations(0) >= 2.0 && rotations(1) >= 2.0, "{} / {}", rotations(0), rotations(1));
    assert_ne!(first, (serial(&nodes, 0), serial(&nodes, 1)), "the certificates did not change");
    // New connections use (and are accepted with) the new certificates.
    drop(conn);
    assert_eq!(nodes.app_round_trip(dst, b"after").expect("new connection"), b"after");
}

#[test]
fn files_mode_serves_the_files_and_rereads_them_when_they_change() {
    let nodes = TwoNodes::start(Setup { cert_files: true, ..Setup::default() });
    let dst = nodes.b(false, 8098);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"files").expect("round trip"), b"files");
    assert_eq!(nodes.proxies[1].config_dump().expect("dump")["certificateSource"], "files");
    let before = serial(&nodes, 1);
    nodes.write_cert_files(&sa("sa-b"), Duration::from_secs(3600));
    let deadline = Instant::now() + Duration::from_secs(10);
    while serial(&nodes, 1) == before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_ne!(serial(&nodes, 1), before, "the new files were not picked up");
    assert_eq!(nodes.app_round_trip(dst, b"again").expect("round trip"), b"again");
}

#[test]
fn a_certificate_file_for_another_identity_is_refused_and_the_current_one_kept() {
    let nodes = TwoNodes::start(Setup { cert_files: true, ..Setup::default() });
    let before = serial(&nodes, 1);
    // sa-a's certificate written where sa-b's belongs.
    let wrong = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(3600)).expect("cert");
    let (chain, key) = wrong.to_pem();
    let d = nodes.dir.join("certs/default/sa-b");
    std::fs::write(d.join("key.pem"), key).expect("key");
    std::fs::write(d.join("cert-chain.pem"), chain).expect("chain");
    let logged = nodes.proxies[1].proxy.wait_for_text(
        "the certificate is for spiffe://cluster.local/ns/default/sa/sa-a, not spiffe://cluster.local/ns/default/sa/sa-b",
        Duration::from_secs(10),
    );
    assert!(logged, "no error naming the mismatch");
    assert_eq!(serial(&nodes, 1), before, "a certificate for another identity was installed");
    let dst = nodes.b(false, 8099);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"kept").expect("round trip"), b"kept");
}

/// Waits (10 s at most) until both proxies have read a bundle of `want` roots (their config
/// dumps): read, not yet proof that each pod's TLS settings were made again with them.
fn wait_roots(nodes: &TwoNodes, want: usize) {
    let roots = |n: usize| {
        let dump = nodes.proxies[n].config_dump().expect("config_dump");
        dump["certificates"][0]["rootCerts"].as_array().map_or(0, Vec::len)
    };
    for n in 0..2 {
        let taken = wait_until(Duration::from_secs(10), || roots(n) == want);
        assert!(taken, "node {} trusts {} roots, not {want}", n + 1, roots(n));
    }
}

/// Writes `ca`'s certificate for `account` (files mode) and waits until node `node` serves it.
fn switch_cert(nodes: &TwoNodes, node: usize, account: &str, ca: &LocalCa) {
    let before = serial(nodes, node);
    let cert = ca.issue(&sa(account), Duration::from_secs(3600)).expect("cert");
    nodes.write_cert(&sa(account), &cert);
    let served = wait_until(Duration::from_secs(10), || serial(nodes, node) != before);
    assert!(served, "node {} did not take {account}'s new certificate", node + 1);
}

/// A round trip from pod a to pod b's echo at `dst` on an HBONE connection made for it: node 1
/// keeps no idle connection by then (`--pool-idle-seconds 1`), and `--pool-max-streams 1`
/// keeps new streams off the held one. Both proxies check each other's certificate on it.
fn round_trip_on_a_new_connection(nodes: &TwoNodes, dst: SocketAddr, step: &str) {
    let node1 = &nodes.proxies[0];
    let pooled = || node1.metric("meshpath_pool_connections", &[]).expect("metrics");
    let opened = || node1.metric("meshpath_pool_connections_opened_total", &[]).expect("metrics");
    assert!(wait_until(Duration::from_secs(10), || pooled() <= 1.0), "an idle connection stayed");
    let before = opened();
    let echoed = nodes.app_round_trip(dst, step.as_bytes());
    assert_eq!(echoed.as_deref().ok(), Some(step.as_bytes()), "{step}: {echoed:?}");
    assert_eq!(opened(), before + 1.0, "{step}: no new HBONE connection was made");
}

/// One echo on the connection opened before the rotation.
fn still_carried(held: &mut TcpStream, step: &str) {
    held.write_all(step.as_bytes()).expect("send on the held connection");
    let mut back = vec![0u8; step.len()];
    held.read_exact(&mut back).expect("echo on the held connection");
    assert_eq!(back, step.as_bytes(), "{step}");
}

/// An HBONE handshake and CONNECT to `dst` in pod b as a client with `cert` that trusts `roots`.
fn connect_trusting(
    nodes: &TwoNodes,
    dst: SocketAddr,
    cert: &WorkloadCert,
    roots: &[&LocalCa],
) -> Result<(), HboneError> {
    let roots: Vec<_> = roots.iter().map(|ca| ca.cert_der.clone()).collect();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(nodes.hbone_to_b_trusting(cert, &roots, dst))
}

/// Node 2 takes a client certificate of `client_ca` for a CONNECT to `dst` (its TLS settings
/// made again with the bundle that added that root), within 10 s; the client trusts
/// `server_ca`, whose certificate node 2 presents.
fn accepts_a_client_of(
    nodes: &TwoNodes,
    dst: SocketAddr,
    client_ca: &LocalCa,
    server_ca: &LocalCa,
) {
    let cert = client_ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let connect = || connect_trusting(nodes, dst, &cert, &[server_ca]);
    let accepted = wait_until(Duration::from_secs(10), || connect().is_ok());
    assert!(accepted, "node 2 refused a client of the new root: {:?}", connect());
}

/// Node 2 refuses a client certificate of `client_ca` (a root that left the bundle), within
/// 10 s, and counts the refusal; the client trusts `server_ca`, whose certificate node 2
/// presents, so the refusal is node 2's.
fn refuses_a_client_of(
    nodes: &TwoNodes,
    dst: SocketAddr,
    client_ca: &LocalCa,
    server_ca: &LocalCa,
) {
    let refused = [("reason", "tls_handshake")];
    let count = || nodes.proxies[1].metric("meshpath_connection_errors_total", &refused);
    let before = count().expect("metrics");
    let cert = client_ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let connect = || connect_trusting(nodes, dst, &cert, &[server_ca]);
    let refusing = wait_until(Duration::from_secs(10), || connect().is_err());
    assert!(refusing, "node 2 still takes a client of the root that left its bundle");
    let counted = wait_until(Duration::from_secs(10), || count().is_ok_and(|n| n > before));
    assert!(counted, "node 2 counted no refused handshake");
}

/// A CA root rotation rolled out as Istio documents it: the new root joins the trust bundle,
/// workloads get certificates of the new root one at a time, then the old root leaves. At each
/// step a new connection (both certificates checked) works and one opened before it all
/// carries on; once the bundle has the new root, node 2 takes a client of it, and once the old
/// root has left, node 2 refuses a client of that one. A proxy that kept the TLS settings it
/// made before the bundle changed fails at the first of those (that mutation was run).
#[test]
fn a_ca_root_rotation_in_steps_keeps_new_and_open_connections_working() {
    let nodes = TwoNodes::start(Setup {
        cert_files: true,
        args: ["--pool-idle-seconds", "1", "--pool-max-streams", "1"].map(String::from).into(),
        ..Setup::default()
    });
    let dst = nodes.b(false, 8101);
    nodes.echo_server_in_b(dst);
    let mut held = nodes.connect_from_a(dst).expect("connect");
    still_carried(&mut held, "before");
    let (old, new) = (&nodes.ca, LocalCa::generate("the new root").expect("CA"));

    nodes.write_trust_bundle(&[old, &new]);
    wait_roots(&nodes, 2);
    accepts_a_client_of(&nodes, dst, &new, old);
    round_trip_on_a_new_connection(&nodes, dst, "both roots trusted");
    still_carried(&mut held, "both roots trusted");

    // Node 2's workload on the new root, node 1's still on the old.
    switch_cert(&nodes, 1, "sa-b", &new);
    round_trip_on_a_new_connection(&nodes, dst, "the server on the new root");
    still_carried(&mut held, "the server on the new root");

    switch_cert(&nodes, 0, "sa-a", &new);
    round_trip_on_a_new_connection(&nodes, dst, "both on the new root");
    still_carried(&mut held, "both on the new root");

    // The old root leaves the bundle.
    nodes.write_trust_bundle(&[&new]);
    wait_roots(&nodes, 1);
    refuses_a_client_of(&nodes, dst, old, &new);
    round_trip_on_a_new_connection(&nodes, dst, "only the new root trusted");
    still_carried(&mut held, "only the new root trusted");
}

/// The issuer of node `node`'s workload certificate now (its config dump), if it has one.
fn issuer(nodes: &TwoNodes, node: usize) -> Option<String> {
    let dump = nodes.proxies[node].config_dump().ok()?;
    let pem = dump["certificates"][0]["certChain"][0]["pem"].as_str()?.to_owned();
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
    let cert = pem.parse_x509().ok()?;
    Some(cert.issuer().to_string())
}

/// The same rotation with the certificates and roots from istiod (the stand-in's CA answers, as
/// istiod's with a plugged CA: the bundle in the chain's last element). Node 1's requests are
/// held unanswered while node 2 moves to the new root, so that one step has the two nodes on
/// different roots, each trusting both.
#[test]
fn a_ca_root_rotation_by_istiod_keeps_new_and_open_connections_working() {
    let nodes = TwoNodes::start(Setup {
        istiod: true,
        // Short-lived certificates, which the stand-in backdates a minute: past half their
        // life at once, so the proxies ask again every moment and each step reaches them
        // within one; 45 s outlasts what node 1 may wait while its requests are held.
        istiod_before: Some(|i| i.set_ttl(Some(Duration::from_secs(45)))),
        args: ["--pool-idle-seconds", "1", "--pool-max-streams", "1"].map(String::from).into(),
        ..Setup::default()
    });
    assert!(nodes.wait_ready(Duration::from_secs(30)), "the proxies did not serve their pods");
    let istiod = nodes.istiod();
    let dst = nodes.b(false, 8102);
    nodes.echo_server_in_b(dst);
    let mut held = nodes.connect_from_a(dst).expect("connect");
    still_carried(&mut held, "before");
    let old = istiod.ca();
    let new = std::sync::Arc::new(LocalCa::generate("the new root").expect("CA"));
    let on_new = |node: usize| issuer(&nodes, node).is_some_and(|i| i.contains("the new root"));

    istiod.rotate_ca(None, &[old, &new]);
    wait_roots(&nodes, 2);
    accepts_a_client_of(&nodes, dst, &new, old);
    round_trip_on_a_new_connection(&nodes, dst, "both roots trusted");
    still_carried(&mut held, "both roots trusted");

    let node1 = sa("sa-a").to_string();
    istiod.stall_identity(Some(&node1));
    istiod.rotate_ca(Some(new.clone()), &[old, &new]);
    assert!(wait_until(Duration::from_secs(10), || on_new(1)), "node 2 kept the old root");
    assert!(!on_new(0), "node 1 moved while its requests were held");
    round_trip_on_a_new_connection(&nodes, dst, "node 2 on the new root, node 1 on the old");
    still_carried(&mut held, "node 2 on the new root, node 1 on the old");

    // Node 1's request held when this lets go ends at the CA client's deadline (5 s); the next
    // one, after its back-off, is answered.
    istiod.stall_identity(None);
    assert!(wait_until(Duration::from_secs(20), || on_new(0)), "node 1 kept the old root");
    round_trip_on_a_new_connection(&nodes, dst, "both on the new root");
    still_carried(&mut held, "both on the new root");

    istiod.rotate_ca(Some(new.clone()), &[&new]);
    wait_roots(&nodes, 1);
    refuses_a_client_of(&nodes, dst, old, &new);
    round_trip_on_a_new_connection(&nodes, dst, "only the new root trusted");
    still_carried(&mut held, "only the new root trusted");
}

/// A client with `cert` opening HBONE to pod b (from pod b's netns).
fn connect_with(nodes: &TwoNodes, cert: &WorkloadCert) -> Result<(), HboneError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(nodes.hbone_to_b(cert, nodes.b(false, 8100)))
}

/// Node 2's count of refused handshakes, once it has counted one (its task counts the refusal
/// after the client has seen it) or after 10 s.
fn tls_refusals(nodes: &TwoNodes) -> f64 {
    let refused = [("reason", "tls_handshake")];
    let node2 = &nodes.proxies[1];
    node2.wait_metrics(Duration::from_secs(10), |m| {
        meshpath_tests::sum_metric(m, "meshpath_connection_errors_total", &refused) >= 1.0
    });
    node2.metric("meshpath_connection_errors_total", &refused).expect("metrics")
}

#[test]
fn an_expired_client_certificate_is_refused() {
    let nodes = TwoNodes::new(meshpath_tests::two_nodes::MESHED);
    nodes.echo_server_in_b(nodes.b(false, 8100));
    let now = time::OffsetDateTime::now_utc();
    let expired = nodes
        .ca
        .issue_between(&sa("sa-a"), now - time::Duration::hours(2), now - time::Duration::hours(1))
        .expect("cert");
    let valid = nodes.ca.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    assert!(connect_with(&nodes, &valid).is_ok(), "a valid client was refused");
    let err = connect_with(&nodes, &expired).expect_err("expired accepted");
    assert!(matches!(err, HboneError::Tls(..) | HboneError::H2(..)), "{err}");
    assert_eq!(tls_refusals(&nodes), 1.0);
}

#[test]
fn a_client_certificate_from_another_ca_is_refused() {
    let nodes = TwoNodes::new(meshpath_tests::two_nodes::MESHED);
    nodes.echo_server_in_b(nodes.b(false, 8100));
    let other = LocalCa::generate("someone else's CA").expect("CA");
    let foreign = other.issue(&sa("sa-a"), Duration::from_secs(600)).expect("cert");
    let err = connect_with(&nodes, &foreign).expect_err("foreign accepted");
    assert!(matches!(err, HboneError::Tls(..) | HboneError::H2(..)), "{err}");
    assert_eq!(tls_refusals(&nodes), 1.0);
}

fn readiness(nodes: &TwoNodes, node: usize) -> u16 {
    nodes.proxies[node].http("READINESS", "GET", "/healthz/ready").map_or(0, |r| r.0)
}

fn liveness(nodes: &TwoNodes, node: usize) -> u16 {
    nodes.proxies[node].http("READINESS", "GET", "/healthz/live").map_or(0, |r| r.0)
}

#[test]
fn readiness_fails_while_a_served_pods_certificate_is_expired() {
    let nodes = TwoNodes::start(Setup { cert_files: true, ..Setup::default() });
    assert_eq!(readiness(&nodes, 1), 200);
    let before = serial(&nodes, 1);
    // A certificate that expires 2 s from now, picked up as any new file is.
    nodes.write_cert_files(&sa("sa-b"), Duration::from_secs(2));
    assert!(wait_until(Duration::from_secs(10), || serial(&nodes, 1) != before), "not picked up");
    let expiry =
        nodes.proxies[1].metric("meshpath_certificate_earliest_expiry_seconds", &[]).expect("m");
    let now = time::OffsetDateTime::now_utc().unix_timestamp() as f64;
    assert!(expiry > now - 5.0 && expiry < now + 5.0, "expiry exported as {expiry}, now {now}");
    assert!(wait_until(Duration::from_secs(10), || readiness(&nodes, 1) == 503), "still ready");
    // Not ready, and alive: the kubelet's liveness probe (deploy/) does not restart it.
    assert_eq!(liveness(&nodes, 1), 200);
    // A valid certificate again: ready again.
    nodes.write_cert_files(&sa("sa-b"), Duration::from_secs(3600));
    assert!(wait_until(Duration::from_secs(10), || readiness(&nodes, 1) == 200), "not ready");
}

#[test]
fn an_expired_certificate_file_is_refused_and_the_current_one_kept() {
    let nodes = TwoNodes::start(Setup { cert_files: true, ..Setup::default() });
    let dst = nodes.b(false, 8121);
    nodes.echo_server_in_b(dst);
    let before = serial(&nodes, 1);
    let now = time::OffsetDateTime::now_utc();
    let expired = nodes
        .ca
        .issue_between(&sa("sa-b"), now - time::Duration::hours(2), now - time::Duration::hours(1))
        .expect("cert");
    nodes.write_cert(&sa("sa-b"), &expired);
    let proxy = &nodes.proxies[1].proxy;
    assert!(
        proxy.wait_for_text("the certificate expired at", Duration::from_secs(10)),
        "the expired file was not refused"
    );
    assert_eq!(serial(&nodes, 1), before, "the expired certificate replaced the valid one");
    assert_eq!(nodes.app_round_trip(dst, b"still").expect("round trip"), b"still");
    assert_eq!(readiness(&nodes, 1), 200);
}
