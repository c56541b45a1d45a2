//! One JSON file per pod under `STATE_DIR/pods/`, written before the pod is enrolled and
//! removed after it is unenrolled, so that a restarted agent knows every pod it may have left
//! enrolled. A pod's netns is found again by inode (`/var/run/netns/*`, then `/proc/*/ns/net`).

use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{Agent, LivePod};
use crate::pods;

/// What the agent remembers of a pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRecord {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub container_id: String,
    pub netns_path: PathBuf,
    pub netns_inode: u64,
    pub cookie: u64,
    pub ips: Vec<IpAddr>,
}

fn dir(state: &Path) -> PathBuf {
    state.join("pods")
}

/// The file name stem of `uid`'s record. A uid comes from outside (the workloads file, the
/// API): anything but ASCII letters, digits, `-` and `_` is percent-encoded, so a uid with `/`,
/// `.` or `..` can neither leave the directory nor collide with the temporary files. A
/// Kubernetes uid (a UUID) is its own stem.
pub fn file_stem(uid: &str) -> String {
    let mut out = String::with_capacity(uid.len());
    for b in uid.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Writes the record (atomically: written aside, then renamed).
pub fn save(state: &Path, r: &PodRecord) -> anyhow::Result<()> {
    let d = dir(state);
    fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    let stem = file_stem(&r.uid);
    let tmp = d.join(format!(".{stem}.tmp"));
    fs::write(&tmp, serde_json::to_vec_pretty(r)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, d.join(format!("{stem}.json"))).context("renaming the pod record")?;
    Ok(())
}

/// Removes the record of `uid` (absent is fine).
pub fn delete(state: &Path, uid: &str) -> anyhow::Result<()> {
    match fs::remove_file(dir(state).join(format!("{}.json", file_stem(uid)))) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

/// Every record on disk (unreadable ones are reported and skipped).
pub fn load_all(state: &Path) -> Vec<PodRecord> {
    let Ok(entries) = fs::read_dir(dir(state)) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| {
            let parsed = fs::read(e.path())
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
            parsed
                .map_err(
                    |err| warn!(file = %e.path().display(), error = %err, "unreadable pod record"),
                )
                .ok()
        })
        .collect()
}

/// Rebuilds the agent's pods from the records: a record whose netns is gone, or whose pod is
/// not enrolled (an ADD that never finished), is removed with whatever it left in the
/// datapath; the others are served again. Returns how many were restored.
pub fn restore(agent: &Arc<Agent>) -> anyhow::Result<usize> {
    let state = &agent.cfg.state_dir;
    let mut restored = 0;
    for r in load_all(state) {
        let enrolled = agent.with_datapath(|dp| {
            Ok(pods::is_enrolled(dp, r.cookie)? && pods::netns_alive(dp, r.cookie)?)
        })?;
        let netns = if enrolled {
            meshpath_podnet::netns::find_by_inode(&r.netns_path, r.netns_inode)
        } else {
            None
        };
        match netns {
            Some(ns) if ns.cookie() == r.cookie => {
                // Its interfaces may have changed while no agent ran: the watch's first look
                // guards any new one.
                let netns = Arc::new(ns);
                let interfaces = super::interfaces::subscribe(&netns)
                    .and_then(|events| super::interfaces::watch(agent, &r.uid, &netns, events, true))
                    .inspect_err(|e| warn!(pod = %r.uid, error = %format!("{e:#}"), "its interfaces added from now on will not be guarded: the watch did not start"))
                    .ok();
                agent
                    .pods
                    .lock()
                    .map_err(|_| anyhow::anyhow!("pods lock"))?
                    .insert(r.uid.clone(), LivePod { record: r, netns, interfaces });
                restored += 1;
            }
            _ => {
                info!(pod = %r.uid, cookie = r.cookie, "record of a pod that is gone or was never fully added: removing");
                agent.with_datapath(|dp| {
                    if pods::is_enrolled(dp, r.cookie)? {
                        pods::unenrol(dp, r.cookie)?;
                    }
                    Ok(())
                })?;
                delete(state, &r.uid)?;
            }
        }
    }
    Ok(restored)
}

#[cfg(test)]
mod tests {
    use super::file_stem;

    #[test]
    fn a_kubernetes_uid_is_its_own_file_name() {
        let uid = "6f1c2a9e-3b7d-4c2a-9e51-0d7b8c1f2e3a";
        assert_eq!(file_stem(uid), uid);
    }

    #[test]
    fn a_uid_with_path_characters_stays_one_plain_file_name() {
        for uid in ["../x", "a/b", "..", ".", "x/../../etc", ".hidden"] {
            let stem = file_stem(uid);
            assert!(!stem.contains('/') && !stem.contains('.'), "{uid} → {stem}");
        }
        assert_ne!(file_stem("a/b"), file_stem("a%2Fb"), "two uids, one file");
    }
}
