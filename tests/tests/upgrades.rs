//! A node's datapath upgraded in place, from a real older version: the previous release's
//! loader (its git tag, built by `cargo xtask test`: xtask/src/previous.rs) pins the datapath
//! and enrols a pod, a proxy serves it, and this version's loader takes the pins over while the
//! pod's connections run both ways (loader/src/datapath/upgrade.rs):
//!
//! - every connection made across it is answered by the proxy, none refused, none reaching its
//!   destination around the proxy (a real listener there must see nothing);
//! - every hook runs the new programs (the node's cgroup links, the pod's sk_lookup link, its
//!   TC guard filter: one, the new one), the pod is still enrolled, the map whose size changed
//!   has its new size, and the pins say which datapath they hold;
//! - an upgrade to the same datapath keeps every map; a map whose size changed is replaced by
//!   one of the new size holding its entries;
//! - a datapath whose map cannot be carried over is refused with a clear error, and keeps
//!   working as it was: no program replaced, the pod still captured.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::Output,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use aya::{
    maps::MapData,
    programs::links::{FdLink, PinnedLink},
};
use datapath_common::{
    consts::{map_names, pins, ports, programs, ORIG_DST_BY_CONN_ENTRIES},
    ConnKey, OrigDst,
};
use meshpath_loader::{datapath::upgrade, pods::link_pins};
use meshpath_podnet::rtnetlink::{self, ClsactHook};
use meshpath_tests::{
    loader, previous_loader, require_root, sibling_bin, CgroupGuard, NetnsGuard, PinRoot, PodPair,
    Sentinel, TestProxy,
};

/// The port pod a's app connects to in pod b (outbound), and the port pod b connects to in
/// pod a (inbound): both captured, both with a real listener behind them.
const OUT_PORT: u16 = 8080;
const IN_PORT: u16 = 9090;
/// The pause between one loop's connections: about 700 a second each way on this machine, so
/// that connections are in every stage of their setup while the hooks switch (each takes an
/// ephemeral port of pod a's for a minute after it closes: this stays well below their 28,000).
const EVERY: Duration = Duration::from_millis(1);

/// Pod a enrolled with outbound and inbound capture by `enrol` (a loader of either version),
/// served by the test proxy in echo mode (it answers each captured connection itself, saying
/// where it was going), sentinels at both real destinations.
struct Node {
    proxy: TestProxy,
    sentinels: [Sentinel; 2],
    _cgroup: CgroupGuard,
    pods: PodPair,
    root: PinRoot,
}

impl Node {
    fn enrolled_by(run: fn(&PinRoot, &[&str]) -> Output) -> Self {
        Self::enrolled_with(run, &[])
    }

    /// As [`Node::enrolled_by`], the proxy started with `proxy_env` as well.
    fn enrolled_with(run: fn(&PinRoot, &[&str]) -> Output, proxy_env: &[(&str, &str)]) -> Self {
        require_root();
        let (root, pods, cgroup) =
            (PinRoot::new(), PodPair::new().expect("pods"), CgroupGuard::new().expect("cgroup"));
        let cg = cgroup.path().display().to_string();
        succeeded(run(&root, &["proxy-cgroup", "--cgroup", &cg]), "registering the proxy cgroup");
        let a = pods.a.path().display().to_string();
        let enrol = ["enrol", "--netns", &a, "--capture-outbound", "--capture-inbound"];
        succeeded(run(&root, &enrol), "enrolling pod a");
        let proxy = TestProxy::start(
            &sibling_bin("meshpath-test-proxy"),
            &pods.a.path(),
            &cgroup,
            "echo",
            true,
            &[[("MESHPATH_TEST_PROXY_QUIET", "1")].as_slice(), proxy_env].concat(),
        )
        .expect("the proxy in pod a");
        let sentinels = [
            Sentinel::new(&pods.b, SocketAddr::from((pods.b_ip, OUT_PORT))),
            Sentinel::new(&pods.a, SocketAddr::from((pods.a_ip, IN_PORT))),
        ];
        Self { proxy, sentinels, _cgroup: cgroup, pods, root }
    }

    fn outbound(&self) -> SocketAddr {
        SocketAddr::from((self.pods.b_ip, OUT_PORT))
    }

    fn inbound(&self) -> SocketAddr {
        SocketAddr::from((self.pods.a_ip, IN_PORT))
    }

    /// One connection from `from` to `to`, answered by the proxy: its line, or why not.
    fn ask(from: &NetnsGuard, to: SocketAddr) -> Result<String, String> {
        let ns = from.open().map_err(|e| e.to_string())?;
        let conn = ns
            .run(|| TcpStream::connect_timeout(&to, Duration::from_secs(5)))
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("connect: {e}"))?;
        conn.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(conn).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
        Ok(line.trim_end().to_owned())
    }

    /// Pod a's captured connection out and pod b's captured connection in, each answered by
    /// the proxy.
    fn assert_captured(&self, when: &str) {
        let out = Self::ask(&self.pods.a, self.outbound());
        assert_eq!(out, Ok(format!("ORIG_DST {}", self.outbound())), "{when}: pod a's outbound");
        let inbound = Self::ask(&self.pods.b, self.inbound());
        let want = format!("INBOUND {} FROM {}", self.inbound(), self.pods.b_ip);
        assert!(
            inbound.as_ref().is_ok_and(|l| l.starts_with(&want)),
            "{when}: pod b's connection to pod a: {inbound:?}"
        );
        for s in &self.sentinels {
            s.assert_untouched(when);
        }
    }

    /// A connection every 20 ms from pod a out and from pod b in, until `stop`; each answer
    /// checked. Returns (answered, failures).
    fn loops(&self, stop: &Arc<AtomicBool>) -> Vec<JoinHandle<(usize, Vec<String>)>> {
        let runs = [
            (self.pods.a.path(), self.outbound(), format!("ORIG_DST {}", self.outbound())),
            (
                self.pods.b.path(),
                self.inbound(),
                format!("INBOUND {} FROM {}", self.inbound(), self.pods.b_ip),
            ),
        ];
        runs.into_iter()
            .map(|(ns, to, want)| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let from = meshpath_loader::netns::Netns::open(&ns).expect("netns");
                    let (mut answered, mut failures) = (0, Vec::new());
                    let started = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        let at = started.elapsed();
                        let got = from
                            .run(|| TcpStream::connect_timeout(&to, Duration::from_secs(5)))
                            .expect("enter netns")
                            .map_err(|e| format!("connect: {e}"))
                            .and_then(|c| {
                                c.set_read_timeout(Some(Duration::from_secs(5)))
                                    .map_err(|e| e.to_string())?;
                                let mut line = String::new();
                                BufReader::new(c)
                                    .read_line(&mut line)
                                    .map_err(|e| format!("read: {e}"))?;
                                Ok(line)
                            });
                        match got {
                            Ok(line) if line.starts_with(&want) => answered += 1,
                            other => failures.push(format!("{to} at {at:?}: {other:?}")),
                        }
                        std::thread::sleep(EVERY);
                    }
                    (answered, failures)
                })
            })
            .collect()
    }
}

fn succeeded(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The program each pinned link under `dir` runs, by pin name.
fn link_programs(dir: &Path) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = std::fs::read_dir(dir)
        .expect("links directory")
        .flatten()
        .map(|e| {
            let link = FdLink::from(PinnedLink::from_pin(e.path()).expect("pinned link"));
            let id = link.info().expect("link info").program_id();
            (e.file_name().to_string_lossy().into_owned(), id)
        })
        .collect();
    out.sort();
    out
}

/// The program ids of the filters named `name` on pod a's eth0 egress hook.
fn filter_programs(pods: &PodPair, name: &str) -> Vec<u32> {
    let ns = pods.a.open().expect("netns a");
    ns.run(|| {
        let ifindex = nix::net::if_::if_nametoindex("eth0").expect("eth0");
        let mut rt = rtnetlink::Socket::open().expect("rtnetlink");
        rt.bpf_filters(ifindex, ClsactHook::Egress)
            .expect("listing filters")
            .into_iter()
            .filter(|f| f.name == name)
            .map(|f| f.program_id)
            .collect()
    })
    .expect("run in pod a")
}

fn pinned_program_id(root: &PinRoot, name: &str) -> u32 {
    let pin = root.path().join(pins::PROGRAMS_DIR).join(name);
    aya::programs::SchedClassifier::from_pin(pin)
        .expect("pinned program")
        .info()
        .expect("program info")
        .id()
}

fn map_max_entries(root: &PinRoot, name: &str) -> u32 {
    let pin = root.path().join(pins::MAPS_DIR).join(name);
    MapData::from_pin(pin).expect("pinned map").info().expect("map info").max_entries()
}

fn map_id(root: &PinRoot, name: &str) -> u32 {
    let pin = root.path().join(pins::MAPS_DIR).join(name);
    MapData::from_pin(pin).expect("pinned map").info().expect("map info").id()
}

/// A pinned hash map of connection entries.
fn conn_map(root: &PinRoot, name: &str) -> aya::maps::HashMap<MapData, ConnKey, OrigDst> {
    let pin = root.path().join(pins::MAPS_DIR).join(name);
    aya::maps::HashMap::try_from(aya::maps::Map::HashMap(
        MapData::from_pin(pin).expect("pinned map"),
    ))
    .expect("a hash of connection entries")
}

/// The version the pins record (0: none).
fn pinned_version(root: &PinRoot) -> u64 {
    let pin = root.path().join(pins::MAPS_DIR).join(map_names::DATAPATH_VERSION);
    if !pin.exists() {
        return 0;
    }
    let map = aya::maps::Array::<MapData, u64>::try_from(aya::maps::Map::Array(
        MapData::from_pin(pin).expect("version map"),
    ))
    .expect("an array");
    map.get(&0, 0).expect("version")
}

fn pod_dirs(root: &PinRoot) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(root.path().join(pins::PODS_DIR))
        .expect("pods directory")
        .flatten()
        .map(|e| e.path())
        .collect()
}

#[test]
fn a_datapath_pinned_by_the_previous_release_is_upgraded_in_place_while_connections_run() {
    let node = Node::enrolled_by(previous_loader);
    node.assert_captured("under the previous release's datapath");
    let node_links = node.root.path().join(pins::NODE_LINKS_DIR);
    let before = link_programs(&node_links);
    let [pod_dir] = pod_dirs(&node.root).try_into().expect("one pod enrolled");
    let sk_lookup_before = link_programs(&pod_dir);
    let guard_before = filter_programs(&node.pods, programs::TC_POD_GUARD);
    assert_eq!(guard_before.len(), 1, "the previous release's guard on pod a's eth0");
    assert_eq!(pinned_version(&node.root), 0, "meshpath 0.1.0 records no version");
    let replaced_map = map_id(&node.root, map_names::ORIG_DST_BY_CONN);
    assert!(MapData::from_id(replaced_map).is_ok(), "the previous release's map, found by id");

    let stop = Arc::new(AtomicBool::new(false));
    let loops = node.loops(&stop);
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    let out = reconcile_logged(&node.root);
    let took = started.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    succeeded(out.clone(), "this version's loader on the previous release's pins");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("datapath upgraded in place"), "no upgrade in the log:\n{log}");
    let upgrade_line = log.lines().find(|l| l.contains("datapath upgraded in place"));
    println!("the loader process that upgraded the datapath took {took:?}: {upgrade_line:?}");
    for (i, handle) in loops.into_iter().enumerate() {
        let (answered, failures) = handle.join().expect("loop thread");
        println!("loop {i}: {answered} answered, {} failed", failures.len());
        assert!(failures.is_empty(), "connections across the upgrade failed: {failures:#?}");
        assert!(answered >= 100, "loop {i}: only {answered} connections in 2 s");
    }
    node.assert_captured("under this version's datapath");

    let after = link_programs(&node_links);
    assert_eq!(after.len(), before.len(), "the same node hooks: {before:?} → {after:?}");
    for ((name, old), (_, new)) in before.iter().zip(&after) {
        assert_ne!(old, new, "node link {name} still runs the previous release's program");
    }
    let sk_lookup_after = link_programs(&pod_dir);
    let sk_lookup = |l: &[(String, u32)]| {
        l.iter().find(|(n, _)| n == link_pins::SK_LOOKUP).map(|(_, id)| *id).expect("sk_lookup")
    };
    assert_ne!(sk_lookup(&sk_lookup_before), sk_lookup(&sk_lookup_after), "pod a's sk_lookup");
    assert_eq!(
        filter_programs(&node.pods, programs::TC_POD_GUARD),
        vec![pinned_program_id(&node.root, programs::TC_POD_GUARD)],
        "pod a's eth0 has one guard, the new one"
    );
    assert_eq!(pod_dirs(&node.root), vec![pod_dir], "pod a is still enrolled, as it was");
    assert_eq!(
        map_max_entries(&node.root, map_names::ORIG_DST_BY_CONN),
        ORIG_DST_BY_CONN_ENTRIES,
        "ORIG_DST_BY_CONN has this version's size"
    );
    assert_eq!(pinned_version(&node.root), upgrade::version());
    // The replaced map was the new programs' fallback while the upgrade ran; then the readers
    // were linked again without it, and nothing holds it any more.
    assert_eq!(map_max_entries(&node.root, map_names::ORIG_DST_BY_CONN_PREVIOUS), 1);
    let freed = Instant::now() + Duration::from_secs(10);
    while MapData::from_id(replaced_map).is_ok() {
        assert!(Instant::now() < freed, "the replaced ORIG_DST_BY_CONN is still held");
        std::thread::sleep(Duration::from_millis(50));
    }
    let leftovers: Vec<_> = walk(node.root.path())
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(pins::NEXT_SUFFIX))
        .collect();
    assert!(leftovers.is_empty(), "pins left half-way: {leftovers:?}");
    drop(node.proxy);
}

/// During an upgrade that replaces `ORIG_DST_BY_CONN`, an old program may file a connection's
/// entry in the old map after its entries were copied, and a new program take it at the
/// proxy's end a moment later: the new programs look in the replaced map too (their fallback,
/// `ORIG_DST_BY_CONN_PREVIOUS`). Staged on this version's datapath, where the moment can be
/// held open: the proxy's listener defers its end of a connection until the app's first byte
/// (TCP_DEFER_ACCEPT), and the test moves the app end's entry into the fallback before sending
/// it. The proxy answers with the original destination, and the entry is taken from the
/// fallback; without the fallback the proxy's getsockopt finds nothing and the connection is
/// refused.
#[test]
fn a_connection_filed_in_the_map_an_upgrade_replaces_is_found_by_the_new_programs() {
    let node = Node::enrolled_with(loader, &[("MESHPATH_TEST_PROXY_DEFER_ACCEPT", "1")]);
    let ns = node.pods.a.open().expect("netns a");
    let mut conn = ns
        .run(|| TcpStream::connect_timeout(&node.outbound(), Duration::from_secs(5)))
        .expect("enter netns a")
        .expect("pod a's app connects (its end is established)");
    let port = conn.local_addr().expect("local address").port();
    let mut current = conn_map(&node.root, map_names::ORIG_DST_BY_CONN);
    let mut fallback = conn_map(&node.root, map_names::ORIG_DST_BY_CONN_PREVIOUS);
    let (key, dst) = current
        .iter()
        .flatten()
        .find(|(k, _)| k.port == port && k.proxy_port == ports::OUTBOUND)
        .expect("the app's end filed its original destination");
    current.remove(&key).expect("taking the entry out of ORIG_DST_BY_CONN");
    fallback.insert(key, dst, 0).expect("filing it in the fallback, as an old program would");

    conn.write_all(b"x").expect("the app's first byte");
    conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut line = String::new();
    let got = BufReader::new(&conn).read_line(&mut line).map(|_| line.trim_end().to_owned());
    assert_eq!(
        got.map_err(|e| e.to_string()),
        Ok(format!("ORIG_DST {}", node.outbound())),
        "the proxy's answer"
    );
    assert!(fallback.get(&key, 0).is_err(), "the entry is still in the fallback");
    assert!(current.get(&key, 0).is_err(), "the entry came back to ORIG_DST_BY_CONN");
    for s in &node.sentinels {
        s.assert_untouched("a connection taken from the fallback");
    }
    drop(node.proxy);
}

/// A rollback (`kubectl rollout undo` of the agent): the previous release's loader on pins this
/// version wrote. It has no code to take a newer datapath over; what it must not do is break
/// the one running. The pod stays captured throughout, and this version's loader, back again,
/// finds its own datapath and keeps it as it is.
#[test]
fn a_rollback_to_the_previous_release_leaves_this_versions_datapath_capturing() {
    let node = Node::enrolled_by(loader);
    let node_links = node.root.path().join(pins::NODE_LINKS_DIR);
    let before = link_programs(&node_links);
    let out = previous_loader(&node.root, &["reconcile"]);
    println!(
        "the previous release's loader on this version's pins: {}; {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    node.assert_captured("after the previous release's loader ran");
    assert_eq!(link_programs(&node_links), before, "the previous release replaced a program");
    assert_eq!(pinned_version(&node.root), upgrade::version(), "the version record changed");
    let again = reconcile_logged(&node.root);
    succeeded(again.clone(), "this version's loader after the rollback");
    let log = String::from_utf8_lossy(&again.stderr);
    assert!(!log.contains("datapath upgraded in place"), "upgraded its own datapath:\n{log}");
    assert_eq!(link_programs(&node_links), before, "this version replaced its own programs");
    node.assert_captured("after this version's loader came back");
    drop(node.proxy);
}

/// Every pin under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn an_upgrade_to_the_same_datapath_keeps_every_map_and_replaces_every_program() {
    let node = Node::enrolled_by(loader);
    let node_links = node.root.path().join(pins::NODE_LINKS_DIR);
    let before = link_programs(&node_links);
    forget_version(&node.root);
    let out = reconcile_logged(&node.root);
    succeeded(out.clone(), "the loader on pins whose version was cleared");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("datapath upgraded in place"), "no upgrade in the log:\n{log}");
    assert!(
        log.contains("maps_copied=[]") && log.contains("maps_replaced=[]"),
        "a map was replaced although every layout is the same:\n{log}"
    );
    let after = link_programs(&node_links);
    for ((name, old), (_, new)) in before.iter().zip(&after) {
        assert_ne!(old, new, "node link {name} was not updated");
    }
    node.assert_captured("after the upgrade");
    assert_eq!(pinned_version(&node.root), upgrade::version());
    drop(node.proxy);
}

#[test]
fn a_datapath_whose_map_cannot_be_carried_over_is_refused_and_keeps_running() {
    let node = Node::enrolled_by(loader);
    let node_links = node.root.path().join(pins::NODE_LINKS_DIR);
    let before = link_programs(&node_links);
    // Pinned in POD_ADDRS's place: a map of another value layout, as a future version's would
    // be (the programs keep the map they were loaded with; only the pin changes).
    let pin = node.root.path().join(pins::MAPS_DIR).join(map_names::POD_ADDRS);
    let real = node.root.path().join("POD_ADDRS-real");
    std::fs::rename(&pin, &real).expect("moving the pin aside");
    let created = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&pin)
        .args(["type", "hash", "key", "8", "value", "4", "entries", "16", "name", "POD_ADDRS"])
        .output()
        .expect("bpftool");
    succeeded(created, "bpftool map create");
    forget_version(&node.root);

    let out = loader(&node.root, &["reconcile"]);
    assert!(!out.status.success(), "the loader took pins it cannot carry over");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot be upgraded in place: its map POD_ADDRS")
            && err.contains("keeps the datapath it has"),
        "unclear refusal:\n{err}"
    );
    assert_eq!(link_programs(&node_links), before, "a program was replaced all the same");
    assert_eq!(pinned_version(&node.root), 0, "the refused version was recorded");
    node.assert_captured("after the refusal");
    std::fs::rename(&real, &pin).expect("putting the pin back");
    drop(node.proxy);
}

#[test]
fn the_entries_of_a_map_whose_size_changed_are_carried_into_the_new_map() {
    let node = Node::enrolled_by(loader);
    // In ORIG_DST_BY_CONN's place: the same layout with meshpath 0.1.0's capacity and flags,
    // holding three connections' entries (the live map's last only a loopback handshake).
    let pin = node.root.path().join(pins::MAPS_DIR).join(map_names::ORIG_DST_BY_CONN);
    std::fs::remove_file(&pin).expect("unpinning the map");
    let bpftool = |args: &[&str]| {
        let out = std::process::Command::new("bpftool").args(args).output().expect("bpftool");
        succeeded(out, &format!("bpftool {}", args.join(" ")));
    };
    let pin_s = pin.display().to_string();
    let (key_size, value_size) = (size_of::<ConnKey>(), size_of::<OrigDst>());
    bpftool(&[
        "map",
        "create",
        &pin_s,
        "type",
        "hash",
        "key",
        &key_size.to_string(),
        "value",
        &value_size.to_string(),
        "entries",
        "65536",
        "name",
        "ORIG_DST_BY_CONN",
    ]);
    let entries: Vec<(ConnKey, OrigDst)> = (0..3u16)
        .map(|i| {
            let key =
                ConnKey { netns: 7, port: 40_000 + i, ip_version: 4, proxy_port: 15001, _pad: 0 };
            let dst = OrigDst {
                addr: [u32::from_ne_bytes([10, 0, 0, i as u8]), 0, 0, 0],
                port: 80u16.to_be(),
                family: datapath_common::AF_INET,
            };
            (key, dst)
        })
        .collect();
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>();
    for (key, dst) in &entries {
        // SAFETY: both are plain #[repr(C)] data without padding bytes left uninitialised.
        let (k, v) = unsafe {
            (
                std::slice::from_raw_parts((key as *const ConnKey).cast::<u8>(), key_size),
                std::slice::from_raw_parts((dst as *const OrigDst).cast::<u8>(), value_size),
            )
        };
        let mut args = vec![
            "map".to_owned(),
            "update".into(),
            "pinned".into(),
            pin_s.clone(),
            "key".into(),
            "hex".into(),
        ];
        args.extend(hex(k));
        args.extend(["value".to_owned(), "hex".into()]);
        args.extend(hex(v));
        bpftool(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }
    forget_version(&node.root);

    let out = reconcile_logged(&node.root);
    succeeded(out.clone(), "the loader on pins with a smaller ORIG_DST_BY_CONN");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains(r#"maps_copied=[("ORIG_DST_BY_CONN", 3)]"#), "{log}");
    assert_eq!(map_max_entries(&node.root, map_names::ORIG_DST_BY_CONN), ORIG_DST_BY_CONN_ENTRIES);
    let map: aya::maps::HashMap<MapData, ConnKey, OrigDst> = aya::maps::HashMap::try_from(
        aya::maps::Map::HashMap(MapData::from_pin(&pin).expect("the new map")),
    )
    .expect("a hash");
    for (key, dst) in &entries {
        assert_eq!(map.get(key, 0).ok().as_ref(), Some(dst), "entry {key:?} carried over");
    }
    node.assert_captured("after the map was replaced");
    drop(node.proxy);
}

/// This version's `meshpath-loader reconcile` on the pins, its log at `info` (a one-shot
/// command logs only warnings by default).
fn reconcile_logged(root: &PinRoot) -> Output {
    std::process::Command::new(meshpath_tests::loader_bin())
        .arg("--pin-root")
        .arg(root.path())
        .arg("reconcile")
        .env("RUST_LOG", "info")
        .output()
        .expect("running meshpath-loader")
}

/// Clears the version the pins record, as if another meshpath had pinned them.
fn forget_version(root: &PinRoot) {
    let pin = root.path().join(pins::MAPS_DIR).join(map_names::DATAPATH_VERSION);
    let mut map = aya::maps::Array::<MapData, u64>::try_from(aya::maps::Map::Array(
        MapData::from_pin(pin).expect("version map"),
    ))
    .expect("an array");
    map.set(0, 0, 0).expect("clearing the version");
}
