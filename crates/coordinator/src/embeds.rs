//! What the find index's encoder may embed for the tools a host offers from its own `--tools`
//! directories: a budget of texts per host and hour.
//!
//! The catalog's tools are the operator's and are always embedded. A host's own tools are the
//! host's word, and a compromised agent could change them with every view it sends: 256 new
//! tools (`--max-host-only-tools`) of up to 33 texts each, every second, each text an encoder
//! pass (6 ms with all-MiniLM-L6-v2, 32 ms with all-mpnet-base-v2), keeping the coordinator's
//! cores busy for as long as it likes. So each host has a bucket of texts, full at the start
//! and refilled continuously at `--max-host-only-embeds-per-hour`; a tool of a host's own
//! whose new texts its host's bucket cannot pay for is left out of the index (still listed,
//! loadable and callable: only `FindTools` does not find it) until a later build can. A tool
//! several hosts offer as their own is paid for by the one with the most left. Texts the index
//! already has a vector for cost nothing, so a host that reconnects, or whose view changes in
//! other ways, pays only for what is new.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Texts of one host's own tools the encoder embeds per hour by default
/// (`--max-host-only-embeds-per-hour`): a host's worth of real tools (256 tools of a summary
/// and about seven keyword phrases each) at once, and as much again each hour.
pub const DEFAULT_MAX_HOST_ONLY_EMBEDS_PER_HOUR: usize = 2048;

/// Texts one tool has at most: its summary and the keyword phrases embedded on their own. A
/// bucket holds at least this many, so that every tool can be paid for eventually.
const MOST_TEXTS_OF_A_TOOL: usize = 1 + toolsrv_find::MAX_KEYWORD_PASSAGES;

/// Shortest wait before a build retries tools it left out: their buckets refill continuously,
/// and each retry rebuilds the index (for 1,000 tools, tens of milliseconds of ranking
/// statistics even with nothing to embed).
const SHORTEST_RETRY: Duration = Duration::from_secs(10);

/// Every host's bucket of texts.
#[derive(Debug)]
pub struct Budget {
    per_hour: usize,
    hosts: HashMap<String, Bucket>,
}

#[derive(Debug)]
struct Bucket {
    /// Texts it may still pay for, as of `at`.
    texts: f64,
    at: Instant,
    /// Whether the last build left one of the host's tools out (to log a change once).
    deferring: bool,
}

/// One index build's use of the budget, from [`Budget::round`].
#[derive(Debug)]
pub struct Round<'a> {
    budget: &'a mut Budget,
    now: Instant,
    /// Tools left out, by the host that could not pay for them.
    deferred: BTreeMap<String, usize>,
    /// The soonest a tool left out could be paid for.
    retry_in: Option<Duration>,
}

/// What a build's [`Round`] did with the budget.
#[derive(Debug, Default, PartialEq)]
pub struct Spent {
    /// Tools left out in all.
    pub deferred: usize,
    /// Hosts whose tools were left out this build and not the one before, with how many.
    pub started: Vec<(String, usize)>,
    /// Hosts whose tools were left out by the build before and none by this one.
    pub cleared: Vec<String>,
    /// When a build could take a tool left out.
    pub retry_in: Option<Duration>,
}

impl Budget {
    /// `per_hour` texts per host and hour; at least one tool's worth.
    pub fn new(per_hour: usize) -> Self {
        Self {
            per_hour: per_hour.max(MOST_TEXTS_OF_A_TOOL),
            hosts: HashMap::new(),
        }
    }

    /// Texts a host's bucket holds when full, and refills per hour.
    pub fn per_hour(&self) -> usize {
        self.per_hour
    }

    /// The budget as one build at `now` uses it.
    pub fn round(&mut self, now: Instant) -> Round<'_> {
        Round {
            budget: self,
            now,
            deferred: BTreeMap::new(),
            retry_in: None,
        }
    }

    fn capacity(&self) -> f64 {
        self.per_hour as f64
    }

    /// Texts refilled per second.
    fn rate(&self) -> f64 {
        self.capacity() / 3600.0
    }

    /// What host `id` may pay for at `now`.
    fn left(&mut self, id: &str, now: Instant) -> f64 {
        let (capacity, rate) = (self.capacity(), self.rate());
        let bucket = self.hosts.entry(id.to_string()).or_insert(Bucket {
            texts: capacity,
            at: now,
            deferring: false,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.texts = (bucket.texts + elapsed * rate).min(capacity);
        bucket.at = now.max(bucket.at);
        bucket.texts
    }
}

impl Round<'_> {
    /// Whether the encoder may embed `texts` new texts of a tool that `owners` offer as their
    /// own (none: a tool the catalog ships, always). The owner with the most left pays.
    pub fn admit(&mut self, owners: &[String], texts: usize) -> bool {
        let now = self.now;
        let Some((payer, left)) = owners
            .iter()
            .map(|id| (id, self.budget.left(id, now)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
        else {
            return true;
        };
        // A tool with more texts than a bucket holds (none has: see MOST_TEXTS_OF_A_TOOL) waits
        // for a full one.
        let need = (texts as f64).min(self.budget.capacity());
        if left >= need {
            if let Some(bucket) = self.budget.hosts.get_mut(payer.as_str()) {
                bucket.texts -= need;
            }
            return true;
        }
        *self.deferred.entry(payer.clone()).or_default() += 1;
        let short = need - left;
        let wait = Duration::from_secs_f64(short / self.budget.rate()).max(SHORTEST_RETRY);
        self.retry_in = Some(self.retry_in.map_or(wait, |w| w.min(wait)));
        false
    }

    /// Ends the build's use of the budget; full buckets of hosts with nothing left out are
    /// forgotten (a new bucket starts full).
    pub fn finish(self) -> Spent {
        let Round {
            budget,
            now,
            deferred,
            retry_in,
        } = self;
        let mut spent = Spent {
            deferred: deferred.values().sum(),
            retry_in,
            ..Spent::default()
        };
        for (id, n) in &deferred {
            if let Some(bucket) = budget.hosts.get_mut(id)
                && !std::mem::replace(&mut bucket.deferring, true)
            {
                spent.started.push((id.clone(), *n));
            }
        }
        let ids: Vec<String> = budget.hosts.keys().cloned().collect();
        for id in ids {
            let full = budget.left(&id, now) >= budget.capacity();
            let Some(bucket) = budget.hosts.get_mut(&id) else {
                continue;
            };
            if bucket.deferring && !deferred.contains_key(&id) {
                bucket.deferring = false;
                spent.cleared.push(id.clone());
            }
            if full && !bucket.deferring {
                budget.hosts.remove(&id);
            }
        }
        spent.cleared.sort_unstable();
        spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_host_pays_for_new_texts_of_its_own_tools_and_the_catalog_s_are_free() {
        let start = Instant::now();
        let mut budget = Budget::new(100);
        let mut round = budget.round(start);
        assert!(
            round.admit(&[], 10_000),
            "a shipped tool is always embedded"
        );
        assert!(round.admit(&hosts(&["a"]), 60));
        assert!(round.admit(&hosts(&["a"]), 40));
        assert!(!round.admit(&hosts(&["a"]), 1), "a's bucket is empty");
        assert!(round.admit(&hosts(&["b"]), 30), "b has a bucket of its own");
        // A tool both offer is paid for by the one with the most left.
        assert!(round.admit(&hosts(&["a", "b"]), 60));
        // b has 10 left, a none: b is the one short.
        assert!(!round.admit(&hosts(&["a", "b"]), 20));
        let spent = round.finish();
        assert_eq!(spent.deferred, 2);
        assert_eq!(
            spent.started,
            vec![("a".to_string(), 1), ("b".to_string(), 1)]
        );
        // a is short of 1 text, which refills in 36 s at 100 an hour; b of 10.
        let retry = spent.retry_in.unwrap();
        assert!(
            retry >= Duration::from_secs(35) && retry <= Duration::from_secs(37),
            "{retry:?}"
        );

        // The same tools left out again: nothing new to log.
        let later = start + Duration::from_secs(10);
        let mut round = budget.round(later);
        assert!(!round.admit(&hosts(&["a"]), 1));
        assert!(!round.admit(&hosts(&["a", "b"]), 20));
        let spent = round.finish();
        assert_eq!((spent.deferred, spent.started.len()), (2, 0));
        assert!(spent.cleared.is_empty());

        // Half an hour on, half a bucket more for each: both pay for what they were short of.
        let later = start + Duration::from_secs(1800);
        let mut round = budget.round(later);
        assert!(round.admit(&hosts(&["a"]), 50));
        assert!(round.admit(&hosts(&["a", "b"]), 20), "b pays, with 60 left");
        let spent = round.finish();
        assert_eq!(spent.deferred, 0);
        assert_eq!(spent.cleared, hosts(&["a", "b"]));
        assert_eq!(spent.retry_in, None);
    }

    #[test]
    fn a_tool_larger_than_a_bucket_waits_for_a_full_one_and_full_buckets_are_forgotten() {
        let start = Instant::now();
        // Below one tool's worth, a bucket still holds one tool's worth.
        let mut budget = Budget::new(1);
        assert_eq!(budget.per_hour(), MOST_TEXTS_OF_A_TOOL);
        let mut round = budget.round(start);
        assert!(round.admit(&hosts(&["a"]), MOST_TEXTS_OF_A_TOOL));
        assert!(!round.admit(&hosts(&["a"]), MOST_TEXTS_OF_A_TOOL + 100));
        let retry = round.finish().retry_in.unwrap();
        assert!(
            retry >= Duration::from_secs(3599) && retry <= Duration::from_secs(3601),
            "{retry:?}"
        );

        // A host never short and back to a full bucket leaves nothing behind.
        let mut budget = Budget::new(100);
        let mut round = budget.round(start);
        assert!(round.admit(&hosts(&["a"]), 10));
        round.finish();
        assert_eq!(budget.hosts.len(), 1);
        let round = budget.round(start + Duration::from_secs(3600));
        round.finish();
        assert!(budget.hosts.is_empty());
        // A wait is never shorter than the shortest retry: 10,000 texts a second refill one
        // in a tenth of a millisecond.
        let mut budget = Budget::new(36_000_000);
        let mut round = budget.round(start);
        assert!(round.admit(&hosts(&["c"]), 36_000_000));
        assert!(!round.admit(&hosts(&["c"]), 1));
        assert_eq!(round.finish().retry_in, Some(SHORTEST_RETRY));
    }
}
