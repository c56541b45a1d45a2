//! The same-node shortcut for the app↔proxy hop (on only when the node turns it on): both ends
//! of a captured connection go into the `LOCAL_SOCKS` SOCKHASH when established (from
//! `mp_sock_ops`), and `mp_sk_msg`, attached to that map, hands each message straight to the
//! other end's receive queue, so the bytes of that hop never cross the TCP/IP stack. Anything it
//! cannot pair (the other end not in the map) is sent the normal way.

use aya_ebpf::{
    bindings::{sk_action::SK_PASS, BPF_ANY, BPF_F_INGRESS},
    helpers::bpf_get_netns_cookie,
    macros::sk_msg,
    programs::{SkMsgContext, SockOpsContext},
    EbpfContext as _,
};
use core::ptr::{addr_of, read_volatile};
use datapath_common::{node_flags, PodIpKey, SockKey, AF_INET};

use crate::{
    maps::{LOCAL_SOCKS, NODE_CONFIG},
    net::{remote_port_host, sock_ops_key},
};

/// Whether the node has the shortcut on.
#[inline(always)]
pub fn enabled() -> bool {
    NODE_CONFIG.get(0).is_some_and(|f| f & node_flags::ACCELERATE != 0)
}

/// Puts this established socket (an end of a captured app↔proxy connection) into the map.
#[inline(always)]
pub fn add(ctx: &SockOpsContext, netns: u64) {
    let key = sock_ops_key(ctx.ops, netns);
    // SAFETY: the context is the kernel's bpf_sock_ops for this callback.
    let _ = LOCAL_SOCKS.update(key, unsafe { &mut *ctx.ops }, u64::from(BPF_ANY));
}

#[sk_msg]
pub fn mp_sk_msg(ctx: SkMsgContext) -> u32 {
    let m = ctx.msg;
    // One load per field at a constant offset (see inbound.rs for why).
    // SAFETY: fields of the kernel's sk_msg_md, readable for any family.
    let key = unsafe {
        let v4 = read_volatile(addr_of!((*m).family)) == u32::from(AF_INET);
        let l4 = read_volatile(addr_of!((*m).local_ip4));
        let r4 = read_volatile(addr_of!((*m).remote_ip4));
        let l6 = [
            read_volatile(addr_of!((*m).local_ip6[0])),
            read_volatile(addr_of!((*m).local_ip6[1])),
            read_volatile(addr_of!((*m).local_ip6[2])),
            read_volatile(addr_of!((*m).local_ip6[3])),
        ];
        let r6 = [
            read_volatile(addr_of!((*m).remote_ip6[0])),
            read_volatile(addr_of!((*m).remote_ip6[1])),
            read_volatile(addr_of!((*m).remote_ip6[2])),
            read_volatile(addr_of!((*m).remote_ip6[3])),
        ];
        SockKey {
            netns: bpf_get_netns_cookie(ctx.as_ptr()),
            local: if v4 { PodIpKey::v4(l4).addr } else { l6 },
            remote: if v4 { PodIpKey::v4(r4).addr } else { r6 },
            local_port: read_volatile(addr_of!((*m).local_port)),
            remote_port: remote_port_host(read_volatile(addr_of!((*m).remote_port))),
        }
    };
    // On success the message is handed to the peer; if the peer is not in the map the verdict
    // is still PASS with no redirect, and the message takes the normal path.
    let _ = LOCAL_SOCKS.redirect_msg(&ctx, key.peer(), u64::from(BPF_F_INGRESS));
    SK_PASS
}
