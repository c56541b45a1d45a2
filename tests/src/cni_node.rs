//! A node as a runtime sees it: a node network namespace with a bridge, the node agent
//! (`meshpath-loader agent`) and the node proxy (`meshpath-proxy --zds-socket`) running, and
//! pods created through the real CNI chain — Debian's `loopback`, `bridge` + `host-local` from
//! /usr/lib/cni, then `meshpath-cni` — invoked exactly as a runtime does (environment
//! variables, config on stdin, `prevResult` threaded through the chain, DEL in reverse order).
//! Everything is removed on drop: processes, namespaces, pins, cgroups, files.

use std::{
    io::Write as _,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use super::{
    loader_bin, require_root, sibling_bin, unique, CgroupGuard, NetnsGuard, NodeProxy, PinRoot,
    TestProxy,
};

/// Where Debian installs the CNI plugins.
pub const CNI_PLUGINS: &str = "/usr/lib/cni";

/// What a plugin run printed and how it exited.
#[derive(Debug, Clone)]
pub struct PluginRun {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl PluginRun {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or(Value::Null)
    }
}

/// `nsenter`'s full path, found once in this process's PATH (`nsenter` if it is not there).
pub fn nsenter() -> &'static Path {
    static FOUND: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FOUND.get_or_init(|| {
        std::env::var_os("PATH")
            .and_then(|p| {
                std::env::split_paths(&p).map(|d| d.join("nsenter")).find(|f| f.is_file())
            })
            .unwrap_or_else(|| PathBuf::from("nsenter"))
    })
}

/// Runs one CNI plugin binary as a runtime does, inside `netns_of_runtime` (the node's netns).
pub fn run_plugin(
    node: &Path,
    plugin: &Path,
    command: &str,
    conf: &Value,
    env: &[(&str, &str)],
) -> Result<PluginRun> {
    // By its full path: a program found through a PATH the command sets makes std fork (and
    // copy the page tables of) this whole process instead of posix_spawn, which in a benchmark
    // process grown by earlier phases cost about 8 ms per plugin run (`meshpath-bench capture`:
    // 14.6 ms per CNI ADD there, 6.2 in a fresh process, same commit and kernel state).
    let mut child = Command::new(nsenter())
        .arg(format!("--net={}", node.display()))
        .arg(plugin)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env(
            "CNI_PATH",
            format!(
                "{CNI_PLUGINS}:{}",
                sibling_bin("meshpath-cni")
                    .parent()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            ),
        )
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", plugin.display()))?;
    child.stdin.take().context("stdin")?.write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    Ok(PluginRun {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// A pod made through the chain.
#[derive(Debug)]
pub struct CniPod {
    pub name: String,
    pub container_id: String,
    /// The `CNI_ARGS` its ADD had (a runtime gives its DEL and CHECK the same).
    pub args: String,
    pub netns: NetnsGuard,
    /// The chain's final result (what the runtime caches for DEL).
    pub result: Value,
    pub ip: IpAddr,
    /// Its IPv6 address, on a dual-stack node.
    pub ip6: Option<IpAddr>,
}

impl CniPod {
    /// A connection from the pod (its app) to `dst`, captured as the pod's traffic is.
    pub fn connect(&self, dst: SocketAddr) -> std::io::Result<std::net::TcpStream> {
        let c = self
            .netns
            .open()
            .map_err(std::io::Error::other)?
            .run(|| std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(5)))
            .map_err(std::io::Error::other)??;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(c)
    }

    /// As [`CniPod::connect`], from a socket the app bound to `src` first.
    pub fn connect_from(
        &self,
        src: IpAddr,
        dst: SocketAddr,
    ) -> std::io::Result<std::net::TcpStream> {
        let connect = || {
            let domain = socket2::Domain::for_address(dst);
            let sock = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
            sock.bind(&SocketAddr::new(src, 0).into())?;
            sock.connect_timeout(&dst.into(), Duration::from_secs(5))?;
            Ok::<_, std::io::Error>(std::net::TcpStream::from(sock))
        };
        let c = self
            .netns
            .open()
            .map_err(std::io::Error::other)?
            .run(connect)
            .map_err(std::io::Error::other)??;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(c)
    }

    /// `cluster-app ARGS…` as the pod's app (in its netns), its standard input held open
    /// (ending it ends `hold` and `loop --until-stdin-closes`) and its output kept; killed if
    /// the test ends first. [`end_app`] ends it and returns what it printed.
    pub fn cluster_app(&self, args: &[&str]) -> std::io::Result<crate::ChildGuard> {
        let child = Command::new(nsenter())
            .arg(format!("--net={}", self.netns.path().display()))
            .arg(sibling_bin("cluster-app"))
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok(crate::ChildGuard(child))
    }

    /// `cluster-app serve --http HTTP` as the pod's app, returned once its sink (9000), echo
    /// (9100) and HTTP port all listen: a client started before that is refused, and counts as
    /// a connection the proxy lost.
    pub fn cluster_app_server(&self, http: u16) -> Result<crate::ChildGuard> {
        let server = self.cluster_app(&["serve", "--http", &http.to_string()])?;
        for port in [9000, 9100, http] {
            self.netns.wait_listening(port, Duration::from_secs(10))?;
        }
        Ok(server)
    }
}

/// Ends a [`CniPod::cluster_app`] client (its standard input closed): what it printed, and
/// whether it exited 0.
pub fn end_app(mut app: crate::ChildGuard) -> (String, bool) {
    use std::io::Read as _;
    drop(app.0.stdin.take());
    let mut out = String::new();
    if let Some(mut stdout) = app.0.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    let ok = app.0.wait().map(|s| s.success()).unwrap_or(false);
    (out, ok)
}

/// Which node proxy a node runs. The datapath serves both the same way (istio-cni's contract),
/// so a behaviour of the contract is tested with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyKind {
    /// `ztunnel-like` (tests/src/bin/ztunnel-like.rs): only opens sockets in the pods, as
    /// Istio's ztunnel does.
    ZtunnelLike,
    /// meshpath-proxy.
    Meshpath,
}

/// The node.
#[derive(Debug)]
pub struct CniNode {
    pub proxy: Option<TestProxy>,
    pub agent: Option<TestProxy>,
    pub node: NetnsGuard,
    _agent_cgroup: CgroupGuard,
    pub proxy_cgroup: CgroupGuard,
    pub root: PinRoot,
    pub dir: PathBuf,
    pub network: String,
    pub subnet: u8,
    /// The pod range's prefix length (`10.SUBNET.0.0/LEN`): 24 gives 253 pods at once.
    pub prefix_len: u8,
    /// Pods get an IPv6 address too (fd00:SUBNET::/64).
    pub dual_stack: bool,
    /// Whether the agent runs in the node's network namespace (its health endpoint is there).
    agent_in_node_netns: bool,
}

impl Drop for CniNode {
    fn drop(&mut self) {
        self.proxy = None;
        self.agent = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl CniNode {
    /// A node whose workloads file is `workloads` (YAML), with agent and proxy running.
    pub fn start(workloads: &str) -> Result<Self> {
        let node = Self::bare(workloads)?;
        let mut node = node;
        node.start_agent()?;
        node.start_proxy()?;
        Ok(node)
    }

    /// `start`, the proxy with `proxy_args`.
    pub fn start_with(workloads: &str, proxy_args: &[&str]) -> Result<Self> {
        let mut node = Self::bare(workloads)?;
        node.start_agent()?;
        node.start_proxy_with(proxy_args)?;
        Ok(node)
    }

    /// The node with nothing running yet.
    pub fn bare(workloads: &str) -> Result<Self> {
        require_root();
        let dir = std::env::temp_dir().join(unique("meshpath-cni-node-"));
        std::fs::create_dir_all(dir.join("state"))?;
        std::fs::write(dir.join("workloads.yaml"), workloads)?;
        let ca = meshpath_proxy::identity::LocalCa::generate("meshpath test CA")?;
        let (cert, key) = ca.to_pem();
        std::fs::write(dir.join("ca.pem"), cert)?;
        std::fs::write(dir.join("ca-key.pem"), key)?;
        let node = NetnsGuard::new("mp-cninode")?;
        // The node's bridge, made before the plugin would, with an address of its own: a
        // bridge the plugin makes takes the lowest address of its ports, so it changes as pods
        // come, and the bridge plugin's CHECK of an earlier pod then fails ("Bridge interface
        // mpbr0 Mac doesn't match"), as on a node whose bridge the runtime did not pin.
        node.ip(&["link", "add", "mpbr0", "type", "bridge"])?;
        node.ip(&["link", "set", "mpbr0", "address", "02:00:5e:4d:50:01"])?;
        node.ip(&["link", "set", "mpbr0", "up"])?;
        Ok(Self {
            proxy: None,
            agent: None,
            node,
            _agent_cgroup: CgroupGuard::new()?,
            proxy_cgroup: CgroupGuard::new()?,
            root: PinRoot::new(),
            network: unique("mpnet"),
            subnet: 77,
            prefix_len: 24,
            dual_stack: false,
            agent_in_node_netns: true,
            dir,
        })
    }

    pub fn cni_socket(&self) -> PathBuf {
        self.dir.join("cni.sock")
    }

    pub fn zds_socket(&self) -> PathBuf {
        self.dir.join("zds.sock")
    }

    /// Starts (or restarts) the agent; waits until it serves.
    pub fn start_agent(&mut self) -> Result<()> {
        self.start_agent_with(&[])
    }

    /// `start_agent` with more arguments.
    pub fn start_agent_with(&mut self, extra: &[String]) -> Result<()> {
        let mut cmd = self.agent_command(true);
        cmd.arg("--workloads").arg(self.dir.join("workloads.yaml")).args(extra);
        self.spawn_agent(cmd, true)
    }

    /// `meshpath-loader agent` with this node's pins, state, sockets and proxy cgroup rule, in
    /// the node's network namespace or in the test's own.
    fn agent_command(&self, in_node_netns: bool) -> Command {
        let mut cmd = if in_node_netns {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", self.node.path().display())).arg(loader_bin());
            c
        } else {
            Command::new(loader_bin())
        };
        cmd.arg("--pin-root")
            .arg(self.root.path())
            .arg("agent")
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--cni-socket")
            .arg(self.cni_socket())
            .arg("--zds-socket")
            .arg(self.zds_socket())
            .arg("--proxy-cgroup-from-zds-peer")
            .arg("--health-addr")
            .arg("127.0.0.1:0")
            .env("RUST_LOG", "info");
        cmd
    }

    fn spawn_agent(&mut self, cmd: Command, in_node_netns: bool) -> Result<()> {
        self.agent = None;
        self.agent_in_node_netns = in_node_netns;
        self.agent = Some(TestProxy::spawn_as("agent", cmd, &self._agent_cgroup)?);
        Ok(())
    }

    /// Starts (or restarts) the node proxy of `kind`.
    pub fn start_node_proxy(&mut self, kind: ProxyKind) -> Result<()> {
        match kind {
            ProxyKind::ZtunnelLike => self.start_ztunnel_like(),
            ProxyKind::Meshpath => self.start_proxy(),
        }
    }

    /// Starts (or restarts) the proxy; waits until the agent's snapshot is applied.
    pub fn start_proxy(&mut self) -> Result<()> {
        self.start_proxy_with(&[])
    }

    /// `start_proxy` with more arguments.
    pub fn start_proxy_with(&mut self, extra: &[&str]) -> Result<()> {
        self.start_proxy_in(&[], extra)
    }

    /// Starts (or restarts) the agent in Kubernetes mode: it learns the node's pods from the API
    /// server behind `kubeconfig`, as node `node_name`. It runs in the test's own network
    /// namespace, where the API server listens (its CNI and ZDS sockets are unix sockets).
    pub fn start_agent_kube(&mut self, kubeconfig: &Path, node_name: &str) -> Result<()> {
        let mut cmd = self.agent_command(false);
        cmd.arg("--kube").arg("--kubeconfig").arg(kubeconfig).arg("--node-name").arg(node_name);
        self.spawn_agent(cmd, false)
    }

    /// Creates pod `name` of `namespace`: loopback, then the chain's ADD.
    pub fn add_pod_in(&self, namespace: &str, name: &str) -> Result<CniPod> {
        self.add_pod_ns_with(namespace, name, &self.conflist(&self.cni_socket()))
    }

    /// The agent's `/readyz`: `Some(true)` 200, `Some(false)` anything else, `None` unreachable.
    pub fn agent_ready(&self) -> Option<bool> {
        self.agent_http("/readyz").map(|(ok, _)| ok)
    }

    /// The sum of the agent's metric `name` over series carrying `labels` (its `/metrics`).
    pub fn agent_metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        Ok(super::sum_metric(&self.agent_metrics_text()?, name, labels))
    }

    /// The agent's `/metrics`, as Prometheus scrapes it.
    pub fn agent_metrics_text(&self) -> Result<String> {
        let (ok, body) = self.agent_http("/metrics").context("the agent is unreachable")?;
        anyhow::ensure!(ok, "/metrics answered: {body}");
        Ok(body)
    }

    /// GET `path` from the agent's health endpoint: (200?, body).
    fn agent_http(&self, path: &str) -> Option<(bool, String)> {
        let agent = self.agent.as_ref()?;
        let addr: SocketAddr = agent
            .lines()
            .iter()
            .find_map(|l| l.strip_prefix("HEALTH ").map(str::to_owned))?
            .parse()
            .ok()?;
        let connect = || std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2));
        let mut conn = if self.agent_in_node_netns {
            self.node.open().ok()?.run(connect).ok()?.ok()?
        } else {
            connect().ok()?
        };
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let req = format!("GET {path} HTTP/1.0\r\n\r\n");
        std::io::Write::write_all(&mut conn, req.as_bytes()).ok()?;
        let mut resp = String::new();
        std::io::Read::read_to_string(&mut conn, &mut resp).ok()?;
        let ok = resp.starts_with("HTTP/1.0 200") || resp.starts_with("HTTP/1.1 200");
        let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        Some((ok, body))
    }

    /// Starts (or restarts) `ztunnel-like` as the node's proxy instead of meshpath-proxy (a
    /// proxy written for istio-cni that gives the datapath no help); waits until the agent's
    /// snapshot is applied.
    pub fn start_ztunnel_like(&mut self) -> Result<()> {
        self.proxy = None;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.node.path().display()))
            .arg(sibling_bin("ztunnel-like"))
            .arg(self.zds_socket())
            .arg(self.dir.join("ca.pem"))
            .arg(self.dir.join("ca-key.pem"))
            .arg(self.dir.join("workloads.yaml"));
        self.proxy = Some(TestProxy::spawn(cmd, &self.proxy_cgroup)?);
        Ok(())
    }

    /// Starts (or restarts) Istio's ztunnel (`bin`: a build of istio/ztunnel with its `testing`
    /// feature, as ../shared/notes/hbone.md says) as the node's proxy, unchanged, in shared
    /// (in-pod) mode on the agent's ZDS socket, in network namespace `netns` (its pod's, under
    /// Kubernetes: two of them may run at once, each its own admin and readiness ports):
    /// workloads from `local_xds` (ztunnel's local configuration file), certificates from its
    /// fake CA, `drain` to finish connections on SIGTERM. For comparisons run by hand: CI has
    /// no ztunnel build. Waits until it has acknowledged the agent's snapshot.
    pub fn start_ztunnel(
        &mut self,
        bin: &Path,
        netns: &Path,
        local_xds: &Path,
        drain: Duration,
    ) -> Result<()> {
        self.proxy = None;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", netns.display()))
            .arg(bin)
            .arg("proxy")
            .env("PROXY_MODE", "shared")
            .env("INPOD_UDS", self.zds_socket())
            .env("XDS_ADDRESS", "")
            .env("LOCAL_XDS_PATH", local_xds)
            .env("FAKE_CA", "true")
            .env("NODE_NAME", "meshpath-test-node")
            .env("POD_NAME", "ztunnel-test")
            .env("POD_NAMESPACE", "istio-system")
            .env("CONNECTION_TERMINATION_DEADLINE", format!("{}s", drain.as_secs()))
            .env("RUST_LOG", "info");
        // It prints no `READY` line: its log says when it has the agent's snapshot.
        let p = TestProxy::spawn_unready(cmd, &self.proxy_cgroup)?;
        if !p.wait_for_text("received snapshot sent", Duration::from_secs(20)) {
            bail!("ztunnel did not get the agent's snapshot:\n{}", p.lines().join("\n"));
        }
        self.proxy = Some(p);
        Ok(())
    }

    /// The proxy as a container runtime runs it: in a mount namespace of its own where
    /// `/proc/sys` is read-only.
    pub fn start_proxy_contained(&mut self) -> Result<()> {
        let ro_proc_sys = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec \"$0\" \"$@\"";
        self.start_proxy_in(
            &["unshare", "--mount", "--propagation", "private", "sh", "-c", ro_proc_sys],
            &[],
        )
    }

    /// Starts (or restarts) meshpath-proxy following `istiod` (the stand-in, listening in this
    /// node's netns) for workloads, policies and certificates, as the DaemonSet runs it; waits
    /// until the agent's snapshot is applied (readiness also needs istiod's first push).
    /// `extra`: more arguments.
    pub fn start_proxy_xds(
        &mut self,
        istiod: &crate::istiod::Istiod,
        extra: &[&str],
    ) -> Result<()> {
        self.proxy = None;
        let token = istiod.token_file("cni-node-token", "node-token")?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.node.path().display()))
            .arg(sibling_bin("meshpath-proxy"))
            .arg("--zds-socket")
            .arg(self.zds_socket())
            .args(["--xds-address", &istiod.url(0), "--ca-address", &istiod.url(0)])
            .arg("--xds-root-ca")
            .arg(&istiod.root_pem)
            .arg("--ca-root-ca")
            .arg(&istiod.root_pem)
            .args(["--alt-xds-hostname", "istiod.istio-system.svc"])
            .args(["--alt-ca-hostname", "istiod.istio-system.svc"])
            .arg("--auth-token")
            .arg(token)
            .args(["--cluster-id", "Kubernetes"])
            .args(extra)
            .env("RUST_LOG", "info");
        let p = TestProxy::spawn(cmd, &self.proxy_cgroup)?;
        if !p.wait_for_text("snapshot from the node agent applied", Duration::from_secs(10)) {
            bail!("the proxy did not get the agent's snapshot:\n{}", p.lines().join("\n"));
        }
        self.proxy = Some(p);
        Ok(())
    }

    /// `start_proxy` behind `wrapper` (a command that execs its arguments).
    fn start_proxy_in(&mut self, wrapper: &[&str], extra: &[&str]) -> Result<()> {
        self.proxy = None;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.node.path().display()))
            .args(wrapper)
            .arg(sibling_bin("meshpath-proxy"))
            .arg("--zds-socket")
            .arg(self.zds_socket())
            .arg("--workloads")
            .arg(self.dir.join("workloads.yaml"))
            .arg("--ca-cert")
            .arg(self.dir.join("ca.pem"))
            .arg("--ca-key")
            .arg(self.dir.join("ca-key.pem"))
            .arg("--refresh-ms")
            .arg("100")
            .args(extra)
            .env("RUST_LOG", "info");
        let p = TestProxy::spawn(cmd, &self.proxy_cgroup)?;
        if !p.wait_for_text("snapshot from the node agent applied", Duration::from_secs(10)) {
            bail!("the proxy did not get the agent's snapshot:\n{}", p.lines().join("\n"));
        }
        self.proxy = Some(p);
        Ok(())
    }

    /// The chain's configuration list.
    pub fn conflist(&self, agent_socket: &Path) -> Value {
        json!({
            "cniVersion": "1.0.0",
            "name": self.network,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "mpbr0",
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "ranges": self.ranges(),
                        "dataDir": self.dir.join("ipam").display().to_string()
                    }
                },
                {"type": "meshpath-cni", "agentSocket": agent_socket.display().to_string()}
            ]
        })
    }

    fn ranges(&self) -> Value {
        let v4 = format!("10.{}.0.0/{}", self.subnet, self.prefix_len);
        let mut ranges = vec![json!([{"subnet": v4}])];
        if self.dual_stack {
            ranges.push(json!([{"subnet": format!("fd00:{}::/64", self.subnet)}]));
        }
        Value::Array(ranges)
    }

    pub fn plugin_path(kind: &str) -> PathBuf {
        if kind == "meshpath-cni" {
            sibling_bin("meshpath-cni")
        } else {
            Path::new(CNI_PLUGINS).join(kind)
        }
    }

    /// Runs the chain's `command` for one pod, as a runtime: each plugin with the list's
    /// version and name, and (after the first) the previous plugin's result. Stops at the first
    /// failure and returns it.
    pub fn run_chain(
        &self,
        list: &Value,
        command: &str,
        env: &[(&str, &str)],
        cached: Option<&Value>,
    ) -> Result<std::result::Result<Value, PluginRun>> {
        let plugins = list["plugins"].as_array().context("plugins")?.clone();
        let order: Vec<Value> =
            if command == "DEL" { plugins.into_iter().rev().collect() } else { plugins };
        let mut prev = cached.cloned();
        for p in order {
            let mut conf = p.clone();
            conf["cniVersion"] = list["cniVersion"].clone();
            conf["name"] = list["name"].clone();
            if let Some(prev) = &prev {
                conf["prevResult"] = prev.clone();
            }
            let kind = p["type"].as_str().context("type")?;
            let run = run_plugin(
                self.node.path().as_path(),
                &Self::plugin_path(kind),
                command,
                &conf,
                env,
            )?;
            if !run.success {
                return Ok(Err(run));
            }
            if command == "ADD" {
                prev = Some(run.json());
            }
        }
        Ok(Ok(prev.unwrap_or(Value::Null)))
    }

    /// The environment a runtime gives the chain.
    pub fn env<'a>(
        container_id: &'a str,
        netns: &'a str,
        args: &'a str,
    ) -> Vec<(&'a str, &'a str)> {
        vec![
            ("CNI_CONTAINERID", container_id),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", args),
        ]
    }

    /// Creates pod `name` (namespace `default`): loopback, then the chain's ADD.
    pub fn add_pod(&self, name: &str) -> Result<CniPod> {
        self.add_pod_with(name, &self.conflist(&self.cni_socket()))
    }

    pub fn add_pod_with(&self, name: &str, list: &Value) -> Result<CniPod> {
        self.add_pod_ns_with("default", name, list)
    }

    /// Creates pod `name` of `namespace` with the chain `list`.
    pub fn add_pod_ns_with(&self, namespace: &str, name: &str, list: &Value) -> Result<CniPod> {
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        self.add_sandbox(name, args, list)
    }

    /// Creates a sandbox of pod `name` of `namespace` whose runtime passes the pod's uid
    /// (`K8S_POD_UID`), as containerd and CRI-O do.
    pub fn add_pod_as(&self, namespace: &str, name: &str, uid: &str) -> Result<CniPod> {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_UID={uid}"
        );
        self.add_sandbox(name, args, &self.conflist(&self.cni_socket()))
    }

    /// A new sandbox (netns, container id) for pod `name`, set up by the chain `list`.
    fn add_sandbox(&self, name: &str, args: String, list: &Value) -> Result<CniPod> {
        let netns = NetnsGuard::new("mp-cnipod")?;
        let container_id = unique("ctr");
        let path = netns.path().display().to_string();
        let env = Self::env(&container_id, &path, &args);
        let lo = json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback"});
        let run = run_plugin(
            self.node.path().as_path(),
            &Self::plugin_path("loopback"),
            "ADD",
            &lo,
            &env,
        )?;
        if !run.success {
            bail!("loopback ADD: {}{}", run.stdout, run.stderr);
        }
        match self.run_chain(list, "ADD", &env, None)? {
            Ok(result) => {
                let ips: Vec<IpAddr> = result["ips"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|i| i["address"].as_str()?.split('/').next()?.parse().ok())
                    .collect();
                let ip = *ips
                    .iter()
                    .find(|i| i.is_ipv4())
                    .context("no IPv4 address in the chain's result")?;
                let ip6 = ips.iter().find(|i| i.is_ipv6()).copied();
                Ok(CniPod { name: name.into(), container_id, args, netns, result, ip, ip6 })
            }
            Err(run) => {
                // As a runtime does after a failed ADD: DEL the whole chain, then drop the netns.
                let _ = self.run_chain(list, "DEL", &env, None);
                bail!("ADD failed: {}{}", run.stdout, run.stderr)
            }
        }
    }

    /// The chain's DEL for `pod` (with `netns` as given: runtimes send "" the second time).
    pub fn del_pod(&self, pod: &CniPod, netns: &str) -> Result<std::result::Result<(), PluginRun>> {
        let env = Self::env(&pod.container_id, netns, &pod.args);
        Ok(self
            .run_chain(&self.conflist(&self.cni_socket()), "DEL", &env, Some(&pod.result))?
            .map(drop))
    }

    /// The chain's CHECK for `pod`.
    pub fn check_pod(&self, pod: &CniPod) -> Result<std::result::Result<(), PluginRun>> {
        let path = pod.netns.path().display().to_string();
        let env = Self::env(&pod.container_id, &path, &pod.args);
        Ok(self
            .run_chain(&self.conflist(&self.cni_socket()), "CHECK", &env, Some(&pod.result))?
            .map(drop))
    }

    /// Pods enrolled in this node's datapath (netns cookies).
    pub fn enrolled(&self) -> Vec<u64> {
        let Ok(dp) = self.root.datapath() else { return Vec::new() };
        dp.pods().map(|m| m.keys().flatten().collect()).unwrap_or_default()
    }

    /// Pod records in the agent's state directory.
    pub fn records(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.dir.join("state/pods"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect()
    }

    /// The proxy's workload store learns the address of the HBONE workload with service
    /// account `service_account` in `workloads` (as a control plane would tell it): outbound
    /// connections to it then go over HBONE. Waits for the proxy's reload.
    pub fn publish_address(&self, workloads: &str, service_account: &str, ip: IpAddr) {
        let entry = format!("serviceAccount: {service_account}, protocol: HBONE}}");
        assert!(workloads.contains(&entry), "no {entry} in the workloads");
        let known = workloads.replace(
            &entry,
            &format!("serviceAccount: {service_account}, protocol: HBONE, workloadIps: [{ip}]}}"),
        );
        std::fs::write(self.dir.join("workloads.yaml"), known).expect("workloads");
        // Its store, not a log line: a reload that read the file half written logs one too.
        let ip = format!("\"{ip}\"");
        let known = crate::wait_until(std::time::Duration::from_secs(10), || {
            self.proxy_config_dump().is_ok_and(|d| d["workloads"].to_string().contains(&ip))
        });
        assert!(known, "the proxy's store did not take {service_account}'s address {ip}");
    }

    /// The proxy's admin view: uids of the pods it serves.
    pub fn proxy_pods(&self) -> Result<Vec<String>> {
        let dump = self.proxy_config_dump()?;
        Ok(dump["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["uid"].as_str().map(str::to_owned))
            .collect())
    }

    /// The proxy's `/config_dump`.
    pub fn proxy_config_dump(&self) -> Result<Value> {
        let p = self.proxy.as_ref().context("no proxy")?;
        NodeProxyView { proxy: p, node: &self.node }.config_dump()
    }

    /// The sum of the proxy's metric `name` over series with `labels`.
    pub fn proxy_metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        Ok(super::sum_metric(&self.proxy_metrics_text()?, name, labels))
    }

    /// The proxy's `/metrics`, as Prometheus scrapes it.
    pub fn proxy_metrics_text(&self) -> Result<String> {
        let p = self.proxy.as_ref().context("no proxy")?;
        let (status, body) = NodeProxy::http_in(p, &self.node, "STATS", "GET", "/metrics")?;
        anyhow::ensure!(status == 200, "/metrics answered {status}");
        Ok(body)
    }

    /// The waypoint stand-in (tests/waypoint-standin) in a netns of its own at
    /// `two_nodes::WAYPOINT_IP`, linked to the node's netns (which routes the pods to it), with
    /// a certificate from the node's CA; it carries what it is sent on to `upstream_sa`.
    pub fn waypoint(&self, upstream_sa: &str) -> Result<crate::two_nodes::WaypointStandIn> {
        let netns = NetnsGuard::new("mpw")?;
        let w = &netns;
        let ip = crate::two_nodes::WAYPOINT_IP;
        self.node.ip(&[
            "link",
            "add",
            "wpn",
            "type",
            "veth",
            "peer",
            "name",
            "wp0",
            "netns",
            w.name(),
        ])?;
        self.node.ip(&["addr", "add", "10.198.0.1/24", "dev", "wpn"])?;
        self.node.ip(&["link", "set", "wpn", "up"])?;
        w.ip(&["addr", "add", &format!("{ip}/24"), "dev", "wp0"])?;
        w.ip(&["link", "set", "wp0", "up"])?;
        w.ip(&["link", "set", "lo", "up"])?;
        w.ip(&["route", "add", "default", "via", "10.198.0.1"])?;
        let ca = meshpath_proxy::identity::LocalCa::from_pem(
            &std::fs::read_to_string(self.dir.join("ca.pem"))?,
            &std::fs::read_to_string(self.dir.join("ca-key.pem"))?,
        )?;
        Ok(crate::two_nodes::WaypointStandIn::spawn(netns, &self.dir, &ca, upstream_sa, &[]))
    }

    /// A TCP echo server in `pod` on `port`, until the test ends.
    pub fn echo_server(&self, pod: &CniPod, port: u16) -> Result<()> {
        let l = pod.netns.listen(SocketAddr::new(pod.ip, port))?;
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut c = c;
                    let mut r = c.try_clone()?;
                    std::io::copy(&mut r, &mut c)
                });
            }
        });
        Ok(())
    }
}

/// Borrowed view to reuse NodeProxy's HTTP helpers on a CniNode's proxy.
struct NodeProxyView<'a> {
    proxy: &'a TestProxy,
    node: &'a NetnsGuard,
}

impl NodeProxyView<'_> {
    fn config_dump(&self) -> Result<Value> {
        let (status, body) =
            NodeProxy::http_in(self.proxy, self.node, "ADMIN", "GET", "/config_dump")?;
        anyhow::ensure!(status == 200, "/config_dump answered {status}");
        Ok(serde_json::from_str(&body)?)
    }
}

/// Routes two nodes' pod subnets to each other over a link between the nodes' netns
/// (10.200.0.1/30 on `a`, .2 on `b`), as a cluster's network does (their subnets must differ).
pub fn link_nodes(a: &CniNode, b: &CniNode) -> Result<()> {
    a.node.ip(&[
        "link",
        "add",
        "mpnodes",
        "type",
        "veth",
        "peer",
        "name",
        "mpnodes",
        "netns",
        b.node.name(),
    ])?;
    for (n, me, via, other) in
        [(a, "10.200.0.1/30", "10.200.0.2", b), (b, "10.200.0.2/30", "10.200.0.1", a)]
    {
        n.node.ip(&["addr", "add", me, "dev", "mpnodes"])?;
        n.node.ip(&["link", "set", "mpnodes", "up"])?;
        n.node.ip(&["route", "add", &format!("10.{}.0.0/24", other.subnet), "via", via])?;
        let forward = Command::new(nsenter())
            .arg(format!("--net={}", n.node.path().display()))
            .args(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
            .status()?;
        anyhow::ensure!(forward.success(), "forwarding on in {}", n.node.name());
    }
    Ok(())
}

/// Routes `pod`, of node `on`, to node `to`'s pods through its own node (the bridge plugin
/// routes only the pod's subnet).
pub fn route_pod(pod: &CniPod, on: &CniNode, to: &CniNode) -> Result<()> {
    let (subnet, gateway) = (format!("10.{}.0.0/24", to.subnet), format!("10.{}.0.1", on.subnet));
    pod.netns.ip(&["route", "add", &subnet, "via", &gateway]).map(drop)
}
