//! Just enough of rtnetlink for the reply routing: add and delete one fwmark rule and one
//! `local` route, and list the rules; and for the node, one host address on `lo` (the kubelet
//! probe source); and the eBPF filters on a pod interface's clsact hooks, listed and deleted
//! one by one (replacing the datapath's in place); and the links of a pod's netns as they
//! appear (a pod's interfaces added after it joined the mesh get the guard); and one link, and
//! the id a netns knows another by (finding the node's end of a pod's link). The requests `ip rule`, `ip route`, `ip addr`
//! and `tc filter` would send, sent from this process: no `ip` process per pod (two spawns were
//! most of a pod's enrolment time), and no iproute2 in the image.
//!
//! A [`Socket`] belongs to the netns of the thread that opens it, for its whole life: open it
//! inside `netns::Netns::run`. Message layouts are those of `linux/netlink.h`,
//! `linux/rtnetlink.h` and `linux/fib_rules.h`.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
};

/// `struct nlmsghdr`: length, type, flags, sequence number, port id.
const NLMSG_HDR_LEN: usize = 16;
/// `struct fib_rule_hdr` and `struct rtmsg` are both 12 bytes.
const BODY_LEN: usize = 12;
/// `struct ifaddrmsg`: family, prefix length, flags, scope, interface index.
const IFADDR_LEN: usize = 8;
// linux/if_addr.h
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
const IFA_F_NODAD: u32 = 0x02;

// linux/fib_rules.h (not all in the libc crate).
const FRA_PRIORITY: u16 = 6;
const FRA_FWMARK: u16 = 10;
const FRA_TABLE: u16 = 15;
const FRA_FWMASK: u16 = 16;
const FR_ACT_TO_TBL: u8 = 1;
// linux/rtnetlink.h traffic-control filters, linux/pkt_cls.h cls_bpf attributes.
const RTM_NEWTFILTER: u16 = 44;
const RTM_DELTFILTER: u16 = 45;
const RTM_GETTFILTER: u16 = 46;
/// `struct tcmsg`: family, padding, interface index, handle, parent, info.
const TCMSG_LEN: usize = 20;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_ID: u16 = 11;
// linux/rtnetlink.h links and netns ids, linux/if_link.h and linux/net_namespace.h attributes.
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_NEWNSID: u16 = 88;
const RTM_GETNSID: u16 = 90;
/// `struct ifinfomsg`: family, padding, type, index, flags, change.
const IFINFO_LEN: usize = 16;
/// `struct rtgenmsg`, padded to 4 bytes.
const RTGEN_LEN: usize = 4;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINK: u16 = 5;
const IFLA_LINK_NETNSID: u16 = 37;
const NETNSA_NSID: u16 = 1;
const NETNSA_FD: u16 = 3;
// linux/netlink.h message types, as the u16 of the header.
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;

/// The address families of the rules and routes here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn af(self) -> u8 {
        match self {
            Family::V4 => libc::AF_INET as u8,
            Family::V6 => libc::AF_INET6 as u8,
        }
    }
}

/// A hook of an interface's clsact qdisc.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClsactHook {
    Ingress,
    Egress,
}

impl ClsactHook {
    /// `TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS / TC_H_MIN_EGRESS)`.
    fn parent(self) -> u32 {
        match self {
            ClsactHook::Ingress => 0xffff_fff2,
            ClsactHook::Egress => 0xffff_fff3,
        }
    }
}

/// One eBPF (`cls_bpf`) filter on a clsact hook, as the kernel lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpfFilter {
    /// The filter's priority (`tc filter … pref`): lower runs first.
    pub priority: u16,
    /// The protocol it matches, as the kernel stores it (network order; `ETH_P_ALL` for ours).
    pub protocol: u16,
    pub handle: u32,
    /// The name given at attachment (aya gives the program's).
    pub name: String,
    /// The id of the program it runs.
    pub program_id: u32,
}

/// One link of the socket's netns and what it says of its other end (a veth's peer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    /// The other end's interface index (`IFLA_LINK`), in the netns [`Link::link_netnsid`]
    /// names, or in this one if it names none.
    pub link: Option<u32>,
    /// The id, in this netns, of the netns the other end is in (`IFLA_LINK_NETNSID`), when
    /// that is another netns.
    pub link_netnsid: Option<u32>,
}

/// `fwmark MARK/MASK lookup TABLE`, optionally with a preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FwmarkRule {
    pub family: Family,
    pub mark: u32,
    pub mask: u32,
    pub table: u32,
    /// `pref`; `None` lets the kernel choose (just before the `main` rule), as `ip` does.
    pub priority: Option<u32>,
}

/// A route-netlink socket in the calling thread's netns.
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
}

impl Socket {
    pub fn open() -> io::Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // The kernel answers at once; a bound on the wait keeps a caller from hanging forever.
        let timeout = libc::timeval { tv_sec: 5, tv_usec: 0 };
        // SAFETY: the option value is a timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd, seq: 0 })
    }

    /// Adds the rule. The kernel allows duplicates, so callers delete it first.
    pub fn add_rule(&mut self, rule: &FwmarkRule) -> io::Result<()> {
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
        self.ack(libc::RTM_NEWRULE, flags, &rule_message(rule))
    }

    /// Deletes one copy of the rule; `Ok(false)` when there was none.
    pub fn delete_rule(&mut self, rule: &FwmarkRule) -> io::Result<bool> {
        absent_is_false(self.ack(libc::RTM_DELRULE, 0, &rule_message(rule)))
    }

    /// `route replace local ANY/0 dev lo table TABLE` (`ip`'s protocol `boot`, scope `host`).
    pub fn replace_local_default(&mut self, family: Family, table: u32) -> io::Result<()> {
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_REPLACE) as u16;
        self.ack(libc::RTM_NEWROUTE, flags, &local_default_message(family, table)?)
    }

    /// `route del local ANY/0 dev lo table TABLE`; `Ok(false)` when there was none.
    pub fn delete_local_default(&mut self, family: Family, table: u32) -> io::Result<bool> {
        let msg = local_default_message(family, table)?;
        absent_is_false(self.ack(libc::RTM_DELROUTE, 0, &msg))
    }

    /// `addr replace ADDR/PREFIX dev IFNAME` (scope global; IPv6 without duplicate address
    /// detection, `nodad`, so the address is usable at once). Idempotent.
    pub fn replace_address(&mut self, addr: IpAddr, prefix: u8, ifname: &str) -> io::Result<()> {
        let index = nix::net::if_::if_nametoindex(ifname).map_err(io::Error::from)?;
        let (family, bytes): (Family, Vec<u8>) = match addr {
            IpAddr::V4(a) => (Family::V4, a.octets().to_vec()),
            IpAddr::V6(a) => (Family::V6, a.octets().to_vec()),
        };
        let mut msg = vec![0u8; IFADDR_LEN];
        msg[0] = family.af();
        msg[1] = prefix;
        msg[4..8].copy_from_slice(&index.to_ne_bytes());
        push_attr(&mut msg, IFA_LOCAL, &bytes);
        push_attr(&mut msg, IFA_ADDRESS, &bytes);
        if family == Family::V6 {
            msg[2] = IFA_F_NODAD as u8;
            push_u32_attr(&mut msg, IFA_FLAGS, IFA_F_NODAD);
        }
        let flags = (libc::NLM_F_CREATE | libc::NLM_F_REPLACE) as u16;
        self.ack(libc::RTM_NEWADDR, flags, &msg)
    }

    /// The fwmark rules of `family` (rules matching no mark are left out).
    pub fn fwmark_rules(&mut self, family: Family) -> io::Result<Vec<FwmarkRule>> {
        let mut body = [0u8; BODY_LEN];
        body[0] = family.af();
        self.dump(libc::RTM_GETRULE, &body, libc::RTM_NEWRULE, None, |p| parse_rule(family, p))
    }

    /// The eBPF filters on `hook` of interface `ifindex` (none when it has no clsact qdisc,
    /// which the kernel says with EINVAL).
    pub fn bpf_filters(&mut self, ifindex: u32, hook: ClsactHook) -> io::Result<Vec<BpfFilter>> {
        let body = tcmsg(ifindex, 0, hook.parent(), 0);
        self.dump(RTM_GETTFILTER, &body, RTM_NEWTFILTER, Some(libc::EINVAL), parse_bpf_filter)
    }

    /// The link with index `ifindex` (`ip link show dev`), `None` if there is none.
    pub fn link(&mut self, ifindex: u32) -> io::Result<Option<Link>> {
        let mut body = vec![0u8; IFINFO_LEN];
        body[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        match self.get(RTM_GETLINK, &body, RTM_NEWLINK, parse_link) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            other => other,
        }
    }

    /// The id this netns knows the netns of `netns` by (`ip netns list-id`), `None` if it has
    /// given it none.
    pub fn nsid_of(&mut self, netns: BorrowedFd<'_>) -> io::Result<Option<u32>> {
        let mut body = vec![0u8; RTGEN_LEN];
        push_u32_attr(&mut body, NETNSA_FD, netns.as_raw_fd() as u32);
        let nsid = self.get(RTM_GETNSID, &body, RTM_NEWNSID, |payload| {
            Attrs(payload.get(RTGEN_LEN..)?)
                .find(|(kind, _)| *kind == NETNSA_NSID)
                .and_then(|(_, v)| v.get(..4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]])))
        })?;
        // -1: NETNSA_NSID_NOT_ASSIGNED.
        Ok(nsid.and_then(|id| u32::try_from(id).ok()))
    }

    /// A request answered by one `answer` message, parsed by `parse` (`None` if it refuses it).
    fn get<T>(
        &mut self,
        request: u16,
        body: &[u8],
        answer: u16,
        parse: impl Fn(&[u8]) -> Option<T>,
    ) -> io::Result<Option<T>> {
        let seq = self.send(request, 0, body)?;
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            let n = self.recv(&mut buf)?;
            for msg in Messages::new(&buf[..n]) {
                let (kind, msg_seq, payload) = msg?;
                if msg_seq != seq {
                    continue;
                }
                match kind {
                    NLMSG_ERROR => error_code(payload)?,
                    k if k == answer => return Ok(parse(payload)),
                    _ => {}
                }
            }
        }
    }

    /// A dump request: every `answer` message parsed by `parse` (those it refuses left out);
    /// an error `empty_errno` means there is nothing to list.
    fn dump<T>(
        &mut self,
        request: u16,
        body: &[u8],
        answer: u16,
        empty_errno: Option<i32>,
        parse: impl Fn(&[u8]) -> Option<T>,
    ) -> io::Result<Vec<T>> {
        let seq = self.send(request, libc::NLM_F_DUMP as u16, body)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            let n = self.recv(&mut buf)?;
            for msg in Messages::new(&buf[..n]) {
                let (kind, msg_seq, payload) = msg?;
                if msg_seq != seq {
                    continue;
                }
                match kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => match error_code(payload) {
                        Err(e) if empty_errno.is_some() && e.raw_os_error() == empty_errno => {
                            return Ok(out)
                        }
                        other => other?,
                    },
                    k if k == answer => out.extend(parse(payload)),
                    _ => {}
                }
            }
        }
    }

    /// Deletes one filter from `hook` of interface `ifindex`; `Ok(false)` when it was gone.
    pub fn delete_filter(
        &mut self,
        ifindex: u32,
        hook: ClsactHook,
        filter: &BpfFilter,
    ) -> io::Result<bool> {
        let info = (u32::from(filter.priority) << 16) | u32::from(filter.protocol);
        let mut body = tcmsg(ifindex, filter.handle, hook.parent(), info);
        push_attr(&mut body, TCA_KIND, b"bpf\0");
        absent_is_false(self.ack(RTM_DELTFILTER, 0, &body))
    }

    /// Sends one request and waits for its acknowledgement.
    fn ack(&mut self, kind: u16, flags: u16, body: &[u8]) -> io::Result<()> {
        let seq = self.send(kind, flags | libc::NLM_F_ACK as u16, body)?;
        let mut buf = vec![0u8; 8 * 1024];
        loop {
            let n = self.recv(&mut buf)?;
            for msg in Messages::new(&buf[..n]) {
                let (kind, msg_seq, payload) = msg?;
                if kind == NLMSG_ERROR && msg_seq == seq {
                    return error_code(payload);
                }
            }
        }
    }

    fn send(&mut self, kind: u16, flags: u16, body: &[u8]) -> io::Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let len = NLMSG_HDR_LEN + body.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&(len as u32).to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(body);
        // SAFETY: an all-zero sockaddr_nl is the kernel's address (pid 0, no groups).
        let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        kernel.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: `msg` and `kernel` outlive the call; the lengths are theirs.
        let rc = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&kernel as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(self.seq)
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is writable for its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// ENOENT (no such rule) and ESRCH (no such route) mean there was nothing to delete.
fn absent_is_false(res: io::Result<()>) -> io::Result<bool> {
    match res {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The errno of an `NLMSG_ERROR` payload (0: the acknowledgement of success).
fn error_code(payload: &[u8]) -> io::Result<()> {
    let code = payload
        .get(..4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or_else(|| io::Error::other("netlink: a truncated error message"))?;
    if code == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(-code))
    }
}

fn push_u32_attr(msg: &mut Vec<u8>, kind: u16, value: u32) {
    push_attr(msg, kind, &value.to_ne_bytes());
}

/// One attribute, padded to 4 bytes.
fn push_attr(msg: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    msg.extend_from_slice(&(len as u16).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(value);
    msg.resize(msg.len() + (align(len) - len), 0);
}

/// `struct fib_rule_hdr` and the rule's attributes.
fn rule_message(rule: &FwmarkRule) -> Vec<u8> {
    let mut msg = vec![0u8; BODY_LEN];
    msg[0] = rule.family.af();
    // The table also goes in the one-byte field when it fits, as `ip` does.
    msg[4] = u8::try_from(rule.table).unwrap_or(0);
    msg[7] = FR_ACT_TO_TBL;
    push_u32_attr(&mut msg, FRA_FWMARK, rule.mark);
    push_u32_attr(&mut msg, FRA_FWMASK, rule.mask);
    push_u32_attr(&mut msg, FRA_TABLE, rule.table);
    if let Some(priority) = rule.priority {
        push_u32_attr(&mut msg, FRA_PRIORITY, priority);
    }
    msg
}

/// `struct rtmsg` and the attributes of `local ANY/0 dev lo table TABLE`.
fn local_default_message(family: Family, table: u32) -> io::Result<Vec<u8>> {
    let lo = nix::net::if_::if_nametoindex("lo").map_err(io::Error::from)?;
    let mut msg = vec![0u8; BODY_LEN];
    msg[0] = family.af();
    msg[4] = u8::try_from(table).unwrap_or(0);
    msg[5] = libc::RTPROT_BOOT;
    msg[6] = libc::RT_SCOPE_HOST;
    msg[7] = libc::RTN_LOCAL;
    push_u32_attr(&mut msg, libc::RTA_OIF, lo);
    push_u32_attr(&mut msg, libc::RTA_TABLE, table);
    Ok(msg)
}

/// `struct tcmsg` (family unspecified).
fn tcmsg(ifindex: u32, handle: u32, parent: u32, info: u32) -> Vec<u8> {
    let mut msg = vec![0u8; TCMSG_LEN];
    msg[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    msg[8..12].copy_from_slice(&handle.to_ne_bytes());
    msg[12..16].copy_from_slice(&parent.to_ne_bytes());
    msg[16..20].copy_from_slice(&info.to_ne_bytes());
    msg
}

/// A filter listed by the kernel, if it is a `cls_bpf` filter instance (the kernel also lists
/// each priority's classifier itself, with handle 0 and no program).
fn parse_bpf_filter(payload: &[u8]) -> Option<BpfFilter> {
    let header = payload.get(..TCMSG_LEN)?;
    let word = |at: usize| {
        u32::from_ne_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let (handle, info) = (word(8), word(16));
    let mut kind_bpf = false;
    let (mut name, mut program_id) = (None, None);
    for (kind, value) in Attrs(&payload[TCMSG_LEN..]) {
        match kind {
            TCA_KIND => kind_bpf = value.split(|&b| b == 0).next() == Some(b"bpf".as_slice()),
            TCA_OPTIONS => {
                for (kind, value) in Attrs(value) {
                    match kind {
                        TCA_BPF_NAME => {
                            let text = value.split(|&b| b == 0).next().unwrap_or_default();
                            name = Some(String::from_utf8_lossy(text).into_owned());
                        }
                        TCA_BPF_ID => {
                            program_id = value
                                .get(..4)
                                .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (kind_bpf && handle != 0).then_some(())?;
    Some(BpfFilter {
        priority: (info >> 16) as u16,
        protocol: (info & 0xffff) as u16,
        handle,
        name: name.unwrap_or_default(),
        program_id: program_id?,
    })
}

/// A link as the kernel describes it (`struct ifinfomsg` and its attributes).
fn parse_link(payload: &[u8]) -> Option<Link> {
    let attrs = payload.get(IFINFO_LEN..)?;
    let mut link = Link { name: String::new(), link: None, link_netnsid: None };
    for (kind, value) in Attrs(attrs) {
        let word = value.get(..4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        match kind {
            IFLA_IFNAME => {
                let text = value.split(|&b| b == 0).next().unwrap_or_default();
                link.name = String::from_utf8_lossy(text).into_owned();
            }
            IFLA_LINK => link.link = word,
            // A negative id: the other netns has none here.
            IFLA_LINK_NETNSID => link.link_netnsid = word.filter(|&id| (id as i32) >= 0),
            _ => {}
        }
    }
    Some(link)
}

/// A rule listed by the kernel, if it is an fwmark rule.
fn parse_rule(family: Family, payload: &[u8]) -> Option<FwmarkRule> {
    let header = payload.get(..BODY_LEN)?;
    let mut rule =
        FwmarkRule { family, mark: 0, mask: u32::MAX, table: u32::from(header[4]), priority: None };
    let mut has_mark = false;
    for (kind, value) in Attrs(&payload[BODY_LEN..]) {
        let Some(v) = value.get(..4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])) else {
            continue;
        };
        match kind {
            FRA_FWMARK => (rule.mark, has_mark) = (v, true),
            FRA_FWMASK => rule.mask = v,
            FRA_TABLE => rule.table = v,
            FRA_PRIORITY => rule.priority = Some(v),
            _ => {}
        }
    }
    has_mark.then_some(rule)
}

/// A socket that hears of the links of the calling thread's netns as they appear and change
/// (`RTMGRP_LINK`), non-blocking, for an event loop: read it with [`announces_a_link`].
pub fn link_events() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a zeroed sockaddr_nl is valid; family and groups set below.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = libc::RTMGRP_LINK as u32;
    // SAFETY: the address is a sockaddr_nl of the size given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Whether the datagram `buf`, read from a [`link_events`] socket, announces a link (new, or
/// changed: the kernel sends `RTM_NEWLINK` for both).
pub fn announces_a_link(buf: &[u8]) -> bool {
    Messages::new(buf).any(|m| matches!(m, Ok((kind, _, _)) if kind == libc::RTM_NEWLINK))
}

/// The netlink messages in one datagram: (type, sequence number, payload), or an error for a
/// message whose length field does not fit.
struct Messages<'a>(&'a [u8]);

impl<'a> Messages<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self(buf)
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = io::Result<(u16, u32, &'a [u8])>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.len() < NLMSG_HDR_LEN {
            return None;
        }
        let b = self.0;
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        if len < NLMSG_HDR_LEN || len > b.len() {
            self.0 = &[];
            return Some(Err(io::Error::other("netlink: a message longer than its datagram")));
        }
        let kind = u16::from_ne_bytes([b[4], b[5]]);
        let seq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
        let payload = &b[NLMSG_HDR_LEN..len];
        self.0 = b.get(align(len)..).unwrap_or(&[]);
        Some(Ok((kind, seq, payload)))
    }
}

/// Route attributes: (type, value).
struct Attrs<'a>(&'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.0;
        if b.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        if len < 4 || len > b.len() {
            self.0 = &[];
            return None;
        }
        // The top two bits of the type are flags (nested, byte order).
        let kind = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        self.0 = b.get(align(len)..).unwrap_or(&[]);
        Some((kind, &b[4..len]))
    }
}

/// `NLMSG_ALIGN` / `NLA_ALIGN`: 4 bytes.
fn align(len: usize) -> usize {
    (len + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_message_parses_back_to_the_same_rule() {
        let rule = FwmarkRule {
            family: Family::V4,
            mark: 0x111,
            mask: 0xfff,
            table: 133,
            priority: Some(32764),
        };
        assert_eq!(parse_rule(Family::V4, &rule_message(&rule)), Some(rule));
    }

    #[test]
    fn a_listed_bpf_filter_gives_its_priority_handle_name_and_program() {
        let mut msg = tcmsg(7, 1, ClsactHook::Egress.parent(), (49151 << 16) | 0x0300);
        push_attr(&mut msg, TCA_KIND, b"bpf\0");
        let mut options = Vec::new();
        push_attr(&mut options, TCA_BPF_NAME, b"tc_pod_guard\0");
        push_u32_attr(&mut options, TCA_BPF_ID, 42);
        push_attr(&mut msg, TCA_OPTIONS, &options);
        let filter = parse_bpf_filter(&msg).expect("a bpf filter");
        assert_eq!(
            filter,
            BpfFilter {
                priority: 49151,
                protocol: 0x0300,
                handle: 1,
                name: "tc_pod_guard".into(),
                program_id: 42
            }
        );
        // The classifier's own entry (handle 0) is not a filter.
        let mut head = tcmsg(7, 0, ClsactHook::Egress.parent(), 49151 << 16);
        push_attr(&mut head, TCA_KIND, b"bpf\0");
        assert_eq!(parse_bpf_filter(&head), None);
    }

    #[test]
    fn a_truncated_message_is_an_error_not_a_panic() {
        let mut msg = vec![0u8; 20];
        msg[0] = 200; // claims 200 bytes
        assert!(Messages::new(&msg).next().is_some_and(|m| m.is_err()));
        assert!(Attrs(&[9, 0, 1, 0, 0]).next().is_none());
        assert!(error_code(&[0, 0]).is_err());
    }
}
