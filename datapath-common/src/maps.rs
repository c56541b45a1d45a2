//! Map keys and values. A pod is identified everywhere by its network namespace cookie
//! (`SO_NETNS_COOKIE` from userspace, `bpf_get_netns_cookie` in the kernel): unique for the life
//! of the boot, never reused, and the same value on both sides.

/// The key of every per-pod map: the pod's netns cookie.
pub type NetnsCookie = u64;

/// Packet and byte counters of one pod, from the point of view of the pod's interface. Held per
/// CPU; userspace sums the CPUs.
///
/// TC sees socket buffers, not wire packets: with GSO/GRO one `packets` step can be a
/// super-packet of many segments, and `bytes` is `skb->len` (L2 header included).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    /// Buffers that entered the pod (TC ingress on its interface).
    pub ingress_packets: u64,
    /// Bytes that entered the pod.
    pub ingress_bytes: u64,
    /// Buffers that left the pod (TC egress on its interface).
    pub egress_packets: u64,
    /// Bytes that left the pod.
    pub egress_bytes: u64,
}

impl PodCounters {
    /// Field-wise sum, for adding up per-CPU values.
    pub fn saturating_add(self, o: Self) -> Self {
        Self {
            ingress_packets: self.ingress_packets.saturating_add(o.ingress_packets),
            ingress_bytes: self.ingress_bytes.saturating_add(o.ingress_bytes),
            egress_packets: self.egress_packets.saturating_add(o.egress_packets),
            egress_bytes: self.egress_bytes.saturating_add(o.egress_bytes),
        }
    }
}

/// Length of [`PodInfo::name`].
pub const POD_NAME_LEN: usize = 64;

/// What the node knows about one enrolled pod. Kept in a pinned map so that a restarted loader
/// rebuilds its state from the kernel, not from a file that could disagree with it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodInfo {
    /// Index of the pod's interface inside its netns.
    pub ifindex: u32,
    /// Reserved; zero.
    pub flags: u32,
    /// Inode of the pod's netns (to match it against `/proc/*/ns/net` and `/var/run/netns/*`).
    pub netns_inode: u64,
    /// Pod name (`namespace/name` or the netns path), NUL-padded UTF-8, truncated to fit.
    pub name: [u8; POD_NAME_LEN],
}

impl PodInfo {
    /// Builds a record, truncating `name` on a character boundary.
    pub fn new(ifindex: u32, netns_inode: u64, name: &str) -> Self {
        let mut buf = [0u8; POD_NAME_LEN];
        let mut end = name.len().min(POD_NAME_LEN);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        buf[..end].copy_from_slice(&name.as_bytes()[..end]);
        Self {
            ifindex,
            flags: 0,
            netns_inode,
            name: buf,
        }
    }

    /// The name as text (up to the first NUL).
    pub fn name(&self) -> &str {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(POD_NAME_LEN);
        match core::str::from_utf8(&self.name[..end]) {
            Ok(s) => s,
            Err(e) => {
                // Only reachable if something else wrote the map: show the valid prefix.
                let valid = e.valid_up_to();
                core::str::from_utf8(&self.name[..valid]).unwrap_or_default()
            }
        }
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: both types are #[repr(C)], made only of integers and byte arrays, with no padding
    // (u32+u32+u64+[u8;64] and 4×u64), so every bit pattern is valid.
    unsafe impl aya::Pod for super::PodCounters {}
    unsafe impl aya::Pod for super::PodInfo {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn pod_info_name_round_trips() {
        assert_eq!(PodInfo::new(3, 7, "default/web-0").name(), "default/web-0");
    }

    #[test]
    fn pod_info_name_truncates_on_a_char_boundary() {
        let long = "é".repeat(40); // 80 bytes
        let info = PodInfo::new(1, 1, &long);
        assert_eq!(info.name(), "é".repeat(32));
    }

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(core::mem::size_of::<PodCounters>(), 32);
        assert_eq!(core::mem::size_of::<PodInfo>(), 16 + POD_NAME_LEN);
    }
}
