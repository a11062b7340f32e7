//! A token bucket kept as one instant, as GCRA does: the instant the bucket is full again.
//! Taking a token moves that instant one interval later (from now, if it was past), and a token
//! may be taken while it is less than `burst` intervals ahead. No timer and no refill step: a
//! bucket is two words, whatever its rate.

use std::time::Duration;

use tokio::time::Instant;

/// How many tokens a bucket holds, and how often one comes back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rate {
    pub burst: u32,
    pub interval: Duration,
}

#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    full_at: Instant,
}

impl Bucket {
    /// A full bucket at `now`.
    pub fn full(now: Instant) -> Self {
        Self { full_at: now }
    }

    /// The first instant a token can be taken.
    pub fn next_at(&self, rate: Rate) -> Instant {
        self.full_at
            .checked_sub(rate.interval * rate.burst.saturating_sub(1))
            .unwrap_or(self.full_at)
    }

    /// Takes a token at `now` if one is left.
    pub fn try_take(&mut self, now: Instant, rate: Rate) -> bool {
        if now < self.next_at(rate) {
            return false;
        }
        self.full_at = self.full_at.max(now) + rate.interval;
        true
    }

    /// Whether the bucket is full at `now`: as if no token had ever been taken.
    pub fn is_full(&self, now: Instant) -> bool {
        now >= self.full_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATE: Rate = Rate {
        burst: 3,
        interval: Duration::from_secs(1),
    };

    #[test]
    fn a_burst_then_one_each_interval_and_full_again_after_quiet() {
        let start = Instant::now();
        let mut bucket = Bucket::full(start);
        assert!((0..3).all(|_| bucket.try_take(start, RATE)));
        assert!(!bucket.try_take(start, RATE));
        assert!(!bucket.is_full(start));
        let next = bucket.next_at(RATE);
        assert_eq!(next, start + RATE.interval);
        assert!(!bucket.try_take(next - Duration::from_millis(1), RATE));
        assert!(bucket.try_take(next, RATE));
        assert!(!bucket.try_take(next, RATE));
        // Quiet for a whole burst's worth: full, and a whole burst again.
        let later = next + RATE.interval * 3;
        assert!(bucket.is_full(later));
        assert!((0..3).all(|_| bucket.try_take(later, RATE)));
        assert!(!bucket.try_take(later, RATE));
    }
}
