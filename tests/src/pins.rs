//! A private pin root for a datapath, and the loader run against it.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::Result;
use meshpath_loader::datapath::Datapath;

use crate::{loader_bin, unique};

/// A private pin root under /sys/fs/bpf, removed (with every pin in it, which detaches the links
/// they hold) on drop.
#[derive(Debug)]
pub struct PinRoot {
    path: PathBuf,
}

impl PinRoot {
    pub fn new() -> Self {
        Self { path: Path::new("/sys/fs/bpf").join(unique("meshpath-test-")) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens (creating on first use) the datapath under this root. The returned handle holds the
    /// root's lock: drop it before running a loader process on the same root.
    pub fn datapath(&self) -> Result<Datapath> {
        Ok(Datapath::open_or_load(&self.path)?)
    }

    /// Every pin file under the root's `pods/` directory.
    pub fn pod_pins(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let pods = self.path.join(datapath_common::consts::pins::PODS_DIR);
        for dir in std::fs::read_dir(pods).into_iter().flatten().flatten() {
            out.push(dir.path());
            out.extend(
                std::fs::read_dir(dir.path()).into_iter().flatten().flatten().map(|e| e.path()),
            );
        }
        out
    }
}

impl Default for PinRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Runs `meshpath-loader --pin-root ROOT ARGS…` as a separate process.
pub fn loader(root: &PinRoot, args: &[&str]) -> Output {
    Command::new(loader_bin())
        .arg("--pin-root")
        .arg(root.path())
        .args(args)
        .output()
        .expect("running meshpath-loader (build it first: cargo xtask build)")
}

/// Runs the previous release's `meshpath-loader --pin-root ROOT ARGS…`.
pub fn previous_loader(root: &PinRoot, args: &[&str]) -> Output {
    Command::new(crate::previous_release_bin("meshpath-loader"))
        .arg("--pin-root")
        .arg(root.path())
        .args(args)
        .output()
        .expect("running the previous release's meshpath-loader")
}
