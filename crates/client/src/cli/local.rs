//! `toolctl local`: list, describe and call tools of a tools path on this machine.

use std::io::Write;
use std::path::PathBuf;

use tokio_util::sync::CancellationToken;
use toolsrv_exec::{Ending, Event, Exit, Stream};
use toolsrv_host::{CallError, CallRequest, Limits, ToolView};
use toolsrv_meta::{Host, Resolution, Severity};
use toolsrv_registry::{Catalog, Scanner, split_tools_path};

use super::exit;
use super::{ToolsArgs, call_args};

/// Scans the tools path once. A listing (`report_errors`) also reports rejected files on stderr;
/// a command about one tool does not, since refusing an invalid tool says what is wrong with it.
pub(super) fn load(tools: &ToolsArgs, report_errors: bool) -> Result<(Catalog, Host), u8> {
    let Some(path) = &tools.tools else {
        eprintln!(
            "toolctl: no tools path: give --tools DIR[:DIR...] or set OLLIE_TOOLS_PATH \
             (for example --tools examples/tools in a checkout)"
        );
        return Err(exit::USAGE);
    };
    let host = host_for(tools).map_err(|e| {
        super::quote::say(&e);
        exit::USAGE
    })?;
    let catalog = Scanner::new(split_tools_path(path)).scan();
    if report_errors {
        // Errors, and a directory of the path that cannot be read (a typo serves nothing, and
        // said nothing: `list` was empty, `call` an unknown tool).
        for d in catalog.diagnostics.iter().filter(|d| {
            d.severity == Severity::Error
                || (d.code == toolsrv_meta::Code::Io && std::fs::metadata(&d.file).is_err())
        }) {
            super::quote::say(d);
        }
    }
    Ok((catalog, host))
}

/// The catalog of `tools` and the host to resolve it for, printing nothing (shell completion);
/// `None` without a tools path or with bad `--as` facts.
pub(super) fn load_quietly(tools: &ToolsArgs) -> Option<(Catalog, Host)> {
    let path = tools.tools.as_ref()?;
    let host = host_for(tools).ok()?;
    Some((Scanner::new(split_tools_path(path)).scan(), host))
}

/// This machine as a host, with `--as` facts applied; the error names the facts.
fn host_for(tools: &ToolsArgs) -> Result<Host, String> {
    let mut host = Host::current();
    if let Some(facts) = &tools.as_host {
        apply_as(&mut host, facts).map_err(|e| format!("--as {facts}: {e}"))?;
    }
    Ok(host)
}

/// Applies `os=...,arch=...` to `host`.
fn apply_as(host: &mut Host, facts: &str) -> Result<(), String> {
    for pair in facts.split(',').filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(format!("`{pair}` is not KEY=VALUE"));
        };
        match key {
            "os" => host.os = value.to_string(),
            "arch" => host.arch = value.to_string(),
            other => {
                return Err(format!(
                    "unknown fact `{other}`: use os and arch (`binary`, `file` and `env` keys are \
                     always checked on this machine)"
                ));
            }
        }
    }
    Ok(())
}

pub fn list(tools: &ToolsArgs, all: bool, json: bool) -> u8 {
    // With `--all` the listing itself says what is wrong with each invalid file.
    let (catalog, host) = match load(tools, !all) {
        Ok(loaded) => loaded,
        Err(code) => return code,
    };
    let views: Vec<ToolView> = toolsrv_host::view(&catalog, &host)
        .into_iter()
        .filter(|v| all || v.resolution.tool().is_some())
        .collect();
    let entries: Vec<_> = views
        .iter()
        .map(|v| crate::shape::Listed::from(v.list_entry()))
        .collect();
    super::print_listing(&entries, json)
}

pub fn describe(tools: &ToolsArgs, name: &str) -> u8 {
    let (catalog, host) = match load(tools, false) {
        Ok(loaded) => loaded,
        Err(code) => return code,
    };
    let Some(entry) = catalog.tools.get(name) else {
        let e = toolsrv_host::unknown(&catalog, name);
        super::quote::say(&e);
        return call_error_code(&e);
    };
    match entry.meta.resolve(&host) {
        Resolution::Visible { tool, .. } => match serde_json::to_string_pretty(&tool) {
            Ok(text) => {
                super::say_out(text);
                0
            }
            Err(e) => {
                eprintln!("toolctl: cannot encode `{name}`: {e}");
                exit::INTERNAL
            }
        },
        // The reason quotes the `.meta` (a file a match names), which anyone who can write
        // to the tools path wrote.
        Resolution::Hidden { reason } => {
            super::quote::say(CallError::Hidden {
                name: name.to_string(),
                reason,
            });
            exit::HIDDEN
        }
    }
}

/// Options of `toolctl local call`.
#[derive(Debug)]
pub struct CallOptions {
    pub cwd: Option<PathBuf>,
    pub timeout: f64,
    pub output_cap: u64,
    pub print_result: bool,
}

pub async fn call(tools: &ToolsArgs, name: &str, args: &[String], opts: CallOptions) -> u8 {
    let args = match call_args::parse(args) {
        Ok(args) => args,
        Err(e) => {
            super::quote::say(&e);
            return exit::USAGE;
        }
    };
    let timeout = match super::timeout_secs(opts.timeout) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("toolctl: {e}");
            return exit::USAGE;
        }
    };
    let cwd = match opts.cwd.map(Ok).unwrap_or_else(std::env::current_dir) {
        Ok(cwd) => cwd,
        Err(e) => {
            eprintln!("toolctl: cannot determine the working directory: {e}");
            return exit::USAGE;
        }
    };
    let (catalog, host) = match load(tools, false) {
        Ok(loaded) => loaded,
        Err(code) => return code,
    };
    let limits = Limits {
        output_cap: opts.output_cap,
        max_timeout: timeout.max(Limits::default().max_timeout),
        ..Limits::default()
    };
    let string_keys = args.string_keys;
    let request = CallRequest {
        tool: name.to_string(),
        args: args.value,
        args_text: Some(args.text),
        cwd,
        timeout: Some(timeout),
    };
    let base_env: Vec<_> = std::env::vars_os().collect();
    let cancel = CancellationToken::new();
    let started = toolsrv_host::prepare(&catalog, &host, &request, &limits, &base_env)
        .and_then(|inv| toolsrv_host::start(name, inv, cancel.clone()));
    let mut execution = match started {
        Ok(execution) => execution,
        Err(e) => {
            super::quote::say(&e);
            if let Some(note) = call_args::string_note(&string_keys, &e.to_string()) {
                eprintln!("toolctl: {note}");
            }
            return call_error_code(&e);
        }
    };
    let interrupt = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                cancel.cancel();
            }
        })
    };
    let code = stream(&mut execution, name, opts.print_result).await;
    interrupt.abort();
    code
}

/// Copies the call's output to our stdout and stderr as it comes, then maps its outcome to an exit code.
async fn stream(execution: &mut toolsrv_exec::Execution, name: &str, print_result: bool) -> u8 {
    let (mut stdout, mut stderr) = (std::io::stdout(), std::io::stderr());
    while let Some(event) = execution.next().await {
        match event {
            Event::Output {
                stream: Stream::Stdout,
                data,
            } if !print_result => {
                // A reader that went away (`| head`) must not stop the tool mid-write with an error here.
                let _ = stdout.write_all(&data).and_then(|()| stdout.flush());
            }
            Event::Output {
                stream: Stream::Stdout,
                ..
            } => {}
            Event::Output {
                stream: Stream::Stderr,
                data,
            } => {
                let _ = stderr.write_all(&data);
            }
            Event::Finished(outcome) => {
                if print_result {
                    super::say_out(&outcome.result);
                }
                return match (outcome.ending, outcome.exit) {
                    (Ending::TimedOut, _) => {
                        eprintln!(
                            "toolctl: tool `{name}` timed out after {:.1?}",
                            outcome.duration
                        );
                        exit::TIMED_OUT
                    }
                    (Ending::Cancelled, _) => {
                        eprintln!("toolctl: tool `{name}` was cancelled");
                        exit::CANCELLED
                    }
                    (Ending::Exited, Exit::Code(c)) => u8::try_from(c).unwrap_or(1),
                    (Ending::Exited, Exit::Signal(s)) => {
                        128u8.saturating_add(u8::try_from(s).unwrap_or(127))
                    }
                };
            }
        }
    }
    eprintln!("toolctl: the call to `{name}` ended without a result");
    exit::INTERNAL
}

fn call_error_code(e: &CallError) -> u8 {
    match e {
        CallError::UnknownTool { .. } | CallError::NoCommand(_) => exit::NOT_FOUND,
        CallError::Hidden { .. } => exit::HIDDEN,
        CallError::InvalidArgs { .. } => exit::INVALID_ARGS,
        CallError::TimeoutTooLong { .. } => exit::USAGE,
        CallError::Spawn { .. } => exit::CANNOT_START,
    }
}
