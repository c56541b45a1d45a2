//! The real two-node cluster `cargo xtask cluster up` starts (xtask/src/cluster.rs: etcd,
//! kube-apiserver, controller-manager, scheduler, a kubelet and a containerd per node; the first
//! node in the network namespace `meshpath-node`, the second a container of its own,
//! xtask/src/cluster/node2.rs, reached as [`Node::Second`]), as the cluster tests (tests/tests/cluster.rs) drive it: kubectl as
//! its administrator, meshpath installed with `kubectl apply -k tests/cluster` (deploy/install
//! with the local image), its proxy following an istiod stand-in (tests/src/istiod.rs) for
//! workloads and certificates, workloads made from the tests' image, the node's files read
//! where kubelet and the DaemonSets leave them.
//!
//! `cargo xtask test` brings the cluster up, runs these tests one at a time (some restart the
//! DaemonSets every other test relies on) and takes it down. Run by hand: `cargo xtask cluster
//! up --debug`, then `MESHPATH_CLUSTER=1 cargo test -p meshpath-tests --test cluster --
//! --test-threads 1`.

use std::{
    io::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

/// The node's network namespace, name and address (xtask/src/cluster.rs).
pub const NETNS: &str = "meshpath-node";
pub const NODE_NAME: &str = "meshpath-node";
pub const NODE_IP: &str = "10.231.255.1";
/// The second node (xtask/src/cluster/node2.rs: a kind-like container of its own on this
/// machine, with its own network and mount namespaces).
pub const NODE2_NAME: &str = "meshpath-node2";
pub const NODE2_IP: &str = "10.231.255.2";

/// A node of the cluster, as the tests reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// `meshpath-node`: the host's mounts, its own network namespace.
    First,
    /// `meshpath-node2`: its own mounts (its /run, bpffs, CNI directories) and network.
    Second,
}

impl Node {
    pub const ALL: [Node; 2] = [Node::First, Node::Second];

    pub fn name(self) -> &'static str {
        match self {
            Node::First => NODE_NAME,
            Node::Second => NODE2_NAME,
        }
    }

    pub fn ip(self) -> &'static str {
        match self {
            Node::First => NODE_IP,
            Node::Second => NODE2_IP,
        }
    }

    /// `program` run on the node: in its network namespace, and on the second in its mounts
    /// too (through its holder process, whose pid `cargo xtask cluster up` recorded).
    pub fn command(self, program: &str) -> Result<Command> {
        match self {
            Node::First => Ok(in_node(program)),
            Node::Second => {
                let state = ClusterState::read()?;
                let holder = state.json["pids"]["node2"]
                    .as_i64()
                    .context("the cluster has no second node (cargo xtask cluster up --nodes 2)")?;
                let mut c = Command::new("nsenter");
                c.arg(format!("--target={holder}")).args(["--net", "--mount", "--"]).arg(program);
                Ok(c)
            }
        }
    }
}

/// The text of file `path` on `node` (its own mounts: the second node's /etc/cni/net.d is not
/// the host's).
pub fn node_file(node: Node, path: &str) -> Result<String> {
    let mut c = node.command("cat")?;
    c.arg(path);
    output(c, None)
}

/// Whether `path` exists on `node`.
pub fn node_has(node: Node, path: &str) -> Result<bool> {
    let mut c = node.command("test")?;
    c.args(["-e", path]);
    Ok(c.status()?.success())
}

impl Node {
    /// Whether process `pid` is in the node's network namespace (a hostNetwork pod's process
    /// is): the two nodes' processes share this machine's pid space.
    pub fn runs(self, pid: i32) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        let node_ns = match self {
            Node::First => std::fs::metadata(Path::new("/run/netns").join(NETNS)),
            Node::Second => ClusterState::read()
                .ok()
                .and_then(|s| s.json["pids"]["node2"].as_i64())
                .map_or_else(
                    || Err(std::io::Error::other("no second node")),
                    |h| std::fs::metadata(format!("/proc/{h}/ns/net")),
                ),
        };
        let of_pid = std::fs::metadata(format!("/proc/{pid}/ns/net"));
        matches!((node_ns, of_pid), (Ok(a), Ok(b)) if a.ino() == b.ino() && a.dev() == b.dev())
    }
}

/// The cluster's nodes, as the API server lists them.
pub fn nodes() -> Result<Vec<Node>> {
    let names = kubectl(&["get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"])?;
    Ok(Node::ALL.into_iter().filter(|n| names.split_whitespace().any(|m| m == n.name())).collect())
}

/// The cluster's files (kubeconfig, logs).
pub const DIR: &str = "/var/lib/meshpath-cluster";
/// meshpath's namespace and DaemonSets (deploy/install).
pub const SYSTEM_NS: &str = "meshpath-system";
pub const AGENT_DS: &str = "meshpath-agent";
pub const PROXY_DS: &str = "meshpath-proxy";
/// The test workload's image (tests/src/bin/cluster-app.rs).
pub const TESTAPP: &str = "localhost/meshpath-testapp:1";
/// This build's image, as tests/cluster installs it.
pub const MESHPATH_IMAGE: &str = "localhost/meshpath:cluster";
/// Where the node's runtime reads CNI configuration and plugins.
pub const CNI_CONF: &str = "/etc/cni/net.d";
pub const CNI_BIN: &str = "/opt/cni/bin";
/// The node's own network configuration (before meshpath-cni is chained into it).
pub const CONFLIST: &str = "/etc/cni/net.d/10-meshpath-cluster.conflist";
/// The proxy's admin socket on the node.
pub const PROXY_ADMIN: &str = "/var/run/meshpath/proxy/admin.sock";
/// The datapath's pins on the node.
pub const PIN_ROOT: &str = "/sys/fs/bpf/meshpath";

/// Panics unless the cluster is up: these tests never skip.
pub fn require_cluster() {
    crate::require_root();
    assert!(
        std::env::var_os("MESHPATH_CLUSTER").is_some(),
        "the cluster tests need the cluster `cargo xtask cluster up` starts; `cargo xtask test` \
         brings it up and sets MESHPATH_CLUSTER"
    );
    assert!(
        Path::new("/run/netns").join(NETNS).exists(),
        "no cluster: /run/netns/{NETNS} is missing (cargo xtask cluster up)"
    );
}

/// A command inside the node's network namespace (mounts untouched).
pub fn in_node(program: &str) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{NETNS}")).arg("--").arg(program);
    c
}

/// Runs `cmd`, `input` on its standard input: its standard output, or an error with what it
/// said if it failed.
pub fn output(mut cmd: Command, input: Option<&str>) -> Result<String> {
    let what = format!("{cmd:?}");
    cmd.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{what}: {}{}",
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl ARGS` as the administrator; its standard output.
pub fn kubectl(args: &[&str]) -> Result<String> {
    let mut c = in_node("kubectl");
    c.arg("--kubeconfig").arg(Path::new(DIR).join("admin.kubeconfig")).args(args);
    output(c, None)
}

/// `kubectl ARGS` with `input` on its standard input (`apply -f -`).
pub fn kubectl_in(args: &[&str], input: &str) -> Result<String> {
    let mut c = in_node("kubectl");
    c.arg("--kubeconfig").arg(Path::new(DIR).join("admin.kubeconfig")).args(args);
    output(c, Some(input))
}

/// `kubectl get … -o json`.
pub fn get_json(args: &[&str]) -> Result<Value> {
    let mut a = vec!["get"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-o", "json"]);
    Ok(serde_json::from_str(&kubectl(&a)?)?)
}

pub use crate::waits::wait_for;

/// The repository root (tests/ is one level below it), as `cargo test` names it to the
/// running binary: checkouts share one target directory, and an unchanged binary built in
/// another checkout is not rebuilt, so the path compiled in can name the other checkout.
pub fn repo_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir.parent().map(Path::to_path_buf).unwrap_or_default()
}

static ISTIOD: std::sync::OnceLock<crate::istiod::Istiod> = std::sync::OnceLock::new();

/// istiod's port, where the stand-in listens on the node's address.
pub const ISTIOD_PORT: u16 = 15012;

/// The istiod stand-in the cluster's proxy follows (tests/src/istiod.rs): in this test
/// process, listening on the node's address inside the node's namespace, for the whole run.
/// The proxy DaemonSet reaches it at https://NODE_IP:15012 (tests/cluster/kustomization.yaml).
pub fn istiod() -> &'static crate::istiod::Istiod {
    ISTIOD.get_or_init(|| {
        let bind = std::net::SocketAddr::new(NODE_IP.parse().expect("node IP"), ISTIOD_PORT);
        // Its files in the cluster's directory, which `cargo xtask cluster down` removes: in a
        // static, the stand-in is never dropped, and in /tmp each run's stayed.
        let dir = Path::new(DIR).join(crate::unique("istiod-stand-in-"));
        crate::istiod::Istiod::start_in(dir, &[Path::new("/run/netns").join(NETNS)], bind)
            .expect("the istiod stand-in in the node's namespace")
    })
}

/// Waits for both DaemonSets Ready; if they never are, the error says what the node and
/// meshpath's pods said (a node condition such as DiskPressure, a container's waiting reason,
/// the namespace's last events), so that a failure in CI can be read from its log alone.
/// An image missing from the node is missing for good (the cluster has no registry): a
/// container waiting for one fails the wait at once rather than after its 180 s, which, with
/// every test installing first, would add up to more than CI's time.
fn both_daemonsets_ready() -> Result<()> {
    wait_for("both DaemonSets Ready", Duration::from_secs(180), || {
        if let Some(missing) = waiting_for_an_image()? {
            return Ok(Some(Err(anyhow::anyhow!("{missing}"))));
        }
        Ok((daemonset_ready(AGENT_DS)? && daemonset_ready(PROXY_DS)?).then_some(Ok(())))
    })
    .and_then(|r| r)
    .map_err(|e| anyhow::anyhow!("{e:#}\n{}", why_not_ready()))
}

/// A container of meshpath's pods that waits for an image the node does not have.
fn waiting_for_an_image() -> Result<Option<String>> {
    let pods = get_json(&["pods", "-n", SYSTEM_NS])?;
    for pod in pods["items"].as_array().into_iter().flatten() {
        let statuses = ["initContainerStatuses", "containerStatuses"];
        for c in statuses.iter().flat_map(|k| pod["status"][k].as_array().into_iter().flatten()) {
            let reason = c["state"]["waiting"]["reason"].as_str().unwrap_or("");
            if matches!(reason, "ErrImageNeverPull" | "ErrImagePull" | "ImagePullBackOff") {
                return Ok(Some(format!(
                    "{} of pod {} waits for an image the node does not have ({reason})",
                    c["name"].as_str().unwrap_or("?"),
                    pod["metadata"]["name"].as_str().unwrap_or("?")
                )));
            }
        }
    }
    Ok(None)
}

/// What the node and the pods of meshpath's namespace say of themselves, one line each.
pub fn why_not_ready() -> String {
    let mut lines = Vec::new();
    if let Ok(nodes) = get_json(&["nodes"]) {
        for node in nodes["items"].as_array().into_iter().flatten() {
            for c in node["status"]["conditions"].as_array().into_iter().flatten() {
                // Ready is the one condition that should be True; the others, False.
                let healthy = (c["type"] == "Ready") == (c["status"] == "True");
                if !healthy {
                    lines.push(format!(
                        "node condition {}={}: {}",
                        c["type"].as_str().unwrap_or("?"),
                        c["status"].as_str().unwrap_or("?"),
                        c["message"].as_str().unwrap_or("")
                    ));
                }
            }
        }
    }
    if let Ok(pods) = get_json(&["pods", "-n", SYSTEM_NS]) {
        for pod in pods["items"].as_array().into_iter().flatten() {
            let mut line = format!(
                "pod {} {}",
                pod["metadata"]["name"].as_str().unwrap_or("?"),
                pod["status"]["phase"].as_str().unwrap_or("?")
            );
            if let Some(reason) = pod["status"]["reason"].as_str() {
                line +=
                    &format!(" ({reason}: {})", pod["status"]["message"].as_str().unwrap_or(""));
            }
            for c in pod["status"]["containerStatuses"].as_array().into_iter().flatten() {
                let state = &c["state"];
                let why = state["waiting"]["reason"]
                    .as_str()
                    .or(state["terminated"]["reason"].as_str())
                    .unwrap_or(if c["ready"] == true { "ready" } else { "running, unready" });
                line += &format!(
                    "; {} {why}, {} restarts",
                    c["name"].as_str().unwrap_or("?"),
                    c["restartCount"]
                );
            }
            lines.push(line);
        }
    }
    if let Ok(events) = kubectl(&[
        "get",
        "events",
        "-n",
        SYSTEM_NS,
        "--sort-by=.lastTimestamp",
        "-o",
        "custom-columns=REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message",
        "--no-headers",
    ]) {
        let events: Vec<&str> = events.lines().collect();
        let from = events.len().saturating_sub(10);
        lines.extend(events[from..].iter().map(|e| format!("event {e}")));
    }
    lines.join("\n")
}

/// Whether a DaemonSet has its pod on every node, up to date and Ready.
pub fn daemonset_ready(name: &str) -> Result<bool> {
    let nodes = i64::try_from(nodes()?.len())?;
    let ds = get_json(&["daemonset", "-n", SYSTEM_NS, name])?;
    let s = &ds["status"];
    let n = |k: &str| s[k].as_i64().unwrap_or(0);
    Ok(ds["metadata"]["generation"] == s["observedGeneration"]
        && n("desiredNumberScheduled") == nodes
        && n("numberReady") == nodes
        && n("updatedNumberScheduled") == nodes
        && n("numberUnavailable") == 0)
}

/// meshpath installed as users install it next to istiod, both DaemonSets Ready: istiod's root
/// in the istio-ca-root-cert ConfigMap (istiod writes it into every namespace; its stand-in
/// cannot), then `kubectl apply -k tests/cluster`. Idempotent: a test that took something
/// down calls it to put it back.
///
/// After [`GIVE_UP_AFTER`] installs in a row failed, later ones fail at once with the last
/// one's error: every test installs first, and 22 waits of 180 s each on a cluster that cannot
/// run meshpath would take more than CI's whole time.
pub fn install() -> Result<()> {
    static FAILED_IN_A_ROW: std::sync::Mutex<(usize, String)> =
        std::sync::Mutex::new((0, String::new()));
    let mut failed = FAILED_IN_A_ROW.lock().unwrap_or_else(|e| e.into_inner());
    if failed.0 >= GIVE_UP_AFTER {
        bail!("not tried: the last {} installs failed, the last with: {}", failed.0, failed.1);
    }
    let installed = (|| {
        namespace_and_root()?;
        let overlay = repo_root().join("tests/cluster");
        kubectl(&["apply", "-k", &overlay.display().to_string()])?;
        both_daemonsets_ready()
    })();
    *failed = match &installed {
        Ok(()) => (0, String::new()),
        Err(e) => (failed.0 + 1, format!("{e:#}")),
    };
    installed
}

/// Installs in a row that may fail before [`install`] stops trying.
const GIVE_UP_AFTER: usize = 2;

/// The previous release's image (its git tag, built and imported by `cargo xtask test`).
pub const MESHPATH_PREVIOUS: &str = "localhost/meshpath:previous";

/// The previous release installed as its users installed it: its own manifests (its
/// tests/cluster overlay of its deploy/install, from the source xtask unpacked:
/// `MESHPATH_PREVIOUS_SOURCE`) with its image, both DaemonSets Ready.
pub fn install_previous_release() -> Result<()> {
    let Some(source) = std::env::var_os("MESHPATH_PREVIOUS_SOURCE") else {
        match std::env::var("MESHPATH_PREVIOUS_ERROR") {
            Ok(why) => bail!("the previous release could not be built: {why}"),
            Err(_) => bail!(
                "MESHPATH_PREVIOUS_SOURCE is not set: run the cluster suite with `cargo xtask test`"
            ),
        }
    };
    namespace_and_root()?;
    let overlay = PathBuf::from(source).join("tests/cluster");
    let yaml = kubectl(&["kustomize", &overlay.display().to_string()])?
        .replace("localhost/meshpath:cluster", MESHPATH_PREVIOUS);
    kubectl_in(&["apply", "-f", "-"], &yaml)?;
    both_daemonsets_ready()
}

/// meshpath's namespace, and istiod's root in the istio-ca-root-cert ConfigMap (istiod writes
/// it into every namespace; its stand-in cannot).
fn namespace_and_root() -> Result<()> {
    let root = std::fs::read_to_string(&istiod().root_pem)?;
    kubectl_in(
        &["apply", "-f", "-"],
        &format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {SYSTEM_NS}\n"),
    )?;
    let cm = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "istio-ca-root-cert", "namespace": SYSTEM_NS},
        "data": {"root-cert.pem": root},
    });
    kubectl_in(&["apply", "-f", "-"], &cm.to_string())?;
    Ok(())
}

/// The manifests `kubectl apply -k tests/cluster` applies, as JSON objects (rendered by
/// kubectl's kustomize), for a test that changes one before applying.
pub fn rendered_install() -> Result<Vec<Value>> {
    let overlay = repo_root().join("tests/cluster");
    let yaml = kubectl(&["kustomize", &overlay.display().to_string()])?;
    let json = kubectl_in(&["create", "--dry-run=client", "-o", "json", "-f", "-"], &yaml)?;
    // One JSON object per document, one after the other (a List's items taken apart).
    let mut objects = Vec::new();
    for v in serde_json::Deserializer::from_str(&json).into_iter::<Value>() {
        let v = v?;
        match v["items"].as_array() {
            Some(items) if v["kind"] == "List" => objects.extend(items.iter().cloned()),
            _ => objects.push(v),
        }
    }
    Ok(objects)
}

/// Takes meshpath off the nodes as docs/deploy.md says: the agent's DaemonSet, then the
/// uninstall Job on each node (the image and pull policy of this cluster), then the proxy's.
pub fn uninstall() -> Result<()> {
    // Foreground: kubectl returns once the agent's pods are gone, not only the DaemonSet object
    // (with the default, background, an agent still shutting down overlapped the Job's removal
    // of the pin root, and the root was there after the Job had succeeded).
    kubectl(&[
        "delete",
        "daemonset",
        "-n",
        SYSTEM_NS,
        AGENT_DS,
        "--ignore-not-found",
        "--cascade=foreground",
        "--wait=true",
    ])?;
    let nodes = nodes()?;
    for node in &nodes {
        let job = std::fs::read_to_string(repo_root().join("deploy/uninstall-job.yaml"))?
            .replace("NODE_NAME", node.name())
            .replace("registry.example.invalid/meshpath:0.1.0", "localhost/meshpath:cluster")
            .replace("imagePullPolicy: IfNotPresent", "imagePullPolicy: Never")
            // Kubernetes 1.20 has no appArmorProfile field (tests/cluster/kustomization.yaml).
            .replace("            appArmorProfile:\n              type: Unconfined\n", "");
        kubectl_in(&["create", "-f", "-"], &job)?;
    }
    let done = wait_for("the uninstall Jobs", Duration::from_secs(120), || {
        let jobs = get_json(&[
            "jobs",
            "-n",
            SYSTEM_NS,
            "-l",
            "app.kubernetes.io/name=meshpath-uninstall",
        ])?;
        Ok(jobs["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|j| j["status"]["succeeded"].as_i64() == Some(1))
            .count()
            .eq(&nodes.len())
            .then_some(()))
    });
    kubectl(&[
        "delete",
        "daemonset",
        "-n",
        SYSTEM_NS,
        PROXY_DS,
        "--ignore-not-found",
        "--wait=true",
    ])?;
    kubectl(&[
        "delete",
        "jobs",
        "-n",
        SYSTEM_NS,
        "-l",
        "app.kubernetes.io/name=meshpath-uninstall",
    ])?;
    done
}

/// The agent's readiness answer (status code and body), from its health port on the node.
pub fn agent_readyz() -> Result<(u16, String)> {
    node_http_get(8000, "/readyz")
}

/// The proxy's readiness answer (status code and body: why it is not ready), on the node.
pub fn proxy_readiness() -> Result<(u16, String)> {
    node_http_get(15021, "/healthz/ready")
}

/// `GET http://NODE_IP:port/path` from the node: status code and body.
fn node_http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut c = in_node("curl");
    c.args([
        "-s",
        "--max-time",
        "5",
        "-w",
        "\n%{http_code}",
        &format!("http://{NODE_IP}:{port}{path}"),
    ]);
    let out = output(c, None)?;
    let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
    Ok((code.trim().parse()?, body.to_owned()))
}

/// Restarts the cluster's kube-apiserver (the same command line; etcd keeps the state), as a
/// control-plane upgrade or crash would: the old process is stopped, a new one started.
pub fn restart_apiserver() -> Result<()> {
    let mut state = ClusterState::read()?;
    // It closes its listener at once on SIGTERM, but its process outlives 30 s here (its
    // open watches draining): killed after 5 s, as a crash would end it.
    let args = state.stop("kube-apiserver", Duration::from_secs(5))?;
    state.start("kube-apiserver", &args)?;
    wait_for("the API server back", Duration::from_secs(90), || {
        Ok(kubectl(&["get", "--raw", "/readyz"]).is_ok().then_some(()))
    })
}

/// The cluster's daemons as `cargo xtask cluster up` recorded them (their pids), which a test
/// that restarts one keeps true (`cargo xtask cluster down` stops them by it).
struct ClusterState {
    path: PathBuf,
    json: Value,
}

impl ClusterState {
    fn read() -> Result<Self> {
        let path = Path::new(DIR).join("state.json");
        let json = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        Ok(Self { path, json })
    }

    /// Stops daemon `name` (SIGTERM, then SIGKILL after `grace`); returns its command line.
    fn stop(&mut self, name: &str, grace: Duration) -> Result<Vec<String>> {
        let pid = self.json["pids"][name].as_i64().with_context(|| format!("no {name} pid"))?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let raw = i32::try_from(pid)?;
        let pid = nix::unistd::Pid::from_raw(raw);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        // Gone, or a zombie (its parent, the xtask that started the cluster, may still run).
        let exited = || {
            std::fs::read_to_string(format!("/proc/{raw}/stat"))
                .map_or(true, |s| s.rsplit(") ").next().is_some_and(|rest| rest.starts_with('Z')))
        };
        let waited = wait_for(&format!("{name} to exit"), grace, || Ok(exited().then_some(())));
        if waited.is_err() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            std::thread::sleep(Duration::from_secs(1));
        }
        Ok(args)
    }

    /// Starts daemon `name` with `args` in the node's netns, in a session of its own, its
    /// output appended to its log; records its pid.
    fn start(&mut self, name: &str, args: &[String]) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(Path::new(DIR).join(format!("logs/{name}.log")))?;
        let mut c = in_node(args.first().context("empty command line")?);
        c.args(&args[1..]).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut c, || {
                libc::setsid();
                Ok(())
            });
        }
        let child = c.spawn()?;
        self.json["pids"][name] = serde_json::json!(child.id());
        std::fs::write(&self.path, serde_json::to_string_pretty(&self.json)?)?;
        Ok(())
    }
}

/// What a reboot takes from the node, simulated: kubelet and containerd stopped, every pod's
/// processes and the runtime's shims killed, the pods' network namespaces and cgroups gone,
/// bpffs unmounted (every pin, and with them every program they kept attached), and what
/// lives in /run (tmpfs) gone: the runtime's state, meshpath's sockets and records. Then the
/// node boots: bpffs mounted again (as systemd does), containerd and kubelet started with the
/// same command lines. The control plane, on other machines in a real cluster, keeps running.
pub fn reboot_node() -> Result<()> {
    let mut state = ClusterState::read()?;
    let kubelet = state.stop("kubelet", Duration::from_secs(30))?;
    kill_in_kubepods();
    let containerd = state.stop("containerd", Duration::from_secs(30))?;
    kill_shims();
    for e in std::fs::read_dir("/run/netns")?.flatten() {
        if e.file_name().to_string_lossy().starts_with("cni-") {
            let _ = nix::mount::umount2(&e.path(), nix::mount::MntFlags::MNT_DETACH);
            let _ = std::fs::remove_file(e.path());
        }
    }
    remove_kubepods_cgroups();
    // Every bpffs stacked there (a reboot leaves none), not only the top one.
    nix::mount::umount2(BPFFS, nix::mount::MntFlags::MNT_DETACH).context("unmounting bpffs")?;
    for _ in 0..16 {
        if bpffs_mounts() == 0 {
            break;
        }
        nix::mount::umount2(BPFFS, nix::mount::MntFlags::MNT_DETACH)
            .context("unmounting a bpffs stacked below")?;
    }
    anyhow::ensure!(bpffs_mounts() == 0, "{} mounts left at {BPFFS}", bpffs_mounts());
    // /run is a tmpfs: nothing in it survives a reboot. The runtime's state (sockets, shims'
    // directories) is below RUN_DIR; meshpath's (the agent's records, cni.sock, the ZDS socket)
    // below /var/run.
    unmount_below(RUN_DIR);
    for dir in [RUN_DIR, "/var/run/meshpath", "/var/run/ztunnel"] {
        if Path::new(dir).exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {dir}"))?;
        }
    }
    std::fs::create_dir_all(RUN_DIR)?;

    // The boot.
    nix::mount::mount(Some("bpf"), BPFFS, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
        .context("mounting bpffs")?;
    // Shared, as `cargo xtask cluster up` needs it (the agent's pod mounts it with
    // Bidirectional propagation).
    let shared = Command::new("mount").args(["--make-shared", BPFFS]).status()?;
    anyhow::ensure!(shared.success(), "mount --make-shared {BPFFS} failed");
    let mounts = bpffs_mounts();
    anyhow::ensure!(mounts == 1, "{mounts} bpffs mounts at {BPFFS} after the boot, not one");
    state.start("containerd", &containerd)?;
    let sock = Path::new(RUN_DIR).join("containerd.sock");
    wait_for("containerd's socket", Duration::from_secs(30), || Ok(sock.exists().then_some(())))?;
    state.start("kubelet", &kubelet)?;
    Ok(())
}

/// The host's bpffs, as a boot mounts it.
const BPFFS: &str = "/sys/fs/bpf";

/// How many mounts there are at [`BPFFS`] (stacked ones each count).
fn bpffs_mounts() -> usize {
    mount_points().iter().filter(|p| *p == BPFFS).count()
}

/// Every mount point /proc/self/mountinfo lists, once per mount (its fifth field).
fn mount_points() -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().filter_map(|l| l.split_whitespace().nth(4).map(str::to_owned)).collect()
}

/// Where `cargo xtask cluster up` puts containerd's state and socket (tmpfs-like: /run).
const RUN_DIR: &str = "/run/meshpath-cluster";

/// Every `kubepods` cgroup directory, deepest first.
fn kubepods_cgroups() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        out.push(dir.to_path_buf());
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path(), out);
            }
        }
    }
    let mut dirs = Vec::new();
    for base in ["/sys/fs/cgroup/kubepods", "/sys/fs/cgroup/unified/kubepods"] {
        if Path::new(base).is_dir() {
            walk(Path::new(base), &mut dirs);
        }
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    dirs
}

/// Kills every process in the pods' cgroups, until none is left (10 s at most).
fn kill_in_kubepods() {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut any = false;
        for d in kubepods_cgroups() {
            let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                any = true;
                let pid = nix::unistd::Pid::from_raw(pid);
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        if !any || std::time::Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn remove_kubepods_cgroups() {
    for d in kubepods_cgroups() {
        let _ = std::fs::remove_dir(&d);
    }
}

/// Kills this cluster's containerd shims (they outlive containerd).
fn kill_shims() {
    let sock = format!("{RUN_DIR}/containerd.sock");
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("containerd-shim") && cmdline.contains(&sock) {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Unmounts every mount below `prefix`, deepest first.
fn unmount_below(prefix: &str) {
    let mut points: Vec<String> =
        mount_points().into_iter().filter(|p| p.starts_with(prefix)).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = nix::mount::umount2(p.as_str(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Starts a rolling update of DaemonSet `ds`, which replaces its pods as its update strategy
/// says (`maxUnavailable: 1`: one node at a time): `kubectl rollout restart`, a new pod
/// template as a new image makes. A new image would be rolled back by the next test's
/// `kubectl apply` ([`install`]): another roll of both nodes; this one stays.
pub fn rolling_update(ds: &str) -> Result<()> {
    kubectl(&["rollout", "restart", "-n", SYSTEM_NS, &format!("daemonset/{ds}")]).map(drop)
}

/// The pod (name) of a DaemonSet on the first node.
pub fn daemonset_pod(name: &str) -> Result<String> {
    daemonset_pod_on(name, Node::First)
}

/// The pod (name) of a DaemonSet on `node`.
pub fn daemonset_pod_on(name: &str, node: Node) -> Result<String> {
    let pods =
        get_json(&["pods", "-n", SYSTEM_NS, "-l", &format!("app.kubernetes.io/name={name}")])?;
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["metadata"]["deletionTimestamp"].is_null() && p["spec"]["nodeName"] == node.name()
        })
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .with_context(|| format!("no pod of {name}"))
}

/// The logs of every pod of some DaemonSets, the replaced ones included, from when it was
/// made until it is dropped: each pod's `kubectl logs -f --timestamps` followed from when the
/// pod appears (checked every 500 ms), so that a pod deleted by a roll leaves its log behind.
/// For what a test prints when it fails.
pub struct DaemonSetLogs {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    poller: Option<std::thread::JoinHandle<()>>,
    logs: PodLogs,
}

/// Each pod followed, with its log so far (written by its reader thread).
type PodLogs =
    std::sync::Arc<std::sync::Mutex<Vec<(String, std::sync::Arc<std::sync::Mutex<String>>)>>>;

impl DaemonSetLogs {
    pub fn follow(daemonsets: &[&str]) -> Self {
        use std::sync::{atomic::Ordering, Arc, Mutex};
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let logs: PodLogs = Arc::default();
        let selector = format!("app.kubernetes.io/name in ({})", daemonsets.join(","));
        let (stop2, logs2) = (stop.clone(), logs.clone());
        let poller = std::thread::spawn(move || {
            // The pods followed. A pod is taken once it has left Pending (its container
            // started), and followed until it ends or the logs are dropped.
            let mut following: Vec<(String, std::process::Child, std::thread::JoinHandle<()>)> =
                Vec::new();
            while !stop2.load(Ordering::SeqCst) {
                let pods = get_json(&["pods", "-n", SYSTEM_NS, "-l", &selector]);
                let names: Vec<String> = pods
                    .iter()
                    .flat_map(|p| p["items"].as_array().cloned().unwrap_or_default())
                    .filter(|p| p["status"]["phase"] != "Pending")
                    .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
                    .collect();
                for name in names {
                    if following.iter().any(|(n, ..)| *n == name) {
                        continue;
                    }
                    let mut c = in_node("kubectl");
                    c.arg("--kubeconfig")
                        .arg(Path::new(DIR).join("admin.kubeconfig"))
                        .args(["logs", "-f", "--timestamps", "-n", SYSTEM_NS, &name])
                        .stdin(Stdio::null())
                        .stdout(Stdio::piped())
                        .stderr(Stdio::null());
                    let Ok(mut child) = c.spawn() else { continue };
                    let Some(out) = child.stdout.take() else { continue };
                    let text = Arc::new(Mutex::new(String::new()));
                    logs2
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((name.clone(), text.clone()));
                    let reader = std::thread::spawn(move || {
                        use std::io::BufRead as _;
                        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                            let mut t = text.lock().unwrap_or_else(|e| e.into_inner());
                            t.push_str(&line);
                            t.push('\n');
                        }
                    });
                    following.push((name, child, reader));
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            for (_, mut child, reader) in following {
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
            }
        });
        Self { stop, poller: Some(poller), logs }
    }

    /// Every line so far that contains one of `needles`, each prefixed with its pod's name,
    /// pod by pod in the order they appeared; `limit` lines at most.
    pub fn lines_with(&self, needles: &[&str], limit: usize) -> Vec<String> {
        let logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        logs.iter()
            .flat_map(|(pod, text)| {
                let text = text.lock().unwrap_or_else(|e| e.into_inner()).clone();
                text.lines()
                    .filter(|l| needles.iter().any(|n| l.contains(n)))
                    .map(|l| format!("{pod}: {l}"))
                    .collect::<Vec<_>>()
            })
            .take(limit)
            .collect()
    }

    /// The pods followed, in the order they appeared.
    pub fn pods(&self) -> Vec<String> {
        let logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        logs.iter().map(|(pod, _)| pod.clone()).collect()
    }
}

impl Drop for DaemonSetLogs {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(p) = self.poller.take() {
            let _ = p.join();
        }
    }
}

/// A namespace of its own for one test (labelled for ambient when `ambient`), deleted on drop.
#[derive(Debug)]
pub struct TestNamespace {
    pub name: String,
}

impl TestNamespace {
    pub fn new(prefix: &str, ambient: bool) -> Result<Self> {
        let name = format!("{prefix}-{}", crate::unique("").replace('x', "-"));
        let labels = if ambient { "\n  labels:\n    istio.io/dataplane-mode: ambient" } else { "" };
        kubectl_in(
            &["apply", "-f", "-"],
            &format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}{labels}\n"),
        )?;
        wait_for("the namespace's default ServiceAccount", Duration::from_secs(60), || {
            Ok(kubectl(&["get", "serviceaccount", "default", "-n", &name]).ok().map(|_| ()))
        })?;
        Ok(Self { name })
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let _ = kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
        // Its pods' workloads go with them, as istiod removes them: a later pod given one of
        // their addresses is not taken for one of them.
        if let Some(istiod) = ISTIOD.get() {
            istiod.remove_namespace_workloads(&self.name);
        }
    }
}

/// The test app as a one-replica Deployment `name` (service account `name`) in `ns`: HTTP on
/// 8080 with kubelet's readiness and liveness probes on `probe_port` (8080 unless a test wants
/// a closed one), the sink on 9000.
pub fn deploy_app(ns: &str, name: &str, probe_port: u16) -> Result<()> {
    deploy_app_with(ns, name, probe_port, &[])
}

/// [`deploy_app`] with more arguments to the app's `serve`.
pub fn deploy_app_with(ns: &str, name: &str, probe_port: u16, serve_args: &[&str]) -> Result<()> {
    deploy_app_on(Some(Node::First), ns, name, probe_port, serve_args)
}

/// [`deploy_app_with`] on `node` (the pod selects it by its hostname label, as users pin pods),
/// or wherever the scheduler puts it.
pub fn deploy_app_on(
    node: Option<Node>,
    ns: &str,
    name: &str,
    probe_port: u16,
    serve_args: &[&str],
) -> Result<()> {
    let node_selector = node
        .map(|n| format!("\n      nodeSelector: {{kubernetes.io/hostname: {}}}", n.name()))
        .unwrap_or_default();
    let command: Vec<String> = ["/usr/local/bin/cluster-app", "serve"]
        .iter()
        .chain(serve_args)
        .map(|a| format!("{a:?}"))
        .collect();
    let command = command.join(", ");
    let yaml = format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata:
  name: {name}
  namespace: {ns}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
  namespace: {ns}
spec:
  replicas: 1
  selector:
    matchLabels: {{app: {name}}}
  template:
    metadata:
      labels: {{app: {name}}}
    spec:
      serviceAccountName: {name}
      terminationGracePeriodSeconds: 1{node_selector}
      containers:
        - name: app
          image: {TESTAPP}
          imagePullPolicy: Never
          command: [{command}]
          ports:
            - {{name: http, containerPort: 8080}}
            - {{name: sink, containerPort: 9000}}
          readinessProbe:
            httpGet: {{path: /healthz, port: {probe_port}}}
            periodSeconds: 2
            failureThreshold: 2
          livenessProbe:
            httpGet: {{path: /healthz, port: {probe_port}}}
            periodSeconds: 5
            failureThreshold: 30
"#
    );
    kubectl_in(&["apply", "-f", "-"], &yaml)?;
    Ok(())
}

/// A pod of Deployment `app` in `ns`, once it has an address (Ready or not).
#[derive(Debug, Clone)]
pub struct PodInfo {
    pub name: String,
    pub uid: String,
    pub ip: IpAddr,
    pub ready: bool,
    pub annotations: Value,
    pub restarts: i64,
}

pub fn app_pod(ns: &str, app: &str) -> Result<Option<PodInfo>> {
    let pods = get_json(&["pods", "-n", ns, "-l", &format!("app={app}")])?;
    let Some(p) = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null())
    else {
        return Ok(None);
    };
    let Some(ip) = p["status"]["podIP"].as_str().and_then(|i| i.parse().ok()) else {
        return Ok(None);
    };
    let ready = p["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    let restarts = p["status"]["containerStatuses"][0]["restartCount"].as_i64().unwrap_or(0);
    Ok(Some(PodInfo {
        name: p["metadata"]["name"].as_str().unwrap_or_default().to_owned(),
        uid: p["metadata"]["uid"].as_str().unwrap_or_default().to_owned(),
        ip,
        ready,
        annotations: p["metadata"]["annotations"].clone(),
        restarts,
    }))
}

/// Waits for a Ready pod of `app`.
pub fn ready_pod(ns: &str, app: &str) -> Result<PodInfo> {
    wait_for(&format!("a Ready pod of {ns}/{app}"), Duration::from_secs(120), || {
        Ok(app_pod(ns, app)?.filter(|p| p.ready))
    })
}

/// `kubectl exec` of the test app in a pod: its output, or an error with it.
pub fn exec(ns: &str, pod: &str, args: &[&str]) -> Result<String> {
    let mut a = vec!["exec", "-n", ns, pod, "--", "/usr/local/bin/cluster-app"];
    a.extend_from_slice(args);
    kubectl(&a)
}

/// The same, not waited for: a long transfer that runs while a test restarts something.
pub fn exec_spawn(ns: &str, pod: &str, args: &[&str]) -> Result<std::process::Child> {
    let mut c = in_node("kubectl");
    c.arg("--kubeconfig")
        .arg(Path::new(DIR).join("admin.kubeconfig"))
        .args(["exec", "-n", ns, pod, "--", "/usr/local/bin/cluster-app"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Ok(c.spawn()?)
}

/// As [`exec_spawn`], with the child's standard input passed to the app (`kubectl exec -i`):
/// closing the child's stdin ends the app's.
pub fn exec_spawn_with_stdin(ns: &str, pod: &str, args: &[&str]) -> Result<std::process::Child> {
    let mut c = in_node("kubectl");
    c.arg("--kubeconfig")
        .arg(Path::new(DIR).join("admin.kubeconfig"))
        .args(["exec", "-i", "-n", ns, pod, "--", "/usr/local/bin/cluster-app"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Ok(c.spawn()?)
}

/// A connect loop in a pod (`cluster-app loop`): a new connection to a sink every 20 ms, each
/// on a thread of its own, from [`ConnectLoop::start`] until [`ConnectLoop::end`] (or
/// `max_seconds`); killed if the test ends first.
pub struct ConnectLoop {
    child: Option<std::process::Child>,
}

impl ConnectLoop {
    /// Starts the loop in `ns`/`pod` to `target` (`IP:PORT`) and lets it run 3 s, so that what
    /// the test does next happens under it.
    pub fn start(ns: &str, pod: &str, target: &str, max_seconds: u64) -> Result<Self> {
        let seconds = max_seconds.to_string();
        let args = ["loop", target, "--seconds", &seconds, "--until-stdin-closes"];
        let this = Self { child: Some(exec_spawn_with_stdin(ns, pod, &args)?) };
        std::thread::sleep(Duration::from_secs(3));
        Ok(this)
    }

    /// Ends the loop (its standard input closed) and returns what it counted.
    pub fn end(mut self) -> Result<LoopCounts> {
        let mut child = self.child.take().context("the loop already ended")?;
        drop(child.stdin.take());
        let out = child.wait_with_output()?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(LoopCounts::read(text.trim()))
    }
}

impl Drop for ConnectLoop {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What a connect loop printed (`opened=N answered=N refused=N reset=N other=N …`, and
/// `failed_at_ms=T,…`), and its counts read.
#[derive(Debug, Clone)]
pub struct LoopCounts {
    pub text: String,
    counts: std::collections::BTreeMap<String, u64>,
}

impl LoopCounts {
    pub fn read(text: &str) -> Self {
        let counts = text
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect();
        Self { text: text.to_owned(), counts }
    }

    /// The count of `what` (`opened`, `answered`, `refused`, `reset`, `other`); `u64::MAX` if
    /// the loop did not print it, which no assertion on it passes.
    pub fn count(&self, what: &str) -> u64 {
        self.counts.get(what).copied().unwrap_or(u64::MAX)
    }

    /// When the failed connections were opened, in milliseconds from the loop's start.
    pub fn failed_at_ms(&self) -> Vec<u64> {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix("failed_at_ms="))
            .unwrap_or_default()
            .split(',')
            .filter_map(|t| t.parse().ok())
            .collect()
    }

    /// Every connection opened was answered, and there was at least one.
    pub fn all_answered(&self) -> bool {
        self.count("opened") > 0 && self.count("answered") == self.count("opened")
    }
}

impl std::fmt::Display for LoopCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// How many connections the sink of the pod at `ip` has accepted (asked over its HTTP port
/// from the node, as kubelet's probes reach it).
pub fn sink_count(ip: IpAddr) -> Result<u64> {
    let out = output(
        {
            let mut c = in_node("curl");
            c.args(["-sf", "--max-time", "5", &format!("http://{ip}:8080/count")]);
            c
        },
        None,
    )?;
    Ok(out.trim().parse()?)
}

/// The proxy's Prometheus text, from its metrics port on the node's address.
pub fn proxy_metrics() -> Result<String> {
    proxy_metrics_on(Node::First)
}

/// The Prometheus text of `node`'s proxy, from its metrics port on the node's address.
pub fn proxy_metrics_on(node: Node) -> Result<String> {
    let mut c = node.command("curl")?;
    c.args(["-sf", "--max-time", "5", &format!("http://{}:15020/metrics", node.ip())]);
    output(c, None)
}

pub use crate::sum_metric as metric_sum;

/// The proxy's configuration dump, from its admin socket on the node.
pub fn proxy_config_dump() -> Result<String> {
    proxy_config_dump_on(Node::First)
}

/// The configuration dump of `node`'s proxy, from its admin socket on that node.
pub fn proxy_config_dump_on(node: Node) -> Result<String> {
    let mut c = node.command("curl")?;
    c.args(["-sf", "--max-time", "5", "--unix-socket", PROXY_ADMIN, "http://admin/config_dump"]);
    output(c, None)
}

/// What istiod would tell the proxy about `pods` once they are meshed: HBONE workloads on this
/// node, (namespace, service account, pod). Returns once the proxy's store holds them all.
pub fn publish_workloads(pods: &[(&str, &str, &PodInfo)]) -> Result<()> {
    let on_first: Vec<_> = pods.iter().map(|(ns, sa, p)| (*ns, *sa, *p, Node::First)).collect();
    publish_workloads_on(&on_first, &[Node::First])
}

/// [`publish_workloads`] for pods of any node, (namespace, service account, pod, its node);
/// returns once the proxies of `proxies` hold them all.
pub fn publish_workloads_on(pods: &[(&str, &str, &PodInfo, Node)], proxies: &[Node]) -> Result<()> {
    for (ns, sa, p, node) in pods {
        istiod().set_pod_workload(meshpath_xds::workload::Workload {
            uid: p.uid.clone(),
            name: p.name.clone(),
            namespace: (*ns).to_owned(),
            service_account: (*sa).to_owned(),
            workload_name: (*sa).to_owned(),
            addresses: vec![match p.ip {
                IpAddr::V4(v4) => v4.octets().to_vec().into(),
                IpAddr::V6(v6) => v6.octets().to_vec().into(),
            }],
            tunnel_protocol: meshpath_xds::workload::TunnelProtocol::Hbone as i32,
            node: node.name().to_owned(),
            ..Default::default()
        });
    }
    wait_for("the proxies to hold the workloads", Duration::from_secs(60), || {
        for proxy in proxies {
            let dump: Value = serde_json::from_str(&proxy_config_dump_on(*proxy)?)?;
            let held: Vec<&str> = dump["workloads"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|w| w["uid"].as_str())
                .collect();
            if !pods.iter().all(|(_, _, p, _)| held.contains(&p.uid.as_str())) {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
}

/// The agent's datapath, as `meshpath-loader list --json` on the node reads it.
pub fn enrolled_pods() -> Result<Value> {
    enrolled_pods_on(Node::First)
}

/// The datapath of `node`'s agent, as `meshpath-loader list --json` on that node reads it.
pub fn enrolled_pods_on(node: Node) -> Result<Value> {
    let loader = crate::loader_bin();
    let mut c = node.command(&loader.display().to_string())?;
    c.args(["--pin-root", PIN_ROOT, "list", "--json"]);
    Ok(serde_json::from_str(&output(c, None)?)?)
}
