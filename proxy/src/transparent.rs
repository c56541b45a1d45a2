//! Connecting to the app with the client's own address as the source, as ztunnel does under
//! istio-cni, without a netfilter rule:
//!
//! - the socket is made inside the pod, `IP_TRANSPARENT`, bound to the client's address, marked
//!   `0x539`;
//! - its 4-tuple is put in the datapath's `PROXY_TRANSPARENT` map for the time of the connect,
//!   so sk_lookup lets the SYN reach the app instead of steering it back to 15006;
//! - in the pod, `tcp_fwmark_accept` makes the app's accepted socket carry the SYN's mark
//!   (`fwmark_reflect` does the same for the kernel's resets when nothing listens), and a rule
//!   sends marked packets to a table whose one route delivers everything locally, so the app's
//!   replies come back to the proxy instead of leaving for the real client.
//!
//! The rule, route and sysctls (`meshpath_cni::pod_setup`) are set up by meshpath-cni at ADD
//! (it runs on the host as root) and again by the proxy when the pod is added, where it may; a
//! pod where neither happened, a client of another family, or a client address that is the pod's own, gets a
//! plain connection from the pod's address.

use std::{io, net::SocketAddr, time::Duration};

use tokio::net::TcpStream;
use tracing::warn;

use crate::inpod::Pod;

/// Inside the pod's netns (on its socket thread): sets up the reply routing, or, where this
/// process may not (a container's read-only `/proc/sys`), finds it set up already by
/// meshpath-cni at ADD. An error means the pod's apps will see the pod's own address.
pub fn setup_reply_routing() -> io::Result<()> {
    match meshpath_cni::pod_setup::reply_routing() {
        Ok(None) => Ok(()),
        Ok(Some(v6)) => {
            warn!(error = %v6, "no IPv6 reply routing in the pod: IPv6 clients' addresses are not kept");
            Ok(())
        }
        Err(e) if meshpath_cni::pod_setup::reply_routing_ready() => {
            tracing::debug!(error = %e, "reply routing set up by meshpath-cni already");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Connects to the app at `target` inside the pod, from `client`'s address when the pod allows.
pub async fn connect_app(
    pod: &Pod,
    client: std::net::IpAddr,
    target: SocketAddr,
    limit: Duration,
) -> io::Result<TcpStream> {
    let plain = || async { pod.sockets.socket(target)?.connect(target).await };
    let transparent = pod.preserves_source()
        && client.is_ipv4() == target.is_ipv4()
        && !pod.workload.workload_ips.contains(&client);
    let Some(conns) = pod.proxy.transparent.as_ref().filter(|_| transparent) else {
        return timed(limit, plain()).await;
    };
    let socket = match pod.sockets.transparent(client) {
        Ok(s) => s,
        Err(e) => {
            warn!(pod = %pod.uid, %client, error = %e, "no transparent socket; connecting from the pod's address");
            return timed(limit, plain()).await;
        }
    };
    let from = socket.local_addr()?;
    conns.insert(target, from).map_err(io::Error::other)?;
    // Removed however this ends, also if the connection's task is cancelled mid-connect.
    let _entry = Entry { conns, app: target, from };
    timed(limit, socket.connect(target)).await
}

/// A `PROXY_TRANSPARENT` entry, removed on drop.
struct Entry<'a> {
    conns: &'a meshpath_loader::datapath::TransparentConns,
    app: SocketAddr,
    from: SocketAddr,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.conns.remove(self.app, self.from);
    }
}

async fn timed(
    limit: Duration,
    f: impl std::future::Future<Output = io::Result<TcpStream>>,
) -> io::Result<TcpStream> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
}
