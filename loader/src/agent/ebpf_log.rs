//! `--ebpf-log off|info|debug`: the datapath's aya-log records, forwarded into the agent's
//! `tracing` output. The level is a switch in `NODE_CONFIG` the programs read on every decision,
//! so it changes at run time and costs nothing when off (the default): the programs write no
//! record unless asked. Records carry numbers (`decision=<reason code> netns=… dst_port=…`);
//! this side names the reason from datapath_common's one table and logs structured fields.
//!
//! At most [`RECORDS_PER_REASON_PER_SECOND`] records of one reason are logged each second: what a
//! pod or a peer can make the datapath refuse (a bind loop on a proxy port, SYNs to a pod whose
//! proxy is down) would otherwise write a line each. The rest are counted and the count is
//! logged with the next record of that reason; the decision counters (metrics) have them all.

use std::{str::FromStr, sync::Mutex, time::Instant};

use aya::programs::SkLookup;
use datapath_common::{
    consts::{pins, programs},
    decisions::{labels, REASONS},
    node_flags,
};
use meshpath_loglimit::PerSecond;
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

use crate::datapath::Datapath;

/// How much of the datapath's decisions the agent logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EbpfLog {
    #[default]
    Off,
    /// Refusals and drops.
    Info,
    /// Every decision.
    Debug,
}

impl FromStr for EbpfLog {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "info" => Ok(Self::Info),
            "debug" => Ok(Self::Debug),
            other => Err(format!("--ebpf-log must be off, info or debug, not {other:?}")),
        }
    }
}

impl EbpfLog {
    fn flags(self) -> u32 {
        match self {
            Self::Off => 0,
            Self::Info => node_flags::EBPF_LOG_INFO,
            Self::Debug => node_flags::EBPF_LOG_INFO | node_flags::EBPF_LOG_DEBUG,
        }
    }
}

/// Sets the programs' log level.
pub fn set_level(dp: &Datapath, level: EbpfLog) -> crate::Result<()> {
    let all = node_flags::EBPF_LOG_INFO | node_flags::EBPF_LOG_DEBUG;
    dp.update_node_flags(level.flags(), all & !level.flags())
}

/// Records of one reason logged per second at most.
pub const RECORDS_PER_REASON_PER_SECOND: u32 = 20;

/// Turns the datapath's records into `tracing` events (target `meshpath::datapath`), each
/// reason's at most [`RECORDS_PER_REASON_PER_SECOND`] a second.
struct Forward {
    /// One per reason of [`REASONS`], in its order, then one for codes this build does not know
    /// and for records that are not decisions: bounded, whatever the records say.
    windows: Mutex<Vec<PerSecond>>,
}

impl Forward {
    fn new() -> Self {
        let window = PerSecond::new(RECORDS_PER_REASON_PER_SECOND);
        Self { windows: Mutex::new(vec![window; REASONS.len() + 1]) }
    }

    /// [`PerSecond::admit`] for the window of reason `code`.
    fn admit(&self, code: Option<u64>) -> (bool, u64) {
        let slot = code
            .and_then(|c| REASONS.iter().position(|r| u64::from(r.0) == c))
            .unwrap_or(REASONS.len());
        let mut windows = self.windows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        windows[slot].admit(Instant::now())
    }
}

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let text = record.args().to_string();
        let field = |name: &str| -> Option<u64> {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
        };
        let code = field("decision");
        let (logged, left_out) = self.admit(code);
        let (hook, decision, reason) = code
            .and_then(|c| u32::try_from(c).ok())
            .and_then(labels)
            .unwrap_or(("?", "?", "unknown reason code"));
        if left_out > 0 {
            warn!(target: "meshpath::datapath", hook, decision, reason, left_out,
                "datapath records of this reason left out of the log in the last second (rate limit; the decision counters have them all)");
        }
        if !logged {
            return;
        }
        let (Some(_), netns, dst_port) = (code, field("netns"), field("dst_port")) else {
            info!(target: "meshpath::datapath", "{text}");
            return;
        };
        let (netns, dst_port) = (netns.unwrap_or(0), dst_port.unwrap_or(0));
        if record.level() <= log::Level::Info {
            info!(target: "meshpath::datapath", hook, decision, reason, netns, dst_port, "datapath decision");
        } else {
            tracing::debug!(target: "meshpath::datapath", hook, decision, reason, netns, dst_port, "datapath decision");
        }
    }

    fn flush(&self) {}
}

/// Starts forwarding the datapath's log records; returns once the reader is set up.
pub fn spawn(dp: &Datapath) -> anyhow::Result<()> {
    use anyhow::Context as _;
    // Every program of the object shares the one pinned AYA_LOGS: any will lead to it.
    let pin = dp.root().join(pins::PROGRAMS_DIR).join(programs::SK_LOOKUP);
    let prog = SkLookup::from_pin(&pin).context("opening the pinned sk_lookup program")?;
    let id = prog.info().context("reading its id")?.id();
    let logger = aya_log::EbpfLogger::init_from_id_with_logger(id, Forward::new())
        .context("opening the datapath's log ring (AYA_LOGS)")?;
    // SAFETY: the logger owns its ring buffer's fd, which stays open and the same for as long
    // as the logger (moved into the AsyncFd) lives.
    let mut fd = unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) }
        .map_err(|e| anyhow::anyhow!("watching the datapath's log ring: {e}"))?;
    tokio::spawn(async move {
        loop {
            let mut guard = match fd.readable_mut().await {
                Ok(g) => g,
                Err(e) => {
                    warn!(error = %e, "the datapath's log ring failed; no more eBPF logs");
                    return;
                }
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Forward, RECORDS_PER_REASON_PER_SECOND};

    #[test]
    fn reasons_have_their_own_share_and_unknown_codes_share_one() {
        let f = Forward::new();
        let limit = RECORDS_PER_REASON_PER_SECOND as usize;
        let bind = Some(u64::from(datapath_common::decisions::reason::BIND_REFUSED_PROXY_PORT));
        assert_eq!((0..limit * 2).filter(|_| f.admit(bind).0).count(), limit);
        let no_listener = Some(u64::from(datapath_common::decisions::reason::IN_DROP_NO_LISTENER));
        assert!(f.admit(no_listener).0, "another reason's flood took this one's share");
        // Codes no build knows, however many, are one reason.
        let unknown = (0..limit as u64 * 2).filter(|c| f.admit(Some(10_000 + c)).0).count();
        assert_eq!(unknown, limit);
        assert_eq!(
            f.windows.lock().expect("lock").len(),
            datapath_common::decisions::REASONS.len() + 1
        );
    }
}
