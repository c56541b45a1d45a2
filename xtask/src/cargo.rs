//! Cargo invocations with the eBPF toolchain on PATH, and eBPF compile errors shown plainly.

use std::{
    env,
    ffi::OsString,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, AtomicU32, Ordering},
};

use anyhow::{bail, Context as _, Result};

/// The workspace root (xtask lives one level below it). Read as the process starts (`cargo
/// run` sets `CARGO_MANIFEST_DIR` for it): checkouts share one target directory, and a binary
/// built in another checkout, unchanged, is not rebuilt, so the path it was compiled with can
/// name the other checkout.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Where xtask's builds go: `CARGO_TARGET_DIR` if set, else `target/` under the tool cache
/// (~/.cache/meshpath/target), outside the checkout as CI systems cache it: a fresh clone on a
/// machine that built meshpath before compiles only the workspace's own crates, not its
/// dependencies again. (A plain `cargo build` in the checkout still uses ./target.)
pub fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::bootstrap::cache_dir().join("target"))
}

/// A cargo command run from the workspace root with `extra_path` first on PATH.
fn cargo(extra_path: Option<&Path>) -> Result<Command> {
    command_in(&workspace_root(), extra_path)
}

/// A cargo command run from `dir` (another workspace: the previous release's) with the one
/// target directory and `extra_path` first on PATH.
pub fn command_in(dir: &Path, extra_path: Option<&Path>) -> Result<Command> {
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(dir);
    cmd.env("CARGO_TARGET_DIR", target_dir());
    if let Some(dir) = extra_path {
        let old = env::var_os("PATH").unwrap_or_default();
        // Only when missing: a PATH that changes between cargo runs makes build scripts that
        // watch it (ring's, aws-lc's) run again, and everything above them rebuild.
        if !env::split_paths(&old).any(|p| p == dir) {
            let mut path = OsString::from(dir);
            path.push(":");
            path.push(old);
            cmd.env("PATH", path);
        }
    }
    Ok(cmd)
}

/// Runs a cargo command. aya-build reports the eBPF crate's compiler output as
/// `warning: meshpath-loader@…: ` lines; on failure those are printed again without the prefix,
/// so an eBPF compile error reads like any other.
pub fn run(cmd: Command) -> Result<()> {
    run_cargo(cmd)
}

fn run_cargo(mut cmd: Command) -> Result<()> {
    let what = format!(
        "cargo {}",
        cmd.get_args().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
    );
    let mut child =
        cmd.stderr(Stdio::piped()).spawn().with_context(|| format!("starting {what}"))?;
    let stderr = child.stderr.take().context("cargo stderr")?;
    let mut ebpf_lines = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap_or_default();
        match line.split_once("meshpath-loader@").and_then(|(_, rest)| rest.split_once(": ")) {
            Some((_, msg)) if line.starts_with("warning: ") => ebpf_lines.push(msg.to_owned()),
            _ => eprintln!("{line}"),
        }
    }
    let status = child.wait()?;
    if !status.success() {
        let relevant: Vec<&String> = ebpf_lines
            .iter()
            .filter(|l| {
                !l.trim_start().starts_with("Compiling")
                    && !l.trim_start().starts_with("Downloaded")
            })
            .collect();
        if relevant.iter().any(|l| l.contains("error")) {
            eprintln!("--- eBPF crate (datapath-ebpf) build output ---");
            for l in relevant {
                eprintln!("{l}");
            }
        }
        bail!("{what} failed with {status}");
    }
    Ok(())
}

/// The profile of what meshpath ships (Cargo.toml: release with fat LTO), and its directory
/// under the target directory.
pub const SHIPPED_PROFILE: &str = "dist";

/// Builds every default workspace member (the loader's build script builds the eBPF object),
/// `release`: as shipped ([`SHIPPED_PROFILE`]), else a debug build. Returns the directory
/// holding the binaries.
pub fn build(extra_path: Option<&Path>, release: bool) -> Result<PathBuf> {
    let mut cmd = cargo(extra_path)?;
    cmd.args(["build", "--bins"]);
    if release {
        cmd.args(["--profile", SHIPPED_PROFILE]);
    }
    run_cargo(cmd)?;
    Ok(target_dir().join(if release { SHIPPED_PROFILE } else { "debug" }))
}

/// Builds only `bins` (package, binary) as shipped ([`SHIPPED_PROFILE`]), and the loader's
/// eBPF object with them: what the demo runs, not the whole workspace. Returns the directory
/// holding them.
pub fn build_release_bins(extra_path: Option<&Path>, bins: &[(&str, &str)]) -> Result<PathBuf> {
    let mut cmd = cargo(extra_path)?;
    cmd.args(["build", "--profile", SHIPPED_PROFILE]);
    for (package, bin) in bins {
        cmd.args(["-p", package, "--bin", bin]);
    }
    run_cargo(cmd)?;
    Ok(target_dir().join(SHIPPED_PROFILE))
}

/// rustfmt's check.
pub fn fmt_check(extra_path: Option<&Path>) -> Result<()> {
    println!("test: cargo fmt --check");
    let mut fmt = cargo(extra_path)?;
    fmt.args(["fmt", "--all", "--", "--check"]);
    run_cargo(fmt).context("code is not formatted: run `cargo fmt --all`")
}

/// clippy with warnings as errors, on every target and on the cluster suite (no default test
/// target: it needs the cluster; `--all-targets` leaves out a target named beside it).
pub fn clippy(extra_path: Option<&Path>) -> Result<()> {
    println!("test: cargo clippy -D warnings");
    for targets in [&["--all-targets"][..], &["--test", "cluster"]] {
        let mut clippy = cargo(extra_path)?;
        clippy.arg("clippy").args(targets).args(["--", "-D", "warnings"]);
        run_cargo(clippy)?;
    }
    Ok(())
}

/// What a test run counted.
#[derive(Debug, Default, Clone)]
pub struct Totals {
    pub passed: u64,
    pub failed: u64,
    /// Each failed test with its panic message, read from the harness output, so the run's
    /// last lines (all a CI log may keep) say what failed and why.
    pub failures: Vec<Failure>,
    /// While reading a `---- NAME stdout ----` block: that failure's index, and whether its
    /// panic message has begun.
    reading: Option<usize>,
    in_panic: bool,
    /// Failures of the test binary being read start at this index.
    binary_start: usize,
    /// The last line was `failures:`; then, whether the names list after it is being read.
    after_header: bool,
    in_list: bool,
}

/// A test the harness reported as failed, and the first lines of its panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub name: String,
    pub message: Vec<String>,
}

/// Lines kept of a failed test's panic message.
const MESSAGE_LINES: usize = 6;

impl Totals {
    /// One failure: a suite that could not run at all, so that the run cannot pass.
    pub fn one_failed() -> Self {
        Self { failed: 1, ..Self::default() }
    }

    /// Adds what `other` (another, separately read output) counted.
    pub fn merge(&mut self, other: Totals) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.failures.extend(other.failures);
        self.binary_start = self.failures.len();
    }

    /// Reads one line of libtest output: `test result:` totals, `test NAME ... FAILED`, the
    /// `---- NAME stdout ----` blocks' panic messages, and the list of failed names libtest
    /// prints last (which names a test whose own result line other output cut in two).
    pub fn read(&mut self, line: &str) {
        let after_header = std::mem::take(&mut self.after_header);
        if after_header {
            self.in_list = line.starts_with("    ");
        }
        if self.in_list {
            match line.strip_prefix("    ").filter(|n| !n.is_empty() && !n.starts_with(' ')) {
                Some(name) => {
                    let known = self.failures[self.binary_start..].iter().any(|f| f.name == name);
                    if !known {
                        let message = Vec::new();
                        self.failures.push(Failure { name: name.to_owned(), message });
                    }
                    return;
                }
                None => self.in_list = false,
            }
        }
        if let Some(rest) = line.strip_prefix("test result: ") {
            self.passed += count_before(rest, " passed");
            self.failed += count_before(rest, " failed");
            self.binary_start = self.failures.len();
            self.reading = None;
        } else if let Some(name) =
            line.strip_prefix("test ").and_then(|l| l.strip_suffix(" ... FAILED"))
        {
            self.failures.push(Failure { name: name.to_owned(), message: Vec::new() });
        } else if let Some(name) =
            line.strip_prefix("---- ").and_then(|l| l.strip_suffix(" stdout ----"))
        {
            // Only failed tests have a block: its panic goes to that failure of this binary (a
            // name can repeat across binaries), recorded here if its result line was cut.
            let start = self.binary_start;
            let i = match self.failures[start..].iter().position(|f| f.name == name) {
                Some(i) => start + i,
                None => {
                    let message = Vec::new();
                    self.failures.push(Failure { name: name.to_owned(), message });
                    self.failures.len() - 1
                }
            };
            self.reading = Some(i);
            self.in_panic = false;
        } else if let Some(i) = self.reading {
            if line.contains("panicked at ") {
                self.in_panic = true;
            }
            let f = &mut self.failures[i];
            if self.in_panic && f.message.len() < MESSAGE_LINES {
                if line.trim().is_empty() || line.starts_with("note: run with `RUST_BACKTRACE") {
                    self.in_panic = false;
                } else {
                    f.message.push(line.to_owned());
                }
            }
            if line == "failures:" {
                self.reading = None;
            }
        }
        if line == "failures:" {
            self.after_header = true;
        }
    }

    /// One line per failed test, with its message indented below it.
    pub fn failure_lines(&self, prefix: &str) -> Vec<String> {
        let mut lines = Vec::new();
        for f in &self.failures {
            lines.push(format!("{prefix}FAILED {}", f.name));
            lines.extend(f.message.iter().map(|m| format!("{prefix}    {m}")));
        }
        lines
    }
}

/// Every test on this machine's kernel (the end-to-end tests run the binaries in `bin_dir`).
pub fn test(extra_path: Option<&Path>, bin_dir: &Path, filter: Option<&str>) -> Result<Totals> {
    println!("test: cargo test");
    let mut test = cargo(extra_path)?;
    test.args(["test", "--no-fail-fast", "--all-targets"]);
    test.env("MESHPATH_LOADER", bin_dir.join("meshpath-loader"));
    test.env("MESHPATH_KUBE_APISERVER", crate::kubernetes::binary("kube-apiserver"));
    if let Some(f) = filter {
        test.args(["--", f]);
    }
    // Tee the harness output and add up its `test result:` lines, so the run ends with one
    // total (the last harness line is otherwise some crate's empty doc-test run).
    run_tee(test)
}

/// The cluster suite's executable (from [`test_binaries`]) against the cluster that is
/// up, one test at a time, run directly rather than through cargo, so that it can run beside
/// another `cargo test` (which holds the target directory's lock). Its lines are printed with
/// `[cluster] ` before them, apart from the other suites running at the same time.
pub fn test_cluster(
    exe: &Path,
    bin_dir: &Path,
    filter: Option<&str>,
    host_running: Option<&Path>,
) -> Result<Totals> {
    if CLUSTER_SUITE_STOPPED.load(Ordering::SeqCst) {
        bail!("not run: the run failed before it could");
    }
    println!("[cluster] test: {} (the two-node cluster)", exe.display());
    let mut test = Command::new(exe);
    // As `cargo test` runs a test binary: in its package's directory, which it names.
    let package = workspace_root().join("tests");
    test.current_dir(&package).env("CARGO_MANIFEST_DIR", &package);
    if let Some(f) = filter {
        test.arg(f);
    }
    test.args(["--test-threads", "1"]);
    test.env("MESHPATH_LOADER", bin_dir.join("meshpath-loader"));
    test.env("MESHPATH_CLUSTER", "1");
    // A test that takes what this machine's tests share with the first node (its bpffs: the
    // reboot) waits while this file exists.
    if let Some(marker) = host_running {
        test.env("MESHPATH_HOST_SUITE_MARKER", marker);
    }
    let child = test.stdout(Stdio::piped()).spawn().context("starting the cluster suite")?;
    CLUSTER_SUITE.store(child.id(), Ordering::SeqCst);
    // Stopped between the check above and now.
    if CLUSTER_SUITE_STOPPED.load(Ordering::SeqCst) {
        kill_cluster_suite();
    }
    let totals = tee(child, true, "[cluster] ");
    CLUSTER_SUITE.store(0, Ordering::SeqCst);
    totals
}

/// The cluster suite's process while it runs (0 when none), and whether it was stopped: the
/// suite runs beside the rest of `cargo xtask test`, which stops it if it fails on its own.
static CLUSTER_SUITE: AtomicU32 = AtomicU32::new(0);
static CLUSTER_SUITE_STOPPED: AtomicBool = AtomicBool::new(false);

/// Stops the cluster suite (killed if it runs; never started if not yet).
pub fn stop_cluster_suite() {
    CLUSTER_SUITE_STOPPED.store(true, Ordering::SeqCst);
    kill_cluster_suite();
}

fn kill_cluster_suite() {
    let pid = CLUSTER_SUITE.load(Ordering::SeqCst);
    if let Ok(pid @ 1..) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
}

/// Runs a `cargo test`, printing its output and adding up its results.
fn run_tee(mut test: Command) -> Result<Totals> {
    let child = test.stdout(Stdio::piped()).spawn().context("starting cargo test")?;
    tee(child, false, "")
}

/// Prints a test harness's output as it comes, each line after `prefix`, and adds up its
/// results. With `one_at_a_time` (a suite run with `--test-threads 1`) each test's result line
/// also says how long it took, counted from the previous result (or from the harness's
/// `running N tests`): where a suite's share of CI's time budget goes.
fn tee(mut child: std::process::Child, one_at_a_time: bool, prefix: &str) -> Result<Totals> {
    let stdout = child.stdout.take().context("cargo test stdout")?;
    let mut totals = Totals::default();
    let mut last = std::time::Instant::now();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap_or_default();
        // A child's output may come between a test's name and its result, which then ends a
        // line of its own.
        let result = (line.starts_with("test ")
            && [" ... ok", " ... FAILED", " ... ignored"].iter().any(|r| line.ends_with(r)))
            || ["ok", "FAILED", "ignored"].contains(&line.as_str());
        if one_at_a_time && result {
            println!("{prefix}{line} ({:.0} s)", last.elapsed().as_secs_f64());
            last = std::time::Instant::now();
        } else {
            println!("{prefix}{line}");
        }
        if line.starts_with("running ") {
            last = std::time::Instant::now();
        }
        totals.read(&line);
    }
    let status = child.wait()?;
    if !status.success() && totals.failed == 0 {
        // A build error or a crashed harness: count it, so the run cannot pass.
        totals.failed += 1;
    }
    Ok(totals)
}

/// Builds every test target without running it; returns (target name, executable) for each
/// integration test binary. Same flags as `test`, so nothing is rebuilt between the two.
pub fn test_binaries(extra_path: Option<&Path>) -> Result<Vec<(String, PathBuf)>> {
    test_executables(extra_path, &["--all-targets"])
}

/// Builds the cluster suite (tests/tests/cluster.rs: no default test target, it needs the
/// cluster) without running it; returns its executable. Named without `-p`: the default
/// members' features, as every other build here (`-p meshpath-tests` alone would build its
/// dependencies again with fewer); `--all-targets` would leave it out.
pub fn cluster_test_binary(extra_path: Option<&Path>) -> Result<PathBuf> {
    test_executables(extra_path, &["--test", "cluster"])?
        .into_iter()
        .find_map(|(name, exe)| (name == "cluster").then_some(exe))
        .context("cargo built no `cluster` test executable")
}

/// `cargo test --no-run` of `targets`: (target name, executable) of each integration test.
fn test_executables(extra_path: Option<&Path>, targets: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo(extra_path)?;
    cmd.args(["test", "--no-run", "--message-format=json"]).args(targets);
    let out = cmd.stderr(Stdio::inherit()).output().context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --no-run failed with {}", out.status);
    }
    let mut bins = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(exe), Some(kinds), Some(name)) = (
            msg["executable"].as_str(),
            msg["target"]["kind"].as_array(),
            msg["target"]["name"].as_str(),
        ) else {
            continue;
        };
        if kinds.iter().any(|k| k == "test") {
            bins.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    Ok(bins)
}

/// The number just before `label` in a `test result:` line (`ok. 6 passed; 0 failed; …`).
pub fn count_before(line: &str, label: &str) -> u64 {
    line.split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok. ")
                .trim_start_matches("FAILED. ")
                .strip_suffix(label.trim_start())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::{count_before, Totals};

    /// A whole libtest transcript read line by line, as the runner reads a test binary's output.
    fn read_all(out: &str) -> Totals {
        let mut t = Totals::default();
        out.lines().for_each(|l| t.read(l));
        t
    }

    #[test]
    fn a_failed_test_whose_result_line_was_cut_is_named_from_the_summary() {
        // One test at a time (as in the VM): the name is printed before the test runs, and the
        // test's child wrote to the same console before FAILED.
        let out = "\
running 1 test
test captured ... monitor: started
FAILED

failures:

---- captured stdout ----
thread 'captured' panicked at tests/tests/decisions.rs:40:5:
no decision
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace


failures:
    captured

test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out
";
        let t = read_all(out);
        assert_eq!(t.failed, 1);
        assert_eq!(
            t.failure_lines(""),
            [
                "FAILED captured",
                "    thread 'captured' panicked at tests/tests/decisions.rs:40:5:",
                "    no decision",
            ]
        );
    }

    #[test]
    fn a_failed_test_is_named_with_its_panic_message() {
        let out = "\
running 2 tests
test fine ... ok
test holds_them_all ... FAILED

failures:

---- holds_them_all stdout ----
idle connections: 10000
thread 'holds_them_all' panicked at tests/tests/idle_connections.rs:120:9:
the app holds 9974 of 10000 connections
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace


failures:
    holds_them_all

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out
";
        let t = read_all(out);
        assert_eq!((t.passed, t.failed), (1, 1));
        assert_eq!(
            t.failure_lines(""),
            [
                "FAILED holds_them_all",
                "    thread 'holds_them_all' panicked at tests/tests/idle_connections.rs:120:9:",
                "    the app holds 9974 of 10000 connections",
            ]
        );
    }

    #[test]
    fn harness_totals_are_read_from_ok_and_failed_lines() {
        let ok = "ok. 6 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.81s";
        let bad = "FAILED. 4 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out";
        assert_eq!((count_before(ok, " passed"), count_before(ok, " failed")), (6, 0));
        assert_eq!((count_before(bad, " passed"), count_before(bad, " failed")), (4, 2));
    }
}
