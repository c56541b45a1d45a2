//! Named constants: Istio ambient's ports and marks (which meshpath keeps), and meshpath's own
//! bpffs layout.

/// Istio ambient's per-pod and node ports (ztunnel's conventions).
pub mod ports {
    /// Outbound capture listener inside each pod's netns.
    pub const OUTBOUND: u16 = 15001;
    /// Inbound plaintext capture listener inside each pod's netns.
    pub const INBOUND_PLAINTEXT: u16 = 15006;
    /// HBONE (HTTP/2 CONNECT over mTLS) listener inside each pod's netns.
    pub const HBONE: u16 = 15008;
    /// DNS capture listener inside each pod's netns.
    pub const DNS: u16 = 15053;
    /// The port DNS clients send to, which DNS capture steers to [`DNS`].
    pub const DNS_UPSTREAM: u16 = 53;
    /// Node proxy admin endpoint (localhost only).
    pub const ADMIN: u16 = 15000;
    /// Prometheus `/metrics`.
    pub const METRICS: u16 = 15020;
    /// `/healthz/ready`.
    pub const READINESS: u16 = 15021;
}

/// Kubelet health probes: istio-cni SNATs them on the host to these link-local sources, and the
/// pod lets them reach the app uncaptured.
pub mod probe {
    /// IPv4 source of kubelet probes: 169.254.7.127.
    pub const SOURCE_V4: [u8; 4] = [169, 254, 7, 127];
    /// IPv6 source of kubelet probes: fd16:9254:7127:1337:ffff:ffff:ffff:ffff.
    pub const SOURCE_V6: [u8; 16] = [
        0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        0xff,
    ];
}

/// Socket marks istio-cni uses. meshpath does not trust marks for bypass (an app with
/// CAP_NET_ADMIN can set them); they are named here so tests and docs can refer to them.
pub mod marks {
    /// The mark ztunnel sets on its own sockets under istio-cni; meshpath's proxy sets it on
    /// its transparent sockets to the app, and the pod's replies to them carry it too
    /// (`tcp_fwmark_accept`), which routes them back to the proxy (see [`REPLY_TABLE`]).
    pub const PROXY_SOCKET: u32 = 0x539;
    /// The routing table, in a pod's netns, that delivers marked replies locally (istio-cni's
    /// table number for the same job).
    pub const REPLY_TABLE: u32 = 133;
    /// Mask istio-cni applies to [`PROXY_SOCKET`].
    pub const PROXY_SOCKET_MASK: u32 = 0xfff;
    /// istio-cni's reply-routing connmark.
    pub const REPLY_CONNMARK: u32 = 0x111;
}

/// Names of the programs in the eBPF object, as the loader looks them up. The TC programs are
/// loaded once per pod (see [`globals::POD_COOKIE`]).
pub mod programs {
    /// TC (TCX) program on a pod's interface, ingress direction (traffic into the pod).
    pub const TC_POD_INGRESS: &str = "tc_pod_ingress";
    /// TC (TCX) program on a pod's interface, egress direction (traffic out of the pod).
    pub const TC_POD_EGRESS: &str = "tc_pod_egress";
    /// cgroup/connect4: redirects a captured pod's IPv4 TCP connect() to the outbound listener.
    pub const CONNECT4: &str = "mp_connect4";
    /// cgroup/connect6: the same for IPv6 (and v4-mapped) sockets.
    pub const CONNECT6: &str = "mp_connect6";
    /// cgroup/getpeername4: shows the app the destination it asked for.
    pub const GETPEERNAME4: &str = "mp_getpeername4";
    /// cgroup/getpeername6.
    pub const GETPEERNAME6: &str = "mp_getpeername6";
    /// sock_ops: records a captured connection under its local port once it is established.
    pub const SOCK_OPS: &str = "mp_sock_ops";
    /// cgroup/getsockopt: answers SO_ORIGINAL_DST / IP6T_SO_ORIGINAL_DST for captured sockets.
    pub const GETSOCKOPT: &str = "mp_getsockopt";
    /// sk_lookup in the pod's netns: steers inbound TCP to the proxy's inbound listener. Loaded
    /// once per node and linked into each pod's netns; it finds the pod by the destination
    /// address in `POD_IPS`.
    pub const SK_LOOKUP: &str = "mp_sk_lookup";
    /// sk_msg on `LOCAL_SOCKS`: hands a message straight to the other end's receive queue.
    pub const SK_MSG: &str = "mp_sk_msg";
    /// sk_lookup that passes everything: linked into pods without inbound capture, where the
    /// link only marks the netns as alive (the kernel detaches it when the netns dies).
    pub const SK_LOOKUP_PASS: &str = "mp_sk_lookup_pass";
    /// cgroup/sendmsg4: DNS datagrams to the proxy's DNS listener.
    pub const SENDMSG4: &str = "mp_sendmsg4";
    /// cgroup/sendmsg6.
    pub const SENDMSG6: &str = "mp_sendmsg6";
    /// cgroup/recvmsg4: DNS replies shown as coming from the server queried.
    pub const RECVMSG4: &str = "mp_recvmsg4";
    /// cgroup/recvmsg6.
    pub const RECVMSG6: &str = "mp_recvmsg6";
    /// Every node-wide cgroup program, in the order the loader attaches them: the ones that
    /// start capturing (connect, sendmsg) last, once everything they rely on is in place.
    pub const CGROUP: [&str; 10] = [
        SOCK_OPS,
        GETSOCKOPT,
        GETPEERNAME4,
        GETPEERNAME6,
        RECVMSG4,
        RECVMSG6,
        CONNECT4,
        CONNECT6,
        SENDMSG4,
        SENDMSG6,
    ];
}

/// Names of load-time constants (`aya_ebpf::Global`) in the eBPF object.
pub mod globals {
    /// The netns cookie of the pod a per-pod program instance serves.
    pub const POD_COOKIE: &str = "POD_COOKIE";
}

/// Names of the maps in the eBPF object (also their pin file names under [`pins::MAPS_DIR`]).
pub mod map_names {
    /// [`crate::PodCounters`] per pod, per CPU, keyed by the pod's netns cookie.
    pub const POD_COUNTERS: &str = "POD_COUNTERS";
    /// [`crate::PodInfo`] per enrolled pod, keyed by the pod's netns cookie.
    pub const PODS: &str = "PODS";
    /// cgroup ids whose sockets are never captured (the proxy's), value unused.
    pub const PROXY_CGROUPS: &str = "PROXY_CGROUPS";
    /// [`crate::OrigDst`] by the app socket's cookie (LRU).
    pub const ORIG_DST_BY_SOCKET: &str = "ORIG_DST_BY_SOCKET";
    /// [`crate::OrigDst`] by [`crate::ConnKey`] (LRU), for the proxy's getsockopt.
    pub const ORIG_DST_BY_CONN: &str = "ORIG_DST_BY_CONN";
    /// Ports excluded from capture, by [`crate::PortKey`], value unused.
    pub const EXCLUDED_PORTS: &str = "EXCLUDED_PORTS";
    /// SOCKHASH of both ends of captured app↔proxy connections, by [`crate::SockKey`].
    pub const LOCAL_SOCKS: &str = "LOCAL_SOCKS";
    /// The node's netns cookie (one `u64`; 0: probe source rewriting off).
    pub const NODE_NETNS: &str = "NODE_NETNS";
    /// Node-wide switches (one `u32` of [`crate::node_flags`]).
    pub const NODE_CONFIG: &str = "NODE_CONFIG";
    /// Longest-prefix exclusions: `Key<CidrKey>` → [`crate::cidr_action`].
    pub const EXCLUDED_CIDRS: &str = "EXCLUDED_CIDRS";
    /// The pods' IP addresses: [`crate::PodIpKey`] → netns cookie.
    pub const POD_IPS: &str = "POD_IPS";
    /// SOCKHASH of the proxy's inbound listeners, by [`crate::PortKey`] (the pod's netns, the
    /// listener's port, [`crate::direction::INBOUND`]). The proxy inserts its own sockets; the
    /// kernel removes them when they close.
    pub const INBOUND_LISTENERS: &str = "INBOUND_LISTENERS";
    /// Connections the proxy is opening transparently (client's address as source):
    /// [`crate::TransparentKey`] → unused (LRU). The proxy inserts before connecting and
    /// removes once connected.
    pub const PROXY_TRANSPARENT: &str = "PROXY_TRANSPARENT";
}

/// meshpath's bpffs layout. Every path is relative to a pin root, [`pins::DEFAULT_ROOT`] unless
/// the loader is told otherwise (tests use a root of their own).
pub mod pins {
    /// The default pin root.
    pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/meshpath";
    /// Maps, pinned by name (the eBPF object declares them `pinned`).
    pub const MAPS_DIR: &str = "maps";
    /// Node-wide links (cgroup programs attached at the cgroup v2 root).
    pub const NODE_LINKS_DIR: &str = "node";
    /// Programs loaded once per node and linked into each pod (sk_lookup).
    pub const PROGRAMS_DIR: &str = "programs";
    /// One directory per enrolled pod, named by its netns cookie in decimal, holding its links
    /// (which hold the pod's program instances).
    pub const PODS_DIR: &str = "pods";
}

/// Capacity of the per-pod maps: how many pods one node can enrol.
pub const MAX_PODS: u32 = 4096;
/// Capacity of the per-connection original-destination maps (LRU: the oldest entries go first).
pub const MAX_TRACKED_CONNECTIONS: u32 = 65_536;

/// Socket option numbers the proxy uses to read a captured connection's original destination,
/// as under iptables REDIRECT.
pub mod sockopt {
    /// `SOL_IP`.
    pub const SOL_IP: i32 = 0;
    /// `SOL_IPV6`.
    pub const SOL_IPV6: i32 = 41;
    /// `SO_ORIGINAL_DST` (linux/netfilter_ipv4.h), level `SOL_IP`.
    pub const SO_ORIGINAL_DST: i32 = 80;
    /// `IP6T_SO_ORIGINAL_DST` (linux/netfilter_ipv6/ip6_tables.h), level `SOL_IPV6`.
    pub const IP6T_SO_ORIGINAL_DST: i32 = 80;
}
