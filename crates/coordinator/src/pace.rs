//! Keepalive pacing: each link's keepalive interval grows with the number of links, so that a
//! large fleet's keepalives stay under `--max-keepalive-rate` per second each way (every side
//! sends one per interval), and shrinks back as the fleet does. At 10,000 links and the
//! default 1 s interval, keepalives alone would be 20,000 messages a second through one
//! process; spaced to 5 s they are 4,000, and a busy coordinator no longer declares links lost
//! because it was slow to read them.
//!
//! A link is told its interval in the Welcome and, when it changes, in a Keepalive carrying
//! `interval_ms`; it counts as lost after `lost_after` scaled by the same factor.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Intervals are whole seconds once spaced, so that a fleet that grows by a few links does not
/// change every link's interval.
const STEP_MS: u64 = 1000;

/// The pace of every link's keepalives.
#[derive(Debug)]
pub(crate) struct Pace {
    configured: Duration,
    lost_after: Duration,
    /// Keepalives per second each way to stay under; 0: never space them.
    rate: u32,
    links: AtomicUsize,
}

/// Counts one link while it lives.
#[derive(Debug)]
pub(crate) struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pace {
    pub fn new(configured: Duration, lost_after: Duration, rate: u32) -> Self {
        Self {
            configured,
            lost_after,
            rate,
            links: AtomicUsize::new(0),
        }
    }

    /// Counts a link until the guard drops.
    pub fn count(&self) -> Counted<'_> {
        self.links.fetch_add(1, Ordering::Relaxed);
        Counted(&self.links)
    }

    /// The interval a link should use now, given the one it uses (`None`: a new link). It
    /// grows as soon as the fleet needs it, and shrinks only when a quarter more links would
    /// still fit the smaller interval, so a fleet at a boundary does not flip back and forth.
    pub fn interval(&self, current: Option<Duration>) -> Duration {
        let links = self.links.load(Ordering::Relaxed);
        let target = self.for_links(links);
        match current {
            Some(current) if target < current && self.for_links(links + links / 4) >= current => {
                current
            }
            _ => target,
        }
    }

    /// How long a link using `interval` may stay silent before it is lost: the configured
    /// `lost_after`, scaled as the interval is.
    pub fn lost_after(&self, interval: Duration) -> Duration {
        let configured = self.configured.as_millis().max(1);
        let scaled = self.lost_after.as_millis() * interval.as_millis() / configured;
        Duration::from_millis(u64::try_from(scaled).unwrap_or(u64::MAX)).max(self.lost_after)
    }

    fn for_links(&self, links: usize) -> Duration {
        if self.rate == 0 {
            return self.configured;
        }
        let need_ms = (links as u64 * 1000).div_ceil(u64::from(self.rate));
        if need_ms <= self.configured.as_millis() as u64 {
            return self.configured;
        }
        Duration::from_millis(need_ms.div_ceil(STEP_MS) * STEP_MS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_grow_with_the_fleet_in_whole_seconds_and_shrink_with_a_margin() {
        let pace = Pace::new(Duration::from_secs(1), Duration::from_secs(3), 2000);
        let guards: Vec<_> = (0..2000).map(|_| pace.count()).collect();
        assert_eq!(pace.interval(None), Duration::from_secs(1));
        let more: Vec<_> = (0..8000).map(|_| pace.count()).collect();
        assert_eq!(pace.interval(None), Duration::from_secs(5));
        assert_eq!(
            pace.lost_after(Duration::from_secs(5)),
            Duration::from_secs(15)
        );
        let one_more = pace.count();
        assert_eq!(
            pace.interval(Some(Duration::from_secs(5))),
            Duration::from_secs(6)
        );
        drop(one_more);
        // 10,000 links: 5 s would do, but 12,500 would not fit it: stay at 6 s.
        assert_eq!(
            pace.interval(Some(Duration::from_secs(6))),
            Duration::from_secs(6)
        );
        drop(more);
        assert_eq!(
            pace.interval(Some(Duration::from_secs(6))),
            Duration::from_secs(1)
        );
        drop(guards);
        assert_eq!(pace.links.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_rate_of_zero_keeps_the_configured_interval() {
        let pace = Pace::new(Duration::from_millis(300), Duration::from_secs(1), 0);
        let _guards: Vec<_> = (0..100_000).map(|_| pace.count()).collect();
        assert_eq!(pace.interval(None), Duration::from_millis(300));
        assert_eq!(
            pace.lost_after(Duration::from_millis(300)),
            Duration::from_secs(1)
        );
    }
}
