//! The replica's health as far as etcd goes: a few named conditions (etcd reachable with a
//! quorum, our lease held, the watch running), published through a `watch` channel and logged
//! once on each transition.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::error::Fault;

/// What a replica reports about its etcd side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterHealth {
    Ok,
    /// Something is wrong; the replica keeps serving the links it holds. The reason names
    /// each failing condition.
    Degraded(String),
}

impl ClusterHealth {
    pub fn is_ok(&self) -> bool {
        matches!(self, Self::Ok)
    }
}

/// One thing that can be wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Condition {
    /// etcd answers, with a leader (from the lease renewals).
    Etcd,
    /// This replica holds a lease.
    Lease,
    /// The routing table follows etcd.
    Watch,
}

impl Condition {
    fn name(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::Lease => "lease",
            Self::Watch => "routing table",
        }
    }
}

/// How long etcd must have been without a leader before new claims are refused at once
/// rather than retried: longer than an election takes (etcd's default election timeout is
/// 1 s, and a new leader normally follows within two), so that a leader that dies is ridden
/// out by the claims' retries, and a lost quorum still answers quickly.
pub const ELECTION_GRACE: Duration = Duration::from_secs(2);

/// The conditions now failing, and their publication.
#[derive(Debug)]
pub(crate) struct Health {
    failing: Mutex<BTreeMap<Condition, Failing>>,
    tx: watch::Sender<ClusterHealth>,
    replica: String,
    grace: Duration,
}

/// A failing condition.
#[derive(Debug, Clone)]
pub(crate) struct Failing {
    pub reason: String,
    /// Set for [`Condition::Etcd`]: why new claims are refused.
    pub fault: Option<Fault>,
    /// Since when the condition fails for this reason (its first words).
    since: Instant,
}

impl Health {
    pub(crate) fn new(replica: &str) -> Self {
        Self::with_grace(replica, ELECTION_GRACE)
    }

    fn with_grace(replica: &str, grace: Duration) -> Self {
        Self {
            failing: Mutex::new(BTreeMap::new()),
            tx: watch::Sender::new(ClusterHealth::Ok),
            replica: replica.to_string(),
            grace,
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<ClusterHealth> {
        self.tx.subscribe()
    }

    pub(crate) fn get(&self) -> ClusterHealth {
        self.tx.borrow().clone()
    }

    /// Marks `condition` failing because of `reason` (etcd faults carry the fault, so that
    /// claims are refused with the right error).
    pub(crate) fn fail(&self, condition: Condition, reason: String, fault: Option<Fault>) {
        let mut failing = self.lock();
        // The reason's first words are enough to tell a transition from a repeat; details
        // (ports, timings) change from one failure to the next.
        let kept = failing
            .get(&condition)
            .filter(|b| gist(&b.reason) == gist(&reason))
            .map(|b| b.since);
        let same = kept.is_some();
        let since = kept.unwrap_or_else(Instant::now);
        failing.insert(
            condition,
            Failing {
                reason,
                fault,
                since,
            },
        );
        if !same {
            tracing::warn!(
                replica = %self.replica,
                condition = condition.name(),
                reason = %failing[&condition].reason,
                "cluster degraded"
            );
        }
        self.publish(&failing, true);
    }

    /// Marks the replica as having left the cluster (shut down): degraded for good, without
    /// the warnings of a fault.
    pub(crate) fn left(&self) {
        let mut failing = self.lock();
        failing.insert(
            Condition::Lease,
            Failing {
                reason: "left the cluster".into(),
                fault: None,
                since: Instant::now(),
            },
        );
        self.publish(&failing, false);
    }

    /// Marks `condition` as fine again.
    pub(crate) fn clear(&self, condition: Condition) {
        let mut failing = self.lock();
        if failing.remove(&condition).is_some() {
            tracing::info!(
                replica = %self.replica,
                condition = condition.name(),
                "cluster condition recovered"
            );
            self.publish(&failing, true);
        }
    }

    /// Why a new claim must be refused now, without trying etcd, if it must: etcd without a
    /// quorum (a member said it has no leader) for longer than [`ELECTION_GRACE`]. Anything
    /// shorter may be an election, which the claim's own retries ride out; etcd out of reach
    /// is no reason either (a renewal that stalls while the members elect a new leader looks
    /// the same), nor a lost lease (the claim waits for the new one within its retries).
    pub(crate) fn refusal(&self) -> Option<Fault> {
        no_quorum(&self.lock())
            .filter(|f| f.since.elapsed() >= self.grace)
            .and_then(|f| f.fault.clone())
    }

    /// Why `condition` fails, while it does.
    pub(crate) fn reason(&self, condition: Condition) -> Option<String> {
        self.lock().get(&condition).map(|f| f.reason.clone())
    }

    /// The fault of a lost quorum (a member said it has no leader), while etcd is failing so.
    pub(crate) fn no_quorum(&self) -> Option<Fault> {
        no_quorum(&self.lock()).and_then(|f| f.fault.clone())
    }

    fn publish(&self, failing: &BTreeMap<Condition, Failing>, log: bool) {
        let now = if failing.is_empty() {
            ClusterHealth::Ok
        } else {
            ClusterHealth::Degraded(
                failing
                    .iter()
                    .map(|(c, f)| format!("{}: {}", c.name(), f.reason))
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        };
        let was_ok = self.tx.borrow().is_ok();
        if log && was_ok != now.is_ok() {
            match &now {
                ClusterHealth::Ok => tracing::info!(replica = %self.replica, "cluster healthy"),
                ClusterHealth::Degraded(reason) => {
                    tracing::warn!(replica = %self.replica, %reason, "cluster unhealthy")
                }
            }
        }
        self.tx.send_if_modified(|h| {
            let changed = *h != now;
            *h = now;
            changed
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Condition, Failing>> {
        // A panic while holding this lock leaves a plain map behind: still usable.
        self.failing.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn no_quorum(failing: &BTreeMap<Condition, Failing>) -> Option<&Failing> {
    failing
        .get(&Condition::Etcd)
        .filter(|f| matches!(f.fault, Some(Fault::NoLeader(_))))
}

fn gist(reason: &str) -> &str {
    reason.split([':', '(']).next().unwrap_or(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_add_up_and_clear() {
        let health = Health::new("r1");
        let rx = health.subscribe();
        assert_eq!(health.get(), ClusterHealth::Ok);
        health.fail(
            Condition::Etcd,
            "no quorum: etcdserver: no leader".into(),
            Some(Fault::NoLeader("x".into())),
        );
        health.fail(Condition::Lease, "lease lost".into(), None);
        let ClusterHealth::Degraded(reason) = rx.borrow().clone() else {
            panic!("not degraded");
        };
        assert!(reason.contains("etcd: no quorum") && reason.contains("lease: lease lost"));
        health.clear(Condition::Etcd);
        assert!(!health.get().is_ok(), "the lease is still lost");
        health.clear(Condition::Lease);
        assert_eq!(*rx.borrow(), ClusterHealth::Ok);
        assert!(health.refusal().is_none());
    }

    #[test]
    fn only_a_lost_quorum_refuses_claims_at_once() {
        let health = Health::with_grace("r1", Duration::ZERO);
        health.fail(
            Condition::Etcd,
            "unreachable: no answer within 1s".into(),
            Some(Fault::Unreachable("x".into())),
        );
        assert!(!health.get().is_ok());
        assert!(
            health.refusal().is_none(),
            "a stalled renewal is no lost quorum"
        );
        assert_eq!(health.no_quorum(), None);
        health.fail(
            Condition::Etcd,
            "no quorum: etcdserver: no leader".into(),
            Some(Fault::NoLeader("x".into())),
        );
        assert!(health.refusal().is_some());
        assert_eq!(health.no_quorum(), Some(Fault::NoLeader("x".into())));
        health.fail(Condition::Lease, "lease lost".into(), None);
        health.clear(Condition::Etcd);
        assert!(
            health.refusal().is_none(),
            "a lost lease is waited for, not refused"
        );
    }

    #[test]
    fn an_election_is_no_lost_quorum() {
        let health = Health::with_grace("r1", Duration::from_millis(300));
        let no_leader = |n: u32| {
            health.fail(
                Condition::Etcd,
                format!("no quorum (etcd has no leader: member {n})"),
                Some(Fault::NoLeader(format!("member {n}"))),
            )
        };
        no_leader(1);
        assert!(health.refusal().is_none(), "within the grace: retried");
        assert!(!health.get().is_ok(), "but reported");
        std::thread::sleep(Duration::from_millis(200));
        no_leader(2);
        assert!(health.refusal().is_none(), "a repeat keeps the first time");
        std::thread::sleep(Duration::from_millis(150));
        no_leader(3);
        assert!(health.refusal().is_some(), "past the grace: refused");
        health.clear(Condition::Etcd);
        no_leader(4);
        assert!(
            health.refusal().is_none(),
            "a new outage starts a new grace"
        );
    }
}
