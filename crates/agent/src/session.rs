//! One session on the agent link: Hello, Welcome, then catalog updates, calls, credits and
//! keepalives until the link ends or the agent shuts down.
//!
//! Tasks and channels of a session:
//! - the main loop (this module) reads the inbound stream, keeps time (keepalives, silence,
//!   drain deadline) and owns the table of running calls;
//! - one keeper task ([`crate::keeper`]) applies catalog updates it gets over `updates`,
//!   rechecks the host, publishes the catalog on a `watch` and sends host views;
//! - one task per call ([`crate::calls`]) in a `JoinSet`, gated by a semaphore;
//! - everything outbound goes through one bounded mpsc whose receiver is the request stream.

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::{JoinError, JoinSet};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tonic::Streaming;
use tonic::transport::Channel;
use toolsrv_confine::Confiner;
use toolsrv_meta::Host;
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::outbound::{self, NotSent, Outbound};
use toolsrv_proto::received::Received;
use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, CallFinished, CallResult, CallStatus, CatalogUpdate, CoordinatorMessage, Goodbye,
    Keepalive, StartCall, Welcome,
};

use crate::blobs::GrpcBlobs;
use crate::calls::{CallEnv, Credit, run_call};
use crate::config::AgentConfig;
use crate::error::AgentError;
use crate::facts::hello;
use crate::keeper::{CatalogKeeper, KeeperChannels, keep_catalog};

use crate::reconnect::SessionEnd;
use crate::store::CatalogStore;

/// Outbound messages buffered before senders wait (output chunks are up to 64 KiB each).
const OUTBOUND_CAPACITY: usize = 64;
/// Catalog updates queued for the keeper.
const UPDATE_QUEUE: usize = 16;
/// How long the coordinator may take to answer the Hello.
const WELCOME_TIMEOUT: Duration = Duration::from_secs(30);
/// Keepalive interval when the Welcome names none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(10);
/// Keepalive intervals of silence after which the link counts as lost.
const SILENT_INTERVALS: u32 = 3;
/// After cancelling calls, how long past their kill grace they may take to report.
const STOP_SLACK: Duration = Duration::from_secs(3);
/// After saying goodbye, how long to wait for the coordinator to close its side.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// What every session of one agent shares.
#[derive(Debug)]
pub(crate) struct Agent {
    pub config: AgentConfig,
    pub host: Host,
    /// The agent's own environment, which tools start from.
    pub base_env: Vec<(OsString, OsString)>,
    pub store: CatalogStore,
    /// Confines every call.
    pub confiner: Arc<Confiner>,
    pub metrics: crate::AgentMetrics,
}

/// Runs one session over `channel`. `welcomed` is set once the coordinator sent its Welcome.
pub(crate) async fn session(
    agent: &Agent,
    channel: Channel,
    shutdown: &CancellationToken,
    welcomed: &mut bool,
) -> Result<SessionEnd, AgentError> {
    let (out, out_rx) = outbound::channel(OUTBOUND_CAPACITY, agent.config.stalled_after);
    let first = AgentMessage {
        msg: Some(Out::Hello(hello(
            &agent.config,
            &agent.host,
            agent.confiner.abilities(),
        ))),
    };
    // The channel is new and empty: there is room for the first message.
    let _ = out.try_send(first);
    let (counted, received) = crate::received::Counted::new(channel.clone());
    let mut client = AgentLinkClient::new(counted)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let mut inbound = tokio::select! {
        attached = client.attach(out_rx) => attached
            .map_err(|status| AgentError::Rpc { what: "opening the agent link", status })?
            .into_inner(),
        () = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
    };
    let welcome = tokio::select! {
        first = timeout(WELCOME_TIMEOUT, inbound.message()) => expect_welcome(first)?,
        () = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
    };
    *welcomed = true;
    agent.metrics.attached();
    let _detached = Detached(&agent.metrics);
    let interval = match welcome.keepalive_interval_ms {
        0 => DEFAULT_KEEPALIVE,
        ms => Duration::from_millis(u64::from(ms).max(10)),
    };
    tracing::info!(
        coordinator = %agent.config.coordinator,
        coordinator_version = %welcome.coordinator_version,
        keepalive = ?interval,
        "attached to the coordinator"
    );

    let keeper = CatalogKeeper::new(agent.store.clone(), &agent.config.tools, agent.host.clone());
    let (catalog_tx, catalog_rx) = watch::channel(keeper.catalog());
    let (updates, updates_rx) = mpsc::channel(UPDATE_QUEUE);
    let keeper_stop = CancellationToken::new();
    let blobs = GrpcBlobs::new(channel);
    let keeper_task = tokio::spawn(keep_catalog(
        keeper,
        blobs.clone(),
        KeeperChannels {
            updates: updates_rx,
            catalog: catalog_tx,
            out: out.clone(),
            recheck_every: agent.config.recheck_every,
            stop: keeper_stop.clone(),
            metrics: agent.metrics.clone(),
        },
    ));
    let env = Arc::new(CallEnv {
        catalog: catalog_rx,
        host: agent.host.clone(),
        base_env: agent.base_env.clone(),
        limits: agent.config.limits,
        workdir: agent.config.workdir.clone(),
        slots: Arc::new(Semaphore::new(
            agent.config.max_concurrent_calls.max(1) as usize
        )),
        out: out.clone(),
        store: agent.store.clone(),
        blobs,
        confiner: agent.confiner.clone(),
        grants: std::sync::RwLock::default(),
        bypasses: Arc::default(),
        metrics: agent.metrics.clone(),
    });
    let mut session = SessionLoop {
        config: &agent.config,
        out,
        updates,
        env,
        calls: HashMap::new(),
        tasks: JoinSet::new(),
        task_calls: HashMap::new(),
        all_calls: CancellationToken::new(),
        draining: false,
        paced: None,
    };
    let end = session
        .serve(&mut inbound, &received, interval, shutdown)
        .await;

    // Whatever ended the session, no call outlives it; a bypass request still waiting is told
    // that the link is gone before its call is cancelled.
    session.env.bypasses.close();
    session.stop_calls().await;
    keeper_stop.cancel();
    if let Err(e) = keeper_task.await {
        tracing::error!(error = %e, "the catalog keeper task failed");
    }
    if matches!(end, Ok(SessionEnd::Shutdown)) {
        session.say_goodbye(&mut inbound).await;
    }
    end
}

/// Marks the link down when a session ends, however it ends.
struct Detached<'a>(&'a crate::AgentMetrics);

impl Drop for Detached<'_> {
    fn drop(&mut self) {
        self.0.detached();
    }
}

fn expect_welcome(
    first: Result<Result<Option<CoordinatorMessage>, tonic::Status>, tokio::time::error::Elapsed>,
) -> Result<Welcome, AgentError> {
    match first {
        Err(_) => Err(AgentError::Protocol(format!(
            "no Welcome within {WELCOME_TIMEOUT:?} of the Hello; the coordinator may be overloaded"
        ))),
        Ok(Err(status)) => Err(AgentError::Rpc {
            what: "attaching to the coordinator",
            status,
        }),
        Ok(Ok(None)) => Err(AgentError::LinkLost(
            "the coordinator closed the link before its Welcome".into(),
        )),
        Ok(Ok(Some(CoordinatorMessage {
            msg: Some(In::Welcome(welcome)),
        }))) => Ok(welcome),
        Ok(Ok(Some(other))) => Err(AgentError::Protocol(format!(
            "its first message must be a Welcome, got {}",
            kind(&other)
        ))),
    }
}

fn kind(msg: &CoordinatorMessage) -> &'static str {
    match &msg.msg {
        Some(In::Welcome(_)) => "a Welcome",
        Some(In::Catalog(_)) => "a CatalogUpdate",
        Some(In::Start(_)) => "a StartCall",
        Some(In::Cancel(_)) => "a CancelCall",
        Some(In::Keepalive(_)) => "a Keepalive",
        Some(In::Goodbye(_)) => "a Goodbye",
        Some(In::Credit(_)) => "a Credit",
        Some(In::Bypass(_)) => "a BypassDecision",
        Some(In::Sandbox(_)) => "a SandboxPolicy",
        None => "an empty message",
    }
}

/// A call the coordinator can still address.
#[derive(Debug)]
struct Running {
    cancel: CancellationToken,
    credit: Arc<Credit>,
}

/// The state of one session's main loop (the coordinator's side of a connection is its `Link`).
struct SessionLoop<'a> {
    config: &'a AgentConfig,
    out: Outbound<AgentMessage>,
    updates: mpsc::Sender<CatalogUpdate>,
    env: Arc<CallEnv>,
    calls: HashMap<u64, Running>,
    tasks: JoinSet<u64>,
    /// Which call each task runs, to report a task that panicked.
    task_calls: HashMap<tokio::task::Id, u64>,
    /// Parent of every call's token: cancelling it stops them all.
    all_calls: CancellationToken,
    /// Shutdown was requested: no new calls start.
    draining: bool,
    /// A keepalive interval the coordinator asked for, not applied yet.
    paced: Option<Duration>,
}

impl SessionLoop<'_> {
    async fn serve(
        &mut self,
        inbound: &mut Streaming<CoordinatorMessage>,
        received: &Received,
        interval: Duration,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, AgentError> {
        let mut keepalive = tokio::time::interval(interval);
        keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut silence = interval * SILENT_INTERVALS;
        let mut last_heard = Instant::now();
        // Bytes still arriving are the coordinator alive, though the message they belong to is
        // not whole yet and its keepalives wait behind it.
        let mut bytes_heard = received.bytes();
        // While draining: when in-flight calls get cancelled, then when waiting for them stops.
        let mut cancel_at: Option<Instant> = None;
        let mut abandon_at: Option<Instant> = None;
        loop {
            // Biased: a message waiting is read before the silence timer is looked at, so a
            // busy agent does not call a link lost whose keepalive has arrived.
            tokio::select! {
                biased;
                () = shutdown.cancelled(), if !self.draining => {
                    self.draining = true;
                    tracing::info!(
                        calls = self.calls.len(), grace = ?self.config.drain_grace,
                        "shutting down: letting in-flight calls finish"
                    );
                    // New calls go nowhere now: the coordinator refuses them as this host
                    // shutting down, rather than sending them to be refused here. Not waited
                    // on past a moment: the drain goes on whether it is sent or not.
                    let draining = Out::Draining(toolsrv_proto::v1::Draining {});
                    let _ = timeout(CLOSE_TIMEOUT, self.send(draining)).await;
                    cancel_at = Some(Instant::now() + self.config.drain_grace);
                }
                () = sleep_until(cancel_at.unwrap_or_else(Instant::now)), if cancel_at.is_some() => {
                    tracing::warn!(calls = self.calls.len(), "drain grace over: cancelling the calls still running");
                    cancel_at = None;
                    self.all_calls.cancel();
                    abandon_at = Some(Instant::now() + self.config.limits.kill_grace + STOP_SLACK);
                }
                () = sleep_until(abandon_at.unwrap_or_else(Instant::now)), if abandon_at.is_some() => {
                    abandon_at = None;
                    self.tasks.abort_all();
                }
                Some(joined) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.reap(joined).await;
                }
                received = inbound.message() => {
                    last_heard = Instant::now();
                    match received {
                        Ok(Some(msg)) => if let Some(end) = self.handle(msg).await? {
                            return Ok(end);
                        },
                        Ok(None) => return Err(AgentError::LinkLost(
                            "the coordinator closed the link without a Goodbye".into(),
                        )),
                        Err(status) => return Err(AgentError::Rpc {
                            what: "receiving from the coordinator",
                            status,
                        }),
                    }
                }
                _ = keepalive.tick() => {
                    self.send(Out::Keepalive(Keepalive { sent_unix_ms: unix_ms(), interval_ms: 0 })).await?;
                }
                () = sleep_until(last_heard + silence) => {
                    if !received.arrived_since(&mut bytes_heard) {
                        return Err(AgentError::LinkLost(format!(
                            "nothing heard from the coordinator for {silence:?} ({SILENT_INTERVALS} keepalive intervals)"
                        )));
                    }
                    last_heard = Instant::now();
                }
            }
            if let Some(every) = self.paced.take() {
                tracing::debug!(keepalive = ?every, "the coordinator changed the keepalive interval");
                keepalive = tokio::time::interval_at(Instant::now() + every, every);
                keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                silence = every * SILENT_INTERVALS;
            }
            if self.draining && self.tasks.is_empty() {
                return Ok(SessionEnd::Shutdown);
            }
        }
    }

    /// Handles one inbound message; `Some` ends the session.
    async fn handle(&mut self, msg: CoordinatorMessage) -> Result<Option<SessionEnd>, AgentError> {
        match msg.msg {
            Some(In::Catalog(update)) => {
                if self.updates.send(update).await.is_err() {
                    return Err(AgentError::LinkLost(
                        "the catalog keeper stopped (the outbound stream is gone)".into(),
                    ));
                }
            }
            Some(In::Start(start)) => self.start_call(start).await?,
            Some(In::Cancel(cancel)) => {
                if let Some(call) = self.calls.get(&cancel.call_id) {
                    tracing::debug!(
                        call_id = cancel.call_id,
                        "call cancelled by the coordinator"
                    );
                    call.cancel.cancel();
                }
            }
            Some(In::Credit(credit)) => {
                if let Some(call) = self.calls.get(&credit.call_id) {
                    call.credit.grant(credit.bytes);
                }
            }
            Some(In::Sandbox(policy)) => {
                let grants = crate::sandbox::grants(policy);
                tracing::info!(grants = grants.len(), "sandbox grants from the coordinator");
                *self.env.grants.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(grants);
            }
            Some(In::Keepalive(k)) => {
                if k.interval_ms != 0 {
                    self.paced = Some(Duration::from_millis(u64::from(k.interval_ms).max(10)));
                }
            }
            Some(In::Bypass(decision)) => {
                let (call_id, request_id) = (decision.call_id, decision.request_id);
                if !self.env.bypasses.deliver(decision) {
                    // The call ended, or its request stopped waiting: nobody to tell.
                    tracing::debug!(
                        call_id,
                        request_id,
                        "dropping a bypass decision nobody waits for"
                    );
                }
            }
            Some(In::Goodbye(goodbye)) => return Ok(Some(SessionEnd::Goodbye(goodbye))),
            Some(In::Welcome(_)) => {
                tracing::warn!("ignoring a second Welcome from the coordinator");
            }
            // A message kind newer than this agent: ignore it rather than drop the link.
            None => tracing::warn!("ignoring an empty or unknown message from the coordinator"),
        }
        Ok(None)
    }

    async fn start_call(&mut self, start: StartCall) -> Result<(), AgentError> {
        let id = start.call_id;
        if self.draining {
            return self
                .finish(id, CallStatus::Cancelled, "agent is shutting down")
                .await;
        }
        if self.calls.contains_key(&id) {
            tracing::error!(
                call_id = id,
                "ignoring a StartCall whose call id is already running"
            );
            return Ok(());
        }
        tracing::debug!(call_id = id, tool = %start.tool, "starting call");
        let cancel = self.all_calls.child_token();
        let credit = Arc::new(Credit::new(start.initial_credit));
        self.calls.insert(
            id,
            Running {
                cancel: cancel.clone(),
                credit: credit.clone(),
            },
        );
        let task = self
            .tasks
            .spawn(run_call(self.env.clone(), start, cancel, credit));
        self.task_calls.insert(task.id(), id);
        Ok(())
    }

    async fn reap(&mut self, joined: Result<(tokio::task::Id, u64), JoinError>) {
        let task = match &joined {
            Ok((task, _)) => *task,
            Err(e) => e.id(),
        };
        let Some(id) = self.task_calls.remove(&task) else {
            return;
        };
        self.calls.remove(&id);
        if let Err(e) = joined {
            // The call task died before reporting: report for it, so the caller does not hang.
            tracing::error!(call_id = id, error = %e, "call task failed");
            let why = if e.is_cancelled() {
                "call was abandoned: it did not stop in time after being cancelled".to_string()
            } else {
                format!("the agent's call task failed: {e}; see the agent's log")
            };
            let status = if e.is_cancelled() {
                CallStatus::Cancelled
            } else {
                CallStatus::ToolError
            };
            let _ = self.finish(id, status, &why).await;
        }
    }

    async fn finish(&self, id: u64, status: CallStatus, message: &str) -> Result<(), AgentError> {
        self.send(Out::Finished(CallFinished {
            call_id: id,
            result: Some(CallResult::not_run(status, message)),
        }))
        .await
    }

    async fn send(&self, msg: Out) -> Result<(), AgentError> {
        self.out
            .send(AgentMessage { msg: Some(msg) })
            .await
            .map_err(|e| {
                AgentError::LinkLost(match e {
                    NotSent::Closed => "the outbound stream to the coordinator closed".into(),
                    NotSent::Stalled(after) => format!(
                        "stalled: the coordinator read nothing the agent sent for {} s",
                        after.as_secs_f64()
                    ),
                })
            })
    }

    /// Cancels every call still running and waits (bounded) for their tasks to end.
    async fn stop_calls(&mut self) {
        if self.tasks.is_empty() {
            return;
        }
        tracing::warn!(
            calls = self.tasks.len(),
            "session over: cancelling running calls"
        );
        self.all_calls.cancel();
        let wait = self.config.limits.kill_grace + STOP_SLACK;
        let drained = timeout(wait, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            self.tasks.shutdown().await;
        }
        self.calls.clear();
        self.task_calls.clear();
    }

    /// Sends the Goodbye, closes the outbound stream and waits (bounded) for the coordinator to
    /// close its side, so the Goodbye is delivered before the connection goes.
    async fn say_goodbye(self, inbound: &mut Streaming<CoordinatorMessage>) {
        let goodbye = Out::Goodbye(Goodbye {
            reason: "agent is shutting down".into(),
            refused: false,
        });
        if timeout(CLOSE_TIMEOUT, self.send(goodbye)).await.is_err() {
            tracing::warn!("could not send the Goodbye: the outbound stream is stuck");
        }
        // Dropping every sender ends the request stream.
        drop(self);
        let _ = timeout(CLOSE_TIMEOUT, async {
            while let Ok(Some(_)) = inbound.message().await {}
        })
        .await;
        tracing::info!("said goodbye to the coordinator");
    }
}

use toolsrv_proto::unix_ms;
