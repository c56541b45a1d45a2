//! Address helpers shared by the socket programs. Addresses are as the kernel hands them to
//! programs: `u32` words holding network-order bytes, read on a little-endian machine.

use aya_ebpf::{bindings::bpf_sock_ops, maps::lpm_trie::Key, programs::SockAddrContext};
use core::ptr::{addr_of, read_volatile};
use datapath_common::{
    cidr_action, CidrKey, NetnsCookie, PodIpKey, SockKey, AF_INET, CIDR_KEY_BITS,
};

use crate::maps::EXCLUDED_CIDRS;

/// 127.0.0.1 as a network-order word.
pub const LOOPBACK4: u32 = u32::from_ne_bytes([127, 0, 0, 1]);
/// ::1 as network-order words.
pub const LOOPBACK6: [u32; 4] = [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])];
/// The third word of a v4-mapped IPv6 address (::ffff:a.b.c.d).
pub const V4_MAPPED_PREFIX: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Whether the longest prefix matching `addr` for this pod and direction says "exclude".
#[inline(always)]
pub fn cidr_excluded(netns: NetnsCookie, direction: u16, addr: [u32; 4]) -> bool {
    let key = Key::new(CIDR_KEY_BITS, CidrKey::new(netns, direction, addr));
    matches!(EXCLUDED_CIDRS.get(&key), Some(&cidr_action::EXCLUDE))
}

/// `struct sockaddr_in` (addresses in network byte order).
#[repr(C)]
pub struct SockaddrIn {
    pub family: u16,
    pub port: u16,
    pub addr: [u8; 4],
    pub zero: [u8; 8],
}

/// `struct sockaddr_in6`.
#[repr(C)]
pub struct SockaddrIn6 {
    pub family: u16,
    pub port: u16,
    pub flowinfo: u32,
    pub addr: [u8; 16],
    pub scope_id: u32,
}

/// The 16 bytes of an address given as four network-order words.
#[inline(always)]
pub fn words_to_bytes(w: [u32; 4]) -> [u8; 16] {
    let (a, b, c, d) =
        (w[0].to_ne_bytes(), w[1].to_ne_bytes(), w[2].to_ne_bytes(), w[3].to_ne_bytes());
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3]]
}

/// 127.0.0.0/8.
#[inline(always)]
pub fn is_loopback4(addr: u32) -> bool {
    addr.to_ne_bytes()[0] == 127
}

/// ::ffff:a.b.c.d
#[inline(always)]
pub fn is_v4_mapped(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_PREFIX
}

/// A port as sock_ops and sk_msg store `remote_port`: the network-order u16 in the upper half.
#[inline(always)]
pub fn remote_port_host(raw: u32) -> u32 {
    u32::from(u16::from_be((raw >> 16) as u16))
}

/// A sock_ops socket's addresses (IPv4 v4-mapped) and ports (host order), as a [`SockKey`] of
/// `netns`.
#[inline(always)]
pub fn sock_ops_key(o: *const bpf_sock_ops, netns: NetnsCookie) -> SockKey {
    // One load per field at a constant offset, both families (see inbound.rs for why).
    // SAFETY: fields of the kernel's bpf_sock_ops, readable for a full socket in the listen,
    // connect, established and state callbacks.
    unsafe {
        let v4 = read_volatile(addr_of!((*o).family)) == u32::from(AF_INET);
        let l4 = read_volatile(addr_of!((*o).local_ip4));
        let r4 = read_volatile(addr_of!((*o).remote_ip4));
        let l6 = [
            read_volatile(addr_of!((*o).local_ip6[0])),
            read_volatile(addr_of!((*o).local_ip6[1])),
            read_volatile(addr_of!((*o).local_ip6[2])),
            read_volatile(addr_of!((*o).local_ip6[3])),
        ];
        let r6 = [
            read_volatile(addr_of!((*o).remote_ip6[0])),
            read_volatile(addr_of!((*o).remote_ip6[1])),
            read_volatile(addr_of!((*o).remote_ip6[2])),
            read_volatile(addr_of!((*o).remote_ip6[3])),
        ];
        SockKey {
            netns,
            local: if v4 { PodIpKey::v4(l4).addr } else { l6 },
            remote: if v4 { PodIpKey::v4(r4).addr } else { r6 },
            local_port: read_volatile(addr_of!((*o).local_port)),
            remote_port: remote_port_host(read_volatile(addr_of!((*o).remote_port))),
        }
    }
}

/// The address a connecting socket is bound to (IPv6 or v4-mapped; unspecified if it is not
/// bound: the kernel picks the source after connect4/6). Every field loaded, at its constant
/// offset, before the family picks: loaded in the branches, the compiler merged the two loads
/// into one at a computed offset, which the verifier refuses ("pointer arithmetic on sock
/// prohibited").
#[inline(always)]
pub fn bound_source(ctx: &SockAddrContext) -> [u32; 4] {
    // SAFETY: the context's socket (the verifier types it a socket, never null); fields of the
    // kernel's bpf_sock, readable in this program type.
    unsafe {
        let sk = (*ctx.sock_addr).__bindgen_anon_1.sk;
        let v4 = read_volatile(addr_of!((*sk).family)) == u32::from(AF_INET);
        let ip4 = read_volatile(addr_of!((*sk).src_ip4));
        let ip6 = [
            read_volatile(addr_of!((*sk).src_ip6[0])),
            read_volatile(addr_of!((*sk).src_ip6[1])),
            read_volatile(addr_of!((*sk).src_ip6[2])),
            read_volatile(addr_of!((*sk).src_ip6[3])),
        ];
        if v4 {
            PodIpKey::v4(ip4).addr
        } else {
            ip6
        }
    }
}
