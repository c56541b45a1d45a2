//! Pod lifecycle around the datapath: pods whose netns vanished are reclaimed, a killed loader's
//! half-done work is cleaned up, enrol/unenrol at volume leaves nothing behind, removing a pod
//! never takes an address another pod holds, and capture never depends on a loader process
//! being alive.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use datapath_common::{cidr_action, direction, pod_flags, PortKey};
use meshpath_loader::pods::{self, EnrolOptions};
use meshpath_tests::{loader, loader_bin, require_root, Mesh, PinRoot, PodPair};

fn full_capture() -> EnrolOptions {
    EnrolOptions {
        capture_outbound: true,
        capture_inbound: true,
        capture_dns: true,
        exclude_outbound_ports: vec![9090],
        exclude_inbound_ports: vec![2222],
        ..EnrolOptions::default()
    }
}

#[test]
fn a_netns_deleted_without_unenrol_is_reclaimed_by_reconcile() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &full_capture()).expect("enrol a");
    let b = pods::enrol(&dp, &pods.b.open().expect("netns b"), &full_capture()).expect("enrol b");

    pods.a.delete().expect("delete netns a");
    // The kernel tears a netns down asynchronously: reconcile until it notices (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut vanished = Vec::new();
    while vanished.is_empty() && Instant::now() < deadline {
        vanished.extend(pods::reconcile(&dp).expect("reconcile").vanished);
        std::thread::sleep(Duration::from_millis(50));
    }

    assert_eq!(vanished, [a]);
    assert!(!dp.pod_dir(a).exists());
    assert!(dp.excluded_ports().expect("map").keys().flatten().all(|k| k.netns != a));
    let left: Vec<u64> = pods::list(&dp).expect("list").iter().map(|p| p.cookie).collect();
    assert_eq!(left, [b], "the live pod must be kept");
}

#[test]
fn reconcile_removes_a_half_done_enrolment_and_keeps_live_pods() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &full_capture()).expect("enrol a");
    // What a loader killed between creating the pod directory and recording the pod leaves.
    let orphan = dp.pod_dir(999_999_999);
    std::fs::create_dir(&orphan).expect("orphan dir");

    let report = pods::reconcile(&dp).expect("reconcile");

    assert_eq!(report.partial, [999_999_999]);
    assert_eq!(report.kept, [a]);
    assert!(report.vanished.is_empty());
    assert!(!orphan.exists());
}

fn exclusion_entries(dp: &meshpath_loader::datapath::Datapath) -> (usize, usize) {
    let ports = dp.excluded_ports().expect("EXCLUDED_PORTS").keys().count();
    (ports, dp.excluded_cidrs().expect("EXCLUDED_CIDRS").keys().count())
}

/// A pod enrolled with no excluded port, or no prefix rule, is noted so in `PODS`, and its
/// removal does not walk that exclusion map: an entry planted there under its cookie stays. The
/// map it has entries in is walked, and all of its entries go.
#[test]
fn a_pods_removal_walks_only_the_exclusion_maps_it_has_entries_in() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let base = EnrolOptions { counters: false, capture_outbound: true, ..EnrolOptions::default() };
    let ports_only = EnrolOptions { exclude_outbound_ports: vec![9090], ..base.clone() };
    let prefixes_only = EnrolOptions {
        exclude_outbound_cidrs: vec!["10.250.0.0/16".parse().expect("cidr")],
        ..base.clone()
    };
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &ports_only).expect("enrol a");
    let b = pods::enrol(&dp, &pods.b.open().expect("netns b"), &prefixes_only).expect("enrol b");
    let flags = |cookie| dp.pods().expect("PODS").get(&cookie, 0).expect("PODS entry").flags;
    let notes = pod_flags::NO_EXCLUDED_PORTS | pod_flags::NO_PREFIX_RULES;
    assert_eq!(flags(a) & notes, pod_flags::NO_PREFIX_RULES, "pod a has excluded ports only");
    assert_eq!(flags(b) & notes, pod_flags::NO_EXCLUDED_PORTS, "pod b has prefix rules only");
    // Planted in the map each pod has nothing in: a walk of it would take them.
    let planted_port = PortKey { netns: b, port: 1, direction: direction::OUTBOUND, _pad: 0 };
    dp.excluded_ports().expect("EXCLUDED_PORTS").insert(planted_port, 1, 0).expect("plant");
    let net = "10.251.0.0/16".parse().expect("cidr");
    let planted_prefix = pods::cidr_key(a, direction::OUTBOUND, net);
    let mut cidrs = dp.excluded_cidrs().expect("EXCLUDED_CIDRS");
    cidrs.insert(&planted_prefix, cidr_action::EXCLUDE, 0).expect("plant");
    assert_eq!(exclusion_entries(&dp), (2, 2));

    pods::unenrol(&dp, a).expect("unenrol a");
    assert_eq!(exclusion_entries(&dp), (1, 2), "pod a's port left, or a prefix map walk");
    pods::unenrol(&dp, b).expect("unenrol b");
    assert_eq!(exclusion_entries(&dp), (1, 1), "pod b's prefix left, or a port map walk");
}

/// Exclusion entries under a cookie no enrolled pod has (a loader killed after writing them,
/// before the pod's directory) are removed by reconcile; a live pod's are kept.
#[test]
fn reconcile_removes_exclusion_entries_no_enrolled_pod_owns() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let opts = EnrolOptions { counters: false, ..full_capture() };
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &opts).expect("enrol a");
    let nobody = 999_999_997;
    let port = PortKey { netns: nobody, port: 9090, direction: direction::OUTBOUND, _pad: 0 };
    dp.excluded_ports().expect("EXCLUDED_PORTS").insert(port, 1, 0).expect("plant");
    let prefix =
        pods::cidr_key(nobody, direction::OUTBOUND, "10.251.0.0/16".parse().expect("cidr"));
    let mut cidrs = dp.excluded_cidrs().expect("EXCLUDED_CIDRS");
    cidrs.insert(&prefix, cidr_action::EXCLUDE, 0).expect("plant");
    assert_eq!(exclusion_entries(&dp), (3, 1), "pod a's two ports and the planted entries");

    let report = pods::reconcile(&dp).expect("reconcile");

    assert_eq!(report.kept, [a]);
    assert_eq!(exclusion_entries(&dp), (2, 0), "the planted entries stayed, or pod a's went");
    assert!(dp.excluded_ports().expect("map").keys().flatten().all(|k| k.netns == a));
}

#[test]
fn a_thousand_enrol_unenrol_cycles_leave_no_map_entry_and_no_pin() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let ns = pods.a.open().expect("netns a");
    // Counters off: their TCX attachment costs an RCU grace period each and is covered by
    // pod_counters.rs; everything capture needs is exercised every cycle.
    let opts = EnrolOptions { counters: false, ..full_capture() };
    for i in 0..1000 {
        let cookie = pods::enrol(&dp, &ns, &opts).unwrap_or_else(|e| panic!("enrol #{i}: {e}"));
        pods::unenrol(&dp, cookie).unwrap_or_else(|e| panic!("unenrol #{i}: {e}"));
    }
    assert!(root.pod_pins().is_empty(), "pins left: {:?}", root.pod_pins());
    assert_eq!(dp.pods().expect("PODS").keys().count(), 0);
    assert_eq!(dp.counters().expect("COUNTERS").keys().count(), 0);
    assert_eq!(dp.excluded_ports().expect("EXCLUDED_PORTS").keys().count(), 0);
    assert_eq!(dp.inbound_listeners().expect("INBOUND_LISTENERS").keys().count(), 0);
    assert_eq!(dp.pod_ips().expect("POD_IPS").keys().count(), 0);
    assert_eq!(dp.pod_addrs().expect("POD_ADDRS").keys().count(), 0);
}

#[test]
fn a_pod_with_two_addresses_of_one_family_leaves_neither_behind_and_other_pods_keep_theirs() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let two_v4: Vec<std::net::IpAddr> =
        vec![pods.a_ip.into(), "10.254.0.9".parse().expect("ip"), "fd00::9".parse().expect("ip")];
    let a = pods::enrol(
        &dp,
        &pods.a.open().expect("netns a"),
        &EnrolOptions { counters: false, pod_ips: two_v4, ..full_capture() },
    )
    .expect("enrol a");
    let b = pods::enrol(
        &dp,
        &pods.b.open().expect("netns b"),
        &EnrolOptions { counters: false, ..full_capture() },
    )
    .expect("enrol b");
    let owners = |dp: &meshpath_loader::datapath::Datapath| -> Vec<u64> {
        let mut v: Vec<u64> =
            dp.pod_ips().expect("POD_IPS").iter().flatten().map(|(_, c)| c).collect();
        v.sort();
        v
    };
    assert_eq!(owners(&dp).iter().filter(|&&c| c == a).count(), 3, "pod a's three addresses");
    // Removal by address for pod b (one address per family), by walking POD_IPS for pod a.
    let by_address = |cookie| {
        dp.pods().expect("PODS").get(&cookie, 0).expect("PODS entry").flags
            & pod_flags::ADDRESSES_IN_POD_ADDRS
            != 0
    };
    assert!(!by_address(a) && by_address(b));
    let b_before = owners(&dp).iter().filter(|&&c| c == b).count();
    assert!(b_before >= 1, "pod b has its address");

    pods::unenrol(&dp, a).expect("unenrol a");
    assert!(!owners(&dp).contains(&a), "an address of pod a is left in POD_IPS");
    assert_eq!(owners(&dp).iter().filter(|&&c| c == b).count(), b_before, "pod b lost an address");
    pods::unenrol(&dp, b).expect("unenrol b");
    assert!(owners(&dp).is_empty());
}

#[test]
fn capture_carries_on_while_loader_processes_are_killed_and_restarted() {
    let mut mesh = Mesh::new(EnrolOptions { capture_outbound: true, ..EnrolOptions::default() });
    mesh.start_proxy("forward");
    let b_ip = std::net::IpAddr::from(mesh.pods.b_ip);
    let _server = mesh.pods.b.iperf3_server(b_ip, 5298, true).expect("iperf3 -s");
    let report = std::thread::scope(|scope| {
        let client =
            scope.spawn(|| mesh.pods.a.iperf3_client(b_ip, 5298, &["-t", "4", "-i", "0.5"]));
        // Meanwhile: loader processes enrol and remove pod b, some killed with SIGKILL mid-way.
        let b = mesh.pods.b.path().display().to_string();
        let started = Instant::now();
        let mut kills = 0;
        while started.elapsed() < Duration::from_secs(3) {
            let mut enrol = Command::new(loader_bin())
                .arg("--pin-root")
                .arg(mesh.root.path())
                .args(["enrol", "--netns", &b, "--no-counters"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("loader");
            std::thread::sleep(Duration::from_millis(kills % 7));
            if enrol.try_wait().expect("wait").is_none() {
                kills += 1;
            }
            let _ = enrol.kill();
            let _ = enrol.wait();
            // The restarted loader cleans up whatever the killed one left, then carries on.
            let out = loader(&mesh.root, &["reconcile"]);
            assert!(out.status.success(), "reconcile: {}", String::from_utf8_lossy(&out.stderr));
            let _ = loader(&mesh.root, &["unenrol", "--netns", &b]);
        }
        (client.join().expect("iperf3 thread"), kills)
    });
    let (report, kills) = (report.0.expect("iperf3 failed (reset?)"), report.1);
    let intervals = report["intervals"].as_array().expect("intervals");
    assert!(intervals.len() >= 7, "{} intervals", intervals.len());
    for (i, iv) in intervals.iter().enumerate() {
        let bytes = iv["sum"]["bytes"].as_u64().unwrap_or(0);
        assert!(bytes > 0, "interval {i} (0.5 s) carried nothing: a stall");
    }
    assert!(mesh.proxy.as_ref().expect("proxy").wait_for_line("ACCEPTED", Duration::from_secs(5)));
    // Without a loader killed while it was still working, this test would prove nothing.
    assert!(kills > 0, "no loader process was killed mid-flight");
    eprintln!("killed {kills} loader processes mid-flight");
}

/// A pod that vanished without unenrol (its netns deleted) and a new pod enrolled with the
/// same address (10.199.0.1), retried while the kernel tears the old netns down: (the old
/// pod's cookie, the new pod's, the new pods, the old pods).
struct Reclaimed {
    gone: u64,
    cookie: u64,
    new: PodPair,
    _old: PodPair,
}

fn a_pod_vanishes_and_a_new_one_takes_its_address(
    dp: &meshpath_loader::datapath::Datapath,
) -> Reclaimed {
    let old = PodPair::new().expect("old pods");
    let gone = pods::enrol(dp, &old.a.open().expect("netns"), &full_capture()).expect("enrol old");
    old.a.delete().expect("delete the old pod's netns");
    let new = PodPair::new().expect("new pods");
    let ns = new.a.open().expect("netns");
    let deadline = Instant::now() + Duration::from_secs(10);
    let cookie = loop {
        match pods::enrol(dp, &ns, &full_capture()) {
            Ok(c) => break c,
            Err(meshpath_loader::Error::AddressInUse { other, .. })
                if other == gone && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("enrol: {e}"),
        }
    };
    Reclaimed { gone, cookie, new, _old: old }
}

#[test]
fn an_address_left_by_a_vanished_pod_can_be_enrolled_again_at_once() {
    require_root();
    let root = PinRoot::new();
    let dp = root.datapath().expect("datapath");
    let Reclaimed { gone, cookie, .. } = a_pod_vanishes_and_a_new_one_takes_its_address(&dp);
    assert_ne!(cookie, gone);
    let left: Vec<u64> = pods::list(&dp).expect("list").iter().map(|p| p.cookie).collect();
    assert_eq!(left, [cookie], "the vanished pod was not reclaimed");
}

#[test]
fn a_late_unenrol_of_a_reclaimed_pod_leaves_the_address_to_its_new_owner() {
    require_root();
    let root = PinRoot::new();
    let dp = root.datapath().expect("datapath");
    let Reclaimed { gone, cookie, new, .. } = a_pod_vanishes_and_a_new_one_takes_its_address(&dp);
    // The runtime's DEL for the old sandbox, arriving after its address went to the new pod:
    // nothing of the old pod is left to remove, and nothing of the new pod's is taken.
    match pods::unenrol(&dp, gone) {
        Err(meshpath_loader::Error::NotEnrolled { .. }) => {}
        other => panic!("unenrol of the reclaimed pod: {other:?}"),
    }
    let key = pods::ip_key(new.a_ip.into());
    assert_eq!(dp.pod_ips().expect("POD_IPS").get(&key, 0).ok(), Some(cookie));
    assert_eq!(dp.pod_addrs().expect("POD_ADDRS").keys().count(), 1, "the new pod's entry");
}

#[test]
fn removal_by_address_deletes_only_the_addresses_still_mapped_to_the_pod() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let opts = EnrolOptions { counters: false, ..full_capture() };
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &opts).expect("enrol a");
    let b = pods::enrol(&dp, &pods.b.open().expect("netns b"), &opts).expect("enrol b");
    let flags = dp.pods().expect("PODS").get(&a, 0).expect("PODS entry").flags;
    assert_ne!(flags & pod_flags::ADDRESSES_IN_POD_ADDRS, 0, "pod a is removed by address");
    // Pod a's address handed to pod b while a is still recorded, as a racing agent process
    // could leave it: a's removal must not take it from b.
    let key = pods::ip_key(pods.a_ip.into());
    dp.pod_ips().expect("POD_IPS").insert(key, b, 0).expect("hand the address to b");
    pods::unenrol(&dp, a).expect("unenrol a");
    let pod_ips = dp.pod_ips().expect("POD_IPS");
    assert_eq!(pod_ips.get(&key, 0).ok(), Some(b), "pod a's removal took pod b's address");
    let left: Vec<u64> = pod_ips.iter().flatten().map(|(_, c)| c).filter(|&c| c == a).collect();
    assert!(left.is_empty(), "pod a's own addresses were left behind");
}

/// Pins `map` as an LRU hash of `key` and `value` bytes, alone, as an older meshpath left it.
fn older_lru_pin(root: &PinRoot, map: &str, key: usize, value: usize) -> std::path::PathBuf {
    let maps = root.path().join(datapath_common::consts::pins::MAPS_DIR);
    std::fs::create_dir_all(&maps).expect("maps dir");
    let pin = maps.join(map);
    let out = Command::new("bpftool")
        .args(["map", "create"])
        .arg(&pin)
        .args(["type", "lru_hash", "key", &key.to_string(), "value", &value.to_string()])
        .args(["entries", "16", "name", "OLD_PIN"])
        .output()
        .expect("bpftool");
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
    pin
}

/// The original destinations on the socket were an LRU hash before they moved into socket
/// storage: entries of one cannot become the other's, so such a pin root is refused with an
/// error that names the map and what to do, before anything is loaded or attached (the old
/// datapath is kept as it is, not half replaced).
#[test]
fn a_datapath_pinned_by_an_older_meshpath_is_refused_naming_the_map() {
    require_root();
    let root = PinRoot::new();
    let map = datapath_common::consts::map_names::ORIG_DST_BY_SOCKET;
    older_lru_pin(&root, map, 8, 20);
    let err = root.datapath().expect_err("an older datapath was opened");
    let text = err.to_string();
    assert!(
        text.contains("cannot be upgraded in place") && text.contains(map),
        "unclear error: {text}"
    );
    let made: Vec<_> = std::fs::read_dir(root.path())
        .expect("pin root")
        .flatten()
        .filter(|e| e.file_name() != datapath_common::consts::pins::MAPS_DIR)
        .flat_map(|dir| std::fs::read_dir(dir.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .collect();
    assert!(made.is_empty(), "pinned although refused: {made:?}");
    let maps = root.path().join(datapath_common::consts::pins::MAPS_DIR);
    let maps_left: Vec<_> = std::fs::read_dir(&maps).expect("maps").flatten().collect();
    assert_eq!(maps_left.len(), 1, "maps pinned although refused: {maps_left:?}");
}

/// A connection map an older meshpath pinned as an LRU hash (before each pod got a share of
/// it) is taken over: the datapath opens, and the pin is now this version's hash.
fn an_older_lru_pin_is_carried_into_a_hash(map: &str, key: usize, value: usize, entries: u32) {
    require_root();
    let root = PinRoot::new();
    let pin = older_lru_pin(&root, map, key, value);
    drop(root.datapath().expect("the datapath over an older LRU pin"));
    let info = aya::maps::MapData::from_pin(&pin).expect("the pin").info().expect("map info");
    assert_eq!(info.map_type().expect("type"), aya::maps::MapType::Hash);
    assert_eq!(info.max_entries(), entries);
}

#[test]
fn a_datapath_whose_connection_map_is_an_older_lru_takes_it_over_as_a_hash() {
    an_older_lru_pin_is_carried_into_a_hash(
        datapath_common::consts::map_names::ORIG_DST_BY_CONN,
        std::mem::size_of::<datapath_common::ConnKey>(),
        std::mem::size_of::<datapath_common::OrigDst>(),
        datapath_common::consts::ORIG_DST_BY_CONN_ENTRIES,
    );
}

#[test]
fn a_datapath_whose_transparent_connection_map_is_an_older_lru_takes_it_over_as_a_hash() {
    an_older_lru_pin_is_carried_into_a_hash(
        datapath_common::consts::map_names::PROXY_TRANSPARENT,
        std::mem::size_of::<datapath_common::TransparentKey>(),
        1,
        datapath_common::consts::MAX_TRANSPARENT_CONNECTIONS,
    );
}
