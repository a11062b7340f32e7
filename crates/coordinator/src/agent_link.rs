//! The AgentLink service: agents attach here, receive the catalog and calls, and fetch blobs.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use toolsrv_proto::v1::agent_link_server::AgentLink;
use toolsrv_proto::v1::{
    AgentMessage, BlobChunk, CallOutput, CoordinatorMessage, FetchBlobRequest, Goodbye, Hello,
    Keepalive, Welcome, agent_message, coordinator_message::Msg,
};

use crate::State;
use crate::catalog::Shipped;
use crate::fleet::{HostEntry, now_ms};
use crate::link::{AgentEvent, Link};

/// How long an agent has to send its Hello after attaching.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Blob bytes per message.
const BLOB_CHUNK: usize = 64 << 10;

/// The AgentLink gRPC service.
#[derive(Debug, Clone)]
pub struct AgentLinkService {
    pub(crate) state: Arc<State>,
}

/// The agent host id proven by the peer's certificate.
fn agent_identity<T>(req: &Request<T>) -> Result<String, Status> {
    crate::proven_name(
        req,
        toolsrv_tls::Role::Agent,
        "the agent link needs an agent certificate (toolsrv://agent/<host-id>)",
    )
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
        let id = agent_identity(&req)?;
        let mut inbound = req.into_inner();
        let hello = read_hello(&mut inbound, &id).await?;
        let (tx, rx) = mpsc::channel(256);
        let state = self.state.clone();
        let generation = state.fleet.next_generation();
        let link = Arc::new(Link::new(
            id.clone(),
            generation,
            tx,
            state.config.credit_window,
        ));
        tracing::info!(host = %id, version = %hello.agent_version, "agent attached");
        state.fleet.attach(HostEntry {
            id: id.clone(),
            facts: hello.facts.clone().unwrap_or_default(),
            agent_version: hello.agent_version.clone(),
            max_concurrent_calls: hello.max_concurrent_calls,
            connected_unix_ms: now_ms(),
            view: None,
            link: Some(link.clone()),
            last_seen: Arc::new(now_ms().into()),
        });
        let last_seen = state
            .fleet
            .get(&id)
            .map(|h| h.last_seen)
            .unwrap_or_default();
        self.state.tasks.spawn(async move {
            let reason = session(&state, &link, inbound, &last_seen).await;
            tracing::info!(host = %link.host_id, %reason, "agent detached");
            link.close(&reason);
            state.fleet.detach(&link.host_id, link.generation);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }

    async fn fetch_blob(
        &self,
        req: Request<FetchBlobRequest>,
    ) -> Result<Response<Self::FetchBlobStream>, Status> {
        agent_identity(&req)?;
        let sha = req.into_inner().sha256;
        let catalog = self.state.registry.catalog();
        let path = catalog
            .tools
            .values()
            .filter_map(|t| t.executable.as_ref())
            .find(|e| e.sha256 == sha)
            .map(|e| e.path.clone())
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no executable with sha256 {sha} in the current catalog"
                ))
            })?;
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| Status::unavailable(format!("cannot open {}: {e}", path.display())))?;
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

/// Reads the first message, which must be a Hello whose host id matches the certificate.
async fn read_hello(inbound: &mut Streaming<AgentMessage>, id: &str) -> Result<Hello, Status> {
    let first = tokio::time::timeout(HELLO_TIMEOUT, inbound.message())
        .await
        .map_err(|_| Status::deadline_exceeded("no hello within 10 s of attaching"))??;
    let Some(AgentMessage {
        msg: Some(agent_message::Msg::Hello(hello)),
    }) = first
    else {
        return Err(Status::invalid_argument(
            "the first message on the agent link must be a hello",
        ));
    };
    if hello.host_id != id {
        tracing::warn!(cert = %id, claimed = %hello.host_id, "agent claimed another host id");
        return Err(Status::permission_denied(format!(
            "hello claims host `{}` but the certificate names agent/{id}",
            hello.host_id
        )));
    }
    Ok(hello)
}

/// Runs one agent connection until it ends; returns why it ended.
async fn session(
    state: &State,
    link: &Arc<Link>,
    mut inbound: Streaming<AgentMessage>,
    last_seen: &std::sync::atomic::AtomicU64,
) -> String {
    let keepalive = state.config.keepalive;
    let welcome = Welcome {
        keepalive_interval_ms: keepalive.as_millis() as u32,
        coordinator_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if !link.send(Msg::Welcome(welcome)).await {
        return "the agent went away before the welcome".into();
    }
    let mut catalogs = state.registry.subscribe();
    let mut shipped = Shipped::default();
    let mut tick = tokio::time::interval(keepalive);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut catalog_changed = true;
    loop {
        if catalog_changed {
            catalog_changed = false;
            let catalog = catalogs.borrow_and_update().clone();
            for update in shipped.updates(&catalog) {
                if !link.send(Msg::Catalog(update)).await {
                    return "the agent went away".into();
                }
            }
        }
        tokio::select! {
            () = state.shutdown.cancelled() => {
                link.send(Msg::Goodbye(Goodbye { reason: "coordinator shutting down".into() })).await;
                return "coordinator shutting down".into();
            }
            () = link.closed.cancelled() => return "replaced by a new connection".into(),
            changed = catalogs.changed() => match changed {
                Ok(()) => catalog_changed = true,
                Err(_) => return "registry stopped".into(),
            },
            _ = tick.tick() => {
                let silent = now_ms().saturating_sub(last_seen.load(Ordering::Relaxed));
                if silent > state.config.lost_after.as_millis() as u64 {
                    return format!("lost: nothing heard for {silent} ms");
                }
                link.send(Msg::Keepalive(Keepalive { sent_unix_ms: now_ms() })).await;
            }
            msg = inbound.message() => match msg {
                Ok(Some(msg)) => {
                    last_seen.store(now_ms(), Ordering::Relaxed);
                    if let Some(reason) = handle(state, link, msg) {
                        return reason;
                    }
                }
                Ok(None) => return "the agent closed the link".into(),
                Err(status) => return format!("link error: {}", status.message()),
            },
        }
    }
}

/// Handles one message from the agent; `Some(reason)` ends the session.
fn handle(state: &State, link: &Link, msg: AgentMessage) -> Option<String> {
    use agent_message::Msg as M;
    match msg.msg {
        Some(M::View(view)) => state.fleet.set_view(&link.host_id, link.generation, view),
        Some(M::Output(CallOutput {
            call_id,
            chunk: Some(chunk),
        })) => link.deliver(call_id, AgentEvent::Output(chunk)),
        Some(M::Finished(f)) => link.deliver(
            f.call_id,
            AgentEvent::Finished(f.result.unwrap_or_default()),
        ),
        Some(M::Goodbye(g)) => return Some(format!("goodbye: {}", g.reason)),
        Some(M::Hello(_)) => return Some("protocol error: a second hello".into()),
        Some(M::Keepalive(_)) | Some(M::Output(_)) | None => {}
    }
    None
}
