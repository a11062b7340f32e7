//! Refused joins, counted per address. `Join` is served to anyone who reaches the port, and each
//! refused join costs an audit record, a log line and, for a service account token, a review by
//! the Kubernetes API. Unbounded, a peer with no certificate sending bogus joins in a loop filled
//! the audit log's disk (which stops every call: [`crate::audit`]) and kept the API server busy.
//!
//! An address (an IPv4 address, or an IPv6 /64, which one host can hold whole) may have
//! [`RATE`]`.burst` refused joins at once, then one more each [`RATE`]`.interval`. Past that its
//! joins are refused at once, unexamined (no token looked up, no review asked), with
//! `RESOURCE_EXHAUSTED` saying when to come back; the first of each run is recorded, the others
//! only counted (`toolsrv_joins_throttled_total`). A join that succeeds costs nothing, so a host
//! with a good token is never held back by its own earlier mistakes for long.
//!
//! At most [`MAX_ADDRESSES`] addresses are remembered; past that, those whose count has gone
//! back to nothing are forgotten, and while every one is still counting, a new address's
//! refusals go uncounted (memory stays bounded; an attacker with that many addresses is slowed
//! by each of them all the same).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use toolsrv_tls::address_key;

use crate::bucket::{Bucket, Rate};

/// Refused joins one address may have at once, then one more each interval.
pub(crate) const RATE: Rate = Rate {
    burst: 10,
    interval: Duration::from_secs(6),
};

/// Addresses remembered at most.
pub(crate) const MAX_ADDRESSES: usize = 65_536;

#[derive(Debug, Default)]
pub(crate) struct Throttle {
    addresses: Mutex<HashMap<IpAddr, Counted>>,
}

#[derive(Debug)]
struct Counted {
    refusals: Bucket,
    /// Whether this run of unexamined refusals has been recorded.
    recorded: bool,
}

/// Whether to examine a join.
#[derive(Debug, PartialEq)]
pub(crate) enum Admit {
    Yes,
    /// Refused unexamined; `record`: the first of this run, to be audited.
    No {
        retry_after: Duration,
        record: bool,
    },
}

impl Throttle {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Counted>> {
        self.addresses.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a join from `ip` at `now` is examined.
    pub fn admit(&self, ip: IpAddr, now: Instant) -> Admit {
        let mut addresses = self.lock();
        let Some(counted) = addresses.get_mut(&address_key(ip)) else {
            return Admit::Yes;
        };
        let next = counted.refusals.next_at(RATE);
        if now >= next {
            counted.recorded = false;
            return Admit::Yes;
        }
        Admit::No {
            retry_after: next - now,
            record: !std::mem::replace(&mut counted.recorded, true),
        }
    }

    /// A join from `ip` was examined and refused at `now`.
    pub fn refused(&self, ip: IpAddr, now: Instant) {
        let key = address_key(ip);
        let mut addresses = self.lock();
        if !addresses.contains_key(&key) && addresses.len() >= MAX_ADDRESSES {
            addresses.retain(|_, c| !c.refusals.is_full(now));
            if addresses.len() >= MAX_ADDRESSES {
                return;
            }
        }
        let counted = addresses.entry(key).or_insert_with(|| Counted {
            refusals: Bucket::full(now),
            recorded: false,
        });
        counted.refusals.try_take(now, RATE);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn an_address_is_examined_until_its_refusals_run_out_then_once_each_interval() {
        let throttle = Throttle::default();
        let start = Instant::now();
        let a = ip("192.0.2.7");
        for _ in 0..RATE.burst {
            assert_eq!(throttle.admit(a, start), Admit::Yes);
            throttle.refused(a, start);
        }
        // Out: refused unexamined, the first recorded, the next not.
        assert_eq!(
            throttle.admit(a, start),
            Admit::No {
                retry_after: RATE.interval,
                record: true
            }
        );
        let soon = start + Duration::from_secs(1);
        assert_eq!(
            throttle.admit(a, soon),
            Admit::No {
                retry_after: RATE.interval - Duration::from_secs(1),
                record: false
            }
        );
        // Another address is not held back.
        assert_eq!(throttle.admit(ip("192.0.2.8"), soon), Admit::Yes);
        // One interval on: examined once more; refused again, the next run is recorded again.
        let later = start + RATE.interval;
        assert_eq!(throttle.admit(a, later), Admit::Yes);
        throttle.refused(a, later);
        assert!(matches!(
            throttle.admit(a, later),
            Admit::No { record: true, .. }
        ));
    }

    #[test]
    fn an_ipv6_slash_64_counts_as_one_address_and_mapped_ipv4_as_its_ipv4() {
        let throttle = Throttle::default();
        let now = Instant::now();
        for i in 0..RATE.burst {
            // Each refusal from another address of the same /64.
            throttle.refused(ip(&format!("2001:db8:1:2::{:x}", i + 1)), now);
        }
        assert!(matches!(
            throttle.admit(ip("2001:db8:1:2:ffff::9"), now),
            Admit::No { .. }
        ));
        assert_eq!(throttle.admit(ip("2001:db8:1:3::1"), now), Admit::Yes);
        for _ in 0..RATE.burst {
            throttle.refused(ip("::ffff:198.51.100.1"), now);
        }
        assert!(matches!(
            throttle.admit(ip("198.51.100.1"), now),
            Admit::No { .. }
        ));
    }

    #[test]
    fn memory_is_bounded_and_addresses_back_to_nothing_are_forgotten() {
        let throttle = Throttle::default();
        let start = Instant::now();
        let nth = |i: usize| IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i as u32));
        for i in 0..MAX_ADDRESSES {
            throttle.refused(nth(i), start);
        }
        assert_eq!(throttle.len(), MAX_ADDRESSES);
        // All still counting: a new address goes uncounted rather than growing the map.
        throttle.refused(nth(MAX_ADDRESSES), start);
        assert_eq!(throttle.len(), MAX_ADDRESSES);
        // Once their one refusal has been forgiven, they make room.
        let later = start + RATE.interval;
        throttle.refused(nth(MAX_ADDRESSES), later);
        assert_eq!(throttle.len(), 1);
    }
}
