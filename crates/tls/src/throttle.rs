//! Log lines a peer can cause at will, at most one per interval, counting the others.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Lets one event through per `every`; [`LogThrottle::pass`] says how many were held back
/// since the last one let through, for its log line.
#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    /// Milliseconds after [`origin`] at which the next event may pass; 0 before the first.
    next_ms: AtomicU64,
    held: AtomicU64,
}

/// A fixed point of the monotonic clock, taken at the first use.
fn origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl LogThrottle {
    pub const fn new(every: Duration) -> Self {
        Self {
            every,
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(held)` when this event is to be logged, with the number held back before it;
    /// `None` when it is only counted.
    pub fn pass(&self) -> Option<u64> {
        let now = u64::try_from(origin().elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        let every = u64::try_from(self.every.as_millis()).unwrap_or(u64::MAX);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(every).max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_passes_and_says_how_many_were_held() {
        let throttle = LogThrottle::new(Duration::from_millis(200));
        assert_eq!(throttle.pass(), Some(0));
        for _ in 0..1000 {
            assert_eq!(throttle.pass(), None);
        }
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(throttle.pass(), Some(1000));
        assert_eq!(throttle.pass(), None);
    }

    #[test]
    fn of_many_threads_at_once_one_passes() {
        let throttle = std::sync::Arc::new(LogThrottle::new(Duration::from_secs(60)));
        let passed: u64 = (0..8)
            .map(|_| {
                let throttle = throttle.clone();
                std::thread::spawn(move || {
                    (0..1000).filter(|_| throttle.pass().is_some()).count() as u64
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(passed, 1);
    }
}
