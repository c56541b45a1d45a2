//! The reply routing, written over rtnetlink, read back with iproute2 in a network namespace
//! of the test's own (a thread that unshared its netns: nothing outside it changes).

use std::process::Command;

use meshpath_podnet::reply_routing;

/// Runs `f` on a thread in a new network namespace with `lo` up; the namespace goes with it.
fn in_new_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (needs root)");
        assert!(ip(&["link", "set", "lo", "up"]).1, "ip link set lo up");
        f()
    })
    .join()
    .expect("netns thread")
}

/// `ip ARGS` in the calling thread's netns: (stdout, success).
fn ip(args: &[&str]) -> (String, bool) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    (String::from_utf8_lossy(&out.stdout).into_owned(), out.status.success())
}

fn rules(family: &str) -> usize {
    ip(&[family, "rule", "show"])
        .0
        .lines()
        .filter(|l| l.contains("fwmark 0x111/0xfff lookup 133"))
        .count()
}

fn local_routes(family: &str) -> usize {
    ip(&[family, "route", "show", "table", "133"])
        .0
        .lines()
        .filter(|l| l.starts_with("local default dev lo"))
        .count()
}

#[test]
fn set_up_writes_the_rule_and_route_iproute2_shows_for_both_families() {
    let (state, seen) = in_new_netns(|| {
        let state = reply_routing::set_up().expect("set_up");
        (state, [rules("-4"), local_routes("-4"), rules("-6"), local_routes("-6")])
    });
    assert_eq!(state, None, "IPv4 and IPv6 both set up");
    assert_eq!(seen, [1, 1, 1, 1]);
}

#[test]
fn set_up_twice_leaves_one_rule() {
    let seen = in_new_netns(|| {
        reply_routing::set_up().expect("first");
        reply_routing::set_up().expect("second");
        [rules("-4"), rules("-6"), local_routes("-4")]
    });
    assert_eq!(seen, [1, 1, 1]);
}

#[test]
fn is_set_up_follows_set_up_and_remove() {
    let seen = in_new_netns(|| {
        let before = reply_routing::is_set_up();
        reply_routing::set_up().expect("set_up");
        let after = reply_routing::is_set_up();
        reply_routing::remove().expect("remove");
        let removed = reply_routing::is_set_up();
        (before, after, removed, rules("-4"), local_routes("-4"), rules("-6"))
    });
    assert_eq!(seen, (false, true, false, 0, 0, 0));
}

#[test]
fn remove_where_nothing_was_set_up_is_not_an_error() {
    in_new_netns(reply_routing::remove).expect("remove");
}
