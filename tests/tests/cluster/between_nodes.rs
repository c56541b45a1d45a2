//! The mesh between two nodes, as users run it: pods pinned to each node of the two-node
//! cluster (`cargo xtask cluster up --nodes 2`, the second node a kind-like container of its
//! own), each node's agent and proxy from the same DaemonSets, HBONE between the nodes over the
//! cluster's pod routes.

use std::time::Duration;

use meshpath_tests::cluster::*;

use super::{end_hold, set_up};

/// A meshed namespace with `server` on the second node and `client` on the first, both
/// published to both proxies as HBONE workloads of their nodes.
struct CrossNodePair {
    ns: TestNamespace,
    server: PodInfo,
    client: PodInfo,
}

fn cross_node_pair() -> CrossNodePair {
    let ns = TestNamespace::new("cross", true).expect("namespace");
    deploy_app_on(Some(Node::Second), &ns.name, "server", 8080, &[]).expect("server");
    deploy_app_on(Some(Node::First), &ns.name, "client", 8080, &[]).expect("client");
    let server = ready_pod(&ns.name, "server").expect("server");
    let client = ready_pod(&ns.name, "client").expect("client");
    publish_workloads_on(
        &[(&ns.name, "server", &server, Node::Second), (&ns.name, "client", &client, Node::First)],
        &Node::ALL,
    )
    .expect("workloads");
    CrossNodePair { ns, server, client }
}

impl CrossNodePair {
    fn exec(&self, args: &[&str]) -> anyhow::Result<String> {
        exec(&self.ns.name, &self.client.name, args)
    }

    fn sink(&self) -> String {
        format!("{}:9000", self.server.ip)
    }

    /// A connect loop from the client to the server's sink across the nodes, for up to 300 s.
    fn connect_loop(&self) -> ConnectLoop {
        ConnectLoop::start(&self.ns.name, &self.client.name, &self.sink(), 300)
            .expect("the connect loop")
    }

    /// The client holding three connections to the server's echo port open for up to 60 s
    /// (ended, and its report read, with `end_hold`).
    fn hold_three(&self) -> std::process::Child {
        let echo = format!("{}:9100", self.server.ip);
        let args = ["hold", &echo, "--connections", "3", "--seconds", "60"];
        let hold = exec_spawn_with_stdin(&self.ns.name, &self.client.name, &args).expect("hold");
        std::thread::sleep(Duration::from_secs(3));
        hold
    }
}

/// Connections to `workload` that `node`'s proxy counted as `reporter`, over mutual TLS.
fn mtls_opened(node: Node, reporter: &str, workload: &str) -> f64 {
    let m = proxy_metrics_on(node).expect("proxy metrics");
    metric_sum(
        &m,
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", reporter),
            ("destination_workload", workload),
            ("connection_security_policy", "mutual_tls"),
        ],
    )
}

/// The proxy's log on `node` (its pod's, through the API server).
fn proxy_log(node: Node) -> String {
    let pod = daemonset_pod_on(PROXY_DS, node).expect("the node's proxy pod");
    kubectl(&["logs", "-n", SYSTEM_NS, &pod]).expect("kubectl logs")
}

/// The cluster the suite runs on: two Ready nodes, each with a pod of each DaemonSet.
#[test]
fn both_nodes_are_ready_and_run_an_agent_and_a_proxy_each() {
    set_up();
    assert_eq!(nodes().expect("nodes"), Node::ALL, "the cluster has not two nodes");
    for node in Node::ALL {
        for ds in [AGENT_DS, PROXY_DS] {
            let pod = daemonset_pod_on(ds, node);
            assert!(pod.is_ok(), "no {ds} pod on {}: {pod:?}", node.name());
        }
    }
}

/// A client on the first node and a server on the second: the client's bytes reach the sink
/// byte-exact, long-lived connections to the echo port carry both ways, the server sees the
/// client's own pod address (HBONE carried it), and each node's proxy counts its side with
/// mutual TLS (the source reporter on the client's node, the destination reporter on the
/// server's) and logs it.
#[test]
fn pods_on_two_nodes_talk_over_hbone_with_mutual_tls_both_ways_and_each_proxy_reports_its_side() {
    set_up();
    let pair = cross_node_pair();
    let src_before = mtls_opened(Node::First, "source", "server");
    let dst_before = mtls_opened(Node::Second, "destination", "server");

    let out = pair.exec(&["send", &pair.sink(), "--bytes", "1000000"]).expect("a megabyte");
    assert!(out.contains("bytes=1000000"), "{out}");
    let (held, ok) = end_hold(pair.hold_three());
    assert!(ok && held.contains("kept=3 "), "echoed both ways: {held}");
    let peer =
        pair.exec(&["get", &format!("{}:8080", pair.server.ip), "/peer"]).expect("GET /peer");
    assert_eq!(peer.trim(), pair.client.ip.to_string(), "the server saw another address");

    let counted = wait_for("both reporters' counts", Duration::from_secs(15), || {
        let src = mtls_opened(Node::First, "source", "server") - src_before;
        let dst = mtls_opened(Node::Second, "destination", "server") - dst_before;
        Ok((src >= 5.0 && dst >= 5.0).then_some((src, dst)))
    });
    assert!(counted.is_ok(), "mutual TLS connections not counted on both nodes: {counted:?}");

    let to_sink = format!("{}:9000", pair.server.ip);
    let logged = |node: Node, direction: &str| {
        proxy_log(node).lines().any(|l| {
            l.contains("connection complete") && l.contains(&to_sink) && l.contains(direction)
        })
    };
    assert!(logged(Node::First, "outbound"), "the client's node logged no outbound line");
    assert!(logged(Node::Second, "inbound"), "the server's node logged no inbound line");
}

/// Each node's agent enrols the pods of its node and no other, and each node's proxy asks
/// istiod's CA (the stand-in counts the requests, with where they came from) for the
/// identities of its node's pods only.
#[test]
fn each_agent_enrols_only_its_nodes_pods_and_each_proxy_asks_the_ca_only_for_its_pods_identities() {
    set_up();
    let pair = cross_node_pair();
    let out = pair.exec(&["send", &pair.sink(), "--bytes", "1000"]).expect("a connection");
    assert!(out.contains("bytes=1000"), "{out}");
    let name = |p: &PodInfo| format!("{}/{}", pair.ns.name, p.name);
    for (node, own, other) in
        [(Node::First, &pair.client, &pair.server), (Node::Second, &pair.server, &pair.client)]
    {
        let listed = enrolled_pods_on(node).expect("the node's datapath").to_string();
        assert!(listed.contains(&name(own)), "{} did not enrol its pod: {listed}", node.name());
        assert!(!listed.contains(&name(other)), "{} enrolled the other's pod", node.name());
    }
    let csrs = istiod().csrs();
    for (sa, node) in [("client", Node::First), ("server", Node::Second)] {
        let id = format!("spiffe://cluster.local/ns/{}/sa/{sa}", pair.ns.name);
        let from: Vec<String> = csrs
            .iter()
            .filter(|c| c.sans.contains(&id))
            .map(|c| c.peer.map_or("?".to_owned(), |p| p.ip().to_string()))
            .collect();
        assert!(!from.is_empty(), "no certificate was asked for {id}");
        assert!(
            from.iter().all(|ip| ip == node.ip()),
            "{id} was asked for from {from:?}, not only from its node {}",
            node.ip()
        );
    }
}

/// The policy the deny test pushes, taken back whatever the test did (the stand-in is the
/// whole suite's).
struct PolicyPushed(String);

impl Drop for PolicyPushed {
    fn drop(&mut self) {
        istiod().remove_policy(&self.0);
    }
}

/// A DENY for the client's identity pushed by the control plane while a cross-node connection
/// is open: the destination's node closes it, and a new one is refused.
#[test]
fn a_policy_denying_a_cross_node_pair_closes_its_open_connections_and_refuses_new_ones() {
    set_up();
    let pair = cross_node_pair();
    let hold = pair.hold_three();
    let name = format!("deny-client-{}", pair.ns.name);
    istiod().set_policy(meshpath_tests::istiod::deny_from(&name, &pair.ns.name, "client"));
    let _pushed = PolicyPushed(name);
    std::thread::sleep(Duration::from_secs(5));
    let (held, ok) = end_hold(hold);
    assert!(!ok && held.contains("kept=0 "), "the denied connections stayed open: {held}");
    // The sink is a real listener: a denied connection that got through would be counted.
    let accepted = sink_count(pair.server.ip).expect("sink count");
    let refused = pair.exec(&["send", &pair.sink(), "--bytes", "1000"]);
    assert!(refused.is_err(), "a new denied connection got through: {refused:?}");
    let after = sink_count(pair.server.ip).expect("sink count");
    assert_eq!(after, accepted, "the server's app accepted a denied connection");
}

/// A cross-node transfer while both DaemonSets roll: these bytes, paced to be spread over
/// these seconds (about 250 KB/s), the rest sent at once when the roll has ended: under way
/// from before the first pod is replaced to after the last is Ready (the test checks bytes
/// were still unsent then), not a fixed time that a slow roll would outlast.
const ROLL_BYTES: &str = "60000000";
const ROLL_MAX_SECONDS: &str = "240";

/// A rolling update of both DaemonSets, one node at a time (`maxUnavailable: 1`), while a
/// cross-node transfer runs and a connect loop opens a connection every 20 ms across the
/// nodes: what docs/deploy.md promises for an upgrade, measured (refused, reset, bytes).
#[test]
fn a_rolling_update_node_by_node_keeps_a_cross_node_transfer_and_answers_every_connection() {
    set_up();
    let pair = cross_node_pair();
    let accepted = sink_count(pair.server.ip).expect("sink count");
    let mut long = exec_spawn_with_stdin(
        &pair.ns.name,
        &pair.client.name,
        &[
            "send",
            &pair.sink(),
            "--bytes",
            ROLL_BYTES,
            "--seconds",
            ROLL_MAX_SECONDS,
            "--until-stdin-closes",
        ],
    )
    .expect("the long transfer");
    wait_for("the long transfer to start", Duration::from_secs(30), || {
        Ok((sink_count(pair.server.ip)? > accepted).then_some(()))
    })
    .expect("the transfer started");
    // Every agent's and proxy's log, the replaced ones' too, for a failure to be explained.
    let logs = DaemonSetLogs::follow(&[AGENT_DS, PROXY_DS]);
    let looping = pair.connect_loop();
    let started = std::time::Instant::now();
    let mut rolled = Vec::new();
    for ds in [AGENT_DS, PROXY_DS] {
        let old: Vec<String> =
            Node::ALL.iter().map(|n| daemonset_pod_on(ds, *n).expect("a pod")).collect();
        rolling_update(ds).expect("kubectl rollout restart");
        wait_for(&format!("{ds} rolled on both nodes"), Duration::from_secs(240), || {
            let now: Vec<String> =
                Node::ALL.iter().filter_map(|n| daemonset_pod_on(ds, *n).ok()).collect();
            let replaced = now.len() == 2 && now.iter().all(|p| !old.contains(p));
            Ok((replaced && daemonset_ready(ds)?).then_some(()))
        })
        .expect("rollout");
        rolled.push(format!("{ds} rolled by {:.1} s", started.elapsed().as_secs_f64()));
    }
    std::thread::sleep(Duration::from_secs(3));
    let looped = looping.end().expect("the connect loop's end");
    // Its standard input closed: the transfer sends what is left and ends.
    drop(long.stdin.take());
    let long = long.wait_with_output().expect("the long transfer's end");
    let transfer = format!(
        "{}{}",
        String::from_utf8_lossy(&long.stdout),
        String::from_utf8_lossy(&long.stderr)
    );
    println!("{}; loop: {looped}; transfer: {}", rolled.join(", "), transfer.trim());
    let transferred = long.status.success() && transfer.contains(&format!("bytes={ROLL_BYTES}"));
    if !looped.all_answered() || !transferred {
        // The failed connections' own lines (by their client ports), and what any agent or
        // proxy warned of (a paused transfer's end among them), from every pod of the roll.
        let ports: Vec<String> = looped
            .text
            .split_whitespace()
            .filter_map(|w| w.strip_prefix(&format!("{}:", pair.client.ip)))
            .map(|p| format!(":{}", p.trim_end_matches(',')))
            .collect();
        let mut needles: Vec<&str> = ports.iter().map(String::as_str).collect();
        needles.extend([" WARN ", " ERROR ", "drain", "hand", "listener", "stopping"]);
        println!("pods followed: {:?}", logs.pods());
        for line in logs.lines_with(&needles, 400) {
            println!("{line}");
        }
    }
    assert!(transferred, "{transfer}");
    // Under way across the whole roll: bytes were still to be sent when it had ended.
    let unsent = transfer
        .split_whitespace()
        .find_map(|w| w.strip_prefix("unsent_at_stdin_end=")?.parse::<u64>().ok());
    assert!(unsent.is_some_and(|n| n > 0), "the transfer ended before the roll: {transfer}");
    let count = |k: &str| looped.count(k);
    assert!(count("opened") > 1000, "the loop did not run: {looped}");
    assert_eq!(count("refused"), 0, "connections refused across the rolling update: {looped}");
    assert_eq!(count("other"), 0, "connections failed across the rolling update: {looped}");
    // None reset either. One in about 3000 was: the connection that dialed the server's node
    // while its proxy was being replaced, its handshake unanswered past the connect timeout
    // (node 2's agent held the listener; 10 to 14 s passed between the two proxies), reset at
    // the timeout. The proxy now dials again (connection_handover.rs has that case, made
    // certain). A proxy told to stop just after its node's new agent is Ready, before it found
    // that agent, closed listeners no agent held (289 of 2748 failed in one CI run;
    // `a_proxy_stopped_while_its_nodes_agent_restarts_…` below): it now waits for the agent.
    assert_eq!(count("reset"), 0, "connections reset across the rolling update: {looped}");
}

/// Node cordons the test made, uncordoned whatever it did.
struct Uncordon(&'static [Node]);

impl Drop for Uncordon {
    fn drop(&mut self) {
        for n in self.0 {
            let _ = kubectl(&["uncordon", n.name()]);
        }
    }
}

/// `kubectl drain` of the second node: the server's pod (a Deployment, not pinned) is evicted,
/// rescheduled onto the first node, captured there by its agent and reached again; uncordoned,
/// the second node takes a new meshed pod into the mesh.
#[test]
fn a_drained_nodes_pod_reschedules_onto_the_other_is_captured_there_and_uncordon_brings_the_node_back(
) {
    set_up();
    let _uncordon = Uncordon(&Node::ALL);
    let ns = TestNamespace::new("drain", true).expect("namespace");
    deploy_app_on(Some(Node::First), &ns.name, "client", 8080, &[]).expect("client");
    // The server unpinned, on the second node: the first cordoned while it is scheduled.
    kubectl(&["cordon", NODE_NAME]).expect("cordon");
    deploy_app_on(None, &ns.name, "server", 8080, &[]).expect("server");
    let before = ready_pod(&ns.name, "server").expect("server");
    kubectl(&["uncordon", NODE_NAME]).expect("uncordon");
    let client = ready_pod(&ns.name, "client").expect("client");
    let on_second = enrolled_pods_on(Node::Second).expect("list").to_string();
    assert!(on_second.contains(&before.name), "the server is not on the second node: {on_second}");

    kubectl(&[
        "drain",
        NODE2_NAME,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=120s",
    ])
    .expect("kubectl drain");
    let after = wait_for("the server rescheduled", Duration::from_secs(120), || {
        Ok(app_pod(&ns.name, "server")?.filter(|p| p.ready && p.uid != before.uid))
    })
    .expect("a new server pod");
    let name = format!("{}/{}", ns.name, after.name);
    let captured =
        wait_for("the new pod enrolled on the first node", Duration::from_secs(30), || {
            Ok(enrolled_pods_on(Node::First)?.to_string().contains(&name).then_some(()))
        });
    assert!(captured.is_ok(), "{captured:?}");
    publish_workloads_on(
        &[(&ns.name, "server", &after, Node::First), (&ns.name, "client", &client, Node::First)],
        &[Node::First],
    )
    .expect("workloads");
    let out =
        exec(&ns.name, &client.name, &["send", &format!("{}:9000", after.ip), "--bytes", "100000"])
            .expect("traffic to the rescheduled pod");
    assert!(out.contains("bytes=100000"), "{out}");

    kubectl(&["uncordon", NODE2_NAME]).expect("uncordon");
    deploy_app_on(Some(Node::Second), &ns.name, "back", 8080, &[]).expect("a pod on the node");
    let back = ready_pod(&ns.name, "back").expect("back");
    let name = format!("{}/{}", ns.name, back.name);
    let captured = wait_for("the pod enrolled on the second node", Duration::from_secs(30), || {
        Ok(enrolled_pods_on(Node::Second)?.to_string().contains(&name).then_some(()))
    });
    assert!(captured.is_ok(), "{captured:?}");
    publish_workloads_on(&[(&ns.name, "back", &back, Node::Second)], &Node::ALL)
        .expect("workloads");
    let dst_before = mtls_opened(Node::Second, "destination", "back");
    let out =
        exec(&ns.name, &client.name, &["send", &format!("{}:9000", back.ip), "--bytes", "100000"])
            .expect("traffic to the node back in the mesh");
    assert!(out.contains("bytes=100000"), "{out}");
    let counted = wait_for("the back pod's count", Duration::from_secs(15), || {
        Ok((mtls_opened(Node::Second, "destination", "back") > dst_before).then_some(()))
    });
    assert!(counted.is_ok(), "not carried over HBONE to the node back in the mesh");
}

/// What a release's rollout can do on a node, both DaemonSets rolling at once: the proxy told
/// to stop while the node's agent restarts (the old one gone, the new one not up or not yet
/// found by the proxy), so that no agent holds the proxy's listeners. The proxy waits for the
/// new agent and hands them over before it drains: on the server's node and then on the
/// client's, under a connect loop across the nodes, every connection is answered (without the
/// wait, the server's node reset every HBONE connect and the client's refused every connect
/// until a new proxy listened).
#[test]
fn a_proxy_stopped_while_its_nodes_agent_restarts_waits_for_it_and_every_connection_is_answered() {
    set_up();
    let pair = cross_node_pair();
    let looping = pair.connect_loop();
    for node in [Node::Second, Node::First] {
        let agent = daemonset_pod_on(AGENT_DS, node).expect("the node's agent");
        let proxy = daemonset_pod_on(PROXY_DS, node).expect("the node's proxy");
        kubectl(&["delete", "pod", "-n", SYSTEM_NS, &agent, "--wait=false"]).expect("delete");
        wait_for("the old agent gone", Duration::from_secs(60), || {
            Ok(kubectl(&["get", "pod", "-n", SYSTEM_NS, &agent]).is_err().then_some(()))
        })
        .expect("the agent's exit");
        kubectl(&["delete", "pod", "-n", SYSTEM_NS, &proxy, "--wait=false"]).expect("delete");
        wait_for(
            &format!("both DaemonSets back on {}", node.name()),
            Duration::from_secs(120),
            || {
                let replaced = daemonset_pod_on(PROXY_DS, node).is_ok_and(|p| p != proxy);
                Ok((replaced && daemonset_ready(AGENT_DS)? && daemonset_ready(PROXY_DS)?)
                    .then_some(()))
            },
        )
        .expect("the node's new agent and proxy");
    }
    std::thread::sleep(Duration::from_secs(3));
    let looped = looping.end().expect("the connect loop's end");
    println!("loop: {looped}");
    assert!(looped.count("opened") > 500, "the loop did not run: {looped}");
    assert!(looped.all_answered(), "connections not answered: {looped}");
}
