//! `ztunnel-like`: a stand-in for Istio's ztunnel in shared in-pod mode, for the tests of the
//! proxy contract. It opens, in each pod's netns, exactly the sockets ztunnel opens (see the
//! notes on ztunnel in-pod), and nothing else: it writes no map, opens no pin, installs no
//! rule, route or sysctl. So a test that passes with it shows the datapath serving a proxy that
//! gives it no help.
//!
//! - Pods come from the node agent over ZDS (hello, Add with the netns fd, Keep, Del,
//!   SnapshotSent), each acked. One thread per pod enters its netns and runs a single-threaded
//!   runtime there, so every socket it makes is the pod's.
//! - Every socket carries mark 0x539. Listeners on the wildcard address: `[::]:15001`,
//!   `[::]:15006`, `[::]:15008`; DNS on `127.0.0.1:15053` and `[::1]:15053` (UDP).
//! - 15001: the original destination by `SO_ORIGINAL_DST`; refused if it is one of its own
//!   ports. A destination the workloads file names as an HBONE workload is reached by HTTP/2
//!   CONNECT over mutual TLS to its `ip:15008` (the pod's certificate minted from the CA for
//!   the identity ZDS gave); anything else by passthrough. Either way over a new, unbound,
//!   marked connection (the kernel picks the source).
//! - 15006: the original destination is the local address; refused if one of its own ports;
//!   else connects to it with `IP_TRANSPARENT` + `IP_FREEBIND`, bound to the client's address.
//! - 15008: HBONE: mutual TLS with the pod's certificate (client certificate required), each
//!   CONNECT to one of its own ports answered 400, else connected to the app like 15006, from
//!   the HBONE client's address, then 200 and bytes both ways.
//!
//! The TLS configurations and HTTP/2 copy loops are meshpath-proxy's library (they are the
//! wire format, not the kernel contract this stand-in is the oracle of).
//! - DNS: every datagram answered with `ANSWER <datagram>`.
//!
//! - Knobs for tests of the agent's side: `ZTUNNEL_LIKE_NO_SNAPSHOT_ACK` (never acknowledges
//!   `SnapshotSent`), `ZTUNNEL_LIKE_LATE_FIRST_ACK_MS` (acknowledges its first Add that late).
//!
//! Prints `READY` after the agent's first snapshot, and one line per connection:
//! `OUTBOUND <orig> FROM <peer>` (with ` VIA HBONE` when it was), `INBOUND <dst> FROM <peer>`,
//! `HBONE <dst> FROM <peer>` (a CONNECT served), `SELF_CALL <dst>`. Usage:
//! `ztunnel-like ZDS_SOCKET CA_CERT CA_KEY WORKLOADS_FILE`.

use std::{
    collections::HashMap,
    io::{self, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::OwnedFd,
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use datapath_common::consts::{marks, ports};
use meshpath_proxy::{
    identity::tls,
    identity::{Identity, LocalCa, WorkloadCert},
    metrics::Meter,
    proxy::hbone,
    state::{store::WorkloadStore, workloads::Protocol},
};
use meshpath_zds::{
    proto::{workload_request::Payload, Version, WorkloadRequest, WorkloadResponse, ZdsHello},
    SeqPacket,
};
use tokio::{
    net::{TcpListener, TcpSocket, TcpStream, UdpSocket},
    sync::oneshot,
};

/// What every pod's thread shares: the CA certificates are minted from, the workloads file.
struct Node {
    ca: LocalCa,
    workloads: PathBuf,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, socket, ca_cert, ca_key, workloads] = args.as_slice() else {
        bail!("usage: ztunnel-like ZDS_SOCKET CA_CERT CA_KEY WORKLOADS_FILE");
    };
    let ca =
        LocalCa::from_pem(&std::fs::read_to_string(ca_cert)?, &std::fs::read_to_string(ca_key)?)?;
    let node = Arc::new(Node { ca, workloads: workloads.into() });
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(zds(socket.into(), node))
}

fn say(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The ZDS session: pods added and removed as the agent says.
async fn zds(path: PathBuf, node: Arc<Node>) -> Result<()> {
    let conn = SeqPacket::connect(&path).with_context(|| format!("connecting to {path:?}"))?;
    conn.send_msg(&ZdsHello { version: Version::V1 as i32, ..Default::default() }, &[]).await?;
    // Dropping a pod's sender stops its thread (its listeners close).
    let mut pods: HashMap<String, oneshot::Sender<()>> = HashMap::new();
    let mut ready = false;
    // A proxy that acknowledges its first Add late (tests of the agent's side): milliseconds.
    let mut late_ack = std::env::var("ZTUNNEL_LIKE_LATE_FIRST_ACK_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(Duration::from_millis);
    loop {
        let (req, mut fds) = conn.recv_msg::<WorkloadRequest>().await?;
        let result = match req.payload {
            Some(Payload::Add(add)) => {
                if let Some(late) = late_ack.take() {
                    // Served all the same: only the ack is late.
                    tokio::time::sleep(late).await;
                }
                add_pod(&node, &mut pods, add, fds.pop())
            }
            Some(Payload::Keep(_)) => Ok(()),
            Some(Payload::Del(del)) => {
                pods.remove(&del.uid);
                Ok(())
            }
            // A proxy that never acknowledges its snapshot (tests of the agent's side).
            Some(Payload::SnapshotSent(_))
                if std::env::var_os("ZTUNNEL_LIKE_NO_SNAPSHOT_ACK").is_some() =>
            {
                say("READY");
                std::future::pending::<()>().await;
                Ok(())
            }
            Some(Payload::SnapshotSent(_)) => {
                if !ready {
                    ready = true;
                    say("READY");
                }
                Ok(())
            }
            // Never sent: like ztunnel, it did not say meshpath_takes_connections.
            Some(Payload::TakeConnection(_)) => Err(anyhow::anyhow!("not asked for")),
            None => Err(anyhow::anyhow!("empty request")),
        };
        conn.send_msg(&WorkloadResponse::ack(result.map_err(|e| format!("{e:#}"))), &[]).await?;
    }
}

/// Serves the pod an `AddWorkload` names, in the netns whose fd came with it.
fn add_pod(
    node: &Arc<Node>,
    pods: &mut HashMap<String, oneshot::Sender<()>>,
    add: meshpath_zds::proto::AddWorkload,
    netns: Option<OwnedFd>,
) -> Result<()> {
    let (Some(fd), Some(info)) = (netns, add.workload_info) else {
        bail!("AddWorkload without a netns fd or workload info");
    };
    let id = Identity::new("cluster.local", &info.namespace, &info.service_account);
    let stop = serve_pod(add.uid.clone(), fd, Pod::new(node, id)?)?;
    pods.insert(add.uid, stop);
    Ok(())
}

/// One pod: its identity and certificate, and the node's workloads.
struct Pod {
    node: Arc<Node>,
    cert: WorkloadCert,
    server: Arc<rustls::ServerConfig>,
}

impl Pod {
    fn new(node: &Arc<Node>, id: Identity) -> Result<Arc<Self>> {
        let cert = node.ca.issue(&id, Duration::from_secs(3600))?;
        let server = tls::server_config(&cert, std::slice::from_ref(&node.ca.cert_der))?;
        Ok(Arc::new(Self { node: node.clone(), cert, server }))
    }
}

/// Starts the pod's thread: enters its netns, opens the listeners, serves until stopped.
/// Returns once the listeners are open.
fn serve_pod(uid: String, netns: OwnedFd, pod: Arc<Pod>) -> Result<oneshot::Sender<()>> {
    let (stop_tx, stop_rx) = oneshot::channel();
    let (open_tx, open_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new().name(format!("pod-{uid}")).spawn(move || {
        let run = || -> Result<()> {
            nix::sched::setns(netns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                let listeners = Listeners::open()?;
                let _ = open_tx.send(Ok(()));
                tokio::select! {
                    _ = stop_rx => {}
                    () = listeners.serve(pod) => {}
                }
                Ok(())
            })
        };
        if let Err(e) = run() {
            let _ = open_tx.send(Err(format!("{e:#}")));
        }
    })?;
    match open_rx.recv() {
        Ok(Ok(())) => Ok(stop_tx),
        Ok(Err(e)) => bail!("pod {uid}: {e}"),
        Err(_) => bail!("pod {uid}: its thread ended"),
    }
}

/// A socket marked 0x539, as every socket ztunnel opens in a pod.
fn marked(domain: socket2::Domain, ty: socket2::Type) -> io::Result<socket2::Socket> {
    let s = socket2::Socket::new(domain, ty, None)?;
    s.set_mark(marks::PROXY_SOCKET)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

fn wildcard_listener(port: u16) -> io::Result<TcpListener> {
    let s = marked(socket2::Domain::IPV6, socket2::Type::STREAM)?;
    s.set_only_v6(false)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port).into())?;
    s.listen(1024)?;
    TcpListener::from_std(s.into())
}

fn dns_socket(ip: IpAddr) -> io::Result<UdpSocket> {
    let domain = if ip.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let s = marked(domain, socket2::Type::DGRAM)?;
    if ip.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.bind(&SocketAddr::new(ip, ports::DNS).into())?;
    UdpSocket::from_std(s.into())
}

struct Listeners {
    outbound: TcpListener,
    inbound: TcpListener,
    hbone: TcpListener,
    dns: [UdpSocket; 2],
}

impl Listeners {
    fn open() -> io::Result<Self> {
        Ok(Self {
            outbound: wildcard_listener(ports::OUTBOUND)?,
            inbound: wildcard_listener(ports::INBOUND_PLAINTEXT)?,
            hbone: wildcard_listener(ports::HBONE)?,
            dns: [
                dns_socket(IpAddr::V4(Ipv4Addr::LOCALHOST))?,
                dns_socket(IpAddr::V6(Ipv6Addr::LOCALHOST))?,
            ],
        })
    }

    async fn serve(self, pod: Arc<Pod>) {
        let Self { outbound, inbound, hbone, dns } = self;
        for udp in dns {
            tokio::spawn(meshpath_tests::answer_dns(udp));
        }
        tokio::join!(
            accept_loop(outbound, Path::Outbound, pod.clone()),
            accept_loop(inbound, Path::Inbound, pod.clone()),
            accept_loop(hbone, Path::Hbone, pod),
        );
    }
}

#[derive(Clone, Copy)]
enum Path {
    Outbound,
    Inbound,
    Hbone,
}

async fn accept_loop(listener: TcpListener, path: Path, pod: Arc<Pod>) {
    while let Ok((conn, peer)) = listener.accept().await {
        let pod = pod.clone();
        tokio::spawn(async move {
            if let Err(e) = handle(conn, canonical(peer), path, &pod).await {
                eprintln!("ztunnel-like: {e:#}");
            }
        });
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

async fn handle(mut conn: TcpStream, peer: SocketAddr, path: Path, pod: &Pod) -> Result<()> {
    let upstream = match path {
        Path::Hbone => return serve_hbone(conn, peer, pod).await,
        Path::Outbound => {
            let orig = meshpath_tests::original_dst(&conn).context("SO_ORIGINAL_DST")?;
            if ports::is_proxy_port(orig.port()) {
                say(&format!("SELF_CALL {orig}"));
                return Ok(());
            }
            let store = WorkloadStore::load(&pod.node.workloads)?;
            if let Some(w) = store.by_ip(orig.ip()).filter(|w| w.protocol == Protocol::Hbone) {
                say(&format!("OUTBOUND {orig} FROM {peer} VIA HBONE"));
                let gateway = SocketAddr::new(orig.ip(), ports::HBONE);
                let roots = std::slice::from_ref(&pod.node.ca.cert_der);
                let config = tls::client_config(&pod.cert, roots, vec![w.identity()])?;
                let tcp = connect(gateway, None).await?;
                let headers = hbone::StreamHeaders::default();
                let (send, recv) = hbone::connect(tcp, gateway, orig, config, &headers).await?;
                let meters = (&Meter::default(), &Meter::default());
                meshpath_proxy::proxy::copy::splice(conn, send, recv, meters, None).await?;
                return Ok(());
            }
            say(&format!("OUTBOUND {orig} FROM {peer}"));
            connect(orig, None).await?
        }
        Path::Inbound => {
            let dst = canonical(conn.local_addr()?);
            if ports::is_proxy_port(dst.port()) {
                say(&format!("SELF_CALL {dst}"));
                return Ok(());
            }
            say(&format!("INBOUND {dst} FROM {peer}"));
            connect(dst, Some(peer.ip())).await?
        }
    };
    let mut upstream = upstream;
    tokio::io::copy_bidirectional(&mut conn, &mut upstream).await?;
    Ok(())
}

/// Inbound HBONE: mutual TLS with the pod's certificate, then each CONNECT served.
async fn serve_hbone(tcp: TcpStream, peer: SocketAddr, pod: &Pod) -> Result<()> {
    let tls = tokio_rustls::TlsAcceptor::from(pod.server.clone()).accept(tcp).await?;
    // ztunnel's HTTP/2 windows.
    let mut conn = hbone::server_builder().handshake(tls).await?;
    while let Some(stream) = conn.accept().await {
        let (req, mut respond) = stream?;
        tokio::spawn(async move {
            let reply = |status: http::StatusCode| {
                http::Response::builder().status(status).body(()).unwrap_or_default()
            };
            let dst: Option<SocketAddr> =
                req.uri().authority().and_then(|a| a.as_str().parse().ok()).map(canonical);
            let Some(dst) = dst.filter(|d| !ports::is_proxy_port(d.port())) else {
                say(&format!("SELF_CALL {:?}", req.uri().authority()));
                let _ = respond.send_response(reply(http::StatusCode::BAD_REQUEST), true);
                return;
            };
            say(&format!("HBONE {dst} FROM {peer}"));
            let app = match connect(dst, Some(peer.ip())).await {
                Ok(a) => a,
                Err(_) => {
                    let _ =
                        respond.send_response(reply(http::StatusCode::SERVICE_UNAVAILABLE), true);
                    return;
                }
            };
            let Ok(send) = respond.send_response(reply(http::StatusCode::OK), false) else {
                return;
            };
            let meters = (&Meter::default(), &Meter::default());
            let _ =
                meshpath_proxy::proxy::copy::splice(app, send, req.into_body(), meters, None).await;
        });
    }
    Ok(())
}

/// A marked connection to `to`: unbound (the kernel picks the source), or from `client` with
/// `IP_TRANSPARENT` + `IP_FREEBIND`, as ztunnel's `freebind_connect`.
async fn connect(to: SocketAddr, client: Option<IpAddr>) -> Result<TcpStream> {
    let domain = if to.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let s = marked(domain, socket2::Type::STREAM)?;
    if let Some(ip) = client {
        if to.is_ipv4() {
            s.set_ip_transparent(true)?;
            s.set_freebind(true)?;
        } else {
            s.set_freebind_ipv6(true)?;
            set_ipv6_transparent(&s)?;
        }
        s.bind(&SocketAddr::new(ip, 0).into())?;
    }
    let stream = TcpSocket::from_std_stream(s.into())
        .connect(to)
        .await
        .with_context(|| format!("connecting to {to}"))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

fn set_ipv6_transparent(s: &socket2::Socket) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let on: libc::c_int = 1;
    // SAFETY: a c_int option value of the right size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_IPV6,
            libc::IPV6_TRANSPARENT,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
