//! Request/response latency of several paths measured in one window, interleaved: every path
//! set up at once (a pod pair each), then blocks of round trips taken from each in turn, the
//! order rotated from block to block, so that whatever the machine does meanwhile (its host's
//! other guests, frequency, the scheduler's mood) falls on all of them alike. The rounds of
//! `meshpath-bench proxy` measure each scenario minutes apart, and one-client p50 moves by
//! more than the gap between two proxies from one such minute to the next; here a ratio is
//! taken between blocks measured back to back, and its spread over the blocks is reported.
//!
//! One client per path, on one connection kept for the whole run (a single request/response
//! stream, as `rr_p50_us`); for each path the p50 and p99 over all its blocks, and for each
//! pair the ratio of those and the median, lowest and highest ratio of the blocks' own p50s.
//! The absolute figures are not `rr_p50_us`'s: measured this way, `direct` takes 4.4 µs here
//! against about 10 µs in the rounds (60 to 70 with idle CPUs halting). In the rounds' samples
//! the client and the server ran on different CPUs (`perf record -a`, 2026-12-07); a client on
//! the calling thread instead of a thread of its own changed nothing (9.6 µs); why the
//! scheduler places them otherwise here was not found. A path's latency moves with what else
//! is set up, unevenly by its shape (on 4773e6b, from the rounds' p50: same_node −35%, hbone
//! +43%, ztunnel +50%). The ratio of two paths of one shape (`hbone` and `ztunnel`: two
//! proxies, HBONE between them) is what this is for; the others are reported with that caveat
//! (results/README.md).
//!
//! Every path is up at once: up to four datapaths attached beside each other (their cgroup
//! programs run at a connection's start and state changes, not per packet, so they cost a
//! block nothing once its connection is open) and each proxy holding the whole store (with a
//! large `--store-workloads`, four times the memory of a round). A path that fails to start is
//! recorded as failed and the others are measured.

use std::{path::Path, time::Duration};

use anyhow::{Context as _, Result};
use meshpath_tests::PodPair;
use serde_json::{json, Map, Value};

use crate::{
    proxy::{rr_pods, start_carrier, Carrier},
    stats::{self, RrClient},
};

/// The paths measured together, where the run has them.
pub const PATHS: [&str; 5] = ["direct", "hbone", "ztunnel", "same_node", "same_node_hbone"];

/// The ratios reported, (over, under), where the run has both (see the module's caveat). Not
/// over `direct`: 4.4 µs measured this way, where `rr_p50_us` finds about 10 µs in the same
/// process, says nothing of what a proxy adds.
pub const PAIRS: [(&str, &str); 3] =
    [("hbone", "ztunnel"), ("same_node", "same_node_hbone"), ("same_node", "ztunnel")];

/// Blocks per path, round trips per block, and round trips before the first block.
const BLOCKS: usize = 40;
const PER_BLOCK: usize = 500;
const WARMUP: usize = 2_000;

/// One path: its pods, what carries the traffic, and its client. Fields drop in order: the
/// client, then the proxies, then the pods.
struct Measured {
    name: &'static str,
    client: RrClient,
    _carrier: Carrier,
    _pods: PodPair,
    samples: Vec<Duration>,
    block_p50_us: Vec<f64>,
}

/// Sets path `name` up: its pods, the request/response server in pod b, what carries the
/// traffic, and a client connected from pod a.
fn start(
    name: &'static str,
    proxy_args: &[String],
    store: crate::proxy::Store,
    ztunnel: Option<&Path>,
) -> Result<Measured> {
    let (pods, a, _b, rr) = rr_pods()?;
    let carrier = start_carrier(name, &pods, proxy_args, store, ztunnel)?;
    let client = a.run(|| RrClient::connect(rr))??;
    Ok(Measured {
        name,
        client,
        _carrier: carrier,
        _pods: pods,
        samples: Vec::with_capacity(BLOCKS * PER_BLOCK),
        block_p50_us: Vec::with_capacity(BLOCKS),
    })
}

/// Measures `names` (those of [`PATHS`] the run has; nothing with fewer than two) interleaved;
/// the results object, or `None`.
pub fn rr(
    names: &[&str],
    proxy_args: &[String],
    store: crate::proxy::Store,
    ztunnel: Option<&Path>,
) -> Result<Option<Value>> {
    let names: Vec<&'static str> = PATHS.into_iter().filter(|p| names.contains(p)).collect();
    if names.len() < 2 {
        return Ok(None);
    }
    let mut out = Map::new();
    let mut paths = Vec::new();
    for name in names {
        match start(name, proxy_args, store, ztunnel) {
            Ok(p) => paths.push(p),
            Err(e) => {
                eprintln!("bench: interleaved: {name} failed: {e:#}");
                out.insert(name.into(), json!({ "error": format!("{e:#}") }));
            }
        }
    }
    // Warmed up together, just before the first block: the first set up does not wait idle
    // for the others.
    for p in &mut paths {
        p.client.round_trips(WARMUP).with_context(|| format!("{}: warm-up", p.name))?;
    }
    let n = paths.len();
    for block in 0..BLOCKS {
        for k in 0..n {
            let p = &mut paths[(block + k) % n];
            let mut s = p.client.round_trips(PER_BLOCK).context(p.name)?;
            p.block_p50_us.push(stats::percentile_us(&mut s, 0.50));
            p.samples.extend(s);
        }
    }
    out.insert("blocks".into(), json!(BLOCKS));
    out.insert("round_trips_per_block".into(), json!(PER_BLOCK));
    for p in &mut paths {
        out.insert(
            p.name.into(),
            json!({
                "rr_p50_us": stats::percentile_us(&mut p.samples, 0.50),
                "rr_p99_us": stats::percentile_us(&mut p.samples, 0.99),
            }),
        );
    }
    let find = |name: &str| paths.iter().find(|p| p.name == name);
    for (over, under) in PAIRS {
        let (Some(o), Some(u)) = (find(over), find(under)) else { continue };
        let mut by_block: Vec<f64> =
            o.block_p50_us.iter().zip(&u.block_p50_us).map(|(a, b)| a / b).collect();
        by_block.sort_by(f64::total_cmp);
        let ratio = |k: &str| Some(out[o.name][k].as_f64()? / out[u.name][k].as_f64()?);
        out.insert(
            format!("{over} / {under}"),
            json!({
                "rr_p50": ratio("rr_p50_us"),
                "rr_p99": ratio("rr_p99_us"),
                "rr_p50_by_block_median": by_block.get(by_block.len() / 2),
                "rr_p50_by_block_min": by_block.first(),
                "rr_p50_by_block_max": by_block.last(),
            }),
        );
    }
    Ok(Some(Value::Object(out)))
}

/// Prints what [`rr`] measured (nothing if it did not run; its error if it failed).
pub fn print(v: &Value) {
    if let Some(e) = v["error"].as_str() {
        println!("\ninterleaved request/response failed: {e}");
    }
    if v["blocks"].is_null() {
        return;
    }
    println!(
        "\ninterleaved 1-client request/response ({} blocks of {} round trips per path, in turn):",
        v["blocks"], v["round_trips_per_block"]
    );
    for name in PATHS {
        let p = &v[name];
        if let (Some(p50), Some(p99)) = (p["rr_p50_us"].as_f64(), p["rr_p99_us"].as_f64()) {
            println!("  {name}: p50 {p50:.1} µs, p99 {p99:.1} µs");
        }
    }
    for (over, under) in PAIRS {
        let r = &v[format!("{over} / {under}")];
        let f = |k: &str| r[k].as_f64().map_or("-".to_owned(), |x| format!("{x:.2}"));
        if r.is_object() {
            println!(
                "  {over} / {under}: p50 {} (by block: median {}, {} to {}), p99 {}",
                f("rr_p50"),
                f("rr_p50_by_block_median"),
                f("rr_p50_by_block_min"),
                f("rr_p50_by_block_max"),
                f("rr_p99"),
            );
        }
    }
}
