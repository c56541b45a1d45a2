//! The node side of Istio's kubelet-probe contract, instead of istio-cni's host rule
//! `-m owner --socket-exists -m set --match-set istio-inpod-probes dst -j SNAT --to-source
//! 169.254.7.127`: when a process of the node's own netns (kubelet) connects to an enrolled pod
//! whose probes bypass capture, connect4/6 bind the socket to the probe source address first.
//! No NAT, no conntrack, no per-packet work: the node holds 169.254.7.127/32 and
//! fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 on `lo` (the loader adds them), so replies are
//! delivered to kubelet's socket directly, and the pod's sk_lookup lets the probe through.

use aya_ebpf::{
    bindings::sockaddr,
    helpers::{bpf_bind, bpf_get_netns_cookie},
    programs::SockAddrContext,
    EbpfContext as _,
};
use datapath_common::{consts::probe, pod_flags, PodIpKey, AF_INET, AF_INET6};

use crate::{
    maps::{NODE_NETNS, PODS, POD_IPS},
    net::{is_v4_mapped, SockaddrIn, SockaddrIn6},
};

const IPPROTO_TCP: u32 = 6;

/// Whether this connect is a node process (kubelet) probing an enrolled pod with probe bypass.
#[inline(always)]
fn is_probe(ctx: &SockAddrContext, dst: PodIpKey) -> bool {
    // SAFETY: the context is the kernel's bpf_sock_addr; map values are plain data.
    unsafe {
        if (*ctx.sock_addr).protocol != IPPROTO_TCP {
            return false;
        }
        let Some(&node) = NODE_NETNS.get(0) else { return false };
        if node == 0 || bpf_get_netns_cookie(ctx.as_ptr()) != node {
            return false;
        }
        let Some(pod) = POD_IPS.get(&dst) else { return false };
        PODS.get(pod).is_some_and(|p| p.flags & pod_flags::PROBE_BYPASS != 0)
    }
}

/// connect4: bind a node process's probe of a pod to 169.254.7.127.
#[inline(always)]
pub fn source4(ctx: &SockAddrContext, dst: u32) {
    if !is_probe(ctx, PodIpKey::v4(dst)) {
        return;
    }
    let mut sa = SockaddrIn { family: AF_INET, port: 0, addr: probe::SOURCE_V4, zero: [0; 8] };
    // SAFETY: a sockaddr_in on the stack and its size. A socket the caller already bound keeps
    // its address (the helper then fails, and the probe goes out as it would have).
    let _ = unsafe {
        bpf_bind(ctx.sock_addr, (&raw mut sa).cast::<sockaddr>(), size_of::<SockaddrIn>() as i32)
    };
}

/// connect6: bind a node process's probe of a pod to fd16:9254:7127:1337:ffff:ffff:ffff:ffff.
#[inline(always)]
pub fn source6(ctx: &SockAddrContext, dst: [u32; 4]) {
    if !is_probe(ctx, PodIpKey { addr: dst }) {
        return;
    }
    // A v6 socket probing a v4-mapped address needs the v4-mapped probe source.
    let v4 = probe::SOURCE_V4;
    let addr = if is_v4_mapped(&dst) {
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, v4[0], v4[1], v4[2], v4[3]]
    } else {
        probe::SOURCE_V6
    };
    let mut sa = SockaddrIn6 { family: AF_INET6, port: 0, flowinfo: 0, addr, scope_id: 0 };
    // SAFETY: as in source4.
    let _ = unsafe {
        bpf_bind(ctx.sock_addr, (&raw mut sa).cast::<sockaddr>(), size_of::<SockaddrIn6>() as i32)
    };
}
