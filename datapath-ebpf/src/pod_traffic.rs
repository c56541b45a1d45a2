//! TC programs on a pod's interface (attached with TCX inside the pod's netns): count the bytes
//! and buffers that enter and leave each enrolled pod.
//!
//! Why a per-pod constant and not `bpf_get_netns_cookie(skb)`: for TC that helper answers with
//! the netns of `skb->sk`, and a veth keeps the sending socket on the skb when it crosses into
//! the peer's netns, so pod B's ingress would be counted against pod A (seen on this kernel).
//! The loader therefore loads these two tiny programs once per pod with [`POD_COOKIE`] set.

use aya_ebpf::{bindings::TC_ACT_UNSPEC, macros::classifier, programs::TcContext};

use crate::maps::{POD_COOKIE, POD_COUNTERS};

/// TCX verdict "continue with the next program on this hook" (TCX_NEXT == TC_ACT_UNSPEC). We only
/// observe, so we never end the chain: a CNI's own TC programs (and the guard,
/// `raw_tcp_guard.rs`) keep running after ours.
const TCX_NEXT: i32 = TC_ACT_UNSPEC;

#[derive(Clone, Copy)]
enum Direction {
    Ingress,
    Egress,
}

#[classifier]
pub fn tc_pod_ingress(ctx: TcContext) -> i32 {
    count(&ctx, Direction::Ingress);
    TCX_NEXT
}

#[classifier]
pub fn tc_pod_egress(ctx: TcContext) -> i32 {
    count(&ctx, Direction::Egress);
    TCX_NEXT
}

#[inline(always)]
fn count(ctx: &TcContext, dir: Direction) {
    let Some(c) = POD_COUNTERS.get_ptr_mut(POD_COOKIE.load()) else {
        return;
    };
    let len = u64::from(ctx.len());
    // SAFETY: the pointer is this CPU's slot of a per-CPU map value, valid for the whole
    // program run and written by no one else meanwhile.
    unsafe {
        match dir {
            Direction::Ingress => {
                (*c).ingress_packets += 1;
                (*c).ingress_bytes += len;
            }
            Direction::Egress => {
                (*c).egress_packets += 1;
                (*c).egress_bytes += len;
            }
        }
    }
}
