//! The pod lifecycle through the real CNI chain (Debian's loopback, bridge and host-local, then
//! meshpath-cni) into the node agent, the datapath and the node proxy over ZDS.

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    time::Duration,
};

use meshpath_tests::cni_node::{run_plugin, CniNode, CniPod};
use serde_json::json;

/// Pods web and db are meshed; legacy is not in the mesh.
const WORKLOADS: &str = "workloads:\n\
- {uid: uid-web, name: web, namespace: default, serviceAccount: web, protocol: HBONE}\n\
- {uid: uid-db, name: db, namespace: default, serviceAccount: db, protocol: HBONE}\n";

/// The store learns db's address (as a control plane would); waits for the proxy's reload.
fn publish_db_address(node: &CniNode, db: &CniPod) {
    node.publish_address(WORKLOADS, "db", db.ip);
}

fn echo_once(pod: &CniPod, dst: SocketAddr, msg: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut c = pod.connect(dst)?;
    c.write_all(msg)?;
    let mut back = vec![0u8; msg.len()];
    c.read_exact(&mut back)?;
    Ok(back)
}

#[test]
fn a_meshed_pod_is_captured_from_its_first_connection() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let db = node.add_pod("db").expect("ADD db");
    node.echo_server(&db, 8080).expect("echo");
    // Before web exists.
    publish_db_address(&node, &db);
    let web = node.add_pod("web").expect("ADD web");
    // The very first thing web does after ADD returned.
    let back = echo_once(&web, SocketAddr::new(db.ip, 8080), b"first").expect("first connection");
    assert_eq!(back, b"first");
    let labels = [
        ("reporter", "source"),
        ("source_workload", "web"),
        ("destination_workload", "db"),
        // Two pods of one node: the proxy carries it on the node-local path.
        ("connection_security_policy", "none"),
    ];
    let carried =
        node.proxy_metric("istio_tcp_connections_opened_total", &labels).expect("metrics");
    assert_eq!(carried, 1.0, "the first connection was not carried by the proxy");
    let mut pods = node.proxy_pods().expect("pods");
    pods.sort();
    assert_eq!(pods, vec!["uid-db", "uid-web"]);
}

#[test]
fn the_agent_exports_its_pods_datapath_decisions_and_drops_a_pod_that_left() {
    // Over HBONE, as ztunnel carries it, so that db's inbound steers to the proxy's 15008.
    let node = CniNode::start_with(WORKLOADS, &["--node-local-hbone"]).expect("node");
    let db = node.add_pod("db").expect("ADD db");
    node.echo_server(&db, 8080).expect("echo");
    publish_db_address(&node, &db);
    let web = node.add_pod("web").expect("ADD web");
    assert_eq!(echo_once(&web, SocketAddr::new(db.ip, 8080), b"hi").expect("connect"), b"hi");
    let metric = "meshpath_datapath_decisions_total";
    let web_captured = [("pod", "default/web"), ("hook", "outbound"), ("decision", "captured")];
    // Over HBONE: steered to the proxy's own 15008 in db's netns.
    let db_steered = [
        ("pod", "default/db"),
        ("hook", "inbound"),
        ("decision", "steered"),
        ("reason", "proxy port"),
    ];
    assert_eq!(node.agent_metric(metric, &web_captured).expect("metrics"), 1.0);
    assert_eq!(node.agent_metric(metric, &db_steered).expect("metrics"), 1.0);
    // The proxy's own connection to db's app (with web's address, IP_TRANSPARENT) is recognised
    // and let through, not steered back to the proxy.
    let db_transparent = [("pod", "default/db"), ("reason", "proxy connection")];
    assert_eq!(node.agent_metric(metric, &db_transparent).expect("metrics"), 1.0);
    let path = web.netns.path().display().to_string();
    assert_eq!(node.del_pod(&web, &path).expect("DEL").map_err(|r| r.stdout), Ok(()));
    assert_eq!(node.agent_metric(metric, &[("pod", "default/web")]).expect("metrics"), 0.0);
    assert_eq!(node.agent_metric(metric, &db_steered).expect("metrics"), 1.0);
}

#[test]
fn the_agent_logs_the_datapaths_drops_when_asked_to() {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    // Listeners not held (`--hold-listeners-seconds 0`, as for Istio's ztunnel): with the
    // proxy gone nothing listens, and the datapath drops what it has nowhere to steer.
    let no_hold = ["--hold-listeners-seconds".into(), "0".into()];
    node.start_agent_with(&[["--ebpf-log".into(), "info".into()].as_slice(), &no_hold].concat())
        .expect("agent");
    node.start_proxy().expect("proxy");
    let db = node.add_pod("db").expect("ADD db");
    let dst = SocketAddr::new(db.ip, 8080);
    // The app listens: the connection must be refused, not delivered around the proxy.
    let app = meshpath_tests::Sentinel::new(&db.netns, dst);
    node.proxy = None;
    let from_node = node.node.open().expect("node netns");
    let refused = from_node
        .run(|| std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(5)))
        .expect("in the node netns");
    assert!(refused.is_err(), "connected to db with its proxy gone");
    app.assert_untouched("db with its proxy gone");
    let agent = node.agent.as_ref().expect("agent");
    let line = "reason=\"no listener\"";
    assert!(agent.wait_for_text(line, Duration::from_secs(10)), "{:#?}", agent.lines());
    let logged = agent.lines().into_iter().find(|l| l.contains(line)).expect("the line");
    assert!(
        logged.contains("datapath decision") && logged.contains("hook=\"inbound\""),
        "{logged}"
    );
}

#[test]
fn a_pod_looping_on_a_refused_bind_writes_a_bounded_number_of_agent_log_lines() {
    use datapath_common::consts::ports;
    use meshpath_loader::agent::ebpf_log::RECORDS_PER_REASON_PER_SECOND as LIMIT;
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    node.start_agent_with(&["--ebpf-log".into(), "info".into()]).expect("agent");
    node.start_proxy().expect("proxy");
    let db = node.add_pod("db").expect("ADD db");
    let ns = db.netns.open().expect("netns");
    let bind = || std::net::TcpListener::bind(("0.0.0.0", ports::INBOUND_PLAINTEXT)).is_err();
    // An app in the pod tries the proxy's port 2000 times: each is refused, and logged at info.
    let refused = ns.run(|| (0..2000).filter(|_| bind()).count()).expect("netns");
    assert_eq!(refused, 2000, "a bind to the proxy's port was let through");
    let agent = node.agent.as_ref().expect("agent");
    let line = "reason=\"proxy port\"";
    assert!(agent.wait_for_text(line, Duration::from_secs(10)), "{:#?}", agent.lines());
    // One more a second later: logged, with how many were left out before it.
    std::thread::sleep(Duration::from_millis(1100));
    assert!(ns.run(bind).expect("netns"), "a bind to the proxy's port was let through");
    assert!(agent.wait_for_text("left_out=", Duration::from_secs(10)), "{:#?}", agent.lines());
    let logged = agent
        .lines()
        .into_iter()
        .filter(|l| l.contains(line) && l.contains("datapath decision"))
        .count();
    // The loop's second (or two, if it straddled one), and the last bind.
    assert!(logged <= 2 * LIMIT as usize + 1, "{logged} lines for 2001 refused binds");
}

#[test]
fn an_unmeshed_pod_passes_through_the_chain_untouched() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let legacy = node.add_pod("legacy").expect("ADD legacy");
    assert!(node.enrolled().is_empty(), "an unmeshed pod was enrolled");
    assert!(node.records().is_empty());
    assert!(node.proxy_pods().expect("pods").is_empty());
    // Its result is the bridge's, unchanged.
    assert!(
        legacy.result["interfaces"].as_array().is_some_and(|i| !i.is_empty()),
        "{}",
        legacy.result
    );
    assert_eq!(
        node.del_pod(&legacy, &legacy.netns.path().display().to_string())
            .expect("DEL")
            .map_err(|r| r.stdout),
        Ok(())
    );
}

#[test]
fn add_returns_the_main_plugins_result_unchanged() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let pod = meshpath_tests::NetnsGuard::new("mp-cnipod").expect("netns");
    let path = pod.path().display().to_string();
    let env = CniNode::env(
        "ctr-same",
        &path,
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=db",
    );
    let list = node.conflist(&node.cni_socket());
    let with = |p: &serde_json::Value, prev: Option<&serde_json::Value>| {
        let mut c = p.clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        if let Some(prev) = prev {
            c["prevResult"] = prev.clone();
        }
        c
    };
    let bridge = run_plugin(
        node.node.path().as_path(),
        std::path::Path::new("/usr/lib/cni/bridge"),
        "ADD",
        &with(&list["plugins"][0], None),
        &env,
    )
    .expect("bridge");
    assert!(bridge.success, "{}", bridge.stdout);
    let ours = run_plugin(
        node.node.path().as_path(),
        &meshpath_tests::sibling_bin("meshpath-cni"),
        "ADD",
        &with(&list["plugins"][1], Some(&bridge.json())),
        &env,
    )
    .expect("meshpath-cni");
    assert!(ours.success, "{}", ours.stdout);
    assert_eq!(ours.json(), bridge.json());
    assert_eq!(node.enrolled().len(), 1);
}

#[test]
fn check_succeeds_and_del_is_idempotent_even_with_an_empty_netns() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let db = node.add_pod("db").expect("ADD");
    assert_eq!(node.enrolled().len(), 1);
    assert_eq!(node.check_pod(&db).expect("CHECK").map_err(|r| r.stdout), Ok(()));
    let path = db.netns.path().display().to_string();
    assert_eq!(node.del_pod(&db, &path).expect("DEL").map_err(|r| r.stdout), Ok(()));
    assert_eq!(node.del_pod(&db, "").expect("second DEL").map_err(|r| r.stdout), Ok(()));
    assert!(node.enrolled().is_empty(), "still enrolled after DEL");
    assert!(node.records().is_empty(), "a record is left");
    assert!(node.root.pod_pins().is_empty(), "pins are left: {:?}", node.root.pod_pins());
    assert!(node.proxy_pods().expect("pods").is_empty(), "the proxy still serves the pod");
}

#[test]
fn add_fails_closed_when_the_agent_is_unreachable() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let list = node.conflist(&node.dir.join("nobody-listens.sock"));
    let err = node.add_pod_with("db", &list).expect_err("ADD succeeded without an agent");
    let msg = err.to_string();
    assert!(msg.contains("\"code\":11") && msg.contains("meshpath agent not reachable"), "{msg}");
    assert!(node.enrolled().is_empty());
}

#[test]
fn add_fails_and_leaves_nothing_when_no_proxy_is_connected() {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    node.start_agent().expect("agent");
    let err = node.add_pod("db").expect_err("ADD succeeded with no proxy");
    let msg = err.to_string();
    assert!(msg.contains("\"code\":100") && msg.contains("no node proxy is connected"), "{msg}");
    assert!(node.enrolled().is_empty(), "half-enrolled");
    assert!(node.records().is_empty(), "a record is left");
    assert!(node.root.pod_pins().is_empty());
}

/// meshpath-cni alone, given `conf` and `env`: its exit and its error result.
fn plugin(
    node: &CniNode,
    command: &str,
    conf: serde_json::Value,
    env: &[(&str, &str)],
) -> (bool, serde_json::Value) {
    let bin = meshpath_tests::sibling_bin("meshpath-cni");
    let run = run_plugin(node.node.path().as_path(), &bin, command, &conf, env).expect("run");
    (run.success, run.json())
}

#[test]
fn malformed_cni_input_gets_a_precise_error_and_the_spec_error_code() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let sock = node.cni_socket().display().to_string();
    let good = json!({"cniVersion": "1.0.0", "name": "n", "type": "meshpath-cni", "agentSocket": sock,
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.9.0.2/24"}]}});
    let env = [
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", "/proc/self/ns/net"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=default;K8S_POD_NAME=x"),
    ];
    // (command, config, environment, expected code, text the message must contain)
    type Case<'a> = (&'a str, serde_json::Value, Vec<(&'a str, &'a str)>, u64, &'a str);
    let cases: Vec<Case> = vec![
        ("ADD", json!("not an object"), env.to_vec(), 4, "network configuration"),
        (
            "ADD",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "meshpath-cni"}),
            env.to_vec(),
            4,
            "prevResult is missing",
        ),
        (
            "ADD",
            {
                let mut c = good.clone();
                c["cniVersion"] = json!("9.9.9");
                c
            },
            env.to_vec(),
            1,
            "cniVersion 9.9.9",
        ),
        ("ADD", good.clone(), env[1..].to_vec(), 7, "CNI_CONTAINERID is not set"),
        (
            "ADD",
            good.clone(),
            vec![env[0], env[1], env[2], ("CNI_ARGS", "K8S_POD_NAMESPACE=default")],
            7,
            "K8S_POD_NAME",
        ),
        (
            "ADD",
            good.clone(),
            vec![env[0], env[1], env[2], ("CNI_ARGS", "garbage")],
            7,
            "not KEY=VALUE",
        ),
        (
            "ADD",
            {
                let mut c = good.clone();
                c["prevResult"]["ips"][0]["address"] = json!("nope");
                c
            },
            env.to_vec(),
            4,
            "is not IP/LEN",
        ),
        ("FROB", good.clone(), env.to_vec(), 7, "CNI_COMMAND \"FROB\""),
    ];
    for (cmd, conf, env, code, text) in cases {
        let (ok, out) = plugin(&node, cmd, conf.clone(), &env);
        assert!(!ok, "{cmd} {conf} succeeded");
        assert_eq!(out["code"].as_u64(), Some(code), "{cmd} {conf}: {out}");
        assert!(
            out["msg"].as_str().is_some_and(|m| m.contains(text)),
            "{cmd} {conf}: {out} lacks {text:?}"
        );
    }
    assert!(node.enrolled().is_empty(), "bad input enrolled something");
    let (ok, out) = plugin(&node, "VERSION", json!({"cniVersion": "1.0.0"}), &[]);
    assert!(
        ok && out["supportedVersions"].as_array().is_some_and(|v| v.contains(&json!("1.0.0"))),
        "{out}"
    );
}

#[test]
fn the_agent_installs_its_plugin_repairs_its_chain_entry_and_uninstall_removes_both() {
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    let (bin, conf) = (node.dir.join("opt-cni-bin"), node.dir.join("etc-cni-net.d"));
    std::fs::create_dir_all(&bin).expect("bin dir");
    std::fs::create_dir_all(&conf).expect("conf dir");
    let bridge_only = json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [{"type": "bridge", "bridge": "cni0"}]});
    let list = conf.join("10-k8s.conflist");
    std::fs::write(&list, bridge_only.to_string()).expect("conflist");
    node.start_agent_with(&[
        "--cni-bin-dir".into(),
        bin.display().to_string(),
        "--cni-conf-dir".into(),
        conf.display().to_string(),
        "--cni-plugin".into(),
        meshpath_tests::sibling_bin("meshpath-cni").display().to_string(),
    ])
    .expect("agent");
    let chained = |want: bool| {
        (0..100).any(|_| {
            let text = std::fs::read_to_string(&list).unwrap_or_default();
            if text.contains("meshpath-cni") == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
            false
        })
    };
    assert!(chained(true), "the agent did not chain its plugin");
    assert!(bin.join("meshpath-cni").exists(), "the plugin binary was not installed");
    let types = |v: &serde_json::Value| -> Vec<String> {
        v["plugins"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["type"].as_str().map(str::to_owned))
            .collect()
    };
    let now: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&list).expect("read")).expect("json");
    assert_eq!(types(&now), ["bridge", "meshpath-cni"]);
    // Another agent rewrites the file without our entry: it comes back.
    std::fs::write(&list, bridge_only.to_string()).expect("rewrite");
    assert!(chained(true), "the entry was not repaired");
    // Uninstall (the agent stopped first, or it would put the entry back).
    node.agent = None;
    let out = std::process::Command::new(meshpath_tests::loader_bin())
        .args(["cni-uninstall", "--cni-bin-dir"])
        .arg(&bin)
        .arg("--cni-conf-dir")
        .arg(&conf)
        .output()
        .expect("cni-uninstall");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let after: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&list).expect("read")).expect("json");
    assert_eq!(types(&after), ["bridge"]);
    assert!(!bin.join("meshpath-cni").exists(), "the plugin binary is left");
}

#[test]
fn add_sets_up_the_reply_routing_of_a_meshed_pod_and_leaves_an_unmeshed_one_alone() {
    // The proxy never sets it up: what is there comes from the agent's enrolment, keyed on the
    // datapath's reply mark (0x111), never on the proxy's own 0x539.
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    node.start_agent().expect("agent");
    node.start_proxy_with(&["--no-preserve-source"]).expect("proxy");
    let (db, legacy) =
        (node.add_pod("db").expect("ADD db"), node.add_pod("legacy").expect("ADD legacy"));
    let state = |pod: &CniPod| {
        pod.netns
            .open()
            .expect("netns")
            .run(|| {
                let accept = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_fwmark_accept")
                    .unwrap_or_default();
                let rules = std::process::Command::new("ip")
                    .args(["-4", "rule", "show"])
                    .output()
                    .expect("ip rule");
                (accept.trim().to_owned(), String::from_utf8_lossy(&rules.stdout).into_owned())
            })
            .expect("run in netns")
    };
    let (accept, rules) = state(&db);
    assert_eq!(accept, "1");
    assert!(rules.contains("fwmark 0x111/0xfff lookup 133"), "{rules}");
    assert!(!rules.contains("0x539"), "a rule keyed on the proxy's own mark: {rules}");
    let (accept, rules) = state(&legacy);
    assert_eq!(accept, "0", "an unmeshed pod was changed");
    assert!(!rules.contains("lookup 133"), "{rules}");
}

#[test]
fn a_contained_proxy_keeps_client_addresses_with_the_reply_routing_the_agent_set_up() {
    // The proxy cannot write /proc/sys (read-only, as in an unprivileged container) and does
    // not need to: the reply routing the agent wrote at enrolment is what lets it keep the
    // client's address.
    let mut node = CniNode::bare(WORKLOADS).expect("node");
    node.start_agent().expect("agent");
    node.start_proxy_contained().expect("proxy");
    let db = node.add_pod("db").expect("ADD db");
    publish_db_address(&node, &db);
    let proxy = node.proxy.as_ref().expect("proxy");
    let web = node.add_pod("web").expect("ADD web");
    let listener = db.netns.listen(SocketAddr::new(db.ip, 8081)).expect("listen");
    let server = std::thread::spawn(move || {
        let (mut c, peer) = listener.accept()?;
        let mut buf = [0u8; 2];
        c.read_exact(&mut buf)?;
        c.write_all(&buf)?;
        Ok::<_, std::io::Error>(peer)
    });
    assert_eq!(echo_once(&web, SocketAddr::new(db.ip, 8081), b"hi").expect("round trip"), b"hi");
    let peer = server.join().expect("server").expect("server io");
    assert_eq!(peer.ip(), web.ip, "the app did not see the client's address");
    // And the proxy really could not have written it itself.
    let ro = std::process::Command::new("nsenter")
        .arg(format!("--mount=/proc/{}/ns/mnt", proxy.pid()))
        .args(["sh", "-c", "echo 1 > /proc/sys/net/ipv4/fwmark_reflect"])
        .output()
        .expect("nsenter");
    assert!(!ro.status.success(), "the proxy's /proc/sys is writable");
}

#[test]
fn a_pod_uid_that_is_no_file_name_is_recorded_inside_the_state_directory() {
    // A uid with `/` and `..` once made ADD fail writing ".../pods/.X//Pod/...tmp".
    let workloads = "workloads:\n\
- {uid: \"x/../Pod/..\", name: web, namespace: default, serviceAccount: web, protocol: HBONE}\n";
    let node = CniNode::start(workloads).expect("node");
    let web = node.add_pod("web").expect("ADD of a pod with that uid");
    let records = node.records();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].parent(), Some(node.dir.join("state/pods").as_path()), "{records:?}");
    node.del_pod(&web, &web.netns.path().display().to_string()).expect("DEL").expect("DEL ok");
    assert!(node.records().is_empty(), "the record was not removed");
}

#[test]
fn a_late_del_of_a_pods_old_sandbox_leaves_its_new_sandbox_in_the_mesh() {
    let node = CniNode::start(WORKLOADS).expect("node");
    let db = node.add_pod("db").expect("ADD db");
    node.echo_server(&db, 8080).expect("echo");
    publish_db_address(&node, &db);
    // The runtime recreates web's sandbox (the first one died); both carry web's uid.
    let old = node.add_pod_as("default", "web", "uid-web").expect("ADD web");
    let new = node.add_pod_as("default", "web", "uid-web").expect("ADD web's new sandbox");
    // Then the old sandbox's DEL, as a runtime's garbage collection sends it.
    let path = old.netns.path().display().to_string();
    assert_eq!(node.del_pod(&old, &path).expect("DEL").map_err(|r| r.stdout), Ok(()));
    let served = node.proxy_pods().expect("pods");
    assert!(
        served.contains(&"uid-web".to_owned()),
        "the old sandbox's DEL took web out: {served:?}"
    );
    let back = echo_once(&new, SocketAddr::new(db.ip, 8080), b"new").expect("connection");
    assert_eq!(back, b"new");
    let labels = [
        ("reporter", "source"),
        ("source_workload", "web"),
        ("connection_security_policy", "none"),
    ];
    let carried =
        node.proxy_metric("istio_tcp_connections_opened_total", &labels).expect("metrics");
    assert_eq!(carried, 1.0, "the new sandbox's connection left the mesh");
}

/// The eBPF filters on egress of `iface` in `pod`'s netns, as `tc filter show` lists them.
fn egress_filters(pod: &CniPod, iface: &str) -> String {
    meshpath_tests::egress_filters(&pod.netns, iface).expect("tc filter show")
}

/// Whether the datapath's guard (`raw_tcp_guard.rs`) is on `iface` of `pod` within 10 s.
fn guarded_soon(pod: &CniPod, iface: &str) -> bool {
    let guard = datapath_common::consts::programs::TC_POD_GUARD;
    meshpath_tests::wait_until(Duration::from_secs(10), || {
        egress_filters(pod, iface).contains(guard)
    })
}

#[test]
fn an_interface_a_meshed_pod_gets_after_joining_is_guarded() {
    // As Multus adds a secondary network's interface after the main network's chain (where
    // meshpath-cni runs), or as one is added by hand later.
    let node = CniNode::start(WORKLOADS).expect("node");
    let web = node.add_pod("web").expect("ADD web");
    assert!(guarded_soon(&web, "eth0"), "{}", egress_filters(&web, "eth0"));
    let other = meshpath_tests::NetnsGuard::new("mpn").expect("another netns");
    meshpath_tests::veth_between((&web.netns, "net1"), (&other, "eth0")).expect("net1");
    assert!(guarded_soon(&web, "net1"), "net1 unguarded: {}", egress_filters(&web, "net1"));
}

#[test]
fn an_interface_a_meshed_pod_got_while_no_agent_ran_is_guarded_when_it_is_back() {
    let mut node = CniNode::start(WORKLOADS).expect("node");
    let web = node.add_pod("web").expect("ADD web");
    let agent = node.agent.as_mut().expect("agent");
    agent.signal(libc::SIGKILL).expect("kill -9 the agent");
    assert!(agent.wait_exit(Duration::from_secs(10)), "the agent did not exit");
    let other = meshpath_tests::NetnsGuard::new("mpn").expect("another netns");
    meshpath_tests::veth_between((&web.netns, "net1"), (&other, "eth0")).expect("net1");
    node.start_agent().expect("the agent back");
    assert!(guarded_soon(&web, "net1"), "net1 unguarded: {}", egress_filters(&web, "net1"));
}

/// The node's end of `pod`'s eth0 (in the node's netns) and the node-side guard's filters on
/// it, as `tc filter show` lists them.
fn host_end_filters(node: &CniNode, pod: &CniPod) -> (String, String) {
    let node_ns = node.node.open().expect("node netns");
    let pod_ns = pod.netns.open().expect("pod netns");
    let ends = node_ns
        .run(|| meshpath_loader::pods::host_ends(&pod_ns))
        .expect("enter the node's netns")
        .expect("host ends");
    let [(end, _, _)] = ends.as_slice() else { panic!("not one end: {ends:?}") };
    let out = node_ns
        .run(|| {
            std::process::Command::new("tc")
                .args(["filter", "show", "dev", end, "ingress"])
                .output()
        })
        .expect("enter the node's netns")
        .expect("tc");
    (end.clone(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn the_node_end_of_a_meshed_pods_link_is_guarded_and_guarded_again_by_a_new_agent() {
    // The bridge plugin's veth: the agent (in the node's netns) finds its node end and guards
    // it. One a node lost (the previous release had none) a new agent puts back at start-up.
    let guard = datapath_common::consts::programs::TC_NODE_GUARD;
    let mut node = CniNode::start(WORKLOADS).expect("node");
    let web = node.add_pod("web").expect("ADD web");
    let (end, filters) = host_end_filters(&node, &web);
    assert!(filters.contains(guard), "{end} unguarded: {filters}");
    let agent = node.agent.as_mut().expect("agent");
    agent.signal(libc::SIGKILL).expect("kill -9 the agent");
    assert!(agent.wait_exit(Duration::from_secs(10)), "the agent did not exit");
    let out = node
        .node
        .open()
        .expect("node netns")
        .run(|| {
            std::process::Command::new("tc").args(["qdisc", "del", "dev", &end, "clsact"]).output()
        })
        .expect("enter netns")
        .expect("tc");
    assert!(out.status.success(), "tc qdisc del: {}", String::from_utf8_lossy(&out.stderr));
    node.start_agent().expect("the agent back");
    let back = meshpath_tests::wait_until(Duration::from_secs(10), || {
        host_end_filters(&node, &web).1.contains(guard)
    });
    assert!(back, "{end} unguarded after the agent's restart: {}", host_end_filters(&node, &web).1);
}
