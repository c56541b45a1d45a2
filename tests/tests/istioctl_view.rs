//! What `istioctl ztunnel-config certificates` and `connections` read from a ztunnel's
//! `/config_dump`, read from meshpath's proxy: the structure istioctl declares for them
//! (istio/istio 86c9f01, istioctl/pkg/writer/ztunnel/configdump/api.go; facts carried over)
//! decoded strictly here (a key istioctl reads that is missing, renamed or of another type
//! fails), and the certificates table rendered as istioctl prints it (a small renderer here,
//! never shipped): a Leaf row per served identity, valid now, with the serial the pod presents,
//! and the Root row of the trust bundle.

use std::collections::BTreeMap;

use meshpath_tests::two_nodes::{Setup, TwoNodes, MESHED};
use serde::Deserialize;

/// The top-level keys istioctl reads (certificates and workload state decoded; the store's
/// three lists only required to be there).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Dump {
    workloads: serde_json::Value,
    services: serde_json::Value,
    policies: serde_json::Value,
    certificates: Vec<CertsDump>,
    workload_state: BTreeMap<String, WorkloadState>,
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
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
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

/// The dump of `nodes`' first proxy, decoded as istioctl declares it, and its raw form.
fn dump_of(nodes: &TwoNodes) -> (Dump, serde_json::Value) {
    let raw = nodes.proxies[0].config_dump().expect("config dump");
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

fn assert_istioctl_reads_pod_a(nodes: &TwoNodes) {
    let (dump, raw) = dump_of(nodes);
    assert!(dump.workloads.is_array() && dump.services.is_array() && dump.policies.is_array());
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
    let _ = (&state.connections.inbound, &state.connections.outbound);
    println!("istioctl ztunnel-config certificates would print:\n{table}");
}

#[test]
fn istioctl_reads_the_certificates_and_workload_state_of_a_proxy_with_a_local_ca() {
    let nodes = TwoNodes::new(MESHED);
    assert_istioctl_reads_pod_a(&nodes);
}

#[test]
fn istioctl_reads_the_certificates_and_workload_state_of_a_proxy_istiod_configures() {
    let nodes = TwoNodes::start(Setup { istiod: true, ..Setup::default() });
    assert!(
        meshpath_tests::wait_until(std::time::Duration::from_secs(30), || {
            nodes.proxies[0].http("READINESS", "GET", "/healthz/ready").is_ok_and(|(s, _)| s == 200)
        }),
        "not ready"
    );
    assert_istioctl_reads_pod_a(&nodes);
}
