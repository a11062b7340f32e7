//! `toolctl mcp --http ADDR`: the MCP server over streamable HTTP at `/mcp`, on loopback unless
//! told otherwise. Every request must carry `Authorization: Bearer TOKEN`: loopback keeps other
//! machines out, not the other users of this one, and whoever gets through calls tools with this
//! command's certificate. The token is new each run unless `--http-token-file` keeps one. A
//! request from a web page of another origin is refused, token or not (DNS rebinding).

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use super::malformed::{self, Check};
use super::server::Server;
use super::strangers::{self, Standing};

/// The path the server answers on.
pub const PATH: &str = "/mcp";

/// Refuses an address off loopback unless `allow_remote`; with it, a warning.
pub fn check_addr(addr: SocketAddr, allow_remote: bool) -> Result<(), String> {
    if addr.ip().is_loopback() {
        return Ok(());
    }
    if !allow_remote {
        return Err(format!(
            "--http {addr}: not a loopback address. This server speaks plain HTTP: its bearer \
             token would cross the network in the clear, and whoever has it calls every tool \
             of the session with your certificate. Give --http-allow-remote to serve there \
             anyway"
        ));
    }
    eprintln!(
        "toolctl mcp: warning: serving on {addr}, off loopback, with --http-allow-remote: plain \
         HTTP carries the bearer token in the clear; put TLS in front of it"
    );
    Ok(())
}

/// Bytes of randomness in a token this command makes (256 bits, 64 hex digits).
const TOKEN_BYTES: usize = 32;
/// Shortest token taken from a file: guessing it must stay out of reach.
const MIN_TOKEN_CHARS: usize = 32;
/// Longest token file read.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// What HTTP clients must present.
#[derive(Debug, Clone)]
pub enum Auth {
    /// `Authorization: Bearer` and this token; `from` says where it is, for the message.
    Bearer { token: Arc<str>, from: TokenFrom },
    /// Nothing (`--http-no-auth`).
    Open,
}

/// Where the bearer token comes from.
#[derive(Debug, Clone)]
pub enum TokenFrom {
    /// Made for this run (printed once on stderr).
    Run,
    /// Read from, or written to, this file.
    File(std::path::PathBuf),
}

/// The clients' credential: `--http-no-auth` for none; else the token in `token_file` (made there,
/// owner-only, when the file does not exist), or a new one for this run.
pub fn auth(token_file: Option<&Path>, no_auth: bool) -> Result<Auth, String> {
    if no_auth {
        return Ok(Auth::Open);
    }
    let token = match token_file {
        Some(path) => token_in(path)?,
        None => new_token()?,
    };
    Ok(Auth::Bearer {
        token: token.into(),
        from: token_file.map_or(TokenFrom::Run, |p| TokenFrom::File(p.to_path_buf())),
    })
}

fn new_token() -> Result<String, String> {
    toolsrv_tls::enroll::secret_hex(TOKEN_BYTES, "the MCP bearer token").map_err(|e| e.to_string())
}

/// The token in `path`, which only its owner may read; made there when the file does not exist.
fn token_in(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let file = match toolsrv_tls::files::open_read(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let token = new_token()?;
            // `~/.config/toolsrv` on a fresh machine: its directories are made as the user's own
            // (0700), as ssh makes `~/.ssh`.
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| {
                        format!(
                            "--http-token-file {shown}: cannot create its directory {}: {e}",
                            dir.display()
                        )
                    })?;
            }
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| format!("--http-token-file {shown}: cannot create it: {e}"))?;
            file.write_all(format!("{token}\n").as_bytes())
                .map_err(|e| format!("--http-token-file {shown}: cannot write it: {e}"))?;
            return Ok(token);
        }
        Err(e) => return Err(format!("--http-token-file {shown}: cannot open it: {e}")),
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("--http-token-file {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("--http-token-file {shown}: not a regular file"));
    }
    owned_by(meta.uid(), nix::unistd::geteuid().as_raw())
        .map_err(|e| format!("--http-token-file {shown}: {e}"))?;
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "--http-token-file {shown}: readable or writable by others (mode {:o}); \
             chmod 600 it",
            meta.mode() & 0o777
        ));
    }
    let text = toolsrv_tls::files::read_text_up_to(file, MAX_TOKEN_FILE_BYTES)
        .map_err(|e| format!("--http-token-file {shown}: cannot read it: {e}"))?
        .ok_or_else(|| {
            format!(
                "--http-token-file {shown}: over {MAX_TOKEN_FILE_BYTES} bytes; a token is one line"
            )
        })?;
    let token = text.trim();
    if token.chars().count() < MIN_TOKEN_CHARS || !token.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!(
            "--http-token-file {shown}: the token must be one line of at least \
             {MIN_TOKEN_CHARS} printable ASCII characters without spaces"
        ));
    }
    Ok(token.to_string())
}

/// Refuses a token file owned by another user than `uid`: whoever owns the file chose the
/// token, and root can read any file, so its mode alone does not tell.
fn owned_by(file_uid: u32, uid: u32) -> Result<(), String> {
    if file_uid == uid {
        return Ok(());
    }
    Err(format!(
        "owned by uid {file_uid}, not by this user (uid {uid})"
    ))
}

/// Whether `header` is `Bearer TOKEN`, compared in time that does not depend on where it differs.
fn presents(header: Option<&[u8]>, token: &str) -> bool {
    let Some(value) = header else {
        return false;
    };
    // The scheme is case-insensitive (RFC 9110), the token is not.
    let Some((scheme, given)) = value.split_at_checked(7) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return false;
    }
    let want = token.as_bytes();
    given.len() == want.len()
        && given
            .iter()
            .zip(want)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// Refuses a request without the token: 401 with `WWW-Authenticate: Bearer`. A request with
/// it makes its connection trusted ([`strangers`]).
async fn require(token: Arc<str>, request: Request, next: Next) -> Response {
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if presents(header, &token) {
        if let Some(ConnectInfo(standing)) = request.extensions().get::<ConnectInfo<Standing>>() {
            standing.trust();
        }
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "toolctl mcp: send the header `Authorization: Bearer TOKEN`, with the token \
         toolctl mcp printed or keeps in its --http-token-file\n",
    )
        .into_response()
}

/// Whether a request's `Origin` may reach the server: none (clients other than browsers send
/// none), or a web page served from loopback (`http(s)://localhost`, `127.0.0.1`, `[::1]`, any
/// port) or from the host this server is bound to (`own`). MCP wants servers to check it: a
/// page of another site that a browser lets through (DNS rebinding: a name of the attacker's
/// resolved to 127.0.0.1) must not reach the tools.
fn origin_allowed(origin: Option<&[u8]>, own: std::net::IpAddr) -> bool {
    let Some(origin) = origin else {
        return true;
    };
    let Ok(origin) = std::str::from_utf8(origin) else {
        return false;
    };
    let origin = origin.trim().to_ascii_lowercase();
    let Some(rest) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        // `null` (a sandboxed page, a file) and other schemes.
        return false;
    };
    // An origin is scheme, host and port: nothing after them.
    if rest.contains(['/', '?', '#', '@']) {
        return false;
    }
    // `host`, `host:port`, `[v6]` or `[v6]:port`.
    let (host, port) = match rest.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((ip, "")) => (ip, None),
            Some((ip, port)) => match port.strip_prefix(':') {
                Some(port) => (ip, Some(port)),
                None => return false,
            },
            None => return false,
        },
        None => match rest.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        },
    };
    if port.is_some_and(|p| p.parse::<u16>().is_err()) {
        return false;
    }
    if host == "localhost" {
        return true;
    }
    host.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback() || (ip == own && !own.is_unspecified()))
}

/// Refuses a request from a web page of another origin (see [`origin_allowed`]): 403 saying so.
async fn same_origin(own: std::net::IpAddr, request: Request, next: Next) -> Response {
    let origin = request.headers().get(header::ORIGIN).map(|v| v.as_bytes());
    if origin_allowed(origin, own) {
        return next.run(request).await;
    }
    let shown = origin.map_or_else(String::new, |o| {
        crate::cli::quote::quoted(&String::from_utf8_lossy(o))
    });
    tracing::warn!(origin = %shown, "refused a request from a web page of another origin");
    (
        StatusCode::FORBIDDEN,
        format!(
            "toolctl mcp: refused: the request comes from a web page at origin `{shown}`; only \
             pages served from loopback (http://localhost, http://127.0.0.1, http://[::1], any \
             port) or from this server's own address may call it, so that another site cannot \
             reach your tools through your browser\n"
        ),
    )
        .into_response()
}

/// A session ended by the client's `DELETE` answers 204 No Content: the SDK answers 202, which
/// the official Python client takes for a failure (`Session termination failed: 202`, logged
/// at every close), as it accepts 200 and 204 only.
async fn ended_is_no_content(request: Request, next: Next) -> Response {
    let delete = request.method() == axum::http::Method::DELETE;
    let mut response = next.run(request).await;
    if delete && response.status() == StatusCode::ACCEPTED {
        *response.status_mut() = StatusCode::NO_CONTENT;
        *response.body_mut() = axum::body::Body::empty();
    }
    response
}

/// A POST of JSON whose body is not a JSON-RPC message is answered `400` with the JSON-RPC
/// error [`malformed`] names: the SDK answers `415 Unsupported Media Type`, which tells a client
/// that did send JSON nothing. A body over `max_bytes` is refused as the SDK refuses it.
async fn well_formed(max_bytes: usize, request: Request, next: Next) -> Response {
    if request.method() != axum::http::Method::POST || !json(request.headers()) {
        // The SDK answers these as it should (405, 415).
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let body = match read_body(body, max_bytes).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let refusal = match malformed::check(&body) {
        Check::Message => {
            // The SDK does not skip a byte order mark, which RFC 8259 lets a parser ignore.
            let body = body.slice(body.len() - malformed::without_bom(&body).len()..);
            return next
                .run(Request::from_parts(parts, axum::body::Body::from(body)))
                .await;
        }
        Check::Stray(refusal) | Check::Refused(refusal) => refusal,
    };
    tracing::warn!(
        id = %refusal.id,
        "answered a POST that is not a JSON-RPC message: {}",
        refusal.message
    );
    (
        StatusCode::BAD_REQUEST,
        [(header::CONTENT_TYPE, "application/json")],
        refusal.to_json(),
    )
        .into_response()
}

/// Whether the request says it carries JSON.
fn json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            let essence = v.split_once(';').map_or(v, |(essence, _)| essence);
            essence.trim().eq_ignore_ascii_case("application/json")
        })
}

/// The whole body, at most `max_bytes` of it.
async fn read_body(
    body: axum::body::Body,
    max_bytes: usize,
) -> Result<axum::body::Bytes, Response> {
    use tokio_stream::StreamExt;
    let mut stream = body.into_data_stream();
    let mut collected = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                format!("toolctl mcp: cannot read the request body: {e}\n"),
            )
                .into_response()
        })?;
        if chunk.len() > max_bytes.saturating_sub(collected.len()) {
            return Err((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("Payload Too Large: request body exceeds {max_bytes} bytes"),
            )
                .into_response());
        }
        collected.extend_from_slice(&chunk);
    }
    Ok(collected.into())
}

/// How long an MCP session over HTTP (a 2025-11-25 client's, which `initialize` opens) lives
/// with nothing sent either way, by default (`--http-session-idle-secs`): then it ends, and
/// with it any call still running in it. A
/// client that drops its connection mid-call without `DELETE` or a cancellation (the protocol
/// lets it come back for the answer) holds the call and its place in the caller's quota that
/// long at most, not until the tool ends (up to an hour), and the session's memory (about
/// 80 KB) is not kept 5 minutes per client that never says goodbye.
pub const SESSION_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// Serves `server` on `addr` until `shutdown`, ending MCP sessions idle for `idle`.
pub async fn serve(
    addr: SocketAddr,
    allow_remote: bool,
    auth: Auth,
    idle: std::time::Duration,
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
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(idle);
    let sessions = Arc::new(sessions);
    let bound = super::sessions::Bound::new(sessions.clone(), super::sessions::MAX_SESSIONS);
    let max_body = config.max_request_body_bytes;
    let sessions = Arc::new(super::ending::Manager::new(sessions));
    let service = StreamableHttpService::new(move || Ok(server.for_connection()), sessions, config);
    // The layers run from the last one in: the token, then the others.
    let router = axum::Router::new()
        .nest_service(PATH, service)
        .layer(axum::middleware::from_fn(
            move |request: Request, next: Next| well_formed(max_body, request, next),
        ))
        .layer(axum::middleware::from_fn(
            move |request: Request, next: Next| {
                super::sessions::bound(bound.clone(), request, next)
            },
        ))
        .layer(axum::middleware::from_fn(ended_is_no_content));
    eprintln!("toolctl mcp: serving MCP on http://{local}{PATH}");
    let open = matches!(auth, Auth::Open);
    let router = match auth {
        Auth::Bearer { token, from } => {
            match from {
                TokenFrom::Run => eprintln!(
                    "toolctl mcp: clients must send the header `Authorization: Bearer {token}` \
                     (a new token each run; --http-token-file FILE keeps one)"
                ),
                TokenFrom::File(path) => eprintln!(
                    "toolctl mcp: clients must send the header `Authorization: Bearer TOKEN`, \
                     with the token in {}",
                    path.display()
                ),
            }
            router.layer(axum::middleware::from_fn(
                move |request: Request, next: Next| require(token.clone(), request, next),
            ))
        }
        Auth::Open => {
            eprintln!(
                "toolctl mcp: warning: --http-no-auth: any process that reaches this address, \
                 other users' included, calls tools with your certificate"
            );
            router
        }
    };
    // Outermost: a page of another site is refused whatever it sends.
    let own = local.ip();
    let router = router.layer(axum::middleware::from_fn(
        move |request: Request, next: Next| same_origin(own, request, next),
    ));
    let listener = strangers::Listener::new(listener, open);
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<Standing>(),
    )
    .with_graceful_shutdown(shutdown.cancelled_owned())
    .await
    .map_err(|e| format!("serving HTTP on {local}: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn only_the_exact_bearer_token_passes() {
        let token = "a".repeat(64);
        let header = format!("Bearer {token}");
        assert!(presents(Some(header.as_bytes()), &token));
        assert!(presents(Some(format!("bearer {token}").as_bytes()), &token));
        assert!(presents(Some(format!("BEARER {token}").as_bytes()), &token));
        assert!(!presents(Some(b"Bearer"), &token));
        for bad in [
            String::new(),
            token.clone(),
            format!("Bearer {}", "a".repeat(63)),
            format!("Bearer {}b", "a".repeat(63)),
            format!("Bearer {token}a"),
            format!("Bearer {}", token.to_uppercase()),
            format!("Basic {token}"),
            format!("Bearer  {token}"),
        ] {
            assert!(!presents(Some(bad.as_bytes()), &token), "{bad:?}");
        }
        assert!(!presents(None, &token));
    }

    #[test]
    fn a_token_file_is_made_private_then_kept_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let Auth::Bearer { token: made, .. } = auth(Some(&path), false).unwrap() else {
            panic!("no token");
        };
        assert_eq!(made.len(), 64);
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let Auth::Bearer { token: again, .. } = auth(Some(&path), false).unwrap() else {
            panic!("no token");
        };
        assert_eq!(made, again, "the file keeps the token");

        // In directories that do not exist yet (`~/.config/toolsrv` on a fresh machine): made,
        // the user's own.
        let nested = dir.path().join("config/toolsrv/mcp-token");
        assert!(matches!(
            auth(Some(&nested), false),
            Ok(Auth::Bearer { .. })
        ));
        let made = std::fs::metadata(dir.path().join("config/toolsrv")).unwrap();
        assert_eq!(made.mode() & 0o777, 0o700);

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = auth(Some(&path), false).unwrap_err();
        assert!(
            e.contains("readable or writable by others") && e.contains("644"),
            "{e}"
        );

        let short = dir.path().join("short");
        std::fs::write(&short, "hunter2\n").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = auth(Some(&short), false).unwrap_err();
        assert!(e.contains("at least 32"), "{e}");

        let e = auth(Some(dir.path()), false).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");

        // Another user's file is refused even when its mode is private: its owner knows the
        // token.
        assert!(owned_by(1000, 1000).is_ok());
        let e = owned_by(65534, 0).unwrap_err();
        assert!(
            e.contains("owned by uid 65534") && e.contains("uid 0"),
            "{e}"
        );

        // A new token each run without a file, and none at all when told.
        let (Auth::Bearer { token: a, .. }, Auth::Bearer { token: b, .. }) =
            (auth(None, false).unwrap(), auth(None, false).unwrap())
        else {
            panic!("no token");
        };
        assert_ne!(a, b);
        assert!(matches!(auth(None, true).unwrap(), Auth::Open));
    }

    /// Browsers send `Origin`; MCP wants it checked against DNS rebinding. Other clients send
    /// none and pass.
    #[test]
    fn only_loopback_or_own_origins_pass() {
        let loopback: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let own: std::net::IpAddr = "192.0.2.7".parse().unwrap();
        for origin in [
            "http://localhost",
            "http://localhost:8765",
            "https://LOCALHOST:443",
            "http://127.0.0.1",
            "http://127.0.0.1:3000",
            "http://[::1]",
            "https://[::1]:8443",
        ] {
            assert!(
                origin_allowed(Some(origin.as_bytes()), loopback),
                "{origin}"
            );
            assert!(origin_allowed(Some(origin.as_bytes()), own), "{origin}");
        }
        assert!(origin_allowed(None, loopback));
        assert!(origin_allowed(Some(b"http://192.0.2.7:8765"), own));
        for origin in [
            "http://evil.example",
            "http://localhost.evil.example",
            "http://127.0.0.1.evil.example",
            "http://evil.example:8765",
            "http://192.0.2.7:8765",
            "null",
            "file://",
            "ftp://localhost",
            "http://localhost:notaport",
            "http://localhost/path",
            "http://user@localhost",
            "http://[::1",
            "http://[::1]x",
            "",
        ] {
            assert!(
                !origin_allowed(Some(origin.as_bytes()), loopback),
                "{origin}"
            );
        }
        assert!(!origin_allowed(
            Some(b"http://0.0.0.0"),
            "0.0.0.0".parse().unwrap()
        ));
        assert!(!origin_allowed(Some(b"http://\xff"), loopback));
    }

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
