//! The workload store: which workloads exist, their addresses, identities and whether they
//! speak HBONE. Read from a YAML file in the camelCase shape of ztunnel's local configuration
//! (`workloads: [{uid, name, namespace, serviceAccount, trustDomain, workloadIps, protocol}]`);
//! fields this proxy does not use yet (services, policies, node, network) are accepted and
//! ignored, so one file can describe a mixed mesh.

use std::{net::IpAddr, path::Path};

use serde::Deserialize;

use crate::identity::Identity;

/// How a workload is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// HTTP/2 CONNECT over mTLS to its port 15008.
    Hbone,
    /// Plain TCP (not in the mesh).
    #[default]
    Tcp,
}

/// One workload.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    pub uid: String,
    #[serde(default)]
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    #[serde(default)]
    pub protocol: Protocol,
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}

impl Workload {
    /// Its SPIFFE identity.
    pub fn identity(&self) -> Identity {
        Identity::new(&self.trust_domain, &self.namespace, &self.service_account)
    }
}

/// Everything the proxy knows about the mesh.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct WorkloadStore {
    #[serde(default)]
    pub workloads: Vec<Workload>,
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

    /// Parses YAML text.
    pub fn parse(text: &str) -> Result<Self, String> {
        serde_yaml::from_str(text).map_err(|e| match e.location() {
            Some(l) => format!("line {}, column {}: {e}", l.line(), l.column()),
            None => e.to_string(),
        })
    }

    /// The workload that owns `ip`.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.workloads.iter().find(|w| w.workload_ips.contains(&ip))
    }

    /// The workload with this uid.
    pub fn by_uid(&self, uid: &str) -> Option<&Workload> {
        self.workloads.iter().find(|w| w.uid == uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
