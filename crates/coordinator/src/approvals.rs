//! Pending approvals: a call the policy marks `approve` waits here until someone allowed to
//! decide it does, or until it expires (a denial).
//!
//! An approval is bound to the request it answers (id, caller, host, tool, argument digest) and
//! is used once: deciding removes the request. A request whose caller goes away is withdrawn
//! (the [`Waiting`] guard removes it on drop), so nobody can approve a call that no longer waits.
//!
//! A request is decided under the policy in force when it is decided: when the policy or the
//! host labels change, [`Approvals::rejudge`] gives each waiting request the approvers the new
//! policy names for it, or decides it as the new policy does (a call it denies, one it lets run
//! without asking), and the waiter is told ([`Next::Retold`]) so that its caller sees who decides
//! now.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use toolsrv_proto::v1::ApprovalRequest;

use crate::audit::bounded;
use crate::selector::glob;

/// The approver list that lets the caller decide its own call.
pub const CALLER: &str = "caller";

/// Bytes of the arguments shown to an approver.
const SHOWN_ARGS: usize = 4 << 10;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Approved {
        by: String,
        reason: String,
    },
    Denied {
        by: String,
        reason: String,
    },
    Expired,
    /// The caller went away before anyone decided.
    Withdrawn,
}

/// Why a decision was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    #[error(
        "no pending approval request `{0}`: it was decided already, expired, or its caller went away"
    )]
    NotFound(String),
    #[error("client {decider} may not decide request `{}`: {why}", request.id)]
    NotAllowed {
        decider: String,
        /// The request, for the audit record of the refusal.
        request: Box<ApprovalRequest>,
        why: String,
    },
}

#[derive(Debug)]
struct Entry {
    request: ApprovalRequest,
    /// The arguments whole (`request` shows them cut at [`SHOWN_ARGS`]).
    args_json: String,
    answer: oneshot::Sender<Decision>,
    /// Told when `request` changed (its approvers, by [`Approvals::rejudge`]).
    retold: Arc<Notify>,
}

/// What the policy in force says of a waiting request ([`Approvals::rejudge`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejudged {
    /// Leave it as it is.
    Keep,
    /// Ask these approvers (as a rule's `approvers`: empty or `["caller"]` is the caller).
    Ask(Vec<String>),
    /// Decided without asking anyone.
    Decide(Decision),
}

/// What a waiter learns next ([`Waiting::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Decided(Decision),
    /// The request changed while it waits (who decides it); `Waiting::request` is the new one.
    Retold,
}

/// Every pending request of this coordinator.
#[derive(Debug, Default)]
pub struct Approvals {
    pending: Mutex<HashMap<String, Entry>>,
}

/// A request waiting for its decision; dropping it withdraws the request.
#[derive(Debug)]
pub struct Waiting<'a> {
    approvals: &'a Approvals,
    pub request: ApprovalRequest,
    answer: oneshot::Receiver<Decision>,
    retold: Arc<Notify>,
}

impl Waiting<'_> {
    /// The decision, [`Decision::Expired`] at `deadline`, or [`Next::Retold`] when the request
    /// changed first (`self.request` is then the changed one).
    pub async fn next(&mut self, deadline: Instant) -> Next {
        loop {
            tokio::select! {
                // An answer already given wins over the deadline passing at the same moment.
                biased;
                answer = &mut self.answer => {
                    return Next::Decided(answer.unwrap_or(Decision::Expired));
                }
                () = tokio::time::sleep_until(deadline) => {
                    // Expired only if nobody took the request meanwhile: a decision made as the
                    // deadline passed (its decider was told it was taken) is the one that holds.
                    if self.approvals.lock().remove(&self.request.id).is_some() {
                        return Next::Decided(Decision::Expired);
                    }
                    return Next::Decided((&mut self.answer).await.unwrap_or(Decision::Expired));
                }
                () = self.retold.notified() => {
                    // Decided meanwhile: the answer is there for the next turn.
                    if let Some(request) = self.approvals.get(&self.request.id)
                        && request != self.request
                    {
                        self.request = request;
                        return Next::Retold;
                    }
                }
            }
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.approvals.lock().remove(&self.request.id);
    }
}

/// Whether `decider` may decide `request`, and if not, why.
fn may_decide(request: &ApprovalRequest, decider: &str) -> Result<(), String> {
    if request.caller_may_decide {
        return if decider == request.caller {
            Ok(())
        } else {
            Err(format!("only the caller, {}, decides it", request.caller))
        };
    }
    if decider == request.caller {
        return Err("a request of yours needs another approver".into());
    }
    if request.approvers.iter().any(|p| glob(p, decider)) {
        Ok(())
    } else {
        Err(format!(
            "its approvers are {}",
            request.approvers.join(", ")
        ))
    }
}

/// Pending request `id`, when `decider` may decide it.
fn decidable<'a>(
    pending: &'a HashMap<String, Entry>,
    id: &str,
    decider: &str,
) -> Result<&'a Entry, DecideError> {
    let entry = pending
        .get(id)
        .ok_or_else(|| DecideError::NotFound(id.to_string()))?;
    may_decide(&entry.request, decider).map_err(|why| DecideError::NotAllowed {
        decider: decider.to_string(),
        request: Box::new(entry.request.clone()),
        why,
    })?;
    Ok(entry)
}

/// Who decides a request asked of a rule's `approvers`: the approver globs shown and kept, and
/// whether the caller decides (`approvers` empty or `["caller"]`).
pub(crate) fn deciders(approvers: &[String]) -> (Vec<String>, bool) {
    let caller_may_decide = approvers.is_empty() || approvers.iter().all(|a| a == CALLER);
    let shown = if caller_may_decide {
        vec![CALLER.to_string()]
    } else {
        approvers.iter().filter(|a| *a != CALLER).cloned().collect()
    };
    (shown, caller_may_decide)
}

/// Why nobody can decide a request of `caller` asked of `approvers`, if nobody can: every
/// approver the rule names is `caller` itself, by name (no glob), and a caller never decides a
/// request that asks for another approver. Such a request could only expire.
pub(crate) fn undecidable(approvers: &[String], caller: &str) -> Option<String> {
    let (shown, caller_may_decide) = deciders(approvers);
    let only_caller = shown.iter().all(|p| p == caller && !p.contains(['*', '?']));
    (!caller_may_decide && only_caller).then(|| {
        format!(
            "nobody can approve it: the only approver its rule names is {caller}, the caller, and \
             a call is approved by someone other than its caller (a rule's `approvers` of \
             `[\"caller\"]` lets the caller decide)"
        )
    })
}

/// A fresh unguessable request id.
pub(crate) fn new_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    // Two independently keyed SipHashes: 128 bits no caller can predict.
    let (a, b) = (RandomState::new(), RandomState::new());
    let now = std::time::Instant::now();
    format!("{:016x}{:016x}", a.hash_one(now), b.hash_one(now))
}

impl Approvals {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // Entries are inserted and removed whole; a poisoned map is consistent.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests waiting for a decision.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    /// The request `id` while it waits for a decision.
    pub fn get(&self, id: &str) -> Option<ApprovalRequest> {
        self.lock().get(id).map(|entry| entry.request.clone())
    }

    /// Files `request` (its id and who may decide are set here): `approvers` empty or
    /// `["caller"]` lets the caller decide, other globs a second identity.
    pub fn file(&self, mut request: ApprovalRequest, approvers: &[String]) -> Waiting<'_> {
        request.id = new_id();
        let args_json = std::mem::take(&mut request.args_json);
        request.args_json = bounded(&args_json, SHOWN_ARGS);
        (request.approvers, request.caller_may_decide) = deciders(approvers);
        let (tx, rx) = oneshot::channel();
        let retold = Arc::new(Notify::new());
        self.lock().insert(
            request.id.clone(),
            Entry {
                request: request.clone(),
                args_json,
                answer: tx,
                retold: retold.clone(),
            },
        );
        Waiting {
            approvals: self,
            request,
            answer: rx,
            retold,
        }
    }

    /// Judges every waiting request again with `judge` (the policy in force): new approvers
    /// replace the old ones, and their waiter is told; a decision answers the request at once.
    /// Returns the requests that changed, each with what became of it.
    pub fn rejudge(
        &self,
        judge: impl Fn(&ApprovalRequest) -> Rejudged,
    ) -> Vec<(ApprovalRequest, Rejudged)> {
        let mut pending = self.lock();
        let mut changed = Vec::new();
        let mut decided = Vec::new();
        for (id, entry) in pending.iter_mut() {
            match judge(&entry.request) {
                Rejudged::Keep => {}
                Rejudged::Ask(approvers) => {
                    let (shown, caller_may_decide) = deciders(&approvers);
                    if (&shown, caller_may_decide)
                        != (&entry.request.approvers, entry.request.caller_may_decide)
                    {
                        entry.request.approvers = shown;
                        entry.request.caller_may_decide = caller_may_decide;
                        entry.retold.notify_one();
                        changed.push((entry.request.clone(), Rejudged::Ask(approvers)));
                    }
                }
                Rejudged::Decide(decision) => decided.push((id.clone(), decision)),
            }
        }
        for (id, decision) in decided {
            if let Some(entry) = pending.remove(&id) {
                // The waiter may have just timed out; its request is used up all the same.
                let _ = entry.answer.send(decision.clone());
                changed.push((entry.request, Rejudged::Decide(decision)));
            }
        }
        changed
    }

    /// Decides request `id` as client `decider`; the request is used up.
    pub fn decide(
        &self,
        id: &str,
        decider: &str,
        approve: bool,
        reason: &str,
    ) -> Result<ApprovalRequest, DecideError> {
        let mut pending = self.lock();
        decidable(&pending, id, decider)?;
        let Some(entry) = pending.remove(id) else {
            return Err(DecideError::NotFound(id.to_string()));
        };
        drop(pending);
        let by = decider.to_string();
        let reason = reason.to_string();
        let decision = if approve {
            Decision::Approved { by, reason }
        } else {
            Decision::Denied { by, reason }
        };
        // The waiter may have just timed out; its request is used up all the same.
        let _ = entry.answer.send(decision);
        Ok(entry.request)
    }

    /// Request `id` with its arguments whole, for someone who may decide it.
    pub fn whole(&self, id: &str, decider: &str) -> Result<ApprovalRequest, DecideError> {
        let pending = self.lock();
        let entry = decidable(&pending, id, decider)?;
        Ok(ApprovalRequest {
            args_json: entry.args_json.clone(),
            ..entry.request.clone()
        })
    }

    /// The pending requests `decider` may decide, oldest first (by expiry).
    pub fn decidable_by(&self, decider: &str) -> Vec<ApprovalRequest> {
        let mut list: Vec<ApprovalRequest> = self
            .lock()
            .values()
            .filter(|e| may_decide(&e.request, decider).is_ok())
            .map(|e| e.request.clone())
            .collect();
        list.sort_by(|a, b| (a.expires_unix_ms, &a.id).cmp(&(b.expires_unix_ms, &b.id)));
        list
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file<'a>(a: &'a Approvals, approvers: &[&str]) -> Waiting<'a> {
        let approvers: Vec<String> = approvers.iter().map(|s| s.to_string()).collect();
        let request = ApprovalRequest {
            caller: "alice".into(),
            host: "db-1".into(),
            tool: "restart".into(),
            args_json: "{}".into(),
            ..ApprovalRequest::default()
        };
        a.file(request, &approvers)
    }

    #[tokio::test]
    async fn the_caller_decides_its_own_request_once() {
        let a = Approvals::default();
        let mut w = file(&a, &[]);
        let id = w.request.id.clone();
        assert!(w.request.caller_may_decide);
        assert!(matches!(
            a.decide(&id, "bob", true, ""),
            Err(DecideError::NotAllowed { .. })
        ));
        a.decide(&id, "alice", true, "ok").unwrap();
        assert_eq!(
            decided(&mut w, 1).await,
            Decision::Approved {
                by: "alice".into(),
                reason: "ok".into()
            }
        );
        assert!(matches!(
            a.decide(&id, "alice", true, ""),
            Err(DecideError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn a_two_person_rule_never_lets_the_caller_decide() {
        let a = Approvals::default();
        let mut w = file(&a, &["oncall-*", "alice"]);
        let id = w.request.id.clone();
        assert!(!w.request.caller_may_decide);
        assert!(a.decidable_by("alice").is_empty());
        assert!(matches!(
            a.decide(&id, "alice", true, ""),
            Err(DecideError::NotAllowed { .. })
        ));
        assert!(a.decide(&id, "dev-1", true, "").is_err());
        assert_eq!(a.decidable_by("oncall-2").len(), 1);
        a.decide(&id, "oncall-2", false, "not now").unwrap();
        assert!(matches!(decided(&mut w, 1).await, Decision::Denied { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn unanswered_requests_expire_and_withdrawn_ones_cannot_be_decided() {
        let a = Approvals::default();
        let mut w = file(&a, &[]);
        assert_eq!(decided(&mut w, 60).await, Decision::Expired);
        let id = w.request.id.clone();
        drop(w);
        assert!(matches!(
            a.decide(&id, "alice", true, ""),
            Err(DecideError::NotFound(_))
        ));
        assert!(a.lock().is_empty());
    }

    async fn decided(w: &mut Waiting<'_>, secs: u64) -> Decision {
        match w
            .next(Instant::now() + std::time::Duration::from_secs(secs))
            .await
        {
            Next::Decided(decision) => decision,
            Next::Retold => panic!("retold, not decided"),
        }
    }

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_judged_again_is_asked_of_its_new_approvers() {
        let a = Approvals::default();
        let mut w = file(&a, &["oncall-*"]);
        let id = w.request.id.clone();
        // The same approvers again: nothing to tell.
        assert!(
            a.rejudge(|_| Rejudged::Ask(strings(&["oncall-*"])))
                .is_empty()
        );
        let changed = a.rejudge(|_| Rejudged::Ask(strings(&["sre-lead"])));
        assert_eq!(changed.len(), 1);
        let deadline = Instant::now() + std::time::Duration::from_secs(60);
        assert_eq!(w.next(deadline).await, Next::Retold);
        assert_eq!(w.request.approvers, ["sre-lead"]);
        assert!(a.decidable_by("oncall-1").is_empty());
        assert!(matches!(
            a.decide(&id, "oncall-1", true, ""),
            Err(DecideError::NotAllowed { .. })
        ));
        // Back to the caller: the caller may decide it now.
        a.rejudge(|_| Rejudged::Ask(Vec::new()));
        assert_eq!(w.next(deadline).await, Next::Retold);
        assert!(w.request.caller_may_decide);
        a.decide(&id, "alice", true, "").unwrap();
        assert!(matches!(
            w.next(deadline).await,
            Next::Decided(Decision::Approved { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_the_policy_now_decides_is_answered_at_once() {
        let a = Approvals::default();
        let mut denied = file(&a, &["oncall-*"]);
        let mut kept = file(&a, &["oncall-*"]);
        let denied_id = denied.request.id.clone();
        let decision = Decision::Denied {
            by: "policy".into(),
            reason: "rule 0 denies it".into(),
        };
        let changed = a.rejudge(|r| {
            if r.id == denied_id {
                Rejudged::Decide(decision.clone())
            } else {
                Rejudged::Keep
            }
        });
        assert_eq!(changed.len(), 1);
        assert_eq!(decided(&mut denied, 1).await, decision);
        assert_eq!(a.pending(), 1);
        assert!(a.decide(&denied_id, "oncall-1", true, "").is_err());
        assert_eq!(decided(&mut kept, 60).await, Decision::Expired);
    }

    #[test]
    fn a_request_only_its_caller_is_named_to_approve_is_undecidable() {
        let caller = "approver";
        assert!(undecidable(&strings(&["approver"]), caller).is_some());
        assert!(undecidable(&strings(&["approver", "approver"]), caller).is_some());
        // Someone else is named, or may match: it can be decided.
        assert!(undecidable(&strings(&["approver", "oncall-1"]), caller).is_none());
        assert!(undecidable(&strings(&["approv*"]), caller).is_none());
        assert!(undecidable(&strings(&["approve?"]), caller).is_none());
        // The caller decides its own.
        assert!(undecidable(&[], caller).is_none());
        assert!(undecidable(&strings(&["caller"]), caller).is_none());
        assert!(undecidable(&strings(&["alice"]), caller).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_decision_made_as_the_deadline_passes_is_the_one_that_holds() {
        let a = Approvals::default();
        let mut w = file(&a, &["oncall-*"]);
        let id = w.request.id.clone();
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        tokio::time::sleep_until(deadline).await;
        // The deadline has passed, and the waiter has not looked yet: a decision now was told
        // to its decider as taken, so the waiter must see it, not an expiry.
        a.decide(&id, "oncall-1", true, "in time").unwrap();
        assert_eq!(
            w.next(deadline).await,
            Next::Decided(Decision::Approved {
                by: "oncall-1".into(),
                reason: "in time".into()
            })
        );
        // And an expiry, once it is one, takes the request away from deciders.
        let mut late = file(&a, &["oncall-*"]);
        let late_id = late.request.id.clone();
        assert_eq!(
            late.next(Instant::now()).await,
            Next::Decided(Decision::Expired)
        );
        assert!(matches!(
            a.decide(&late_id, "oncall-1", true, ""),
            Err(DecideError::NotFound(_))
        ));
    }

    #[test]
    fn ids_differ_and_arguments_are_cut() {
        let a = Approvals::default();
        let big = ApprovalRequest {
            args_json: "x".repeat(10_000),
            ..ApprovalRequest::default()
        };
        let w1 = a.file(big, &[]);
        let w2 = file(&a, &[]);
        assert_ne!(w1.request.id, w2.request.id);
        assert_eq!(w1.request.id.len(), 32);
        assert!(w1.request.args_json.len() < 4200);
        // Whole, for whoever may decide it (here the caller, as no approvers are named).
        let whole = a.whole(&w1.request.id, &w1.request.caller).unwrap();
        assert_eq!(whole.args_json.len(), 10_000);
        assert!(matches!(
            a.whole(&w1.request.id, "someone-else"),
            Err(DecideError::NotAllowed { .. })
        ));
        assert!(matches!(
            a.whole("nope", "x"),
            Err(DecideError::NotFound(_))
        ));
    }
}
