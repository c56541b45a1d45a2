//! `meshpath-loader`: the node agent's command line.

use std::{net::IpAddr, path::PathBuf, process::ExitCode};

use ipnet::IpNet;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use datapath_common::{consts::pins, pod_flags};
use meshpath_loader::{
    datapath::Datapath,
    netns::Netns,
    pods::{self, EnrolOptions, PodStatus},
};

#[derive(Parser)]
#[command(
    name = "meshpath-loader",
    version,
    about = "meshpath node agent: enrol pods into the eBPF datapath"
)]
struct Cli {
    /// bpffs directory holding meshpath's pinned programs, maps and links.
    #[arg(long, env = "MESHPATH_PIN_ROOT", default_value = pins::DEFAULT_ROOT, global = true)]
    pin_root: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the node agent: pods from the CNI plugin into the datapath and to the proxy (ZDS).
    Agent(AgentArgs),
    /// Remove meshpath-cni's entry from the CNI configuration lists and its binary.
    CniUninstall {
        #[arg(long, default_value = "/opt/cni/bin")]
        cni_bin_dir: PathBuf,
        #[arg(long, default_value = "/etc/cni/net.d")]
        cni_conf_dir: PathBuf,
    },
    /// Enrol a pod by its network namespace.
    Enrol(EnrolArgs),
    /// Register (or, with --remove, forget) the proxy's cgroup: its sockets are never captured.
    ProxyCgroup {
        /// The proxy's cgroup v2 directory.
        #[arg(long)]
        cgroup: PathBuf,
        #[arg(long)]
        remove: bool,
    },
    /// Turn the same-node app↔proxy shortcut (sockops + sk_msg) on or off for the node. It is
    /// off by default, and `on` is refused without --accept-kernel-defects: see `doctor`.
    Accelerate {
        #[arg(value_parser = ["on", "off"])]
        state: String,
        /// Turn it on although the kernel cannot do it correctly (doctor says why).
        #[arg(long)]
        accept_kernel_defects: bool,
    },
    /// Make host processes (kubelet) probing enrolled pods leave from Istio's probe source
    /// addresses (169.254.7.127, fd16:9254:7127:1337:ffff:ffff:ffff:ffff).
    ProbeSource {
        /// The node's netns (default: this process's).
        #[arg(long, default_value = "/proc/self/ns/net")]
        node_netns: PathBuf,
        /// Turn it off.
        #[arg(long)]
        off: bool,
    },
    /// Remove pods whose network namespace is gone and half-done enrolments; keep the rest.
    Reconcile,
    /// Check the kernel features the datapath needs, one line each.
    Doctor,
    /// Remove a pod from the datapath.
    Unenrol(PodRef),
    /// List enrolled pods with their counters.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one pod's record and counters.
    Show {
        #[command(flatten)]
        pod: PodRef,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Stream the datapath's decisions, one line each (time, pod, hook, addresses, decision,
    /// reason), until interrupted. The programs send them only while a monitor runs.
    Monitor {
        /// Only this pod: its name as enrolled (NAMESPACE/NAME under the agent).
        #[arg(long)]
        pod: Option<String>,
        /// Or by its netns path.
        #[arg(long, conflicts_with = "pod")]
        netns: Option<PathBuf>,
        /// Or by its netns cookie.
        #[arg(long, conflicts_with_all = ["pod", "netns"])]
        cookie: Option<u64>,
        /// `drops`: only refusals and drops.
        #[arg(long, value_parser = ["drops"])]
        only: Option<String>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Stop after this many decisions.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Count the datapath's decisions (on by default) or stop counting (to measure the cost).
    DecisionCounters {
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
}

/// `agent`'s arguments.
#[derive(Args)]
struct AgentArgs {
    /// Per-pod records, so a restarted agent knows its pods.
    #[arg(long, default_value = "/var/run/meshpath")]
    state_dir: PathBuf,
    /// Where the CNI plugin reaches the agent.
    #[arg(long, default_value = meshpath_cni::agent::DEFAULT_SOCKET)]
    cni_socket: PathBuf,
    /// Where the node proxy connects (ZDS, as Istio's ztunnel does).
    #[arg(long, default_value = meshpath_zds::DEFAULT_SOCKET)]
    zds_socket: PathBuf,
    /// Which pods are meshed, and as whom, from a workloads file (ztunnel's format), for
    /// running without a cluster.
    #[arg(long, required_unless_present = "kube", conflicts_with = "kube")]
    workloads: Option<PathBuf>,
    /// Which pods are meshed, from the Kubernetes API: the Pods of this node and the
    /// Namespaces, watched (`istio.io/dataplane-mode`).
    #[arg(long)]
    kube: bool,
    /// The kubeconfig to reach the API with (default: the pod's service account).
    #[arg(long, requires = "kube")]
    kubeconfig: Option<PathBuf>,
    /// This node's name, as the Pods' `spec.nodeName` says it (the downward API's NODE_NAME).
    #[arg(long, env = "NODE_NAME", required_if_eq("kube", "true"))]
    node_name: Option<String>,
    /// A namespace whose pods are never meshed (repeatable; default: kube-system).
    #[arg(long = "exclude-namespace", requires = "kube")]
    exclude_namespaces: Vec<String>,
    /// Install meshpath-cni here (with --cni-conf-dir).
    #[arg(long, requires = "cni_conf_dir")]
    cni_bin_dir: Option<PathBuf>,
    /// Append meshpath-cni to the first CNI configuration list here, and keep it there.
    #[arg(long, requires = "cni_bin_dir")]
    cni_conf_dir: Option<PathBuf>,
    /// The meshpath-cni binary to install (default: next to this executable).
    #[arg(long)]
    cni_plugin: Option<PathBuf>,
    /// A cgroup whose sockets are the proxy's (repeatable).
    #[arg(long = "proxy-cgroup")]
    proxy_cgroups: Vec<PathBuf>,
    /// Register the cgroup of the process that connects to the ZDS socket as the proxy's
    /// (the socket is root-only).
    #[arg(long)]
    proxy_cgroup_from_zds_peer: bool,
    /// /healthz and /readyz.
    #[arg(long)]
    health_addr: Option<std::net::SocketAddr>,
    /// Make kubelet's probes of pods leave from Istio's probe source addresses (added to lo of
    /// this netns, which must be the node's).
    #[arg(long)]
    probe_source: bool,
    /// Forward the datapath's own records (aya-log) into this log: `info` refusals and drops,
    /// `debug` every decision. Off by default: the programs then write none.
    #[arg(long, default_value = "off", value_parser = ["off", "info", "debug"])]
    ebpf_log: String,
    /// Seconds the proxy has to acknowledge a pod.
    #[arg(long, default_value_t = 10)]
    ack_timeout_seconds: u64,
    /// Seconds a pod's listening sockets are held open while no proxy serves it, for a
    /// proxy that hands them over (meshpath-proxy; never Istio's ztunnel): connections wait
    /// in their backlog across a proxy restart instead of being refused, and are refused once
    /// this passes with no proxy back. 0: not held (connections are refused while no proxy runs).
    #[arg(long, default_value_t = meshpath_zds::listeners::DEFAULT_HOLD.as_secs(),
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    hold_listeners_seconds: u64,
    /// Seconds the open connections a draining proxy (meshpath-proxy, on SIGTERM) handed over
    /// are held for the next proxy, which carries them on: a proxy upgrade keeps them. Past
    /// this with no proxy back, they close. 0: none is taken (the proxy drains them as before).
    #[arg(long, default_value_t = meshpath_zds::connections::DEFAULT_HOLD.as_secs(),
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    hold_connections_seconds: u64,
}

/// `enrol`'s arguments: the pod and its capture configuration.
#[derive(Args)]
struct EnrolArgs {
    /// The pod's netns: /var/run/netns/NAME or /proc/PID/ns/net.
    #[arg(long)]
    netns: PathBuf,
    /// The pod's interface inside its netns (for the TC counters).
    #[arg(long, default_value = "eth0")]
    iface: String,
    /// A name to show for the pod (default: the netns path).
    #[arg(long)]
    name: Option<String>,
    /// The pod's IP address (repeatable; default: the addresses in its netns).
    #[arg(long = "pod-ip", value_name = "IP")]
    pod_ips: Vec<IpAddr>,
    /// Capture the pod's outbound TCP to the proxy (port 15001 in the pod).
    #[arg(long)]
    capture_outbound: bool,
    /// Capture TCP arriving at the pod to the proxy (port 15006 in the pod; 15008 untouched).
    #[arg(long)]
    capture_inbound: bool,
    /// Capture DNS (UDP and TCP to port 53) to the proxy (port 15053 in the pod).
    #[arg(long)]
    capture_dns: bool,
    /// A destination port outbound capture leaves alone (repeatable).
    #[arg(long = "exclude-outbound-port", value_name = "PORT")]
    exclude_outbound_ports: Vec<u16>,
    /// A pod port inbound capture leaves alone (repeatable).
    #[arg(long = "exclude-inbound-port", value_name = "PORT")]
    exclude_inbound_ports: Vec<u16>,
    /// A destination prefix outbound capture leaves alone (repeatable; longest prefix wins).
    #[arg(long = "exclude-outbound-cidr", value_name = "CIDR")]
    exclude_outbound_cidrs: Vec<IpNet>,
    /// A destination prefix captured after all, inside a wider excluded one (repeatable).
    #[arg(long = "capture-outbound-cidr", value_name = "CIDR")]
    capture_outbound_cidrs: Vec<IpNet>,
    /// A client prefix inbound capture leaves alone (repeatable).
    #[arg(long = "exclude-inbound-cidr", value_name = "CIDR")]
    exclude_inbound_cidrs: Vec<IpNet>,
    /// Capture kubelet probes too (by default they reach the app directly, as in Istio).
    #[arg(long)]
    no_probe_bypass: bool,
    /// Skip the per-pod TC packet/byte counters (their TCX attachment is the slow part); the
    /// guard against raw TCP goes on the interface either way.
    #[arg(long)]
    no_counters: bool,
}

impl EnrolArgs {
    fn options(&self) -> EnrolOptions {
        EnrolOptions {
            iface: self.iface.clone(),
            name: self.name.clone(),
            pod_ips: self.pod_ips.clone(),
            capture_outbound: self.capture_outbound,
            capture_inbound: self.capture_inbound,
            capture_dns: self.capture_dns,
            exclude_outbound_ports: self.exclude_outbound_ports.clone(),
            exclude_inbound_ports: self.exclude_inbound_ports.clone(),
            exclude_outbound_cidrs: self.exclude_outbound_cidrs.clone(),
            capture_outbound_cidrs: self.capture_outbound_cidrs.clone(),
            exclude_inbound_cidrs: self.exclude_inbound_cidrs.clone(),
            probe_bypass: !self.no_probe_bypass,
            counters: !self.no_counters,
        }
    }
}

/// A pod, by its netns path or, when the netns is gone, by the cookie `list` shows.
#[derive(Args)]
#[group(required = true, multiple = false)]
struct PodRef {
    /// The pod's netns path.
    #[arg(long)]
    netns: Option<PathBuf>,
    /// The pod's netns cookie.
    #[arg(long)]
    cookie: Option<u64>,
}

impl PodRef {
    fn cookie(&self) -> Result<u64> {
        match (&self.netns, self.cookie) {
            (_, Some(c)) => Ok(c),
            (Some(path), None) => Ok(Netns::open(path)?.cookie()),
            (None, None) => anyhow::bail!("name the pod with --netns or --cookie"),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The daemon logs what it does; one-shot commands only what went wrong.
    let default = if matches!(cli.command, Cmd::Agent(_)) { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: log collectors get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshpath-loader: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let dp = || {
        Datapath::open_or_load(&cli.pin_root)
            .map_err(meshpath_loader::doctor::explain)
            .with_context(|| format!("opening the datapath at {}", cli.pin_root.display()))
    };
    match &cli.command {
        Cmd::Agent(a) => {
            let cfg = meshpath_loader::agent::AgentConfig {
                pin_root: cli.pin_root.clone(),
                state_dir: a.state_dir.clone(),
                cni_socket: a.cni_socket.clone(),
                zds_socket: a.zds_socket.clone(),
                directory: match (&a.workloads, &a.node_name) {
                    (Some(w), _) => {
                        meshpath_loader::agent::directory::DirectoryConfig::Workloads(w.clone())
                    }
                    (None, node) => meshpath_loader::agent::directory::DirectoryConfig::Kube(
                        meshpath_loader::agent::directory::kube::KubeConfig {
                            kubeconfig: a.kubeconfig.clone(),
                            node_name: node
                                .clone()
                                .context("--node-name (or NODE_NAME) is required with --kube")?,
                            excluded_namespaces: if a.exclude_namespaces.is_empty() {
                                datapath_common::consts::k8s::DEFAULT_EXCLUDED_NAMESPACES
                                    .iter()
                                    .map(|s| (*s).to_owned())
                                    .collect()
                            } else {
                                a.exclude_namespaces.clone()
                            },
                        },
                    ),
                },
                cni_bin_dir: a.cni_bin_dir.clone(),
                cni_conf_dir: a.cni_conf_dir.clone(),
                cni_plugin: a.cni_plugin.clone(),
                proxy_cgroups: a.proxy_cgroups.clone(),
                proxy_cgroup_from_zds_peer: a.proxy_cgroup_from_zds_peer,
                health_addr: a.health_addr,
                ack_timeout: std::time::Duration::from_secs(a.ack_timeout_seconds),
                hold_listeners: std::time::Duration::from_secs(a.hold_listeners_seconds),
                hold_connections: std::time::Duration::from_secs(a.hold_connections_seconds),
                probe_source: a.probe_source,
                ebpf_log: a.ebpf_log.parse().map_err(anyhow::Error::msg)?,
            };
            if meshpath_loader::agent::enter_host_cgroup_ns()? {
                tracing::info!("entered the host's cgroup namespace");
            }
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(meshpath_loader::agent::run(cfg))?;
        }
        Cmd::CniUninstall { cni_bin_dir, cni_conf_dir } => {
            meshpath_loader::agent::cni_install::uninstall(cni_bin_dir, cni_conf_dir)?;
            println!(
                "meshpath-cni removed from {} and {}",
                cni_conf_dir.display(),
                cni_bin_dir.display()
            );
        }
        Cmd::Enrol(args) => {
            let ns = Netns::open(&args.netns)?;
            let cookie = pods::enrol(&dp()?, &ns, &args.options())?;
            let name = args.name.clone().unwrap_or_else(|| args.netns.display().to_string());
            println!("enrolled {name} (netns cookie {cookie})");
        }
        Cmd::ProxyCgroup { cgroup, remove } => {
            let dp = dp()?;
            if *remove {
                dp.unregister_proxy_cgroup(cgroup)?;
                println!("forgot proxy cgroup {}", cgroup.display());
            } else {
                let id = dp.register_proxy_cgroup(cgroup)?;
                println!("registered proxy cgroup {} (id {id})", cgroup.display());
            }
        }
        Cmd::Accelerate { state, accept_kernel_defects } => {
            anyhow::ensure!(
                state == "off" || *accept_kernel_defects,
                "the app-proxy shortcut stays off: {}; to turn it on anyway, for a measurement, \
                 add --accept-kernel-defects",
                meshpath_loader::doctor::SHORTCUT_DEFECTS
            );
            dp()?.set_acceleration(state == "on")?;
            println!("app-proxy shortcut {state}");
        }
        Cmd::ProbeSource { node_netns, off } => {
            let dp = dp()?;
            if *off {
                dp.set_probe_source(None)?;
                println!("probe source addresses off");
            } else {
                dp.set_probe_source(Some(&Netns::open(node_netns)?))?;
                println!(
                    "kubelet probes from {} leave from the probe source addresses",
                    node_netns.display()
                );
            }
        }
        Cmd::Reconcile => {
            let r = pods::reconcile(&dp()?)?;
            println!(
                "kept {} pods, removed {} whose netns is gone {:?}, removed {} half-done enrolments {:?}",
                r.kept.len(),
                r.vanished.len(),
                r.vanished,
                r.partial.len(),
                r.partial
            );
        }
        Cmd::Doctor => {
            let checks = meshpath_loader::doctor::run();
            let missing = checks.iter().filter(|c| c.is_missing()).count();
            let kernel = meshpath_loader::doctor::kernel();
            println!("kernel   Linux {kernel}");
            for c in &checks {
                println!("{}", c.line(&kernel));
            }
            anyhow::ensure!(missing == 0, "{missing} of {} checks failed", checks.len());
        }
        Cmd::Unenrol(pod) => {
            let cookie = pod.cookie()?;
            match &pod.netns {
                // Inside the netns, filters that are not links (the guard; the counters on kernels
                // without TCX) come off too.
                Some(path) => pods::unenrol_netns(&dp()?, &Netns::open(path)?)?,
                None => pods::unenrol(&dp()?, cookie)?,
            }
            println!("unenrolled netns cookie {cookie}");
        }
        Cmd::List { json } => {
            let all = pods::list(&dp()?)?;
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&all.iter().map(to_json).collect::<Vec<_>>())?
                );
            } else {
                println!(
                    "{:<20} {:<32} {:>7} {:>12} {:>14} {:>12} {:>14}",
                    "COOKIE",
                    "POD",
                    "IFINDEX",
                    "IN_PACKETS",
                    "IN_BYTES",
                    "OUT_PACKETS",
                    "OUT_BYTES"
                );
                for p in &all {
                    let c = &p.counters;
                    println!(
                        "{:<20} {:<32} {:>7} {:>12} {:>14} {:>12} {:>14}",
                        p.cookie,
                        p.info.name(),
                        p.info.ifindex,
                        c.ingress_packets,
                        c.ingress_bytes,
                        c.egress_packets,
                        c.egress_bytes
                    );
                }
                // What the datapath decided, per pod and node-wide.
                let counts = meshpath_loader::decisions::counts(&dp()?)?;
                if !counts.is_empty() {
                    println!();
                    println!(
                        "{:<32} {:<10} {:<9} {:<28} {:>12}",
                        "DECISIONS", "HOOK", "DECISION", "REASON", "COUNT"
                    );
                }
                for d in &counts {
                    let pod = all.iter().find(|p| p.cookie == d.netns).map_or_else(
                        || if d.netns == 0 { "node".to_owned() } else { d.netns.to_string() },
                        |p| p.info.name().to_owned(),
                    );
                    println!(
                        "{:<32} {:<10} {:<9} {:<28} {:>12}",
                        pod, d.hook, d.decision, d.why, d.count
                    );
                }
            }
        }
        Cmd::Show { pod, json } => {
            let p = pods::show(&dp()?, pod.cookie()?)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&to_json(&p))?);
            } else {
                let c = &p.counters;
                println!("pod:          {}", p.info.name());
                println!("netns cookie: {}", p.cookie);
                println!("netns inode:  {}", p.info.netns_inode);
                println!("ifindex:      {}", p.info.ifindex);
                println!("pins:         {}", p.pins.join(", "));
                let flag = |f: u32| if p.info.flags & f != 0 { "on" } else { "off" };
                println!(
                    "capture:      outbound {}, inbound {}, dns {}, probe bypass {}",
                    flag(pod_flags::CAPTURE_OUTBOUND),
                    flag(pod_flags::CAPTURE_INBOUND),
                    flag(pod_flags::CAPTURE_DNS),
                    flag(pod_flags::PROBE_BYPASS)
                );
                let ips: Vec<String> = p.ips.iter().map(ToString::to_string).collect();
                println!("addresses:    {}", ips.join(", "));
                for (port, dir) in &p.excluded_ports {
                    println!("excluded:     {dir} port {port}");
                }
                for (net, dir, action) in &p.cidr_rules {
                    println!("prefix rule:  {dir} {net} {action}");
                }
                println!("ingress:      {} packets, {} bytes", c.ingress_packets, c.ingress_bytes);
                println!("egress:       {} packets, {} bytes", c.egress_packets, c.egress_bytes);
                for d in &p.decisions {
                    println!("decision:     {} {} ({}): {}", d.hook, d.decision, d.why, d.count);
                }
            }
        }
        Cmd::Monitor { pod, netns, cookie, only, json, count } => {
            let cookie = match pod {
                Some(name) => {
                    let all = pods::list(&dp()?)?;
                    let found = all.iter().find(|p| p.info.name() == name.as_str());
                    Some(found.with_context(|| format!("no enrolled pod is named {name}"))?.cookie)
                }
                None => match (netns, cookie) {
                    (Some(path), _) => Some(Netns::open(path)?.cookie()),
                    (None, c) => *c,
                },
            };
            let filter =
                meshpath_loader::monitor::Filter { pod: cookie, drops_only: only.is_some() };
            monitor(&cli.pin_root, filter, *json, *count)?;
        }
        Cmd::DecisionCounters { state } => {
            meshpath_loader::decisions::set_counting(&dp()?, state == "on")?;
            println!("decision counters {state}");
        }
    }
    Ok(())
}

/// Set by SIGINT/SIGTERM: the monitor stops and switches the stream off.
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn monitor(
    root: &std::path::Path,
    filter: meshpath_loader::monitor::Filter,
    json: bool,
    count: Option<u64>,
) -> Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    use std::io::Write as _;
    // No SA_RESTART: the wait for events returns at once on a signal.
    let action = SigAction::new(SigHandler::Handler(on_stop), SaFlags::empty(), SigSet::empty());
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(sig, &action) }.context("installing the signal handler")?;
    }
    let mut m =
        meshpath_loader::monitor::Monitor::start(root, filter).context("starting the monitor")?;
    let mut out = std::io::stdout().lock();
    // The first line says the stream is on (scripts and tests wait for it).
    writeln!(out, "# monitoring datapath decisions (Ctrl-C to stop)")?;
    out.flush()?;
    let mut seen = 0u64;
    while !STOP.load(std::sync::atomic::Ordering::Relaxed) && count.is_none_or(|n| seen < n) {
        let Some(ev) = m.next(std::time::Duration::from_millis(500))? else { continue };
        seen += 1;
        let line = if json { ev.json().to_string() } else { ev.line() };
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            break; // the reader went away
        }
    }
    Ok(())
}

fn to_json(p: &PodStatus) -> serde_json::Value {
    let c = &p.counters;
    serde_json::json!({
        "cookie": p.cookie,
        "name": p.info.name(),
        "ifindex": p.info.ifindex,
        "capture_outbound": p.info.flags & pod_flags::CAPTURE_OUTBOUND != 0,
        "capture_inbound": p.info.flags & pod_flags::CAPTURE_INBOUND != 0,
        "probe_bypass": p.info.flags & pod_flags::PROBE_BYPASS != 0,
        "capture_dns": p.info.flags & pod_flags::CAPTURE_DNS != 0,
        "netns_inode": p.info.netns_inode,
        "pins": p.pins,
        "addresses": p.ips,
        "excluded_ports": p.excluded_ports.iter().map(|(port, dir)| serde_json::json!({"port": port, "direction": dir})).collect::<Vec<_>>(),
        "prefix_rules": p.cidr_rules.iter().map(|(net, dir, action)| serde_json::json!({"prefix": net.to_string(), "direction": dir, "action": action})).collect::<Vec<_>>(),
        "counters": {
            "ingress_packets": c.ingress_packets,
            "ingress_bytes": c.ingress_bytes,
            "egress_packets": c.egress_packets,
            "egress_bytes": c.egress_bytes,
        },
        "decisions": p.decisions.iter().map(|d| serde_json::json!({"hook": d.hook, "decision": d.decision, "reason": d.why, "count": d.count})).collect::<Vec<_>>(),
    })
}
