//! `meshpath-loader monitor`: one line per datapath decision, live, from the `MONITOR_EVENTS`
//! ring buffer. The programs write it only while `node_flags::MONITOR` is set, which a monitor
//! sets when it starts and clears when it stops (also on SIGINT/SIGTERM), so nobody watching
//! costs the hot path nothing but one array read. One monitor at a time: a ring buffer has one
//! consumer position, so a second reader would take half of the first one's events.

use std::{
    collections::HashMap,
    fs::File,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use aya::maps::{MapData, RingBuf};
use datapath_common::{
    consts::pins,
    decisions::{is_drop, labels, DecisionEvent, NODE_WIDE},
    node_flags, NetnsCookie, PodIpKey,
};
use nix::fcntl::{Flock, FlockArg};

use crate::{datapath::Datapath, pods::key_ip, Error, Result};

/// What to show.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this pod's decisions.
    pub pod: Option<NetnsCookie>,
    /// Only refusals and drops (the programs then send only those).
    pub drops_only: bool,
}

/// One decision as streamed.
#[derive(Debug, Clone)]
pub struct Event {
    pub time: SystemTime,
    pub netns: NetnsCookie,
    /// The pod's name as enrolled, `node` for node-wide decisions, or the cookie of a pod
    /// that has gone since.
    pub pod: String,
    pub hook: &'static str,
    pub decision: &'static str,
    pub why: &'static str,
    /// None where the hook does not know it (connect runs before the source is chosen).
    pub src: Option<SocketAddr>,
    pub dst: Option<SocketAddr>,
}

impl Event {
    /// `time pod hook src -> dst decision (reason)`.
    pub fn line(&self) -> String {
        let at = self.time.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = at.as_secs();
        let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
        let addr = |a: &Option<SocketAddr>| a.map_or_else(|| "*".to_owned(), |a| a.to_string());
        format!(
            "{h:02}:{m:02}:{s:02}.{:06} {} {} {} -> {} {} ({})",
            at.subsec_micros(),
            self.pod,
            self.hook,
            addr(&self.src),
            addr(&self.dst),
            self.decision,
            self.why
        )
    }

    /// The same as one JSON object.
    pub fn json(&self) -> serde_json::Value {
        let at = self.time.duration_since(UNIX_EPOCH).unwrap_or_default();
        serde_json::json!({
            "time": at.as_secs_f64(),
            "pod": self.pod,
            "netns": self.netns,
            "hook": self.hook,
            "decision": self.decision,
            "reason": self.why,
            "src": self.src.map(|a| a.to_string()),
            "dst": self.dst.map(|a| a.to_string()),
        })
    }
}

/// A running monitor: the switch is on while it lives.
pub struct Monitor {
    root: PathBuf,
    ring: RingBuf<MapData>,
    filter: Filter,
    names: HashMap<NetnsCookie, String>,
    /// Wall clock minus CLOCK_MONOTONIC (what `bpf_ktime_get_ns` counts).
    boot: SystemTime,
    _one: Flock<File>,
}

fn monotonic() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32)
}

impl Monitor {
    /// Switches the stream on for the datapath pinned at `root` and starts reading it.
    pub fn start(root: &Path, filter: Filter) -> Result<Self> {
        let maps_dir = root.join(pins::MAPS_DIR);
        let dir = File::open(&maps_dir)
            .map_err(|e| Error::io(format!("opening {}", maps_dir.display()), e))?;
        let one = Flock::lock(dir, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            Error::io(
                "starting the monitor",
                std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!("another monitor is running on this node ({e})"),
                ),
            )
        })?;
        let dp = Datapath::open_existing(root)?;
        let ring = dp.monitor_events()?;
        let set = node_flags::MONITOR
            | if filter.drops_only { node_flags::MONITOR_DROPS_ONLY } else { 0 };
        let clear = if filter.drops_only { 0 } else { node_flags::MONITOR_DROPS_ONLY };
        dp.update_node_flags(set, clear)?;
        let boot = SystemTime::now() - monotonic();
        let mut monitor =
            Self { root: root.to_owned(), ring, filter, names: HashMap::new(), boot, _one: one };
        monitor.refresh_names(&dp);
        // Events left from an earlier monitor that stopped without reading them are old news.
        while monitor.ring.next().is_some() {}
        Ok(monitor)
    }

    fn refresh_names(&mut self, dp: &Datapath) {
        if let Ok(pods) = dp.pods() {
            self.names =
                pods.iter().flatten().map(|(c, info)| (c, info.name().to_owned())).collect();
        }
    }

    /// The next decision that passes the filter, waiting up to `timeout` for one.
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Event>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            loop {
                let ev = {
                    let Some(item) = self.ring.next() else { break };
                    if item.len() < std::mem::size_of::<DecisionEvent>() {
                        continue;
                    }
                    // SAFETY: the programs write whole DecisionEvents (checked length; read
                    // unaligned, the ring gives no alignment guarantee to this side).
                    unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<DecisionEvent>()) }
                };
                if let Some(e) = self.event(ev) {
                    return Ok(Some(e));
                }
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let mut pfd = libc::pollfd {
                fd: self.ring.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: one pollfd we own, for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    return Ok(None);
                }
                return Err(Error::io("waiting for decisions", e));
            }
        }
    }

    fn event(&mut self, ev: DecisionEvent) -> Option<Event> {
        if self.filter.pod.is_some_and(|p| p != ev.netns) {
            return None;
        }
        if self.filter.drops_only && !is_drop(ev.reason) {
            return None;
        }
        let (hook, decision, why) = labels(ev.reason)?;
        if ev.netns != NODE_WIDE && !self.names.contains_key(&ev.netns) {
            if let Ok(dp) = Datapath::open_existing(&self.root) {
                self.refresh_names(&dp);
            }
        }
        let pod = if ev.netns == NODE_WIDE {
            "node".to_owned()
        } else {
            self.names.get(&ev.netns).cloned().unwrap_or_else(|| format!("cookie:{}", ev.netns))
        };
        let addr = |words: [u32; 4], port: u16| -> Option<SocketAddr> {
            let ip = key_ip(PodIpKey { addr: words });
            let unknown =
                port == 0 && (ip.is_unspecified() || ip == IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            (!unknown).then_some(SocketAddr::new(ip, port))
        };
        Some(Event {
            time: self.boot + Duration::from_nanos(ev.ktime_ns),
            netns: ev.netns,
            pod,
            hook,
            decision,
            why,
            src: addr(ev.src, ev.src_port),
            dst: addr(ev.dst, ev.dst_port),
        })
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        match Datapath::open_existing(&self.root) {
            Ok(dp) => {
                if let Err(e) =
                    dp.update_node_flags(0, node_flags::MONITOR | node_flags::MONITOR_DROPS_ONLY)
                {
                    tracing::warn!(error = %e, "could not switch the monitor stream off");
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not switch the monitor stream off"),
        }
    }
}
