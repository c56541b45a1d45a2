//! The workloads file as a directory, for running without a cluster: the same file as the
//! proxy's (ztunnel's local configuration format), of which only the fields needed here are
//! read. A pod listed with `protocol: HBONE` is meshed, with every capture on; anything else is
//! left alone.

use std::{
    collections::HashMap, os::unix::fs::MetadataExt as _, path::PathBuf, sync::Mutex,
    time::SystemTime,
};

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

/// The workloads file, parsed once per version of it: a CNI ADD looks a pod up in an index
/// instead of reading and parsing the whole file (which, with a thousand workloads, cost more
/// than the rest of the ADD: `meshpath-bench cni`).
#[derive(Debug)]
pub struct WorkloadsFile {
    path: PathBuf,
    parsed: Mutex<Option<Parsed>>,
}

/// One version of the file, indexed.
#[derive(Debug)]
struct Parsed {
    version: Version,
    by_uid: HashMap<String, usize>,
    by_name: HashMap<(String, String), usize>,
    workloads: Vec<Entry>,
}

/// What tells one version of the file from another: modification time, size and inode (an
/// editor's or a ConfigMap's rename-into-place changes the inode even within one mtime tick).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Version {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl Version {
    fn of(meta: &std::fs::Metadata) -> Self {
        Self { modified: meta.modified().ok(), len: meta.len(), inode: meta.ino() }
    }
}

impl WorkloadsFile {
    pub fn new(path: PathBuf) -> Self {
        Self { path, parsed: Mutex::new(None) }
    }

    /// The decision for a pod, by uid (when the runtime gave one) or by namespace and name.
    pub fn lookup(&self, uid: &str, namespace: &str, name: &str) -> anyhow::Result<Decision> {
        Ok(decide(self.find(uid, namespace, name)?))
    }

    fn find(&self, uid: &str, namespace: &str, name: &str) -> anyhow::Result<Option<Entry>> {
        let shown = self.path.display();
        let meta = std::fs::metadata(&self.path)
            .map_err(|e| anyhow::anyhow!("reading the workloads file {shown}: {e}"))?;
        let version = Version::of(&meta);
        let mut parsed =
            self.parsed.lock().map_err(|_| anyhow::anyhow!("workloads lock poisoned"))?;
        if parsed.as_ref().is_none_or(|p| p.version != version) {
            let text = std::fs::read_to_string(&self.path)
                .map_err(|e| anyhow::anyhow!("reading the workloads file {shown}: {e}"))?;
            let file: File = serde_yaml::from_str(&text)
                .map_err(|e| anyhow::anyhow!("the workloads file {shown}: {e}"))?;
            *parsed = Some(Parsed::new(version, file.workloads));
        }
        Ok(parsed.as_ref().and_then(|p| p.find(uid, namespace, name)).cloned())
    }
}

impl Parsed {
    fn new(version: Version, workloads: Vec<Entry>) -> Self {
        // The first entry wins when two share a key, as a scan from the top would find it.
        let (mut by_uid, mut by_name) = (HashMap::new(), HashMap::new());
        for (i, w) in workloads.iter().enumerate() {
            by_uid.entry(w.uid.clone()).or_insert(i);
            by_name.entry((w.namespace.clone(), w.name.clone())).or_insert(i);
        }
        Self { version, by_uid, by_name, workloads }
    }

    fn find(&self, uid: &str, namespace: &str, name: &str) -> Option<&Entry> {
        let by_uid = (!uid.is_empty()).then(|| self.by_uid.get(uid)).flatten();
        let i = by_uid.or_else(|| self.by_name.get(&(namespace.to_owned(), name.to_owned())))?;
        self.workloads.get(*i)
    }
}

fn decide(entry: Option<Entry>) -> Decision {
    match entry {
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
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn write(path: &Path, workloads: &[(&str, &str, &str)]) {
        let mut yaml = String::from("workloads:\n");
        for (uid, name, protocol) in workloads {
            yaml += &format!(
                "- uid: {uid}\n  name: {name}\n  namespace: default\n  serviceAccount: sa\n  protocol: {protocol}\n"
            );
        }
        // Written aside and renamed into place, as a ConfigMap update or an editor does.
        let aside = path.with_extension("new");
        std::fs::write(&aside, yaml).expect("write");
        std::fs::rename(&aside, path).expect("rename");
    }

    fn meshed(d: Decision) -> Option<String> {
        match d {
            Decision::Meshed(m) => Some(m.uid),
            _ => None,
        }
    }

    #[test]
    fn a_pod_is_found_by_uid_or_else_by_namespace_and_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("workloads.yaml");
        write(&path, &[("u1", "a", "HBONE"), ("u2", "b", "HBONE"), ("u3", "c", "TCP")]);
        let file = WorkloadsFile::new(path);
        assert_eq!(meshed(file.lookup("u2", "default", "a").expect("lookup")), Some("u2".into()));
        assert_eq!(meshed(file.lookup("", "default", "a").expect("lookup")), Some("u1".into()));
        assert_eq!(meshed(file.lookup("nope", "default", "b").expect("lookup")), Some("u2".into()));
        assert!(matches!(
            file.lookup("u3", "default", "c").expect("lookup"),
            Decision::NotMeshed("not an HBONE workload")
        ));
        assert!(matches!(
            file.lookup("", "default", "zz").expect("lookup"),
            Decision::NotMeshed("not in the workloads file")
        ));
    }

    #[test]
    fn a_new_version_of_the_file_is_read_at_the_next_lookup() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("workloads.yaml");
        write(&path, &[("u1", "a", "HBONE")]);
        let file = WorkloadsFile::new(path.clone());
        assert_eq!(meshed(file.lookup("", "default", "b").expect("lookup")), None);
        write(&path, &[("u1", "a", "HBONE"), ("u2", "b", "HBONE")]);
        assert_eq!(meshed(file.lookup("", "default", "b").expect("lookup")), Some("u2".into()));
    }

    #[test]
    fn a_broken_file_is_a_clear_error_and_its_fixed_version_is_read_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("workloads.yaml");
        std::fs::write(&path, "workloads: [unclosed\n").expect("write");
        let file = WorkloadsFile::new(path.clone());
        let err = file.lookup("u1", "default", "a").expect_err("broken yaml").to_string();
        assert!(err.contains("the workloads file"), "{err}");
        write(&path, &[("u1", "a", "HBONE")]);
        assert_eq!(meshed(file.lookup("u1", "default", "a").expect("lookup")), Some("u1".into()));
    }
}
