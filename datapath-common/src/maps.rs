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
    /// What the datapath does for this pod: [`pod_flags`] bits.
    pub flags: u32,
    /// Inode of the pod's netns (to match it against `/proc/*/ns/net` and `/var/run/netns/*`).
    pub netns_inode: u64,
    /// Pod name (`namespace/name` or the netns path), NUL-padded UTF-8, truncated to fit.
    pub name: [u8; POD_NAME_LEN],
}

/// Bits of [`PodInfo::flags`].
pub mod pod_flags {
    /// Capture the pod's outbound TCP to the proxy's outbound listener.
    pub const CAPTURE_OUTBOUND: u32 = 1 << 0;
    /// Steer TCP arriving at the pod (any port but HBONE's) to the proxy's inbound listener.
    pub const CAPTURE_INBOUND: u32 = 1 << 1;
    /// Let kubelet probes (from [`crate::consts::probe`] addresses) reach the app uncaptured.
    pub const PROBE_BYPASS: u32 = 1 << 2;
    /// Send the pod's DNS (UDP and TCP to port 53) to the proxy's DNS listener.
    pub const CAPTURE_DNS: u32 = 1 << 3;
    /// Read by no program: the node agent's note that the pod's `POD_IPS` keys are exactly the
    /// addresses in its `POD_ADDRS` entry (at most one per family), so taking the pod out
    /// deletes those keys instead of walking `POD_IPS` (a walk per removal made removing a pod
    /// cost more the more pods the node had). Without it, removal walks.
    pub const ADDRESSES_IN_POD_ADDRS: u32 = 1 << 4;
    /// Read by no program: the node agent's note that the pod has no entry in `EXCLUDED_PORTS`,
    /// so taking it out does not walk that map, which holds every pod's excluded ports (a walk
    /// per removal made removing any pod cost more the more exclusions other pods had).
    /// Without it, removal walks.
    pub const NO_EXCLUDED_PORTS: u32 = 1 << 5;
    /// Read by no program: likewise for `EXCLUDED_CIDRS`: the pod has no prefix rule.
    pub const NO_PREFIX_RULES: u32 = 1 << 6;
}

impl PodInfo {
    /// Builds a record with no flags, truncating `name` on a character boundary.
    pub fn new(ifindex: u32, netns_inode: u64, name: &str) -> Self {
        let mut buf = [0u8; POD_NAME_LEN];
        let mut end = name.len().min(POD_NAME_LEN);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        buf[..end].copy_from_slice(&name.as_bytes()[..end]);
        Self { ifindex, flags: 0, netns_inode, name: buf }
    }

    /// The name as text (up to the first NUL).
    pub fn name(&self) -> &str {
        let end = self.name.iter().position(|&b| b == 0).unwrap_or(POD_NAME_LEN);
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

/// `AF_INET`, as the kernel stores it in socket contexts.
pub const AF_INET: u16 = 2;
/// `AF_INET6`.
pub const AF_INET6: u16 = 10;

/// Where a captured connection was going. Addresses and port in network byte order; an IPv4
/// destination is in `addr[0]` with `family` [`AF_INET`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrigDst {
    /// IPv4 in `addr[0]`, or the 16 bytes of an IPv6 address.
    pub addr: [u32; 4],
    /// Destination port, network byte order.
    pub port: u16,
    /// [`AF_INET`] or [`AF_INET6`].
    pub family: u16,
}

/// Finds a captured connection from the proxy's side: the pod's netns, the IP version of the
/// loopback hop and the app's local (ephemeral) port, which is the accepted socket's peer port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnKey {
    /// The pod's netns cookie.
    pub netns: NetnsCookie,
    /// The app socket's local port, host byte order.
    pub port: u16,
    /// 4 or 6: the IP version of the app↔proxy hop (a v4-mapped IPv6 socket counts as 4).
    pub ip_version: u16,
    /// The proxy listener's port the app was sent to (15001, or 15053 for DNS), host order:
    /// two connections may share an app port towards different listeners.
    pub proxy_port: u16,
    /// Zero.
    pub _pad: u16,
}

/// One of a pod's IP addresses, as the kernel hands them to programs (network-order words), an
/// IPv4 address v4-mapped (`::ffff:a.b.c.d`), so both families share one map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodIpKey {
    /// The 16 bytes of the (v4-mapped) IPv6 address.
    pub addr: [u32; 4],
}

impl PodIpKey {
    /// The key of an IPv4 address given as a network-order word.
    pub const fn v4(addr: u32) -> Self {
        Self { addr: [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), addr] }
    }
}

/// A port a pod excludes from capture in one direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortKey {
    /// The pod's netns cookie.
    pub netns: NetnsCookie,
    /// The port, host byte order.
    pub port: u16,
    /// [`direction::OUTBOUND`] or [`direction::INBOUND`].
    pub direction: u16,
    /// Zero.
    pub _pad: u32,
}

/// The data of an `EXCLUDED_CIDRS` longest-prefix key: the pod, the direction, then the address
/// (IPv4 v4-mapped, network-order words). A rule's prefix length always covers the pod and the
/// direction ([`CIDR_FIXED_BITS`]) and then the rule's own prefix of the address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CidrKey {
    /// The pod's netns cookie, native byte order (matched in full).
    pub netns: [u8; 8],
    /// [`direction::OUTBOUND`] (destination address) or [`direction::INBOUND`] (client
    /// address), native byte order, zero-padded.
    pub direction: [u8; 4],
    /// The address, IPv4 v4-mapped.
    pub addr: [u32; 4],
}

/// Bits of a [`CidrKey`] before the address: netns and direction.
pub const CIDR_FIXED_BITS: u32 = 96;
/// Bits of a full [`CidrKey`] (what a lookup uses).
pub const CIDR_KEY_BITS: u32 = CIDR_FIXED_BITS + 128;

impl CidrKey {
    /// The key for `addr` (v4-mapped words) of pod `netns` in `direction`.
    pub const fn new(netns: NetnsCookie, direction: u16, addr: [u32; 4]) -> Self {
        let d = (direction as u32).to_ne_bytes();
        Self { netns: netns.to_ne_bytes(), direction: d, addr }
    }
}

/// Values of `EXCLUDED_CIDRS`: the longest matching prefix decides.
pub mod cidr_action {
    /// Leave traffic to (outbound) or from (inbound) this prefix alone.
    pub const EXCLUDE: u32 = 1;
    /// Capture it after all (carves a hole in a wider excluded prefix).
    pub const CAPTURE: u32 = 2;
}

/// A local TCP connection's end, for the app↔proxy shortcut (`LOCAL_SOCKS`): the netns, both
/// addresses (IPv4 v4-mapped, network-order words) and both ports (host order). The peer of an
/// end is the same key with local and remote swapped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockKey {
    /// The netns cookie.
    pub netns: NetnsCookie,
    /// Local address.
    pub local: [u32; 4],
    /// Remote address.
    pub remote: [u32; 4],
    /// Local port, host order.
    pub local_port: u32,
    /// Remote port, host order.
    pub remote_port: u32,
}

impl SockKey {
    /// The key of the other end of the same connection.
    pub const fn peer(&self) -> Self {
        Self {
            netns: self.netns,
            local: self.remote,
            remote: self.local,
            local_port: self.remote_port,
            remote_port: self.local_port,
        }
    }
}

/// Bits of `NODE_CONFIG[0]`.
pub mod node_flags {
    /// Shortcut the app↔proxy hop with sockops + sk_msg (`LOCAL_SOCKS`).
    pub const ACCELERATE: u32 = 1 << 0;
    /// Stop counting decisions in `DECISIONS` (counting is on by default; off only to measure
    /// what it costs).
    pub const DECISION_COUNTERS_OFF: u32 = 1 << 1;
    /// A monitor is watching: send every decision to `MONITOR_EVENTS`.
    pub const MONITOR: u32 = 1 << 2;
    /// With `MONITOR`: only refusals and drops.
    pub const MONITOR_DROPS_ONLY: u32 = 1 << 3;
    /// aya-log: refusals and drops at info level.
    pub const EBPF_LOG_INFO: u32 = 1 << 4;
    /// aya-log: every decision at debug level (and refusals and drops at info).
    pub const EBPF_LOG_DEBUG: u32 = 1 << 5;
}

/// Directions for [`PortKey::direction`].
pub mod direction {
    /// Traffic the pod's apps start.
    pub const OUTBOUND: u16 = 1;
    /// Traffic that arrives at the pod.
    pub const INBOUND: u16 = 2;
}

/// A connection made inside a pod to one of the pod's own addresses from an address that is not
/// the pod's (a transparent socket: what a proxy opens to reach the app with the client's
/// address). `sock_ops` files it when the connection starts and removes it once the app's end
/// is accepted (or the connecting end closes first); meanwhile sk_lookup lets its handshake
/// reach the app instead of steering it back to the proxy, as
/// istio-cni's rules never redirect a connection made inside the pod to the pod itself.
/// Addresses as in [`PodIpKey`] (IPv4 v4-mapped); ports host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransparentKey {
    /// The app's address (the pod's).
    pub local: [u32; 4],
    /// The client's address the proxy connects from.
    pub remote: [u32; 4],
    /// The app's port.
    pub local_port: u16,
    /// The proxy socket's port.
    pub remote_port: u16,
}

/// A pod's own addresses, one per family (network-order words; all zero: the pod has none of
/// that family). The outbound hook steers an app's connection to the proxy's outbound listener
/// *at the pod's address*, so the connection's source is the pod's address, as under
/// istio-cni's `REDIRECT` (where source selection happened on the original route).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodAddrs {
    /// The pod's IPv6 address.
    pub v6: [u32; 4],
    /// The pod's IPv4 address.
    pub v4: u32,
}

/// The node's end of one of an enrolled pod's links (a veth whose peer is in the pod), by its
/// interface index in the node's netns: which pod it leads to, and the id by which the node's
/// netns knows the pod's (`RTM_GETNSID`), for the node-side guard's socket lookup there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostEnd {
    /// The pod's netns cookie.
    pub netns: NetnsCookie,
    /// The pod's netns id in the node's netns.
    pub nsid: u32,
    /// Zero.
    pub _pad: u32,
}

/// The proxy's inbound listener (15006, or HBONE's 15008) of one pod, port and address family,
/// as `sock_ops` files it when the listener starts listening. A dual-stack `[::]` listener is filed as [`AF_INET6`]
/// and also serves IPv4 lookups when no [`AF_INET`] listener is filed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListenerKey {
    /// The pod's netns cookie.
    pub netns: NetnsCookie,
    /// The listener's port, host order.
    pub port: u16,
    /// The listener socket's family: [`AF_INET`] or [`AF_INET6`].
    pub family: u16,
    /// Zero.
    pub _pad: u32,
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: #[repr(C)] integers with explicit padding fields: every bit pattern is valid.
    unsafe impl aya::Pod for super::OrigDst {}
    unsafe impl aya::Pod for super::ConnKey {}
    unsafe impl aya::Pod for super::PortKey {}
    unsafe impl aya::Pod for super::PodIpKey {}
    unsafe impl aya::Pod for super::CidrKey {}
    unsafe impl aya::Pod for super::SockKey {}
    unsafe impl aya::Pod for super::TransparentKey {}
    unsafe impl aya::Pod for super::PodAddrs {}
    unsafe impl aya::Pod for super::ListenerKey {}
    unsafe impl aya::Pod for super::HostEnd {}
    unsafe impl aya::Pod for crate::decisions::DecisionKey {}
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
        assert_eq!(core::mem::size_of::<OrigDst>(), 20);
        assert_eq!(core::mem::size_of::<ConnKey>(), 16);
        assert_eq!(core::mem::size_of::<PortKey>(), 16);
        assert_eq!(core::mem::size_of::<SockKey>(), 48);
        assert_eq!(core::mem::size_of::<CidrKey>(), 28);
        assert_eq!(core::mem::size_of::<PodAddrs>(), 20);
        assert_eq!(core::mem::size_of::<ListenerKey>(), 16);
        assert_eq!(core::mem::size_of::<HostEnd>(), 16);
    }
}
