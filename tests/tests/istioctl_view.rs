//! What `istioctl ztunnel-config` reads from a ztunnel's `/config_dump`, read from meshpath's
//! proxy: the structure istioctl declares (istio/istio 86c9f01,
//! istioctl/pkg/writer/ztunnel/configdump/api.go; facts carried over) decoded strictly here (a
//! key istioctl reads that is missing, renamed or of another type fails; those it marks
//! omitempty may be absent), and the workloads, services and certificates tables rendered as
//! istioctl prints them (a small renderer here, never shipped): pod a's row with its addresses
//! and protocol, pod b's service with its one healthy endpoint, a Leaf row per served identity,
//! valid now, with the serial the pod presents, and the Root row of the trust bundle.

use meshpath_tests::{
    istioctl::{certificate_rows, connection_rows, policy_rows, service_rows, workload_rows, Dump},
    two_nodes::{Setup, TwoNodes, MESHED},
};

/// Pod b's service (pod b names it in the workloads file).
const SERVICE_B: &str = "services:
- name: b
  namespace: default
  hostname: b.default.svc.cluster.local
  vips: [\"/10.96.0.10\"]
  ports: {80: 8090}
policies:
- {name: no-8091, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [8091]}]]]}
";

/// The dump of `nodes`' first proxy, decoded as istioctl declares it, and its raw form.
fn dump_of(nodes: &TwoNodes) -> (Dump, serde_json::Value) {
    dump_at(nodes, 0)
}

/// The dump of `nodes`' proxy `i`, decoded as istioctl declares it, and its raw form.
fn dump_at(nodes: &TwoNodes, i: usize) -> (Dump, serde_json::Value) {
    let raw = nodes.proxies[i].config_dump().expect("config dump");
    let dump: Dump = serde_json::from_value(raw.clone())
        .unwrap_or_else(|e| panic!("not what istioctl reads: {e}\n{raw:#}"));
    (dump, raw)
}

/// The pod's certificate serial as the proxy's own section shows it, as istioctl prints it.
fn pod_serial(raw: &serde_json::Value, uid: &str) -> String {
    let pod = raw["pods"].as_array().into_iter().flatten().find(|p| p["uid"] == uid);
    let serial = pod.and_then(|p| p["certificate"]["serial"].as_str()).expect("a served pod");
    serial.replace(':', "").to_lowercase().trim_start_matches('0').to_owned()
}

fn assert_istioctl_reads_pod_a(nodes: &TwoNodes, with_service: bool) {
    let (dump, raw) = dump_of(nodes);
    let workloads = workload_rows(&dump);
    let a = workloads.iter().find(|r| r[1] == "app-a").expect("pod a's row");
    let a_ips = format!("{},{}", nodes.pods.a_ip, nodes.pods.a_ip6);
    assert_eq!(a[..3], ["default".to_owned(), "app-a".into(), a_ips], "{workloads:?}");
    assert_eq!((&*a[4], &*a[5]), ("None", "HBONE"), "{workloads:?}");
    let services = service_rows(&dump);
    if with_service {
        let b = ["default", "b", "10.96.0.10", "None", "1/1"].map(str::to_owned);
        assert!(services.contains(&b), "pod b's service: {services:?}");
        let policies = policy_rows(&dump);
        let deny = ["default", "no-8091", "Deny", "Namespace"].map(str::to_owned);
        assert_eq!(policies, [deny], "{policies:?}");
    }
    println!(
        "istioctl ztunnel-config workloads would print:\n{workloads:?}\nservices:\n{services:?}"
    );
    let rows = certificate_rows(&dump);
    let id = "spiffe://cluster.local/ns/default/sa/sa-a";
    let mine: Vec<&[String; 7]> = rows.iter().filter(|r| r[0] == id).collect();
    let table: Vec<String> = rows.iter().map(|r| r.join("  ")).collect();
    let table = table.join("\n");
    assert!(
        mine.first().is_some_and(|r| r[1] == "Leaf" && r[2] == "Available" && r[3] == "true"),
        "{table}"
    );
    assert_eq!(mine[0][4], pod_serial(&raw, "pod-a"), "{table}");
    assert!(mine.iter().any(|r| r[1] == "Root" && r[3] == "true"), "no root row:\n{table}");
    let leaf = dump.certificates.iter().find(|c| c.identity == id).map(|c| &c.cert_chain[0]);
    assert!(leaf.is_some_and(|c| c.pem.starts_with("-----BEGIN CERTIFICATE-----")), "no PEM");
    let state = dump.workload_state.get("pod-a").expect("pod a's workload state");
    assert_eq!(state.state, "Up");
    assert_eq!(
        (&*state.info.namespace, &*state.info.service_account, &*state.info.trust_domain),
        ("default", "sa-a", "cluster.local")
    );
    assert!(!state.info.name.is_empty(), "no name");
    println!("istioctl ztunnel-config certificates would print:\n{table}");
}

#[test]
fn istioctl_reads_the_workloads_services_certificates_and_pods_of_a_proxy_with_a_local_ca() {
    let nodes = TwoNodes::start(Setup { view: MESHED, yaml: SERVICE_B.into(), ..Setup::default() });
    assert_istioctl_reads_pod_a(&nodes, true);
}

#[test]
fn istioctl_reads_the_workloads_certificates_and_pods_of_a_proxy_istiod_configures() {
    let nodes = TwoNodes::start(Setup { istiod: true, ..Setup::default() });
    assert!(
        meshpath_tests::wait_until(std::time::Duration::from_secs(30), || nodes.ready(0)),
        "not ready"
    );
    assert_istioctl_reads_pod_a(&nodes, false);
}

/// A pod's open connection as `istioctl ztunnel-config connections` lists it at both ends:
/// outbound at pod a's proxy (from pod a, to pod b's HBONE port, for pod b's port), inbound at
/// pod b's (to pod b's port, from pod a); gone from the list once closed.
#[test]
fn istioctl_lists_an_open_connection_at_both_ends_until_it_closes() {
    assert_open_connection_listed_at_both_ends(&TwoNodes::new(MESHED));
}

/// The same with both proxies configured by istiod (its stand-in): workloads and certificates
/// from xDS and istiod's CA.
#[test]
fn istioctl_lists_an_open_connection_of_proxies_istiod_configures() {
    let nodes = TwoNodes::start(Setup { istiod: true, ..Setup::default() });
    assert!(nodes.wait_ready(std::time::Duration::from_secs(30)), "not ready");
    assert_open_connection_listed_at_both_ends(&nodes);
}

fn assert_open_connection_listed_at_both_ends(nodes: &TwoNodes) {
    use std::io::{Read as _, Write as _};
    let dst = nodes.b(false, 8096);
    nodes.echo_server_in_b(dst);
    let mut live = nodes.connect_from_a(dst).expect("connect");
    live.write_all(b"ping").expect("write");
    let mut back = [0u8; 4];
    live.read_exact(&mut back).expect("the echo");
    let outbound = connection_rows(&dump_at(nodes, 0).0);
    let inbound = connection_rows(&dump_at(nodes, 1).0);
    println!("pod a's proxy: {outbound:?}\npod b's proxy: {inbound:?}");
    let [row] = &outbound[..] else { panic!("one connection at pod a's proxy: {outbound:?}") };
    assert_eq!((&*row[0], &*row[1]), ("app-a.default", "Outbound"), "{row:?}");
    assert!(row[2].starts_with("app-a.default:"), "{row:?}");
    assert_eq!(
        (&*row[3], &*row[4], &*row[5]),
        ("app-b.default:15008", "app-b.default:8096", "HBONE")
    );
    let [row] = &inbound[..] else { panic!("one connection at pod b's proxy: {inbound:?}") };
    assert_eq!((&*row[0], &*row[1], &*row[2]), ("app-b.default", "Inbound", "app-b.default:8096"));
    assert!(row[3].starts_with("app-a.default:"), "{row:?}");
    assert_eq!((&*row[4], &*row[5]), (&*dst.to_string(), "HBONE"), "{row:?}");
    drop(live);
    assert!(
        meshpath_tests::wait_until(std::time::Duration::from_secs(10), || {
            connection_rows(&dump_at(nodes, 0).0).is_empty()
                && connection_rows(&dump_at(nodes, 1).0).is_empty()
        }),
        "the closed connection is still listed"
    );
}
