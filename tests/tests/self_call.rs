//! A connection whose destination is one of the proxy's own ports (15001, 15006, 15008, 15053)
//! is refused on every inbound path, before policy, as ztunnel refuses a `SelfCall`. Without
//! that, a pod connecting to its own address on 15006 has the proxy connect to its own
//! listener, which proxies that connection again, and so on until the proxy runs out of file
//! descriptors.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use meshpath_proxy::{identity::Identity, proxy::hbone::HboneError};
use meshpath_tests::two_nodes::{Setup, TwoNodes, View, MESHED};

/// Pod b captures inbound (node 2's proxy serves its 15006); node 1 sends it plain TCP.
const CAPTURED: View = View { b_protocol: "TCP", b_inbound_captured: true, ..MESHED };

fn self_calls(nodes: &TwoNodes, node: usize) -> f64 {
    nodes.proxies[node]
        .metric(
            "meshpath_connection_errors_total",
            &[("direction", "inbound"), ("reason", "self_call")],
        )
        .expect("metrics")
}

fn inbound_opened(nodes: &TwoNodes) -> f64 {
    nodes.proxies[1]
        .metric("istio_tcp_connections_opened_total", &[("reporter", "destination")])
        .expect("metrics")
}

/// Sends a line on the connection and reads until the proxy closes it; the bytes that came
/// back. The proxy resets a refused connection at once, which can reach the client before its
/// `connect` returns: a reset there is a refusal too, any other error is not.
fn exchange(conn: std::io::Result<TcpStream>) -> Vec<u8> {
    let mut conn = match conn {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Vec::new(),
        Err(e) => panic!("connect: {e}"),
    };
    conn.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let _ = conn.write_all(b"hello\n");
    let mut back = Vec::new();
    // A reset is an error here; either way nothing may come back.
    let _ = conn.read_to_end(&mut back);
    back
}

#[test]
fn a_pod_connecting_to_its_own_address_on_15006_is_refused_once() {
    let nodes = TwoNodes::new(CAPTURED);
    let own = nodes.b(false, 15006);
    let conn = nodes
        .pods
        .b
        .open()
        .expect("b")
        .run(|| TcpStream::connect_timeout(&own, Duration::from_secs(5)))
        .expect("netns");
    assert!(exchange(conn).is_empty(), "a connection to the proxy's own port was served");
    // Refused once: a loop would count one refusal per hop, or none at all.
    assert!(
        nodes.proxies[1].wait_metrics(Duration::from_secs(5), |_| self_calls(&nodes, 1) >= 1.0),
        "the proxy did not count the self call"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(self_calls(&nodes, 1), 1.0, "the connection came back to the proxy");
    assert_eq!(inbound_opened(&nodes), 0.0, "the proxy opened a connection to its own port");
}

#[test]
fn plaintext_from_another_pod_to_a_proxy_port_is_refused() {
    // Pod a sends to the proxy ports uncaptured, as a client outside the mesh would; pod b's
    // datapath steers what it receives to node 2's 15006 (15006 itself reaches it directly),
    // where the original destination is the proxy port.
    let ports = [15001u16, 15006, 15053];
    let nodes = TwoNodes::start(Setup {
        view: CAPTURED,
        a_exclude_outbound_ports: ports.to_vec(),
        ..Setup::default()
    });
    for (n, port) in ports.into_iter().enumerate() {
        let dst = nodes.b(false, port);
        assert!(exchange(nodes.connect_from_a(dst)).is_empty(), "port {port} was served");
        let want = (n + 1) as f64;
        assert!(
            nodes.proxies[1]
                .wait_metrics(Duration::from_secs(5), |_| self_calls(&nodes, 1) >= want),
            "node 2 did not refuse port {port} as a self call"
        );
    }
    assert_eq!(inbound_opened(&nodes), 0.0, "node 2 opened a connection to a proxy port");
}

#[tokio::test]
async fn hbone_connect_to_a_proxy_port_is_answered_400() {
    let nodes = TwoNodes::new(MESHED);
    let client = nodes
        .ca
        .issue(&Identity::new("cluster.local", "default", "sa-a"), Duration::from_secs(600))
        .expect("cert");
    for port in [15001u16, 15006, 15008, 15053] {
        let dst: SocketAddr = nodes.b(false, port);
        match nodes.hbone_to_b(&client, dst).await {
            Err(HboneError::Status { status, .. }) => {
                assert_eq!(status, 400, "CONNECT to port {port}")
            }
            other => panic!("CONNECT to port {port}: expected 400, got {other:?}"),
        }
    }
    assert_eq!(self_calls(&nodes, 1), 4.0);
    assert_eq!(inbound_opened(&nodes), 0.0, "node 2 opened a connection to a proxy port");
}
