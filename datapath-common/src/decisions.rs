//! What the datapath decided, for operators: every branch that matters has a reason code. The
//! programs count each decision per pod in `DECISIONS` (per CPU) and, while a monitor watches,
//! send one [`DecisionEvent`] per decision to `MONITOR_EVENTS`. [`REASONS`] is the one table
//! that names them (hook, decision, reason) for `meshpath-loader show/list/monitor` and the
//! agent's `meshpath_datapath_decisions_total` metric.

use crate::NetnsCookie;

/// Key of `DECISIONS`. `netns` is the pod's netns cookie, or [`NODE_WIDE`] for decisions about
/// no enrolled pod (so the key set stays bounded by the pods enrolled).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct DecisionKey {
    pub netns: NetnsCookie,
    /// One of [`reason`].
    pub reason: u32,
    pub _pad: u32,
}

/// The `netns` of node-wide decisions (no enrolled pod is involved).
pub const NODE_WIDE: NetnsCookie = 0;

/// One decision, as the monitor streams it. Addresses are IPv6 or v4-mapped words in network
/// order; a part the hook does not know yet (connect has no source port) is zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DecisionEvent {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC).
    pub ktime_ns: u64,
    pub netns: NetnsCookie,
    pub reason: u32,
    /// Host order.
    pub src_port: u16,
    /// Host order.
    pub dst_port: u16,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

/// Reason codes. Each names one branch of one hook; [`REASONS`] gives its labels.
pub mod reason {
    // Outbound: cgroup connect4/6 (TCP).
    /// Sent to the proxy's outbound listener (15001).
    pub const OUT_CAPTURED: u32 = 1;
    /// The socket belongs to the proxy's cgroup.
    pub const OUT_PASS_PROXY_CGROUP: u32 = 2;
    /// The destination port is excluded for the pod.
    pub const OUT_PASS_EXCLUDED_PORT: u32 = 3;
    /// The destination is in a prefix excluded for the pod.
    pub const OUT_PASS_EXCLUDED_CIDR: u32 = 4;
    /// Loopback or unspecified destination: stays in the pod.
    pub const OUT_PASS_LOOPBACK: u32 = 5;
    /// The pod's own address: stays in the pod.
    pub const OUT_PASS_OWN_ADDRESS: u32 = 6;
    /// The pod is enrolled without outbound capture (or the protocol is not captured).
    pub const OUT_PASS_NOT_CAPTURED: u32 = 7;
    /// No original-destination slot could be filed: refused rather than leaked.
    pub const OUT_REFUSED_NO_SLOT: u32 = 8;
    /// The socket is in no enrolled pod (counted node-wide).
    pub const OUT_PASS_NOT_ENROLLED: u32 = 9;
    /// The pod already holds its share of captured connections the proxy has not yet taken
    /// (`consts::MAX_PENDING_CONNECTIONS_PER_POD`): refused at connect, or, for one that got
    /// past connect meanwhile, its destination not filed (the proxy's getsockopt refuses it).
    pub const OUT_REFUSED_SHARE_FULL: u32 = 10;
    // DNS: connect (TCP, connected UDP) and sendmsg (UDP) to port 53.
    /// Sent to the proxy's DNS listener (15053).
    pub const DNS_CAPTURED: u32 = 20;
    // Inbound: sk_lookup in the pod's netns (TCP).
    /// Steered to the proxy's inbound listener (15006).
    pub const IN_STEERED: u32 = 40;
    /// To the proxy's own ports (15008 HBONE, 15006): to the proxy's socket on that port.
    pub const IN_STEERED_PROXY_PORT: u32 = 41;
    /// From kubelet's probe source, with bypass on.
    pub const IN_PASS_PROBE: u32 = 42;
    /// To a port excluded for the pod.
    pub const IN_PASS_EXCLUDED_PORT: u32 = 43;
    /// From a client prefix excluded for the pod.
    pub const IN_PASS_EXCLUDED_CIDR: u32 = 44;
    /// The proxy's transparent connection to the app (its 4-tuple in `PROXY_TRANSPARENT`).
    pub const IN_PASS_PROXY_CONNECTION: u32 = 45;
    /// The pod's record says no inbound capture (a pod enrolled so is linked to the program
    /// that passes everything and counts nothing; this is the steering program's guard).
    pub const IN_PASS_NOT_CAPTURED: u32 = 46;
    /// No proxy listener for the pod (the proxy is down): refused.
    pub const IN_DROP_NO_LISTENER: u32 = 47;
    /// To an address no enrolled pod has: refused.
    pub const IN_DROP_UNKNOWN_ADDRESS: u32 = 48;
    /// Traffic that stays in the pod (loopback, or the pod to its own address).
    pub const IN_PASS_IN_POD: u32 = 49;
    // Inbound: cgroup connect4/6 of the proxy's transparent connect to the app.
    /// The pod already holds its share of the proxy's transparent connects to it whose app end
    /// is not accepted yet (`consts::MAX_PENDING_CONNECTIONS_PER_POD`): refused at connect.
    pub const IN_REFUSED_SHARE_FULL: u32 = 50;
    // The proxy's getsockopt(SO_ORIGINAL_DST).
    /// Answered with a captured connection's original destination.
    pub const ORIGINAL_DST_ANSWERED: u32 = 60;
    /// No captured connection matched: the proxy gets ENOENT, as from netfilter.
    pub const ORIGINAL_DST_REFUSED: u32 = 61;
    // cgroup bind4/6 in an enrolled pod.
    /// A bind to one of the proxy's ports from outside the proxy's cgroup: refused (EPERM).
    pub const BIND_REFUSED_PROXY_PORT: u32 = 80;
    // sock_ops, a connect in an enrolled pod.
    /// A transparent connection to the pod itself from a socket the proxy did not bind (an
    /// app with CAP_NET_RAW or CAP_NET_ADMIN): not filed, so nothing reaches the app past the
    /// proxy from that address.
    pub const TRANSPARENT_NOT_PROXY: u32 = 81;
    // TC egress on an enrolled pod's interface.
    /// A TCP segment that no TCP socket sent (a raw or packet socket's) and that could open a
    /// connection or carry data: dropped, so it cannot reach a peer past the proxy.
    pub const EGRESS_DROP_NOT_TCP_SOCKET: u32 = 100;
    // TC ingress on the node's end of an enrolled pod's link.
    /// A TCP segment from the pod that no socket of the pod's netns could have sent (none has
    /// its connection, or only a listener, for anything but a SYN-ACK): dropped, whatever the
    /// pod did to get it past its own side.
    pub const NODE_DROP_NOT_POD_SOCKET: u32 = 101;
}

/// (code, hook, decision, reason) for every reason code: labels for people and metrics.
pub const REASONS: &[(u32, &str, &str, &str)] = &[
    (reason::OUT_CAPTURED, "outbound", "captured", "to proxy"),
    (reason::OUT_PASS_PROXY_CGROUP, "outbound", "passed", "proxy cgroup"),
    (reason::OUT_PASS_EXCLUDED_PORT, "outbound", "passed", "excluded port"),
    (reason::OUT_PASS_EXCLUDED_CIDR, "outbound", "passed", "excluded cidr"),
    (reason::OUT_PASS_LOOPBACK, "outbound", "passed", "loopback"),
    (reason::OUT_PASS_OWN_ADDRESS, "outbound", "passed", "own address"),
    (reason::OUT_PASS_NOT_CAPTURED, "outbound", "passed", "capture off"),
    (reason::OUT_REFUSED_NO_SLOT, "outbound", "refused", "no original-destination slot"),
    (reason::OUT_PASS_NOT_ENROLLED, "outbound", "passed", "not enrolled"),
    (reason::OUT_REFUSED_SHARE_FULL, "outbound", "refused", "pod's share of pending connections"),
    (reason::DNS_CAPTURED, "dns", "captured", "to dns proxy"),
    (reason::IN_STEERED, "inbound", "steered", "to proxy"),
    (reason::IN_STEERED_PROXY_PORT, "inbound", "steered", "proxy port"),
    (reason::IN_PASS_PROBE, "inbound", "passed", "probe"),
    (reason::IN_PASS_EXCLUDED_PORT, "inbound", "passed", "excluded port"),
    (reason::IN_PASS_EXCLUDED_CIDR, "inbound", "passed", "excluded cidr"),
    (reason::IN_PASS_PROXY_CONNECTION, "inbound", "passed", "proxy connection"),
    (reason::IN_PASS_NOT_CAPTURED, "inbound", "passed", "capture off"),
    (reason::IN_DROP_NO_LISTENER, "inbound", "dropped", "no listener"),
    (reason::IN_DROP_UNKNOWN_ADDRESS, "inbound", "dropped", "unknown address"),
    (reason::IN_PASS_IN_POD, "inbound", "passed", "in pod"),
    (
        reason::IN_REFUSED_SHARE_FULL,
        "inbound",
        "refused",
        "pod's share of pending transparent connections",
    ),
    (reason::ORIGINAL_DST_ANSWERED, "getsockopt", "answered", "original destination"),
    (reason::ORIGINAL_DST_REFUSED, "getsockopt", "refused", "no captured connection"),
    (reason::BIND_REFUSED_PROXY_PORT, "bind", "refused", "proxy port"),
    (reason::TRANSPARENT_NOT_PROXY, "sock_ops", "refused", "transparent connect outside the proxy"),
    (reason::EGRESS_DROP_NOT_TCP_SOCKET, "tc egress", "dropped", "tcp not from a tcp socket"),
    (reason::NODE_DROP_NOT_POD_SOCKET, "tc node ingress", "dropped", "tcp from no pod socket"),
];

/// The labels of a reason code (`None` for a code this build does not know).
pub fn labels(code: u32) -> Option<(&'static str, &'static str, &'static str)> {
    REASONS.iter().find(|r| r.0 == code).map(|&(_, h, d, r)| (h, d, r))
}

/// Whether a reason is a refusal or drop (what `monitor --only drops` shows).
pub fn is_drop(code: u32) -> bool {
    matches!(
        code,
        reason::OUT_REFUSED_NO_SLOT
            | reason::OUT_REFUSED_SHARE_FULL
            | reason::IN_REFUSED_SHARE_FULL
            | reason::IN_DROP_NO_LISTENER
            | reason::IN_DROP_UNKNOWN_ADDRESS
            | reason::ORIGINAL_DST_REFUSED
            | reason::BIND_REFUSED_PROXY_PORT
            | reason::TRANSPARENT_NOT_PROXY
            | reason::EGRESS_DROP_NOT_TCP_SOCKET
            | reason::NODE_DROP_NOT_POD_SOCKET
    )
}

/// Capacity of `DECISIONS`: every reason for every pod, and the node-wide ones.
pub const MAX_DECISION_KEYS: u32 = (crate::consts::MAX_PODS + 1) * REASON_SLOTS;
/// Reasons per pod the map is sized for (at least `REASONS.len()`).
pub const REASON_SLOTS: u32 = 32;
const _: () = assert!(REASONS.len() as u32 <= REASON_SLOTS);

/// Size of the monitor's ring buffer (a power of two, a multiple of the page size).
pub const MONITOR_RING_BYTES: u32 = 256 * 1024;
