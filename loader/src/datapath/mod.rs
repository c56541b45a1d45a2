//! The node's datapath as it lives in bpffs: the maps, pinned under a pin root and shared by every
//! pod, and per pod the links (pinned) that hold that pod's program instances. A later loader
//! process (a restart, another CLI call) opens the pins instead of creating anything again, so
//! nothing the kernel is doing is interrupted.

use std::{
    fs::{self, File},
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuHashMap, SockHash},
    programs::{
        links::{CgroupAttachMode, FdLink},
        Program, ProgramError, SkLookup, SkMsg,
    },
    Ebpf, EbpfLoader,
};
use datapath_common::{
    consts::{globals, map_names, pins, probe, programs},
    decisions::DecisionKey,
    node_flags, CidrKey, HostEnd, ListenerKey, NetnsCookie, PodAddrs, PodCounters, PodInfo,
    PodIpKey, PortKey,
};
use nix::fcntl::{Flock, FlockArg};
use tracing::{debug, info};

use crate::{netns::Netns, Error, Result};

pub mod upgrade;

/// The compiled eBPF object, built by build.rs with aya-build.
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/meshpath-datapath"));

/// Maps pinned by path rather than by their definition: aya-log's ring buffer, and the BTF maps
/// (socket storage), which aya-ebpf cannot mark pinned.
const PINNED_BY_PATH: [&str; 4] = [
    map_names::AYA_LOGS,
    map_names::ORIG_DST_BY_SOCKET,
    map_names::ORIG_DST_BY_ACCEPTED,
    map_names::PROXY_BOUND,
];

/// The programs loaded and pinned once per node under `programs/`, which pods link to.
const SHARED_PROGRAMS: [&str; 5] = [
    programs::SK_LOOKUP,
    programs::SK_LOOKUP_PASS,
    programs::SK_MSG,
    programs::TC_POD_GUARD,
    programs::TC_NODE_GUARD,
];

/// Where verifier logs are written when the kernel rejects a program.
const VERIFIER_LOG_DIR: &str = "/run/meshpath";

/// The pinned datapath under one pin root. Holding it holds an exclusive lock on the root, so
/// two loaders never change the same node at once.
#[derive(Debug)]
pub struct Datapath {
    root: PathBuf,
    _lock: Flock<File>,
}

impl Datapath {
    /// Opens the datapath pinned under `root`, loading and pinning it first if this is the first
    /// loader on the node, or upgrading it in place if an older (or newer) meshpath's programs
    /// run there (`upgrade.rs`). Mounts bpffs on its parent when missing.
    pub fn open_or_load(root: &Path) -> Result<Self> {
        ensure_bpffs(root)?;
        for dir in [pins::MAPS_DIR, pins::PODS_DIR, pins::NODE_LINKS_DIR, pins::PROGRAMS_DIR] {
            // The agent opens the datapath for every pod added or removed: one stat when the
            // directory is there (create_dir_all would try to create it, then stat it).
            let dir = root.join(dir);
            if !dir.is_dir() {
                fs::create_dir_all(&dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            }
        }
        let dp = Self::locked(root)?;
        // Fresh: no map pinned at all. Some but not the ones every version has: what an older
        // meshpath or a stopped load left, which the upgrade takes over or refuses as it would
        // a whole datapath (loading over it, aya would reuse each pin whatever its layout).
        let fresh = !dp.maps_pinned() && !dp.any_map_pinned();
        if fresh {
            // Parsing the object creates and pins every map it declares `pinned`.
            dp.load_object(0)?;
            info!(root = %dp.root.display(), "datapath maps created and pinned");
        }
        let current = fresh
            || (dp.maps_pinned() && upgrade::pinned_version(&dp)? == Some(upgrade::version()));
        if !current {
            upgrade::run(&dp)?;
        }
        dp.attach_node_programs()?;
        dp.pin_shared_programs()?;
        if !current || fresh {
            upgrade::record_version(&dp)?;
        }
        Ok(dp)
    }

    /// Opens a datapath some agent already loaded under `root`, without loading or attaching
    /// anything (what the proxy needs to register its listeners): an error if nothing is pinned.
    pub fn open_existing(root: &Path) -> Result<Self> {
        let dp = Self::locked(root)?;
        if !dp.maps_pinned() {
            return Err(Error::io(
                format!("the datapath at {}", root.display()),
                io::Error::new(io::ErrorKind::NotFound, "not loaded: no node agent has pinned it"),
            ));
        }
        Ok(dp)
    }

    /// The root, its exclusive lock held.
    fn locked(root: &Path) -> Result<Self> {
        let dir =
            File::open(root).map_err(|e| Error::io(format!("opening {}", root.display()), e))?;
        let lock = Flock::lock(dir, FlockArg::LockExclusive)
            .map_err(|(_, e)| Error::io(format!("locking {}", root.display()), e.into()))?;
        Ok(Self { root: root.to_owned(), _lock: lock })
    }

    /// The pin root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory holding one pod's links.
    pub fn pod_dir(&self, cookie: NetnsCookie) -> PathBuf {
        self.root.join(pins::PODS_DIR).join(cookie.to_string())
    }

    fn map_pin(&self, name: &str) -> PathBuf {
        self.root.join(pins::MAPS_DIR).join(name)
    }

    fn any_map_pinned(&self) -> bool {
        fs::read_dir(self.root.join(pins::MAPS_DIR))
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
    }

    fn maps_pinned(&self) -> bool {
        [map_names::POD_COUNTERS, map_names::PODS].iter().all(|m| self.map_pin(m).exists())
    }

    /// Parses the embedded object for one pod: maps declared `pinned` are reused from the pin
    /// root (created and pinned there if absent); load-time constants are set for `pod_cookie`.
    fn load_object(&self, pod_cookie: NetnsCookie) -> Result<Ebpf> {
        self.load_object_with(pod_cookie, &[])
    }

    /// As `load_object`, with the maps named in `next` taken from (or created at) their
    /// `NAME-next` pins: an upgrade's replacements.
    fn load_object_with(&self, pod_cookie: NetnsCookie, next: &[&str]) -> Result<Ebpf> {
        let mut loader = EbpfLoader::new();
        // No CO-RE relocations in our programs: skip parsing the kernel's BTF (megabytes of
        // it), which was most of an enrolment's cost.
        loader.btf(None).default_map_pin_directory(self.root.join(pins::MAPS_DIR));
        // BTF maps and aya-log's: pinned here, not by their definition
        // (datapath-ebpf/src/maps.rs).
        let paths: Vec<(&str, PathBuf)> = PINNED_BY_PATH
            .iter()
            .chain(next)
            .map(|&name| {
                let pin = self.map_pin(name);
                let pin = if next.contains(&name) { upgrade::next_pin(&pin) } else { pin };
                (name, pin)
            })
            .collect();
        for (name, pin) in &paths {
            loader.map_pin_path(name, pin.as_path());
        }
        loader
            .override_global(globals::POD_COOKIE, &pod_cookie, true)
            .load(EBPF_OBJECT)
            .map_err(|e| Error::bpf("loading the embedded eBPF object", e))
    }

    /// Parses the object for the pod with `pod_cookie` (its per-pod programs read it). The
    /// caller loads and attaches the programs it needs, and takes their links.
    pub fn load_pod_object(&self, pod_cookie: NetnsCookie) -> Result<Ebpf> {
        self.load_object(pod_cookie)
    }

    /// The proxy's inbound listeners, as sock_ops filed them.
    pub fn inbound_listeners(&self) -> Result<SockHash<MapData, ListenerKey>> {
        SockHash::try_from(self.map(map_names::INBOUND_LISTENERS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::INBOUND_LISTENERS), e))
    }

    /// Attaches the node-wide capture programs at the cgroup v2 root, once: their pinned links
    /// under `node/` keep them attached across loader restarts.
    fn attach_node_programs(&self) -> Result<()> {
        let dir = self.root.join(pins::NODE_LINKS_DIR);
        if programs::CGROUP.iter().all(|p| dir.join(p).exists()) {
            return Ok(());
        }
        let cgroup_root = cgroup2_root()?;
        let cgroup = File::open(&cgroup_root)
            .map_err(|e| Error::io(format!("opening cgroup {}", cgroup_root.display()), e))?;
        let mut ebpf = self.load_object(0)?;
        // Dependencies first: connect4/6 (which start capturing) come last in CGROUP.
        for name in programs::CGROUP {
            let pin = dir.join(name);
            if pin.exists() {
                continue;
            }
            let what = || format!("attaching {name} to cgroup {}", cgroup_root.display());
            let prog = ebpf.program_mut(name).ok_or_else(|| {
                Error::bpf(name, io::Error::other("program missing from the object"))
            })?;
            // aya's program types share no attach trait: the same steps for each.
            macro_rules! attach_at_cgroup {
                ($p:expr) => {{
                    load($p.load(), name)?;
                    let id = $p
                        .attach(&cgroup, CgroupAttachMode::Single)
                        .map_err(|e| Error::bpf(what(), e))?;
                    $p.take_link(id)
                        .map_err(|e| Error::bpf(what(), e))?
                        .try_into()
                        .map_err(|e| Error::bpf(what(), e))?
                }};
            }
            let link: FdLink = match prog {
                Program::CgroupSockAddr(p) => attach_at_cgroup!(p),
                Program::SockOps(p) => attach_at_cgroup!(p),
                Program::CgroupSockopt(p) => {
                    load(p.load(), name)?;
                    crate::sys::link_cgroup_getsockopt(p, &cgroup, &pin)
                        .map_err(|e| Error::io(what(), e))?;
                    continue;
                }
                _ => return Err(Error::bpf(name, io::Error::other("unexpected program type"))),
            };
            link.pin(&pin).map_err(|e| Error::bpf(format!("pinning {}", pin.display()), e))?;
        }
        info!(cgroup = %cgroup_root.display(), "capture programs attached");
        Ok(())
    }

    /// Loads and pins, once, the programs every pod links to (sk_lookup, the TC guard):
    /// enrolment then only attaches them, with no object parsing or verification per pod.
    fn pin_shared_programs(&self) -> Result<()> {
        let names = SHARED_PROGRAMS;
        let dir = self.root.join(pins::PROGRAMS_DIR);
        if names.iter().all(|n| dir.join(n).exists()) {
            return Ok(());
        }
        let mut ebpf = self.load_object(0)?;
        for name in names {
            let pin = dir.join(name);
            if pin.exists() {
                continue;
            }
            let prog = ebpf.program_mut(name).ok_or_else(|| {
                Error::bpf(name, io::Error::other("program missing from the object"))
            })?;
            let pinned = match prog {
                Program::SkLookup(p) => load(p.load(), name).map(|()| p.pin(&pin)),
                Program::SkMsg(p) => load(p.load(), name).map(|()| p.pin(&pin)),
                Program::SchedClassifier(p) => load(p.load(), name).map(|()| p.pin(&pin)),
                _ => return Err(Error::bpf(name, io::Error::other("unexpected program type"))),
            }?;
            pinned.map_err(|e| Error::bpf(format!("pinning {}", pin.display()), e))?;
        }
        Ok(())
    }

    /// Turns the app↔proxy shortcut (sockops + sk_msg on `LOCAL_SOCKS`) on or off for the node.
    /// On: the sk_msg program is attached to the map first, then the flag lets sock_ops add
    /// connections; off: the reverse. Connections already paired keep the shortcut until they
    /// close.
    pub fn set_acceleration(&self, on: bool) -> Result<()> {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        let mut config: Array<MapData, u32> = Array::try_from(self.map(map_names::NODE_CONFIG)?)
            .map_err(|e| Error::bpf("map NODE_CONFIG", e))?;
        let flags = config.get(&0, 0).map_err(|e| Error::bpf("reading NODE_CONFIG", e))?;
        let socks = MapData::from_pin(self.map_pin(map_names::LOCAL_SOCKS))
            .map_err(|e| Error::bpf("opening LOCAL_SOCKS", e))?;
        let prog = SkMsg::from_pin(self.root.join(pins::PROGRAMS_DIR).join(programs::SK_MSG))
            .map_err(|e| Error::bpf("opening the sk_msg program", e))?;
        let prog_fd =
            prog.fd().map_err(|e| Error::bpf("sk_msg program fd", e))?.as_fd().as_raw_fd();
        let map_fd = socks.fd().as_fd().as_raw_fd();
        let was_on = flags & node_flags::ACCELERATE != 0;
        if on && !was_on {
            crate::sys::sk_msg_on_map(prog_fd, map_fd, true)
                .map_err(|e| Error::io("attaching sk_msg to LOCAL_SOCKS", e))?;
            config
                .set(0, flags | node_flags::ACCELERATE, 0)
                .map_err(|e| Error::bpf("writing NODE_CONFIG", e))?;
        } else if !on && was_on {
            config
                .set(0, flags & !node_flags::ACCELERATE, 0)
                .map_err(|e| Error::bpf("writing NODE_CONFIG", e))?;
            crate::sys::sk_msg_on_map(prog_fd, map_fd, false)
                .map_err(|e| Error::io("detaching sk_msg from LOCAL_SOCKS", e))?;
        }
        info!(on, "app-proxy shortcut");
        Ok(())
    }

    /// Both ends of the connections the shortcut currently pairs.
    pub fn local_socks(&self) -> Result<SockHash<MapData, datapath_common::SockKey>> {
        SockHash::try_from(self.map(map_names::LOCAL_SOCKS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::LOCAL_SOCKS), e))
    }

    /// Makes connections from processes of `node`'s netns (kubelet) to enrolled pods whose
    /// probes bypass capture leave from Istio's probe source addresses, which this adds to `lo`
    /// there (replacing istio-cni's host SNAT rule); `None` turns it off (the addresses stay).
    pub fn set_probe_source(&self, node: Option<&Netns>) -> Result<()> {
        let mut map: Array<MapData, u64> = Array::try_from(self.map(map_names::NODE_NETNS)?)
            .map_err(|e| Error::bpf("map NODE_NETNS", e))?;
        let Some(node) = node else {
            return map.set(0, 0, 0).map_err(|e| Error::bpf("writing NODE_NETNS", e));
        };
        let v4 = std::net::Ipv4Addr::from(probe::SOURCE_V4);
        let v6 = std::net::Ipv6Addr::from(probe::SOURCE_V6);
        // Over rtnetlink from a thread inside the node's netns: `replace` is idempotent.
        node.run(|| -> Result<()> {
            let mut rt = meshpath_podnet::rtnetlink::Socket::open()
                .map_err(|e| Error::io("opening rtnetlink in the node's netns", e))?;
            for (addr, prefix) in [(IpAddr::V4(v4), 32), (IpAddr::V6(v6), 128)] {
                rt.replace_address(addr, prefix, "lo")
                    .map_err(|e| Error::io(format!("adding {addr}/{prefix} to lo"), e))?;
            }
            Ok(())
        })??;
        map.set(0, node.cookie(), 0).map_err(|e| Error::bpf("writing NODE_NETNS", e))?;
        info!(node = %node.path().display(), "kubelet probes leave from the probe source addresses");
        Ok(())
    }

    /// Whether the app↔proxy shortcut is on.
    pub fn acceleration(&self) -> Result<bool> {
        let config: Array<MapData, u32> = Array::try_from(self.map(map_names::NODE_CONFIG)?)
            .map_err(|e| Error::bpf("map NODE_CONFIG", e))?;
        let flags = config.get(&0, 0).map_err(|e| Error::bpf("reading NODE_CONFIG", e))?;
        Ok(flags & node_flags::ACCELERATE != 0)
    }

    /// The TC guard every enrolled pod's interface gets (`raw_tcp_guard.rs`), from its pin.
    pub fn guard_program(&self) -> Result<aya::programs::SchedClassifier> {
        aya::programs::SchedClassifier::from_pin(
            self.root.join(pins::PROGRAMS_DIR).join(programs::TC_POD_GUARD),
        )
        .map_err(|e| Error::bpf("opening the TC guard", e))
    }

    /// The TC guard on the node's end of every enrolled pod's link (`raw_tcp_guard.rs`,
    /// `tc_node_guard`), from its pin.
    pub fn node_guard_program(&self) -> Result<aya::programs::SchedClassifier> {
        aya::programs::SchedClassifier::from_pin(
            self.root.join(pins::PROGRAMS_DIR).join(programs::TC_NODE_GUARD),
        )
        .map_err(|e| Error::bpf("opening the node-side TC guard", e))
    }

    /// The node's ends of enrolled pods' links, by interface index in the node's netns.
    pub fn host_ends(&self) -> Result<HashMap<MapData, u32, HostEnd>> {
        self.hash_map(map_names::HOST_ENDS)
    }

    /// A shared program, opened from its pin.
    pub fn sk_lookup_program(&self, name: &str) -> Result<SkLookup> {
        SkLookup::from_pin(self.root.join(pins::PROGRAMS_DIR).join(name))
            .map_err(|e| Error::bpf(format!("opening pinned program {name}"), e))
    }

    /// Longest-prefix exclusions.
    pub fn excluded_cidrs(&self) -> Result<LpmTrie<MapData, CidrKey, u32>> {
        LpmTrie::try_from(self.map(map_names::EXCLUDED_CIDRS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::EXCLUDED_CIDRS), e))
    }

    /// The pods' addresses.
    pub fn pod_ips(&self) -> Result<HashMap<MapData, PodIpKey, NetnsCookie>> {
        self.hash_map(map_names::POD_IPS)
    }

    /// The pods' own addresses, one per family.
    pub fn pod_addrs(&self) -> Result<HashMap<MapData, NetnsCookie, PodAddrs>> {
        self.hash_map(map_names::POD_ADDRS)
    }

    /// The transparent connections inside pods to the pods themselves (see `TransparentKey`)
    /// whose app end is not accepted yet, as sock_ops filed them.
    pub fn proxy_transparent(
        &self,
    ) -> Result<HashMap<MapData, datapath_common::TransparentKey, u8>> {
        self.hash_map(map_names::PROXY_TRANSPARENT)
    }

    /// Each enrolled pod's count of entries in `ORIG_DST_BY_CONN` (its share:
    /// `MAX_PENDING_CONNECTIONS_PER_POD`).
    pub fn pending_connections(&self) -> Result<HashMap<MapData, NetnsCookie, u64>> {
        self.hash_map(map_names::PENDING_CONNECTIONS)
    }

    /// Each enrolled pod's count of entries in `PROXY_TRANSPARENT` (its share:
    /// `MAX_PENDING_CONNECTIONS_PER_POD`).
    pub fn pending_transparent(&self) -> Result<HashMap<MapData, NetnsCookie, u64>> {
        self.hash_map(map_names::PENDING_TRANSPARENT)
    }

    /// Original destinations filed by connection (`ConnKey`) that the proxy's end of the
    /// connection has not taken yet.
    pub fn orig_dst_by_conn(
        &self,
    ) -> Result<HashMap<MapData, datapath_common::ConnKey, datapath_common::OrigDst>> {
        self.hash_map(map_names::ORIG_DST_BY_CONN)
    }

    fn hash_map<K: aya::Pod, V: aya::Pod>(&self, name: &str) -> Result<HashMap<MapData, K, V>> {
        HashMap::try_from(self.map(name)?).map_err(|e| Error::bpf(format!("map {name}"), e))
    }

    /// Registers a cgroup whose sockets are never captured: the proxy's.
    pub fn register_proxy_cgroup(&self, cgroup: &Path) -> Result<u64> {
        let id = cgroup_id(cgroup)?;
        self.hash_map::<u64, u32>(map_names::PROXY_CGROUPS)?
            .insert(id, 1, 0)
            .map_err(|e| Error::bpf("registering the proxy cgroup", e))?;
        info!(cgroup = %cgroup.display(), id, "proxy cgroup registered");
        Ok(id)
    }

    /// The cgroup ids registered as the proxy's.
    pub fn proxy_cgroup_ids(&self) -> Result<Vec<u64>> {
        Ok(self.hash_map::<u64, u32>(map_names::PROXY_CGROUPS)?.keys().flatten().collect())
    }

    /// Forgets a proxy cgroup.
    pub fn unregister_proxy_cgroup(&self, cgroup: &Path) -> Result<()> {
        self.unregister_proxy_cgroup_id(cgroup_id(cgroup)?)
    }

    /// Forgets a proxy cgroup by id (its directory may be gone: a proxy that exited).
    pub fn unregister_proxy_cgroup_id(&self, id: u64) -> Result<()> {
        match self.hash_map::<u64, u32>(map_names::PROXY_CGROUPS)?.remove(&id) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(Error::bpf("unregistering the proxy cgroup", e)),
        }
    }

    /// Ports pods exclude from capture.
    pub fn excluded_ports(&self) -> Result<HashMap<MapData, PortKey, u32>> {
        self.hash_map(map_names::EXCLUDED_PORTS)
    }

    fn map(&self, name: &str) -> Result<Map> {
        let data = MapData::from_pin(self.map_pin(name))
            .map_err(|e| Error::bpf(format!("opening pinned map {name}"), e))?;
        Map::from_map_data(data).map_err(|e| Error::bpf(format!("map {name}"), e))
    }

    /// The enrolled pods.
    pub fn pods(&self) -> Result<HashMap<MapData, NetnsCookie, PodInfo>> {
        HashMap::try_from(self.map(map_names::PODS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::PODS), e))
    }

    /// The per-pod, per-CPU counters.
    pub fn counters(&self) -> Result<PerCpuHashMap<MapData, NetnsCookie, PodCounters>> {
        PerCpuHashMap::try_from(self.map(map_names::POD_COUNTERS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::POD_COUNTERS), e))
    }

    /// Decision counts per pod and reason, per CPU.
    pub fn decisions(&self) -> Result<PerCpuHashMap<MapData, DecisionKey, u64>> {
        PerCpuHashMap::try_from(self.map(map_names::DECISIONS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::DECISIONS), e))
    }

    /// The monitor's ring buffer.
    pub fn monitor_events(&self) -> Result<aya::maps::RingBuf<MapData>> {
        aya::maps::RingBuf::try_from(self.map(map_names::MONITOR_EVENTS)?)
            .map_err(|e| Error::bpf(format!("map {}", map_names::MONITOR_EVENTS), e))
    }

    /// The node-wide switches (`NODE_CONFIG[0]`, bits of `node_flags`).
    pub fn node_flags(&self) -> Result<u32> {
        let config: Array<MapData, u32> = Array::try_from(self.map(map_names::NODE_CONFIG)?)
            .map_err(|e| Error::bpf("map NODE_CONFIG", e))?;
        config.get(&0, 0).map_err(|e| Error::bpf("reading NODE_CONFIG", e))
    }

    /// Sets the bits `set` and clears the bits `clear` of the node-wide switches (others
    /// unchanged; the agent and the CLI are the only writers and hold the datapath lock).
    pub fn update_node_flags(&self, set: u32, clear: u32) -> Result<()> {
        let mut config: Array<MapData, u32> = Array::try_from(self.map(map_names::NODE_CONFIG)?)
            .map_err(|e| Error::bpf("map NODE_CONFIG", e))?;
        let flags = config.get(&0, 0).map_err(|e| Error::bpf("reading NODE_CONFIG", e))?;
        config.set(0, (flags | set) & !clear, 0).map_err(|e| Error::bpf("writing NODE_CONFIG", e))
    }
}

/// The SOCKHASH keys a pod's inbound listeners may be filed under (each of
/// `INBOUND_LISTENER_PORTS`, one per family).
pub fn inbound_listener_keys(cookie: NetnsCookie) -> [ListenerKey; 4] {
    use datapath_common::{consts::ports::INBOUND_LISTENER_PORTS, AF_INET, AF_INET6};
    let [plaintext, hbone] = INBOUND_LISTENER_PORTS;
    let key = |port, family| ListenerKey { netns: cookie, port, family, _pad: 0 };
    [key(plaintext, AF_INET), key(plaintext, AF_INET6), key(hbone, AF_INET), key(hbone, AF_INET6)]
}

/// A program load result, with a rejection turned into [`Error::Verifier`].
pub(crate) fn load(res: Result<(), ProgramError>, name: &str) -> Result<()> {
    res.map_err(|e| verifier_error(name, e))
}

/// The cgroup v2 mount point (`MESHPATH_CGROUP_ROOT` overrides): where node-wide programs
/// attach. /sys/fs/cgroup on most nodes, /sys/fs/cgroup/unified on hybrid hosts.
pub fn cgroup2_root() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("MESHPATH_CGROUP_ROOT") {
        return cgroup2_at(Path::new(&p));
    }
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io("reading /proc/self/mountinfo", e))?;
    // (mount point, root of the mount within the hierarchy)
    let (point, root) = mountinfo
        .lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let f: Vec<&str> = pre.split_whitespace().collect();
            (post.split_whitespace().next() == Some("cgroup2"))
                .then(|| Some((PathBuf::from(f.get(4)?), f.get(3)?.to_string())))
                .flatten()
        })
        .ok_or_else(|| {
            Error::io("finding the cgroup v2 mount", io::Error::other("cgroup2 is not mounted"))
        })?;
    // Programs attached below the real root would capture only that subtree's sockets while
    // the pods' records said they were captured.
    if root != "/" {
        return Err(Error::io(
            format!("the cgroup v2 mount at {}", point.display()),
            io::Error::other(format!(
                "shows only the subtree {root} (a cgroup namespace?); mount the host's cgroup2 root \
                 or set MESHPATH_CGROUP_ROOT to it"
            )),
        ));
    }
    Ok(point)
}

fn is_cgroup2(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

/// The cgroup v2 hierarchy an operator pointed at (a DaemonSet mounts the host's /sys/fs/cgroup
/// whatever its layout): that directory if it is cgroup2, or on a hybrid host (cgroup v1
/// controllers, v2 beside them) its `unified` subdirectory.
fn cgroup2_at(dir: &Path) -> Result<PathBuf> {
    if is_cgroup2(dir) {
        return Ok(dir.to_path_buf());
    }
    let unified = dir.join("unified");
    if is_cgroup2(&unified) {
        return Ok(unified);
    }
    Err(Error::io(
        format!("MESHPATH_CGROUP_ROOT={}", dir.display()),
        io::Error::other("neither it nor its unified/ subdirectory is a cgroup v2 mount"),
    ))
}

/// A cgroup v2 directory's id, as `bpf_get_current_cgroup_id` reports it: its inode number.
pub fn cgroup_id(cgroup: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = fs::metadata(cgroup)
        .map_err(|e| Error::io(format!("reading cgroup {}", cgroup.display()), e))?;
    Ok(meta.ino())
}

/// Turns a load failure into one sentence plus a file with the verifier's log.
fn verifier_error(program: &str, e: ProgramError) -> Error {
    match e {
        ProgramError::LoadError { io_error, verifier_log } => {
            let log = PathBuf::from(VERIFIER_LOG_DIR).join(format!("verifier-{program}.log"));
            let text = verifier_log.to_string();
            let written =
                fs::create_dir_all(VERIFIER_LOG_DIR).and_then(|()| fs::write(&log, &text));
            if let Err(w) = written {
                debug!(error = %w, "could not write the verifier log");
            }
            let kernel = aya::util::KernelVersion::current()
                .map_or_else(|_| "unknown".to_owned(), |k| k.to_string());
            Error::Verifier { program: program.to_owned(), kernel, cause: io_error, log, text }
        }
        other => Error::bpf(format!("loading program {program}"), other),
    }
}

/// Mounts bpffs at the pin root's mount point (its parent's bpffs, normally /sys/fs/bpf) if
/// nothing of type bpf is mounted there yet.
fn ensure_bpffs(root: &Path) -> Result<()> {
    let mut probe = root.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    let fs_type = nix::sys::statfs::statfs(&probe).map(|s| s.filesystem_type());
    if fs_type == Ok(nix::sys::statfs::BPF_FS_MAGIC) {
        return Ok(());
    }
    let mount_point = Path::new("/sys/fs/bpf");
    if !root.starts_with(mount_point) {
        return Err(Error::Bpffs(
            root.to_owned(),
            io::Error::other("the pin root is not on bpffs; use a path under /sys/fs/bpf"),
        ));
    }
    nix::mount::mount(
        Some("bpf"),
        mount_point,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| Error::Bpffs(mount_point.to_owned(), e.into()))?;
    info!("mounted bpffs at /sys/fs/bpf");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use datapath_common::consts::programs;

    use super::EBPF_OBJECT;

    #[test]
    fn every_program_in_the_ebpf_object_is_named_once_in_datapath_common_and_every_name_is_in_it() {
        let object = aya_obj::Object::parse(EBPF_OBJECT).expect("the built eBPF object parses");
        let in_object: BTreeSet<&str> = object.programs.keys().map(String::as_str).collect();
        let named: BTreeSet<&str> = programs::ALL.into_iter().collect();
        assert_eq!(named.len(), programs::ALL.len(), "a name listed twice in programs::ALL");
        assert_eq!(in_object, named);
        assert!(programs::CGROUP.iter().all(|p| named.contains(p)));
    }
}
