//! `meshpath-bench proxy`: pod to pod directly vs through two meshpath-proxy processes (two
//! "nodes") over HBONE with mutual TLS, on the eBPF capture; and, as the floor under HBONE,
//! through two plaintext forwarders (`meshpath-test-proxy forward`, tokio's
//! `copy_bidirectional` with 64 KiB buffers) on the same capture and the same three TCP hops
//! (pod a's outbound to the first, the first to pod b's address where inbound capture hands it
//! to the second, the second to the app), with no TLS and no HTTP/2: what the hops cost on
//! their own, so that HBONE's own share is measured, not guessed; and HBONE again with the
//! sockops + sk_msg shortcut on (`hbone_sockmap`: the app's socket joined to node 1's proxy in
//! the kernel; the shortcut joins the outbound hop only; off by default, docs/datapath.md says
//! why). Per scenario: iperf3 1 and 4
//! streams, request/response latency and connection rate from 1 client and from 100 at once
//! (`*_100`); for every scenario the machine's busy CPU seconds per GB while one stream runs
//! (`machine_cpu_s_per_gb`); for HBONE and the forwarders also the proxies' own; for
//! HBONE the resident memory node 1's proxy spends per open stream and per idle pooled HTTP/2
//! connection.
//!
//! `same_node` and `same_node_hbone`: one meshpath-proxy serving both pods, as one node's proxy
//! serves two meshed pods of the node: on the node-local path (the proxy connects from pod a's
//! socket to pod b's app directly: two TCP hops, no TLS), and with `--node-local-hbone` (HBONE
//! to itself: three hops, two TLS sessions, as ztunnel carries same-node traffic); the run
//! reports `same_node / same_node_hbone` and `same_node / ztunnel`.
//!
//! With `--ztunnel PATH` (a build of Istio's ztunnel: ../shared/notes/hbone.md), scenario
//! `ztunnel` runs beside them: two ztunnel processes in dedicated mode, one in each pod's netns
//! as a sidecar would be, on the same eBPF capture, over HBONE with mutual TLS (its fake CA),
//! carrying the same traffic as `hbone`, keeping the client's address on its connection to the
//! app as both do when deployed (`ENABLE_ORIG_SRC`); the run then reports `hbone / ztunnel`.
//!
//! After the rounds, the one-client request/response latency of `direct`, `hbone`, `ztunnel`,
//! `same_node` and `same_node_hbone` (those the run has) once more, all set up at once and
//! measured in turn in short blocks (`interleaved.rs`; `interleaved_rr` in the results): ratios
//! of latencies measured in one window rather than minutes apart.
//!
//! `--store-workloads N` lists N other workloads (and one service per ten of them) in the
//! proxies' store before the two pods, as a large mesh would: what a connection costs when the
//! proxy knows many workloads, not two.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result};
use meshpath_loader::{
    netns::Netns,
    pods::{self, EnrolOptions},
};
use meshpath_proxy::identity::LocalCa;
use meshpath_tests::{sibling_bin, unique, CgroupGuard, PinRoot, PodPair, TestProxy};
use serde_json::{json, Value};

use crate::stats::{self, record};

const RR_PORT: u16 = 7100;
const ONESHOT_PORT: u16 = 7101;
const IPERF_PORT: u16 = 5202;

/// Two proxies serving pod a (node 1) and pod b (node 2).
struct Hbone {
    proxies: Vec<TestProxy>,
    _cgroup: CgroupGuard,
    _root: PinRoot,
    dir: PathBuf,
}

impl Drop for Hbone {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two plaintext forwarders where the HBONE scenario has its two proxies: pod a's outbound
/// captured to the first (in pod a), which connects to the destination; pod b's inbound captured
/// to the second (in pod b), which connects to the app. Fields drop in order: the forwarders
/// before their cgroup, the cgroup before the datapath.
struct Forwarders {
    forwarders: Vec<TestProxy>,
    _cgroup: CgroupGuard,
    _root: PinRoot,
}

fn start_forwarders(pods: &PodPair) -> Result<Forwarders> {
    let (root, cgroup) = (PinRoot::new(), CgroupGuard::new()?);
    {
        let dp = root.datapath()?;
        dp.register_proxy_cgroup(cgroup.path())?;
        let a = EnrolOptions { capture_outbound: true, counters: false, ..EnrolOptions::default() };
        pods::enrol(&dp, &pods.a.open()?, &a)?;
        let b = EnrolOptions { capture_inbound: true, counters: false, ..EnrolOptions::default() };
        pods::enrol(&dp, &pods.b.open()?, &b)?;
    }
    let bin = sibling_bin("meshpath-test-proxy");
    let mut forwarders = Vec::new();
    for (ns, inbound) in [(&pods.a, false), (&pods.b, true)] {
        let quiet = [crate::QUIET_PROXY];
        forwarders.push(TestProxy::start(&bin, &ns.path(), &cgroup, "forward", inbound, &quiet)?);
    }
    Ok(Forwarders { forwarders, _cgroup: cgroup, _root: root })
}

/// What the proxies' store lists besides the two pods: what a connection costs in a large mesh.
#[derive(Debug, Clone, Copy)]
pub struct Store {
    /// Other workloads (and a service per ten), at most 1,048,576.
    pub workloads: usize,
    /// Authorization policies, none of which applies to the two pods (their connections are
    /// allowed as with none): half selecting workloads by name, half NAMESPACE-wide in other
    /// namespaces.
    pub policies: usize,
}

/// The proxies' store: other workloads (one service per ten of them), then the two pods, then
/// the policies.
fn store_yaml(pods: &PodPair, store: Store) -> String {
    use std::fmt::Write as _;
    let others = store.workloads;
    let mut yaml = String::from("workloads:\n");
    // 172.16.0.0/12 and 10.96.0.0/12: outside the pods' addresses (10.199.0.0/24), for up to a
    // million workloads.
    let ip = |base: u32, i: usize| std::net::Ipv4Addr::from(base + i as u32);
    for i in 0..others.min(1 << 20) {
        let _ = writeln!(
            yaml,
            "- {{uid: other-{i}, namespace: default, serviceAccount: other, protocol: HBONE, workloadIps: [\"{}\"], services: {{\"default/svc-{}.default.svc.cluster.local\": {{80: 8080}}}}}}",
            ip(0xac10_0000, i),
            i / 10
        );
    }
    let _ = write!(
        yaml,
        "- uid: pod-a\n  namespace: default\n  serviceAccount: a\n  protocol: HBONE\n  workloadIps: [\"{}\"]\n\
         - uid: pod-b\n  namespace: default\n  serviceAccount: b\n  protocol: HBONE\n  workloadIps: [\"{}\"]\n",
        pods.a_ip, pods.b_ip
    );
    if others > 0 {
        yaml.push_str("services:\n");
        for j in 0..others.min(1 << 20).div_ceil(10) {
            let _ = writeln!(
                yaml,
                "- {{name: svc-{j}, namespace: default, hostname: svc-{j}.default.svc.cluster.local, vips: [\"/{}\"]}}",
                ip(0x0a60_0000, j)
            );
        }
    }
    if store.policies > 0 {
        yaml.push_str("policies:\n");
        for j in 0..store.policies.min(1 << 20) {
            let rule = "rules: [[[{principals: [\"cluster.local/ns/bench/sa/nobody\"]}]]]";
            let scope = if j % 2 == 0 { "WORKLOAD_SELECTOR" } else { "NAMESPACE" };
            let _ = writeln!(
                yaml,
                "- {{name: p-{j}, namespace: ns-{j}, scope: {scope}, action: ALLOW, {rule}}}"
            );
        }
    }
    yaml
}

/// The capture the HBONE scenarios share: a datapath pinned under a root of its own, the
/// proxies' cgroup registered, pod a's outbound captured and pod b enrolled (as deployed: its
/// reply routing, and the datapath's view of the proxy's transparent connections to its app);
/// with `shortcut`, the sockops + sk_msg shortcut on.
fn capture(pods: &PodPair, shortcut: bool) -> Result<(PinRoot, CgroupGuard)> {
    let (root, cgroup) = (PinRoot::new(), CgroupGuard::new()?);
    let dp = root.datapath()?;
    dp.register_proxy_cgroup(cgroup.path())?;
    dp.set_acceleration(shortcut)?;
    let a = EnrolOptions { capture_outbound: true, counters: false, ..EnrolOptions::default() };
    pods::enrol(&dp, &pods.a.open()?, &a)?;
    let b = EnrolOptions { counters: false, ..EnrolOptions::default() };
    pods::enrol(&dp, &pods.b.open()?, &b)?;
    drop(dp);
    Ok((root, cgroup))
}

/// How the pods' proxies are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Two meshpath-proxy processes over HBONE (two nodes); with the sockops + sk_msg shortcut
    /// on if `shortcut`.
    TwoNodes { shortcut: bool },
    /// One meshpath-proxy serving both pods (one node).
    SameNode,
}

/// The pods' meshpath-proxy processes, laid out as `layout` says.
fn start_hbone(
    pods: &PodPair,
    extra: &[String],
    env: &[(&str, &str)],
    store: Store,
    layout: Layout,
) -> Result<Hbone> {
    let shortcut = layout == Layout::TwoNodes { shortcut: true };
    let (root, cgroup) = capture(pods, shortcut)?;
    let dir = std::env::temp_dir().join(unique("meshpath-bench-"));
    std::fs::create_dir_all(&dir)?;
    // Built first, so the directory goes even when a proxy fails to start.
    let mut hbone = Hbone { proxies: Vec::new(), _cgroup: cgroup, _root: root, dir };
    let dir = hbone.dir.clone();
    let (cert, key) = LocalCa::generate("meshpath bench CA")?.to_pem();
    std::fs::write(dir.join("ca.pem"), cert)?;
    std::fs::write(dir.join("ca-key.pem"), key)?;
    std::fs::write(dir.join("workloads.yaml"), store_yaml(pods, store))?;
    let both = [("pod-a", &pods.a), ("pod-b", &pods.b)];
    let served: Vec<&[(&str, &meshpath_tests::NetnsGuard)]> = match layout {
        Layout::TwoNodes { .. } => both.chunks(1).collect(),
        Layout::SameNode => vec![&both[..]],
    };
    for pods in served {
        let mut cmd = Command::new(sibling_bin("meshpath-proxy"));
        cmd.arg("--workloads").arg(dir.join("workloads.yaml"));
        cmd.arg("--ca-cert").arg(dir.join("ca.pem")).arg("--ca-key").arg(dir.join("ca-key.pem"));
        for (pod, ns) in pods {
            cmd.arg("--pod").arg(format!("{pod}={}", ns.path().display()));
        }
        // Both proxies share this netns: their node-wide endpoints take any free port.
        for flag in ["--admin-addr", "--stats-addr", "--readiness-addr"] {
            cmd.arg(flag).arg("127.0.0.1:0");
        }
        cmd.args(extra).envs(env.iter().copied());
        cmd.env("RUST_LOG", "error").stderr(Stdio::null());
        hbone.proxies.push(TestProxy::spawn(cmd, &hbone._cgroup)?);
    }
    Ok(hbone)
}

/// Two ztunnel processes (`bin`), one in each pod's netns in dedicated mode (its listeners in
/// the pod, as a sidecar's), on the capture `start_hbone` sets up, in the proxies' cgroup;
/// certificates from its fake CA, the two workloads from a local configuration file.
fn start_ztunnel(pods: &PodPair, bin: &Path) -> Result<Hbone> {
    let (root, cgroup) = capture(pods, false)?;
    let dir = std::env::temp_dir().join(unique("meshpath-bench-ztunnel-"));
    std::fs::create_dir_all(&dir)?;
    let mut hbone = Hbone { proxies: Vec::new(), _cgroup: cgroup, _root: root, dir };
    let config = hbone.dir.join("ztunnel.yaml");
    let workload = |name: &str, sa: &str, ip: std::net::Ipv4Addr| {
        format!(
            "- uid: {name}\n  name: {name}\n  namespace: default\n  serviceAccount: {sa}\n  trustDomain: cluster.local\n  workloadIps: [\"{ip}\"]\n  protocol: HBONE\n  services: {{}}\n"
        )
    };
    let yaml = format!(
        "workloads:\n{}{}",
        workload("pod-a", "a", pods.a_ip),
        workload("pod-b", "b", pods.b_ip)
    );
    std::fs::write(&config, yaml)?;
    for (pod, sa, ns) in [("pod-a", "a", &pods.a), ("pod-b", "b", &pods.b)] {
        let mut cmd = Command::new(meshpath_tests::cni_node::nsenter());
        cmd.arg(format!("--net={}", ns.path().display())).arg(bin).arg("proxy");
        cmd.env("PROXY_MODE", "dedicated")
            .env("PROXY_WORKLOAD_INFO", format!("default/{pod}/{sa}"))
            .env("XDS_ADDRESS", "")
            .env("LOCAL_XDS_PATH", &config)
            .env("FAKE_CA", "true")
            // As deployed (in-pod, with NET_ADMIN, it keeps the client's address by default), and
            // as meshpath-proxy does: its connection to the app from the client's address.
            .env("ENABLE_ORIG_SRC", "true")
            .env("RUST_LOG", "error")
            .stderr(Stdio::null());
        // It prints no `READY` line: its readiness endpoint (15021, in the pod) says.
        hbone.proxies.push(TestProxy::spawn_unready(cmd, &hbone._cgroup)?);
        let netns = ns.open()?;
        let ready = || -> bool {
            let ask = || -> std::io::Result<bool> {
                let mut c = TcpStream::connect(("127.0.0.1", 15021))?;
                c.write_all(b"GET /healthz/ready HTTP/1.0\r\n\r\n")?;
                let mut answer = String::new();
                c.read_to_string(&mut answer)?;
                Ok(answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"))
            };
            netns.run(ask).ok().and_then(Result::ok).unwrap_or(false)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !ready() {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "ztunnel in {pod} not ready in 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(hbone)
}

/// (user + system CPU seconds, resident KiB) of a process.
fn usage(pid: u32) -> Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("").split_whitespace().collect();
    // After the command name: utime and stime are fields 14 and 15 of stat(5), here 11 and 12.
    let ticks: f64 = fields
        .get(11)
        .zip(fields.get(12))
        .map_or(0.0, |(u, s)| u.parse::<f64>().unwrap_or(0.0) + s.parse::<f64>().unwrap_or(0.0));
    let hz = stats::clock_ticks_per_s();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .context("VmRSS")?;
    Ok((ticks / hz, rss))
}

/// iperf3 from pod a to pod b with `streams` parallel streams: (Gbit/s, bytes received).
fn iperf3(pods: &PodPair, secs: f64, streams: u32) -> Result<(f64, f64)> {
    let (secs, streams) = (format!("{secs}"), streams.to_string());
    let r = pods.a.iperf3_client(pods.b_ip.into(), IPERF_PORT, &["-t", &secs, "-P", &streams])?;
    let sum = &r["end"]["sum_received"];
    Ok((
        sum["bits_per_second"].as_f64().context("bps")? / 1e9,
        sum["bytes"].as_f64().context("bytes")?,
    ))
}

/// What carries scenario `name`'s traffic between the pods (nothing for `direct`); dropped,
/// it stops.
pub(crate) struct Carrier {
    hbone: Option<Hbone>,
    forwarders: Option<Forwarders>,
}

/// Starts scenario `name`'s proxies (or forwarders) for `pods`.
pub(crate) fn start_carrier(
    name: &str,
    pods: &PodPair,
    proxy_args: &[String],
    store: Store,
    ztunnel: Option<&Path>,
) -> Result<Carrier> {
    let hbone = match name {
        "hbone" | "hbone_sockmap" => {
            let layout = Layout::TwoNodes { shortcut: name == "hbone_sockmap" };
            Some(start_hbone(pods, proxy_args, &[], store, layout)?)
        }
        "same_node" => Some(start_hbone(pods, proxy_args, &[], store, Layout::SameNode)?),
        "same_node_hbone" => {
            let args: Vec<String> =
                proxy_args.iter().cloned().chain(["--node-local-hbone".to_owned()]).collect();
            Some(start_hbone(pods, &args, &[], store, Layout::SameNode)?)
        }
        "ztunnel" => Some(start_ztunnel(pods, ztunnel.context("no ztunnel build given")?)?),
        "direct" | "forwarders" => None,
        other => anyhow::bail!("no scenario {other}"),
    };
    let forwarders = if name == "forwarders" { Some(start_forwarders(pods)?) } else { None };
    Ok(Carrier { hbone, forwarders })
}

/// A new pod pair with the request/response server in pod b: the pods, pod a's and pod b's
/// netns, and the server's address (what `scenario` and the interleaved step both start from).
pub(crate) fn rr_pods() -> Result<(PodPair, Netns, Netns, SocketAddr)> {
    let pods = PodPair::new()?;
    let (a, b) = (pods.a.open()?, pods.b.open()?);
    let rr = SocketAddr::new(pods.b_ip.into(), RR_PORT);
    stats::start_rr_server(&b, rr)?;
    Ok((pods, a, b, rr))
}

fn scenario(
    name: &str,
    secs: f64,
    proxy_args: &[String],
    store: Store,
    ztunnel: Option<&Path>,
) -> Result<Value> {
    let (pods, a, b, rr) = rr_pods()?;
    let oneshot = SocketAddr::new(pods.b_ip.into(), ONESHOT_PORT);
    stats::start_oneshot_server(&b, oneshot)?;
    let _iperf = pods.b.iperf3_server(pods.b_ip.into(), IPERF_PORT, false)?;
    let Carrier { mut hbone, forwarders } = start_carrier(name, &pods, proxy_args, store, ztunnel)?;
    let pids: Vec<u32> = hbone
        .iter()
        .flat_map(|h| h.proxies.iter())
        .chain(forwarders.iter().flat_map(|f| f.forwarders.iter()))
        .map(TestProxy::pid)
        .collect();
    let cpu = |pids: &[u32]| -> Result<f64> { pids.iter().map(|&p| usage(p).map(|u| u.0)).sum() };

    // A metric that fails is recorded as failed (null), not the end of the whole run.
    let mut out = serde_json::Map::new();
    let cpu0 = cpu(&pids);
    let machine0 = stats::machine_busy_s();
    match iperf3(&pods, secs, 1) {
        Ok((gbps, bytes)) => {
            record(&mut out, name, "throughput_gbps", Ok(gbps));
            let used = machine0.and_then(|m0| Ok(stats::machine_busy_s()? - m0));
            record(&mut out, name, "machine_cpu_s_per_gb", used.map(|s| s / (bytes / 1e9)));
            if !pids.is_empty() {
                let used = cpu0.and_then(|c0| Ok(cpu(&pids)? - c0));
                record(&mut out, name, "cpu_s_per_gb", used.map(|s| s / (bytes / 1e9)));
            }
        }
        Err(e) => {
            if !pids.is_empty() {
                record(&mut out, name, "cpu_s_per_gb", Err(anyhow::anyhow!("{e:#}")));
            }
            record(&mut out, name, "machine_cpu_s_per_gb", Err(anyhow::anyhow!("{e:#}")));
            record(&mut out, name, "throughput_gbps", Err(e));
        }
    }
    record(&mut out, name, "throughput_4_gbps", iperf3(&pods, secs, 4).map(|(gbps, _)| gbps));
    stats::record_rate_and_latency(&mut out, name, &a, oneshot, rr, secs, &pids);
    // Not measured here (the proxies' own metrics for direct): n/a; measured and failed: failed.
    let f = |out: &serde_json::Map<String, Value>, k: &str| match out.get(k) {
        None => "n/a".to_owned(),
        Some(v) => v.as_f64().map_or("failed".to_owned(), |x| format!("{x:.1}")),
    };
    eprintln!(
        "bench: {name}: {} Gbit/s (4 streams {}), {} conn/s ({} from 100 clients), rr p50 {} us p99 {} us (100 clients: {} / {}), cpu {} s/GB (machine {})",
        f(&out, "throughput_gbps"),
        f(&out, "throughput_4_gbps"),
        f(&out, "conn_per_s"),
        f(&out, "conn_per_s_100"),
        f(&out, "rr_p50_us"),
        f(&out, "rr_p99_us"),
        f(&out, "rr_p50_us_100"),
        f(&out, "rr_p99_us_100"),
        f(&out, "cpu_s_per_gb"),
        f(&out, "machine_cpu_s_per_gb"),
    );
    // `n` connections from pod a, each through one round trip (so its stream is open).
    let hold = |n: usize| -> Result<Vec<stats::RrClient>> {
        (0..n)
            .map(|_| {
                a.run(|| {
                    let mut c = stats::RrClient::connect(rr)?;
                    c.round_trips(1)?;
                    Ok(c)
                })?
            })
            .collect()
    };
    // Memory, each in fresh proxies whose allocator gives freed memory back at once
    // (jemalloc's dirty decay at 0, where it keeps freed pages for 10 s): otherwise
    // memory the runs above freed would be reused and the connections would look free, or the
    // buffers of closed streams, freed but kept, would be counted as the connections'. What node
    // 1's proxy holds with 100 more connections (one warm-up connection first), over what it
    // held before.
    let fresh_rss_per_conn = |args: &[&str], keep_open: bool| -> Result<f64> {
        let args: Vec<String> =
            proxy_args.iter().cloned().chain(args.iter().map(|a| a.to_string())).collect();
        let env = [("MALLOC_CONF", "dirty_decay_ms:0")];
        let fresh = start_hbone(&pods, &args, &env, store, Layout::TwoNodes { shortcut: false })?;
        let pid = fresh.proxies[0].pid();
        drop(hold(1)?);
        std::thread::sleep(Duration::from_millis(300));
        let before = usage(pid)?.1;
        let held = hold(if keep_open { 100 } else { 101 })?;
        if !keep_open {
            drop(held);
            std::thread::sleep(Duration::from_millis(500));
            return Ok((usage(pid)?.1 - before) / 100.0);
        }
        std::thread::sleep(Duration::from_millis(300));
        Ok((usage(pid)?.1 - before) / 100.0)
    };
    // The proxies' memory is measured once, in `hbone`; the shortcut changes no proxy buffer.
    if let Some(old) = hbone.take().filter(|_| name == "hbone") {
        drop(old);
        // Per open stream: 100 connections held open, streams of one pooled HTTP/2 connection.
        record(&mut out, name, "rss_kib_per_conn", fresh_rss_per_conn(&[], true));
        // Per idle pooled connection: one stream per connection allowed, 100 connections opened
        // (100 HTTP/2 connections) and closed, their HTTP/2 connections left idle in the pool.
        record(
            &mut out,
            name,
            "rss_kib_per_idle_conn",
            fresh_rss_per_conn(&["--pool-max-streams", "1"], false),
        );
        eprintln!(
            "bench: {name}: rss {} KiB/stream, {} KiB/idle conn",
            f(&out, "rss_kib_per_conn"),
            f(&out, "rss_kib_per_idle_conn")
        );
    }
    Ok(Value::Object(out))
}

/// Each scenario's metrics (the median over rounds goes in the results file) and their column
/// in the printed table. The proxies' own: switches, system calls and CPU per GB for every
/// scenario with proxies, memory for `hbone` only; the machine's CPU per GB (everything busy
/// while one stream runs) for every scenario.
const KEYS: [(&str, &str); 16] = [
    ("throughput_gbps", "Gbit/s 1 stream"),
    ("throughput_4_gbps", "Gbit/s 4 streams"),
    ("rr_p50_us", "RR p50 µs"),
    ("rr_p99_us", "RR p99 µs"),
    ("conn_per_s", "conn/s"),
    ("rr_p50_us_100", "RR p50 µs, 100 clients"),
    ("rr_p99_us_100", "RR p99 µs, 100 clients"),
    ("conn_per_s_100", "conn/s, 100 clients"),
    ("rr_cpu_us_100", "CPU µs/RR, 100 clients"),
    ("rr_busy_100", "CPU busy, 100 clients"),
    ("rr_switches", "proxy switches/RR"),
    ("rr_syscalls", "proxy syscalls/RR"),
    ("cpu_s_per_gb", "proxy CPU s/GB"),
    ("machine_cpu_s_per_gb", "machine CPU s/GB"),
    ("rss_kib_per_conn", "RSS KiB/open stream"),
    ("rss_kib_per_idle_conn", "RSS KiB/idle pooled conn"),
];

/// Whether scenario `name` measures `key`: the proxies' CPU only where there are proxies, their
/// memory per stream and per pooled connection only where there are streams and a pool (HBONE).
fn measures(name: &str, key: &str) -> bool {
    match key {
        "cpu_s_per_gb" | "rr_switches" | "rr_syscalls" => name != "direct",
        "rss_kib_per_conn" | "rss_kib_per_idle_conn" => name == "hbone",
        _ => true,
    }
}

/// A scenario's results: each metric's median over its rounds, how many rounds each metric
/// failed in (`failed_rounds`: a round that failed is reported, not silently left out of the
/// median), and the rounds.
fn summarize(name: &str, rounds: &[Value]) -> Value {
    let mut m = serde_json::Map::new();
    let mut failed = serde_json::Map::new();
    for (key, _) in KEYS.into_iter().filter(|(k, _)| measures(name, k)) {
        let mut v: Vec<f64> = rounds.iter().filter_map(|r| r[key].as_f64()).collect();
        let lost = rounds.len() - v.len();
        if lost > 0 {
            failed.insert(key.into(), json!(lost));
        }
        v.sort_by(f64::total_cmp);
        m.insert(key.into(), json!(v.get(v.len() / 2)));
    }
    m.insert("failed_rounds".into(), Value::Object(failed));
    m.insert("rounds".into(), Value::Array(rounds.to_vec()));
    Value::Object(m)
}

/// The scenarios, in the order the first round runs them (`ztunnel` only with a ztunnel
/// build); the second runs them in reverse, the third as the first, and so on.
pub const SCENARIOS: [&str; 7] =
    ["direct", "forwarders", "hbone", "hbone_sockmap", "same_node", "same_node_hbone", "ztunnel"];

/// The results file of a whole run.
const PROXY_RESULTS: &str = "results/proxy.json";

/// Runs the proxy benchmark, writes `out`, prints a table.
pub fn run(
    out: &Path,
    secs: f64,
    rounds: usize,
    proxy_args: &[String],
    store: Store,
    ztunnel: Option<&Path>,
    only: &[String],
) -> Result<()> {
    meshpath_tests::require_root();
    if !only.is_empty() && out.ends_with(PROXY_RESULTS) {
        anyhow::bail!("a partial run (--scenarios) does not replace {PROXY_RESULTS}: give --out");
    }
    if ztunnel.is_none() && only.iter().any(|o| o == "ztunnel") {
        anyhow::bail!("scenario ztunnel needs a ztunnel build: --ztunnel PATH");
    }
    let names: Vec<&str> = SCENARIOS
        .iter()
        .copied()
        .filter(|n| *n != "ztunnel" || ztunnel.is_some())
        .filter(|n| only.is_empty() || only.iter().any(|o| o == n))
        .collect();
    let steal = crate::Steal::start();
    let mut runs: Vec<Vec<Value>> = vec![Vec::new(); names.len()];
    for round in 0..rounds {
        eprintln!("bench: round {}/{rounds}", round + 1);
        // Every other round runs them in the reverse order: each pair of scenarios runs in both
        // orders (ztunnel ran last in every round, after hbone), so a drift within a round
        // does not favour one side of a ratio in every round.
        let mut order: Vec<usize> = (0..names.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let name = &names[i];
            // A round whose set-up failed is recorded as failed for every metric, and the
            // rounds go on.
            let round = scenario(name, secs, proxy_args, store, ztunnel).unwrap_or_else(|e| {
                eprintln!("bench: {name}: round {} failed: {e:#}", round + 1);
                json!({ "error": format!("{e:#}") })
            });
            runs[i].push(round);
        }
    }
    let mut scenarios = json!({});
    for (i, name) in names.iter().enumerate() {
        scenarios[*name] = summarize(name, &runs[i]);
    }
    // After the rounds: one window with every latency path up at once.
    eprintln!("bench: interleaved request/response");
    let interleaved =
        crate::interleaved::rr(&names, proxy_args, store, ztunnel).unwrap_or_else(|e| {
            eprintln!("bench: interleaved request/response failed: {e:#}");
            Some(json!({ "error": format!("{e:#}") }))
        });
    let result = json!({
        "machine": crate::machine(), "commit": crate::commit(), "date": crate::date(),
        "steal_pct": steal.pct(), "proxy_args": proxy_args, "store_workloads": store.workloads,
        "store_policies": store.policies, "scenarios": scenarios,
        "ztunnel": ztunnel.map(ztunnel_version), "interleaved_rr": interleaved,
        "idle_cpus": crate::idle_cpus(),
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&result)? + "\n")?;
    crate::print_steal(&result);
    println!("Idle CPUs over the run: {}\n", crate::idle_cpus());
    let heads: Vec<&str> = KEYS.iter().map(|(_, head)| *head).collect();
    println!("| scenario | {} |", heads.join(" | "));
    println!("|---|{}", "---|".repeat(KEYS.len()));
    for name in &names {
        let cells: Vec<String> =
            KEYS.iter().map(|(k, _)| crate::traffic_cell(&scenarios[name], k, 2)).collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    let (d, f, h) = (&scenarios["direct"], &scenarios["forwarders"], &scenarios["hbone"]);
    let (hs, z) = (&scenarios["hbone_sockmap"], &scenarios["ztunnel"]);
    let (sn, snh) = (&scenarios["same_node"], &scenarios["same_node_hbone"]);
    for (label, over, under) in [
        ("hbone / direct", h, d),
        ("hbone / forwarders", h, f),
        ("hbone_sockmap / hbone", hs, h),
        ("hbone / ztunnel", h, z),
        ("same_node / same_node_hbone", sn, snh),
        ("same_node / ztunnel", sn, z),
        ("same_node / direct", sn, d),
    ] {
        let ratio = |k: &str| Some(over[k].as_f64()? / under[k].as_f64()?);
        if let (Some(t), Some(t4), Some(c), Some(c100), Some(p50), Some(p50_100)) = (
            ratio("throughput_gbps"),
            ratio("throughput_4_gbps"),
            ratio("conn_per_s"),
            ratio("conn_per_s_100"),
            ratio("rr_p50_us"),
            ratio("rr_p50_us_100"),
        ) {
            println!("\n{label}: throughput {t:.2} (4 streams {t4:.2}); conn/s {c:.2} (100 clients {c100:.2}); rr p50 {p50:.2} (100 clients {p50_100:.2})");
        }
        if let Some(cpu) = ratio("cpu_s_per_gb") {
            println!("{label}: proxies' CPU per GB {cpu:.2}");
        }
        if let Some(cpu) = ratio("machine_cpu_s_per_gb") {
            println!("{label}: machine CPU per GB {cpu:.2}");
        }
        if let Some(p99) = ratio("rr_p99_us") {
            println!("{label}: rr p99 {p99:.2}");
        }
    }
    crate::interleaved::print(&result["interleaved_rr"]);
    let added = |k: &str| Some(h[k].as_f64()? - d[k].as_f64()?);
    for (clients, p50, p99) in
        [(1, "rr_p50_us", "rr_p99_us"), (100, "rr_p50_us_100", "rr_p99_us_100")]
    {
        if let (Some(p50), Some(p99)) = (added(p50), added(p99)) {
            println!("added request/response latency, {clients} client(s): p50 {p50:.1} µs, p99 {p99:.1} µs");
        }
    }
    // Little's law: with every CPU busy, N clients each waiting for one round trip see a mean
    // of N × (CPU per round trip) / CPUs; a p50 near it is CPU, not a queue in front of idle CPUs.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    for name in &names {
        let s = &scenarios[*name];
        if let (Some(cpu), Some(busy), Some(p50)) =
            (s["rr_cpu_us_100"].as_f64(), s["rr_busy_100"].as_f64(), s["rr_p50_us_100"].as_f64())
        {
            println!(
                "{name}, 100 clients: {cpu:.1} µs of CPU per round trip, CPUs {:.0}% busy; 100 × that / {cpus} CPUs = {:.0} µs, p50 {p50:.0} µs",
                busy * 100.0,
                100.0 * cpu / cpus
            );
        }
    }
    eprintln!("bench: wrote {} and {}", out.display(), crate::charts::write_for(out)?.display());
    Ok(())
}

/// What `ztunnel version` says of the build (recorded in the results file).
fn ztunnel_version(bin: &Path) -> String {
    Command::new(bin)
        .arg("version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|e| format!("{}: {e}", bin.display()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::summarize;

    #[test]
    fn a_round_whose_set_up_failed_counts_as_failed_for_every_metric_of_its_scenario() {
        let rounds = [
            json!({ "throughput_gbps": 9.0, "cpu_s_per_gb": 1.2 }),
            json!({ "error": "starting the proxies" }),
            json!({ "throughput_gbps": 8.0, "cpu_s_per_gb": null }),
        ];
        let s = summarize("hbone", &rounds);
        assert_eq!(s["throughput_gbps"], json!(9.0));
        assert_eq!(s["failed_rounds"]["throughput_gbps"], json!(1));
        assert_eq!(s["failed_rounds"]["cpu_s_per_gb"], json!(2));
        assert_eq!(s["failed_rounds"]["conn_per_s"], json!(3));
    }

    #[test]
    fn direct_is_not_failed_for_the_proxies_own_metrics() {
        let s = summarize("direct", &[json!({ "throughput_gbps": 20.0 })]);
        assert!(s.get("cpu_s_per_gb").is_none());
        assert!(s["failed_rounds"].get("rss_kib_per_idle_conn").is_none());
        assert_eq!(s["failed_rounds"]["conn_per_s"], json!(1));
    }

    #[test]
    fn the_forwarders_are_measured_for_cpu_per_gb_and_not_for_a_pools_memory() {
        let s = summarize("forwarders", &[json!({ "throughput_gbps": 9.0 })]);
        assert_eq!(s["failed_rounds"]["cpu_s_per_gb"], json!(1));
        assert!(s["failed_rounds"].get("rss_kib_per_conn").is_none());
        assert!(s["failed_rounds"].get("rss_kib_per_idle_conn").is_none());
    }
}
