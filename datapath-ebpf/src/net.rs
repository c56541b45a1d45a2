//! Address helpers shared by the socket programs. Addresses are as the kernel hands them to
//! programs: `u32` words holding network-order bytes, read on a little-endian machine.

use aya_ebpf::maps::lpm_trie::Key;
use datapath_common::{cidr_action, CidrKey, NetnsCookie, CIDR_KEY_BITS};

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
