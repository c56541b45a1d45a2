//! `--ebpf-log off|info|debug`: the datapath's aya-log records, forwarded into the agent's
//! `tracing` output. The level is a switch in `NODE_CONFIG` the programs read on every decision,
//! so it changes at run time and costs nothing when off (the default): the programs write no
//! record unless asked. Records carry numbers (`decision=<reason code> netns=… dst_port=…`);
//! this side names the reason from datapath_common's one table and logs structured fields.

use std::str::FromStr;

use aya::programs::SkLookup;
use datapath_common::{
    consts::{pins, programs},
    decisions::labels,
    node_flags,
};
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

/// Turns the datapath's records into `tracing` events (target `meshpath::datapath`).
struct Forward;

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
        let (Some(code), netns, dst_port) = (field("decision"), field("netns"), field("dst_port"))
        else {
            info!(target: "meshpath::datapath", "{text}");
            return;
        };
        let (hook, decision, reason) =
            u32::try_from(code).ok().and_then(labels).unwrap_or(("?", "?", "unknown reason code"));
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
    let logger = aya_log::EbpfLogger::init_from_id_with_logger(id, Forward)
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
