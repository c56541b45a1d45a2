//! L4 authorization, evaluated exactly as ztunnel's `rbac.rs` evaluates Istio ambient policies
//! at the destination's proxy.
//!
//! Which policies apply to a destination workload: GLOBAL ones, NAMESPACE ones of its namespace,
//! and any the workload names in `authorizationPolicies` (`"NS/NAME"`). Then, as Istio's
//! AuthorizationPolicy reference says: a DENY policy that matches denies; with no ALLOW policy
//! the connection is allowed; otherwise one ALLOW policy must match.
//!
//! Matching (`rules: [[[match]]]`, rules → clauses → matches), with ztunnel's edge cases:
//! - a policy with no rules matches nothing; a rule with no clauses matches everything;
//! - a rule matches when every clause does; a clause when any of its matches does, except
//!   that an *empty clause* (no matches) always matches;
//! - an *empty match* (no field set) is skipped: it never makes a clause match;
//! - a match holds when, for every field pair, the positive list is empty or has a hit, and
//!   the `not*` list has no hit.
//!
//! A plaintext peer has no identity: it matches no `principals`, `serviceAccounts` or
//! `Presence` namespace and every `not*` form of them, and its namespace is the empty string.
//! So Istio's STRICT PeerAuthentication is the DENY policy `notPrincipals: ["*"]`.
//!
//! `dryRun` policies are evaluated and their would-be verdict logged, never enforced: they
//! neither deny nor make ALLOW-mode apply.
//!
//! Format: ztunnel's field names (camelCase). String matches are written either as Istio's
//! AuthorizationPolicy strings (`"*"` presence, `"x*"` prefix, `"*x"` suffix, else exact; a
//! leading `spiffe://` is dropped, as principals are matched without it) or in ztunnel's own
//! serialisation (`{Exact: x}`, `{Prefix: x}`, `{Suffix: x}`, `{Presence: []}`). Service
//! accounts are `"NS/SA"` or `{namespace, serviceAccount}`; addresses `IP` or `IP/LEN`. Unknown
//! fields are errors rather than silently empty matches (an empty match is skipped, so a typo in
//! a DENY rule would otherwise disable it).

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize};
use tracing::info;

use crate::{identity::Identity, state::workloads::Workload};

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

/// A string condition (namespaces, principals).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    /// Any non-empty value.
    Presence(),
}

impl StringMatch {
    /// Istio's AuthorizationPolicy string form, converted as istiod converts it for ztunnel.
    pub fn from_istio(pattern: &str) -> Self {
        let p = pattern.strip_prefix("spiffe://").unwrap_or(pattern);
        if p == "*" {
            Self::Presence()
        } else if let Some(suffix) = p.strip_prefix('*') {
            Self::Suffix(suffix.into())
        } else if let Some(prefix) = p.strip_suffix('*') {
            Self::Prefix(prefix.into())
        } else {
            Self::Exact(p.into())
        }
    }

    pub fn matches(&self, value: &str) -> bool {
        match self {
            Self::Exact(s) => value == s,
            Self::Prefix(s) => value.starts_with(s.as_str()),
            Self::Suffix(s) => value.ends_with(s.as_str()),
            Self::Presence() => !value.is_empty(),
        }
    }

    /// Principals are matched on the identity without its `spiffe://` scheme; no identity
    /// (plaintext) matches nothing.
    fn matches_principal(&self, id: Option<&Identity>) -> bool {
        id.is_some_and(|id| {
            let full = id.to_string();
            full.strip_prefix("spiffe://").is_some_and(|short| self.matches(short))
        })
    }
}

/// Written as ztunnel writes it, `{Exact: S}` … `{Presence: []}`, as a one-entry map (serde's
/// own enum form would be a YAML tag, `!Exact S`, that the reader does not take: found by
/// fuzz/fuzz_targets/workloads_file.rs).
impl Serialize for StringMatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut m = s.serialize_map(Some(1))?;
        match self {
            Self::Exact(v) => m.serialize_entry("Exact", v)?,
            Self::Prefix(v) => m.serialize_entry("Prefix", v)?,
            Self::Suffix(v) => m.serialize_entry("Suffix", v)?,
            Self::Presence() => m.serialize_entry("Presence", &[(); 0])?,
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for StringMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        enum Ztunnel {
            Exact(String),
            Prefix(String),
            Suffix(String),
            Presence(serde::de::IgnoredAny),
        }
        #[derive(Deserialize)]
        #[serde(
            untagged,
            expecting = "a string (Istio form) or one of {Exact|Prefix|Suffix: S} / {Presence: []}"
        )]
        enum Form {
            Istio(String),
            Ztunnel(Ztunnel),
        }
        Ok(match Form::deserialize(d)? {
            Form::Istio(s) => Self::from_istio(&s),
            Form::Ztunnel(Ztunnel::Exact(s)) => Self::Exact(s),
            Form::Ztunnel(Ztunnel::Prefix(s)) => Self::Prefix(s),
            Form::Ztunnel(Ztunnel::Suffix(s)) => Self::Suffix(s),
            Form::Ztunnel(Ztunnel::Presence(_)) => Self::Presence(),
        })
    }
}

/// A Kubernetes service account: matches a peer whose identity has this namespace and account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountMatch {
    pub namespace: String,
    pub service_account: String,
}

impl ServiceAccountMatch {
    fn matches(&self, id: Option<&Identity>) -> bool {
        id.is_some_and(|id| {
            id.namespace == self.namespace && id.service_account == self.service_account
        })
    }
}

impl<'de> Deserialize<'de> for ServiceAccountMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        struct Fields {
            namespace: String,
            service_account: String,
        }
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "\"NAMESPACE/ACCOUNT\" or {namespace, serviceAccount}")]
        enum Form {
            Istio(String),
            Ztunnel(Fields),
        }
        match Form::deserialize(d)? {
            Form::Ztunnel(f) => {
                Ok(Self { namespace: f.namespace, service_account: f.service_account })
            }
            Form::Istio(s) => match s.split_once('/') {
                Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                    Ok(Self { namespace: ns.into(), service_account: sa.into() })
                }
                _ => Err(serde::de::Error::custom(format!(
                    "service account {s:?} is not NAMESPACE/ACCOUNT"
                ))),
            },
        }
    }
}

/// An address range: `IP/LEN`, or a bare `IP` (its host route).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Cidr(pub IpNet);

impl Cidr {
    fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&crate::state::canonical(ip))
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.parse::<IpNet>()
            .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
            .map(Cidr)
            .map_err(|_| format!("address {s:?} is not IP or IP/LEN"))
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// One match: conditions on the connection, all of which must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<StringMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<StringMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<ServiceAccountMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<ServiceAccountMatch>,
    /// SPIFFE ids without the scheme: `TD/ns/NS/sa/SA`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<StringMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<StringMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_ips: Vec<Cidr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_source_ips: Vec<Cidr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ips: Vec<Cidr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ips: Vec<Cidr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
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
    /// Evaluated and logged, never enforced.
    #[serde(default)]
    pub dry_run: bool,
}

/// The connection being authorized.
#[derive(Debug, Clone, Copy)]
pub struct Connection<'a> {
    /// The peer's verified identity; `None` for plaintext.
    pub src_identity: Option<&'a Identity>,
    pub src: IpAddr,
    /// The destination as the client addressed it (the workload's address and port).
    pub dst: SocketAddr,
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
    /// `NS/NAME`, as workloads name it.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether it applies to `dst`: the rule the store's index applies
    /// ([`crate::state::store::WorkloadStore::policies_for`]).
    pub fn selects(&self, dst: &Workload) -> bool {
        match self.scope {
            Scope::Global => true,
            Scope::Namespace if self.namespace == dst.namespace => true,
            _ => dst.authorization_policies.contains(&self.key()),
        }
    }

    pub fn matches(&self, c: &Connection<'_>) -> bool {
        // No rules: nothing matches. No clauses in a rule: the rule matches.
        self.rules.iter().any(|rule| rule.iter().all(|clause| clause_matches(clause, c)))
    }
}

/// An empty clause matches; otherwise some non-empty match must.
fn clause_matches(clause: &[Match], c: &Connection<'_>) -> bool {
    clause.is_empty() || clause.iter().any(|m| !m.is_empty() && m.matches(c))
}

/// Positive list empty or hit, negative list not hit.
fn pair<T>(positive: &[T], negative: &[T], hit: impl Fn(&T) -> bool) -> bool {
    (positive.is_empty() || positive.iter().any(&hit)) && !negative.iter().any(&hit)
}

impl Match {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    fn matches(&self, c: &Connection<'_>) -> bool {
        let id = c.src_identity;
        let ns = id.map_or("", |i| i.namespace.as_str());
        pair(&self.destination_ips, &self.not_destination_ips, |n| n.contains(c.dst.ip()))
            && pair(&self.source_ips, &self.not_source_ips, |n| n.contains(c.src))
            && pair(&self.destination_ports, &self.not_destination_ports, |p| *p == c.dst.port())
            && pair(&self.service_accounts, &self.not_service_accounts, |s| s.matches(id))
            && pair(&self.principals, &self.not_principals, |p| p.matches_principal(id))
            && pair(&self.namespaces, &self.not_namespaces, |n| n.matches(ns))
    }
}

/// What the policies decide, and what they would decide with the dry-run ones enforced too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub enforced: Result<(), Denied>,
    /// `Some` when a dry-run policy applies to the destination.
    pub dry_run: Option<Result<(), Denied>>,
}

fn evaluate<'p>(
    applicable: impl Iterator<Item = &'p Policy> + Clone,
    c: &Connection<'_>,
) -> Result<(), Denied> {
    if let Some(p) = applicable.clone().find(|p| p.action == Action::Deny && p.matches(c)) {
        return Err(Denied::ByPolicy(p.key()));
    }
    let mut allows = applicable.filter(|p| p.action == Action::Allow).peekable();
    if allows.peek().is_none() {
        return Ok(());
    }
    let mut names = Vec::new();
    for p in allows {
        if p.matches(c) {
            return Ok(());
        }
        names.push(p.key());
    }
    Err(Denied::NotAllowed(names.join(", ")))
}

/// Decides whether `c` may reach its destination under the policies that apply to it
/// (`WorkloadStore::policies_for`).
pub fn decide(applicable: &[&Policy], c: &Connection<'_>) -> Decision {
    let applicable = applicable.iter().copied();
    let enforced = evaluate(applicable.clone().filter(|p| !p.dry_run), c);
    let dry_run = applicable.clone().any(|p| p.dry_run).then(|| evaluate(applicable, c));
    Decision { enforced, dry_run }
}

/// [`decide`], logging what dry-run policies would have changed.
pub fn check(applicable: &[&Policy], c: &Connection<'_>) -> Result<(), Denied> {
    let d = decide(applicable, c);
    if let Some(would) = &d.dry_run {
        if *would != d.enforced {
            let would = match would {
                Ok(()) => "allow".to_string(),
                Err(e) => format!("deny ({e})"),
            };
            info!(dst = %c.dst, src = %c.src, dry_run = true, would, "dry-run policy would change this decision");
        }
    }
    d.enforced
}

#[cfg(test)]
mod tests;
