//! Sockets inside a pod's network namespace. A socket belongs to the netns it was created in, so
//! a socket for a pod is created by the calling thread after entering the pod's netns, and the
//! thread goes back to the proxy's own netns before anything else runs on it: two `setns(2)`
//! around one `socket(2)`, as ztunnel does (`meshpath_podnet::netns::run_in`). The proxy then
//! uses the socket from any task: listeners on 15001/15006/15008 live in the pod, and upstream
//! connections leave from the pod's own address. (A thread per connection, or a per-pod thread
//! making sockets on request, cost connection rate: results/README.md, "Why the proxy has its
//! shape".) Set-up work that runs longer than one syscall (`run`, `addresses`) enters the
//! same way, on the calling thread: no pod has a thread of its own.
//!
//! A thread that cannot go back to the proxy's netns would make every later socket of every pod
//! in the wrong place: the process aborts instead (fail closed).
//!
//! Like ztunnel's, every socket made here carries mark 0x539 (`marks::PROXY_SOCKET`). The
//! datapath needs no mark (the proxy bypasses capture by cgroup); the mark is kept so that
//! meshpath-proxy exercises the same kernel paths as ztunnel on a meshpath node.

use std::{fs::File, io, net::SocketAddr, os::fd::AsFd as _, sync::OnceLock};

use datapath_common::consts::ports;
use meshpath_podnet::netns::{run_in, Netns};
use meshpath_zds::listeners::{ListenerId, Transport};
use tokio::net::{TcpListener, TcpSocket, UdpSocket};

use super::held_listeners::PodListeners;

/// Creates sockets inside one pod's netns.
#[derive(Debug)]
pub struct SocketFactory {
    /// The pod's netns.
    pod: File,
    /// Its listeners held by the node agent: taken over rather than bound anew, and given to
    /// the agent to hold.
    pub held: PodListeners,
}

/// The proxy's own netns, where every runtime thread lives: opened once, before any thread
/// enters a pod's (the proxy opens it at start, [`open_home`]; a factory made before that opens
/// it then).
fn home() -> io::Result<&'static File> {
    static HOME: OnceLock<File> = OnceLock::new();
    if let Some(f) = HOME.get() {
        return Ok(f);
    }
    let f = File::open("/proc/self/ns/net")?;
    Ok(HOME.get_or_init(|| f))
}

/// Opens the proxy's own netns (kept open for the life of the process), so that the first pod
/// neither pays for it nor shows it as a descriptor it added.
pub fn open_home() -> io::Result<()> {
    home().map(drop)
}

/// `socket(2)` inside `pod`'s netns on the calling thread, which is back in `home` when this
/// returns (or the process aborts: `run_in`).
fn socket_in(
    pod: &File,
    home: &File,
    domain: socket2::Domain,
    ty: socket2::Type,
) -> io::Result<socket2::Socket> {
    run_in(pod, home, || socket2::Socket::new(domain, ty, None))?
}

impl SocketFactory {
    /// A factory for the pod whose netns is `ns`, whose listeners the agent holds as `held`.
    pub fn new(ns: &Netns, held: PodListeners) -> io::Result<Self> {
        home()?;
        Ok(Self { pod: ns.file().try_clone()?, held })
    }

    fn domain(addr: SocketAddr) -> socket2::Domain {
        if addr.is_ipv4() {
            socket2::Domain::IPV4
        } else {
            socket2::Domain::IPV6
        }
    }

    /// A socket made in the pod, on the calling thread.
    fn raw(&self, addr: SocketAddr, ty: socket2::Type) -> io::Result<socket2::Socket> {
        let s = socket_in(&self.pod, home()?, Self::domain(addr), ty)?;
        s.set_mark(datapath_common::consts::marks::PROXY_SOCKET)?;
        Ok(s)
    }

    /// Runs `job` inside the pod's netns, on the calling thread (which is back in the proxy's
    /// when this returns). A job makes its sockets with plain `socket(2)` (it is in the pod
    /// already), never through this factory.
    pub fn run<T>(&self, job: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        run_in(&self.pod, home()?, job)?
    }

    /// A TCP socket inside the pod bound to `from`, an address that is not the pod's (the
    /// client's): `IP_TRANSPARENT` and `IP_FREEBIND`, as ztunnel's. The datapath recognises
    /// its connect to the app and marks it so that the app's replies come back to it.
    pub fn transparent(&self, from: std::net::IpAddr) -> io::Result<TcpSocket> {
        use std::os::fd::AsRawFd as _;
        let addr = SocketAddr::new(from, 0);
        let s = self.raw(addr, socket2::Type::STREAM)?;
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
        self.run(addresses)
    }

    /// A TCP listener on `addr` inside the pod: the one the agent held, if it handed it over
    /// (with the connections that waited in its backlog), else a new one.
    pub fn listen(&self, addr: SocketAddr) -> io::Result<TcpListener> {
        let l: std::net::TcpListener =
            match self.held.take(&ListenerId { transport: Transport::Tcp, addr }) {
                Some(fd) => fd.into(),
                None => {
                    let s = self.raw(addr, socket2::Type::STREAM)?;
                    if addr.is_ipv6() {
                        s.set_only_v6(false)?;
                    }
                    s.set_reuse_address(true)?;
                    s.bind(&addr.into())?;
                    s.listen(1024)?;
                    s.into()
                }
            };
        l.set_nonblocking(true)?;
        self.held.opened(l.as_fd())?;
        TcpListener::from_std(l)
    }

    /// An unconnected TCP socket of `addr`'s family inside the pod.
    pub fn socket(&self, addr: SocketAddr) -> io::Result<TcpSocket> {
        let s = self.raw(addr, socket2::Type::STREAM)?;
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
        Ok(TcpSocket::from_std_stream(s.into()))
    }

    /// A UDP socket inside the pod bound to `addr` (port 0: any). On a proxy port (DNS): the
    /// one the agent held, if it handed it over (with the queries that waited in it).
    pub fn udp(&self, addr: SocketAddr) -> io::Result<UdpSocket> {
        if !ports::is_proxy_port(addr.port()) {
            let s = self.raw(addr, socket2::Type::DGRAM)?;
            return Self::bind_udp(s, addr);
        }
        let sock = match self.held.take(&ListenerId { transport: Transport::Udp, addr }) {
            Some(fd) => {
                let u = std::net::UdpSocket::from(fd);
                u.set_nonblocking(true)?;
                UdpSocket::from_std(u)?
            }
            None => Self::bind_udp(self.raw(addr, socket2::Type::DGRAM)?, addr)?,
        };
        self.held.opened(sock.as_fd())?;
        Ok(sock)
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;

    use meshpath_podnet::netns::{read_cookie, socket_cookie};

    use super::*;

    /// A new network namespace standing in for a pod's, alive while the file is open.
    fn new_netns() -> (File, u64) {
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (root?)");
            let file = File::open("/proc/thread-self/ns/net").expect("open the new netns");
            (file, read_cookie().expect("cookie"))
        })
        .join()
        .expect("netns thread")
    }

    #[test]
    fn a_pod_socket_is_made_in_the_pods_netns_and_the_thread_comes_back() {
        let (pod, pod_cookie) = new_netns();
        let home_cookie = read_cookie().expect("cookie");
        assert_ne!(pod_cookie, home_cookie);
        for (domain, ty) in [
            (socket2::Domain::IPV4, socket2::Type::STREAM),
            (socket2::Domain::IPV6, socket2::Type::DGRAM),
        ] {
            let s = socket_in(&pod, home().expect("home"), domain, ty).expect("socket");
            assert_eq!(socket_cookie(s.as_fd()).expect("cookie"), pod_cookie, "{domain:?}");
            assert_eq!(read_cookie().expect("cookie"), home_cookie, "the thread stayed in the pod");
        }
    }
}
