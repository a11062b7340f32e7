//! `toolctl mcp --http ADDR`: the MCP server over streamable HTTP at `/mcp`, on loopback unless
//! told otherwise (nothing authenticates HTTP clients).

use std::net::SocketAddr;
use std::sync::Arc;

use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use super::server::Server;

/// The path the server answers on.
pub const PATH: &str = "/mcp";

/// Refuses an address off loopback unless `allow_remote`; with it, a warning.
pub fn check_addr(addr: SocketAddr, allow_remote: bool) -> Result<(), String> {
    if addr.ip().is_loopback() {
        return Ok(());
    }
    if !allow_remote {
        return Err(format!(
            "--http {addr}: not a loopback address, and nothing authenticates MCP clients over \
             HTTP: anyone who reaches it could call every tool of the session with your \
             certificate. Give --http-allow-remote to serve there anyway"
        ));
    }
    eprintln!(
        "toolctl mcp: warning: serving on {addr}, off loopback, with --http-allow-remote: \
         nothing authenticates MCP clients; anyone who reaches this address can call every \
         tool of the session as you"
    );
    Ok(())
}

/// Serves `server` on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    allow_remote: bool,
    server: Server,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the address listened on: {e}"))?;
    let mut config =
        StreamableHttpServerConfig::default().with_cancellation_token(shutdown.child_token());
    if allow_remote {
        // The `Host` check guards loopback servers against DNS rebinding; a server meant to be
        // reached by other names cannot list them all.
        config = config.disable_allowed_hosts();
    }
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let router = axum::Router::new().nest_service(PATH, service);
    eprintln!("toolctl mcp: serving MCP on http://{local}{PATH}");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(|e| format!("serving HTTP on {local}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_without_the_flag() {
        let addr = |s: &str| {
            s.parse::<SocketAddr>()
                .unwrap_or_else(|e| panic!("{s}: {e}"))
        };
        assert!(check_addr(addr("127.0.0.1:8080"), false).is_ok());
        assert!(check_addr(addr("[::1]:8080"), false).is_ok());
        assert!(check_addr(addr("0.0.0.0:8080"), false).is_err());
        assert!(check_addr(addr("192.0.2.1:8080"), false).is_err());
        assert!(check_addr(addr("0.0.0.0:8080"), true).is_ok());
    }
}
