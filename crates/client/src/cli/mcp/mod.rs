//! `toolctl mcp`: an MCP server (on the `rmcp` SDK) in front of one session on the coordinator,
//! over stdio or streamable HTTP. It opens the session from a profile, serves its loaded tools
//! and two of its own (`tool_search`, `tool_load`), runs calls on the fleet, and closes the
//! session when it exits.

mod call;
mod ending;
mod http;
mod keeper;
mod malformed;
mod own;
mod server;
mod sessions;
mod stdio;
mod strangers;
mod tools;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use rmcp::ServiceExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::exit;
use super::remote::ConnArgs;
use crate::Profile;

/// How long closing the session at exit may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the last answers on stdout may take to be read once the MCP service ended.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// `toolctl mcp`'s options.
#[derive(Debug, Args)]
pub struct McpArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Profile file: {"autoLoad": ["tool", ...], "hosts": "SELECTOR", "maxLoaded": 40}
    #[arg(long, value_name = "FILE")]
    profile: PathBuf,
    /// Host selector, replacing the profile's `hosts`
    #[arg(long, value_name = "SELECTOR")]
    hosts: Option<String>,
    /// Serve streamable HTTP at http://ADDR/mcp instead of stdio (a loopback address, such as
    /// 127.0.0.1:8765, unless --http-allow-remote)
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// Allow --http on an address off loopback: whoever reaches the address and has the bearer
    /// token calls tools with this command's certificate
    #[arg(long, requires = "http")]
    http_allow_remote: bool,
    /// The bearer token HTTP clients must send, kept in FILE (owner-only; made there when it does
    /// not exist). Without it, a new token each run, printed on stderr
    #[arg(
        long,
        value_name = "FILE",
        requires = "http",
        conflicts_with = "http_no_auth"
    )]
    http_token_file: Option<PathBuf>,
    /// Serve HTTP without a bearer token: every process that reaches the address, other users'
    /// included, calls tools with this command's certificate
    #[arg(long, requires = "http")]
    http_no_auth: bool,
    /// How long an HTTP client's MCP session lives with nothing sent either way; then it ends,
    /// and any call still running in it is cancelled
    #[arg(
        long,
        value_name = "SECS",
        requires = "http",
        default_value_t = http::SESSION_IDLE.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    http_session_idle_secs: u64,
}

/// Runs the MCP server until its stdio client goes away (stdin closes), or until Ctrl-C or
/// SIGTERM; returns the exit code.
pub async fn run(args: McpArgs) -> u8 {
    // Listening from the start: a signal while the session opens or before the client's
    // `initialize` ends the server too, and closes the session it opened.
    let mut stop = Stop::listen();
    let profile = match Profile::load(&args.profile) {
        Ok(profile) => profile,
        Err(e) => {
            eprintln!(
                "toolctl mcp: {}",
                crate::cli::quote::printable(&e.to_string())
            );
            return exit::USAGE;
        }
    };
    let http = match args.http {
        Some(addr) => {
            let checked = http::check_addr(addr, args.http_allow_remote)
                .and_then(|()| http::auth(args.http_token_file.as_deref(), args.http_no_auth));
            match checked {
                Ok(auth) => Some((addr, auth)),
                Err(e) => {
                    eprintln!("toolctl mcp: {e}");
                    return exit::USAGE;
                }
            }
        }
        None => None,
    };
    let client = match super::remote::connect_client(&args.conn).await {
        Ok(client) => client,
        Err(code) => return code,
    };
    let sessions = keeper::Coordinator {
        client: client.clone(),
        profile,
        hosts: args.hosts.clone(),
    };
    let state = match keeper::Sessions::open(&sessions, &[]).await {
        Ok(state) => state,
        Err(e) => {
            eprintln!("toolctl mcp: cannot open a session: {e}");
            return super::remote::error_code(&e);
        }
    };
    eprintln!(
        "toolctl mcp: session {} on hosts `{}` ({} selected), tools loaded: {}",
        state.id,
        state.hosts,
        state.selected.len(),
        state.tools.len()
    );
    let (catalog, _) = watch::channel(Arc::new(tools::Catalog::from_state(&state)));
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let nudge = Arc::new(tokio::sync::Notify::new());
    let keeper = tokio::spawn(keeper::keep(
        sessions,
        catalog.clone(),
        shutdown.clone(),
        nudge.clone(),
        tokio::time::sleep,
    ));
    let calls = call::Calls {
        client: client.clone(),
        parked: call::Parked::default(),
        tasks: tasks.clone(),
        session_gone: nudge,
    };
    let server = server::Server::new(calls, catalog.clone());
    let code = match http {
        Some((addr, auth)) => {
            let idle = Duration::from_secs(args.http_session_idle_secs);
            serve_http(
                addr,
                args.http_allow_remote,
                auth,
                idle,
                server,
                shutdown.clone(),
                &mut stop,
            )
            .await
        }
        None => serve_stdio(server, &mut stop).await,
    };
    shutdown.cancel();
    if let Err(e) = keeper.await {
        tracing::warn!(error = %e, "the session keeper failed");
    }
    let id = catalog.borrow().session.clone();
    match tokio::time::timeout(CLOSE_TIMEOUT, client.close_session(&id)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("toolctl mcp: cannot close session {id}: {e}"),
        Err(_) => eprintln!("toolctl mcp: closing session {id} timed out"),
    }
    // Parked calls and notification forwarders end with the process.
    tasks.close();
    code
}

/// Serves one client on stdin and stdout until it goes away or a signal comes.
async fn serve_stdio(server: server::Server, stop: &mut Stop) -> u8 {
    // Through [`stdio`], which answers the lines that are not JSON-RPC messages.
    let (filter, pipes) = stdio::start(tokio::io::stdin(), tokio::io::stdout());
    let code = serve_pipes(server, pipes, stop).await;
    filter.finish(FLUSH_TIMEOUT).await;
    code
}

/// Serves one client on the SDK's ends of [`stdio`]'s pipes.
async fn serve_pipes(
    server: server::Server,
    pipes: (tokio::io::DuplexStream, tokio::io::DuplexStream),
    stop: &mut Stop,
) -> u8 {
    let running = tokio::select! {
        started = server.serve(pipes) => match started {
            Ok(running) => running,
            Err(e) => {
                eprintln!("toolctl mcp: the MCP client on stdio did not start a connection: {e}");
                return exit::USAGE;
            }
        },
        () = stop.signalled() => return 0,
    };
    let token = running.cancellation_token();
    tokio::select! {
        quit = running.waiting() => {
            if let Err(e) = quit {
                eprintln!("toolctl mcp: the MCP service failed: {e}");
                return exit::INTERNAL;
            }
            0
        }
        () = stop.signalled() => {
            token.cancel();
            0
        }
    }
}

async fn serve_http(
    addr: SocketAddr,
    allow_remote: bool,
    auth: http::Auth,
    idle: Duration,
    server: server::Server,
    shutdown: CancellationToken,
    stop: &mut Stop,
) -> u8 {
    let serving = async {
        let served = http::serve(addr, allow_remote, auth, idle, server, shutdown.clone()).await;
        shutdown.cancel();
        served
    };
    let signals = async {
        tokio::select! {
            () = stop.signalled() => shutdown.cancel(),
            () = shutdown.cancelled() => {}
        }
    };
    match tokio::join!(serving, signals).0 {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("toolctl mcp: {e}");
            exit::UNAVAILABLE
        }
    }
}

/// Ctrl-C (SIGINT) and SIGTERM, caught from the moment it is made: until then, either ends
/// the process at once, without closing the session.
struct Stop {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
}

impl Stop {
    fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        Self {
            interrupt: signal(SignalKind::interrupt()).ok(),
            terminate: signal(SignalKind::terminate()).ok(),
        }
    }

    /// Resolves at the next of either signal (never, for one that could not be caught).
    async fn signalled(&mut self) {
        async fn next(signal: &mut Option<tokio::signal::unix::Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(&mut self.interrupt) => {}
            () = next(&mut self.terminate) => {}
        }
    }
}
