//! The pod's interface, egress: TCP that no TCP socket sent does not leave an enrolled pod.
//!
//! The capture hooks run when a TCP socket connects, so a pod's raw socket (`SOCK_RAW`,
//! CAP_NET_RAW, which runtimes grant by default) or packet socket (`AF_PACKET`) can hand-build a
//! SYN that no hook sees and reach a peer past the proxy. istio-cni's nat OUTPUT rules see a raw
//! IP socket's SYN (netfilter's LOCAL_OUT runs for it) and redirect it to the proxy; here this
//! program, on the pod's interface, drops it. A packet socket's frames pass no netfilter hook, so
//! istio-cni lets them out; this program sees them unless the socket asks for
//! `PACKET_QDISC_BYPASS`, which skips TC egress as well (docs/datapath.md, "Known limits").
//!
//! What TCP is comes from the frame itself: its ethertype, past up to two VLAN tags, as the
//! receiver reads it (a packet socket chooses the kernel's `skb->protocol` for its frame).
//!
//! What passes untouched: everything that is not TCP, and TCP sent by a kernel TCP socket,
//! which capture has already decided on (app, proxy, excluded port or prefix, probe reply).
//! What passes from any other sender is what the kernel's own control socket (itself a raw TCP
//! socket, which a program cannot tell from an app's) sends: resets (no SYN, no data, not
//! fragmented), which no peer answers; and bare ACKs that answer one of the pod's TIME_WAIT or
//! request sockets (found by looking the connection up in the pod's netns), the only ones that
//! socket sends. A bare ACK, FIN or flagless segment for any other connection is a probe a peer
//! would answer (an ACK, FIN or NULL scan); it is dropped with everything else, and counted
//! (`EGRESS_DROP_NOT_TCP_SOCKET`).
//!
//! One instance for the node, loaded and pinned once; enrolment attaches it to the pod's
//! interface as a netlink filter on a clsact qdisc (a fraction of a millisecond) rather than a
//! TCX link, whose attach and detach each wait for an RCU grace period (10 to 20 ms here), on
//! the CNI ADD and DEL path. Being one instance, it has no pod cookie: drops are counted node-wide
//! (`bpf_get_netns_cookie` takes an skb in TC only from Linux 6.15 on).
//!
//! The node side, `tc_node_guard`: TC ingress on the node's end of each of the pod's links (a
//! veth's peer in the node's netns), where every frame the pod sends arrives however it was
//! sent: a packet socket's with `PACKET_QDISC_BYPASS`, and any frame of a pod with
//! CAP_NET_ADMIN that deleted its own side's filters. The frame has no socket there (crossing
//! the veth orphans it), so the question is asked of the pod's netns instead: is there a TCP
//! socket of the pod with this segment's connection (`bpf_skc_lookup_tcp` in the pod's netns,
//! by the id the node's netns knows it by: `HOST_ENDS`)? A connecting, established, closing,
//! request or TIME_WAIT socket: the segment passes. Only a listener (the lookup falls back to
//! one): only a SYN-ACK passes, the one a listener sends with SYN cookies; any other segment
//! from a listener's port opens or probes nothing a real socket of the pod would. None: the
//! segment is dropped and counted for the pod (`NODE_DROP_NOT_POD_SOCKET`). A raw socket that
//! copies a live connection's 4-tuple gets through, into a connection the pod already has.

use aya_ebpf::{
    bindings::{
        bpf_sock, bpf_sock_tuple, BPF_F_CURRENT_NETNS, BPF_TCP_LISTEN, BPF_TCP_NEW_SYN_RECV,
        BPF_TCP_SYN_RECV, BPF_TCP_TIME_WAIT, TC_ACT_SHOT, TC_ACT_UNSPEC,
    },
    helpers::{bpf_sk_fullsock, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
    EbpfContext as _,
};
use core::ptr::{addr_of, read_volatile};
use datapath_common::decisions::{reason, NODE_WIDE};

use crate::{
    decisions::{mapped, record, Tuple},
    maps::HOST_ENDS,
};

/// cls_bpf (direct action) verdict "no opinion": the next filter runs, and after the last one
/// the packet goes on.
const PASS: i32 = TC_ACT_UNSPEC;
/// cls_bpf verdict "drop".
const DROP: i32 = TC_ACT_SHOT as i32;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
/// VLAN tags skipped to find the frame's network header: 802.1ad outside 802.1Q inside (QinQ),
/// as a receiver strips them. A frame with more is taken as TCP this cannot read.
const MAX_VLAN_TAGS: usize = 2;
const IPPROTO_TCP: u8 = 6;
const SOCK_STREAM: u32 = 1;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// IPv6 extension headers walked before giving up (each one a helper call).
const MAX_EXTENSION_HEADERS: usize = 4;

/// What the headers say about a packet.
enum Segment {
    /// Not TCP: not this program's business.
    NotTcp,
    /// A reset that opens nothing and carries nothing.
    Reset,
    /// A segment with neither SYN, RST nor data (a bare ACK, a FIN, no flags): the kernel's
    /// answer for one of its mini sockets, or a probe.
    Bare(Readable),
    /// A SYN (`syn_ack`: with ACK) or data.
    Opening { r: Readable, syn_ack: bool },
    /// TCP this program cannot read whole: a fragment, headers it cannot walk.
    Unreadable(Tuple),
}

/// A TCP segment whose connection can be looked up: `t` has its ports (and destination), `v4`
/// says the addresses are v4-mapped, `l3` is where the IP header starts.
#[derive(Clone, Copy)]
struct Readable {
    t: Tuple,
    v4: bool,
    l3: usize,
}

/// The verdict for one packet leaving an enrolled pod.
#[classifier]
pub fn tc_pod_guard(ctx: TcContext) -> i32 {
    if sent_by_tcp_socket(&ctx) {
        return PASS;
    }
    let t = match segment(&ctx) {
        Segment::NotTcp | Segment::Reset => return PASS,
        Segment::Bare(r) => match socket_state(&ctx, &r, BPF_F_CURRENT_NETNS as u64) {
            Some(state) if is_mini_socket(state) => return PASS,
            _ => r.t,
        },
        Segment::Opening { r, .. } => r.t,
        Segment::Unreadable(t) => t,
    };
    record(&ctx, NODE_WIDE, reason::EGRESS_DROP_NOT_TCP_SOCKET, || t);
    DROP
}

/// The verdict for one frame arriving from an enrolled pod at the node's end of its link.
#[classifier]
pub fn tc_node_guard(ctx: TcContext) -> i32 {
    let (r, syn_ack) = match segment(&ctx) {
        Segment::NotTcp | Segment::Reset => return PASS,
        Segment::Bare(r) => (r, false),
        Segment::Opening { r, syn_ack } => (r, syn_ack),
        Segment::Unreadable(t) => {
            record(&ctx, NODE_WIDE, reason::NODE_DROP_NOT_POD_SOCKET, || t);
            return DROP;
        }
    };
    // SAFETY: a field of the kernel's __sk_buff for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a plain value the map owns, copied out at once.
    let Some(&end) = (unsafe { HOST_ENDS.get(&ifindex) }) else {
        // Attached only after its entry is written, and taken off before it is removed: a
        // filter on an end with no entry is a left-over, which still fails closed.
        record(&ctx, NODE_WIDE, reason::NODE_DROP_NOT_POD_SOCKET, || r.t);
        return DROP;
    };
    match socket_state(&ctx, &r, u64::from(end.nsid)) {
        Some(BPF_TCP_LISTEN) if !syn_ack => {}
        Some(_) => return PASS,
        None => {}
    }
    record(&ctx, end.netns, reason::NODE_DROP_NOT_POD_SOCKET, || r.t);
    DROP
}

/// The kernel's TIME_WAIT and request sockets, for which its control socket sends ACKs.
#[inline(always)]
fn is_mini_socket(state: u32) -> bool {
    state == BPF_TCP_TIME_WAIT || state == BPF_TCP_NEW_SYN_RECV || state == BPF_TCP_SYN_RECV
}

/// The state of the TCP socket of `netns` (a netns id in the netns of the packet's device, or
/// `BPF_F_CURRENT_NETNS`) that has the connection of a segment sent from there: looked up as
/// the segment's answer would be received, so an established, connecting, TIME_WAIT or request
/// socket, or failing those a listener on the segment's source port. The addresses are read
/// here, at their fixed offsets, not while the headers are walked: carried through every path
/// of that walk they cost Linux 6.1's verifier over its million instructions.
#[inline(always)]
fn socket_state(ctx: &TcContext, r: &Readable, netns: u64) -> Option<u32> {
    let (t, v4, l3) = (&r.t, r.v4, r.l3);
    // SAFETY: an all-zero tuple is valid plain data; the union's member written is the one
    // whose size is passed.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = if v4 {
        let Ok([src, dst]) = ctx.load::<[u32; 2]>(l3 + 12) else {
            return None;
        };
        tuple.__bindgen_anon_1.ipv4.saddr = dst;
        tuple.__bindgen_anon_1.ipv4.daddr = src;
        tuple.__bindgen_anon_1.ipv4.sport = t.dst_port.to_be();
        tuple.__bindgen_anon_1.ipv4.dport = t.src_port.to_be();
        // SAFETY: the member just written.
        core::mem::size_of_val(unsafe { &tuple.__bindgen_anon_1.ipv4 })
    } else {
        let Ok([src, dst]) = ctx.load::<[[u32; 4]; 2]>(l3 + 8) else {
            return None;
        };
        tuple.__bindgen_anon_1.ipv6.saddr = dst;
        tuple.__bindgen_anon_1.ipv6.daddr = src;
        tuple.__bindgen_anon_1.ipv6.sport = t.dst_port.to_be();
        tuple.__bindgen_anon_1.ipv6.dport = t.src_port.to_be();
        // SAFETY: as above.
        core::mem::size_of_val(unsafe { &tuple.__bindgen_anon_1.ipv6 })
    };
    // SAFETY: the helper gets this program's context and a tuple of the size given; a socket it
    // returns holds a reference, released below on every path (the verifier checks that).
    unsafe {
        let sk = bpf_skc_lookup_tcp(ctx.as_ptr(), &mut tuple, size as u32, netns, 0);
        if sk.is_null() {
            return None;
        }
        let state = read_volatile(addr_of!((*sk).state));
        bpf_sk_release(sk.cast());
        Some(state)
    }
}

/// Whether the kernel's TCP sent this: the skb's socket is a TCP stream socket, or one of TCP's
/// own mini sockets (a request socket's SYN-ACK, a TIME_WAIT socket's ACK), which are not full
/// sockets. No socket at all passes too: locally sent packets always carry theirs, so none
/// means forwarded, which a pod cannot turn on without CAP_NET_ADMIN.
#[inline(always)]
fn sent_by_tcp_socket(ctx: &TcContext) -> bool {
    // SAFETY: `skb` is the kernel's __sk_buff for this run; `sk` is read with one 8-byte load
    // at its fixed offset, which the verifier rewrites into skb->sk (or NULL).
    let sk: *mut bpf_sock = unsafe { read_volatile(addr_of!((*ctx.skb.skb).__bindgen_anon_2.sk)) };
    if sk.is_null() {
        return true;
    }
    // SAFETY: `sk` is non-NULL as the verifier requires; the helper answers NULL for the mini
    // sockets.
    let full = unsafe { bpf_sk_fullsock(sk) };
    if full.is_null() {
        return true;
    }
    // SAFETY: `type` and `protocol` are readable on a full socket (the verifier refuses them on
    // the socket from `skb->sk` before bpf_sk_fullsock).
    unsafe {
        read_volatile(addr_of!((*full).type_)) == SOCK_STREAM
            && read_volatile(addr_of!((*full).protocol)) == u32::from(IPPROTO_TCP)
    }
}

/// Reads the headers (through bpf_skb_load_bytes, so any offset is checked at run time).
/// Unreadable headers of a TCP packet count as [`Segment::Unreadable`].
///
/// The network protocol is the frame's own ethertype, read from its bytes past any VLAN tags,
/// as the receiver reads it: not `skb->protocol`, which a packet socket sets from its
/// `sll_protocol` whatever the frame holds (an IPv4 SYN sent as ARP passed a guard that went by
/// it), and which says nothing of what is behind a tag.
#[inline(always)]
fn segment(ctx: &TcContext) -> Segment {
    let Ok(mut proto) = ctx.load::<u16>(ETH_HLEN - 2) else {
        return Segment::Unreadable(Tuple::default());
    };
    let mut l3 = ETH_HLEN;
    for _ in 0..MAX_VLAN_TAGS {
        let p = u16::from_be(proto);
        if p != ETH_P_8021Q && p != ETH_P_8021AD {
            break;
        }
        // The tag: 2 bytes of priority and VLAN id, then the ethertype of what follows.
        proto = match ctx.load::<u16>(l3 + 2) {
            Ok(next) => next,
            Err(_) => return Segment::Unreadable(Tuple::default()),
        };
        l3 += 4;
    }
    match u16::from_be(proto) {
        ETH_P_IP => v4(ctx, l3),
        ETH_P_IPV6 => v6(ctx, l3),
        // More tags than this walks: what they hide is unknown.
        ETH_P_8021Q | ETH_P_8021AD => Segment::Unreadable(Tuple::default()),
        _ => Segment::NotTcp,
    }
}

#[inline(always)]
fn v4(ctx: &TcContext, l3: usize) -> Segment {
    let ip = l3;
    match ctx.load::<u8>(ip + 9) {
        Ok(IPPROTO_TCP) => {}
        Ok(_) => return Segment::NotTcp,
        Err(_) => return Segment::Unreadable(Tuple::default()),
    }
    let dst = ctx.load::<u32>(ip + 16).unwrap_or(0);
    let mut t = Tuple { dst: mapped(dst), ..Tuple::default() };
    let (Ok(ver_ihl), Ok(total), Ok(frag)) =
        (ctx.load::<u8>(ip), ctx.load::<u16>(ip + 2), ctx.load::<u16>(ip + 6))
    else {
        return Segment::Unreadable(t);
    };
    // A fragment: the flags may be in a later one (or this is one), which this cannot see.
    if u16::from_be(frag) & 0x3fff != 0 {
        return Segment::Unreadable(t);
    }
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    tcp(ctx, ip + ihl, usize::from(u16::from_be(total)).saturating_sub(ihl), &mut t, l3, true)
}

#[inline(always)]
fn v6(ctx: &TcContext, l3: usize) -> Segment {
    let ip = l3;
    let (Ok(payload), Ok(mut next)) = (ctx.load::<u16>(ip + 4), ctx.load::<u8>(ip + 6)) else {
        return Segment::Unreadable(Tuple::default());
    };
    let mut t = Tuple::default();
    for (i, w) in t.dst.iter_mut().enumerate() {
        *w = ctx.load::<u32>(ip + 24 + 4 * i).unwrap_or(0);
    }
    let mut off = ip + 40;
    let mut left = usize::from(u16::from_be(payload));
    // Bounded for the verifier; a chain longer than this is refused, not walked.
    for _ in 0..MAX_EXTENSION_HEADERS {
        let len = match next {
            IPPROTO_TCP => return tcp(ctx, off, left, &mut t, l3, false),
            // Hop-by-hop, routing, destination options: (length + 1) * 8 bytes.
            0 | 43 | 60 => match ctx.load::<u8>(off + 1) {
                Ok(l) => (usize::from(l) + 1) * 8,
                Err(_) => return Segment::Unreadable(t),
            },
            // Fragment: 8 bytes; TCP behind it is a fragment of a segment.
            44 => match ctx.load::<u8>(off) {
                Ok(IPPROTO_TCP) => return Segment::Unreadable(t),
                Ok(_) => return Segment::NotTcp,
                Err(_) => return Segment::Unreadable(t),
            },
            // Authentication header: (length + 2) * 4 bytes.
            51 => match ctx.load::<u8>(off + 1) {
                Ok(l) => (usize::from(l) + 2) * 4,
                Err(_) => return Segment::Unreadable(t),
            },
            _ => return Segment::NotTcp,
        };
        next = match ctx.load::<u8>(off) {
            Ok(n) => n,
            Err(_) => return Segment::Unreadable(t),
        };
        off += len;
        left = left.saturating_sub(len);
    }
    if next == IPPROTO_TCP {
        tcp(ctx, off, left, &mut t, l3, false)
    } else {
        Segment::Unreadable(t)
    }
}

/// The TCP header at `off`, `len` bytes of segment (header and data) after it, in the packet
/// whose IP header is at `l3`; `v4`: an IPv4 packet's.
#[inline(always)]
fn tcp(ctx: &TcContext, off: usize, len: usize, t: &mut Tuple, l3: usize, v4: bool) -> Segment {
    let (Ok(ports), Ok(doff), Ok(flags)) =
        (ctx.load::<[u16; 2]>(off), ctx.load::<u8>(off + 12), ctx.load::<u8>(off + 13))
    else {
        return Segment::Unreadable(*t);
    };
    t.src_port = u16::from_be(ports[0]);
    t.dst_port = u16::from_be(ports[1]);
    let header = usize::from(doff >> 4) * 4;
    let r = Readable { t: *t, v4, l3 };
    if flags & TCP_SYN != 0 || len > header {
        Segment::Opening { r, syn_ack: flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK }
    } else if flags & TCP_RST != 0 {
        Segment::Reset
    } else {
        Segment::Bare(r)
    }
}
