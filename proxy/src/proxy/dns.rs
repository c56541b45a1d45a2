//! DNS (15053, UDP and TCP, on the pod's loopback, where the datapath steers the pod's queries
//! to port 53): A and AAAA questions for a service hostname in the workload store are answered
//! with its VIPs, so a pod resolves mesh services without a cluster DNS round trip; anything else
//! is forwarded to the upstream resolvers from a socket inside the pod (the resolver sees the
//! pod's address). A query that does not parse is dropped (UDP) or ends its connection (TCP),
//! counted as `dns_malformed`.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use anyhow::Context as _;
use datapath_common::consts::ports;
use hickory_proto::{
    op::{Message, MessageType, ResponseCode},
    rr::{
        rdata::{A, AAAA},
        RData, Record, RecordType,
    },
    serialize::binary::BinDecodable as _,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpStream, UdpSocket},
};
use tracing::{debug, warn};

use crate::{metrics::Direction, proxy::pod::Pod, state::store::WorkloadStore};

/// TTL of answers made from the store.
const TTL: u32 = 30;
/// UDP queries answered at once per pod and listener; more are dropped (the client retries).
const MAX_IN_FLIGHT: usize = 256;
/// How long an upstream has to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the pod's DNS listeners (UDP and TCP, 127.0.0.1 and ::1).
pub fn start(pod: Arc<Pod>) -> anyhow::Result<()> {
    for ip in [IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)] {
        let addr = SocketAddr::new(ip, ports::DNS);
        let udp = Arc::new(pod.sockets.udp(addr).with_context(|| format!("DNS on udp {addr}"))?);
        let p = pod.clone();
        let stop = pod.listening.clone();
        pod.proxy.drain.spawn(async move {
            tokio::select! {
                () = serve_udp(udp, p) => {}
                () = stop.cancelled() => {}
            }
        });
        let tcp = pod.sockets.listen(addr).with_context(|| format!("DNS on tcp {addr}"))?;
        pod.proxy.drain.serve(
            tcp,
            pod.scope(crate::metrics::Direction::Outbound, false),
            pod.clone(),
            "DNS over TCP",
            |conn, _peer, pod: Arc<Pod>, _| async move { serve_tcp(conn, &pod).await },
        );
    }
    Ok(())
}

async fn serve_udp(sock: Arc<UdpSocket>, pod: Arc<Pod>) {
    let mut buf = vec![0u8; 65535];
    // Queries in flight per pod and listener: a pod flooding its resolver is dropped beyond
    // this, not given every socket and task of the node.
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                warn!(pod = %pod.uid, error = %e, "DNS receive failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            pod.proxy.metrics.error(Direction::Outbound, "dns_overload");
            continue;
        };
        let query = buf[..n].to_vec();
        let (sock, p) = (sock.clone(), pod.clone());
        pod.spawn(async move {
            let _permit = permit;
            match answer(&p, &query, false).await {
                Ok(Some(reply)) => {
                    if let Err(e) = sock.send_to(&reply, from).await {
                        debug!(error = %e, "DNS reply not sent");
                    }
                }
                Ok(None) => {}
                Err(e) => warn!(pod = %p.uid, error = %format!("{e:#}"), "DNS query failed"),
            }
        });
    }
}

/// How long a DNS-over-TCP client may stay silent (before a query, or inside one) before the
/// connection is closed (RFC 7766 asks servers to close idle connections): a client that
/// connects and sends nothing holds no connection for long.
pub const TCP_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

async fn serve_tcp(mut conn: TcpStream, pod: &Pod) -> anyhow::Result<()> {
    loop {
        let len = match tokio::time::timeout(TCP_IDLE, conn.read_u16()).await {
            Err(_) => return Ok(()), // idle: closed
            Ok(Ok(l)) => usize::from(l),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e.into()),
        };
        let mut query = vec![0u8; len];
        tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut query))
            .await
            .context("a DNS query over TCP stalled")??;
        let Some(reply) = answer(pod, &query, true).await? else { return Ok(()) };
        let len = u16::try_from(reply.len()).context("reply longer than 64 KiB")?;
        conn.write_u16(len).await?;
        conn.write_all(&reply).await?;
    }
}

/// The reply to `query`: from the store, or from an upstream. `None`: nothing to send.
async fn answer(pod: &Pod, query: &[u8], tcp: bool) -> anyhow::Result<Option<Vec<u8>>> {
    let msg = match Message::from_bytes(query) {
        Ok(m) if m.message_type() == MessageType::Query => m,
        _ => {
            pod.proxy.metrics.error(Direction::Outbound, "dns_malformed");
            return Ok(None);
        }
    };
    let query_type = msg.queries().first().map(|q| q.query_type().to_string());
    pod.proxy.metrics.dns_request(query_type.as_deref().unwrap_or("other"), tcp);
    if let Some(reply) = from_store(&pod.proxy.store(), &msg) {
        return Ok(Some(reply.to_vec()?));
    }
    forward(pod, query, tcp).await.map(Some)
}

/// An answer for A/AAAA questions about a known service hostname.
pub fn from_store(store: &WorkloadStore, query: &Message) -> Option<Message> {
    let [q] = query.queries() else { return None };
    if !matches!(q.query_type(), RecordType::A | RecordType::AAAA) {
        return None;
    }
    let svc = store.service_by_hostname(&q.name().to_ascii())?;
    let mut reply = Message::new();
    reply
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_authoritative(true)
        .set_response_code(ResponseCode::NoError)
        .add_query(q.clone());
    for vip in svc.vip_addrs() {
        let data = match (vip, q.query_type()) {
            (IpAddr::V4(v4), RecordType::A) => RData::A(A(v4)),
            (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(v6)),
            _ => continue,
        };
        reply.add_answer(Record::from_rdata(q.name().clone(), TTL, data));
    }
    Some(reply)
}

async fn forward(pod: &Pod, query: &[u8], tcp: bool) -> anyhow::Result<Vec<u8>> {
    let upstreams = &pod.proxy.settings.dns_upstreams;
    let mut last = anyhow::anyhow!("no DNS upstream configured");
    for &up in upstreams {
        let attempt =
            if tcp { forward_tcp(pod, up, query).await } else { forward_udp(pod, up, query).await };
        match attempt {
            Ok(r) => return Ok(r),
            Err(e) => last = e.context(format!("upstream {up}")),
        }
    }
    pod.proxy.metrics.error(Direction::Outbound, "dns_upstream");
    Err(last)
}

async fn forward_udp(pod: &Pod, up: SocketAddr, query: &[u8]) -> anyhow::Result<Vec<u8>> {
    let any = if up.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let sock = pod.sockets.udp(SocketAddr::new(any, 0))?;
    sock.connect(up).await?;
    sock.send(query).await?;
    let mut buf = vec![0u8; 65535];
    let n = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf))
        .await
        .context("timed out")??;
    buf.truncate(n);
    Ok(buf)
}

async fn forward_tcp(pod: &Pod, up: SocketAddr, query: &[u8]) -> anyhow::Result<Vec<u8>> {
    let exchange = async {
        let mut conn = pod.sockets.socket(up)?.connect(up).await?;
        conn.write_u16(u16::try_from(query.len())?).await?;
        conn.write_all(query).await?;
        let len = usize::from(conn.read_u16().await?);
        let mut reply = vec![0u8; len];
        conn.read_exact(&mut reply).await?;
        anyhow::Ok(reply)
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, exchange).await.context("timed out")?
}

/// The nameservers of a resolv.conf, on port 53.
pub fn resolv_conf_upstreams(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|ip| ip.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, ports::DNS_UPSTREAM))
        .collect()
}

#[cfg(test)]
mod tests {
    use hickory_proto::{op::Query, rr::Name, serialize::binary::BinEncodable as _};

    use super::*;

    fn query(name: &str, ty: RecordType) -> Message {
        let mut m = Message::new();
        m.set_id(7).set_recursion_desired(true);
        m.add_query(Query::query(Name::from_ascii(name).expect("name"), ty));
        m
    }

    fn store() -> WorkloadStore {
        WorkloadStore::parse(
            "services:\n- {name: web, namespace: d, hostname: web.d.svc.cluster.local, vips: [\"/10.96.0.7\", \"/fd00::7\"]}\n",
        )
        .expect("store")
    }

    #[test]
    fn a_service_hostname_is_answered_with_its_vips_by_family() {
        let reply = from_store(&store(), &query("web.d.svc.cluster.local.", RecordType::A))
            .expect("answered");
        assert_eq!(reply.id(), 7);
        let ips: Vec<String> =
            reply.answers().iter().filter_map(|r| r.data()).map(|d| d.to_string()).collect();
        assert_eq!(ips, vec!["10.96.0.7"]);
        let reply = from_store(&store(), &query("WEB.d.svc.cluster.local.", RecordType::AAAA))
            .expect("answered");
        let bytes = reply.to_bytes().expect("encode");
        let back = Message::from_bytes(&bytes).expect("decode");
        assert_eq!(back.answers().len(), 1);
    }

    #[test]
    fn other_names_and_types_are_not_answered_from_the_store() {
        assert!(from_store(&store(), &query("example.org.", RecordType::A)).is_none());
        assert!(from_store(&store(), &query("web.d.svc.cluster.local.", RecordType::MX)).is_none());
    }

    #[test]
    fn resolv_conf_nameservers_become_upstreams() {
        let ups =
            resolv_conf_upstreams("search x\nnameserver 10.0.0.10\nnameserver fd00::a\n# c\n");
        assert_eq!(
            ups,
            vec!["10.0.0.10:53".parse().expect("a"), "[fd00::a]:53".parse().expect("b")]
        );
    }
}
