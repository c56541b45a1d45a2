//! Pooled HBONE connections are checked with HTTP/2 PING, as ztunnel does (every 10 s, 20 s to
//! answer; shortened here): a peer that stops answering — its TCP connection still up, so
//! nothing else would notice — has its connection dropped from the pool, and a live one is kept.

use std::time::Duration;

use meshpath_tests::{
    sum_metric,
    two_nodes::{Setup, TwoNodes},
};

/// SIGSTOPs a process; SIGCONTs it when dropped (so a failing test leaves nothing frozen).
struct Frozen(i32);

impl Frozen {
    fn new(pid: u32) -> Self {
        let pid = pid as i32;
        // SAFETY: signalling a child process of this test.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP");
        Self(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

fn pooled(metrics: &str) -> f64 {
    sum_metric(metrics, "meshpath_pool_connections", &[])
}

fn nodes() -> TwoNodes {
    TwoNodes::start(Setup {
        args: vec![
            "--hbone-keepalive-interval-ms".into(),
            "200".into(),
            "--hbone-keepalive-timeout-ms".into(),
            "400".into(),
        ],
        ..Setup::default()
    })
}

#[test]
fn a_pooled_connection_whose_peer_answers_pings_is_kept() {
    let nodes = nodes();
    let dst = nodes.b(false, 8110);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"hi").expect("round trip"), b"hi");
    let node1 = &nodes.proxies[0];
    assert!(node1.wait_metrics(Duration::from_secs(5), |m| pooled(m) == 1.0), "never pooled");
    // Several PING rounds (and their timeouts) pass: the live connection stays.
    let gone = node1.wait_metrics(Duration::from_secs(3), |m| pooled(m) != 1.0);
    assert!(!gone, "a connection whose peer answers was dropped");
    assert_eq!(nodes.app_round_trip(dst, b"again").expect("round trip"), b"again");
}

#[test]
fn a_pooled_connection_whose_peer_stops_answering_pings_is_dropped() {
    let nodes = nodes();
    let dst = nodes.b(false, 8111);
    nodes.echo_server_in_b(dst);
    assert_eq!(nodes.app_round_trip(dst, b"hi").expect("round trip"), b"hi");
    let node1 = &nodes.proxies[0];
    assert!(node1.wait_metrics(Duration::from_secs(5), |m| pooled(m) == 1.0), "never pooled");
    let _frozen = Frozen::new(nodes.proxies[1].proxy.pid());
    assert!(
        node1.wait_metrics(Duration::from_secs(10), |m| pooled(m) == 0.0),
        "the connection to a peer that stopped answering is still pooled"
    );
}
