//! Ends the requests of an HTTP MCP session the moment the session ends (idle for
//! `--http-session-idle-secs`, or closed), not 5 seconds later.
//!
//! When a session's worker quits, the SDK's service loop sees its input end and waits up to 5
//! seconds for the handlers still running to answer before it cancels them. A call the client
//! abandoned never answers, so it ran, and held its place in the caller's quota, 5 seconds past
//! the bound the README gives. This session manager is the SDK's own, with each session's
//! transport marking the requests it delivers with [`SessionEnd`], a token cancelled when the
//! session's input ends; [`super::server::Server`] drops a request's work when it fires.

use std::sync::Arc;

use rmcp::RoleServer;
use rmcp::model::{ClientJsonRpcMessage, GetExtensions, ServerJsonRpcMessage};
use rmcp::service::{RequestContext, RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use rmcp::transport::common::server_side_http::ServerSseMessage;
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError, SessionTransport,
};
use rmcp::transport::streamable_http_server::{RestoreOutcome, SessionId, SessionManager};
use tokio_stream::Stream;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Cancelled when the session a request came in ends: in the request's extensions.
#[derive(Debug, Clone)]
pub struct SessionEnd(pub CancellationToken);

/// The token of the session `ctx`'s request came in, if it came over HTTP.
pub fn session_end(ctx: &RequestContext<RoleServer>) -> Option<CancellationToken> {
    ctx.extensions.get::<SessionEnd>().map(|end| end.0.clone())
}

/// [`LocalSessionManager`], its sessions' transports [`Ending`].
#[derive(Debug)]
pub struct Manager {
    inner: Arc<LocalSessionManager>,
}

impl Manager {
    pub fn new(inner: Arc<LocalSessionManager>) -> Self {
        Self { inner }
    }
}

/// A session's transport that marks each request it delivers with its [`SessionEnd`], cancelled
/// when its input ends (or it is dropped).
pub struct Ending {
    inner: SessionTransport,
    end: CancellationToken,
    _guard: DropGuard,
}

impl Ending {
    fn new(inner: SessionTransport) -> Self {
        let end = CancellationToken::new();
        Self {
            inner,
            _guard: end.clone().drop_guard(),
            end,
        }
    }
}

impl Transport<RoleServer> for Ending {
    type Error = <SessionTransport as Transport<RoleServer>>::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        match self.inner.receive().await {
            Some(mut message) => {
                if let ClientJsonRpcMessage::Request(request) = &mut message {
                    request
                        .request
                        .extensions_mut()
                        .insert(SessionEnd(self.end.clone()));
                }
                Some(message)
            }
            None => {
                self.end.cancel();
                None
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.end.cancel();
        self.inner.close().await
    }
}

impl SessionManager for Manager {
    type Error = LocalSessionManagerError;
    type Transport = Ending;

    async fn create_session(&self) -> Result<(SessionId, Ending), Self::Error> {
        let (id, transport) = self.inner.create_session().await?;
        Ok((id, Ending::new(transport)))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.inner.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.inner.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        self.inner.close_session(id).await
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_stream(id, message).await
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.inner.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_standalone_stream(id).await
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.resume(id, last_event_id).await
    }

    async fn restore_session(&self, id: SessionId) -> Result<RestoreOutcome<Ending>, Self::Error> {
        Ok(match self.inner.restore_session(id).await? {
            RestoreOutcome::Restored(transport) => RestoreOutcome::Restored(Ending::new(transport)),
            RestoreOutcome::AlreadyPresent => RestoreOutcome::AlreadyPresent,
            // `NotSupported`, and what later versions add.
            _ => RestoreOutcome::NotSupported,
        })
    }

    fn event_store(
        &self,
    ) -> Option<Arc<dyn rmcp::transport::streamable_http_server::session::EventStore>> {
        self.inner.event_store()
    }
}
