//! `cargo xtask demo`: two local nodes in network namespaces, run the way a real node runs
//! meshpath.
//!
//! Each node namespace gets the node agent (`meshpath-loader agent`: its own datapath, which it
//! loads and pins) and the node proxy (`meshpath-proxy --zds-socket`, in a cgroup of its own
//! that the agent registers as the proxy's when it connects over ZDS). The agent installs
//! `meshpath-cni` into the node's CNI directories and appends it to the node's bridge
//! configuration list. Pods are then created through that real CNI chain — Debian's loopback,
//! bridge and host-local, then meshpath-cni — invoked as a runtime invokes it. The nodes are
//! joined by a veth link with routes between their pod subnets.
//!
//! Traffic: iperf3 from `sleep` (node 1) to `httpbin` (node 2), captured by eBPF and carried
//! over HBONE with mutual TLS between the two proxies; `sleep` to `legacy` (node 2, not in the
//! mesh) by plain passthrough; `sleep` to service `httpbin-l7`, which a waypoint serves (the
//! tests' waypoint stand-in, `tests/waypoint-standin`, in pod `waypoint` on node 2: Envoy cannot
//! run here), through the waypoint; and a connection to a port that policy denies. A summary
//! from both proxies' /metrics follows. Everything is removed on exit, on error and on Ctrl-C;
//! `--keep` leaves it running (until Ctrl-C) with the commands to look around.
//!
//! `--kube` also runs a Kubernetes API server (etcd and kube-apiserver, on loopback): the
//! agents run in Kubernetes mode (`--kube`), the `default` namespace is labelled
//! `istio.io/dataplane-mode=ambient`, `legacy` lives in an unlabelled namespace, and every pod
//! is made with the API before the runtime's CNI ADD; the demo shows the annotation the agents
//! wrote back.
//!
//! `--proxy ztunnel-like` runs the same nodes with `ztunnel-like` as both nodes' proxy (the
//! tests' stand-in for Istio's ztunnel: it only opens sockets in the pods, marks them 0x539,
//! and speaks HBONE); it has no policy, no metrics and no waypoints, so the demo shows its
//! connection lines instead and skips the waypoint and the denial.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

/// The pods: (name, node, service account, meshed).
const PODS: [(&str, usize, &str, bool); 4] = [
    ("sleep", 1, "sleep", true),
    ("httpbin", 2, "httpbin", true),
    ("legacy", 2, "legacy", false),
    // The waypoint stand-in's pod: a waypoint is not captured, as in Istio.
    ("waypoint", 2, "waypoint", false),
];
/// Service `httpbin-l7`'s VIP and port: a waypoint serves it.
const L7_VIP: &str = "10.96.0.80:80";
/// Where the waypoint sends what it gets for `L7_VIP`: httpbin's port.
const L7_PORT: u16 = 5202;
/// The port policy denies on httpbin.
const DENIED_PORT: u16 = 9090;

/// Which node proxy the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proxy {
    Meshpath,
    ZtunnelLike,
}

/// One node's pieces.
struct NodeDirs {
    n: usize,
    dir: PathBuf,
    pin_root: PathBuf,
    cgroup: PathBuf,
}

impl NodeDirs {
    fn ns(&self, tag: &str) -> String {
        format!("mp-demo-node{}-{tag}", self.n)
    }
    fn subnet(&self) -> String {
        format!("10.244.{}.0/24", self.n)
    }
    fn bin(&self) -> PathBuf {
        self.dir.join("cni/bin")
    }
    fn conf(&self) -> PathBuf {
        self.dir.join("cni/net.d")
    }
}

/// Everything the demo made, removed on drop.
struct Demo {
    tag: String,
    proxy: Proxy,
    /// The API server when the demo runs with `--kube`.
    api: Option<crate::kube_api::ApiServer>,
    bin_dir: PathBuf,
    files: PathBuf,
    nodes: Vec<NodeDirs>,
    namespaces: Vec<String>,
    children: Vec<Child>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        println!("demo: cleaning up");
        // Proxies and agents first, then what they used.
        for mut c in self.children.drain(..).rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for n in &self.nodes {
            let _ = fs::remove_dir_all(&n.pin_root);
            for _ in 0..50 {
                if fs::remove_dir(&n.cgroup).is_ok() || !n.cgroup.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for ns in self.namespaces.drain(..).rev() {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
        let _ = fs::remove_dir_all(&self.files);
    }
}

fn sh(program: &str, args: &[&str]) -> Result<()> {
    let out =
        Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The cgroup v2 mount point, from /proc/self/mountinfo.
fn cgroup2_root() -> Result<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    info.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split_whitespace().next() == Some("cgroup2"))
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .context("cgroup v2 is not mounted")
}

/// Runs `f` on a thread inside the network namespace at `netns`.
fn in_netns<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let file = fs::File::open(netns).with_context(|| format!("opening {netns}"))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on this thread only, with an open namespace file.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("setns {netns}: {}", std::io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("thread in {netns} panicked"))?
    })
}

/// An HTTP GET to `addr` from inside `netns`: the body.
fn http_get(netns: &str, addr: SocketAddr, path: &str) -> Result<String> {
    in_netns(netns, || -> Result<String> {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(c, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut resp = String::new();
        c.read_to_string(&mut resp)?;
        Ok(resp.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
    })?
}

/// Spawns `cmd` into `cgroup` (if given) with its output to `log`.
fn spawn_logged(mut cmd: Command, cgroup: Option<&Path>, log: &Path) -> Result<Child> {
    let out = fs::File::create(log)?;
    cmd.stdout(out.try_clone()?).stderr(out);
    if let Some(cg) = cgroup {
        let procs = fs::OpenOptions::new().write(true).open(cg.join("cgroup.procs"))?;
        let fd = procs.as_raw_fd();
        // SAFETY: only write(2) between fork and exec, on an fd open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        drop(procs);
        return Ok(child);
    }
    Ok(cmd.spawn()?)
}

/// Waits for `needle` in the log file.
fn wait_for(log: &Path, needle: &str, what: &str) -> Result<()> {
    for _ in 0..200 {
        if fs::read_to_string(log).is_ok_and(|t| t.contains(needle)) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "{what} did not start; its log ({}):\n{}",
        log.display(),
        fs::read_to_string(log).unwrap_or_default()
    )
}

/// Runs one CNI plugin as a runtime does. (tests/src/cni_node.rs has the same runner: xtask
/// builds before the eBPF toolchain exists, so it cannot depend on the tests crate.)
fn cni(
    node_ns: &str,
    plugin: &Path,
    cni_path: &str,
    command: &str,
    conf: &Value,
    env: &[(&str, &str)],
) -> Result<Value> {
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{node_ns}"))
        .arg(plugin)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_PATH", cni_path)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", plugin.display()))?;
    child.stdin.take().context("stdin")?.write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{} {command}: {}{}",
            plugin.display(),
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(serde_json::from_slice(&out.stdout).unwrap_or(Value::Null))
}

impl Demo {
    fn add_netns(&mut self, name: &str) -> Result<()> {
        sh("ip", &["netns", "add", name])?;
        self.namespaces.push(name.to_owned());
        sh("ip", &["-n", name, "link", "set", "lo", "up"])
    }

    /// Node `n`: its namespace, CNI directories with a bridge configuration list, its agent and
    /// its proxy.
    fn start_node(&mut self, n: usize) -> Result<()> {
        let dir = self.files.join(format!("node{n}"));
        let node = NodeDirs {
            n,
            pin_root: PathBuf::from(format!("/sys/fs/bpf/meshpath-demo-{}-node{n}", self.tag)),
            cgroup: cgroup2_root()?.join(format!("meshpath-demo-{}-proxy{n}", self.tag)),
            dir,
        };
        let ns = node.ns("host");
        self.add_netns(&ns)?;
        fs::create_dir_all(node.bin())?;
        fs::create_dir_all(node.conf())?;
        fs::create_dir_all(&node.cgroup)?;
        let list = json!({
            "cniVersion": "1.0.0",
            "name": "demo",
            "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": node.subnet()}]],
                         "routes": [{"dst": "0.0.0.0/0"}],
                         "dataDir": node.dir.join("ipam").display().to_string()}
            }]
        });
        fs::write(node.conf().join("10-demo.conflist"), serde_json::to_string_pretty(&list)?)?;
        let netns = format!("--net=/var/run/netns/{ns}");
        // With the API server (on this host's loopback) the agents run in the host's netns,
        // where they reach it; their CNI and ZDS sockets are unix sockets either way.
        let mut agent = if self.api.is_some() {
            Command::new(self.bin_dir.join("meshpath-loader"))
        } else {
            let mut c = Command::new("nsenter");
            c.arg(&netns).arg(self.bin_dir.join("meshpath-loader"));
            c
        };
        agent
            .arg("--pin-root")
            .arg(&node.pin_root)
            .arg("agent")
            .arg("--state-dir")
            .arg(node.dir.join("state"))
            .arg("--cni-socket")
            .arg(node.dir.join("cni.sock"))
            .arg("--zds-socket")
            .arg(node.dir.join("zds.sock"))
            .arg("--cni-bin-dir")
            .arg(node.bin())
            .arg("--cni-conf-dir")
            .arg(node.conf())
            .arg("--proxy-cgroup-from-zds-peer");
        match &self.api {
            Some(api) => {
                agent
                    .arg("--kube")
                    .arg("--kubeconfig")
                    .arg(&api.kubeconfig)
                    .args(["--node-name", &format!("node{n}")])
                    .args(["--health-addr", "127.0.0.1:0"]);
            }
            None => {
                agent
                    .arg("--workloads")
                    .arg(self.files.join("workloads.yaml"))
                    .arg("--probe-source")
                    .args(["--health-addr", "127.0.0.1:8000"]);
            }
        }
        let log = node.dir.join("agent.log");
        self.children.push(spawn_logged(agent, None, &log)?);
        wait_for(&log, "agent serving", "the node agent")?;
        let mut proxy = Command::new("nsenter");
        proxy.arg(&netns);
        let ready = match self.proxy {
            Proxy::Meshpath => {
                proxy
                    .arg(self.bin_dir.join("meshpath-proxy"))
                    .arg("--zds-socket")
                    .arg(node.dir.join("zds.sock"))
                    .arg("--workloads")
                    .arg(self.files.join("workloads.yaml"))
                    .arg("--ca-cert")
                    .arg(self.files.join("ca.pem"))
                    .arg("--ca-key")
                    .arg(self.files.join("ca-key.pem"))
                    .arg("--refresh-ms")
                    .arg("200")
                    .env("RUST_LOG", "info");
                "snapshot from the node agent applied"
            }
            Proxy::ZtunnelLike => {
                proxy
                    .arg(self.bin_dir.join("ztunnel-like"))
                    .arg(node.dir.join("zds.sock"))
                    .arg(self.files.join("ca.pem"))
                    .arg(self.files.join("ca-key.pem"))
                    .arg(self.files.join("workloads.yaml"));
                "READY"
            }
        };
        let log = node.dir.join("proxy.log");
        self.children.push(spawn_logged(proxy, Some(&node.cgroup), &log)?);
        wait_for(&log, ready, "the node proxy")?;
        // The agent appends meshpath-cni to the node's chain within a second.
        for _ in 0..100 {
            if fs::read_to_string(node.conf().join("10-demo.conflist"))
                .is_ok_and(|t| t.contains("meshpath-cni"))
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!(
            "demo: node{n}: agent and proxy up; the agent installed {} and chained it in {}",
            node.bin().join("meshpath-cni").display(),
            node.conf().join("10-demo.conflist").display()
        );
        self.nodes.push(node);
        Ok(())
    }

    /// Creates a pod through node `n`'s CNI chain, as a runtime: loopback, then each plugin of
    /// the configuration list with the previous one's result. Returns its IPv4 address.
    fn add_pod(&mut self, name: &str, n: usize) -> Result<Ipv4Addr> {
        let node = self.nodes.iter().find(|d| d.n == n).context("no such node")?;
        let (node_ns, bin, conf) = (node.ns("host"), node.bin(), node.conf());
        let pod_ns = format!("mp-demo-{}-{name}", self.tag);
        self.add_netns(&pod_ns)?;
        let list: Value =
            serde_json::from_str(&fs::read_to_string(conf.join("10-demo.conflist"))?)?;
        let cni_path = format!("/usr/lib/cni:{}", bin.display());
        let netns = format!("/var/run/netns/{pod_ns}");
        let namespace = pod_namespace(name, self.api.is_some());
        if let Some(api) = &self.api {
            // As a user would: the Pod object first; the scheduler's part is spec.nodeName.
            let sa = PODS.iter().find(|p| p.0 == name).map_or("default", |p| p.2);
            api.request(
                "POST",
                &format!("/api/v1/namespaces/{namespace}/pods"),
                Some(&json!({
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"nodeName": format!("node{n}"), "serviceAccountName": sa,
                             "containers": [{"name": "app", "image": "app"}]}
                })),
            )?;
        }
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let id = format!("demo-{}-{name}", self.tag);
        let env = [
            ("CNI_CONTAINERID", id.as_str()),
            ("CNI_NETNS", netns.as_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", args.as_str()),
        ];
        cni(
            &node_ns,
            Path::new("/usr/lib/cni/loopback"),
            &cni_path,
            "ADD",
            &json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback"}),
            &env,
        )?;
        let mut prev: Option<Value> = None;
        for p in list["plugins"].as_array().context("plugins")? {
            let kind = p["type"].as_str().context("type")?;
            let plugin = if kind == "meshpath-cni" {
                bin.join(kind)
            } else {
                Path::new("/usr/lib/cni").join(kind)
            };
            let mut c = p.clone();
            c["cniVersion"] = list["cniVersion"].clone();
            c["name"] = list["name"].clone();
            if let Some(prev) = &prev {
                c["prevResult"] = prev.clone();
            }
            prev = Some(cni(&node_ns, &plugin, &cni_path, "ADD", &c, &env)?);
        }
        let result = prev.context("empty chain")?;
        let ip = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .context("no address in the chain's result")?;
        Ok(ip)
    }
}

/// The workloads file: pod identities for the agents, addresses and policy for the proxies.
fn workloads(ips: &[(&str, Ipv4Addr)]) -> String {
    let mut y = String::from("workloads:\n");
    for (name, _, sa, meshed) in PODS {
        let ip = ips
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, ip)| format!("[\"{ip}\"]"))
            .unwrap_or_else(|| "[]".into());
        y += &format!(
            "- {{uid: uid-{name}, name: {name}, namespace: default, serviceAccount: {sa}, protocol: {}, workloadIps: {ip}}}\n",
            if meshed { "HBONE" } else { "TCP" }
        );
    }
    if let Some((_, wp)) = ips.iter().find(|(n, _)| *n == "waypoint") {
        let (vip, port) = L7_VIP.split_once(':').unwrap_or_default();
        y += &format!(
            "services:\n- {{name: httpbin-l7, namespace: default, hostname: httpbin-l7.default.svc.cluster.local, vips: [\"/{vip}\"], ports: {{{port}: {L7_PORT}}}, waypoint: {{destination: {{address: \"/{wp}\"}}}}}}\n"
        );
    }
    y += &format!(
        "policies:\n- {{name: no-{DENIED_PORT}, namespace: default, scope: Namespace, action: Deny, rules: [[[{{destinationPorts: [{DENIED_PORT}]}}]]]}}\n"
    );
    y
}

fn iperf3(client_ns: &str, server_ns: &str, ip: Ipv4Addr, port: u16, secs: u32) -> Result<String> {
    iperf3_to(client_ns, server_ns, (ip, port), SocketAddr::from((ip, port)), secs)
}

/// iperf3 served at `server` (in `server_ns`), the client (in `client_ns`) asking for `dst`.
fn iperf3_to(
    client_ns: &str,
    server_ns: &str,
    (ip, port): (Ipv4Addr, u16),
    dst: SocketAddr,
    secs: u32,
) -> Result<String> {
    let port_s = port.to_string();
    let mut server = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{server_ns}"))
        .args(["iperf3", "-s", "-1", "-B", &ip.to_string(), "-p", &port_s])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s")?;
    std::thread::sleep(Duration::from_millis(300));
    let client = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{client_ns}"))
        .args(["iperf3", "-c", &dst.ip().to_string(), "-p", &dst.port().to_string()])
        .args(["-t", &secs.to_string(), "-f", "g"])
        .output()
        .context("running iperf3 -c")?;
    let _ = server.kill();
    let _ = server.wait();
    if !client.status.success() {
        bail!(
            "{}",
            String::from_utf8_lossy(&client.stdout)
                .lines()
                .chain(String::from_utf8_lossy(&client.stderr).lines())
                .last()
                .unwrap_or("iperf3 failed")
                .trim()
                .to_owned()
        );
    }
    Ok(String::from_utf8_lossy(&client.stdout)
        .lines()
        .find(|l| l.contains("receiver"))
        .unwrap_or_default()
        .trim()
        .to_owned())
}

/// The interesting lines of a proxy's /metrics.
fn summary(metrics: &str) -> Vec<String> {
    let pick = |l: &str, k: &str| {
        l.split_once(&format!("{k}=\""))
            .and_then(|(_, r)| r.split('"').next())
            .unwrap_or("")
            .to_owned()
    };
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let name = series.split('{').next()?;
            match name {
                "istio_tcp_connections_opened_total"
                | "istio_tcp_received_bytes_total"
                | "istio_tcp_sent_bytes_total" => Some(format!(
                    "{name:<36} {value:>12}  {} → {} ({}), reporter={}, {}",
                    pick(l, "source_principal"),
                    pick(l, "destination_principal"),
                    pick(l, "destination_workload"),
                    pick(l, "reporter"),
                    pick(l, "connection_security_policy"),
                )),
                "meshpath_connection_errors_total" => Some(format!(
                    "{name:<36} {value:>12}  {} {}",
                    pick(l, "direction"),
                    pick(l, "reason")
                )),
                _ => None,
            }
        })
        .collect()
}

/// Runs the demo with the binaries in `bin_dir`.
/// A pod's namespace: with the API server, the unmeshed pod lives in an unlabelled one.
fn pod_namespace(name: &str, kube: bool) -> &'static str {
    let meshed = PODS.iter().any(|p| p.0 == name && p.3);
    if kube && !meshed {
        "legacy"
    } else {
        "default"
    }
}

pub fn run(bin_dir: &Path, keep: bool, proxy: Proxy, kube: bool) -> Result<()> {
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        // Children get the same SIGINT and exit; we note it and let Drop clean up.
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .context("installing the Ctrl-C handler")?;
    }
    let check = || -> Result<()> {
        if interrupted.load(Ordering::SeqCst) {
            bail!("interrupted");
        }
        Ok(())
    };
    let tag = std::process::id().to_string();
    let mut demo = Demo {
        files: PathBuf::from(format!("/run/meshpath-demo-{tag}")),
        tag,
        proxy,
        api: None,
        bin_dir: bin_dir.to_owned(),
        nodes: Vec::new(),
        namespaces: Vec::new(),
        children: Vec::new(),
    };
    fs::create_dir_all(&demo.files)?;
    println!(
        "demo: a CA for the run (meshpath-proxy new-ca) and the workloads file (ztunnel's format)"
    );
    let out =
        Command::new(bin_dir.join("meshpath-proxy")).arg("new-ca").arg(&demo.files).output()?;
    if !out.status.success() {
        bail!("meshpath-proxy new-ca: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    fs::write(demo.files.join("workloads.yaml"), workloads(&[]))?;
    if kube {
        let api = crate::kube_api::ApiServer::start(&demo.files.join("kube"))?;
        println!("demo: a Kubernetes API server on 127.0.0.1:{} (etcd, kube-apiserver)", api.port);
        // The API server makes the `default` namespace shortly after it is ready.
        let label = json!({"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}});
        let mut labelled = api.request("PATCH", "/api/v1/namespaces/default", Some(&label));
        for _ in 0..50 {
            if labelled.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
            labelled = api.request("PATCH", "/api/v1/namespaces/default", Some(&label));
        }
        labelled?;
        api.request("POST", "/api/v1/namespaces", Some(&json!({"metadata": {"name": "legacy"}})))?;
        println!("demo: namespace default labelled istio.io/dataplane-mode=ambient; namespace legacy not");
        demo.api = Some(api);
    }
    for n in [1, 2] {
        check()?;
        demo.start_node(n)?;
    }
    // The node link: node1 192.168.77.1 ↔ node2 192.168.77.2, routes to each other's pods.
    let (n1, n2) = (demo.nodes[0].ns("host"), demo.nodes[1].ns("host"));
    sh(
        "ip",
        &[
            "-n", &n1, "link", "add", "to-node2", "type", "veth", "peer", "name", "to-node1",
            "netns", &n2,
        ],
    )?;
    for (ns, dev, addr, peer_subnet, via) in [
        (&n1, "to-node2", "192.168.77.1/30", "10.244.2.0/24", "192.168.77.2"),
        (&n2, "to-node1", "192.168.77.2/30", "10.244.1.0/24", "192.168.77.1"),
    ] {
        sh("ip", &["-n", ns, "addr", "add", addr, "dev", dev])?;
        sh("ip", &["-n", ns, "link", "set", dev, "up"])?;
        sh("ip", &["-n", ns, "route", "add", peer_subnet, "via", via])?;
        sh("ip", &["netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
    }
    println!(
        "demo: nodes linked (192.168.77.0/30), pod subnets 10.244.1.0/24 and 10.244.2.0/24 routed"
    );
    let mut ips = Vec::new();
    for (name, n, _, meshed) in PODS {
        check()?;
        let ip = demo.add_pod(name, n)?;
        println!(
            "demo: pod {name} on node{n} at {ip}, through the CNI chain (loopback, bridge, host-local, meshpath-cni): {}",
            if meshed { "enrolled and handed to the proxy" } else { "not in the mesh, left alone" }
        );
        ips.push((name, ip));
    }
    if let Some(api) = &demo.api {
        for (name, ..) in PODS {
            let ns = pod_namespace(name, true);
            let pod = api.request("GET", &format!("/api/v1/namespaces/{ns}/pods/{name}"), None)?;
            let r = &pod["metadata"]["annotations"]["ambient.istio.io/redirection"];
            println!(
                "demo: pod {ns}/{name}: ambient.istio.io/redirection = {}",
                r.as_str().unwrap_or("(none)")
            );
        }
    }
    // The control plane's part: the proxies learn the pods' addresses.
    fs::write(demo.files.join("workloads.yaml"), workloads(&ips))?;
    // ztunnel-like reads the file per connection.
    if proxy == Proxy::Meshpath {
        for node in &demo.nodes {
            let log = node.dir.join("proxy.log");
            wait_for(&log, "workload store reloaded", "the workloads reload")?;
        }
    }
    let tag = demo.tag.clone();
    let ns_of = move |name: &str| format!("mp-demo-{tag}-{name}");
    let ip_of =
        |name: &str| ips.iter().find(|(n, _)| *n == name).map(|(_, ip)| *ip).context("pod ip");
    check()?;
    println!("demo: iperf3 sleep (node1) → httpbin (node2), 3 s: captured by eBPF, HBONE over mTLS between the proxies");
    println!("demo:   {}", iperf3(&ns_of("sleep"), &ns_of("httpbin"), ip_of("httpbin")?, 5201, 3)?);
    check()?;
    println!("demo: iperf3 sleep → legacy (node2, not meshed), 1 s: passthrough");
    println!("demo:   {}", iperf3(&ns_of("sleep"), &ns_of("legacy"), ip_of("legacy")?, 5201, 1)?);
    check()?;
    if proxy == Proxy::ZtunnelLike {
        println!("demo: ztunnel-like enforces no policy: the denial is not shown");
        for node in &demo.nodes {
            println!("demo: node{} ztunnel-like's connections:", node.n);
            let log = fs::read_to_string(node.dir.join("proxy.log")).unwrap_or_default();
            for line in log.lines().filter(|l| !l.starts_with("READY")) {
                println!("demo:   {line}");
            }
        }
    } else {
        let (httpbin, waypoint) = (ip_of("httpbin")?, ip_of("waypoint")?);
        demo.show_waypoint(
            &ns_of("sleep"),
            &ns_of("httpbin"),
            &ns_of("waypoint"),
            httpbin,
            waypoint,
        )?;
        check()?;
        show_denial_and_metrics(&demo, &ns_of("sleep"), &ns_of("httpbin"), httpbin)?;
    }
    if keep {
        println!("demo: --keep: running until Ctrl-C. Look around:");
        for node in &demo.nodes {
            let ns = node.ns("host");
            if proxy == Proxy::Meshpath {
                println!("  ip netns exec {ns} curl -s localhost:15000/config_dump     # node{} proxy: pods, certificates, pool", node.n);
                println!("  ip netns exec {ns} curl -s localhost:15020/metrics");
            }
            println!(
                "  {} --pin-root {} list      # node{} datapath",
                bin_dir.join("meshpath-loader").display(),
                node.pin_root.display(),
                node.n
            );
            println!(
                "  cat {}   # chained entry the agent added",
                node.conf().join("10-demo.conflist").display()
            );
            println!(
                "  less {} {}",
                node.dir.join("agent.log").display(),
                node.dir.join("proxy.log").display()
            );
        }
        println!("  ip netns exec {} iperf3 -c {} -t 5", ns_of("sleep"), ip_of("httpbin")?);
        while !interrupted.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(())
}

impl Demo {
    /// A service a waypoint serves: the waypoint stand-in started in its pod, iperf3 from sleep
    /// to the service's VIP, and what the waypoint saw.
    fn show_waypoint(
        &mut self,
        sleep: &str,
        httpbin_ns: &str,
        waypoint_ns: &str,
        httpbin: Ipv4Addr,
        waypoint: Ipv4Addr,
    ) -> Result<()> {
        let log = self.files.join("waypoint.log");
        let mut standin = Command::new("nsenter");
        standin
            .arg(format!("--net=/var/run/netns/{waypoint_ns}"))
            .arg(self.bin_dir.join("waypoint-standin"))
            .arg(format!("{waypoint}:15008"))
            .arg(self.files.join("ca.pem"))
            .arg(self.files.join("ca-key.pem"))
            .args(["waypoint", "httpbin", &format!("{L7_VIP}={httpbin}:{L7_PORT}")]);
        self.children.push(spawn_logged(standin, None, &log)?);
        wait_for(&log, "READY", "the waypoint stand-in")?;
        println!(
            "demo: iperf3 sleep → service httpbin-l7 ({L7_VIP}), 1 s: its waypoint (the stand-in, pod waypoint on node2) serves it, so node1's proxy sends it there over HBONE, and the waypoint on to httpbin"
        );
        let vip: SocketAddr = L7_VIP.parse()?;
        println!("demo:   {}", iperf3_to(sleep, httpbin_ns, (httpbin, L7_PORT), vip, 1)?);
        let seen = fs::read_to_string(&log).unwrap_or_default();
        for line in seen.lines().filter(|l| l.starts_with("CONNECT ")) {
            println!("demo:   the waypoint saw: {line}");
        }
        Ok(())
    }
}

/// meshpath-proxy's part of the demo: a connection policy denies, then both proxies' metrics.
fn show_denial_and_metrics(demo: &Demo, sleep: &str, httpbin: &str, ip: Ipv4Addr) -> Result<()> {
    println!("demo: sleep → httpbin:{DENIED_PORT}, which policy denies at node2's proxy:");
    match iperf3(sleep, httpbin, ip, DENIED_PORT, 1) {
        Ok(line) => println!("demo:   NOT denied (unexpected): {line}"),
        Err(e) => println!("demo:   refused as it should be: {e}"),
    }
    std::thread::sleep(Duration::from_millis(300));
    for node in &demo.nodes {
        let ns = format!("/var/run/netns/{}", node.ns("host"));
        let metrics = http_get(&ns, "127.0.0.1:15020".parse()?, "/metrics")?;
        println!("demo: node{} proxy /metrics:", node.n);
        for line in summary(&metrics) {
            println!("demo:   {line}");
        }
    }
    Ok(())
}
