//! One connected agent: its outbound queue, its in-flight calls, and per-call flow control.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::v1::{
    CallResult, CallStatus, CancelCall, CoordinatorMessage, Credit, OutputChunk, StartCall,
    coordinator_message::Msg,
};

/// Room for what wraps a `StartCall` on the wire (message tags, the call id and credit set later).
const START_SLACK: usize = 64;

/// Something that happened to a call on the agent.
#[derive(Debug)]
pub enum AgentEvent {
    Output(OutputChunk),
    Finished(CallResult),
}

/// A connected agent.
#[derive(Debug)]
pub struct Link {
    pub host_id: String,
    /// Distinguishes successive connections of the same host.
    pub generation: u64,
    tx: mpsc::Sender<CoordinatorMessage>,
    calls: Mutex<HashMap<u64, mpsc::UnboundedSender<AgentEvent>>>,
    next_call: AtomicU64,
    /// Cancelled when the connection ends.
    pub closed: CancellationToken,
    /// Bytes of output a call may have in flight before the coordinator grants more.
    window: u64,
}

impl Link {
    pub fn new(
        host_id: String,
        generation: u64,
        tx: mpsc::Sender<CoordinatorMessage>,
        window: u64,
    ) -> Self {
        Self {
            host_id,
            generation,
            tx,
            calls: Mutex::new(HashMap::new()),
            next_call: AtomicU64::new(1),
            closed: CancellationToken::new(),
            window,
        }
    }

    /// Queues a message for the agent; false when the connection is gone.
    pub async fn send(&self, msg: Msg) -> bool {
        self.tx
            .send(CoordinatorMessage { msg: Some(msg) })
            .await
            .is_ok()
    }

    pub fn calls_in_flight(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, mpsc::UnboundedSender<AgentEvent>>> {
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
            return Err(status(
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
        self.lock().insert(call_id, tx);
        start.call_id = call_id;
        start.initial_credit = self.window;
        let handle = CallHandle {
            link: self.clone(),
            call_id,
            rx,
            finished: false,
            ungranted: 0,
        };
        if self.closed.is_cancelled() || !self.send(Msg::Start(start)).await {
            return Err(status(
                CallStatus::Lost,
                format!(
                    "the link to host {} closed before the call started",
                    self.host_id
                ),
            ));
        }
        Ok(handle)
    }

    /// Delivers an agent's message about a call. Never blocks: the credit window bounds what is queued.
    pub fn deliver(&self, call_id: u64, event: AgentEvent) {
        let finished = matches!(event, AgentEvent::Finished(_));
        let mut calls = self.lock();
        let sink = if finished {
            calls.remove(&call_id)
        } else {
            calls.get(&call_id).cloned()
        };
        drop(calls);
        if let Some(sink) = sink {
            // The receiver may be gone (the client left); the cancel is already on its way.
            let _ = sink.send(event);
        }
    }

    /// Ends the connection: every in-flight call finishes as LOST with `reason`.
    pub fn close(&self, reason: &str) {
        self.closed.cancel();
        let calls: Vec<_> = self.lock().drain().collect();
        for (_, sink) in calls {
            let _ = sink.send(AgentEvent::Finished(status(
                CallStatus::Lost,
                format!("host {}: {reason}", self.host_id),
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
            None => AgentEvent::Finished(status(
                CallStatus::Lost,
                format!("the link to host {} closed", self.link.host_id),
            )),
        };
        if matches!(event, AgentEvent::Finished(_)) {
            self.finished = true;
        }
        Some(event)
    }

    /// Tells the agent that `bytes` of output were passed on, so it may send more.
    /// Credit is returned in batches of half a window to keep the link quiet.
    pub async fn consumed(&mut self, bytes: u64) {
        self.ungranted += bytes;
        if self.ungranted >= self.link.window / 2 && !self.finished {
            let credit = Credit {
                call_id: self.call_id,
                bytes: self.ungranted,
            };
            self.ungranted = 0;
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
        let cancel = CoordinatorMessage {
            msg: Some(Msg::Cancel(CancelCall {
                call_id: self.call_id,
            })),
        };
        if let Err(mpsc::error::TrySendError::Full(cancel)) = self.link.tx.try_send(cancel) {
            let tx = self.link.tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(cancel).await;
            });
        }
    }
}

/// A result that carries only a status and a message.
pub fn status(status: CallStatus, message: impl Into<String>) -> CallResult {
    CallResult {
        status: status as i32,
        message: message.into(),
        ..CallResult::default()
    }
}
