//! Where a captured connection's time goes in the kernel's eBPF programs: the run time of every
//! meshpath program (the kernel's `BPF_ENABLE_STATS` counters, on only while this measures)
//! over a stretch of one-client connections, per connection, by program.
//!
//! Every meshpath program is counted, whichever socket it ran for: the app's connection to the
//! proxy, the proxy's to the server, the server's end; the TC guards (the pod's side and the
//! node's) for every packet the pod sends. The bench is the only thing loading meshpath
//! programs while it runs (programs are told apart by their names,
//! `datapath_common::consts::programs::ALL`).

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result};
use datapath_common::consts::programs;
use meshpath_loader::netns::Netns;
use serde_json::{json, Value};

use crate::stats;

/// Whether a loaded program's name (as the kernel keeps it: cut to
/// [`programs::KERNEL_NAME_LEN`] bytes) is one of the datapath's programs.
fn is_meshpaths(kernel_name: &str) -> bool {
    programs::ALL.iter().any(|n| n.get(..programs::KERNEL_NAME_LEN).unwrap_or(n) == kernel_name)
}

/// Program name → (run time, run count), for every loaded meshpath program.
fn snapshot() -> Result<BTreeMap<String, (Duration, u64)>> {
    let mut by_name = BTreeMap::new();
    for info in aya::programs::loaded_programs() {
        let info = info.context("listing loaded eBPF programs")?;
        let Some(name) = info.name_as_str().filter(|n| is_meshpaths(n)) else {
            continue;
        };
        let e = by_name.entry(name.to_owned()).or_insert((Duration::ZERO, 0));
        e.0 += info.run_time();
        e.1 += info.run_count();
    }
    Ok(by_name)
}

/// One-client connections to `to` from `ns` for `secs` with run-time statistics on: the keys
/// `bpf_us_per_conn` (every meshpath program's time per connection, µs), `bpf_share_of_conn`
/// (that over the connection's own time) and `bpf_per_conn_by_program` (µs and runs per
/// connection, by program).
pub fn per_connection(ns: &Netns, to: SocketAddr, secs: f64) -> Result<Value> {
    let _on = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("turning on eBPF run-time statistics (BPF_ENABLE_STATS)")?;
    let before = snapshot()?;
    let (conns, elapsed) = stats::connections(ns, to, secs, 1)?;
    let after = snapshot()?;
    anyhow::ensure!(conns > 0, "no connection was made");
    let per_conn = conns as f64;
    let mut by_program = serde_json::Map::new();
    let mut total_us = 0.0;
    for (name, (time, runs)) in &after {
        let (t0, r0) = before.get(name).copied().unwrap_or_default();
        let us = time.saturating_sub(t0).as_secs_f64() * 1e6 / per_conn;
        let runs = runs.saturating_sub(r0) as f64 / per_conn;
        if runs > 0.0 {
            total_us += us;
            by_program.insert(name.clone(), json!({ "us": us, "runs": runs }));
        }
    }
    let conn_us = elapsed.as_secs_f64() * 1e6 / per_conn;
    Ok(json!({
        "bpf_us_per_conn": total_us,
        "bpf_share_of_conn": total_us / conn_us,
        "bpf_per_conn_by_program": by_program,
    }))
}

#[cfg(test)]
mod tests {
    use super::is_meshpaths;

    #[test]
    fn every_datapath_program_is_counted_by_the_name_the_kernel_keeps_and_no_other() {
        // The kernel cuts names to 15 bytes: mp_sk_lookup_pass is loaded as mp_sk_lookup_pa.
        for name in ["mp_sock_ops", "tc_pod_guard", "tc_pod_egress", "mp_sk_lookup_pa"] {
            assert!(is_meshpaths(name), "{name}");
        }
        for name in ["mp_sk_lookup_pass", "tc_pod", "mp_", "sd_fw_egress"] {
            assert!(!is_meshpaths(name), "{name}");
        }
    }
}
