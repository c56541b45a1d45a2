//! Pod lifecycle: enrol a pod's network namespace into the datapath, remove it, and report what
//! is enrolled. State lives only in bpffs (the `PODS` map and one pin directory per pod), so any
//! loader process, including one started after a crash, sees the same truth.

use std::{
    fs, io,
    net::IpAddr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    maps::{lpm_trie::Key, MapError, PerCpuValues},
    programs::{links::FdLink, SchedClassifier, TcAttachType},
    util::{nr_cpus, KernelVersion},
};
use datapath_common::{
    cidr_action,
    consts::{programs, MAX_EXCLUSIONS_PER_POD},
    direction, pod_flags, CidrKey, HostEnd, NetnsCookie, PodAddrs, PodCounters, PodInfo, PodIpKey,
    PortKey, CIDR_FIXED_BITS,
};
use ipnet::IpNet;
use meshpath_podnet::{reply_routing, rtnetlink::ClsactHook};
use tracing::{info, warn};

use crate::{
    datapath::{inbound_listener_keys, load, Datapath},
    netns::Netns,
    Error, Result,
};

/// `BPF_NOEXIST` (linux/bpf.h): a map update that only creates.
const BPF_NOEXIST: u64 = 1;

/// Pin file names of a pod's links, inside its pod directory.
pub mod link_pins {
    /// The TCX ingress link on the pod's interface.
    pub const TC_INGRESS: &str = "tc_ingress";
    /// The TCX egress link on the pod's interface.
    pub const TC_EGRESS: &str = "tc_egress";
    /// The sk_lookup link on the pod's netns.
    pub const SK_LOOKUP: &str = "sk_lookup";
    /// The node-side guard's TCX link on the node's end of one of the pod's links, when it is
    /// one (see `guard_host_ends`): this, then the end's interface index in the node's netns.
    pub const NODE_GUARD_PREFIX: &str = "node_guard_";
}

/// How to enrol a pod.
#[derive(Debug, Clone)]
pub struct EnrolOptions {
    /// The pod's interface inside its netns.
    pub iface: String,
    /// A name to show for the pod (defaults to the netns path).
    pub name: Option<String>,
    /// Send the pod's outbound TCP to the proxy's outbound listener.
    pub capture_outbound: bool,
    /// Destination ports the pod's outbound capture leaves alone.
    pub exclude_outbound_ports: Vec<u16>,
    /// Steer TCP arriving at the pod to the proxy's inbound listener.
    pub capture_inbound: bool,
    /// Pod ports inbound capture leaves alone.
    pub exclude_inbound_ports: Vec<u16>,
    /// Let kubelet probes (169.254.7.127, fd16:9254:7127:1337:ffff:ffff:ffff:ffff) through.
    pub probe_bypass: bool,
    /// Send the pod's DNS (UDP and TCP to port 53) to the proxy's DNS listener (15053).
    pub capture_dns: bool,
    /// Count the pod's packets and bytes with TC programs on its interface (TCX links, one
    /// loaded per pod). The guard (`raw_tcp_guard.rs`) goes on the interface either way.
    pub counters: bool,
    /// The pod's addresses (from the CNI result); empty: read them from its netns.
    pub pod_ips: Vec<IpAddr>,
    /// Destination prefixes outbound capture leaves alone (longest prefix wins).
    pub exclude_outbound_cidrs: Vec<IpNet>,
    /// Destination prefixes captured after all, inside a wider excluded one.
    pub capture_outbound_cidrs: Vec<IpNet>,
    /// Client prefixes inbound capture leaves alone.
    pub exclude_inbound_cidrs: Vec<IpNet>,
}

impl Default for EnrolOptions {
    fn default() -> Self {
        Self {
            iface: "eth0".into(),
            name: None,
            capture_outbound: false,
            exclude_outbound_ports: Vec::new(),
            capture_inbound: false,
            exclude_inbound_ports: Vec::new(),
            probe_bypass: true,
            capture_dns: false,
            counters: true,
            pod_ips: Vec::new(),
            exclude_outbound_cidrs: Vec::new(),
            capture_outbound_cidrs: Vec::new(),
            exclude_inbound_cidrs: Vec::new(),
        }
    }
}

/// One enrolled pod as the datapath sees it.
#[derive(Debug, Clone)]
pub struct PodStatus {
    /// The pod's netns cookie.
    pub cookie: NetnsCookie,
    /// What was recorded at enrolment.
    pub info: PodInfo,
    /// Counters summed over CPUs.
    pub counters: PodCounters,
    /// The pin files present in the pod's directory.
    pub pins: Vec<String>,
    /// The pod's addresses the datapath knows.
    pub ips: Vec<IpAddr>,
    /// Excluded ports: (port, "outbound" | "inbound").
    pub excluded_ports: Vec<(u16, &'static str)>,
    /// Prefix rules: (prefix, "outbound" | "inbound", "exclude" | "capture").
    pub cidr_rules: Vec<(IpNet, &'static str, &'static str)>,
    /// What the datapath decided for the pod, per reason.
    pub decisions: Vec<crate::decisions::DecisionCount>,
}

/// The pod's exclusions fit its share of the node's exclusion maps
/// ([`MAX_EXCLUSIONS_PER_POD`] entries in each).
fn check_exclusions(pod: &str, opts: &EnrolOptions) -> Result<()> {
    let ports = opts.exclude_outbound_ports.len() + opts.exclude_inbound_ports.len();
    let prefixes = prefix_rules(opts).len();
    for (what, count) in [("excluded ports", ports), ("prefix rules", prefixes)] {
        if count > MAX_EXCLUSIONS_PER_POD {
            let (pod, max) = (pod.to_owned(), MAX_EXCLUSIONS_PER_POD);
            return Err(Error::TooManyExclusions { pod, what, count, max });
        }
    }
    Ok(())
}

/// Enrols the pod whose netns is `netns`: records its addresses, links the node's sk_lookup
/// program into its netns, attaches the TC counters (when asked) and the node's TC guard to its
/// interface, then records it in `PODS`, which turns capture on. Either all of it happens or, on
/// error, none of it is left behind.
pub fn enrol(dp: &Datapath, netns: &Netns, opts: &EnrolOptions) -> Result<NetnsCookie> {
    let cookie = netns.cookie();
    let pod = opts.name.clone().unwrap_or_else(|| netns.path().display().to_string());
    check_exclusions(&pod, opts)?;
    if is_enrolled(dp, cookie)? {
        return Err(Error::AlreadyEnrolled { pod, cookie });
    }
    let ips =
        if opts.pod_ips.is_empty() { netns.run(pod_addresses)?? } else { opts.pod_ips.clone() };
    let mut pod_ips = dp.pod_ips()?;
    for &ip in &ips {
        match pod_ips.get(&ip_key(ip), 0) {
            Ok(other) if netns_alive(dp, other)? => {
                return Err(Error::AddressInUse { pod, ip, other });
            }
            // The address's previous owner is gone (deleted without unenrol): reclaim it now,
            // as reconcile would, so the address can be reused at once.
            Ok(other) => {
                warn!(cookie = other, %ip, "reclaiming a vanished pod that still held this address");
                remove_all(dp, other)?;
            }
            Err(MapError::KeyNotFound) => {}
            Err(e) => return Err(Error::bpf("reading POD_IPS", e)),
        }
    }
    let mut undo = Undo { dp, cookie, armed: true };

    let ncpus = nr_cpus().map_err(|(what, e)| Error::io(what, e))?;
    let zeros = PerCpuValues::try_from(vec![PodCounters::default(); ncpus])
        .map_err(|e| Error::bpf("per-CPU counters", e))?;
    dp.counters()?
        .insert(cookie, zeros, 0)
        .map_err(|e| Error::bpf(format!("pod {pod}: creating counters"), e))?;
    for &ip in &ips {
        pod_ips
            .insert(ip_key(ip), cookie, 0)
            .map_err(|e| Error::bpf(format!("pod {pod}: recording address {ip}"), e))?;
    }
    dp.pod_addrs()?
        .insert(cookie, pod_addrs(&ips), 0)
        .map_err(|e| Error::bpf(format!("pod {pod}: recording its own addresses"), e))?;
    // The app's replies to the proxy's transparent connections must come back to the proxy:
    // without this they would leave for the real client, so a pod that cannot have it is not
    // enrolled.
    match netns.run(reply_routing::set_up)? {
        Ok(None) => {}
        Ok(Some(v6)) => warn!(%pod, error = %v6, "no IPv6 reply routing in the pod"),
        Err(e) => return Err(Error::io(format!("pod {pod}: setting up its reply routing"), e)),
    }
    let mut excluded = dp.excluded_ports()?;
    let outbound = opts.exclude_outbound_ports.iter().map(|&p| (p, direction::OUTBOUND));
    let inbound = opts.exclude_inbound_ports.iter().map(|&p| (p, direction::INBOUND));
    let ports_excluded = opts.exclude_outbound_ports.len() + opts.exclude_inbound_ports.len();
    for (port, direction) in outbound.chain(inbound) {
        let key = PortKey { netns: cookie, port, direction, _pad: 0 };
        excluded
            .insert(key, 1, 0)
            .map_err(|e| Error::bpf(format!("pod {pod}: excluding port {port}"), e))?;
    }

    let mut cidrs = dp.excluded_cidrs()?;
    let rules = prefix_rules(opts);
    let rules_len = rules.len();
    for (net, direction, action) in rules {
        cidrs
            .insert(&cidr_key(cookie, direction, net), action, 0)
            .map_err(|e| Error::bpf(format!("pod {pod}: prefix {net}"), e))?;
    }

    let dir = dp.pod_dir(cookie);
    fs::create_dir(&dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    link_sk_lookup(dp, netns, &dir, &pod, opts.capture_inbound)?;
    if opts.counters {
        netns.run(|| attach_tc(dp, cookie, &dir, &pod, &opts.iface))??;
    }
    // The guard on every interface of the pod (a second one, Multus', is a way out too), its
    // main one first, which the pod's record names.
    let ifindex = netns.run(|| attach_guard(dp, &pod, &opts.iface))??;
    // A netlink filter is not undone with the pod's pins: take them off if what follows fails.
    let mut guard = GuardFilter { netns, armed: true };
    netns.run(|| guard_other_interfaces(dp, &pod, ifindex))??;
    // And the node's end of each of its links (taken off again by `undo` if what follows
    // fails): what the pod does to its own side cannot get past that one.
    guard_host_ends(dp, netns, &pod)?;

    // Last: the PODS entry is what turns capture on for the pod.
    let mut info = PodInfo::new(ifindex, netns.inode(), &pod);
    for (on, flag) in [
        (opts.capture_outbound, pod_flags::CAPTURE_OUTBOUND),
        (opts.capture_inbound, pod_flags::CAPTURE_INBOUND),
        (opts.probe_bypass, pod_flags::PROBE_BYPASS),
        (opts.capture_dns, pod_flags::CAPTURE_DNS),
        (covers_all(&ips), pod_flags::ADDRESSES_IN_POD_ADDRS),
        (ports_excluded == 0, pod_flags::NO_EXCLUDED_PORTS),
        (rules_len == 0, pod_flags::NO_PREFIX_RULES),
    ] {
        if on {
            info.flags |= flag;
        }
    }
    // The pod's counts of pending connections, for its shares of the maps that hold them: kept
    // if there are some (enrolled again, its connections still counted in them), so that what
    // the programs count is never reset.
    for (mut counts, what) in [
        (dp.pending_connections()?, "its pending connections' count"),
        (dp.pending_transparent()?, "its pending transparent connections' count"),
    ] {
        match counts.insert(cookie, 0, BPF_NOEXIST) {
            Ok(()) => {}
            Err(MapError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::AlreadyExists => {
            }
            Err(e) => return Err(Error::bpf(format!("pod {pod}: {what}"), e)),
        }
    }
    dp.pods()?
        .insert(cookie, info, 0)
        .map_err(|e| Error::bpf(format!("pod {pod}: recording enrolment"), e))?;
    undo.armed = false;
    guard.armed = false;
    info!(%pod, cookie, ?ips, "pod enrolled");
    Ok(cookie)
}

/// The calling thread's netns addresses a pod is reached at: every address but loopback and
/// IPv6 link-local ones.
fn pod_addresses() -> Result<Vec<IpAddr>> {
    let addrs = nix::ifaddrs::getifaddrs()
        .map_err(|e| Error::io("listing the pod's addresses", e.into()))?;
    let mut ips: Vec<IpAddr> = addrs
        .filter_map(|a| {
            let sa = a.address?;
            if let Some(v4) = sa.as_sockaddr_in() {
                return Some(IpAddr::V4(v4.ip()));
            }
            sa.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        })
        .filter(|ip| match ip {
            IpAddr::V4(v4) => !v4.is_loopback(),
            IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unicast_link_local(),
        })
        .collect();
    ips.sort();
    ips.dedup();
    Ok(ips)
}

/// Whether [`pod_addrs`] holds every one of `ips` (no family has two).
fn covers_all(ips: &[IpAddr]) -> bool {
    ips.iter().filter(|ip| ip.is_ipv4()).count() <= 1
        && ips.iter().filter(|ip| ip.is_ipv6()).count() <= 1
}

/// The `POD_IPS` keys of a `POD_ADDRS` entry (a family without an address is all zeros).
fn pod_addrs_keys(addrs: &PodAddrs) -> Vec<PodIpKey> {
    let mut keys = Vec::with_capacity(2);
    if addrs.v4 != 0 {
        // As `pod_addrs` stored it: the last word of the v4-mapped key.
        let mut key = ip_key(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        key.addr[3] = addrs.v4;
        keys.push(key);
    }
    if addrs.v6 != [0; 4] {
        keys.push(PodIpKey { addr: addrs.v6 });
    }
    keys
}

/// The pod's own address of each family (the first of each), as the outbound hook steers to
/// them.
fn pod_addrs(ips: &[IpAddr]) -> PodAddrs {
    let mut addrs = PodAddrs::default();
    if let Some(v4) = ips.iter().find(|ip| ip.is_ipv4()) {
        addrs.v4 = ip_key(*v4).addr[3];
    }
    if let Some(v6) = ips.iter().find(|ip| ip.is_ipv6()) {
        addrs.v6 = ip_key(*v6).addr;
    }
    addrs
}

/// The `POD_IPS` key of an address (IPv4 v4-mapped).
pub fn ip_key(ip: IpAddr) -> PodIpKey {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let o = v6.octets();
    let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
    PodIpKey { addr: [word(0), word(4), word(8), word(12)] }
}

/// The pod's prefix rules as `EXCLUDED_CIDRS` holds them, in the order they are written (a
/// later one for the same prefix replaces an earlier). The keys are IPv6 with IPv4 v4-mapped,
/// so an IPv6 prefix that covers `::ffff:0:0/96` (`::/0`, say) would cover every IPv4 address
/// too: in each direction that has one, `::ffff:0:0/96` → capture comes first, which leaves
/// IPv4 to the pod's IPv4 rules (longer prefixes: they win), as an ip6tables rule leaves IPv4
/// to iptables. (A prefix inside `::ffff:0:0/96` is an IPv4 prefix written as IPv6, and acts
/// as one.)
pub fn prefix_rules(opts: &EnrolOptions) -> Vec<(IpNet, u16, u32)> {
    let v4_mapped =
        IpNet::V6(ipnet::Ipv6Net::new_assert(std::net::Ipv4Addr::UNSPECIFIED.to_ipv6_mapped(), 96));
    let rules = [
        (&opts.exclude_outbound_cidrs, direction::OUTBOUND, cidr_action::EXCLUDE),
        (&opts.capture_outbound_cidrs, direction::OUTBOUND, cidr_action::CAPTURE),
        (&opts.exclude_inbound_cidrs, direction::INBOUND, cidr_action::EXCLUDE),
    ];
    let mut out: Vec<(IpNet, u16, u32)> = Vec::new();
    for (nets, direction, _) in rules {
        let covers_ipv4 =
            |n: &IpNet| matches!(n, IpNet::V6(_)) && n.contains(&v4_mapped) && *n != v4_mapped;
        let guard = (v4_mapped, direction, cidr_action::CAPTURE);
        if nets.iter().any(covers_ipv4) && !out.contains(&guard) {
            out.push(guard);
        }
    }
    for (nets, direction, action) in rules {
        out.extend(nets.iter().map(|n| (n.trunc(), direction, action)));
    }
    out
}

/// The `EXCLUDED_CIDRS` key of a prefix rule.
pub fn cidr_key(cookie: NetnsCookie, direction: u16, net: IpNet) -> Key<CidrKey> {
    let net = net.trunc();
    let (addr, bits) = match net {
        IpNet::V4(v4) => (IpAddr::V4(v4.addr()), 96 + u32::from(v4.prefix_len())),
        IpNet::V6(v6) => (IpAddr::V6(v6.addr()), u32::from(v6.prefix_len())),
    };
    Key::new(CIDR_FIXED_BITS + bits, CidrKey::new(cookie, direction, ip_key(addr).addr))
}

/// Links the node's sk_lookup program into the pod's netns and pins the link. Every pod gets
/// one: with inbound capture the steering program, else one that passes everything. The kernel
/// detaches a netns link when the netns dies, which is how `reconcile` tells a vanished pod from
/// a live one without scanning /proc.
fn link_sk_lookup(
    dp: &Datapath,
    netns: &Netns,
    dir: &Path,
    pod: &str,
    inbound: bool,
) -> Result<()> {
    let name = if inbound { programs::SK_LOOKUP } else { programs::SK_LOOKUP_PASS };
    let mut prog = dp.sk_lookup_program(name)?;
    let what = || format!("pod {pod}: linking {name} into its netns");
    let id = prog.attach(netns.file()).map_err(|e| Error::bpf(what(), e))?;
    let link = FdLink::from(prog.take_link(id).map_err(|e| Error::bpf(what(), e))?);
    let pin = link_pins::SK_LOOKUP;
    link.pin(dir.join(pin)).map_err(|e| Error::bpf(format!("pod {pod}: pinning {pin}"), e))?;
    Ok(())
}

/// Whether this kernel has TCX links (6.6): aya attaches TC programs with TCX there and through
/// netlink (a clsact qdisc and a filter) below it, the same test.
pub fn tcx_supported() -> bool {
    KernelVersion::current().is_ok_and(|k| k >= KernelVersion::new(6, 6, 0))
}

/// Loads the pod's instance of the TC counters (they key on a load-time constant), attaches
/// them to `iface` in the calling thread's netns (the pod's) and, with TCX, pins the links in
/// `dir`. Returns the interface index. TCX attachment costs the kernel an RCU grace period per
/// link (~12 ms here): counters are optional.
///
/// Below 6.6 (no TCX) the programs go in as netlink filters on a clsact qdisc, which is what the
/// kernel has there. Such a filter is not a bpf link: it cannot be pinned and stays attached
/// after this process exits (aya's link would detach it on drop, so it is forgotten), until
/// `detach_tc_filters` removes it by name or the pod's interface goes away with its netns.
fn attach_tc(
    dp: &Datapath,
    cookie: NetnsCookie,
    dir: &Path,
    pod: &str,
    iface: &str,
) -> Result<u32> {
    let ifindex = nix::net::if_::if_nametoindex(iface)
        .map_err(|_| Error::NoSuchInterface { pod: pod.to_owned(), iface: iface.to_owned() })?;
    let tcx = tcx_supported();
    if !tcx {
        // A filter left by an earlier enrolment of this netns would count twice.
        detach_tc_filters(iface);
        if let Err(e) = aya::programs::tc::qdisc_add_clsact(iface) {
            // Usually "exists" (another tool or an earlier enrolment made it); if it is really
            // missing, attaching says so next.
            tracing::debug!(%pod, %iface, error = %e, "adding the clsact qdisc");
        }
    }
    let mut ebpf = dp.load_pod_object(cookie)?;
    let attached = (|| {
        for (program, attach_type, pin) in [
            (programs::TC_POD_INGRESS, TcAttachType::Ingress, link_pins::TC_INGRESS),
            (programs::TC_POD_EGRESS, TcAttachType::Egress, link_pins::TC_EGRESS),
        ] {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(program)
                .and_then(|p| p.try_into().ok())
                .ok_or_else(|| Error::bpf(program, io::Error::other("not a TC program")))?;
            load(prog.load(), program)?;
            let what = || format!("pod {pod}: attaching {program} to {iface}");
            let id = prog.attach(iface, attach_type).map_err(|e| Error::bpf(what(), e))?;
            let link = prog.take_link(id).map_err(|e| Error::bpf(what(), e))?;
            if !tcx {
                std::mem::forget(link);
                continue;
            }
            let link: FdLink = link.try_into().map_err(|e| Error::bpf(what(), e))?;
            link.pin(dir.join(pin))
                .map_err(|e| Error::bpf(format!("pod {pod}: pinning {pin}"), e))?;
        }
        Ok(())
    })();
    if attached.is_err() && !tcx {
        detach_tc_filters(iface);
    }
    attached.map(|()| ifindex)
}

/// Attaches the node's TC guard (`raw_tcp_guard.rs`) to `iface` in the calling thread's netns
/// (the pod's) as a netlink filter on a clsact qdisc: a TCX link's attach and detach each wait
/// for an RCU grace period (10 to 20 ms here), which would sit on the CNI ADD and DEL path; a
/// filter takes a fraction of a millisecond. A guard left there by an earlier enrolment of the
/// netns is replaced. Returns the interface index.
fn attach_guard(dp: &Datapath, pod: &str, iface: &str) -> Result<u32> {
    let ifindex = nix::net::if_::if_nametoindex(iface)
        .map_err(|_| Error::NoSuchInterface { pod: pod.to_owned(), iface: iface.to_owned() })?;
    detach_guard(iface);
    if let Err(e) = aya::programs::tc::qdisc_add_clsact(iface) {
        // Usually "exists" (the CNI, another tool or an earlier enrolment made it); if it is
        // really missing, attaching says so next.
        tracing::debug!(%pod, %iface, error = %e, "adding the clsact qdisc");
    }
    let mut prog = dp.guard_program()?;
    let what = || format!("pod {pod}: attaching {} to {iface}", programs::TC_POD_GUARD);
    let id = prog
        .attach_with_options(
            iface,
            TcAttachType::Egress,
            aya::programs::tc::TcAttachOptions::Netlink(Default::default()),
        )
        .map_err(|e| Error::bpf(what(), e))?;
    // Not a bpf link: it stays attached after this process exits, until `detach_guard` or
    // the interface goes (aya's link would detach it on drop, so it is forgotten).
    let link = prog.take_link(id).map_err(|e| Error::bpf(what(), e))?;
    std::mem::forget(link);
    Ok(ifindex)
}

/// Takes the guard's filter off `iface` in the calling thread's netns, if it is there.
fn detach_guard(iface: &str) {
    detach_filter(iface, TcAttachType::Egress, programs::TC_POD_GUARD);
}

/// Every interface of the calling thread's netns but loopback (ifindex 1 in every netns),
/// by name and index.
pub fn interfaces() -> Result<Vec<(String, u32)>> {
    let all = nix::net::if_::if_nameindex()
        .map_err(|e| Error::io("listing the pod's interfaces", e.into()))?;
    Ok(all
        .iter()
        .filter(|i| i.index() != LOOPBACK_IFINDEX)
        .map(|i| (i.name().to_string_lossy().into_owned(), i.index()))
        .collect())
}

/// `lo`'s index, in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// Attaches the guard to every interface of the calling thread's netns (the pod's) but
/// loopback and `main` (attached already); an interface that goes meanwhile is skipped.
/// Returns how many it attached.
fn guard_other_interfaces(dp: &Datapath, pod: &str, main: u32) -> Result<usize> {
    let mut attached = 0;
    for (name, index) in interfaces()? {
        if index == main {
            continue;
        }
        match attach_guard(dp, pod, &name) {
            Ok(_) => attached += 1,
            Err(Error::NoSuchInterface { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(attached)
}

/// Puts the guard on each interface of the pod in `netns` that lacks it: one that appeared
/// after the pod was enrolled (a secondary network's, which Multus adds after the pod's main
/// network's chain, or one added by hand). Those that have it are left as they are (no moment
/// without it). Nothing to do if the pod is not enrolled. Returns the interfaces guarded.
pub fn guard_unguarded_interfaces(dp: &Datapath, netns: &Netns) -> Result<Vec<String>> {
    let cookie = netns.cookie();
    if !is_enrolled(dp, cookie)? {
        return Ok(Vec::new());
    }
    let pod = format!("with netns cookie {cookie}");
    let name = crate::datapath::upgrade::prog_name(&dp.guard_program()?);
    let mut guarded = netns.run(|| {
        let mut rt = meshpath_podnet::rtnetlink::Socket::open()
            .map_err(|e| Error::io(format!("pod {pod}: opening rtnetlink"), e))?;
        let mut guarded = Vec::new();
        for (iface, index) in interfaces()? {
            let filters = match rt.bpf_filters(index, ClsactHook::Egress) {
                Ok(f) => f,
                // Gone meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => continue,
                Err(e) => {
                    return Err(Error::io(format!("pod {pod}: listing the filters of {iface}"), e))
                }
            };
            if filters.iter().any(|f| f.name == name) {
                continue;
            }
            match attach_guard(dp, &pod, &iface) {
                Ok(_) => guarded.push(iface),
                Err(Error::NoSuchInterface { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(guarded)
    })??;
    guarded.extend(guard_host_ends(dp, netns, &pod)?);
    Ok(guarded)
}

/// The node's end of each of the pod's links: for each interface of the pod in `netns` that is
/// one end of a veth whose other end is in the calling thread's netns (the node's, where the
/// agent runs), that end's name and index here, and the id this netns knows the pod's by. A
/// pod interface without such a peer (a macvlan, or a link to another netns) has none.
pub fn host_ends(netns: &Netns) -> Result<Vec<(String, u32, u32)>> {
    let pod = netns.path().display().to_string();
    let rtnetlink = |e| Error::io(format!("pod {pod}: asking rtnetlink for its links"), e);
    // In the pod: each interface's peer index, if the peer is in another netns.
    let peers = netns.run(|| -> Result<Vec<(u32, u32)>> {
        let mut rt = meshpath_podnet::rtnetlink::Socket::open().map_err(rtnetlink)?;
        let mut peers = Vec::new();
        for (_, index) in interfaces()? {
            if let Some(meshpath_podnet::rtnetlink::Link {
                link: Some(peer),
                link_netnsid: Some(_),
                ..
            }) = rt.link(index).map_err(rtnetlink)?
            {
                peers.push((index, peer));
            }
        }
        Ok(peers)
    })??;
    if peers.is_empty() {
        return Ok(Vec::new());
    }
    // Here: the link at each peer index, if it is the other end of that very interface, in
    // the pod's netns (interface indexes repeat from netns to netns: every pod's eth0 may be 2).
    let mut rt = meshpath_podnet::rtnetlink::Socket::open().map_err(rtnetlink)?;
    let mut ends = Vec::new();
    for (pod_index, peer) in peers {
        let Some(link) = rt.link(peer).map_err(rtnetlink)? else { continue };
        let (Some(back), Some(nsid)) = (link.link, link.link_netnsid) else { continue };
        // Asked after the link: listing it gave the pod's netns an id here if it had none.
        if back == pod_index && rt.nsid_of(netns.file().as_fd()).map_err(rtnetlink)? == Some(nsid) {
            ends.push((link.name, peer, nsid));
        }
    }
    Ok(ends)
}

/// Puts the node-side guard (`tc_node_guard`) on the node's end of each of the pod's links
/// that lacks it, its `HOST_ENDS` entry written first (the guard drops all TCP from an end it
/// has no entry for). Returns the ends guarded.
///
/// As a netlink filter, like the pod's side (no RCU grace period on the CNI ADD path), unless
/// the end already runs TCX programs (a CNI's own, Cilium's from 6.6 on): those decide before
/// any netlink filter runs, and one that passes a frame would pre-empt the guard. There the
/// guard goes in as a TCX link at the head, pinned in the pod's directory, in front of them.
fn guard_host_ends(dp: &Datapath, netns: &Netns, pod: &str) -> Result<Vec<String>> {
    let ends = host_ends(netns)?;
    if ends.is_empty() {
        return Ok(Vec::new());
    }
    let mut prog = dp.node_guard_program()?;
    let name = crate::datapath::upgrade::prog_name(&prog);
    let mut map = dp.host_ends()?;
    let mut rt = meshpath_podnet::rtnetlink::Socket::open()
        .map_err(|e| Error::io(format!("pod {pod}: opening rtnetlink"), e))?;
    let mut guarded = Vec::new();
    for (iface, index, nsid) in ends {
        let end = HostEnd { netns: netns.cookie(), nsid, _pad: 0 };
        map.insert(index, end, 0)
            .map_err(|e| Error::bpf(format!("pod {pod}: recording the node's end {iface}"), e))?;
        let pin =
            dp.pod_dir(netns.cookie()).join(format!("{}{index}", link_pins::NODE_GUARD_PREFIX));
        if pin.exists() {
            continue;
        }
        let filters = rt.bpf_filters(index, ClsactHook::Ingress).map_err(|e| {
            Error::io(format!("pod {pod}: listing the filters of the node's end {iface}"), e)
        })?;
        if filters.iter().any(|f| f.name == name) {
            continue;
        }
        let what = || format!("pod {pod}: attaching {} to {iface}", programs::TC_NODE_GUARD);
        let tcx_there = tcx_supported()
            && SchedClassifier::query_tcx(&iface, TcAttachType::Ingress)
                .is_ok_and(|(_, programs)| !programs.is_empty());
        if tcx_there {
            let id = prog
                .attach_with_options(
                    &iface,
                    TcAttachType::Ingress,
                    aya::programs::tc::TcAttachOptions::TcxOrder(aya::programs::LinkOrder::first()),
                )
                .map_err(|e| Error::bpf(what(), e))?;
            let link: FdLink = prog
                .take_link(id)
                .map_err(|e| Error::bpf(what(), e))?
                .try_into()
                .map_err(|e| Error::bpf(what(), e))?;
            link.pin(&pin)
                .map_err(|e| Error::bpf(format!("pod {pod}: pinning {}", pin.display()), e))?;
            guarded.push(iface);
            continue;
        }
        if let Err(e) = aya::programs::tc::qdisc_add_clsact(&iface) {
            tracing::debug!(%pod, %iface, error = %e, "adding the clsact qdisc");
        }
        let id = prog
            .attach_with_options(
                &iface,
                TcAttachType::Ingress,
                aya::programs::tc::TcAttachOptions::Netlink(Default::default()),
            )
            .map_err(|e| Error::bpf(what(), e))?;
        // Not a bpf link, as the pod side's: it stays until taken off or the link goes.
        std::mem::forget(prog.take_link(id).map_err(|e| Error::bpf(what(), e))?);
        guarded.push(iface);
    }
    Ok(guarded)
}

/// Takes the node-side guard off the node's ends of the pod's links (in the calling thread's
/// netns, the node's) and forgets them. An end already gone (its pod deleted) is only
/// forgotten. A TCX link went with the pod's directory, just before.
fn unguard_host_ends(dp: &Datapath, cookie: NetnsCookie) -> Result<Vec<Result<(), MapError>>> {
    let mut map = dp.host_ends()?;
    let ends: Vec<u32> =
        map.iter().flatten().filter(|(_, end)| end.netns == cookie).map(|(i, _)| i).collect();
    Ok(ends
        .into_iter()
        .map(|index| {
            // Off before the entry goes: without its entry the guard would drop all TCP.
            if let Ok(iface) = nix::net::if_::if_indextoname(index) {
                detach_filter(
                    &iface.to_string_lossy(),
                    TcAttachType::Ingress,
                    programs::TC_NODE_GUARD,
                );
            }
            map.remove(&index)
        })
        .collect())
}

/// Takes the guard off every interface of the calling thread's netns.
fn detach_guards() {
    for (name, _) in interfaces().unwrap_or_default() {
        detach_guard(&name);
    }
}

/// Takes the guards off again when an enrolment fails after attaching them.
struct GuardFilter<'a> {
    netns: &'a Netns,
    armed: bool,
}

impl Drop for GuardFilter<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.netns.run(detach_guards);
        }
    }
}

fn detach_filter(iface: &str, attach_type: TcAttachType, program: &str) {
    match aya::programs::tc::qdisc_detach_program(iface, attach_type, program) {
        Ok(()) => {}
        Err(aya::programs::tc::TcError::IoError(e)) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => warn!(%iface, %program, error = %e, "detaching a TC filter"),
    }
}

/// Removes the counters' netlink filters (kernels without TCX) from `iface` in the calling
/// thread's netns; nothing to do where there are none. TCX links are detached by `remove_all`.
pub fn detach_tc_filters(iface: &str) {
    detach_filter(iface, TcAttachType::Ingress, programs::TC_POD_INGRESS);
    detach_filter(iface, TcAttachType::Egress, programs::TC_POD_EGRESS);
}

/// Unenrols the pod whose netns is `netns`: as `unenrol`, and first takes the netlink filters
/// off its interfaces (they are not links, so only something inside the netns can): the guard
/// from every interface, and on kernels without TCX the counters from the main one. Without
/// this they would stay attached (the guard still dropping the pod's raw TCP, the counters
/// counting nothing) until the netns goes.
pub fn unenrol_netns(dp: &Datapath, netns: &Netns) -> Result<()> {
    let cookie = netns.cookie();
    if let Ok(info) = dp.pods()?.get(&cookie, 0) {
        netns.run(|| {
            detach_guards();
            if info.ifindex != 0 && !tcx_supported() {
                if let Ok(name) = nix::net::if_::if_indextoname(info.ifindex) {
                    detach_tc_filters(&name.to_string_lossy());
                }
            }
        })?;
    }
    unenrol(dp, cookie)
}

/// Removes everything enrolment made for the pod with this cookie. Works whether or not the
/// pod's netns still exists.
pub fn unenrol(dp: &Datapath, cookie: NetnsCookie) -> Result<()> {
    if !is_enrolled(dp, cookie)? {
        return Err(Error::NotEnrolled { pod: format!("with netns cookie {cookie}") });
    }
    remove_all(dp, cookie)?;
    info!(cookie, "pod unenrolled");
    Ok(())
}

/// Whether any trace of an enrolment exists for `cookie`.
pub fn is_enrolled(dp: &Datapath, cookie: NetnsCookie) -> Result<bool> {
    let recorded = match dp.pods()?.get(&cookie, 0) {
        Ok(_) => true,
        Err(MapError::KeyNotFound) => false,
        Err(e) => return Err(Error::bpf("reading PODS", e)),
    };
    Ok(recorded || dp.pod_dir(cookie).exists())
}

/// Removes the pod's links (detached, then unpinned), its directory and its map entries.
/// Missing pieces are not errors: this also finishes a half-done enrolment.
fn remove_all(dp: &Datapath, cookie: NetnsCookie) -> Result<()> {
    // Every step runs even if one fails; the failures are reported together at the end.
    let mut failed: Vec<String> = Vec::new();
    fn map_step<E: std::fmt::Display>(
        failed: &mut Vec<String>,
        what: &str,
        res: std::result::Result<Vec<std::result::Result<(), MapError>>, E>,
    ) {
        match res {
            Ok(results) => {
                for r in results {
                    match r {
                        Ok(()) | Err(MapError::KeyNotFound) => {}
                        // SOCKHASH deletes report a missing key as the raw ENOENT.
                        Err(MapError::SyscallError(e))
                            if e.io_error.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => failed.push(format!("{what}: {e}")),
                    }
                }
            }
            Err(e) => failed.push(format!("{what}: {e}")),
        }
    }
    // Read before PODS goes: the agent's notes on which entries are the pod's (see the flags).
    // Best effort like every step here: without them, the walks below.
    let mut pods = dp.pods();
    let flags = pods.as_ref().ok().and_then(|m| m.get(&cookie, 0).ok()).map_or(0, |i| i.flags);
    let noted = |flag: u32| flags & flag != 0;
    let mut pod_addrs = dp.pod_addrs();
    let own_keys = pod_addrs
        .as_ref()
        .ok()
        .filter(|_| noted(pod_flags::ADDRESSES_IN_POD_ADDRS))
        .and_then(|m| m.get(&cookie, 0).ok())
        .map(|addrs| pod_addrs_keys(&addrs));
    // PODS first: capture turns off for the pod while everything it relies on is still there
    // (inbound, still linked, then refuses: POD_IPS without PODS is SK_DROP).
    map_step(&mut failed, "PODS", pods.as_mut().map(|m| vec![m.remove(&cookie)]));

    let dir = dp.pod_dir(cookie);
    let unpin = || -> io::Result<()> {
        for entry in fs::read_dir(&dir)?.flatten() {
            // Detached first, so that no program of the pod's runs once this returns: the
            // unlink alone detaches only later (sys::detach_pinned_link). If that fails, the
            // unlink still detaches, later.
            if let Err(e) = crate::sys::detach_pinned_link(&entry.path()) {
                warn!(cookie, pin = %entry.path().display(), error = %e, "detaching a pod's link");
            }
            fs::remove_file(entry.path())?;
        }
        fs::remove_dir(&dir)
    };
    match unpin() {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => failed.push(format!("unpinning {}: {e}", dir.display())),
    }
    map_step(&mut failed, "HOST_ENDS", unguard_host_ends(dp, cookie));

    if !noted(pod_flags::NO_EXCLUDED_PORTS) {
        map_step(
            &mut failed,
            "EXCLUDED_PORTS",
            dp.excluded_ports().map(|mut m| {
                let keys: Vec<PortKey> = m.keys().flatten().filter(|k| k.netns == cookie).collect();
                keys.iter().map(|k| m.remove(k)).collect()
            }),
        );
    }
    map_step(&mut failed, "POD_COUNTERS", dp.counters().map(|mut m| vec![m.remove(&cookie)]));
    map_step(
        &mut failed,
        "PENDING_CONNECTIONS",
        dp.pending_connections().map(|mut m| vec![m.remove(&cookie)]),
    );
    map_step(
        &mut failed,
        "PENDING_TRANSPARENT",
        dp.pending_transparent().map(|mut m| vec![m.remove(&cookie)]),
    );
    if !noted(pod_flags::NO_PREFIX_RULES) {
        let mine = cookie.to_ne_bytes();
        map_step(
            &mut failed,
            "EXCLUDED_CIDRS",
            dp.excluded_cidrs().map(|mut m| {
                let keys: Vec<Key<CidrKey>> =
                    m.keys().flatten().filter(|k| k.data().netns == mine).collect();
                keys.iter().map(|k| m.remove(k)).collect()
            }),
        );
    }
    map_step(
        &mut failed,
        "POD_IPS",
        dp.pod_ips().map(|mut m| {
            let keys: Vec<PodIpKey> = match &own_keys {
                // Only while still the pod's: an address already reclaimed stays its new owner's.
                Some(own) => {
                    own.iter().copied().filter(|k| m.get(k, 0).ok() == Some(cookie)).collect()
                }
                None => m.iter().flatten().filter(|(_, c)| *c == cookie).map(|(k, _)| k).collect(),
            };
            keys.iter().map(|k| m.remove(k)).collect()
        }),
    );
    map_step(&mut failed, "POD_ADDRS", pod_addrs.as_mut().map(|m| vec![m.remove(&cookie)]));
    map_step(
        &mut failed,
        "INBOUND_LISTENERS",
        dp.inbound_listeners()
            .map(|mut m| inbound_listener_keys(cookie).iter().map(|k| m.remove(k)).collect()),
    );
    // Last: a decision made while the entries above were going may still have been counted.
    map_step(&mut failed, "DECISIONS", crate::decisions::remove_pod(dp, cookie));
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::io(
            format!("removing the pod with netns cookie {cookie}"),
            io::Error::other(failed.join("; ")),
        ))
    }
}

/// Undoes a partial enrolment when dropped while armed.
struct Undo<'a> {
    dp: &'a Datapath,
    cookie: NetnsCookie,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = remove_all(self.dp, self.cookie) {
                warn!(cookie = self.cookie, error = %e, "could not undo a failed enrolment");
            }
        }
    }
}

/// What [`reconcile`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Pods whose netns is alive: left as they are.
    pub kept: Vec<NetnsCookie>,
    /// Pods removed because their netns is gone.
    pub vanished: Vec<NetnsCookie>,
    /// Half-done enrolments (a pod directory with no `PODS` record) removed.
    pub partial: Vec<NetnsCookie>,
}

/// Brings the datapath in line with the kernel: removes every pod whose network namespace is
/// gone (deleted without an unenrol, or the pod vanished mid-enrolment) and every half-done
/// enrolment a killed loader left. Live pods are not touched, so running traffic is not either.
pub fn reconcile(dp: &Datapath) -> Result<ReconcileReport> {
    let mut report = ReconcileReport::default();
    let recorded: Vec<NetnsCookie> =
        dp.pods()?.keys().collect::<Result<_, _>>().map_err(|e| Error::bpf("reading PODS", e))?;
    for &cookie in &recorded {
        if netns_alive(dp, cookie)? {
            report.kept.push(cookie);
        } else {
            remove_all(dp, cookie)?;
            info!(cookie, "reclaimed a pod whose network namespace is gone");
            report.vanished.push(cookie);
        }
    }
    let pods_dir = dp.root().join(datapath_common::consts::pins::PODS_DIR);
    let entries = fs::read_dir(&pods_dir)
        .map_err(|e| Error::io(format!("reading {}", pods_dir.display()), e))?;
    for entry in entries.flatten() {
        let Some(cookie) = entry.file_name().to_str().and_then(|n| n.parse::<NetnsCookie>().ok())
        else {
            continue;
        };
        if !recorded.contains(&cookie) {
            remove_all(dp, cookie)?;
            info!(cookie, "removed a half-done enrolment");
            report.partial.push(cookie);
        }
    }
    // Counts under a cookie no pod has (a decision raced an unenrolment).
    let live: Vec<NetnsCookie> = report.kept.clone();
    for r in crate::decisions::remove_orphans(dp, &live)? {
        if let Err(e) = r {
            warn!(error = %e, "removing a stale decision count");
        }
    }
    for r in remove_orphan_exclusions(dp, &live)? {
        if let Err(e) = r {
            warn!(error = %e, "removing a stale exclusion entry");
        }
    }
    Ok(report)
}

/// Removes the exclusion entries of cookies not in `live` (reconcile). A loader killed after
/// writing a pod's exclusions but before its directory leaves entries no pod owns; a removal
/// that goes by the pod's `NO_EXCLUDED_PORTS` / `NO_PREFIX_RULES` notes would never find them
/// (a cookie is never reused), so without this they would hold room in the shared maps for good.
fn remove_orphan_exclusions(
    dp: &Datapath,
    live: &[NetnsCookie],
) -> Result<Vec<std::result::Result<(), MapError>>> {
    let mut ports = dp.excluded_ports()?;
    let stray: Vec<PortKey> = ports.keys().flatten().filter(|k| !live.contains(&k.netns)).collect();
    let mut results: Vec<_> = stray.iter().map(|k| ports.remove(k)).collect();
    let mut cidrs = dp.excluded_cidrs()?;
    let owned = |k: &Key<CidrKey>| live.iter().any(|c| c.to_ne_bytes() == k.data().netns);
    let stray: Vec<Key<CidrKey>> = cidrs.keys().flatten().filter(|k| !owned(k)).collect();
    results.extend(stray.iter().map(|k| cidrs.remove(k)));
    Ok(results)
}

/// Whether the pod's netns still exists: its pinned sk_lookup link is still attached (the
/// kernel detaches netns links, target inode 0, when the netns is destroyed). A missing link
/// counts as gone; any other error is reported, never taken as "gone" (that would turn capture
/// off for a live pod).
pub fn netns_alive(dp: &Datapath, cookie: NetnsCookie) -> Result<bool> {
    let pin = dp.pod_dir(cookie).join(link_pins::SK_LOOKUP);
    match crate::sys::pinned_link_target(&pin) {
        Ok(inode) => Ok(inode != 0),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("reading the netns link of cookie {cookie}"), e)),
    }
}

/// Every enrolled pod, with its counters.
pub fn list(dp: &Datapath) -> Result<Vec<PodStatus>> {
    let pods = dp.pods()?;
    let mut out = Vec::new();
    for entry in pods.iter() {
        let (cookie, info) = entry.map_err(|e| Error::bpf("reading PODS", e))?;
        out.push(status_of(dp, cookie, info)?);
    }
    out.sort_by_key(|p| p.cookie);
    Ok(out)
}

/// One enrolled pod, with its counters.
pub fn show(dp: &Datapath, cookie: NetnsCookie) -> Result<PodStatus> {
    let info = match dp.pods()?.get(&cookie, 0) {
        Ok(info) => info,
        Err(MapError::KeyNotFound) => {
            return Err(Error::NotEnrolled { pod: format!("with netns cookie {cookie}") })
        }
        Err(e) => return Err(Error::bpf("reading PODS", e)),
    };
    status_of(dp, cookie, info)
}

fn status_of(dp: &Datapath, cookie: NetnsCookie, info: PodInfo) -> Result<PodStatus> {
    let counters = match dp.counters()?.get(&cookie, 0) {
        Ok(per_cpu) => per_cpu.iter().fold(PodCounters::default(), |a, c| a.saturating_add(*c)),
        Err(MapError::KeyNotFound) => PodCounters::default(),
        Err(e) => return Err(Error::bpf("reading POD_COUNTERS", e)),
    };
    let pins = pin_names(dp.pod_dir(cookie));
    let mut ips: Vec<IpAddr> = dp
        .pod_ips()?
        .iter()
        .flatten()
        .filter(|(_, c)| *c == cookie)
        .map(|(k, _)| key_ip(k))
        .collect();
    ips.sort();
    let dir_name = |d: u16| if d == direction::INBOUND { "inbound" } else { "outbound" };
    let mut excluded_ports: Vec<(u16, &'static str)> = dp
        .excluded_ports()?
        .keys()
        .flatten()
        .filter(|k| k.netns == cookie)
        .map(|k| (k.port, dir_name(k.direction)))
        .collect();
    excluded_ports.sort();
    let mine = cookie.to_ne_bytes();
    let mut cidr_rules = Vec::new();
    for (key, action) in dp.excluded_cidrs()?.iter().flatten() {
        let data = key.data();
        if data.netns != mine {
            continue;
        }
        let ip = key_ip(PodIpKey { addr: data.addr });
        let bits = key.prefix_len().saturating_sub(CIDR_FIXED_BITS);
        let net = match ip {
            IpAddr::V4(v4) => IpNet::new(v4.into(), bits.saturating_sub(96) as u8),
            IpAddr::V6(v6) => IpNet::new(v6.into(), bits as u8),
        };
        let Ok(net) = net else { continue };
        let direction = dir_name(u32::from_ne_bytes(data.direction) as u16);
        let action = if action == cidr_action::CAPTURE { "capture" } else { "exclude" };
        cidr_rules.push((net, direction, action));
    }
    cidr_rules.sort();
    let decisions = crate::decisions::of(dp, cookie)?;
    Ok(PodStatus { cookie, info, counters, pins, ips, excluded_ports, cidr_rules, decisions })
}

/// The address a `POD_IPS` key stands for (v4-mapped back to IPv4).
pub fn key_ip(key: PodIpKey) -> IpAddr {
    let mut o = [0u8; 16];
    for (i, w) in key.addr.iter().enumerate() {
        o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
    }
    let v6 = std::net::Ipv6Addr::from(o);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

fn pin_names(dir: PathBuf) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ip_keys_round_trip_and_map_ipv4() {
        for ip in ["10.1.2.3", "fd00::1", "2001:db8::7"] {
            let ip: IpAddr = ip.parse().expect("ip");
            assert_eq!(key_ip(ip_key(ip)), ip);
        }
        let k = ip_key("10.1.2.3".parse().expect("ip"));
        assert_eq!(k, PodIpKey::v4(u32::from_ne_bytes([10, 1, 2, 3])));
    }

    #[test]
    fn a_pods_own_addresses_give_back_its_pod_ips_keys() {
        let ips: Vec<IpAddr> = ["10.1.2.3", "fd00::1"].map(|a| a.parse().expect("ip")).into();
        assert!(covers_all(&ips));
        let keys = pod_addrs_keys(&pod_addrs(&ips));
        assert_eq!(keys, ips.iter().map(|&ip| ip_key(ip)).collect::<Vec<_>>());
        let v6_only: Vec<IpAddr> = vec!["fd00::1".parse().expect("ip")];
        assert_eq!(pod_addrs_keys(&pod_addrs(&v6_only)), [ip_key(v6_only[0])]);
        assert!(pod_addrs_keys(&pod_addrs(&[])).is_empty());
    }

    #[test]
    fn two_addresses_of_one_family_are_not_all_in_pod_addrs() {
        let two_v4: Vec<IpAddr> =
            ["10.1.2.3", "10.1.2.4", "fd00::1"].map(|a| a.parse().expect("ip")).into();
        assert!(!covers_all(&two_v4));
        assert_eq!(pod_addrs_keys(&pod_addrs(&two_v4)).len(), 2, "only the first of each family");
    }

    #[test]
    fn an_ipv6_prefix_covering_the_v4_mapped_space_is_preceded_by_a_capture_of_it() {
        let net = |s: &str| -> IpNet { s.parse().expect("net") };
        let opts = EnrolOptions {
            exclude_outbound_cidrs: vec![net("::/0"), net("10.0.0.0/8")],
            exclude_inbound_cidrs: vec![net("fd00::/8")],
            ..EnrolOptions::default()
        };
        let mapped = net("::ffff:0:0/96");
        assert_eq!(
            prefix_rules(&opts),
            [
                (mapped, direction::OUTBOUND, cidr_action::CAPTURE),
                (net("::/0"), direction::OUTBOUND, cidr_action::EXCLUDE),
                (net("10.0.0.0/8"), direction::OUTBOUND, cidr_action::EXCLUDE),
                (net("fd00::/8"), direction::INBOUND, cidr_action::EXCLUDE),
            ]
        );
    }

    #[test]
    fn cidr_keys_cover_pod_direction_and_prefix() {
        let v4 = cidr_key(7, direction::OUTBOUND, "10.1.0.0/16".parse().expect("net"));
        assert_eq!(v4.prefix_len(), CIDR_FIXED_BITS + 96 + 16);
        let v6 = cidr_key(7, direction::INBOUND, "fd00::/8".parse().expect("net"));
        assert_eq!(v6.prefix_len(), CIDR_FIXED_BITS + 8);
        // Host bits are cleared so the trie holds one entry per prefix.
        let host = cidr_key(7, direction::OUTBOUND, "10.1.2.3/16".parse().expect("net"));
        assert_eq!(host.data(), v4.data());
    }
}
