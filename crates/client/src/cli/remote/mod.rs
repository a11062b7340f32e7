//! `toolctl` commands that go through a coordinator: hosts, tools, describe, call, fanout, watch.

mod approve;
pub(crate) mod call;
pub mod complete;
mod fanout;
mod hosts;
mod master;
mod revoke;
mod session;
pub mod token;
mod tools;
mod watch;

use std::io::Write;
use std::path::PathBuf;

use crate::{Client, ClientError, ConnectOptions, TlsError, TlsFiles};
use clap::Args;

pub use approve::{Answer, approval, approvals, asked, decide};
pub use call::{CallOptions, call, failure_line};
pub use fanout::{FanOutOptions, fan_out};
pub use hosts::hosts;
pub use master::master;
pub use revoke::{revocations, revoke, unrevoke};
pub use session::{check_find, find, find_note};
pub mod sessions {
    //! The `toolctl session` subcommands.
    pub use super::session::{close, list, load, open, show, watch};
}
pub use tools::{describe, tools};
pub use watch::watch;

pub(super) use super::{write_json, written};

use super::exit;

/// Where the coordinator is and which client certificate to present, or the control socket of a
/// running `toolctl master` that holds a connection already.
#[derive(Debug, Args)]
pub struct ConnArgs {
    /// The coordinator's URL, `https://host:port` (`host:port` alone means https)
    #[arg(long, env = "TOOLSRV_ADDR", value_name = "URL")]
    addr: Option<String>,
    /// CA certificate (PEM) the coordinator's certificate must chain to
    #[arg(long, env = "TOOLSRV_CA", value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Client certificate (PEM), issued for `toolsrv://client/<name>`
    #[arg(long, env = "TOOLSRV_CERT", value_name = "FILE")]
    cert: Option<PathBuf>,
    /// The client certificate's private key (PEM)
    #[arg(long, env = "TOOLSRV_KEY", value_name = "FILE")]
    key: Option<PathBuf>,
    /// Control socket of a `toolctl master`: used when one answers there, otherwise the
    /// command connects directly with the four settings above. `default` is
    /// $XDG_RUNTIME_DIR/toolctl.sock, or, without XDG_RUNTIME_DIR, toolctl.sock in a private
    /// directory under /tmp (`toolctl-<uid>`), where `master` serves when not told otherwise
    #[arg(long, env = "TOOLSRV_CONTROL", value_name = "SOCKET")]
    control: Option<PathBuf>,
}

impl ConnArgs {
    /// The control socket to try: the one named, with `default` standing for the default one.
    fn control_path(&self) -> Option<PathBuf> {
        self.control.as_ref().map(|path| {
            if path.as_os_str() == crate::control::DEFAULT_WORD {
                crate::control::default_socket()
            } else {
                path.clone()
            }
        })
    }
}

impl ConnArgs {
    /// The direct connection's settings, or one line naming what is missing.
    fn direct(&self) -> Result<ConnectOptions, String> {
        if let (Some(addr), Some(ca), Some(cert), Some(key)) =
            (&self.addr, &self.ca, &self.cert, &self.key)
        {
            return Ok(ConnectOptions {
                addr: normalize_addr(addr),
                tls: TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                },
            });
        }
        let missing: Vec<&str> = [
            ("--addr (TOOLSRV_ADDR)", self.addr.is_none()),
            ("--ca (TOOLSRV_CA)", self.ca.is_none()),
            ("--cert (TOOLSRV_CERT)", self.cert.is_none()),
            ("--key (TOOLSRV_KEY)", self.key.is_none()),
        ]
        .into_iter()
        .filter_map(|(name, absent)| absent.then_some(name))
        .collect();
        Err(format!(
            "no coordinator to talk to: missing {}",
            missing.join(", ")
        ))
    }
}

/// A connected client and the address it reached, for messages.
#[derive(Debug)]
struct Remote {
    client: Client,
    addr: String,
}

impl Remote {
    /// Prints one line for an error and returns its exit code. What the coordinator answered is
    /// printed as it worded it (`toolctl: <message>`), the same line whichever command met the
    /// condition, with control and direction characters escaped (it may quote what the caller
    /// typed, or what a host said); anything else says what we were doing and where (`toolctl:
    /// <what> at <addr>: <error>`).
    fn fail(&self, what: &str, e: &ClientError) -> u8 {
        match e {
            ClientError::Status { .. } => crate::cli::quote::say(e),
            _ => eprintln!("toolctl: {what} at {}: {e}", self.addr),
        }
        error_code(e)
    }
}

/// `host:port` means `https://host:port`; anything else is left for the TLS crate to judge.
/// Several replicas, comma-separated, are each normalised.
fn normalize_addr(addr: &str) -> String {
    addr.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| {
            if a.contains("://") {
                a.to_string()
            } else {
                format!("https://{a}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects through the control socket when a master answers there, else directly; or prints one
/// line saying what failed and why, and returns the exit code.
async fn connect(conn: &ConnArgs) -> Result<Remote, u8> {
    let direct = conn.direct();
    if let Some(path) = &conn.control_path() {
        match Client::connect_control(path).await {
            Ok(client) => {
                return Ok(Remote {
                    client,
                    addr: path.display().to_string(),
                });
            }
            // Someone else's socket on our path is an attack or a mistake, never "no master".
            Err(e @ ClientError::UntrustedControl(_)) => {
                eprintln!("toolctl: {e}");
                return Err(error_code(&e));
            }
            // Like ssh with `ControlMaster auto`: no master, so connect ourselves.
            Err(e) if direct.is_ok() => tracing::debug!(error = %e, "connecting directly"),
            Err(e) => {
                eprintln!(
                    "toolctl: {e}: start `toolctl master`, or give --addr, --ca, --cert and --key"
                );
                return Err(error_code(&e));
            }
        }
    }
    let opts = direct.map_err(|e| {
        eprintln!("toolctl: {e} (or --control for a running `toolctl master`)");
        exit::USAGE
    })?;
    connect_direct(opts).await
}

/// Connects as the other remote commands do (through a master when one answers on
/// `--control`), for commands that keep the client: `toolctl mcp`.
pub async fn connect_client(conn: &ConnArgs) -> Result<Client, u8> {
    connect(conn).await.map(|remote| remote.client)
}

/// Connects with our own certificate; on failure prints one line and returns the exit code.
async fn connect_direct(opts: ConnectOptions) -> Result<Remote, u8> {
    let addr = opts.addr.clone();
    match Client::connect(&opts).await {
        Ok(client) => Ok(Remote { client, addr }),
        Err(e) => {
            match &e {
                // Already says "cannot connect to <addr>: ...".
                ClientError::Tls(TlsError::Connect(_)) => eprintln!("toolctl: {e}"),
                ClientError::Tls(TlsError::Identity(_)) => {
                    eprintln!("toolctl: cannot connect to {addr}: {e}: check --addr and --ca")
                }
                _ => eprintln!("toolctl: cannot connect to {addr}: {e}"),
            }
            Err(error_code(&e))
        }
    }
}

/// The exit code for an error that kept a command from getting an answer.
pub(super) fn error_code(e: &ClientError) -> u8 {
    use tonic::Code;
    match e {
        ClientError::Tls(TlsError::Connect(_)) => exit::UNAVAILABLE,
        ClientError::Tls(TlsError::Identity(_)) => exit::DENIED,
        ClientError::Tls(TlsError::InvalidName { .. }) => exit::USAGE,
        ClientError::Tls(_) => exit::CONFIG,
        ClientError::Status { code, .. } | ClientError::Transport { code, .. } => match code {
            // A coordinator that went away, a host that is offline, or a quota that is full
            // now: all worth retrying later.
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::ResourceExhausted => exit::UNAVAILABLE,
            Code::PermissionDenied | Code::Unauthenticated => exit::DENIED,
            Code::NotFound => exit::NOT_FOUND,
            // The tool is not visible on the host (or on any host of a session), or a session
            // is full of tools that are never unloaded.
            Code::FailedPrecondition => exit::HIDDEN,
            Code::InvalidArgument => exit::USAGE,
            _ => exit::INTERNAL,
        },
        ClientError::Control(_) => exit::UNAVAILABLE,
        ClientError::UntrustedControl(_) => exit::DENIED,
        ClientError::Protocol(_) => exit::INTERNAL,
        ClientError::Profile(_) => exit::USAGE,
    }
}

/// Resolves when the user presses Ctrl-C; never when the handler cannot be installed.
async fn interrupted() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Writes aligned columns under a header; the last column is not padded.
///
/// Every cell is shown [`printable`](crate::cli::quote::printable): what hosts report (a host-only
/// tool's description, a label) cannot move the cursor, clear the screen or reorder the text
/// around it on the reader's terminal.
fn write_table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            row.iter()
                .map(|cell| crate::cli::quote::printable(cell))
                .collect()
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i + 1 == widths.len() {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:<w$}  "));
            }
        }
        text.trim_end().to_string()
    };
    writeln!(out, "{}", line(&mut header.iter().copied()))?;
    for row in &rows {
        writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
    }
    Ok(())
}

/// A tool's name for a table, with ` [host-only]` when the catalog does not ship it (as
/// `toolctl tools` marks it): what it says is its hosts' word.
fn marked(name: &str, host_only: bool) -> String {
    if host_only {
        format!("{name} [host-only]")
    } else {
        name.to_string()
    }
}

/// A duration in milliseconds for people: `850ms`, `1.25s`, `3m05s`.
fn human_ms(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{:.2}s", ms as f64 / 1000.0),
        _ => format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

/// What `call` and `fanout` share before they send: the arguments as JSON text (and the names
/// given as `KEY=VALUE` strings), the timeout in milliseconds and a connection; or the exit code
/// after one line saying what was wrong.
async fn prepare_run(
    conn: &ConnArgs,
    args: &[String],
    timeout: Option<f64>,
) -> Result<(Remote, Prepared), u8> {
    let args = crate::cli::call_args::parse(args).map_err(|e| {
        eprintln!("toolctl: {e}");
        exit::USAGE
    })?;
    let timeout_ms = timeout_ms(timeout)?;
    let remote = connect(conn).await?;
    let prepared = Prepared {
        args_json: args.text,
        string_keys: args.string_keys,
        timeout_ms,
    };
    Ok((remote, prepared))
}

/// A call's or fan-out's request fields from the command line.
struct Prepared {
    args_json: String,
    /// The names given as `KEY=VALUE` strings, for [`note_strings`].
    string_keys: Vec<String>,
    timeout_ms: u64,
}

/// Says how to pass a number or a boolean when a tool refused a value given as `KEY=VALUE`.
fn note_strings(string_keys: &[String], result: &crate::CallResult) {
    if result.status == crate::CallStatus::InvalidArgs as i32
        && let Some(note) = crate::cli::call_args::string_note(string_keys, &result.message)
    {
        eprintln!("toolctl: {note}");
    }
}

/// `--timeout` seconds as the request's milliseconds; `None` (agent default) when absent.
fn timeout_ms(timeout: Option<f64>) -> Result<u64, u8> {
    let Some(secs) = timeout else { return Ok(0) };
    match crate::cli::timeout_secs(secs) {
        Ok(t) => Ok(u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)),
        Err(e) => {
            eprintln!("toolctl: {e}");
            Err(exit::USAGE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_default_to_https() {
        assert_eq!(normalize_addr("127.0.0.1:7443"), "https://127.0.0.1:7443");
        assert_eq!(normalize_addr("https://h:1"), "https://h:1");
        assert_eq!(normalize_addr("http://h:1"), "http://h:1");
    }

    #[test]
    fn errors_map_to_documented_codes() {
        let status = |code| ClientError::Status {
            code,
            message: String::new(),
            session_gone: false,
        };
        let cases = [
            (
                ClientError::Tls(TlsError::Connect("x".into())),
                exit::UNAVAILABLE,
            ),
            (
                ClientError::Tls(TlsError::Identity("x".into())),
                exit::DENIED,
            ),
            (status(tonic::Code::Unavailable), exit::UNAVAILABLE),
            (status(tonic::Code::ResourceExhausted), exit::UNAVAILABLE),
            (status(tonic::Code::PermissionDenied), exit::DENIED),
            (status(tonic::Code::Unauthenticated), exit::DENIED),
            (status(tonic::Code::NotFound), exit::NOT_FOUND),
            (status(tonic::Code::FailedPrecondition), exit::HIDDEN),
            (status(tonic::Code::InvalidArgument), exit::USAGE),
            (status(tonic::Code::Internal), exit::INTERNAL),
            (ClientError::Protocol("x".into()), exit::INTERNAL),
        ];
        for (e, code) in cases {
            assert_eq!(error_code(&e), code, "{e:?}");
        }
    }

    #[test]
    fn tables_align_columns() {
        let mut out = Vec::new();
        let rows = vec![
            vec!["web-1".to_string(), "ok".to_string(), "".to_string()],
            vec![
                "database".to_string(),
                "timed_out".to_string(),
                "after 5s".to_string(),
            ],
        ];
        write_table(&mut out, &["HOST", "STATUS", "MESSAGE"], &rows).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HOST      STATUS     MESSAGE\n\
             web-1     ok\n\
             database  timed_out  after 5s\n"
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(human_ms(850), "850ms");
        assert_eq!(human_ms(1250), "1.25s");
        assert_eq!(human_ms(185_000), "3m05s");
    }

    #[test]
    fn timeouts_convert_to_milliseconds() {
        assert_eq!(timeout_ms(None), Ok(0));
        assert_eq!(timeout_ms(Some(1.5)), Ok(1500));
        assert_eq!(timeout_ms(Some(0.001)), Ok(1));
        assert_eq!(timeout_ms(Some(0.0001)), Err(exit::USAGE));
        assert_eq!(timeout_ms(Some(1e18)), Err(exit::USAGE));
        assert_eq!(timeout_ms(Some(0.0)), Err(exit::USAGE));
        assert_eq!(timeout_ms(Some(-1.0)), Err(exit::USAGE));
    }
}
