//! The workload store: the workloads, services and L4 authorization policies the proxy knows,
//! from istiod (`crate::xds`) or the workloads file (`crate::reload`).
//!
//! A store is read-only once made, and indexed as it is made: what a connection looks up (the
//! workload at an address, the service at a VIP, a service's endpoints, the policies that apply
//! to a destination) is a hash lookup, not a walk over every workload, service and policy in the
//! mesh. Where the file names an address, uid,
//! VIP or hostname twice, the first entry wins, as ztunnel's local configuration reads.

use std::{collections::HashMap, net::IpAddr, path::Path, sync::Arc};

use serde::{Deserialize, Serialize};

use crate::state::{
    authorization::{Policy, Scope},
    workloads::{parse_vip, HealthStatus, Service, Workload},
};

/// What the file says, as it says it; from xDS, the resources held, in name order. Entries are
/// shared (`Arc`) between the stores made one after another, so a new store costs its index,
/// not a copy of every workload.
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

/// Positions in [`Contents`], by what connections look them up by.
#[derive(Debug, Clone, Default)]
struct Index {
    workload_by_ip: HashMap<IpAddr, usize>,
    workload_by_uid: HashMap<String, usize>,
    service_by_vip: HashMap<IpAddr, usize>,
    /// Lower-cased.
    service_by_hostname: HashMap<String, usize>,
    /// Service key (`NS/HOSTNAME`) → the workloads that back it, in file order.
    backends: HashMap<String, Vec<usize>>,
    /// GLOBAL policies.
    global_policies: Vec<usize>,
    /// NAMESPACE policies by their namespace.
    namespace_policies: HashMap<String, Vec<usize>>,
    /// Every policy by key (`NS/NAME`), as workloads name the policies that select them.
    policies_by_key: HashMap<String, Vec<usize>>,
}

impl Index {
    fn of(c: &Contents) -> Self {
        let mut ix = Self::default();
        for (i, w) in c.workloads.iter().enumerate() {
            for ip in &w.workload_ips {
                ix.workload_by_ip.entry(*ip).or_insert(i);
            }
            ix.workload_by_uid.entry(w.uid.clone()).or_insert(i);
            for key in w.services.keys() {
                ix.backends.entry(key.clone()).or_default().push(i);
            }
        }
        for (i, s) in c.services.iter().enumerate() {
            for vip in s.vip_addrs() {
                ix.service_by_vip.entry(vip).or_insert(i);
            }
            ix.service_by_hostname.entry(s.hostname.to_ascii_lowercase()).or_insert(i);
        }
        for (i, p) in c.policies.iter().enumerate() {
            match p.scope {
                Scope::Global => ix.global_policies.push(i),
                Scope::Namespace => {
                    ix.namespace_policies.entry(p.namespace.clone()).or_default().push(i)
                }
                Scope::WorkloadSelector => {}
            }
            ix.policies_by_key.entry(p.key()).or_default().push(i);
        }
        ix
    }
}

/// Everything the proxy knows about the mesh (see the module docs).
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(from = "Contents", into = "Contents")]
pub struct WorkloadStore {
    contents: Contents,
    index: Index,
}

impl From<Contents> for WorkloadStore {
    fn from(contents: Contents) -> Self {
        let index = Index::of(&contents);
        Self { contents, index }
    }
}

impl From<WorkloadStore> for Contents {
    fn from(store: WorkloadStore) -> Self {
        store.contents
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
        for (i, s) in store.services().iter().enumerate() {
            for v in &s.vips {
                parse_vip(v).map_err(|e| format!("services[{i}].vips: {e}"))?;
            }
        }
        Ok(store)
    }

    /// A store of these entries (what xDS holds), indexed.
    pub fn from_parts(
        workloads: Vec<Arc<Workload>>,
        services: Vec<Arc<Service>>,
        policies: Vec<Arc<Policy>>,
    ) -> Self {
        Contents { workloads, services, policies }.into()
    }

    /// Every workload, in file order.
    pub fn workloads(&self) -> &[Arc<Workload>] {
        &self.contents.workloads
    }

    /// Every service, in file order.
    pub fn services(&self) -> &[Arc<Service>] {
        &self.contents.services
    }

    /// Every authorization policy, in file order.
    pub fn policies(&self) -> &[Arc<Policy>] {
        &self.contents.policies
    }

    /// The authorization policies that apply to `dst` ([`Policy::selects`]), in file order:
    /// GLOBAL ones, NAMESPACE ones of its namespace, and those it names.
    pub fn policies_for(&self, dst: &Workload) -> Vec<&Policy> {
        let ix = &self.index;
        let mut at: Vec<usize> = ix.global_policies.clone();
        if let Some(own) = ix.namespace_policies.get(&dst.namespace) {
            at.extend(own);
        }
        for key in &dst.authorization_policies {
            if let Some(named) = ix.policies_by_key.get(key) {
                at.extend(named);
            }
        }
        at.sort_unstable();
        at.dedup();
        at.into_iter().map(|i| &*self.contents.policies[i]).collect()
    }

    /// The workload that owns `ip`.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.index.workload_by_ip.get(&ip).map(|&i| &*self.contents.workloads[i])
    }

    /// The workload with this uid.
    pub fn by_uid(&self, uid: &str) -> Option<&Workload> {
        self.index.workload_by_uid.get(uid).map(|&i| &*self.contents.workloads[i])
    }

    /// The service with `ip` among its VIPs.
    pub fn service_by_vip(&self, ip: IpAddr) -> Option<&Service> {
        self.index.service_by_vip.get(&ip).map(|&i| &*self.contents.services[i])
    }

    /// The service with this hostname (any case, with or without the final dot).
    pub fn service_by_hostname(&self, host: &str) -> Option<&Service> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.index.service_by_hostname.get(&host).map(|&i| &*self.contents.services[i])
    }

    /// The healthy endpoints of `svc` for service port `port`: each workload and the port it
    /// listens on.
    pub fn endpoints(&self, svc: &Service, port: u16) -> Vec<(&Workload, u16)> {
        let key = svc.key();
        let Some(backends) = self.index.backends.get(&key) else { return Vec::new() };
        backends
            .iter()
            .map(|&i| &*self.contents.workloads[i])
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
        assert_eq!(s.workloads().len(), 3, "nothing dropped from the store itself");
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
}
