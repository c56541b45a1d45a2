//! meshpath's eBPF programs. One object, loaded once per node and pinned; each pod gets links
//! to the shared programs, and every per-pod fact is looked up by the pod's netns cookie.
//!
//! - `maps`: every map, pinned by name.
//! - `decisions`: every decision counted per pod and reason, streamed while a monitor watches.
//! - `pod_traffic`: TC (TCX) counters on the pod's interface (one instance per pod).
//! - `raw_tcp_guard`: TC on the pod's interfaces, egress, and on the node's ends of its links,
//!   ingress (one instance each for the node): TCP that no TCP socket of the pod sent (raw and
//!   packet sockets) is dropped.
//! - `outbound`: cgroup connect4/6, getpeername4/6 and sock_ops: capture of outbound TCP to the
//!   proxy's outbound listener, without netfilter (node-wide, filtered by netns cookie).
//! - `accelerate`: sockops + sk_msg shortcut for the local app↔proxy hop (off unless turned on).
//! - `dns`: cgroup sendmsg4/6 and recvmsg4/6: DNS over UDP to the proxy's DNS listener.
//! - `inbound`: sk_lookup in each pod's netns: inbound TCP to the proxy's inbound listener.
//! - `proxy_sockets`: what sock_ops learns of the proxy with no help from it: its inbound
//!   listeners and its transparent connections to the app (with their reply mark).
//! - `probes`: node side of the kubelet probe contract (probe source address, no SNAT).
//! - `original_dst`: cgroup getsockopt answering SO_ORIGINAL_DST for the proxy.
//! - `pending`: each pod's share of the node-wide map of connections between their app end's
//!   establishment and the proxy end's.
//! - `proxy_ports`: cgroup bind4/6 keeping the proxy's ports in a pod for the proxy.

#![no_std]
#![no_main]
// `core::intrinsics::atomic_xadd` for counters shared between CPUs (`pending.rs`).
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod accelerate;
mod decisions;
mod dns;
mod inbound;
mod maps;
mod net;
mod original_dst;
mod outbound;
mod pending;
mod pod_traffic;
mod probes;
mod proxy_ports;
mod proxy_sockets;
mod raw_tcp_guard;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // eBPF programs cannot panic (the verifier rejects unbounded loops); this is never reached.
    loop {}
}

/// GPL-compatible licence, required for GPL-only helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
