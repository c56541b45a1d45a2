//! The previous release, built from its git tag, for the tests that upgrade a node from it:
//! a datapath pinned by that release's agent, taken over by this one's
//! (tests/tests/upgrades.rs, and the cluster's DaemonSet rolled from its image).
//!
//! Its source is taken from this checkout's history (`git archive` of the tagged commit, so a
//! clone without tags works too) into the tool cache, and built there with its own lock file
//! and this machine's eBPF toolchain, into the one target directory under a profile of its own
//! (`previous`, the dev profile's settings), so its binaries never take the place of this
//! build's. The first build compiles its dependencies once; later runs find them built.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::cache_dir;

/// The release upgrades are tested from.
pub const TAG: &str = "v0.1.0";
/// Its commit: found in the history when the tag is not (a CI clone without tags).
pub const COMMIT: &str = "955a27a92d7d1f93856d8812e461977a69cadf8b";
/// The variable that tells the tests where its binaries are.
pub const BIN_DIR_VAR: &str = "MESHPATH_PREVIOUS_BIN_DIR";
/// The variable that tells the tests where its source is (its manifests, for the cluster's
/// upgrade test).
pub const SOURCE_VAR: &str = "MESHPATH_PREVIOUS_SOURCE";
/// The variable that tells the tests why it could not be built.
pub const ERROR_VAR: &str = "MESHPATH_PREVIOUS_ERROR";
/// The cargo profile its binaries are built with (target/previous/).
const PROFILE: &str = "previous";

/// Where its source is unpacked.
pub fn source_dir() -> PathBuf {
    cache_dir().join("previous").join(TAG)
}

/// Unpacks the release's source (once per commit), builds its loader, proxy and CNI plugin,
/// and returns the directory holding them.
pub fn build(extra_path: Option<&Path>) -> Result<PathBuf> {
    let dir = source_dir();
    let stamp = dir.join(".meshpath-commit");
    if fs::read_to_string(&stamp).ok().as_deref() != Some(COMMIT) {
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        fs::create_dir_all(&dir)?;
        let root = crate::cargo::workspace_root();
        let mut archive = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["archive", "--format=tar", COMMIT])
            .stdout(Stdio::piped())
            .spawn()
            .context("running git archive")?;
        let tar = archive.stdout.take().context("git archive's output")?;
        let untar = Command::new("tar")
            .arg("-x")
            .arg("-C")
            .arg(&dir)
            .stdin(tar)
            .status()
            .context("running tar")?;
        let archived = archive.wait()?;
        if !archived.success() || !untar.success() {
            bail!(
                "the previous release ({TAG}, commit {COMMIT}) is not in this checkout's history \
                 (a shallow clone?): `git fetch --unshallow` or fetch the tag {TAG}"
            );
        }
        fs::write(&stamp, COMMIT)?;
    }
    println!("previous release: building {TAG} ({}) in {}", &COMMIT[..7], dir.display());
    let mut cmd = crate::cargo::command_in(&dir, extra_path)?;
    cmd.args(["build", "--locked", "--bins"])
        .args(["--config", &format!("profile.{PROFILE}.inherits=\"dev\"")])
        .args(["--profile", PROFILE])
        .args(["-p", "meshpath-loader", "-p", "meshpath-proxy", "-p", "meshpath-cni"]);
    crate::cargo::run(cmd).with_context(|| format!("building the previous release {TAG}"))?;
    Ok(crate::cargo::target_dir().join(PROFILE))
}
