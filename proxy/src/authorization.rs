//! L4 authorization, as Istio ambient enforces it at the destination's proxy.
//!
//! A policy has a scope (GLOBAL: every workload; NAMESPACE: the workloads of its namespace;
//! WORKLOAD_SELECTOR: the workloads that list it in `authorizationPolicies`), an action (ALLOW or
//! DENY) and rules: a policy matches when any rule matches; a rule when all of its clauses match;
//! a clause when any of its matches matches; a match when every list it sets matches (any entry)
//! and none of its `not*` lists does. A connection is denied when a DENY policy matches, or when
//! ALLOW policies apply to the destination and none matches.
//!
//! Plaintext (no peer identity) never matches `principals` and always matches `notPrincipals`:
//! requiring mTLS for a workload (Istio's STRICT PeerAuthentication) is the DENY policy
//! `notPrincipals: ["*"]`.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::{config::Workload, identity::Identity};

/// Where a policy applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Scope {
    #[serde(alias = "GLOBAL")]
    Global,
    #[serde(alias = "NAMESPACE")]
    Namespace,
    #[serde(alias = "WORKLOAD_SELECTOR")]
    WorkloadSelector,
}

/// What a matching policy does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Action {
    #[serde(alias = "ALLOW")]
    Allow,
    #[serde(alias = "DENY")]
    Deny,
}

/// One match: conditions on the connection, all of which must hold.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    #[serde(default)]
    pub namespaces: Vec<String>,
    #[serde(default)]
    pub not_namespaces: Vec<String>,
    /// `TD/ns/NS/sa/SA` or the full `spiffe://` form; `*` as prefix or suffix is a wildcard and
    /// `*` alone means "any identity".
    #[serde(default)]
    pub principals: Vec<String>,
    #[serde(default)]
    pub not_principals: Vec<String>,
    /// `IP` or `IP/LEN`.
    #[serde(default)]
    pub source_ips: Vec<String>,
    #[serde(default)]
    pub not_source_ips: Vec<String>,
    #[serde(default)]
    pub destination_ports: Vec<u16>,
    #[serde(default)]
    pub not_destination_ports: Vec<u16>,
}

/// An authorization policy.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Policy {
    pub name: String,
    #[serde(default)]
    pub namespace: String,
    pub scope: Scope,
    pub action: Action,
    /// rules → clauses → matches.
    #[serde(default)]
    pub rules: Vec<Vec<Vec<Match>>>,
}

/// The connection being authorized.
#[derive(Debug, Clone, Copy)]
pub struct Connection<'a> {
    /// The peer's verified identity; `None` for plaintext.
    pub src_identity: Option<&'a Identity>,
    pub src_ip: IpAddr,
    pub dst_port: u16,
}

/// Why a connection was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("denied by DENY policy {0}")]
    ByPolicy(String),
    #[error("no ALLOW policy matched (of {0})")]
    NotAllowed(String),
}

impl Policy {
    /// Checks what serde cannot: source IP prefixes.
    pub fn validate(&self) -> Result<(), String> {
        for m in self.rules.iter().flatten().flatten() {
            for p in m.source_ips.iter().chain(&m.not_source_ips) {
                parse_prefix(p).ok_or_else(|| format!("source IP {p:?} is not IP or IP/LEN"))?;
            }
        }
        Ok(())
    }

    /// Whether it applies to `dst`.
    pub fn selects(&self, dst: &Workload) -> bool {
        match self.scope {
            Scope::Global => true,
            Scope::Namespace => self.namespace == dst.namespace,
            Scope::WorkloadSelector => {
                let me = format!("{}/{}", self.namespace, self.name);
                dst.authorization_policies.contains(&me)
            }
        }
    }

    fn matches(&self, c: &Connection<'_>) -> bool {
        self.rules.iter().any(|rule| rule.iter().all(|clause| clause.iter().any(|m| m.matches(c))))
    }
}

impl Match {
    fn matches(&self, c: &Connection<'_>) -> bool {
        let ns = c.src_identity.map(|i| i.namespace.as_str());
        let ns_in = |list: &[String]| ns.is_some_and(|ns| list.iter().any(|n| n == ns));
        let principal_in =
            |list: &[String]| c.src_identity.is_some_and(|i| list.iter().any(|p| principal(p, i)));
        let ip_in = |list: &[String]| {
            list.iter()
                .any(|p| parse_prefix(p).is_some_and(|(net, len)| in_prefix(c.src_ip, net, len)))
        };
        let port_in = |list: &[u16]| list.contains(&c.dst_port);
        let want = |list_empty: bool, hit: bool| list_empty || hit;
        want(self.namespaces.is_empty(), ns_in(&self.namespaces))
            && !ns_in(&self.not_namespaces)
            && want(self.principals.is_empty(), principal_in(&self.principals))
            && !principal_in(&self.not_principals)
            && want(self.source_ips.is_empty(), ip_in(&self.source_ips))
            && !ip_in(&self.not_source_ips)
            && want(self.destination_ports.is_empty(), port_in(&self.destination_ports))
            && !port_in(&self.not_destination_ports)
    }
}

fn principal(pattern: &str, id: &Identity) -> bool {
    let full = id.to_string();
    let short = full.trim_start_matches("spiffe://");
    let pattern_short = pattern.trim_start_matches("spiffe://");
    if pattern_short == "*" {
        return true;
    }
    if let Some(suffix) = pattern_short.strip_prefix('*') {
        return short.ends_with(suffix);
    }
    if let Some(prefix) = pattern_short.strip_suffix('*') {
        return short.starts_with(prefix);
    }
    short == pattern_short
}

fn parse_prefix(s: &str) -> Option<(IpAddr, u8)> {
    let (ip, len) = match s.split_once('/') {
        Some((ip, len)) => (ip.parse::<IpAddr>().ok()?, len.parse::<u8>().ok()?),
        None => {
            let ip = s.parse::<IpAddr>().ok()?;
            (ip, if ip.is_ipv4() { 32 } else { 128 })
        }
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some((ip, len))
}

fn in_prefix(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (crate::inbound::canonical(ip), net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Decides whether `c` may reach `dst` under `policies`.
pub fn check(policies: &[Policy], dst: &Workload, c: &Connection<'_>) -> Result<(), Denied> {
    let applicable: Vec<&Policy> = policies.iter().filter(|p| p.selects(dst)).collect();
    if let Some(p) = applicable.iter().find(|p| p.action == Action::Deny && p.matches(c)) {
        return Err(Denied::ByPolicy(format!("{}/{}", p.namespace, p.name)));
    }
    let allows: Vec<&&Policy> = applicable.iter().filter(|p| p.action == Action::Allow).collect();
    if allows.is_empty() || allows.iter().any(|p| p.matches(c)) {
        return Ok(());
    }
    let names: Vec<String> = allows.iter().map(|p| format!("{}/{}", p.namespace, p.name)).collect();
    Err(Denied::NotAllowed(names.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WorkloadStore;

    fn store(policies: &str) -> WorkloadStore {
        WorkloadStore::parse(&format!(
            "workloads:\n- {{uid: b, namespace: prod, serviceAccount: b, authorizationPolicies: [prod/only-b]}}\n\
             - {{uid: c, namespace: prod, serviceAccount: c}}\npolicies:\n{policies}"
        ))
        .expect("parse")
    }

    fn conn<'a>(id: Option<&'a Identity>, ip: &str, port: u16) -> Connection<'a> {
        Connection { src_identity: id, src_ip: ip.parse().expect("ip"), dst_port: port }
    }

    fn decide(s: &WorkloadStore, uid: &str, c: &Connection<'_>) -> Result<(), Denied> {
        check(&s.policies, s.by_uid(uid).expect("workload"), c)
    }

    const SLEEP: fn() -> Identity = || Identity::new("cluster.local", "dev", "sleep");

    #[test]
    fn no_policy_allows() {
        let s = store("  []\n");
        assert_eq!(decide(&s, "b", &conn(None, "10.0.0.1", 80)), Ok(()));
    }

    #[test]
    fn a_matching_deny_denies_and_names_the_policy() {
        let s = store("- {name: no-dev, namespace: prod, scope: Namespace, action: Deny, rules: [[[{namespaces: [dev]}]]]}\n");
        let id = SLEEP();
        assert_eq!(
            decide(&s, "b", &conn(Some(&id), "10.0.0.1", 80)),
            Err(Denied::ByPolicy("prod/no-dev".into()))
        );
        let other = Identity::new("cluster.local", "prod", "x");
        assert_eq!(decide(&s, "b", &conn(Some(&other), "10.0.0.1", 80)), Ok(()));
    }

    #[test]
    fn allow_policies_deny_what_they_do_not_match() {
        let s = store("- {name: only-b, namespace: prod, scope: WORKLOAD_SELECTOR, action: ALLOW, rules: [[[{principals: [\"cluster.local/ns/dev/sa/sleep\"], destinationPorts: [80]}]]]}\n");
        let id = SLEEP();
        assert_eq!(decide(&s, "b", &conn(Some(&id), "10.0.0.1", 80)), Ok(()));
        assert!(decide(&s, "b", &conn(Some(&id), "10.0.0.1", 81)).is_err());
        assert!(decide(&s, "b", &conn(None, "10.0.0.1", 80)).is_err());
        // Not selected: workload c has no policy.
        assert_eq!(decide(&s, "c", &conn(None, "10.0.0.1", 81)), Ok(()));
    }

    #[test]
    fn strict_mtls_is_deny_not_principals_any() {
        let s = store("- {name: strict, namespace: prod, scope: Namespace, action: Deny, rules: [[[{notPrincipals: [\"*\"]}]]]}\n");
        let id = SLEEP();
        assert!(decide(&s, "c", &conn(None, "10.0.0.1", 80)).is_err());
        assert_eq!(decide(&s, "c", &conn(Some(&id), "10.0.0.1", 80)), Ok(()));
    }

    #[test]
    fn source_prefixes_and_their_negation_match_v4_and_v6() {
        let s = store("- {name: net, namespace: prod, scope: Global, action: Allow, rules: [[[{sourceIps: [10.1.0.0/16, \"fd00::/8\"], notSourceIps: [10.1.2.3]}]]]}\n");
        assert_eq!(decide(&s, "c", &conn(None, "10.1.9.9", 80)), Ok(()));
        assert_eq!(decide(&s, "c", &conn(None, "::ffff:10.1.9.9", 80)), Ok(()));
        assert_eq!(decide(&s, "c", &conn(None, "fd00::1", 80)), Ok(()));
        assert!(decide(&s, "c", &conn(None, "10.1.2.3", 80)).is_err());
        assert!(decide(&s, "c", &conn(None, "10.2.0.1", 80)).is_err());
    }

    #[test]
    fn a_rule_needs_every_clause_and_a_clause_any_match() {
        let s = store("- {name: two, namespace: prod, scope: Global, action: Allow, rules: [[[{destinationPorts: [80]}, {destinationPorts: [81]}], [{namespaces: [dev]}]]]}\n");
        let id = SLEEP();
        assert_eq!(decide(&s, "c", &conn(Some(&id), "10.0.0.1", 81)), Ok(()));
        assert!(decide(&s, "c", &conn(Some(&id), "10.0.0.1", 82)).is_err());
        assert!(decide(&s, "c", &conn(None, "10.0.0.1", 80)).is_err());
    }

    #[test]
    fn a_bad_source_prefix_is_a_parse_error_naming_the_policy() {
        let err = WorkloadStore::parse("policies:\n- {name: p, scope: Global, action: Deny, rules: [[[{sourceIps: [10.0.0.0/33]}]]]}\n")
            .expect_err("accepted");
        assert!(err.contains("policies[0] (p)") && err.contains("10.0.0.0/33"), "{err}");
    }
}
