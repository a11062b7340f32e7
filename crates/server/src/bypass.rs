//! `toolsrv bypass`: a tool's client of its call's bypass socket (`OLLIE_BYPASS_SOCKET`), for
//! shell tools.
//!
//! Exit status: the command's when it ran, 77 when the request was denied (the reason on
//! stderr), 125 when the request could not be made (no socket, a broken answer).

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;

use clap::Args;
use serde_json::{Value, json};

/// Exit status of a denied request.
pub const DENIED: u8 = 77;
/// Exit status when the request could not be made.
pub const FAILED: u8 = 125;
/// The most standard input passed to the command (the agent's bound).
const MAX_STDIN: usize = 1 << 20;

/// Ask to run a command outside the call's sandbox (from inside a tool)
#[derive(Debug, Args)]
pub struct BypassArgs {
    /// Why the command is needed, shown to whoever decides and written to the audit log
    #[arg(long, default_value = "")]
    reason: String,
    /// Do not pass this command's standard input on (by default it is read to its end and
    /// given to the command, unless it is a terminal)
    #[arg(long)]
    no_stdin: bool,
    /// The command and its arguments
    #[arg(required = true, last = true, value_name = "CMD")]
    argv: Vec<String>,
}

pub fn run(args: &BypassArgs) -> ExitCode {
    match ask(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("toolsrv bypass: {e}");
            ExitCode::from(FAILED)
        }
    }
}

fn ask(args: &BypassArgs) -> Result<ExitCode, String> {
    let path = std::env::var_os("OLLIE_BYPASS_SOCKET").ok_or(
        "OLLIE_BYPASS_SOCKET is not set: run this from a tool called through toolsrv on an agent that confines calls with a cgroup per call",
    )?;
    let stdin = if args.no_stdin || std::io::stdin().is_terminal() {
        None
    } else {
        let mut input = Vec::new();
        std::io::stdin()
            .take(MAX_STDIN as u64 + 1)
            .read_to_end(&mut input)
            .map_err(|e| format!("cannot read standard input: {e}; use --no-stdin to pass none"))?;
        if input.len() > MAX_STDIN {
            return Err(format!(
                "standard input is longer than {MAX_STDIN} bytes; give the command less, or use --no-stdin"
            ));
        }
        let text = String::from_utf8(input)
            .map_err(|_| "standard input is not UTF-8 text; the bypass socket carries text only, use --no-stdin".to_owned())?;
        (!text.is_empty()).then_some(text)
    };
    let socket = std::path::Path::new(&path);
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot connect to {}: {e}; the call may have ended",
            socket.display()
        )
    })?;
    let mut request = json!({"argv": args.argv, "reason": args.reason});
    if let Some(text) = stdin {
        request["stdin"] = Value::String(text);
    }
    let line = format!("{request}\n");
    stream
        .write_all(line.as_bytes())
        .map_err(|e| format!("cannot send the request to {}: {e}", socket.display()))?;
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .map_err(|e| format!("cannot read the answer from {}: {e}", socket.display()))?;
    let answer: Value = serde_json::from_str(&answer).map_err(|e| {
        format!(
            "the answer from {} is not a JSON line ({e}); the agent may have stopped",
            socket.display()
        )
    })?;
    if answer["approved"] != Value::Bool(true) {
        // The reason is an approver's words, which reach the caller's terminal through the
        // tool's stderr: escaped.
        eprintln!(
            "toolsrv bypass: denied: {}",
            toolsrv_proto::text::printable(answer["reason"].as_str().unwrap_or("no reason given"))
        );
        return Ok(ExitCode::from(DENIED));
    }
    let out = answer["stdout"].as_str().unwrap_or_default();
    let err = answer["stderr"].as_str().unwrap_or_default();
    // A closed stdout or stderr is the reader's choice: the exit status still tells the outcome.
    let _ = std::io::stdout().write_all(out.as_bytes());
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().write_all(err.as_bytes());
    if answer["truncated"] == Value::Bool(true) {
        eprintln!("toolsrv bypass: the command's output was cut at 1 MiB per stream");
    }
    let code = answer["exit_code"].as_i64().unwrap_or(i64::from(FAILED));
    Ok(ExitCode::from(
        u8::try_from(code.clamp(0, 255)).unwrap_or(FAILED),
    ))
}
