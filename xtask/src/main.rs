//! `cargo xtask`: the one entry point for building, testing and demonstrating meshpath. It
//! installs what a fresh machine lacks before it needs it (see bootstrap.rs).

mod bootstrap;
mod cargo;
mod cluster;
mod demo;
mod demo_cluster;
mod fuzz;
mod images;
mod kube_api;
mod kubernetes;
mod previous;
mod vm;

use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, test and run meshpath")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Start it (taking down one already there), with meshpath's image built from the release
    /// build (`--debug`: the test build).
    Up {
        #[arg(long)]
        debug: bool,
        /// How many nodes: 1, or 2 (the second its own kind-like container on this machine,
        /// xtask/src/cluster/node2.rs).
        #[arg(long, default_value_t = cluster::NODES_IN_TESTS)]
        nodes: usize,
    },
    /// Stop it and undo what it changed on the host.
    Down,
    /// Rebuild meshpath's image and import it into the running cluster (`--debug`: from the
    /// test build); restart the DaemonSets' pods to run it.
    Image {
        #[arg(long)]
        debug: bool,
    },
    /// kubectl as the cluster's administrator, inside the node's network namespace.
    Kubectl {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what this machine lacks (nightly rust-src, bpf-linker, Debian packages, bpffs).
    Setup,
    /// Build the eBPF object and every userspace binary.
    Build {
        /// Build as shipped: the `dist` profile (release with fat LTO), into target/dist.
        #[arg(long)]
        release: bool,
        /// Also build the previous release (its git tag), which the upgrade tests start from,
        /// and print where its binaries are (`MESHPATH_PREVIOUS_BIN_DIR` for `cargo test`).
        #[arg(long)]
        previous: bool,
    },
    /// Run every check and test: rustfmt, clippy, unit and end-to-end tests (as root) on this
    /// machine's kernel, each fuzz target for seconds, then the DaemonSets on a two-node
    /// cluster and, beside them, the capture tests on Debian's 6.1 kernel (the floor) under QEMU.
    Test {
        /// Only run tests whose name contains this (on this machine's kernel).
        filter: Option<String>,
        /// Only this kernel: `host` (this machine's, every test) or a Debian series booted
        /// under QEMU (the capture tests).
        #[arg(long, value_parser = ["host", "6.1", "6.12"], conflicts_with = "kernels")]
        kernel: Option<String>,
        /// `all`: this machine's kernel, then every series in the matrix (6.1, 6.12).
        #[arg(long, value_parser = ["all"])]
        kernels: Option<String>,
        /// Only the cluster suite: meshpath's DaemonSets on a real two-node cluster
        /// (brought up for the run and taken down after; `cargo xtask test` runs it beside the VM).
        #[arg(long, conflicts_with_all = ["kernel", "kernels"])]
        cluster: bool,
    },
    /// Run two local nodes (agent and proxy each), pods made through the real CNI chain, real
    /// traffic across nodes over HBONE.
    Demo {
        /// Leave it running for exploration (until Ctrl-C).
        #[arg(long)]
        keep: bool,
        /// The node proxy: meshpath's, or `ztunnel-like`, a proxy that only opens sockets in
        /// the pods as Istio's ztunnel does (the datapath serves it with no help from it).
        #[arg(long, default_value = "meshpath-proxy", value_parser = ["meshpath-proxy", "ztunnel-like"])]
        proxy: String,
        /// On a real two-node Kubernetes cluster instead (kubelets, containerds, the control
        /// plane; `cargo xtask cluster up`): meshpath installed with kubectl as DaemonSets, pods
        /// made with Deployments on both nodes, traffic between the nodes over HBONE. The first
        /// run builds Kubernetes from Debian's source (about 6 minutes once).
        #[arg(long, conflicts_with_all = ["kube", "proxy"])]
        cluster: bool,
        /// Run a Kubernetes API server too: pods are made with the API, and the agents learn
        /// from it which are meshed (the `default` namespace is labelled for ambient).
        #[arg(long)]
        kube: bool,
    },
    /// Run the fuzz targets (fuzz/: cargo-fuzz, the nightly, AddressSanitizer) for a while each;
    /// `cargo xtask test` runs each for seconds.
    Fuzz {
        /// Only this target (dns_message, zds_session, identity, authorization,
        /// workloads_file, cni_input).
        target: Option<String>,
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        secs: u64,
    },
    /// A real Kubernetes cluster of two nodes (or one) on this machine (kubelets, containerds,
    /// the control plane; built from Debian's packages), with meshpath's image built from this workspace
    /// and imported: `kubectl apply -k tests/cluster` installs meshpath on it.
    Cluster {
        #[command(subcommand)]
        action: ClusterCmd,
    },
    /// Make a CA for the proxies (DIR/ca.pem, DIR/ca-key.pem), as the demo and tests do.
    Ca { dir: std::path::PathBuf },
    /// Run a benchmark (not a test; prints a table, writes results/NAME.json and its chart,
    /// results/NAME.svg).
    Bench {
        /// Which: `capture` (meshpath capture vs istio-cni's iptables rules vs direct),
        /// `proxy` (direct vs two meshpath-proxy processes over HBONE), `control-plane` (istiod's
        /// state over xDS: apply time, memory, a delta, the first certificate), or `charts` (redraw
        /// results/*.svg from results/*.json, measuring nothing).
        #[arg(value_parser = ["capture", "proxy", "control-plane", "charts"])]
        which: String,
        /// Passed to `meshpath-bench capture` (e.g. --secs 3 --pods 100 --rounds 1).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    use bootstrap::Needs;
    match cli.command {
        Cmd::Setup => {
            ensure(Needs { ebpf_toolchain: true, runtime: true, vm: true, kubernetes: true })?;
            println!("setup: everything meshpath needs is installed");
        }
        Cmd::Build { release, previous } => {
            let path = ensure(Needs { ebpf_toolchain: true, ..Needs::NOTHING })?;
            cargo::build(path.as_deref(), release)?;
            if previous {
                let dir = previous::build(path.as_deref())?;
                println!("{}={}", previous::BIN_DIR_VAR, dir.display());
            }
        }
        Cmd::Test { filter, kernel, kernels, cluster } => {
            if !bootstrap::is_root() {
                bail!(
                    "the tests load eBPF programs and create network namespaces: run them as root"
                );
            }
            let (host, series): (bool, Vec<&str>) = match (kernel.as_deref(), kernels.is_some()) {
                _ if cluster => (false, vec![]),
                (_, true) => (true, vm::SERIES.to_vec()),
                (Some("host"), _) => (true, vec![]),
                (Some(one), _) => (false, vec![one]),
                (None, _) => (true, vec![vm::FLOOR]),
            };
            // The cluster suite runs in a full run (no filter, this machine's kernel included)
            // or alone.
            let with_cluster = cluster || (host && filter.is_none() && kernel.is_none());
            let path = ensure(Needs {
                ebpf_toolchain: true,
                runtime: true,
                vm: !series.is_empty(),
                kubernetes: host || cluster,
            })?;
            test(path.as_deref(), filter.as_deref(), host, &series, with_cluster)?;
        }
        Cmd::Bench { which, args } => {
            if !bootstrap::is_root() {
                bail!("the benchmarks load eBPF programs and create network namespaces: run them as root");
            }
            let path = ensure(Needs { ebpf_toolchain: true, runtime: true, ..Needs::NOTHING })?;
            let bin_dir = cargo::build(path.as_deref(), true)?;
            let mut cmd = std::process::Command::new(bin_dir.join("meshpath-bench"));
            cmd.arg(&which);
            if which == "charts" {
                let results = cargo::workspace_root().join("results");
                cmd.arg(results.join("capture.json")).arg(results.join("proxy.json"));
            } else if !args.iter().any(|a| a == "--out" || a.starts_with("--out=")) {
                let out = cargo::workspace_root().join("results").join(format!("{which}.json"));
                cmd.arg("--out").arg(out);
            }
            bootstrap::run(cmd.args(args))?;
        }
        Cmd::Fuzz { target, secs } => {
            ensure(Needs::NOTHING)?;
            let which: Vec<&str> = target.as_deref().into_iter().collect();
            fuzz::run(&which, secs)?;
        }
        Cmd::Ca { dir } => {
            let path = ensure(Needs { ebpf_toolchain: true, ..Needs::NOTHING })?;
            let bin_dir = cargo::build(path.as_deref(), false)?;
            bootstrap::run(
                std::process::Command::new(bin_dir.join("meshpath-proxy")).arg("new-ca").arg(&dir),
            )?;
        }
        Cmd::Cluster { action } => {
            if !bootstrap::is_root() {
                bail!("the cluster runs kubelet, containerd and eBPF programs: run it as root");
            }
            match action {
                ClusterCmd::Up { debug, nodes } => {
                    let path = ensure(Needs {
                        ebpf_toolchain: true,
                        runtime: true,
                        kubernetes: true,
                        ..Needs::NOTHING
                    })?;
                    let bin_dir = cargo::build(path.as_deref(), !debug)?;
                    let previous = previous::build(path.as_deref())?;
                    cluster::up(&cargo::workspace_root(), &bin_dir, Some(&previous), nodes)?;
                }
                ClusterCmd::Down => cluster::down()?,
                ClusterCmd::Image { debug } => {
                    let path = ensure(Needs { ebpf_toolchain: true, ..Needs::NOTHING })?;
                    let bin_dir = cargo::build(path.as_deref(), !debug)?;
                    cluster::reload_image(&cargo::workspace_root(), &bin_dir)?;
                }
                ClusterCmd::Kubectl { args } => {
                    let status = cluster::kubectl().args(&args).status()?;
                    if !status.success() {
                        bail!("kubectl failed with {status}");
                    }
                }
            }
        }
        Cmd::Demo { keep, proxy, kube, cluster: on_cluster } => {
            if !bootstrap::is_root() {
                bail!(
                    "the demo loads eBPF programs and creates network namespaces: run it as root"
                );
            }
            let path = ensure(Needs {
                ebpf_toolchain: true,
                runtime: true,
                kubernetes: kube || on_cluster,
                ..Needs::NOTHING
            })?;
            if on_cluster {
                // The image carries the release binaries; the demo's pods run the tests' app.
                let bin_dir = cargo::build_release_bins(
                    path.as_deref(),
                    &[
                        ("meshpath-loader", "meshpath-loader"),
                        ("meshpath-proxy", "meshpath-proxy"),
                        ("meshpath-cni", "meshpath-cni"),
                        ("meshpath-tests", "cluster-app"),
                    ],
                )?;
                return demo_cluster::run(&cargo::workspace_root(), &bin_dir, keep);
            }
            let proxy = if proxy == "ztunnel-like" {
                demo::Proxy::ZtunnelLike
            } else {
                demo::Proxy::Meshpath
            };
            // What the demo runs, built as users run it (release), and nothing else.
            let mut bins = vec![
                ("meshpath-loader", "meshpath-loader"),
                ("meshpath-proxy", "meshpath-proxy"),
                ("meshpath-cni", "meshpath-cni"),
            ];
            if proxy == demo::Proxy::ZtunnelLike {
                bins.push(("meshpath-tests", "ztunnel-like"));
            } else {
                bins.push(("meshpath-waypoint-standin", "waypoint-standin"));
            }
            let bin_dir = cargo::build_release_bins(path.as_deref(), &bins)?;
            demo::run(&bin_dir, keep, proxy, kube)?;
        }
    }
    Ok(())
}

/// Brings the machine to what `needs` asks for (bootstrap.rs), then builds Kubernetes if
/// asked (kubernetes.rs). Returns the directory to put first on PATH for bpf-linker.
fn ensure(needs: bootstrap::Needs) -> Result<Option<std::path::PathBuf>> {
    let path = bootstrap::ensure(needs)?;
    if needs.kubernetes {
        kubernetes::ensure()?;
    }
    Ok(path)
}

/// A file that exists while this value lives (removed on drop, whatever happened).
struct Marker(std::path::PathBuf);

impl Marker {
    fn create(path: &std::path::Path) -> Result<Self> {
        std::fs::write(path, b"")?;
        Ok(Self(path.to_path_buf()))
    }
}

impl Drop for Marker {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What the suites of a run counted, added up.
#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
    /// What failed where, printed last: a CI log may keep only the run's tail.
    failures: Vec<String>,
    /// The stages that failed.
    bad: Vec<String>,
}

impl Tally {
    fn add(&mut self, stage: &str, t: &cargo::Totals) {
        self.passed += t.passed;
        self.failed += t.failed;
        self.failures.extend(t.failure_lines(&format!("{stage}: ")));
        if t.failed > 0 {
            self.bad.push(stage.to_owned());
        }
    }
}

/// The time since `since`, as "Xm Ys".
fn since(since: std::time::Instant) -> String {
    let secs = since.elapsed().as_secs();
    format!("{}m {:02}s", secs / 60, secs % 60)
}

/// rustfmt's check and the build, then the suites side by side: the cluster's (it comes up
/// during the build; its suite starts as soon as it is Ready), the capture tests in a VM per
/// kernel series (once every test executable is built), clippy, this machine's kernel's tests
/// (`host`), and the fuzz targets' build and runs. Ends with one line per stage and one
/// overall.
///
/// Side by side because CI's budget is 20 minutes on two cores and the cluster's suite alone
/// takes most of it: it mostly waits (on the kubelet, on paced transfers), the VMs' TCG and the
/// host's tests mostly compute. None sees another's namespaces, cgroups or pins: the cluster
/// has its own network namespace, cgroups and pin root, the guest its own kernel. The one
/// thing shared, the first node's bpffs (this machine's), is unmounted by the cluster's reboot
/// test, which waits for this machine's tests to end (the marker below).
fn test(
    path: Option<&std::path::Path>,
    filter: Option<&str>,
    host: bool,
    series: &[&str],
    with_cluster: bool,
) -> Result<()> {
    let started = std::time::Instant::now();
    if host {
        cargo::fmt_check(path)?;
    }
    // The end-to-end tests run the loader binary: build every binary first, and the previous
    // release's, which the upgrade tests start from (their children find it by this variable,
    // the VMs' guest script too).
    let bin_dir = cargo::build(path, false)?;
    // Without it only the upgrade tests can fail: they say why (the variable below).
    let previous = match previous::build(path) {
        Ok(dir) => {
            std::env::set_var(previous::BIN_DIR_VAR, &dir);
            std::env::set_var(previous::SOURCE_VAR, previous::source_dir());
            Some(dir)
        }
        Err(e) => {
            println!("previous release: {e:#}");
            std::env::set_var(previous::ERROR_VAR, format!("{e:#}"));
            None
        }
    };
    // The cluster comes up (images built from these binaries, the control plane and the
    // nodes' daemons started: mostly waiting) while its suite builds, and its suite starts as
    // soon as it is Ready: the longest stage, it starts first. The cluster is taken down
    // whatever the tests did.
    // Exists while this machine's tests run: the cluster suite's reboot waits for them (the
    // first node shares this machine's bpffs, which a reboot unmounts).
    let host_running = host.then(|| cargo::target_dir().join("host-suite-running"));
    let host_marker = match &host_running {
        Some(path) => Some(Marker::create(path)?),
        None => None,
    };
    let cluster = if with_cluster {
        let (root, bins, previous) = (cargo::workspace_root(), bin_dir.clone(), previous.clone());
        let up = std::thread::spawn(move || {
            cluster::up(&root, &bins, previous.as_deref(), cluster::NODES_IN_TESTS)
        });
        let exe = match cargo::cluster_test_binary(path) {
            Ok(exe) => exe,
            Err(e) => {
                let _ = up.join();
                let _ = cluster::down();
                return Err(e);
            }
        };
        // The filter is the host suite's when both run; the cluster's when only it runs.
        let filter: Option<String> = if host { None } else { filter.map(str::to_owned) };
        let bin_dir = bin_dir.clone();
        Some(std::thread::spawn(move || -> (cargo::Totals, Option<String>, String) {
            let stage = std::time::Instant::now();
            let up = up.join().unwrap_or_else(|_| Err(anyhow::anyhow!("cluster up panicked")));
            let (t, error) = match up {
                Ok(()) => {
                    let t = cargo::test_cluster(
                        &exe,
                        &bin_dir,
                        filter.as_deref(),
                        host_running.as_deref(),
                    );
                    if let Err(e) = cluster::down() {
                        println!("cluster: {e:#}");
                    }
                    match t {
                        Ok(t) => (t, None),
                        Err(e) => (cargo::Totals::one_failed(), Some(e)),
                    }
                }
                Err(e) => (cargo::Totals::one_failed(), Some(e.context("could not start it"))),
            };
            let error = error.map(|e| {
                println!("cluster: {e:#}");
                format!("the cluster: {e:#}")
            });
            (t, error, since(stage))
        }))
    } else {
        None
    };
    // Beside it: every other test executable built before any other suite runs (then no
    // cargo waits on another's lock of the target directory while a suite runs). If that
    // fails, the run has failed: the cluster's suite is stopped and its cluster taken down
    // before this returns.
    let bins = match cargo::test_binaries(path) {
        Ok(bins) => bins,
        Err(e) => {
            cargo::stop_cluster_suite();
            if let Some(cluster) = cluster {
                let _ = cluster.join();
            }
            return Err(e);
        }
    };

    // The kernels' VMs, one after the other: the longest stage after the cluster's, started
    // before clippy.
    let vms = {
        let series: Vec<String> = series.iter().map(|s| (*s).to_owned()).collect();
        let bin_dir = bin_dir.clone();
        std::thread::spawn(move || -> Result<Vec<(vm::Outcome, String)>> {
            series
                .iter()
                .map(|s| {
                    let stage = std::time::Instant::now();
                    Ok((vm::run_matrix_entry(s, &bin_dir, &bins)?, since(stage)))
                })
                .collect()
        })
    };

    let mut lines = Vec::new();
    let mut total = Tally::default();
    // clippy, a stage of its own: a warning fails the run, which goes on to its end.
    if host {
        let stage = std::time::Instant::now();
        match cargo::clippy(path) {
            Ok(()) => lines.push(format!("clippy: no warning ({})", since(stage))),
            Err(e) => {
                println!("clippy: {e:#}");
                lines.push(format!("clippy: failed: {e:#} ({})", since(stage)));
                total.bad.push("clippy".to_owned());
            }
        }
    }
    println!("test: checks and builds done in {}", since(started));
    if host {
        let stage = std::time::Instant::now();
        // Counted as a failure if cargo cannot even start: the other suites are still joined.
        let t = cargo::test(path, &bin_dir, filter).unwrap_or_else(|e| {
            println!("test: {e:#}");
            cargo::Totals::one_failed()
        });
        lines.push(format!(
            "tests on this machine's kernel: {} passed, {} failed ({})",
            t.passed,
            t.failed,
            since(stage)
        ));
        total.add("this machine's kernel", &t);
    }
    drop(host_marker);
    // The fuzz targets once the host's tests are done: their build compiles on both cores.
    if host && filter.is_none() {
        let stage = std::time::Instant::now();
        let secs = fuzz::IN_TESTS_SECS;
        match fuzz::build().and_then(|()| fuzz::run(&[], secs)) {
            Ok(()) => lines.push(format!(
                "fuzz targets: {} run {secs} s each, no crash ({})",
                fuzz::TARGETS.len(),
                since(stage)
            )),
            Err(e) => {
                println!("fuzz: {e:#}");
                lines.push(format!("fuzz targets: failed: {e:#} ({})", since(stage)));
                total.bad.push("the fuzz targets".to_owned());
            }
        }
    }
    if let Some(cluster) = cluster {
        let (t, error, took) =
            cluster.join().map_err(|_| anyhow::anyhow!("the cluster's thread panicked"))?;
        lines.push(format!(
            "tests on the two-node cluster: {} passed, {} failed ({took})",
            t.passed, t.failed
        ));
        total.failures.extend(error);
        total.add("the cluster", &t);
    }
    let outs = match vms.join().map_err(|_| anyhow::anyhow!("the VMs' thread panicked"))? {
        Ok(outs) => outs,
        Err(e) => {
            println!("vm: {e:#}");
            total.failures.push(format!("the VMs: {e:#}"));
            total.bad.push("the VMs".to_owned());
            Vec::new()
        }
    };
    for (out, took) in outs {
        lines.push(format!(
            "tests on Linux {} (QEMU): {} passed, {} failed{} ({took})",
            out.release,
            out.tests.passed,
            out.tests.failed,
            if out.failed_suites.is_empty() {
                String::new()
            } else {
                format!("; failing: {}", out.failed_suites.join(", "))
            },
        ));
        let what = format!("Linux {}", out.release);
        total.add(&what, &out.tests);
        if out.tests.failed == 0 && !out.failed_suites.is_empty() {
            total.bad.push(what);
        }
    }
    for l in &lines {
        println!("{l}");
    }
    for f in &total.failures {
        println!("{f}");
    }
    println!(
        "tests: {} passed, {} failed (in {}, checks and builds included)",
        total.passed,
        total.failed,
        since(started)
    );
    if !total.bad.is_empty() {
        bail!("tests failed on {}", total.bad.join(", "));
    }
    if total.passed == 0 {
        bail!("cargo test ran no test");
    }
    Ok(())
}
