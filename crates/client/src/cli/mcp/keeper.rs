//! Keeps the MCP server's session: watches it for its whole life (which also keeps it from
//! expiring), re-watches with bounded backoff when the stream breaks, opens a new session from
//! the profile when the old one is gone, and publishes every state as a [`Catalog`].

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::{Client, ClientError, Profile, SessionState, SessionWatch};

use super::tools::Catalog;

/// First wait before re-watching after the stream broke.
const MIN_BACKOFF: Duration = Duration::from_millis(250);
/// Longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What the keeper needs from a coordinator; a trait so that tests can script it.
pub(super) trait Sessions {
    /// A stream of session states.
    type Watch: StateStream;
    /// Opens a new session from the profile; with `keep` not empty, loading those tools (the
    /// ones a session before had loaded, in load order) instead of the profile's `autoLoad`.
    async fn open(&self, keep: &[String]) -> Result<SessionState, ClientError>;
    /// Watches session `id`.
    async fn watch(&self, id: &str) -> Result<Self::Watch, ClientError>;
}

/// A session's states, as [`SessionWatch`] gives them.
pub(super) trait StateStream {
    /// The next state; `None` when the coordinator ended the stream.
    async fn next(&mut self) -> Option<Result<SessionState, ClientError>>;
}

/// The sessions of one coordinator, opened from one profile.
#[derive(Debug, Clone)]
pub struct Coordinator {
    pub client: Client,
    pub profile: Profile,
    /// `--hosts`, replacing the profile's selector.
    pub hosts: Option<String>,
}

impl Sessions for Coordinator {
    type Watch = SessionWatch;

    async fn open(&self, keep: &[String]) -> Result<SessionState, ClientError> {
        let mut profile = self.profile.clone();
        if !keep.is_empty() {
            // As autoLoad, a tool no host offers yet (its agents not back after a restart of
            // the coordinator) is kept, and arrives when a host offers it.
            profile.auto_load = keep.to_vec();
        }
        self.client
            .open_session(&profile, self.hosts.as_deref())
            .await
    }

    async fn watch(&self, id: &str) -> Result<SessionWatch, ClientError> {
        self.client.watch_session(id).await
    }
}

impl StateStream for SessionWatch {
    async fn next(&mut self) -> Option<Result<SessionState, ClientError>> {
        SessionWatch::next(self).await
    }
}

/// Publishes `state` unless it is older than what is published; receivers are woken only when
/// the MCP tool list changes. `reopened` marks a state of a new session, which replaces any.
pub fn publish(tx: &watch::Sender<Arc<Catalog>>, state: &SessionState, reopened: bool) {
    let new = Catalog::from_state(state);
    tx.send_if_modified(|current| {
        let same_session = current.session == new.session;
        if !reopened && (!same_session || new.generation < current.generation) {
            return false;
        }
        let changed = current.tools(true) != new.tools(true);
        *current = Arc::new(new);
        changed
    });
}

/// Exponential backoff with jitter between [`MIN_BACKOFF`] and [`MAX_BACKOFF`].
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: MIN_BACKOFF }
    }
}

impl Backoff {
    /// The wait before the next attempt: the current step, less up to a quarter of it at random
    /// (so that many servers do not retry in step), never under the minimum.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (step * 2).min(MAX_BACKOFF);
        let jitter = step.mul_f64(fastrand::f64() / 4.0);
        step.saturating_sub(jitter).max(MIN_BACKOFF)
    }

    /// Back to the shortest wait, after a success.
    pub fn reset(&mut self) {
        self.next = MIN_BACKOFF;
    }
}

/// Whether the session no longer exists (closed, expired, or the coordinator restarted).
fn gone(e: &ClientError) -> bool {
    e.session_gone()
}

/// Watches the published session until `shutdown`, keeping it and the catalog current.
/// `sleep` is how it waits between attempts (a test passes one that records the waits);
/// `nudge` cuts a wait short: a request that found the session gone says so, and the session is
/// opened again at once rather than after the backoff.
pub(super) async fn keep<S, F, Fut>(
    sessions: S,
    tx: watch::Sender<Arc<Catalog>>,
    shutdown: CancellationToken,
    nudge: Arc<Notify>,
    sleep: F,
) where
    S: Sessions,
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut backoff = Backoff::default();
    loop {
        let id = tx.borrow().session.clone();
        let watched = tokio::select! {
            () = shutdown.cancelled() => return,
            watched = sessions.watch(&id) => watched,
        };
        let failure = match watched {
            Ok(mut states) => loop {
                let next = tokio::select! {
                    () = shutdown.cancelled() => return,
                    next = states.next() => next,
                };
                match next {
                    Some(Ok(state)) => {
                        backoff.reset();
                        publish(&tx, &state, false);
                    }
                    Some(Err(e)) => break e,
                    None => {
                        break ClientError::Protocol(
                            "the coordinator ended the session watch (shutting down?)".into(),
                        );
                    }
                }
            },
            Err(e) => e,
        };
        if gone(&failure) {
            let before = tx.borrow().loaded_names();
            match sessions.open(&before).await {
                Ok(state) => {
                    let with = match before.is_empty() {
                        true => "the profile's tools".to_string(),
                        false => {
                            format!("the tools the last one had loaded: {}", before.join(", "))
                        }
                    };
                    eprintln!(
                        "toolctl mcp: session {id} is gone ({failure}); opened session {} with \
                         {with}",
                        state.id
                    );
                    publish(&tx, &state, true);
                    backoff.reset();
                    continue;
                }
                Err(e) => eprintln!(
                    "toolctl mcp: session {id} is gone ({failure}) and a new one cannot be \
                     opened: {e}; trying again"
                ),
            }
        } else {
            eprintln!("toolctl mcp: lost the watch of session {id}: {failure}; watching again");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = sleep(backoff.next_delay()) => {}
            () = nudge.notified() => {}
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::*;
    use crate::{HostState, LoadedTool, SessionHost, ToolDefinition, ToolResolution};

    #[test]
    fn backoff_stays_within_bounds_and_grows() {
        for _ in 0..200 {
            let mut b = Backoff::default();
            let mut last_cap = MIN_BACKOFF;
            for _ in 0..20 {
                let d = b.next_delay();
                assert!(d >= MIN_BACKOFF && d <= MAX_BACKOFF, "{d:?}");
                assert!(d <= last_cap, "{d:?} over this step's {last_cap:?}");
                last_cap = (last_cap * 2).min(MAX_BACKOFF);
            }
            assert!(b.next_delay() >= MAX_BACKOFF.mul_f64(0.75));
            b.reset();
            assert!(b.next_delay() == MIN_BACKOFF);
        }
    }

    /// A state of session `id` on host `a` alone, with `tools` loaded and offered there.
    pub(in crate::cli::mcp) fn state(id: &str, generation: u64, tools: &[&str]) -> SessionState {
        SessionState {
            id: id.into(),
            generation,
            selected: vec![SessionHost {
                host_id: "a".into(),
                state: HostState::Online as i32,
            }],
            tools: tools
                .iter()
                .map(|t| LoadedTool {
                    name: t.to_string(),
                    hosts: vec!["a".into()],
                    resolutions: vec![ToolResolution {
                        definition: Some(ToolDefinition {
                            name: t.to_string(),
                            ..Default::default()
                        }),
                        hosts: vec!["a".into()],
                    }],
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn publishing_wakes_receivers_only_for_new_tool_lists() {
        let (tx, mut rx) = watch::channel(Arc::new(Catalog::from_state(&state("s", 1, &[]))));
        publish(&tx, &state("s", 2, &[]), false);
        assert!(!rx.has_changed().unwrap());
        assert_eq!(rx.borrow().generation, 2);
        publish(&tx, &state("s", 3, &["x"]), false);
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        // An older state (a LoadTool answer overtaken by the watch) is dropped.
        publish(&tx, &state("s", 2, &[]), false);
        assert_eq!(rx.borrow().tools(true).len(), 1);
        // Another session's state only counts when it is a reopened one.
        publish(&tx, &state("t", 1, &[]), false);
        assert_eq!(rx.borrow().session, "s");
        publish(&tx, &state("t", 1, &[]), true);
        assert_eq!(rx.borrow().session, "t");
        assert!(rx.has_changed().unwrap());
    }

    /// What one scripted `watch` answers: a stream of states, or an error.
    type WatchAnswer = Result<Vec<Result<SessionState, ClientError>>, ClientError>;

    /// Scripted answers: each `watch` takes the next entry, each `open` the next state.
    #[derive(Default)]
    struct Script {
        watches: Mutex<VecDeque<WatchAnswer>>,
        opens: Mutex<VecDeque<SessionState>>,
        watched: Mutex<Vec<String>>,
        /// What each `open` was asked to keep.
        kept: Mutex<Vec<Vec<String>>>,
    }

    struct Scripted(VecDeque<Result<SessionState, ClientError>>);

    impl StateStream for Scripted {
        async fn next(&mut self) -> Option<Result<SessionState, ClientError>> {
            self.0.pop_front()
        }
    }

    impl Sessions for &Script {
        type Watch = Scripted;
        async fn open(&self, keep: &[String]) -> Result<SessionState, ClientError> {
            self.kept.lock().unwrap().push(keep.to_vec());
            self.opens
                .lock()
                .unwrap()
                .pop_front()
                .ok_or_else(|| ClientError::Protocol("no more".into()))
        }
        async fn watch(&self, id: &str) -> Result<Scripted, ClientError> {
            self.watched.lock().unwrap().push(id.to_string());
            let next = self.watches.lock().unwrap().pop_front();
            match next {
                Some(Ok(states)) => Ok(Scripted(states.into())),
                Some(Err(e)) => Err(e),
                None => std::future::pending().await,
            }
        }
    }

    fn status(code: tonic::Code) -> ClientError {
        ClientError::Status {
            code,
            message: format!("{code:?}"),
            session_gone: code == tonic::Code::NotFound,
        }
    }

    /// A session gone with its coordinator is opened again with what the model had loaded, in
    /// the same order, as the new session's autoLoad: a tool no host offers yet (the agents not
    /// back yet) is kept until one does, where loading it after the open was refused and it was
    /// lost for good (3 of 6 restarts).
    #[tokio::test]
    async fn a_reopened_session_gets_back_the_tools_loaded_since_the_profile() {
        let script = Script::default();
        script
            .watches
            .lock()
            .unwrap()
            .push_back(Err(status(tonic::Code::NotFound)));
        script.opens.lock().unwrap().push_back(state("t", 1, &[]));
        let old = state("s", 4, &["x", "pending", "y"]);
        let (tx, mut rx) = watch::channel(Arc::new(Catalog::from_state(&old)));
        let shutdown = CancellationToken::new();
        let keeper = keep(&script, tx, shutdown.clone(), Arc::default(), |_| {
            std::future::ready(())
        });
        let check = async {
            let catalog = rx.wait_for(|c| c.session == "t").await.unwrap().clone();
            shutdown.cancel();
            catalog
        };
        let ((), catalog) = tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(keeper, check)
        })
        .await
        .unwrap();
        assert_eq!(catalog.session, "t");
        assert_eq!(*script.kept.lock().unwrap(), [["x", "pending", "y"]]);
    }

    /// A request that found the session gone cuts the keeper's wait short: with waits that
    /// never end, the session is opened again all the same.
    #[tokio::test]
    async fn a_nudge_cuts_the_wait_short() {
        let script = Script::default();
        script.watches.lock().unwrap().extend([
            Err(status(tonic::Code::Unavailable)),
            Err(status(tonic::Code::NotFound)),
        ]);
        // The profile's tool: a new tool list, which wakes the receiver.
        script
            .opens
            .lock()
            .unwrap()
            .push_back(state("t", 1, &["y"]));
        let (tx, mut rx) = watch::channel(Arc::new(Catalog::from_state(&state("s", 1, &[]))));
        let shutdown = CancellationToken::new();
        let nudge = Arc::new(Notify::new());
        let keeper = keep(&script, tx, shutdown.clone(), nudge.clone(), |_| {
            std::future::pending::<()>()
        });
        let check = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(rx.borrow().session, "s", "waiting, without end");
            nudge.notify_one();
            rx.wait_for(|c| c.session == "t").await.unwrap();
            shutdown.cancel();
        };
        tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(keeper, check)
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn rewatches_after_breaks_and_reopens_a_gone_session() {
        let script = Script::default();
        script.watches.lock().unwrap().extend([
            Err(status(tonic::Code::Unavailable)),
            Ok(vec![
                Ok(state("s", 2, &["x"])),
                Err(status(tonic::Code::Unavailable)),
            ]),
            Err(status(tonic::Code::NotFound)),
            Ok(vec![Ok(state("t", 5, &["y"]))]),
        ]);
        script.opens.lock().unwrap().push_back(state("t", 1, &[]));
        let (tx, mut rx) = watch::channel(Arc::new(Catalog::from_state(&state("s", 1, &[]))));
        let waits = Mutex::new(Vec::new());
        let shutdown = CancellationToken::new();
        let keeper = keep(&script, tx, shutdown.clone(), Arc::default(), |d| {
            waits.lock().unwrap().push(d);
            std::future::ready(())
        });
        let check = async {
            rx.wait_for(|c| c.session == "t" && c.generation == 5)
                .await
                .unwrap();
            shutdown.cancel();
        };
        tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(keeper, check)
        })
        .await
        .unwrap();
        assert_eq!(
            *script.watched.lock().unwrap(),
            ["s", "s", "s", "t", "t"].map(String::from)
        );
        let waits = waits.lock().unwrap();
        assert_eq!(waits.len(), 3, "{waits:?}");
        assert!(waits.iter().all(|w| *w >= MIN_BACKOFF && *w <= MAX_BACKOFF));
    }
}
