//! Outbound: a pod's captured TCP arrives on its 15001 listener; the original destination
//! (`SO_ORIGINAL_DST`, as under iptables) decides: a workload that speaks HBONE is reached by
//! HTTP/2 CONNECT over mTLS to its `ip:15008`, verifying its SPIFFE identity; anything else is
//! passed through as plain TCP. Upstream sockets are made in the pod's netns, so traffic leaves
//! from the pod's own address.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    sync::Arc,
};

use anyhow::Context as _;
use datapath_common::consts::{ports, sockopt};
use tokio::net::TcpStream;
use tracing::info;

use crate::{config::Protocol, hbone, inbound::Pod, pool::PoolKey, tls};

/// Serves one pod's outbound listeners (127.0.0.1:15001 and [::1]:15001 in its netns).
pub fn start(pod: Arc<Pod>) -> io::Result<()> {
    for addr in [
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), ports::OUTBOUND),
        SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), ports::OUTBOUND),
    ] {
        let listener = pod.sockets.listen(addr)?;
        pod.proxy.drain.serve(
            listener,
            pod.clone(),
            "outbound",
            |conn, peer, pod: Arc<Pod>| async move {
                handle(conn, peer, &pod).await.with_context(|| format!("pod {}", pod.uid))
            },
        );
    }
    Ok(())
}

async fn handle(conn: TcpStream, peer: SocketAddr, pod: &Pod) -> anyhow::Result<()> {
    let orig = original_dst(&conn)?;
    if [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::HBONE].contains(&orig.port()) {
        anyhow::bail!("refusing {orig}: a proxy port as destination would loop");
    }
    conn.set_nodelay(true)?;
    let dest = pod.proxy.store.by_ip(orig.ip()).cloned();
    match dest {
        Some(d) if d.protocol == Protocol::Hbone => {
            let gateway = SocketAddr::new(orig.ip(), ports::HBONE);
            let key = PoolKey {
                src: pod.identity.clone(),
                dst: d.identity(),
                src_workload: pod.uid.clone(),
                gateway,
            };
            let h2conn = pod
                .proxy
                .pool
                .get(&key, || async {
                    let tcp = pod
                        .sockets
                        .socket(gateway)
                        .map_err(|e| hbone::HboneError::Connect(gateway, e))?
                        .connect(gateway)
                        .await
                        .map_err(|e| hbone::HboneError::Connect(gateway, e))?;
                    let config =
                        tls::client_config(&pod.cert, &pod.proxy.roots, vec![d.identity()])
                            .map_err(|e| {
                                hbone::HboneError::Tls(gateway, std::io::Error::other(e))
                            })?;
                    hbone::handshake(tcp, gateway, config).await
                })
                .await?;
            let (send, recv) = hbone::open_stream(h2conn, gateway, orig, Some(peer)).await?;
            let (up, down) = hbone::splice(conn, send, recv).await?;
            info!(src = %pod.identity, dst = %orig, dst_identity = %d.identity(), up, down, "hbone connection closed");
        }
        _ => {
            let mut upstream = pod.sockets.socket(orig)?.connect(orig).await?;
            let mut conn = conn;
            let (up, down) = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await?;
            info!(src = %pod.identity, dst = %orig, up, down, "passthrough connection closed");
        }
    }
    Ok(())
}

/// The original destination, asked as under iptables: SOL_IP/SO_ORIGINAL_DST for an IPv4
/// socket, SOL_IPV6/IP6T_SO_ORIGINAL_DST for an IPv6 one; falls back to the local address.
pub fn original_dst(conn: &TcpStream) -> io::Result<SocketAddr> {
    let v6 = conn.local_addr()?.is_ipv6();
    let mut buf = [0u8; 28];
    let mut len = buf.len() as libc::socklen_t;
    let (level, name) = if v6 {
        (sockopt::SOL_IPV6, sockopt::IP6T_SO_ORIGINAL_DST)
    } else {
        (sockopt::SOL_IP, sockopt::SO_ORIGINAL_DST)
    };
    // SAFETY: buf and len describe a writable buffer of len bytes.
    let rc = unsafe {
        libc::getsockopt(conn.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &mut len)
    };
    if rc != 0 {
        return conn.local_addr();
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    match i32::from(u16::from_ne_bytes([buf[0], buf[1]])) {
        libc::AF_INET => {
            Ok(SocketAddr::from((Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]), port)))
        }
        libc::AF_INET6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&buf[8..24]);
            let ip = Ipv6Addr::from(a);
            Ok(SocketAddr::new(ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4), port))
        }
        f => Err(io::Error::other(format!("SO_ORIGINAL_DST answered family {f}"))),
    }
}
