//! The Tools service: the client API. Handlers decode, check the caller, and call into the fleet.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, broadcast, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use toolsrv_proto::limits::MAX_ARGS_BYTES;
use toolsrv_proto::v1::tools_server::Tools;
use toolsrv_proto::v1::{
    CallEvent, CallRequest, CallStatus, CatalogEvent, CatalogEventKind, DescribeToolRequest,
    FanOutEvent, FanOutRequest, FanOutSummary, ListHostsRequest, ListHostsResponse,
    ListToolsRequest, ListToolsResponse, ToolDefinition, WatchCatalogRequest, call_event,
    fan_out_event,
};

use crate::State;
use crate::calls::{self, CallSpec, Event};
use crate::link::status;
use crate::selector::Selector;
use crate::views::LIST_PAGE_BYTES;

/// The Tools gRPC service.
#[derive(Debug, Clone)]
pub struct ToolsService {
    pub(crate) state: Arc<State>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The client name proven by the peer's certificate.
fn client_identity<T>(req: &Request<T>) -> Result<String, Status> {
    crate::proven_name(
        toolsrv_tls::peer_of(req),
        toolsrv_tls::Role::Client,
        "the client API needs a client certificate (toolsrv://client/<name>)",
    )
}

/// Checks the arguments are a JSON object and fingerprints them for the audit log.
fn call_spec(
    client: String,
    tool: String,
    args_json: String,
    cwd: String,
    timeout_ms: u64,
) -> Result<CallSpec, Status> {
    if args_json.len() > MAX_ARGS_BYTES {
        return Err(Status::invalid_argument(format!(
            "args_json is {} bytes, above the limit of {MAX_ARGS_BYTES} bytes (1 MiB); pass large inputs as files the tool reads",
            args_json.len()
        )));
    }
    let args_json = if args_json.trim().is_empty() {
        "{}".to_string()
    } else {
        args_json
    };
    match serde_json::from_str::<serde_json::Value>(&args_json) {
        Ok(v) if v.is_object() => {}
        Ok(_) => return Err(Status::invalid_argument("args_json must be a JSON object")),
        Err(e) => {
            return Err(Status::invalid_argument(format!(
                "args_json is not valid JSON: {e}"
            )));
        }
    }
    let args_sha256 = Sha256::digest(args_json.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
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

    async fn list_hosts(
        &self,
        req: Request<ListHostsRequest>,
    ) -> Result<Response<ListHostsResponse>, Status> {
        client_identity(&req)?;
        let hosts = self.state.fleet.hosts().iter().map(|h| h.info()).collect();
        Ok(Response::new(ListHostsResponse { hosts }))
    }

    async fn list_tools(
        &self,
        req: Request<ListToolsRequest>,
    ) -> Result<Response<ListToolsResponse>, Status> {
        client_identity(&req)?;
        let req = req.into_inner();
        let host = self.host(&req.host)?;
        let view = host.view.clone().unwrap_or_default();
        let (tools, next_page_token) =
            view.page(req.include_hidden, &req.page_token, LIST_PAGE_BYTES);
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
        client_identity(&req)?;
        let req = req.into_inner();
        let host = self.host(&req.host)?;
        match host.tool(&req.tool) {
            Some(t) if t.visible => Ok(Response::new(
                t.definition.as_deref().cloned().unwrap_or_default(),
            )),
            Some(t) => Err(Status::failed_precondition(format!(
                "tool `{}` is hidden on host `{}`: {}",
                req.tool, req.host, t.reason
            ))),
            None => Err(Status::not_found(format!(
                "host `{}` has no tool `{}`",
                req.host, req.tool
            ))),
        }
    }

    async fn call(&self, req: Request<CallRequest>) -> Result<Response<Self::CallStream>, Status> {
        let client = client_identity(&req)?;
        let req = req.into_inner();
        let spec = call_spec(client, req.tool, req.args_json, req.cwd, req.timeout_ms)?;
        let (tx, rx) = mpsc::channel(16);
        let state = self.state.clone();
        self.state.tasks.spawn(async move {
            let emit = |event: Event| {
                let tx = tx.clone();
                async move {
                    let event = match event {
                        Event::Output(chunk) => call_event::Event::Output(chunk),
                        Event::Result(result) => call_event::Event::Result(result),
                    };
                    tx.send(Ok(CallEvent { event: Some(event) })).await.is_ok()
                }
            };
            tokio::select! {
                _ = calls::run(&state, &req.host, &spec, emit) => {}
                // The client went away while the tool was quiet: dropping the call cancels it.
                () = tx.closed() => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fan_out(
        &self,
        req: Request<FanOutRequest>,
    ) -> Result<Response<Self::FanOutStream>, Status> {
        let client = client_identity(&req)?;
        let req = req.into_inner();
        let selector = Selector::parse(&req.selector).map_err(Status::invalid_argument)?;
        let mut spec = call_spec(client, req.tool, req.args_json, req.cwd, req.timeout_ms)?;
        spec.fanout = Some(format!("{:016x}", rand_id()));
        let (tx, rx) = mpsc::channel(64);
        let state = self.state.clone();
        let limits = (req.concurrency, req.max_errors);
        self.state.tasks.spawn(async move {
            tokio::select! {
                () = fan_out(state, selector, spec, limits, tx.clone()) => {}
                () = tx.closed() => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn watch_catalog(
        &self,
        req: Request<WatchCatalogRequest>,
    ) -> Result<Response<Self::WatchCatalogStream>, Status> {
        client_identity(&req)?;
        let mut events = self.state.fleet.subscribe();
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
            loop {
                let event = tokio::select! {
                    () = tx.closed() => return,
                    () = state.shutdown.cancelled() => return,
                    event = events.recv() => match event {
                        Ok(event) => event,
                        // Missed events: a fresh snapshot tells the client to refresh everything.
                        Err(broadcast::error::RecvError::Lagged(_)) => snapshot(&state),
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                };
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl ToolsService {
    fn host(&self, id: &str) -> Result<crate::fleet::HostEntry, Status> {
        let host = self
            .state
            .fleet
            .get(id)
            .ok_or_else(|| Status::not_found(format!("unknown host `{id}`")))?;
        if !host.online() {
            return Err(Status::unavailable(format!("host `{id}` is offline")));
        }
        Ok(host)
    }
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

/// Runs one fan-out: a result for every targeted host, then the summary.
async fn fan_out(
    state: Arc<State>,
    selector: Selector,
    spec: CallSpec,
    (concurrency, max_errors): (u32, u32),
    tx: mpsc::Sender<Result<FanOutEvent, Status>>,
) {
    let started = Instant::now();
    let mut targets: Vec<String> = state
        .fleet
        .select(&selector)
        .into_iter()
        .map(|h| h.id)
        .collect();
    for exact in selector.exact_hosts() {
        if !targets.iter().any(|t| t == exact) && state.fleet.get(exact).is_none() {
            // Named outright but never seen: report it rather than drop it.
            targets.push(exact.to_string());
        }
    }
    targets.sort();
    targets.dedup();
    let permits = Arc::new(Semaphore::new(if concurrency == 0 {
        Semaphore::MAX_PERMITS
    } else {
        concurrency as usize
    }));
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
            let Ok(_permit) = permits.acquire_owned().await else {
                return;
            };
            let result = if max_errors > 0 && failed.load(Ordering::Relaxed) > max_errors {
                let result = status(
                    CallStatus::Skipped,
                    format!("not started: more than {max_errors} hosts failed"),
                );
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
                        };
                        tx.send(Ok(host_event(&host, event))).await.is_ok()
                    }
                };
                calls::run(&state, &host, &spec, emit).await
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

fn host_event(host: &str, event: fan_out_event::Event) -> FanOutEvent {
    FanOutEvent {
        host: host.to_string(),
        event: Some(event),
    }
}
