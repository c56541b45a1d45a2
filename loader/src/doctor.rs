//! `meshpath-loader doctor`: checks, one line each, every kernel feature the datapath relies on,
//! and says what to do about a missing one.

use std::path::Path;

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{is_helper_supported, is_map_supported, is_program_supported, BpfHelper},
    util::KernelVersion,
};

/// One check's outcome.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked.
    pub what: String,
    /// None when fine, else what to do.
    pub fix: Option<String>,
}

fn check(what: impl Into<String>, ok: bool, fix: impl Into<String>) -> Check {
    Check { what: what.into(), fix: (!ok).then(|| fix.into()) }
}

/// Runs every check.
pub fn run() -> Vec<Check> {
    let mut out = Vec::new();
    let kernel = KernelVersion::current().ok();
    out.push(check(
        format!(
            "kernel {} (TCX and sk_lookup ingress_ifindex need 6.6)",
            kernel.map_or("unknown".into(), |k| k.to_string())
        ),
        kernel.is_some_and(|k| k >= KernelVersion::new(6, 6, 0)),
        "run a Linux 6.6 or newer kernel",
    ));
    out.push(check(
        "BTF at /sys/kernel/btf/vmlinux",
        Path::new("/sys/kernel/btf/vmlinux").exists(),
        "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
    ));
    let bpffs = nix::sys::statfs::statfs("/sys/fs/bpf")
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC);
    out.push(check(
        "bpffs mounted at /sys/fs/bpf",
        bpffs,
        "mount -t bpf bpf /sys/fs/bpf (the loader also does this)",
    ));
    let cgroup = crate::datapath::cgroup2_root();
    out.push(check(
        format!("cgroup v2 mounted{}", cgroup.as_ref().map(|p| format!(" at {}", p.display())).unwrap_or_default()),
        cgroup.is_ok(),
        "mount cgroup2 (e.g. mount -t cgroup2 none /sys/fs/cgroup) or boot with systemd.unified_cgroup_hierarchy=1",
    ));
    out.push(check(
        "SO_NETNS_COOKIE",
        crate::netns::read_cookie().is_ok(),
        "run a Linux 5.14 or newer kernel",
    ));
    for (ty, name, helpers) in [
        (ProgramType::SchedClassifier, "sched_cls (TC counters)", &[][..]),
        (
            ProgramType::CgroupSockAddr,
            "cgroup_sock_addr (connect, sendmsg, recvmsg, getpeername)",
            &[
                BpfHelper::BPF_FUNC_get_netns_cookie,
                BpfHelper::BPF_FUNC_get_socket_cookie,
                BpfHelper::BPF_FUNC_get_current_cgroup_id,
            ][..],
        ),
        (
            ProgramType::SockOps,
            "sock_ops",
            &[BpfHelper::BPF_FUNC_get_netns_cookie, BpfHelper::BPF_FUNC_get_socket_cookie][..],
        ),
        (
            ProgramType::CgroupSockopt,
            "cgroup_sockopt (SO_ORIGINAL_DST)",
            &[BpfHelper::BPF_FUNC_get_netns_cookie, BpfHelper::BPF_FUNC_get_current_cgroup_id][..],
        ),
        (ProgramType::SkLookup, "sk_lookup (inbound)", &[BpfHelper::BPF_FUNC_sk_assign][..]),
    ] {
        let supported = is_program_supported(ty).unwrap_or(false);
        out.push(check(format!("program type {name}"), supported, "enable CONFIG_BPF_SYSCALL, CONFIG_CGROUP_BPF, CONFIG_NET_CLS_BPF and run a newer kernel"));
        for &helper in helpers {
            let ok = supported && is_helper_supported(ty, helper).unwrap_or(false);
            out.push(check(format!("helper {helper:?} in {name}"), ok, "run a newer kernel"));
        }
    }
    for (ty, name) in [
        (MapType::Hash, "hash"),
        (MapType::PerCpuHash, "per-CPU hash"),
        (MapType::LruHash, "LRU hash"),
        (MapType::SockHash, "sockhash"),
    ] {
        out.push(check(
            format!("map type {name}"),
            is_map_supported(ty).unwrap_or(false),
            "run a newer kernel",
        ));
    }
    out
}
