//! The reconnect loop: run sessions until shutdown, waiting a backoff delay between failures.
//!
//! It takes the session, sleep and jitter functions as parameters so tests drive it without a
//! network or a clock.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::error::AgentError;

/// The ceiling of the delay after a refusal that only an operator can fix (a certificate that
/// names another host, an identity the coordinator does not accept): long, so the log is not a
/// stream of the same error, yet a fixed certificate is picked up without a restart.
pub const REFUSED_RETRY: Duration = Duration::from_secs(300);

/// How a session ended without an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was requested; the agent said goodbye.
    Shutdown,
    /// The coordinator said goodbye (it is restarting, or it refused something this agent
    /// sent); reconnect later.
    Goodbye(toolsrv_proto::v1::Goodbye),
}

/// What one connection attempt came to.
#[derive(Debug)]
pub struct SessionOutcome {
    /// The coordinator accepted the agent (sent its Welcome) during this session.
    pub welcomed: bool,
    pub result: Result<SessionEnd, AgentError>,
}

/// Runs `session` until it ends with [`SessionEnd::Shutdown`] or `shutdown` fires.
///
/// Between sessions it sleeps `jitter(backoff.ceiling(attempt))`; `attempt` counts sessions that
/// ended since the last one that got a Welcome, so a healthy link that drops reconnects quickly
/// while a coordinator that stays away is retried ever more slowly, up to `backoff.max`.
pub async fn reconnect_loop<S, SF, Z, ZF, J>(
    backoff: Backoff,
    shutdown: &CancellationToken,
    mut session: S,
    mut sleep: Z,
    mut jitter: J,
) where
    S: FnMut() -> SF,
    SF: Future<Output = SessionOutcome>,
    Z: FnMut(Duration) -> ZF,
    ZF: Future<Output = ()>,
    J: FnMut(Duration) -> Duration,
{
    let mut attempt: u32 = 0;
    while !shutdown.is_cancelled() {
        let outcome = session().await;
        if outcome.welcomed {
            attempt = 0;
        }
        let mut ceiling = backoff.ceiling(attempt);
        match outcome.result {
            Ok(SessionEnd::Shutdown) => return,
            // The coordinator ends a link over a message of this agent's it refused:
            // worth an operator's eye (a version mismatch, or a broken host).
            Ok(SessionEnd::Goodbye(goodbye)) if goodbye.refused => {
                tracing::warn!(reason = %goodbye.reason, "the coordinator refused this agent and ended the link; reconnecting");
            }
            Ok(SessionEnd::Goodbye(goodbye)) => {
                tracing::info!(reason = %goodbye.reason, "coordinator said goodbye; reconnecting");
            }
            Err(e) if e.needs_operator() => {
                ceiling = REFUSED_RETRY.max(backoff.max);
                tracing::error!(
                    error = %e,
                    retry_in = ?ceiling,
                    "the coordinator refuses this agent, which retrying cannot fix by itself: \
                     do what it says (the certificate and --host-id are read again on each \
                     attempt; a revocation is lifted by an administrator); retrying only every \
                     few minutes until then"
                );
            }
            Err(e) => tracing::warn!(error = %e, attempt, "agent session ended"),
        }
        if shutdown.is_cancelled() {
            return;
        }
        let delay = jitter(ceiling);
        attempt = attempt.saturating_add(1);
        tracing::debug!(?delay, "waiting before reconnecting");
        tokio::select! {
            () = sleep(delay) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::VecDeque;

    use super::*;

    fn failed(welcomed: bool) -> SessionOutcome {
        SessionOutcome {
            welcomed,
            result: Err(AgentError::LinkLost("test".into())),
        }
    }

    /// Drives the loop with a script of session outcomes; returns the delays it slept.
    async fn drive(script: Vec<SessionOutcome>) -> (Vec<Duration>, usize) {
        let backoff = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(1000),
        };
        let shutdown = CancellationToken::new();
        let script = RefCell::new(VecDeque::from(script));
        let sessions = RefCell::new(0usize);
        let slept = RefCell::new(Vec::new());
        reconnect_loop(
            backoff,
            &shutdown,
            || {
                *sessions.borrow_mut() += 1;
                let next = script.borrow_mut().pop_front();
                let shutdown = shutdown.clone();
                async move {
                    next.unwrap_or_else(|| {
                        shutdown.cancel();
                        SessionOutcome {
                            welcomed: true,
                            result: Ok(SessionEnd::Shutdown),
                        }
                    })
                }
            },
            |d| {
                slept.borrow_mut().push(d);
                async {}
            },
            // No jitter: the delays are the ceilings, so growth is visible.
            |ceiling| ceiling,
        )
        .await;
        (slept.into_inner(), sessions.into_inner())
    }

    #[tokio::test]
    async fn delays_grow_cap_and_reset_after_a_welcome() {
        let mut script: Vec<_> = (0..6).map(|_| failed(false)).collect();
        script.push(failed(true));
        script.push(failed(false));
        script.push(SessionOutcome {
            welcomed: true,
            result: Ok(SessionEnd::Goodbye(toolsrv_proto::v1::Goodbye {
                reason: "restart".into(),
                refused: false,
            })),
        });
        let (slept, sessions) = drive(script).await;
        let ms: Vec<u128> = slept.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1000, 1000, 100, 200, 100]);
        assert_eq!(sessions, 10);
    }

    #[tokio::test]
    async fn a_refusal_no_retry_can_fix_waits_long() {
        let refused = || SessionOutcome {
            welcomed: false,
            result: Err(AgentError::Identity(
                "certificate names another host".into(),
            )),
        };
        let denied = SessionOutcome {
            welcomed: false,
            result: Err(AgentError::Rpc {
                what: "opening the agent link",
                status: tonic::Status::permission_denied("hello claims another host"),
            }),
        };
        let (slept, _) = drive(vec![failed(false), refused(), denied, failed(false)]).await;
        let ms: Vec<u128> = slept.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [100, 300_000, 300_000, 800]);
    }

    #[tokio::test]
    async fn shutdown_ends_the_loop_without_sleeping() {
        let (slept, sessions) = drive(vec![]).await;
        assert!(slept.is_empty());
        assert_eq!(sessions, 1);
    }

    #[tokio::test]
    async fn shutdown_interrupts_the_sleep() {
        let shutdown = CancellationToken::new();
        let sessions = RefCell::new(0);
        let done = tokio::time::timeout(
            Duration::from_secs(5),
            reconnect_loop(
                Backoff::default(),
                &shutdown,
                || {
                    *sessions.borrow_mut() += 1;
                    async { failed(false) }
                },
                |_| {
                    shutdown.cancel();
                    std::future::pending()
                },
                |c| c,
            ),
        )
        .await;
        assert!(
            done.is_ok(),
            "the loop must end when shutdown fires during a sleep"
        );
        assert_eq!(sessions.into_inner(), 1);
    }
}
