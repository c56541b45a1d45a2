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
    /// Node proxy admin endpoint (localhost only).
    pub const ADMIN: u16 = 15000;
    /// Prometheus `/metrics`.
    pub const METRICS: u16 = 15020;
    /// `/healthz/ready`.
    pub const READINESS: u16 = 15021;
}

/// Socket marks istio-cni uses. meshpath does not trust marks for bypass (an app with
/// CAP_NET_ADMIN can set them); they are named here so tests and docs can refer to them.
pub mod marks {
    /// The mark ztunnel sets on its own sockets under istio-cni.
    pub const PROXY_SOCKET: u32 = 0x539;
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
}

/// meshpath's bpffs layout. Every path is relative to a pin root, [`pins::DEFAULT_ROOT`] unless
/// the loader is told otherwise (tests use a root of their own).
pub mod pins {
    /// The default pin root.
    pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/meshpath";
    /// Maps, pinned by name (the eBPF object declares them `pinned`).
    pub const MAPS_DIR: &str = "maps";
    /// One directory per enrolled pod, named by its netns cookie in decimal, holding its links
    /// (which hold the pod's program instances).
    pub const PODS_DIR: &str = "pods";
}

/// Capacity of the per-pod maps: how many pods one node can enrol.
pub const MAX_PODS: u32 = 4096;
