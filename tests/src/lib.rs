//! Test fixtures for meshpath's end-to-end tests: pod-like network namespaces joined by veth,
//! private pin roots, real TCP traffic. Every fixture removes what it made when dropped, also
//! when the test fails, and every name is unique so tests run in parallel and again.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
    thread::JoinHandle,
};

use anyhow::{bail, Context as _, Result};
use meshpath_loader::{datapath::Datapath, netns::Netns};

/// Panics unless running as root: these tests load eBPF programs and create namespaces. They are
/// never skipped, so a run without privileges fails loudly instead of passing empty.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "meshpath's end-to-end tests must run as root (they load eBPF programs)");
}

/// A name no other test (in this or another process) is using: `prefix` + pid + counter.
/// Kept short: interface names are limited to 15 bytes.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{}x{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed))
}

/// Runs a command, failing with its stderr if it does not succeed.
pub fn sh(program: &str, args: &[&str]) -> Result<Output> {
    let out =
        Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// A named network namespace (`ip netns add`), deleted on drop.
#[derive(Debug)]
pub struct NetnsGuard {
    name: String,
}

impl NetnsGuard {
    pub fn new(prefix: &str) -> Result<Self> {
        let name = unique(prefix);
        sh("ip", &["netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    pub fn open(&self) -> Result<Netns> {
        Ok(Netns::open(&self.path())?)
    }

    /// A TCP listener on `addr` inside this namespace.
    pub fn listen(&self, addr: SocketAddr) -> Result<TcpListener> {
        Ok(self.open()?.run(|| TcpListener::bind(addr))??)
    }

    /// A TCP listener on `addr` inside this namespace, bound as the proxy binds it: from a
    /// process in `cgroup`. In an enrolled pod the datapath lets only the proxy's cgroup bind
    /// the proxy's ports, so a test that stands in for the proxy on one of them binds this way.
    pub fn listen_in_cgroup(&self, addr: SocketAddr, cgroup: &CgroupGuard) -> Result<TcpListener> {
        self.listen_in_cgroup_with(addr, cgroup, false)
    }

    /// [`Self::listen_in_cgroup`], with `SO_REUSEPORT` set when `reuse_port` (as ztunnel sets
    /// it on its in-pod listeners).
    pub fn listen_in_cgroup_with(
        &self,
        addr: SocketAddr,
        cgroup: &CgroupGuard,
        reuse_port: bool,
    ) -> Result<TcpListener> {
        let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
        let sock =
            self.open()?.run(|| socket2::Socket::new(domain, socket2::Type::STREAM, None))??;
        sock.set_reuse_address(true)?;
        sock.set_reuse_port(reuse_port)?;
        in_cgroup(&sock, SocketCall::Bind, &addr.into(), cgroup.path())
            .with_context(|| format!("binding {addr} from cgroup {}", cgroup.path().display()))?;
        sock.listen(128)?;
        Ok(sock.into())
    }

    /// A TCP connection to `to` from inside this namespace, connected as the proxy connects:
    /// from a process in `cgroup`, so the datapath does not capture it (a peer node's proxy
    /// reaching a pod's HBONE port from its own pod's address).
    pub fn connect_in_cgroup(&self, to: SocketAddr, cgroup: &CgroupGuard) -> Result<TcpStream> {
        let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
        let sock =
            self.open()?.run(|| socket2::Socket::new(domain, socket2::Type::STREAM, None))??;
        in_cgroup(&sock, SocketCall::Connect, &to.into(), cgroup.path()).with_context(|| {
            format!("connecting to {to} from cgroup {}", cgroup.path().display())
        })?;
        Ok(sock.into())
    }

    /// A transparent connection made inside this namespace, as a proxy keeping its client's
    /// address makes one (`IP_TRANSPARENT` and `IP_FREEBIND`, bound to `from`, which need not
    /// be local): bound from `cgroup` when given (the proxy's: the datapath judges the bind by
    /// its cgroup), else by this process, as an app with CAP_NET_RAW would. Non-blocking: the
    /// connect is only started.
    pub fn transparent_connect(
        &self,
        from: SocketAddr,
        to: SocketAddr,
        cgroup: Option<&CgroupGuard>,
    ) -> Result<socket2::Socket> {
        let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
        let sock = self.open()?.run(|| -> std::io::Result<socket2::Socket> {
            let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
            s.set_ip_transparent(true)?;
            s.set_freebind(true)?;
            Ok(s)
        })??;
        match cgroup {
            Some(c) => in_cgroup(&sock, SocketCall::Bind, &from.into(), c.path())?,
            None => sock.bind(&from.into())?,
        }
        sock.set_nonblocking(true)?;
        match sock.connect(&to.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(sock)
    }

    /// `nsenter --net=<this netns> ARGS…`, not waited for: killed when the guard drops.
    pub fn spawn(&self, args: &[&str]) -> Result<ChildGuard> {
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.path().display()))
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", args.join(" ")))?;
        Ok(ChildGuard(child))
    }

    /// An iperf3 server on `ip:port` in this namespace (one test if `once`), returned once it
    /// listens.
    pub fn iperf3_server(&self, ip: IpAddr, port: u16, once: bool) -> Result<ChildGuard> {
        let (ip_s, port_s) = (ip.to_string(), port.to_string());
        let mut args = vec!["iperf3", "-s", "-B", &ip_s, "-p", &port_s];
        if once {
            args.push("-1");
        }
        let server = self.spawn(&args)?;
        self.wait_listening(port, std::time::Duration::from_secs(10))?;
        Ok(server)
    }

    /// Waits until a TCP socket listens on `port` in this namespace (as `ss` sees it), without
    /// connecting to it.
    pub fn wait_listening(&self, port: u16, timeout: std::time::Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let out = Command::new("ip")
                .args(["netns", "exec", self.name(), "ss", "-Hltn"])
                .arg(format!("sport = :{port}"))
                .output()
                .context("running ss")?;
            if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                bail!("nothing listens on port {port} in {} after {timeout:?}", self.name());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Runs `iperf3 -c ip -p port -J EXTRA…` in this namespace; its JSON report.
    pub fn iperf3_client(
        &self,
        ip: IpAddr,
        port: u16,
        extra: &[&str],
    ) -> Result<serde_json::Value> {
        let (ip, port) = (ip.to_string(), port.to_string());
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.path().display()))
            .args(["iperf3", "-c", &ip, "-p", &port, "-J"])
            .args(extra)
            .output()
            .context("running iperf3 -c")?;
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
        if let Some(err) = report["error"].as_str() {
            bail!("iperf3: {err}");
        }
        if !out.status.success() {
            bail!("iperf3 exited with {}", out.status);
        }
        Ok(report)
    }

    /// `ip -n NAME ARGS…`
    pub fn ip(&self, args: &[&str]) -> Result<Output> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        sh("ip", &all)
    }
}

impl NetnsGuard {
    /// Deletes the namespace now, as a runtime does when a pod goes (no unenrol).
    pub fn delete(&self) -> Result<()> {
        sh("ip", &["netns", "del", &self.name]).map(drop)
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        // Deleting the netns also deletes the veth ends inside it.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Two dual-stack pods, each in its own netns with an `eth0`, joined by a veth pair on
/// 10.199.0.0/24 and fd00:199::/64.
#[derive(Debug)]
pub struct PodPair {
    pub a: NetnsGuard,
    pub b: NetnsGuard,
    pub a_ip: Ipv4Addr,
    pub b_ip: Ipv4Addr,
    pub a_ip6: Ipv6Addr,
    pub b_ip6: Ipv6Addr,
}

impl PodPair {
    pub fn new() -> Result<Self> {
        let a = NetnsGuard::new("mpa")?;
        let b = NetnsGuard::new("mpb")?;
        let (va, vb) = (unique("va"), unique("vb"));
        sh(
            "ip",
            &[
                "link",
                "add",
                &va,
                "netns",
                a.name(),
                "type",
                "veth",
                "peer",
                "name",
                &vb,
                "netns",
                b.name(),
            ],
        )?;
        let (a_ip, b_ip) = (Ipv4Addr::new(10, 199, 0, 1), Ipv4Addr::new(10, 199, 0, 2));
        let a_ip6: Ipv6Addr = "fd00:199::1".parse()?;
        let b_ip6: Ipv6Addr = "fd00:199::2".parse()?;
        for (ns, dev, ip, ip6) in [(&a, &va, a_ip, a_ip6), (&b, &vb, b_ip, b_ip6)] {
            ns.ip(&["link", "set", dev, "name", "eth0"])?;
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
            // nodad: usable at once, no duplicate address detection wait.
            ns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
        }
        Ok(Self { a, b, a_ip, b_ip, a_ip6, b_ip6 })
    }
}

/// A private pin root under /sys/fs/bpf, removed (with every pin in it, which detaches the links
/// they hold) on drop.
#[derive(Debug)]
pub struct PinRoot {
    path: PathBuf,
}

impl PinRoot {
    pub fn new() -> Self {
        Self { path: Path::new("/sys/fs/bpf").join(unique("meshpath-test-")) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens (creating on first use) the datapath under this root. The returned handle holds the
    /// root's lock: drop it before running a loader process on the same root.
    pub fn datapath(&self) -> Result<Datapath> {
        Ok(Datapath::open_or_load(&self.path)?)
    }

    /// Every pin file under the root's `pods/` directory.
    pub fn pod_pins(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let pods = self.path.join(datapath_common::consts::pins::PODS_DIR);
        for dir in std::fs::read_dir(pods).into_iter().flatten().flatten() {
            out.push(dir.path());
            out.extend(
                std::fs::read_dir(dir.path()).into_iter().flatten().flatten().map(|e| e.path()),
            );
        }
        out
    }
}

impl Default for PinRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The `meshpath-loader` binary of this build (`MESHPATH_LOADER` overrides).
pub fn loader_bin() -> PathBuf {
    match std::env::var_os("MESHPATH_LOADER") {
        Some(p) => PathBuf::from(p),
        None => sibling_bin("meshpath-loader"),
    }
}

/// A binary of this build, in target/<profile>/ (test binaries run from its deps/).
pub fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("the executable's directory").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// A child process killed (and reaped) on drop, so a failing test or bench leaves none behind.
#[derive(Debug)]
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads one line (5 s at most) from a connection, without the newline.
pub fn read_line(conn: &TcpStream) -> String {
    use std::io::BufRead as _;
    conn.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
    let mut line = String::new();
    std::io::BufReader::new(conn).read_line(&mut line).expect("read a line from the proxy");
    line.trim_end().to_owned()
}

/// Runs `meshpath-loader --pin-root ROOT ARGS…` as a separate process.
pub fn loader(root: &PinRoot, args: &[&str]) -> Output {
    Command::new(loader_bin())
        .arg("--pin-root")
        .arg(root.path())
        .args(args)
        .output()
        .expect("running meshpath-loader (build it first: cargo xtask build)")
}

/// A TCP server inside `ns` that counts the bytes it receives on one connection.
pub fn tcp_sink(ns: &Netns, addr: SocketAddrV4) -> Result<JoinHandle<std::io::Result<u64>>> {
    let listener = ns.run(|| TcpListener::bind(addr))??;
    Ok(std::thread::spawn(move || {
        let (mut conn, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            match conn.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    }))
}

/// Connects from inside `ns` to `addr` and sends exactly `bytes` bytes, then closes.
pub fn tcp_send(ns: &Netns, addr: SocketAddrV4, bytes: usize) -> Result<u64> {
    let mut conn = ns.run(|| TcpStream::connect(SocketAddr::V4(addr)))??;
    let chunk = vec![0x5au8; 1 << 16];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        conn.write_all(&chunk[..n])?;
        left -= n;
    }
    conn.shutdown(std::net::Shutdown::Write)?;
    // Wait for the peer to close so every segment has crossed both TC hooks.
    let mut rest = [0u8; 1];
    let _ = conn.read(&mut rest)?;
    retransmitted_at_most(&conn)
}

/// At most how many payload bytes `conn` sent twice: its retransmitted segments (TCP_INFO's
/// `tcpi_total_retrans`) times its MSS. A loaded machine retransmits now and then, and a
/// counter of bytes on the wire rightly counts those bytes again.
fn retransmitted_at_most(conn: &TcpStream) -> Result<u64> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: an all-zero tcp_info is valid; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` outlive the call and describe the buffer.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("TCP_INFO");
    }
    Ok(u64::from(info.tcpi_total_retrans) * u64::from(info.tcpi_snd_mss))
}

/// Sends `bytes` from pod a to pod b over TCP and returns what b received.
pub fn transfer(pods: &PodPair, port: u16, bytes: usize) -> Result<u64> {
    Ok(transfer_counting_retransmits(pods, port, bytes)?.0)
}

/// As [`transfer`], with at most how many payload bytes the sender retransmitted.
pub fn transfer_counting_retransmits(
    pods: &PodPair,
    port: u16,
    bytes: usize,
) -> Result<(u64, u64)> {
    let (a, b) = (pods.a.open()?, pods.b.open()?);
    let addr = SocketAddrV4::new(pods.b_ip, port);
    let sink = tcp_sink(&b, addr)?;
    let retransmitted = tcp_send(&a, addr, bytes)?;
    let got = sink.join().map_err(|_| anyhow::anyhow!("sink panicked"))??;
    Ok((got, retransmitted))
}

/// The socket call [`in_cgroup`] makes.
#[derive(Debug, Clone, Copy)]
enum SocketCall {
    Bind,
    Connect,
}

/// Binds or connects `sock` to `addr` in a forked child that first moves itself into `cgroup`:
/// the datapath judges a `bind()` or `connect()` by the cgroup of the task that makes it, and a
/// thread cannot change cgroup alone. The socket is the caller's; the child only makes the one
/// call (a blocking connect completes there) and exits.
fn in_cgroup(
    sock: &socket2::Socket,
    call: SocketCall,
    addr: &socket2::SockAddr,
    cgroup: &Path,
) -> Result<()> {
    use std::os::fd::AsRawFd as _;

    use nix::{
        sys::wait::{waitpid, WaitStatus},
        unistd::{fork, ForkResult},
    };

    /// The child's exit code when it could not join the cgroup (a failed call exits with errno).
    const NO_CGROUP: i32 = 255;
    let procs = std::fs::OpenOptions::new().write(true).open(cgroup.join("cgroup.procs"))?;
    let (procs_fd, sock_fd) = (procs.as_raw_fd(), sock.as_raw_fd());
    // SAFETY: after the fork the child makes only async-signal-safe calls (write, bind, _exit)
    // on memory and descriptors set up before it; it never returns into Rust code.
    match unsafe { fork() }? {
        ForkResult::Child => unsafe {
            // "0" is the writing process itself.
            if libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                libc::_exit(NO_CGROUP);
            }
            let ret = match call {
                SocketCall::Bind => libc::bind(sock_fd, addr.as_ptr().cast(), addr.len()),
                SocketCall::Connect => libc::connect(sock_fd, addr.as_ptr().cast(), addr.len()),
            };
            let code = if ret == 0 { 0 } else { *libc::__errno_location() };
            libc::_exit(code)
        },
        ForkResult::Parent { child } => match waitpid(child, None)? {
            WaitStatus::Exited(_, 0) => Ok(()),
            WaitStatus::Exited(_, NO_CGROUP) => {
                bail!("the {call:?} child could not join the cgroup")
            }
            WaitStatus::Exited(_, errno) => Err(std::io::Error::from_raw_os_error(errno).into()),
            other => bail!("the {call:?} child ended as {other:?}"),
        },
    }
}

/// A memory cgroup of its own with a limit (the memory controller's hierarchy: cgroup v1's
/// `memory` on a hybrid host, else cgroup v2), for a process a test runs under a memory limit;
/// removed on drop (after the process is gone).
#[derive(Debug)]
pub struct MemoryCgroup {
    path: PathBuf,
}

impl MemoryCgroup {
    pub fn new(limit: u64) -> Result<Self> {
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let (path, file) = if v1.join("memory.limit_in_bytes").exists() {
            (v1.join(unique("meshpath-test-")), "memory.limit_in_bytes")
        } else {
            let root = meshpath_loader::datapath::cgroup2_root()?;
            (root.join(unique("meshpath-test-mem-")), "memory.max")
        };
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        let me = Self { path };
        std::fs::write(me.path.join(file), limit.to_string())
            .with_context(|| format!("setting {file} in {}", me.path.display()))?;
        Ok(me)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// A cgroup v2 directory of its own (for the proxy), removed on drop.
#[derive(Debug)]
pub struct CgroupGuard {
    path: PathBuf,
}

impl CgroupGuard {
    pub fn new() -> Result<Self> {
        let root = meshpath_loader::datapath::cgroup2_root()?;
        let path = root.join(unique("meshpath-test-"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        // Its processes are gone by now (TestProxy is dropped first); retry briefly meanwhile.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// `meshpath-test-proxy` running inside a pod's netns, in its own cgroup registered as the
/// proxy's; killed on drop. Its stdout lines are collected.
#[derive(Debug)]
pub struct TestProxy {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestProxy {
    /// Starts `meshpath-test-proxy` (`mode` is `echo` or `forward`) and waits until it
    /// listens. With `inbound` it also listens on the inbound port (the datapath finds it).
    pub fn start(
        bin: &Path,
        netns: &Path,
        cgroup: &CgroupGuard,
        mode: &str,
        inbound: bool,
        envs: &[(&str, &str)],
    ) -> Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.arg(netns).arg(mode).args(inbound.then_some("inbound")).envs(envs.iter().copied());
        Self::spawn(cmd, cgroup)
    }

    /// Starts `cmd` in `cgroup` and waits for its `READY` line (any program that prints one);
    /// its log lines are shown as `proxy: …`.
    pub fn spawn(cmd: Command, cgroup: &CgroupGuard) -> Result<Self> {
        Self::spawn_as("proxy", cmd, cgroup)
    }

    /// As [`TestProxy::spawn`], its log lines shown as `LABEL: …` (the node agent's as
    /// `agent: …`).
    pub fn spawn_as(label: &'static str, cmd: Command, cgroup: &CgroupGuard) -> Result<Self> {
        let (proxy, ready) = Self::launch(label, cmd, cgroup)?;
        ready
            .recv_timeout(std::time::Duration::from_secs(10))
            .with_context(|| format!("the {label} did not become ready"))?;
        Ok(proxy)
    }

    /// As [`TestProxy::spawn`], without waiting for `READY` (a proxy a test expects never to
    /// get there).
    pub fn spawn_unready(cmd: Command, cgroup: &CgroupGuard) -> Result<Self> {
        Ok(Self::launch("proxy", cmd, cgroup)?.0)
    }

    /// Starts `cmd` in `cgroup`; the receiver gets its `READY` line.
    fn launch(
        label: &'static str,
        mut cmd: Command,
        cgroup: &CgroupGuard,
    ) -> Result<(Self, std::sync::mpsc::Receiver<()>)> {
        use std::{io::BufRead as _, os::fd::AsRawFd as _, os::unix::process::CommandExt as _};
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(cgroup.path().join("cgroup.procs"))
            .context("opening cgroup.procs")?;
        let procs_fd = procs.as_raw_fd();
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        // SAFETY: only write(2) between fork and exec, on an fd open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting the {label}"))?;
        drop(procs);
        let stdout = child.stdout.take().with_context(|| format!("{label} stdout"))?;
        let stderr = child.stderr.take().with_context(|| format!("{label} stderr"))?;
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        // Its logs: kept with the lines (tests read access logs) and shown if the test fails.
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{label}: {line}");
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == "READY" {
                    let _ = ready_tx.send(());
                }
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        Ok((Self { child, lines }, ready_rx))
    }

    /// Lines printed so far (stdout and stderr).
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits up to `timeout` for a line starting with `prefix`; whether one came.
    pub fn wait_for_line(&self, prefix: &str, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.lines().iter().any(|l| l.starts_with(prefix)) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Waits up to `timeout` for a line containing `needle`; whether one came.
    pub fn wait_for_text(&self, needle: &str, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.lines().iter().any(|l| l.contains(needle)) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The proxy's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the proxy process.
    pub fn signal(&self, signal: libc::c_int) -> std::io::Result<()> {
        // SAFETY: kill(2) on our own child's pid.
        if unsafe { libc::kill(self.child.id() as libc::pid_t, signal) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout` for the process to exit; whether it did.
    pub fn wait_exit(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    }

    /// Stops the proxy now.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

pub use mesh::Mesh;

mod mesh {
    use std::{
        io::{self, Read as _, Write as _},
        net::{IpAddr, SocketAddr, TcpStream},
        thread::JoinHandle,
        time::Duration,
    };

    use meshpath_loader::{
        datapath::Datapath,
        pods::{self, EnrolOptions},
    };

    use super::{require_root, sibling_bin, CgroupGuard, NetnsGuard, PinRoot, PodPair, TestProxy};

    /// Two pods, pod a enrolled with outbound capture, a proxy cgroup registered. Field order is
    /// drop order: the proxy dies before its cgroup is removed, the pods before the pins.
    pub struct Mesh {
        pub proxy: Option<TestProxy>,
        pub cgroup: CgroupGuard,
        pub pods: PodPair,
        pub root: PinRoot,
    }

    impl Mesh {
        pub fn new(opts: EnrolOptions) -> Self {
            require_root();
            let (root, pods, cgroup) = (
                PinRoot::new(),
                PodPair::new().expect("pods"),
                CgroupGuard::new().expect("cgroup"),
            );
            let dp = root.datapath().expect("datapath");
            dp.register_proxy_cgroup(cgroup.path()).expect("register proxy cgroup");
            pods::enrol(&dp, &pods.a.open().expect("netns a"), &opts).expect("enrol a");
            Self { proxy: None, cgroup, pods, root }
        }

        pub fn capturing() -> Self {
            Self::new(EnrolOptions { capture_outbound: true, ..EnrolOptions::default() })
        }

        pub fn with_proxy(mut self, mode: &str) -> Self {
            self.start_proxy(mode);
            self
        }

        pub fn start_proxy(&mut self, mode: &str) {
            let proxy = TestProxy::start(
                &sibling_bin("meshpath-test-proxy"),
                &self.pods.a.path(),
                &self.cgroup,
                mode,
                true,
                &[],
            )
            .expect("test proxy");
            self.proxy = Some(proxy);
        }

        pub fn datapath(&self) -> Datapath {
            self.root.datapath().expect("datapath")
        }

        /// Connects from inside pod a (the app), optionally with a socket mark set first.
        pub fn connect_from_a(&self, to: SocketAddr, mark: Option<u32>) -> io::Result<TcpStream> {
            connect(&self.pods.a, to, mark, None)
        }

        /// Connects from inside pod b, optionally from a given source address.
        pub fn connect_from_b(&self, to: SocketAddr, src: Option<IpAddr>) -> io::Result<TcpStream> {
            connect(&self.pods.b, to, None, src)
        }

        /// Pod a's address.
        pub fn a(&self, v6: bool, port: u16) -> SocketAddr {
            let ip: IpAddr = if v6 { self.pods.a_ip6.into() } else { self.pods.a_ip.into() };
            SocketAddr::new(ip, port)
        }

        /// Pod b's address.
        pub fn b(&self, v6: bool, port: u16) -> SocketAddr {
            let ip: IpAddr = if v6 { self.pods.b_ip6.into() } else { self.pods.b_ip.into() };
            SocketAddr::new(ip, port)
        }

        /// An echo server in pod b on `addr` for one connection; returns the client's address.
        pub fn echo_server_in_b(&self, addr: SocketAddr) -> JoinHandle<io::Result<SocketAddr>> {
            echo_server(&self.pods.b, addr)
        }

        /// An echo server in pod a (the app) on `addr` for one connection.
        pub fn echo_server_in_a(&self, addr: SocketAddr) -> JoinHandle<io::Result<SocketAddr>> {
            echo_server(&self.pods.a, addr)
        }

        /// An echo server in pod a on one of the proxy's ports, bound from the proxy's cgroup
        /// (only the proxy may bind them in an enrolled pod), for one connection.
        pub fn echo_server_as_proxy_in_a(
            &self,
            addr: SocketAddr,
        ) -> JoinHandle<io::Result<SocketAddr>> {
            serve_echo(self.pods.a.listen_in_cgroup(addr, &self.cgroup).expect("bind as the proxy"))
        }
    }

    fn connect(
        from: &NetnsGuard,
        to: SocketAddr,
        mark: Option<u32>,
        src: Option<IpAddr>,
    ) -> io::Result<TcpStream> {
        let ns = from.open().expect("netns");
        ns.run(|| {
            let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
            let sock = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
            if let Some(m) = mark {
                sock.set_mark(m)?;
            }
            if let Some(ip) = src {
                sock.bind(&SocketAddr::new(ip, 0).into())?;
            }
            sock.connect_timeout(&to.into(), Duration::from_secs(5))?;
            Ok(TcpStream::from(sock))
        })
        .expect("enter netns")
    }

    fn echo_server(ns: &NetnsGuard, addr: SocketAddr) -> JoinHandle<io::Result<SocketAddr>> {
        serve_echo(ns.listen(addr).expect("bind"))
    }

    fn serve_echo(listener: std::net::TcpListener) -> JoinHandle<io::Result<SocketAddr>> {
        std::thread::spawn(move || {
            let (mut conn, peer) = listener.accept()?;
            let mut buf = [0u8; 65536];
            loop {
                match conn.read(&mut buf)? {
                    0 => return Ok(peer),
                    n => conn.write_all(&buf[..n])?,
                }
            }
        })
    }
}

pub use node_proxy::{sum_metric, NodeProxy};

pub mod cluster;
pub mod cni_node;
pub mod istiod;
pub mod kube_api;
pub mod two_nodes;

mod node_proxy {
    use std::{
        io::{Read as _, Write as _},
        net::{SocketAddr, TcpStream},
        process::Command,
        time::Duration,
    };

    use anyhow::{bail, Context as _, Result};

    use super::{sibling_bin, CgroupGuard, NetnsGuard, TestProxy};

    /// `meshpath-proxy` as a node runs it: in its own "node" network namespace (so its node-wide
    /// endpoints 15000/15020/15021 are its own), in `cgroup` (registered as the proxy's).
    /// Field order matters: the process is killed before its namespace is deleted.
    #[derive(Debug)]
    pub struct NodeProxy {
        pub proxy: TestProxy,
        pub node: NetnsGuard,
    }

    /// Where the proxy said it listens.
    fn endpoint(proxy: &TestProxy, name: &str) -> Result<SocketAddr> {
        let line = proxy
            .lines()
            .into_iter()
            .find_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_owned))
            .with_context(|| format!("the proxy printed no {name} line"))?;
        Ok(line.parse()?)
    }

    impl NodeProxy {
        /// Starts `meshpath-proxy ARGS…` in a new node netns, with `env` added to its environment.
        pub fn start(
            args: &[String],
            env: &[(&str, &str)],
            cgroup: &CgroupGuard,
            rust_log: &str,
        ) -> Result<Self> {
            Self::start_in(NetnsGuard::new("mp-node")?, args, env, cgroup, rust_log)
        }

        /// [`Self::start`] in a node namespace made beforehand (one something else already
        /// listens in: the istiod stand-in).
        pub fn start_in(
            node: NetnsGuard,
            args: &[String],
            env: &[(&str, &str)],
            cgroup: &CgroupGuard,
            rust_log: &str,
        ) -> Result<Self> {
            Self::start_limited(node, args, env, cgroup, rust_log, None)
        }

        /// [`Self::start_in`], the proxy run in `memory` (a [`super::MemoryCgroup`]'s
        /// directory) when given: under its memory limit.
        pub fn start_limited(
            node: NetnsGuard,
            args: &[String],
            env: &[(&str, &str)],
            cgroup: &CgroupGuard,
            rust_log: &str,
            memory: Option<&std::path::Path>,
        ) -> Result<Self> {
            if let Some(mem) = memory {
                // A shell that joins the memory cgroup, then becomes the proxy.
                let mut cmd = Command::new("sh");
                cmd.arg("-c")
                    .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
                    .arg(mem)
                    .arg("nsenter")
                    .arg(format!("--net={}", node.path().display()))
                    .arg(sibling_bin("meshpath-proxy"))
                    .args(args)
                    .envs(env.iter().copied())
                    .env("RUST_LOG", rust_log);
                let proxy = TestProxy::spawn(cmd, cgroup)?;
                return Ok(Self { proxy, node });
            }
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--net={}", node.path().display()))
                .arg(sibling_bin("meshpath-proxy"))
                .args(args)
                .envs(env.iter().copied())
                .env("RUST_LOG", rust_log);
            let proxy = TestProxy::spawn(cmd, cgroup)?;
            Ok(Self { proxy, node })
        }

        /// A TCP connection to the endpoint `name` (ADMIN, STATS, READINESS), from its node.
        pub fn connect_endpoint(&self, name: &str) -> Result<TcpStream> {
            let mut addr = endpoint(&self.proxy, name)?;
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            Ok(self
                .node
                .open()?
                .run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))??)
        }

        /// One HTTP/1.0 request to the endpoint `name` (ADMIN, STATS, READINESS); the status and
        /// the body.
        pub fn http(&self, name: &str, method: &str, path: &str) -> Result<(u16, String)> {
            Self::http_in(&self.proxy, &self.node, name, method, path)
        }

        /// `http` for a proxy process `proxy` running in `node`.
        pub fn http_in(
            proxy: &TestProxy,
            node: &NetnsGuard,
            name: &str,
            method: &str,
            path: &str,
        ) -> Result<(u16, String)> {
            let mut addr = endpoint(proxy, name)?;
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            let mut conn = node
                .open()?
                .run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))??;
            conn.set_read_timeout(Some(Duration::from_secs(10)))?;
            write!(conn, "{method} {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
            let mut resp = String::new();
            conn.read_to_string(&mut resp)?;
            let (head, body) = resp.split_once("\r\n\r\n").context("no HTTP header end")?;
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .with_context(|| format!("bad status line in {head:?}"))?;
            Ok((status, body.to_owned()))
        }

        /// `GET /metrics`.
        pub fn metrics(&self) -> Result<String> {
            match self.http("STATS", "GET", "/metrics")? {
                (200, body) => Ok(body),
                (s, body) => bail!("/metrics answered {s}: {body}"),
            }
        }

        /// The sum of metric `name` over the series whose labels include every `labels` pair.
        pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
            Ok(sum_metric(&self.metrics()?, name, labels))
        }

        /// `GET /config_dump`, parsed.
        pub fn config_dump(&self) -> Result<serde_json::Value> {
            match self.http("ADMIN", "GET", "/config_dump")? {
                (200, body) => Ok(serde_json::from_str(&body)?),
                (s, body) => bail!("/config_dump answered {s}: {body}"),
            }
        }

        /// Waits up to `timeout` for `cond` on the metrics text; whether it held.
        pub fn wait_metrics(&self, timeout: Duration, cond: impl Fn(&str) -> bool) -> bool {
            let deadline = std::time::Instant::now() + timeout;
            loop {
                if self.metrics().is_ok_and(|m| cond(&m)) {
                    return true;
                }
                if std::time::Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        /// How many file descriptors the proxy process holds.
        pub fn open_fds(&self) -> usize {
            std::fs::read_dir(format!("/proc/{}/fd", self.proxy.pid()))
                .map(|d| d.count())
                .unwrap_or(0)
        }
    }

    /// The sum of metric `name` over the series of Prometheus text `text` whose labels include
    /// every `labels` pair.
    pub fn sum_metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
                (n == name).then_some((rest, value))
            })
            .filter(|(rest, _)| labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
            .filter_map(|(_, v)| v.parse::<f64>().ok())
            .sum()
    }
}

/// Written here rather than taken from meshpath-proxy on purpose: the test proxies
/// (`meshpath-test-proxy`, `ztunnel-like`) are the datapath tests' independent oracle, and must
/// not share a bug with the proxy they check.
///
/// The original destination, asked exactly as under iptables: SOL_IP/SO_ORIGINAL_DST for an
/// IPv4 socket, SOL_IPV6/IP6T_SO_ORIGINAL_DST for an IPv6 one.
pub fn original_dst(
    conn: &(impl std::os::fd::AsRawFd + LocalAddr),
) -> std::io::Result<std::net::SocketAddr> {
    // A v4-mapped address on a dual-stack listener is an IPv4 connection: netfilter answers
    // it at SOL_IP only (the IPv6 level says ENOENT), as ztunnel asks.
    let v6 = match conn.local_addr()?.ip() {
        std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped().is_none(),
        std::net::IpAddr::V4(_) => false,
    };
    let mut buf = [0u8; 28];
    let mut len = buf.len() as libc::socklen_t;
    let (level, name) = if v6 {
        (
            datapath_common::consts::sockopt::SOL_IPV6,
            datapath_common::consts::sockopt::IP6T_SO_ORIGINAL_DST,
        )
    } else {
        (
            datapath_common::consts::sockopt::SOL_IP,
            datapath_common::consts::sockopt::SO_ORIGINAL_DST,
        )
    };
    // SAFETY: buf and len describe a writable buffer of len bytes.
    let rc = unsafe {
        libc::getsockopt(conn.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    let family = u16::from_ne_bytes([buf[0], buf[1]]);
    match (family as i32, len) {
        // netfilter writes a sockaddr_in but leaves the length as passed: go by the family.
        (libc::AF_INET, 16..) => Ok(std::net::SocketAddr::from((
            std::net::Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]),
            port,
        ))),
        (libc::AF_INET6, 28) => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&buf[8..24]);
            let ip = std::net::Ipv6Addr::from(a);
            Ok(match ip.to_ipv4_mapped() {
                Some(v4) => std::net::SocketAddr::from((v4, port)),
                None => std::net::SocketAddr::from((ip, port)),
            })
        }
        _ => Err(std::io::Error::other(format!("unexpected answer: family {family}, {len} bytes"))),
    }
}

/// What `original_dst` needs of a socket besides its fd.
pub trait LocalAddr {
    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr>;
}

impl LocalAddr for tokio::net::TcpStream {
    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        tokio::net::TcpStream::local_addr(self)
    }
}

/// The test proxies' DNS: every datagram on `udp` is answered with `ANSWER <datagram>`, until
/// the socket fails.
pub async fn answer_dns(udp: tokio::net::UdpSocket) {
    let mut buf = [0u8; 1500];
    while let Ok((n, from)) = udp.recv_from(&mut buf).await {
        let mut reply = b"ANSWER ".to_vec();
        reply.extend_from_slice(&buf[..n]);
        let _ = udp.send_to(&reply, from).await;
    }
}

/// A real listener behind a port that a test says must not be reached. Without one, a
/// connection that leaked around the proxy would be refused all the same, and the check would
/// pass whether or not capture works.
#[derive(Debug)]
pub struct Sentinel {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Sentinel {
    /// Listens on `addr` inside `ns`.
    pub fn new(ns: &NetnsGuard, addr: SocketAddr) -> Self {
        let listener = ns.listen(addr).expect("sentinel listener");
        listener.set_nonblocking(true).expect("nonblocking");
        Self { listener, addr }
    }

    /// Panics if any connection reached it.
    pub fn assert_untouched(&self, what: &str) {
        match self.listener.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Ok((_, peer)) => panic!("{what}: {} was reached from {peer}", self.addr),
            Err(e) => panic!("{what}: sentinel on {}: {e}", self.addr),
        }
    }
}
