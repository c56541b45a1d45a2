//! Pods as the tests make them: a named network namespace (its sockets, processes, iperf3)
//! and a pair of them joined by veth; a socket call made from a given cgroup.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{bail, Context as _, Result};
use meshpath_loader::netns::Netns;

use crate::{sh, unique, CgroupGuard, ChildGuard};

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
        in_cgroup(&[&sock], SocketCall::Bind, &addr.into(), cgroup.path())
            .with_context(|| format!("binding {addr} from cgroup {}", cgroup.path().display()))?;
        sock.listen(128)?;
        Ok(sock.into())
    }

    /// A TCP listener on `addr` inside this namespace that holds every connection until data
    /// comes (`TCP_DEFER_ACCEPT`, a minute): the listening side of a connection is not
    /// established while its client sends nothing, as when an overflowing accept queue drops
    /// the handshake's last ACK. Bound from `cgroup` when given (the proxy's). Its queue, and
    /// the namespace's limits on queues, take `backlog` connections, so that none falls back on
    /// a syncookie (which would establish it at once).
    pub fn deferring_listener(
        &self,
        addr: SocketAddr,
        cgroup: Option<&CgroupGuard>,
        backlog: i32,
    ) -> Result<TcpListener> {
        use std::os::fd::AsRawFd as _;

        for sysctl in ["/proc/sys/net/core/somaxconn", "/proc/sys/net/ipv4/tcp_max_syn_backlog"] {
            self.open()?
                .run(|| std::fs::write(sysctl, backlog.to_string()))?
                .with_context(|| format!("{sysctl} in {}", self.name))?;
        }
        let listener = match cgroup {
            Some(c) => self.listen_in_cgroup(addr, c)?,
            None => self.listen(addr)?,
        };
        let defer_secs: libc::c_int = 60;
        // SAFETY: a valid socket and an int option of the size given.
        let rc = unsafe {
            libc::setsockopt(
                listener.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_DEFER_ACCEPT,
                std::ptr::from_ref(&defer_secs).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("TCP_DEFER_ACCEPT");
        }
        socket2::SockRef::from(&listener).listen(backlog).context("a longer queue")?;
        Ok(listener)
    }

    /// A TCP connection to `to` from inside this namespace, connected as the proxy connects:
    /// from a process in `cgroup`, so the datapath does not capture it (a peer node's proxy
    /// reaching a pod's HBONE port from its own pod's address).
    pub fn connect_in_cgroup(&self, to: SocketAddr, cgroup: &CgroupGuard) -> Result<TcpStream> {
        self.connect_from_in_cgroup(None, to, cgroup)
    }

    /// [`Self::connect_in_cgroup`] from `from` (an address of this namespace) when given.
    pub fn connect_from_in_cgroup(
        &self,
        from: Option<SocketAddr>,
        to: SocketAddr,
        cgroup: &CgroupGuard,
    ) -> Result<TcpStream> {
        let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
        let sock =
            self.open()?.run(|| socket2::Socket::new(domain, socket2::Type::STREAM, None))??;
        if let Some(from) = from {
            sock.bind(&from.into()).with_context(|| format!("binding {from}"))?;
        }
        in_cgroup(&[&sock], SocketCall::Connect, &to.into(), cgroup.path()).with_context(|| {
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
        let mut socks = self.transparent_connects(from, to, 1, cgroup)?;
        socks.pop().context("no socket")
    }

    /// `n` of [`Self::transparent_connect`] (`from` with port 0: each its own port), bound in
    /// one go: from one child process when `cgroup` is given. Forking once per socket would
    /// also copy, for as long as each child lives, every socket the test process holds, and
    /// delay the real close of any that another test closes meanwhile.
    pub fn transparent_connects(
        &self,
        from: SocketAddr,
        to: SocketAddr,
        n: usize,
        cgroup: Option<&CgroupGuard>,
    ) -> Result<Vec<socket2::Socket>> {
        let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
        let socks = self.open()?.run(|| -> std::io::Result<Vec<socket2::Socket>> {
            (0..n)
                .map(|_| {
                    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
                    s.set_ip_transparent(true)?;
                    s.set_freebind(true)?;
                    Ok(s)
                })
                .collect()
        })??;
        match cgroup {
            Some(c) => {
                let refs: Vec<&socket2::Socket> = socks.iter().collect();
                in_cgroup(&refs, SocketCall::Bind, &from.into(), c.path())?;
            }
            None => {
                for s in &socks {
                    s.bind(&from.into())?;
                }
            }
        }
        for sock in &socks {
            sock.set_nonblocking(true)?;
            match sock.connect(&to.into()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(socks)
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
        veth_between((&a, "eth0"), (&b, "eth0"))?;
        let (a_ip, b_ip) = (Ipv4Addr::new(10, 199, 0, 1), Ipv4Addr::new(10, 199, 0, 2));
        let a_ip6: Ipv6Addr = "fd00:199::1".parse()?;
        let b_ip6: Ipv6Addr = "fd00:199::2".parse()?;
        for (ns, ip, ip6) in [(&a, a_ip, a_ip6), (&b, b_ip, b_ip6)] {
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
            // nodad: usable at once, no duplicate address detection wait.
            ns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
        }
        Ok(Self { a, b, a_ip, b_ip, a_ip6, b_ip6 })
    }

    /// Another network between the two pods, as Multus adds one: a veth pair named `iface` in
    /// each, pod a at `a_ip`/24 and pod b at `b_ip`/24.
    pub fn add_network(&self, iface: &str, a_ip: Ipv4Addr, b_ip: Ipv4Addr) -> Result<()> {
        veth_between((&self.a, iface), (&self.b, iface))?;
        for (ns, ip) in [(&self.a, a_ip), (&self.b, b_ip)] {
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", iface])?;
        }
        Ok(())
    }
}

/// The eBPF filters on egress of `iface` in `ns`, as `tc filter show` lists them.
pub fn egress_filters(ns: &NetnsGuard, iface: &str) -> Result<String> {
    let out = ns
        .open()?
        .run(|| Command::new("tc").args(["filter", "show", "dev", iface, "egress"]).output())??;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A veth pair from interface `a.1` in netns `a.0` to `b.1` in `b.0`, both up (no address).
pub fn veth_between(a: (&NetnsGuard, &str), b: (&NetnsGuard, &str)) -> Result<()> {
    let (va, vb) = (unique("va"), unique("vb"));
    let args = [
        "link",
        "add",
        &va,
        "netns",
        a.0.name(),
        "type",
        "veth",
        "peer",
        "name",
        &vb,
        "netns",
        b.0.name(),
    ];
    sh("ip", &args)?;
    for ((ns, iface), dev) in [(a, &va), (b, &vb)] {
        ns.ip(&["link", "set", dev, "name", iface])?;
        ns.ip(&["link", "set", iface, "up"])?;
    }
    Ok(())
}

/// The socket call [`in_cgroup`] makes.
#[derive(Debug, Clone, Copy)]
enum SocketCall {
    Bind,
    Connect,
}

/// Binds or connects each of `socks` to `addr` in one forked child that first moves itself into
/// `cgroup`: the datapath judges a `bind()` or `connect()` by the cgroup of the task that makes
/// it, and a thread cannot change cgroup alone. The sockets are the caller's; the child only
/// makes the calls (a blocking connect completes there), stopping at the first that fails, and
/// exits.
fn in_cgroup(
    socks: &[&socket2::Socket],
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
    let procs_fd = procs.as_raw_fd();
    let fds: Vec<i32> = socks.iter().map(|s| s.as_raw_fd()).collect();
    // SAFETY: after the fork the child makes only async-signal-safe calls (write, bind,
    // connect, _exit) on memory and descriptors set up before it; it never returns into Rust
    // code.
    match unsafe { fork() }? {
        ForkResult::Child => unsafe {
            // "0" is the writing process itself.
            if libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                libc::_exit(NO_CGROUP);
            }
            for &fd in &fds {
                let ret = match call {
                    SocketCall::Bind => libc::bind(fd, addr.as_ptr().cast(), addr.len()),
                    SocketCall::Connect => libc::connect(fd, addr.as_ptr().cast(), addr.len()),
                };
                if ret != 0 {
                    libc::_exit(*libc::__errno_location());
                }
            }
            libc::_exit(0)
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
