//! Enrollment requests counted per asker, so that none can make the coordinator write audit
//! records (and, for joins, ask the Kubernetes API) as fast as it sends. Each join and renewal
//! costs an audit record and a log line, and a join with a service account token a review by
//! the Kubernetes API: unbounded, a peer with no certificate sending bogus joins in a loop, or
//! an agent renewing in a loop, filled the audit log's disk (which stops every call:
//! [`crate::audit`]) and kept the API server busy.
//!
//! - Joins: refused joins counted per address (an IPv4 address, or an IPv6 /64, which one host
//!   can hold whole), [`JOIN_RATE`]. A join that succeeds costs nothing, so a host with a good
//!   token is never held back by its own earlier mistakes for long.
//! - Renewals: every renewal counted per agent, [`renewal_rate`] (an agent renews at two thirds
//!   of its certificate's lifetime, and retries a failed renewal every 1 to 30 s).
//!
//! Past its count, an asker's requests are refused at once, unexamined (no token looked up, no
//! review asked, nothing signed), with `RESOURCE_EXHAUSTED` saying when to come back; the first
//! of each run is recorded, the others only counted (`toolsrv_enrollment_throttled_total`).
//!
//! At most [`MAX_ASKERS`] askers are remembered; past that, those whose count has gone back to
//! nothing are forgotten, and while every one is still counting, a new asker goes uncounted
//! (memory stays bounded; an attacker with that many addresses is slowed by each of them all
//! the same).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::bucket::{Bucket, Rate};

/// Refused joins one address may have at once, then one more each interval.
pub(crate) const JOIN_RATE: Rate = Rate {
    burst: 10,
    interval: Duration::from_secs(6),
};

/// Renewals one agent may ask for at once, then one more each interval: a quarter of the
/// certificate's lifetime (an honest agent renews once a lifetime, at two thirds of it), from
/// 1 s to a minute.
pub(crate) fn renewal_rate(ttl: Duration) -> Rate {
    Rate {
        burst: 5,
        interval: (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(60)),
    }
}

/// Askers remembered at most.
pub(crate) const MAX_ASKERS: usize = 65_536;

#[derive(Debug)]
pub(crate) struct Throttle<K> {
    rate: Rate,
    askers: Mutex<HashMap<K, Counted>>,
}

#[derive(Debug)]
struct Counted {
    spent: Bucket,
    /// Whether this run of unexamined refusals has been recorded.
    recorded: bool,
}

/// Whether to examine a request.
#[derive(Debug, PartialEq)]
pub(crate) enum Admit {
    Yes,
    /// Refused unexamined; `record`: the first of this run, to be audited.
    No {
        retry_after: Duration,
        record: bool,
    },
}

impl<K: Hash + Eq> Throttle<K> {
    pub fn new(rate: Rate) -> Self {
        Self {
            rate,
            askers: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, Counted>> {
        self.askers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request of `asker` at `now` is examined.
    pub fn admit(&self, asker: &K, now: Instant) -> Admit {
        let mut askers = self.lock();
        let Some(counted) = askers.get_mut(asker) else {
            return Admit::Yes;
        };
        let next = counted.spent.next_at(self.rate);
        if now >= next {
            counted.recorded = false;
            return Admit::Yes;
        }
        Admit::No {
            retry_after: next - now,
            record: !std::mem::replace(&mut counted.recorded, true),
        }
    }

    /// A request of `asker` that counts was examined at `now`.
    pub fn count(&self, asker: K, now: Instant) {
        let mut askers = self.lock();
        if !askers.contains_key(&asker) && askers.len() >= MAX_ASKERS {
            askers.retain(|_, c| !c.spent.is_full(now));
            if askers.len() >= MAX_ASKERS {
                return;
            }
        }
        let counted = askers.entry(asker).or_insert_with(|| Counted {
            spent: Bucket::full(now),
            recorded: false,
        });
        counted.spent.try_take(now, self.rate);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn an_asker_is_examined_until_its_count_runs_out_then_once_each_interval() {
        let throttle = Throttle::new(JOIN_RATE);
        let start = Instant::now();
        let a = ip("192.0.2.7");
        for _ in 0..JOIN_RATE.burst {
            assert_eq!(throttle.admit(&a, start), Admit::Yes);
            throttle.count(a, start);
        }
        // Out: refused unexamined, the first recorded, the next not.
        assert_eq!(
            throttle.admit(&a, start),
            Admit::No {
                retry_after: JOIN_RATE.interval,
                record: true
            }
        );
        let soon = start + Duration::from_secs(1);
        assert_eq!(
            throttle.admit(&a, soon),
            Admit::No {
                retry_after: JOIN_RATE.interval - Duration::from_secs(1),
                record: false
            }
        );
        // Another asker is not held back.
        assert_eq!(throttle.admit(&ip("192.0.2.8"), soon), Admit::Yes);
        // One interval on: examined once more; counted again, the next run is recorded again.
        let later = start + JOIN_RATE.interval;
        assert_eq!(throttle.admit(&a, later), Admit::Yes);
        throttle.count(a, later);
        assert!(matches!(
            throttle.admit(&a, later),
            Admit::No { record: true, .. }
        ));
    }

    #[test]
    fn renewals_are_paced_by_the_certificate_lifetime() {
        let day = renewal_rate(Duration::from_secs(86_400));
        assert_eq!((day.burst, day.interval), (5, Duration::from_secs(60)));
        let short = renewal_rate(Duration::from_secs(8));
        assert_eq!(short.interval, Duration::from_secs(2));
        assert_eq!(
            renewal_rate(Duration::from_secs(2)).interval,
            Duration::from_secs(1)
        );
        // An agent with 5 s certificates renews every 3.3 s, and is never held.
        let rate = renewal_rate(Duration::from_secs(5));
        let throttle = Throttle::new(rate);
        let mut now = Instant::now();
        for i in 0..1000 {
            assert_eq!(throttle.admit(&"a", now), Admit::Yes, "{i}");
            throttle.count("a", now);
            now += Duration::from_millis(3333);
        }
    }

    #[test]
    fn memory_is_bounded_and_askers_back_to_nothing_are_forgotten() {
        let throttle = Throttle::new(JOIN_RATE);
        let start = Instant::now();
        for i in 0..MAX_ASKERS {
            throttle.count(i, start);
        }
        assert_eq!(throttle.len(), MAX_ASKERS);
        // All still counting: a new asker goes uncounted rather than growing the map.
        throttle.count(MAX_ASKERS, start);
        assert_eq!(throttle.len(), MAX_ASKERS);
        // Once their one request has been forgiven, they make room.
        let later = start + JOIN_RATE.interval;
        throttle.count(MAX_ASKERS, later);
        assert_eq!(throttle.len(), 1);
    }
}
