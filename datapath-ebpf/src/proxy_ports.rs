//! The proxy's ports in an enrolled pod are the proxy's: a `bind()` inside an enrolled pod to
//! 15001, 15006, 15008 or 15053 (TCP or UDP, any address) by a process outside the proxy's
//! cgroup (`PROXY_CGROUPS`, the cgroup the agent registers for the proxy that connected over
//! ZDS) is refused with `EPERM`. Otherwise an app could take the pod's inbound traffic past
//! the proxy (sock_ops files whatever listens on 15006) while the proxy restarts, or beside a
//! proxy that binds the pod's address instead of the wildcard one. istio-cni's REDIRECT only
//! ever delivers to the proxy's own listeners on these ports; ztunnel creates its in-pod
//! sockets in its own process, so its binds pass. Every bind the proxy makes there marks its
//! socket (`PROXY_BOUND`): `sock_ops` takes only a marked socket listening on 15006 as the
//! pod's inbound listener, so a port got without `bind()` does not count, and files only a
//! marked socket's transparent connection, so an app that binds an outside address itself
//! (`IP_TRANSPARENT`, CAP_NET_RAW) cannot open a path around the proxy.

use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_netns_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext as _,
};
use datapath_common::{consts::ports, decisions::reason};

use crate::{
    decisions::{record, Tuple},
    maps::{PODS, PROXY_BOUND, PROXY_CGROUPS},
    outbound::ALLOW,
};

const REFUSE: i32 = 0;

#[cgroup_sock_addr(bind4)]
pub fn mp_bind4(ctx: SockAddrContext) -> i32 {
    bind(&ctx)
}

#[cgroup_sock_addr(bind6)]
pub fn mp_bind6(ctx: SockAddrContext) -> i32 {
    bind(&ctx)
}

#[inline(always)]
fn bind(ctx: &SockAddrContext) -> i32 {
    // SAFETY: helper called with this program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: map values are plain data owned by the map.
    if unsafe { PODS.get(&netns) }.is_none() {
        return ALLOW;
    }
    // SAFETY: no arguments; map values as above.
    if unsafe { PROXY_CGROUPS.get(&bpf_get_current_cgroup_id()) }.is_some() {
        // Every socket the proxy binds in a pod is marked, whatever the port: a listener on an
        // inbound port, and a transparent connection bound to its client's address, are taken
        // as the proxy's only with the mark (`proxy_sockets.rs`).
        // SAFETY: the helper is given this program's own socket; a pointer it returns is that
        // socket's storage. With no memory for it the bind still passes, but the socket is
        // not taken as the proxy's: the pod's inbound is refused, never leaked.
        unsafe {
            let slot = PROXY_BOUND.get_or_insert_ptr_mut(ctx, None);
            if !slot.is_null() {
                *slot = 1;
            }
        }
        return ALLOW;
    }
    // SAFETY: a field of the kernel's bpf_sock_addr; user_port holds a network-order u16.
    let port = u16::from_be(unsafe { (*ctx.sock_addr).user_port } as u16);
    if !ports::is_proxy_port(port) {
        return ALLOW;
    }
    record(ctx, netns, reason::BIND_REFUSED_PROXY_PORT, || Tuple {
        dst_port: port,
        ..Tuple::default()
    });
    REFUSE
}
