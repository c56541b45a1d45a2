//! `meshpath-loader doctor` on the machine the tests run on (this one, and each kernel of the
//! QEMU matrix): every feature the datapath uses is reported present, or, for one it can do
//! without, as a fallback; one line per check, each with the first kernel that has it. The
//! app↔proxy socket shortcut is reported off, with the kernel's reasons.

use meshpath_tests::{loader, require_root, PinRoot};

#[test]
fn doctor_reports_every_feature_present_or_with_its_fallback_one_line_each() {
    require_root();
    let root = PinRoot::new();
    let out = loader(&root, &["doctor"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "doctor failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.len() >= 15, "too few checks:\n{stdout}");
    let kernel = meshpath_loader::doctor::kernel();
    assert_eq!(lines[0], format!("kernel   Linux {kernel}"));
    let checks = &lines[1..];
    assert!(
        checks.iter().all(|l| l.starts_with("ok       ")
            || l.starts_with("fallback ")
            || l.starts_with("off      ")),
        "{stdout}"
    );
    // The one feature off on every kernel, with both of the kernel's defects named.
    let off: Vec<&&str> = checks.iter().filter(|l| l.starts_with("off")).collect();
    assert_eq!(off.len(), 1, "{stdout}");
    for why in ["shortcut", "no flow control", "ENOMEM", "EAGAIN"] {
        assert!(off[0].contains(why), "{}", off[0]);
    }
    // TCX is the one feature with a fallback; the kernel has it from 6.6.
    let tcx = checks.iter().find(|l| l.contains("TCX")).expect("a TCX check");
    assert!(tcx.contains("(Linux 6.6+)"), "{tcx}");
    assert_eq!(tcx.starts_with("ok"), meshpath_loader::pods::tcx_supported(), "{tcx}");
    assert!(checks.iter().filter(|l| l.starts_with("fallback")).all(|l| l.contains("TCX")));
    for needle in [
        "sk_lookup",
        "cgroup_sockopt",
        "sock_ops",
        "BPF_FUNC_get_netns_cookie",
        "sockhash",
        "cgroup v2",
    ] {
        assert!(stdout.contains(needle), "no check mentions {needle}:\n{stdout}");
    }
}
