//! `meshpath-loader doctor`: checks, one line each, every kernel feature the datapath relies on,
//! with the first Linux version that has it, and says what to do about a missing one. A feature
//! the datapath can do without (it falls back) is reported as such, not as missing.
//!
//! Measured (docs/kernels.md): the whole datapath loads and captures on Debian's 6.1 and 6.12
//! and on 6.18; below 6.6 only the TC counters differ (netlink clsact filters instead of TCX).

use std::path::Path;

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{is_helper_supported, is_map_supported, is_program_supported, BpfHelper},
    util::KernelVersion,
};

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Present.
    Ok,
    /// Absent, and the datapath does without it this way.
    Fallback(String),
    /// Absent, and capture needs it: what to do.
    Missing(String),
    /// Present but off, because the kernel cannot do it correctly: why.
    Off(String),
}

/// One check's outcome.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked.
    pub what: String,
    /// The first Linux version that has it (upstream), when one applies.
    pub since: Option<&'static str>,
    /// What was found.
    pub status: Status,
}

impl Check {
    fn required(what: impl Into<String>, since: Option<&'static str>, ok: bool, fix: &str) -> Self {
        let status = if ok { Status::Ok } else { Status::Missing(fix.to_owned()) };
        Self { what: what.into(), since, status }
    }

    /// Whether capture cannot work without what this check found missing.
    pub fn is_missing(&self) -> bool {
        matches!(self.status, Status::Missing(_))
    }

    /// The one line `doctor` prints.
    pub fn line(&self, kernel: &str) -> String {
        let since = self.since.map(|v| format!(" (Linux {v}+)")).unwrap_or_default();
        match &self.status {
            Status::Ok => format!("ok       {}{since}", self.what),
            Status::Fallback(how) => {
                format!("fallback {}{since}: not in this kernel ({kernel}); {how}", self.what)
            }
            Status::Missing(fix) => format!("MISSING  {}{since}: {fix}", self.what),
            Status::Off(why) => format!("off      {}{since}: {why}", self.what),
        }
    }
}

/// This kernel's version as `doctor` names it.
pub fn kernel() -> String {
    KernelVersion::current().map_or_else(|_| "unknown".to_owned(), |k| k.to_string())
}

fn at_least(major: u8, minor: u8) -> bool {
    KernelVersion::current().is_ok_and(|k| k >= KernelVersion::new(major, minor, 0))
}

/// Why the app↔proxy socket shortcut (sockops + sk_msg, `accelerate on`) stays off on every
/// kernel meshpath runs on: two defects of the kernel's `tcp_bpf` (net/ipv4/tcp_bpf.c), both
/// measured on 6.1, 6.12 and 6.18 and both unchanged upstream (docs/datapath.md, issue 36).
pub const SHORTCUT_DEFECTS: &str = "the kernel's sk_msg redirect into the proxy's socket has no \
     flow control (a pod writing faster than the proxy forwards queues without bound, up to the \
     node's whole tcp_mem, then gets ENOMEM, and every TCP socket on the node is under memory \
     pressure meanwhile), and a blocking read on a paired socket returns EAGAIN when a wake-up \
     brings no data (the socket's own shutdown(SHUT_WR) does it)";

/// Runs every check.
pub fn run() -> Vec<Check> {
    let mut out = Vec::new();
    out.push(Check {
        what: "app-proxy socket shortcut (sockops + sk_msg)".into(),
        since: None,
        status: Status::Off(format!("{SHORTCUT_DEFECTS}; no kernel fixes either yet")),
    });
    let newer = |v: &str| format!("run Linux {v} or newer");
    out.push(Check {
        what: "TCX links for the per-pod TC counters".into(),
        since: Some("6.6"),
        status: if at_least(6, 6) {
            Status::Ok
        } else {
            Status::Fallback("the counters attach as netlink filters on a clsact qdisc".into())
        },
    });
    out.push(Check::required(
        "BTF at /sys/kernel/btf/vmlinux",
        Some("5.4"),
        Path::new("/sys/kernel/btf/vmlinux").exists(),
        "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
    ));
    let bpffs = nix::sys::statfs::statfs("/sys/fs/bpf")
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC);
    out.push(Check::required(
        "bpffs mounted at /sys/fs/bpf",
        None,
        bpffs,
        "mount -t bpf bpf /sys/fs/bpf (the loader also does this)",
    ));
    let cgroup = crate::datapath::cgroup2_root();
    out.push(Check::required(
        format!("cgroup v2 mounted{}", cgroup.as_ref().map(|p| format!(" at {}", p.display())).unwrap_or_default()),
        None,
        cgroup.is_ok(),
        "mount cgroup2 (e.g. mount -t cgroup2 none /sys/fs/cgroup) or boot with systemd.unified_cgroup_hierarchy=1",
    ));
    out.push(Check::required(
        "SO_NETNS_COOKIE",
        Some("5.14"),
        crate::netns::read_cookie().is_ok(),
        &newer("5.14"),
    ));
    // A helper's version only where it is known exactly; the program type's is the floor.
    type Helpers = &'static [(BpfHelper, Option<&'static str>)];
    let programs: [(ProgramType, &str, &'static str, Helpers); 6] = [
        (ProgramType::SchedClassifier, "sched_cls (TC counters)", "4.1", &[]),
        (
            ProgramType::CgroupSockAddr,
            "cgroup_sock_addr (connect, sendmsg, recvmsg, getpeername)",
            "5.8",
            &[
                (BpfHelper::BPF_FUNC_get_netns_cookie, Some("5.7")),
                (BpfHelper::BPF_FUNC_sk_storage_get, None),
                (BpfHelper::BPF_FUNC_get_current_cgroup_id, Some("5.7")),
            ],
        ),
        (
            ProgramType::SockOps,
            "sock_ops",
            "4.13",
            &[
                (BpfHelper::BPF_FUNC_get_netns_cookie, Some("5.15")),
                (BpfHelper::BPF_FUNC_sk_storage_get, None),
            ],
        ),
        (ProgramType::SkMsg, "sk_msg (local hop shortcut)", "4.17", &[]),
        (
            ProgramType::CgroupSockopt,
            "cgroup_sockopt (SO_ORIGINAL_DST)",
            "5.3",
            &[
                (BpfHelper::BPF_FUNC_get_netns_cookie, Some("5.15")),
                (BpfHelper::BPF_FUNC_get_current_cgroup_id, None),
                (BpfHelper::BPF_FUNC_sk_storage_get, None),
            ],
        ),
        (
            ProgramType::SkLookup,
            "sk_lookup (inbound, with ingress_ifindex)",
            "5.17",
            &[(BpfHelper::BPF_FUNC_sk_assign, Some("5.9"))],
        ),
    ];
    for (ty, name, since_prog, helpers) in programs {
        let supported = is_program_supported(ty).unwrap_or(false);
        out.push(Check::required(
            format!("program type {name}"),
            Some(since_prog),
            supported,
            &format!(
                "enable CONFIG_BPF_SYSCALL, CONFIG_CGROUP_BPF, CONFIG_NET_CLS_BPF and {}",
                newer(since_prog)
            ),
        ));
        for &(helper, since) in helpers {
            let ok = supported && is_helper_supported(ty, helper).unwrap_or(false);
            out.push(Check::required(
                format!("helper {helper:?} in {name}"),
                since,
                ok,
                &newer(since.unwrap_or(since_prog)),
            ));
        }
    }
    for (ty, name, since) in [
        (MapType::Hash, "hash", "3.19"),
        (MapType::PerCpuHash, "per-CPU hash", "4.6"),
        (MapType::LruHash, "LRU hash", "4.10"),
        (MapType::LpmTrie, "LPM trie", "4.11"),
        (MapType::SockHash, "sockhash", "4.18"),
        (MapType::RingBuf, "ring buffer (decision monitor, eBPF logs)", "5.8"),
        (MapType::SkStorage, "socket storage (original destinations)", "5.2"),
    ] {
        out.push(Check::required(
            format!("map type {name}"),
            Some(since),
            is_map_supported(ty).unwrap_or(false),
            &newer(since),
        ));
    }
    out
}

/// What this kernel lacks that capture needs, one phrase per feature, for start-up errors
/// (empty when nothing is missing).
pub fn missing_summary() -> String {
    let missing: Vec<String> = run()
        .into_iter()
        .filter(Check::is_missing)
        .map(|c| match c.since {
            Some(v) => format!("{} (Linux {v}+)", c.what),
            None => c.what,
        })
        .collect();
    if missing.is_empty() {
        String::new()
    } else {
        format!("this kernel (Linux {}) lacks: {}", kernel(), missing.join("; "))
    }
}

/// `e` (a datapath that failed to load or attach), with what this kernel lacks when doctor
/// finds anything: the exact feature and the kernel version, as `doctor` would print them.
pub fn explain(e: crate::Error) -> anyhow::Error {
    let summary = missing_summary();
    let e = anyhow::Error::new(e);
    if summary.is_empty() {
        e
    } else {
        e.context(format!("{summary} (run `meshpath-loader doctor`)"))
    }
}
