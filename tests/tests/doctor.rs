//! `meshpath-loader doctor` on the machine the tests run on: every feature the datapath uses is
//! reported present, one line per check.

use meshpath_tests::{loader, require_root, PinRoot};

#[test]
fn doctor_reports_every_feature_present_one_line_each() {
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
    assert!(lines.iter().all(|l| l.starts_with("ok       ")), "{stdout}");
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
