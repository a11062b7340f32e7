//! The AgentLink service: agents attach here, receive the catalog and calls, and fetch blobs.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status, Streaming};
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::outbound::{self, Taken};
use toolsrv_proto::received::Received;
use toolsrv_proto::text::printable_line;
use toolsrv_proto::v1::agent_link_server::{AgentLink, AgentLinkServer};
use toolsrv_proto::v1::{
    AgentMessage, BlobChunk, CallOutput, CoordinatorMessage, FetchBlobRequest, Goodbye, Hello,
    HostView, Keepalive, SandboxPolicy, Welcome, agent_message, coordinator_message::Msg,
};

use crate::State;
use crate::catalog::Shipped;
use crate::fleet::{HostEntry, now_ms};
use crate::framing::{self, Inbound};
use crate::identity::Caller;
use crate::link::{AgentEvent, Link};
use crate::view_pace::ViewPace;
use crate::views::ViewParts;

/// Most bytes of an agent's message on how a call ended that the coordinator passes on (cut
/// past that, saying so); the agent's own are a line.
const MAX_CALL_MESSAGE_BYTES: usize = 4096;

/// How long an agent has to send its Hello after attaching.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an agent may take to say anything after the Welcome before its link counts as
/// lost, when that is longer than `lost_after`: it speaks only once the Welcome has reached it,
/// so its first word comes a whole round trip later, and a link whose round trip is longer
/// than `lost_after` (a satellite uplink, a congested VPN) would otherwise be judged lost at
/// every attach, for ever, though its keepalives would keep it alive after.
const FIRST_WORD_WITHIN: Duration = HELLO_TIMEOUT;
/// The path of the `Attach` method.
const ATTACH_PATH: &str = "/toolsrv.v1.AgentLink/Attach";
/// How long a goodbye at shutdown waits for room in a link's queue.
const GOODBYE_WAIT: Duration = Duration::from_secs(2);
/// Blob bytes per message.
const BLOB_CHUNK: usize = 64 << 10;

/// The AgentLink gRPC service.
#[derive(Debug, Clone)]
pub struct AgentLinkService {
    pub(crate) state: Arc<State>,
}

type Outbound = Pin<Box<dyn Stream<Item = Result<CoordinatorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl AgentLink for AgentLinkService {
    type AttachStream = Outbound;
    type FetchBlobStream = Pin<Box<dyn Stream<Item = Result<BlobChunk, Status>> + Send>>;

    async fn attach(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        // Served through `AgentLinkRoutes`, which frames the stream itself; this path serves the
        // same session for anyone mounting the generated server directly.
        let caller = Caller::of(req.extensions(), toolsrv_tls::Role::Agent)?.clone();
        // tonic's codec gives whole messages only: silence is judged on them.
        let received = Arc::default();
        let outbound = self.open(caller, req.into_inner(), received).await?;
        Ok(Response::new(Box::pin(outbound.map(Ok))))
    }

    async fn fetch_blob(
        &self,
        req: Request<FetchBlobRequest>,
    ) -> Result<Response<Self::FetchBlobStream>, Status> {
        Caller::agent(&req)?;
        let sha = req.into_inner().sha256;
        let catalog = self.state.registry.catalog();
        let (path, size) = catalog
            .tools
            .values()
            .filter_map(|t| t.executable.as_ref())
            .find(|e| e.sha256 == sha)
            .map(|e| (e.path.clone(), e.size))
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no executable with sha256 {sha} in the current catalog"
                ))
            })?;
        // Not waiting on a FIFO put in the executable's place since the scan, and no more than
        // the bytes hashed then (a file that grew, or a link now to /dev/zero, is cut there and
        // fails the agent's digest check).
        let opened = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || toolsrv_registry::open_regular(&path)).await
        };
        let file = match opened {
            Ok(Ok(file)) => file,
            Ok(Err(e)) => {
                return Err(Status::unavailable(format!(
                    "cannot open {}: {e}",
                    path.display()
                )));
            }
            Err(e) => return Err(Status::internal(format!("opening the executable: {e}"))),
        };
        let mut file = tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(file), size);
        let (tx, rx) = mpsc::channel(4);
        self.state.tasks.spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0; BLOB_CHUNK];
            loop {
                let item = match file.read(&mut buf).await {
                    Ok(0) => return,
                    Ok(n) => Ok(BlobChunk {
                        data: buf[..n].to_vec(),
                    }),
                    Err(e) => Err(Status::data_loss(format!(
                        "reading {}: {e}",
                        path.display()
                    ))),
                };
                let failed = item.is_err();
                if tx.send(item).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl AgentLinkService {
    /// Starts the session of agent `id` once its hello has arrived on `inbound`; the returned
    /// stream is what goes back to the agent. `received` counts the bytes read from it, as they
    /// arrive.
    async fn open<S>(
        &self,
        caller: Caller,
        mut inbound: S,
        received: Arc<Received>,
    ) -> Result<Taken<CoordinatorMessage>, Status>
    where
        S: Stream<Item = Result<AgentMessage, Status>> + Unpin + Send + 'static,
    {
        let id = caller.name;
        let hello = read_hello(&mut inbound, &id).await?;
        let state = self.state.clone();
        let (tx, rx) = outbound::channel(256, state.config.stalled_after);
        let generation = state.fleet.next_generation();
        let link = Link::new(id.clone(), generation, tx, state.config.credit_window);
        // Small chunks are held to the window too, where the agent counts what each costs.
        let link = Arc::new(if hello.counts_chunk_overhead {
            link.counting_chunk_overhead()
        } else {
            link
        });
        tracing::info!(host = %id, version = ?hello.agent_version, "agent attached");
        let mut entry = HostEntry {
            id: id.clone(),
            facts: hello.facts.clone().unwrap_or_default(),
            synced: false,
            certificate_labels: caller.labels,
            trusted_labels: Default::default(),
            selectable_labels: Default::default(),
            agent_version: hello.agent_version.clone(),
            max_concurrent_calls: hello.max_concurrent_calls,
            connected_unix_ms: now_ms(),
            view: None,
            link: Some(link.clone()),
            remote: None,
            last_seen: Arc::new(now_ms().into()),
        };
        // Trusted: the labels the certificate carries (bound at enrollment), with the ones
        // `--host-labels` assigns over them.
        let labelled_with = state.host_labels.now();
        entry.relabel(labelled_with.of(&id));
        // With replicas, the link is this replica's only once etcd says so.
        if let Some(replicas) = &state.replicas {
            replicas.claim(&entry, &link.link_id).await?;
        }
        state.metrics.attached();
        state.fleet.attach(entry);
        // New host labels may have taken force since the entry was labelled, and the
        // relabelling of every host missed it, not yet attached: label it with them (and
        // its claim, which carries its labels to the other replicas).
        let labels = state.host_labels.now();
        if !Arc::ptr_eq(&labels, &labelled_with)
            && state.fleet.relabel_one(&id, labels.of(&id))
            && let Some(replicas) = &state.replicas
        {
            replicas.relabelled(&state.fleet, vec![id.clone()]).await;
        }
        let last_seen = state
            .fleet
            .get(&id)
            .map(|h| h.last_seen)
            .unwrap_or_default();
        let not_after = caller.not_after;
        self.state.tasks.spawn(async move {
            let heard = Heard {
                last_seen: &last_seen,
                received: &received,
            };
            let reason = session(&state, &link, inbound, heard, not_after).await;
            tracing::info!(host = %link.host_id, reason = ?reason, "agent detached");
            link.close(&reason);
            state.fleet.detach(&link.host_id, link.generation);
            if let Some(replicas) = &state.replicas {
                replicas.release(&link.host_id, &link.link_id);
            }
        });
        Ok(rx)
    }

    /// `Attach` with the lean framing of [`crate::framing`].
    async fn attach_framed(
        &self,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, Status> {
        let (parts, body) = req.into_parts();
        let caller = Caller::of(&parts.extensions, toolsrv_tls::Role::Agent)?.clone();
        let inbound = Inbound::new(body, MAX_MESSAGE_BYTES).first_at_most(MAX_HELLO_BYTES);
        let received = inbound.received();
        let outbound = self.open(caller, inbound, received).await?;
        Ok(framing::response(outbound.map(Ok), MAX_MESSAGE_BYTES))
    }
}

/// The most a hello (the link's first message) may take: its facts and labels are a few KiB.
const MAX_HELLO_BYTES: usize = 256 << 10;

/// The AgentLink service as the coordinator serves it: `Attach` framed by [`crate::framing`], whose
/// buffers shrink back when a link goes quiet (tonic's keep the size of the largest message for
/// the life of the stream, and an agent link lives for days), the other methods by the generated
/// server.
#[derive(Debug, Clone)]
pub struct AgentLinkRoutes {
    service: AgentLinkService,
    generated: AgentLinkServer<AgentLinkService>,
}

impl AgentLinkRoutes {
    pub fn new(service: AgentLinkService) -> Self {
        let generated = AgentLinkServer::new(service.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Self { service, generated }
    }
}

impl NamedService for AgentLinkRoutes {
    const NAME: &'static str = <AgentLinkServer<AgentLinkService> as NamedService>::NAME;
}

impl Service<http::Request<Body>> for AgentLinkRoutes {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != ATTACH_PATH {
            return self.generated.call(req);
        }
        let service = self.service.clone();
        Box::pin(async move {
            Ok(service
                .attach_framed(req)
                .await
                .unwrap_or_else(Status::into_http))
        })
    }
}

/// Reads the first message, which must be a Hello whose host id matches the certificate's `id`
/// (already lowercase) once normalised the same way; the Hello returned carries that spelling.
async fn read_hello<S>(inbound: &mut S, id: &str) -> Result<Hello, Status>
where
    S: Stream<Item = Result<AgentMessage, Status>> + Unpin,
{
    let first = tokio::time::timeout(HELLO_TIMEOUT, inbound.next())
        .await
        .map_err(|_| Status::deadline_exceeded("no hello within 10 s of attaching"))?
        .transpose()?;
    let Some(AgentMessage {
        msg: Some(agent_message::Msg::Hello(mut hello)),
    }) = first
    else {
        return Err(Status::invalid_argument(
            "the first message on the agent link must be a hello",
        ));
    };
    crate::labels::check_hello(&hello).map_err(Status::invalid_argument)?;
    if toolsrv_tls::normalize_name(&hello.host_id) != id {
        tracing::warn!(cert = %id, claimed = ?hello.host_id, "agent claimed another host id");
        return Err(Status::permission_denied(format!(
            "hello claims host `{}` but the certificate names agent/{id}",
            hello.host_id
        )));
    }
    hello.host_id = id.to_string();
    Ok(hello)
}

/// How long a link whose certificate expired goes on for the calls running on it.
const EXPIRED_GRACE_SECS: i64 = 300;

/// Why a link whose certificate (valid until `not_after`, Unix seconds) expired must end at
/// `now`: at the first moment no call runs on it, or [`EXPIRED_GRACE_SECS`] after the expiry
/// whatever runs. An enrolled agent renews its certificate well before, but its connection
/// keeps the one it was made with; ending the link moves it to the renewed one.
fn expired(not_after: Option<i64>, calls_running: usize, now: i64) -> Option<String> {
    let not_after = not_after?;
    let over = now.checked_sub(not_after)?;
    (over >= 0 && (calls_running == 0 || over >= EXPIRED_GRACE_SECS)).then(|| {
        format!(
            "its certificate expired {over} s ago (notAfter {not_after}, Unix seconds): \
             reconnect with a renewed one"
        )
    })
}

/// What tells that an agent is alive: when it was last heard from (wall time, for users), and
/// the bytes read from its link so far.
struct Heard<'a> {
    last_seen: &'a std::sync::atomic::AtomicU64,
    received: &'a Received,
}

/// Runs one agent connection until it ends; returns why it ended.
async fn session<S>(
    state: &State,
    link: &Arc<Link>,
    mut inbound: S,
    alive: Heard<'_>,
    not_after: Option<i64>,
) -> String
where
    S: Stream<Item = Result<AgentMessage, Status>> + Unpin,
{
    let last_seen = alive.last_seen;
    let _counted = state.pace.count();
    let mut keepalive = state.pace.interval(None);
    let mut lost_after = state.pace.lost_after(keepalive);
    let welcome = Welcome {
        keepalive_interval_ms: keepalive.as_millis() as u32,
        coordinator_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if !link.send(Msg::Welcome(welcome)).await {
        return "the agent went away before the welcome".into();
    }
    // The host's sandbox grants go before the catalog, so no call can run without them; and
    // again whenever a new policy or new host labels change them (subscribed first, so no
    // change is missed).
    let mut settings = state.settings_applied.subscribe();
    let mut grants = grants_for(state, &link.host_id);
    if !link.send(Msg::Sandbox(grants.clone())).await {
        return gone(link);
    }
    let mut catalogs = state.registry.subscribe();
    let mut shipped = Shipped::default();
    let mut tick = tokio::time::interval(keepalive);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut catalog_changed = true;
    // Liveness is judged on the monotonic clock (a wall-clock step must not lose or keep an
    // agent); `last_seen` keeps wall time only for what is shown to users.
    let mut heard = tokio::time::Instant::now();
    // Bytes still arriving are the agent alive, though the message they belong to (a view part
    // of a megabyte on a slow uplink) is not whole yet, and its keepalives wait behind it.
    let mut bytes_heard = alive.received.bytes();
    // Nothing heard since the Welcome yet: silence is judged by FIRST_WORD_WITHIN until then.
    let mut spoken = false;
    let mut views = ViewParts::default();
    let mut pace = ViewPace::new(tokio::time::Instant::now());
    loop {
        if catalog_changed {
            catalog_changed = false;
            let catalog = catalogs.borrow_and_update().clone();
            for update in shipped.updates(&catalog) {
                if !link.send(Msg::Catalog(update)).await {
                    return gone(link);
                }
            }
        }
        // Biased: what the agent sent is read before the timer judges its silence, so a
        // coordinator slow to poll does not declare lost a link whose keepalive is waiting.
        tokio::select! {
            biased;
            () = state.shutdown.cancelled() => {
                // Said if the agent has room for it: a stalled one does not hold the shutdown.
                let goodbye = Msg::Goodbye(Goodbye {
                    reason: "coordinator shutting down".into(),
                    refused: false,
                });
                let _ = tokio::time::timeout(GOODBYE_WAIT, link.send(goodbye)).await;
                return "coordinator shutting down".into();
            }
            () = link.closed.cancelled() => {
                let reason = link.close_reason().unwrap_or("replaced by a new connection");
                // The agent hears why (a revocation, a newer link elsewhere), if it still reads.
                let goodbye = Msg::Goodbye(Goodbye {
                    reason: reason.to_string(),
                    refused: link.refused(),
                });
                let _ = tokio::time::timeout(GOODBYE_WAIT, link.send(goodbye)).await;
                return reason.into();
            }
            msg = inbound.next() => match msg {
                Some(Ok(msg)) => {
                    heard = tokio::time::Instant::now();
                    spoken = true;
                    last_seen.store(now_ms(), Ordering::Relaxed);
                    let mut reported = Reported { views: &mut views, pace: &mut pace };
                    match handle(state, link, &shipped, &mut reported, msg) {
                        None => {}
                        Some(Ended::Left(reason)) => return reason,
                        Some(Ended::Refused(reason)) => return refuse(link, reason).await,
                    }
                }
                None => return "the agent closed the link".into(),
                Some(Err(status)) => {
                    return refuse(link, format!("link error: {}", status.message())).await;
                }
            },
            changed = catalogs.changed() => match changed {
                Ok(()) => catalog_changed = true,
                Err(_) => return "registry stopped".into(),
            },
            changed = settings.changed() => {
                if changed.is_err() {
                    return "coordinator shutting down".into();
                }
                let now = grants_for(state, &link.host_id);
                if now != grants {
                    grants = now;
                    if !link.send(Msg::Sandbox(grants.clone())).await {
                        return gone(link);
                    }
                }
            }
            () = until(pace.due()) => {
                if let Some(view) = pace.take_due(tokio::time::Instant::now()) {
                    store_view(state, link, &shipped, view);
                }
            }
            scheduled = tick.tick() => {
                if alive.received.arrived_since(&mut bytes_heard) {
                    heard = tokio::time::Instant::now();
                    spoken = true;
                    last_seen.store(now_ms(), Ordering::Relaxed);
                }
                let silent = heard.elapsed();
                // A tick that fires late says this process is behind (a reconnect storm's
                // handshakes, a busy machine): the agent's keepalive may be waiting unread in
                // the connection. Silence is judged only on a tick on time; a dead connection
                // still ends through HTTP/2 keepalive pings meanwhile.
                let behind = scheduled.elapsed() > keepalive / 2;
                let limit = if spoken {
                    lost_after
                } else {
                    lost_after.max(FIRST_WORD_WITHIN)
                };
                if silent > limit && !behind {
                    return format!("lost: nothing heard for {} ms", silent.as_millis());
                }
                let now = i64::try_from(now_ms() / 1000).unwrap_or(i64::MAX);
                if let Some(reason) = expired(not_after, link.calls_in_flight(), now) {
                    link.send(Msg::Goodbye(Goodbye {
                        reason: reason.clone(),
                        refused: false,
                    }))
                    .await;
                    return reason;
                }
                let paced = state.pace.interval(Some(keepalive));
                let mut interval_ms = 0;
                if paced != keepalive {
                    // The agent learns the new interval with this keepalive; silence is judged
                    // by the longer of the two until it has.
                    lost_after = lost_after.max(state.pace.lost_after(paced));
                    keepalive = paced;
                    interval_ms = paced.as_millis() as u32;
                    tick = tokio::time::interval_at(tokio::time::Instant::now() + paced, paced);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                } else {
                    lost_after = state.pace.lost_after(keepalive);
                }
                link.send(Msg::Keepalive(Keepalive { sent_unix_ms: now_ms(), interval_ms })).await;
            }
        }
    }
}

/// Ends a link over what its agent sent, saying why in a Goodbye (when the agent has room for
/// it), so that the agent's log names the cause rather than a link closed without a word.
async fn refuse(link: &Link, reason: String) -> String {
    let goodbye = Msg::Goodbye(Goodbye {
        reason: reason.clone(),
        refused: true,
    });
    let _ = tokio::time::timeout(GOODBYE_WAIT, link.send(goodbye)).await;
    reason
}

/// Why a link whose message could not be queued ended: the stall that closed it, or the agent
/// gone.
fn gone(link: &Link) -> String {
    link.close_reason().unwrap_or("the agent went away").into()
}

/// The policy's sandbox grants for host `id`, as it is now.
fn grants_for(state: &State, id: &str) -> SandboxPolicy {
    state
        .fleet
        .get(id)
        .map(|host| state.policy.now().sandbox_for(&host.policy_facts()))
        .unwrap_or_default()
}

/// Sleeps until `at`; for ever when `None`.
async fn until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Where the views an agent reports go before they are stored: parts pile up in `views`
/// (within a bound) until the last is in, then the whole view waits its turn in `pace`.
struct Reported<'a> {
    views: &'a mut ViewParts,
    pace: &'a mut ViewPace,
}

/// Why a message from the agent ends the session.
enum Ended {
    /// The agent said goodbye.
    Left(String),
    /// The coordinator refuses what it sent (the agent is told why: [`refuse`]).
    Refused(String),
}

/// Handles one message from the agent; `Some` ends the session.
fn handle(
    state: &State,
    link: &Link,
    shipped: &Shipped,
    reported: &mut Reported<'_>,
    msg: AgentMessage,
) -> Option<Ended> {
    use agent_message::Msg as M;
    match msg.msg {
        Some(M::View(part)) => match reported.views.add(part) {
            Ok(Some(view)) => offer_view(state, link, shipped, reported.pace, view),
            Ok(None) => {}
            Err(reason) => return Some(Ended::Refused(reason)),
        },
        Some(M::Output(CallOutput {
            call_id,
            chunk: Some(chunk),
        })) => link.deliver(call_id, AgentEvent::Output(chunk)),
        Some(M::Finished(f)) => {
            let result = checked_result(f.result.unwrap_or_default());
            link.deliver(f.call_id, AgentEvent::Finished(result))
        }
        Some(M::Bypass(request)) => link.deliver(request.call_id, AgentEvent::Bypass(request)),
        Some(M::Draining(_)) => {
            // Said once: an agent that says it again is not worth a line each time.
            if link.set_draining() {
                tracing::info!(host = %link.host_id, "the agent is shutting down: no new calls go to it");
            }
        }
        // Reaches the callers of the calls the link ends: one bounded line.
        Some(M::Goodbye(g)) => {
            return Some(Ended::Left(format!(
                "goodbye: {}",
                printable_line(&g.reason, 256)
            )));
        }
        Some(M::Hello(_)) => return Some(Ended::Refused("protocol error: a second hello".into())),
        Some(M::Keepalive(_)) | Some(M::Output(_)) | None => {}
    }
    None
}

/// How an agent says a call ended, held to what a host can know before it reaches the caller
/// and the audit log: a status only the coordinator gives (denied, busy, offline, ...) or none
/// at all becomes `lost`, saying so; an exit code or a signal no process has is dropped; a
/// result that is not JSON is left out, saying so; the message is one printable line (it
/// reaches terminals and models). A compromised host could otherwise have the audit log say
/// that the policy denied a call it ran.
fn checked_result(mut result: toolsrv_proto::v1::CallResult) -> toolsrv_proto::v1::CallResult {
    use toolsrv_proto::v1::CallStatus as S;
    let mut notes = Vec::new();
    let status = S::try_from(result.status).ok();
    let host_may_say = matches!(
        status,
        Some(
            S::Ok
                | S::ToolError
                | S::Hidden
                | S::TimedOut
                | S::InvalidArgs
                | S::Cancelled
                | S::FailedToStart
                | S::Unconfined
                | S::UnknownTool
        )
    );
    if !host_may_say {
        notes.push(format!(
            "the host reported the call ended with status {}, which only the coordinator gives: \
             its outcome is unknown",
            status.map_or_else(
                || result.status.to_string(),
                |s| s.as_str_name().to_string()
            )
        ));
        result.status = S::Lost as i32;
    }
    if result.exit_code.is_some_and(|c| !(0..=255).contains(&c)) {
        result.exit_code = None;
    }
    if result.signal.is_some_and(|s| !(1..=64).contains(&s)) {
        result.signal = None;
    }
    if !result.result_json.is_empty()
        && serde_json::from_str::<serde::de::IgnoredAny>(&result.result_json).is_err()
    {
        result.result_json.clear();
        notes.push("the host's result was not JSON and was left out".to_string());
    }
    // The agent's words on how the call ended reach terminals and models: one line.
    let message = std::iter::once(result.message.as_str())
        .filter(|m| !m.is_empty())
        .chain(notes.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("; ");
    result.message = printable_line(&message, MAX_CALL_MESSAGE_BYTES);
    result
}

/// A whole view the agent reported: stored now if its link has a turn ([`crate::view_pace`]),
/// else kept until its turn comes, in place of any view already waiting.
fn offer_view(state: &State, link: &Link, shipped: &Shipped, pace: &mut ViewPace, view: HostView) {
    let sent = shipped.catalog(view.catalog_revision).is_some();
    let offered = pace.offer(view, sent, tokio::time::Instant::now());
    if offered.replaced {
        state.metrics.view_passed_over();
    }
    if offered.first_wait {
        tracing::warn!(
            host = %link.host_id,
            "the agent reports views faster than they are stored ({} at once, then one each {} ms): \
             each waits for its turn and a newer one replaces it; the newest is always stored",
            crate::view_pace::BURST,
            crate::view_pace::INTERVAL.as_millis()
        );
    }
    if let Some(view) = offered.store {
        store_view(state, link, shipped, view);
    }
}

/// Stores a whole view the agent reported, checked against the catalog it was computed from
/// ([`crate::views::Interner::check`]). A view of a catalog this link did not ship lately is
/// passed over: a newer one follows the update the agent has yet to read.
fn store_view(state: &State, link: &Link, shipped: &Shipped, view: HostView) {
    let Some(catalog) = shipped.catalog(view.catalog_revision) else {
        tracing::warn!(
            host = %link.host_id,
            revision = view.catalog_revision,
            "the agent reported a view of a catalog revision this link did not ship lately: passed over"
        );
        return;
    };
    let checked = state
        .fleet
        .check_view(view, catalog, state.config.host_only);
    if !checked.problems.is_empty() {
        const SHOWN: usize = 5;
        let mut problems = checked.problems[..checked.problems.len().min(SHOWN)].join("; ");
        if checked.problems.len() > SHOWN {
            problems.push_str(&format!("; and {} more", checked.problems.len() - SHOWN));
        }
        tracing::warn!(
            host = %link.host_id,
            revision = catalog.revision,
            "the agent's view differs from the catalog, which has the last word: {problems}"
        );
    }
    state
        .fleet
        .set_view(&link.host_id, link.generation, checked.view);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a compromised host says of a call's end is held to what a host can know.
    #[test]
    fn a_host_s_account_of_a_call_is_checked() {
        use toolsrv_proto::v1::{CallResult, CallStatus as S};
        let said = |status: i32| CallResult {
            status,
            message: "done".into(),
            ..CallResult::default()
        };
        // Only the coordinator denies, finds a client busy, a host offline...
        for status in [S::Denied, S::Busy, S::Offline, S::Skipped, S::Unspecified] {
            let r = checked_result(said(status as i32));
            assert_eq!(r.status, S::Lost as i32, "{status:?}");
            assert!(
                r.message
                    .starts_with("done; the host reported the call ended with status")
                    && r.message.contains(status.as_str_name()),
                "{}",
                r.message
            );
        }
        let r = checked_result(said(999));
        assert_eq!(r.status, S::Lost as i32);
        assert!(r.message.contains("status 999"), "{}", r.message);
        // What a host may say stays as said.
        for status in [S::Ok, S::ToolError, S::TimedOut, S::Hidden, S::Cancelled] {
            let r = checked_result(CallResult {
                exit_code: Some(3),
                signal: Some(9),
                result_json: r#"{"content": []}"#.into(),
                ..said(status as i32)
            });
            assert_eq!(
                (r.status, r.exit_code, r.signal, r.message.as_str()),
                (status as i32, Some(3), Some(9), "done")
            );
            assert_eq!(r.result_json, r#"{"content": []}"#);
        }
        // No process exits with -5 or dies of signal 2^31 - 1; a result must be JSON.
        let r = checked_result(CallResult {
            exit_code: Some(-5),
            signal: Some(i32::MAX),
            result_json: "not json {".into(),
            message: "\u{1b}[2Jbye".into(),
            ..said(S::ToolError as i32)
        });
        assert_eq!((r.exit_code, r.signal), (None, None));
        assert!(r.result_json.is_empty());
        assert_eq!(
            r.message,
            r"\u{1b}[2Jbye; the host's result was not JSON and was left out"
        );
    }

    #[test]
    fn an_expired_link_ends_when_idle_or_after_the_grace() {
        // No certificate time known (a test peer), or not expired yet: goes on.
        assert_eq!(expired(None, 0, 1_000), None);
        assert_eq!(expired(Some(1_000), 0, 999), None);
        // Expired and idle: ends, saying why.
        let why = expired(Some(1_000), 0, 1_000).unwrap();
        assert!(
            why.contains("expired 0 s ago") && why.contains("renewed"),
            "{why}"
        );
        // Expired with calls running: they finish first, within the grace.
        assert_eq!(
            expired(Some(1_000), 2, 1_000 + EXPIRED_GRACE_SECS - 1),
            None
        );
        assert!(expired(Some(1_000), 2, 1_000 + EXPIRED_GRACE_SECS).is_some());
        // Odd times do not overflow: a difference that does not fit is no expiry.
        assert_eq!(expired(Some(i64::MAX), 0, i64::MIN), None);
        assert_eq!(expired(Some(i64::MIN), 0, i64::MAX), None);
        assert!(expired(Some(-5), 0, 0).is_some());
    }

    fn hello(host_id: &str) -> Result<AgentMessage, Status> {
        Ok(AgentMessage {
            msg: Some(agent_message::Msg::Hello(Hello {
                host_id: host_id.to_string(),
                ..Hello::default()
            })),
        })
    }

    #[tokio::test]
    async fn the_hello_is_compared_after_the_same_normalisation_as_the_certificate() {
        // Certificate `agent/Web-1` is host `web-1`; its agent may say so in any case.
        let cert = toolsrv_tls::Identity::parse_uri("toolsrv://agent/Web-1").unwrap();
        let id = cert.name().unwrap();
        for claimed in ["Web-1", "web-1", "WEB-1"] {
            let mut inbound = tokio_stream::iter([hello(claimed)]);
            let got = read_hello(&mut inbound, id).await.unwrap();
            assert_eq!(got.host_id, "web-1", "{claimed}");
        }
        let mut inbound = tokio_stream::iter([hello("Web-2")]);
        let err = read_hello(&mut inbound, id).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert!(err.message().contains("agent/web-1"), "{}", err.message());
    }
}
