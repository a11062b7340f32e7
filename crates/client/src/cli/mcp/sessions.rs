//! How many MCP sessions `toolctl mcp --http` keeps: each costs memory (about 80 KB with its
//! cached responses) until it is closed or idle for `--http-session-idle-secs`, and a client
//! library that opens one per request and never closes it would otherwise pile them up. Past
//! [`MAX_SESSIONS`], the oldest is closed (and any call running in it cancelled).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use rmcp::transport::common::server_side_http::SessionId;
use rmcp::transport::streamable_http_server::session::SessionManager;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;

/// Most MCP sessions kept at once.
pub const MAX_SESSIONS: usize = 256;

/// The header a session's id travels in.
const SESSION_HEADER: &str = "mcp-session-id";

/// The sessions opened through the server, oldest first, and the manager that keeps them.
#[derive(Debug)]
pub struct Bound {
    manager: Arc<LocalSessionManager>,
    opened: Mutex<VecDeque<SessionId>>,
    max: usize,
}

impl Bound {
    pub fn new(manager: Arc<LocalSessionManager>, max: usize) -> Arc<Self> {
        Arc::new(Self {
            manager,
            opened: Mutex::default(),
            max,
        })
    }

    /// Notes a session the manager just opened; closes the oldest past the bound.
    async fn opened(&self, id: SessionId) {
        let live: HashSet<SessionId> = self.manager.sessions.read().await.keys().cloned().collect();
        let oldest: Vec<SessionId> = {
            let mut opened = self
                .opened
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Those closed or idle for too long are gone from the manager already.
            opened.retain(|s| live.contains(s));
            opened.push_back(id);
            let excess = opened.len().saturating_sub(self.max);
            opened.drain(..excess).collect()
        };
        for id in oldest {
            tracing::warn!(session = %id, max = self.max, "too many MCP sessions: closing the oldest");
            if let Err(e) = self.manager.close_session(&id).await {
                tracing::warn!(session = %id, error = %e, "cannot close an MCP session");
            }
        }
    }
}

/// Middleware: notes each session a request without a session id opened.
pub async fn bound(bound: Arc<Bound>, request: Request, next: Next) -> Response {
    let new = !request.headers().contains_key(SESSION_HEADER);
    let response = next.run(request).await;
    if new
        && let Some(id) = response
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
    {
        bound.opened(Arc::from(id)).await;
    }
    response
}
