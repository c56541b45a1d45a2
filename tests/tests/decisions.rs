//! What the datapath decided, visible: each decision a real connection causes is counted for
//! its pod and reason (`meshpath_loader::decisions`, what `show`/`list` and the agent's metric
//! read) and streamed by `meshpath-loader monitor` while one runs. One reason per test; every
//! "passed" has a real listener that takes the connection, every "dropped" a real listener
//! that must see nothing. Real kernel, real namespaces, real TCP and UDP.

use std::{
    io::{BufRead as _, BufReader},
    net::{SocketAddr, UdpSocket},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use datapath_common::{
    consts::{ports, probe},
    decisions::NODE_WIDE,
    node_flags,
};
use meshpath_loader::{decisions, pods::EnrolOptions};
use meshpath_tests::{loader_bin, read_line, Mesh, PinRoot, Sentinel};
use serde_json::Value;

/// `meshpath-loader monitor --json` on a test's datapath, stopped (SIGTERM) on drop.
struct Monitor {
    child: Child,
    lines: mpsc::Receiver<Value>,
}

impl Monitor {
    fn start(root: &PinRoot, extra: &[&str]) -> Self {
        let mut child = Command::new(loader_bin())
            .arg("--pin-root")
            .arg(root.path())
            .args(["monitor", "--json"])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("meshpath-loader monitor");
        let stdout = child.stdout.take().expect("stdout");
        let (ready_tx, ready) = mpsc::channel();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("# monitoring") {
                    let _ = ready_tx.send(());
                } else if let Ok(v) = serde_json::from_str(&line) {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
            }
        });
        ready.recv_timeout(Duration::from_secs(20)).expect("the monitor never said it started");
        Self { child, lines }
    }

    /// The first event with these labels toward `dst` (or any destination), within 10 s.
    fn expect(&self, hook: &str, decision: &str, reason: &str, dst: Option<SocketAddr>) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let Ok(v) = self.lines.recv_timeout(left) else { break };
            let hit = v["hook"] == hook
                && v["decision"] == decision
                && v["reason"] == reason
                && dst.is_none_or(|d| v["dst"] == d.to_string());
            if hit {
                return v;
            }
            seen.push(v);
        }
        panic!("no `{hook} {decision} ({reason})` event to {dst:?}; saw {seen:#?}");
    }

    /// Every event that arrives within `wait`.
    fn drain(&self, wait: Duration) -> Vec<Value> {
        let deadline = Instant::now() + wait;
        let mut out = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(v) => out.push(v),
                Err(_) => break,
            }
        }
        out
    }

    /// Stops it as Ctrl-C would.
    fn stop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Asserts that pod a's inbound decisions are `decision (reason)` only, counted at least once.
/// Not once per connection: sk_lookup runs for a packet that finds no socket (established,
/// request or time-wait), so a packet that arrives after the connection's sockets are gone is
/// counted again (a 6.1 VM counted two for one SYN), and a SYN sent again may or may not be,
/// as it finds the request socket or not.
fn assert_inbound_only(mesh: &Mesh, decision: &str, reason: &str) {
    let all = decisions::of(&mesh.datapath(), cookie_a(mesh)).expect("decisions");
    let inbound: Vec<_> = all.iter().filter(|d| d.hook == "inbound").collect();
    assert!(
        inbound.len() == 1
            && inbound[0].decision == decision
            && inbound[0].why == reason
            && inbound[0].count >= 1,
        "expected only `inbound {decision} ({reason})`; got {inbound:?}"
    );
}

/// The count of (hook, decision, reason) for `netns` in the test's datapath.
fn count(mesh: &Mesh, netns: u64, hook: &str, decision: &str, reason: &str) -> u64 {
    decisions::of(&mesh.datapath(), netns)
        .expect("decisions")
        .iter()
        .find(|d| d.hook == hook && d.decision == decision && d.why == reason)
        .map_or(0, |d| d.count)
}

fn cookie_a(mesh: &Mesh) -> u64 {
    mesh.pods.a.open().expect("netns a").cookie()
}

fn pod_a_name(mesh: &Mesh) -> String {
    mesh.pods.a.path().display().to_string()
}

#[test]
fn a_captured_outbound_connection_is_counted_and_streamed_for_its_pod() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(false, 8080);
    let conn = mesh.connect_from_a(dst, None).expect("connect through capture");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    assert_eq!(count(&mesh, cookie_a(&mesh), "outbound", "captured", "to proxy"), 1);
    let ev = monitor.expect("outbound", "captured", "to proxy", Some(dst));
    assert_eq!(ev["pod"], pod_a_name(&mesh));
    assert_eq!(ev["netns"], cookie_a(&mesh));
}

#[test]
fn the_proxys_original_destination_lookup_is_counted_as_answered() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(true, 8081);
    let conn = mesh.connect_from_a(dst, None).expect("connect through capture");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    assert_eq!(count(&mesh, cookie_a(&mesh), "getsockopt", "answered", "original destination"), 1);
    monitor.expect("getsockopt", "answered", "original destination", Some(dst));
}

#[test]
fn a_connection_the_datapath_did_not_capture_gets_no_original_destination() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    // The app reaching the proxy's 15001 at its own address directly: not captured, so the
    // proxy's SO_ORIGINAL_DST is refused, as netfilter refuses it for an unredirected socket.
    let conn = mesh.connect_from_a(mesh.a(false, ports::OUTBOUND), None).expect("connect");
    let _ = read_line(&conn);
    monitor.expect("getsockopt", "refused", "no captured connection", None);
    assert!(count(&mesh, cookie_a(&mesh), "getsockopt", "refused", "no captured connection") >= 1);
}

#[test]
fn an_excluded_outbound_port_is_counted_as_passed() {
    let mesh = Mesh::new(EnrolOptions {
        capture_outbound: true,
        exclude_outbound_ports: vec![9090],
        ..EnrolOptions::default()
    });
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(false, 9090);
    let server = mesh.echo_server_in_b(dst);
    drop(mesh.connect_from_a(dst, None).expect("excluded port connects directly"));
    server.join().expect("server").expect("the server took the connection");
    assert_eq!(count(&mesh, cookie_a(&mesh), "outbound", "passed", "excluded port"), 1);
    monitor.expect("outbound", "passed", "excluded port", Some(dst));
}

#[test]
fn an_excluded_outbound_prefix_is_counted_as_passed() {
    let mesh = Mesh::new(EnrolOptions {
        capture_outbound: true,
        exclude_outbound_cidrs: vec!["fd00:199::2/128".parse().expect("cidr")],
        ..EnrolOptions::default()
    });
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(true, 9091);
    let server = mesh.echo_server_in_b(dst);
    drop(mesh.connect_from_a(dst, None).expect("excluded prefix connects directly"));
    server.join().expect("server").expect("the server took the connection");
    assert_eq!(count(&mesh, cookie_a(&mesh), "outbound", "passed", "excluded cidr"), 1);
    monitor.expect("outbound", "passed", "excluded cidr", Some(dst));
}

#[test]
fn loopback_and_own_address_connections_are_counted_as_staying_in_the_pod() {
    let mesh = Mesh::capturing();
    let monitor = Monitor::start(&mesh.root, &[]);
    let lo: SocketAddr = "127.0.0.1:9092".parse().expect("addr");
    let own = mesh.a(false, 9093);
    for dst in [lo, own] {
        let server = mesh.echo_server_in_a(dst);
        drop(mesh.connect_from_a(dst, None).expect("in-pod connect"));
        server.join().expect("server").expect("the app took the connection");
    }
    let a = cookie_a(&mesh);
    assert_eq!(count(&mesh, a, "outbound", "passed", "loopback"), 1);
    assert_eq!(count(&mesh, a, "outbound", "passed", "own address"), 1);
    monitor.expect("outbound", "passed", "loopback", Some(lo));
    monitor.expect("outbound", "passed", "own address", Some(own));
}

#[test]
fn the_proxys_own_connections_are_counted_as_passed() {
    let mesh = Mesh::capturing().with_proxy("forward");
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(false, 9094);
    let server = mesh.echo_server_in_b(dst);
    let conn = mesh.connect_from_a(dst, None).expect("connect through the forwarding proxy");
    drop(conn);
    server.join().expect("server").expect("the proxy's upstream connection arrived");
    assert_eq!(count(&mesh, cookie_a(&mesh), "outbound", "passed", "proxy cgroup"), 1);
    monitor.expect("outbound", "passed", "proxy cgroup", Some(dst));
}

#[test]
fn a_pod_enrolled_without_capture_is_counted_as_capture_off() {
    let mesh = Mesh::new(EnrolOptions::default());
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(false, 9095);
    let server = mesh.echo_server_in_b(dst);
    drop(mesh.connect_from_a(dst, None).expect("direct connect"));
    server.join().expect("server").expect("the server took the connection");
    assert_eq!(count(&mesh, cookie_a(&mesh), "outbound", "passed", "capture off"), 1);
    monitor.expect("outbound", "passed", "capture off", Some(dst));
}

#[test]
fn connections_outside_any_enrolled_pod_are_counted_node_wide() {
    let mesh = Mesh::capturing();
    let monitor = Monitor::start(&mesh.root, &[]);
    // Pod b is not enrolled.
    let dst = mesh.a(false, 9096);
    let server = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_b(dst, None).expect("connect from b"));
    server.join().expect("server").expect("pod a took the connection");
    assert!(count(&mesh, NODE_WIDE, "outbound", "passed", "not enrolled") >= 1);
    let ev = monitor.expect("outbound", "passed", "not enrolled", Some(dst));
    assert_eq!(ev["pod"], "node");
}

#[test]
fn outbound_with_the_proxy_down_is_refused_by_the_kernel_and_shown_as_captured() {
    // connect() is steered to 15001, where nothing listens: the refusal is the TCP stack's,
    // so the decision the datapath made is "captured"; the app listening at the destination
    // proves nothing went around.
    let mesh = Mesh::capturing();
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.b(false, 9097);
    let sentinel = Sentinel::new(&mesh.pods.b, dst);
    assert!(mesh.connect_from_a(dst, None).is_err());
    sentinel.assert_untouched("outbound without a proxy");
    monitor.expect("outbound", "captured", "to proxy", Some(dst));
}

fn inbound(opts: EnrolOptions) -> Mesh {
    Mesh::new(EnrolOptions { capture_inbound: true, ..opts })
}

#[test]
fn an_inbound_connection_is_counted_as_steered_with_its_client() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.a(false, 8082);
    let conn = mesh.connect_from_b(dst, None).expect("connect to pod a");
    let client = conn.local_addr().expect("local addr");
    assert_eq!(read_line(&conn), format!("INBOUND {dst} FROM {client}"));
    assert_eq!(count(&mesh, cookie_a(&mesh), "inbound", "steered", "to proxy"), 1);
    let ev = monitor.expect("inbound", "steered", "to proxy", Some(dst));
    assert_eq!(ev["src"], client.to_string());
}

#[test]
fn a_killed_proxy_shows_as_inbound_dropped_no_listener_for_the_next_connection() {
    let mut mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &["--only", "drops"]);
    let dst = mesh.a(true, 8083);
    let sentinel = Sentinel::new(&mesh.pods.a, dst);
    let conn = mesh.connect_from_b(dst, None).expect("connect while the proxy runs");
    assert!(read_line(&conn).starts_with("INBOUND"));
    mesh.proxy.as_mut().expect("proxy").stop();
    let err = mesh.connect_from_b(dst, None).expect_err("connected with the proxy gone");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    sentinel.assert_untouched("inbound with the proxy gone");
    assert_eq!(count(&mesh, cookie_a(&mesh), "inbound", "dropped", "no listener"), 1);
    let ev = monitor.expect("inbound", "dropped", "no listener", Some(dst));
    assert_eq!(ev["pod"], pod_a_name(&mesh));
}

#[test]
fn inbound_to_an_unknown_address_is_counted_node_wide_as_dropped() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    mesh.pods.a.ip(&["addr", "add", "10.199.0.77/24", "dev", "eth0"]).expect("extra address");
    let dst: SocketAddr = "10.199.0.77:8084".parse().expect("addr");
    let sentinel = Sentinel::new(&mesh.pods.a, dst);
    assert!(mesh.connect_from_b(dst, None).is_err(), "unknown address accepted");
    sentinel.assert_untouched("an address the datapath does not know");
    assert_eq!(count(&mesh, NODE_WIDE, "inbound", "dropped", "unknown address"), 1);
    monitor.expect("inbound", "dropped", "unknown address", Some(dst));
}

#[test]
fn inbound_to_the_hbone_port_is_counted_as_steered_to_a_proxy_port() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    let hbone = mesh.a(false, ports::HBONE);
    let server = mesh.echo_server_as_proxy_in_a(hbone);
    drop(mesh.connect_from_b(hbone, None).expect("connect to 15008"));
    server.join().expect("server").expect("15008 took the connection");
    assert_inbound_only(&mesh, "steered", "proxy port");
    monitor.expect("inbound", "steered", "proxy port", Some(hbone));
}

#[test]
fn an_excluded_inbound_port_is_counted_as_passed() {
    let mesh = inbound(EnrolOptions { exclude_inbound_ports: vec![2222], ..Default::default() });
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.a(false, 2222);
    let app = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_b(dst, None).expect("excluded port reaches the app"));
    app.join().expect("app").expect("the app took the connection");
    assert_inbound_only(&mesh, "passed", "excluded port");
    monitor.expect("inbound", "passed", "excluded port", Some(dst));
}

#[test]
fn an_excluded_inbound_client_prefix_is_counted_as_passed() {
    let mesh = inbound(EnrolOptions {
        exclude_inbound_cidrs: vec!["10.199.0.2/32".parse().expect("cidr")],
        ..Default::default()
    });
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.a(false, 2224);
    let app = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_b(dst, None).expect("excluded client reaches the app"));
    app.join().expect("app").expect("the app took the connection");
    assert_inbound_only(&mesh, "passed", "excluded cidr");
    monitor.expect("inbound", "passed", "excluded cidr", Some(dst));
}

#[test]
fn inbound_inside_the_pod_is_counted_as_in_pod() {
    let mesh = inbound(EnrolOptions::default());
    let monitor = Monitor::start(&mesh.root, &[]);
    let dst = mesh.a(false, 8085);
    let app = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_a(dst, None).expect("in-pod connect"));
    app.join().expect("app").expect("the app took the connection");
    assert!(count(&mesh, cookie_a(&mesh), "inbound", "passed", "in pod") >= 1);
    monitor.expect("inbound", "passed", "in pod", Some(dst));
}

#[test]
fn a_kubelet_probe_is_counted_as_passed() {
    let mesh = inbound(EnrolOptions::default()).with_proxy("echo");
    let monitor = Monitor::start(&mesh.root, &[]);
    // Pod b plays kubelet: it gets the probe source address; pod a routes back to it.
    let probe_ip = std::net::IpAddr::from(probe::SOURCE_V4);
    mesh.pods.b.ip(&["addr", "add", &format!("{probe_ip}/32"), "dev", "eth0"]).expect("probe ip");
    mesh.pods.a.ip(&["route", "add", &probe_ip.to_string(), "dev", "eth0"]).expect("route");
    let dst = mesh.a(false, 8092);
    let app = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_b(dst, Some(probe_ip)).expect("probe connects"));
    let client = app.join().expect("app").expect("the app took the probe");
    assert_eq!(client.ip(), probe_ip);
    assert_eq!(count(&mesh, cookie_a(&mesh), "inbound", "passed", "probe"), 1);
    monitor.expect("inbound", "passed", "probe", Some(dst));
}

#[test]
fn a_pod_without_inbound_capture_pays_for_no_inbound_decision() {
    // Its netns is linked to the program that passes everything without a look at the maps.
    let mesh = Mesh::new(EnrolOptions::default());
    let dst = mesh.a(false, 8086);
    let app = mesh.echo_server_in_a(dst);
    drop(mesh.connect_from_b(dst, None).expect("direct inbound"));
    app.join().expect("app").expect("the app took the connection");
    let all = decisions::of(&mesh.datapath(), cookie_a(&mesh)).expect("decisions");
    assert!(all.iter().all(|d| d.hook != "inbound"), "{all:?}");
}

#[test]
fn a_udp_dns_query_is_counted_as_dns_captured() {
    let mesh = Mesh::new(EnrolOptions { capture_dns: true, ..EnrolOptions::default() });
    let monitor = Monitor::start(&mesh.root, &[]);
    let server = mesh.b(false, ports::DNS_UPSTREAM);
    // A real DNS server in pod b: the query must not reach it (it goes to 15053 in pod a).
    let real = mesh.pods.b.open().expect("netns").run(|| UdpSocket::bind(server)).expect("netns");
    let real = real.expect("bind");
    real.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
    let sock = mesh
        .pods
        .a
        .open()
        .expect("netns")
        .run(|| UdpSocket::bind("0.0.0.0:0"))
        .expect("netns")
        .expect("bind");
    sock.send_to(b"query", server).expect("send");
    let mut buf = [0u8; 16];
    assert!(
        meshpath_tests::again_after_eintr(|| real.recv_from(&mut buf)).is_err(),
        "the query went around the DNS capture"
    );
    assert_eq!(count(&mesh, cookie_a(&mesh), "dns", "captured", "to dns proxy"), 1);
    monitor.expect("dns", "captured", "to dns proxy", Some(server));
}

#[test]
fn a_monitor_for_drops_only_shows_no_other_decision() {
    let mesh = inbound(EnrolOptions::default());
    let monitor = Monitor::start(&mesh.root, &["--only", "drops"]);
    let open = mesh.a(false, ports::HBONE);
    let app = mesh.echo_server_as_proxy_in_a(open);
    drop(mesh.connect_from_b(open, None).expect("connect to 15008"));
    app.join().expect("app").expect("15008 took the connection");
    let dst = mesh.a(false, 8087);
    let sentinel = Sentinel::new(&mesh.pods.a, dst);
    assert!(mesh.connect_from_b(dst, None).is_err());
    sentinel.assert_untouched("inbound without a proxy");
    monitor.expect("inbound", "dropped", "no listener", Some(dst));
    let rest = monitor.drain(Duration::from_millis(300));
    assert!(
        rest.iter().all(|v| v["decision"] == "dropped" || v["decision"] == "refused"),
        "{rest:#?}"
    );
}

#[test]
fn the_stream_is_off_unless_a_monitor_runs() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let flags = || mesh.datapath().node_flags().expect("flags");
    assert_eq!(flags() & node_flags::MONITOR, 0, "on before any monitor");
    let mut monitor = Monitor::start(&mesh.root, &["--only", "drops"]);
    assert_ne!(flags() & node_flags::MONITOR, 0);
    assert_ne!(flags() & node_flags::MONITOR_DROPS_ONLY, 0);
    monitor.stop();
    assert_eq!(flags() & (node_flags::MONITOR | node_flags::MONITOR_DROPS_ONLY), 0);
    // Decisions made now reach no ring: a new monitor finds nothing old in it.
    let dst = mesh.b(false, 8088);
    let conn = mesh.connect_from_a(dst, None).expect("connect");
    assert_eq!(read_line(&conn), format!("ORIG_DST {dst}"));
    let again = Monitor::start(&mesh.root, &[]);
    let old = again.drain(Duration::from_millis(300));
    assert!(old.iter().all(|v| v["dst"] != dst.to_string()), "{old:#?}");
}

#[test]
fn a_second_monitor_is_refused_while_one_runs() {
    let mesh = Mesh::capturing();
    let _first = Monitor::start(&mesh.root, &[]);
    let out = Command::new(loader_bin())
        .arg("--pin-root")
        .arg(mesh.root.path())
        .args(["monitor", "--count", "1"])
        .output()
        .expect("second monitor");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another monitor is running"), "{err}");
}

#[test]
fn counting_can_be_switched_off_and_on() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let a = cookie_a(&mesh);
    decisions::set_counting(&mesh.datapath(), false).expect("off");
    let dst = mesh.b(false, 8089);
    assert_eq!(
        read_line(&mesh.connect_from_a(dst, None).expect("connect")),
        format!("ORIG_DST {dst}")
    );
    assert_eq!(count(&mesh, a, "outbound", "captured", "to proxy"), 0);
    decisions::set_counting(&mesh.datapath(), true).expect("on");
    assert_eq!(
        read_line(&mesh.connect_from_a(dst, None).expect("connect")),
        format!("ORIG_DST {dst}")
    );
    assert_eq!(count(&mesh, a, "outbound", "captured", "to proxy"), 1);
}

#[test]
fn an_unenrolled_pods_counts_are_removed_with_it() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let a = cookie_a(&mesh);
    let dst = mesh.b(false, 8090);
    assert_eq!(
        read_line(&mesh.connect_from_a(dst, None).expect("connect")),
        format!("ORIG_DST {dst}")
    );
    assert!(!decisions::of(&mesh.datapath(), a).expect("decisions").is_empty());
    meshpath_loader::pods::unenrol(&mesh.datapath(), a).expect("unenrol");
    assert!(decisions::of(&mesh.datapath(), a).expect("decisions").is_empty());
}

#[test]
fn show_prints_a_pods_decisions() {
    let mesh = Mesh::capturing().with_proxy("echo");
    let dst = mesh.b(false, 8091);
    assert_eq!(
        read_line(&mesh.connect_from_a(dst, None).expect("connect")),
        format!("ORIG_DST {dst}")
    );
    let out = meshpath_tests::loader(
        &mesh.root,
        &["show", "--json", "--netns", &mesh.pods.a.path().to_string_lossy()],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let captured = v["decisions"]
        .as_array()
        .expect("decisions")
        .iter()
        .find(|d| d["hook"] == "outbound" && d["decision"] == "captured")
        .cloned()
        .expect("a captured decision");
    assert_eq!(captured["count"], 1);
}
