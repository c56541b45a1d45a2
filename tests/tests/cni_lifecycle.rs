//! The node under stress and failure: the proxy or the agent killed (SIGKILL) mid-flight,
//! concurrent ADDs interrupted by an agent crash, and a hundred pods added and removed at once.
//! Whatever happens: traffic waits or is refused rather than carried outside the mesh, every ADD either
//! fully succeeded or failed cleanly, and nothing is left behind once the pods are gone.

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    sync::Arc,
    time::Duration,
};

use meshpath_tests::cni_node::{CniNode, CniPod};

fn workloads(n: usize) -> String {
    let mut s = String::from("workloads:\n");
    for i in 0..n {
        s.push_str(&format!(
            "- {{uid: uid-p{i}, name: p{i}, namespace: default, serviceAccount: sa{i}, protocol: HBONE}}\n"
        ));
    }
    s
}

/// Meshed pods p0 → p1 (p1 known to the store with its address), an echo server in p1.
fn two_pods(node: &CniNode) -> (CniPod, CniPod) {
    let p1 = node.add_pod("p1").expect("ADD p1");
    node.publish_address(&workloads(2), "sa1", p1.ip);
    node.echo_server(&p1, 8080).expect("echo");
    let p0 = node.add_pod("p0").expect("ADD p0");
    (p0, p1)
}

#[test]
fn a_proxy_killed_mid_transfer_fails_the_connection_and_nothing_bypasses_it() {
    let mut node = CniNode::start(&workloads(2)).expect("node");
    let (p0, p1) = two_pods(&node);
    let dst = SocketAddr::new(p1.ip, 8080);
    let mut conn = p0.connect(dst).expect("connect");
    conn.write_all(b"before").expect("send");
    let mut buf = [0u8; 6];
    conn.read_exact(&mut buf).expect("echo");
    node.proxy.as_ref().expect("proxy").signal(libc::SIGKILL).expect("kill -9");
    assert!(node.proxy.as_mut().expect("proxy").wait_exit(Duration::from_secs(10)));
    // The open connection fails...
    let mut failed = false;
    for _ in 0..50 {
        if conn.write_all(&[0u8; 1024]).is_err()
            || meshpath_tests::again_after_eintr(|| conn.read(&mut buf)).map_or(true, |n| n == 0)
        {
            failed = true;
            break;
        }
    }
    assert!(failed, "the connection outlived its proxy");
    // ...and new ones are never carried around the mesh: they wait in the backlog of the
    // listener the agent holds (tests/proxy_restarts.rs), and the echo server, which answers
    // whoever reaches it, does not answer.
    let mut waiting = p0.connect(dst).expect("a new connection was refused while held");
    waiting.write_all(b"early").expect("send");
    waiting.set_read_timeout(Some(Duration::from_secs(1))).expect("timeout");
    let unanswered = meshpath_tests::again_after_eintr(|| waiting.read(&mut buf));
    assert!(
        matches!(&unanswered, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "answered with no proxy: {unanswered:?}"
    );
    // A new proxy gets the snapshot and serves again, the waiting connection first.
    node.start_proxy().expect("proxy restarted");
    waiting.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut early = [0u8; 5];
    waiting.read_exact(&mut early).expect("the waiting connection served");
    assert_eq!(&early, b"early");
    let mut c = p0.connect(dst).expect("connect after restart");
    c.write_all(b"after").expect("send");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("echo after restart");
    assert_eq!(&back, b"after");
    let mut pods = node.proxy_pods().expect("pods");
    pods.sort();
    assert_eq!(pods, vec!["uid-p0", "uid-p1"], "the new proxy did not get every pod");
}

#[test]
fn an_agent_restart_keeps_traffic_flowing_and_removes_pods_that_vanished_meanwhile() {
    let mut node = CniNode::start(&workloads(3)).expect("node");
    let (p0, p1) = two_pods(&node);
    let p2 = node.add_pod("p2").expect("ADD p2");
    let dst = SocketAddr::new(p1.ip, 8080);
    let mut conn = p0.connect(dst).expect("connect");
    node.agent.as_ref().expect("agent").signal(libc::SIGKILL).expect("kill -9 agent");
    assert!(node.agent.as_mut().expect("agent").wait_exit(Duration::from_secs(10)));
    // While the agent is down: the open connection still works, p2's netns is deleted.
    conn.write_all(b"agentless").expect("send");
    let mut back = [0u8; 9];
    conn.read_exact(&mut back).expect("echo without the agent");
    p2.netns.delete().expect("delete p2's netns");
    node.start_agent().expect("agent restarted");
    // The proxy reconnects and gets a snapshot without p2.
    let proxy = node.proxy.as_ref().expect("proxy");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut pods = Vec::new();
    while std::time::Instant::now() < deadline {
        pods = node.proxy_pods().expect("pods");
        pods.sort();
        if pods == ["uid-p0", "uid-p1"] {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(pods, vec!["uid-p0", "uid-p1"], "{}", proxy.lines().join("\n"));
    assert_eq!(node.enrolled().len(), 2, "the vanished pod is still enrolled");
    assert_eq!(node.records().len(), 2, "the vanished pod's record is left");
    conn.write_all(b"agentback").expect("send");
    conn.read_exact(&mut back).expect("echo after the agent came back");
}

#[test]
fn an_agent_killed_during_concurrent_adds_leaves_every_pod_added_or_cleanly_refused() {
    const N: usize = 50;
    let mut node = CniNode::start(&workloads(N)).expect("node");
    let shared = Arc::new(std::sync::Mutex::new(Vec::new()));
    let results: Vec<_> = std::thread::scope(|s| {
        let node = &node;
        let handles: Vec<_> = (0..N)
            .map(|i| {
                let shared = shared.clone();
                s.spawn(move || {
                    let r = node.add_pod(&format!("p{i}"));
                    if let Ok(pod) = &r {
                        shared
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(pod.container_id.clone());
                    }
                    r
                })
            })
            .collect();
        // Kill the agent while the ADDs are in flight: once a few have succeeded.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while shared.lock().unwrap_or_else(|p| p.into_inner()).len() < 10
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = node.agent.as_ref().expect("agent").signal(libc::SIGKILL);
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let added: Vec<CniPod> = results.into_iter().filter_map(Result::ok).collect();
    eprintln!("{} of {N} ADDs succeeded before the agent was killed", added.len());
    assert!(
        (10..N).contains(&added.len()),
        "the kill did not land among the ADDs: the test interrupted nothing"
    );
    node.start_agent().expect("agent restarted");
    // Reconcile: exactly the pods whose ADD succeeded are enrolled, recorded and served.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline
        && node.proxy_pods().map(|p| p.len()).unwrap_or(0) != added.len()
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(node.enrolled().len(), added.len(), "enrolled pods ≠ successful ADDs");
    assert_eq!(node.records().len(), added.len(), "records ≠ successful ADDs");
    assert_eq!(
        node.proxy_pods().expect("pods").len(),
        added.len(),
        "served pods ≠ successful ADDs"
    );
    for pod in &added {
        assert_eq!(node.check_pod(pod).expect("CHECK").map_err(|r| r.stdout), Ok(()));
        node.del_pod(pod, &pod.netns.path().display().to_string()).expect("DEL").expect("DEL ok");
    }
    assert!(
        node.enrolled().is_empty() && node.records().is_empty() && node.root.pod_pins().is_empty()
    );
}

#[test]
fn a_hundred_pods_added_and_removed_concurrently_leave_nothing_behind() {
    const N: usize = 100;
    let node = CniNode::start(&workloads(N)).expect("node");
    let proxy_fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", node.proxy.as_ref().expect("proxy").pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let baseline = proxy_fds();
    let pods: Vec<CniPod> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..N)
            .map(|i| {
                s.spawn({
                    let node = &node;
                    move || node.add_pod(&format!("p{i}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread").expect("ADD")).collect()
    });
    assert_eq!(node.enrolled().len(), N);
    assert_eq!(node.proxy_pods().expect("pods").len(), N);
    std::thread::scope(|s| {
        for pod in &pods {
            let node = &node;
            s.spawn(move || {
                node.del_pod(pod, &pod.netns.path().display().to_string())
                    .expect("DEL")
                    .expect("DEL ok");
            });
        }
    });
    assert!(node.enrolled().is_empty(), "map entries left");
    assert!(node.root.pod_pins().is_empty(), "pins left");
    assert!(node.records().is_empty(), "records left");
    assert!(node.proxy_pods().expect("pods").is_empty(), "listeners left");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while proxy_fds() > baseline && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(proxy_fds() <= baseline, "the proxy holds {} fds, {baseline} before", proxy_fds());
}

/// A pod costs the proxy its sockets, not a thread: it used to keep one thread per pod in the
/// pod's netns (1003 threads and 122 MiB resident at 1000 pods, against 4 and 27 MiB without:
/// docs/deploy.md, "The proxy's memory").
#[test]
fn the_proxy_serves_pods_without_a_thread_per_pod() {
    const N: usize = 20;
    let node = CniNode::start(&workloads(N)).expect("node");
    let threads = || {
        let pid = node.proxy.as_ref().expect("proxy").pid();
        std::fs::read_dir(format!("/proc/{pid}/task")).expect("the proxy's threads").count()
    };
    let before = threads();
    let pods: Vec<CniPod> = (0..N).map(|i| node.add_pod(&format!("p{i}")).expect("ADD")).collect();
    assert_eq!(node.proxy_pods().expect("pods").len(), N);
    // Slack for the runtime's blocking pool, which a pod's set-up runs on.
    let serving = threads();
    assert!(serving <= before + 4, "{serving} threads serving {N} pods, {before} serving none");
    drop(pods);
}

#[test]
fn adding_and_removing_another_pod_leaves_open_connections_alone() {
    let node = CniNode::start(&workloads(3)).expect("node");
    let (p0, p1) = two_pods(&node);
    let mut conn = p0.connect(SocketAddr::new(p1.ip, 8080)).expect("connect");
    let mut back = [0u8; 4];
    conn.write_all(b"one.").expect("send");
    conn.read_exact(&mut back).expect("echo");
    let p2 = node.add_pod("p2").expect("ADD p2");
    node.del_pod(&p2, &p2.netns.path().display().to_string()).expect("DEL").expect("DEL ok");
    conn.write_all(b"two.").expect("send after another pod came and went");
    conn.read_exact(&mut back).expect("echo after another pod came and went");
    assert_eq!(&back, b"two.");
}

#[test]
fn a_pod_removed_with_connections_open_has_them_closed_and_is_no_longer_served() {
    let node = CniNode::start(&workloads(2)).expect("node");
    let (p0, p1) = two_pods(&node);
    let dst = SocketAddr::new(p1.ip, 8080);
    let mut conn = p0.connect(dst).expect("connect");
    let mut back = [0u8; 4];
    conn.write_all(b"one.").expect("send");
    conn.read_exact(&mut back).expect("echo");
    node.del_pod(&p0, &p0.netns.path().display().to_string()).expect("DEL").expect("DEL ok");
    // The proxy ended the pod's connections: the app sees its connection end.
    let mut ended = false;
    for _ in 0..50 {
        match meshpath_tests::again_after_eintr(|| conn.read(&mut back)) {
            Ok(0) | Err(_) => {
                ended = true;
                break;
            }
            Ok(_) => {}
        }
    }
    assert!(ended, "a removed pod's connection stayed open");
    let mut pods = node.proxy_pods().expect("pods");
    pods.sort();
    assert_eq!(pods, vec!["uid-p1"]);
    // Not enrolled any more: p0's traffic is no longer captured (it goes straight out).
    assert_eq!(node.enrolled().len(), 1);
}

#[test]
fn a_new_proxy_takes_over_the_bypass_only_once_it_acknowledged_its_snapshot() {
    let mut node = CniNode::bare(&workloads(1)).expect("node");
    node.start_agent_with(&["--ack-timeout-seconds".into(), "2".into()]).expect("agent");
    // ztunnel-like as the serving proxy: it does not reconnect (and re-register) when the agent
    // drops its connection for the newcomer, so what the map holds is the agent's doing.
    node.start_ztunnel_like().expect("proxy");
    let _p0 = node.add_pod("p0").expect("ADD p0");
    let dp = || node.root.datapath().expect("datapath");
    let old = meshpath_loader::datapath::cgroup_id(node.proxy_cgroup.path()).expect("old cgroup");
    // A second proxy, in a cgroup of its own, that connects and never acknowledges its snapshot.
    let new_cgroup = meshpath_tests::CgroupGuard::new().expect("cgroup");
    let new = meshpath_loader::datapath::cgroup_id(new_cgroup.path()).expect("new cgroup");
    let mut cmd = std::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", node.node.path().display()))
        .arg(meshpath_tests::sibling_bin("ztunnel-like"))
        .arg(node.zds_socket())
        .arg(node.dir.join("ca.pem"))
        .arg(node.dir.join("ca-key.pem"))
        .arg(node.dir.join("workloads.yaml"))
        .env("ZTUNNEL_LIKE_NO_SNAPSHOT_ACK", "1");
    let stalled = meshpath_tests::TestProxy::spawn(cmd, &new_cgroup).expect("stalled proxy");
    // Past the agent's ack timeout: the snapshot was never acknowledged.
    std::thread::sleep(Duration::from_secs(3));
    let ids = dp().proxy_cgroup_ids().expect("PROXY_CGROUPS");
    assert!(ids.contains(&old), "the serving proxy lost its bypass to one that never took over");
    assert!(!ids.contains(&new), "a proxy that never acknowledged kept a bypass: {ids:?}");
    drop(stalled);
}

#[test]
fn a_proxy_that_acknowledges_a_snapshot_pod_late_loses_its_session_and_no_later_request_takes_that_ack(
) {
    let mut node = CniNode::bare(&workloads(2)).expect("node");
    node.start_agent_with(&["--ack-timeout-seconds".into(), "1".into()]).expect("agent");
    node.start_ztunnel_like().expect("proxy");
    let _p0 = node.add_pod("p0").expect("ADD p0");
    // A new proxy whose ack for p0 (the snapshot's only pod) comes a second after the agent's
    // timeout. Acks carry no id: were the session kept, that ack would answer `SnapshotSent`,
    // and the ack of `SnapshotSent` the next ADD.
    let late_cgroup = meshpath_tests::CgroupGuard::new().expect("cgroup");
    let mut cmd = std::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", node.node.path().display()))
        .arg(meshpath_tests::sibling_bin("ztunnel-like"))
        .arg(node.zds_socket())
        .arg(node.dir.join("ca.pem"))
        .arg(node.dir.join("ca-key.pem"))
        .arg(node.dir.join("workloads.yaml"))
        .env("ZTUNNEL_LIKE_LATE_FIRST_ACK_MS", "2000");
    let late = meshpath_tests::TestProxy::spawn_unready(cmd, &late_cgroup).expect("late proxy");
    let agent = node.agent.as_ref().expect("agent");
    let gave_up = agent.wait_for_text("did not ack within", Duration::from_secs(30));
    assert!(gave_up, "the agent kept the late proxy's session: {:#?}", agent.lines());
    // The agent gave the session up: with no proxy (this one does not reconnect), an ADD fails
    // rather than succeeding on an ack that answered something else.
    let added = node.add_pod("p1");
    assert!(added.is_err(), "an ADD succeeded on a stale ack of a session that lost its place");
    drop(late);
}
