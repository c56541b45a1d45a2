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
//!   own is only counted), is filed in `PROXY_TRANSPARENT` once its 4-tuple
//!   is known (`TCP_CONNECT_CB`, before its SYN is built) until it closes (`STATE_CB`, which this
//!   turns on for that socket only; removed at close even if the pod has left); sk_lookup lets its SYN reach the app. istio-cni never redirects a
//!   connection made inside the pod to the pod itself either. The socket gets `marks::REPLY`:
//!   its SYN carries the mark, `tcp_fwmark_accept` gives it to the app's accepted socket, and
//!   the pod's `fwmark 0x111/0xfff lookup 133` rule (written at enrolment) delivers the app's
//!   replies locally, back to the proxy. The proxy's own mark (ztunnel's 0x539) is replaced on
//!   this one socket, whose packets are local anyway; every other socket of the proxy keeps its
//!   mark and routes normally.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE},
    helpers::{bpf_get_netns_cookie, bpf_setsockopt},
    programs::SockOpsContext,
    EbpfContext as _,
};
use datapath_common::{
    consts::{marks, ports, sol_socket},
    decisions::reason,
    ListenerKey, NetnsCookie, PodIpKey, TransparentKey, AF_INET, AF_INET6,
};

use crate::{
    decisions::{record, Tuple},
    maps::{sk_storage_slot, INBOUND_LISTENERS, PODS, POD_IPS, PROXY_BOUND, PROXY_TRANSPARENT},
    net::{is_loopback4, is_v4_mapped, sock_ops_key, LOOPBACK6},
};

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
    let loopback = k.local == LOOPBACK6 || (is_v4_mapped(&k.local) && is_loopback4(k.local[3]));
    // SAFETY: as above.
    if loopback || unsafe { POD_IPS.get(&PodIpKey { addr: k.local }) } == Some(&netns) {
        return None;
    }
    Some(reversed(&k))
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
    // A full map leaves the connection unfiled: sk_lookup then steers it to the proxy's
    // inbound listener, which refuses its own connection; nothing reaches the app around it.
    if PROXY_TRANSPARENT.insert(&key, &1, 0).is_err() {
        return;
    }
    // The state callback removes the entry when the connection closes.
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
/// connection is closed. Whether or not the pod is still enrolled: a pod taken out with the
/// connection open would otherwise leave the entry behind, and a pod given its address later
/// would let that 4-tuple reach its app around the proxy.
#[inline(always)]
pub fn state_changed(ctx: &SockOpsContext) {
    if ctx.arg(1) != BPF_TCP_CLOSE {
        return;
    }
    // The socket's own netns: only the 4-tuple of the key comes from it.
    // SAFETY: helper called with this program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let _ = PROXY_TRANSPARENT.remove(&reversed(&sock_ops_key(ctx.ops, netns)));
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
