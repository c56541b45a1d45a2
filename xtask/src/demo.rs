//! `cargo xtask demo`: a local node in network namespaces, its pods' traffic steered by
//! meshpath's eBPF capture (no netfilter rule) into the node's HBONE proxy and carried between
//! pods over HTTP/2 CONNECT with mutual TLS and SPIFFE identities.
//!
//! A node namespace holds a bridge; two pod namespaces hang off it by veth; both pods are
//! enrolled with `meshpath-loader` (outbound and inbound capture); one `meshpath-proxy` serves
//! both pods, in a cgroup registered as the proxy's, with certificates minted from a CA made for
//! the run; iperf3 runs from pod-a to pod-b; what the proxy carried (identities, bytes) and the
//! per-pod counters are printed; everything is removed on exit, on error and on Ctrl-C.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
};

use anyhow::{bail, Context as _, Result};

const BRIDGE: &str = "br0";
const NODE_IP: &str = "10.244.0.1/24";
/// (pod, address, enrolment flags)
/// (pod, address, service account)
const PODS: [(&str, &str, &str); 2] =
    [("pod-a", "10.244.0.10", "sleep"), ("pod-b", "10.244.0.11", "httpbin")];

/// Everything the demo created, removed on drop in reverse order.
struct Node {
    tag: String,
    pin_root: PathBuf,
    bin_dir: PathBuf,
    namespaces: Vec<String>,
    enrolled: Vec<String>,
    cgroup: Option<PathBuf>,
    proxies: Vec<Child>,
    /// CA and workload files for the run.
    files: PathBuf,
}

impl Node {
    fn ns(&self, short: &str) -> String {
        format!("{short}-{}", self.tag)
    }

    fn netns_path(&self, short: &str) -> String {
        format!("/var/run/netns/{}", self.ns(short))
    }

    fn add_netns(&mut self, short: &str) -> Result<()> {
        let name = self.ns(short);
        sh("ip", &["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        sh("ip", &["-n", &name, "link", "set", "lo", "up"])
    }

    fn loader(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(self.bin_dir.join("meshpath-loader"))
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(args)
            .output()
            .context("running meshpath-loader")?;
        if !out.status.success() {
            bail!(
                "meshpath-loader {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Starts the node's `meshpath-proxy` for every pod, in the proxy cgroup; the connections
    /// it reports carrying are collected in `seen`.
    fn start_proxy(&mut self, seen: Arc<Mutex<Vec<String>>>) -> Result<()> {
        let cgroup = self.cgroup.as_ref().context("no proxy cgroup")?;
        let procs = fs::OpenOptions::new()
            .write(true)
            .open(cgroup.join("cgroup.procs"))
            .context("cgroup.procs")?;
        let fd = procs.as_raw_fd();
        let mut cmd = Command::new(self.bin_dir.join("meshpath-proxy"));
        cmd.arg("--workloads").arg(self.files.join("workloads.yaml"));
        cmd.arg("--ca-cert").arg(self.files.join("ca.pem"));
        cmd.arg("--ca-key").arg(self.files.join("ca-key.pem"));
        cmd.arg("--pin-root").arg(&self.pin_root);
        for (pod, _, _) in PODS {
            cmd.arg("--pod").arg(format!("{pod}={}", self.netns_path(pod)));
        }
        cmd.env("RUST_LOG", "info").stdout(Stdio::piped()).stderr(Stdio::piped());
        // The tests crate has the same helper (TestProxy::spawn); xtask cannot depend on it: it
        // must build before the eBPF toolchain exists.
        // SAFETY: only write(2) between fork and exec, on an fd open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("starting meshpath-proxy")?;
        drop(procs);
        let stdout = child.stdout.take().context("proxy stdout")?;
        let stderr = child.stderr.take().context("proxy stderr")?;
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("hbone connection closed") {
                    if let Ok(mut s) = seen.lock() {
                        // Drop the timestamp and target: keep the message and its fields.
                        let msg = line.split_once("closed").map_or(line.as_str(), |(_, rest)| rest);
                        let kind = if line.contains("inbound") { "inbound " } else { "outbound" };
                        s.push(format!("{kind} HBONE:{msg}"));
                    }
                }
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == "READY" {
                    let _ = tx.send(());
                }
            }
        });
        self.proxies.push(child);
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .context("meshpath-proxy did not start")?;
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        println!("demo: cleaning up");
        for mut p in self.proxies.drain(..) {
            let _ = p.kill();
            let _ = p.wait();
        }
        for path in self.enrolled.drain(..).rev() {
            let _ = Command::new(self.bin_dir.join("meshpath-loader"))
                .arg("--pin-root")
                .arg(&self.pin_root)
                .args(["unenrol", "--netns", &path])
                .stdout(Stdio::null())
                .status();
        }
        let _ = fs::remove_dir_all(&self.pin_root);
        if let Some(cg) = self.cgroup.take() {
            let _ = fs::remove_dir(cg);
        }
        let _ = fs::remove_dir_all(&self.files);
        for ns in self.namespaces.drain(..).rev() {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
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

/// Runs the demo with the binaries in `bin_dir`.
pub fn run(bin_dir: &Path) -> Result<()> {
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

    let tag = format!("{}", std::process::id());
    let mut node = Node {
        pin_root: PathBuf::from(format!("/sys/fs/bpf/meshpath-demo-{tag}")),
        cgroup: None,
        tag: tag.clone(),
        bin_dir: bin_dir.to_owned(),
        namespaces: Vec::new(),
        enrolled: Vec::new(),
        proxies: Vec::new(),
        files: PathBuf::from(format!("/run/meshpath-demo-{tag}")),
    };

    println!("demo: creating node namespace {} with bridge {BRIDGE}", node.ns("node"));
    node.add_netns("node")?;
    let node_ns = node.ns("node");
    sh("ip", &["-n", &node_ns, "link", "add", BRIDGE, "type", "bridge"])?;
    sh("ip", &["-n", &node_ns, "addr", "add", NODE_IP, "dev", BRIDGE])?;
    sh("ip", &["-n", &node_ns, "link", "set", BRIDGE, "up"])?;

    for (i, (pod, ip, _)) in PODS.iter().enumerate() {
        check()?;
        println!("demo: creating {pod} ({ip}) and wiring it to the node bridge");
        node.add_netns(pod)?;
        let pod_ns = node.ns(pod);
        let host_if = format!("veth{i}");
        sh(
            "ip",
            &[
                "-n", &node_ns, "link", "add", &host_if, "type", "veth", "peer", "name", "eth0",
                "netns", &pod_ns,
            ],
        )?;
        sh("ip", &["-n", &node_ns, "link", "set", &host_if, "master", BRIDGE, "up"])?;
        sh("ip", &["-n", &pod_ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        sh("ip", &["-n", &pod_ns, "link", "set", "eth0", "up"])?;
    }

    let cgroup = cgroup2_root()?.join(format!("meshpath-demo-proxy-{}", node.tag));
    fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
    node.cgroup = Some(cgroup.clone());
    print!("demo: {}", node.loader(&["proxy-cgroup", "--cgroup", &cgroup.display().to_string()])?);
    for (pod, _, _) in PODS {
        check()?;
        let path = node.netns_path(pod);
        let name = format!("default/{pod}");
        let enrolled = node.loader(&[
            "enrol",
            "--netns",
            &path,
            "--name",
            &name,
            "--capture-outbound",
            "--capture-inbound",
        ])?;
        print!("demo: {enrolled}");
        node.enrolled.push(path);
    }

    println!("demo: making a CA for the run and the workload list (ztunnel's format)");
    fs::create_dir_all(&node.files)?;
    let out = Command::new(bin_dir.join("meshpath-proxy"))
        .arg("new-ca")
        .arg(&node.files)
        .output()
        .context("meshpath-proxy new-ca")?;
    if !out.status.success() {
        bail!("meshpath-proxy new-ca: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let mut yaml = String::from("workloads:\n");
    for (pod, ip, sa) in PODS {
        yaml += &format!(
            "- uid: {pod}\n  name: {pod}\n  namespace: default\n  serviceAccount: {sa}\n  \
             workloadIps: [\"{ip}\"]\n  protocol: HBONE\n"
        );
    }
    fs::write(node.files.join("workloads.yaml"), yaml)?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    println!("demo: starting meshpath-proxy for both pods (cgroup {})", cgroup.display());
    node.start_proxy(seen.clone())?;

    let (server_ns, server_ip) = (node.netns_path(PODS[1].0), PODS[1].1);
    let client_ns = node.netns_path(PODS[0].0);
    println!(
        "demo: iperf3 from {} to {} for 3 s (captured → HBONE over mTLS → pod-b)",
        PODS[0].0, PODS[1].0
    );
    let mut server = Command::new("nsenter")
        .arg(format!("--net={server_ns}"))
        .args(["iperf3", "-s", "-1", "-B", server_ip])
        .stdout(Stdio::null())
        .spawn()
        .context("starting iperf3 -s")?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    let client = Command::new("nsenter")
        .arg(format!("--net={client_ns}"))
        .args(["iperf3", "-c", server_ip, "-t", "3", "-f", "g"])
        .output()
        .context("running iperf3 -c")?;
    let _ = server.kill();
    let _ = server.wait();
    check()?;
    if !client.status.success() {
        bail!("iperf3 failed: {}", String::from_utf8_lossy(&client.stderr).trim());
    }
    for line in String::from_utf8_lossy(&client.stdout).lines().filter(|l| l.contains("receiver")) {
        println!("demo: iperf3: {}", line.trim());
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    println!("demo: what meshpath-proxy carried:");
    for line in seen.lock().map(|s| s.clone()).unwrap_or_default() {
        println!("demo:   {line}");
    }
    println!("demo: per-pod counters (TC on each pod's eth0, read from the pinned map):");
    print!("{}", node.loader(&["list"])?);
    Ok(())
}
