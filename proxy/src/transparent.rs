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
//! The rule and route are set up when the pod is added (`setup_reply_routing`); a pod where
//! that failed, a client of another family, or a client address that is the pod's own, gets a
//! plain connection from the pod's address.

use std::{io, net::SocketAddr, process::Command, time::Duration};

use datapath_common::consts::marks;
use tokio::net::TcpStream;
use tracing::warn;

use crate::inpod::Pod;

/// Inside the pod's netns (on its socket thread): `tcp_fwmark_accept`, `fwmark_reflect`, and
/// the rule and route that deliver marked packets locally. IPv4 is required; IPv6 is set up
/// where the pod has it (a failure there is logged, IPv4 clients still keep their address).
/// Idempotent.
pub fn setup_reply_routing() -> io::Result<()> {
    // The app's accepted socket takes the SYN's mark; the kernel's own answers (a reset when
    // nothing listens, ICMP) reflect it.
    for knob in ["/proc/sys/net/ipv4/tcp_fwmark_accept", "/proc/sys/net/ipv4/fwmark_reflect"] {
        std::fs::write(knob, "1").map_err(|e| io::Error::other(format!("{knob}: {e}")))?;
    }
    ip_batch("-4", "0.0.0.0/0")?;
    let v6 = std::fs::write("/proc/sys/net/ipv6/fwmark_reflect", "1")
        .and_then(|()| ip_batch("-6", "::/0"));
    if let Err(e) = v6 {
        warn!(error = %e, "no IPv6 reply routing in the pod: IPv6 clients' addresses are not kept");
    }
    Ok(())
}

/// `ip FAMILY -force -batch -`: the rule (deleted first: `rule add` would duplicate it) and the
/// `local` route of the reply table.
fn ip_batch(family: &str, any: &str) -> io::Result<()> {
    let (mark, table) =
        (format!("{:#x}/{:#x}", marks::PROXY_SOCKET, marks::PROXY_SOCKET_MASK), marks::REPLY_TABLE);
    let batch = format!(
        "rule del fwmark {mark} lookup {table}\nrule add fwmark {mark} lookup {table}\nroute replace local {any} dev lo table {table}\n"
    );
    let mut child = Command::new("ip")
        .args([family, "-force", "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        io::Write::write_all(&mut stdin, batch.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    // The expected failure of the first `rule del` (nothing to delete) aside, any error counts.
    let real = err.lines().filter(|l| {
        !l.trim().is_empty()
            && !l.contains("No such file or directory")
            && !l.starts_with("Command failed")
    });
    match real.collect::<Vec<_>>().join("; ") {
        e if e.is_empty() => Ok(()),
        e => Err(io::Error::other(format!("ip {family}: {e}"))),
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
