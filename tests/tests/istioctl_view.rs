//! What `istioctl ztunnel-config` reads from a ztunnel's `/config_dump`, read from meshpath's
//! proxy: the structure istioctl declares (istio/istio 86c9f01,
//! istioctl/pkg/writer/ztunnel/configdump/api.go; facts carried over) decoded strictly here (a
//! key istioctl reads that is missing, renamed or of another type fails; those it marks
//! omitempty may be absent), and the workloads, services and certificates tables rendered as
//! istioctl prints them (a small renderer here, never shipped): pod a's row with its addresses
//! and protocol, pod b's service with its one healthy endpoint, a Leaf row per served identity,
//! valid now, with the serial the pod presents, and the Root row of the trust bundle.

use std::collections::BTreeMap;

use meshpath_tests::two_nodes::{Setup, TwoNodes, MESHED};
use serde::Deserialize;

/// The top-level keys istioctl reads (certificates and workload state decoded; the store's
/// three lists only required to be there).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Dump {
    workloads: Vec<Workload>,
    services: Vec<Service>,
    policies: Vec<Policy>,
    certificates: Vec<CertsDump>,
    workload_state: BTreeMap<String, WorkloadState>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
struct Workload {
    uid: String,
    workload_ips: Vec<String>,
    #[serde(default)]
    waypoint: Option<GatewayAddress>,
    protocol: String,
    name: String,
    namespace: String,
    service_account: String,
    workload_name: String,
    workload_type: String,
    canonical_name: String,
    canonical_revision: String,
    cluster_id: String,
    #[serde(default)]
    trust_domain: String,
    node: String,
    #[serde(default)]
    network: String,
    status: String,
    hostname: String,
    capacity: u32,
    #[serde(default)]
    authorization_policies: Vec<String>,
}

#[derive(Deserialize)]
struct GatewayAddress {
    destination: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
struct Service {
    name: String,
    namespace: String,
    hostname: String,
    vips: Vec<String>,
    ports: BTreeMap<String, u32>,
    #[serde(default)]
    waypoint: Option<GatewayAddress>,
    endpoints: BTreeMap<String, Endpoint>,
    ip_families: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
struct Endpoint {
    workload_uid: String,
    service: String,
    #[serde(default)]
    address: String,
    port: BTreeMap<String, u16>,
}

#[derive(Deserialize)]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
struct Policy {
    name: String,
    namespace: String,
    scope: String,
    action: String,
    rules: Vec<Vec<Vec<serde_json::Value>>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CertsDump {
    identity: String,
    state: String,
    cert_chain: Vec<Cert>,
    root_certs: Vec<Cert>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Cert {
    pem: String,
    serial_number: String,
    valid_from: String,
    expiration_time: String,
}

#[derive(Deserialize)]
struct WorkloadState {
    #[serde(default)]
    state: String,
    connections: Connections,
    info: WorkloadInfo,
}

#[derive(Deserialize)]
struct Connections {
    inbound: Vec<Connection>,
    outbound: Vec<Connection>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Connection {
    src: String,
    original_dst: Option<String>,
    actual_dst: String,
    protocol: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WorkloadInfo {
    name: String,
    namespace: String,
    trust_domain: String,
    service_account: String,
}

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

/// A decimal number (istioctl's serial) in lower-case hex without leading zeros, as istioctl
/// prints it.
fn hex_of_decimal(decimal: &str) -> String {
    let mut bytes: Vec<u8> = vec![0];
    for d in decimal.bytes() {
        assert!(d.is_ascii_digit(), "serial {decimal:?} is not decimal");
        // bytes = bytes * 10 + d, little-endian.
        let mut carry = u32::from(d - b'0');
        for b in bytes.iter_mut() {
            let v = u32::from(*b) * 10 + carry;
            *b = (v & 0xff) as u8;
            carry = v >> 8;
        }
        while carry > 0 {
            bytes.push((carry & 0xff) as u8);
            carry >>= 8;
        }
    }
    let hex: String = bytes.iter().rev().map(|b| format!("{b:02x}")).collect();
    let trimmed = hex.trim_start_matches('0');
    if trimmed.is_empty() {
        "0".into()
    } else {
        trimmed.into()
    }
}

/// `2026-12-05T21:30:00Z` → seconds since the epoch (what istioctl's RFC 3339 parse needs
/// here: UTC, whole seconds); none if it is not that.
fn epoch_of(t: &str) -> Option<i64> {
    let (date, rest) = t.split_once('T')?;
    let clock = rest.strip_suffix('Z')?;
    let d: Vec<i64> = date.split('-').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let c: Vec<i64> = clock.split(':').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let [y, m, day] = d[..] else { return None };
    let [h, min, s] = c[..] else { return None };
    let month = time::Month::try_from(u8::try_from(m).ok()?).ok()?;
    let date =
        time::Date::from_calendar_date(i32::try_from(y).ok()?, month, u8::try_from(day).ok()?)
            .ok()?;
    let at = date
        .with_hms(u8::try_from(h).ok()?, u8::try_from(min).ok()?, u8::try_from(s).ok()?)
        .ok()?
        .assume_utc();
    Some(at.unix_timestamp())
}

/// The rows of `istioctl ztunnel-config certificates` (CERTIFICATE NAME, TYPE, STATUS, VALID
/// CERT, SERIAL NUMBER, NOT AFTER, NOT BEFORE), in dump order.
fn certificate_rows(dump: &Dump) -> Vec<[String; 7]> {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let mut rows = Vec::new();
    for c in &dump.certificates {
        let status = if c.state.contains("Unavailable") {
            "Unavailable".to_owned()
        } else {
            c.state.clone()
        };
        if c.cert_chain.is_empty() {
            let na = || "NA".to_owned();
            rows.push([c.identity.clone(), na(), status, "false".into(), na(), na(), na()]);
            continue;
        }
        let row = |kind: &str, cert: &Cert| {
            let valid = match (epoch_of(&cert.valid_from), epoch_of(&cert.expiration_time)) {
                (Some(from), Some(to)) => from <= now && now <= to,
                _ => false,
            };
            let or_na = |s: &str| if s.is_empty() { "NA".to_owned() } else { s.to_owned() };
            [
                c.identity.clone(),
                kind.to_owned(),
                status.clone(),
                valid.to_string(),
                hex_of_decimal(&cert.serial_number),
                or_na(&cert.expiration_time),
                or_na(&cert.valid_from),
            ]
        };
        for (i, cert) in c.cert_chain.iter().enumerate() {
            let last = i + 1 == c.cert_chain.len();
            let kind = match i {
                _ if last && c.root_certs.is_empty() && i > 0 => "Root",
                0 => "Leaf",
                _ => "Intermediate",
            };
            rows.push(row(kind, cert));
        }
        rows.extend(c.root_certs.iter().map(|r| row("Root", r)));
    }
    rows
}

/// istioctl's WAYPOINT column: `None`, the name of the service the destination names (by
/// `NS/HOSTNAME` or one of its VIPs), or `NA`.
fn waypoint_column(w: Option<&GatewayAddress>, services: &[Service]) -> String {
    let Some(w) = w else { return "None".into() };
    services
        .iter()
        .find(|s| {
            format!("{}/{}", s.namespace, s.hostname) == w.destination
                || s.vips.contains(&w.destination)
        })
        .map_or_else(|| "NA".into(), |s| s.name.clone())
}

/// The rows of `istioctl ztunnel-config workloads` (NAMESPACE, POD NAME, ADDRESS, NODE,
/// WAYPOINT, PROTOCOL), sorted as it sorts them.
fn workload_rows(dump: &Dump) -> Vec<[String; 6]> {
    let mut ws: Vec<&Workload> = dump.workloads.iter().collect();
    ws.sort_by(|a, b| {
        (format!("{}.{}", a.namespace, a.name), &a.node)
            .cmp(&(format!("{}.{}", b.namespace, b.name), &b.node))
    });
    ws.iter()
        .map(|w| {
            let address = if w.workload_ips.is_empty() {
                w.hostname.clone()
            } else {
                w.workload_ips.join(",")
            };
            [
                w.namespace.clone(),
                w.name.clone(),
                address,
                w.node.clone(),
                waypoint_column(w.waypoint.as_ref(), &dump.services),
                w.protocol.clone(),
            ]
        })
        .collect()
}

/// The rows of `istioctl ztunnel-config services` (NAMESPACE, SERVICE NAME, SERVICE VIP,
/// WAYPOINT, ENDPOINTS as healthy/total).
fn service_rows(dump: &Dump) -> Vec<[String; 5]> {
    let healthy = |uid: &str| dump.workloads.iter().any(|w| w.uid == uid && w.status == "Healthy");
    let mut rows: Vec<[String; 5]> = dump
        .services
        .iter()
        .map(|s| {
            let vips: Vec<&str> =
                s.vips.iter().map(|v| v.split_once('/').map_or(v.as_str(), |(_, ip)| ip)).collect();
            let up = s.endpoints.values().filter(|e| healthy(&e.workload_uid)).count();
            [
                s.namespace.clone(),
                s.name.clone(),
                vips.join(","),
                waypoint_column(s.waypoint.as_ref(), &dump.services),
                format!("{up}/{}", s.endpoints.len()),
            ]
        })
        .collect();
    rows.sort();
    rows
}

/// The rows of `istioctl ztunnel-config policies` (NAMESPACE, POLICY NAME, ACTION, SCOPE).
fn policy_rows(dump: &Dump) -> Vec<[String; 4]> {
    let mut rows: Vec<[String; 4]> = dump
        .policies
        .iter()
        .map(|p| [p.namespace.clone(), p.name.clone(), p.action.clone(), p.scope.clone()])
        .collect();
    rows.sort();
    rows
}

/// The rows of `istioctl ztunnel-config connections` (WORKLOAD, DIRECTION, LOCAL, REMOTE,
/// REMOTE TARGET, PROTOCOL): each served pod's open connections, inbound first, addresses named
/// as istioctl names them (a service's first VIP by its hostname, a workload's first address
/// by `NAME.NAMESPACE`, with the port).
fn connection_rows(dump: &Dump) -> Vec<[String; 6]> {
    let lookup = |addr: &str| -> String {
        let Some((host, port)) = addr.rsplit_once(':') else { return addr.to_owned() };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let vip = |v: &String| v.split_once('/').map_or(v.clone(), |(_, ip)| ip.to_owned());
        if let Some(s) =
            dump.services.iter().find(|s| s.vips.first().map(vip).as_deref() == Some(host))
        {
            return format!("{}:{port}", s.hostname);
        }
        if let Some(w) =
            dump.workloads.iter().find(|w| w.workload_ips.first().map(String::as_str) == Some(host))
        {
            return format!("{}.{}:{port}", w.name, w.namespace);
        }
        addr.to_owned()
    };
    let mut states: Vec<&WorkloadState> = dump.workload_state.values().collect();
    states
        .sort_by(|a, b| (&a.info.namespace, &a.info.name).cmp(&(&b.info.namespace, &b.info.name)));
    let mut rows = Vec::new();
    for st in states {
        let name = format!("{}.{}", st.info.name, st.info.namespace);
        for c in &st.connections.inbound {
            rows.push([
                name.clone(),
                "Inbound".into(),
                lookup(&c.actual_dst),
                lookup(&c.src),
                c.original_dst.clone().unwrap_or_default(),
                c.protocol.clone(),
            ]);
        }
        for c in &st.connections.outbound {
            rows.push([
                name.clone(),
                "Outbound".into(),
                lookup(&c.src),
                lookup(&c.actual_dst),
                lookup(c.original_dst.as_deref().unwrap_or_default()),
                c.protocol.clone(),
            ]);
        }
    }
    rows
}

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
        meshpath_tests::wait_until(std::time::Duration::from_secs(30), || {
            nodes.proxies[0].http("READINESS", "GET", "/healthz/ready").is_ok_and(|(s, _)| s == 200)
        }),
        "not ready"
    );
    assert_istioctl_reads_pod_a(&nodes, false);
}

/// A pod's open connection as `istioctl ztunnel-config connections` lists it at both ends:
/// outbound at pod a's proxy (from pod a, to pod b's HBONE port, for pod b's port), inbound at
/// pod b's (to pod b's port, from pod a); gone from the list once closed.
#[test]
fn istioctl_lists_an_open_connection_at_both_ends_until_it_closes() {
    use std::io::{Read as _, Write as _};
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8096);
    nodes.echo_server_in_b(dst);
    let mut live = nodes.connect_from_a(dst).expect("connect");
    live.write_all(b"ping").expect("write");
    let mut back = [0u8; 4];
    live.read_exact(&mut back).expect("the echo");
    let outbound = connection_rows(&dump_at(&nodes, 0).0);
    let inbound = connection_rows(&dump_at(&nodes, 1).0);
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
            connection_rows(&dump_at(&nodes, 0).0).is_empty()
                && connection_rows(&dump_at(&nodes, 1).0).is_empty()
        }),
        "the closed connection is still listed"
    );
}
