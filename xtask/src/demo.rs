//! `cargo xtask demo`: a local node in network namespaces, its pods' traffic steered through a
//! proxy by meshpath's eBPF capture, with no netfilter rule.
//!
//! A node namespace holds a bridge; two pod namespaces hang off it by veth; both pods are
//! enrolled with `meshpath-loader` (pod-a: outbound capture, pod-b: inbound capture); a
//! forwarding proxy runs inside each pod's netns, in a cgroup registered as the proxy's (until
//! the HBONE proxy lands this is `meshpath-test-proxy`, which reads the original destination
//! with `SO_ORIGINAL_DST` exactly as an iptables-era proxy does); iperf3 runs from pod-a to
//! pod-b, through both proxies; the connections each proxy saw and the per-pod counters are
//! printed; everything is removed on exit, on error and on Ctrl-C.

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
const PODS: [(&str, &str, &str); 2] =
    [("pod-a", "10.244.0.10", "--capture-outbound"), ("pod-b", "10.244.0.11", "--capture-inbound")];

/// Everything the demo created, removed on drop in reverse order.
struct Node {
    tag: String,
    pin_root: PathBuf,
    bin_dir: PathBuf,
    namespaces: Vec<String>,
    enrolled: Vec<String>,
    cgroup: Option<PathBuf>,
    proxies: Vec<Child>,
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

    /// Starts the forwarding proxy inside a pod's netns, in the proxy cgroup; its `ACCEPTED`
    /// lines are collected in `seen`.
    fn start_proxy(&mut self, pod: &str, seen: Arc<Mutex<Vec<String>>>) -> Result<()> {
        let cgroup = self.cgroup.as_ref().context("no proxy cgroup")?;
        let procs = fs::OpenOptions::new()
            .write(true)
            .open(cgroup.join("cgroup.procs"))
            .context("cgroup.procs")?;
        let fd = procs.as_raw_fd();
        let mut cmd = Command::new(self.bin_dir.join("meshpath-test-proxy"));
        cmd.arg(self.netns_path(pod)).arg("forward").arg(&self.pin_root);
        // Its stderr reports peers resetting at iperf3's teardown: noise in a demo.
        cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        // SAFETY: only write(2) between fork and exec, on an fd open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("starting the proxy")?;
        drop(procs);
        let stdout = child.stdout.take().context("proxy stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        let pod = pod.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == "READY" {
                    let _ = tx.send(());
                } else if let Some(orig) = line.strip_prefix("ACCEPTED ") {
                    if let Ok(mut s) = seen.lock() {
                        s.push(format!("{pod} proxy accepted a connection for {orig}"));
                    }
                }
            }
        });
        self.proxies.push(child);
        rx.recv_timeout(std::time::Duration::from_secs(10)).context("the proxy did not start")?;
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
        tag,
        bin_dir: bin_dir.to_owned(),
        namespaces: Vec::new(),
        enrolled: Vec::new(),
        proxies: Vec::new(),
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
    for (pod, _, capture) in PODS {
        check()?;
        let path = node.netns_path(pod);
        let name = format!("default/{pod}");
        print!("demo: {}", node.loader(&["enrol", "--netns", &path, "--name", &name, capture])?);
        node.enrolled.push(path);
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    for (pod, _, _) in PODS {
        println!(
            "demo: starting a forwarding proxy inside {pod}'s netns (cgroup {})",
            cgroup.display()
        );
        node.start_proxy(pod, seen.clone())?;
    }

    let (server_ns, server_ip) = (node.netns_path(PODS[1].0), PODS[1].1);
    let client_ns = node.netns_path(PODS[0].0);
    println!(
        "demo: iperf3 from {} to {} for 3 s (pod-a's proxy → pod-b's proxy → iperf3)",
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
    std::thread::sleep(std::time::Duration::from_millis(200));
    for line in seen.lock().map(|s| s.clone()).unwrap_or_default() {
        println!("demo: {line}");
    }
    println!("demo: per-pod counters (TC on each pod's eth0, read from the pinned map):");
    print!("{}", node.loader(&["list"])?);
    Ok(())
}
