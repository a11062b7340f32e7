//! Reconnect delays: capped exponential backoff with full jitter.

use std::time::Duration;

/// Capped exponential backoff: attempt `n` waits a uniformly random time in
/// `[0, min(max, initial * 2^n)]` ("full jitter"), so a fleet that lost its
/// coordinator does not reconnect in lockstep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The ceiling of the first delay.
    pub initial: Duration,
    /// No delay is longer than this.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// The longest delay of attempt `attempt` (0-based): `min(max, initial * 2^attempt)`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        2u32.checked_pow(attempt)
            .and_then(|factor| self.initial.checked_mul(factor))
            .map_or(self.max, |d| d.min(self.max))
    }

    /// A random delay for attempt `attempt`, uniform in `[0, ceiling(attempt)]`.
    pub fn delay(&self, attempt: u32, rng: &mut fastrand::Rng) -> Duration {
        full_jitter(self.ceiling(attempt), rng)
    }
}

/// A uniformly random duration in `[0, ceiling]`, at nanosecond resolution.
pub fn full_jitter(ceiling: Duration, rng: &mut fastrand::Rng) -> Duration {
    // Ceilings beyond u64 nanoseconds (584 years) are clamped; no one waits that long.
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rng.u64(0..=nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_then_caps() {
        let b = Backoff::default();
        let cases = [
            (0, 200),
            (1, 400),
            (2, 800),
            (7, 25_600),
            (8, 30_000),
            (31, 30_000),
            (32, 30_000),
            (u32::MAX, 30_000),
        ];
        for (attempt, ms) in cases {
            assert_eq!(
                b.ceiling(attempt),
                Duration::from_millis(ms),
                "attempt {attempt}"
            );
        }
    }

    /// Property: for many seeds and shapes, every delay lies in `[0, min(max, initial*2^n)]`,
    /// never above `max`, and the cap is reached.
    #[test]
    fn every_delay_is_within_its_bounds() {
        for seed in 0..300u64 {
            let mut shape = fastrand::Rng::with_seed(seed ^ 0x5eed);
            let initial = Duration::from_nanos(shape.u64(1..=2_000_000_000));
            let max = initial + Duration::from_nanos(shape.u64(0..=60_000_000_000));
            let b = Backoff { initial, max };
            let mut rng = fastrand::Rng::with_seed(seed);
            for attempt in 0..80u32 {
                let want = (initial.as_nanos() * (1u128 << attempt.min(100))).min(max.as_nanos());
                let ceiling = b.ceiling(attempt);
                assert_eq!(ceiling.as_nanos(), want, "seed {seed} attempt {attempt}");
                let d = b.delay(attempt, &mut rng);
                assert!(
                    d <= ceiling,
                    "seed {seed} attempt {attempt}: {d:?} > {ceiling:?}"
                );
                assert!(
                    d <= max,
                    "seed {seed} attempt {attempt}: {d:?} > max {max:?}"
                );
            }
            assert_eq!(b.ceiling(79), max, "seed {seed}: the cap is reached");
        }
    }

    #[test]
    fn jitter_spreads_over_the_whole_range() {
        let mut rng = fastrand::Rng::with_seed(7);
        let ceiling = Duration::from_secs(1);
        let delays: Vec<_> = (0..2000).map(|_| full_jitter(ceiling, &mut rng)).collect();
        assert!(delays.iter().any(|d| *d < Duration::from_millis(100)));
        assert!(delays.iter().any(|d| *d > Duration::from_millis(900)));
        assert_eq!(full_jitter(Duration::ZERO, &mut rng), Duration::ZERO);
    }
}
