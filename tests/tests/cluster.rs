//! meshpath as users run it: its DaemonSets applied with kubectl to a real two-node cluster
//! (kubelet, containerd, the control plane; `cargo xtask cluster up`), pods made with kubectl,
//! kubelet's own probes, restarts and the uninstall Job. One test at a time: several restart
//! the DaemonSets every test relies on, and each first makes sure meshpath is installed.
//! tests/src/cluster.rs has the fixtures.

use std::{path::Path, time::Duration};

use meshpath_tests::{cluster::*, istiod::Istiod};

#[path = "cluster/between_nodes.rs"]
mod between_nodes;

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

/// Connections to `workload` its proxy counted as the destination, with `security` (the
/// cluster has one node: two meshed pods' connections are node-local, `none`).
fn opened_to(workload: &str, security: &str) -> f64 {
    let m = proxy_metrics().expect("proxy metrics");
    metric_sum(
        &m,
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", "destination"),
            ("destination_workload", workload),
            ("connection_security_policy", security),
        ],
    )
}

/// Connections to `workload` carried through the proxy, over HBONE with mutual TLS (as the
/// previous release carries two pods of one node) or on the node-local path (as this one does).
fn carried_to(workload: &str) -> f64 {
    opened_to(workload, "mutual_tls") + opened_to(workload, "none")
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
fn meshed_pods_of_the_node_carry_traffic_to_each_other_on_the_node_local_path() {
    set_up();
    let pair = meshed_pair();
    let before = opened_to("server", "none");
    let out = send(&pair, "1000000").expect("a megabyte from client to server");
    assert!(out.contains("bytes=1000000"), "{out}");
    let after = wait_for("the destination's node-local count", Duration::from_secs(10), || {
        let n = opened_to("server", "none");
        Ok((n > before).then_some(n))
    });
    assert!(after.is_ok(), "no node-local connection to the server was counted: {after:?}");
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

/// A long paced transfer from the client to the server's sink, once the server has accepted
/// it (a disruption after this is one it is under way across).
fn long_transfer_under_way(pair: &MeshedPair) -> std::process::Child {
    transfer_under_way(pair, LONG_BYTES, LONG_SECONDS)
}

/// A paced transfer of `bytes` over `seconds` from the client to the server's sink, once the
/// server has accepted it.
fn transfer_under_way(pair: &MeshedPair, bytes: &str, seconds: &str) -> std::process::Child {
    let target = format!("{}:9000", pair.server.ip);
    let accepted = sink_count(pair.server.ip).expect("sink count");
    let long = exec_spawn(
        &pair.ns.name,
        &pair.client.name,
        &["send", &target, "--bytes", bytes, "--seconds", seconds],
    )
    .expect("the long transfer");
    wait_for("the long transfer to start", Duration::from_secs(30), || {
        Ok((sink_count(pair.server.ip)? > accepted).then_some(()))
    })
    .expect("the transfer started");
    long
}

/// Starts a long paced transfer from the client, runs `disrupt`, and checks the transfer
/// arrives byte-exact and a new connection works after.
fn survives(disrupt: impl FnOnce()) {
    set_up();
    let pair = meshed_pair();
    let long = long_transfer_under_way(&pair);
    disrupt();
    let out = long.wait_with_output().expect("the long transfer's end");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the transfer across the restart failed: {text}");
    assert!(text.contains(&format!("bytes={LONG_BYTES}")), "{text}");
    let after = send(&pair, "100000").expect("a new connection after the restart");
    assert!(after.contains("bytes=100000"), "{after}");
}

/// The time of day, in seconds, of a log line that starts with an RFC 3339 timestamp
/// (`2026-12-05T21:30:00.123456Z ...`, tracing's format).
fn seconds_of_day(line: &str) -> Option<f64> {
    let time = line.split_whitespace().next()?.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.splitn(3, ':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// A node running the previous release (its git tag, installed with its own manifests and
/// image) whose agent DaemonSet is rolled to this version's image: the new agent takes over the
/// datapath the old one pinned, in place (loader/src/datapath/upgrade.rs), while a meshed pod
/// carries a long paced transfer and opens a connection every 20 ms to another. The transfer
/// arrives byte-exact, every connection is answered (none refused, none reset), each one
/// through the proxy (nothing around the mesh), and the pins then say which
/// datapath they hold. (This is also the agent's rolling update the other tests rely on.)
#[test]
fn the_previous_releases_agent_rolled_to_this_version_upgrades_the_datapath_under_traffic() {
    set_up();
    uninstall().expect("taking this version off the node");
    install_previous_release().expect("the previous release, as its users installed it");
    let version_pin = Path::new(PIN_ROOT).join("maps/DATAPATH_VERSION");
    assert!(!version_pin.exists(), "the previous release records no datapath version");

    let pair = meshed_pair();
    let target = format!("{}:9000", pair.server.ip);
    let carried_before = carried_to("server");
    let long = long_transfer_under_way(&pair);
    let looping = ConnectLoop::start(&pair.ns.name, &pair.client.name, &target, 300)
        .expect("the connect loop");

    let old = daemonset_pod(AGENT_DS).expect("agent pod");
    let rolled = std::time::Instant::now();
    kubectl(&[
        "set",
        "image",
        "-n",
        SYSTEM_NS,
        &format!("daemonset/{AGENT_DS}"),
        &format!("agent={MESHPATH_IMAGE}"),
        &format!("mount-bpffs={MESHPATH_IMAGE}"),
    ])
    .expect("kubectl set image");
    wait_for("this version's agent", Duration::from_secs(120), || {
        Ok((daemonset_ready(AGENT_DS)? && daemonset_pod(AGENT_DS)? != old).then_some(()))
    })
    .expect("rollout");
    let ready_after = rolled.elapsed();
    let agent = daemonset_pod(AGENT_DS).expect("the new agent");
    let log = kubectl(&["logs", "-n", SYSTEM_NS, &agent, "-c", "agent"]).expect("agent log");
    let upgraded = log.lines().find(|l| l.contains("datapath upgraded in place"));
    // From the agent's first line to the upgrade's: its start to the datapath upgraded.
    let first = log.lines().find(|l| l.starts_with(|c: char| c.is_ascii_digit()));
    let start_to_upgraded = first.zip(upgraded).and_then(|(a, b)| {
        let (a, b) = (seconds_of_day(a)?, seconds_of_day(b)?);
        Some(Duration::from_secs_f64((b - a).rem_euclid(86_400.0)))
    });
    println!(
        "agent rolled to this version, Ready after {ready_after:?}; from its first log line to \
         the datapath upgraded: {start_to_upgraded:?}; {upgraded:?}"
    );
    assert!(upgraded.is_some(), "the new agent did not upgrade the datapath:\n{log}");

    // On until the long transfer has ended, and 3 s after the new agent is Ready at least.
    std::thread::sleep(Duration::from_secs(3));
    let long = long.wait_with_output().expect("the long transfer's end");
    let looped = looping.end().expect("the connect loop's end");
    println!("connect loop across the upgrade: {looped}");
    let n = |k: &str| looped.count(k);
    assert!(
        looped.all_answered() && n("refused") == 0 && n("reset") == 0,
        "connections failed across the upgrade: {looped}"
    );
    let long_text = format!(
        "{}{}",
        String::from_utf8_lossy(&long.stdout),
        String::from_utf8_lossy(&long.stderr)
    );
    assert!(
        long.status.success() && long_text.contains(&format!("bytes={LONG_BYTES}")),
        "the long transfer across the upgrade: {long_text}"
    );
    // Every one of them went through the proxies: the server side's proxy counted each as
    // carried through it (one that got around the mesh would be answered all the same).
    let through_mesh = carried_to("server") - carried_before;
    assert!(
        through_mesh >= n("answered") as f64 + 1.0,
        "{through_mesh} connections through the mesh for {} answered and the transfer",
        n("answered")
    );
    assert!(version_pin.exists(), "the pins do not say which datapath they hold");
    // This version's proxy too, as the other tests expect.
    install().expect("this version's manifests");
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

/// The connect loop runs issue 47's 60 s, and on until the three proxy restarts below are done
/// and [`LOOP_AFTER_SECONDS`] more: each takes 3 to 17 s here, but a deleted pod's replacement
/// has taken 70 s (CI on a8e46a4: 90.5 s in all). [`LOOP_MAX_SECONDS`] at most.
const LOOP_SECONDS: u64 = 60;
const LOOP_AFTER_SECONDS: u64 = 5;
const LOOP_MAX_SECONDS: u64 = 180;

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

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

/// The host pid of the proxy DaemonSet's process on the first node (the cluster's nodes are
/// this machine).
fn proxy_pid() -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let ours = args.first() == Some(&&b"/usr/local/bin/meshpath-proxy"[..])
            && args.contains(&&b"/var/run/ztunnel/ztunnel.sock"[..]);
        (ours && Node::First.runs(pid)).then_some(pid)
    })
}

fn proxy_restarts() -> u64 {
    let pod = daemonset_pod(PROXY_DS).expect("proxy pod");
    get_json(&["pod", "-n", SYSTEM_NS, &pod]).expect("pod")["status"]["containerStatuses"][0]
        ["restartCount"]
        .as_u64()
        .unwrap_or(0)
}

/// The proxy's process killed with SIGKILL; returns once the kubelet restarted it, Ready, with
/// the instant of the kill.
fn kill_9_the_proxy() -> std::time::Instant {
    let before = proxy_restarts();
    let pid = proxy_pid().expect("the proxy's process");
    let at = std::time::Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
        .expect("kill -9");
    wait_for("the proxy restarted", Duration::from_secs(60), || {
        Ok((proxy_restarts() > before && daemonset_ready(PROXY_DS)?).then_some(()))
    })
    .expect("restarted");
    at
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

/// A rolling update of the proxy DaemonSet; returns once its new pods are Ready.
fn roll_the_proxy() {
    let old = daemonset_pod(PROXY_DS).expect("proxy pod");
    rolling_update(PROXY_DS).expect("kubectl rollout restart");
    wait_for("the updated proxy", Duration::from_secs(120), || {
        Ok((daemonset_ready(PROXY_DS)? && daemonset_pod(PROXY_DS)? != old).then_some(()))
    })
    .expect("rollout");
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
    let looping = ConnectLoop::start(&pair.ns.name, &pair.client.name, &target, LOOP_MAX_SECONDS)
        .expect("the connect loop");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (done, events_took, looped, logs, killed_at) = std::thread::scope(|s| {
        let logs = s.spawn(|| proxy_logs(&stop));
        // The log copier stops however this ends: a panic below would otherwise leave the
        // scope waiting for it for ever.
        let _stop_logs = StopOnDrop(&stop);
        std::thread::sleep(Duration::from_secs(2));
        let mut done = Vec::new();
        let mut killed_at = Duration::ZERO;
        // The kill's own instant: finding the process first asks the API server (hundreds of
        // milliseconds on a busy node), and a connection opened meanwhile is in flight at it.
        let kill = || killed_at = kill_9_the_proxy() - started;
        for (what, event) in [
            ("kill -9", Box::new(kill) as Box<dyn FnOnce() + '_>),
            ("kubectl delete pod", Box::new(delete_the_proxy_pod)),
            ("rolling update", Box::new(roll_the_proxy)),
        ] {
            let at = started.elapsed();
            event();
            let ready = started.elapsed() - at;
            done.push(format!(
                "{what} at {:.1} s, ready after {:.1} s",
                at.as_secs_f64(),
                ready.as_secs_f64()
            ));
        }
        let events_took = started.elapsed();
        let end = Duration::from_secs(LOOP_SECONDS)
            .max(events_took + Duration::from_secs(LOOP_AFTER_SECONDS));
        std::thread::sleep(end.saturating_sub(started.elapsed()));
        let looped = looping.end().expect("the connect loop's end");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (done, events_took, looped, logs.join().unwrap_or_default(), killed_at)
    });
    println!("{}; {looped}", done.join("; "));
    let mut proxies = String::new();
    for (file, log) in logs {
        let notable: Vec<&str> =
            log.lines().filter(|l| !l.contains("connection complete")).take(150).collect();
        proxies.push_str(&format!("\n--- {file}:\n{}", notable.join("\n")));
    }
    // The loop's clock started when `kubectl exec` ran it, up to a second after `started`: a
    // connection the killed proxy carried was opened at most a second or so before the kill.
    let failed_at = looped.failed_at_ms();
    let kill_ms = killed_at.as_millis() as u64;
    let in_flight_at_kill = |t: &u64| *t + 2000 >= kill_ms && *t <= kill_ms + 200;
    let unexplained: Vec<&u64> = failed_at.iter().filter(|t| !in_flight_at_kill(t)).collect();
    assert!(
        unexplained.is_empty() && failed_at.len() <= 5 && looped.count("opened") > 0,
        "connections failed that no crash explains (kill -9 at {kill_ms} ms): {unexplained:?}; {}; {looped}{proxies}",
        done.join("; ")
    );
    assert!(
        events_took + Duration::from_secs(LOOP_AFTER_SECONDS) < Duration::from_secs(LOOP_MAX_SECONDS),
        "the restarts took {events_took:?}, past the {LOOP_MAX_SECONDS} s loop: not all were under it"
    );
}

/// Ends a `hold` client's run (its standard input) and returns what it printed and whether it
/// exited 0.
fn end_hold(mut client: std::process::Child) -> (String, bool) {
    drop(client.stdin.take());
    let out = client.wait_with_output().expect("the hold client's end");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (text, out.status.success())
}

#[test]
fn open_connections_plain_both_ways_and_node_local_survive_a_rolling_update_and_a_deletion_of_the_proxy(
) {
    set_up();
    let pair = meshed_pair();
    let plain = TestNamespace::new("plain", false).expect("namespace");
    deploy_app(&plain.name, "legacy", 8080).expect("deployment");
    let legacy = ready_pod(&plain.name, "legacy").expect("legacy");
    // Long-lived connections, a third each bulk, request/response and idle (cluster-app
    // `hold`): out of a meshed pod to one outside the mesh (passthrough), and into a meshed
    // pod from one outside it (inbound plaintext), and between the two meshed pods (the
    // node-local path: the proxy holds one socket in each pod). The proxy hands them to the
    // agent on SIGTERM and the next one carries them on: none ends, every byte arrives once.
    let hold = |ns: &str, pod: &str, to: &str, n: &str| {
        exec_spawn_with_stdin(ns, pod, &["hold", to, "--connections", n, "--seconds", "400"])
            .expect("hold")
    };
    let out = hold(&pair.ns.name, &pair.client.name, &format!("{}:9100", legacy.ip), "60");
    let inbound = hold(&plain.name, &legacy.name, &format!("{}:9100", pair.server.ip), "30");
    let local_before = opened_to("server", "none");
    let local = hold(&pair.ns.name, &pair.client.name, &format!("{}:9100", pair.server.ip), "30");
    std::thread::sleep(Duration::from_secs(5));
    let counted = opened_to("server", "none") - local_before;
    assert!(counted >= 30.0, "the meshed pods' connections were not node-local: {counted}");
    let started = std::time::Instant::now();
    roll_the_proxy();
    let rolled = started.elapsed();
    std::thread::sleep(Duration::from_secs(3));
    let deleted_at = started.elapsed();
    delete_the_proxy_pod();
    let deleted = started.elapsed() - deleted_at;
    std::thread::sleep(Duration::from_secs(5));
    let (out, out_ok) = end_hold(out);
    let (inbound, in_ok) = end_hold(inbound);
    let (local, local_ok) = end_hold(local);
    println!(
        "rolled in {:.1} s, deleted and back in {:.1} s; out: {}; in: {}; node-local: {}",
        rolled.as_secs_f64(),
        deleted.as_secs_f64(),
        out.trim(),
        inbound.trim(),
        local.trim()
    );
    // A connection ended, reset or short of a byte is not kept; with the agent's hold off
    // every one ends at the first restart (connection_handover.rs has that control).
    assert!(out_ok && out.contains("kept=60 "), "passthrough: {out}");
    assert!(in_ok && inbound.contains("kept=30 "), "inbound plaintext: {inbound}");
    assert!(local_ok && local.contains("kept=30 "), "node-local between meshed pods: {local}");
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

/// The node's conflist as its own runtime reads it.
fn conflist_on(node: Node) -> serde_json::Value {
    serde_json::from_str(&node_file(node, CONFLIST).expect("the node's conflist"))
        .expect("the conflist's JSON")
}

#[test]
fn the_uninstall_job_on_every_node_leaves_each_as_it_was() {
    set_up();
    let nodes = nodes().expect("nodes");
    for node in &nodes {
        assert_eq!(
            plugin_types(&conflist_on(*node)),
            ["bridge", "meshpath-cni"],
            "not installed on {} to begin with",
            node.name()
        );
    }
    uninstall().expect("uninstall as docs/deploy.md says");
    for node in &nodes {
        let n = node.name();
        assert!(!node_has(*node, PIN_ROOT).expect("test -e"), "{PIN_ROOT} is still on {n}");
        assert_eq!(
            plugin_types(&conflist_on(*node)),
            ["bridge"],
            "the conflist of {n} still chains meshpath-cni"
        );
        let plugin = format!("{CNI_BIN}/meshpath-cni");
        assert!(!node_has(*node, &plugin).expect("test -e"), "{plugin} is still on {n}");
    }
    // No meshpath program left at the cgroup v2 root, where each node's agent attaches its
    // node-wide ones (their names start with `mp_`, datapath-common's program names; the two
    // nodes share this machine's kernel).
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
    let events = datapath_unavailable_event_saying("cgroup");
    let ready_while_broken = daemonset_ready(AGENT_DS).expect("ds");
    // Back to the shipped manifests: the same agent becomes ready.
    install().expect("install");
    let (code, _) = agent_readyz().expect("readyz");
    assert!(why.is_ok(), "no reason on /readyz: {why:?}");
    assert!(events.is_ok(), "{events:?}");
    assert!(!ready_while_broken, "the agent was Ready with no datapath");
    assert_eq!(code, 200);
}

/// A map pin of another layout than this agent's, in POD_ADDRS's place (as a release whose map
/// cannot be carried over would meet), with the version the pins record cleared; undone on drop.
struct ForeignMapPin {
    pin: std::path::PathBuf,
    aside: std::path::PathBuf,
}

impl ForeignMapPin {
    fn put() -> Self {
        let pin = Path::new(PIN_ROOT).join("maps/POD_ADDRS");
        let aside = Path::new(PIN_ROOT).join("POD_ADDRS-aside");
        std::fs::rename(&pin, &aside).expect("moving POD_ADDRS's pin aside");
        let me = ForeignMapPin { pin, aside };
        let pin_s = me.pin.display().to_string();
        bpftool(
            &["map", "create", &pin_s, "type", "hash", "key", "8", "value", "4"]
                .into_iter()
                .chain(["entries", "16", "name", "POD_ADDRS"])
                .collect::<Vec<_>>(),
        );
        let version = Path::new(PIN_ROOT).join("maps/DATAPATH_VERSION").display().to_string();
        bpftool(
            &["map", "update", "pinned", &version, "key", "0", "0", "0", "0", "value"]
                .into_iter()
                .chain(["0"; 8])
                .collect::<Vec<_>>(),
        );
        me
    }
}

impl Drop for ForeignMapPin {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pin);
        let _ = std::fs::rename(&self.aside, &self.pin);
    }
}

fn bpftool(args: &[&str]) {
    let out = std::process::Command::new("bpftool").args(args).output().expect("bpftool");
    assert!(out.status.success(), "bpftool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Waits (30 s at most) for the agent's `DatapathUnavailable` Event on the Node whose message
/// contains `text`.
fn datapath_unavailable_event_saying(text: &str) -> anyhow::Result<()> {
    wait_for("the Event on the Node", Duration::from_secs(30), || {
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
                && e["message"].as_str().is_some_and(|m| m.contains(text))
        });
        Ok(on_node.then_some(()))
    })
}

/// An agent that cannot take the pinned datapath over says why on /readyz and in an Event on
/// the Node, and changes nothing: the datapath it found keeps every meshed pod captured (their
/// connections carried over mutual TLS). Once the pins can be taken over, it does, on its own.
#[test]
fn an_agent_that_cannot_take_the_pinned_datapath_over_says_why_and_the_pinned_one_keeps_capturing()
{
    set_up();
    let pair = meshed_pair();
    let foreign = ForeignMapPin::put();
    let old = daemonset_pod(AGENT_DS).expect("agent pod");
    kubectl(&["delete", "pod", "-n", SYSTEM_NS, &old, "--wait=false"]).expect("delete");
    let why = wait_for("the new agent's answer", Duration::from_secs(120), || {
        if daemonset_pod(AGENT_DS)? == old {
            return Ok(None);
        }
        let (code, body) = agent_readyz()?;
        Ok((code == 503 && body.contains("cannot be upgraded in place")).then_some(body))
    })
    .expect("the reason on /readyz");
    println!("/readyz: {}", why.trim());
    assert!(why.contains("POD_ADDRS") && why.contains("keeps the datapath it has"), "{why}");
    datapath_unavailable_event_saying("POD_ADDRS").expect("an Event on the Node");
    assert!(!daemonset_ready(AGENT_DS).expect("ds"), "the agent was Ready on pins it refused");
    // The pinned datapath still captures: a connection goes through the proxies.
    let carried_before = carried_to("server");
    let out = send(&pair, "100000").expect("a meshed connection beside the refusing agent");
    assert!(out.contains("bytes=100000"), "{out}");
    wait_for("the connection counted through the proxy", Duration::from_secs(10), || {
        Ok((carried_to("server") > carried_before).then_some(()))
    })
    .expect("carried through the proxy");
    // The pins as this version can take them: the agent's next try does (every 15 s).
    drop(foreign);
    wait_for("the agent Ready on the pins", Duration::from_secs(60), || {
        Ok(daemonset_ready(AGENT_DS)?.then_some(()))
    })
    .expect("ready");
    assert_eq!(agent_readyz().expect("readyz").0, 200);
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

/// Puts the istiod stand-in back as the other tests expect it, also when a test fails: every
/// type pushed, the CA signing with the validity asked for, no raw resource of a test's left.
struct IstiodRestored;

impl Drop for IstiodRestored {
    fn drop(&mut self) {
        let istiod = istiod();
        istiod.withhold(meshpath_xds::AUTHORIZATION_TYPE, false);
        istiod.ca_away(false);
        istiod.set_ttl(None);
        istiod.remove_address(BAD_RESOURCE);
    }
}

/// The name of the resource the bad-push test puts in istiod's state.
const BAD_RESOURCE: &str = "meshpath-test-bad-resource";

/// `kubectl delete pod` of the proxy's pod; its replacement's name once it runs (ready or not).
fn replace_the_proxy_pod() -> String {
    let old = daemonset_pod(PROXY_DS).expect("proxy pod");
    kubectl(&["delete", "pod", "-n", SYSTEM_NS, &old, "--wait=false"]).expect("delete");
    wait_for("a new proxy pod running", Duration::from_secs(120), || {
        let pod = daemonset_pod(PROXY_DS)?;
        let p = get_json(&["pod", "-n", SYSTEM_NS, &pod])?;
        Ok((pod != old && p["status"]["phase"] == "Running").then_some(pod))
    })
    .expect("a new proxy pod")
}

/// The kubelet's probe failures of `pod` so far, from its Events (each one's count summed):
/// (readiness, liveness), and the Events' text.
fn probe_failures(pod: &str) -> (u64, u64, String) {
    let selector = format!("involvedObject.name={pod},reason=Unhealthy");
    let events =
        get_json(&["events", "-n", SYSTEM_NS, "--field-selector", &selector]).expect("events");
    let count = |what: &str| -> u64 {
        events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["message"].as_str().is_some_and(|m| m.starts_with(what)))
            .map(|e| e["count"].as_u64().unwrap_or(1))
            .sum()
    };
    (count("Readiness probe failed"), count("Liveness probe failed"), events.to_string())
}

/// Readiness failures to see before judging: 4 of its 5 s periods, 20 s unready from the
/// container's start, in which the liveness probe (initial delay 10 s, period 10 s) has run at
/// least once. A liveness probe tied to readiness would fail there, and one failure shows as an
/// Event (six in a row restart the container). Counted in periods: a shorter period needs more
/// (11 at 2 s).
const READINESS_FAILURES: u64 = 4;

/// `pod` probed unready by the kubelet [`READINESS_FAILURES`] times while its liveness probe
/// never failed and its container was never restarted (the proxy carries on as it is).
fn probed_unready_but_never_restarted(pod: &str, why: &str) {
    let (readiness, liveness, events) =
        wait_for("the kubelet's readiness failures", Duration::from_secs(90), || {
            let (r, l, text) = probe_failures(pod);
            Ok((r >= READINESS_FAILURES || l > 0).then_some((r, l, text)))
        })
        .unwrap_or_else(|e| panic!("{why}: never probed unready long enough: {e:#}"));
    let status = get_json(&["pod", "-n", SYSTEM_NS, pod]).expect("pod")["status"].clone();
    println!("{why}: {readiness} readiness failures, {liveness} liveness failures");
    assert_eq!(liveness, 0, "{why}: the liveness probe failed: {events}");
    assert_eq!(status["containerStatuses"][0]["restartCount"], 0, "{why}: restarted: {status}");
    assert_eq!(status["containerStatuses"][0]["ready"], false, "{why}: ready all the same");
}

/// The proxy DaemonSet Ready again, its pod `pod` (not a replacement) and never restarted.
fn ready_again_without_a_restart(pod: &str, why: &str) {
    wait_for(why, Duration::from_secs(90), || Ok(daemonset_ready(PROXY_DS)?.then_some(())))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(daemonset_pod(PROXY_DS).expect("proxy pod"), pod, "{why}: the pod was replaced");
    assert_eq!(proxy_restarts(), 0, "{why}: the proxy was restarted");
}

/// Waits until the proxy's readiness answer satisfies `f`; returns it.
fn proxy_says(what: &str, f: impl Fn(&str) -> bool) -> String {
    let last = std::sync::Mutex::new(String::new());
    wait_for(what, Duration::from_secs(90), || {
        let (_, body) = proxy_readiness()?;
        *last.lock().expect("last") = body.clone();
        Ok(f(&body).then_some(body))
    })
    .unwrap_or_else(|e| panic!("{e:#}; the proxy said: {}", last.lock().expect("last")))
}

/// A new proxy pod, started with istiod as `before` leaves it, unready for the reason its
/// readiness answer names (`says`): the kubelet probes it unready for 20 s and never restarts
/// it (one liveness failure would show). `lift` then puts istiod right, and the same process
/// turns ready on its own and carries the pods' traffic over mutual TLS.
/// `started` runs once the new pod runs, given how many certificates istiod had signed before.
fn unready_but_never_restarted(
    why: &str,
    before: impl FnOnce(&Istiod),
    started: impl FnOnce(&Istiod, usize),
    says: impl Fn(&str) -> bool,
    lift: impl FnOnce(&Istiod),
) {
    set_up();
    let _restored = IstiodRestored;
    let pair = meshed_pair();
    let istiod = istiod();
    before(istiod);
    let csrs_before = istiod.csrs().len();
    let pod = replace_the_proxy_pod();
    started(istiod, csrs_before);
    let readiness = proxy_says(why, says);
    println!("{why}: the proxy says {}", readiness.trim());
    probed_unready_but_never_restarted(&pod, why);
    lift(istiod);
    ready_again_without_a_restart(&pod, &format!("{why}: ready once istiod is right again"));
    let carried_before = carried_to("server");
    let out = send(&pair, "4096").expect("a meshed connection");
    assert!(out.contains("bytes=4096"), "{out}");
    wait_for("the connection counted through the proxy", Duration::from_secs(10), || {
        Ok((carried_to("server") > carried_before).then_some(()))
    })
    .expect("carried through the proxy");
}

/// A resource in the first push that the proxy refuses (NACKed by name): as ztunnel, a type
/// counts once a response of it is taken whole, so the proxy stays unready until istiod
/// sends one it takes.
#[test]
fn a_proxy_refusing_a_resource_of_its_first_push_is_unready_but_never_restarted() {
    unready_but_never_restarted(
        "a refused first push",
        |istiod| istiod.set_address_raw(BAD_RESOURCE, vec![0xff, 0xff, 0xff]),
        |_, _| {},
        |b| b.contains("istiod's Address") && !b.contains("Authorization"),
        |istiod| {
            let nacked = istiod
                .received()
                .into_iter()
                .any(|r| r.error.is_some_and(|e| e.contains(BAD_RESOURCE)));
            assert!(nacked, "no NACK naming {BAD_RESOURCE}");
            istiod.remove_address(BAD_RESOURCE);
        },
    );
}

/// A first push that never completes (the policies withheld, as an istiod away or slow).
#[test]
fn a_proxy_whose_first_push_never_completes_is_unready_but_never_restarted() {
    unready_but_never_restarted(
        "istiod's policies withheld",
        |istiod| istiod.withhold(meshpath_xds::AUTHORIZATION_TYPE, true),
        |_, _| {},
        |b| b.contains("istiod's Authorization") && !b.contains("Address"),
        |istiod| istiod.withhold(meshpath_xds::AUTHORIZATION_TYPE, false),
    );
}

/// Its pods' certificates expired while istiod's CA is away.
#[test]
fn a_proxy_whose_certificates_expired_with_istiods_ca_away_is_unready_but_never_restarted() {
    unready_but_never_restarted(
        "certificates expired",
        // Certificates that live 8 s: the new proxy gets them, then the CA goes away.
        |istiod| istiod.set_ttl(Some(Duration::from_secs(8))),
        |istiod, csrs_before| {
            wait_for("the pods' certificates", Duration::from_secs(60), || {
                Ok((istiod.csrs().len() >= csrs_before + 2).then_some(()))
            })
            .expect("certificates asked for");
            istiod.ca_away(true);
        },
        |b| b.contains("without a valid certificate") && !b.contains("accepted whole"),
        |istiod| {
            istiod.set_ttl(None);
            istiod.ca_away(false);
        },
    );
}

/// The port on the node where the pods' `--hello` connects (outside the mesh).
const HELLO_PORT: u16 = 19_999;

/// Hellos received on the node: the peer the listener saw, and the local address the app
/// said its socket had.
type Hellos = std::sync::Arc<std::sync::Mutex<Vec<(std::net::SocketAddr, String)>>>;

/// A listener on the node's address, outside the mesh, recording each hello: an app's first
/// connection, which says the address it was made from. The same address as the peer: the app
/// reached it itself; another: a proxy did, on the app's behalf.
fn hello_listener() -> Hellos {
    let node = meshpath_loader::netns::Netns::open(Path::new("/run/netns").join(NETNS).as_path())
        .expect("the node's netns");
    let listener = node
        .run(|| std::net::TcpListener::bind((NODE_IP, HELLO_PORT)))
        .expect("enter the node's netns")
        .expect("the hello listener");
    let hellos: Hellos = Default::default();
    let record = hellos.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let record = record.clone();
            std::thread::spawn(move || {
                use std::io::BufRead as _;
                let Ok(peer) = conn.peer_addr() else { return };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut line = String::new();
                let _ = std::io::BufReader::new(&conn).read_line(&mut line);
                if let Some(from) = line.trim().strip_prefix("hello from ") {
                    record.lock().expect("hellos").push((peer, from.to_owned()));
                }
            });
        }
    });
    hellos
}

/// Waits for the hello of the app at `ip` (after the first `skip` hellos) and says whether a
/// proxy carried it (the listener's peer is not the app's own socket).
fn hello_carried_by_a_proxy(hellos: &Hellos, skip: usize, ip: std::net::IpAddr) -> bool {
    wait_for(&format!("the hello of the app at {ip}"), Duration::from_secs(120), || {
        let seen = hellos.lock().expect("hellos");
        Ok(seen
            .iter()
            .skip(skip)
            .find(|(_, from)| from.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip() == ip))
            .map(|(peer, from)| peer.to_string() != *from))
    })
    .expect("a hello")
}

/// The first node shares this machine's mounts, and a reboot unmounts bpffs, where this
/// machine's own tests pin their datapaths: `cargo xtask test` runs them beside this suite and
/// names a file that exists while they run (`MESHPATH_HOST_SUITE_MARKER`). A reboot waits for
/// them to end (they are done long before: the test is named to run late). Two of them failed
/// (`BPF_OBJ_PIN`: no such file) when it did not.
fn wait_for_this_machines_tests() {
    let Some(marker) = std::env::var_os("MESHPATH_HOST_SUITE_MARKER") else { return };
    let marker = std::path::PathBuf::from(marker);
    wait_for("this machine's tests to end", Duration::from_secs(1800), || {
        Ok((!marker.exists()).then_some(()))
    })
    .expect("this machine's tests still running");
}

/// A node reboot, simulated (tests/src/cluster.rs `reboot_node`: kubelet, containerd and every
/// pod process stopped, the pods' netns and cgroups gone, bpffs unmounted, /run cleared, then
/// all started again). An ambient pod whose app's first act is a connection out is captured
/// before that first byte, after the reboot as before it (the connection reaches the node's
/// listener from the proxy's socket, never the app's own), while a pod outside the mesh
/// reaches it itself (the check tells the two apart). Nothing left from before misleads the new
/// agent: the pod's annotation still says it is captured, the pins and records are gone, and
/// the agent enrols the pod's new sandbox afresh. (Named to run late: see
/// [`wait_for_this_machines_tests`].)
#[test]
fn when_a_node_reboots_every_ambient_pod_is_captured_before_its_app_sends_a_byte() {
    wait_for_this_machines_tests();
    set_up();
    let hellos = hello_listener();
    let meshed = TestNamespace::new("reboot", true).expect("namespace");
    let plain = TestNamespace::new("plain", false).expect("namespace");
    let hello = format!("{NODE_IP}:{HELLO_PORT}");
    for ns in [&meshed, &plain] {
        deploy_app_with(&ns.name, "early", 8080, &["--hello", &hello]).expect("deployment");
    }
    let (m, p) = (
        ready_pod(&meshed.name, "early").expect("meshed pod"),
        ready_pod(&plain.name, "early").expect("plain pod"),
    );
    assert!(
        hello_carried_by_a_proxy(&hellos, 0, m.ip),
        "the meshed pod's app went around the mesh"
    );
    assert!(
        !hello_carried_by_a_proxy(&hellos, 0, p.ip),
        "the check cannot tell a proxy from the app"
    );

    let before = hellos.lock().expect("hellos").len();
    let rebooted = std::time::Instant::now();
    reboot_node().expect("the reboot");
    assert!(!Path::new(PIN_ROOT).exists(), "pins survived the reboot");
    wait_for("both DaemonSets Ready after the reboot", Duration::from_secs(240), || {
        Ok((daemonset_ready(AGENT_DS)? && daemonset_ready(PROXY_DS)?).then_some(()))
    })
    .expect("meshpath back");
    // The pods' status may still show the old sandbox for a while: back means Ready with a
    // hello from its current address since the reboot.
    let back = |ns: &str| {
        wait_for(&format!("{ns}'s pod back after the reboot"), Duration::from_secs(240), || {
            let Some(pod) = app_pod(ns, "early")?.filter(|p| p.ready) else { return Ok(None) };
            let seen = hellos.lock().expect("hellos");
            let hello = seen.iter().skip(before).find(|(_, from)| {
                from.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip() == pod.ip)
            });
            Ok(hello.map(|(peer, from)| (pod.clone(), peer.to_string() != *from)))
        })
        .expect("the pod back")
    };
    let (m2, meshed_carried) = back(&meshed.name);
    let (_, plain_carried) = back(&plain.name);
    println!("node rebooted; both pods back after {:?}", rebooted.elapsed());
    assert!(
        meshed_carried,
        "after the reboot the meshed pod's app reached the node around the mesh"
    );
    assert!(!plain_carried, "the plain pod's hello came through a proxy");
    let annotations = &app_pod(&meshed.name, "early").expect("pod").expect("pod").annotations;
    assert_eq!(annotations["ambient.istio.io/redirection"], "enabled");
    let enrolled = enrolled_pods().expect("meshpath-loader list");
    let listed = enrolled.to_string();
    assert!(listed.contains(&format!("{}/{}", meshed.name, m2.name)), "not enrolled: {listed}");
    assert!(!listed.contains(&plain.name), "the plain pod was enrolled: {listed}");
}

/// meshpath's own proxy DaemonSet back in place of `ztunnel`, whatever the istioctl test did.
struct ProxyRestored;

impl Drop for ProxyRestored {
    fn drop(&mut self) {
        if let Err(e) = delete_proxy_daemonset(ISTIOCTL_DS).and_then(|()| install()) {
            eprintln!("putting meshpath-proxy back: {e:#}");
        }
    }
}

/// Deletes the proxy's DaemonSet `name`, then its pod with a grace of 1 s (no drain: the test
/// does not measure one, and the agent holds the pods' listeners meanwhile).
fn delete_proxy_daemonset(name: &str) -> anyhow::Result<()> {
    let orphan = ["--cascade=orphan", "--ignore-not-found"];
    kubectl(&[&["delete", "daemonset", "-n", SYSTEM_NS, name][..], &orphan].concat())?;
    let selector = format!("app.kubernetes.io/name={PROXY_DS}");
    kubectl(&[
        "delete",
        "pods",
        "-n",
        SYSTEM_NS,
        "-l",
        &selector,
        "--grace-period=1",
        "--wait=true",
    ])?;
    Ok(())
}

/// The DaemonSet name `istioctl ztunnel-config` looks up (deploy/istioctl gives it to the proxy).
const ISTIOCTL_DS: &str = "ztunnel";

/// `istioctl ztunnel-config` finds meshpath's proxy as it finds Istio's ztunnel once the install
/// has deploy/istioctl (istio/istio istioctl/pkg/ztunnelconfig, carried over as facts): the
/// DaemonSet `ztunnel` in the namespace it is given (`--istio-namespace meshpath-system`), its
/// pod on the node by the DaemonSet's own selector (`--node`), the pod's `app` label `ztunnel`,
/// then GET /config_dump on the pod's port 15000 through a port-forward. The dump, decoded as
/// istioctl declares it, lists the node's two meshed pods, the connection open between them at
/// both ends, and their certificates from istiod's CA, available.
#[test]
fn istioctl_finds_the_proxy_as_ztunnel_and_reads_its_config_dump_through_a_port_forward() {
    set_up();
    let _restored = ProxyRestored;
    let pair = meshed_pair();
    delete_proxy_daemonset(PROXY_DS).expect("deleting meshpath-proxy");
    let overlay = repo_root().join("tests/cluster-istioctl");
    kubectl(&["apply", "-k", &overlay.display().to_string()]).expect("applying deploy/istioctl");
    wait_for("the ztunnel DaemonSet Ready", Duration::from_secs(180), || {
        Ok(daemonset_ready(ISTIOCTL_DS)?.then_some(()))
    })
    .expect("ztunnel Ready");

    // As istioctl --node: the DaemonSet's selector, the pod on the node, its `app` label.
    let ds = get_json(&["daemonset", "-n", SYSTEM_NS, ISTIOCTL_DS]).expect("the DaemonSet");
    let selector: Vec<String> = ds["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect();
    let on_node = format!("spec.nodeName={NODE_NAME}");
    let pods = get_json(&[
        "pods",
        "-n",
        SYSTEM_NS,
        "-l",
        &selector.join(","),
        "--field-selector",
        &on_node,
    ])
    .expect("the DaemonSet's pods");
    let pod = &pods["items"][0];
    let name = pod["metadata"]["name"].as_str().expect("a pod on the node").to_owned();
    assert_eq!(pod["metadata"]["labels"]["app"], "ztunnel", "istioctl's check of the pod");
    assert!(name.starts_with("ztunnel"), "{name}");

    // Open while the dump is read (8 s), not one of the restart tests' long transfers.
    let long = transfer_under_way(&pair, "1000000", "8");
    let mut forward = in_node("kubectl");
    forward
        .arg("--kubeconfig")
        .arg(Path::new(DIR).join("admin.kubeconfig"))
        .args(["port-forward", "-n", SYSTEM_NS, &format!("pod/{name}"), ":15000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut forward = forward.spawn().expect("kubectl port-forward");
    let mut line = String::new();
    let mut stdout = std::io::BufReader::new(forward.stdout.take().expect("its stdout"));
    std::io::BufRead::read_line(&mut stdout, &mut line).expect("kubectl port-forward's first line");
    // It says a line per connection: read on, or it dies of a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    // "Forwarding from 127.0.0.1:PORT -> 15000"
    let port = line
        .split_whitespace()
        .nth(2)
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no local port in {line:?}"));
    let mut curl = in_node("curl");
    curl.args(["-sf", "--max-time", "10", &format!("http://127.0.0.1:{port}/config_dump")]);
    let body = output(curl, None);
    let _ = forward.kill();
    let _ = forward.wait();
    let body = body.expect("GET /config_dump through the port-forward");
    let dump: meshpath_tests::istioctl::Dump = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("not what istioctl reads: {e}\n{body}"));

    let workloads = meshpath_tests::istioctl::workload_rows(&dump);
    for p in [&pair.client, &pair.server] {
        let row = workloads.iter().find(|r| r[1] == p.name);
        assert!(
            row.is_some_and(|r| r[0] == pair.ns.name && r[2] == p.ip.to_string()),
            "{} in the workloads table: {workloads:?}",
            p.name
        );
    }
    let connections = meshpath_tests::istioctl::connection_rows(&dump);
    println!("istioctl ztunnel-config connections would print:\n{connections:?}");
    // The two pods are of one node: the transfer is node-local, plain TCP on both sides.
    for direction in ["Outbound", "Inbound"] {
        assert!(
            connections.iter().any(|r| r[1] == direction && r[5] == "TCP"),
            "no {direction} connection: {connections:?}"
        );
    }
    let certificates = meshpath_tests::istioctl::certificate_rows(&dump);
    for sa in ["client", "server"] {
        let id = format!("spiffe://cluster.local/ns/{}/sa/{sa}", pair.ns.name);
        assert!(
            certificates.iter().any(|r| r[0] == id && r[1] == "Leaf" && r[2] == "Available"),
            "no available certificate for {id}: {certificates:?}"
        );
    }
    let out = long.wait_with_output().expect("the transfer's end");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_meshed_pods_hand_built_syn_that_skips_its_own_side_never_reaches_another_pod() {
    // A packet socket with PACKET_QDISC_BYPASS (CAP_NET_RAW, which containerd grants) skips the
    // pod's own guard; the agent's guard on the node's end of the pod's veth (the bridge
    // plugin's) drops the SYN there. The control: the same SYN from an unmeshed pod to the
    // same listener is answered.
    set_up();
    let pair = meshed_pair();
    let plain = TestNamespace::new("plain", false).expect("namespace");
    for app in ["legacy", "outsider"] {
        deploy_app(&plain.name, app, 8080).expect("deployment");
    }
    let legacy = ready_pod(&plain.name, "legacy").expect("legacy");
    let outsider = ready_pod(&plain.name, "outsider").expect("outsider");
    let listener = format!("{}:9000", legacy.ip);
    let syn = ["raw-syn", listener.as_str(), "--qdisc-bypass"];
    let control = exec(&plain.name, &outsider.name, &syn).expect("raw-syn from outside the mesh");
    assert_eq!(control.trim(), "answered", "the control's SYN was not answered: {control}");
    let meshed = exec(&pair.ns.name, &pair.client.name, &syn).expect("raw-syn from the mesh");
    assert_eq!(meshed.trim(), "unanswered", "a meshed pod's hand-built SYN got through");
}
