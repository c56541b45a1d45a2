//! The workloads file as a directory, for running without a cluster: the same file as the
//! proxy's (ztunnel's local configuration format), of which only the fields needed here are
//! read. A pod listed with `protocol: HBONE` is meshed, with every capture on; anything else is
//! left alone.

use std::path::Path;

use serde::Deserialize;

use super::{Decision, Member, MeshOptions};

/// A pod as the directory knows it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub uid: String,
    #[serde(default)]
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    #[serde(default)]
    pub protocol: String,
}

impl Entry {
    pub fn meshed(&self) -> bool {
        self.protocol.eq_ignore_ascii_case("HBONE")
    }
}

#[derive(Debug, Deserialize)]
struct File {
    #[serde(default)]
    workloads: Vec<Entry>,
}

/// Finds the pod by uid (when the runtime gave one) or by namespace and name.
pub fn lookup(path: &Path, uid: &str, namespace: &str, name: &str) -> anyhow::Result<Decision> {
    Ok(match find(path, uid, namespace, name)? {
        None => Decision::NotMeshed("not in the workloads file"),
        Some(e) if !e.meshed() => Decision::NotMeshed("not an HBONE workload"),
        Some(e) => Decision::Meshed(Member {
            uid: e.uid,
            name: e.name,
            namespace: e.namespace,
            service_account: e.service_account,
            ips: Vec::new(),
            options: MeshOptions {
                capture_inbound: true,
                capture_dns: true,
                ..MeshOptions::default()
            },
        }),
    })
}

fn find(path: &Path, uid: &str, namespace: &str, name: &str) -> anyhow::Result<Option<Entry>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading the workloads file {}: {e}", path.display()))?;
    let file: File = serde_yaml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("the workloads file {}: {e}", path.display()))?;
    let by_uid = file.workloads.iter().position(|w| !uid.is_empty() && w.uid == uid);
    let by_name = || file.workloads.iter().position(|w| w.namespace == namespace && w.name == name);
    Ok(by_uid.or_else(by_name).map(|i| file.workloads[i].clone()))
}
