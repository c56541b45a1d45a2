//! Cgroups a test makes: the proxy's (cgroup v2) and one with a memory limit.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

use crate::unique;

/// A memory cgroup of its own with a limit (the memory controller's hierarchy: cgroup v1's
/// `memory` on a hybrid host, else cgroup v2), for a process a test runs under a memory limit;
/// removed on drop (after the process is gone).
#[derive(Debug)]
pub struct MemoryCgroup {
    path: PathBuf,
}

impl MemoryCgroup {
    pub fn new(limit: u64) -> Result<Self> {
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let (path, file) = if v1.join("memory.limit_in_bytes").exists() {
            (v1.join(unique("meshpath-test-")), "memory.limit_in_bytes")
        } else {
            let root = meshpath_loader::datapath::cgroup2_root()?;
            (root.join(unique("meshpath-test-mem-")), "memory.max")
        };
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        let me = Self { path };
        std::fs::write(me.path.join(file), limit.to_string())
            .with_context(|| format!("setting {file} in {}", me.path.display()))?;
        Ok(me)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// A cgroup v2 directory of its own (for the proxy), removed on drop.
#[derive(Debug)]
pub struct CgroupGuard {
    path: PathBuf,
}

impl CgroupGuard {
    pub fn new() -> Result<Self> {
        let root = meshpath_loader::datapath::cgroup2_root()?;
        let path = root.join(unique("meshpath-test-"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        // Its processes are gone by now (TestProxy is dropped first); retry briefly meanwhile.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
