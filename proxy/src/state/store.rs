//! The workload store: the workloads, services and L4 authorization policies the proxy knows,
//! from istiod (`crate::xds`) or the workloads file (`crate::reload`).
//!
//! A store is indexed by what a connection looks up (the workload at an address, the service at
//! a VIP, a service's endpoints, the policies that apply to a destination): a hash lookup, not
//! a walk over every workload, service and policy in the mesh. A connection holds the store of
//! its start (a snapshot); the proxy swaps in a new one when the mesh changes.
//!
//! Its maps are persistent (`imbl`): a copy shares everything with the original, and changing
//! one workload or service in it costs that entry's index entries, so istiod's delta of one pod
//! makes a new store in microseconds whatever the mesh's size (the control-plane benchmark
//! measures it). Policies are few and a change re-checks every open connection anyway: they are
//! indexed again as a whole when they change.
//!
//! An address, uid, VIP or hostname that several entries claim (a pod's address reused while
//! the pod that had it is still listed) is served by one of them, chosen as ztunnel chooses:
//! for a workload, a pod in the mesh before a pod, a pod before a workload entry, a workload in
//! the mesh before one that is not; among equals, from istiod the one written last, from the
//! file the first. Removing it hands the key to the next claimant (`Claims`).

use std::{collections::HashMap, net::IpAddr, path::Path, sync::Arc};

use imbl::{HashMap as PHashMap, OrdMap, Vector};
use serde::{Deserialize, Serialize};

use crate::state::{
    authorization::{Policy, Scope},
    workloads::{
        parse_vip, HealthStatus, NetworkMode, Protocol, Service, Waypoint, WaypointAt, Workload,
    },
};

/// The file's shape (and what `/config_dump` shows): its entries in its order.
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
struct Contents {
    #[serde(default)]
    workloads: Vec<Arc<Workload>>,
    #[serde(default)]
    services: Vec<Arc<Service>>,
    #[serde(default)]
    policies: Vec<Arc<Policy>>,
}

/// The policies and their index, made again whenever they change.
#[derive(Debug, Default)]
struct Policies {
    /// In file order, or from xDS in name order.
    all: Vec<Arc<Policy>>,
    /// GLOBAL policies (positions in `all`).
    global: Vec<usize>,
    /// NAMESPACE policies by their namespace.
    namespace: HashMap<String, Vec<usize>>,
    /// Every policy by key (`NS/NAME`), as workloads name the policies that select them.
    by_key: HashMap<String, Vec<usize>>,
}

impl Policies {
    fn of(all: Vec<Arc<Policy>>) -> Self {
        let mut p = Self { all, ..Self::default() };
        for (i, policy) in p.all.iter().enumerate() {
            match policy.scope {
                Scope::Global => p.global.push(i),
                Scope::Namespace => {
                    p.namespace.entry(policy.namespace.clone()).or_default().push(i)
                }
                Scope::WorkloadSelector => {}
            }
            p.by_key.entry(policy.key()).or_default().push(i);
        }
        p
    }
}

/// Everything the proxy knows about the mesh (see the module docs). Entries are kept under a
/// name: istiod's resource name, or for the file the entry's position (so the name order is
/// the file order).
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(from = "Contents", into = "Contents")]
pub struct WorkloadStore {
    workloads: OrdMap<String, Arc<Workload>>,
    services: OrdMap<String, Arc<Service>>,
    policies: Arc<Policies>,
    workload_by_ip: PHashMap<IpAddr, Claims<Workload>>,
    /// Workloads not kept under their uid (the file's, kept under their position); istiod's
    /// are found by name.
    workload_by_uid: PHashMap<String, Claims<Workload>>,
    service_by_vip: PHashMap<IpAddr, Claims<Service>>,
    /// Lower-cased.
    service_by_hostname: PHashMap<String, Claims<Service>>,
    /// Service key (`NS/HOSTNAME`) → the workloads that back it, by their names.
    backends: PHashMap<String, OrdMap<String, Arc<Workload>>>,
}

/// The name a file's entry `i` is kept under: sorts in file order.
fn file_name(i: usize) -> String {
    format!("#{i:010}")
}

impl From<Contents> for WorkloadStore {
    fn from(c: Contents) -> Self {
        let mut store = Self::default();
        for (i, w) in c.workloads.into_iter().enumerate() {
            store.index_workload(file_name(i), &w, false);
            store.workloads.insert(file_name(i), w);
        }
        for (i, s) in c.services.into_iter().enumerate() {
            store.index_service(&s, false);
            store.services.insert(file_name(i), s);
        }
        store.policies = Arc::new(Policies::of(c.policies));
        store
    }
}

impl From<WorkloadStore> for Contents {
    fn from(store: WorkloadStore) -> Self {
        Self {
            workloads: store.workloads.values().cloned().collect(),
            services: store.services.values().cloned().collect(),
            policies: store.policies.all.clone(),
        }
    }
}

/// A configuration file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {0}: {1}")]
    Read(String, std::io::Error),
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
}

/// The entries that claim one key of an index. Nearly always one; the enum keeps that case a
/// single pointer in the index's nodes, as the maps hold their values inline. Several are kept
/// by rank, each rank in claiming order, in persistent vectors: adding one or finding the one
/// served takes the same time however many claim the key (a copy of every claimant per
/// addition made istiod's 10,000 workloads of one address cost 10,000² copies), and taking
/// one away walks only its rank's.
#[derive(Debug)]
enum Claims<V> {
    One(Arc<V>),
    /// By rank; within one, in claiming order: the last of the best-ranked is served.
    Many(Arc<[Vector<Arc<V>>; RANKS]>),
}

/// How many ranks there are (`Rank::rank` is below this).
const RANKS: usize = 4;

impl<V> Clone for Claims<V> {
    fn clone(&self) -> Self {
        match self {
            Self::One(v) => Self::One(v.clone()),
            Self::Many(all) => Self::Many(all.clone()),
        }
    }
}

/// How a claimant ranks (ztunnel's order when several workloads have one address): below
/// [`RANKS`].
trait Rank {
    fn rank(&self) -> u8;
}

impl Rank for Workload {
    fn rank(&self) -> u8 {
        // A pod is not spoofable as a workload entry is; one in the mesh says more of itself.
        let pod = self.uid.contains("//Pod/");
        let hbone = self.protocol == Protocol::Hbone;
        u8::from(pod) * 2 + u8::from(hbone)
    }
}

impl Rank for Service {
    fn rank(&self) -> u8 {
        0
    }
}

fn rank_of<V: Rank>(v: &V) -> usize {
    usize::from(v.rank()).min(RANKS - 1)
}

impl<V: Rank> Claims<V> {
    /// The claimant served.
    fn served(&self) -> Option<&V> {
        match self {
            Self::One(v) => Some(v),
            Self::Many(ranks) => ranks.iter().rev().find_map(|r| r.last()).map(|v| &**v),
        }
    }

    /// Adds a claimant: served before equals already there unless `first_wins`.
    fn add(&mut self, v: Arc<V>, first_wins: bool) {
        let ranks = match self {
            Self::One(one) => {
                let mut ranks: [Vector<Arc<V>>; RANKS] = Default::default();
                ranks[rank_of(&**one)].push_back(one.clone());
                *self = Self::Many(Arc::new(ranks));
                match self {
                    Self::Many(ranks) => ranks,
                    Self::One(_) => return,
                }
            }
            Self::Many(ranks) => ranks,
        };
        // Copies the four vectors' roots, not their claimants.
        let rank = &mut Arc::make_mut(ranks)[rank_of(&*v)];
        if first_wins {
            rank.push_front(v);
        } else {
            rank.push_back(v);
        }
    }

    /// Takes `v`'s claim away; whether none is left.
    fn remove(&mut self, v: &Arc<V>) -> bool {
        let Self::Many(ranks) = self else {
            return matches!(self, Self::One(one) if Arc::ptr_eq(one, v));
        };
        let r = rank_of(&**v);
        if let Some(i) = ranks[r].iter().position(|c| Arc::ptr_eq(c, v)) {
            Arc::make_mut(ranks)[r].remove(i);
        }
        let left: usize = ranks.iter().map(Vector::len).sum();
        match left {
            0 => true,
            1 => {
                if let Some(last) = ranks.iter().find_map(|r| r.front().cloned()) {
                    *self = Self::One(last);
                }
                false
            }
            _ => false,
        }
    }
}

/// Adds `v`'s claim on `k`.
fn claim<K, V: Rank>(map: &mut PHashMap<K, Claims<V>>, k: K, v: Arc<V>, first_wins: bool)
where
    K: std::hash::Hash + Eq + Clone,
{
    match map.get_mut(&k) {
        Some(claims) => claims.add(v, first_wins),
        None => {
            map.insert(k, Claims::One(v));
        }
    }
}

/// Takes `v`'s claim on `k` away; the key goes with its last claimant.
fn release<K, V: Rank>(map: &mut PHashMap<K, Claims<V>>, k: &K, v: &Arc<V>)
where
    K: std::hash::Hash + Eq + Clone,
{
    if map.get_mut(k).is_some_and(|claims| claims.remove(v)) {
        map.remove(k);
    }
}

impl WorkloadStore {
    /// Reads the YAML file; errors name the line and the field.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(file.clone(), e))?;
        Self::parse(&text).map_err(|message| ConfigError::Parse { file, message })
    }

    /// Parses YAML text and checks what serde cannot (service VIPs).
    pub fn parse(text: &str) -> Result<Self, String> {
        let store: Self = serde_yaml::from_str(text).map_err(|e| match e.location() {
            Some(l) => format!("line {}, column {}: {e}", l.line(), l.column()),
            None => e.to_string(),
        })?;
        let waypoint = |wp: &Option<Waypoint>| match wp.as_ref().map(|w| &w.destination) {
            Some(WaypointAt::Address(a)) => parse_vip(a).map(drop),
            _ => Ok(()),
        };
        for (i, s) in store.services().enumerate() {
            for v in &s.vips {
                parse_vip(v).map_err(|e| format!("services[{i}].vips: {e}"))?;
            }
            waypoint(&s.waypoint).map_err(|e| format!("services[{i}].waypoint: {e}"))?;
        }
        for (i, w) in store.workloads().enumerate() {
            waypoint(&w.waypoint).map_err(|e| format!("workloads[{i}].waypoint: {e}"))?;
        }
        Ok(store)
    }

    /// The addresses a workload is found by: none for a host-network one (they are its node's).
    fn own_ips(w: &Workload) -> &[IpAddr] {
        match w.network_mode {
            NetworkMode::Standard => &w.workload_ips,
            NetworkMode::HostNetwork => &[],
        }
    }

    fn index_workload(&mut self, name: String, w: &Arc<Workload>, last_wins: bool) {
        let first_wins = !last_wins;
        for ip in Self::own_ips(w) {
            claim(&mut self.workload_by_ip, *ip, w.clone(), first_wins);
        }
        // Kept under its uid (istiod names a workload by it), the map of workloads is its uid
        // index: a second index would hold every uid again.
        if name != w.uid {
            claim(&mut self.workload_by_uid, w.uid.clone(), w.clone(), first_wins);
        }
        for key in w.services.keys() {
            let mut backends = self.backends.get(key).cloned().unwrap_or_default();
            backends.insert(name.clone(), w.clone());
            self.backends.insert(key.clone(), backends);
        }
    }

    fn unindex_workload(&mut self, name: &str, w: &Arc<Workload>) {
        for ip in Self::own_ips(w) {
            release(&mut self.workload_by_ip, ip, w);
        }
        release(&mut self.workload_by_uid, &w.uid, w);
        for key in w.services.keys() {
            if let Some(mut backends) = self.backends.get(key).cloned() {
                backends.remove(name);
                if backends.is_empty() {
                    self.backends.remove(key);
                } else {
                    self.backends.insert(key.clone(), backends);
                }
            }
        }
    }

    fn index_service(&mut self, s: &Arc<Service>, last_wins: bool) {
        for vip in s.vip_addrs() {
            claim(&mut self.service_by_vip, vip, s.clone(), !last_wins);
        }
        claim(
            &mut self.service_by_hostname,
            s.hostname.to_ascii_lowercase(),
            s.clone(),
            !last_wins,
        );
    }

    fn unindex_service(&mut self, s: &Arc<Service>) {
        for vip in s.vip_addrs() {
            release(&mut self.service_by_vip, &vip, s);
        }
        release(&mut self.service_by_hostname, &s.hostname.to_ascii_lowercase(), s);
    }

    /// Puts workload `w` under `name` (istiod's resource name), replacing what was there; it
    /// takes its addresses and uid. Returns what it replaced.
    pub fn put_workload(&mut self, name: &str, w: Arc<Workload>) -> Option<Arc<Workload>> {
        let old = self.remove_workload(name);
        self.index_workload(name.to_owned(), &w, true);
        self.workloads.insert(name.to_owned(), w);
        old
    }

    /// Removes the workload under `name`; returns it.
    pub fn remove_workload(&mut self, name: &str) -> Option<Arc<Workload>> {
        let old = self.workloads.remove(name)?;
        self.unindex_workload(name, &old);
        Some(old)
    }

    /// Puts service `s` under `name`, replacing what was there; it takes its VIPs and hostname.
    pub fn put_service(&mut self, name: &str, s: Arc<Service>) -> Option<Arc<Service>> {
        let old = self.remove_service(name);
        self.index_service(&s, true);
        self.services.insert(name.to_owned(), s);
        old
    }

    /// Removes the service under `name`; returns it.
    pub fn remove_service(&mut self, name: &str) -> Option<Arc<Service>> {
        let old = self.services.remove(name)?;
        self.unindex_service(&old);
        Some(old)
    }

    /// Replaces every policy (in this order).
    pub fn set_policies(&mut self, policies: Vec<Arc<Policy>>) {
        self.policies = Arc::new(Policies::of(policies));
    }

    /// Whether `other` has the same policies (the same set, not an equal one).
    pub fn same_policies(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.policies, &other.policies)
    }

    /// Whether a workload is held under `name`.
    pub fn has_workload(&self, name: &str) -> bool {
        self.workloads.contains_key(name)
    }

    /// Whether a service is held under `name`.
    pub fn has_service(&self, name: &str) -> bool {
        self.services.contains_key(name)
    }

    /// How many workloads, services and policies it holds.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.workloads.len(), self.services.len(), self.policies.all.len())
    }

    /// Every workload, in file order (from istiod: in name order).
    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values()
    }

    /// Every service, in file order (from istiod: in name order).
    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services.values()
    }

    /// Every authorization policy, in file order (from istiod: in name order).
    pub fn policies(&self) -> &[Arc<Policy>] {
        &self.policies.all
    }

    /// The authorization policies that apply to `dst` ([`Policy::selects`]), in file order:
    /// GLOBAL ones, NAMESPACE ones of its namespace, and those it names.
    pub fn policies_for(&self, dst: &Workload) -> Vec<&Policy> {
        let p = &*self.policies;
        let mut at: Vec<usize> = p.global.clone();
        if let Some(own) = p.namespace.get(&dst.namespace) {
            at.extend(own);
        }
        for key in &dst.authorization_policies {
            if let Some(named) = p.by_key.get(key) {
                at.extend(named);
            }
        }
        at.sort_unstable();
        at.dedup();
        at.into_iter().map(|i| &*p.all[i]).collect()
    }

    /// The workload that owns `ip`.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.workload_by_ip.get(&ip).and_then(Claims::served)
    }

    /// The workload with this uid.
    pub fn by_uid(&self, uid: &str) -> Option<&Workload> {
        self.workload_by_uid
            .get(uid)
            .and_then(Claims::served)
            .or_else(|| self.workloads.get(uid).map(|w| &**w))
    }

    /// The service with `ip` among its VIPs.
    pub fn service_by_vip(&self, ip: IpAddr) -> Option<&Service> {
        self.service_by_vip.get(&ip).and_then(Claims::served)
    }

    /// The service with this hostname (any case, with or without the final dot).
    pub fn service_by_hostname(&self, host: &str) -> Option<&Service> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.service_by_hostname.get(&host).and_then(Claims::served)
    }

    /// The healthy endpoints of `svc` for service port `port`: each workload and the port it
    /// listens on, in file order (from istiod: in name order).
    pub fn endpoints(&self, svc: &Service, port: u16) -> Vec<(&Workload, u16)> {
        let key = svc.key();
        let Some(backends) = self.backends.get(&key) else { return Vec::new() };
        backends
            .values()
            .map(|w| &**w)
            .filter(|w| w.status == HealthStatus::Healthy)
            .filter_map(|w| {
                let ports = w.services.get(&key)?;
                let target =
                    ports.get(&port).or_else(|| svc.ports.get(&port)).copied().unwrap_or(port);
                Some((w, target))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::workloads::Protocol;

    #[test]
    fn ztunnel_style_workloads_parse() {
        let s = WorkloadStore::parse(
            "workloads:\n- uid: a\n  name: web\n  namespace: default\n  serviceAccount: web\n  workloadIps: [10.0.0.1]\n  protocol: HBONE\n  node: n1\nservices: []\n",
        )
        .expect("parse");
        let w = s.by_ip("10.0.0.1".parse().expect("ip")).expect("workload");
        assert_eq!(w.protocol, Protocol::Hbone);
        assert_eq!(w.identity().to_string(), "spiffe://cluster.local/ns/default/sa/web");
    }

    #[test]
    fn errors_name_the_line_and_field() {
        let err = WorkloadStore::parse("workloads:\n- uid: a\n  namespace: default\n")
            .expect_err("accepted");
        assert!(err.contains("line 2") && err.contains("serviceAccount"), "{err}");
    }

    #[test]
    fn an_unknown_top_level_section_is_an_error() {
        let err = WorkloadStore::parse("workload: []\n").expect_err("accepted");
        assert!(err.contains("workload"), "{err}");
    }

    #[test]
    fn a_bad_vip_is_an_error_naming_the_service() {
        let err = WorkloadStore::parse(
            "services:\n- name: s\n  namespace: d\n  hostname: s.d.svc\n  vips: [\"net/not-an-ip\"]\n",
        )
        .expect_err("accepted");
        assert!(err.contains("services[0].vips") && err.contains("not-an-ip"), "{err}");
    }

    #[test]
    fn an_address_or_uid_listed_twice_belongs_to_the_first_workload() {
        let s = WorkloadStore::parse(
            "workloads:\n\
             - {uid: a, namespace: d, serviceAccount: a, workloadIps: [10.0.0.1, 10.0.0.9]}\n\
             - {uid: b, namespace: d, serviceAccount: b, workloadIps: [10.0.0.9, 10.0.0.2]}\n\
             - {uid: a, namespace: d, serviceAccount: other}\n",
        )
        .expect("parse");
        let uid = |ip: &str| s.by_ip(ip.parse().expect("ip")).map(|w| w.uid.as_str());
        assert_eq!(uid("10.0.0.9"), Some("a"));
        assert_eq!(uid("10.0.0.2"), Some("b"));
        assert_eq!(uid("10.0.0.3"), None);
        assert_eq!(s.by_uid("a").map(|w| w.service_account.as_str()), Some("a"));
        assert_eq!(s.workloads().count(), 3, "nothing dropped from the store itself");
    }

    #[test]
    fn a_service_is_found_by_any_of_its_vips_and_by_hostname_in_any_case() {
        let s = WorkloadStore::parse(
            "services:\n\
             - {name: s, namespace: d, hostname: S.d.svc.cluster.local, vips: [\"net/10.96.0.10\", \"/fd00::10\"]}\n\
             - {name: t, namespace: d, hostname: t.d.svc.cluster.local, vips: [\"10.96.0.10\"]}\n",
        )
        .expect("parse");
        let name = |ip: &str| s.service_by_vip(ip.parse().expect("ip")).map(|v| v.name.as_str());
        assert_eq!(name("10.96.0.10"), Some("s"), "the first service with the VIP");
        assert_eq!(name("fd00::10"), Some("s"));
        assert_eq!(name("10.96.0.11"), None);
        for host in ["s.d.svc.cluster.local", "S.D.SVC.CLUSTER.LOCAL.", "s.d.svc.cluster.local."] {
            assert_eq!(s.service_by_hostname(host).map(|v| v.name.as_str()), Some("s"), "{host}");
        }
        assert!(s.service_by_hostname("s.d.svc").is_none());
    }

    #[test]
    fn the_policies_for_a_workload_are_those_that_select_it_in_file_order() {
        let policy = |name: &str, ns: &str, scope: &str| {
            format!("- {{name: {name}, namespace: {ns}, scope: {scope}, action: ALLOW}}\n")
        };
        let mut yaml = String::from(
            "workloads:\n\
             - {uid: a, namespace: d, serviceAccount: a, authorizationPolicies: [d/named, e/other-ns, d/global, nowhere/missing]}\n\
             - {uid: b, namespace: e, serviceAccount: b}\n\
             policies:\n",
        );
        for (name, ns, scope) in [
            ("named", "d", "WORKLOAD_SELECTOR"),
            ("ns-d", "d", "NAMESPACE"),
            ("global", "d", "GLOBAL"),
            ("unnamed", "d", "WORKLOAD_SELECTOR"),
            ("ns-e", "e", "NAMESPACE"),
            ("other-ns", "e", "NAMESPACE"),
            ("global", "e", "GLOBAL"),
            ("named", "d", "WORKLOAD_SELECTOR"),
        ] {
            yaml.push_str(&policy(name, ns, scope));
        }
        let s = WorkloadStore::parse(&yaml).expect("parse");
        for uid in ["a", "b"] {
            let w = s.by_uid(uid).expect("workload");
            let by_index: Vec<*const Policy> =
                s.policies_for(w).into_iter().map(|p| p as *const Policy).collect();
            let by_rule: Vec<*const Policy> = s
                .policies()
                .iter()
                .filter(|p| p.selects(w))
                .map(|p| &**p as *const Policy)
                .collect();
            assert_eq!(by_index, by_rule, "workload {uid}");
        }
        let keys = |uid: &str| -> Vec<String> {
            s.policies_for(s.by_uid(uid).expect("workload")).iter().map(|p| p.key()).collect()
        };
        assert_eq!(
            keys("a"),
            ["d/named", "d/ns-d", "d/global", "e/other-ns", "e/global", "d/named"]
        );
        assert_eq!(keys("b"), ["d/global", "e/ns-e", "e/other-ns", "e/global"]);
    }

    #[test]
    fn service_endpoints_are_the_healthy_workloads_with_their_target_ports() {
        let s = WorkloadStore::parse(
            "workloads:\n\
             - {uid: a, namespace: d, serviceAccount: a, workloadIps: [10.0.0.1], services: {\"d/s.d.svc\": {80: 8080}}}\n\
             - {uid: b, namespace: d, serviceAccount: b, workloadIps: [10.0.0.2], status: Unhealthy, services: {\"d/s.d.svc\": {80: 8080}}}\n\
             - {uid: c, namespace: d, serviceAccount: c, workloadIps: [10.0.0.3], services: {\"d/s.d.svc\": {}}}\n\
             services:\n- {name: s, namespace: d, hostname: s.d.svc, vips: [\"/10.96.0.10\"], ports: {80: 9090}}\n",
        )
        .expect("parse");
        let svc = s.service_by_vip("10.96.0.10".parse().expect("ip")).expect("service");
        let eps: Vec<(&str, u16)> =
            s.endpoints(svc, 80).into_iter().map(|(w, p)| (w.uid.as_str(), p)).collect();
        assert_eq!(eps, vec![("a", 8080), ("c", 9090)]);
    }

    fn workload(uid: &str, ips: &[&str], service: Option<&str>) -> Arc<Workload> {
        let yaml = format!(
            "{{uid: {uid}, namespace: d, serviceAccount: {uid}, workloadIps: [{}]{}}}",
            ips.join(", "),
            service.map(|s| format!(", services: {{\"{s}\": {{80: 8080}}}}")).unwrap_or_default()
        );
        Arc::new(serde_yaml::from_str(&yaml).expect("workload"))
    }

    fn uid_at(s: &WorkloadStore, ip: &str) -> Option<String> {
        s.by_ip(ip.parse().expect("ip")).map(|w| w.uid.clone())
    }

    fn endpoint_uids(s: &WorkloadStore, svc: &Service) -> Vec<String> {
        s.endpoints(svc, 80).into_iter().map(|(w, _)| w.uid.clone()).collect()
    }

    #[test]
    fn a_workload_put_from_istiod_is_found_by_address_uid_and_service_and_removing_it_frees_them() {
        let svc: Service = serde_yaml::from_str(
            "{name: s, namespace: d, hostname: s.d.svc, vips: [\"/10.96.0.10\"]}",
        )
        .expect("service");
        let mut s = WorkloadStore::default();
        s.put_service("d/s.d.svc", Arc::new(svc.clone()));
        s.put_workload("pod-a", workload("a", &["10.0.0.1"], Some("d/s.d.svc")));
        s.put_workload("pod-b", workload("b", &["10.0.0.2"], Some("d/s.d.svc")));
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("a"));
        assert!(s.by_uid("b").is_some());
        assert_eq!(endpoint_uids(&s, &svc), ["a", "b"]);
        assert_eq!(s.remove_workload("pod-a").map(|w| w.uid.clone()).as_deref(), Some("a"));
        assert_eq!(uid_at(&s, "10.0.0.1"), None);
        assert!(s.by_uid("a").is_none());
        assert_eq!(endpoint_uids(&s, &svc), ["b"]);
        assert_eq!(s.counts(), (1, 1, 0));
        assert!(s.remove_workload("pod-a").is_none(), "removed twice");
    }

    #[test]
    fn host_network_workloads_are_never_found_by_the_nodes_address() {
        let mut s = WorkloadStore::default();
        let host = |uid: &str| {
            let mut w = (*workload(uid, &["10.1.0.1"], None)).clone();
            w.network_mode = NetworkMode::HostNetwork;
            Arc::new(w)
        };
        s.put_workload("kube-proxy", host("kube-proxy"));
        s.put_workload("node-exporter", host("node-exporter"));
        assert_eq!(uid_at(&s, "10.1.0.1"), None, "the node's address named a host-network pod");
        assert!(s.by_uid("kube-proxy").is_some());
        // A pod that has the address as its own is found by it, before and after they go.
        s.put_workload("pod", workload("pod", &["10.1.0.1"], None));
        assert_eq!(uid_at(&s, "10.1.0.1").as_deref(), Some("pod"));
        s.remove_workload("kube-proxy");
        assert_eq!(uid_at(&s, "10.1.0.1").as_deref(), Some("pod"));
    }

    #[test]
    fn a_workload_written_again_leaves_its_old_address_and_service() {
        let svc: Service =
            serde_yaml::from_str("{name: s, namespace: d, hostname: s.d.svc}").expect("service");
        let mut s = WorkloadStore::default();
        s.put_workload("pod-a", workload("a", &["10.0.0.1"], Some("d/s.d.svc")));
        s.put_workload("pod-a", workload("a", &["10.0.0.9"], None));
        assert_eq!(uid_at(&s, "10.0.0.1"), None, "the old address still leads to it");
        assert_eq!(uid_at(&s, "10.0.0.9").as_deref(), Some("a"));
        assert!(endpoint_uids(&s, &svc).is_empty(), "still an endpoint of the service it left");
        assert_eq!(s.counts().0, 1);
    }

    #[test]
    fn removing_a_workload_frees_only_the_addresses_it_still_holds() {
        let mut s = WorkloadStore::default();
        s.put_workload("pod-a", workload("a", &["10.0.0.1"], None));
        // istiod gave the address to another pod (written last, it takes it).
        s.put_workload("pod-b", workload("b", &["10.0.0.1"], None));
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("b"));
        s.remove_workload("pod-a");
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("b"));
    }

    #[test]
    fn an_address_two_pods_claim_is_served_by_the_one_written_last_and_then_by_the_other() {
        let mut s = WorkloadStore::default();
        // A new pod got the address of one still listed (terminating).
        s.put_workload("pod-old", workload("old", &["10.0.0.1"], None));
        s.put_workload("pod-new", workload("new", &["10.0.0.1"], None));
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("new"));
        // The old pod's status changes: written last, it is served again...
        s.put_workload("pod-old", workload("old", &["10.0.0.1"], None));
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("old"));
        // ...and when it goes, the address is the new pod's, not nobody's.
        s.remove_workload("pod-old");
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("new"));
        s.remove_workload("pod-new");
        assert_eq!(uid_at(&s, "10.0.0.1"), None);
    }

    #[test]
    fn ten_thousand_workloads_of_one_address_hand_it_over_in_claiming_order() {
        let mut s = WorkloadStore::default();
        for i in 0..10_000 {
            s.put_workload(&format!("w{i}"), workload(&format!("u{i}"), &["10.0.0.1"], None));
        }
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("u9999"), "the last written");
        for i in (1..10_000).rev() {
            s.remove_workload(&format!("w{i}"));
            let want = format!("u{}", i - 1);
            assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some(want.as_str()));
        }
        s.remove_workload("w0");
        assert_eq!(uid_at(&s, "10.0.0.1"), None);
    }

    #[test]
    fn a_pod_in_the_mesh_is_served_before_a_workload_entry_with_its_address() {
        let hbone = |uid: &str| {
            let mut w = (*workload(uid, &["10.0.0.1"], None)).clone();
            w.protocol = Protocol::Hbone;
            Arc::new(w)
        };
        let mut s = WorkloadStore::default();
        s.put_workload("pod", hbone("c//Pod/d/a"));
        s.put_workload("plain-pod", workload("c//Pod/d/b", &["10.0.0.1"], None));
        s.put_workload("entry", hbone("c//WorkloadEntry/d/e"));
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("c//Pod/d/a"));
        s.remove_workload("pod");
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("c//Pod/d/b"));
        s.remove_workload("plain-pod");
        assert_eq!(uid_at(&s, "10.0.0.1").as_deref(), Some("c//WorkloadEntry/d/e"));
    }

    #[test]
    fn a_copy_of_the_store_does_not_change_when_the_original_does() {
        let mut s = WorkloadStore::default();
        s.put_workload("pod-a", workload("a", &["10.0.0.1"], None));
        let snapshot = s.clone();
        s.remove_workload("pod-a");
        s.put_workload("pod-b", workload("b", &["10.0.0.2"], None));
        s.set_policies(Vec::new());
        assert_eq!(uid_at(&snapshot, "10.0.0.1").as_deref(), Some("a"));
        assert_eq!(uid_at(&snapshot, "10.0.0.2"), None);
        assert_eq!(snapshot.counts(), (1, 0, 0));
        assert!(!snapshot.same_policies(&s), "the policies were replaced in the original");
        assert!(snapshot.clone().same_policies(&snapshot));
    }

    #[test]
    fn a_service_written_again_leaves_its_old_vip_and_hostname() {
        let mut s = WorkloadStore::default();
        let svc = |host: &str, vip: &str| -> Arc<Service> {
            Arc::new(
                serde_yaml::from_str(&format!(
                    "{{name: s, namespace: d, hostname: {host}, vips: [\"/{vip}\"]}}"
                ))
                .expect("service"),
            )
        };
        s.put_service("d/s", svc("s.d.svc", "10.96.0.10"));
        s.put_service("d/s", svc("t.d.svc", "10.96.0.11"));
        assert!(s.service_by_vip("10.96.0.10".parse().expect("ip")).is_none());
        assert!(s.service_by_hostname("s.d.svc").is_none());
        assert!(s.service_by_vip("10.96.0.11".parse().expect("ip")).is_some());
        s.remove_service("d/s");
        assert!(s.service_by_hostname("t.d.svc").is_none());
        assert_eq!(s.counts(), (0, 0, 0));
    }
}
