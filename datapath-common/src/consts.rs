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

    /// The ports the proxy itself listens on in every pod. A connection whose destination is
    /// one of them would make the proxy dial its own listener (and that connection would be
    /// proxied again, until the proxy runs out of file descriptors): every path refuses them,
    /// as ztunnel does (`SelfCall`).
    pub const PROXY_PORTS: [u16; 4] = [OUTBOUND, INBOUND_PLAINTEXT, HBONE, DNS];

    /// Whether `port` is one of [`PROXY_PORTS`].
    pub const fn is_proxy_port(port: u16) -> bool {
        port == OUTBOUND || port == INBOUND_PLAINTEXT || port == HBONE || port == DNS
    }

    /// The ports of the proxy's inbound listeners in a pod, the ones inbound capture hands
    /// connections to: traffic for each of them goes to the proxy's own socket on that port,
    /// every other port's to its [`INBOUND_PLAINTEXT`] one.
    pub const INBOUND_LISTENER_PORTS: [u16; 2] = [INBOUND_PLAINTEXT, HBONE];

    /// Whether `port` is one of [`INBOUND_LISTENER_PORTS`].
    pub const fn is_inbound_listener_port(port: u16) -> bool {
        port == HBONE || port == INBOUND_PLAINTEXT
    }

    // Every inbound listener port is a proxy port (the loop guard refuses it as a destination):
    // checked when this crate compiles, so a list edited out of step does not build.
    const _: () = {
        let mut i = 0;
        while i < INBOUND_LISTENER_PORTS.len() {
            assert!(
                is_proxy_port(INBOUND_LISTENER_PORTS[i]),
                "an inbound listener port is no proxy port"
            );
            i += 1;
        }
    };
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

/// Socket marks. meshpath never trusts a mark for capture decisions (an app with CAP_NET_ADMIN
/// can set any); the one mark it relies on is [`marks::REPLY`], which only the datapath sets.
pub mod marks {
    /// The mark ztunnel sets on every socket it opens in a pod (istio-cni's rules let marked
    /// packets bypass capture). meshpath's datapath ignores it: the proxy's sockets bypass by
    /// cgroup, and its marked packets route like any other.
    pub const PROXY_SOCKET: u32 = 0x539;
    /// The mark the datapath puts on a transparent connection made inside a pod to the pod
    /// itself (the proxy reaching the app with the client's address): the SYN carries it,
    /// `tcp_fwmark_accept` hands it to the app's accepted socket, and the pod's rule
    /// `fwmark 0x111/0xfff lookup 133` delivers the app's replies locally, back to the proxy,
    /// instead of sending them to the real client. istio-cni uses the same value as the
    /// connmark it restores on the app's replies.
    pub const REPLY: u32 = 0x111;
    /// Mask of the pod's reply rule (istio-cni's).
    pub const REPLY_MASK: u32 = 0xfff;
    /// The routing table, in a pod's netns, whose one route delivers everything locally.
    pub const REPLY_TABLE: u32 = 133;
}

/// Kubernetes labels and annotations the node agent reads and writes: Istio ambient's, and
/// meshpath's own per-pod capture options.
pub mod k8s {
    /// On a namespace or a pod: `ambient` meshes it; on a pod, `none` opts it out.
    pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
    /// [`DATAPLANE_MODE`] value that meshes.
    pub const DATAPLANE_MODE_AMBIENT: &str = "ambient";
    /// [`DATAPLANE_MODE`] value with which a pod opts out.
    pub const DATAPLANE_MODE_NONE: &str = "none";
    /// Present on pods with an Istio sidecar: never meshed by the node.
    pub const SIDECAR_STATUS: &str = "sidecar.istio.io/status";
    /// Written by the agent once a pod is captured (istiod gives a pod HBONE only with it).
    pub const REDIRECTION: &str = "ambient.istio.io/redirection";
    /// [`REDIRECTION`]'s value.
    pub const REDIRECTION_ENABLED: &str = "enabled";
    /// `"true"`: inbound traffic is not captured.
    pub const BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
    /// `"false"`: DNS is not captured.
    pub const DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
    /// Comma-separated destination ports outbound capture leaves alone.
    pub const EXCLUDE_OUTBOUND_PORTS: &str = "meshpath.io/exclude-outbound-ports";
    /// Comma-separated pod ports inbound capture leaves alone.
    pub const EXCLUDE_INBOUND_PORTS: &str = "meshpath.io/exclude-inbound-ports";
    /// Comma-separated destination prefixes outbound capture leaves alone.
    pub const EXCLUDE_OUTBOUND_CIDRS: &str = "meshpath.io/exclude-outbound-cidrs";
    /// Comma-separated client prefixes inbound capture leaves alone.
    pub const EXCLUDE_INBOUND_CIDRS: &str = "meshpath.io/exclude-inbound-cidrs";
    /// On a static pod's mirror in the API: the static pod's own uid (the one its runtime
    /// passes as `K8S_POD_UID`).
    pub const CONFIG_MIRROR: &str = "kubernetes.io/config.mirror";
    /// The label naming an application.
    pub const APP_NAME: &str = "app.kubernetes.io/name";
    /// [`APP_NAME`] of the node proxy's pods (deploy/), never meshed.
    pub const PROXY_APP_NAME: &str = "meshpath-proxy";
    /// The component named in the Events the agent writes.
    pub const AGENT_COMPONENT: &str = "meshpath-agent";
    /// Namespaces never meshed unless configured otherwise.
    pub const DEFAULT_EXCLUDED_NAMESPACES: &[&str] = &["kube-system"];
}

/// Socket option numbers the datapath sets from eBPF.
pub mod sol_socket {
    /// `SOL_SOCKET`.
    pub const SOL_SOCKET: i32 = 1;
    /// `SO_MARK`.
    pub const SO_MARK: i32 = 36;
}

/// Names of the programs in the eBPF object, as the loader looks them up. The TC counters are
/// loaded once per pod (see [`globals::POD_COOKIE`]).
pub mod programs {
    /// TC (TCX) program on a pod's interface, ingress direction (traffic into the pod).
    pub const TC_POD_INGRESS: &str = "tc_pod_ingress";
    /// TC (TCX) program on a pod's interface, egress direction (traffic out of the pod).
    pub const TC_POD_EGRESS: &str = "tc_pod_egress";
    /// TC program on every enrolled pod's interface, egress: drops TCP that no TCP socket sent.
    /// Loaded once per node; attached as a netlink filter, which is found again by this name
    /// (under the kernel's 16-byte program name limit).
    pub const TC_POD_GUARD: &str = "tc_pod_guard";
    /// TC program on the node's end of each of an enrolled pod's links, ingress: drops TCP the
    /// pod sent from no socket of its own, whatever the pod did to its side (a packet socket
    /// with `PACKET_QDISC_BYPASS`, its own filters deleted). Loaded once per node; attached as
    /// a netlink filter, found again by this name.
    pub const TC_NODE_GUARD: &str = "tc_node_guard";
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
    /// cgroup/bind4: refuses binds to the proxy's ports in a pod from outside the proxy's cgroup.
    pub const BIND4: &str = "mp_bind4";
    /// cgroup/bind6.
    pub const BIND6: &str = "mp_bind6";
    /// Every node-wide cgroup program, in the order the loader attaches them: the ones that
    /// start capturing (connect, sendmsg) last, once everything they rely on is in place.
    pub const CGROUP: [&str; 12] = [
        BIND4,
        BIND6,
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
    /// The programs that are not cgroup programs: sk_lookup, sk_msg, TC.
    pub const NOT_CGROUP: [&str; 7] = [
        SK_LOOKUP,
        SK_LOOKUP_PASS,
        SK_MSG,
        TC_POD_GUARD,
        TC_NODE_GUARD,
        TC_POD_INGRESS,
        TC_POD_EGRESS,
    ];
    /// Every program in the eBPF object: [`CGROUP`], then [`NOT_CGROUP`].
    pub const ALL: [&str; CGROUP.len() + NOT_CGROUP.len()] = {
        let mut all = [""; CGROUP.len() + NOT_CGROUP.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = if i < CGROUP.len() { CGROUP[i] } else { NOT_CGROUP[i - CGROUP.len()] };
            i += 1;
        }
        all
    };
    /// The longest program name the kernel keeps (`BPF_OBJ_NAME_LEN` less its NUL): a loaded
    /// program's name is the first this many bytes of its name here.
    pub const KERNEL_NAME_LEN: usize = 15;
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
    /// Decision counts per pod and reason, per CPU: [`crate::decisions::DecisionKey`] → u64.
    pub const DECISIONS: &str = "DECISIONS";
    /// Ring buffer of [`crate::decisions::DecisionEvent`], written while a monitor watches.
    pub const MONITOR_EVENTS: &str = "MONITOR_EVENTS";
    /// aya-log's ring buffer (its name is aya-log's). Pinned so that every load of the object
    /// shares one, which the agent forwards into its log.
    pub const AYA_LOGS: &str = "AYA_LOGS";
    /// cgroup ids whose sockets are never captured (the proxy's), value unused.
    pub const PROXY_CGROUPS: &str = "PROXY_CGROUPS";
    /// [`crate::OrigDst`] in each captured app socket's own storage (socket storage).
    pub const ORIG_DST_BY_SOCKET: &str = "ORIG_DST_BY_SOCKET";
    /// [`crate::OrigDst`] by [`crate::ConnKey`] (a hash: nothing is evicted), until the proxy's
    /// end of the connection takes it or the app's end closes.
    pub const ORIG_DST_BY_CONN: &str = "ORIG_DST_BY_CONN";
    /// The same layout as `ORIG_DST_BY_CONN`, where the programs also look: during a datapath
    /// upgrade that replaces that map with one of another shape, the replaced map itself;
    /// else one empty slot.
    pub const ORIG_DST_BY_CONN_PREVIOUS: &str = "ORIG_DST_BY_CONN_PREVIOUS";
    /// Each pod's entries in `ORIG_DST_BY_CONN` (a `u64` by netns cookie, created at enrolment
    /// and removed at unenrolment; the programs only count in it): its share is
    /// [`super::MAX_PENDING_CONNECTIONS_PER_POD`].
    pub const PENDING_CONNECTIONS: &str = "PENDING_CONNECTIONS";
    /// [`crate::OrigDst`] in the storage of each socket the proxy accepted from a captured app
    /// (socket storage), for its getsockopt.
    pub const ORIG_DST_BY_ACCEPTED: &str = "ORIG_DST_BY_ACCEPTED";
    /// Sockets the proxy bound to one of its ports in an enrolled pod (socket storage, a `u8`
    /// whose presence is the mark): the only ones taken as a pod's inbound listener.
    pub const PROXY_BOUND: &str = "PROXY_BOUND";
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
    /// Each pod's own addresses, by netns cookie: [`crate::PodAddrs`].
    pub const POD_ADDRS: &str = "POD_ADDRS";
    /// SOCKHASH of the proxy's inbound listeners, by [`crate::ListenerKey`]. `sock_ops` files
    /// every socket that starts listening on 15006 in an enrolled pod; the kernel removes it
    /// when it closes. The proxy never touches it.
    pub const INBOUND_LISTENERS: &str = "INBOUND_LISTENERS";
    /// Transparent connections made inside a pod to the pod itself, during their handshake:
    /// [`crate::TransparentKey`] → unused (a hash: nothing is evicted). Filed and removed by
    /// `sock_ops`; the proxy never touches it.
    pub const PROXY_TRANSPARENT: &str = "PROXY_TRANSPARENT";
    /// Each pod's entries in `PROXY_TRANSPARENT` (as [`PENDING_CONNECTIONS`] for
    /// `ORIG_DST_BY_CONN`): its share is [`super::MAX_PENDING_CONNECTIONS_PER_POD`].
    pub const PENDING_TRANSPARENT: &str = "PENDING_TRANSPARENT";
    /// The node's ends of enrolled pods' links, by interface index in the node's netns:
    /// [`crate::HostEnd`]. Written by the agent when it guards such an end, removed when it
    /// takes the guard off; read by the node-side guard.
    pub const HOST_ENDS: &str = "HOST_ENDS";
    /// Which datapath the pins hold: one `u64`, the loader's hash of the eBPF object it
    /// embeds, written once every program runs from that object. Read by no program. Absent
    /// (meshpath 0.1.0) or another value: the agent upgrades the datapath in place.
    pub const DATAPATH_VERSION: &str = "DATAPATH_VERSION";
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
    /// Suffix of a pin being replaced during a datapath upgrade: the new map or program is
    /// pinned at `NAME-next`, then renamed over `NAME` (bpffs renames atomically; it refuses
    /// names with a dot).
    pub const NEXT_SUFFIX: &str = "-next";
}

/// Capacity of the per-pod maps: how many pods one node can enrol.
pub const MAX_PODS: u32 = 4096;
/// Capacity of `HOST_ENDS`: four links per pod at the most pods a node can enrol (a pod has
/// one link per network: Multus gives it a few).
pub const MAX_HOST_ENDS: u32 = MAX_PODS * 4;
/// Capacity of each of the node's exclusion maps (`EXCLUDED_PORTS`, `EXCLUDED_CIDRS`), which
/// all pods share.
pub const EXCLUSION_MAP_ENTRIES: u32 = MAX_PODS * 8;
/// Entries one pod may have in each exclusion map: its excluded ports (both directions
/// together), its prefix rules (all three lists together). The maps are shared: without a cap,
/// a few pods with long annotation lists could fill them, and every later pod with an
/// exclusion would fail to enrol. At this cap, filling one takes 256 pods with full lists, more
/// than Kubernetes lets a node run by default (110). Istio sets no cap (iptables rules have no
/// shared table to fill).
pub const MAX_EXCLUSIONS_PER_POD: usize = 128;
const _: () = assert!(EXCLUSION_MAP_ENTRIES as usize / MAX_EXCLUSIONS_PER_POD >= 256);
/// Capacity of `LOCAL_SOCKS` (the app↔proxy shortcut's pairs; the kernel leaves out what does
/// not fit, and the connection goes the normal way).
pub const MAX_TRACKED_CONNECTIONS: u32 = 65_536;
/// The most pods kubelet runs on a node by default (`maxPods`).
pub const KUBELET_DEFAULT_MAX_PODS: u32 = 110;
/// Capacity of `ORIG_DST_BY_CONN` (a hash, nothing evicted, each pod held to a share: see
/// [`MAX_PENDING_CONNECTIONS_PER_POD`]): 128 pods' full shares, so that no set of pods a node
/// runs by default ([`KUBELET_DEFAULT_MAX_PODS`]) can fill it, all at their share at once.
/// Allocated per entry (`BPF_F_NO_PREALLOC`): 8 MiB of buckets, and memory for entries only
/// while they live (each is one loopback handshake long). meshpath 0.1.0 had 65,536
/// preallocated entries, full at 16 pods' shares; an agent of this version carries its
/// entries over into the new map (`loader/src/datapath/upgrade.rs`).
pub const ORIG_DST_BY_CONN_ENTRIES: u32 = 128 * MAX_PENDING_CONNECTIONS_PER_POD;
const _: () =
    assert!(ORIG_DST_BY_CONN_ENTRIES / MAX_PENDING_CONNECTIONS_PER_POD > KUBELET_DEFAULT_MAX_PODS);
/// Capacity of `PROXY_TRANSPARENT` (a hash, nothing evicted, each pod held to a share), which
/// peers drive, not pods: each entry is one of the proxy's connections to an app, in its
/// handshake. So it holds more than the most connections meshpath's proxy carries at all by
/// default (200,000, its cap without a memory limit; the proxy knows nothing of this map, as
/// any proxy written for istio-cni), and peers filling pods' shares fill it only past 64 pods
/// at their share. Allocated per entry (`BPF_F_NO_PREALLOC`): 4 MiB of buckets, and memory for
/// entries only while they live.
pub const MAX_TRANSPARENT_CONNECTIONS: u32 = 262_144;
const _: () = assert!(MAX_TRANSPARENT_CONNECTIONS / MAX_PENDING_CONNECTIONS_PER_POD >= 64);
/// Entries one pod may hold in each of the node-wide maps of connections between their two
/// ends' establishment (one loopback handshake apart normally; longer only when the accepting
/// side's queue overflows):
/// - `ORIG_DST_BY_CONN`: captured connections whose app end is established and whose proxy
///   end is not yet. Past the share, the pod's captured connects are refused (EPERM).
/// - `PROXY_TRANSPARENT`: the proxy's transparent connects to the pod's app whose app end is
///   not accepted yet. Past the share, the proxy's next one is refused (EPERM).
///
/// Each refusal is counted; so one pod can never fill a map that every pod's connections need
/// for that moment, and nothing is ever evicted from either. 128 pods at their share would be
/// needed to fill the first ([`ORIG_DST_BY_CONN_ENTRIES`]), 64 the second
/// ([`MAX_TRANSPARENT_CONNECTIONS`]). Istio has no
/// such maps (conntrack holds REDIRECT's destination, shared by the whole node with no share
/// per pod).
pub const MAX_PENDING_CONNECTIONS_PER_POD: u32 = 4_096;

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

#[cfg(test)]
mod tests {
    use super::ports;

    /// The predicates the eBPF programs call (a loop over a const array is not what the
    /// verifier wants there) say yes to exactly the ports of their lists.
    #[test]
    fn each_port_predicate_holds_for_exactly_the_ports_of_its_list() {
        for port in 0..=u16::MAX {
            assert_eq!(ports::is_proxy_port(port), ports::PROXY_PORTS.contains(&port), "{port}");
            assert_eq!(
                ports::is_inbound_listener_port(port),
                ports::INBOUND_LISTENER_PORTS.contains(&port),
                "{port}"
            );
        }
    }
}
