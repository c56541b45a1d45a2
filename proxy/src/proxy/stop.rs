//! A stop that every connection's copy loop watches on each wake (the hand-over's: `handover`):
//! fired once, then seen with one atomic load.
//!
//! A `CancellationToken` polled on every wake costs two mutexes each time (its tree node's, then
//! its `Notify`'s), and where every connection watches the same token, the same two mutexes for
//! all of them. A [`Watch`] registers its task's waker with the token once (again only if the
//! waker changes) and from then on reads a flag: what a 64-byte round trip pays for being
//! stoppable is a load, not two locks (results/README.md, "Why the proxy has its shape").

use std::{
    future::Future as _,
    pin::Pin,
    sync::atomic::{AtomicBool, Ordering},
    task::{Context, Poll, Waker},
};

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Fired once, by one caller; watched by many tasks.
#[derive(Debug, Default)]
pub struct Stop {
    fired: AtomicBool,
    /// Wakes the watchers: cancelled after `fired` is set, so a task it wakes sees the flag.
    token: CancellationToken,
}

impl Stop {
    /// Fires the stop (again: no effect).
    pub fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        self.token.cancel();
    }

    /// Whether it has fired.
    pub fn is_fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    /// Done once it has fired (for a `select!` that runs once, not in a copy loop).
    pub async fn fired(&self) {
        self.token.cancelled().await;
    }

    /// A watch for a loop that asks on every wake.
    pub fn watch(&self) -> Watch<'_> {
        Watch { stop: self, registered: None }
    }
}

/// One task's watch on a [`Stop`].
pub struct Watch<'a> {
    stop: &'a Stop,
    /// The waker the token wakes, and the wait that holds it there. Boxed: made at the first
    /// `Pending`, not carried in the task of every connection that never waits.
    registered: Option<(Waker, Pin<Box<WaitForCancellationFutureOwned>>)>,
}

impl Watch<'_> {
    /// Ready once the stop has fired; otherwise the task is woken when it fires.
    pub fn poll_fired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.stop.is_fired() {
            return Poll::Ready(());
        }
        // Registered with this waker: `fire` sets the flag before it wakes it, so a fire after
        // the load above still wakes this task, which then sees the flag.
        if let Some((waker, _)) = &self.registered {
            if waker.will_wake(cx.waker()) {
                return Poll::Pending;
            }
        }
        let mut wait = Box::pin(self.stop.token.clone().cancelled_owned());
        if wait.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        self.registered = Some((cx.waker().clone(), wait));
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::{future::poll_fn, sync::Arc, time::Duration};

    use super::*;

    #[tokio::test]
    async fn a_task_waiting_on_a_watch_is_woken_when_the_stop_fires() {
        let stop = Arc::new(Stop::default());
        let waiting = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut watch = stop.watch();
                // Polled more than once before the fire, as a copy loop does.
                for _ in 0..3 {
                    let pending =
                        poll_fn(|cx| Poll::Ready(watch.poll_fired(cx).is_pending())).await;
                    assert!(pending, "fired before the fire");
                    tokio::task::yield_now().await;
                }
                poll_fn(|cx| watch.poll_fired(cx)).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "done before the fire");
        stop.fire();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("not woken by the fire")
            .expect("the waiting task");
    }

    #[tokio::test]
    async fn a_watch_made_after_the_fire_is_ready_at_once() {
        let stop = Stop::default();
        stop.fire();
        assert!(stop.is_fired());
        let mut watch = stop.watch();
        poll_fn(|cx| watch.poll_fired(cx)).await;
        stop.fired().await;
    }
}
