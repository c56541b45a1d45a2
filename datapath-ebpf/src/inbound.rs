//! Inbound capture without netfilter: an sk_lookup program, loaded once per node and linked into
//! each pod's netns, steers TCP that arrives at the pod, for any port, to the proxy's inbound
//! plaintext listener, like istio-cni's `REDIRECT --to-ports 15006`. sk_lookup has no netns
//! cookie helper, so the program finds the pod by the destination address (`POD_IPS`); since it
//! runs only in enrolled pods, an address it does not know is refused, never let through.
//! Addresses are not rewritten: the accepted socket's local address is the original destination
//! and its peer the real client.
//!
//! The listeners are the ones `sock_ops` saw the proxy start on 15006 and 15008 in the pod
//! (`proxy_sockets.rs`): of the lookup's family first, then a dual-stack IPv6 one. Traffic for
//! HBONE (15008) and for 15006 itself goes to the proxy's socket on that port, as every other
//! port's goes to its 15006 one: never to the kernel's lookup, which would share it with an app
//! in the proxy's SO_REUSEPORT group on that port (an app that held the port before its pod was
//! enrolled, or got it through the pod's ephemeral port range).
//!
//! Left alone: transparent connections made inside the pod to the pod itself
//! (`PROXY_TRANSPARENT`, filed by sock_ops: the proxy reaching the app with the client's
//! address); traffic that stays inside the pod (loopback addresses, or a source address equal
//! to the destination, which is what the kernel picks when a pod connects to its own address:
//! the app talking to itself, the outbound hop to the proxy, the proxy connecting to the app);
//! kubelet probes when bypass is on; excluded ports and client CIDRs (never a proxy port).
//! `ingress_ifindex` cannot tell local traffic apart: for a packet to a local address it
//! reports the interface that owns the address, not `lo`.
//!
//! Fail closed: a pod whose listener for a port is missing (the proxy is not running) gets no
//! socket: SK_DROP makes the TCP lookup fail, and the kernel answers the SYN with a reset.

use aya_ebpf::{
    bindings::{bpf_sk_lookup, BPF_SK_LOOKUP_F_NO_REUSEPORT},
    macros::sk_lookup,
    programs::SkLookupContext,
};
use core::ptr::{addr_of, read_volatile};
use datapath_common::{
    consts::{ports, probe},
    decisions::{reason, NODE_WIDE},
    direction, pod_flags, ListenerKey, NetnsCookie, PodIpKey, PortKey, TransparentKey, AF_INET,
    AF_INET6,
};

use crate::{
    decisions::{record, Tuple},
    maps::{EXCLUDED_PORTS, INBOUND_LISTENERS, PODS, POD_IPS, PROXY_TRANSPARENT},
    net::{cidr_excluded, is_loopback4, is_v4_mapped, LOOPBACK6},
};

const SK_PASS: u32 = 1;
const SK_DROP: u32 = 0;
const IPPROTO_TCP: u32 = 6;
/// `lo` has ifindex 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// The fields of one lookup, read once, each with its own load from the context. Reading them
/// where needed let the compiler share one `ctx + offset` pointer between the IPv4 and IPv6
/// branches, which the verifier rejects ("dereference of modified ctx ptr").
struct Lookup {
    family: u32,
    protocol: u32,
    local_port: u16,
    /// Host order.
    remote_port: u16,
    ifindex: u32,
    local: PodIpKey,
    remote: PodIpKey,
}

impl Lookup {
    #[inline(always)]
    fn read(l: *const bpf_sk_lookup) -> Self {
        // Straight-line, one volatile load per field at a constant offset, both families read:
        // any branch or shared helper here let LLVM compute `ctx + variable`.
        // SAFETY: every field of the kernel's bpf_sk_lookup is readable for any family.
        unsafe {
            let family = read_volatile(addr_of!((*l).family));
            let protocol = read_volatile(addr_of!((*l).protocol));
            let local_port = read_volatile(addr_of!((*l).local_port));
            // `remote_port` is in network order (the kernel pads it to 32 bits).
            let remote_port = u16::from_be(read_volatile(addr_of!((*l).remote_port)));
            let ifindex = read_volatile(addr_of!((*l).ingress_ifindex));
            let local4 = read_volatile(addr_of!((*l).local_ip4));
            let remote4 = read_volatile(addr_of!((*l).remote_ip4));
            let local6 = [
                read_volatile(addr_of!((*l).local_ip6[0])),
                read_volatile(addr_of!((*l).local_ip6[1])),
                read_volatile(addr_of!((*l).local_ip6[2])),
                read_volatile(addr_of!((*l).local_ip6[3])),
            ];
            let remote6 = [
                read_volatile(addr_of!((*l).remote_ip6[0])),
                read_volatile(addr_of!((*l).remote_ip6[1])),
                read_volatile(addr_of!((*l).remote_ip6[2])),
                read_volatile(addr_of!((*l).remote_ip6[3])),
            ];
            let v4 = family == u32::from(AF_INET);
            Self {
                family,
                protocol,
                local_port: local_port as u16,
                remote_port,
                ifindex,
                local: if v4 { PodIpKey::v4(local4) } else { PodIpKey { addr: local6 } },
                remote: if v4 { PodIpKey::v4(remote4) } else { PodIpKey { addr: remote6 } },
            }
        }
    }

    /// Loopback destination, or source == destination (a local connection).
    #[inline(always)]
    fn stays_in_pod(&self) -> bool {
        let a = &self.local.addr;
        self.local == self.remote || a == &LOOPBACK6 || (is_v4_mapped(a) && is_loopback4(a[3]))
    }
}

#[sk_lookup]
pub fn mp_sk_lookup(ctx: SkLookupContext) -> u32 {
    let l = Lookup::read(ctx.lookup);
    if l.protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    let (verdict, netns, why) = decide(&ctx, &l);
    record(&ctx, netns, why, || Tuple {
        src: l.remote.addr,
        dst: l.local.addr,
        src_port: l.remote_port,
        dst_port: l.local_port,
    });
    verdict
}

/// The pod a lookup's destination address belongs to, or node-wide for none.
#[inline(always)]
fn pod_of(l: &Lookup) -> NetnsCookie {
    // SAFETY: map values are plain data owned by the map.
    unsafe { POD_IPS.get(&l.local) }.copied().unwrap_or(NODE_WIDE)
}

/// What to do with a TCP lookup: the verdict, the pod to count it under, and why.
#[inline(always)]
fn decide(ctx: &SkLookupContext, l: &Lookup) -> (u32, NetnsCookie, u32) {
    if l.ifindex == LOOPBACK_IFINDEX || l.stays_in_pod() {
        return (SK_PASS, pod_of(l), reason::IN_PASS_IN_POD);
    }
    let port = l.local_port;
    // A transparent connection made inside the pod to the pod (the proxy connecting to the app
    // with the client's address): never recaptured.
    let transparent = TransparentKey {
        local: l.local.addr,
        remote: l.remote.addr,
        local_port: port,
        remote_port: l.remote_port,
    };
    // SAFETY: as below.
    if unsafe { PROXY_TRANSPARENT.get(&transparent) }.is_some() {
        return (SK_PASS, pod_of(l), reason::IN_PASS_PROXY_CONNECTION);
    }
    // SAFETY: map values are plain data owned by the map.
    let Some(&netns) = (unsafe { POD_IPS.get(&l.local) }) else {
        return (SK_DROP, NODE_WIDE, reason::IN_DROP_UNKNOWN_ADDRESS);
    };
    // SAFETY: as above.
    let Some(pod) = (unsafe { PODS.get(&netns) }) else {
        // Addresses without a pod: an enrolment being made or removed. Counted node-wide: the
        // cookie has no pod to be removed with.
        return (SK_DROP, NODE_WIDE, reason::IN_DROP_UNKNOWN_ADDRESS);
    };
    if pod.flags & pod_flags::CAPTURE_INBOUND == 0 {
        return (SK_PASS, netns, reason::IN_PASS_NOT_CAPTURED);
    }
    // HBONE, or 15006 asked for directly: the proxy's own socket on that port, before any
    // exclusion (a proxy port is never the app's).
    if ports::is_inbound_listener_port(port) {
        return steer(ctx, l, netns, port, reason::IN_STEERED_PROXY_PORT);
    }
    if pod.flags & pod_flags::PROBE_BYPASS != 0 && l.remote == probe_source(l.family) {
        return (SK_PASS, netns, reason::IN_PASS_PROBE);
    }
    let excluded = PortKey { netns, port, direction: direction::INBOUND, _pad: 0 };
    // SAFETY: as above.
    if unsafe { EXCLUDED_PORTS.get(&excluded) }.is_some() {
        return (SK_PASS, netns, reason::IN_PASS_EXCLUDED_PORT);
    }
    if cidr_excluded(netns, direction::INBOUND, l.remote.addr) {
        return (SK_PASS, netns, reason::IN_PASS_EXCLUDED_CIDR);
    }
    steer(ctx, l, netns, ports::INBOUND_PLAINTEXT, reason::IN_STEERED)
}

/// Assigns the lookup to the proxy's listener on `port` in the pod (`steered` is why, when it
/// is there), or refuses it.
#[inline(always)]
fn steer(
    ctx: &SkLookupContext,
    l: &Lookup,
    netns: NetnsCookie,
    port: u16,
    steered: u32,
) -> (u32, NetnsCookie, u32) {
    // NO_REUSEPORT: exactly the socket the proxy bound, never another member of its
    // SO_REUSEPORT group (ztunnel sets SO_REUSEPORT; an app that held the port with it before
    // its pod was enrolled would otherwise share the pod's inbound with the proxy).
    let flags = u64::from(BPF_SK_LOOKUP_F_NO_REUSEPORT);
    if l.family == u32::from(AF_INET) {
        let v4 = ListenerKey { netns, port, family: AF_INET, _pad: 0 };
        if INBOUND_LISTENERS.redirect_sk_lookup(ctx, v4, flags).is_ok() {
            return (SK_PASS, netns, steered);
        }
    }
    // A dual-stack [::] listener (ztunnel's) serves both families; the kernel refuses to assign
    // a v6-only one to an IPv4 lookup.
    let v6 = ListenerKey { netns, port, family: AF_INET6, _pad: 0 };
    match INBOUND_LISTENERS.redirect_sk_lookup(ctx, v6, flags) {
        Ok(()) => (SK_PASS, netns, steered),
        Err(_) => (SK_DROP, netns, reason::IN_DROP_NO_LISTENER),
    }
}

/// Linked into pods without inbound capture: changes nothing; the link marks the netns alive.
#[sk_lookup]
pub fn mp_sk_lookup_pass(_ctx: SkLookupContext) -> u32 {
    SK_PASS
}

/// Kubelet's probe source for this family, as a [`PodIpKey`].
#[inline(always)]
fn probe_source(family: u32) -> PodIpKey {
    if family == u32::from(AF_INET) {
        return PodIpKey::v4(u32::from_ne_bytes(probe::SOURCE_V4));
    }
    let b = probe::SOURCE_V6;
    PodIpKey {
        addr: [
            u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
            u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
            u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
            u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
        ],
    }
}
