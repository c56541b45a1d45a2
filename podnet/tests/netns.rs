//! Running code inside a network namespace on the calling thread: the thread is in the
//! namespace while the code runs and back in its own after, whatever the code does. Each test
//! makes its own namespace (a thread that unshared its netns), gone when its file closes.

use std::{fs::File, path::Path};

use meshpath_podnet::netns::{read_cookie, run_in, Netns};

/// A new network namespace, open (it lives while the file does), and its cookie.
fn new_netns() -> (File, u64) {
    std::thread::spawn(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (needs root)");
        let file = File::open("/proc/thread-self/ns/net").expect("open the new netns");
        (file, read_cookie().expect("cookie"))
    })
    .join()
    .expect("netns thread")
}

fn pod() -> (Netns, u64) {
    let (file, cookie) = new_netns();
    (Netns::from_file(file, Path::new("test-pod")).expect("a netns"), cookie)
}

#[test]
fn opening_a_namespace_reads_its_cookie_and_leaves_the_thread_home() {
    let home = read_cookie().expect("cookie");
    let (ns, cookie) = pod();
    assert_eq!(ns.cookie(), cookie);
    assert_ne!(cookie, home);
    assert_eq!(read_cookie().expect("cookie"), home, "the thread stayed in the namespace");
}

#[test]
fn code_runs_inside_the_namespace_on_the_calling_thread_and_the_thread_comes_back() {
    let home = read_cookie().expect("cookie");
    let (ns, cookie) = pod();
    let caller = std::thread::current().id();
    let (inside, thread) =
        ns.run(|| (read_cookie().expect("cookie"), std::thread::current().id())).expect("run");
    assert_eq!(inside, cookie);
    assert_eq!(thread, caller, "ran on another thread");
    assert_eq!(read_cookie().expect("cookie"), home, "the thread stayed in the namespace");
}

#[test]
fn a_panic_inside_the_namespace_still_brings_the_thread_back() {
    let home = read_cookie().expect("cookie");
    let (ns, _) = pod();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ns.run(|| panic!("the code run inside panics")).expect("run")
    }));
    assert!(panicked.is_err());
    assert_eq!(read_cookie().expect("cookie"), home, "the thread stayed in the namespace");
}

#[test]
fn a_thread_started_inside_the_namespace_is_born_there() {
    let (ns, cookie) = pod();
    let born = ns
        .run(|| std::thread::spawn(|| read_cookie().expect("cookie")).join().expect("thread"))
        .expect("run");
    assert_eq!(born, cookie);
}

#[test]
fn a_file_that_is_not_a_network_namespace_is_refused_and_the_thread_stays_home() {
    let home_cookie = read_cookie().expect("cookie");
    let home = File::open("/proc/thread-self/ns/net").expect("own netns");
    let not_net = File::open("/proc/thread-self/ns/uts").expect("a namespace of another type");
    let mut ran = false;
    let refused = run_in(&not_net, &home, || ran = true);
    assert!(refused.is_err(), "setns(CLONE_NEWNET) took a UTS namespace");
    assert!(!ran, "the code ran although the thread did not enter");
    assert_eq!(read_cookie().expect("cookie"), home_cookie);
}
