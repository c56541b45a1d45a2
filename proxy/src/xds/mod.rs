//! The proxy's side of istiod: workloads, services and authorization policies over the delta
//! xDS stream (`DeltaAggregatedResources`), as ztunnel takes them, over the gRPC channel
//! (`crate::istiod`) that the CA client (certs/ca_client.rs) uses too.
//!
//! - One stream, over TLS to `XDS_ADDRESS`, istiod verified against `XDS_ROOT_CA`; every call
//!   carries `authorization: Bearer <token>` (the projected token, re-read each time) and
//!   `clusterid`.
//! - On each (re)connect: one request per type (Address, then Authorization), wildcard, with the
//!   node (ztunnel's id and metadata) and the versions held (`initial_resource_versions`).
//! - Each response is applied as a whole (the proxy's store swapped once) and answered: an ACK
//!   (type and nonce), or a NACK naming each refused resource and why (`name: reason; …`) with
//!   the rest applied. A refused resource keeps what was held under its name.
//! - Ready once one response of each type has been accepted whole (ACKed: a first push with a
//!   refused resource leaves the proxy unready, as ztunnel, until istiod sends one it takes;
//!   serving without a policy it refused could let through what that policy denies). istiod
//!   lost later, the proxy keeps serving the last state and reconnects with a jittered backoff
//!   (`meshpath_xds_connected`, `meshpath_xds_last_applied_timestamp_seconds`).
//! - Bounded: a message over [`MAX_MESSAGE`] ends the stream (the state held stays), and no
//!   type holds more than [`MAX_RESOURCES`].

pub mod convert;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use meshpath_xds::{
    discovery::{
        aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, Node, Status,
    },
    security, workload, ADDRESS_TYPE, AUTHORIZATION_TYPE,
};
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info, warn};

use crate::{
    istiod::{Channel, ChannelConfig},
    metrics::{XdsLabels, XdsTermination},
    proxy::Proxy,
    state::{authorization::Policy, store::WorkloadStore, Synced},
};

/// The largest xDS message accepted: ztunnel's limit, so a mesh whose push ztunnel takes is
/// taken here too (50,000 workloads and 5,000 services make about 12 MiB; a push of
/// [`MAX_RESOURCES`] workloads fits). Over it the stream ends, as it does in ztunnel: gRPC
/// refuses the message before it can be read, so there is no nonce to NACK.
pub const MAX_MESSAGE: usize = 200 * 1024 * 1024;
/// The most resources of one type held.
pub const MAX_RESOURCES: usize = 500_000;
/// Reconnect backoff: from this, doubling, to [`BACKOFF_MAX`], each wait jittered by ±20 %.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(15);

/// Who this proxy is, for the node istiod sees (ztunnel's node id and metadata).
#[derive(Debug, Clone, Default)]
pub struct NodeInfo {
    pub instance_ip: String,
    pub pod_name: String,
    pub pod_namespace: String,
    pub node_name: String,
}

impl NodeInfo {
    /// `ztunnel~IP~POD.NS~NS.svc.cluster.local` with NAME, NAMESPACE, INSTANCE_IPS, NODE_NAME.
    pub fn node(&self) -> Node {
        let ip = if self.instance_ip.is_empty() { "1.1.1.1" } else { &self.instance_ip };
        let string = |s: &str| prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(s.to_owned())),
        };
        let fields = [
            ("NAME", string(&self.pod_name)),
            ("NAMESPACE", string(&self.pod_namespace)),
            ("INSTANCE_IPS", string(ip)),
            ("NODE_NAME", string(&self.node_name)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Node {
            id: format!(
                "ztunnel~{ip}~{}.{}~{}.svc.cluster.local",
                self.pod_name, self.pod_namespace, self.pod_namespace
            ),
            cluster: String::new(),
            metadata: Some(prost_types::Struct { fields }),
        }
    }
}

/// What is held from istiod: the store its resources make, changed in place by each response
/// (its maps are persistent: a response costs what it changes, and the copy handed to the
/// proxy shares the rest), the policies by name, and every resource's version.
#[derive(Debug, Default)]
pub struct Held {
    store: WorkloadStore,
    policies: BTreeMap<String, Arc<Policy>>,
    versions: HashMap<&'static str, HashMap<String, String>>,
}

/// The reply a response gets, and whether it changed what is held.
#[derive(Debug)]
pub struct Applied {
    pub reply: DeltaDiscoveryRequest,
    pub changed: bool,
    /// Whether a workload left, or one changed the workload it is counted under (telemetry of
    /// workloads no longer in the store is then removed).
    pub workloads_left: bool,
    pub refused: usize,
}

fn kind(type_url: &str) -> Option<&'static str> {
    match type_url {
        ADDRESS_TYPE => Some(ADDRESS_TYPE),
        AUTHORIZATION_TYPE => Some(AUTHORIZATION_TYPE),
        _ => None,
    }
}

impl Held {
    /// The first request of a stream for `type_url`: wildcard, the node, the versions held.
    pub fn initial_request(&self, type_url: &'static str, node: &Node) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            node: Some(node.clone()),
            type_url: type_url.to_owned(),
            initial_resource_versions: self.versions.get(type_url).cloned().unwrap_or_default(),
            ..Default::default()
        }
    }

    /// How many resources of each type are held.
    pub fn counts(&self) -> (usize, usize, usize) {
        self.store.counts()
    }

    /// The store these resources make (a copy sharing all of it).
    pub fn store(&self) -> WorkloadStore {
        self.store.clone()
    }

    /// Applies one response; the reply to send (ACK, or NACK naming what was refused).
    pub fn apply(&mut self, resp: &DeltaDiscoveryResponse) -> Applied {
        let ack = |error: Option<String>| DeltaDiscoveryRequest {
            type_url: resp.type_url.clone(),
            response_nonce: resp.nonce.clone(),
            error_detail: error.map(|message| Status { code: 0, message, details: vec![] }),
            ..Default::default()
        };
        let Some(kind) = kind(&resp.type_url) else {
            warn!(type_url = %resp.type_url, "xDS response of a type never asked for; ignored");
            return Applied { reply: ack(None), changed: false, workloads_left: false, refused: 0 };
        };
        let mut refused: Vec<(String, String)> = Vec::new();
        let mut seen = HashSet::new();
        let mut changed = false;
        let mut workloads_left = false;
        let mut policies_changed = false;
        for r in &resp.resources {
            if !seen.insert(r.name.as_str()) {
                refused.push((r.name.clone(), "the name appears twice in one response".into()));
                continue;
            }
            let Some(any) = &r.resource else {
                refused.push((r.name.clone(), "XDS payload without resource".into()));
                continue;
            };
            if any.type_url != resp.type_url {
                // Decoded as the response's type, another type's bytes could parse as garbage.
                refused
                    .push((r.name.clone(), format!("a {} in a response of {kind}", any.type_url)));
                continue;
            }
            let result = if kind == ADDRESS_TYPE {
                self.apply_address(&r.name, &any.value).map(|left| workloads_left |= left)
            } else {
                self.apply_policy(&r.name, &any.value).map(|()| policies_changed = true)
            };
            match result {
                Ok(()) => {
                    changed = true;
                    self.versions
                        .entry(kind)
                        .or_default()
                        .insert(r.name.clone(), r.version.clone());
                }
                Err(why) => refused.push((r.name.clone(), why)),
            }
        }
        for name in &resp.removed_resources {
            let removed = if kind == ADDRESS_TYPE {
                let workload = self.store.remove_workload(name).is_some();
                workloads_left |= workload;
                workload | self.store.remove_service(name).is_some()
            } else {
                let policy = self.policies.remove(name).is_some();
                policies_changed |= policy;
                policy
            };
            changed |= removed;
            if let Some(v) = self.versions.get_mut(kind) {
                v.remove(name);
            }
        }
        if policies_changed {
            self.store.set_policies(self.policies.values().cloned().collect());
        }
        let n = refused.len();
        let error = (!refused.is_empty()).then(|| nack_text(&refused));
        Applied { reply: ack(error), changed, workloads_left, refused: n }
    }

    /// Puts one Address resource into the store; whether a workload it replaced was counted
    /// under another workload (telemetry).
    fn apply_address(&mut self, name: &str, bytes: &[u8]) -> Result<bool, String> {
        let a = workload::Address::decode(bytes).map_err(|e| format!("decode: {e}"))?;
        let (workloads, services, _) = self.store.counts();
        match convert::address(name, &a)? {
            convert::Address::Workload(w) => {
                if !self.store.has_workload(name) && workloads >= MAX_RESOURCES {
                    return Err(format!("more than {MAX_RESOURCES} workloads"));
                }
                let counted_as = (w.namespace.clone(), w.workload_label().to_owned());
                let old = self.store.put_workload(name, Arc::new(w));
                Ok(old.is_some_and(|o| {
                    (o.namespace.as_str(), o.workload_label()) != (&counted_as.0, &counted_as.1)
                }))
            }
            convert::Address::Service(s) => {
                if !self.store.has_service(name) && services >= MAX_RESOURCES {
                    return Err(format!("more than {MAX_RESOURCES} services"));
                }
                self.store.put_service(name, Arc::new(s));
                Ok(false)
            }
        }
    }

    fn apply_policy(&mut self, name: &str, bytes: &[u8]) -> Result<(), String> {
        let a = security::Authorization::decode(bytes).map_err(|e| format!("decode: {e}"))?;
        let p = convert::policy(name, &a)?;
        if !self.policies.contains_key(name) && self.policies.len() >= MAX_RESOURCES {
            return Err(format!("more than {MAX_RESOURCES} policies"));
        }
        self.policies.insert(name.to_owned(), Arc::new(p));
        Ok(())
    }
}

/// How the proxy reaches istiod's xDS.
#[derive(Debug, Clone)]
pub struct XdsConfig {
    pub channel: ChannelConfig,
    pub node: NodeInfo,
}

/// Runs the xDS client until the process ends: connects, applies, reconnects.
pub fn spawn(proxy: Arc<Proxy>, cfg: XdsConfig, synced: Arc<Synced>) {
    tokio::spawn(async move {
        let mut held = Held::default();
        let node = cfg.node.node();
        let mut backoff = BACKOFF_FIRST;
        loop {
            let started = std::time::Instant::now();
            let ended = session(&proxy, &cfg, &node, &mut held, &synced).await;
            // Whether the stream had opened (`session` sets the gauge once it has).
            let opened = proxy.metrics.xds_connected.get() == 1;
            match ended {
                Ok(()) => {
                    proxy.metrics.xds_terminated(XdsTermination::Complete);
                    info!("xDS stream ended; reconnecting")
                }
                Err(e) => {
                    proxy.metrics.xds_terminated(if opened {
                        XdsTermination::Error
                    } else {
                        XdsTermination::ConnectionError
                    });
                    warn!(error = %format!("{e:#}"), "xDS stream failed; keeping the state held and reconnecting")
                }
            }
            proxy.metrics.xds_connected.set(0);
            // A stream that lived a while starts the backoff over.
            if started.elapsed() > Duration::from_secs(30) {
                backoff = BACKOFF_FIRST;
            }
            tokio::time::sleep(jitter(backoff)).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    });
}

/// `d` ± 20 %.
fn jitter(d: Duration) -> Duration {
    let mut b = [0u8; 2];
    let _ = getrandom(&mut b);
    let r = f64::from(u16::from_ne_bytes(b)) / f64::from(u16::MAX); // 0..=1
    d.mul_f64(0.8 + 0.4 * r)
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    // SAFETY: getrandom writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

async fn session(
    proxy: &Arc<Proxy>,
    cfg: &XdsConfig,
    node: &Node,
    held: &mut Held,
    synced: &Synced,
) -> anyhow::Result<()> {
    let channel = Channel::connect(&cfg.channel).await?;
    let mut client = AggregatedDiscoveryServiceClient::with_interceptor(
        channel.inner.clone(),
        channel.interceptor(),
    )
    .max_decoding_message_size(MAX_MESSAGE);
    let (tx, rx) = mpsc::channel(8);
    // The stream begins with one request per type (Address first, as ztunnel).
    for t in [ADDRESS_TYPE, AUTHORIZATION_TYPE] {
        tx.send(held.initial_request(t, node)).await?;
    }
    let mut responses =
        client.delta_aggregated_resources(ReceiverStream::new(rx)).await?.into_inner();
    proxy.metrics.xds_connected.set(1);
    info!(address = %cfg.channel.address, "xDS stream to istiod open");
    while let Some(resp) = responses.message().await? {
        let applied = held.apply(&resp);
        let kind_label = match resp.type_url.as_str() {
            ADDRESS_TYPE => "address",
            AUTHORIZATION_TYPE => "authorization",
            _ => "other",
        };
        if applied.changed {
            proxy.set_store(held.store(), applied.workloads_left);
            let (w, s, p) = held.counts();
            for (k, n) in [("workload", w), ("service", s), ("authorization", p)] {
                proxy
                    .metrics
                    .xds_resources
                    .get_or_create(&XdsLabels { kind: k.into(), reply: String::new() })
                    .set(n as i64);
            }
        }
        let nack = applied.reply.error_detail.is_some();
        if let Some(e) = &applied.reply.error_detail {
            warn!(kind = kind_label, refused = applied.refused, error = %e.message, "xDS resources refused (NACK); the rest applied");
        } else {
            match resp.type_url.as_str() {
                ADDRESS_TYPE => synced.set_addresses(),
                AUTHORIZATION_TYPE => synced.set_authorization(),
                _ => {}
            }
        }
        proxy
            .metrics
            .xds_responses
            .get_or_create(&XdsLabels {
                kind: kind_label.into(),
                reply: if nack { "nack" } else { "ack" }.into(),
            })
            .inc();
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        proxy.metrics.xds_last_applied.set(now.as_secs() as i64);
        tx.send(applied.reply).await?;
    }
    Ok(())
}

/// The token file's path default, as ztunnel's DaemonSet mounts it.
pub fn default_token_path() -> PathBuf {
    PathBuf::from("/var/run/secrets/tokens/istio-token")
}

/// Refused resources named in one NACK, and bytes of each name and of each reason: a response
/// of 10,000 bad resources (or one with a huge name) is answered in a few kilobytes, not with
/// all of them joined (istiod logs the text, and sends the next push regardless).
const NACK_NAMES: usize = 16;
const NACK_FIELD_BYTES: usize = 256;

/// The NACK's text: the first refused resources, each `name: reason` cut to a bound, and how
/// many more there were.
fn nack_text(refused: &[(String, String)]) -> String {
    fn cut(s: &str) -> &str {
        let mut end = s.len().min(NACK_FIELD_BYTES);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        &s[..end]
    }
    let mut text = refused
        .iter()
        .take(NACK_NAMES)
        .map(|(name, why)| format!("{}: {}", cut(name), cut(why)))
        .collect::<Vec<_>>()
        .join("; ");
    if refused.len() > NACK_NAMES {
        text.push_str(&format!("; and {} more refused", refused.len() - NACK_NAMES));
    }
    text
}

#[cfg(test)]
mod tests {
    //! A hostile or malformed push, as `Held::apply` takes it: each refused resource is named
    //! in the NACK with its reason, the rest of the response is applied, and what was held
    //! under a refused name stays.

    use meshpath_xds::discovery::Resource;

    use super::*;

    fn resource(name: &str, type_url: &str, value: Vec<u8>) -> Resource {
        Resource {
            name: name.into(),
            version: "v1".into(),
            resource: Some(prost_types::Any { type_url: type_url.into(), value }),
            ..Default::default()
        }
    }

    fn pod(uid: &str, sa: &str) -> workload::Workload {
        workload::Workload {
            uid: uid.into(),
            name: uid.into(),
            namespace: "ns".into(),
            service_account: sa.into(),
            addresses: vec![vec![10, 0, 0, 1].into()],
            tunnel_protocol: workload::TunnelProtocol::Hbone as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_nack_of_many_refused_resources_names_the_first_and_counts_the_rest() {
        let long = "x".repeat(100_000);
        let mut resources: Vec<Resource> =
            (0..10_000).map(|i| resource(&format!("bad-{i}"), ADDRESS_TYPE, vec![0xff])).collect();
        resources.insert(0, resource(&long, ADDRESS_TYPE, vec![0xff]));
        let mut held = Held::default();
        let applied = held.apply(&response(ADDRESS_TYPE, resources, &[]));
        assert_eq!(applied.refused, 10_001);
        let text = nack(&applied);
        assert!(text.len() < 16 * 1024, "a NACK of {} bytes", text.len());
        assert!(text.starts_with(&"x".repeat(NACK_FIELD_BYTES)), "{}", &text[..300]);
        assert!(text.contains("bad-0: ") && text.ends_with("; and 9985 more refused"), "{text}");
    }

    fn address(w: workload::Workload) -> Vec<u8> {
        workload::Address { r#type: Some(workload::address::Type::Workload(w)) }.encode_to_vec()
    }

    fn response(
        type_url: &str,
        resources: Vec<Resource>,
        removed: &[&str],
    ) -> DeltaDiscoveryResponse {
        DeltaDiscoveryResponse {
            type_url: type_url.into(),
            nonce: "n1".into(),
            resources,
            removed_resources: removed.iter().map(|r| (*r).to_owned()).collect(),
            ..Default::default()
        }
    }

    fn nack(applied: &Applied) -> String {
        applied.reply.error_detail.as_ref().map(|e| e.message.clone()).unwrap_or_default()
    }

    fn policy(name: &str, ns: &str, scope: security::Scope) -> security::Authorization {
        security::Authorization {
            name: name.into(),
            namespace: ns.into(),
            scope: scope as i32,
            action: security::Action::Deny as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_name_twice_in_one_response_is_refused_the_second_time() {
        let mut held = Held::default();
        let applied = held.apply(&response(
            ADDRESS_TYPE,
            vec![
                resource("a", ADDRESS_TYPE, address(pod("a", "first"))),
                resource("a", ADDRESS_TYPE, address(pod("a", "second"))),
            ],
            &[],
        ));
        assert_eq!(applied.refused, 1);
        assert_eq!(nack(&applied), "a: the name appears twice in one response");
        let store = held.store();
        assert_eq!(store.by_uid("a").map(|w| w.service_account.as_str()), Some("first"));
    }

    #[test]
    fn an_unknown_enum_is_refused_and_what_was_held_under_its_name_stays() {
        let mut held = Held::default();
        held.apply(&response(
            ADDRESS_TYPE,
            vec![resource("a", ADDRESS_TYPE, address(pod("a", "old")))],
            &[],
        ));
        let mut bad = pod("a", "new");
        bad.tunnel_protocol = 7;
        let applied = held.apply(&response(
            ADDRESS_TYPE,
            vec![
                resource("a", ADDRESS_TYPE, address(bad)),
                resource("b", ADDRESS_TYPE, address(pod("b", "b"))),
            ],
            &[],
        ));
        assert_eq!(applied.refused, 1);
        assert!(
            nack(&applied).starts_with("a: unknown enum: tunnel protocol"),
            "{}",
            nack(&applied)
        );
        let store = held.store();
        assert_eq!(store.by_uid("a").map(|w| w.service_account.as_str()), Some("old"));
        assert!(store.by_uid("b").is_some(), "the rest of the response was not applied");
    }

    #[test]
    fn a_resource_of_the_other_type_in_a_response_is_refused() {
        let mut held = Held::default();
        // A valid policy under its right name, labelled as an address: only the type check
        // refuses it (its bytes decode, and would apply, as the response's type).
        let valid = policy("p", "ns", security::Scope::Namespace).encode_to_vec();
        let applied = held.apply(&response(
            AUTHORIZATION_TYPE,
            vec![resource("ns/p", ADDRESS_TYPE, valid.clone())],
            &[],
        ));
        assert_eq!(applied.refused, 1, "{}", nack(&applied));
        assert_eq!(held.counts(), (0, 0, 0));
        // The control: labelled right, the same bytes apply.
        let applied = held.apply(&response(
            AUTHORIZATION_TYPE,
            vec![resource("ns/p", AUTHORIZATION_TYPE, valid)],
            &[],
        ));
        assert_eq!(applied.refused, 0, "{}", nack(&applied));
        assert_eq!(held.counts(), (0, 0, 1));
    }

    #[test]
    fn a_host_network_workload_is_kept_and_never_found_by_its_nodes_address() {
        let mut held = Held::default();
        let mut host = pod("kube-proxy", "kube-proxy");
        host.network_mode = workload::NetworkMode::HostNetwork as i32;
        let applied = held.apply(&response(
            ADDRESS_TYPE,
            vec![resource("kube-proxy", ADDRESS_TYPE, address(host))],
            &[],
        ));
        assert_eq!(applied.refused, 0, "{}", nack(&applied));
        let store = held.store();
        assert!(store.by_uid("kube-proxy").is_some());
        assert!(store.by_ip("10.0.0.1".parse().expect("ip")).is_none(), "found by the node's IP");
    }

    #[test]
    fn a_policy_with_a_bad_cidr_or_a_name_that_is_not_its_key_is_refused() {
        let mut held = Held::default();
        let mut cidr = policy("p", "ns", security::Scope::Namespace);
        cidr.rules = vec![security::Rule {
            clauses: vec![security::Clause {
                matches: vec![security::Match {
                    source_ips: vec![security::Address {
                        address: vec![10, 0, 0, 0].into(),
                        length: 33,
                    }],
                    ..Default::default()
                }],
            }],
        }];
        let applied = held.apply(&response(
            AUTHORIZATION_TYPE,
            vec![
                resource("ns/p", AUTHORIZATION_TYPE, cidr.encode_to_vec()),
                resource(
                    "other/q",
                    AUTHORIZATION_TYPE,
                    policy("q", "ns", security::Scope::Global).encode_to_vec(),
                ),
            ],
            &[],
        ));
        let msg = nack(&applied);
        assert_eq!(applied.refused, 2, "{msg}");
        assert!(msg.contains("ns/p: invalid cidr: 10.0.0.0/33"), "{msg}");
        assert!(msg.contains("other/q: a policy's resource name must be NAMESPACE/NAME"), "{msg}");
        assert_eq!(held.counts(), (0, 0, 0));
    }

    #[test]
    fn a_policy_that_selects_no_workload_is_held_and_applies_to_none() {
        // ztunnel takes a WORKLOAD_SELECTOR policy no workload names: it selects nothing.
        let mut held = Held::default();
        let applied = held.apply(&response(
            AUTHORIZATION_TYPE,
            vec![resource(
                "ns/p",
                AUTHORIZATION_TYPE,
                policy("p", "ns", security::Scope::WorkloadSelector).encode_to_vec(),
            )],
            &[],
        ));
        assert!(applied.reply.error_detail.is_none(), "{}", nack(&applied));
        held.apply(&response(
            ADDRESS_TYPE,
            vec![resource("a", ADDRESS_TYPE, address(pod("a", "a")))],
            &[],
        ));
        let store = held.store();
        let a = store.by_uid("a").expect("a");
        assert_eq!(held.counts(), (1, 0, 1));
        assert!(store.policies_for(a).is_empty());
    }

    #[test]
    fn removing_a_name_never_held_changes_nothing_and_is_acked() {
        let mut held = Held::default();
        held.apply(&response(
            ADDRESS_TYPE,
            vec![resource("a", ADDRESS_TYPE, address(pod("a", "a")))],
            &[],
        ));
        let applied = held.apply(&response(ADDRESS_TYPE, vec![], &["nobody"]));
        assert!(applied.reply.error_detail.is_none());
        assert!(!applied.changed && !applied.workloads_left);
        assert_eq!(held.counts(), (1, 0, 0));
    }
}
