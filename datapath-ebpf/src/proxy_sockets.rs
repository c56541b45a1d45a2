//! What the datapath learns about the proxy's sockets by itself. The proxy contract is
//! istio-cni's: a proxy only opens sockets in the pod's netns (from the netns fd it gets over
//! ZDS); it writes no map, registers nothing and installs no route. So the kernel side finds,
//! from `sock_ops` (node-wide, filtered by the pods' netns cookies):
//!
//! - **The inbound listeners.** A socket that starts listening on 15006 or 15008 in an enrolled
//!   pod (`TCP_LISTEN_CB`, run in `listen()`) is filed in `INBOUND_LISTENERS` under the pod, the
//!   port and the socket's family; sk_lookup steers the pod's inbound TCP to it (HBONE to the
//!   15008 one, every other port to the 15006 one), and the kernel drops the entry when the
//!   socket closes (proxy gone → nothing to steer to → refused). Only a socket the proxy bound
//!   (`PROXY_BOUND`, set by the bind hook in `proxy_ports.rs`, which refuses anyone else these
//!   ports in the pod) counts; the proxy's listener gets the pod's inbound traffic, as under
//!   istio-cni's `REDIRECT --to-ports 15006`.
//! - **Transparent connections to the app.** A connect made inside an enrolled pod to one of
//!   the pod's own addresses from an address that is not the pod's (an `IP_TRANSPARENT` socket
//!   bound to the client's address: the proxy keeping the client's address, which needs
//!   CAP_NET_RAW or CAP_NET_ADMIN in the pod), if the proxy bound it (`PROXY_BOUND`: an app's
//!   own is only counted), is filed in `PROXY_TRANSPARENT` once its 4-tuple is known
//!   (`TCP_CONNECT_CB`, before its SYN is built); sk_lookup lets its SYN reach the app.
//!   istio-cni never redirects a connection made inside the pod to the pod itself either. The
//!   entry is needed only for the handshake: it goes when the app's end is accepted
//!   (`PASSIVE_ESTABLISHED`, [`accepted`]), after which every segment of the connection finds
//!   that socket, or its TIME_WAIT, before sk_lookup would run; or when the connecting end
//!   closes first (`STATE_CB`, which this turns on for that socket only; removed even if the
//!   pod has left). Each pod's entries are counted (`PENDING_TRANSPARENT`) and held to its
//!   share: connect4/6 refuses the proxy's next transparent connect to a pod at its share
//!   ([`over_share`]; sock_ops cannot refuse a connect). The socket gets `marks::REPLY`:
//!   its SYN carries the mark, `tcp_fwmark_accept` gives it to the app's accepted socket, and
//!   the pod's `fwmark 0x111/0xfff lookup 133` rule (written at enrolment) delivers the app's
//!   replies locally, back to the proxy. The proxy's own mark (ztunnel's 0x539) is replaced on
//!   this one socket, whose packets are local anyway; every other socket of the proxy keeps its
//!   mark and routes normally.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_EXIST, BPF_NOEXIST, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE},
    helpers::{bpf_get_netns_cookie, bpf_setsockopt},
    programs::{SockAddrContext, SockOpsContext},
    EbpfContext as _,
};
use datapath_common::{
    consts::{marks, ports, sol_socket},
    decisions::{reason, NODE_WIDE},
    ListenerKey, NetnsCookie, PodIpKey, TransparentKey, AF_INET, AF_INET6,
};

use crate::{
    decisions::{record, Tuple},
    maps::{
        sk_storage_slot, INBOUND_LISTENERS, PENDING_TRANSPARENT, PODS, POD_IPS, PROXY_BOUND,
        PROXY_TRANSPARENT,
    },
    net::{bound_source, is_loopback4, is_v4_mapped, sock_ops_key, LOOPBACK6},
    pending::{self, ONE_LESS, ONE_MORE},
};

const IPPROTO_TCP: u32 = 6;

/// The netns cookie of the socket, if it is an enrolled pod's.
#[inline(always)]
fn enrolled_netns(ctx: &SockOpsContext) -> Option<NetnsCookie> {
    // SAFETY: helper called with this program's own context; map values are plain data.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    unsafe { PODS.get(&netns) }.map(|_| netns)
}

/// `TCP_LISTEN_CB`: files a pod's listener on an inbound listener port (15006, 15008), if the
/// proxy bound it
/// (`PROXY_BOUND`).
#[inline(always)]
pub fn listening(ctx: &SockOpsContext) {
    // `local_port` is in host order and fits in 16 bits.
    let port = ctx.local_port() as u16;
    if !ports::is_inbound_listener_port(port) {
        return;
    }
    let Some(netns) = enrolled_netns(ctx) else {
        return;
    };
    // SAFETY: `sk` is this callback's socket (the verifier has it "socket or null": checked);
    // a slot the helper returns is that socket's mark.
    let bound_by_proxy = unsafe {
        let sk = (*ctx.ops).__bindgen_anon_2.sk;
        !sk.is_null() && !sk_storage_slot(&PROXY_BOUND, sk, false).is_null()
    };
    if !bound_by_proxy {
        return;
    }
    let family = if ctx.family() == u32::from(AF_INET) { AF_INET } else { AF_INET6 };
    let key = ListenerKey { netns, port, family, _pad: 0 };
    // SAFETY: the context is the kernel's bpf_sock_ops for this callback.
    let _ = INBOUND_LISTENERS.update(key, unsafe { &mut *ctx.ops }, u64::from(BPF_ANY));
}

/// The [`TransparentKey`] of a connection from the connecting socket's side, if it is a
/// transparent connection inside its (enrolled) pod to the pod itself.
#[inline(always)]
fn transparent_key(ctx: &SockOpsContext) -> Option<TransparentKey> {
    let netns = enrolled_netns(ctx)?;
    let k = sock_ops_key(ctx.ops, netns);
    // To one of the pod's own addresses…
    // SAFETY: map values are plain data owned by the map.
    if unsafe { POD_IPS.get(&PodIpKey { addr: k.remote }) } != Some(&netns) {
        return None;
    }
    // …from an address that is neither the pod's nor loopback.
    if !outside_source(netns, &k.local) {
        return None;
    }
    Some(reversed(&k))
}

/// Whether `addr` (IPv6 or v4-mapped) is an address a transparent socket in the pod `netns`
/// connects from: not unspecified (an unbound socket), not loopback, not the pod's own.
#[inline(always)]
fn outside_source(netns: NetnsCookie, addr: &[u32; 4]) -> bool {
    let mapped = is_v4_mapped(addr);
    let unspecified = *addr == [0; 4] || (mapped && addr[3] == 0);
    let loopback = *addr == LOOPBACK6 || (mapped && is_loopback4(addr[3]));
    // SAFETY: map values are plain data owned by the map.
    !unspecified && !loopback && unsafe { POD_IPS.get(&PodIpKey { addr: *addr }) } != Some(&netns)
}

/// connect4/6 of a socket in an enrolled pod (`netns`) that is not steered, to `dst` (IPv6 or
/// v4-mapped; `port_be` for the count): whether it is the proxy's transparent connect to the
/// pod itself (TCP, to one of the pod's own addresses, on a socket the proxy bound to an
/// outside address) while the pod holds its share of those not accepted yet. Refused then, and
/// counted: sock_ops, which files them, cannot refuse a connect, and a connect left unfiled
/// would be steered to the proxy's own `:15006`. Connects that got past here together can pass
/// the share only by as many as run at once.
#[inline(always)]
pub fn over_share(ctx: &SockAddrContext, netns: NetnsCookie, dst: [u32; 4], port_be: u16) -> bool {
    // SAFETY: the context pointer is the kernel's bpf_sock_addr for this call.
    if netns == NODE_WIDE || unsafe { (*ctx.sock_addr).protocol } != IPPROTO_TCP {
        return false;
    }
    // SAFETY: map values are plain data owned by the map.
    if unsafe { POD_IPS.get(&PodIpKey { addr: dst }) } != Some(&netns)
        || !pending::full(&PENDING_TRANSPARENT, netns)
    {
        return false;
    }
    // SAFETY: the helper is given this program's own socket; only whether a slot exists is
    // read.
    if unsafe { PROXY_BOUND.get_ptr_mut(ctx) }.is_null() {
        return false;
    }
    let src = bound_source(ctx);
    if !outside_source(netns, &src) {
        return false;
    }
    record(ctx, netns, reason::IN_REFUSED_SHARE_FULL, || Tuple {
        src,
        dst,
        dst_port: u16::from_be(port_be),
        ..Tuple::default()
    });
    true
}

/// `TCP_CONNECT_CB`: files a transparent connection to the pod itself and marks its socket,
/// if the proxy bound the socket (`PROXY_BOUND`, set by the bind hook in the proxy's cgroup).
/// An app's own transparent connection is not filed, only counted: filed, its 4-tuple would
/// let a SYN from that outside address and port reach the app past the proxy.
#[inline(always)]
pub fn connecting(ctx: &SockOpsContext) {
    let Some(key) = transparent_key(ctx) else {
        return;
    };
    // SAFETY: `sk` is this callback's socket (checked for null); a slot the helper returns is
    // that socket's mark.
    let bound_by_proxy = unsafe {
        let sk = (*ctx.ops).__bindgen_anon_2.sk;
        !sk.is_null() && !sk_storage_slot(&PROXY_BOUND, sk, false).is_null()
    };
    if !bound_by_proxy {
        // SAFETY: helper called with this program's own context.
        let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
        record(ctx, netns, reason::TRANSPARENT_NOT_PROXY, || Tuple {
            src: key.remote,
            dst: key.local,
            src_port: key.remote_port,
            dst_port: key.local_port,
        });
        return;
    }
    // SAFETY: helper called with this program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    if PROXY_TRANSPARENT.insert(&key, &1, u64::from(BPF_NOEXIST)).is_ok() {
        pending::count(&PENDING_TRANSPARENT, netns, ONE_MORE);
    } else if PROXY_TRANSPARENT.insert(&key, &1, u64::from(BPF_EXIST)).is_err() {
        // Not new, and no entry of this key: the map is full (64 pods at their share). The
        // connection stays unfiled: sk_lookup steers it to the proxy's inbound listener,
        // which refuses its own connection; nothing reaches the app around it.
        return;
    }
    // (Already there: a closed connection's of the same 4-tuple whose removal has not run
    // yet; it stays counted once.) The state callback removes the entry if this end closes
    // before the app's end is accepted.
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    let mut mark = marks::REPLY;
    // SAFETY: helper called with this program's own context and a 4-byte option value.
    unsafe {
        bpf_setsockopt(
            ctx.ops.cast(),
            sol_socket::SOL_SOCKET,
            sol_socket::SO_MARK,
            (&raw mut mark).cast(),
            4,
        );
    }
}

/// `STATE_CB` (on only for filed transparent connections): removes the entry once the
/// connecting end is closed, if the app's end did not take it. Whether or not the pod is still
/// enrolled: a pod taken out with the connection open would otherwise leave the entry behind,
/// and a pod given its address later would let that 4-tuple reach its app around the proxy.
#[inline(always)]
pub fn state_changed(ctx: &SockOpsContext) {
    if ctx.arg(1) != BPF_TCP_CLOSE {
        return;
    }
    // SAFETY: helper called with this program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    forget(&reversed(&sock_ops_key(ctx.ops, netns)), netns);
}

/// `PASSIVE_ESTABLISHED` of a socket in an enrolled pod accepted on a port that is not the
/// proxy's: if it is the app's end of one of the proxy's transparent connections, that
/// connection's entry goes. From here on every segment of it finds this socket (or its
/// TIME_WAIT) in the kernel's lookup, before sk_lookup would run; one that comes after both
/// are gone is steered to the proxy's `:15006`, which resets it, as the app's closed port
/// would. A connection accepted by a syncookie passed sk_lookup with the entry still there.
#[inline(always)]
pub fn accepted(ctx: &SockOpsContext) {
    let Some(netns) = enrolled_netns(ctx) else {
        return;
    };
    let k = sock_ops_key(ctx.ops, netns);
    // Only at one of the pod's own addresses: a pod that put another pod's address on its
    // interface (CAP_NET_ADMIN) must not take, and count down under itself, that pod's
    // entries by accepting connections of their 4-tuples.
    // SAFETY: map values are plain data owned by the map.
    if unsafe { POD_IPS.get(&PodIpKey { addr: k.local }) } != Some(&netns) {
        return;
    }
    let key = TransparentKey {
        local: k.local,
        remote: k.remote,
        local_port: k.local_port as u16,
        remote_port: k.remote_port as u16,
    };
    forget(&key, netns);
}

/// Removes `key`'s entry, counting it down under `netns` if it was there.
#[inline(always)]
fn forget(key: &TransparentKey, netns: NetnsCookie) {
    if PROXY_TRANSPARENT.remove(key).is_ok() {
        pending::count(&PENDING_TRANSPARENT, netns, ONE_LESS);
    }
}

/// The [`TransparentKey`] of a connection seen from its connecting end (the app's end is
/// local in the key).
#[inline(always)]
fn reversed(k: &datapath_common::SockKey) -> TransparentKey {
    TransparentKey {
        local: k.remote,
        remote: k.local,
        local_port: k.remote_port as u16,
        remote_port: k.local_port as u16,
    }
}
