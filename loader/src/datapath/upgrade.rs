//! Upgrading a pinned datapath in place: an agent of a newer version on a node whose pins an
//! older one left takes them over without a drain, a pod restart or a moment without capture.
//!
//! The pins say which datapath they hold (`DATAPATH_VERSION`, the hash of the eBPF object its
//! loader embeds; absent before meshpath 0.2). When that is not this loader's object:
//!
//! 1. **Plan the maps.** Each map the object declares is compared with its pin (type, key and
//!    value size, capacity, flags). Unchanged: kept, entries and all. Absent: created. Only
//!    its capacity, flags, or hash kind changed (a hash, an LRU hash, an array, an LPM trie): a
//!    new map, pinned beside the old as `NAME-next`, gets the old one's entries. A ring buffer that changed: a new, empty
//!    one. Anything else (a key or value layout that changed): the upgrade is refused before
//!    anything is touched, and the node keeps the datapath it has, every pod captured
//!    ([`Error::StaleDatapath`]; the agent says so on /readyz and in an Event on its Node).
//! 2. **Load** the new object against those maps, and every program (the verifier's verdict
//!    comes before any change). Where `ORIG_DST_BY_CONN` is replaced, the new programs get
//!    the old map as their fallback (`ORIG_DST_BY_CONN_PREVIOUS`), where they look after the
//!    new one: a connection an old program files at any moment of the swap is found by a new
//!    program at the proxy's accept ([`FALLBACK`]).
//! 3. **Copy** the entries of the maps that are replaced.
//! 4. **Swap**, each hook at once, never detached: the shared programs' pins are replaced
//!    (rename), each pod's sk_lookup and TCX links are updated (`BPF_LINK_UPDATE`), each pod's
//!    netlink filters (the TC guard, and the counters below Linux 6.6) get the new program in
//!    front of the old before the old is deleted, the sk_msg program is attached to the
//!    shortcut's map, and the node's cgroup links are updated in the order they were attached.
//! 5. **Copy again** what the old programs did to the replaced maps between the first copy and
//!    the swap (entries they added are added, entries they took are taken, and so are entries
//!    the new programs took through the fallback); then rename the new maps over the old
//!    pins, and link the fallback's readers again, loaded against the empty fallback. The old
//!    maps go with the last program that held them.
//! 6. **Write the version**, last: an upgrade that stopped part way is done again, from the
//!    start, by the next agent (every step is idempotent).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, MapData},
    programs::{tc::TcAttachType, Program, SchedClassifier},
    Ebpf,
};
use datapath_common::{
    consts::{map_names, pins, programs},
    pod_flags, HostEnd, NetnsCookie, PodInfo,
};
use meshpath_podnet::rtnetlink::{self, ClsactHook};
use tracing::{debug, info, warn};

use super::{load, Datapath, EBPF_OBJECT, PINNED_BY_PATH, SHARED_PROGRAMS};
use crate::{pods::link_pins, sys, Error, Result};

/// The datapath this loader embeds: FNV-1a of its eBPF object, taken by build.rs.
pub fn version() -> u64 {
    VERSION
}

const VERSION: u64 = decimal(env!("MESHPATH_DATAPATH_VERSION"));

/// A decimal number, at compile time.
const fn decimal(s: &str) -> u64 {
    let b = s.as_bytes();
    let mut i = 0;
    let mut n: u64 = 0;
    while i < b.len() {
        n = n.wrapping_mul(10).wrapping_add((b[i] - b'0') as u64);
        i += 1;
    }
    n
}

/// `BPF_NOEXIST`: an update that only adds.
const BPF_NOEXIST: u64 = 1;

/// A map one program files into and another reads from a moment later (a connection's two
/// ends): replaced by one of another shape, an entry an old program filed after the copy would
/// be missed by a new program reading the new map. So the new programs also read the map it
/// replaces, pinned as the fallback while the upgrade runs, until the last old program is
/// gone and its entries are copied; then the readers are loaded again against the empty
/// fallback and their links updated once more.
struct Fallback {
    /// The programs that read the map (sock_ops takes an entry at the proxy's accept,
    /// getsockopt answers from it), each linked at the node's cgroup.
    readers: [&'static str; 2],
}

const FALLBACK: Fallback = Fallback { readers: [programs::SOCK_OPS, programs::GETSOCKOPT] };

/// `enum bpf_map_type` values this module tells apart.
mod map_type {
    pub const HASH: u32 = 1;
    pub const ARRAY: u32 = 2;
    pub const PERF_EVENT_ARRAY: u32 = 4;
    pub const PERCPU_HASH: u32 = 5;
    pub const PERCPU_ARRAY: u32 = 6;
    pub const LRU_HASH: u32 = 9;
    pub const LRU_PERCPU_HASH: u32 = 10;
    pub const LPM_TRIE: u32 = 11;
    pub const RINGBUF: u32 = 27;
}

/// A map's shape: what must match for a pin to be taken as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    flags: u32,
}

impl Layout {
    fn of_pin(pin: &Path) -> Result<Self> {
        let data = MapData::from_pin(pin)
            .map_err(|e| Error::bpf(format!("opening pinned map {}", pin.display()), e))?;
        let info =
            data.info().map_err(|e| Error::bpf(format!("reading map {}", pin.display()), e))?;
        let map_type = info
            .map_type()
            .map_err(|e| Error::bpf(format!("map {}: its type", pin.display()), e))?;
        Ok(Self {
            map_type: map_type as u32,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
            flags: info.map_flags(),
        })
    }

    /// Whether entries can be copied from a map of layout `self` into one of `new`: the same
    /// key and value, a type whose entries a key walk finds, of one family (a hash and an LRU
    /// hash hold the same entries: meshpath's connection maps were LRU hashes once).
    fn copies_into(&self, new: &Self) -> bool {
        use map_type::*;
        let family = |t: u32| match t {
            HASH | LRU_HASH => Some(HASH),
            PERCPU_HASH | LRU_PERCPU_HASH => Some(PERCPU_HASH),
            ARRAY | PERCPU_ARRAY | LPM_TRIE => Some(t),
            _ => None,
        };
        family(self.map_type).is_some_and(|f| family(new.map_type) == Some(f))
            && self.key_size == new.key_size
            && self.value_size == new.value_size
    }

    fn is_stream(&self) -> bool {
        matches!(self.map_type, map_type::RINGBUF | map_type::PERF_EVENT_ARRAY)
    }

    fn has_deletable_keys(&self) -> bool {
        !matches!(self.map_type, map_type::ARRAY | map_type::PERCPU_ARRAY)
    }

    /// Bytes of one value as lookups return it (per-CPU maps: each CPU's, 8-byte aligned).
    fn value_len(&self) -> Result<usize> {
        let per_cpu = matches!(
            self.map_type,
            map_type::PERCPU_HASH | map_type::PERCPU_ARRAY | map_type::LRU_PERCPU_HASH
        );
        if !per_cpu {
            return Ok(self.value_size as usize);
        }
        let cpus = aya::util::nr_cpus().map_err(|(what, e)| Error::io(what, e))?;
        Ok((self.value_size as usize).div_ceil(8) * 8 * cpus)
    }

    fn describe(&self) -> String {
        format!(
            "type {}, key {} B, value {} B, {} entries, flags {:#x}",
            self.map_type, self.key_size, self.value_size, self.max_entries, self.flags
        )
    }
}

/// What the upgrade does with one map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// Pinned with this layout: used as it is.
    Keep,
    /// Not pinned: the load creates it.
    Create,
    /// Replaced by a map of the new layout holding the old one's entries.
    Copy { old: Layout, new: Layout },
    /// Replaced by an empty one (a ring buffer: records in flight are not worth a refusal).
    Replace,
}

/// The maps this object pins, with their layouts as it declares them.
fn declared_maps() -> Result<BTreeMap<String, Layout>> {
    let object = aya_obj::Object::parse(EBPF_OBJECT)
        .map_err(|e| Error::bpf("parsing the embedded eBPF object", e))?;
    // SAFETY: sysconf has no preconditions.
    let page = u32::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    Ok(object
        .maps
        .iter()
        .filter(|(name, m)| {
            m.pinning() == aya_obj::maps::PinningType::ByName
                || PINNED_BY_PATH.contains(&name.as_str())
        })
        .map(|(name, m)| {
            let mut max_entries = m.max_entries();
            if m.map_type() == map_type::RINGBUF {
                // As aya creates it: a power-of-two multiple of the page size.
                max_entries = max_entries.div_ceil(page).next_power_of_two() * page;
            }
            let layout = Layout {
                map_type: m.map_type(),
                key_size: m.key_size(),
                // aya creates ring buffers with value size 0.
                value_size: if m.map_type() == map_type::RINGBUF { 0 } else { m.value_size() },
                max_entries,
                flags: m.map_flags(),
            };
            (name.clone(), layout)
        })
        .collect())
}

/// Each declared map's plan against the pins under `dp`; refused (before anything changes)
/// where a map's entries cannot be carried over.
fn plan(dp: &Datapath, declared: &BTreeMap<String, Layout>) -> Result<BTreeMap<String, Plan>> {
    let mut plans = BTreeMap::new();
    for (name, &new) in declared {
        let pin = dp.map_pin(name);
        let plan = if !pin.exists() {
            Plan::Create
        } else if name == map_names::ORIG_DST_BY_CONN_PREVIOUS {
            // Empty at rest, whatever its shape (see [`FALLBACK`]).
            Plan::Keep
        } else {
            let old = Layout::of_pin(&pin)?;
            if old == new {
                Plan::Keep
            } else if old.copies_into(&new) {
                Plan::Copy { old, new }
            } else if old.is_stream() && new.is_stream() {
                Plan::Replace
            } else {
                return Err(Error::StaleDatapath {
                    root: dp.root.clone(),
                    map: name.clone(),
                    found: old.describe(),
                    wanted: new.describe(),
                });
            }
        };
        plans.insert(name.clone(), plan);
    }
    Ok(plans)
}

/// What an upgrade did, for the log and the tests.
#[derive(Debug, Default)]
pub struct Report {
    /// Maps replaced by a larger or otherwise reshaped copy, with the entries carried over.
    pub maps_copied: Vec<(String, usize)>,
    /// Maps replaced empty (ring buffers).
    pub maps_replaced: Vec<String>,
    /// Maps the old datapath did not have.
    pub maps_created: Vec<String>,
    /// bpf links now running the new programs.
    pub links_updated: usize,
    /// Netlink TC filters replaced by the new program's.
    pub filters_replaced: usize,
    /// Pods whose hooks were switched.
    pub pods: usize,
    pub elapsed: Duration,
}

/// Upgrades the datapath pinned under `dp` to this loader's (see the module's docs).
pub(super) fn run(dp: &Datapath) -> Result<Report> {
    let started = Instant::now();
    let declared = declared_maps()?;
    let plans = plan(dp, &declared)?;
    let mut report = Report::default();
    // Maps loaded from their `-next` pin: new ones taking an old one's place.
    let replaced: Vec<&str> = plans
        .iter()
        .filter(|(_, p)| matches!(p, Plan::Copy { .. } | Plan::Replace))
        .map(|(n, _)| n.as_str())
        .collect();
    for name in &replaced {
        // A `-next` left by an upgrade that stopped part way is used again if it has the new
        // layout (programs may already run on it), else made anew.
        let next = next_pin(&dp.map_pin(name));
        if next.exists() && Layout::of_pin(&next).ok() != declared.get(*name).copied() {
            remove_pin(&next)?;
        }
    }
    // ORIG_DST_BY_CONN replaced: the new programs also read the map it replaces, until the
    // last old program is gone and its entries are copied ([`FALLBACK`]).
    let fallback = matches!(plans.get(map_names::ORIG_DST_BY_CONN), Some(Plan::Copy { .. }));
    let fallback_pin = next_pin(&dp.map_pin(map_names::ORIG_DST_BY_CONN_PREVIOUS));
    remove_pin(&fallback_pin)?;
    let mut first_load = replaced.clone();
    if fallback {
        let old = MapData::from_pin(dp.map_pin(map_names::ORIG_DST_BY_CONN))
            .map_err(|e| Error::bpf("opening ORIG_DST_BY_CONN", e))?;
        old.pin(&fallback_pin)
            .map_err(|e| Error::bpf(format!("pinning {}", fallback_pin.display()), e))?;
        first_load.push(map_names::ORIG_DST_BY_CONN_PREVIOUS);
    }
    let mut ebpf = dp.load_object_with(0, &first_load)?;
    for name in [SHARED_PROGRAMS.as_slice(), programs::CGROUP.as_slice()].concat() {
        load_program(&mut ebpf, name)?;
    }

    // First copy: nearly every entry, while the old programs still run.
    let mut copies = Vec::new();
    for (name, plan) in &plans {
        match *plan {
            Plan::Copy { old, new } => {
                let old_pin = dp.map_pin(name);
                let first = snapshot(&old_pin, &old)?;
                write_entries(&next_pin(&old_pin), &new, &first)?;
                copies.push((name.clone(), old, new, first));
            }
            Plan::Replace => report.maps_replaced.push(name.clone()),
            Plan::Create => report.maps_created.push(name.clone()),
            Plan::Keep => {}
        }
    }

    // The swap. Shared programs first: pods enrolled from now on link the new ones.
    for name in SHARED_PROGRAMS {
        let pin = dp.root.join(pins::PROGRAMS_DIR).join(name);
        let next = next_pin(&pin);
        remove_pin(&next)?;
        pin_program(&mut ebpf, name, &next)?;
        fs::rename(&next, &pin)
            .map_err(|e| Error::io(format!("replacing {}", pin.display()), e))?;
    }
    switch_pods(dp, &mut ebpf, &first_load, &mut report)?;
    if dp.acceleration()? {
        let fd = program_fd(&ebpf, programs::SK_MSG)?;
        let socks = MapData::from_pin(dp.map_pin(map_names::LOCAL_SOCKS))
            .map_err(|e| Error::bpf("opening LOCAL_SOCKS", e))?;
        sys::sk_msg_on_map(fd, socks.fd().as_fd().as_raw_fd(), true)
            .map_err(|e| Error::io("attaching the new sk_msg program to LOCAL_SOCKS", e))?;
    }
    let node = dp.root.join(pins::NODE_LINKS_DIR);
    for name in programs::CGROUP {
        let pin = node.join(name);
        if pin.exists() {
            sys::update_pinned_link(&pin, program_fd(&ebpf, name)?)
                .map_err(|e| Error::io(format!("updating {}", pin.display()), e))?;
            report.links_updated += 1;
        }
        // A program the old datapath did not have is attached after this, as on a new node.
    }
    for entry in fs::read_dir(&node).into_iter().flatten().flatten() {
        let name = entry.file_name();
        if !programs::CGROUP.iter().any(|p| name == *p) {
            // A hook this version no longer has.
            sys::detach_pinned_link(&entry.path())
                .map_err(|e| Error::io(format!("detaching {}", entry.path().display()), e))?;
            remove_pin(&entry.path())?;
        }
    }

    // Second copy: what the old programs did between the first and the swap.
    for (name, old, new, first) in copies {
        let old_pin = dp.map_pin(&name);
        let next = next_pin(&old_pin);
        let last = snapshot(&old_pin, &old)?;
        let added: BTreeMap<Vec<u8>, Vec<u8>> = last
            .iter()
            .filter(|(k, _)| !first.contains_key(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        write_entries(&next, &new, &added)?;
        if old.has_deletable_keys() {
            let data = MapData::from_pin(&next)
                .map_err(|e| Error::bpf(format!("opening {}", next.display()), e))?;
            let fd = data.fd().as_fd().as_raw_fd();
            let mut value = vec![0u8; new.value_len()?];
            // Taken after the first copy (by an old program, or by a new one through the
            // fallback), or, for a fallback map, while this copy ran (the new programs take
            // from it, and look in the new map first, so nothing taken after this walk was
            // missed): unless a new program wrote the key since (another value), it goes.
            let now = if fallback && name == map_names::ORIG_DST_BY_CONN {
                snapshot(&old_pin, &old)?
            } else {
                last.clone()
            };
            let taken = first.iter().chain(&added).filter(|(k, _)| !now.contains_key(*k));
            for (key, was) in taken {
                if sys::map_lookup(fd, key, &mut value).unwrap_or(false) && &value == was {
                    let _ = sys::map_delete(fd, key);
                }
            }
        }
        fs::rename(&next, &old_pin)
            .map_err(|e| Error::io(format!("replacing {}", old_pin.display()), e))?;
        report.maps_copied.push((name, last.len()));
    }
    for name in &report.maps_replaced {
        let pin = dp.map_pin(name);
        fs::rename(next_pin(&pin), &pin)
            .map_err(|e| Error::io(format!("replacing {}", pin.display()), e))?;
    }
    if fallback {
        // No old program runs and the new map holds what the old one had: the readers are
        // linked again, loaded against the empty fallback, and the old map goes with the
        // programs that held it.
        let mut readers = dp.load_object_with(0, &[])?;
        for name in FALLBACK.readers {
            let pin = node.join(name);
            if !pin.exists() {
                // Not attached yet (pins of maps alone): attached after this, as on a new node.
                continue;
            }
            load_program(&mut readers, name)?;
            sys::update_pinned_link(&pin, program_fd(&readers, name)?)
                .map_err(|e| Error::io(format!("updating {}", pin.display()), e))?;
            report.links_updated += 1;
        }
        remove_pin(&fallback_pin)?;
    }
    report.elapsed = started.elapsed();
    info!(
        maps_copied = ?report.maps_copied,
        maps_replaced = ?report.maps_replaced,
        maps_created = ?report.maps_created,
        links_updated = report.links_updated,
        filters_replaced = report.filters_replaced,
        pods = report.pods,
        elapsed_ms = report.elapsed.as_millis() as u64,
        "datapath upgraded in place"
    );
    Ok(report)
}

/// Points each enrolled pod's hooks at the new programs: its sk_lookup link, its TCX counter
/// links, its netlink filters (inside its netns). A pod whose netns is gone is left to the
/// reconcile that follows.
fn switch_pods(
    dp: &Datapath,
    ebpf: &mut Ebpf,
    replaced: &[&str],
    report: &mut Report,
) -> Result<()> {
    let pods: Vec<(NetnsCookie, PodInfo)> = dp.pods()?.iter().flatten().collect();
    let inodes: BTreeSet<u64> = pods.iter().map(|(_, info)| info.netns_inode).collect();
    let namespaces = meshpath_podnet::netns::find_all_by_inode(&inodes);
    let tcx = crate::pods::tcx_supported();
    let mut guard = dp.guard_program()?;
    for (cookie, info) in pods {
        let dir = dp.pod_dir(cookie);
        let name = info.name().to_owned();
        let sk_lookup = dir.join(link_pins::SK_LOOKUP);
        if sk_lookup.exists() {
            let program = if info.flags & pod_flags::CAPTURE_INBOUND != 0 {
                programs::SK_LOOKUP
            } else {
                programs::SK_LOOKUP_PASS
            };
            report.links_updated += update_pod_link(&sk_lookup, program_fd(ebpf, program)?, &name)?;
        }
        // The node-side guard's TCX links (on ends that run a CNI's TCX programs).
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(link_pins::NODE_GUARD_PREFIX) {
                let fd = program_fd(ebpf, programs::TC_NODE_GUARD)?;
                report.links_updated += update_pod_link(&entry.path(), fd, &name)?;
            }
        }
        let counters = dir.join(link_pins::TC_INGRESS).exists();
        let mut pod_object = None;
        if counters && tcx {
            let object = pod_object.insert(dp.load_object_with(cookie, replaced)?);
            for (program, pin) in [
                (programs::TC_POD_INGRESS, link_pins::TC_INGRESS),
                (programs::TC_POD_EGRESS, link_pins::TC_EGRESS),
            ] {
                load_program(object, program)?;
                report.links_updated +=
                    update_pod_link(&dir.join(pin), program_fd(object, program)?, &name)?;
            }
        }
        let Some(netns) = namespaces.get(&info.netns_inode) else {
            debug!(pod = %name, cookie, "netns gone: left to reconcile");
            continue;
        };
        // The guard, on each interface that has it (every one the pod had when enrolled, and
        // each added since that the agent saw).
        report.filters_replaced += netns.run(|| -> Result<usize> {
            let mut replaced = 0;
            for (iface, index) in crate::pods::interfaces()? {
                replaced +=
                    replace_filters(&mut guard, TcAttachType::Egress, index, &iface, &name)?;
            }
            Ok(replaced)
        })??;
        let Ok(iface) = netns.run(|| nix::net::if_::if_indextoname(info.ifindex))? else {
            debug!(pod = %name, cookie, "interface gone: left to reconcile");
            continue;
        };
        let iface = iface.to_string_lossy().into_owned();
        // Below Linux 6.6 the counters are netlink filters too, with no pins to tell they are
        // there: the filters themselves say it.
        if !tcx {
            let object = match pod_object.as_mut() {
                Some(o) => o,
                None => pod_object.insert(dp.load_object_with(cookie, replaced)?),
            };
            for (program, hook) in [
                (programs::TC_POD_INGRESS, TcAttachType::Ingress),
                (programs::TC_POD_EGRESS, TcAttachType::Egress),
            ] {
                let prog: &mut SchedClassifier = object
                    .program_mut(program)
                    .and_then(|p| p.try_into().ok())
                    .ok_or_else(|| Error::bpf(program, io::Error::other("not a TC program")))?;
                report.filters_replaced += netns.run(|| {
                    if prog.fd().is_err() {
                        load(prog.load(), program)?;
                    }
                    replace_filters(prog, hook, info.ifindex, &iface, &name)
                })??;
            }
        }
        report.pods += 1;
    }
    // The node-side guard, on the node's end of each pod's link (in this thread's netns, the
    // node's, where the agent runs).
    let mut node_guard = dp.node_guard_program()?;
    let ends: Vec<(u32, HostEnd)> = dp.host_ends()?.iter().flatten().collect();
    for (index, end) in ends {
        let Ok(iface) = nix::net::if_::if_indextoname(index) else {
            debug!(cookie = end.netns, index, "the node's end of a pod's link is gone");
            continue;
        };
        let iface = iface.to_string_lossy().into_owned();
        let pod = format!("with netns cookie {}", end.netns);
        report.filters_replaced +=
            replace_filters(&mut node_guard, TcAttachType::Ingress, index, &iface, &pod)?;
    }
    Ok(())
}

/// Updates one of a pod's pinned links; 0 if its target (netns, interface) is gone, which the
/// kernel says with ENOLINK.
fn update_pod_link(pin: &Path, prog_fd: i32, pod: &str) -> Result<usize> {
    match sys::update_pinned_link(pin, prog_fd) {
        Ok(()) => Ok(1),
        Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => Ok(0),
        Err(e) => Err(Error::io(format!("pod {pod}: updating {}", pin.display()), e)),
    }
}

/// In the calling thread's netns (the pod's): puts `prog` on `hook` of `iface` as a netlink
/// filter, in front of the filters of its name already there (the kernel gives a filter with
/// no priority one before the first), then deletes those. Every packet meets one of them.
/// Returns how many were replaced; a hook with none gets none (the pod never had it).
fn replace_filters(
    prog: &mut SchedClassifier,
    hook: TcAttachType,
    ifindex: u32,
    iface: &str,
    pod: &str,
) -> Result<usize> {
    let clsact = match hook {
        TcAttachType::Ingress => ClsactHook::Ingress,
        _ => ClsactHook::Egress,
    };
    let name = prog_name(prog);
    let mut rt = rtnetlink::Socket::open()
        .map_err(|e| Error::io(format!("pod {pod}: opening rtnetlink"), e))?;
    let old: Vec<_> = rt
        .bpf_filters(ifindex, clsact)
        .map_err(|e| Error::io(format!("pod {pod}: listing the TC filters of {iface}"), e))?
        .into_iter()
        .filter(|f| f.name == name)
        .collect();
    if old.is_empty() {
        return Ok(0);
    }
    let what = || format!("pod {pod}: attaching {name} to {iface}");
    let id = prog
        .attach_with_options(
            iface,
            hook,
            aya::programs::tc::TcAttachOptions::Netlink(Default::default()),
        )
        .map_err(|e| Error::bpf(what(), e))?;
    // Not a bpf link: it stays after this process (aya's would detach it on drop).
    std::mem::forget(prog.take_link(id).map_err(|e| Error::bpf(what(), e))?);
    for f in &old {
        rt.delete_filter(ifindex, clsact, f)
            .map_err(|e| Error::io(format!("pod {pod}: deleting the old {name} on {iface}"), e))?;
    }
    Ok(old.len())
}

/// The name aya gives a program's netlink filters: its kernel name.
pub(crate) fn prog_name(prog: &SchedClassifier) -> String {
    prog.info().ok().and_then(|i| i.name_as_str().map(str::to_owned)).unwrap_or_default()
}

/// Loads `name` from `ebpf` (once).
fn load_program(ebpf: &mut Ebpf, name: &str) -> Result<()> {
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| Error::bpf(name, io::Error::other("program missing from the object")))?;
    macro_rules! load_once {
        ($p:expr) => {
            if $p.fd().is_err() {
                load($p.load(), name)?;
            }
        };
    }
    match prog {
        Program::CgroupSockAddr(p) => load_once!(p),
        Program::SockOps(p) => load_once!(p),
        Program::CgroupSockopt(p) => load_once!(p),
        Program::SkLookup(p) => load_once!(p),
        Program::SkMsg(p) => load_once!(p),
        Program::SchedClassifier(p) => load_once!(p),
        _ => return Err(Error::bpf(name, io::Error::other("unexpected program type"))),
    }
    Ok(())
}

/// A loaded program's descriptor (owned by `ebpf`).
fn program_fd(ebpf: &Ebpf, name: &str) -> Result<i32> {
    let prog = ebpf
        .program(name)
        .ok_or_else(|| Error::bpf(name, io::Error::other("program missing from the object")))?;
    let fd = prog.fd().map_err(|e| Error::bpf(format!("program {name}"), e))?;
    Ok(fd.as_fd().as_raw_fd())
}

fn pin_program(ebpf: &mut Ebpf, name: &str, pin: &Path) -> Result<()> {
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| Error::bpf(name, io::Error::other("program missing from the object")))?;
    prog.pin(pin).map_err(|e| Error::bpf(format!("pinning {}", pin.display()), e))
}

/// `NAME-next` beside a pin (`pins::NEXT_SUFFIX`): where a replacement waits.
pub(super) fn next_pin(pin: &Path) -> PathBuf {
    let mut name = pin.file_name().unwrap_or_default().to_owned();
    name.push(pins::NEXT_SUFFIX);
    pin.with_file_name(name)
}

fn remove_pin(pin: &Path) -> Result<()> {
    match fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("removing {}", pin.display()), e)),
    }
}

/// Every entry of the map pinned at `pin`, key and value as bytes. A walk of a map that
/// programs change meanwhile may see a key twice (the kernel starts over from the first key
/// when the one it is given has gone): bounded by twice the capacity, deduplicated by key.
fn snapshot(pin: &Path, layout: &Layout) -> Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let data =
        MapData::from_pin(pin).map_err(|e| Error::bpf(format!("opening {}", pin.display()), e))?;
    let fd = data.fd().as_fd().as_raw_fd();
    let what = || format!("reading {}", pin.display());
    let mut entries = BTreeMap::new();
    let mut key: Option<Vec<u8>> = None;
    let mut next = vec![0u8; layout.key_size as usize];
    let mut value = vec![0u8; layout.value_len()?];
    for _ in 0..u64::from(layout.max_entries) * 2 {
        if !sys::map_next_key(fd, key.as_deref(), &mut next).map_err(|e| Error::io(what(), e))? {
            break;
        }
        if sys::map_lookup(fd, &next, &mut value).map_err(|e| Error::io(what(), e))? {
            entries.insert(next.clone(), value.clone());
        }
        key = Some(next.clone());
    }
    Ok(entries)
}

/// Writes `entries` into the map pinned at `pin` (of layout `layout`): new keys only in a hash
/// (a program may have written one since), every index that fits in an array.
fn write_entries(pin: &Path, layout: &Layout, entries: &BTreeMap<Vec<u8>, Vec<u8>>) -> Result<()> {
    let data =
        MapData::from_pin(pin).map_err(|e| Error::bpf(format!("opening {}", pin.display()), e))?;
    let fd = data.fd().as_fd().as_raw_fd();
    let flags = if layout.has_deletable_keys() { BPF_NOEXIST } else { 0 };
    let mut dropped = 0usize;
    for (key, value) in entries {
        match sys::map_update(fd, key, value, flags) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            // Full (a smaller map), or an index past a shorter array.
            Err(e) if matches!(e.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)) => dropped += 1,
            Err(e) => return Err(Error::io(format!("writing {}", pin.display()), e)),
        }
    }
    if dropped > 0 {
        warn!(map = %pin.display(), dropped, "entries that did not fit in the new map");
    }
    Ok(())
}

/// The version recorded in the pins (`None`: none, as meshpath 0.1.0 left them).
pub(super) fn pinned_version(dp: &Datapath) -> Result<Option<u64>> {
    let pin = dp.map_pin(map_names::DATAPATH_VERSION);
    if !pin.exists() {
        return Ok(None);
    }
    let map: Array<MapData, u64> = Array::try_from(dp.map(map_names::DATAPATH_VERSION)?)
        .map_err(|e| Error::bpf("map DATAPATH_VERSION", e))?;
    let v = map.get(&0, 0).map_err(|e| Error::bpf("reading DATAPATH_VERSION", e))?;
    Ok((v != 0).then_some(v))
}

/// Records that every program under `dp` runs from this loader's object.
pub(super) fn record_version(dp: &Datapath) -> Result<()> {
    let mut map: Array<MapData, u64> = Array::try_from(dp.map(map_names::DATAPATH_VERSION)?)
        .map_err(|e| Error::bpf("map DATAPATH_VERSION", e))?;
    map.set(0, version(), 0).map_err(|e| Error::bpf("writing DATAPATH_VERSION", e))
}
