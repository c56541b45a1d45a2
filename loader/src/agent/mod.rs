//! The node agent daemon (`meshpath-loader agent`): the pod lifecycle from the CNI plugin to
//! the node proxy.
//!
//! - `cni_server` — the CNI plugin's requests: ADD enrols a meshed pod in the datapath and
//!   hands it to the proxy, answering only once the proxy acked; DEL undoes it; CHECK checks;
//! - `zds_server` — the proxy side of the node: ZDS, Istio's agent ↔ ztunnel protocol;
//! - `held_listeners` — the pods' listening sockets, kept open while no proxy runs (a proxy
//!   restart refuses nothing);
//! - `records` — one file per pod under the state directory, so a restarted agent knows its
//!   pods; the pods' netns are found again by inode;
//! - `directory` — which pods are meshed and as whom: the Kubernetes API (Pods of this node and
//!   Namespaces, watched), or a workloads file when there is no cluster;
//! - `membership` — a pod joins or leaves the mesh (record, datapath, proxy, annotation);
//! - `mesh_sync` — Kubernetes mode: running pods that become meshed, leave, or are deleted;
//! - `cni_install` — the plugin binary and its entry in the host's CNI configuration, repaired
//!   when another agent rewrites the file;
//! - `health` — `/healthz` and `/readyz`.
//!
//! Start-up reconciles before serving: pods whose netns is gone are removed from the datapath
//! and the records; the rest stay captured (their traffic never stops) and go to the proxy in
//! the next snapshot.

pub mod cni_install;
pub mod cni_server;
pub mod directory;
pub mod ebpf_log;
pub mod health;
pub mod held_connections;
pub mod held_listeners;
pub mod interfaces;
pub mod membership;
pub mod mesh_sync;
pub mod records;
pub mod zds_server;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use anyhow::Context as _;
use tracing::{info, warn};

use crate::{datapath::Datapath, netns::Netns, pods};

/// How the agent is set up (the CLI's flags).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub pin_root: PathBuf,
    pub state_dir: PathBuf,
    pub cni_socket: PathBuf,
    pub zds_socket: PathBuf,
    /// Where the agent learns which pods are meshed.
    pub directory: directory::DirectoryConfig,
    /// Where to install the plugin binary and the chained entry (both or neither).
    pub cni_bin_dir: Option<PathBuf>,
    pub cni_conf_dir: Option<PathBuf>,
    /// The plugin binary to install (default: `meshpath-cni` next to this executable).
    pub cni_plugin: Option<PathBuf>,
    /// Cgroups registered as the proxy's (its sockets are never captured).
    pub proxy_cgroups: Vec<PathBuf>,
    /// Also register the cgroup of the process that connects to the ZDS socket.
    pub proxy_cgroup_from_zds_peer: bool,
    pub health_addr: Option<SocketAddr>,
    /// How long the proxy has to ack a request.
    pub ack_timeout: Duration,
    /// How long a pod's listeners are held open with no proxy serving it (zero: not held).
    pub hold_listeners: Duration,
    /// How long connections a draining proxy handed over are held for the next (zero: none).
    pub hold_connections: Duration,
    /// Make node processes probing pods (kubelet) leave from Istio's probe source addresses,
    /// this process's netns being the node's.
    pub probe_source: bool,
    /// The datapath's own log records, forwarded into this process's log.
    pub ebpf_log: ebpf_log::EbpfLog,
}

/// Enters the host's cgroup namespace when this process runs in another one (a container):
/// the cgroup paths the agent reads from /proc/PID/cgroup, and registers as the proxy's, must
/// be the host's, not relative to a container's view. Call before any thread is started (the
/// threads started afterwards inherit it).
pub fn enter_host_cgroup_ns() -> anyhow::Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    let (Ok(host), Ok(me)) =
        (std::fs::metadata("/proc/1/ns/cgroup"), std::fs::metadata("/proc/self/ns/cgroup"))
    else {
        return Ok(false);
    };
    if host.ino() == me.ino() {
        return Ok(false);
    }
    let f =
        std::fs::File::open("/proc/1/ns/cgroup").context("opening the host's cgroup namespace")?;
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWCGROUP)
        .context("entering the host's cgroup namespace (hostPID and CAP_SYS_ADMIN needed)")?;
    Ok(true)
}

/// A pod the agent serves now.
#[derive(Debug)]
pub struct LivePod {
    pub record: records::PodRecord,
    pub netns: Arc<Netns>,
    /// The watch that guards its interfaces added later; stops when the pod is dropped. None
    /// only for a pod found at start-up whose watch could not start (logged).
    pub interfaces: Option<interfaces::Watch>,
}

/// The agent's state.
#[derive(Debug)]
pub struct Agent {
    pub cfg: AgentConfig,
    /// One datapath change at a time (the datapath's own lock is per open, and the proxy opens
    /// it too to register its listeners).
    dp_lock: Mutex<()>,
    pub pods: Mutex<BTreeMap<String, LivePod>>,
    pub zds: zds_server::ZdsHub,
    pub directory: directory::Directory,
    ready: AtomicBool,
    /// Why the datapath could not be set up, while it cannot (the readiness endpoint says it).
    not_ready_reason: Mutex<Option<String>>,
    /// One CNI request at a time: a retried ADD, or a DEL racing an ADD, must see the first
    /// one's outcome, not its middle.
    cni_lock: tokio::sync::Mutex<()>,
}

impl Agent {
    /// Runs `f` with the datapath open.
    pub fn with_datapath<T>(
        &self,
        f: impl FnOnce(&Datapath) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let _one = self.dp_lock.lock().map_err(|_| anyhow::anyhow!("datapath lock poisoned"))?;
        let dp = Datapath::open_or_load(&self.cfg.pin_root).map_err(crate::doctor::explain)?;
        f(&dp)
    }

    /// Reconciled and serving, and (in Kubernetes mode) watching the API.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && self.directory.healthy()
    }

    /// Why the agent is not ready, when it knows: the datapath could not be set up (a kernel
    /// feature missing, a mount absent), or the API is not watched yet.
    pub fn not_ready_reason(&self) -> String {
        if let Some(r) = self.not_ready_reason.lock().ok().and_then(|r| r.clone()) {
            return r;
        }
        if !self.directory.healthy() {
            return "the Kubernetes API is not watched yet (or unreachable)".to_owned();
        }
        "starting".to_owned()
    }

    fn set_not_ready_reason(&self, reason: Option<String>) {
        if let Ok(mut r) = self.not_ready_reason.lock() {
            *r = reason;
        }
    }

    /// Loads (or opens) the datapath and brings it to the agent's configuration; reconciles
    /// the pods it holds.
    fn set_up_datapath(&self) -> anyhow::Result<()> {
        self.with_datapath(|dp| {
            for cg in &self.cfg.proxy_cgroups {
                dp.register_proxy_cgroup(cg)
                    .with_context(|| format!("proxy cgroup {}", cg.display()))?;
            }
            if self.cfg.probe_source {
                let me = Netns::open(std::path::Path::new("/proc/self/ns/net"))?;
                dp.set_probe_source(Some(&me)).context("setting the probe source")?;
            }
            ebpf_log::set_level(dp, self.cfg.ebpf_log).context("setting the eBPF log level")?;
            if self.cfg.ebpf_log != ebpf_log::EbpfLog::Off {
                ebpf_log::spawn(dp)?;
            }
            let report = pods::reconcile(dp)?;
            info!(
                kept = report.kept.len(),
                vanished = report.vanished.len(),
                partial = report.partial.len(),
                "datapath reconciled"
            );
            Ok(())
        })
    }
}

/// How often a datapath that could not be set up is tried again.
const DATAPATH_RETRY: Duration = Duration::from_secs(15);

/// Reconciles, then serves until SIGTERM.
pub async fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    let directory = directory::Directory::start(&cfg.directory).await?;
    let agent = Arc::new(Agent {
        zds: zds_server::ZdsHub::new(cfg.ack_timeout, cfg.hold_listeners, cfg.hold_connections),
        directory,
        cfg,
        dp_lock: Mutex::new(()),
        pods: Mutex::new(BTreeMap::new()),
        ready: AtomicBool::new(false),
        not_ready_reason: Mutex::new(None),
        cni_lock: tokio::sync::Mutex::new(()),
    });
    // Probes first: a node where the datapath cannot be set up keeps an agent that is alive
    // and says why it is not ready (`/readyz`, and an Event on the Node), instead of one that
    // crash-loops with the reason in a log.
    if let Some(addr) = agent.cfg.health_addr {
        let bound = health::serve(agent.clone(), addr).await?;
        println!("HEALTH {bound}");
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        match agent.set_up_datapath() {
            Ok(()) => break,
            Err(e) => {
                let reason = format!("{e:#}");
                warn!(error = %reason, retry_in = ?DATAPATH_RETRY, "the datapath cannot be set up on this node; not ready");
                agent.set_not_ready_reason(Some(reason.clone()));
                if let directory::Directory::Kube(k) = &agent.directory {
                    k.warn_node("DatapathUnavailable", &reason).await;
                }
                tokio::select! {
                    _ = tokio::time::sleep(DATAPATH_RETRY) => {}
                    _ = term.recv() => return Ok(()),
                }
            }
        }
    }
    agent.set_not_ready_reason(None);
    let restored = records::restore(&agent)?;
    info!(pods = restored, "pods restored from the state directory");
    if let (Some(bin), Some(conf)) = (&agent.cfg.cni_bin_dir, &agent.cfg.cni_conf_dir) {
        let plugin = match &agent.cfg.cni_plugin {
            Some(p) => p.clone(),
            None => std::env::current_exe()?.with_file_name("meshpath-cni"),
        };
        cni_install::spawn(plugin, bin.clone(), conf.clone(), agent.cfg.cni_socket.clone());
    }
    let zds_listener = meshpath_zds::Listener::bind(&agent.cfg.zds_socket)
        .with_context(|| format!("listening on {}", agent.cfg.zds_socket.display()))?;
    zds_server::spawn(agent.clone(), zds_listener);
    let cni_listener = cni_server::bind(&agent.cfg.cni_socket)?;
    cni_server::spawn(agent.clone(), cni_listener);
    if let directory::Directory::Kube(k) = &agent.directory {
        tokio::spawn(mesh_sync::run(agent.clone(), k.clone()));
    }
    agent.ready.store(true, Ordering::Relaxed);
    println!("READY");
    info!(cni = %agent.cfg.cni_socket.display(), zds = %agent.cfg.zds_socket.display(), "agent serving");
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r?,
    }
    // Pods stay enrolled: they keep failing closed until an agent is back (see docs).
    warn!("agent stopping; pods stay captured");
    Ok(())
}
