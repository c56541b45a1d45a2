//! `cargo xtask fuzz`: the cargo-fuzz targets in fuzz/ (libFuzzer with AddressSanitizer, the
//! nightly), built into fuzz/ of xtask's target directory (cargo.rs, `target_dir`). Each target starts from its committed seeds
//! (fuzz/seeds/TARGET, which also hold every input that once crashed it) plus what earlier runs
//! on this machine found (fuzz/corpus/TARGET there). A crash stops the run with the input's
//! path; it becomes a seed and a regression test.

use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::{bootstrap, cargo::workspace_root};

/// Every target (fuzz/Cargo.toml's bins).
pub const TARGETS: &[&str] = &[
    "dns_message",
    "zds_session",
    "identity",
    "authorization",
    "workloads_file",
    "cni_input",
    "xds_response",
];

/// Seconds per target inside `cargo xtask test` (its time budget: the seeds and the corpus
/// every earlier run here found are replayed first; `cargo xtask fuzz` runs longer).
pub const IN_TESTS_SECS: u64 = 5;

fn nightly_cargo(dir: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.arg("+nightly").current_dir(dir);
    // From the outer `cargo xtask` (the stable toolchain): cargo-fuzz must see the nightly's.
    for var in ["CARGO", "RUSTC", "RUSTUP_TOOLCHAIN", "RUSTC_WRAPPER", "CARGO_TARGET_DIR"] {
        cmd.env_remove(var);
    }
    cmd
}

fn ensure_cargo_fuzz() -> Result<()> {
    let present = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        println!("bootstrap: installing cargo-fuzz (crates.io)");
        bootstrap::run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
            .context("could not install cargo-fuzz")?;
    }
    Ok(())
}

/// Builds every target (with AddressSanitizer: both cores' worth of compiling when the
/// crates they fuzz changed).
pub fn build() -> Result<()> {
    // libFuzzer is C++, compiled by libfuzzer-sys.
    bootstrap::ensure_debian_packages(&[("g++", "g++")])?;
    ensure_cargo_fuzz()?;
    let fuzz = workspace_root().join("fuzz");
    let target_dir = crate::cargo::target_dir().join("fuzz");
    bootstrap::run(
        nightly_cargo(&fuzz).arg("fuzz").arg("build").arg("--target-dir").arg(&target_dir),
    )
    .context("building the fuzz targets")
}

/// Builds the targets (nothing to do if [`build`] just did), then runs `which` (all when
/// empty) for `secs` seconds each: one process at a time, one core.
pub fn run(which: &[&str], secs: u64) -> Result<()> {
    build()?;
    let root = workspace_root();
    let fuzz = root.join("fuzz");
    let target_dir = crate::cargo::target_dir().join("fuzz");
    let which = if which.is_empty() { TARGETS } else { which };
    for t in which {
        if !TARGETS.contains(t) {
            bail!("no fuzz target {t:?}; there are: {}", TARGETS.join(", "));
        }
        let corpus = target_dir.join("corpus").join(t);
        let artifacts = target_dir.join("artifacts").join(t);
        std::fs::create_dir_all(&corpus)?;
        std::fs::create_dir_all(&artifacts)?;
        let status = nightly_cargo(&fuzz)
            .args(["fuzz", "run", "--target-dir"])
            .arg(&target_dir)
            .arg(t)
            .arg(&corpus)
            .arg(fuzz.join("seeds").join(t))
            .arg("--")
            .arg(format!("-max_total_time={secs}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .arg("-print_final_stats=1")
            .status()
            .with_context(|| format!("running fuzz target {t}"))?;
        if !status.success() {
            bail!(
                "fuzz target {t} crashed ({status}); the input is in {}: add it to fuzz/seeds/{t}/ \
                 and write the regression test before fixing",
                artifacts.display()
            );
        }
        println!("fuzz: {t}: {secs} s, no crash");
    }
    Ok(())
}
