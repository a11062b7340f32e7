//! Retrying idempotent etcd operations: jittered exponential backoff within a bounded total
//! time, so that a request the client sent to a dead member goes to a live one next.
//!
//! The etcd client sends each request to one member and moves to the next one when a request
//! fails for want of a connection or a leader (see `client.rs`); a request to a member that is
//! down fails at once with a transport error. A short first delay is enough: the next attempt
//! already goes to another member.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Fault, Result};

/// How long to wait between attempts and for how long to try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RetryPolicy {
    /// The upper bound of the first delay; each next bound doubles it.
    pub first: Duration,
    /// The largest delay between two attempts.
    pub max: Duration,
    /// No attempt starts after this much time since the first one.
    pub budget: Duration,
}

impl RetryPolicy {
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            first: Duration::from_millis(20),
            max: Duration::from_millis(500),
            budget,
        }
    }

    /// The delay after failed attempt number `attempt` (0 for the first), given `unit`, a random
    /// draw in `[0, 1)`: between half and all of `min(first * 2^attempt, max)`. Half is kept so
    /// that retries never turn into a busy loop; the jitter spreads replicas that failed
    /// together.
    pub(crate) fn delay(&self, attempt: u32, unit: f64) -> Duration {
        let bound = self
            .first
            .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
            .min(self.max);
        bound.mul_f64(0.5 + unit.clamp(0.0, 1.0) / 2.0)
    }
}

/// Runs `attempt` (given the attempt number, from 0) until it succeeds, fails for good, or the
/// budget would run out before the next try. The error reports the most telling fault seen
/// (a missing leader over unreachable members), with `op` and `key`.
///
/// `attempt` is a closure returning a future rather than an async closure: futures of async
/// closures that borrow are not provably `Send`, and these run in spawned tasks.
pub(crate) async fn retry<T, F, Fut>(
    op: &'static str,
    key: &str,
    policy: RetryPolicy,
    mut attempt: F,
) -> Result<T>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, Fault>>,
{
    let start = Instant::now();
    let mut seen: Option<Fault> = None;
    let mut n = 0;
    loop {
        let fault = match attempt(n).await {
            Ok(value) => return Ok(value),
            Err(fault) => fault,
        };
        n += 1;
        if !fault.is_transient() {
            return Err(fault.into_error(op, key, n, start.elapsed()));
        }
        let fault = match seen.take() {
            Some(before) => before.most_telling(fault),
            None => fault,
        };
        let delay = policy.delay(n - 1, fastrand::f64());
        if start.elapsed() + delay > policy.budget {
            tracing::debug!(op, key, attempts = n, fault = ?fault, "giving up");
            return Err(fault.into_error(op, key, n, start.elapsed()));
        }
        tracing::trace!(op, key, attempt = n, ?delay, fault = ?fault, "retrying");
        seen = Some(fault);
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ClusterError;

    #[test]
    fn delays_stay_within_their_bounds() {
        let policy = RetryPolicy::new(Duration::from_secs(5));
        let mut rng = fastrand::Rng::with_seed(7);
        for attempt in 0..64 {
            let bound = (policy.first * 2u32.pow(attempt.min(20))).min(policy.max);
            for _ in 0..200 {
                let d = policy.delay(attempt, rng.f64());
                assert!(
                    d >= bound / 2 && d <= bound,
                    "attempt {attempt}: {d:?} vs {bound:?}"
                );
            }
        }
        assert_eq!(policy.delay(0, 1.0), policy.first);
        assert_eq!(policy.delay(40, 1.0), policy.max);
        assert_eq!(policy.delay(3, -5.0), policy.first * 8 / 2);
    }

    #[tokio::test(start_paused = true)]
    async fn transient_faults_are_retried_until_success() {
        let policy = RetryPolicy::new(Duration::from_secs(5));
        let got = retry("get", "/k", policy, |n| async move {
            if n < 3 {
                Err(Fault::Unreachable("refused".into()))
            } else {
                Ok(n)
            }
        })
        .await;
        assert_eq!(got.ok(), Some(3));
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_bounds_the_time_and_no_leader_is_reported() {
        let policy = RetryPolicy::new(Duration::from_secs(2));
        let start = Instant::now();
        let got: Result<()> = retry("claim", "/toolsrv/hosts/a", policy, |n| async move {
            Err(if n == 1 {
                Fault::NoLeader("etcdserver: no leader".into())
            } else {
                Fault::Unreachable("connection refused".into())
            })
        })
        .await;
        assert!(
            start.elapsed() <= Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        match got {
            Err(ClusterError::NoQuorum { op, key, .. }) => {
                assert_eq!((op, key.as_str()), ("claim", "/toolsrv/hosts/a"));
            }
            other => panic!("want NoQuorum, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_faults_are_not_retried() {
        let policy = RetryPolicy::new(Duration::from_secs(5));
        let calls = std::cell::Cell::new(0);
        let got: Result<()> = retry("put", "/k", policy, |_| {
            calls.set(calls.get() + 1);
            async { Err(Fault::Permanent("bad".into())) }
        })
        .await;
        assert!(matches!(got, Err(ClusterError::Refused { .. })));
        assert_eq!(calls.get(), 1);
    }
}
