//! `cargo xtask demo`: a local node in network namespaces. A node namespace holds a bridge; two
//! pod namespaces hang off it by veth; both pods are enrolled with `meshpath-loader`; iperf3
//! runs between them; the per-pod counters are printed; everything is removed on exit, on error
//! and on Ctrl-C.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use anyhow::{bail, Context as _, Result};

const BRIDGE: &str = "br0";
const NODE_IP: &str = "10.244.0.1/24";
const PODS: [(&str, &str); 2] = [("pod-a", "10.244.0.10"), ("pod-b", "10.244.0.11")];

/// Everything the demo created, removed on drop in reverse order.
struct Node {
    tag: String,
    pin_root: PathBuf,
    loader: PathBuf,
    namespaces: Vec<String>,
    enrolled: Vec<String>,
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
        let out = Command::new(&self.loader)
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
}

impl Drop for Node {
    fn drop(&mut self) {
        println!("demo: cleaning up");
        for path in self.enrolled.drain(..).rev() {
            let _ = Command::new(&self.loader)
                .arg("--pin-root")
                .arg(&self.pin_root)
                .args(["unenrol", "--netns", &path])
                .stdout(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.pin_root);
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
        tag,
        loader: bin_dir.join("meshpath-loader"),
        namespaces: Vec::new(),
        enrolled: Vec::new(),
    };

    println!("demo: creating node namespace {} with bridge {BRIDGE}", node.ns("node"));
    node.add_netns("node")?;
    let node_ns = node.ns("node");
    sh("ip", &["-n", &node_ns, "link", "add", BRIDGE, "type", "bridge"])?;
    sh("ip", &["-n", &node_ns, "addr", "add", NODE_IP, "dev", BRIDGE])?;
    sh("ip", &["-n", &node_ns, "link", "set", BRIDGE, "up"])?;

    for (i, (pod, ip)) in PODS.iter().enumerate() {
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

    for (pod, _) in PODS {
        check()?;
        let path = node.netns_path(pod);
        print!(
            "demo: {}",
            node.loader(&["enrol", "--netns", &path, "--name", &format!("default/{pod}")])?
        );
        node.enrolled.push(path);
    }

    let (server_ns, server_ip) = (node.netns_path(PODS[1].0), PODS[1].1);
    let client_ns = node.netns_path(PODS[0].0);
    println!("demo: iperf3 from {} to {} for 3 s", PODS[0].0, PODS[1].0);
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

    println!("demo: per-pod counters (TC on each pod's eth0, read from the pinned map):");
    print!("{}", node.loader(&["list"])?);
    Ok(())
}
