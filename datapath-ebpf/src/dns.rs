//! DNS capture over unconnected UDP, like istio-cni's `udp dport 53 REDIRECT --to-ports 15053`:
//! - sendmsg4/6: a datagram to port 53 from a pod whose DNS is captured goes to the proxy's DNS
//!   listener on loopback; the server it was meant for is kept on the socket (socket storage).
//! - recvmsg4/6: a reply from the DNS listener is shown to the app as coming from that server,
//!   so resolvers that check the reply's source accept it.
//!
//! TCP and connected UDP to port 53 are steered by connect4/6 (`outbound.rs`), whose getpeername
//! hooks show the original server too.

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use datapath_common::consts::ports;

use crate::{
    net::{is_v4_mapped, LOOPBACK4, LOOPBACK6},
    outbound::{orig_of, show4, show6, steer4, steer6, Hook, ALLOW},
};

#[cgroup_sock_addr(sendmsg4)]
pub fn mp_sendmsg4(ctx: SockAddrContext) -> i32 {
    steer4(&ctx, Hook::Sendmsg)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn mp_sendmsg6(ctx: SockAddrContext) -> i32 {
    steer6(&ctx, Hook::Sendmsg)
}

/// Whether the datagram's source (in the context's user address) is the DNS listener.
#[inline(always)]
fn from_dns_listener(port: u32) -> bool {
    port as u16 == ports::DNS.to_be()
}

#[cgroup_sock_addr(recvmsg4)]
pub fn mp_recvmsg4(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: fields of the kernel's bpf_sock_addr.
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    if ip == LOOPBACK4 && from_dns_listener(port) {
        if let Some(orig) = orig_of(&ctx) {
            show4(&ctx, &orig);
        }
    }
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn mp_recvmsg6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: fields of the kernel's bpf_sock_addr, read one word at a time.
    let (ip, port) = unsafe {
        (
            [(*sa).user_ip6[0], (*sa).user_ip6[1], (*sa).user_ip6[2], (*sa).user_ip6[3]],
            (*sa).user_port,
        )
    };
    let loopback = ip == LOOPBACK6 || (is_v4_mapped(&ip) && ip[3] == LOOPBACK4);
    if loopback && from_dns_listener(port) {
        if let Some(orig) = orig_of(&ctx) {
            show6(&ctx, &orig);
        }
    }
    ALLOW
}
