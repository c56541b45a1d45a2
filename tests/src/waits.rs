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
