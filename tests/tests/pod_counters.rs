//! The first program on the wire: TC counters on each enrolled pod's interface, pinned so they
//! outlive the loader, removed without trace on unenrol. Real kernel, real namespaces, real TCP.

use aya::programs::{SchedClassifier, TcAttachType};
use datapath_common::{consts::programs, PodCounters};
use meshpath_loader::{
    pods::{self, EnrolOptions},
    Error,
};
use meshpath_tests::{
    loader, require_root, transfer, transfer_counting_retransmits, PinRoot, PodPair,
};

/// Largest L2+L3+L4 header one buffer can carry: Ethernet 14 + IPv4 60 + TCP 60 bytes. Every
/// counted buffer carries at most this much on top of its payload.
const MAX_HEADER_BYTES: u64 = 14 + 60 + 60;

/// Asserts that `bytes` counted over `packets` buffers can carry exactly `payload` bytes of TCP
/// payload, `resent` of them (at most) twice: at least the payload, at most the payload and the
/// resent bytes plus one maximal header per buffer.
fn assert_carries(what: &str, packets: u64, bytes: u64, payload: u64, resent: u64) {
    assert!(packets > 0, "{what}: no buffers counted");
    assert!(bytes >= payload, "{what}: {bytes} bytes counted < {payload} bytes of payload sent");
    let overhead = bytes - payload;
    assert!(
        overhead <= resent + packets * MAX_HEADER_BYTES,
        "{what}: {overhead} bytes over payload across {packets} buffers exceeds {MAX_HEADER_BYTES} per buffer and the {resent} bytes retransmitted at most"
    );
}

fn enrol_both(root: &PinRoot, pods: &PodPair) -> (u64, u64) {
    let dp = root.datapath().expect("datapath");
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &EnrolOptions::default())
        .expect("enrol a");
    let b = pods::enrol(&dp, &pods.b.open().expect("netns b"), &EnrolOptions::default())
        .expect("enrol b");
    (a, b)
}

fn counters(root: &PinRoot, cookie: u64) -> PodCounters {
    pods::show(&root.datapath().expect("datapath"), cookie).expect("show").counters
}

#[test]
fn tcp_payload_between_enrolled_pods_is_counted_on_both_pods() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let (a, b) = enrol_both(&root, &pods);
    let payload: u64 = 4 * 1024 * 1024 + 123;

    let (received, resent) =
        transfer_counting_retransmits(&pods, 7001, payload as usize).expect("transfer");
    assert_eq!(received, payload);

    let (ca, cb) = (counters(&root, a), counters(&root, b));
    assert_carries("pod a egress", ca.egress_packets, ca.egress_bytes, payload, resent);
    assert_carries("pod b ingress", cb.ingress_packets, cb.ingress_bytes, payload, resent);
    // The reverse direction carried only ACKs and the handshake: far less than the payload.
    assert!(
        ca.ingress_bytes < payload / 10,
        "pod a ingress {} looks like the payload",
        ca.ingress_bytes
    );
    assert!(
        cb.egress_bytes < payload / 10,
        "pod b egress {} looks like the payload",
        cb.egress_bytes
    );
}

#[test]
fn counters_keep_counting_after_the_loader_process_exits() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    for ns in [&pods.a, &pods.b] {
        let out = loader(&root, &["enrol", "--netns", &ns.path().to_string_lossy()]);
        assert!(out.status.success(), "enrol failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    // No loader process is running now: only the pins keep the programs attached.
    let show = || -> PodCounters {
        let out = loader(&root, &["show", "--json", "--netns", &pods.a.path().to_string_lossy()]);
        assert!(out.status.success(), "show failed: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("show --json output");
        let c = &v["counters"];
        let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("counters.{k} missing in {v}"));
        PodCounters {
            ingress_packets: n("ingress_packets"),
            ingress_bytes: n("ingress_bytes"),
            egress_packets: n("egress_packets"),
            egress_bytes: n("egress_bytes"),
        }
    };

    let first: u64 = 1_000_000;
    let (_, resent) =
        transfer_counting_retransmits(&pods, 7002, first as usize).expect("first transfer");
    let after_first = show();
    assert_carries(
        "after first transfer",
        after_first.egress_packets,
        after_first.egress_bytes,
        first,
        resent,
    );

    let second: u64 = 2_000_000;
    let (_, resent) =
        transfer_counting_retransmits(&pods, 7003, second as usize).expect("second transfer");
    let after_second = show();
    assert_carries(
        "second transfer",
        after_second.egress_packets - after_first.egress_packets,
        after_second.egress_bytes - after_first.egress_bytes,
        second,
        resent,
    );
}

/// What an enrolment with counters attaches to the pod's eth0, by name, sorted.
const ENROLLED_WITH_COUNTERS: [&str; 3] =
    [programs::TC_POD_EGRESS, programs::TC_POD_GUARD, programs::TC_POD_INGRESS];

/// Programs attached to `eth0` in the pod's netns, sorted by name, as the kernel reports them:
/// TCX links where the kernel has TCX (6.6), and the clsact qdisc's filters (`tc filter show`:
/// the guard on every kernel, the counters' netlink fallback on older ones).
fn attached_programs(pods: &PodPair) -> Vec<String> {
    let mut names = Vec::new();
    for dir in [TcAttachType::Ingress, TcAttachType::Egress] {
        if pods::tcx_supported() {
            let progs = pods
                .a
                .open()
                .expect("netns")
                .run(|| SchedClassifier::query_tcx("eth0", dir).expect("query tcx").1)
                .expect("run in netns");
            names.extend(progs.iter().map(|p| p.name_as_str().unwrap_or("?").to_owned()));
        }
        // Netlink filters, on every kernel: the guard is one (the counters too, without TCX).
        let which = if dir == TcAttachType::Ingress { "ingress" } else { "egress" };
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", pods.a.name(), "tc", "filter", "show", "dev", "eth0", which])
            .output()
            .expect("tc filter show");
        assert!(out.status.success(), "tc: {}", String::from_utf8_lossy(&out.stderr));
        // `filter protocol all pref 49152 bpf chain 0 handle 0x1 tc_pod_ingress direct-action …`
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut words = line.split_whitespace().skip_while(|w| *w != "handle").skip(2);
            if line.contains(" bpf ") {
                names.extend(words.next().map(str::to_owned));
            }
        }
    }
    names.sort();
    names
}

#[test]
fn unenrol_leaves_no_pin_link_or_map_entry() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let (a, _b) = enrol_both(&root, &pods);
    transfer(&pods, 7004, 100_000).expect("transfer");
    assert_eq!(attached_programs(&pods), ENROLLED_WITH_COUNTERS);

    let dp = root.datapath().expect("datapath");
    pods::unenrol_netns(&dp, &pods.a.open().expect("netns a")).expect("unenrol");

    assert!(!dp.pod_dir(a).exists(), "pod directory still pinned");
    let b_dir = dp.pod_dir(_b);
    let mut left = root.pod_pins();
    left.sort();
    // Without TCX the counters are netlink filters, not links: nothing of theirs is pinned.
    let expected: Vec<_> = if pods::tcx_supported() {
        [b_dir.clone(), b_dir.join("sk_lookup"), b_dir.join("tc_egress"), b_dir.join("tc_ingress")]
            .into()
    } else {
        [b_dir.clone(), b_dir.join("sk_lookup")].into()
    };
    assert_eq!(left, expected, "only pod b's directory and links may remain");
    assert!(dp.pods().expect("PODS").keys().flatten().all(|k| k != a), "PODS entry left");
    assert!(dp.counters().expect("COUNTERS").keys().flatten().all(|k| k != a), "counters left");
    assert!(attached_programs(&pods).is_empty(), "TC programs still attached to eth0");
    assert!(matches!(pods::show(&dp, a), Err(Error::NotEnrolled { .. })));
}

#[test]
fn enrolling_a_path_that_is_not_a_netns_fails_and_changes_nothing() {
    require_root();
    let root = PinRoot::new();
    let pins_before = root.pod_pins();
    for path in ["/etc/hostname", "/proc/self/ns/pid", "/nonexistent/netns", "/var/run"] {
        let out = loader(&root, &["enrol", "--netns", path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "enrolling {path} succeeded");
        assert!(
            stderr.contains(&format!("{path} is not a network namespace")),
            "unclear error for {path}: {stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "error for {path} is not one line: {stderr}");
    }
    assert_eq!(root.pod_pins(), pins_before);
    assert!(pods::list(&root.datapath().expect("datapath")).expect("list").is_empty());
}

#[test]
fn enrolling_the_same_netns_twice_fails_and_changes_nothing() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let (a, _b) = enrol_both(&root, &pods);
    let pins_before = root.pod_pins();

    let out =
        loader(&root, &["enrol", "--netns", &pods.a.path().to_string_lossy(), "--name", "web-0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "second enrolment succeeded");
    assert!(
        stderr.contains("web-0") && stderr.contains("already enrolled"),
        "unclear error: {stderr}"
    );

    assert_eq!(root.pod_pins(), pins_before);
    assert_eq!(attached_programs(&pods), ENROLLED_WITH_COUNTERS);
    let listed = pods::list(&root.datapath().expect("datapath")).expect("list");
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().any(|p| p.cookie == a));
}

#[test]
fn failed_enrolment_rolls_back_everything_it_made() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let opts = EnrolOptions {
        iface: "nosuch0".into(),
        name: Some("ns/web".into()),
        capture_outbound: true,
        exclude_outbound_ports: vec![9090],
        capture_inbound: true,
        exclude_inbound_ports: vec![22],
        probe_bypass: true,
        capture_dns: true,
        counters: true,
        ..EnrolOptions::default()
    };

    let err = pods::enrol(&dp, &pods.a.open().expect("netns"), &opts)
        .expect_err("enrolled without the interface");

    assert!(
        matches!(&err, Error::NoSuchInterface { pod, iface } if pod == "ns/web" && iface == "nosuch0"),
        "{err}"
    );
    assert!(root.pod_pins().is_empty(), "left pins: {:?}", root.pod_pins());
    assert_eq!(dp.counters().expect("COUNTERS").keys().count(), 0);
    assert_eq!(dp.pods().expect("PODS").keys().count(), 0);
    assert_eq!(dp.excluded_ports().expect("EXCLUDED_PORTS").keys().count(), 0);
}

#[test]
fn enrolling_a_pod_with_another_pods_address_fails_and_changes_nothing() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let a = pods::enrol(&dp, &pods.a.open().expect("netns a"), &EnrolOptions::default())
        .expect("enrol a");
    let clash = EnrolOptions { pod_ips: vec![pods.a_ip.into()], ..EnrolOptions::default() };
    let err =
        pods::enrol(&dp, &pods.b.open().expect("netns b"), &clash).expect_err("enrolled a clash");
    assert!(matches!(&err, Error::AddressInUse { other, .. } if *other == a), "{err}");
    assert_eq!(pods::list(&dp).expect("list").len(), 1);
}

#[test]
fn enrolling_a_pod_with_more_exclusions_than_its_share_fails_and_changes_nothing() {
    require_root();
    let (root, pods) = (PinRoot::new(), PodPair::new().expect("pods"));
    let dp = root.datapath().expect("datapath");
    let pins_before = root.pod_pins();
    let max = datapath_common::consts::MAX_EXCLUSIONS_PER_POD;
    // The cap counts both directions together: at it, then one over it.
    let outbound: Vec<u16> = (1..=max as u16).collect();
    let over = EnrolOptions {
        name: Some("ns/greedy".into()),
        exclude_outbound_ports: outbound.clone(),
        exclude_inbound_ports: vec![22],
        ..EnrolOptions::default()
    };
    let err = pods::enrol(&dp, &pods.a.open().expect("netns"), &over).expect_err("enrolled");
    assert!(matches!(&err, Error::TooManyExclusions { count, .. } if *count == max + 1), "{err}");
    assert!(err.to_string().contains("ns/greedy"), "the error names the pod: {err}");
    assert!(pods::list(&dp).expect("list").is_empty());
    assert_eq!(dp.excluded_ports().expect("map").keys().count(), 0);
    assert_eq!(root.pod_pins(), pins_before);

    // Prefix rules: the three lists together.
    let nets = |first: u8, n: usize| {
        (0..n).map(|i| format!("10.{first}.{i}.0/24").parse().expect("net")).collect::<Vec<_>>()
    };
    let prefixes = EnrolOptions {
        exclude_outbound_cidrs: nets(1, 64),
        capture_outbound_cidrs: nets(2, 64),
        exclude_inbound_cidrs: nets(3, 1),
        ..EnrolOptions::default()
    };
    let err = pods::enrol(&dp, &pods.a.open().expect("netns"), &prefixes).expect_err("enrolled");
    assert!(matches!(&err, Error::TooManyExclusions { count, .. } if *count == max + 1), "{err}");
    assert!(pods::list(&dp).expect("list").is_empty());

    let at_cap = EnrolOptions { exclude_outbound_ports: outbound, ..EnrolOptions::default() };
    pods::enrol(&dp, &pods.a.open().expect("netns"), &at_cap).expect("a pod at its share enrols");
    assert_eq!(dp.excluded_ports().expect("map").keys().count(), max);
}
