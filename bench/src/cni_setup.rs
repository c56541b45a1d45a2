//! Pod set-up and teardown as a container runtime sees them: what the mesh's step of the CNI
//! chain costs per pod, for 1, 100 and 1,000 pods made on one node, meshpath against
//! istio-cni's in-pod path done the way istio-cni does it. Both sides get the same pods, made
//! the same way and not timed (Debian's `loopback`, then `bridge` + `host-local`, invoked as a
//! runtime does), and the same proxy process answering ZDS.
//!
//! - `ebpf` (meshpath): a node with `meshpath-loader agent` and `meshpath-proxy` running. Timed:
//!   the `meshpath-cni` ADD, exactly as the runtime runs it after the bridge plugin — the
//!   plugin's exec, its request to the agent, the agent's lookup (here in its workloads file of
//!   1,101 pods, read per request; in a cluster, its API cache) and record, the datapath
//!   enrolment, the pod's reply routing, and the proxy's ZDS ack, which the plugin waits for.
//!   DEL likewise (`meshpath-cni` DEL: unenrol, record removed, ZDS Del acked).
//! - `iptables` (istio-cni): what istio-cni's plugin and node agent do for a pod in ambient
//!   mode. Its plugin's exec and hand-off to its agent are stood in for by one exec of
//!   `meshpath-cni VERSION` (a process of the same kind, which contacts nothing: so this side's
//!   hand-off is, if anything, cheaper than the real one); then, inside the pod's netns:
//!   `iptables-save` then `iptables-restore` for IPv4 and `ip6tables-save` then
//!   `ip6tables-restore` for IPv6 (istio-cni's in-pod rule set, bench/src/istio_rules.rs),
//!   `ip rule` and `ip route` for the marked connections (both families), and the ZDS
//!   AddWorkload round trip (the pod's netns as a descriptor) to a meshpath-proxy, as istio-cni's
//!   agent sends it to ztunnel. DEL: the exec, and the ZDS DelWorkload round trip (istio-cni
//!   leaves the rules to die with the netns).
//!
//! Results: `scenarios.{ebpf,iptables}.cni_add_ms_per_pod` and `cni_del_ms_per_pod`, each keyed
//! by pod count: the mean over the pods of that run.

use std::{
    fs::File,
    os::fd::AsFd as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use meshpath_tests::{
    cni_node::{run_plugin, CniNode, PluginRun},
    sibling_bin, unique, CgroupGuard, NetnsGuard, TestProxy,
};
use meshpath_zds::{
    proto::{
        workload_request::Payload, AddWorkload, DelWorkload, SnapshotSent, WorkloadInfo,
        WorkloadRequest, WorkloadResponse, ZdsHello,
    },
    Listener, SeqPacket,
};
use serde_json::{json, Value};

/// A pod made up to the main plugin: what the mesh's step of the chain is given.
struct Pod {
    netns: NetnsGuard,
    container_id: String,
    name: String,
    /// The bridge plugin's result (the chain's `prevResult` for the next plugin).
    prev: Value,
}

impl Pod {
    fn env(&self) -> Vec<(String, String)> {
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={}", self.name);
        CniNode::env(&self.container_id, &self.netns.path().display().to_string(), &args)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    fn uid(&self) -> String {
        format!("uid-{}", self.name)
    }
}

fn succeeded(run: PluginRun, what: &str) -> Result<PluginRun> {
    if !run.success {
        bail!("{what} failed: {}{}", run.stdout, run.stderr);
    }
    Ok(run)
}

/// Plugin `index` of the chain `list` as the runtime hands it over.
fn plugin_conf(list: &Value, index: usize, prev: Option<&Value>) -> Value {
    let mut conf = list["plugins"][index].clone();
    conf["cniVersion"] = list["cniVersion"].clone();
    conf["name"] = list["name"].clone();
    if let Some(prev) = prev {
        conf["prevResult"] = prev.clone();
    }
    conf
}

fn run(
    node: &CniNode,
    kind: &str,
    command: &str,
    conf: &Value,
    env: &[(String, String)],
) -> Result<PluginRun> {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_plugin(node.node.path().as_path(), &CniNode::plugin_path(kind), command, conf, &env)
}

/// Makes pod `name`: its netns, loopback, then the bridge plugin (not timed).
fn make_pod(node: &CniNode, list: &Value, name: String) -> Result<Pod> {
    let mut pod = Pod {
        netns: NetnsGuard::new("mpbc")?,
        container_id: unique("ctr"),
        name,
        prev: Value::Null,
    };
    let env = pod.env();
    let lo = json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback"});
    succeeded(run(node, "loopback", "ADD", &lo, &env)?, "loopback ADD")?;
    let bridge =
        succeeded(run(node, "bridge", "ADD", &plugin_conf(list, 0, None), &env)?, "bridge ADD")?;
    pod.prev = bridge.json();
    Ok(pod)
}

/// The bridge plugin's DEL (not timed); the netns goes when the pod drops.
fn remove_pod(node: &CniNode, list: &Value, pod: Pod) -> Result<()> {
    succeeded(
        run(node, "bridge", "DEL", &plugin_conf(list, 0, Some(&pod.prev)), &pod.env())?,
        "bridge DEL",
    )?;
    Ok(())
}

/// The workloads file both the agent and the proxy read: every pod any run makes, meshed.
pub fn workloads(sizes: &[usize]) -> String {
    let mut y = String::from("workloads:\n");
    // 1: the warm-up pod's.
    let sizes: std::collections::BTreeSet<usize> = sizes.iter().copied().chain([1]).collect();
    for n in sizes {
        for i in 0..n {
            let name = format!("b{n}-{i}");
            y.push_str(&format!(
                "- {{uid: uid-{name}, name: {name}, namespace: default, serviceAccount: bench, protocol: HBONE}}\n"
            ));
        }
    }
    y
}

/// istio-cni's node agent as far as the proxy sees it: the ZDS server end, and a meshpath-proxy
/// connected to it (in a node netns of its own: the meshpath node's proxy has 15000-15021).
struct IstioAgent {
    rt: tokio::runtime::Runtime,
    conn: SeqPacket,
    _proxy: TestProxy,
    _proxy_node: NetnsGuard,
    _cgroup: CgroupGuard,
}

impl IstioAgent {
    fn start(node: &CniNode) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let socket = node.dir.join("istio-zds.sock");
        let listener = rt.block_on(async { Listener::bind(&socket) })?;
        let proxy_node = NetnsGuard::new("mpbi")?;
        let cgroup = CgroupGuard::new()?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", proxy_node.path().display()))
            .arg(sibling_bin("meshpath-proxy"))
            .arg("--zds-socket")
            .arg(&socket)
            .arg("--workloads")
            .arg(node.dir.join("workloads.yaml"))
            .arg("--ca-cert")
            .arg(node.dir.join("ca.pem"))
            .arg("--ca-key")
            .arg(node.dir.join("ca-key.pem"))
            // It warns, rightly, that nothing set up reply routing for these pods: quiet.
            .env("RUST_LOG", "error");
        let proxy = TestProxy::spawn(cmd, &cgroup)?;
        let conn = rt.block_on(async {
            let conn = tokio::time::timeout(Duration::from_secs(10), listener.accept())
                .await
                .context("the proxy did not connect to ZDS")??;
            let (_hello, _) = conn.recv_msg::<ZdsHello>().await?;
            Ok::<_, anyhow::Error>(conn)
        })?;
        let agent = Self { rt, conn, _proxy: proxy, _proxy_node: proxy_node, _cgroup: cgroup };
        agent.request(Payload::SnapshotSent(SnapshotSent {}), None)?;
        Ok(agent)
    }

    /// One request and its ack.
    fn request(&self, payload: Payload, netns: Option<&File>) -> Result<()> {
        let req = WorkloadRequest { payload: Some(payload) };
        let resp = self.rt.block_on(async {
            let fds: Vec<_> = netns.iter().map(|f| f.as_fd()).collect();
            self.conn.send_msg(&req, &fds).await?;
            let (resp, _) = tokio::time::timeout(
                Duration::from_secs(10),
                self.conn.recv_msg::<WorkloadResponse>(),
            )
            .await
            .context("no ZDS answer")??;
            Ok::<_, anyhow::Error>(resp)
        })?;
        let ack = resp.payload.context("a ZDS answer without an ack")?;
        let meshpath_zds::proto::workload_response::Payload::Ack(ack) = ack;
        if !ack.error.is_empty() {
            bail!("the proxy refused: {}", ack.error);
        }
        Ok(())
    }
}

fn sh_in(netns: &Path, program: &str, args: &[&str], stdin: Option<&str>) -> Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    let mut input = child.stdin.take().context("stdin")?;
    if let Some(text) = stdin {
        input.write_all(text.as_bytes())?;
    }
    drop(input);
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The plugin exec istio-cni's side is charged (see the module docs).
fn plugin_exec_stand_in(node: &CniNode) -> Result<()> {
    succeeded(
        run(node, "meshpath-cni", "VERSION", &json!({"cniVersion": "1.0.0"}), &[])?,
        "VERSION",
    )?;
    Ok(())
}

/// `meshpath-cni COMMAND` for `pod`, as the runtime runs it after the bridge plugin.
fn meshpath_cni(node: &CniNode, list: &Value, pod: &Pod, command: &str) -> Result<()> {
    let conf = plugin_conf(list, 1, Some(&pod.prev));
    succeeded(run(node, "meshpath-cni", command, &conf, &pod.env())?, command)?;
    Ok(())
}

fn istio_add(node: &CniNode, agent: &IstioAgent, pod: &Pod) -> Result<()> {
    plugin_exec_stand_in(node)?;
    let ns = pod.netns.path();
    sh_in(&ns, "iptables-save", &[], None)?;
    sh_in(&ns, "iptables-restore", &[], Some(crate::istio_rules::RULES_V4))?;
    sh_in(&ns, "ip6tables-save", &[], None)?;
    sh_in(&ns, "ip6tables-restore", &[], Some(&crate::istio_rules::rules_v6()))?;
    for family in ["-4", "-6"] {
        sh_in(
            &ns,
            "ip",
            &[family, "rule", "add", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100"],
            None,
        )?;
    }
    sh_in(
        &ns,
        "ip",
        &["-4", "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "100"],
        None,
    )?;
    sh_in(&ns, "ip", &["-6", "route", "add", "local", "::/0", "dev", "lo", "table", "100"], None)?;
    let file = File::open(&ns).context("opening the pod's netns")?;
    let info = WorkloadInfo {
        name: pod.name.clone(),
        namespace: "default".into(),
        service_account: "bench".into(),
    };
    agent.request(
        Payload::Add(AddWorkload {
            uid: pod.uid(),
            workload_info: Some(info),
            ..Default::default()
        }),
        Some(&file),
    )
}

fn istio_del(node: &CniNode, agent: &IstioAgent, pod: &Pod) -> Result<()> {
    plugin_exec_stand_in(node)?;
    agent.request(Payload::Del(DelWorkload { uid: pod.uid() }), None)
}

/// The pod counts measured: 1, 100 and `max`, those not above `max`.
pub fn sizes(max: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = [1, 100, max].into_iter().filter(|&n| n <= max).collect();
    sizes.dedup();
    sizes
}

/// Waits (up to a minute) for the CPUs to be nearly idle: the kernel tears down removed network
/// namespaces in the background (for 1,000 pods, seconds of kworker time), which would
/// otherwise be charged to whichever side is timed next.
fn quiet() {
    fn busy_idle() -> Option<(u64, u64)> {
        let v = crate::cpu_ticks()?;
        let idle = v[3] + v[4];
        Some((v.iter().sum::<u64>() - idle, idle))
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Some((b0, i0)) = busy_idle() else { return };
        std::thread::sleep(Duration::from_millis(250));
        let Some((b1, i1)) = busy_idle() else { return };
        let (busy, idle) = ((b1 - b0) as f64, (i1 - i0) as f64);
        if busy / (busy + idle).max(1.0) < 0.1 {
            return;
        }
    }
    eprintln!("bench: the machine did not go quiet in 60 s; timing anyway");
}

/// How many times the run for `n` pods is repeated, its per-pod time the mean over all: one
/// pod's ADD is too short to time once.
fn repetitions(n: usize) -> usize {
    (100 / n.max(1)).clamp(1, 20)
}

/// `reps` times: `n` pods made (not timed), `add` run for each, then `del` for each, the pods
/// removed (not timed). Mean ms per pod of `add` and of `del`.
fn time_per_pod(
    node: &CniNode,
    list: &Value,
    n: usize,
    reps: usize,
    add: impl Fn(&Pod) -> Result<()>,
    del: impl Fn(&Pod) -> Result<()>,
) -> Result<(f64, f64)> {
    let (mut add_s, mut del_s) = (0.0, 0.0);
    for _ in 0..reps {
        let pods: Vec<Pod> =
            (0..n).map(|i| make_pod(node, list, format!("b{n}-{i}"))).collect::<Result<_>>()?;
        quiet();
        let start = Instant::now();
        pods.iter().try_for_each(&add)?;
        add_s += start.elapsed().as_secs_f64();
        let start = Instant::now();
        pods.iter().try_for_each(&del)?;
        del_s += start.elapsed().as_secs_f64();
        pods.into_iter().try_for_each(|pod| remove_pod(node, list, pod))?;
    }
    let ms_per_pod = |s: f64| s * 1e3 / (n * reps) as f64;
    Ok((ms_per_pod(add_s), ms_per_pod(del_s)))
}

/// Per-pod ADD and DEL in ms for each size, for both sides: ((ebpf add, ebpf del),
/// (iptables add, iptables del)), each a JSON object keyed by pod count. Each side first sets
/// up and tears down one pod untimed (the proxies' first certificate, cold caches).
pub fn measure(sizes: &[usize]) -> Result<((Value, Value), (Value, Value))> {
    let mut node = CniNode::bare(&workloads(sizes))?;
    node.prefix_len = 21; // 2,046 addresses: 1,000 pods at once.
    node.start_agent()?;
    node.start_proxy()?;
    let list = node.conflist(&node.cni_socket());
    let istio = IstioAgent::start(&node)?;
    let meshpath_add = |pod: &Pod| meshpath_cni(&node, &list, pod, "ADD");
    let meshpath_del = |pod: &Pod| meshpath_cni(&node, &list, pod, "DEL");
    let istio_add = |pod: &Pod| istio_add(&node, &istio, pod);
    let istio_del = |pod: &Pod| istio_del(&node, &istio, pod);
    time_per_pod(&node, &list, 1, 1, meshpath_add, meshpath_del)?;
    time_per_pod(&node, &list, 1, 1, istio_add, istio_del)?;
    let (mut e_add, mut e_del, mut i_add, mut i_del) = (json!({}), json!({}), json!({}), json!({}));
    for &n in sizes {
        let (key, reps) = (n.to_string(), repetitions(n));
        eprintln!("bench: {n} pods through the CNI chain, {reps} time(s) (meshpath)");
        let (add, del) = time_per_pod(&node, &list, n, reps, meshpath_add, meshpath_del)?;
        (e_add[&key], e_del[&key]) = (json!(add), json!(del));
        eprintln!(
            "bench: {n} pods through the CNI chain, {reps} time(s) (istio-cni's in-pod path)"
        );
        let (ipt_add, ipt_del) = time_per_pod(&node, &list, n, reps, istio_add, istio_del)?;
        (i_add[&key], i_del[&key]) = (json!(ipt_add), json!(ipt_del));
        eprintln!(
            "bench: {n} pods: CNI ADD meshpath {add:.2} ms/pod, istio-cni {ipt_add:.2} ({:.2}x); DEL meshpath {del:.2}, istio-cni {ipt_del:.2}",
            add / ipt_add
        );
    }
    Ok(((e_add, e_del), (i_add, i_del)))
}
