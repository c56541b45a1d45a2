//! What `istioctl ztunnel-config` reads from a ztunnel's `/config_dump`: the structure istioctl
//! declares (istio/istio 86c9f01, istioctl/pkg/writer/ztunnel/configdump/api.go; facts carried
//! over) for a strict decode (a key istioctl reads that is missing, renamed or of another type
//! fails; those it marks omitempty may be absent), and its tables rendered as istioctl prints
//! them (a small renderer for the tests, never shipped). Used by istioctl_view.rs and the
//! cluster suite.

use std::collections::BTreeMap;

use serde::Deserialize;

/// The top-level keys istioctl reads (certificates and workload state decoded; the store's
/// three lists only required to be there).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Dump {
    pub workloads: Vec<Workload>,
    pub services: Vec<Service>,
    pub policies: Vec<Policy>,
    pub certificates: Vec<CertsDump>,
    pub workload_state: BTreeMap<String, WorkloadState>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
pub struct Workload {
    pub uid: String,
    pub workload_ips: Vec<String>,
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    pub protocol: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub workload_name: String,
    pub workload_type: String,
    pub canonical_name: String,
    pub canonical_revision: String,
    pub cluster_id: String,
    #[serde(default)]
    pub trust_domain: String,
    pub node: String,
    #[serde(default)]
    pub network: String,
    pub status: String,
    pub hostname: String,
    pub capacity: u32,
    #[serde(default)]
    pub authorization_policies: Vec<String>,
}

#[derive(Deserialize)]
pub struct GatewayAddress {
    pub destination: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
pub struct Service {
    pub name: String,
    pub namespace: String,
    pub hostname: String,
    pub vips: Vec<String>,
    pub ports: BTreeMap<String, u32>,
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    pub endpoints: BTreeMap<String, Endpoint>,
    pub ip_families: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
pub struct Endpoint {
    pub workload_uid: String,
    pub service: String,
    #[serde(default)]
    pub address: String,
    pub port: BTreeMap<String, u16>,
}

#[derive(Deserialize)]
#[allow(dead_code)] // decoded for its shape: istioctl reads each field
pub struct Policy {
    pub name: String,
    pub namespace: String,
    pub scope: String,
    pub action: String,
    pub rules: Vec<Vec<Vec<serde_json::Value>>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertsDump {
    pub identity: String,
    pub state: String,
    pub cert_chain: Vec<Cert>,
    pub root_certs: Vec<Cert>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cert {
    pub pem: String,
    pub serial_number: String,
    pub valid_from: String,
    pub expiration_time: String,
}

#[derive(Deserialize)]
pub struct WorkloadState {
    #[serde(default)]
    pub state: String,
    pub connections: Connections,
    pub info: WorkloadInfo,
}

#[derive(Deserialize)]
pub struct Connections {
    pub inbound: Vec<Connection>,
    pub outbound: Vec<Connection>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Connection {
    pub src: String,
    pub original_dst: Option<String>,
    pub actual_dst: String,
    pub protocol: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadInfo {
    pub name: String,
    pub namespace: String,
    pub trust_domain: String,
    pub service_account: String,
}

/// A decimal number (istioctl's serial) in lower-case hex without leading zeros, as istioctl
/// prints it.
pub fn hex_of_decimal(decimal: &str) -> String {
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
pub fn epoch_of(t: &str) -> Option<i64> {
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
pub fn certificate_rows(dump: &Dump) -> Vec<[String; 7]> {
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
pub fn waypoint_column(w: Option<&GatewayAddress>, services: &[Service]) -> String {
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
pub fn workload_rows(dump: &Dump) -> Vec<[String; 6]> {
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
pub fn service_rows(dump: &Dump) -> Vec<[String; 5]> {
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
pub fn policy_rows(dump: &Dump) -> Vec<[String; 4]> {
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
pub fn connection_rows(dump: &Dump) -> Vec<[String; 6]> {
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
