//! What the datapath decided, read back: the `DECISIONS` counts summed over CPUs, per pod and
//! reason (labels from `datapath_common::decisions::REASONS`), for `show`, `list` and the
//! agent's metrics; removed with the pod at unenrolment, so the label set stays bounded.

use aya::maps::MapError;
use datapath_common::{
    decisions::{labels, DecisionKey, NODE_WIDE, REASONS},
    node_flags, NetnsCookie,
};

use crate::{datapath::Datapath, Error, Result};

/// One counted decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionCount {
    /// The pod's netns cookie, or `decisions::NODE_WIDE`.
    pub netns: NetnsCookie,
    pub reason: u32,
    pub hook: &'static str,
    pub decision: &'static str,
    pub why: &'static str,
    pub count: u64,
}

/// Every count, summed over CPUs, ordered by pod then reason code. Codes this build does not
/// know (a newer datapath) are skipped.
pub fn counts(dp: &Datapath) -> Result<Vec<DecisionCount>> {
    let map = dp.decisions()?;
    let mut out = Vec::new();
    for entry in map.iter() {
        let (key, per_cpu) = entry.map_err(|e| Error::bpf("reading DECISIONS", e))?;
        let Some((hook, decision, why)) = labels(key.reason) else { continue };
        let count = per_cpu.iter().fold(0u64, |a, c| a.saturating_add(*c));
        out.push(DecisionCount {
            netns: key.netns,
            reason: key.reason,
            hook,
            decision,
            why,
            count,
        });
    }
    out.sort_by_key(|c| (c.netns, c.reason));
    Ok(out)
}

/// The counts of one pod (or `NODE_WIDE`).
pub fn of(dp: &Datapath, netns: NetnsCookie) -> Result<Vec<DecisionCount>> {
    Ok(counts(dp)?.into_iter().filter(|c| c.netns == netns).collect())
}

/// Removes the pod's counts (unenrolment). Returns each removal's result.
/// One delete per known reason, not a walk over every pod's counts (which made removing a pod
/// cost more the more pods the node had); a count under a reason this agent does not know is
/// left to `remove_orphans`.
pub(crate) fn remove_pod(dp: &Datapath, netns: NetnsCookie) -> Result<Vec<Result<(), MapError>>> {
    let mut map = dp.decisions()?;
    Ok(REASONS
        .iter()
        .map(|&(reason, ..)| map.remove(&DecisionKey { netns, reason, _pad: 0 }))
        .collect())
}

/// Removes the counts of cookies that are neither node-wide nor in `live` (reconcile).
pub(crate) fn remove_orphans(
    dp: &Datapath,
    live: &[NetnsCookie],
) -> Result<Vec<Result<(), MapError>>> {
    let mut map = dp.decisions()?;
    let keys: Vec<DecisionKey> =
        map.keys().flatten().filter(|k| k.netns != NODE_WIDE && !live.contains(&k.netns)).collect();
    Ok(keys.iter().map(|k| map.remove(k)).collect())
}

/// The counts in Prometheus text format: `meshpath_datapath_pods`, the pods enrolled, then
/// `meshpath_datapath_decisions_total` labelled by pod (its name as enrolled, `node` for
/// node-wide decisions), hook, decision and reason. Pods that left are gone from the map, so
/// from the metric.
pub fn prometheus(dp: &Datapath) -> Result<String> {
    use std::fmt::Write as _;
    let names: std::collections::HashMap<NetnsCookie, String> =
        dp.pods()?.iter().flatten().map(|(c, info)| (c, info.name().to_owned())).collect();
    let mut out = format!(
        "# HELP meshpath_datapath_pods Pods enrolled in the node's datapath.\n\
         # TYPE meshpath_datapath_pods gauge\n\
         meshpath_datapath_pods {}\n\
         # HELP meshpath_datapath_decisions_total Decisions the eBPF datapath made, by pod and reason.\n\
         # TYPE meshpath_datapath_decisions_total counter\n",
        names.len()
    );
    for c in counts(dp)? {
        let pod = if c.netns == NODE_WIDE {
            "node".to_owned()
        } else if let Some(name) = names.get(&c.netns) {
            name.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
        } else {
            continue; // a pod that is leaving
        };
        let _ = writeln!(
            out,
            "meshpath_datapath_decisions_total{{pod=\"{pod}\",hook=\"{}\",decision=\"{}\",reason=\"{}\"}} {}",
            c.hook, c.decision, c.why, c.count
        );
    }
    Ok(out)
}

/// Turns counting on (the default) or off (only to measure its cost).
pub fn set_counting(dp: &Datapath, on: bool) -> Result<()> {
    if on {
        dp.update_node_flags(0, node_flags::DECISION_COUNTERS_OFF)
    } else {
        dp.update_node_flags(node_flags::DECISION_COUNTERS_OFF, 0)
    }
}
