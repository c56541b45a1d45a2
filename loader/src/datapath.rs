//! The node's datapath as it lives in bpffs: the maps, pinned under a pin root and shared by every
//! pod, and per pod the links (pinned) that hold that pod's program instances. A later loader
//! process (a restart, another CLI call) opens the pins instead of creating anything again, so
//! nothing the kernel is doing is interrupted.

use std::{
    fs::{self, File},
    io,
    path::{Path, PathBuf},
};

use aya::{
    maps::{HashMap, Map, MapData, PerCpuHashMap},
    programs::{ProgramError, SchedClassifier},
    Ebpf, EbpfLoader,
};
use datapath_common::{
    consts::{globals, map_names, pins},
    NetnsCookie, PodCounters, PodInfo,
};
use nix::fcntl::{Flock, FlockArg};
use tracing::{debug, info};

use crate::{Error, Result};

/// The compiled eBPF object, built by build.rs with aya-build.
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/meshpath-datapath"));

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
    /// loader on the node. Mounts bpffs on its parent when missing.
    pub fn open_or_load(root: &Path) -> Result<Self> {
        ensure_bpffs(root)?;
        for dir in [pins::MAPS_DIR, pins::PODS_DIR] {
            fs::create_dir_all(root.join(dir))
                .map_err(|e| Error::io(format!("creating {}", root.join(dir).display()), e))?;
        }
        let dir =
            File::open(root).map_err(|e| Error::io(format!("opening {}", root.display()), e))?;
        let lock = Flock::lock(dir, FlockArg::LockExclusive)
            .map_err(|(_, e)| Error::io(format!("locking {}", root.display()), e.into()))?;
        let dp = Self {
            root: root.to_owned(),
            _lock: lock,
        };
        if !dp.maps_pinned() {
            // Parsing the object creates and pins every map it declares `pinned`.
            dp.load_object(0)?;
            info!(root = %dp.root.display(), "datapath maps created and pinned");
        }
        Ok(dp)
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

    fn maps_pinned(&self) -> bool {
        [map_names::POD_COUNTERS, map_names::PODS]
            .iter()
            .all(|m| self.map_pin(m).exists())
    }

    /// Parses the embedded object for one pod: maps declared `pinned` are reused from the pin
    /// root (created and pinned there if absent); load-time constants are set for `pod_cookie`.
    fn load_object(&self, pod_cookie: NetnsCookie) -> Result<Ebpf> {
        EbpfLoader::new()
            .default_map_pin_directory(self.root.join(pins::MAPS_DIR))
            .override_global(globals::POD_COOKIE, &pod_cookie, true)
            .load(EBPF_OBJECT)
            .map_err(|e| Error::bpf("loading the embedded eBPF object", e))
    }

    /// Loads the named TC programs into the kernel for the pod with `pod_cookie`. The returned
    /// object owns them; attach them and take their links before dropping it.
    pub fn load_pod_programs(&self, pod_cookie: NetnsCookie, names: &[&str]) -> Result<Ebpf> {
        let mut ebpf = self.load_object(pod_cookie)?;
        for &name in names {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| {
                    Error::bpf(name, io::Error::other("program missing from the object"))
                })?
                .try_into()
                .map_err(|e| Error::bpf(format!("program {name}"), e))?;
            prog.load().map_err(|e| verifier_error(name, e))?;
        }
        Ok(ebpf)
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
}

/// Turns a load failure into one sentence plus a file with the verifier's log.
fn verifier_error(program: &str, e: ProgramError) -> Error {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = PathBuf::from(VERIFIER_LOG_DIR).join(format!("verifier-{program}.log"));
            let written = fs::create_dir_all(VERIFIER_LOG_DIR)
                .and_then(|()| fs::write(&log, verifier_log.to_string()));
            if let Err(w) = written {
                debug!(error = %w, "could not write the verifier log");
            }
            Error::Verifier {
                program: program.to_owned(),
                cause: io_error,
                log,
            }
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
