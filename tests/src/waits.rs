//! How every test waits for something: a condition polled until a deadline. No test sleeps a
//! fixed time in place of "long enough"; a wait that ends early costs nothing, and one that
//! runs out says what it waited for.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

/// How often a condition is asked again.
const POLL: Duration = Duration::from_millis(50);

/// Polls `cond` until it holds or `limit` has passed (then asks once more); whether it held.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(POLL);
    }
    cond()
}

/// [`wait_until`] inside a runtime: the runtime keeps running between polls.
pub async fn wait_until_async<F: Future<Output = bool>>(
    limit: Duration,
    mut cond: impl FnMut() -> F,
) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(POLL).await;
    }
    cond().await
}

/// One read (or recv) within `limit`: `op` is given the time left, sets it as the socket's
/// timeout and reads once. Read again after EINTR, with what is left of the first deadline: a
/// read with a timeout (SO_RCVTIMEO) is never restarted (signal(7)); a stop and continue of
/// the process, with no handler at all, ends it so (a CI run failed after 1.35 s of 40). Past
/// the deadline: `WouldBlock`, what a read that timed out returns.
pub fn read_within<T>(
    limit: Duration,
    mut op: impl FnMut(Duration) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        match op(left) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// `op`, one read or recv on a socket whose timeout is already set, again after EINTR (see
/// [`read_within`]; here each try waits the whole timeout: a test waits a little longer, once
/// in a long while, instead of failing).
pub fn again_after_eintr<T>(mut op: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match op() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// Asserts that `c` stays silent for `limit`: no byte and no end arrive (its read times out).
/// Panics with `why` and what arrived otherwise. Leaves `c`'s read timeout at what was left.
pub fn assert_unanswered_within(c: &mut std::net::TcpStream, limit: Duration, why: &str) {
    use std::io::Read as _;
    let mut b = [0u8; 1];
    match read_within(limit, |t| {
        c.set_read_timeout(Some(t))?;
        c.read(&mut b)
    }) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("{why}: {other:?}"),
    }
}

/// Polls `f` until it returns `Some`, or fails after `limit` naming `what` and the last error.
pub fn wait_for<T>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(t)) => return Ok(t),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!(
                "waited {} s for {what}{}",
                limit.as_secs(),
                if last.is_empty() { String::new() } else { format!(" (last error: {last})") }
            );
        }
        // Each poll of the cluster runs kubectl: a quarter second apart, not 50 ms.
        std::thread::sleep(Duration::from_millis(250));
    }
}
