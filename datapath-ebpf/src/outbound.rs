//! Outbound capture without netfilter. Attached once per node at the cgroup v2 root and
//! filtered by the socket's netns cookie, so a pod is captured from the moment its netns is
//! enrolled, whatever cgroup its containers land in.
//!
//! - connect4/connect6: a captured pod's TCP connect() to any destination goes to the proxy's
//!   outbound listener instead (like istio-cni's `REDIRECT --to-ports 15001`), at the pod's own
//!   address of that family (`POD_ADDRS`), so that the connection's source is the pod's
//!   address as under REDIRECT: the proxy's `peer_addr()` and the app's `getsockname()` both
//!   show the pod, never 127.0.0.1 (loopback only for a family the pod has no address of, or a
//!   socket the app bound to an address not the pod's: `bound_elsewhere`). TCP
//!   and connected UDP to port 53 go to the DNS listener on loopback (15053) when DNS is
//!   captured. The
//!   destination asked for is kept on the socket (socket storage). Sockets of the proxy's cgroup
//!   are never captured: an app cannot join another cgroup from inside its pod, whereas it can
//!   set any socket mark with CAP_NET_ADMIN. A connect that is not steered may still be
//!   refused: the proxy's transparent connect to a pod's app while that pod holds its share of
//!   those not accepted yet (`proxy_sockets::over_share`).
//! - sock_ops: once such a connection is established, its local port is known; the original
//!   destination is filed under (netns, IP version, port, listener port), and the proxy's end,
//!   once established, takes it onto its own socket for the proxy's getsockopt
//!   (`original_dst.rs`). The same program learns the proxy's listeners and transparent
//!   connections (`proxy_sockets.rs`).
//! - getpeername4/6: the app sees the destination it asked for, not the proxy.
//!
//! DNS over unconnected UDP (sendmsg/recvmsg) is in `dns.rs`; it shares [`steer4`]/[`steer6`].

use aya_ebpf::{
    bindings::{
        bpf_sock_addr, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_SOCK_OPS_TCP_LISTEN_CB,
        BPF_TCP_CLOSE,
    },
    helpers::{bpf_get_current_cgroup_id, bpf_get_netns_cookie},
    macros::{cgroup_sock_addr, sock_ops},
    programs::{SockAddrContext, SockOpsContext},
    EbpfContext as _,
};
use core::ptr::{addr_of_mut, write_volatile};
use datapath_common::{
    consts::ports,
    decisions::{reason, NODE_WIDE},
    direction, pod_flags, NetnsCookie, OrigDst, PodIpKey, PortKey, AF_INET, AF_INET6,
};

use crate::{
    accelerate,
    decisions::{mapped, record, Tuple},
    maps::{
        sk_storage_slot, EXCLUDED_PORTS, ORIG_DST_BY_SOCKET, PENDING_CONNECTIONS, PODS, POD_ADDRS,
        POD_IPS, PROXY_CGROUPS,
    },
    net::{
        bound_source, cidr_excluded, is_loopback4, is_v4_mapped, LOOPBACK4, LOOPBACK6,
        V4_MAPPED_PREFIX,
    },
    original_dst, pending, probes, proxy_sockets,
};

/// sock_addr verdicts.
pub const ALLOW: i32 = 1;
const REFUSE: i32 = 0;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

/// The proxy port this socket's traffic to `port_be` must go to: DNS (TCP or UDP to port 53)
/// when the pod's DNS is captured, else the outbound listener for TCP when its outbound is
/// captured and the port is not excluded; with the pod's netns cookie. Otherwise the netns to
/// count under and why not (reason 0: nothing worth counting, e.g. not TCP or UDP).
#[inline(always)]
fn target(
    ctx: &SockAddrContext,
    addr: [u32; 4],
    port_be: u16,
) -> Result<(u16, NetnsCookie), (NetnsCookie, u32)> {
    // SAFETY: the context pointer is the kernel's bpf_sock_addr for this call.
    let protocol = unsafe { (*ctx.sock_addr).protocol };
    if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
        return Err((NODE_WIDE, 0));
    }
    // SAFETY: helpers called with this program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: map values are plain data owned by the map.
    let Some(pod) = (unsafe { PODS.get(&netns) }) else {
        return Err((NODE_WIDE, reason::OUT_PASS_NOT_ENROLLED));
    };
    if pod.flags & (pod_flags::CAPTURE_OUTBOUND | pod_flags::CAPTURE_DNS) == 0 {
        return Err((netns, reason::OUT_PASS_NOT_CAPTURED));
    }
    // SAFETY: no arguments.
    let cgroup = unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: as above.
    if unsafe { PROXY_CGROUPS.get(&cgroup) }.is_some() {
        return Err((netns, reason::OUT_PASS_PROXY_CGROUP));
    }
    let port = u16::from_be(port_be);
    if port == ports::DNS_UPSTREAM && pod.flags & pod_flags::CAPTURE_DNS != 0 {
        return Ok((ports::DNS, netns));
    }
    if protocol != IPPROTO_TCP || pod.flags & pod_flags::CAPTURE_OUTBOUND == 0 {
        return Err((netns, reason::OUT_PASS_NOT_CAPTURED));
    }
    let key = PortKey { netns, port, direction: direction::OUTBOUND, _pad: 0 };
    // SAFETY: as above.
    if unsafe { EXCLUDED_PORTS.get(&key) }.is_some() {
        return Err((netns, reason::OUT_PASS_EXCLUDED_PORT));
    }
    // The pod talking to its own address stays in the pod (istio-cni: "via lo → ACCEPT").
    // SAFETY: as above.
    if unsafe { POD_IPS.get(&PodIpKey { addr }) } == Some(&netns) {
        return Err((netns, reason::OUT_PASS_OWN_ADDRESS));
    }
    if cidr_excluded(netns, direction::OUTBOUND, addr) {
        return Err((netns, reason::OUT_PASS_EXCLUDED_CIDR));
    }
    Ok((ports::OUTBOUND, netns))
}

/// Which hook steers: connect (every decision counted) or sendmsg (only captured DNS counted:
/// a node's every UDP datagram is not worth a count).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Connect,
    Sendmsg,
}

/// Counts a connect that stays on loopback: under its pod, or node-wide outside any pod.
#[inline(always)]
fn count_loopback(ctx: &SockAddrContext, hook: Hook, dst: [u32; 4], port_be: u16) {
    if hook != Hook::Connect {
        return;
    }
    // SAFETY: helper called with this program's own context; map values are plain data.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let (netns, why) = if unsafe { PODS.get(&netns) }.is_some() {
        (netns, reason::OUT_PASS_LOOPBACK)
    } else {
        (NODE_WIDE, reason::OUT_PASS_NOT_ENROLLED)
    };
    record(ctx, netns, why, || to(dst, port_be));
}

/// A monitor tuple with only the destination known (connect and sendmsg run before the source
/// port is chosen).
#[inline(always)]
fn to(dst: [u32; 4], port_be: u16) -> Tuple {
    Tuple { dst, dst_port: u16::from_be(port_be), ..Tuple::default() }
}

/// Counts the outcome of [`target`] for a destination that was not steered.
#[inline(always)]
fn count_pass(
    ctx: &SockAddrContext,
    hook: Hook,
    (netns, why): (NetnsCookie, u32),
    dst: [u32; 4],
    port_be: u16,
) {
    if hook == Hook::Connect && why != 0 {
        record(ctx, netns, why, || to(dst, port_be));
    }
}

/// Counts a steered destination.
#[inline(always)]
fn count_steered(
    ctx: &SockAddrContext,
    hook: Hook,
    to_port: u16,
    netns: NetnsCookie,
    dst: [u32; 4],
    port_be: u16,
) {
    let why = if to_port == ports::DNS { reason::DNS_CAPTURED } else { reason::OUT_CAPTURED };
    if hook == Hook::Connect || why == reason::DNS_CAPTURED {
        record(ctx, netns, why, || to(dst, port_be));
    }
}

/// Whether the app bound this socket to an address that is not the pod's: one it added to its
/// interface (CAP_NET_ADMIN), or loopback. Its connection to the pod's own address would look,
/// to sk_lookup, like one from outside the pod (`ingress_ifindex` names the address's
/// interface, not `lo`) and be steered to the pod's inbound listener: the proxy would take its
/// app for a client, and the address it chose for the client's. So it goes to the outbound
/// listener on loopback, as REDIRECT sends every local connection (to 127.0.0.1, from the
/// source the app had): still captured, its source the address it bound, as under istio-cni.
/// (A socket bound to an address the pod does not have, with IP_TRANSPARENT, gets no answer:
/// the reply from loopback cannot leave the pod.)
#[inline(always)]
fn bound_elsewhere(ctx: &SockAddrContext, netns: NetnsCookie) -> bool {
    let src = bound_source(ctx);
    let unspecified = src == [0; 4] || (is_v4_mapped(&src) && src[3] == 0);
    // SAFETY: map values are plain data owned by the map.
    !unspecified && unsafe { POD_IPS.get(&PodIpKey { addr: src }) } != Some(&netns)
}

/// Where a captured connection is sent: the DNS listener on loopback, the outbound listener at
/// the pod's own address of the family (`v4`: IPv4 or v4-mapped), or on loopback if the pod
/// has none or the socket is bound to an address not the pod's ([`bound_elsewhere`]). A
/// network-order word for IPv4, words for IPv6 (v4-mapped for `v4`).
#[inline(always)]
fn proxy_addr4(ctx: &SockAddrContext, to: u16, netns: NetnsCookie) -> u32 {
    if to != ports::OUTBOUND || bound_elsewhere(ctx, netns) {
        return LOOPBACK4;
    }
    // SAFETY: map values are plain data owned by the map.
    match unsafe { POD_ADDRS.get(&netns) } {
        Some(a) if a.v4 != 0 => a.v4,
        _ => LOOPBACK4,
    }
}

/// As [`proxy_addr4`] for a native IPv6 destination.
#[inline(always)]
fn proxy_addr6(ctx: &SockAddrContext, to: u16, netns: NetnsCookie) -> [u32; 4] {
    if to != ports::OUTBOUND || bound_elsewhere(ctx, netns) {
        return LOOPBACK6;
    }
    // SAFETY: as above.
    match unsafe { POD_ADDRS.get(&netns) } {
        Some(a) if a.v6 != [0; 4] => a.v6,
        _ => LOOPBACK6,
    }
}

/// Whether a captured TCP connect must be refused because its pod holds its share of
/// connections the proxy has not taken yet (`pending.rs`).
#[inline(always)]
fn over_share(ctx: &SockAddrContext, hook: Hook, netns: NetnsCookie) -> bool {
    // SAFETY: the context pointer is the kernel's bpf_sock_addr for this call.
    hook == Hook::Connect
        && unsafe { (*ctx.sock_addr).protocol } == IPPROTO_TCP
        && pending::full(&PENDING_CONNECTIONS, netns)
}

/// Files the original destination in the socket's own storage (a socket steered again, as a
/// UDP one may be, gets the new one; one connected anywhere else forgets it: [`forget`]). No
/// memory for it is a refusal, not a leak around the proxy.
#[inline(always)]
fn remember(ctx: &SockAddrContext, orig: &OrigDst) -> bool {
    // SAFETY: the helper is given this program's own socket; a pointer it returns is that
    // socket's OrigDst, created zeroed if it had none.
    unsafe {
        let slot = ORIG_DST_BY_SOCKET.get_or_insert_ptr_mut(ctx, None);
        if slot.is_null() {
            return false;
        }
        *slot = *orig;
    }
    true
}

/// A connect that is not steered: a destination the socket was steered to before (a UDP
/// socket connects again; a TCP one may after a failed connect) is forgotten, so getpeername
/// and recvmsg show the socket's own peer. Not on sendmsg: an unconnected socket keeps the DNS
/// server it last wrote to, for the replies still to come.
#[inline(always)]
fn forget(ctx: &SockAddrContext, hook: Hook) {
    if hook == Hook::Connect {
        // SAFETY: the context's socket (the verifier types it a socket, never null); deleting
        // storage the socket does not have is a no-op (ENOENT).
        let _ = unsafe { ORIG_DST_BY_SOCKET.delete((*ctx.sock_addr).__bindgen_anon_1.sk) };
    }
}

/// Rewrites an IPv4 destination (connect4, sendmsg4) to the proxy if captured.
#[inline(always)]
pub fn steer4(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: fields of the kernel's bpf_sock_addr; user_port holds a network-order u16.
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16) };
    // Loopback and the unspecified address (which connects to this host) stay in the pod.
    if is_loopback4(ip) || ip == 0 {
        forget(ctx, hook);
        count_loopback(ctx, hook, mapped(ip), port);
        return ALLOW;
    }
    let dst = PodIpKey::v4(ip).addr;
    let (to, netns) = match target(ctx, dst, port) {
        Ok(t) => t,
        Err(not) => {
            if hook == Hook::Connect && proxy_sockets::over_share(ctx, not.0, dst, port) {
                return REFUSE;
            }
            forget(ctx, hook);
            count_pass(ctx, hook, not, mapped(ip), port);
            return ALLOW;
        }
    };
    if over_share(ctx, hook, netns) {
        record(ctx, netns, reason::OUT_REFUSED_SHARE_FULL, || self::to(mapped(ip), port));
        return REFUSE;
    }
    if !remember(ctx, &OrigDst { addr: [ip, 0, 0, 0], port, family: AF_INET }) {
        record(ctx, netns, reason::OUT_REFUSED_NO_SLOT, || self::to(mapped(ip), port));
        return REFUSE;
    }
    count_steered(ctx, hook, to, netns, mapped(ip), port);
    let proxy = proxy_addr4(ctx, to, netns);
    // Volatile, one field at a time: merged into one 8-byte store the verifier rejects the
    // write ("invalid bpf_context access").
    // SAFETY: writable fields of the context.
    unsafe {
        write_volatile(addr_of_mut!((*sa).user_ip4), proxy);
        write_volatile(addr_of_mut!((*sa).user_port), u32::from(to.to_be()));
    }
    ALLOW
}

/// Rewrites an IPv6 (or v4-mapped) destination to the proxy (v4-mapped for a v4-mapped one).
#[inline(always)]
pub fn steer6(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: fields of the kernel's bpf_sock_addr, read one word at a time.
    let (ip, port) = unsafe {
        (
            [(*sa).user_ip6[0], (*sa).user_ip6[1], (*sa).user_ip6[2], (*sa).user_ip6[3]],
            (*sa).user_port as u16,
        )
    };
    let mapped = is_v4_mapped(&ip);
    if (mapped && (is_loopback4(ip[3]) || ip[3] == 0)) || ip == LOOPBACK6 || ip == [0; 4] {
        forget(ctx, hook);
        count_loopback(ctx, hook, ip, port);
        return ALLOW;
    }
    let (to, netns) = match target(ctx, ip, port) {
        Ok(t) => t,
        Err(not) => {
            if hook == Hook::Connect && proxy_sockets::over_share(ctx, not.0, ip, port) {
                return REFUSE;
            }
            forget(ctx, hook);
            count_pass(ctx, hook, not, ip, port);
            return ALLOW;
        }
    };
    if over_share(ctx, hook, netns) {
        record(ctx, netns, reason::OUT_REFUSED_SHARE_FULL, || self::to(ip, port));
        return REFUSE;
    }
    let (orig, lo) = if mapped {
        (
            OrigDst { addr: [ip[3], 0, 0, 0], port, family: AF_INET },
            [0, 0, V4_MAPPED_PREFIX, proxy_addr4(ctx, to, netns)],
        )
    } else {
        (OrigDst { addr: ip, port, family: AF_INET6 }, proxy_addr6(ctx, to, netns))
    };
    if !remember(ctx, &orig) {
        record(ctx, netns, reason::OUT_REFUSED_NO_SLOT, || self::to(ip, port));
        return REFUSE;
    }
    count_steered(ctx, hook, to, netns, ip, port);
    // SAFETY: writable fields of the context (see steer4).
    unsafe {
        write_ip6(sa, lo);
        write_volatile(addr_of_mut!((*sa).user_port), u32::from(to.to_be()));
    }
    ALLOW
}

/// Writes `user_ip6` with 4-byte stores.
#[inline(always)]
pub unsafe fn write_ip6(sa: *mut bpf_sock_addr, ip: [u32; 4]) {
    // SAFETY: the caller passes its context; each store is one 4-byte field word.
    unsafe {
        write_volatile(addr_of_mut!((*sa).user_ip6[0]), ip[0]);
        write_volatile(addr_of_mut!((*sa).user_ip6[1]), ip[1]);
        write_volatile(addr_of_mut!((*sa).user_ip6[2]), ip[2]);
        write_volatile(addr_of_mut!((*sa).user_ip6[3]), ip[3]);
    }
}

#[cgroup_sock_addr(connect4)]
pub fn mp_connect4(ctx: SockAddrContext) -> i32 {
    // SAFETY: a field of the kernel's bpf_sock_addr.
    probes::source4(&ctx, unsafe { (*ctx.sock_addr).user_ip4 });
    steer4(&ctx, Hook::Connect)
}

#[cgroup_sock_addr(connect6)]
pub fn mp_connect6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: fields of the kernel's bpf_sock_addr, one word at a time.
    let dst =
        unsafe { [(*sa).user_ip6[0], (*sa).user_ip6[1], (*sa).user_ip6[2], (*sa).user_ip6[3]] };
    probes::source6(&ctx, dst);
    steer6(&ctx, Hook::Connect)
}

/// The original destination of a captured app socket, if this is one.
#[inline(always)]
pub fn orig_of(ctx: &SockAddrContext) -> Option<OrigDst> {
    // SAFETY: the helper is given this program's own socket; a pointer it returns is that
    // socket's OrigDst (plain data).
    unsafe {
        let slot = ORIG_DST_BY_SOCKET.get_ptr_mut(ctx);
        if slot.is_null() {
            None
        } else {
            Some(*slot)
        }
    }
}

/// The original destination of the sock_ops socket, if it is a captured app socket.
#[inline(always)]
fn orig_of_sock_ops(ctx: &SockOpsContext) -> Option<OrigDst> {
    // SAFETY: `sk` of the kernel's bpf_sock_ops for this call, null-checked (the verifier types
    // it "socket or null"); a slot the helper returns is that socket's OrigDst.
    unsafe {
        let sk = (*ctx.ops).__bindgen_anon_2.sk;
        if sk.is_null() {
            return None;
        }
        let slot = sk_storage_slot(&ORIG_DST_BY_SOCKET, sk, false);
        if slot.is_null() {
            None
        } else {
            Some(*slot)
        }
    }
}

/// Puts `orig` into an IPv4 context's user address (getpeername4, recvmsg4).
#[inline(always)]
pub fn show4(ctx: &SockAddrContext, orig: &OrigDst) {
    if orig.family == AF_INET {
        let sa = ctx.sock_addr;
        // SAFETY: writable fields of the context, 4-byte stores.
        unsafe {
            write_volatile(addr_of_mut!((*sa).user_ip4), orig.addr[0]);
            write_volatile(addr_of_mut!((*sa).user_port), u32::from(orig.port));
        }
    }
}

/// Puts `orig` into an IPv6 context's user address, v4-mapped for an IPv4 destination.
#[inline(always)]
pub fn show6(ctx: &SockAddrContext, orig: &OrigDst) {
    let ip =
        if orig.family == AF_INET { [0, 0, V4_MAPPED_PREFIX, orig.addr[0]] } else { orig.addr };
    let sa = ctx.sock_addr;
    // SAFETY: writable fields of the context, 4-byte stores.
    unsafe {
        write_ip6(sa, ip);
        write_volatile(addr_of_mut!((*sa).user_port), u32::from(orig.port));
    }
}

#[cgroup_sock_addr(getpeername4)]
pub fn mp_getpeername4(ctx: SockAddrContext) -> i32 {
    if let Some(orig) = orig_of(&ctx) {
        show4(&ctx, &orig);
    }
    1
}

#[cgroup_sock_addr(getpeername6)]
pub fn mp_getpeername6(ctx: SockAddrContext) -> i32 {
    if let Some(orig) = orig_of(&ctx) {
        show6(&ctx, &orig);
    }
    1
}

#[sock_ops]
pub fn mp_sock_ops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_TCP_LISTEN_CB {
        proxy_sockets::listening(&ctx);
        return 1;
    }
    if op == BPF_SOCK_OPS_TCP_CONNECT_CB {
        proxy_sockets::connecting(&ctx);
        return 1;
    }
    if op == BPF_SOCK_OPS_STATE_CB {
        // Only sockets that asked hear of their state changes: captured app ends (their
        // pending entry), the proxy's transparent connections (their filing).
        if !pending::app_state_changed(&ctx) && ctx.arg(1) == BPF_TCP_CLOSE {
            proxy_sockets::state_changed(&ctx);
        }
        return 1;
    }
    if op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        // The proxy's end of an app↔proxy connection: accepted on the outbound (or DNS)
        // listener in an enrolled pod.
        let local = ctx.local_port();
        if local == u32::from(ports::OUTBOUND) || local == u32::from(ports::DNS) {
            original_dst::accepted(&ctx);
        } else if !ports::is_inbound_listener_port(local as u16) {
            // Possibly an app's end of the proxy's transparent connection to it.
            proxy_sockets::accepted(&ctx);
        }
        if local == u32::from(ports::OUTBOUND) && accelerate::enabled() {
            // SAFETY: helper called with this program's own context; map values are plain data.
            let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
            if unsafe { PODS.get(&netns) }.is_some() {
                accelerate::add(&ctx, netns);
            }
        }
        return 1;
    }
    if op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        return 1;
    }
    let Some(orig) = orig_of_sock_ops(&ctx) else {
        return 1;
    };
    let key = pending::app_key(&ctx);
    // Before the ACK that lets the proxy's end be established (and take it) is sent.
    if let Err(why) = pending::file(&ctx, &key, &orig) {
        record(&ctx, key.netns, why, || Tuple {
            dst: if orig.family == AF_INET { mapped(orig.addr[0]) } else { orig.addr },
            dst_port: u16::from_be(orig.port),
            src_port: key.port,
            ..Tuple::default()
        });
        return 1;
    }
    // The app's end of a connection to the outbound listener (not DNS).
    if accelerate::enabled() && key.proxy_port == ports::OUTBOUND {
        accelerate::add(&ctx, key.netns);
    }
    1
}
