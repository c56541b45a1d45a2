//! The HTTP endpoints (the proxy's admin, metrics and readiness, the agent's health) close a
//! connection whose request headers do not arrive in time: a client that sends a request line
//! and then nothing cannot hold a connection (and its memory) forever.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    time::Duration,
};

use meshpath_tests::{cni_node::CniNode, two_nodes::TwoNodes};

/// Sends a request line and one header, never the blank line that ends the headers, then
/// waits (up to far longer than the server's limit) for the server to give up.
fn closed_by_the_server(mut conn: TcpStream, what: &str) {
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").expect("send");
    let mut buf = [0u8; 256];
    match meshpath_tests::read_within(Duration::from_secs(30), |t| {
        conn.set_read_timeout(Some(t))?;
        conn.read(&mut buf)
    }) {
        // Closed, possibly after a 408.
        Ok(n) => {
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(n == 0 || text.contains(" 408 "), "{what}: answered {text}");
        }
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("{what}: the connection was still open after 30 s ({e})"),
    }
}

#[test]
fn the_proxys_endpoints_close_connections_whose_headers_never_end() {
    let nodes = TwoNodes::new(meshpath_tests::two_nodes::MESHED);
    for name in ["ADMIN", "STATS", "READINESS"] {
        let conn = nodes.proxies[0].connect_endpoint(name).expect("connect");
        closed_by_the_server(conn, name);
    }
}

#[test]
fn the_agents_health_endpoint_closes_connections_whose_headers_never_end() {
    let mut node = CniNode::bare("workloads: []\n").expect("node");
    node.start_agent().expect("agent");
    let agent = node.agent.as_ref().expect("agent");
    let addr: std::net::SocketAddr = agent
        .lines()
        .iter()
        .find_map(|l| l.strip_prefix("HEALTH ").map(str::to_owned))
        .expect("the agent printed its health address")
        .parse()
        .expect("address");
    let conn = node
        .node
        .open()
        .expect("node netns")
        .run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))
        .expect("netns")
        .expect("connect");
    closed_by_the_server(conn, "agent health");
}
