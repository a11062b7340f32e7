//! The Tools service: the client API. Handlers decode, check the caller, and call into the fleet.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use tokio::sync::{Semaphore, broadcast, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use toolsrv_meta::MAX_NAME_BYTES;
use toolsrv_proto::limits::MAX_ARGS_BYTES;
use toolsrv_proto::text::printable_line;
use toolsrv_proto::v1::tools_server::Tools;
use toolsrv_proto::v1::{
    ApproveRequest, ApproveResponse, CallEvent, CallRequest, CallResult, CallStatus, CatalogEvent,
    CatalogEventKind, DescribeToolRequest, FanOutEvent, FanOutRequest, FanOutSummary,
    ListApprovalsRequest, ListApprovalsResponse, ListHostsRequest, ListHostsResponse,
    ListToolsRequest, ListToolsResponse, ToolDefinition, ToolStatus, WatchCatalogRequest,
    call_event, fan_out_event,
};
use toolsrv_proto::v1::{
    CloseSessionResponse, FindToolsRequest, FindToolsResponse, GetSessionRequest,
    ListSessionsRequest, ListSessionsResponse, LoadToolRequest, OpenSessionRequest, SessionState,
    UnloadToolRequest,
};
use toolsrv_proto::v1::{
    ListRevocationsRequest, ListRevocationsResponse, RevokeRequest, RevokeResponse,
    UnrevokeRequest, UnrevokeResponse,
};

use crate::State;

use crate::approvals::DecideError;
use crate::audit::{Pending, Record};
use crate::calls::{CallSpec, Event};
use crate::identity::Caller;
use crate::refusal::{self, Refusal};
use crate::replicas;
use crate::revocation;
use crate::selector::Selector;
use crate::session_api;
use crate::views::LIST_PAGE_BYTES;

/// The Tools gRPC service.
#[derive(Debug, Clone)]
pub struct ToolsService {
    pub(crate) state: Arc<State>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A watch stream holding its client's slot (`--max-watches-per-client`) until it is dropped:
/// when it ends, or when the client goes away.
struct Watched<T> {
    inner: BoxStream<T>,
    _slot: Option<crate::quota::Held>,
}

impl<T> Stream for Watched<T> {
    type Item = Result<T, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.get_mut().inner.as_mut().poll_next(cx)
    }
}

impl ToolsService {
    /// A watch stream's slot for `client`; none for a watch relayed by another replica (the
    /// replica the client reached counted it).
    fn watch_slot(
        &self,
        client: &str,
        relayed: bool,
    ) -> Result<Option<crate::quota::Held>, Status> {
        if relayed {
            return Ok(None);
        }
        self.state
            .quotas
            .watch(client)
            .map(Some)
            .map_err(Status::resource_exhausted)
    }
}

/// `inner` holding `slot` for as long as it is open.
fn watched<T: Send + 'static>(
    inner: BoxStream<T>,
    slot: Option<crate::quota::Held>,
) -> BoxStream<T> {
    Box::pin(Watched { inner, _slot: slot })
}

/// Longest working directory a call may name (Linux's PATH_MAX).
const MAX_CWD_BYTES: usize = 4096;
/// Longest host selector a fan-out may give.
const MAX_SELECTOR_BYTES: usize = 4096;

/// Refuses a request field longer than `max` bytes, naming the field and the limit.
fn bounded(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes, over the limit of {max} bytes",
            value.len()
        )));
    }
    Ok(())
}

/// Checks what a call asks for against the coordinator's limits (sizes, timeout), checks the
/// arguments are a JSON object, and fingerprints them for the audit log.
fn call_spec(
    state: &State,
    client: String,
    tool: String,
    args_json: String,
    cwd: String,
    timeout_ms: u64,
) -> Result<CallSpec, Status> {
    if args_json.len() > MAX_ARGS_BYTES {
        return Err(Status::invalid_argument(format!(
            "args_json is {} bytes, over the limit of {} bytes (1 MiB); pass large inputs as \
             files on the host instead",
            args_json.len(),
            MAX_ARGS_BYTES
        )));
    }
    bounded("the tool name", &tool, MAX_NAME_BYTES)?;
    bounded("cwd", &cwd, MAX_CWD_BYTES)?;
    if !cwd.is_empty() && !cwd.starts_with('/') {
        return Err(Status::invalid_argument(format!(
            "cwd {cwd:?} is not an absolute path: a working directory on a host is named from \
             its root (/srv/app)"
        )));
    }
    let max_timeout = state.quotas.limits.max_call_timeout;
    if u128::from(timeout_ms) > max_timeout.as_millis() {
        return Err(Status::invalid_argument(format!(
            "a timeout of {} s is over this coordinator's maximum of {} s (--max-call-timeout-secs)",
            timeout_ms / 1000,
            max_timeout.as_secs()
        )));
    }
    let args_json = if args_json.trim().is_empty() {
        "{}".to_string()
    } else {
        args_json
    };
    // Read without building anything: a JSON tree takes tens of times its text.
    toolsrv_meta::check_args_json(&args_json)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let args_sha256 = toolsrv_registry::hex_sha256(args_json.as_bytes());
    Ok(CallSpec {
        client,
        tool,
        args_json,
        args_sha256,
        cwd,
        timeout_ms,
        fanout: None,
    })
}

#[tonic::async_trait]
impl Tools for ToolsService {
    type CallStream = BoxStream<CallEvent>;
    type FanOutStream = BoxStream<FanOutEvent>;
    type WatchCatalogStream = BoxStream<CatalogEvent>;
    type WatchSessionStream = BoxStream<SessionState>;

    async fn list_hosts(
        &self,
        req: Request<ListHostsRequest>,
    ) -> Result<Response<ListHostsResponse>, Status> {
        Caller::client(&req)?;
        let req = req.into_inner();
        bounded("the page token", &req.page_token, toolsrv_tls::MAX_NAME_LEN)?;
        let (hosts, next_page_token) = match &self.state.replicas {
            Some(replicas) => page(replicas.hosts(&self.state), &req.page_token),
            None => self.state.fleet.page(&req.page_token, LIST_PAGE_BYTES),
        };
        Ok(Response::new(ListHostsResponse {
            hosts,
            next_page_token,
        }))
    }

    async fn list_tools(
        &self,
        req: Request<ListToolsRequest>,
    ) -> Result<Response<ListToolsResponse>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let mut req = req.into_inner();
        bounded("the host id", &req.host, toolsrv_tls::MAX_NAME_LEN)?;
        req.host = toolsrv_tls::normalize_name(&req.host);
        if let (Some(record), Some(replicas)) = (
            replicas::route_elsewhere(&self.state, &req.host, relayed),
            &self.state.replicas,
        ) {
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            return tools.list_tools(request).await;
        }
        let host = refusal::online_host(&self.state, &req.host, |h| h.synced)
            .await
            .map_err(Refusal::grpc)?;
        let view = host.view.clone().unwrap_or_default();
        // Tools of the catalog whose files are invalid are listed too, hidden with the reason,
        // unless the host has a tool of that name of its own.
        let invalid: Vec<ToolStatus> = if req.include_hidden {
            let catalog = self.state.registry.catalog();
            catalog
                .invalid
                .iter()
                .filter(|(name, _)| view.tool(name).is_none())
                .map(|(name, invalid)| ToolStatus {
                    name: name.clone(),
                    visible: false,
                    reason: invalid.reason(),
                    ..ToolStatus::default()
                })
                .collect()
        } else {
            Vec::new()
        };
        // Each visible tool says what a call of it by this client would meet, as a call made
        // now would be judged.
        let policy = self.state.policy.now();
        let facts = host.policy_facts();
        let (tools, next_page_token) = view.page(
            req.include_hidden,
            &req.page_token,
            LIST_PAGE_BYTES,
            &invalid,
            |status| {
                if status.visible {
                    status.policy = Some(policy.answer(&client, &status.name, &facts));
                }
            },
        );
        Ok(Response::new(ListToolsResponse {
            host: req.host,
            catalog_revision: view.catalog_revision,
            tools,
            next_page_token,
        }))
    }

    async fn describe_tool(
        &self,
        req: Request<DescribeToolRequest>,
    ) -> Result<Response<ToolDefinition>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let mut req = req.into_inner();
        // Both end up in error messages: bounded, so no request can grow a response header.
        bounded("the host id", &req.host, toolsrv_tls::MAX_NAME_LEN)?;
        bounded("the tool name", &req.tool, MAX_NAME_BYTES)?;
        req.host = toolsrv_tls::normalize_name(&req.host);
        if let (Some(record), Some(replicas)) = (
            replicas::route_elsewhere(&self.state, &req.host, relayed),
            &self.state.replicas,
        ) {
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            return tools.describe_tool(request).await;
        }
        let state = &self.state;
        let host =
            refusal::online_host(state, &req.host, |h| refusal::settled(state, h, &req.tool))
                .await
                .map_err(Refusal::grpc)?;
        let tool = refusal::visible_tool(state, &host, &req.tool).map_err(Refusal::grpc)?;
        let mut response = Response::new(tool.definition.as_deref().cloned().unwrap_or_default());
        let answer = state
            .policy
            .now()
            .answer(&client, &req.tool, &host.policy_facts());
        response.metadata_mut().insert_bin(
            toolsrv_proto::CALLER_POLICY_METADATA,
            tonic::metadata::MetadataValue::from_bytes(&prost::Message::encode_to_vec(&answer)),
        );
        if tool.host_only {
            response.metadata_mut().insert(
                toolsrv_proto::HOST_ONLY_METADATA,
                tonic::metadata::MetadataValue::from_static("true"),
            );
        }
        Ok(response)
    }

    async fn call(&self, req: Request<CallRequest>) -> Result<Response<Self::CallStream>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let mut req = req.into_inner();
        req.host = toolsrv_tls::normalize_name(&req.host);
        let state = self.state.clone();
        let refuse = |status: Status| {
            state.audit.refused(&client, &req.host, &req.tool, &status);
            status
        };
        // Counted before the drain check: a drain that begins after the check waits for it.
        let running = state.in_flight.token();
        draining(&state).map_err(refuse)?;
        audit_writable(&state).map_err(refuse)?;
        bounded("the host id", &req.host, toolsrv_tls::MAX_NAME_LEN).map_err(refuse)?;
        if !req.session.is_empty() {
            session_api::touch(&state, &client, &req.session, &req.tool).map_err(refuse)?;
        }
        let spec = call_spec(
            &state,
            client.clone(),
            req.tool.clone(),
            req.args_json,
            req.cwd,
            req.timeout_ms,
        )
        .map_err(refuse)?;
        let slot = state
            .quotas
            .call(&client, &req.host, false)
            .map_err(|e| refuse(Status::resource_exhausted(e)))?;
        let (tx, rx) = mpsc::channel(16);
        let host = req.host;
        self.state.tasks.spawn(async move {
            let _running = running;
            let emit = |event: Event| {
                let tx = tx.clone();
                async move {
                    let event = match event {
                        Event::Output(chunk) => call_event::Event::Output(chunk),
                        Event::Result(result) => call_event::Event::Result(result),
                        Event::Approval(request) => call_event::Event::Approval(request),
                    };
                    tx.send(Ok(CallEvent { event: Some(event) })).await.is_ok()
                }
            };
            tokio::select! {
                _ = replicas::run_call(&state, &host, &spec, Some(slot), relayed, emit) => {}
                // The client went away while the tool was quiet: dropping the call cancels it
                // (and its audit record says so).
                () = tx.closed() => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fan_out(
        &self,
        req: Request<FanOutRequest>,
    ) -> Result<Response<Self::FanOutStream>, Status> {
        let client = Caller::client(&req)?;
        let req = req.into_inner();
        let state = self.state.clone();
        let refuse = |status: Status| {
            state
                .audit
                .refused(&client, &req.selector, &req.tool, &status);
            status
        };
        let running = state.in_flight.token();
        draining(&state).map_err(refuse)?;
        audit_writable(&state).map_err(refuse)?;
        bounded("the selector", &req.selector, MAX_SELECTOR_BYTES).map_err(refuse)?;
        let selector = Selector::parse(&req.selector)
            .map_err(|e| refuse(Status::invalid_argument(e.to_string())))?;
        let mut spec = call_spec(
            &state,
            client.clone(),
            req.tool.clone(),
            req.args_json.clone(),
            req.cwd.clone(),
            req.timeout_ms,
        )
        .map_err(refuse)?;
        let targets = targets(&state, &selector);
        let width = state.quotas.limits.fanout_hosts;
        if targets.len() > width {
            return Err(refuse(Status::resource_exhausted(format!(
                "the selector picks {} hosts, over this coordinator's limit of {width} hosts per \
                 fan-out (--max-fanout-hosts); narrow the selector or split the fan-out",
                targets.len()
            ))));
        }
        let wanted = match req.concurrency {
            0 => targets.len(),
            n => n as usize,
        };
        let reservation = state
            .quotas
            .reserve(&client, wanted.min(targets.len()).max(1))
            .map_err(|e| refuse(Status::resource_exhausted(e)))?;
        if targets.is_empty() {
            // Answered with an empty fan-out (the client says no host matched), and on the
            // record, once, like any request that reached no host.
            state.audit.refused(
                &client,
                &req.selector,
                &req.tool,
                &Status::not_found("the selector matches no host"),
            );
        }
        spec.fanout = Some(format!("{:016x}", rand_id()));
        let (tx, rx) = mpsc::channel(64);
        let max_errors = req.max_errors;
        self.state.tasks.spawn(async move {
            let _running = running;
            let concurrency = reservation.slots;
            tokio::select! {
                () = fan_out(state, targets, spec, (concurrency, max_errors), tx.clone()) => {}
                () = tx.closed() => {}
            }
            drop(reservation);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn list_approvals(
        &self,
        req: Request<ListApprovalsRequest>,
    ) -> Result<Response<ListApprovalsResponse>, Status> {
        let client = Caller::client(&req)?;
        if !req.get_ref().id.is_empty() {
            bounded("the request id", &req.get_ref().id, 64)?;
            let id = req.get_ref().id.clone();
            let relayed = replicas::is_relayed(&req);
            return match self.state.approvals.whole(&id, &client) {
                Ok(request) => Ok(Response::new(ListApprovalsResponse {
                    requests: vec![request],
                })),
                // A relayed call waits for its approval on the replica that runs it.
                Err(e @ DecideError::NotFound(_)) => match &self.state.replicas {
                    Some(replicas) if !relayed => {
                        match replicas.approval_elsewhere(&client, &id).await? {
                            Some(request) => Ok(Response::new(ListApprovalsResponse {
                                requests: vec![request],
                            })),
                            None => Err(Status::not_found(e.to_string())),
                        }
                    }
                    _ => Err(Status::not_found(e.to_string())),
                },
                Err(e @ DecideError::NotAllowed { .. }) => {
                    Err(Status::permission_denied(e.to_string()))
                }
            };
        }
        let mut requests = self.state.approvals.decidable_by(&client);
        // Through any replica, the requests waiting on every replica.
        if let Some(replicas) = &self.state.replicas
            && !replicas::is_relayed(&req)
        {
            requests.extend(replicas.remote_approvals(&client).await);
            requests.sort_by_key(|r| r.expires_unix_ms);
        }
        Ok(Response::new(ListApprovalsResponse { requests }))
    }

    async fn approve(
        &self,
        req: Request<ApproveRequest>,
    ) -> Result<Response<ApproveResponse>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let req = req.into_inner();
        bounded("the request id", &req.id, 64)?;
        bounded("the reason", &req.reason, 1024)?;
        if req.id.is_empty() {
            return Err(Status::invalid_argument(
                "the request id is empty: give one that `toolctl approvals` lists",
            ));
        }
        // No call is let run that the audit log cannot record: the request keeps waiting, to be
        // approved once the log is written again (this refusal's record is its next try).
        if req.approve
            && let Some(request) = self.state.approvals.get(&req.id)
            && let Err(why) = audit_writable(&self.state)
        {
            self.state.audit.approval_refused(&client, &request, &why);
            return Err(why);
        }
        match self
            .state
            .approvals
            .decide(&req.id, &client, req.approve, &req.reason)
        {
            Ok(_) => Ok(Response::new(ApproveResponse {})),
            // A relayed call waits for its approval on the replica that runs it.
            Err(e @ DecideError::NotFound(_)) => match &self.state.replicas {
                Some(replicas) if !relayed => {
                    if replicas.approve_elsewhere(&client, &req).await? {
                        Ok(Response::new(ApproveResponse {}))
                    } else {
                        Err(Status::not_found(e.to_string()))
                    }
                }
                _ => Err(Status::not_found(e.to_string())),
            },
            Err(e @ DecideError::NotAllowed { .. }) => {
                let status = Status::permission_denied(e.to_string());
                if let DecideError::NotAllowed { request, .. } = &e {
                    // Someone tried to decide what is not theirs to decide: on the record.
                    tracing::warn!(client = %printable_line(&client, 256), request = %printable_line(&request.id, 64), "refused a decision on an approval request: {}", printable_line(status.message(), 1024));
                    self.state.audit.approval_refused(&client, request, &status);
                }
                Err(status)
            }
        }
    }

    async fn watch_catalog(
        &self,
        req: Request<WatchCatalogRequest>,
    ) -> Result<Response<Self::WatchCatalogStream>, Status> {
        let client = Caller::client(&req)?;
        // Through any replica, the whole fleet's events; a replica watching another gets only
        // the hosts it holds.
        let relayed = crate::replicas::is_relayed(&req);
        let slot = self.watch_slot(&client, relayed)?;
        let mut events = self.state.fleet.subscribe();
        let mut remote = match &self.state.replicas {
            Some(replicas) if !relayed => Some(replicas.remote_events()),
            _ => None,
        };
        let (tx, rx) = mpsc::channel(64);
        let state = self.state.clone();
        self.state.tasks.spawn(async move {
            let snapshot = |s: &State| CatalogEvent {
                kind: CatalogEventKind::Snapshot as i32,
                revision: s.fleet.revision(),
                ..CatalogEvent::default()
            };
            if tx.send(Ok(snapshot(&state))).await.is_err() {
                return;
            }
            // Another replica watching this one: the view of every host held here first.
            if relayed {
                for id in state.fleet.ids() {
                    let Some(host) = state.fleet.get(&id).filter(|h| h.online()) else {
                        continue;
                    };
                    let info = host.info();
                    let event = CatalogEvent {
                        kind: CatalogEventKind::HostView as i32,
                        revision: state.fleet.revision(),
                        host: id,
                        view_revision: info.view_revision,
                        visible_tools: info.visible_tools,
                        ..CatalogEvent::default()
                    };
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
            }
            loop {
                let event = tokio::select! {
                    () = tx.closed() => return,
                    () = state.shutdown.cancelled() => return,
                    event = events.recv() => match event {
                        Ok(event) if remote.is_some() && state.replicas.as_ref().is_some_and(|r| r.hides_local(&event)) => continue,
                        Ok(event) => event,
                        // Missed events: a fresh snapshot tells the client to refresh everything.
                        Err(broadcast::error::RecvError::Lagged(_)) => snapshot(&state),
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    event = async {
                        match remote.as_mut() {
                            Some(remote) => remote.recv().await,
                            None => std::future::pending().await,
                        }
                    }, if remote.is_some() => match event {
                        Ok(event) => event,
                        Err(broadcast::error::RecvError::Lagged(_)) => snapshot(&state),
                        Err(broadcast::error::RecvError::Closed) => {
                            remote = None;
                            continue;
                        }
                    },
                };
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(watched(
            Box::pin(ReceiverStream::new(rx)),
            slot,
        )))
    }

    async fn find_tools(
        &self,
        req: Request<FindToolsRequest>,
    ) -> Result<Response<FindToolsResponse>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let req = req.into_inner();
        let started = Instant::now();
        let found = crate::finder::find(&self.state, &client, req.clone()).await;
        self.state.metrics.find(
            found
                .as_ref()
                .map(|f| f.matches.len())
                .map_err(Status::code),
            started.elapsed(),
        );
        let found = found?;
        // Through any replica, the tools of every replica's hosts.
        let found = match &self.state.replicas {
            Some(replicas) if !relayed => {
                let others = replicas.remote_matches(&client, &req).await;
                crate::finder::merge(found, others, crate::finder::limit_of(&req)?)
            }
            _ => found,
        };
        Ok(Response::new(found))
    }

    async fn open_session(
        &self,
        req: Request<OpenSessionRequest>,
    ) -> Result<Response<SessionState>, Status> {
        let client = Caller::client(&req)?;
        session_api::open(&self.state, &client, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn load_tool(
        &self,
        req: Request<LoadToolRequest>,
    ) -> Result<Response<SessionState>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let req = req.into_inner();
        if let Some((replicas, record)) =
            replicas::session_elsewhere(&self.state, &req.session, relayed)?
        {
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            return tools.load_tool(request).await;
        }
        session_api::load(&self.state, &client, req)
            .await
            .map(Response::new)
    }

    async fn unload_tool(
        &self,
        req: Request<UnloadToolRequest>,
    ) -> Result<Response<SessionState>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let req = req.into_inner();
        if let Some((replicas, record)) =
            replicas::session_elsewhere(&self.state, &req.session, relayed)?
        {
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            return tools.unload_tool(request).await;
        }
        session_api::unload(&self.state, &client, req)
            .await
            .map(Response::new)
    }

    async fn get_session(
        &self,
        req: Request<GetSessionRequest>,
    ) -> Result<Response<SessionState>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let req = req.into_inner();
        if let Some((replicas, record)) =
            replicas::session_elsewhere(&self.state, &req.session, relayed)?
        {
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            return tools.get_session(request).await;
        }
        session_api::get(&self.state, &client, &req.session)
            .await
            .map(Response::new)
    }

    async fn watch_session(
        &self,
        req: Request<GetSessionRequest>,
    ) -> Result<Response<Self::WatchSessionStream>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let slot = self.watch_slot(&client, relayed)?;
        let req = req.into_inner();
        if let Some((replicas, record)) =
            replicas::session_elsewhere(&self.state, &req.session, relayed)?
        {
            // The replica keeping the session streams its states; dropping this stream (the
            // client went away) ends the relayed watch with it.
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            let stream = tools.watch_session(request).await?.into_inner();
            return Ok(Response::new(watched(Box::pin(stream), slot)));
        }
        let rx = session_api::watch(&self.state, &client, &req.session)?;
        Ok(Response::new(watched(
            Box::pin(ReceiverStream::new(rx)),
            slot,
        )))
    }

    async fn close_session(
        &self,
        req: Request<GetSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, Status> {
        let client = Caller::client(&req)?;
        let relayed = replicas::is_relayed(&req);
        let req = req.into_inner();
        if let Some((replicas, record)) =
            replicas::session_elsewhere(&self.state, &req.session, relayed)?
        {
            let (mut tools, request) = replicas.relay(&record, &client, req)?;
            return tools.close_session(request).await;
        }
        session_api::close(&self.state, &client, &req.session)?;
        Ok(Response::new(CloseSessionResponse {}))
    }

    async fn list_sessions(
        &self,
        req: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let client = Caller::client(&req)?;
        let mut sessions = session_api::list(&self.state, &client).await;
        // Through any replica, the caller's sessions on every replica.
        if let Some(replicas) = &self.state.replicas
            && !replicas::is_relayed(&req)
        {
            sessions.extend(replicas.remote_sessions(&client).await);
        }
        sessions.sort_by(|a, b| a.id.cmp(&b.id));
        crate::sessions::fit_list(&mut sessions, crate::sessions::MAX_LIST_BYTES);
        Ok(Response::new(ListSessionsResponse { sessions }))
    }

    async fn revoke(
        &self,
        req: Request<RevokeRequest>,
    ) -> Result<Response<RevokeResponse>, Status> {
        revocation::revoke_shared(&self.state, req)
            .await
            .map(Response::new)
    }

    async fn unrevoke(
        &self,
        req: Request<UnrevokeRequest>,
    ) -> Result<Response<UnrevokeResponse>, Status> {
        revocation::unrevoke_shared(&self.state, req)
            .await
            .map(Response::new)
    }

    async fn list_revocations(
        &self,
        req: Request<ListRevocationsRequest>,
    ) -> Result<Response<ListRevocationsResponse>, Status> {
        revocation::list_rpc(&self.state, &req).map(Response::new)
    }
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

/// The hosts a fan-out targets, sorted: those the selector picks, and hosts it names outright
/// that never connected (reported as unknown rather than dropped).
fn targets(state: &State, selector: &Selector) -> Vec<String> {
    // Hosts offline here stay targets (reported offline, or routed to the replica that holds
    // them now).
    let mut targets: Vec<String> = state
        .fleet
        .select(selector)
        .into_iter()
        .map(|h| h.id)
        .collect();
    if let Some(replicas) = &state.replicas {
        // Hosts held by other replicas, from the routing table; and those they held that have
        // no link now, reported (offline, reconnecting, or reached through the replica that
        // held them) rather than left out.
        targets.extend(
            replicas
                .select_remote(selector)
                .into_iter()
                .map(|(id, _)| id),
        );
        targets.extend(replicas.select_gone(selector));
    }
    for exact in selector.exact_hosts() {
        if !targets.iter().any(|t| t == exact) && state.fleet.get(exact).is_none() {
            targets.push(exact.to_string());
        }
    }
    targets.sort();
    targets.dedup();
    targets
}

/// Runs one fan-out: a result for every targeted host, then the summary. `concurrency` is
/// the number of the client's call slots the fan-out holds.
async fn fan_out(
    state: Arc<State>,
    targets: Vec<String>,
    spec: CallSpec,
    (concurrency, max_errors): (usize, u32),
    tx: mpsc::Sender<Result<FanOutEvent, Status>>,
) {
    let started = Instant::now();
    state.metrics.fanout(targets.len());
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let failed = Arc::new(AtomicU32::new(0));
    let ok = Arc::new(AtomicU32::new(0));
    let spec = Arc::new(spec);
    let mut hosts = tokio::task::JoinSet::new();
    let targeted = targets.len() as u32;
    for host in targets {
        let (state, tx, permits, failed, ok, spec) = (
            state.clone(),
            tx.clone(),
            permits.clone(),
            failed.clone(),
            ok.clone(),
            spec.clone(),
        );
        hosts.spawn(async move {
            // Every targeted host is audited: one the fan-out never reached (its caller went
            // away first) as not started, a skipped one as skipped.
            let record = Record {
                client: &spec.client,
                host: &host,
                tool: &spec.tool,
                args_sha256: &spec.args_sha256,
                fanout: spec.fanout.as_deref(),
            };
            let unstarted = Pending::not_started(&state.audit, record);
            let Ok(_permit) = permits.acquire_owned().await else {
                return;
            };
            // The caller went away while this host waited its turn (the tasks are being
            // aborted, and a host's slot freed by another's abort must not start it).
            if tx.is_closed() {
                return;
            }
            let result = if max_errors > 0 && failed.load(Ordering::Relaxed) > max_errors {
                let result = CallResult::not_run(
                    CallStatus::Skipped,
                    format!(
                        "not started: more than {max_errors} {} failed",
                        if max_errors == 1 { "host" } else { "hosts" }
                    ),
                );
                unstarted.finish(&result);
                state.metrics.call(true).finish(&result);
                let _ = tx
                    .send(Ok(host_event(
                        &host,
                        fan_out_event::Event::Result(result.clone()),
                    )))
                    .await;
                result
            } else {
                let emit = |event: Event| {
                    let (tx, host) = (tx.clone(), host.clone());
                    async move {
                        let event = match event {
                            Event::Output(chunk) => fan_out_event::Event::Output(chunk),
                            Event::Result(result) => fan_out_event::Event::Result(result),
                            Event::Approval(request) => fan_out_event::Event::Approval(request),
                        };
                        tx.send(Ok(host_event(&host, event))).await.is_ok()
                    }
                };
                unstarted.hand_over();
                replicas::run_call(&state, &host, &spec, None, false, emit).await
            };
            let counter = if result.status == CallStatus::Ok as i32 {
                &ok
            } else {
                &failed
            };
            counter.fetch_add(1, Ordering::Relaxed);
        });
    }
    while hosts.join_next().await.is_some() {}
    let summary = FanOutSummary {
        targeted,
        ok: ok.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        duration_ms: started.elapsed().as_millis() as u64,
    };
    let _ = tx
        .send(Ok(FanOutEvent {
            host: String::new(),
            event: Some(fan_out_event::Event::Summary(summary)),
        }))
        .await;
}

/// Refuses a new call or fan-out once the coordinator drains: clients retry, here once it is
/// back or on another coordinator.
fn draining(state: &State) -> Result<(), Status> {
    if state.draining.is_cancelled() {
        return Err(Status::unavailable(
            "the coordinator is shutting down and takes no new calls: retry in a few seconds \
             (calls already running finish)",
        ));
    }
    Ok(())
}

/// Refuses a new call or fan-out while the audit log cannot be written ([`crate::audit`]).
fn audit_writable(state: &State) -> Result<(), Status> {
    state.audit.writable().map_err(Status::unavailable)
}

fn host_event(host: &str, event: fan_out_event::Event) -> FanOutEvent {
    FanOutEvent {
        host: host.to_string(),
        event: Some(event),
    }
}

/// One page of `hosts` (sorted by id): those after `after`, within the page budget; the token of
/// the next page, empty at the end.
fn page(
    hosts: Vec<toolsrv_proto::v1::HostInfo>,
    after: &str,
) -> (Vec<toolsrv_proto::v1::HostInfo>, String) {
    use prost::Message;
    let mut page = Vec::new();
    let mut bytes = 0;
    for host in hosts
        .into_iter()
        .filter(|h| after.is_empty() || h.host_id.as_str() > after)
    {
        let size = host.encoded_len() + 8;
        if !page.is_empty() && bytes + size > LIST_PAGE_BYTES {
            let next = page
                .last()
                .map(|h: &toolsrv_proto::v1::HostInfo| h.host_id.clone())
                .unwrap_or_default();
            return (page, next);
        }
        bytes += size;
        page.push(host);
    }
    (page, String::new())
}
