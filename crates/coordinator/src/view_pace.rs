//! The pace at which one link's views are stored. Every view stored tells every client watching
//! the catalog, wakes every session watcher and the `FindTools` index, and (with replicas) every
//! other replica. An agent reporting views without pause (a compromised one, or a script
//! rewriting its tools directory in a loop) sent about 20,000 a second, all of them passed on.
//!
//! A link may store [`BURST`] views at once, then one each [`INTERVAL`]. A view that comes
//! before its turn waits for it, and a later view replaces the waiting one (which is passed
//! over, never stored): the last view an agent reports is always stored, at most [`INTERVAL`]
//! late, and an agent reporting at the usual pace (after a catalog change, or when something on
//! its host changed) is never held back. The first view of a catalog revision newer than any
//! view stored on the link, and one the link was sent, is stored at once even without a turn:
//! how often those come is the coordinator's to say (a catalog edited in many steps makes many
//! revisions), not the agent's.

use std::time::Duration;

use tokio::time::Instant;
use toolsrv_proto::v1::HostView;

use crate::bucket::{Bucket, Rate};

/// Views one link may store at once.
pub(crate) const BURST: u32 = 16;
/// Then one view each this long.
pub(crate) const INTERVAL: Duration = Duration::from_millis(500);

const RATE: Rate = Rate {
    burst: BURST,
    interval: INTERVAL,
};

/// One link's pace, and the view waiting for its turn.
#[derive(Debug)]
pub(crate) struct ViewPace {
    /// A turn to store a view is a token.
    turns: Bucket,
    waiting: Option<HostView>,
    /// Whether a view has waited on this link yet.
    held: bool,
    /// The newest catalog revision, among those the link was sent, of a view stored on it.
    newest: Option<u64>,
}

/// What to do with a view the agent reported.
#[derive(Debug, PartialEq)]
pub(crate) struct Offered {
    /// The view to store now; `None`: it waits for its turn.
    pub store: Option<HostView>,
    /// A view that was waiting is passed over: this one replaces it.
    pub replaced: bool,
    /// The first view of the link that waits.
    pub first_wait: bool,
}

impl ViewPace {
    pub fn new(now: Instant) -> Self {
        Self {
            turns: Bucket::full(now),
            waiting: None,
            held: false,
            newest: None,
        }
    }

    /// A whole view from the agent at `now`; `sent`: its catalog revision is one the link was
    /// sent lately (another is passed over when stored, so it has no claim to be on time).
    pub fn offer(&mut self, view: HostView, sent: bool, now: Instant) -> Offered {
        let new_revision = sent && self.newest.is_none_or(|n| view.catalog_revision > n);
        // A view of a newer catalog takes a turn when one is free, and is stored regardless.
        let turn = self.turns.try_take(now, RATE);
        let (store, replaced, first_wait) = if turn || new_revision {
            if sent {
                self.newest = self.newest.max(Some(view.catalog_revision));
            }
            (Some(view), self.waiting.take().is_some(), false)
        } else {
            let replaced = self.waiting.replace(view).is_some();
            (None, replaced, !std::mem::replace(&mut self.held, true))
        };
        Offered {
            store,
            replaced,
            first_wait,
        }
    }

    /// When the waiting view's turn comes; `None` when none waits.
    pub fn due(&self) -> Option<Instant> {
        self.waiting.as_ref()?;
        Some(self.turns.next_at(RATE))
    }

    /// The waiting view, if its turn has come at `now`.
    pub fn take_due(&mut self, now: Instant) -> Option<HostView> {
        self.waiting.as_ref()?;
        if !self.turns.try_take(now, RATE) {
            return None;
        }
        // Never of a newer revision the link was sent: that one would not have waited.
        self.waiting.take()
    }
}

#[cfg(test)]
mod tests {
    use toolsrv_proto::v1::ToolStatus;

    use super::*;

    /// A view of catalog revision 1, told apart from the others by `tag`.
    fn view(tag: u64) -> HostView {
        of_revision(1, tag)
    }

    fn of_revision(revision: u64, tag: u64) -> HostView {
        HostView {
            catalog_revision: revision,
            tools: vec![ToolStatus {
                name: format!("t{tag}"),
                ..ToolStatus::default()
            }],
            more: false,
        }
    }

    fn stored(view: HostView) -> Offered {
        Offered {
            store: Some(view),
            replaced: false,
            first_wait: false,
        }
    }

    fn waits(first_wait: bool, replaced: bool) -> Offered {
        Offered {
            store: None,
            replaced,
            first_wait,
        }
    }

    #[test]
    fn a_burst_is_stored_at_once_then_one_view_each_interval_and_the_last_always() {
        let start = Instant::now();
        let mut pace = ViewPace::new(start);
        for i in 0..u64::from(BURST) {
            assert_eq!(pace.offer(view(i), true, start), stored(view(i)));
        }
        assert_eq!(pace.due(), None);
        // The next waits for one interval; those after it replace it.
        assert_eq!(pace.offer(view(100), true, start), waits(true, false));
        let due = pace.due().unwrap();
        assert_eq!(due, start + INTERVAL);
        for r in 101..110 {
            let now = start + Duration::from_millis(10);
            assert_eq!(pace.offer(view(r), true, now), waits(false, true));
        }
        assert_eq!(pace.take_due(due - Duration::from_millis(1)), None);
        assert_eq!(pace.take_due(due), Some(view(109)), "the latest is stored");
        assert_eq!(pace.due(), None);
        // Still out of turns: the next waits another interval.
        assert_eq!(pace.offer(view(200), true, due), waits(false, false));
        assert_eq!(pace.due(), Some(due + INTERVAL));
    }

    #[test]
    fn a_quiet_link_gets_its_burst_back_and_a_steady_one_is_never_held() {
        let start = Instant::now();
        let mut pace = ViewPace::new(start);
        for i in 0..BURST {
            assert!(pace.offer(view(0), true, start).store.is_some(), "{i}");
        }
        // Quiet for BURST intervals: a whole burst again.
        let later = start + INTERVAL * BURST;
        for i in 0..BURST {
            assert!(pace.offer(view(1), true, later).store.is_some(), "{i}");
        }
        // A view each interval, for ever: stored each time.
        let mut now = later;
        for i in 0..1000 {
            now += INTERVAL;
            assert_eq!(pace.offer(view(2), true, now), stored(view(2)), "{i}");
        }
    }

    #[test]
    fn a_view_arriving_when_the_waiting_one_is_due_is_stored_in_its_place() {
        // The link's loop had not woken for the waiting view when a newer one came: the newer
        // one is stored, the waiting one passed over.
        let start = Instant::now();
        let mut pace = ViewPace::new(start);
        for _ in 0..BURST {
            pace.offer(view(0), true, start);
        }
        assert_eq!(pace.offer(view(1), true, start), waits(true, false));
        let late = start + INTERVAL * 3;
        assert_eq!(
            pace.offer(view(2), true, late),
            Offered {
                store: Some(view(2)),
                replaced: true,
                first_wait: false,
            }
        );
        assert_eq!(pace.due(), None);
        assert_eq!(pace.take_due(late + INTERVAL * 100), None);
    }

    #[test]
    fn the_first_view_of_a_newer_catalog_is_stored_at_once_and_only_the_first() {
        // A catalog edited in many steps: every agent reports a view per revision, as fast as
        // the revisions come, and none of them is held.
        let start = Instant::now();
        let mut pace = ViewPace::new(start);
        for revision in 1..=100 {
            let view = of_revision(revision, 0);
            assert_eq!(
                pace.offer(view.clone(), true, start),
                stored(view),
                "{revision}"
            );
        }
        // Out of turns now (the first 16 took them): more views of revision 100, or of an
        // older one, wait their turn.
        assert_eq!(
            pace.offer(of_revision(100, 1), true, start),
            waits(true, false)
        );
        assert_eq!(
            pace.offer(of_revision(100, 2), true, start),
            waits(false, true)
        );
        assert_eq!(
            pace.offer(of_revision(99, 3), true, start),
            waits(false, true)
        );
        // A newer revision the link was never sent (an agent making numbers up) has no such
        // claim: it waits like the rest, and stored on its turn, it raises no bar.
        assert_eq!(
            pace.offer(of_revision(5000, 5), false, start),
            waits(false, true)
        );
        let turn = pace.due().unwrap();
        assert_eq!(pace.take_due(turn), Some(of_revision(5000, 5)));
        assert_eq!(
            pace.offer(of_revision(100, 6), true, turn),
            waits(false, false)
        );
        // A newer revision it was sent replaces the waiting view and is stored at once.
        assert_eq!(
            pace.offer(of_revision(101, 4), true, turn),
            Offered {
                store: Some(of_revision(101, 4)),
                replaced: true,
                first_wait: false,
            }
        );
    }
}
