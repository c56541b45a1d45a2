//! Istio's kubelet-probe contract, node side included: a process of the node's netns (kubelet)
//! probing an enrolled pod leaves from 169.254.7.127 / fd16:9254:7127:1337:ffff:ffff:ffff:ffff
//! (istio-cni does this with a host SNAT rule; meshpath binds the socket in connect4/6) and
//! reaches the app uncaptured; other node connections keep their own source.

use std::{
    io::Read as _,
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream},
    time::Duration,
};

use datapath_common::consts::probe;
use meshpath_loader::{
    netns::Netns,
    pods::{self, EnrolOptions},
};
use meshpath_tests::{
    read_line, require_root, sh, sibling_bin, unique, CgroupGuard, NetnsGuard, PinRoot, TestProxy,
};

/// A node netns and one pod behind a veth, dual-stack, the pod routed through the node.
struct Node {
    _proxy: TestProxy,
    _cgroup: CgroupGuard,
    pod: NetnsGuard,
    node: NetnsGuard,
    root: PinRoot,
}

const POD_V4: &str = "10.198.0.2";
const POD_V6: &str = "fd00:198::2";

impl Node {
    fn new(opts: EnrolOptions) -> Self {
        require_root();
        let (node, pod) =
            (NetnsGuard::new("mpnode").expect("node"), NetnsGuard::new("mppod").expect("pod"));
        let (host_if, pod_if) = (unique("vh"), unique("vp"));
        sh(
            "ip",
            &[
                "link",
                "add",
                &host_if,
                "netns",
                node.name(),
                "type",
                "veth",
                "peer",
                "name",
                &pod_if,
                "netns",
                pod.name(),
            ],
        )
        .expect("veth");
        node.ip(&["addr", "add", "10.198.0.1/24", "dev", &host_if]).expect("node v4");
        node.ip(&["addr", "add", "fd00:198::1/64", "dev", &host_if, "nodad"]).expect("node v6");
        node.ip(&["link", "set", &host_if, "up"]).expect("up");
        pod.ip(&["link", "set", &pod_if, "name", "eth0"]).expect("rename");
        pod.ip(&["addr", "add", &format!("{POD_V4}/24"), "dev", "eth0"]).expect("pod v4");
        pod.ip(&["addr", "add", &format!("{POD_V6}/64"), "dev", "eth0", "nodad"]).expect("pod v6");
        pod.ip(&["link", "set", "eth0", "up"]).expect("up");
        pod.ip(&["route", "add", "default", "via", "10.198.0.1"]).expect("v4 default route");
        pod.ip(&["-6", "route", "add", "default", "via", "fd00:198::1"]).expect("v6 default route");
        let (root, cgroup) = (PinRoot::new(), CgroupGuard::new().expect("cgroup"));
        {
            let dp = root.datapath().expect("datapath");
            dp.register_proxy_cgroup(cgroup.path()).expect("proxy cgroup");
            pods::enrol(&dp, &pod.open().expect("pod netns"), &opts).expect("enrol");
            dp.set_probe_source(Some(&node.open().expect("node netns"))).expect("probe source");
        }
        let proxy = TestProxy::start(
            &sibling_bin("meshpath-test-proxy"),
            &pod.path(),
            &cgroup,
            "echo",
            true,
            &[],
        )
        .expect("proxy");
        Self { _proxy: proxy, _cgroup: cgroup, pod, node, root }
    }

    fn pod_addr(v6: bool, port: u16) -> SocketAddr {
        SocketAddr::new(if v6 { POD_V6 } else { POD_V4 }.parse().expect("ip"), port)
    }

    /// "kubelet": a connection from the node's netns.
    fn probe(&self, to: SocketAddr) -> TcpStream {
        let ns: Netns = self.node.open().expect("node netns");
        ns.run(|| TcpStream::connect_timeout(&to, Duration::from_secs(5)))
            .expect("netns")
            .expect("probe connects")
    }
}

fn probe_source(v6: bool) -> IpAddr {
    if v6 {
        Ipv6Addr::from(probe::SOURCE_V6).into()
    } else {
        IpAddr::from(probe::SOURCE_V4)
    }
}

#[test]
fn kubelet_probes_from_the_node_reach_the_app_from_the_probe_source() {
    let node = Node::new(EnrolOptions { capture_inbound: true, ..EnrolOptions::default() });
    for v6 in [false, true] {
        let dst = Node::pod_addr(v6, 8080);
        let app = node.pod.listen(dst).expect("bind");
        let probe = node.probe(dst);
        let (mut conn, peer) = app.accept().expect("the app itself accepts the probe");
        assert_eq!(peer.ip(), probe_source(v6), "v6={v6}");
        assert_eq!(probe.local_addr().expect("local").ip(), probe_source(v6));
        drop(probe);
        let mut rest = Vec::new();
        conn.read_to_end(&mut rest).expect("close");
    }
}

#[test]
fn probes_are_captured_from_the_probe_source_when_bypass_is_off() {
    let node = Node::new(EnrolOptions {
        capture_inbound: true,
        probe_bypass: false,
        ..EnrolOptions::default()
    });
    // Without bypass the probe contract does not apply: the node's own address, and captured.
    let dst = Node::pod_addr(false, 8081);
    let conn = node.probe(dst);
    assert!(read_line(&conn).starts_with(&format!("INBOUND {dst} FROM 10.198.0.1:")));
}

#[test]
fn node_connections_keep_their_source_when_the_probe_source_is_off() {
    let node = Node::new(EnrolOptions { capture_inbound: true, ..EnrolOptions::default() });
    node.root.datapath().expect("datapath").set_probe_source(None).expect("off");
    let dst = Node::pod_addr(false, 8082);
    let conn = node.probe(dst);
    assert!(read_line(&conn).starts_with(&format!("INBOUND {dst} FROM 10.198.0.1:")));
}
