//! A minimal capture-side proxy for the datapath tests, written the way a proxy written for
//! iptables REDIRECT is: listen on the outbound port (`[::]:15001`, dual-stack, as ztunnel)
//! inside the pod's netns, read each accepted
//! connection's original destination with `getsockopt(SO_ORIGINAL_DST)`, then either
//! - `echo`: answer `ORIG_DST <addr>\n` and close, or
//! - `forward`: connect to the original destination and copy both ways.
//!
//! It also answers DNS on 15053: every UDP datagram with `ANSWER <datagram>`, TCP like any
//! outbound connection.
//!
//! With `inbound` it also listens on the inbound port (`[::]:15006`, dual-stack); it touches no
//! map: the datapath finds the listener by itself. Inbound connections are answered or
//! forwarded the same way (echo: `INBOUND <orig dst> FROM <peer>`).
//!
//! With `MESHPATH_TEST_PROXY_UPSTREAMS=PORT=ADDR[,PORT=ADDR…]` it also listens on
//! `127.0.0.1:PORT` for each pair and forwards what it accepts there to `ADDR` without asking
//! for an original destination: the same proxy addressed directly by the client, with no capture
//! at all (the capture benchmark's `proxy_addressed`: what a capture that cost nothing would
//! leave).
//!
//! It prints `READY` once listening, `ACCEPTED <orig dst> FROM <peer> AT <local>` per
//! connection, and one
//! `FORWARDED <bytes up> <bytes down>` line per closed forwarded connection, unless
//! `MESHPATH_TEST_PROXY_QUIET=1` (the benchmark: those two lines per connection are a write each
//! here and a wake-up of the reading process; without them the eBPF scenario's conn/s from 100
//! clients was 11% higher, four alternating runs each, 2026-12-02). Event-driven
//! (tokio), like the proxies it stands in for, so the benchmark measures capture, not threads.
//! `MESHPATH_TEST_PROXY_DEFER_ACCEPT=1` sets TCP_DEFER_ACCEPT on the outbound listener (see
//! `defer_accept`).
//! Usage: `meshpath-test-proxy NETNS_PATH echo|forward [inbound]`.

use std::{
    io::{self, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
};

use anyhow::{bail, Context as _, Result};
use datapath_common::consts::ports;
use tokio::{
    io::AsyncWriteExt as _,
    net::{TcpListener, TcpSocket, TcpStream, UdpSocket},
};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(netns), Some(mode)) = (args.get(1), args.get(2)) else {
        bail!("usage: meshpath-test-proxy NETNS_PATH echo|forward [inbound]");
    };
    let forward = match mode.as_str() {
        "echo" => false,
        "forward" => true,
        other => bail!("unknown mode {other}"),
    };
    let inbound = match args.get(3).map(String::as_str) {
        None => false,
        Some("inbound") => true,
        Some(other) => bail!("unknown argument {other}"),
    };
    // Before any thread exists, so the whole process (and the runtime's threads) enters it.
    let ns = std::fs::File::open(netns).with_context(|| format!("opening {netns}"))?;
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(forward, inbound))
}

/// Where each connection accepted on a listener goes.
#[derive(Clone, Copy)]
enum Route {
    /// Its original destination, as the datapath or iptables captured it (`inbound`: on the
    /// inbound port).
    Captured { inbound: bool },
    /// A fixed upstream (`MESHPATH_TEST_PROXY_UPSTREAMS`).
    Fixed(SocketAddr),
}

/// `MESHPATH_TEST_PROXY_UPSTREAMS`: `PORT=ADDR` pairs, comma-separated.
fn fixed_upstreams() -> Result<Vec<(u16, SocketAddr)>> {
    let Ok(list) = std::env::var("MESHPATH_TEST_PROXY_UPSTREAMS") else { return Ok(Vec::new()) };
    list.split(',')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (port, to) =
                pair.split_once('=').with_context(|| format!("{pair:?}: not PORT=ADDR"))?;
            Ok((
                port.parse().with_context(|| format!("port {port:?}"))?,
                to.parse().with_context(|| format!("address {to:?}"))?,
            ))
        })
        .collect()
}

async fn run(forward: bool, inbound: bool) -> Result<()> {
    let v4 = |port| SocketAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    let outbound = Route::Captured { inbound: false };
    let outbound_listener = TcpListener::bind((Ipv6Addr::UNSPECIFIED, ports::OUTBOUND)).await?;
    if std::env::var("MESHPATH_TEST_PROXY_DEFER_ACCEPT").is_ok_and(|v| v == "1") {
        defer_accept(&outbound_listener)?;
    }
    let mut listeners = vec![
        (outbound_listener, outbound),
        // DNS over TCP is answered like any outbound connection.
        (TcpListener::bind(v4(ports::DNS)).await?, outbound),
        (v6_only_listener(ports::DNS)?, outbound),
    ];
    if inbound {
        let l = TcpListener::bind((Ipv6Addr::UNSPECIFIED, ports::INBOUND_PLAINTEXT)).await?;
        listeners.push((l, Route::Captured { inbound: true }));
    }
    for (port, to) in fixed_upstreams()? {
        listeners.push((TcpListener::bind(v4(port)).await?, Route::Fixed(to)));
    }
    // DNS over UDP: every datagram is answered with `ANSWER <datagram>`.
    for udp in [UdpSocket::bind(v4(ports::DNS)).await?, v6_only_udp(ports::DNS)?] {
        tokio::spawn(meshpath_tests::answer_dns(udp));
    }
    say("READY")?;
    for (listener, route) in listeners {
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Err(e) = serve(conn, forward, route).await {
                        eprintln!("meshpath-test-proxy: {e:#}");
                    }
                });
            }
        });
    }
    std::future::pending().await
}

/// `MESHPATH_TEST_PROXY_DEFER_ACCEPT=1`: TCP_DEFER_ACCEPT on the outbound listener, so that
/// the proxy's end of a connection is established (its sock_ops `PASSIVE_ESTABLISHED` runs)
/// only once the app sends its first byte, while the app's end is established at once: a
/// test can act between the two (upgrades.rs).
fn defer_accept(listener: &TcpListener) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let seconds: nix::libc::c_int = 60;
    // SAFETY: a valid socket descriptor and a c_int option value of the size given.
    let rc = unsafe {
        nix::libc::setsockopt(
            listener.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_DEFER_ACCEPT,
            (&seconds as *const nix::libc::c_int).cast(),
            std::mem::size_of::<nix::libc::c_int>() as nix::libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn say(line: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

fn v6_only_socket(ty: socket2::Type, port: u16) -> io::Result<socket2::Socket> {
    let sock = socket2::Socket::new(socket2::Domain::IPV6, ty, None)?;
    sock.set_only_v6(true)?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&SocketAddr::from(SocketAddrV6::new(Ipv6Addr::LOCALHOST, port, 0, 0)).into())?;
    Ok(sock)
}

fn v6_only_listener(port: u16) -> io::Result<TcpListener> {
    let sock = v6_only_socket(socket2::Type::STREAM, port)?;
    sock.listen(1024)?;
    TcpListener::from_std(sock.into())
}

fn v6_only_udp(port: u16) -> io::Result<UdpSocket> {
    UdpSocket::from_std(v6_only_socket(socket2::Type::DGRAM, port)?.into())
}

/// Connects to the original destination. Under iptables capture the proxy's sockets must carry
/// istio's mark to escape the REDIRECT rules: `MESHPATH_TEST_PROXY_MARK=0x539` sets it (the
/// benchmark's iptables scenario). meshpath capture needs no mark: the proxy's cgroup bypasses.
async fn connect_upstream(to: SocketAddr) -> io::Result<TcpStream> {
    let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    if let Ok(mark) = std::env::var("MESHPATH_TEST_PROXY_MARK") {
        let mark =
            u32::from_str_radix(mark.trim_start_matches("0x"), 16).map_err(io::Error::other)?;
        sock.set_mark(mark)?;
    }
    sock.set_nonblocking(true)?;
    let stream = TcpSocket::from_std_stream(sock.into()).connect(to).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Each direction's copy buffer: 64 KiB, not tokio's default of 8, so a bulk stream is not
/// measured as a proxy's syscalls per 8 KiB (the HBONE proxy reads up to 256 KiB); below
/// glibc's mmap threshold (128 KiB), so a connection's buffers are no mmap and munmap each.
const COPY_BUF: usize = 64 * 1024;

fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())),
            None => a,
        },
        v4 => v4,
    }
}

async fn serve(mut conn: TcpStream, forward: bool, route: Route) -> Result<()> {
    let (orig, inbound) = match route {
        Route::Captured { inbound } => {
            (meshpath_tests::original_dst(&conn).context("getsockopt(SO_ORIGINAL_DST)")?, inbound)
        }
        Route::Fixed(to) => (to, false),
    };
    conn.set_nodelay(true)?;
    let (peer, local) = (canonical(conn.peer_addr()?), canonical(conn.local_addr()?));
    if !quiet() {
        say(&format!("ACCEPTED {orig} FROM {peer} AT {local}"))?;
    }
    if !forward {
        let line = if inbound {
            // The same answer two ways: SO_ORIGINAL_DST and the socket's own address.
            let local = canonical(conn.local_addr()?);
            anyhow::ensure!(local == orig, "getsockname {local} != SO_ORIGINAL_DST {orig}");
            format!("INBOUND {orig} FROM {}\n", canonical(conn.peer_addr()?))
        } else {
            format!("ORIG_DST {orig}\n")
        };
        conn.write_all(line.as_bytes()).await?;
        return Ok(());
    }
    let mut upstream =
        connect_upstream(orig).await.with_context(|| format!("connecting to {orig}"))?;
    let (up, down) =
        tokio::io::copy_bidirectional_with_sizes(&mut conn, &mut upstream, COPY_BUF, COPY_BUF)
            .await?;
    if !quiet() {
        say(&format!("FORWARDED {up} {down}"))?;
    }
    Ok(())
}

/// `MESHPATH_TEST_PROXY_QUIET=1`: no line per connection (see the module docs).
fn quiet() -> bool {
    static QUIET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *QUIET.get_or_init(|| std::env::var("MESHPATH_TEST_PROXY_QUIET").is_ok_and(|v| v == "1"))
}
