//! `GET /config_dump`: what the proxy holds, as JSON. Its shape is ztunnel's where istioctl
//! reads it (`istioctl ztunnel-config workloads | services | policies | certificates |
//! connections`, istio/istio's istioctl/pkg/writer/ztunnel/configdump/api.go): the same keys,
//! types and meanings, so Istio's own tools read meshpath's proxy unchanged. meshpath's extras
//! are under keys of their own (`pods`, `pool`, `certificateSource`).
//!
//! - `workloads`, `services`, `policies`: the store, as the workloads file spells it, with the
//!   keys istioctl reads that the file has not: a workload's `workloadType` (`pod`),
//!   `canonicalRevision`, `clusterId`, `hostname`, `network` (present and empty: the proxy
//!   does not hold them), `capacity` (1), `node`; a waypoint's `destination` as one string
//!   (`NS/HOSTNAME` or `NETWORK/IP`); a service's `endpoints` (by `UID:/IP`, from the workloads
//!   that back it) and `ipFamilies`.
//! - `certificates`: each identity the proxy serves, holds or is asking istiod for, with its
//!   state (`Available`, `Initializing`, `Unavailable: why`), its chain and the trust roots;
//!   serial numbers in decimal, times in RFC 3339, as ztunnel writes them.
//! - `workloadState`: each served pod by uid: `Up`, who it is (`info`), its open
//!   `connections` by direction (`proxy/open_connections.rs`): the client's address, where it
//!   was going, where the proxy connected, `HBONE` or `TCP`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{
    certs::ca_client::CertState,
    identity::WorkloadCert,
    metrics::Direction,
    proxy::{pool::PoolEntry, Proxy},
};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ConfigDump {
    #[serde(flatten)]
    store: serde_json::Map<String, serde_json::Value>,
    certificates: Vec<CertsDump>,
    workload_state: BTreeMap<String, WorkloadState>,
    certificate_source: &'static str,
    pods: Vec<PodDump>,
    pool: Vec<PoolEntry>,
}

/// One identity's certificate, as ztunnel's dump has it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CertsDump {
    identity: String,
    state: String,
    cert_chain: Vec<CertDump>,
    root_certs: Vec<CertDump>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CertDump {
    pem: String,
    /// Decimal, as ztunnel writes it (istioctl prints it in hex).
    serial_number: String,
    valid_from: String,
    expiration_time: String,
}

#[derive(Serialize)]
struct WorkloadState {
    state: &'static str,
    connections: Connections,
    info: WorkloadInfo,
}

#[derive(Serialize, Default)]
struct Connections {
    inbound: Vec<Connection>,
    outbound: Vec<Connection>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Connection {
    src: String,
    original_dst: String,
    actual_dst: String,
    protocol: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WorkloadInfo {
    name: String,
    namespace: String,
    trust_domain: String,
    service_account: String,
}

/// A served pod and its certificate (meshpath's own section).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PodDump {
    uid: String,
    identity: String,
    netns_cookie: u64,
    certificate: Option<PodCertDump>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PodCertDump {
    serial: String,
    not_before: String,
    not_after: String,
    expires_in_seconds: i64,
}

/// The dump, pretty JSON.
pub(super) fn render(proxy: &Proxy) -> Result<String, serde_json::Error> {
    let now = time::OffsetDateTime::now_utc();
    let pods = proxy.pods();
    let store = proxy.store();
    let dump = ConfigDump {
        store: store_view(&store)?,
        certificates: certificates(proxy, now),
        workload_state: pods
            .iter()
            .map(|p| {
                let w = p.current_workload(&store);
                let id = p.identity();
                let info = WorkloadInfo {
                    name: w.name.clone(),
                    namespace: id.namespace.clone(),
                    trust_domain: id.trust_domain.clone(),
                    service_account: id.service_account.clone(),
                };
                let mut connections = Connections::default();
                for e in p.open.snapshot() {
                    let c = Connection {
                        src: e.src.to_string(),
                        original_dst: e.original_dst.to_string(),
                        actual_dst: e.actual_dst.to_string(),
                        protocol: e.protocol.to_owned(),
                    };
                    match e.direction {
                        Direction::Inbound => connections.inbound.push(c),
                        Direction::Outbound => connections.outbound.push(c),
                    }
                }
                (p.uid.clone(), WorkloadState { state: "Up", connections, info })
            })
            .collect(),
        certificate_source: proxy.certs.mode(),
        pods: pods
            .iter()
            .map(|p| PodDump {
                uid: p.uid.clone(),
                identity: p.identity().to_string(),
                netns_cookie: p.netns.cookie(),
                certificate: p.cert().map(|c| PodCertDump {
                    serial: c.serial(),
                    not_before: c.not_before.to_string(),
                    not_after: c.not_after.to_string(),
                    expires_in_seconds: (c.not_after - now).whole_seconds(),
                }),
            })
            .collect(),
        pool: proxy.pool.dump(),
    };
    serde_json::to_string_pretty(&dump)
}

/// The store as istioctl reads it (the module's comment says what is added to the file's form).
fn store_view(
    store: &crate::state::store::WorkloadStore,
) -> Result<serde_json::Map<String, serde_json::Value>, serde_json::Error> {
    use serde_json::{json, Value};
    let serde_json::Value::Object(mut view) = serde_json::to_value(store)? else {
        return Ok(Default::default());
    };
    // A service's endpoints: the workloads that name it, each under `UID:/IP` (its first
    // address), as ztunnel keys them.
    let mut endpoints: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
    for w in store.workloads() {
        let address = w.workload_ips.first().map(|ip| format!("/{ip}")).unwrap_or_default();
        for (service, ports) in &w.services {
            let port: serde_json::Map<String, Value> =
                ports.iter().map(|(p, t)| (p.to_string(), json!(t))).collect();
            endpoints.entry(service.clone()).or_default().insert(
                format!("{}:{address}", w.uid),
                json!({"workloadUid": w.uid, "service": service, "address": address, "port": port}),
            );
        }
    }
    let defaults = [
        ("workloadType", json!("pod")),
        ("canonicalRevision", json!("")),
        ("clusterId", json!("")),
        ("hostname", json!("")),
        ("network", json!("")),
        ("capacity", json!(1)),
        ("node", json!("")),
    ];
    if let Some(Value::Array(workloads)) = view.get_mut("workloads") {
        for w in workloads.iter_mut().filter_map(Value::as_object_mut) {
            for (key, value) in &defaults {
                w.entry(*key).or_insert_with(|| value.clone());
            }
            flatten_waypoint(w);
        }
    }
    if let Some(Value::Array(services)) = view.get_mut("services") {
        for svc in services.iter_mut().filter_map(Value::as_object_mut) {
            let key = format!(
                "{}/{}",
                svc.get("namespace").and_then(Value::as_str).unwrap_or_default(),
                svc.get("hostname").and_then(Value::as_str).unwrap_or_default()
            );
            svc.insert(
                "endpoints".into(),
                Value::Object(endpoints.remove(&key).unwrap_or_default()),
            );
            svc.entry("ipFamilies").or_insert_with(|| json!(""));
            flatten_waypoint(svc);
        }
    }
    Ok(view)
}

/// A waypoint's destination as istioctl compares it: `NS/HOSTNAME`, or the address as given
/// (`NETWORK/IP` or `IP`), in place of the file's `{hostname: {namespace, hostname}}` or
/// `{address}`.
fn flatten_waypoint(entry: &mut serde_json::Map<String, serde_json::Value>) {
    let Some(dest) = entry.get_mut("waypoint").and_then(|w| w.get_mut("destination")) else {
        return;
    };
    let flat = if let Some(a) = dest.get("address").and_then(|a| a.as_str()) {
        a.to_owned()
    } else if let Some(h) = dest.get("hostname") {
        format!(
            "{}/{}",
            h.get("namespace").and_then(|n| n.as_str()).unwrap_or_default(),
            h.get("hostname").and_then(|n| n.as_str()).unwrap_or_default()
        )
    } else {
        return;
    };
    *dest = serde_json::Value::String(flat);
}

/// Every identity the served pods have (their certificates as they present them), then, from
/// istiod's CA client, those it holds ahead, is asking for, or failed to get; by identity.
fn certificates(proxy: &Proxy, now: time::OffsetDateTime) -> Vec<CertsDump> {
    let roots = proxy.certs.roots();
    let root_certs: Vec<CertDump> = roots.iter().map(|r| cert_dump(r)).collect();
    let entry = |identity: String, state: String, cert: Option<&WorkloadCert>| CertsDump {
        identity,
        state,
        // The chain without the roots the bundle lists (a local CA's chain ends with it).
        cert_chain: cert
            .map(|c| c.chain.iter().filter(|d| !roots.contains(d)).map(|d| cert_dump(d)).collect())
            .unwrap_or_default(),
        root_certs: root_certs.iter().map(CertDump::clone_of).collect(),
    };
    let mut by_identity: BTreeMap<String, CertsDump> = BTreeMap::new();
    for pod in proxy.pods() {
        let id = pod.identity().to_string();
        let cert = pod.cert();
        let state = match &cert {
            Some(c) if c.not_after > now => "Available".to_owned(),
            Some(c) => format!("Unavailable: expired at {}", rfc3339(c.not_after)),
            None => "Initializing".to_owned(),
        };
        by_identity.insert(id.clone(), entry(id, state, cert.as_deref()));
    }
    if let Some(ca) = proxy.certs.ca_client() {
        for (id, state) in ca.states() {
            let id = id.to_string();
            if by_identity.contains_key(&id) {
                continue;
            }
            let e = match state {
                CertState::Available(c) => entry(id.clone(), "Available".into(), Some(&c)),
                CertState::Initializing => entry(id.clone(), "Initializing".into(), None),
                CertState::Unavailable(why) => {
                    entry(id.clone(), format!("Unavailable: {why}"), None)
                }
            };
            by_identity.insert(id, e);
        }
    }
    by_identity.into_values().collect()
}

impl CertDump {
    fn clone_of(&self) -> Self {
        Self {
            pem: self.pem.clone(),
            serial_number: self.serial_number.clone(),
            valid_from: self.valid_from.clone(),
            expiration_time: self.expiration_time.clone(),
        }
    }
}

fn cert_dump(der: &rustls::pki_types::CertificateDer<'_>) -> CertDump {
    let pem = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
    match x509_parser::parse_x509_certificate(der) {
        Ok((_, c)) => CertDump {
            pem,
            serial_number: decimal(c.raw_serial()),
            valid_from: rfc3339(c.validity().not_before.to_datetime()),
            expiration_time: rfc3339(c.validity().not_after.to_datetime()),
        },
        Err(_) => CertDump {
            pem,
            serial_number: String::new(),
            valid_from: String::new(),
            expiration_time: String::new(),
        },
    }
}

/// `2026-12-05T21:30:00Z`: RFC 3339 in UTC, to the second, as ztunnel writes certificate times.
fn rfc3339(t: time::OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// A big-endian unsigned integer (a certificate's serial) in decimal.
fn decimal(big_endian: &[u8]) -> String {
    let mut n: Vec<u8> = big_endian.iter().copied().skip_while(|b| *b == 0).collect();
    if n.is_empty() {
        return "0".to_owned();
    }
    let mut digits = Vec::new();
    while !n.is_empty() {
        // n / 10, most significant byte first; the remainder is the next digit.
        let mut rem = 0u32;
        for b in n.iter_mut() {
            let cur = (rem << 8) | u32::from(*b);
            *b = (cur / 10) as u8;
            rem = cur % 10;
        }
        digits.push(b'0' + rem as u8);
        let zeros = n.iter().take_while(|b| **b == 0).count();
        n.drain(..zeros);
    }
    digits.reverse();
    String::from_utf8(digits).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_numbers_are_written_in_decimal() {
        assert_eq!(decimal(&[]), "0");
        assert_eq!(decimal(&[0, 0]), "0");
        assert_eq!(decimal(&[0x01, 0x00]), "256");
        assert_eq!(decimal(&[0xff; 8]), u64::MAX.to_string());
        // 2^64: past any machine integer.
        assert_eq!(decimal(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), "18446744073709551616");
    }

    #[test]
    fn certificate_times_are_rfc_3339_in_utc() {
        let utc = time::OffsetDateTime::from_unix_timestamp(1_679_403_777).expect("a time");
        let plus_two = time::UtcOffset::from_hms(2, 0, 0).expect("an offset");
        assert_eq!(rfc3339(utc.to_offset(plus_two)), "2023-03-21T13:02:57Z");
    }
}
