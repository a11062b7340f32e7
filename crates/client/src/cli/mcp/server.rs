//! The MCP server handler: lists the session's tools and the server's own, dispatches calls,
//! and tells clients when the tool list changes (unprompted to 2025-11-25 clients, on a
//! `subscriptions/listen` stream to 2026-07-28 ones).

use std::borrow::Cow;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CustomRequest, CustomResult, Implementation,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ProtocolVersion, ServerCapabilities,
    SubscriptionFilter, Tool,
};
use rmcp::service::{NotificationContext, Peer, RequestContext, SubscriptionContext};
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use tokio::sync::watch;

use super::call::{Calls, can_ask, error};
use super::own;
use super::tools::{Catalog, HOST_ARG, LOAD, Route, SEARCH, own_tools};
use crate::cli::quote::quoted;

/// The revisions served: the newest, and the one before for clients that still use the
/// `initialize` handshake.
const VERSIONS: &[ProtocolVersion] =
    &[ProtocolVersion::V_2026_07_28, ProtocolVersion::V_2025_11_25];

/// One handler per MCP connection (per session or request over HTTP, each made by
/// [`Server::for_connection`]); clones share everything.
#[derive(Debug, Clone)]
pub struct Server {
    calls: Calls,
    catalog: watch::Sender<Arc<Catalog>>,
    own: Arc<Vec<Tool>>,
    /// Whether this connection's client has its `list_changed` forwarded already: a client
    /// that sends `initialized` again gets no second forwarder (100,000 of them held 200 MB
    /// and sent each change 100,000 times).
    forwarding: Arc<std::sync::atomic::AtomicBool>,
}

impl Server {
    pub fn new(calls: Calls, catalog: watch::Sender<Arc<Catalog>>) -> Self {
        Self {
            calls,
            catalog,
            own: Arc::new(own_tools()),
            forwarding: Arc::default(),
        }
    }

    /// The handler of a new connection: everything shared but what is the connection's own.
    pub fn for_connection(&self) -> Self {
        Self {
            forwarding: Arc::default(),
            ..self.clone()
        }
    }

    fn current(&self) -> Arc<Catalog> {
        self.catalog.borrow().clone()
    }
}

/// Tells a 2025-11-25 client of every change of the tool list until it goes away.
async fn forward_changes(peer: Peer<RoleServer>, mut changes: watch::Receiver<Arc<Catalog>>) {
    while changes.changed().await.is_ok() {
        if peer.is_transport_closed() || peer.notify_tool_list_changed().await.is_err() {
            return;
        }
    }
}

impl ServerHandler for Server {
    fn get_info(&self) -> InitializeResult {
        let capabilities = ServerCapabilities::builder()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        let mut info = InitializeResult::new(capabilities).with_instructions(format!(
            "Tools of a toolsrv session: each runs on a host of the fleet. Find more with \
             {SEARCH} and load them with {LOAD}. When the session has several hosts, every \
             fleet tool takes a `{HOST_ARG}` argument naming the host to run on."
        ));
        info.server_info = Implementation::new("toolsrv", env!("CARGO_PKG_VERSION"));
        info
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(VERSIONS)
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        // Only clients of the handshake revisions send `initialized`: they get `list_changed`
        // unprompted, 2026-07-28 clients through `listen`.
        if self
            .forwarding
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let changes = self.catalog.subscribe();
        self.calls
            .tasks
            .spawn(forward_changes(context.peer, changes));
    }

    fn accepted_subscription_filter(
        &self,
        _requested: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        Some(SubscriptionFilter::builder().tools_list_changed().build())
    }

    async fn listen(&self, subscription: SubscriptionContext) -> Result<(), McpError> {
        let mut changes = self.catalog.subscribe();
        let wanted = subscription.accepted().tools_list_changed == Some(true);
        loop {
            tokio::select! {
                () = subscription.cancelled() => return Ok(()),
                changed = changes.changed() => {
                    if changed.is_err() {
                        // The server is shutting down: end the subscription gracefully.
                        return Ok(());
                    }
                    if wanted && subscription.sink().notify_tool_list_changed().await.is_err() {
                        return Ok(());
                    }
                }
            }
        }
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let catalog = self.current();
        let tools = self
            .own
            .iter()
            .cloned()
            .chain(catalog.tools(can_ask(&context)).iter().cloned())
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    /// A request the SDK could not read: one of its methods whose `params` do not have that
    /// method's shape (a `tools/call` whose `arguments` is not an object, say), or a method it
    /// does not know. Either way the client hears which.
    async fn on_custom_request(
        &self,
        request: CustomRequest,
        _context: RequestContext<RoleServer>,
    ) -> Result<CustomResult, McpError> {
        Err(unread_request(&request.method, request.params))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        let catalog = self.current();
        self.own
            .iter()
            .chain(catalog.tools(true).iter())
            .find(|t| t.name == name)
            .cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        // The SDK cancels a request of an ended HTTP session only seconds later: dropping the
        // work now cancels a call on its host within the session's idle bound.
        let Some(end) = super::ending::session_end(&context) else {
            return self.call(request, context).await;
        };
        tokio::select! {
            response = self.call(request, context) => response,
            () = end.cancelled() => {
                tracing::info!("the MCP session ended: its call is cancelled");
                Err(McpError::internal_error("the MCP session ended", None))
            }
        }
    }
}

impl Server {
    /// [`ServerHandler::call_tool`], for as long as the session lasts.
    async fn call(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let catalog = self.current();
        let mut args = request.arguments.clone().unwrap_or_default();
        let name = request.name.as_ref();
        match name {
            SEARCH => {
                return Ok(
                    own::search(&self.calls.client, &catalog, &args, can_ask(&context))
                        .await
                        .into(),
                );
            }
            LOAD => {
                return Ok(own::load(
                    &self.calls,
                    &catalog,
                    &self.catalog,
                    &args,
                    can_ask(&context),
                )
                .await
                .into());
            }
            _ => {}
        }
        if let Some(handle) = &request.request_state {
            return self
                .calls
                .resume(name, handle, request.input_responses.as_ref(), &context)
                .await;
        }
        match catalog.route(name, &mut args) {
            // Loaded, and not served now: an error result saying why, for the model to read.
            None => match catalog.not_served(name) {
                Some(why) => Ok(error(why).into()),
                None => Err(McpError::invalid_params(
                    format!(
                        "unknown tool `{}`: it is not loaded in this session (find tools with \
                         {SEARCH}, load one with {LOAD})",
                        quoted(name)
                    ),
                    None,
                )),
            },
            Some(Route::Refused(text)) => Ok(error(text).into()),
            Some(Route::Host(host)) => {
                self.calls
                    .start(&catalog.session, host, name.to_string(), args, &context)
                    .await
            }
        }
    }
}

/// The requests of the MCP revisions this server speaks, as the SDK reads them: one that reaches
/// [`Server::on_custom_request`] with such a method had `params` the SDK could not read.
const KNOWN_REQUESTS: [&str; 21] = [
    "initialize",
    "server/discover",
    "ping",
    "tools/list",
    "tools/call",
    "subscriptions/listen",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "resources/directory/read",
    "prompts/list",
    "prompts/get",
    "logging/setLevel",
    "completion/complete",
    "tasks/get",
    "tasks/update",
    "tasks/cancel",
    "skills/list",
    "skills/get",
];

/// Most bytes of a decoder's reason an invalid-params error gives.
const MAX_REASON_BYTES: usize = 300;

/// The error for a request the SDK could not read: invalid params (naming what is wrong with
/// them for `tools/call`) when the method is known, method not found otherwise.
fn unread_request(method: &str, params: Option<serde_json::Value>) -> McpError {
    if !KNOWN_REQUESTS.contains(&method) {
        return McpError::new(
            rmcp::model::ErrorCode::METHOD_NOT_FOUND,
            format!("no method `{}` in this server", quoted(method)),
            None,
        );
    }
    let why = match method {
        "tools/call" => params
            .ok_or_else(|| "no params".to_string())
            .and_then(|p| {
                serde_json::from_value::<CallToolRequestParams>(p).map_err(|e| e.to_string())
            })
            .err(),
        _ => None,
    };
    // The decoder's reason may quote what it was given (5 MB of `arguments`): it comes back
    // escaped and cut.
    let message = match why {
        Some(why) => format!(
            "invalid params of `{method}`: {}",
            toolsrv_proto::text::printable_line(&why, MAX_REASON_BYTES)
        ),
        None => format!("invalid params of `{method}`"),
    };
    McpError::invalid_params(message, None)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_request_the_sdk_could_not_read_says_whether_its_params_or_its_method_is_wrong() {
        let e = unread_request(
            "tools/call",
            Some(json!({"name": "x", "arguments": "text"})),
        );
        assert_eq!(e.code, rmcp::model::ErrorCode::INVALID_PARAMS);
        assert!(
            e.message
                .starts_with("invalid params of `tools/call`: invalid type: string"),
            "{}",
            e.message
        );
        let e = unread_request("tools/call", None);
        assert_eq!(e.message, "invalid params of `tools/call`: no params");
        let e = unread_request("tools/list", Some(json!(7)));
        assert_eq!(
            (e.code, e.message.as_ref()),
            (
                rmcp::model::ErrorCode::INVALID_PARAMS,
                "invalid params of `tools/list`"
            )
        );
        let e = unread_request("tools/\u{1b}[2Jexplode", None);
        assert_eq!(e.code, rmcp::model::ErrorCode::METHOD_NOT_FOUND);
        assert_eq!(
            e.message,
            "no method `tools/\\u{1b}[2Jexplode` in this server"
        );
    }
}
