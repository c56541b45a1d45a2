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

use crate::{require_root, sibling_bin, CgroupGuard, NetnsGuard, PinRoot, PodPair, TestProxy};

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
        Self::prepared(opts, |_| {})
    }

    /// As `new`, with `prepare` run on the pods before pod a is enrolled.
    pub fn prepared(opts: EnrolOptions, prepare: impl FnOnce(&PodPair)) -> Self {
        require_root();
        let (root, pods, cgroup) =
            (PinRoot::new(), PodPair::new().expect("pods"), CgroupGuard::new().expect("cgroup"));
        prepare(&pods);
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

    /// Connects from inside pod a (the app) from a socket bound to `src` first.
    pub fn connect_from_a_at(&self, to: SocketAddr, src: IpAddr) -> io::Result<TcpStream> {
        connect(&self.pods.a, to, None, Some(src))
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
