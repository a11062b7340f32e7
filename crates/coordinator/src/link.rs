//! One connected agent: its outbound queue, its in-flight calls, and per-call flow control.
//!
//! Architecture invariant: what the coordinator holds of one call's events is bounded whatever
//! the agent sends. Output is queued only within the credit the call was given (the agent's own
//! rule: it may send while its credit is above zero), each chunk costing its data and, for an
//! agent that counts it, [`CHUNK_OVERHEAD`] for what holding it costs (so a million one-byte
//! chunks are not a megabyte); an empty chunk is a breach. At most one bypass request waits for
//! an answer. An agent that breaks a rule ends that call, not its link or its other calls.
//!
//! Nothing waits without end for an agent to read: the link's queue is a
//! [`toolsrv_proto::outbound`] one, and a send it refuses as stalled closes the link (its calls
//! end as LOST; the agent may connect again).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::outbound::{NotSent, Outbound};
use toolsrv_proto::v1::{
    BypassDecision, BypassRequest, CallResult, CallStatus, CancelCall, CoordinatorMessage, Credit,
    OutputChunk, StartCall, coordinator_message::Msg,
};

/// Room for what wraps a `StartCall` on the wire (message tags, the call id and credit set later).
const START_SLACK: usize = 64;

pub use toolsrv_proto::outbound::DEFAULT_STALLED_AFTER;

/// Bytes of credit an output chunk costs on top of its data, for agents that count it (Hello's
/// `counts_chunk_overhead`): about what the coordinator spends holding one chunk in a call's
/// queue (the queued event and its buffer's allocation). With a window of 1 MiB, a call's queue
/// then holds at most about 4,000 chunks, where an agent sending one byte a chunk had it hold a
/// million (some 150 MB).
pub const CHUNK_OVERHEAD: u64 = 256;

/// Something that happened to a call on the agent.
#[derive(Debug)]
pub enum AgentEvent {
    Output(OutputChunk),
    /// The call's tool asks to run a command outside its sandbox.
    Bypass(BypassRequest),
    Finished(CallResult),
}

/// Where one call's events go, and what the agent may still send for it.
#[derive(Debug)]
struct Sink {
    tx: mpsc::UnboundedSender<AgentEvent>,
    /// Bytes of output the agent may still send: the first window and every grant since, less
    /// what it sent. May end below zero by the last chunk, as the agent spends it.
    credit: i64,
    /// Bypass requests delivered and not yet answered: the agent asks one at a time.
    unanswered: u32,
    /// Cancelled when the call ends on the link's side: its result delivered, the link closed,
    /// or the agent broke the protocol for it.
    ended: CancellationToken,
}

/// A connected agent.
#[derive(Debug)]
pub struct Link {
    pub host_id: String,
    /// Distinguishes successive connections of the same host.
    pub generation: u64,
    /// Unique across replicas: what this link's claim in etcd names (see `replicas`).
    pub link_id: String,
    tx: Outbound<CoordinatorMessage>,
    calls: Mutex<HashMap<u64, Sink>>,
    next_call: AtomicU64,
    /// Cancelled when the connection ends.
    pub closed: CancellationToken,
    /// Why it was closed from this side (the first reason given to [`Link::close`]).
    close_reason: std::sync::OnceLock<String>,
    /// Bytes of output a call may have in flight before the coordinator grants more.
    window: u64,
    /// Bytes of credit each output chunk costs on top of its data ([`CHUNK_OVERHEAD`] for an
    /// agent that counts it, 0 for one that does not).
    chunk_overhead: u64,
    /// The agent said it is shutting down: it takes no new call.
    draining: std::sync::atomic::AtomicBool,
    /// Closed by [`Link::refuse`]: the agent is told so in its Goodbye.
    refused: std::sync::atomic::AtomicBool,
}

impl Link {
    pub fn new(
        host_id: String,
        generation: u64,
        tx: Outbound<CoordinatorMessage>,
        window: u64,
    ) -> Self {
        Self {
            host_id,
            generation,
            link_id: toolsrv_cluster::new_link_id(),
            tx,
            calls: Mutex::new(HashMap::new()),
            next_call: AtomicU64::new(1),
            closed: CancellationToken::new(),
            close_reason: std::sync::OnceLock::new(),
            window,
            chunk_overhead: 0,
            draining: std::sync::atomic::AtomicBool::new(false),
            refused: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Charges every output chunk of this link's calls [`CHUNK_OVERHEAD`] bytes of credit on
    /// top of its data, as an agent whose Hello says `counts_chunk_overhead` does itself.
    #[must_use]
    pub fn counting_chunk_overhead(mut self) -> Self {
        self.chunk_overhead = CHUNK_OVERHEAD;
        self
    }

    /// [`Link::close`] for a reason that refuses the agent (its identity revoked): its
    /// Goodbye says so.
    pub fn refuse(&self, reason: &str) {
        self.refused.store(true, Ordering::Relaxed);
        self.close(reason);
    }

    /// Whether [`Link::refuse`] closed it.
    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Marks the agent as shutting down (its `Draining`): no new call goes to it. True the
    /// first time.
    pub fn set_draining(&self) -> bool {
        !self.draining.swap(true, Ordering::Relaxed)
    }

    /// Whether the agent said it is shutting down.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Why [`Link::close`] closed the link, if it did.
    pub fn close_reason(&self) -> Option<&str> {
        self.close_reason.get().map(String::as_str)
    }

    /// Queues a message for the agent; false when the connection is gone, or when the queue
    /// stayed full for the stall limit with the agent taking nothing from it (the link is then
    /// closed, saying so). While the agent takes messages, however slowly, this waits its turn.
    pub async fn send(&self, msg: Msg) -> bool {
        match self.tx.send(CoordinatorMessage { msg: Some(msg) }).await {
            Ok(()) => true,
            Err(NotSent::Closed) => false,
            Err(NotSent::Stalled(after)) => {
                self.close(&format!(
                    "stalled: the agent read nothing it was sent for {} s",
                    after.as_secs_f64()
                ));
                false
            }
        }
    }

    pub fn calls_in_flight(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Sink>> {
        // The map stays consistent under panic: every operation on it is a single insert or remove.
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a call on the agent. The handle yields its events; dropping it early cancels the call.
    pub async fn start_call(
        self: &Arc<Self>,
        mut start: StartCall,
    ) -> Result<CallHandle, CallResult> {
        // A message the agent would refuse ends the link and every call on it: refuse this call
        // instead (arguments are limited before, but the working directory is not).
        let size = prost::Message::encoded_len(&start);
        if size + START_SLACK > MAX_MESSAGE_BYTES {
            return Err(CallResult::not_run(
                CallStatus::InvalidArgs,
                format!(
                    "the call to host {} is {size} bytes with its arguments and working directory, \
                     more than a message may hold ({MAX_MESSAGE_BYTES} bytes); send less",
                    self.host_id
                ),
            ));
        }
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let ended = CancellationToken::new();
        let sink = Sink {
            tx,
            credit: i64::try_from(self.window).unwrap_or(i64::MAX),
            unanswered: 0,
            ended: ended.clone(),
        };
        self.lock().insert(call_id, sink);
        start.call_id = call_id;
        start.initial_credit = self.window;
        start.chunk_overhead = u32::try_from(self.chunk_overhead).unwrap_or(u32::MAX);
        let handle = CallHandle {
            link: self.clone(),
            call_id,
            rx,
            finished: false,
            ungranted: 0,
            ended,
        };
        if self.closed.is_cancelled() || !self.send(Msg::Start(start)).await {
            return Err(CallResult::not_run(
                CallStatus::Lost,
                format!(
                    "the link to host {} closed before the call started",
                    self.host_id
                ),
            ));
        }
        Ok(handle)
    }

    /// Delivers an agent's message about a call. Never blocks, and queues only what the
    /// protocol lets the agent send: output past the call's credit, or a second bypass request
    /// before the first was answered, ends the call (cancelled on the agent) with a result
    /// naming the breach. A message for a call that ended is dropped.
    pub fn deliver(&self, call_id: u64, event: AgentEvent) {
        let mut calls = self.lock();
        let Some(sink) = calls.get_mut(&call_id) else {
            return;
        };
        let breach = match &event {
            // An agent never sends an empty chunk (it reads none), and one would cost nothing
            // of the credit of an agent that does not count chunks: a flood of them once grew
            // the coordinator by gigabytes.
            AgentEvent::Output(chunk) if chunk.data.is_empty() => Some(format!(
                "host {} sent an empty output chunk for the call",
                self.host_id
            )),
            AgentEvent::Output(chunk) => {
                if sink.credit <= 0 {
                    Some(format!(
                        "host {} sent output for the call beyond the credit it was given",
                        self.host_id
                    ))
                } else {
                    let n = self.chunk_cost(chunk.data.len());
                    sink.credit = sink.credit.saturating_sub(n);
                    None
                }
            }
            AgentEvent::Bypass(_) if sink.unanswered > 0 => Some(format!(
                "host {} asked for a second command outside the sandbox before the first was answered",
                self.host_id
            )),
            AgentEvent::Bypass(_) => {
                sink.unanswered += 1;
                None
            }
            AgentEvent::Finished(_) => None,
        };
        let finished = matches!(event, AgentEvent::Finished(_));
        if breach.is_none() && !finished {
            // The receiver may be gone (the client left); the cancel is already on its way.
            let _ = sink.tx.send(event);
            return;
        }
        let Some(sink) = calls.remove(&call_id) else {
            return;
        };
        drop(calls);
        sink.ended.cancel();
        let event = match breach {
            None => event,
            Some(breach) => {
                tracing::warn!(host = %self.host_id, call_id, "{breach}: the call is cancelled");
                self.cancel_on_agent(call_id);
                AgentEvent::Finished(CallResult::not_run(
                    CallStatus::Lost,
                    format!(
                        "{breach} (a broken or compromised agent); the call was cancelled there \
                         and its outcome is unknown"
                    ),
                ))
            }
        };
        let _ = sink.tx.send(event);
    }

    /// What a chunk of `len` bytes of output costs of a call's credit.
    fn chunk_cost(&self, len: usize) -> i64 {
        let len = u64::try_from(len).unwrap_or(u64::MAX);
        i64::try_from(len.saturating_add(self.chunk_overhead)).unwrap_or(i64::MAX)
    }

    /// Tells the agent to kill a call, without waiting for room in the link's queue.
    fn cancel_on_agent(&self, call_id: u64) {
        let cancel = CoordinatorMessage {
            msg: Some(Msg::Cancel(CancelCall { call_id })),
        };
        if let Err(mpsc::error::TrySendError::Full(cancel)) = self.tx.try_send(cancel) {
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(cancel).await;
            });
        }
    }

    /// Ends the connection: every in-flight call finishes as LOST with `reason`.
    pub fn close(&self, reason: &str) {
        let _ = self.close_reason.set(reason.to_string());
        self.closed.cancel();
        let calls: Vec<_> = self.lock().drain().collect();
        for (_, sink) in calls {
            sink.ended.cancel();
            // The caller knows the host: the message says what happened to the call there.
            let _ = sink.tx.send(AgentEvent::Finished(CallResult::not_run(
                CallStatus::Lost,
                format!(
                    "the link to its host ended mid-call ({reason}); whether the tool finished \
                     there is not known"
                ),
            )));
        }
    }
}

/// A call in flight on an agent.
#[derive(Debug)]
pub struct CallHandle {
    link: Arc<Link>,
    call_id: u64,
    rx: mpsc::UnboundedReceiver<AgentEvent>,
    finished: bool,
    /// Bytes consumed by the caller but not yet granted back to the agent.
    ungranted: u64,
    ended: CancellationToken,
}

impl CallHandle {
    /// The next event; the last one is always `Finished`.
    pub async fn next(&mut self) -> Option<AgentEvent> {
        if self.finished {
            return None;
        }
        let event = match self.rx.recv().await {
            Some(event) => event,
            // The link dropped our sink without a result: the connection is gone.
            None => AgentEvent::Finished(CallResult::not_run(
                CallStatus::Lost,
                format!("the link to host {} closed", self.link.host_id),
            )),
        };
        if matches!(event, AgentEvent::Finished(_)) {
            self.finished = true;
        }
        Some(event)
    }

    /// Fires when the call has ended on the link's side (its result is queued, or will not
    /// come): nothing asked on its behalf is worth waiting for any more.
    pub fn ended(&self) -> &CancellationToken {
        &self.ended
    }

    /// Answers a bypass request of this call.
    pub async fn answer_bypass(&self, request: &BypassRequest, approved: bool, reason: String) {
        if let Some(sink) = self.link.lock().get_mut(&self.call_id) {
            sink.unanswered = sink.unanswered.saturating_sub(1);
        }
        let decision = BypassDecision {
            call_id: self.call_id,
            request_id: request.request_id,
            approved,
            reason,
        };
        self.link.send(Msg::Bypass(decision)).await;
    }

    /// Tells the agent that a chunk of `len` bytes of output was passed on, so it may send
    /// more: what the chunk cost of the credit comes back. Credit is returned in batches of
    /// half a window to keep the link quiet.
    pub async fn consumed(&mut self, len: usize) {
        let cost = u64::try_from(self.link.chunk_cost(len)).unwrap_or(0);
        self.ungranted = self.ungranted.saturating_add(cost);
        if self.ungranted >= self.link.window / 2 && !self.finished {
            let credit = Credit {
                call_id: self.call_id,
                bytes: self.ungranted,
            };
            self.ungranted = 0;
            if let Some(sink) = self.link.lock().get_mut(&self.call_id) {
                let granted = i64::try_from(credit.bytes).unwrap_or(i64::MAX);
                sink.credit = sink.credit.saturating_add(granted);
            }
            self.link.send(Msg::Credit(credit)).await;
        }
    }
}

impl Drop for CallHandle {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // The caller went away mid-call: forget the call and tell the agent to kill it.
        self.link.lock().remove(&self.call_id);
        self.link.cancel_on_agent(self.call_id);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;
    use toolsrv_proto::outbound::{self, Taken};
    use toolsrv_proto::v1::OutputStream;

    fn link(window: u64) -> (Arc<Link>, Taken<CoordinatorMessage>) {
        let (tx, rx) = outbound::channel(64, DEFAULT_STALLED_AFTER);
        (Arc::new(Link::new("web-1".into(), 7, tx, window)), rx)
    }

    /// An agent that says `Draining` again and again is logged once (the first time only is
    /// news): 20,000 of them made 20,000 log lines.
    #[test]
    fn draining_is_news_once() {
        let (link, _rx) = link(1000);
        assert!(!link.draining());
        assert!(link.set_draining());
        for _ in 0..3 {
            assert!(!link.set_draining());
        }
        assert!(link.draining());
    }

    fn start() -> StartCall {
        StartCall {
            tool: "t".into(),
            args_json: "{}".into(),
            ..StartCall::default()
        }
    }

    fn chunk(n: usize) -> AgentEvent {
        AgentEvent::Output(OutputChunk {
            stream: OutputStream::Stdout as i32,
            data: vec![b'x'; n],
        })
    }

    fn next_msg(rx: &mut Taken<CoordinatorMessage>) -> Option<Msg> {
        rx.try_recv().ok().and_then(|m| m.msg)
    }

    #[tokio::test]
    async fn a_call_starts_with_a_full_window_and_ids_are_unique() {
        let (link, mut rx) = link(1000);
        let _a = link.start_call(start()).await.unwrap();
        let _b = link.start_call(start()).await.unwrap();
        let (Some(Msg::Start(a)), Some(Msg::Start(b))) = (next_msg(&mut rx), next_msg(&mut rx))
        else {
            panic!("two starts expected");
        };
        assert_ne!(a.call_id, b.call_id);
        assert_eq!(a.initial_credit, 1000);
        assert_eq!(link.calls_in_flight(), 2);
    }

    #[tokio::test]
    async fn credit_goes_back_in_batches_of_half_a_window() {
        let (link, mut rx) = link(1000);
        let mut call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        for _ in 0..4 {
            link.deliver(1, chunk(100));
            assert!(matches!(call.next().await, Some(AgentEvent::Output(_))));
            call.consumed(100).await;
        }
        assert!(
            next_msg(&mut rx).is_none(),
            "400 bytes: under half a window, no credit yet"
        );
        link.deliver(1, chunk(100));
        call.next().await.unwrap();
        call.consumed(100).await;
        match next_msg(&mut rx) {
            Some(Msg::Credit(c)) => assert_eq!((c.call_id, c.bytes), (1, 500)),
            other => panic!("credit expected, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn dropping_an_unfinished_call_cancels_it_on_the_agent() {
        let (link, mut rx) = link(1000);
        let call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        drop(call);
        match next_msg(&mut rx) {
            Some(Msg::Cancel(c)) => assert_eq!(c.call_id, 1),
            other => panic!("cancel expected, got {other:?}"),
        }
        assert_eq!(link.calls_in_flight(), 0);
        // A late event for the forgotten call goes nowhere and harms nothing.
        link.deliver(1, chunk(10));
    }

    #[tokio::test]
    async fn a_finished_call_is_not_cancelled_when_dropped() {
        let (link, mut rx) = link(1000);
        let mut call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        link.deliver(
            1,
            AgentEvent::Finished(CallResult::not_run(CallStatus::Ok, "")),
        );
        assert!(matches!(call.next().await, Some(AgentEvent::Finished(_))));
        assert!(call.next().await.is_none(), "nothing after the end");
        drop(call);
        assert!(next_msg(&mut rx).is_none());
    }

    #[tokio::test]
    async fn closing_the_link_ends_every_call_as_lost_and_refuses_new_ones() {
        let (link, _rx) = link(1000);
        let mut a = link.start_call(start()).await.unwrap();
        let mut b = link.start_call(start()).await.unwrap();
        link.close("lost: nothing heard for 3000 ms");
        for call in [&mut a, &mut b] {
            match call.next().await {
                Some(AgentEvent::Finished(r)) => {
                    assert_eq!(r.status, CallStatus::Lost as i32);
                    assert!(r.message.contains("nothing heard"), "{}", r.message);
                }
                other => panic!("lost expected, got {other:?}"),
            }
        }
        let refused = link.start_call(start()).await.unwrap_err();
        assert_eq!(refused.status, CallStatus::Lost as i32);
    }

    fn bypass(request_id: u64) -> AgentEvent {
        AgentEvent::Bypass(BypassRequest {
            call_id: 1,
            request_id,
            argv: vec!["true".into()],
            ..BypassRequest::default()
        })
    }

    /// Reads the call's events to its result; the bytes of output before it.
    async fn drain(call: &mut CallHandle) -> (usize, CallResult) {
        let mut bytes = 0;
        loop {
            match call.next().await {
                Some(AgentEvent::Output(chunk)) => bytes += chunk.data.len(),
                Some(AgentEvent::Finished(result)) => return (bytes, result),
                Some(AgentEvent::Bypass(_)) => {}
                None => panic!("no result"),
            }
        }
    }

    #[tokio::test]
    async fn output_past_the_credit_ends_that_call_alone() {
        let (link, mut rx) = link(1000);
        let mut call = link.start_call(start()).await.unwrap();
        let mut other = link.start_call(start()).await.unwrap();
        let (_a, _b) = (next_msg(&mut rx), next_msg(&mut rx));
        // The agent's own rule: it may send while its credit is above zero, so its last chunk
        // may overshoot the window.
        link.deliver(1, chunk(900));
        link.deliver(1, chunk(900));
        assert!(!call.ended().is_cancelled());
        // Its credit is spent: more is a breach, and nothing more is queued for the call.
        link.deliver(1, chunk(1));
        for _ in 0..100 {
            link.deliver(1, chunk(1 << 20));
        }
        assert!(call.ended().is_cancelled());
        match next_msg(&mut rx) {
            Some(Msg::Cancel(c)) => assert_eq!(c.call_id, 1),
            other => panic!("cancel expected, got {other:?}"),
        }
        let (bytes, result) = drain(&mut call).await;
        assert_eq!(bytes, 1800, "what the credit allowed reaches the caller");
        assert_eq!(result.status, CallStatus::Lost as i32);
        assert!(
            result
                .message
                .contains("host web-1 sent output for the call beyond the credit"),
            "{}",
            result.message
        );
        // The link and its other call go on.
        assert!(!link.closed.is_cancelled());
        link.deliver(2, chunk(500));
        link.deliver(
            2,
            AgentEvent::Finished(CallResult::not_run(CallStatus::Ok, "")),
        );
        let (bytes, result) = drain(&mut other).await;
        assert_eq!((bytes, result.status), (500, CallStatus::Ok as i32));
    }

    #[tokio::test]
    async fn credit_granted_back_lets_the_agent_send_more() {
        let (link, mut rx) = link(1000);
        let mut call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        // Three windows' worth, each chunk sent only once the grant for the last came.
        for _ in 0..6 {
            link.deliver(1, chunk(500));
            assert!(matches!(call.next().await, Some(AgentEvent::Output(_))));
            call.consumed(500).await;
            assert!(matches!(next_msg(&mut rx), Some(Msg::Credit(_))));
        }
        assert!(!call.ended().is_cancelled(), "an agent within its credit");
    }

    /// A compromised agent sent tens of millions of empty chunks, which cost no credit: the
    /// coordinator grew by 3 GB holding them. One is now a breach of the call.
    #[tokio::test]
    async fn an_empty_output_chunk_ends_the_call() {
        let (link, mut rx) = link(1000);
        let mut call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        link.deliver(1, chunk(10));
        for _ in 0..1000 {
            link.deliver(1, chunk(0));
        }
        assert!(call.ended().is_cancelled());
        assert!(matches!(next_msg(&mut rx), Some(Msg::Cancel(_))));
        let mut events = 0;
        let result = loop {
            match call.next().await {
                Some(AgentEvent::Finished(result)) => break result,
                Some(_) => events += 1,
                None => panic!("no result"),
            }
        };
        assert_eq!(events, 1, "only the chunk before the breach was held");
        assert_eq!(result.status, CallStatus::Lost as i32);
        assert!(
            result
                .message
                .contains("host web-1 sent an empty output chunk"),
            "{}",
            result.message
        );
    }

    /// Of an agent that counts chunks, a call's queue holds no more than its window of data
    /// and overhead: one-byte chunks once filled it by the million.
    #[tokio::test]
    async fn small_chunks_are_held_to_the_window_with_their_overhead() {
        let (tx, mut rx) = outbound::channel(64, DEFAULT_STALLED_AFTER);
        let window = 10 * CHUNK_OVERHEAD;
        let link = Arc::new(Link::new("web-1".into(), 7, tx, window).counting_chunk_overhead());
        let mut call = link.start_call(start()).await.unwrap();
        let Some(Msg::Start(started)) = next_msg(&mut rx) else {
            panic!("a start expected");
        };
        assert_eq!(u64::from(started.chunk_overhead), CHUNK_OVERHEAD);
        // 257 bytes of credit each, out of 2,560: the tenth overshoots (247 were left before
        // it, above zero), and the eleventh is past the credit.
        for _ in 0..10 {
            link.deliver(1, chunk(1));
        }
        assert!(!call.ended().is_cancelled(), "within the agent's own rule");
        link.deliver(1, chunk(1));
        assert!(call.ended().is_cancelled());
        assert!(matches!(next_msg(&mut rx), Some(Msg::Cancel(_))));
        let (bytes, result) = drain(&mut call).await;
        assert_eq!(bytes, 10);
        assert!(
            result.message.contains("beyond the credit"),
            "{}",
            result.message
        );

        // What a passed-on chunk cost comes back as credit.
        let mut call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        for _ in 0..5 {
            link.deliver(2, chunk(1));
            assert!(matches!(call.next().await, Some(AgentEvent::Output(_))));
            call.consumed(1).await;
        }
        match next_msg(&mut rx) {
            Some(Msg::Credit(c)) => assert_eq!(c.bytes, 5 * (CHUNK_OVERHEAD + 1)),
            other => panic!("credit expected, got {other:?}"),
        }
    }

    /// What the coordinator holds per queued chunk, besides its data, stays within what the
    /// chunk is charged.
    #[test]
    fn a_queued_chunk_costs_no_more_than_its_overhead() {
        // The event in the channel's slot, plus the smallest allocation of its buffer.
        let held = std::mem::size_of::<AgentEvent>() + 32;
        assert!(
            held as u64 <= CHUNK_OVERHEAD,
            "a queued chunk holds {held} bytes besides its data; raise CHUNK_OVERHEAD"
        );
    }

    #[tokio::test]
    async fn a_second_bypass_request_before_the_first_is_answered_ends_the_call() {
        let (link, mut rx) = link(1000);
        let mut call = link.start_call(start()).await.unwrap();
        let _start = next_msg(&mut rx);
        link.deliver(1, bypass(1));
        let Some(AgentEvent::Bypass(first)) = call.next().await else {
            panic!("the first request reaches the call");
        };
        call.answer_bypass(&first, false, "no".into()).await;
        assert!(matches!(next_msg(&mut rx), Some(Msg::Bypass(_))));
        // Answered: the next one is in order.
        link.deliver(1, bypass(2));
        assert!(!call.ended().is_cancelled());
        // Another before that one's answer is a breach.
        link.deliver(1, bypass(3));
        assert!(call.ended().is_cancelled());
        assert!(matches!(next_msg(&mut rx), Some(Msg::Cancel(_))));
        let (_, result) = drain(&mut call).await;
        assert_eq!(result.status, CallStatus::Lost as i32);
        assert!(
            result
                .message
                .contains("a second command outside the sandbox"),
            "{}",
            result.message
        );
    }

    #[tokio::test]
    async fn a_call_s_end_on_the_link_side_is_signalled() {
        let (link, _rx) = link(1000);
        let a = link.start_call(start()).await.unwrap();
        let b = link.start_call(start()).await.unwrap();
        link.deliver(
            1,
            AgentEvent::Finished(CallResult::not_run(CallStatus::Ok, "")),
        );
        assert!(a.ended().is_cancelled(), "its result came");
        assert!(!b.ended().is_cancelled());
        link.close("lost");
        assert!(b.ended().is_cancelled(), "its link closed");
    }

    /// A link whose queue holds two messages, closing after 5 s with nothing taken.
    fn stalling_link() -> (Arc<Link>, Taken<CoordinatorMessage>) {
        let (tx, rx) = outbound::channel(2, Duration::from_secs(5));
        (Arc::new(Link::new("web-1".into(), 7, tx, 1000)), rx)
    }

    fn keepalive() -> Msg {
        Msg::Keepalive(toolsrv_proto::v1::Keepalive::default())
    }

    #[tokio::test(start_paused = true)]
    async fn a_link_whose_agent_reads_nothing_closes_after_the_stall_limit() {
        let (link, _rx) = stalling_link();
        let mut call = link.start_call(start()).await.unwrap();
        assert!(link.send(keepalive()).await, "room for two");
        let started = tokio::time::Instant::now();
        assert!(!link.send(keepalive()).await, "the queue stayed full");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(link.closed.is_cancelled());
        let reason = link.close_reason().unwrap();
        assert!(
            reason.contains("stalled: the agent read nothing"),
            "{reason}"
        );
        let (_, result) = drain(&mut call).await;
        assert_eq!(result.status, CallStatus::Lost as i32);
        assert!(
            link.start_call(start()).await.is_err(),
            "a new call waits no more"
        );
    }

    #[tokio::test]
    async fn a_call_too_big_for_one_message_is_refused_alone() {
        let (link, mut rx) = link(1000);
        let mut huge = start();
        huge.cwd = "d".repeat(MAX_MESSAGE_BYTES);
        let refused = link.start_call(huge).await.unwrap_err();
        assert_eq!(refused.status, CallStatus::InvalidArgs as i32);
        assert!(next_msg(&mut rx).is_none(), "nothing was sent");
        assert!(link.start_call(start()).await.is_ok(), "the link is fine");
    }
}
