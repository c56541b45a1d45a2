//! Sockets inside a pod's network namespace. A socket belongs to the netns it was created in, so
//! each pod gets one thread that entered its netns once and creates sockets on request; the
//! proxy then uses them from any task: listeners on 15001/15006/15008 live in the pod, and
//! upstream connections leave from the pod's own address. (Entering the netns per connection
//! cost a thread and a setns(2) each: ~20x fewer connections per second.)
//!
//! Like ztunnel's, every socket made here carries mark 0x539 (`marks::PROXY_SOCKET`). The
//! datapath needs no mark (the proxy bypasses capture by cgroup); the mark is kept so that
//! meshpath-proxy exercises the same kernel paths as ztunnel on a meshpath node.

use std::{
    io,
    net::SocketAddr,
    sync::{mpsc, Mutex},
};

use meshpath_podnet::netns::Netns;
use tokio::net::{TcpListener, TcpSocket, UdpSocket};

type Job = Box<dyn FnOnce() -> io::Result<()> + Send>;

/// Where the socket thread sends a new socket: to a caller blocked on a channel (set-up code,
/// off the runtime's workers) or to a task that awaits it (connection paths: a worker thread
/// must never block on a pod's socket thread, or one slow pod would stall every pod).
enum Reply {
    Blocking(mpsc::Sender<io::Result<socket2::Socket>>),
    Async(tokio::sync::oneshot::Sender<io::Result<socket2::Socket>>),
}

enum Request {
    Socket(socket2::Domain, socket2::Type, Reply),
    Addresses(mpsc::Sender<io::Result<Vec<std::net::IpAddr>>>),
    Run(Job, mpsc::Sender<io::Result<()>>),
}

/// Creates sockets inside one pod's netns.
#[derive(Debug)]
pub struct SocketFactory {
    requests: Mutex<mpsc::Sender<Request>>,
}

impl SocketFactory {
    /// Starts the pod's socket thread.
    pub fn new(ns: &Netns) -> io::Result<Self> {
        let file = ns.file().try_clone()?;
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new().name("netns-sockets".into()).spawn(move || {
            let entered = nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET);
            let ok = entered.is_ok();
            let _ = ready_tx.send(entered.map_err(io::Error::from));
            if !ok {
                return;
            }
            // Ends when the factory (the sender) is dropped.
            for req in rx {
                match req {
                    Request::Socket(domain, ty, reply) => {
                        let s = socket2::Socket::new(domain, ty, None);
                        match reply {
                            Reply::Blocking(tx) => drop(tx.send(s)),
                            Reply::Async(tx) => drop(tx.send(s)),
                        }
                    }
                    Request::Addresses(reply) => {
                        let _ = reply.send(addresses());
                    }
                    Request::Run(job, reply) => {
                        let _ = reply.send(job());
                    }
                }
            }
        })?;
        ready_rx.recv().map_err(io::Error::other)??;
        Ok(Self { requests: Mutex::new(tx) })
    }

    fn request(&self, req: Request) -> io::Result<()> {
        self.requests
            .lock()
            .map_err(|_| io::Error::other("socket thread lock poisoned"))?
            .send(req)
            .map_err(|_| io::Error::other("the pod's socket thread is gone"))
    }

    fn domain(addr: SocketAddr) -> socket2::Domain {
        if addr.is_ipv4() {
            socket2::Domain::IPV4
        } else {
            socket2::Domain::IPV6
        }
    }

    /// A socket made in the pod, waited for by blocking (set-up code only).
    fn raw(&self, addr: SocketAddr, ty: socket2::Type) -> io::Result<socket2::Socket> {
        let (tx, rx) = mpsc::channel();
        self.request(Request::Socket(Self::domain(addr), ty, Reply::Blocking(tx)))?;
        let s = rx.recv().map_err(|_| io::Error::other("the pod's socket thread is gone"))??;
        s.set_mark(datapath_common::consts::marks::PROXY_SOCKET)?;
        Ok(s)
    }

    /// A socket made in the pod, awaited (connection paths).
    async fn raw_async(&self, addr: SocketAddr, ty: socket2::Type) -> io::Result<socket2::Socket> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.request(Request::Socket(Self::domain(addr), ty, Reply::Async(tx)))?;
        let s = rx.await.map_err(|_| io::Error::other("the pod's socket thread is gone"))??;
        s.set_mark(datapath_common::consts::marks::PROXY_SOCKET)?;
        Ok(s)
    }

    /// Runs `job` on the pod's thread (inside its netns); children it starts run there too.
    pub fn run(&self, job: impl FnOnce() -> io::Result<()> + Send + 'static) -> io::Result<()> {
        let (tx, rx) = mpsc::channel();
        self.requests
            .lock()
            .map_err(|_| io::Error::other("socket thread lock poisoned"))?
            .send(Request::Run(Box::new(job), tx))
            .map_err(|_| io::Error::other("the pod's socket thread is gone"))?;
        rx.recv().map_err(|_| io::Error::other("the pod's socket thread is gone"))?
    }

    /// A TCP socket inside the pod bound to `from`, an address that is not the pod's (the
    /// client's): `IP_TRANSPARENT` and `IP_FREEBIND`, as ztunnel's. The datapath recognises
    /// its connect to the app and marks it so that the app's replies come back to it.
    pub async fn transparent(&self, from: std::net::IpAddr) -> io::Result<TcpSocket> {
        use std::os::fd::AsRawFd as _;
        let addr = SocketAddr::new(from, 0);
        let s = self.raw_async(addr, socket2::Type::STREAM).await?;
        if from.is_ipv4() {
            s.set_ip_transparent(true)?;
            s.set_freebind(true)?;
        } else {
            s.set_freebind_ipv6(true)?;
            let on: libc::c_int = 1;
            // SAFETY: a c_int option value of the right size.
            let rc = unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_IPV6,
                    libc::IPV6_TRANSPARENT,
                    std::ptr::addr_of!(on).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
        s.bind(&addr.into())?;
        Ok(TcpSocket::from_std_stream(s.into()))
    }

    /// The pod's addresses (not loopback, not link-local IPv6).
    pub fn addresses(&self) -> io::Result<Vec<std::net::IpAddr>> {
        let (tx, rx) = mpsc::channel();
        self.requests
            .lock()
            .map_err(|_| io::Error::other("socket thread lock poisoned"))?
            .send(Request::Addresses(tx))
            .map_err(|_| io::Error::other("the pod's socket thread is gone"))?;
        rx.recv().map_err(|_| io::Error::other("the pod's socket thread is gone"))?
    }

    /// A TCP listener on `addr` inside the pod.
    pub fn listen(&self, addr: SocketAddr) -> io::Result<TcpListener> {
        let s = self.raw(addr, socket2::Type::STREAM)?;
        if addr.is_ipv6() {
            s.set_only_v6(false)?;
        }
        s.set_reuse_address(true)?;
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        s.listen(1024)?;
        TcpListener::from_std(s.into())
    }

    /// An unconnected TCP socket of `addr`'s family inside the pod.
    pub async fn socket(&self, addr: SocketAddr) -> io::Result<TcpSocket> {
        let s = self.raw_async(addr, socket2::Type::STREAM).await?;
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
        Ok(TcpSocket::from_std_stream(s.into()))
    }

    /// A UDP socket inside the pod bound to `addr` (port 0: any), waited for by blocking (the
    /// pod's listeners, at set-up).
    pub fn udp(&self, addr: SocketAddr) -> io::Result<UdpSocket> {
        let s = self.raw(addr, socket2::Type::DGRAM)?;
        Self::bind_udp(s, addr)
    }

    /// `udp`, awaited (upstream queries on a connection path).
    pub async fn udp_async(&self, addr: SocketAddr) -> io::Result<UdpSocket> {
        let s = self.raw_async(addr, socket2::Type::DGRAM).await?;
        Self::bind_udp(s, addr)
    }

    fn bind_udp(s: socket2::Socket, addr: SocketAddr) -> io::Result<UdpSocket> {
        if addr.is_ipv6() {
            s.set_only_v6(true)?;
        }
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        UdpSocket::from_std(s.into())
    }
}

/// The calling thread's netns addresses, as the pod's.
fn addresses() -> io::Result<Vec<std::net::IpAddr>> {
    let mut out = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs()? {
        let Some(addr) = ifa.address else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            std::net::IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            std::net::IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        let link_local =
            matches!(ip, std::net::IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
        if !ip.is_loopback() && !link_local && !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}
