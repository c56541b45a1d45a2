//! What a connection's task pays, on each wake, for being stoppable.
//!
//! A [`Stop`] is fired once and seen with one atomic load: the hand-over's, which every copy
//! loop asks about on every wake. [`when_woken`] wraps a future that sits in a `select!` beside
//! a connection's bytes and is almost never ready (a pod's removal, a policy's close, a drain, a
//! keepalive timer): `select!` polls every branch on every wake, and the wrapped one is then
//! polled only when it woke the task itself.
//!
//! A `CancellationToken` polled on every wake costs two mutexes each time (its tree node's, then
//! its `Notify`'s), and where every connection watches the same token, the same two mutexes for
//! all of them. A [`Watch`] registers its task's waker with the token once (again only if the
//! waker changes) and from then on reads a flag: what a 64-byte round trip pays for being
//! stoppable is a load, not two locks (results/README.md, "Why the proxy has its shape").

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
    task::{Context, Poll, Wake, Waker},
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

/// `fut`, polled only when it woke its task itself (and at its first poll): for a `select!`
/// branch beside a connection's bytes that is almost never ready. Its poll on any other wake is
/// a comparison of wakers and a load, where a token's `cancelled()` takes two mutexes (shared by
/// every connection of a pod, for a pod's token) and a timer registers its waker again.
pub fn when_woken<F: Future>(fut: F) -> WhenWoken<F> {
    WhenWoken { fut, woken: None, done: false }
}

pin_project_lite::pin_project! {
    /// See [`when_woken`].
    pub struct WhenWoken<F> {
        #[pin]
        fut: F,
        // Made at the first poll: the flag `fut` wakes, the waker that sets it, and the task's
        // waker the flag wakes in turn (kept to see whether the task's has changed).
        woken: Option<(Arc<Woken>, Waker, Waker)>,
        // `fut` returned Ready: polled again, this panics, as an `async fn` does (the flag
        // could otherwise be set and the finished `fut` polled).
        done: bool,
    }
}

/// Set when the wrapped future wakes; wakes the task.
struct Woken {
    flag: AtomicBool,
    task: Mutex<Waker>,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Set before the task is woken: the poll the wake causes sees it. Woken under the lock
        // (a tokio waker only schedules the task); a poisoned lock still holds a waker.
        self.flag.store(true, Ordering::Release);
        self.task.lock().unwrap_or_else(PoisonError::into_inner).wake_by_ref();
    }
}

impl<F: Future> Future for WhenWoken<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        assert!(!*this.done, "`when_woken` polled after it completed");
        let (woken, own, task) = this.woken.get_or_insert_with(|| {
            // Set: the first poll polls `fut`, which registers its waker.
            let woken = Arc::new(Woken {
                flag: AtomicBool::new(true),
                task: Mutex::new(cx.waker().clone()),
            });
            (woken.clone(), Waker::from(woken), cx.waker().clone())
        });
        if !task.will_wake(cx.waker()) {
            // Another waker (a spawned tokio task's is the same on every poll; a `block_on`'s
            // may not be): the one woken from now on, set before the flag is read so that a
            // wake after the read reaches it; and `fut` polled, in case a wake went to the old.
            let old = {
                let mut t = woken.task.lock().unwrap_or_else(PoisonError::into_inner);
                std::mem::replace(&mut *t, cx.waker().clone())
            };
            // Dropped outside the lock: its drop is another's code.
            drop(old);
            *task = cx.waker().clone();
            woken.flag.store(true, Ordering::Release);
        }
        // Cleared before `fut` is polled: a wake during its poll sets it again.
        if !woken.flag.load(Ordering::Acquire) || !woken.flag.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let polled = this.fut.poll(&mut Context::from_waker(own));
        *this.done = polled.is_ready();
        polled
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

    #[tokio::test]
    async fn a_quiet_branch_is_polled_only_when_it_woke_the_task() {
        // In a task of its own, as a connection is: a task's waker is the same on every poll.
        let polls = tokio::spawn(async {
            let polls = std::sync::atomic::AtomicUsize::new(0);
            // Never ready, and registers no waker: only the wrapper decides when it is polled.
            let quiet = when_woken(poll_fn(|_| {
                polls.fetch_add(1, Ordering::Relaxed);
                Poll::<()>::Pending
            }));
            tokio::pin!(quiet);
            // The first poll polls it; then woken for something else three times: not polled.
            for _ in 0..4 {
                assert!(poll_fn(|cx| Poll::Ready(quiet.as_mut().poll(cx).is_pending())).await);
                tokio::task::yield_now().await;
            }
            polls.load(Ordering::Relaxed)
        });
        assert_eq!(polls.await.expect("the task"), 1);
    }

    #[tokio::test]
    async fn a_quiet_branch_that_wakes_its_task_is_polled_and_seen_ready() {
        let stop = Arc::new(tokio_util::sync::CancellationToken::new());
        let waiting = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let quiet = when_woken(stop.cancelled());
                tokio::pin!(quiet);
                // A busy branch woken again and again beside it, as a connection's bytes are.
                let mut busy = 0u32;
                loop {
                    tokio::select! {
                        () = &mut quiet => return busy,
                        () = tokio::task::yield_now() => busy += 1,
                    }
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "done before the token was cancelled");
        stop.cancel();
        let busy = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("not woken by the cancel")
            .expect("the waiting task");
        assert!(busy > 0);
    }
}
