//! Every map of the object. Layouts come from datapath-common; all maps are pinned by name so
//! that every program instance and every loader process shares them (the legacy ones by their
//! definition; the BTF ones, socket storage, which aya-ebpf cannot mark pinned, by the loader:
//! `map_pin_path`).

use aya_ebpf::{
    bindings::{bpf_sock, BPF_F_NO_PREALLOC, BPF_SK_STORAGE_GET_F_CREATE},
    btf_maps::SkStorage,
    helpers::bpf_sk_storage_get,
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, PerCpuHashMap, RingBuf, SockHash},
    Global,
};
use datapath_common::{
    consts::{
        ports, EXCLUSION_MAP_ENTRIES, MAX_HOST_ENDS, MAX_PODS, MAX_TRACKED_CONNECTIONS,
        MAX_TRANSPARENT_CONNECTIONS, ORIG_DST_BY_CONN_ENTRIES,
    },
    decisions::{DecisionKey, MAX_DECISION_KEYS, MONITOR_RING_BYTES},
    CidrKey, ConnKey, HostEnd, ListenerKey, NetnsCookie, OrigDst, PodAddrs, PodCounters, PodInfo,
    PodIpKey, PortKey, SockKey, TransparentKey,
};

/// Per pod, per CPU counters, created at enrolment and removed at unenrolment.
#[map]
pub static POD_COUNTERS: PerCpuHashMap<NetnsCookie, PodCounters> =
    PerCpuHashMap::pinned(MAX_PODS, 0);

/// What the programs decided, per pod (or node-wide) and reason, per CPU.
#[map]
pub static DECISIONS: PerCpuHashMap<DecisionKey, u64> = PerCpuHashMap::pinned(MAX_DECISION_KEYS, 0);

/// One event per decision while a monitor watches (`node_flags::MONITOR`).
#[map]
pub static MONITOR_EVENTS: RingBuf = RingBuf::pinned(MONITOR_RING_BYTES, 0);

/// The node's ends of enrolled pods' links, by interface index (`raw_tcp_guard.rs`, the
/// node-side guard).
#[map]
pub static HOST_ENDS: HashMap<u32, HostEnd> = HashMap::pinned(MAX_HOST_ENDS, 0);

/// The enrolled pods and what to do for each (`PodInfo::flags`).
#[map]
pub static PODS: HashMap<NetnsCookie, PodInfo> = HashMap::pinned(MAX_PODS, 0);

/// cgroup ids of the proxy: their sockets are never captured.
#[map]
pub static PROXY_CGROUPS: HashMap<u64, u32> = HashMap::pinned(64, 0);

/// Ports a pod excludes from capture.
#[map]
pub static EXCLUDED_PORTS: HashMap<PortKey, u32> = HashMap::pinned(EXCLUSION_MAP_ENTRIES, 0);

/// Original destination of a captured app socket, kept on the socket itself (socket storage:
/// for getpeername, recvmsg and sock_ops). It lives exactly as long as the socket, as the
/// destination NAT of iptables REDIRECT does: an LRU map keyed by socket cookie evicted a
/// long-lived connection's entry once enough newer connections came (its getpeername then
/// showed the proxy), and its inserts, evicting on a full map, were most of the datapath's
/// per-connection cost. Needs the object's BTF (socket storage maps are BTF-described).
#[btf_map]
pub static ORIG_DST_BY_SOCKET: SkStorage<OrigDst> = SkStorage::new();

/// Original destination by (netns, IP version, app port, listener port): filed when the app's
/// connection is established, taken (moved to `ORIG_DST_BY_ACCEPTED`) when the proxy's end of
/// it is, a moment later, or removed when the app's end closes first; so it holds only
/// connections between the two. A plain hash, not an LRU: nothing in it can be evicted, by one
/// pod's flood or otherwise; each pod's entries are counted in `PENDING_CONNECTIONS` and held
/// to its share (`pending.rs`), so no pod can fill it either.
#[map]
pub static ORIG_DST_BY_CONN: HashMap<ConnKey, OrigDst> =
    HashMap::pinned(ORIG_DST_BY_CONN_ENTRIES, BPF_F_NO_PREALLOC);

/// While a datapath upgrade replaces `ORIG_DST_BY_CONN` with one of another shape (capacity,
/// flags, hash kind), the old map itself, so that a connection an old program filed there is
/// still found by the new programs until the last old one is gone and its entries are copied
/// (`pending::filed`, loader/src/datapath/upgrade.rs). Otherwise, and once that upgrade is
/// done (the loader links the readers again without it), this: one slot, always empty.
#[map]
pub static ORIG_DST_BY_CONN_PREVIOUS: HashMap<ConnKey, OrigDst> = HashMap::pinned(1, 0);

/// Each enrolled pod's entries in `ORIG_DST_BY_CONN`: created (zero) by the loader at
/// enrolment, removed at unenrolment; the programs only add and subtract.
#[map]
pub static PENDING_CONNECTIONS: HashMap<NetnsCookie, u64> = HashMap::pinned(MAX_PODS, 0);

/// Original destination of a socket the proxy accepted from a captured app, on the socket
/// itself (socket storage), for the proxy's getsockopt(SO_ORIGINAL_DST) as long as it lives,
/// as conntrack answers it under REDIRECT. Not the app socket's map: getpeername on the
/// proxy's socket must show the app, not the destination.
#[btf_map]
pub static ORIG_DST_BY_ACCEPTED: SkStorage<OrigDst> = SkStorage::new();

/// Sockets bound to one of the proxy's ports inside an enrolled pod by the proxy (set by the
/// bind hook, `proxy_ports.rs`): only such a socket listening on 15006 is taken as the pod's
/// inbound listener, never one that got the port without `bind()` (an unbound socket's
/// `listen()` takes a port from the pod's `ip_local_port_range`) or bound it before the pod was
/// enrolled. The value is unused: having one is the mark.
#[btf_map]
pub static PROXY_BOUND: SkStorage<u8> = SkStorage::new();

/// Transparent connections made inside a pod to the pod itself (the proxy's to the app), filed
/// by sock_ops while their handshake is under way: sk_lookup lets their SYN reach the app.
/// Removed once the app's end is accepted (from then on every segment of the connection finds
/// a socket before sk_lookup would run) or the connecting end closes first. A plain hash, as
/// `ORIG_DST_BY_CONN`: nothing in it can be evicted; each pod's entries are counted in
/// `PENDING_TRANSPARENT` and held to its share (`proxy_sockets.rs`). Sized and allocated as
/// `MAX_TRANSPARENT_CONNECTIONS` says.
#[map]
pub static PROXY_TRANSPARENT: HashMap<TransparentKey, u8> =
    HashMap::pinned(MAX_TRANSPARENT_CONNECTIONS, BPF_F_NO_PREALLOC);

/// Each enrolled pod's entries in `PROXY_TRANSPARENT`, as `PENDING_CONNECTIONS`.
#[map]
pub static PENDING_TRANSPARENT: HashMap<NetnsCookie, u64> = HashMap::pinned(MAX_PODS, 0);

/// Both ends of captured app↔proxy connections, when acceleration is on.
#[map]
pub static LOCAL_SOCKS: SockHash<SockKey> = SockHash::pinned(MAX_TRACKED_CONNECTIONS, 0);

/// The node's netns cookie: host processes there connecting to a pod get the probe source.
#[map]
pub static NODE_NETNS: Array<u64> = Array::pinned(1, 0);

/// Node-wide switches: `NODE_CONFIG[0]` holds `node_flags`.
#[map]
pub static NODE_CONFIG: Array<u32> = Array::pinned(1, 0);

/// Longest-prefix exclusions per pod and direction.
#[map]
pub static EXCLUDED_CIDRS: LpmTrie<CidrKey, u32> = LpmTrie::pinned(EXCLUSION_MAP_ENTRIES, 0);

/// The pods' addresses: how the node-wide sk_lookup program tells which pod a lookup is for.
#[map]
pub static POD_IPS: HashMap<PodIpKey, NetnsCookie> = HashMap::pinned(MAX_PODS * 4, 0);

/// The proxy's inbound listeners (`ports::INBOUND_LISTENER_PORTS`, each of either family), filed
/// by sock_ops when they start listening.
#[map]
pub static INBOUND_LISTENERS: SockHash<ListenerKey> =
    SockHash::pinned(MAX_PODS * (ports::INBOUND_LISTENER_PORTS.len() as u32 * 2), 0);

/// Each pod's own addresses: where the outbound hook sends the app's connections.
#[map]
pub static POD_ADDRS: HashMap<NetnsCookie, PodAddrs> = HashMap::pinned(MAX_PODS, 0);

/// Which datapath the pins hold (`map_names::DATAPATH_VERSION`): written by the loader, read by
/// no program. Declared here so that loading the object creates and pins it with the rest.
#[map]
pub static DATAPATH_VERSION: Array<u64> = Array::pinned(1, 0);

/// The netns cookie of the pod a per-pod program instance (TC counters) serves; set by the
/// loader at load time (`datapath_common::consts::globals::POD_COOKIE`). Zero in the node-wide
/// instance.
#[unsafe(no_mangle)]
pub static POD_COOKIE: Global<NetnsCookie> = Global::new(0);

/// The value of socket `sk` in the socket storage `map` (null: none, or, with `create`, no
/// memory for one; created zeroed). For the contexts aya-ebpf's `SkStorage` does not take (it
/// takes only a sock_addr context): sock_ops and sockopt. The map pointer is the map's own
/// definition, as that wrapper passes it.
///
/// # Safety
/// `sk` must be a non-null socket pointer of the running program's context.
#[inline(always)]
pub unsafe fn sk_storage_slot<T>(map: &SkStorage<T>, sk: *mut bpf_sock, create: bool) -> *mut T {
    let flags = if create { u64::from(BPF_SK_STORAGE_GET_F_CREATE) } else { 0 };
    let map = core::ptr::from_ref(map).cast_mut().cast();
    // SAFETY: as the caller promises. The helper reads the socket's storage; with `create` it
    // allocates one for this map (charged to the map's memory cgroup and the socket's optmem)
    // and links it to the socket, which frees it when it goes.
    unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), flags) }.cast()
}
