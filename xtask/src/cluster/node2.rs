//! The cluster's second node (`cargo xtask cluster up --nodes 2`), made the way kind makes a
//! node: a container of its own on this machine, with its own runtime and kubelet joining the
//! one control plane.
//!
//! What is its own, as on a machine of its own:
//! - the network namespace `meshpath-node2`: its address a /32 on `lo`, its pods on its own
//!   `cni0` bridge and subnet, a veth to the first node with routes to the other node's address
//!   and pod subnet (the cluster's pod network: every pod reaches every pod by its address, no
//!   NAT, no overlay), forwarding on;
//! - a mount namespace (kept by a holder process, `sleep`, whose pid is in the cluster's state):
//!   its own /run and /var/log (tmpfs, as a booted machine has), its own bpffs on /sys/fs/bpf
//!   (meshpath's pins, the agent's and the proxy's sockets below /var/run are the node's own),
//!   its own /opt/cni/bin and /etc/cni/net.d (the node's CNI chain, which meshpath's installer
//!   edits), every mount shared within it (the DaemonSets' mount propagation needs it);
//! - kubelet's pods' cgroups below `/meshpath-node2` in every hierarchy (`cgroupRoot`): the
//!   first node's kubelet removes every pod cgroup below its own `kubepods` it does not know.
//!
//! What it shares with the first, as a kind node shares it with its host: the kernel, so both
//! nodes' agents attach their node-wide programs at the one cgroup v2 root (as bpf links, which
//! the kernel runs side by side); each datapath acts only on the pods in its own maps.
//!
//! Its files on disk are below the cluster's (`DIR/node2`), so `down` removes them with the
//! rest; its mounts live and die with its mount namespace.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result};

use super::{
    conflist, containerd_config, dir, import_with, kubelet_args, kubelet_config, run, spawn_daemon,
    wait, wait_ready, State, CNI_BIN, CNI_CONF, CONFLIST, DEBIAN_CNI, NODE_IP,
    POD_SUBNET as NODE1_POD_SUBNET,
};
use crate::kubernetes;

/// The node's name, network namespace and address.
pub const NAME: &str = "meshpath-node2";
pub const NETNS: &str = "meshpath-node2";
pub const IP: &str = "10.231.255.2";
/// Its pods' subnet (host-local on its `cni0`).
pub const POD_SUBNET: &str = "10.231.1.0/24";
/// kubelet's credentials (in the cluster's directory, made with the others by `pki`).
pub const KUBECONFIG: &str = "kubelet2.kubeconfig";
/// Its kubelet's `cgroupRoot`, in every hierarchy.
pub const CGROUP_ROOT: &str = "meshpath-node2";
/// containerd's state and socket, in the node's own /run (a name of its own all the same: the
/// tests find the first node's shims by their socket's path in their command lines).
const RUN: &str = "/run/meshpath-cluster-node2";
/// The veth joining the nodes: its end in the first node, and its end here.
const LINK_IN_NODE1: &str = "to-node2";
const LINK_HERE: &str = "to-node1";
/// The names of its processes in the cluster's state (`down` stops them in this order).
pub const HOLDER: &str = "node2";
pub const KUBELET: &str = "kubelet-node2";
pub const CONTAINERD: &str = "containerd-node2";

fn files() -> PathBuf {
    dir().join("node2")
}

/// `program` run in the node's network and mount namespaces.
fn in_node2(holder: i32, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--target={holder}")).args(["--net", "--mount", "--"]).arg(program);
    c
}

/// `program` run on the second node of the running cluster (its network and mount namespaces).
pub fn command(program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
    let holder = super::saved_state().pids.get(HOLDER).copied();
    let holder = holder.context("the cluster has no second node (cargo xtask cluster up)")?;
    Ok(in_node2(holder, program))
}

/// Imports `archives` into the second node's containerd, if the running cluster has one.
pub(super) fn import_if_up(archives: &[PathBuf]) -> Result<()> {
    match super::saved_state().pids.get(HOLDER) {
        Some(&holder) => {
            import_with(in_node2(holder, "ctr"), Path::new(&containerd_socket()), archives)
        }
        None => Ok(()),
    }
}

/// Starts the node and waits for it to be Ready (the control plane runs: the first node is up).
pub(super) fn start(state: &mut State, archives: &[PathBuf]) -> Result<()> {
    network()?;
    let files = files();
    for d in ["cni-bin", "cni-net.d", "kubelet", "kubelet-pki"] {
        fs::create_dir_all(files.join(d))?;
    }
    for p in ["bridge", "host-local", "loopback"] {
        fs::copy(Path::new(DEBIAN_CNI).join(p), files.join("cni-bin").join(p))
            .with_context(|| format!("copying the {p} plugin from {DEBIAN_CNI}"))?;
    }
    fs::write(files.join("cni-net.d").join(CONFLIST), conflist(POD_SUBNET))?;
    cgroups()?;

    // The holder: the node's mounts are made in a mount namespace of its own, then it sleeps.
    // What it copied of the host's mounts goes first, but for the kernel's views every node has
    // (/proc, /sys, its cgroups, /dev): a copy would keep alive what the host unmounts, such as
    // the first node's bpffs at a simulated reboot (its pins, so its programs stay attached) or
    // a test's network namespace bound below /run.
    let script = format!(
        "set -e\n\
         awk '{{print $5}}' /proc/self/mountinfo | sort -r | while read -r m; do\n\
           case \"$m\" in\n\
             /sys/fs/bpf|/sys/fs/bpf/*) umount -l \"$m\" 2>/dev/null || true ;;\n\
             /|/dev|/dev/*|/proc|/proc/*|/sys|/sys/*) ;;\n\
             *) umount -l \"$m\" 2>/dev/null || true ;;\n\
           esac\n\
         done\n\
         mount -t tmpfs -o mode=755 tmpfs /run\n\
         mkdir -p /run/netns /run/lock {RUN}\n\
         mount -t tmpfs -o mode=755 tmpfs /var/log\n\
         mount --bind {bin} {CNI_BIN}\n\
         mount --bind {conf} {CNI_CONF}\n\
         mount -t bpf bpf /sys/fs/bpf\n\
         mount --make-rshared /\n\
         touch /run/node-booted\n\
         exec sleep infinity\n",
        bin = files.join("cni-bin").display(),
        conf = files.join("cni-net.d").display(),
    );
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{NETNS}"))
        .args(["--", "unshare", "--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(script);
    let pid = spawn_daemon(HOLDER, cmd)?;
    state.pids.insert(HOLDER.into(), pid);
    state.save()?;
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    wait("the second node's mounts", Duration::from_secs(30), || {
        Ok(root.join("run/node-booted").exists())
    })?;

    fs::write(files.join("containerd.toml"), containerd_config(&files, RUN))?;
    let mut cmd = in_node2(pid, "containerd");
    cmd.arg("--config").arg(files.join("containerd.toml"));
    state.pids.insert(CONTAINERD.into(), spawn_daemon(CONTAINERD, cmd)?);
    state.save()?;
    let sock = Path::new(RUN).join("containerd.sock");
    let sock_seen = root.join(sock.strip_prefix("/")?);
    wait(
        "the second node's containerd socket",
        Duration::from_secs(30),
        || Ok(sock_seen.exists()),
    )?;
    import_with(in_node2(pid, "ctr"), &sock, archives)?;

    fs::write(files.join("kubelet.yaml"), kubelet_config(IP, Some(&format!("/{CGROUP_ROOT}"))))?;
    let mut cmd = in_node2(pid, kubernetes::binary("kubelet"));
    cmd.args(kubelet_args(&files, KUBECONFIG, RUN, NAME, IP));
    state.pids.insert(KUBELET.into(), spawn_daemon(KUBELET, cmd)?);
    state.save()?;
    wait_ready(NAME)
}

/// The node's namespace and address, and the link to the first node with routes both ways.
fn network() -> Result<()> {
    let ip = |args: &[&str]| run(Command::new("ip").args(args).stdout(Stdio::null()));
    let node1 = super::NETNS;
    ip(&["netns", "add", NETNS])?;
    ip(&["-n", NETNS, "link", "set", "lo", "up"])?;
    ip(&["-n", NETNS, "addr", "add", &format!("{IP}/32"), "dev", "lo"])?;
    ip(&[
        "-n",
        node1,
        "link",
        "add",
        LINK_IN_NODE1,
        "type",
        "veth",
        "peer",
        "name",
        LINK_HERE,
        "netns",
        NETNS,
    ])?;
    for (ns, link, own_ip, peer_ip, peer_pods) in [
        (node1, LINK_IN_NODE1, NODE_IP, IP, POD_SUBNET),
        (NETNS, LINK_HERE, IP, NODE_IP, NODE1_POD_SUBNET),
    ] {
        ip(&["-n", ns, "link", "set", link, "up"])?;
        ip(&["-n", ns, "route", "add", &format!("{peer_ip}/32"), "dev", link, "src", own_ip])?;
        ip(&["-n", ns, "route", "add", peer_pods, "via", peer_ip, "dev", link, "onlink"])?;
        // The bridge plugin turns forwarding on once the node has a pod; the other node's
        // address must be reachable from the pods before that (kubelet's probes' replies).
        run(Command::new("nsenter").arg(format!("--net=/run/netns/{ns}")).args([
            "--",
            "sh",
            "-c",
            "echo 1 > /proc/sys/net/ipv4/ip_forward",
        ]))?;
    }
    Ok(())
}

/// Every mounted cgroup hierarchy's directory (/sys/fs/cgroup/cpu, …, unified).
fn hierarchies() -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let fstype = post.split_whitespace().next()?;
            let point = pre.split_whitespace().nth(4)?;
            (matches!(fstype, "cgroup" | "cgroup2") && point.starts_with("/sys/fs/cgroup"))
                .then(|| PathBuf::from(point))
        })
        .collect()
}

/// kubelet's `cgroupRoot` in every hierarchy (it refuses one that does not exist); cpuset's
/// with its parent's CPUs and memory nodes (a new v1 cpuset has none, and takes no process).
fn cgroups() -> Result<()> {
    for h in hierarchies() {
        let d = h.join(CGROUP_ROOT);
        fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(h.join(f)) {
                fs::write(d.join(f), v.trim()).with_context(|| format!("{}/{f}", d.display()))?;
            }
        }
    }
    Ok(())
}

/// The node's cgroups (`down` kills what is left in them, then removes them deepest first).
pub fn cgroup_roots() -> Vec<PathBuf> {
    hierarchies().into_iter().map(|h| h.join(CGROUP_ROOT)).filter(|d| d.is_dir()).collect()
}

/// Its containerd's socket, as its shims' command lines name it.
pub fn containerd_socket() -> String {
    format!("{RUN}/containerd.sock")
}

/// Removes its network namespace (the veth goes with it).
pub fn remove_network() {
    let _ = Command::new("ip").args(["netns", "del", NETNS]).stderr(Stdio::null()).status();
}
