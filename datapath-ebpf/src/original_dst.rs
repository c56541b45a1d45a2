//! cgroup getsockopt: answers `getsockopt(SOL_IP, SO_ORIGINAL_DST)` and
//! `getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST)` on a socket the proxy accepted from a captured
//! app, exactly as netfilter would after REDIRECT, so a proxy written for iptables capture needs
//! no change. For inbound (sk_lookup does not rewrite addresses) the answer is the accepted
//! socket's own local address, on sockets of a pod captured inbound. Only callers in the proxy's
//! cgroup are answered; every other getsockopt passes through untouched.
//!
//! Also sock_ops' part of it on the proxy's side (`accepted`): the accepted socket takes the
//! original destination the app's end filed, into its own storage.

use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_netns_cookie},
    macros::cgroup_sockopt,
    programs::{SockOpsContext, SockoptContext},
    EbpfContext as _,
};
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use datapath_common::{
    consts::{
        ports,
        sockopt::{IP6T_SO_ORIGINAL_DST, SOL_IP, SOL_IPV6, SO_ORIGINAL_DST},
    },
    decisions::{reason, NODE_WIDE},
    pod_flags, ConnKey, NetnsCookie, OrigDst, AF_INET, AF_INET6,
};

use crate::{
    decisions::{mapped, record, Tuple},
    maps::{sk_storage_slot, ORIG_DST_BY_ACCEPTED, PODS, PROXY_CGROUPS},
    net::{is_v4_mapped, words_to_bytes, SockaddrIn, SockaddrIn6, V4_MAPPED_PREFIX},
    pending,
};

#[cgroup_sockopt(getsockopt)]
pub fn mp_getsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: every access is to the kernel's bpf_sockopt for this call, its socket, or the
    // option buffer after the bounds check the verifier requires.
    unsafe { answer(&ctx) };
    1
}

unsafe fn answer(ctx: &SockoptContext) {
    let so = ctx.sockopt;
    let (level, optname) = unsafe { ((*so).level, (*so).optname) };
    let v6_request = match (level, optname) {
        (SOL_IP, SO_ORIGINAL_DST) => false,
        (SOL_IPV6, IP6T_SO_ORIGINAL_DST) => true,
        _ => return,
    };
    // Only the proxy is answered.
    if unsafe { PROXY_CGROUPS.get(&bpf_get_current_cgroup_id()) }.is_none() {
        return;
    }
    let sk = unsafe { (*so).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    // The proxy's accepted socket: its peer is the app's end of the loopback hop.
    let (family, peer_port, peer_ip6) = unsafe {
        let s = &*sk;
        (
            s.family,
            u16::from_be(s.dst_port),
            [s.dst_ip6[0], s.dst_ip6[1], s.dst_ip6[2], s.dst_ip6[3]],
        )
    };
    // Its own volatile load at a constant offset: read with the others, LLVM computed the
    // field's address first ("pointer arithmetic on sock prohibited").
    let peer_ip4 = unsafe { read_volatile(addr_of!((*sk).dst_ip4)) };
    let v4 = family == u32::from(AF_INET) || is_v4_mapped(&peer_ip6);
    // The peer as the monitor shows it.
    let peer_ip6 = if family == u32::from(AF_INET) { mapped(peer_ip4) } else { peer_ip6 };
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // bpf_sock.src_port (the accepted socket's local port) is in host byte order. Accepted on
    // the outbound listener: an outbound capture; on any other port: an inbound one.
    let local_port = unsafe { (*sk).src_port } as u16;
    let orig = if local_port == ports::OUTBOUND || local_port == ports::DNS {
        let key = ConnKey {
            netns,
            port: peer_port,
            ip_version: if v4 { 4 } else { 6 },
            proxy_port: local_port,
            _pad: 0,
        };
        // Taken onto the socket when it was accepted (`accepted`); still filed by connection
        // if that did not happen (the proxy's end established first, as with TCP Fast Open).
        match unsafe { accepted_orig(sk) }.or_else(|| pending::filed(&key)) {
            Some(o) => o,
            None => return refused(ctx, netns, peer_ip6, peer_port, local_port),
        }
    } else {
        match unsafe { inbound_orig(sk, netns) } {
            Some(o) => o,
            None => return refused(ctx, netns, peer_ip6, peer_port, local_port),
        }
    };
    let optval = unsafe { (*so).__bindgen_anon_2.optval } as *mut u8;
    let end = unsafe { (*so).__bindgen_anon_3.optval_end } as *mut u8;
    let len = if !v6_request {
        if orig.family != AF_INET {
            return;
        }
        let size = core::mem::size_of::<SockaddrIn>();
        // The verifier needs this exact shape: pointer + constant compared with optval_end.
        if optval.wrapping_add(size) > end {
            return;
        }
        let out = optval as *mut SockaddrIn;
        unsafe {
            (*out).family = AF_INET;
            (*out).port = orig.port;
            (*out).addr = orig.addr[0].to_ne_bytes();
            (*out).zero = [0; 8];
        }
        size
    } else {
        let size = core::mem::size_of::<SockaddrIn6>();
        if optval.wrapping_add(size) > end {
            return;
        }
        let addr =
            if orig.family == AF_INET { [0, 0, V4_MAPPED_PREFIX, orig.addr[0]] } else { orig.addr };
        let out = optval as *mut SockaddrIn6;
        unsafe {
            (*out).family = AF_INET6;
            (*out).port = orig.port;
            (*out).flowinfo = 0;
            (*out).addr = words_to_bytes(addr);
            (*out).scope_id = 0;
        }
        size
    };
    // One context field per store (see outbound.rs).
    unsafe {
        write_volatile(addr_of_mut!((*so).optlen), len as i32);
        write_volatile(addr_of_mut!((*so).retval), 0);
    }
    let dst = if orig.family == AF_INET { mapped(orig.addr[0]) } else { orig.addr };
    record(ctx, pod_or_node(netns), reason::ORIGINAL_DST_ANSWERED, || Tuple {
        src: peer_ip6,
        dst,
        src_port: peer_port,
        dst_port: u16::from_be(orig.port),
    });
}

/// sock_ops, `PASSIVE_ESTABLISHED` on the outbound or DNS listener's port: the proxy's end of
/// a captured connection takes the original destination the app's end filed by connection
/// (`ORIG_DST_BY_CONN`) into its own storage, where getsockopt finds it for as long as the
/// socket lives, and the entry by connection goes: that map then holds only connections
/// between their two ends' establishment, and its inserts find free slots instead of evicting.
/// A socket of no captured connection finds no entry and gets no storage.
#[inline(always)]
pub fn accepted(ctx: &SockOpsContext) {
    let v4 = ctx.family() == u32::from(AF_INET) || is_v4_mapped(&ctx.remote_ip6());
    // The same key the app's end filed, from this end: its peer is the app's local port.
    let key = ConnKey {
        // SAFETY: helper called with this program's own context.
        netns: unsafe { bpf_get_netns_cookie(ctx.as_ptr()) },
        // remote_port holds the network-order port in its upper half.
        port: u16::from_be((ctx.remote_port() >> 16) as u16),
        ip_version: if v4 { 4 } else { 6 },
        proxy_port: ctx.local_port() as u16,
        _pad: 0,
    };
    // SAFETY: map values are plain data owned by the map; `sk` of the kernel's bpf_sock_ops
    // for this call, null-checked (the verifier types it "socket or null"); a slot the helper
    // returns is that socket's OrigDst.
    unsafe {
        let Some(orig) = pending::filed(&key) else {
            return;
        };
        let sk = (*ctx.ops).__bindgen_anon_2.sk;
        if sk.is_null() {
            return;
        }
        let slot = sk_storage_slot(&ORIG_DST_BY_ACCEPTED, sk, true);
        // Without memory for it, the entry stays where getsockopt also looks.
        if slot.is_null() {
            return;
        }
        *slot = orig;
        pending::remove(&key);
    }
}

/// The original destination taken onto the proxy's accepted socket `sk`, if any.
#[inline(always)]
unsafe fn accepted_orig(sk: *mut aya_ebpf::bindings::bpf_sock) -> Option<OrigDst> {
    // SAFETY: `sk` is the (non-null) socket of this call; a slot the helper returns is that
    // socket's OrigDst.
    unsafe {
        let slot = sk_storage_slot(&ORIG_DST_BY_ACCEPTED, sk, false);
        if slot.is_null() {
            None
        } else {
            Some(*slot)
        }
    }
}

/// The proxy asked about a socket the datapath did not capture: it gets netfilter's ENOENT.
#[inline(always)]
fn refused(
    ctx: &SockoptContext,
    netns: NetnsCookie,
    peer: [u32; 4],
    peer_port: u16,
    local_port: u16,
) {
    record(ctx, pod_or_node(netns), reason::ORIGINAL_DST_REFUSED, || Tuple {
        src: peer,
        src_port: peer_port,
        dst_port: local_port,
        ..Tuple::default()
    });
}

/// `netns` if it is an enrolled pod's, else node-wide (keys stay bounded by the pods).
#[inline(always)]
fn pod_or_node(netns: NetnsCookie) -> NetnsCookie {
    // SAFETY: map values are plain data owned by the map.
    if unsafe { PODS.get(&netns) }.is_some() {
        netns
    } else {
        NODE_WIDE
    }
}

/// For a socket the proxy accepted in a pod captured inbound: its own local address.
unsafe fn inbound_orig(
    sk: *mut aya_ebpf::bindings::bpf_sock,
    netns: NetnsCookie,
) -> Option<OrigDst> {
    let pod = unsafe { PODS.get(&netns) }?;
    if pod.flags & pod_flags::CAPTURE_INBOUND == 0 {
        return None;
    }
    let s = unsafe { &*sk };
    let port = s.src_port as u16;
    let ip6 = [s.src_ip6[0], s.src_ip6[1], s.src_ip6[2], s.src_ip6[3]];
    Some(if s.family == u32::from(AF_INET) {
        OrigDst { addr: [s.src_ip4, 0, 0, 0], port: port.to_be(), family: AF_INET }
    } else if is_v4_mapped(&ip6) {
        OrigDst { addr: [ip6[3], 0, 0, 0], port: port.to_be(), family: AF_INET }
    } else {
        OrigDst { addr: ip6, port: port.to_be(), family: AF_INET6 }
    })
}
