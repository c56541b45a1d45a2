//! Each pod's share of the node-wide maps that hold a connection between its two ends'
//! establishment:
//!
//! - `ORIG_DST_BY_CONN`, a captured connection's original destination: the app's end files it,
//!   the proxy's end takes it a loopback handshake later (`original_dst.rs`); this file;
//! - `PROXY_TRANSPARENT`, the proxy's transparent connect to the app, until the app's end is
//!   accepted (`proxy_sockets.rs`, with [`full`] and [`count`] from here).
//!
//! Both maps are plain hashes, so nothing is ever evicted from them; what one pod could still
//! do is fill one (connections whose other end never comes, e.g. past an overflowing accept
//! queue), and then every pod's new connections would find no room. So each pod's entries are
//! counted (`PENDING_CONNECTIONS`, `PENDING_TRANSPARENT`) and held to
//! `MAX_PENDING_CONNECTIONS_PER_POD`. For `ORIG_DST_BY_CONN`:
//!
//! - connect4/6 refuses a pod's captured TCP connect while the pod is at its share;
//! - sock_ops files an entry only below it (connects that got past connect together can pass
//!   the share only by as many as run at once, one per CPU), and counts it; the entry leaves,
//!   counted down, when the proxy's end takes it or when the app's end closes first
//!   ([`app_state_changed`]), so a pod's count is never more than its live connections.
//!
//! A pod with no counter (enrolled by an agent from before the shares) is held to none.

use aya_ebpf::{
    bindings::{BPF_EXIST, BPF_NOEXIST, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE},
    helpers::bpf_get_netns_cookie,
    maps::HashMap,
    programs::SockOpsContext,
    EbpfContext as _,
};
use core::intrinsics::{atomic_xadd, AtomicOrdering};
use datapath_common::{
    consts::{ports, MAX_PENDING_CONNECTIONS_PER_POD},
    decisions::reason,
    ConnKey, NetnsCookie, OrigDst, AF_INET,
};

use crate::{
    maps::{
        sk_storage_slot, ORIG_DST_BY_CONN, ORIG_DST_BY_CONN_PREVIOUS, ORIG_DST_BY_SOCKET,
        PENDING_CONNECTIONS,
    },
    net::is_v4_mapped,
};

/// Whether the pod is at its share by `counts` (`PENDING_CONNECTIONS`, `PENDING_TRANSPARENT`).
#[inline(always)]
pub fn full(counts: &HashMap<NetnsCookie, u64>, netns: NetnsCookie) -> bool {
    // SAFETY: map values are plain data owned by the map.
    match unsafe { counts.get(&netns) } {
        // Signed: a count a re-enrolment restarted from zero may go below it for a while.
        Some(&n) => n as i64 >= i64::from(MAX_PENDING_CONNECTIONS_PER_POD),
        None => false,
    }
}

/// One more entry of the pod.
pub const ONE_MORE: u64 = 1;
/// One entry of the pod less (wrapping).
pub const ONE_LESS: u64 = u64::MAX;

/// Adds `delta` ([`ONE_MORE`] or [`ONE_LESS`]) to the pod's count in `counts`, if it has one.
/// The result is unused, so this is the plain atomic add every kernel's verifier takes (a u64:
/// the BPF target has no 32-bit atomics).
#[inline(always)]
pub fn count(counts: &HashMap<NetnsCookie, u64>, netns: NetnsCookie, delta: u64) {
    if let Some(n) = counts.get_ptr_mut(&netns) {
        // The intrinsic, not `AtomicU64::fetch_add`: the BPF target declares no atomic
        // read-modify-write, though its instruction set has this add.
        // SAFETY: a pointer to the map's u64 value for this key, valid for this program run;
        // other CPUs update it only atomically.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, delta) };
    }
}

/// The key the app's end of a captured connection files under (sock_ops on that end: the
/// local port is the app's, the remote the proxy listener's).
#[inline(always)]
pub fn app_key(ctx: &SockOpsContext) -> ConnKey {
    let v4 = ctx.family() == u32::from(AF_INET) || is_v4_mapped(&ctx.local_ip6());
    ConnKey {
        // SAFETY: helper called with this program's own context.
        netns: unsafe { bpf_get_netns_cookie(ctx.as_ptr()) },
        port: ctx.local_port() as u16,
        ip_version: if v4 { 4 } else { 6 },
        // remote_port holds the network-order port in its upper half.
        proxy_port: u16::from_be((ctx.remote_port() >> 16) as u16),
        _pad: 0,
    }
}

/// sock_ops, the app's end established: files its original destination for the proxy's end,
/// within the pod's share, and asks to hear when this end closes. Not filed (the proxy's
/// getsockopt will refuse the connection), the reason to count: the pod is at its share, or
/// the map is full.
#[inline(always)]
pub fn file(ctx: &SockOpsContext, key: &ConnKey, orig: &OrigDst) -> Result<(), u32> {
    if full(&PENDING_CONNECTIONS, key.netns) {
        return Err(reason::OUT_REFUSED_SHARE_FULL);
    }
    if ORIG_DST_BY_CONN.insert(key, orig, u64::from(BPF_NOEXIST)).is_ok() {
        count(&PENDING_CONNECTIONS, key.netns, ONE_MORE);
    } else if ORIG_DST_BY_CONN.insert(key, orig, u64::from(BPF_EXIST)).is_err() {
        // Not new, and no entry of this key to replace: the map is full.
        return Err(reason::OUT_REFUSED_NO_SLOT);
    }
    // (Replaced: an entry of this key is a closed connection's whose removal has not run yet;
    // it stays counted once, as it was.)
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    Ok(())
}

/// The original destination filed under `key`: in `ORIG_DST_BY_CONN`, or, during a datapath
/// upgrade that replaces that map, in the map it replaces, where the old programs still file
/// (`ORIG_DST_BY_CONN_PREVIOUS`; empty at any other time).
#[inline(always)]
pub fn filed(key: &ConnKey) -> Option<OrigDst> {
    // SAFETY: map values are plain data owned by the map, copied out at once.
    unsafe { ORIG_DST_BY_CONN.get(key).or_else(|| ORIG_DST_BY_CONN_PREVIOUS.get(key)).copied() }
}

/// Removes `key`'s entry (the proxy's end took it, or the app's end closed), counting it down
/// if it was there: from both maps [`filed`] reads (the upgrade's first copy may have put one
/// filing in both), counted once.
#[inline(always)]
pub fn remove(key: &ConnKey) {
    let current = ORIG_DST_BY_CONN.remove(key).is_ok();
    let previous = ORIG_DST_BY_CONN_PREVIOUS.remove(key).is_ok();
    if current || previous {
        count(&PENDING_CONNECTIONS, key.netns, ONE_LESS);
    }
}

/// sock_ops, a state change of a socket that asked for them: if it is a captured app end (it
/// has an original destination and its peer is one of the proxy's listeners), its entry goes
/// when it closes, if the proxy's end has not taken it already; and once the entry is gone, the
/// socket stops asking (one callback more per connection, not one per state). True: it was
/// such a socket.
#[inline(always)]
pub fn app_state_changed(ctx: &SockOpsContext) -> bool {
    let key = app_key(ctx);
    if key.proxy_port != ports::OUTBOUND && key.proxy_port != ports::DNS {
        return false;
    }
    // SAFETY: `sk` of the kernel's bpf_sock_ops for this call, null-checked; only whether a
    // slot exists is read.
    let captured = unsafe {
        let sk = (*ctx.ops).__bindgen_anon_2.sk;
        !sk.is_null() && !sk_storage_slot(&ORIG_DST_BY_SOCKET, sk, false).is_null()
    };
    if !captured {
        return false;
    }
    if ctx.arg(1) == BPF_TCP_CLOSE {
        remove(&key);
    } else if filed(&key).is_none() {
        // Taken by the proxy's end: nothing left to watch for.
        let _ = ctx.set_cb_flags((ctx.cb_flags() & !BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    }
    true
}
