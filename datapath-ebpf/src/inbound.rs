//! Inbound capture without netfilter: an sk_lookup program attached to each pod's netns (one
//! instance per pod, [`POD_COOKIE`]) steers TCP that arrives at the pod, for any port, to the
//! proxy's inbound plaintext listener, like istio-cni's `REDIRECT --to-ports 15006`. Addresses
//! are not rewritten: the accepted socket's local address is the original destination and its
//! peer the real client.
//!
//! Left alone: HBONE (15008) and the inbound listener's own port; traffic that stays inside the
//! pod (loopback addresses, or a source address equal to the destination, which is what the
//! kernel picks when a pod connects to its own address: the app talking to itself, the outbound
//! hop to the proxy, the proxy connecting to the app); kubelet probes when bypass is on;
//! excluded ports. `ingress_ifindex` cannot tell local traffic apart: for a packet to a local
//! address it reports the interface that owns the address, not `lo`.
//!
//! Fail closed: a pod whose inbound listener is missing (the proxy is not running) gets no
//! socket: SK_DROP makes the TCP lookup fail, and the kernel answers the SYN with a reset.

use aya_ebpf::{macros::sk_lookup, programs::SkLookupContext};
use datapath_common::{
    consts::{ports, probe},
    direction, pod_flags, PortKey, AF_INET,
};

use crate::{
    maps::{EXCLUDED_PORTS, INBOUND_LISTENERS, PODS, POD_COOKIE},
    net::{is_loopback4, is_v4_mapped, LOOPBACK6},
};

const SK_PASS: u32 = 1;
const SK_DROP: u32 = 0;
const IPPROTO_TCP: u32 = 6;
/// `lo` has ifindex 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

#[sk_lookup]
pub fn mp_sk_lookup(ctx: SkLookupContext) -> u32 {
    let l = ctx.lookup;
    // SAFETY: fields of the kernel's bpf_sk_lookup for this lookup.
    let (protocol, family, local_port, ifindex) =
        unsafe { ((*l).protocol, (*l).family, (*l).local_port, (*l).ingress_ifindex) };
    // SAFETY: reads of the same context.
    if protocol != IPPROTO_TCP || ifindex == LOOPBACK_IFINDEX || unsafe { stays_in_pod(l, family) }
    {
        return SK_PASS;
    }
    let port = local_port as u16;
    if port == ports::HBONE || port == ports::INBOUND_PLAINTEXT {
        return SK_PASS;
    }
    let netns = POD_COOKIE.load();
    // SAFETY: map values are plain data owned by the map.
    let Some(pod) = (unsafe { PODS.get(&netns) }) else {
        return SK_PASS;
    };
    if pod.flags & pod_flags::CAPTURE_INBOUND == 0 {
        return SK_PASS;
    }
    // SAFETY: fields of the kernel's bpf_sk_lookup, read one word at a time.
    let from_probe = unsafe {
        if family == u32::from(AF_INET) {
            (*l).remote_ip4 == u32::from_ne_bytes(probe::SOURCE_V4)
        } else {
            let r =
                [(*l).remote_ip6[0], (*l).remote_ip6[1], (*l).remote_ip6[2], (*l).remote_ip6[3]];
            r == probe_v6()
        }
    };
    if from_probe && pod.flags & pod_flags::PROBE_BYPASS != 0 {
        return SK_PASS;
    }
    let excluded = PortKey { netns, port, direction: direction::INBOUND, _pad: 0 };
    // SAFETY: as above.
    if unsafe { EXCLUDED_PORTS.get(&excluded) }.is_some() {
        return SK_PASS;
    }
    let listener =
        PortKey { netns, port: ports::INBOUND_PLAINTEXT, direction: direction::INBOUND, _pad: 0 };
    match INBOUND_LISTENERS.redirect_sk_lookup(&ctx, listener, 0) {
        Ok(()) => SK_PASS,
        Err(_) => SK_DROP,
    }
}

/// Loopback destination, or source == destination (a local connection).
#[inline(always)]
unsafe fn stays_in_pod(l: *mut aya_ebpf::bindings::bpf_sk_lookup, family: u32) -> bool {
    // SAFETY: fields of the kernel's bpf_sk_lookup, read one word at a time.
    unsafe {
        if family == u32::from(AF_INET) {
            is_loopback4((*l).local_ip4) || (*l).local_ip4 == (*l).remote_ip4
        } else {
            let local =
                [(*l).local_ip6[0], (*l).local_ip6[1], (*l).local_ip6[2], (*l).local_ip6[3]];
            let remote =
                [(*l).remote_ip6[0], (*l).remote_ip6[1], (*l).remote_ip6[2], (*l).remote_ip6[3]];
            local == LOOPBACK6
                || local == remote
                || (is_v4_mapped(&local) && is_loopback4(local[3]))
        }
    }
}

#[inline(always)]
fn probe_v6() -> [u32; 4] {
    let b = probe::SOURCE_V6;
    [
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
        u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
        u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
    ]
}
