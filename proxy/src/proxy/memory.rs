//! The node-wide connection cap a proxy takes when none is given: what the memory limit it
//! runs under (its cgroup's) can hold, so that the cap refuses connections before the kernel
//! kills the proxy, with every connection of every pod on the node, for running out of it.
//! Anyone who can reach a pod can open connections; without this, a 1 GiB limit held some
//! 70,000 idle connections while the cap allowed 200,000.

/// Memory a connection may cost that a peer can make it cost while holding it: its socket
/// buffers in the proxy's accounting, a read buffer while bytes arrive (64 KiB under TLS),
/// TLS and HTTP/2 state. An idle connection costs 13 to 15 KiB (docs/deploy.md, "The proxy's
/// memory"); a peer that trickles bytes keeps the larger buffers in use.
pub const PER_CONNECTION_BYTES: u64 = 64 * 1024;
/// Kept out of the budget: the proxy itself (its pods' listeners and certificates, the store,
/// the pool) and the allocator's slack.
pub const RESERVED_BYTES: u64 = 64 * 1024 * 1024;
/// The cap without a memory limit (or when it cannot be read).
pub const UNLIMITED_CAP: usize = 200_000;
/// The least cap derived, whatever the limit.
pub const MIN_CAP: usize = 1_000;

/// The cap for a memory limit of `limit` bytes: three quarters of what is left after
/// [`RESERVED_BYTES`], in [`PER_CONNECTION_BYTES`], between [`MIN_CAP`] and [`UNLIMITED_CAP`].
pub fn cap_for(limit: Option<u64>) -> usize {
    let Some(limit) = limit else { return UNLIMITED_CAP };
    let usable = limit.saturating_sub(RESERVED_BYTES) / 4 * 3;
    usize::try_from(usable / PER_CONNECTION_BYTES)
        .unwrap_or(usize::MAX)
        .clamp(MIN_CAP, UNLIMITED_CAP)
}

/// The memory limit this process runs under: the smallest `memory.max` (cgroup v2) or
/// `memory.limit_in_bytes` (cgroup v1) from its cgroup up to the hierarchy's root. `None`:
/// no limit, or none that can be read.
pub fn own_limit() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    limit_in(&cgroups, &mountinfo, &|p| std::fs::read_to_string(p).ok())
}

/// [`own_limit`] over the given /proc/self/cgroup and /proc/self/mountinfo, reading files with
/// `read`.
fn limit_in(
    cgroups: &str,
    mountinfo: &str,
    read: &dyn Fn(&std::path::Path) -> Option<String>,
) -> Option<u64> {
    let mut limits = Vec::new();
    for line in cgroups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let (v2, file) = if controllers.is_empty() {
            (true, "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (false, "memory.limit_in_bytes")
        } else {
            continue;
        };
        // The mount of that hierarchy, and the cgroup path its root is.
        let Some((point, root)) = mountinfo.lines().find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let fields: Vec<&str> = pre.split_whitespace().collect();
            let mut post = post.split_whitespace();
            let fstype = post.next()?;
            let options = post.nth(1).unwrap_or_default();
            let ours = if v2 {
                fstype == "cgroup2"
            } else {
                fstype == "cgroup" && options.split(',').any(|o| o == "memory")
            };
            if !ours {
                return None;
            }
            Some((std::path::PathBuf::from(fields.get(4)?), fields.get(3)?.to_string()))
        }) else {
            continue;
        };
        let rel = path.strip_prefix(root.as_str()).unwrap_or(path).trim_start_matches('/');
        let mut dir = point.join(rel);
        loop {
            if let Some(v) = read(&dir.join(file)).and_then(|t| t.trim().parse::<u64>().ok()) {
                // cgroup v1 writes "no limit" as a page-rounded i64::MAX.
                if v < (1 << 62) {
                    limits.push(v);
                }
            }
            if dir == point || !dir.pop() {
                break;
            }
        }
    }
    limits.into_iter().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_what_the_limit_holds_within_bounds() {
        assert_eq!(cap_for(None), UNLIMITED_CAP);
        // 1 GiB: (1024 - 64) MiB × 3/4 = 720 MiB, at 64 KiB a connection.
        assert_eq!(cap_for(Some(1 << 30)), 11_520);
        assert_eq!(cap_for(Some(64 << 20)), MIN_CAP);
        assert_eq!(cap_for(Some(1 << 40)), UNLIMITED_CAP);
    }

    #[test]
    fn the_smallest_limit_from_the_cgroup_up_counts_in_v2_and_v1() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let files = |p: &std::path::Path| -> Option<String> {
            match p.to_str()? {
                "/sys/fs/cgroup/unified/kubepods/pod1/c1/memory.max" => Some("max\n".into()),
                "/sys/fs/cgroup/unified/kubepods/pod1/memory.max" => Some("536870912\n".into()),
                "/sys/fs/cgroup/memory/kubepods/pod1/c1/memory.limit_in_bytes" => {
                    Some("9223372036854771712\n".into())
                }
                "/sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes" => Some("1073741824".into()),
                _ => None,
            }
        };
        let v2 = "0::/kubepods/pod1/c1\n";
        assert_eq!(limit_in(v2, mountinfo, &files), Some(536_870_912));
        let v1 = "4:memory:/kubepods/pod1/c1\n";
        assert_eq!(limit_in(v1, mountinfo, &files), Some(1_073_741_824));
        assert_eq!(limit_in("4:memory:/other\n", mountinfo, &files), None);
    }

    #[test]
    fn inside_a_cgroup_namespace_the_mount_root_is_the_cgroup_itself() {
        // A container: its cgroup is "/" in its namespace, and the mount shows it at the top.
        let mountinfo = "40 30 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let files = |p: &std::path::Path| -> Option<String> {
            (p.to_str()? == "/sys/fs/cgroup/memory.max").then(|| "268435456".into())
        };
        assert_eq!(limit_in("0::/\n", mountinfo, &files), Some(268_435_456));
    }
}
