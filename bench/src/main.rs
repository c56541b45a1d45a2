//! `meshpath-bench capture`: the capture benchmark. Runs the peers side by side in one run, on
//! fresh pod namespaces each, with the same minimal forwarding proxy:
//! - `direct`: no capture, no proxy;
//! - `proxy_addressed`: no capture; the client connects to the proxy's own address and the proxy
//!   forwards to a fixed upstream: what a capture that cost nothing would leave, the ceiling of
//!   any capture's ratio to `iptables`;
//! - `iptables`: istio-cni's in-pod rule set (REDIRECT variant), proxy marks its sockets 0x539;
//! - `ebpf`: meshpath capture (the proxy's cgroup bypasses);
//! - `ebpf_sockmap`: meshpath capture with the sockops + sk_msg app↔proxy shortcut on;
//! - `ebpf_no_decision_counters`: meshpath capture with the per-decision counters off (what
//!   counting costs is `ebpf` against this);
//! - `ebpf_monitor`: meshpath capture with `monitor` attached, streaming every decision.
//!
//! Then pod set-up: the datapath's own enrolment against `iptables-restore` (in process), and
//! the whole CNI step as a runtime sees it, meshpath against istio-cni's in-pod path
//! (`cni_setup`), for 1, 100 and 1,000 pods.
//!
//! Writes `results/capture.json` and prints a markdown table. Not a test: no assertion on speed.

mod bpf_cost;
mod charts;
mod cni_setup;
mod control_plane;
mod interleaved;
mod istio_rules;
mod proxy;
mod stats;

use std::{
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};
use meshpath_loader::pods::{self, EnrolOptions};
use meshpath_tests::{sibling_bin, CgroupGuard, NetnsGuard, PinRoot, PodPair, TestProxy};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(name = "meshpath-bench")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Pod to pod directly vs through two meshpath-proxy processes over HBONE.
    Proxy {
        /// Where to write the JSON results.
        #[arg(long, default_value = "results/proxy.json")]
        out: PathBuf,
        /// Seconds per throughput and connection-rate run.
        #[arg(long, default_value_t = 5.0)]
        secs: f64,
        /// Rounds (each metric: the median over rounds).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// A flag given to both proxies (repeat for more; recorded in the results), to compare
        /// settings: `--proxy-arg=--pool-max-streams --proxy-arg=1`.
        #[arg(long = "proxy-arg", allow_hyphen_values = true)]
        proxy_args: Vec<String>,
        /// Other workloads listed in the proxies' store (recorded in the results; at most
        /// 1,048,576): what a connection costs in a large mesh.
        #[arg(long, default_value_t = 0)]
        store_workloads: usize,
        /// Authorization policies in the proxies' store, none applying to the two pods
        /// (recorded in the results; at most 1,048,576): what a connection's policy check costs
        /// in a large mesh.
        #[arg(long, default_value_t = 0)]
        store_policies: usize,
        /// A build of Istio's ztunnel to run beside meshpath-proxy (scenario `ztunnel`: two
        /// ztunnel processes in dedicated mode on the same capture; the table then has
        /// `hbone / ztunnel`). How to build one: ../shared/notes/hbone.md.
        #[arg(long, env = "MESHPATH_ZTUNNEL")]
        ztunnel: Option<PathBuf>,
        /// Only these scenarios (comma-separated; all by default), e.g. to profile one; a
        /// partial run needs `--out` (it never replaces results/proxy.json).
        #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(proxy::SCENARIOS))]
        scenarios: Vec<String>,
        /// Let idle CPUs halt as the kernel chooses, instead of holding them polling for the
        /// run (`IdlePolled`): in a VM, each wake of a halted vCPU then adds the hypervisor's
        /// cost to every round trip.
        #[arg(long)]
        halt_idle: bool,
    },
    /// How fast the proxy takes istiod's state and what holding it costs: 1,000, 10,000 and
    /// 50,000 workloads over xDS (from the istiod stand-in), a delta of one, the first
    /// certificate.
    ControlPlane {
        /// Where to write the JSON results (the chart beside it, .svg).
        #[arg(long, default_value = "results/control-plane.json")]
        out: PathBuf,
    },
    /// Redraws the SVG chart of each results file (`results/NAME.svg`) from its JSON alone.
    Charts {
        /// Results files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Only the CNI step per pod (meshpath-cni ADD/DEL against istio-cni's in-pod path), printed
    /// and not written: `capture` measures and records it with everything else.
    Cni {
        /// Largest pod count (runs 1, 100 and this many, up to it).
        #[arg(long, default_value_t = 1000)]
        pods: usize,
    },
    /// meshpath capture vs istio-cni's iptables rules vs direct.
    Capture {
        /// Where to write the JSON results.
        #[arg(long, default_value = CAPTURE_RESULTS)]
        out: PathBuf,
        /// Seconds per throughput and connection-rate run.
        #[arg(long, default_value_t = 5.0)]
        secs: f64,
        /// Largest pod count for the set-up timing.
        #[arg(long, default_value_t = 1000)]
        pods: usize,
        /// Rounds of the traffic scenarios (each metric: the median over rounds).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Only these traffic scenarios (comma-separated; all by default), e.g. to profile one.
        #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(SCENARIOS))]
        scenarios: Vec<String>,
    },
}

/// Where `capture` writes its results by default.
const CAPTURE_RESULTS: &str = "results/capture.json";

const RR_PORT: u16 = 7000;
const ONESHOT_PORT: u16 = 7001;
const IPERF_PORT: u16 = 5201;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // What is measured is what the tree is now (see `commit`).
    let _ = commit();
    let res = match cli.command {
        Cmd::Capture { out, secs, pods, rounds, scenarios } => {
            capture(&out, secs, pods, rounds, &scenarios)
        }
        Cmd::Proxy {
            out,
            secs,
            rounds,
            proxy_args,
            store_workloads,
            store_policies,
            ztunnel,
            scenarios,
            halt_idle,
        } => {
            let store = proxy::Store { workloads: store_workloads, policies: store_policies };
            let _idle = IdlePolled::hold(!halt_idle);
            proxy::run(&out, secs, rounds, &proxy_args, store, ztunnel.as_deref(), &scenarios)
        }
        Cmd::ControlPlane { out } => control_plane::run(&out),
        Cmd::Cni { pods } => cni_setup::measure(&cni_setup::sizes(pods)).map(|_| ()),
        Cmd::Charts { files } => files.iter().try_for_each(|f| {
            let svg = charts::write_for(f)?;
            eprintln!("bench: wrote {}", svg.display());
            Ok(())
        }),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshpath-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

pub(crate) fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let kernel = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let nproc = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    json!({ "cpu": cpu, "cpus": nproc, "kernel": kernel })
}

/// All CPUs' time since boot, in ticks, from /proc/stat's first line: user, nice, system, idle,
/// iowait, irq, softirq, steal.
pub(crate) fn cpu_ticks() -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|x| x.parse().ok())
        .collect();
    (v.len() == 8).then_some(v)
}

/// The share of CPU time the hypervisor gave to other guests ("steal" in /proc/stat) over a run:
/// a run with much of it measured a disturbed machine, whatever the ratios say.
pub(crate) struct Steal {
    start: Option<(u64, u64)>,
}

impl Steal {
    /// (all CPU time, stolen time), in ticks, since boot.
    fn now() -> Option<(u64, u64)> {
        let v = cpu_ticks()?;
        Some((v.iter().sum(), *v.get(7)?))
    }

    pub(crate) fn start() -> Self {
        Self { start: Self::now() }
    }

    /// Percent of CPU time stolen since `start` (`null` where /proc/stat could not be read).
    pub(crate) fn pct(&self) -> Value {
        let (Some((t0, s0)), Some((t1, s1))) = (self.start, Self::now()) else {
            return Value::Null;
        };
        let all = t1.saturating_sub(t0).max(1) as f64;
        json!((s1.saturating_sub(s0) as f64 * 1000.0 / all).round() / 10.0)
    }
}

/// Idle CPUs kept polling for the run (`/dev/cpu_dma_latency` held at 0 µs, as tuned's
/// latency-performance profile holds it), instead of halting. In a VM, a halted vCPU that work
/// is handed to wakes through the hypervisor: on the 2-core machine these results come from
/// (cpuidle `haltpoll` with `guest_halt_poll_ns=0`) that added about 57 µs to every round
/// trip between two threads, direct ones included (67 µs p50 against 10 with the CPUs
/// polling), and swamped what the paths themselves cost. A polling CPU is still idle in
/// /proc/stat, so the CPU figures are unchanged by it. Released when dropped.
pub(crate) struct IdlePolled(Option<std::fs::File>);

/// Whether an [`IdlePolled`] holds the CPUs polling now.
static IDLE_POLLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl IdlePolled {
    /// Holds the CPUs polling if `on` and the kernel lets it; says on stderr if it cannot.
    pub(crate) fn hold(on: bool) -> Self {
        if !on {
            return Self(None);
        }
        let held = std::fs::OpenOptions::new().write(true).open("/dev/cpu_dma_latency").and_then(
            |mut f| {
                use std::io::Write as _;
                f.write_all(&0i32.to_ne_bytes())?;
                Ok(f)
            },
        );
        match held {
            Ok(f) => {
                IDLE_POLLED.store(true, std::sync::atomic::Ordering::Relaxed);
                Self(Some(f))
            }
            Err(e) => {
                eprintln!(
                    "bench: idle CPUs not held polling (/dev/cpu_dma_latency: {e}): they halt"
                );
                Self(None)
            }
        }
    }
}

impl Drop for IdlePolled {
    fn drop(&mut self) {
        if self.0.take().is_some() {
            IDLE_POLLED.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// For the results: how idle CPUs waited (see [`IdlePolled`]).
pub(crate) fn idle_cpus() -> &'static str {
    if IDLE_POLLED.load(std::sync::atomic::Ordering::Relaxed) {
        "polled (/dev/cpu_dma_latency 0)"
    } else {
        "as the kernel chose (halted)"
    }
}

/// The run's steal share, as a line before its table.
pub(crate) fn print_steal(r: &Value) {
    if let Some(pct) = r["steal_pct"].as_f64() {
        println!("CPU time stolen by the hypervisor over the run: {pct:.1}%\n");
    }
}

/// What a scenario puts in place; dropped at the end of the scenario.
enum Setup {
    Direct,
    Addressed { _proxy: TestProxy, _cgroup: CgroupGuard },
    Iptables { _proxy: TestProxy, _cgroup: CgroupGuard },
    Ebpf { _monitor: Option<Drain>, _proxy: TestProxy, _cgroup: CgroupGuard, _root: PinRoot },
}

/// A monitor reading every decision (and dropping it) until dropped.
struct Drain {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Drain {
    fn start(root: &PinRoot) -> Result<Self> {
        let mut m = meshpath_loader::monitor::Monitor::start(root.path(), Default::default())?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(Some(_)) = m.next(std::time::Duration::from_millis(100)) {
                    n += 1;
                }
            }
            n
        });
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Drain {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            if let Ok(n) = t.join() {
                eprintln!("bench: the monitor read {n} decisions");
            }
        }
    }
}

fn iptables_restore(ns: &str, v6: bool, rules: &str) -> Result<()> {
    let tool = if v6 { "ip6tables-restore" } else { "iptables-restore" };
    let mut child = Command::new("nsenter")
        .arg(format!("--net={ns}"))
        .arg(tool)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {tool}"))?;
    child.stdin.take().context("stdin")?.write_all(rules.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{tool} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// istio-cni's per-pod set-up: both rule sets.
fn istio_setup(ns: &str) -> Result<()> {
    iptables_restore(ns, false, istio_rules::RULES_V4)?;
    iptables_restore(ns, true, &istio_rules::rules_v6())
}

/// The capture scenarios' proxy prints no line per connection: writing and reading them would be
/// measured with the capture.
const QUIET_PROXY: (&str, &str) = ("MESHPATH_TEST_PROXY_QUIET", "1");

fn setup(name: &str, pods: &PodPair) -> Result<Setup> {
    let proxy_bin = sibling_bin("meshpath-test-proxy");
    let a = pods.a.path();
    Ok(match name {
        "direct" => Setup::Direct,
        "proxy_addressed" => {
            let upstreams: Vec<String> = ADDRESSED_PORTS
                .iter()
                .map(|(at, to)| format!("{at}={}", SocketAddr::new(pods.b_ip.into(), *to)))
                .collect();
            let upstreams = upstreams.join(",");
            let cgroup = CgroupGuard::new()?;
            let env = [("MESHPATH_TEST_PROXY_UPSTREAMS", upstreams.as_str()), QUIET_PROXY];
            let proxy = TestProxy::start(&proxy_bin, &a, &cgroup, "forward", false, &env)?;
            Setup::Addressed { _proxy: proxy, _cgroup: cgroup }
        }
        "iptables" => {
            istio_setup(&a.display().to_string())?;
            // istio-cni's reply routing for marked connections.
            pods.a.ip(&[
                "rule",
                "add",
                "fwmark",
                "0x111/0xfff",
                "pref",
                "32764",
                "lookup",
                "100",
            ])?;
            pods.a.ip(&["route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "100"])?;
            let cgroup = CgroupGuard::new()?;
            let proxy = TestProxy::start(
                &proxy_bin,
                &a,
                &cgroup,
                "forward",
                false,
                &[("MESHPATH_TEST_PROXY_MARK", "0x539"), QUIET_PROXY],
            )?;
            Setup::Iptables { _proxy: proxy, _cgroup: cgroup }
        }
        "ebpf" | "ebpf_sockmap" | "ebpf_no_decision_counters" | "ebpf_monitor" => {
            let root = PinRoot::new();
            let cgroup = CgroupGuard::new()?;
            {
                let dp = root.datapath()?;
                dp.register_proxy_cgroup(cgroup.path())?;
                // Enrolled from pod b's netns, which holds the other end of a's link as a node's
                // netns holds its pods': the node-side guard (`tc_node_guard`) goes on b's eth0
                // ingress and runs for every packet a sends, as on a node's end of a pod's veth.
                let a = pods.a.open()?;
                pods.b.open()?.run(|| pods::enrol(&dp, &a, &capture_opts(false)))??;
                dp.set_acceleration(name == "ebpf_sockmap")?;
                meshpath_loader::decisions::set_counting(&dp, name != "ebpf_no_decision_counters")?;
            }
            let monitor = if name == "ebpf_monitor" { Some(Drain::start(&root)?) } else { None };
            let proxy = TestProxy::start(&proxy_bin, &a, &cgroup, "forward", true, &[QUIET_PROXY])?;
            Setup::Ebpf { _monitor: monitor, _proxy: proxy, _cgroup: cgroup, _root: root }
        }
        other => bail!("unknown scenario {other}"),
    })
}

/// The same capture istio-cni sets up: outbound, inbound, DNS.
fn capture_opts(counters: bool) -> EnrolOptions {
    EnrolOptions {
        capture_outbound: true,
        capture_inbound: true,
        capture_dns: true,
        counters,
        ..EnrolOptions::default()
    }
}

fn traffic(name: &str, secs: f64) -> Result<Value> {
    let pods = PodPair::new()?;
    let (a, b) = (pods.a.open()?, pods.b.open()?);
    let rr_addr = SocketAddr::new(pods.b_ip.into(), RR_PORT);
    stats::start_rr_server(&b, rr_addr)?;
    let oneshot_addr = SocketAddr::new(pods.b_ip.into(), ONESHOT_PORT);
    stats::start_oneshot_server(&b, oneshot_addr)?;
    let _iperf_server = pods.b.iperf3_server(pods.b_ip.into(), IPERF_PORT, false)?;
    let _setup = setup(name, &pods)?;
    // The client asks for the servers' addresses; only `proxy_addressed`'s asks for the proxy's.
    let (rr_addr, oneshot_addr, iperf) = if name == "proxy_addressed" {
        let at = |port| SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, addressed(port)));
        (at(RR_PORT), at(ONESHOT_PORT), at(IPERF_PORT))
    } else {
        (rr_addr, oneshot_addr, SocketAddr::new(pods.b_ip.into(), IPERF_PORT))
    };

    // A metric that fails is recorded as failed, not the end of the whole run.
    let mut out = serde_json::Map::new();
    stats::record(&mut out, name, "throughput_gbps", iperf3_gbps(&pods, iperf, secs));
    stats::record_rate_and_latency(&mut out, name, &a, oneshot_addr, rr_addr, secs, &[]);
    // Where the time of a connection goes in the datapath's programs (meshpath's path only).
    if name == "ebpf" {
        match bpf_cost::per_connection(&a, oneshot_addr, secs) {
            Ok(Value::Object(cost)) => out.extend(cost),
            Ok(_) => unreachable!("per_connection returns an object"),
            Err(e) => {
                let us = Err(anyhow::anyhow!("{e:#}"));
                stats::record(&mut out, name, "bpf_us_per_conn", us);
                stats::record(&mut out, name, "bpf_share_of_conn", Err(e));
            }
        }
    }
    let f = |k: &str| out[k].as_f64().map_or("failed".to_owned(), |x| format!("{x:.1}"));
    eprintln!(
        "bench: {name}: {} Gbit/s, {} conn/s, rr p50 {} us p99 {} us; 100 clients: {} conn/s, rr p50 {} us p99 {} us",
        f("throughput_gbps"),
        f("conn_per_s"),
        f("rr_p50_us"),
        f("rr_p99_us"),
        f("conn_per_s_100"),
        f("rr_p50_us_100"),
        f("rr_p99_us_100")
    );
    Ok(Value::Object(out))
}

/// iperf3 single-stream throughput from pod a to `to` (pod b's server, or the proxy in front of
/// it), Gbit/s (receiver side).
fn iperf3_gbps(pods: &PodPair, to: SocketAddr, secs: f64) -> Result<f64> {
    let report = pods.a.iperf3_client(to.ip(), to.port(), &["-t", &format!("{secs}")])?;
    Ok(report["end"]["sum_received"]["bits_per_second"].as_f64().context("iperf3 result")? / 1e9)
}

/// Per-pod capture set-up cost for 1, 100 and `max` pods: istio-cni's iptables-restore (v4 and
/// v6, one process each, as istio-cni runs them) vs meshpath enrolment (in the agent's process).
fn setup_cost(max: usize) -> Result<(Value, Value, Value)> {
    let mut sizes: Vec<usize> = [1, 100, max].into_iter().filter(|&n| n <= max).collect();
    sizes.dedup();
    let (mut ipt, mut ebpf, mut ebpf_counters) = (json!({}), json!({}), json!({}));
    for &n in &sizes {
        // Fresh namespaces for each size, as pods are when they are set up.
        eprintln!("bench: creating {n} pod namespaces");
        let namespaces: Vec<NetnsGuard> =
            (0..n).map(|_| NetnsGuard::new("mpbn")).collect::<Result<_>>()?;
        // Each with an eth0, as a pod has when it is enrolled (the datapath attaches its egress
        // guard there): one end of a veth pair whose other end stays in the same netns (this
        // machine's kernel has no dummy links); not timed.
        for ns in &namespaces {
            ns.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
        }
        let start = Instant::now();
        for ns in &namespaces {
            istio_setup(&ns.path().display().to_string())?;
        }
        let ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        ipt[n.to_string()] = json!(ms);

        let root = PinRoot::new();
        let dp = root.datapath()?;
        let opened: Vec<_> = namespaces.iter().map(|ns| ns.open()).collect::<Result<_>>()?;
        let mut cookies = Vec::with_capacity(n);
        let mut per_pod = Vec::with_capacity(n);
        let start = Instant::now();
        for ns in &opened {
            let t = Instant::now();
            cookies.push(pods::enrol(&dp, ns, &capture_opts(false))?);
            per_pod.push(t.elapsed());
        }
        let enrol_ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        let median_ms = stats::percentile_us(&mut per_pod, 0.5) / 1e3;
        let start = Instant::now();
        for &c in &cookies {
            pods::unenrol(&dp, c)?;
        }
        let unenrol_ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
        ebpf[n.to_string()] =
            json!({ "enrol": enrol_ms, "enrol_median": median_ms, "unenrol": unenrol_ms });
        eprintln!("bench: {n} pods: iptables-restore {ms:.2} ms/pod, enrol {enrol_ms:.2} ms/pod (median {median_ms:.2}), unenrol {unenrol_ms:.2} ms/pod");
    }
    // With the TC counters (TCX attachment: an RCU grace period per link), on pods with an eth0.
    for &n in sizes.iter().filter(|&&n| n <= 100) {
        let pairs: Vec<PodPair> = (0..n).map(|_| PodPair::new()).collect::<Result<_>>()?;
        let root = PinRoot::new();
        let dp = root.datapath()?;
        let opened: Vec<_> = pairs.iter().map(|p| p.a.open()).collect::<Result<_>>()?;
        let start = Instant::now();
        for (i, ns) in opened.iter().enumerate() {
            // Every pair's pod a has 10.199.0.1: give each its own address for the datapath.
            let ip = std::net::Ipv4Addr::new(10, 250, (i / 250) as u8, (i % 250) as u8 + 1);
            let opts = EnrolOptions { pod_ips: vec![ip.into()], ..capture_opts(true) };
            pods::enrol(&dp, ns, &opts)?;
        }
        ebpf_counters[n.to_string()] = json!(start.elapsed().as_secs_f64() * 1e3 / n as f64);
    }
    Ok((ipt, ebpf, ebpf_counters))
}

fn capture(
    out: &PathBuf,
    secs: f64,
    max_pods: usize,
    rounds: usize,
    only: &[String],
) -> Result<()> {
    meshpath_tests::require_root();
    if (max_pods == 0 || !only.is_empty()) && out.ends_with(CAPTURE_RESULTS) {
        bail!("a partial run (--pods 0 or --scenarios) does not replace {CAPTURE_RESULTS}: give --out");
    }
    // Rounds interleave the scenarios, so machine noise spreads over all of them; each metric
    // is the median over rounds.
    let names: Vec<&str> =
        SCENARIOS.into_iter().filter(|s| only.is_empty() || only.iter().any(|o| o == s)).collect();
    let steal = Steal::start();
    let mut runs: Vec<Vec<Value>> = vec![Vec::new(); names.len()];
    for round in 0..rounds {
        eprintln!("bench: round {}/{rounds}", round + 1);
        for (i, name) in names.iter().enumerate() {
            runs[i].push(traffic(name, secs)?);
        }
    }
    let mut scenarios = json!({});
    for (i, name) in names.iter().enumerate() {
        let mut m = serde_json::Map::new();
        let mut failed = serde_json::Map::new();
        for key in TRAFFIC_KEYS {
            // Not measured in this scenario (as opposed to failed in a round).
            if runs[i].iter().all(|r| r.get(key).is_none()) {
                continue;
            }
            let mut v: Vec<f64> = runs[i].iter().filter_map(|r| r[key].as_f64()).collect();
            // A round that failed is reported, not silently left out of the median.
            let lost = runs[i].len() - v.len();
            if lost > 0 {
                failed.insert(key.into(), json!(lost));
            }
            v.sort_by(f64::total_cmp);
            m.insert(key.into(), json!(v.get(v.len() / 2)));
        }
        if let Some(by_program) = median_by_program(&runs[i]) {
            m.insert("bpf_per_conn_by_program".into(), by_program);
        }
        m.insert("failed_rounds".into(), Value::Object(failed));
        m.insert("rounds".into(), Value::Array(runs[i].clone()));
        scenarios[*name] = Value::Object(m);
    }
    if max_pods == 0 {
        // Traffic only (`--pods 0`).
        let result = json!({ "machine": machine(), "commit": commit(), "date": date(), "steal_pct": steal.pct(), "scenarios": scenarios });
        std::fs::write(out, serde_json::to_string_pretty(&result)? + "\n")?;
        print_table(&result);
        return Ok(());
    }
    let (ipt, ebpf, ebpf_counters) = setup_cost(max_pods)?;
    scenarios["iptables"]["enrol_ms_per_pod"] = ipt;
    scenarios["ebpf"]["enrol_ms_per_pod"] = json!(ebpf.as_object().map(|o| o
        .iter()
        .map(|(k, v)| (k.clone(), v["enrol"].clone()))
        .collect::<serde_json::Map<_, _>>()));
    scenarios["ebpf"]["enrol_median_ms"] = json!(ebpf.as_object().map(|o| o
        .iter()
        .map(|(k, v)| (k.clone(), v["enrol_median"].clone()))
        .collect::<serde_json::Map<_, _>>()));
    scenarios["ebpf"]["unenrol_ms_per_pod"] = json!(ebpf.as_object().map(|o| o
        .iter()
        .map(|(k, v)| (k.clone(), v["unenrol"].clone()))
        .collect::<serde_json::Map<_, _>>()));
    scenarios["ebpf"]["enrol_with_tc_counters_ms_per_pod"] = ebpf_counters;
    let ((add, del), (ipt_add, ipt_del)) = cni_setup::measure(&cni_setup::sizes(max_pods))?;
    scenarios["ebpf"]["cni_add_ms_per_pod"] = add;
    scenarios["ebpf"]["cni_del_ms_per_pod"] = del;
    scenarios["iptables"]["cni_add_ms_per_pod"] = ipt_add;
    scenarios["iptables"]["cni_del_ms_per_pod"] = ipt_del;
    let result = json!({
        "machine": machine(), "commit": commit(), "date": date(), "steal_pct": steal.pct(),
        "scenarios": scenarios,
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&result)? + "\n")?;
    print_table(&result);
    eprintln!("bench: wrote {} and {}", out.display(), charts::write_for(out)?.display());
    Ok(())
}

/// The median over rounds of `a`'s metric `k` over `b`'s in the same round (rounds where either
/// failed left out), if any round has both.
fn paired_ratio(a: &Value, b: &Value, k: &str) -> Option<f64> {
    let (a, b) = (a["rounds"].as_array()?, b["rounds"].as_array()?);
    let mut v: Vec<f64> =
        a.iter().zip(b).filter_map(|(x, y)| Some(x[k].as_f64()? / y[k].as_f64()?)).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The median over rounds of each program's time and runs per connection
/// (`bpf_per_conn_by_program`), if any round measured them.
fn median_by_program(rounds: &[Value]) -> Option<Value> {
    let measured: Vec<&serde_json::Map<String, Value>> =
        rounds.iter().filter_map(|r| r["bpf_per_conn_by_program"].as_object()).collect();
    let names: std::collections::BTreeSet<&String> =
        measured.iter().flat_map(|m| m.keys()).collect();
    if names.is_empty() {
        return None;
    }
    let median = |name: &str, k: &str| {
        let mut v: Vec<f64> = measured.iter().filter_map(|m| m.get(name)?[k].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        json!(v.get(v.len() / 2))
    };
    Some(Value::Object(
        names
            .into_iter()
            .map(|n| (n.clone(), json!({ "us": median(n, "us"), "runs": median(n, "runs") })))
            .collect(),
    ))
}

/// What `traffic` measures per scenario and round (the `bpf_` ones in meshpath's scenario only).
const TRAFFIC_KEYS: [&str; 9] = [
    "throughput_gbps",
    "conn_per_s",
    "rr_p50_us",
    "rr_p99_us",
    "conn_per_s_100",
    "rr_p50_us_100",
    "rr_p99_us_100",
    "bpf_us_per_conn",
    "bpf_share_of_conn",
];

/// The scenarios of `capture`, in the order they run each round.
const SCENARIOS: [&str; 7] = [
    "direct",
    "proxy_addressed",
    "iptables",
    "ebpf",
    "ebpf_sockmap",
    "ebpf_no_decision_counters",
    "ebpf_monitor",
];

/// Where `proxy_addressed`'s proxy listens (on the client pod's 127.0.0.1) for each of the
/// servers, which it forwards to: the request/response server, the connection-rate server,
/// iperf3.
const ADDRESSED_PORTS: [(u16, u16); 3] =
    [(16000, RR_PORT), (16001, ONESHOT_PORT), (16201, IPERF_PORT)];

/// The port `proxy_addressed`'s proxy listens on for the server at `port`.
fn addressed(port: u16) -> u16 {
    ADDRESSED_PORTS.iter().find(|(_, to)| *to == port).map_or(port, |(at, _)| *at)
}

/// The commit measured (`+dirty` when the tree had changes), so results stay comparable. Read
/// once, when the run starts (`main`): by then xtask has built every binary the run uses, so an
/// edit made while it measures is not in what it measures.
pub(crate) fn commit() -> String {
    static MEASURED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MEASURED.get_or_init(|| commit_of(Path::new("."))).clone()
}

/// The commit of the checkout at `dir`, `+dirty` when a tracked file outside `results/` has
/// changed: the benches' own output (one bench's results waiting to be committed while the
/// next runs) changes nothing measured.
fn commit_of(dir: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(dir)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let head = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let status =
        ["status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)results"];
    let dirty = git(&status).is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{head}+dirty")
    } else {
        head
    }
}

/// Today, UTC (`date -u +%F`).
pub(crate) fn date() -> String {
    Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// One traffic metric of a scenario for the printed table: its median, and how many rounds
/// failed to measure it (`failed_rounds`), so a median over fewer rounds says so.
pub(crate) fn traffic_cell(scenario: &Value, key: &str, decimals: usize) -> String {
    let rounds = scenario["rounds"].as_array().map_or(0, Vec::len);
    let failed = scenario["failed_rounds"][key].as_u64().unwrap_or(0);
    match (scenario[key].as_f64(), failed) {
        (Some(v), 0) => format!("{v:.decimals$}"),
        (Some(v), n) => format!("{v:.decimals$} ({n} of {rounds} rounds failed)"),
        (None, 0) => "n/a".to_owned(),
        (None, n) => format!("failed ({n} of {rounds} rounds)"),
    }
}

fn print_table(r: &Value) {
    print_steal(r);
    let s = &r["scenarios"];
    let f = |v: &Value| v.as_f64().map_or("n/a".to_owned(), |x| format!("{x:.2}"));
    println!("| scenario | throughput Gbit/s | conn/s | RR p50 µs | RR p99 µs | 100 clients: conn/s | RR p50 µs | RR p99 µs | set-up ms/pod (1 / 100 / N) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for name in SCENARIOS {
        let x = &s[name];
        let e = &x["enrol_ms_per_pod"];
        let setup = e
            .as_object()
            .map_or("n/a".to_owned(), |o| o.values().map(f).collect::<Vec<_>>().join(" / "));
        let cell = |k: &str, decimals: usize| traffic_cell(x, k, decimals);
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {setup} |",
            cell("throughput_gbps", 2),
            cell("conn_per_s", 0),
            cell("rr_p50_us", 2),
            cell("rr_p99_us", 2),
            cell("conn_per_s_100", 0),
            cell("rr_p50_us_100", 2),
            cell("rr_p99_us_100", 2)
        );
    }
    // The ratio of the medians, then the median of the rounds' own ratios (the scenarios of a
    // round run back to back, so a round's ratio is free of drift between rounds).
    let ratio = |over: &str, under: &str, k: &str| {
        let (o, u) = (s[over][k].as_f64(), s[under][k].as_f64());
        let medians = o.zip(u).map_or("n/a".to_owned(), |(o, u)| format!("{:.2}", o / u));
        match paired_ratio(&s[over], &s[under], k) {
            Some(p) => format!("{medians} (by round {p:.2})"),
            None => medians,
        }
    };
    println!();
    // meshpath against istio-cni; what a capture that cost nothing would get against
    // istio-cni (the ceiling of the first); meshpath against that.
    for (over, under) in
        [("ebpf", "iptables"), ("proxy_addressed", "iptables"), ("ebpf", "proxy_addressed")]
    {
        let ratio = |k: &str| ratio(over, under, k);
        println!(
            "{over} / {under}: conn/s {}, throughput {}, p50 {}, p99 {}; 100 clients: conn/s {}, p50 {}, p99 {}",
            ratio("conn_per_s"),
            ratio("throughput_gbps"),
            ratio("rr_p50_us"),
            ratio("rr_p99_us"),
            ratio("conn_per_s_100"),
            ratio("rr_p50_us_100"),
            ratio("rr_p99_us_100")
        );
    }
    if let (Some(e), Some(i)) =
        (s["ebpf"]["enrol_ms_per_pod"].as_object(), s["iptables"]["enrol_ms_per_pod"].as_object())
    {
        let parts: Vec<String> = e
            .iter()
            .filter_map(|(n, v)| Some(format!("{n} pods {:.3}", v.as_f64()? / i.get(n)?.as_f64()?)))
            .collect();
        println!("ebpf / iptables set-up per pod: {}", parts.join(", "));
    }
    for (k, what) in [("cni_add_ms_per_pod", "CNI ADD"), ("cni_del_ms_per_pod", "CNI DEL")] {
        if let (Some(e), Some(i)) = (s["ebpf"][k].as_object(), s["iptables"][k].as_object()) {
            let parts: Vec<String> = e
                .iter()
                .filter_map(|(n, v)| {
                    let (e, i) = (v.as_f64()?, i.get(n)?.as_f64()?);
                    Some(format!("{n} pods {e:.2} / {i:.2} ms = {:.2}", e / i))
                })
                .collect();
            println!("{what} per pod, meshpath / istio-cni: {}", parts.join(", "));
        }
    }
    let cost = |with: &str, without: &str, k: &str| {
        s[with][k]
            .as_f64()
            .zip(s[without][k].as_f64())
            .map_or("n/a".to_owned(), |(a, b)| format!("{:.2}", a / b))
    };
    let e = &s["ebpf"];
    if let (Some(us), Some(share)) =
        (e["bpf_us_per_conn"].as_f64(), e["bpf_share_of_conn"].as_f64())
    {
        let parts: Vec<String> = e["bpf_per_conn_by_program"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(n, v)| {
                Some(format!("{n} {:.2} µs ({:.1} runs)", v["us"].as_f64()?, v["runs"].as_f64()?))
            })
            .collect();
        println!(
            "ebpf programs per connection (1 client): {us:.2} µs, {:.1}% of its time; {}",
            share * 100.0,
            parts.join(", ")
        );
    }
    println!(
        "decision counters on / off: conn/s {}, p99 {}; monitor attached / not: conn/s {}, p99 {}",
        cost("ebpf", "ebpf_no_decision_counters", "conn_per_s"),
        cost("ebpf", "ebpf_no_decision_counters", "rr_p99_us"),
        cost("ebpf_monitor", "ebpf", "conn_per_s"),
        cost("ebpf_monitor", "ebpf", "rr_p99_us"),
    );
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{commit_of, median_by_program, paired_ratio, traffic_cell};

    /// A directory of its own, removed on drop.
    struct TempDir(std::path::PathBuf);

    impl TempDir {
        fn path(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A git checkout in a fresh directory with one commit of `src/a.rs` and
    /// `results/capture.json`.
    fn checkout() -> (TempDir, String) {
        let dir = TempDir(std::env::temp_dir().join(meshpath_tests::unique("meshpath-bench-git-")));
        std::fs::create_dir(dir.path()).expect("temp dir");
        let git = |args: &[&str]| {
            let out = std::process::Command::new("git")
                .current_dir(dir.path())
                .args(["-c", "user.name=t", "-c", "user.email=t@t"])
                .args(args)
                .output()
                .expect("git");
            assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        std::fs::create_dir_all(dir.path().join("src")).expect("src");
        std::fs::create_dir_all(dir.path().join("results")).expect("results");
        std::fs::write(dir.path().join("src/a.rs"), "fn a() {}\n").expect("write");
        std::fs::write(dir.path().join("results/capture.json"), "{}\n").expect("write");
        git(&["init", "-q"]);
        git(&["add", "."]);
        git(&["commit", "-q", "-m", "one"]);
        let head = git(&["rev-parse", "HEAD"]);
        (dir, head)
    }

    #[test]
    fn a_changed_results_file_leaves_the_measured_commit_clean() {
        let (dir, head) = checkout();
        std::fs::write(dir.path().join("results/capture.json"), "{\"x\": 1}\n").expect("write");
        assert_eq!(commit_of(dir.path()), head);
        assert_eq!(commit_of(&dir.path().join("src")), head, "from a subdirectory too");
    }

    #[test]
    fn a_changed_source_file_marks_the_measured_commit_dirty() {
        let (dir, head) = checkout();
        std::fs::write(dir.path().join("src/a.rs"), "fn b() {}\n").expect("write");
        assert_eq!(commit_of(dir.path()), format!("{head}+dirty"));
    }

    #[test]
    fn a_median_over_fewer_rounds_says_how_many_failed() {
        let s = json!({ "throughput_gbps": 6.724, "failed_rounds": { "throughput_gbps": 3 },
                        "rounds": [{}, {}, {}, {}, {}] });
        assert_eq!(traffic_cell(&s, "throughput_gbps", 2), "6.72 (3 of 5 rounds failed)");
    }

    #[test]
    fn a_metric_every_round_failed_is_shown_failed_not_missing() {
        let s = json!({ "throughput_gbps": null, "failed_rounds": { "throughput_gbps": 5 },
                        "rounds": [{}, {}, {}, {}, {}] });
        assert_eq!(traffic_cell(&s, "throughput_gbps", 2), "failed (5 of 5 rounds)");
    }

    #[test]
    fn a_metric_no_round_failed_is_its_median_alone() {
        let s = json!({ "conn_per_s": 4466.1, "failed_rounds": {}, "rounds": [{}, {}, {}] });
        assert_eq!(traffic_cell(&s, "conn_per_s", 0), "4466");
    }

    #[test]
    fn each_programs_cost_per_connection_is_its_median_over_the_rounds_that_measured_it() {
        let round = |c: f64, s: f64| {
            json!({ "bpf_per_conn_by_program": {
                "mp_connect4": { "us": c, "runs": 2.0 }, "mp_sk_lookup": { "us": s, "runs": 1.0 } } })
        };
        // A round whose measurement failed has no breakdown.
        let rounds = [round(1.5, 0.2), json!({}), round(0.9, 0.3), round(1.1, 0.25)];
        let m = median_by_program(&rounds).expect("measured");
        assert_eq!(m["mp_connect4"], json!({ "us": 1.1, "runs": 2.0 }));
        assert_eq!(m["mp_sk_lookup"], json!({ "us": 0.25, "runs": 1.0 }));
        assert_eq!(median_by_program(&[json!({}), json!({})]), None);
    }

    #[test]
    fn a_paired_ratio_is_the_median_of_the_rounds_own_ratios() {
        let a = json!({ "rounds": [{ "c": 12.0 }, { "c": 8.0 }, { "c": 9.0 }, { "c": 1.0 }] });
        // Round 2 drifted slow for both; round 4 failed for b.
        let b = json!({ "rounds": [{ "c": 10.0 }, { "c": 5.0 }, { "c": 10.0 }, { "c": null }] });
        assert_eq!(paired_ratio(&a, &b, "c"), Some(1.2));
        assert_eq!(paired_ratio(&a, &b, "missing"), None);
    }
}
