//! `cargo xtask cluster up|down|kubectl`: a real Kubernetes cluster of one or two nodes on this
//! machine (the second node: cluster/node2.rs), from Debian's packages: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
//! kubelet (kubernetes.rs builds them from Debian's source), containerd and runc, Debian's CNI
//! plugins (bridge + host-local) as the node's network. meshpath is then installed on it the
//! way users install it: `kubectl apply` of deploy/install (through tests/cluster's kustomize
//! overlay, which points the manifests at the locally built image), kubelet running the
//! DaemonSets.
//!
//! The first node has a network namespace of its own (`meshpath-node`), as a kind node has a
//! container: every component runs in it (so do hostNetwork pods, which share the runtime's),
//! the node address is a /32 on its `lo`, the pods hang off its `cni0` bridge, and nothing of
//! it reaches the host's network: `ip_forward`, the probe source addresses and every route stay
//! in that namespace. Everything else is the host's, as on a real node: the mounts
//! (/sys/fs/bpf, /sys/fs/cgroup, /var/run/netns), the CNI directories /opt/cni/bin and
//! /etc/cni/net.d, cgroups.
//!
//! What the cluster changes on the host, and `down` undoes: `/` and /sys/fs/bpf made shared
//! mounts (as systemd makes every mount; the DaemonSets' mount propagation needs it); the sysctls `vm.overcommit_memory`,
//! `kernel.panic` and `kernel.panic_on_oops` (saved at `up`, restored), /var/log/pods and
//! /var/log/containers, /var/lib/cni (the runtime's CNI results), /run/netns/cni-*, the
//! `kubepods` cgroups; and meshpath's own node footprint if an uninstall did not remove it:
//! /sys/fs/bpf/meshpath, /var/run/meshpath, /var/run/ztunnel. Only paths that did not exist
//! before `up` are removed.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use crate::{
    bootstrap::{ensure_debian_packages, run},
    images, kubernetes,
};

pub mod node2;

/// How many nodes `cargo xtask test` runs the cluster suite on.
pub const NODES_IN_TESTS: usize = 2;

/// The node's network namespace (`/run/netns/meshpath-node`).
pub const NETNS: &str = "meshpath-node";
pub const NODE_NAME: &str = "meshpath-node";
/// The node's address: a /32 on the node namespace's `lo`.
pub const NODE_IP: &str = "10.231.255.1";
/// The pods' subnet on the node's `cni0` bridge (host-local).
pub const POD_SUBNET: &str = "10.231.0.0/24";
const SERVICE_RANGE: &str = "10.96.0.0/16";
const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";
pub const APISERVER_PORT: u16 = 6443;
/// The cluster's files: PKI, kubeconfigs, etcd, kubelet's root, containerd's root, logs.
pub const DIR: &str = "/var/lib/meshpath-cluster";
/// containerd's state and socket (short: shims put unix sockets below it).
const RUN: &str = "/run/meshpath-cluster";
/// Where the node's runtime reads CNI plugins and configuration: the defaults, which the
/// shipped manifests mount.
pub const CNI_BIN: &str = "/opt/cni/bin";
pub const CNI_CONF: &str = "/etc/cni/net.d";
/// Where Debian's containernetworking-plugins installs the plugins.
const DEBIAN_CNI: &str = "/usr/lib/cni";
/// The node's own network configuration (bridge + host-local), as a simple cluster has.
const CONFLIST: &str = "10-meshpath-cluster.conflist";
/// The image tag `up` imports meshpath's image under: the overlay's. (The tests' rolling
/// updates are `kubectl rollout restart`s: a second tag rolled to would be rolled back by the
/// next test's `kubectl apply`, another roll of both nodes each time.)
pub const IMAGE_TAG: &str = "cluster";
/// The tag of the previous release's image.
const PREVIOUS_TAG: &str = "previous";

/// Sysctls kubelet sets on start.
const SYSCTLS: &[&str] = &["vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"];
/// Host paths the cluster or meshpath on it may create; removed at `down` if `up` did not
/// find them.
const HOST_PATHS: &[&str] = &[
    CNI_BIN,
    CNI_CONF,
    "/opt/cni",
    "/etc/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/cni",
    "/var/run/meshpath",
    "/var/run/ztunnel",
    "/sys/fs/bpf/meshpath",
];

/// Debian packages the node runs.
const PACKAGES: &[(&str, &str)] = &[
    ("containerd", "containerd"),
    ("runc", "runc"),
    ("containernetworking-plugins", "/usr/lib/cni/bridge"),
    ("etcd-server", "etcd"),
    ("openssl", "openssl"),
    ("curl", "curl"),
    ("iproute2", "ip"),
    ("util-linux", "nsenter"),
];

fn dir() -> PathBuf {
    PathBuf::from(DIR)
}

fn state_path() -> PathBuf {
    dir().join("state.json")
}

/// The administrator's kubeconfig (server: the node address, inside the node namespace).
pub fn admin_kubeconfig() -> PathBuf {
    dir().join("admin.kubeconfig")
}

/// A command run inside the node's network namespace (`nsenter --net`, which leaves the mounts
/// alone: `ip netns exec` would remount /sys and hide bpffs).
pub fn in_node(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{NETNS}")).arg("--").arg(program);
    c
}

/// `kubectl` as the cluster's administrator.
pub fn kubectl() -> Command {
    let mut c = in_node("kubectl");
    c.arg("--kubeconfig").arg(admin_kubeconfig());
    c
}

/// What `up` found and started, for `down`.
#[derive(Default)]
struct State {
    pids: BTreeMap<String, i32>,
    sysctls: BTreeMap<String, String>,
    /// Host paths that did not exist before `up`.
    created: Vec<String>,
    /// /run/netns entries that existed before `up`.
    netns_before: Vec<String>,
    /// Mount points `up` made shared (they were private).
    made_shared: Vec<String>,
}

impl State {
    fn to_json(&self) -> Value {
        json!({"pids": self.pids, "sysctls": self.sysctls, "created": self.created,
               "netns_before": self.netns_before, "made_shared": self.made_shared})
    }

    fn from_json(v: &Value) -> Self {
        let strings = |k: &str| -> Vec<String> {
            v[k].as_array()
                .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
                .unwrap_or_default()
        };
        Self {
            pids: v["pids"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .filter_map(|(k, p)| Some((k.clone(), i32::try_from(p.as_i64()?).ok()?)))
                        .collect()
                })
                .unwrap_or_default(),
            sysctls: v["sysctls"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .filter_map(|(k, s)| Some((k.clone(), s.as_str()?.to_owned())))
                        .collect()
                })
                .unwrap_or_default(),
            created: strings("created"),
            netns_before: strings("netns_before"),
            made_shared: strings("made_shared"),
        }
    }

    fn save(&self) -> Result<()> {
        fs::write(state_path(), serde_json::to_string_pretty(&self.to_json())?)?;
        Ok(())
    }
}

fn netns_entries() -> Vec<String> {
    fs::read_dir("/run/netns")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// Whether a cluster made by `up` is there (running or not).
pub fn exists() -> bool {
    state_path().exists() || Path::new("/run/netns").join(NETNS).exists()
}

/// Starts the cluster and installs nothing of meshpath's: its images are imported (built from
/// the binaries in `bin_dir`), so `kubectl apply -k tests/cluster` installs it; with
/// `previous` (the previous release's binaries, xtask/src/previous.rs), its image too, as
/// `localhost/meshpath:previous`, built from its own Containerfile.
pub fn up(root: &Path, bin_dir: &Path, previous: Option<&Path>, nodes: usize) -> Result<()> {
    if !(1..=2).contains(&nodes) {
        bail!("the cluster has 1 or 2 nodes, not {nodes}");
    }
    let started = Instant::now();
    if exists() {
        println!("cluster: one is already there; taking it down first");
        down()?;
    }
    ensure_debian_packages(PACKAGES)?;
    kubernetes::ensure()?;
    println!("cluster: building images (pause, meshpath from deploy/Containerfile, test app)");
    let mut archives = vec![
        images::pause()?,
        images::meshpath(root, bin_dir, &[IMAGE_TAG])?,
        images::testapp(bin_dir)?,
    ];
    if let Some(previous) = previous {
        archives.push(images::meshpath(&crate::previous::source_dir(), previous, &[PREVIOUS_TAG])?);
    }
    let is_conf =
        |p: &Path| p.extension().is_some_and(|x| x == "conf" || x == "conflist" || x == "json");
    if fs::read_dir(CNI_CONF).is_ok_and(|d| d.flatten().any(|e| is_conf(&e.path()))) {
        bail!(
            "{CNI_CONF} already holds a CNI configuration: this machine looks like a node \
             already; the cluster would take it over. Remove it or run elsewhere"
        );
    }
    let mut state = State {
        created: HOST_PATHS
            .iter()
            .filter(|p| !Path::new(p).exists())
            .map(|p| (*p).to_owned())
            .collect(),
        netns_before: netns_entries(),
        ..State::default()
    };
    for s in SYSCTLS {
        let v = fs::read_to_string(Path::new("/proc/sys").join(s))?;
        state.sysctls.insert((*s).to_owned(), v.trim().to_owned());
    }
    fs::create_dir_all(dir().join("logs"))?;
    fs::create_dir_all(RUN)?;
    state.save()?;
    let result = start(&mut state, &archives).and_then(|()| {
        if nodes == 2 {
            node2::start(&mut state, &archives)?;
        }
        Ok(())
    });
    state.save()?;
    if let Err(e) = result {
        println!("cluster: start failed ({e:#}); logs in {DIR}/logs; taking it down");
        let _ = down();
        return Err(e);
    }
    let names = if nodes == 2 {
        format!("nodes {NODE_NAME} and {}", node2::NAME)
    } else {
        format!("node {NODE_NAME}")
    };
    println!(
        "cluster: {names} Ready in {} s; kubectl: `cargo xtask cluster kubectl -- get \
         pods -A` (or nsenter --net=/run/netns/{NETNS} kubectl --kubeconfig {})",
        started.elapsed().as_secs(),
        admin_kubeconfig().display()
    );
    Ok(())
}

/// Mounts a node needs shared (systemd makes every mount shared; this machine's init does not),
/// each alone, not recursively: `/`, which holds the agent's host paths that are no mount points
/// themselves (/var/run/netns is looked up without following the /var/run link, and its
/// HostToContainer propagation needs a shared or slave mount), and bpffs, which the agent's init
/// container mounts with Bidirectional propagation (a shared mount only).
const SHARED_MOUNTS: &[&str] = &["/", "/sys/fs/bpf"];

/// Whether `point` is a mount point, and whether it is shared (mountinfo's `shared:N`).
fn mount_propagation(point: &str) -> Option<bool> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let (pre, _) = l.split_once(" - ")?;
        let f: Vec<&str> = pre.split_whitespace().collect();
        (f.get(4) == Some(&point)).then(|| f[6..].iter().any(|o| o.starts_with("shared:")))
    })
}

/// Imports OCI archives into the node's containerd (CRI's namespace, where kubelet looks).
fn import(archives: &[PathBuf]) -> Result<()> {
    import_with(Command::new("ctr"), &Path::new(RUN).join("containerd.sock"), archives)
}

/// [`import`] through `ctr` (a command that runs it in some node's mounts) and `sock`.
fn import_with(ctr: Command, sock: &Path, archives: &[PathBuf]) -> Result<()> {
    let (program, pre): (std::ffi::OsString, Vec<std::ffi::OsString>) =
        (ctr.get_program().to_owned(), ctr.get_args().map(|a| a.to_owned()).collect());
    for a in archives {
        run(Command::new(&program)
            .args(&pre)
            .arg("--address")
            .arg(sock)
            .args(["-n", "k8s.io", "images", "import", "--no-unpack"])
            .arg(a)
            .stdout(Stdio::null()))
        .with_context(|| format!("importing {}", a.display()))?;
    }
    Ok(())
}

/// Rebuilds meshpath's image from the binaries in `bin_dir` and imports it under its tags
/// into the running cluster (pods already running keep the image they started with).
pub fn reload_image(root: &Path, bin_dir: &Path) -> Result<()> {
    if !exists() {
        bail!("no cluster is up: cargo xtask cluster up");
    }
    let archives = [images::meshpath(root, bin_dir, &[IMAGE_TAG])?];
    import(&archives)?;
    // Every node runs the DaemonSets: each containerd gets the image.
    node2::import_if_up(&archives)?;
    println!("cluster: meshpath's image rebuilt and imported as {}:{IMAGE_TAG}", images::MESHPATH);
    Ok(())
}

fn start(state: &mut State, archives: &[PathBuf]) -> Result<()> {
    for m in SHARED_MOUNTS {
        match mount_propagation(m) {
            None => bail!("{m} is not a mount point (bpffs is mounted by `cargo xtask setup`)"),
            Some(true) => {}
            Some(false) => {
                run(Command::new("mount").args(["--make-shared", m]))?;
                state.made_shared.push((*m).to_owned());
            }
        }
    }
    // The node's network namespace and address.
    run(Command::new("ip").args(["netns", "add", NETNS]))?;
    run(Command::new("ip").args(["-n", NETNS, "link", "set", "lo", "up"]))?;
    run(Command::new("ip").args([
        "-n",
        NETNS,
        "addr",
        "add",
        &format!("{NODE_IP}/32"),
        "dev",
        "lo",
    ]))?;
    pki()?;
    cni()?;
    // containerd first: images imported before kubelet asks for them.
    fs::write(dir().join("containerd.toml"), containerd_config(&dir(), RUN))?;
    let containerd = daemon(
        "containerd",
        "containerd",
        &["--config".as_ref(), dir().join("containerd.toml").as_os_str()],
    )?;
    state.pids.insert("containerd".into(), containerd);
    let sock = Path::new(RUN).join("containerd.sock");
    wait("containerd's socket", Duration::from_secs(30), || Ok(sock.exists()))?;
    import(archives)?;
    let etcd_dir = dir().join("etcd");
    let etcd = daemon(
        "etcd",
        "etcd",
        &[
            "--name".as_ref(),
            "node".as_ref(),
            "--data-dir".as_ref(),
            etcd_dir.as_os_str(),
            "--listen-client-urls".as_ref(),
            "http://127.0.0.1:2379".as_ref(),
            "--advertise-client-urls".as_ref(),
            "http://127.0.0.1:2379".as_ref(),
            "--listen-peer-urls".as_ref(),
            "http://127.0.0.1:2380".as_ref(),
            "--initial-advertise-peer-urls".as_ref(),
            "http://127.0.0.1:2380".as_ref(),
            "--initial-cluster".as_ref(),
            "node=http://127.0.0.1:2380".as_ref(),
        ],
    )?;
    state.pids.insert("etcd".into(), etcd);
    let d = dir();
    let p = |f: &str| d.join(f).display().to_string();
    let apiserver_args: Vec<String> = vec![
        "--etcd-servers=http://127.0.0.1:2379".into(),
        "--bind-address=0.0.0.0".into(),
        format!("--secure-port={APISERVER_PORT}"),
        "--insecure-port=0".into(),
        format!("--advertise-address={NODE_IP}"),
        format!("--tls-cert-file={}", p("pki/apiserver.crt")),
        format!("--tls-private-key-file={}", p("pki/apiserver.key")),
        format!("--client-ca-file={}", p("pki/ca.crt")),
        format!("--token-auth-file={}", p("pki/tokens.csv")),
        format!("--service-account-key-file={}", p("pki/sa.key")),
        format!("--service-account-signing-key-file={}", p("pki/sa.key")),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        "--authorization-mode=Node,RBAC".into(),
        "--enable-admission-plugins=NodeRestriction".into(),
        format!("--service-cluster-ip-range={SERVICE_RANGE}"),
        "--kubelet-preferred-address-types=InternalIP".into(),
        "--allow-privileged=true".into(),
    ];
    let apiserver =
        daemon_s("kube-apiserver", &kubernetes::binary("kube-apiserver"), &apiserver_args)?;
    state.pids.insert("kube-apiserver".into(), apiserver);
    wait("the API server", Duration::from_secs(90), || {
        Ok(kubectl()
            .args(["get", "--raw", "/readyz"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?
            .success())
    })?;
    let cm = daemon_s(
        "kube-controller-manager",
        &kubernetes::binary("kube-controller-manager"),
        &[
            format!("--kubeconfig={}", p("controller-manager.kubeconfig")),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--service-account-private-key-file={}", p("pki/sa.key")),
            format!("--root-ca-file={}", p("pki/ca.crt")),
            "--controllers=*".into(),
            "--use-service-account-credentials=true".into(),
        ],
    )?;
    state.pids.insert("kube-controller-manager".into(), cm);
    let sched = daemon_s(
        "kube-scheduler",
        &kubernetes::binary("kube-scheduler"),
        &[
            format!("--kubeconfig={}", p("scheduler.kubeconfig")),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
        ],
    )?;
    state.pids.insert("kube-scheduler".into(), sched);
    fs::write(d.join("kubelet.yaml"), kubelet_config(NODE_IP, None))?;
    let kubelet = daemon_s(
        "kubelet",
        &kubernetes::binary("kubelet"),
        &kubelet_args(&d, "kubelet.kubeconfig", RUN, NODE_NAME, NODE_IP),
    )?;
    state.pids.insert("kubelet".into(), kubelet);
    state.save()?;
    wait_ready(NODE_NAME)?;
    // Pods need their namespace's default ServiceAccount (the controller-manager makes it).
    wait("the default ServiceAccount", Duration::from_secs(60), || {
        Ok(kubectl()
            .args(["get", "serviceaccount", "default"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?
            .success())
    })?;
    Ok(())
}

/// kubelet's command line for the node `name` at `ip` whose files are below `files` (its
/// configuration in kubelet.yaml there) and whose runtime's socket is below `run`.
fn kubelet_args(files: &Path, kubeconfig: &str, run: &str, name: &str, ip: &str) -> Vec<String> {
    let p = |f: &str| files.join(f).display().to_string();
    vec![
        format!("--kubeconfig={}", dir().join(kubeconfig).display()),
        format!("--config={}", p("kubelet.yaml")),
        "--container-runtime=remote".into(),
        format!("--container-runtime-endpoint=unix://{run}/containerd.sock"),
        format!("--pod-infra-container-image={}", images::PAUSE),
        format!("--root-dir={}", p("kubelet")),
        format!("--cert-dir={}", p("kubelet-pki")),
        format!("--hostname-override={name}"),
        format!("--node-ip={ip}"),
    ]
}

/// Waits for the node `name` to be Ready.
fn wait_ready(name: &str) -> Result<()> {
    wait(&format!("node {name} to be Ready"), Duration::from_secs(120), || {
        let out = kubectl()
            .args(["get", "node", name, "-o"])
            .arg(r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#)
            .stderr(Stdio::null())
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).trim() == "True")
    })
}

/// Polls `ready` every 200 ms until it says yes or `limit` passes.
fn wait(what: &str, limit: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if ready().unwrap_or(false) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("waited {} s for {what}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Starts `program` in the node's namespace, in a session of its own (it outlives xtask), its
/// output into logs/NAME.log; returns its pid.
fn daemon(
    name: &str,
    program: impl AsRef<std::ffi::OsStr>,
    args: &[&std::ffi::OsStr],
) -> Result<i32> {
    let mut cmd = in_node(program);
    cmd.args(args);
    spawn_daemon(name, cmd)
}

/// Starts `cmd` (a program, through `nsenter`, in some node's namespaces) in a session of its
/// own, its output into logs/NAME.log; returns its pid.
pub(crate) fn spawn_daemon(name: &str, mut cmd: Command) -> Result<i32> {
    let log = fs::File::create(dir().join("logs").join(format!("{name}.log")))?;
    cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
    // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    // nsenter execs the program: the pid is the program's.
    Ok(child.id() as i32)
}

fn daemon_s(name: &str, program: &Path, args: &[String]) -> Result<i32> {
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    daemon(name, program, &args)
}

/// The CA, the API server's serving certificate (the node address, 127.0.0.1, the
/// `kubernetes` Service), the service account key, a token per component and their
/// kubeconfigs.
fn pki() -> Result<()> {
    let pki = dir().join("pki");
    fs::create_dir_all(&pki)?;
    let openssl = |args: &[&str]| {
        run(Command::new("openssl")
            .args(args)
            .current_dir(&pki)
            .stdout(Stdio::null())
            .stderr(Stdio::null()))
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "30",
        "-subj",
        "/CN=meshpath-cluster-ca",
    ])?;
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        "-subj",
        "/CN=kube-apiserver",
    ])?;
    fs::write(
        pki.join("apiserver.ext"),
        format!(
            "subjectAltName=IP:{NODE_IP},IP:127.0.0.1,IP:{KUBERNETES_SERVICE_IP},DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,\
             DNS:kubernetes.default.svc.cluster.local\n"
        ),
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "apiserver.crt",
        "-days",
        "30",
        "-extfile",
        "apiserver.ext",
    ])?;
    openssl(&["genrsa", "-out", "sa.key", "2048"])?;
    let token = |who: &str| format!("{who}-{:016x}", rand_u64());
    let (admin, kubelet, kubelet2, cm, sched) =
        (token("admin"), token("kubelet"), token("kubelet2"), token("cm"), token("sched"));
    let node2 = node2::NAME;
    fs::write(
        pki.join("tokens.csv"),
        format!(
            "{admin},admin,admin,system:masters\n\
             {kubelet},system:node:{NODE_NAME},kubelet,system:nodes\n\
             {kubelet2},system:node:{node2},kubelet2,system:nodes\n\
             {cm},system:kube-controller-manager,cm\n\
             {sched},system:kube-scheduler,sched\n"
        ),
    )?;
    for (file, tok) in [
        ("admin.kubeconfig", &admin),
        ("kubelet.kubeconfig", &kubelet),
        (node2::KUBECONFIG, &kubelet2),
        ("controller-manager.kubeconfig", &cm),
        ("scheduler.kubeconfig", &sched),
    ] {
        fs::write(dir().join(file), kubeconfig(tok))?;
    }
    Ok(())
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most the buffer's length into it.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Tokens of a cluster reachable only inside its own namespace: the pid and the clock
        // are enough if the kernel has no entropy to give.
        return u64::from(std::process::id()) ^ Instant::now().elapsed().as_nanos() as u64;
    }
    u64::from_ne_bytes(b)
}

fn kubeconfig(token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: meshpath\n  cluster:\n    server: \
         https://{NODE_IP}:{APISERVER_PORT}\n    certificate-authority: {DIR}/pki/ca.crt\nusers:\n- \
         name: user\n  user:\n    token: {token}\ncontexts:\n- name: meshpath\n  context:\n    \
         cluster: meshpath\n    user: user\ncurrent-context: meshpath\n"
    )
}

/// Debian's plugins where the runtime looks, and the node's own bridge network.
fn cni() -> Result<()> {
    fs::create_dir_all(CNI_BIN)?;
    fs::create_dir_all(CNI_CONF)?;
    for p in ["bridge", "host-local", "loopback"] {
        fs::copy(Path::new(DEBIAN_CNI).join(p), Path::new(CNI_BIN).join(p))
            .with_context(|| format!("copying the {p} plugin from {DEBIAN_CNI}"))?;
    }
    fs::write(Path::new(CNI_CONF).join(CONFLIST), conflist(POD_SUBNET))?;
    Ok(())
}

/// A node's own network configuration: its pods on its `cni0` bridge, addresses from `subnet`.
fn conflist(subnet: &str) -> String {
    // No ipMasq and no portmap: both write iptables rules, and nothing here needs them.
    let conf = json!({
        "cniVersion": "1.0.0",
        "name": "meshpath-cluster",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet}]],
                "routes": [{"dst": "0.0.0.0/0"}]
            }
        }]
    });
    format!("{conf:#}")
}

/// containerd's configuration for a node whose files are below `files` and whose state and
/// socket below `run`.
fn containerd_config(files: &Path, run: &str) -> String {
    let files = files.display();
    format!(
        r#"version = 2
root = "{files}/containerd"
state = "{run}/containerd"
[grpc]
  address = "{run}/containerd.sock"
# Its "opt" directory in the cluster's files, not /opt/containerd.
[plugins."io.containerd.internal.v1.opt"]
  path = "{files}/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # This sandbox may not raise a process's OOM score adjustment (no CAP_SYS_RESOURCE).
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{CNI_CONF}"
"#,
        pause = images::PAUSE
    )
}

/// kubelet's configuration for the node at `ip`; `cgroup_root` for a node that shares the
/// machine's cgroups with another (its pods' cgroups below it, where the other's kubelet,
/// which removes every pod cgroup it does not know, does not look).
fn kubelet_config(ip: &str, cgroup_root: Option<&str>) -> String {
    let cgroup_root =
        cgroup_root.map(|r| format!("cgroupRoot: {r}\ncgroupsPerQOS: true\n")).unwrap_or_default();
    // Anonymous access with AlwaysAllow on the kubelet's port: it listens only inside the
    // node's namespace. syncFrequency 10 s: a ConfigMap edit reaches a pod's volume within
    // seconds (the proxy's workloads file). No eviction for disk: the node's disk is the
    // machine's, shared with builds that fill it (CI's once had under 1 % free, and the
    // kubelet's DiskPressure then admitted no pod); a 0% threshold turns a signal off.
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
failSwapOn: false
makeIPTablesUtilChains: false
syncFrequency: 10s
clusterDomain: cluster.local
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
  imagefs.inodesFree: "0%"
{cgroup_root}"#
    )
}

/// The state file `up` wrote (empty if there is none).
fn saved_state() -> State {
    fs::read_to_string(state_path())
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .map(|v| State::from_json(&v))
        .unwrap_or_default()
}

/// Stops everything `up` started and undoes what it and kubelet changed on the host.
pub fn down() -> Result<()> {
    let state = saved_state();
    // kubelets first: they would restart what the next steps stop.
    for name in [node2::KUBELET, "kubelet", "kube-scheduler", "kube-controller-manager"] {
        if let Some(pid) = state.pids.get(name) {
            stop(*pid);
        }
    }
    kill_pods();
    kill_shims();
    // The second node's holder last of its processes: its mounts go with it.
    for name in [node2::CONTAINERD, node2::HOLDER, "containerd", "kube-apiserver", "etcd"] {
        if let Some(pid) = state.pids.get(name) {
            stop(*pid);
        }
    }
    node2::remove_network();
    // Pod network namespaces the runtime made.
    for n in netns_entries() {
        if n.starts_with("cni-") && !state.netns_before.contains(&n) {
            let p = Path::new("/run/netns").join(&n);
            let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
            let _ = fs::remove_file(&p);
        }
    }
    unmount_below(&[DIR, RUN]);
    remove_kubepods_cgroups();
    let _ = Command::new("ip").args(["netns", "del", NETNS]).stderr(Stdio::null()).status();
    for m in &state.made_shared {
        let _ = Command::new("mount").args(["--make-private", m]).status();
    }
    for (k, v) in &state.sysctls {
        let _ = fs::write(Path::new("/proc/sys").join(k), v);
    }
    for p in &state.created {
        let p = Path::new(p);
        if p.is_dir() {
            let _ = fs::remove_dir_all(p);
        } else {
            let _ = fs::remove_file(p);
        }
    }
    if Path::new(CNI_CONF).join(CONFLIST).exists() {
        let _ = fs::remove_file(Path::new(CNI_CONF).join(CONFLIST));
    }
    let _ = fs::remove_dir_all(RUN);
    let _ = fs::remove_dir_all(DIR);
    if Path::new(DIR).exists() {
        bail!("{DIR} could not be removed (a mount left below it?)");
    }
    println!("cluster: down; the host is as it was");
    Ok(())
}

/// SIGTERM, up to 10 s, then SIGKILL.
fn stop(pid: i32) {
    use nix::{sys::signal, unistd::Pid};
    let p = Pid::from_raw(pid);
    if signal::kill(p, signal::Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // Reap it if it is our child (it is not after `up` returned).
        let _ = nix::sys::wait::waitpid(p, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
        if signal::kill(p, None).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = signal::kill(p, signal::Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(p, None);
}

/// Every cgroup directory named `kubepods` under the mounted hierarchies, and the second node's
/// cgroup roots.
fn kubepods_roots() -> Vec<PathBuf> {
    let mut roots = node2::cgroup_roots();
    let base = Path::new("/sys/fs/cgroup");
    if base.join("kubepods").is_dir() {
        roots.push(base.join("kubepods"));
    }
    for e in fs::read_dir(base).into_iter().flatten().flatten() {
        let k = e.path().join("kubepods");
        if k.is_dir() {
            roots.push(k);
        }
    }
    roots
}

fn walk_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            walk_dirs(&e.path(), out);
        }
    }
}

/// Kills every process of every pod (what is in the `kubepods` cgroups), until none is left.
fn kill_pods() {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut any = false;
        for root in kubepods_roots() {
            let mut dirs = Vec::new();
            walk_dirs(&root, &mut dirs);
            for d in dirs {
                let procs = fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    any = true;
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        if !any || Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Kills the runtime's shims of this cluster (they outlive containerd).
fn kill_shims() {
    let socks = [format!("{RUN}/containerd.sock"), node2::containerd_socket()];
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let cmdline = fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("containerd-shim") && socks.iter().any(|s| cmdline.contains(s)) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Unmounts every mount below `prefixes`, deepest first.
fn unmount_below(prefixes: &[&str]) {
    for _ in 0..3 {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<String> = info
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4).map(str::to_owned))
            .filter(|p| prefixes.iter().any(|pre| p.starts_with(pre)))
            .collect();
        if points.is_empty() {
            return;
        }
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let _ = nix::mount::umount2(p.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Removes the `kubepods` cgroups, deepest first (a cgroup goes once it has no process).
fn remove_kubepods_cgroups() {
    for root in kubepods_roots() {
        let mut dirs = Vec::new();
        walk_dirs(&root, &mut dirs);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            let _ = fs::remove_dir(&d);
        }
    }
}
