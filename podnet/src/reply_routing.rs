//! The reply routing a meshed pod's netns needs for the proxy's transparent connections to the
//! pod's apps (the proxy connecting with the client's address as source, as ztunnel does). The
//! datapath marks such a connection's socket `marks::REPLY` (0x111) from `sock_ops`;
//! `tcp_fwmark_accept` gives the app's accepted socket the SYN's mark (`fwmark_reflect` does the
//! same for the kernel's resets and ICMP errors); the rule `fwmark 0x111/0xfff lookup 133`
//! sends that mark to table 133, whose one route is `local` on `lo`: the app's replies come
//! back to the proxy instead of leaving for the real client. It is istio-cni's table-100 rule,
//! keyed on the same value; no netfilter rule, no conntrack. The proxy's own mark (ztunnel's
//! 0x539) has no rule: its HBONE, passthrough and 15008 packets route normally.
//!
//! Run inside the pod's netns (see `netns::Netns::run`). The node agent sets it up when it
//! enrols a pod and removes it when the pod leaves the mesh; the proxy never needs to.

use std::io;

use datapath_common::consts::marks;

use crate::rtnetlink::{Family, FwmarkRule, Socket};

/// The sysctls set to 1 in the pod, below /proc/sys (IPv4; IPv6 shares `tcp_fwmark_accept`
/// with IPv4).
const SYSCTLS_V4: [&str; 2] = ["net/ipv4/tcp_fwmark_accept", "net/ipv4/fwmark_reflect"];
const SYSCTL_V6: &str = "net/ipv6/fwmark_reflect";

/// Writes a network sysctl of the calling thread's netns (`/proc/sys/net` always shows the
/// netns of the task that opens it, whichever procfs mount it goes through). In a container
/// the runtime mounts /proc/sys read-only (unless privileged): the same file is then written
/// through a procfs of this process's own, mounted once under the temporary directory (the
/// agent's DaemonSet grants CAP_SYS_ADMIN for setns already; the mount lives and dies with its
/// container).
fn write_sysctl(rel: &str, value: &str) -> io::Result<()> {
    let direct = format!("/proc/sys/{rel}");
    match std::fs::write(&direct, value) {
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => {
            let own = own_procfs()
                .map_err(|e2| io::Error::new(e2.kind(), format!("{direct}: {e}; {e2}")))?;
            let path = own.join("sys").join(rel);
            std::fs::write(&path, value).map_err(|e2| {
                io::Error::new(e2.kind(), format!("{direct}: {e}; {}: {e2}", path.display()))
            })
        }
        r => r.map_err(|e| io::Error::new(e.kind(), format!("{direct}: {e}"))),
    }
}

/// A writable procfs of this process's own (see [`write_sysctl`]), mounted on first use.
fn own_procfs() -> io::Result<std::path::PathBuf> {
    static MOUNTED: std::sync::OnceLock<Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    MOUNTED
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("meshpath-procfs-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            nix::mount::mount(
                Some("proc"),
                &dir,
                Some("proc"),
                nix::mount::MsFlags::MS_NOSUID
                    | nix::mount::MsFlags::MS_NODEV
                    | nix::mount::MsFlags::MS_NOEXEC,
                None::<&str>,
            )
            .map_err(|e| format!("mounting a procfs at {} (for sysctls): {e}", dir.display()))?;
            Ok(dir)
        })
        .clone()
        .map_err(io::Error::other)
}

/// `fwmark 0x111/0xfff lookup 133` for `family`.
fn rule(family: Family) -> FwmarkRule {
    FwmarkRule {
        family,
        mark: marks::REPLY,
        mask: marks::REPLY_MASK,
        table: marks::REPLY_TABLE,
        priority: None,
    }
}

/// Sets it up in the calling thread's netns. `Ok(None)`: IPv4 and IPv6; `Ok(Some(why))`: IPv4
/// only (the pod has no IPv6, or it failed); `Err`: not even IPv4. Idempotent.
pub fn set_up() -> io::Result<Option<String>> {
    for knob in SYSCTLS_V4 {
        write_sysctl(knob, "1")?;
    }
    let mut rtnl = Socket::open().map_err(|e| context("opening rtnetlink", e))?;
    install(&mut rtnl, Family::V4).map_err(|e| context("IPv4", e))?;
    let v6 = write_sysctl(SYSCTL_V6, "1")
        .and_then(|()| install(&mut rtnl, Family::V6).map_err(|e| context("IPv6", e)));
    Ok(v6.err().map(|e| e.to_string()))
}

/// Removes the rule and the table's route (the sysctls stay: with no marked socket they change
/// nothing). Missing pieces are not errors.
pub fn remove() -> io::Result<()> {
    let mut rtnl = Socket::open().map_err(|e| context("opening rtnetlink", e))?;
    uninstall(&mut rtnl, Family::V4).map_err(|e| context("IPv4", e))?;
    // A pod without IPv6 has nothing to remove there.
    let _ = uninstall(&mut rtnl, Family::V6);
    Ok(())
}

/// Whether it is in place for IPv4 (read-only checks).
pub fn is_set_up() -> bool {
    let accept = std::fs::read_to_string(format!("/proc/sys/{}", SYSCTLS_V4[0]))
        .is_ok_and(|v| v.trim() == "1");
    let want = rule(Family::V4);
    accept
        && Socket::open().and_then(|mut s| s.fwmark_rules(Family::V4)).is_ok_and(|rules| {
            rules.iter().any(|r| (r.mark, r.mask, r.table) == (want.mark, want.mask, want.table))
        })
}

/// `0x111/0xfff`.
pub fn mark() -> String {
    format!("{:#x}/{:#x}", marks::REPLY, marks::REPLY_MASK)
}

/// The rule deleted first (adding would duplicate it), then added, and the table's route.
fn install(rtnl: &mut Socket, family: Family) -> io::Result<()> {
    rtnl.delete_rule(&rule(family))?;
    rtnl.add_rule(&rule(family))?;
    rtnl.replace_local_default(family, marks::REPLY_TABLE)
}

fn uninstall(rtnl: &mut Socket, family: Family) -> io::Result<()> {
    rtnl.delete_rule(&rule(family))?;
    rtnl.delete_local_default(family, marks::REPLY_TABLE)?;
    Ok(())
}

fn context(what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}
