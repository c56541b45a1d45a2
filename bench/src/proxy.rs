//! `meshpath-bench proxy`: pod to pod directly vs through two meshpath-proxy processes (two
//! "nodes") over HBONE with mutual TLS, on the eBPF capture. Per scenario: iperf3 1 and 4
//! streams, request/response latency, connection rate; for HBONE also the proxies' CPU seconds
//! per GB carried and the resident memory node 1's proxy spends per open stream and per idle
//! pooled HTTP/2 connection.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result};
use meshpath_loader::pods::{self, EnrolOptions};
use meshpath_proxy::identity::LocalCa;
use meshpath_tests::{sibling_bin, unique, CgroupGuard, PinRoot, PodPair, TestProxy};
use serde_json::{json, Value};

use crate::stats;

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

fn start_hbone(pods: &PodPair, extra: &[&str], env: &[(&str, &str)]) -> Result<Hbone> {
    let (root, cgroup) = (PinRoot::new(), CgroupGuard::new()?);
    {
        let dp = root.datapath()?;
        dp.register_proxy_cgroup(cgroup.path())?;
        let opts =
            EnrolOptions { capture_outbound: true, counters: false, ..EnrolOptions::default() };
        pods::enrol(&dp, &pods.a.open()?, &opts)?;
        // As deployed, the destination pod is enrolled too (its reply routing, and the
        // datapath's view of the proxy's transparent connections to its app).
        let b = EnrolOptions { counters: false, ..EnrolOptions::default() };
        pods::enrol(&dp, &pods.b.open()?, &b)?;
    }
    let dir = std::env::temp_dir().join(unique("meshpath-bench-"));
    std::fs::create_dir_all(&dir)?;
    let (cert, key) = LocalCa::generate("meshpath bench CA")?.to_pem();
    std::fs::write(dir.join("ca.pem"), cert)?;
    std::fs::write(dir.join("ca-key.pem"), key)?;
    let yaml = format!(
        "workloads:\n- uid: pod-a\n  namespace: default\n  serviceAccount: a\n  protocol: HBONE\n  workloadIps: [\"{}\"]\n\
         - uid: pod-b\n  namespace: default\n  serviceAccount: b\n  protocol: HBONE\n  workloadIps: [\"{}\"]\n",
        pods.a_ip, pods.b_ip
    );
    std::fs::write(dir.join("workloads.yaml"), yaml)?;
    let mut proxies = Vec::new();
    for (pod, ns) in [("pod-a", &pods.a), ("pod-b", &pods.b)] {
        let mut cmd = Command::new(sibling_bin("meshpath-proxy"));
        cmd.arg("--workloads").arg(dir.join("workloads.yaml"));
        cmd.arg("--ca-cert").arg(dir.join("ca.pem")).arg("--ca-key").arg(dir.join("ca-key.pem"));
        cmd.arg("--pod").arg(format!("{pod}={}", ns.path().display()));
        // Both proxies share this netns: their node-wide endpoints take any free port.
        for flag in ["--admin-addr", "--stats-addr", "--readiness-addr"] {
            cmd.arg(flag).arg("127.0.0.1:0");
        }
        cmd.args(extra).envs(env.iter().copied());
        cmd.env("RUST_LOG", "error").stderr(Stdio::null());
        proxies.push(TestProxy::spawn(cmd, &cgroup)?);
    }
    Ok(Hbone { proxies, _cgroup: cgroup, _root: root, dir })
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
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
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

fn scenario(name: &str, secs: f64) -> Result<Value> {
    let pods = PodPair::new()?;
    let (a, b) = (pods.a.open()?, pods.b.open()?);
    let rr = SocketAddr::new(pods.b_ip.into(), RR_PORT);
    let oneshot = SocketAddr::new(pods.b_ip.into(), ONESHOT_PORT);
    stats::start_rr_server(&b, rr)?;
    stats::start_oneshot_server(&b, oneshot)?;
    let _iperf = pods.b.iperf3_server(pods.b_ip.into(), IPERF_PORT, false)?;
    let mut hbone = if name == "hbone" { Some(start_hbone(&pods, &[], &[])?) } else { None };
    let pids: Vec<u32> = hbone.iter().flat_map(|h| h.proxies.iter().map(TestProxy::pid)).collect();
    let cpu = |pids: &[u32]| -> Result<f64> { pids.iter().map(|&p| usage(p).map(|u| u.0)).sum() };

    let cpu0 = cpu(&pids)?;
    let (gbps, bytes) = iperf3(&pods, secs, 1)?;
    let cpu_s_per_gb =
        if pids.is_empty() { None } else { Some((cpu(&pids)? - cpu0) / (bytes / 1e9)) };
    let (gbps4, _) = iperf3(&pods, secs, 4)?;
    let cps = stats::conn_per_s(&a, oneshot, secs)?;
    let (p50, p99) = stats::rr_latency(&a, rr, 2_000, 20_000)?;
    let hold = |n: usize| -> Result<Vec<TcpStream>> {
        (0..n)
            .map(|_| {
                a.run(|| -> std::io::Result<TcpStream> {
                    let mut c = TcpStream::connect(rr)?;
                    let mut buf = [0u8; stats::MESSAGE];
                    c.write_all(&buf)?;
                    c.read_exact(&mut buf)?;
                    Ok(c)
                })?
                .map_err(anyhow::Error::from)
            })
            .collect()
    };
    // Memory per open stream: node 1's proxy before and after 100 connections are held open
    // (all streams of one pooled HTTP/2 connection).
    let rss_kib_per_conn = match pids.first() {
        Some(&pid) => {
            let before = usage(pid)?.1;
            let held = hold(100)?;
            std::thread::sleep(Duration::from_millis(300));
            let after = usage(pid)?.1;
            drop(held);
            Some((after - before) / 100.0)
        }
        None => None,
    };
    // Memory per idle pooled connection: fresh proxies allowing one stream per connection, 100
    // connections opened (100 HTTP/2 connections) and closed; what node 1's proxy holds with
    // the 100 idle pooled connections, over what it held before. glibc's malloc is told to give
    // freed memory back at once (MALLOC_TRIM_THRESHOLD_=0): otherwise the buffers of the 100
    // closed streams, freed but kept by the allocator, would be counted as the connections'.
    let rss_kib_per_idle_conn = if let Some(old) = hbone.take() {
        drop(old);
        let fresh =
            start_hbone(&pods, &["--pool-max-streams", "1"], &[("MALLOC_TRIM_THRESHOLD_", "0")])?;
        let pid = fresh.proxies[0].pid();
        drop(hold(1)?);
        std::thread::sleep(Duration::from_millis(300));
        let before = usage(pid)?.1;
        drop(hold(101)?);
        std::thread::sleep(Duration::from_millis(500));
        let after = usage(pid)?.1;
        drop(fresh);
        Some((after - before) / 100.0)
    } else {
        None
    };
    eprintln!("bench: {name}: {gbps:.2} Gbit/s (4 streams {gbps4:.2}), {cps:.0} conn/s, rr p50 {p50:.1} us p99 {p99:.1} us, cpu {cpu_s_per_gb:?} s/GB, rss {rss_kib_per_conn:?} KiB/stream, {rss_kib_per_idle_conn:?} KiB/idle conn");
    Ok(json!({
        "throughput_gbps": gbps, "throughput_4_gbps": gbps4, "rr_p50_us": p50, "rr_p99_us": p99,
        "conn_per_s": cps, "cpu_s_per_gb": cpu_s_per_gb, "rss_kib_per_conn": rss_kib_per_conn,
        "rss_kib_per_idle_conn": rss_kib_per_idle_conn,
    }))
}

/// Runs the proxy benchmark, writes `out`, prints a table.
pub fn run(out: &Path, secs: f64, rounds: usize) -> Result<()> {
    meshpath_tests::require_root();
    let names = ["direct", "hbone"];
    let mut runs: Vec<Vec<Value>> = vec![Vec::new(); names.len()];
    for round in 0..rounds {
        eprintln!("bench: round {}/{rounds}", round + 1);
        for (i, name) in names.iter().enumerate() {
            runs[i].push(scenario(name, secs)?);
        }
    }
    let keys = [
        "throughput_gbps",
        "throughput_4_gbps",
        "rr_p50_us",
        "rr_p99_us",
        "conn_per_s",
        "cpu_s_per_gb",
        "rss_kib_per_conn",
        "rss_kib_per_idle_conn",
    ];
    let mut scenarios = json!({});
    for (i, name) in names.iter().enumerate() {
        let mut m = serde_json::Map::new();
        for key in keys {
            let mut v: Vec<f64> = runs[i].iter().filter_map(|r| r[key].as_f64()).collect();
            v.sort_by(f64::total_cmp);
            m.insert(key.into(), json!(v.get(v.len() / 2)));
        }
        m.insert("rounds".into(), Value::Array(runs[i].clone()));
        scenarios[*name] = Value::Object(m);
    }
    let result = json!({ "machine": crate::machine(), "commit": crate::commit(), "date": crate::date(), "scenarios": scenarios });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&result)? + "\n")?;
    let f = |v: &Value| v.as_f64().map_or("n/a".to_owned(), |x| format!("{x:.2}"));
    println!("| scenario | Gbit/s 1 stream | Gbit/s 4 streams | RR p50 µs | RR p99 µs | conn/s | proxy CPU s/GB | RSS KiB/open stream | RSS KiB/idle pooled conn |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for name in names {
        let x = &scenarios[name];
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f(&x["throughput_gbps"]),
            f(&x["throughput_4_gbps"]),
            f(&x["rr_p50_us"]),
            f(&x["rr_p99_us"]),
            f(&x["conn_per_s"]),
            f(&x["cpu_s_per_gb"]),
            f(&x["rss_kib_per_conn"]),
            f(&x["rss_kib_per_idle_conn"])
        );
    }
    let (d, h) = (&scenarios["direct"], &scenarios["hbone"]);
    if let (Some(dt), Some(ht), Some(dp), Some(hp)) = (
        d["throughput_gbps"].as_f64(),
        h["throughput_gbps"].as_f64(),
        d["rr_p50_us"].as_f64(),
        h["rr_p50_us"].as_f64(),
    ) {
        println!("\nhbone / direct throughput {:.2}; added p50 {:.1} µs", ht / dt, hp - dp);
    }
    eprintln!("bench: wrote {} and {}", out.display(), crate::charts::write_for(out)?.display());
    Ok(())
}
