//! The proxy's admin endpoint (config dump, log level, shutdown) on a unix socket only root can
//! reach, as deploy runs it (`--admin-socket … --no-admin-tcp`): under hostNetwork any process of
//! the host reaches 127.0.0.1:15000, so there it is off.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    process::Command,
    time::Duration,
};

use meshpath_tests::cni_node::CniNode;

/// One HTTP/1.0 request over the unix socket at `path`, as root: the status.
fn status_over(path: &Path, method: &str, target: &str) -> u16 {
    let mut conn = UnixStream::connect(path).expect("connect to the admin socket");
    write!(conn, "{method} {target} HTTP/1.0\r\n\r\n").expect("send");
    let mut resp = String::new();
    conn.read_to_string(&mut resp).expect("read");
    resp.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status line")
}

/// The proxy's readiness status (503 once draining).
fn readiness(node: &CniNode) -> u16 {
    let proxy = node.proxy.as_ref().expect("proxy");
    meshpath_tests::NodeProxy::http_in(proxy, &node.node, "READINESS", "GET", "/healthz/ready")
        .expect("readiness")
        .0
}

fn node_with_admin_socket() -> (CniNode, std::path::PathBuf) {
    let mut node = CniNode::bare("workloads: []\n").expect("node");
    node.start_agent().expect("agent");
    let sock = node.dir.join("admin").join("proxy-admin.sock");
    let sock_arg = sock.display().to_string();
    node.start_proxy_with(&["--admin-socket", &sock_arg, "--no-admin-tcp"]).expect("proxy");
    (node, sock)
}

#[test]
fn root_reaches_admin_on_its_socket() {
    let (_node, sock) = node_with_admin_socket();
    assert_eq!(status_over(&sock, "GET", "/config_dump"), 200);
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&sock), 0o600);
    assert_eq!(mode(sock.parent().expect("dir")), 0o700);
}

#[test]
fn another_user_cannot_shut_the_proxy_down_through_admin() {
    let (node, sock) = node_with_admin_socket();
    // An unprivileged host process tries POST /quitquitquit.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "curl", "-s", "-o", "/dev/null"])
        .args(["-w", "%{http_code}", "-X", "POST", "--unix-socket"])
        .arg(&sock)
        .arg("http://admin/quitquitquit")
        .output()
        .expect("setpriv curl");
    // curl's exit 7: it could not connect.
    assert_eq!(out.status.code(), Some(7), "{}", String::from_utf8_lossy(&out.stdout));
    // The proxy still serves: not draining, and admin still answers root.
    assert_eq!(readiness(&node), 200);
    let proxy = node.proxy.as_ref().expect("proxy");
    assert!(!proxy.lines().iter().any(|l| l.contains("draining")), "{:#?}", proxy.lines());
    assert_eq!(status_over(&sock, "GET", "/config_dump"), 200);
}

#[test]
fn with_the_socket_admin_is_not_served_on_tcp() {
    let (node, sock) = node_with_admin_socket();
    let proxy = node.proxy.as_ref().expect("proxy");
    let lines = proxy.lines();
    assert!(lines.iter().any(|l| l.starts_with("ADMIN_SOCKET ")), "{lines:#?}");
    // Nothing listens on the admin port in the proxy's network namespace, while its readiness
    // port, a few numbers away on the same address, answers: the probe reaches where admin
    // would be.
    let connect = |port: u16| {
        node.node
            .open()
            .expect("node netns")
            .run(|| {
                std::net::TcpStream::connect_timeout(
                    &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                    Duration::from_secs(5),
                )
            })
            .expect("netns")
    };
    assert!(connect(15021).is_ok(), "the readiness port does not answer: the probe is off");
    let admin = connect(15000);
    assert!(
        matches!(&admin, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
        "admin on TCP 15000: {admin:?}"
    );
    // Root's POST /quitquitquit over the socket does start the drain: the socket is the
    // endpoint.
    assert_eq!(readiness(&node), 200);
    assert_eq!(status_over(&sock, "POST", "/quitquitquit"), 200);
    let drained = proxy.wait_for_text("draining: no new connections", Duration::from_secs(10));
    assert!(drained, "{:#?}", proxy.lines());
}
