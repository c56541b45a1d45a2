//! meshpath as users run it: its DaemonSets applied with kubectl to a real single-node cluster
//! (kubelet, containerd, the control plane; `cargo xtask cluster up`), pods made with kubectl,
//! kubelet's own probes, restarts and the uninstall Job. One test at a time: several restart
//! the DaemonSets every test relies on, and each first makes sure meshpath is installed.
//! tests/src/cluster.rs has the fixtures.

use std::{path::Path, time::Duration};

use meshpath_tests::cluster::*;

/// Bytes of a long transfer across a restart, and the seconds it is spread over.
const LONG_BYTES: &str = "20000000";
const LONG_SECONDS: &str = "25";

fn set_up() {
    require_cluster();
    install().expect("installing meshpath with kubectl");
}

/// A meshed namespace with a server and a client, their certificates issued and the proxy
/// told they are HBONE workloads.
struct MeshedPair {
    ns: TestNamespace,
    server: PodInfo,
    client: PodInfo,
}

fn meshed_pair() -> MeshedPair {
    let ns = TestNamespace::new("mesh", true).expect("namespace");
    for sa in ["server", "client"] {
        deploy_app(&ns.name, sa, 8080).expect("deployment");
    }
    let server = ready_pod(&ns.name, "server").expect("server");
    let client = ready_pod(&ns.name, "client").expect("client");
    publish_workloads(&[(&ns.name, "server", &server), (&ns.name, "client", &client)])
        .expect("workloads");
    MeshedPair { ns, server, client }
}

fn mtls_opened_to(workload: &str) -> f64 {
    let m = proxy_metrics().expect("proxy metrics");
    metric_sum(
        &m,
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", "destination"),
            ("destination_workload", workload),
            ("connection_security_policy", "mutual_tls"),
        ],
    )
}

fn send(pair: &MeshedPair, bytes: &str) -> anyhow::Result<String> {
    exec(
        &pair.ns.name,
        &pair.client.name,
        &["send", &format!("{}:9000", pair.server.ip), "--bytes", bytes],
    )
}

fn conflist() -> serde_json::Value {
    let text = std::fs::read_to_string(CONFLIST).expect("the node's conflist");
    serde_json::from_str(&text).expect("conflist JSON")
}

fn plugin_types(conf: &serde_json::Value) -> Vec<String> {
    conf["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["type"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn installed_with_kubectl_both_daemonsets_are_ready_and_the_plugin_ends_the_nodes_chain() {
    set_up();
    assert!(daemonset_ready(AGENT_DS).expect("agent"));
    assert!(daemonset_ready(PROXY_DS).expect("proxy"));
    assert_eq!(plugin_types(&conflist()), ["bridge", "meshpath-cni"]);
    let plugin = std::fs::metadata(Path::new(CNI_BIN).join("meshpath-cni")).expect("plugin");
    assert!(std::os::unix::fs::PermissionsExt::mode(&plugin.permissions()) & 0o111 != 0);
    assert!(Path::new(PIN_ROOT).join("maps").is_dir(), "the agent pinned no datapath");
}

#[test]
fn a_pod_in_an_ambient_namespace_is_captured_and_annotated_and_one_in_a_plain_namespace_is_not() {
    set_up();
    let mesh = TestNamespace::new("mesh", true).expect("namespace");
    let plain = TestNamespace::new("plain", false).expect("namespace");
    deploy_app(&mesh.name, "server", 8080).expect("meshed");
    deploy_app(&plain.name, "server", 8080).expect("plain");
    let meshed = ready_pod(&mesh.name, "server").expect("meshed pod");
    let unmeshed = ready_pod(&plain.name, "server").expect("plain pod");
    let annotated = wait_for("the redirection annotation", Duration::from_secs(30), || {
        let p = app_pod(&mesh.name, "server")?;
        Ok(p.filter(|p| p.annotations["ambient.istio.io/redirection"] == "enabled"))
    });
    assert!(annotated.is_ok(), "{annotated:?}");
    assert!(
        unmeshed.annotations.get("ambient.istio.io/redirection").is_none(),
        "the plain pod was annotated: {}",
        unmeshed.annotations
    );
    let list = enrolled_pods().expect("meshpath-loader list").to_string();
    assert!(list.contains(&format!("{}/{}", mesh.name, meshed.name)), "{list}");
    assert!(!list.contains(&plain.name), "{list}");
}

#[test]
fn meshed_pods_carry_traffic_to_each_other_over_hbone_with_mutual_tls() {
    set_up();
    let pair = meshed_pair();
    let before = mtls_opened_to("server");
    let out = send(&pair, "1000000").expect("a megabyte from client to server");
    assert!(out.contains("bytes=1000000"), "{out}");
    let after = wait_for("the destination's mutual_tls count", Duration::from_secs(10), || {
        let n = mtls_opened_to("server");
        Ok((n > before).then_some(n))
    });
    assert!(after.is_ok(), "no mutual TLS connection to the server was counted: {after:?}");
    // The server saw the client's own address: the proxy connected from it.
    let peer = exec(
        &pair.ns.name,
        &pair.client.name,
        &["get", &format!("{}:8080", pair.server.ip), "/peer"],
    )
    .expect("GET /peer");
    assert_eq!(peer.trim(), pair.client.ip.to_string());
}

#[test]
fn a_meshed_pod_reaches_an_unmeshed_one_in_plain_tcp_without_mutual_tls() {
    set_up();
    let pair = meshed_pair();
    let plain = TestNamespace::new("plain", false).expect("namespace");
    deploy_app(&plain.name, "legacy", 8080).expect("deployment");
    let legacy = ready_pod(&plain.name, "legacy").expect("legacy");
    // Carried by the proxy, as plain TCP: counted by the source's reporter, not mutual TLS
    // (with capture off the client would reach the pod directly and nothing be counted).
    let passthrough = || {
        metric_sum(
            &proxy_metrics().expect("metrics"),
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", "source"),
                ("source_workload_namespace", &pair.ns.name),
                ("connection_security_policy", "unknown"),
            ],
        )
    };
    let passed_before = passthrough();
    let before = metric_sum(
        &proxy_metrics().expect("metrics"),
        "istio_tcp_connections_opened_total",
        &[("connection_security_policy", "mutual_tls")],
    );
    let out = exec(
        &pair.ns.name,
        &pair.client.name,
        &["send", &format!("{}:9000", legacy.ip), "--bytes", "100000"],
    )
    .expect("client to the unmeshed pod");
    assert!(out.contains("bytes=100000"), "{out}");
    let after = metric_sum(
        &proxy_metrics().expect("metrics"),
        "istio_tcp_connections_opened_total",
        &[("connection_security_policy", "mutual_tls")],
    );
    assert_eq!(before, after, "a connection to an unmeshed pod was counted as mutual TLS");
    assert!(passthrough() > passed_before, "the proxy did not carry the connection");
    assert!(legacy.annotations.get("ambient.istio.io/redirection").is_none());
}

#[test]
fn kubelet_probes_reach_a_meshed_pod_and_a_closed_probe_port_leaves_it_unready() {
    set_up();
    let ns = TestNamespace::new("probe", true).expect("namespace");
    deploy_app(&ns.name, "open", 8080).expect("deployment");
    // Nothing listens on 8081.
    deploy_app(&ns.name, "closed", 8081).expect("deployment");
    let open = ready_pod(&ns.name, "open").expect("a meshed pod whose probes succeed is Ready");
    assert_eq!(open.annotations["ambient.istio.io/redirection"], "enabled", "not meshed");
    // The closed one gets an address and is probed; kubelet reports its probe failing.
    let closed = wait_for("the closed pod's address", Duration::from_secs(60), || {
        app_pod(&ns.name, "closed")
    })
    .expect("closed pod");
    let unhealthy = |pod: &str| -> usize {
        let selector = format!("involvedObject.name={pod},reason=Unhealthy");
        get_json(&["events", "-n", &ns.name, "--field-selector", &selector])
            .map(|e| e["items"].as_array().map_or(0, Vec::len))
            .unwrap_or(0)
    };
    let failed =
        wait_for("kubelet's failed probe of the closed pod", Duration::from_secs(60), || {
            Ok((unhealthy(&closed.name) > 0).then_some(()))
        });
    assert!(failed.is_ok(), "{failed:?}");
    let closed = app_pod(&ns.name, "closed").expect("pod").expect("pod");
    assert!(!closed.ready, "a pod whose probe port is closed went Ready");
    // The open pod: no probe of it ever failed, and it was never restarted.
    assert_eq!(unhealthy(&open.name), 0, "a probe of the meshed pod failed");
    assert_eq!(app_pod(&ns.name, "open").expect("pod").expect("pod").restarts, 0);
}

/// Starts a long paced transfer from the client, runs `disrupt`, and checks the transfer
/// arrives byte-exact and a new connection works after.
fn survives(disrupt: impl FnOnce()) {
    set_up();
    let pair = meshed_pair();
    let target = format!("{}:9000", pair.server.ip);
    let accepted = sink_count(pair.server.ip).expect("sink count");
    let long = exec_spawn(
        &pair.ns.name,
        &pair.client.name,
        &["send", &target, "--bytes", LONG_BYTES, "--seconds", LONG_SECONDS],
    )
    .expect("the long transfer");
    // Disrupted once it is under way: the server has accepted it.
    wait_for("the long transfer to start", Duration::from_secs(30), || {
        Ok((sink_count(pair.server.ip)? > accepted).then_some(()))
    })
    .expect("the transfer started");
    disrupt();
    let out = long.wait_with_output().expect("the long transfer's end");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the transfer across the restart failed: {text}");
    assert!(text.contains(&format!("bytes={LONG_BYTES}")), "{text}");
    let after = send(&pair, "100000").expect("a new connection after the restart");
    assert!(after.contains("bytes=100000"), "{after}");
}

#[test]
fn a_rolling_update_of_the_agent_keeps_a_long_transfer_byte_exact_and_new_connections_working() {
    survives(|| {
        let old = daemonset_pod(AGENT_DS).expect("agent pod");
        kubectl(&[
            "set",
            "image",
            "-n",
            SYSTEM_NS,
            &format!("daemonset/{AGENT_DS}"),
            &format!("agent={MESHPATH_NEXT}"),
            &format!("mount-bpffs={MESHPATH_NEXT}"),
        ])
        .expect("kubectl set image");
        wait_for("the updated agent", Duration::from_secs(120), || {
            Ok((daemonset_ready(AGENT_DS)? && daemonset_pod(AGENT_DS)? != old).then_some(()))
        })
        .expect("rollout");
        let image = get_json(&["daemonset", "-n", SYSTEM_NS, AGENT_DS]).expect("ds");
        assert_eq!(image["spec"]["template"]["spec"]["containers"][0]["image"], MESHPATH_NEXT);
    });
}

#[test]
fn deleting_the_agent_pod_keeps_a_long_transfer_byte_exact_and_new_connections_working() {
    survives(|| {
        let old = daemonset_pod(AGENT_DS).expect("agent pod");
        kubectl(&["delete", "pod", "-n", SYSTEM_NS, &old, "--wait=false"]).expect("delete");
        wait_for("a new agent", Duration::from_secs(120), || {
            Ok((daemonset_ready(AGENT_DS)? && daemonset_pod(AGENT_DS)? != old).then_some(()))
        })
        .expect("a new agent pod");
    });
}

/// Takes the proxy DaemonSet's pod off the node (a node selector nothing matches) and brings it
/// back.
fn proxy_away(away: bool) {
    let patch = if away {
        r#"{"spec":{"template":{"spec":{"nodeSelector":{"meshpath.io/test-no-node":"true"}}}}}"#
    } else {
        r#"[{"op":"remove","path":"/spec/template/spec/nodeSelector/meshpath.io~1test-no-node"}]"#
    };
    let kind = if away { "merge" } else { "json" };
    kubectl(&["patch", "daemonset", "-n", SYSTEM_NS, PROXY_DS, "--type", kind, "-p", patch])
        .expect("patch");
}

#[test]
fn while_the_proxy_is_away_meshed_traffic_waits_unseen_and_once_it_is_back_it_flows() {
    set_up();
    let pair = meshed_pair();
    proxy_away(true);
    let gone = wait_for("the proxy pod gone", Duration::from_secs(90), || {
        Ok(daemonset_pod(PROXY_DS).is_err().then_some(()))
    });
    gone.expect("the proxy left the node");
    // A transfer started with no proxy on the node: the agent holds the pods' listeners, so it
    // waits in their backlog (refused only past --hold-listeners-seconds), and the server's
    // sink, which accepts whoever reaches it, sees nothing meanwhile.
    let before = sink_count(pair.server.ip).expect("sink count");
    let target = format!("{}:9000", pair.server.ip);
    let mut waiting =
        exec_spawn(&pair.ns.name, &pair.client.name, &["send", &target, "--bytes", "1000"])
            .expect("a transfer with no proxy");
    std::thread::sleep(Duration::from_secs(5));
    let after = sink_count(pair.server.ip).expect("sink count");
    let early = waiting.try_wait().expect("the transfer's state");
    proxy_away(false);
    assert_eq!(before, after, "the server's sink accepted a connection while the proxy was away");
    assert!(early.is_none(), "the transfer ended with no proxy on the node: {early:?}");
    // The proxy back: it takes the held listeners and serves what waited.
    let out = waiting.wait_with_output().expect("the waiting transfer's end");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("bytes=1000"), "not served: {text}");
    wait_for("the proxy back", Duration::from_secs(120), || {
        Ok(daemonset_ready(PROXY_DS)?.then_some(()))
    })
    .expect("proxy back");
    assert!(send(&pair, "1000").is_ok_and(|o| o.contains("bytes=1000")), "traffic did not resume");
}

/// Seconds the connect loop runs: long enough for the three proxy restarts below (each about
/// 10-20 s here), which must all be done before it ends.
const LOOP_SECONDS: u64 = 100;

/// Copies of the proxy pods' container logs (the kubelet's files under /var/log/pods, read on
/// this node every 200 ms, kept after a pod is gone) until `stop`, for a failure's message.
fn proxy_logs(stop: &std::sync::atomic::AtomicBool) -> std::collections::BTreeMap<String, String> {
    let mut seen = std::collections::BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let pods = std::fs::read_dir("/var/log/pods").into_iter().flatten().flatten();
        for pod in pods.filter(|p| p.file_name().to_string_lossy().contains("meshpath-proxy")) {
            let files = std::fs::read_dir(pod.path().join("proxy")).into_iter().flatten().flatten();
            for f in files {
                if let Ok(text) = std::fs::read_to_string(f.path()) {
                    seen.insert(f.path().display().to_string(), text);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    seen
}

/// The host pid of the proxy DaemonSet's process (the cluster's node is this machine).
fn proxy_pid() -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let ours = args.first() == Some(&&b"/usr/local/bin/meshpath-proxy"[..])
            && args.contains(&&b"/var/run/ztunnel/ztunnel.sock"[..]);
        ours.then_some(pid)
    })
}

fn proxy_restarts() -> u64 {
    let pod = daemonset_pod(PROXY_DS).expect("proxy pod");
    get_json(&["pod", "-n", SYSTEM_NS, &pod]).expect("pod")["status"]["containerStatuses"][0]
        ["restartCount"]
        .as_u64()
        .unwrap_or(0)
}

/// The proxy's process killed with SIGKILL; returns once the kubelet restarted it, Ready.
fn kill_9_the_proxy() {
    let before = proxy_restarts();
    let pid = proxy_pid().expect("the proxy's process");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
        .expect("kill -9");
    wait_for("the proxy restarted", Duration::from_secs(60), || {
        Ok((proxy_restarts() > before && daemonset_ready(PROXY_DS)?).then_some(()))
    })
    .expect("restarted");
}

/// `kubectl delete pod` of the proxy's pod; returns once its replacement is Ready.
fn delete_the_proxy_pod() {
    let old = daemonset_pod(PROXY_DS).expect("proxy pod");
    kubectl(&["delete", "pod", "-n", SYSTEM_NS, &old, "--wait=false"]).expect("delete");
    wait_for("a new proxy", Duration::from_secs(120), || {
        Ok((daemonset_ready(PROXY_DS)? && daemonset_pod(PROXY_DS)? != old).then_some(()))
    })
    .expect("a new proxy pod");
}

/// A rolling update of the proxy DaemonSet to another image (`set_up` puts the first back).
fn roll_the_proxy_to_a_new_image() {
    let old = daemonset_pod(PROXY_DS).expect("proxy pod");
    let image = format!("proxy={MESHPATH_NEXT}");
    kubectl(&["set", "image", "-n", SYSTEM_NS, &format!("daemonset/{PROXY_DS}"), &image])
        .expect("kubectl set image");
    wait_for("the updated proxy", Duration::from_secs(120), || {
        Ok((daemonset_ready(PROXY_DS)? && daemonset_pod(PROXY_DS)? != old).then_some(()))
    })
    .expect("rollout");
    let ds = get_json(&["daemonset", "-n", SYSTEM_NS, PROXY_DS]).expect("ds");
    assert_eq!(ds["spec"]["template"]["spec"]["containers"][0]["image"], MESHPATH_NEXT);
}

#[test]
fn a_connect_loop_across_kill_9_delete_and_a_rolling_update_of_the_proxy_is_always_answered() {
    set_up();
    let pair = meshed_pair();
    let target = format!("{}:9000", pair.server.ip);
    // A new connection to the server's sink every 20 ms, each on its own thread (cluster-app
    // `loop`), across the three ways a proxy goes away: every one answered, none refused or
    // reset (the agent holds the pods' listeners while no proxy runs), but those the killed
    // proxy was carrying at the instant of `kill -9` (a crash hands nothing over).
    let started = std::time::Instant::now();
    let loop_seconds = LOOP_SECONDS.to_string();
    let client = exec_spawn(
        &pair.ns.name,
        &pair.client.name,
        &["loop", &target, "--seconds", &loop_seconds],
    )
    .expect("the connect loop");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (done, events_took, out, logs, killed_at) = std::thread::scope(|s| {
        let logs = s.spawn(|| proxy_logs(&stop));
        std::thread::sleep(Duration::from_secs(5));
        let mut done = Vec::new();
        let mut killed_at = Duration::ZERO;
        for (what, event) in [
            ("kill -9", kill_9_the_proxy as fn()),
            ("kubectl delete pod", delete_the_proxy_pod),
            ("rolling update to a new image", roll_the_proxy_to_a_new_image),
        ] {
            let at = started.elapsed();
            if what == "kill -9" {
                killed_at = at;
            }
            event();
            let ready = started.elapsed() - at;
            done.push(format!(
                "{what} at {:.1} s, ready after {:.1} s",
                at.as_secs_f64(),
                ready.as_secs_f64()
            ));
        }
        let events_took = started.elapsed();
        let out = client.wait_with_output().expect("the connect loop's end");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (done, events_took, out, logs.join().unwrap_or_default(), killed_at)
    });
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{}; {}", done.join("; "), text.trim());
    let mut proxies = String::new();
    for (file, log) in logs {
        let notable: Vec<&str> =
            log.lines().filter(|l| !l.contains("connection complete")).take(150).collect();
        proxies.push_str(&format!("\n--- {file}:\n{}", notable.join("\n")));
    }
    // The loop's clock started when `kubectl exec` ran it, up to a second after `started`: a
    // connection the killed proxy carried was opened at most a second or so before the kill.
    let failed_at: Vec<u64> = text
        .lines()
        .find_map(|l| l.strip_prefix("failed_at_ms="))
        .unwrap_or_default()
        .split(',')
        .filter_map(|t| t.parse().ok())
        .collect();
    let kill_ms = killed_at.as_millis() as u64;
    let in_flight_at_kill = |t: &u64| *t + 2000 >= kill_ms && *t <= kill_ms + 200;
    let unexplained: Vec<&u64> = failed_at.iter().filter(|t| !in_flight_at_kill(t)).collect();
    assert!(
        unexplained.is_empty() && failed_at.len() <= 5 && text.contains("opened="),
        "connections failed that no crash explains (kill -9 at {kill_ms} ms): {unexplained:?}; {}; {text}{proxies}",
        done.join("; ")
    );
    assert!(
        events_took < Duration::from_secs(LOOP_SECONDS),
        "the restarts took {events_took:?}, past the {LOOP_SECONDS} s loop: not all were under it"
    );
}

#[test]
fn a_deleted_meshed_pod_leaves_the_datapath() {
    set_up();
    let ns = TestNamespace::new("del", true).expect("namespace");
    deploy_app(&ns.name, "server", 8080).expect("deployment");
    let pod = ready_pod(&ns.name, "server").expect("pod");
    let name = format!("{}/{}", ns.name, pod.name);
    wait_for("the pod enrolled", Duration::from_secs(30), || {
        Ok(enrolled_pods()?.to_string().contains(&name).then_some(()))
    })
    .expect("enrolled");
    kubectl(&["delete", "deployment", "-n", &ns.name, "server"]).expect("delete");
    let gone = wait_for("the pod out of the datapath", Duration::from_secs(60), || {
        Ok((!enrolled_pods()?.to_string().contains(&name)).then_some(()))
    });
    assert!(gone.is_ok(), "{gone:?}");
}

#[test]
fn a_pod_created_while_the_agent_is_down_is_captured_once_it_is_back() {
    set_up();
    let agent_away = |away: bool| {
        let patch = if away {
            r#"{"spec":{"template":{"spec":{"nodeSelector":{"meshpath.io/test-no-node":"true"}}}}}"#
        } else {
            r#"[{"op":"remove","path":"/spec/template/spec/nodeSelector/meshpath.io~1test-no-node"}]"#
        };
        let kind = if away { "merge" } else { "json" };
        kubectl(&["patch", "daemonset", "-n", SYSTEM_NS, AGENT_DS, "--type", kind, "-p", patch])
            .expect("patch");
    };
    agent_away(true);
    let gone = wait_for("the agent pod gone", Duration::from_secs(90), || {
        Ok(daemonset_pod(AGENT_DS).is_err().then_some(()))
    });
    let ns = TestNamespace::new("late", true).expect("namespace");
    deploy_app(&ns.name, "server", 8080).expect("deployment");
    // With no agent, the chained plugin refuses the pod's sandbox (kubelet says so in an
    // Event, and retries): it does not start uncaptured.
    let refused = wait_for("kubelet's failed sandbox", Duration::from_secs(60), || {
        let ev = get_json(&[
            "events",
            "-n",
            &ns.name,
            "--field-selector",
            "reason=FailedCreatePodSandBox",
        ])?;
        Ok(ev["items"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["message"].as_str().is_some_and(|m| m.contains("meshpath-cni")))
            .then_some(()))
    });
    let early = app_pod(&ns.name, "server").expect("pods");
    agent_away(false);
    gone.expect("the agent left the node");
    assert!(refused.is_ok(), "no sandbox refusal by meshpath-cni: {refused:?}");
    assert!(early.is_none(), "a meshed pod got an address while no agent ran: {early:?}");
    let pod = ready_pod(&ns.name, "server").expect("the pod starts once the agent is back");
    let annotated = wait_for("the annotation", Duration::from_secs(30), || {
        Ok(app_pod(&ns.name, "server")?
            .filter(|p| p.annotations["ambient.istio.io/redirection"] == "enabled"))
    });
    assert!(annotated.is_ok(), "{annotated:?}");
    let list = enrolled_pods().expect("list").to_string();
    assert!(list.contains(&format!("{}/{}", ns.name, pod.name)), "{list}");
}

#[test]
fn the_uninstall_job_leaves_the_node_as_it_was() {
    set_up();
    assert_eq!(
        plugin_types(&conflist()),
        ["bridge", "meshpath-cni"],
        "not installed to begin with"
    );
    uninstall().expect("uninstall as docs/deploy.md says");
    assert!(!Path::new(PIN_ROOT).exists(), "{PIN_ROOT} is still there");
    assert_eq!(plugin_types(&conflist()), ["bridge"], "the conflist still chains meshpath-cni");
    assert!(!Path::new(CNI_BIN).join("meshpath-cni").exists());
    // No meshpath program left at the cgroup v2 root, where the agent attaches its node-wide
    // ones (their names start with `mp_`, datapath-common's program names).
    let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .find(|p| Path::new(p).join("cgroup.procs").exists())
        .expect("a cgroup v2 root");
    let out = std::process::Command::new("bpftool")
        .args(["-j", "cgroup", "show", root])
        .output()
        .expect("bpftool");
    // A bpftool that failed lists nothing: that must not pass for an empty list.
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
    let attached = String::from_utf8_lossy(&out.stdout);
    // With nothing attached bpftool prints nothing at all; anything else is its JSON list.
    if !attached.trim().is_empty() {
        let listed: serde_json::Value = serde_json::from_str(&attached).expect("bpftool's JSON");
        assert!(listed.is_array(), "bpftool listed no array: {attached}");
    }
    assert!(
        !attached.contains("\"name\":\"mp_"),
        "meshpath programs still attached at {root}: {attached}"
    );
}

#[test]
fn an_agent_on_a_node_without_cgroup_v2_stays_unready_saying_why_on_its_probe_and_in_an_event() {
    set_up();
    uninstall().expect("a node without meshpath");
    // The agent told that the host's cgroup v2 hierarchy is a cgroup v1 one: what it meets on a
    // node whose kernel has no cgroup v2 mounted.
    let mut objects = rendered_install().expect("the rendered manifests");
    for o in &mut objects {
        if o["kind"] == "DaemonSet" && o["metadata"]["name"] == AGENT_DS {
            let env = o["spec"]["template"]["spec"]["containers"][0]["env"]
                .as_array_mut()
                .expect("the agent's env");
            for e in env.iter_mut() {
                if e["name"] == "MESHPATH_CGROUP_ROOT" {
                    e["value"] = "/host/sys/fs/cgroup/memory".into();
                }
            }
        }
    }
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
    kubectl_in(&["apply", "-f", "-"], &list.to_string()).expect("apply");
    let why = wait_for("the agent's answer", Duration::from_secs(120), || {
        let (code, body) = agent_readyz()?;
        Ok((code == 503 && body.contains("cgroup")).then_some(body))
    });
    let events = wait_for("the Event on the Node", Duration::from_secs(30), || {
        let ev = get_json(&[
            "events",
            "-n",
            "default",
            "--field-selector",
            "reason=DatapathUnavailable",
        ])?;
        let on_node = ev["items"].as_array().into_iter().flatten().any(|e| {
            e["involvedObject"]["kind"] == "Node"
                && e["involvedObject"]["name"] == NODE_NAME
                && e["message"].as_str().is_some_and(|m| m.contains("cgroup"))
        });
        Ok(on_node.then_some(()))
    });
    let ready_while_broken = daemonset_ready(AGENT_DS).expect("ds");
    // Back to the shipped manifests: the same agent becomes ready.
    install().expect("install");
    let (code, _) = agent_readyz().expect("readyz");
    assert!(why.is_ok(), "no reason on /readyz: {why:?}");
    assert!(events.is_ok(), "{events:?}");
    assert!(!ready_while_broken, "the agent was Ready with no datapath");
    assert_eq!(code, 200);
}

#[test]
fn pods_created_while_the_api_server_restarts_are_all_captured() {
    set_up();
    let ns = TestNamespace::new("restart", true).expect("namespace");
    let apps = ["a1", "a2", "a3", "a4"];
    deploy_app(&ns.name, apps[0], 8080).expect("deployment");
    deploy_app(&ns.name, apps[1], 8080).expect("deployment");
    restart_apiserver().expect("API server restart");
    deploy_app(&ns.name, apps[2], 8080).expect("deployment");
    restart_apiserver().expect("API server restart");
    deploy_app(&ns.name, apps[3], 8080).expect("deployment");
    for app in apps {
        let pod = ready_pod(&ns.name, app).expect("a Ready pod");
        let annotated = wait_for("the annotation", Duration::from_secs(30), || {
            Ok(app_pod(&ns.name, app)?
                .filter(|p| p.annotations["ambient.istio.io/redirection"] == "enabled"))
        });
        assert!(annotated.is_ok(), "{app}: {annotated:?}");
        let name = format!("{}/{}", ns.name, pod.name);
        assert!(enrolled_pods().expect("list").to_string().contains(&name), "{name} not enrolled");
    }
}

/// A token of `sa` in meshpath's namespace, as the kubelet would mount it.
fn token_of(sa: &str) -> String {
    kubectl(&["create", "token", sa, "-n", SYSTEM_NS]).expect("a token").trim().to_owned()
}

/// kubectl with `token` instead of the administrator's credentials.
fn as_token(token: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut a = vec!["--token", token];
    a.extend_from_slice(args);
    kubectl(&a)
}

#[test]
fn the_agents_token_annotates_pods_and_can_change_nothing_else() {
    set_up();
    let ns = TestNamespace::new("rbac", true).expect("namespace");
    deploy_app(&ns.name, "server", 8080).expect("deployment");
    // The agent annotated the pod with its own token (through pods/status).
    let annotated = wait_for("the annotation", Duration::from_secs(120), || {
        Ok(app_pod(&ns.name, "server")?
            .filter(|p| p.annotations["ambient.istio.io/redirection"] == "enabled"))
    })
    .expect("annotated by the agent");
    let token = token_of(AGENT_DS);
    let pod = annotated.name.clone();
    // The same token, at what it must not do (each tried first with the administrator's
    // credentials, which may: the refusal is the role's, not a broken request).
    let label = r#"{"metadata":{"labels":{"pwned":"yes"}}}"#;
    kubectl(&["patch", "pod", "-n", &ns.name, &pod, "--dry-run=server", "-p", label])
        .expect("the administrator may");
    let err = as_token(&token, &["patch", "pod", "-n", &ns.name, &pod, "-p", label])
        .expect_err("the agent's token patched a pod's labels");
    assert!(err.to_string().contains("forbidden"), "{err}");
    let image = r#"{"spec":{"containers":[{"name":"app","image":"evil:1"}]}}"#;
    let err = as_token(&token, &["patch", "pod", "-n", &ns.name, &pod, "-p", image])
        .expect_err("the agent's token changed a pod's image");
    assert!(err.to_string().contains("forbidden"), "{err}");
    let err =
        as_token(&token, &["get", "secrets", "-A"]).expect_err("the agent's token listed Secrets");
    assert!(err.to_string().contains("forbidden"), "{err}");
    // What it needs, it has.
    let can = as_token(
        &token,
        &["auth", "can-i", "patch", "pods", "--subresource=status", "-n", &ns.name],
    )
    .expect("can-i");
    assert_eq!(can.trim(), "yes");
}

#[test]
fn the_proxys_token_grants_nothing_in_the_kubernetes_api() {
    set_up();
    let token = token_of(PROXY_DS);
    for args in [
        vec!["get", "pods", "-A"],
        vec!["get", "secrets", "-n", SYSTEM_NS],
        vec!["get", "configmaps", "-n", SYSTEM_NS],
    ] {
        let err = as_token(&token, &args).expect_err("the proxy's token read something");
        assert!(err.to_string().contains("forbidden"), "{args:?}: {err}");
    }
}

/// Releases what the istiod stand-in withholds, also when the test fails.
struct Withheld(&'static str);

impl Drop for Withheld {
    fn drop(&mut self) {
        istiod().withhold(self.0, false);
    }
}

#[test]
fn a_proxy_whose_first_push_never_completes_stays_unready_and_is_never_restarted() {
    set_up();
    // istiod never sends its policies: the proxy cannot turn ready (it would serve a DENY it
    // has not seen), and that is no reason to kill it.
    let _withheld = Withheld(meshpath_xds::AUTHORIZATION_TYPE);
    istiod().withhold(meshpath_xds::AUTHORIZATION_TYPE, true);
    let old = daemonset_pod(PROXY_DS).expect("proxy pod");
    kubectl(&["delete", "pod", "-n", SYSTEM_NS, &old, "--wait=false"]).expect("delete");
    let pod = wait_for("a new proxy pod running", Duration::from_secs(120), || {
        let pod = daemonset_pod(PROXY_DS)?;
        let p = get_json(&["pod", "-n", SYSTEM_NS, &pod])?;
        Ok((pod != old && p["status"]["phase"] == "Running").then_some(pod))
    })
    .expect("a new proxy pod");
    // Past the liveness probe's initial delay (10 s) and four of its periods (10 s).
    std::thread::sleep(Duration::from_secs(50));
    let selector = format!("involvedObject.name={pod},reason=Unhealthy");
    let events = get_json(&["events", "-n", SYSTEM_NS, "--field-selector", &selector])
        .expect("events")
        .to_string();
    let status = get_json(&["pod", "-n", SYSTEM_NS, &pod]).expect("pod")["status"].clone();
    assert!(events.contains("Readiness probe failed"), "never probed unready: {events}");
    assert!(!events.contains("Liveness probe failed"), "liveness failed: {events}");
    assert_eq!(status["containerStatuses"][0]["restartCount"], 0, "restarted: {status}");
    assert_eq!(status["containerStatuses"][0]["ready"], false, "ready without policies");
    istiod().withhold(meshpath_xds::AUTHORIZATION_TYPE, false);
    wait_for("the proxy ready once the push completes", Duration::from_secs(60), || {
        Ok(daemonset_ready(PROXY_DS)?.then_some(()))
    })
    .expect("ready");
}
