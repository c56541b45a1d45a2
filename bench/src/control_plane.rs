//! `meshpath-bench control-plane`: how fast the proxy takes istiod's state, and what holding it
//! costs. For 1,000, 10,000 and 50,000 workloads (with a tenth as many services):
//!
//! - **apply**: one delta response carrying all of them, as the proxy takes it: decoded,
//!   checked and converted, held, made into the store and swapped for the one before, which is
//!   dropped (`xds::Held`, in this process);
//! - **delta of one**: one more workload applied on top of them (the median of 20);
//! - **memory**: a real `meshpath-proxy` following the istiod stand-in (tests/src/istiod.rs)
//!   that serves them, its resident memory once it holds them all, against the same proxy
//!   holding none (so the figure is the state's, not the process's);
//! - **first certificate**: a CA client asking the stand-in for a certificate on a fresh
//!   connection (TCP, TLS, a new key and CSR, the answer checked): the median of 5.
//!
//! And **one address, many claimants**: 10,000 workloads istiod lists with one address (each
//! may claim it; the proxy serves ztunnel's pick), applied in one response, then one more, then
//! one fewer: the work per input must not grow with how many share it (issue 48).
//!
//! Goals (issue 34): 10,000 workloads applied in under 1 s and held in under 40 MB; a delta of
//! one workload in under 1 ms.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use meshpath_proxy::{state::store::WorkloadStore, xds::Held};
use meshpath_tests::{istiod::Istiod, sibling_bin, CgroupGuard, NetnsGuard, TestProxy};
use meshpath_xds::{
    discovery::{DeltaDiscoveryResponse, Resource},
    workload as wl, ADDRESS_TYPE,
};
use prost::Message as _;
use serde_json::{json, Value};

/// The sizes measured.
pub const SIZES: &[usize] = &[1_000, 10_000, 50_000];

fn ip(i: usize) -> IpAddr {
    let i = i as u32;
    IpAddr::V4(Ipv4Addr::new(10, 100 + (i >> 16) as u8, (i >> 8) as u8, i as u8))
}

/// Workload `i`, as istiod describes a pod: an address, a service it backs, HBONE.
pub fn workload(i: usize) -> wl::Workload {
    let svc = format!("bench/svc-{}.bench.svc.cluster.local", i % 100);
    wl::Workload {
        uid: format!("Kubernetes//Pod/bench/pod-{i}"),
        name: format!("pod-{i}"),
        namespace: "bench".into(),
        service_account: format!("sa-{}", i % 100),
        addresses: vec![match ip(i) {
            IpAddr::V4(v4) => v4.octets().to_vec().into(),
            IpAddr::V6(v6) => v6.octets().to_vec().into(),
        }],
        tunnel_protocol: wl::TunnelProtocol::Hbone as i32,
        workload_name: format!("deploy-{}", i % 100),
        node: format!("node-{}", i % 50),
        services: [(
            svc,
            wl::PortList {
                ports: vec![wl::Port { service_port: 80, target_port: 8080, app_protocol: 0 }],
            },
        )]
        .into(),
        ..Default::default()
    }
}

/// Service `i`.
pub fn service(i: usize) -> wl::Service {
    wl::Service {
        name: format!("svc-{i}"),
        namespace: "bench".into(),
        hostname: format!("svc-{i}.bench.svc.cluster.local"),
        addresses: vec![wl::NetworkAddress {
            network: String::new(),
            address: vec![10, 96, (i >> 8) as u8, i as u8].into(),
        }],
        ports: vec![wl::Port { service_port: 80, target_port: 8080, app_protocol: 0 }],
        ..Default::default()
    }
}

fn resource(name: String, a: wl::Address) -> Resource {
    Resource {
        version: "v1".into(),
        name,
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE.into(),
            value: a.encode_to_vec(),
        }),
        aliases: vec![],
        ttl: None,
    }
}

/// One response carrying workloads `range` and services `services`.
fn response(range: std::ops::Range<usize>, services: std::ops::Range<usize>) -> Vec<u8> {
    response_of(range, services, workload)
}

/// Workload `i`, with the one address all of the shared-address case's claim.
fn sharing(i: usize) -> wl::Workload {
    wl::Workload { addresses: vec![vec![10, 99, 0, 1].into()], ..workload(i) }
}

/// The response of workloads `range` made by `make`, and services `services`.
fn response_of(
    range: std::ops::Range<usize>,
    services: std::ops::Range<usize>,
    make: fn(usize) -> wl::Workload,
) -> Vec<u8> {
    let mut resources = Vec::new();
    for i in range {
        let w = make(i);
        resources.push(resource(
            w.uid.clone(),
            wl::Address { r#type: Some(wl::address::Type::Workload(w)) },
        ));
    }
    for i in services {
        let s = service(i);
        resources.push(resource(
            format!("{}/{}", s.namespace, s.hostname),
            wl::Address { r#type: Some(wl::address::Type::Service(s)) },
        ));
    }
    DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE.into(),
        nonce: "n".into(),
        resources,
        ..Default::default()
    }
    .encode_to_vec()
}

/// Decoding, applying and making the store of `bytes`; the time it took.
/// Takes one response as the proxy does: decoded, applied to what is held, and the store it
/// makes swapped for `current` (which is dropped, as the proxy drops the store before).
fn apply(held: &mut Held, bytes: &[u8], current: &mut WorkloadStore) -> Result<Duration> {
    let t = Instant::now();
    let resp = DeltaDiscoveryResponse::decode(bytes)?;
    let applied = held.apply(&resp);
    anyhow::ensure!(applied.refused == 0, "refused: {:?}", applied.reply.error_detail);
    *current = held.store();
    let took = t.elapsed();
    std::hint::black_box(&current);
    Ok(took)
}

/// `bytes` applied to nothing held, three times: the times (ms), and what the last made.
fn apply_from_empty(bytes: &[u8]) -> Result<(Vec<f64>, Held, WorkloadStore)> {
    let mut apply_ms = Vec::new();
    let (mut held, mut current) = (Held::default(), WorkloadStore::default());
    for _ in 0..3 {
        (held, current) = (Held::default(), WorkloadStore::default());
        apply_ms.push(apply(&mut held, bytes, &mut current)?.as_secs_f64() * 1e3);
    }
    Ok((apply_ms, held, current))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS")
}

/// A proxy following `istiod` (xDS and CA), no pod served; returns once it holds `n`
/// workloads, with its resident memory then.
fn proxy_holding(
    istiod: &Istiod,
    node: &NetnsGuard,
    cgroup: &CgroupGuard,
    n: usize,
) -> Result<u64> {
    let root = istiod.root_pem.display().to_string();
    let args: Vec<String> = [
        "--xds-address",
        &istiod.url(0),
        "--ca-address",
        &istiod.url(0),
        "--xds-root-ca",
        &root,
        "--ca-root-ca",
        &root,
        "--alt-xds-hostname",
        "istiod.istio-system.svc",
        "--alt-ca-hostname",
        "istiod.istio-system.svc",
        "--auth-token",
        "/nonexistent",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let mut cmd = std::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", node.path().display()))
        .arg(sibling_bin("meshpath-proxy"))
        .args(&args)
        .env("RUST_LOG", "warn");
    let proxy = TestProxy::spawn(cmd, cgroup)?;
    let started = Instant::now();
    loop {
        let m = meshpath_tests::NodeProxy::http_in(&proxy, node, "STATS", "GET", "/metrics")
            .map(|(_, b)| b)
            .unwrap_or_default();
        let held =
            meshpath_tests::sum_metric(&m, "meshpath_xds_resources", &[("kind", "workload")]);
        let synced =
            m.contains("meshpath_xds_responses_total{kind=\"authorization\",reply=\"ack\"}");
        if held as usize == n && synced {
            // Let freed decode buffers go back before reading.
            std::thread::sleep(Duration::from_millis(500));
            return rss_kib(proxy.pid());
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the proxy never held {n} workloads ({held})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn first_certificate(istiod: &Istiod, node: &NetnsGuard) -> Result<Duration> {
    use meshpath_proxy::{
        certs::ca_client::{CaClient, CaConfig},
        identity::Identity,
        istiod::ChannelConfig,
        metrics::Metrics,
    };
    let cfg = CaConfig {
        channel: ChannelConfig {
            address: istiod.url(0),
            root_ca: istiod.root_pem.clone(),
            alt_hostname: Some("istiod.istio-system.svc".into()),
            token: None,
            cluster_id: "Kubernetes".into(),
        },
        ttl: Duration::from_secs(86_400),
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let id = Identity::new("cluster.local", "bench", "sa-0");
    // The stand-in listens inside the node's namespace: connect from a thread in it.
    let ns = node.open()?;
    let took = ns.run(|| {
        rt.block_on(async {
            let client = CaClient::new(cfg, std::sync::Arc::new(Metrics::new()));
            let t = Instant::now();
            client.get(&id).await?;
            anyhow::Ok(t.elapsed())
        })
    })??;
    Ok(took)
}

/// Runs it; the results object (also printed as a table).
pub fn run(out: &Path) -> Result<()> {
    let steal = crate::Steal::start();
    let mut sizes = Vec::new();
    let node = NetnsGuard::new("mp-cp")?;
    let cgroup = CgroupGuard::new()?;
    let istiod = Istiod::start(&[node.path()])?;
    let baseline = proxy_holding(&istiod, &node, &cgroup, 0)?;
    let mut cert_ms = Vec::new();
    for _ in 0..5 {
        cert_ms.push(first_certificate(&istiod, &node)?.as_secs_f64() * 1e3);
    }
    for &n in SIZES {
        let services = n / 10;
        let all = response(0..n, 0..services);
        let (apply_ms, mut held, mut current) = apply_from_empty(&all)?;
        let mut delta_us = Vec::new();
        for k in 0..20 {
            let one = response(n + k..n + k + 1, 0..0);
            delta_us.push(apply(&mut held, &one, &mut current)?.as_secs_f64() * 1e6);
        }
        for i in 0..n {
            istiod.set_workload(workload(i));
        }
        for i in 0..services {
            istiod.set_service(service(i));
        }
        let rss = proxy_holding(&istiod, &node, &cgroup, n)?;
        for i in 0..n {
            istiod.remove_address(&workload(i).uid);
        }
        for i in 0..services {
            let s = service(i);
            istiod.remove_address(&format!("{}/{}", s.namespace, s.hostname));
        }
        let r = json!({
            "workloads": n,
            "services": services,
            "response_mib": all.len() as f64 / 1048576.0,
            "apply_ms": median(apply_ms.clone()),
            "apply_ms_rounds": apply_ms,
            "delta_one_us": median(delta_us.clone()),
            "delta_one_us_max": delta_us.iter().copied().fold(0.0, f64::max),
            "proxy_rss_mib": rss as f64 / 1024.0,
            "state_mib": rss.saturating_sub(baseline) as f64 / 1024.0,
        });
        println!(
            "{n:>6} workloads, {services:>5} services: applied in {:.1} ms, one more in {:.0} µs, held in {:.1} MiB (proxy {:.1} MiB)",
            r["apply_ms"].as_f64().unwrap_or(f64::NAN),
            r["delta_one_us"].as_f64().unwrap_or(f64::NAN),
            r["state_mib"].as_f64().unwrap_or(f64::NAN),
            r["proxy_rss_mib"].as_f64().unwrap_or(f64::NAN),
        );
        sizes.push(r);
    }
    let shared = shared_address(SHARED)?;
    let result = json!({
        "shared_address": shared,
        "machine": crate::machine(),
        "commit": crate::commit(),
        "date": crate::date(),
        "steal_pct": steal.pct(),
        "baseline_proxy_rss_mib": baseline as f64 / 1024.0,
        "first_certificate_ms": median(cert_ms.clone()),
        "first_certificate_ms_rounds": cert_ms,
        "sizes": sizes,
    });
    println!(
        "first certificate: {:.1} ms (median of 5)",
        result["first_certificate_ms"].as_f64().unwrap_or(f64::NAN)
    );
    crate::print_steal(&result);
    std::fs::create_dir_all(out.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(out, serde_json::to_string_pretty(&result)?)?;
    let svg = out.with_extension("svg");
    std::fs::write(&svg, chart(&result))?;
    eprintln!("bench: wrote {} and {}", out.display(), svg.display());
    Ok(())
}

/// Workloads sharing one address in the shared-address case.
const SHARED: usize = 10_000;

/// `n` workloads of one address applied in one response; then one more (median of 20); then
/// one removed (median of 20).
fn shared_address(n: usize) -> Result<Value> {
    let all = response_of(0..n, 0..0, sharing);
    let (apply_ms, mut held, mut current) = apply_from_empty(&all)?;
    let mut more_us = Vec::new();
    for k in 0..20 {
        let one = response_of(n + k..n + k + 1, 0..0, sharing);
        more_us.push(apply(&mut held, &one, &mut current)?.as_secs_f64() * 1e6);
    }
    let mut fewer_us = Vec::new();
    for k in 0..20 {
        let gone = DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            nonce: "n".into(),
            removed_resources: vec![sharing(k).uid],
            ..Default::default()
        }
        .encode_to_vec();
        fewer_us.push(apply(&mut held, &gone, &mut current)?.as_secs_f64() * 1e6);
    }
    let r = json!({
        "workloads": n,
        "apply_ms": median(apply_ms.clone()),
        "apply_ms_rounds": apply_ms,
        "one_more_us": median(more_us),
        "one_fewer_us": median(fewer_us),
    });
    println!(
        "{n:>6} workloads of one address: applied in {:.1} ms, one more in {:.0} µs, one fewer in {:.0} µs",
        r["apply_ms"].as_f64().unwrap_or(f64::NAN),
        r["one_more_us"].as_f64().unwrap_or(f64::NAN),
        r["one_fewer_us"].as_f64().unwrap_or(f64::NAN),
    );
    Ok(r)
}

/// Two bar groups per size: apply time (ms) and state held (MiB), each scaled to its largest.
pub fn chart(r: &Value) -> String {
    let sizes = r["sizes"].as_array().cloned().unwrap_or_default();
    let (w, h, pad) = (640.0, 320.0, 50.0);
    let max = |k: &str| sizes.iter().filter_map(|s| s[k].as_f64()).fold(1e-9, f64::max);
    let (max_ms, max_mib) = (max("apply_ms"), max("state_mib"));
    let group = (w - 2.0 * pad) / sizes.len().max(1) as f64;
    let mut body = String::new();
    for (i, s) in sizes.iter().enumerate() {
        let x = pad + i as f64 * group;
        for (j, (k, top, color, unit)) in
            [("apply_ms", max_ms, "#4477aa", "ms"), ("state_mib", max_mib, "#cc6677", "MiB")]
                .iter()
                .enumerate()
        {
            let v = s[k].as_f64().unwrap_or(0.0);
            let bh = (h - 2.0 * pad) * v / top;
            let bx = x + 10.0 + j as f64 * (group / 2.0 - 10.0);
            body.push_str(&format!(
                "<rect x=\"{bx:.0}\" y=\"{:.0}\" width=\"{:.0}\" height=\"{bh:.0}\" fill=\"{color}\"/><text x=\"{bx:.0}\" y=\"{:.0}\" font-size=\"11\">{v:.1} {unit}</text>",
                h - pad - bh,
                group / 2.0 - 20.0,
                h - pad - bh - 4.0
            ));
        }
        body.push_str(&format!(
            "<text x=\"{:.0}\" y=\"{:.0}\" font-size=\"12\">{} workloads</text>",
            x + 10.0,
            h - pad + 16.0,
            s["workloads"]
        ));
    }
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\"><rect width=\"100%\" height=\"100%\" fill=\"white\"/><text x=\"{pad}\" y=\"24\" font-size=\"14\">xDS: one response applied (blue, ms) and the state held by the proxy (red, MiB); commit {}</text>{body}</svg>",
        r["commit"].as_str().unwrap_or("?")
    )
}
