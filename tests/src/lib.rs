//! Test fixtures for meshpath's end-to-end tests: pod-like network namespaces joined by veth,
//! private pin roots, real TCP traffic. Every fixture removes what it made when dropped, also
//! when the test fails, and every name is unique so tests run in parallel and again.

use std::{
    path::PathBuf,
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context as _, Result};

/// Panics unless running as root: these tests load eBPF programs and create namespaces. They are
/// never skipped, so a run without privileges fails loudly instead of passing empty.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "meshpath's end-to-end tests must run as root (they load eBPF programs)");
}

/// Raises this process's open-file limit to at least `n` (the hard limit too if it is lower:
/// the tests run as root), for a test that holds thousands of sockets: the QEMU guests start
/// with a soft limit of 1,024.
pub fn raise_open_files(n: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid rlimit for the kernel to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0, "getrlimit");
    if lim.rlim_cur >= n {
        return;
    }
    let want = libc::rlimit { rlim_cur: n, rlim_max: lim.rlim_max.max(n) };
    // SAFETY: a valid rlimit.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) };
    assert_eq!(rc, 0, "raising the open-file limit to {n}: {}", std::io::Error::last_os_error());
}

/// A name no other test (in this or another process) is using: `prefix` + pid + counter.
/// Kept short: interface names are limited to 15 bytes.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{}x{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed))
}

/// Runs a command, failing with its stderr if it does not succeed.
pub fn sh(program: &str, args: &[&str]) -> Result<Output> {
    let out =
        Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// The `meshpath-loader` binary of this build (`MESHPATH_LOADER` overrides).
pub fn loader_bin() -> PathBuf {
    match std::env::var_os("MESHPATH_LOADER") {
        Some(p) => PathBuf::from(p),
        None => sibling_bin("meshpath-loader"),
    }
}

/// A binary of the previous release (its git tag, built by `cargo xtask test`, or by
/// `cargo xtask build --previous`, which prints the variable to set), for the upgrade tests.
pub fn previous_release_bin(name: &str) -> PathBuf {
    let Some(dir) = std::env::var_os("MESHPATH_PREVIOUS_BIN_DIR") else {
        match std::env::var("MESHPATH_PREVIOUS_ERROR") {
            Ok(why) => panic!("the previous release could not be built: {why}"),
            Err(_) => panic!(
                "MESHPATH_PREVIOUS_BIN_DIR is not set: run these tests with `cargo xtask test`, \
                 or set it as `cargo xtask build --previous` prints"
            ),
        }
    };
    let bin = PathBuf::from(dir).join(name);
    assert!(bin.exists(), "the previous release's {} is missing", bin.display());
    bin
}

/// A binary of this build, in target/<profile>/ (test binaries run from its deps/).
pub fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("the executable's directory").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// A child process killed (and reaped) on drop, so a failing test or bench leaves none behind.
#[derive(Debug)]
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub mod cluster;
pub mod cni_node;
pub mod istioctl;
pub mod istiod;
pub mod kube_api;
pub mod two_nodes;
pub mod waits;

mod cgroups;
mod mesh;
mod netns;
mod node_proxy;
mod oracle;
mod pins;
mod test_proxy;
mod traffic;

pub use cgroups::{CgroupGuard, MemoryCgroup};
pub use mesh::Mesh;
pub use netns::{egress_filters, veth_between, NetnsGuard, PodPair};
pub use node_proxy::{sum_metric, NodeProxy};
pub use oracle::{answer_dns, original_dst, LocalAddr};
pub use pins::{loader, previous_loader, PinRoot};
pub use test_proxy::TestProxy;
pub use traffic::{
    read_line, tcp_send, tcp_sink, transfer, transfer_counting_retransmits, Sentinel,
};
pub use waits::{
    again_after_eintr, assert_unanswered_within, read_within, wait_until, wait_until_async,
};
