//! Counting and streaming what the programs decide (reason codes: datapath_common::decisions).
//! One per-CPU increment per decision; the monitor's ring buffer is written only while a
//! monitor has switched it on in `NODE_CONFIG`, so nobody watching costs one array read.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns, EbpfContext};
use aya_log_ebpf::{debug, info};
use datapath_common::{
    decisions::{is_drop, DecisionEvent, DecisionKey},
    node_flags, NetnsCookie,
};

use crate::{
    maps::{DECISIONS, MONITOR_EVENTS, NODE_CONFIG},
    net::V4_MAPPED_PREFIX,
};

/// What the monitor shows of the connection: IPv6 or v4-mapped words, host-order ports; zero
/// where the hook does not know it yet.
#[derive(Clone, Copy, Default)]
pub struct Tuple {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub src_port: u16,
    pub dst_port: u16,
}

/// An IPv4 address (network-order word) as v4-mapped words.
#[inline(always)]
pub fn mapped(ip: u32) -> [u32; 4] {
    [0, 0, V4_MAPPED_PREFIX, ip]
}

/// Counts `reason` for `netns`; if a monitor watches (and wants this one), streams it with the
/// connection `tuple()` describes (built only then); and logs it through aya-log when the agent
/// asked for that (`--ebpf-log`), which forwards it into its own log.
#[inline(always)]
pub fn record<C: EbpfContext>(ctx: &C, netns: NetnsCookie, reason: u32, tuple: impl Fn() -> Tuple) {
    let flags = NODE_CONFIG.get(0).copied().unwrap_or(0);
    if flags & (node_flags::EBPF_LOG_INFO | node_flags::EBPF_LOG_DEBUG) != 0 {
        log(ctx, flags, netns, reason, tuple().dst_port);
    }
    if flags & node_flags::DECISION_COUNTERS_OFF == 0 {
        let key = DecisionKey { netns, reason, _pad: 0 };
        match DECISIONS.get_ptr_mut(&key) {
            // SAFETY: this CPU's slot of a per-CPU value, owned by the map.
            Some(n) => unsafe { *n += 1 },
            // A full map (more keys than it is sized for) loses the count, never the decision.
            None => {
                let _ = DECISIONS.insert(&key, &1, u64::from(BPF_NOEXIST));
            }
        }
    }
    if flags & node_flags::MONITOR == 0
        || (flags & node_flags::MONITOR_DROPS_ONLY != 0 && !is_drop(reason))
    {
        return;
    }
    // A full ring (a slow reader) drops the event, never the decision.
    if let Some(mut slot) = MONITOR_EVENTS.reserve::<DecisionEvent>(0) {
        let t = tuple();
        slot.write(DecisionEvent {
            // SAFETY: no arguments.
            ktime_ns: unsafe { bpf_ktime_get_ns() },
            netns,
            reason,
            src_port: t.src_port,
            dst_port: t.dst_port,
            src: t.src,
            dst: t.dst,
        });
        slot.submit(0);
    }
}

/// One aya-log record per decision: drops at info, the rest at debug. Numbers only, parsed by
/// the agent's forwarder (`decision=` is a reason code it names): strings from a table here
/// would cost the verifier a variable-length read.
#[inline(never)]
fn log<C: EbpfContext>(ctx: &C, flags: u32, netns: NetnsCookie, reason: u32, dst_port: u16) {
    if is_drop(reason) {
        info!(ctx, "decision={} netns={} dst_port={}", reason, netns, dst_port);
    } else if flags & node_flags::EBPF_LOG_DEBUG != 0 {
        debug!(ctx, "decision={} netns={} dst_port={}", reason, netns, dst_port);
    }
}
