//! A budget of log lines per second, for events an outsider can repeat as fast as they like (a
//! pod looping on a refused `bind()`, a peer opening and dropping connections): a line each
//! would let them flood the log. Within the budget each event is logged; past it, events are
//! only counted, and the count is given with the first line of the next second, so nothing is
//! lost from the total the log tells. Metrics count every event either way.

use std::time::{Duration, Instant};

/// One kind of event's current second: how many of its lines were logged, how many left out.
#[derive(Debug, Clone, Copy)]
pub struct PerSecond {
    limit: u32,
    start: Option<Instant>,
    logged: u32,
    left_out: u64,
}

impl PerSecond {
    /// At most `limit` lines a second.
    pub const fn new(limit: u32) -> Self {
        Self { limit, start: None, logged: 0, left_out: 0 }
    }

    /// Whether an event at `now` is logged, and how many were left out of the second that ended
    /// before it (0 if none, or if its second is still running).
    pub fn admit(&mut self, now: Instant) -> (bool, u64) {
        let mut ended = 0;
        if self.start.is_none_or(|s| now.duration_since(s) >= Duration::from_secs(1)) {
            ended = std::mem::take(&mut self.left_out);
            *self = Self { start: Some(now), logged: 0, left_out: 0, ..*self };
        }
        if self.logged < self.limit {
            self.logged += 1;
            (true, ended)
        } else {
            self.left_out += 1;
            (false, ended)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::PerSecond;

    #[test]
    fn at_most_the_limit_is_logged_a_second_and_the_rest_counted_for_the_next_second() {
        let (mut w, t0) = (PerSecond::new(20), Instant::now());
        let admitted = (0..50).filter(|_| w.admit(t0).0).count();
        assert_eq!(admitted, 20);
        // The next second: logged again, with the count of the 30 left out.
        assert_eq!(w.admit(t0 + Duration::from_millis(1000)), (true, 30));
        assert_eq!(w.admit(t0 + Duration::from_millis(1001)), (true, 0));
    }

    #[test]
    fn a_second_within_the_limit_leaves_nothing_out() {
        let (mut w, t0) = (PerSecond::new(3), Instant::now());
        assert!((0..3).all(|_| w.admit(t0) == (true, 0)));
        assert_eq!(w.admit(t0 + Duration::from_secs(5)), (true, 0));
    }
}
