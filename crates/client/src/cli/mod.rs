//! `toolctl`: command-line parsing and dispatch. A library module so that the `toolsrv` binary
//! can also run as `toolctl` (what `toolsrv up` links into its state directory).

mod call_args;
pub mod env_note;
pub mod exit;
mod find;
mod lint;
mod local;
mod mcp;
mod quote;
pub(crate) mod remote;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand};
use clap_complete::{ArgValueCompleter, CompleteEnv};
use remote::ConnArgs;

/// The toolsrv command line.
#[derive(Debug, Parser)]
#[command(
    name = "toolctl",
    version,
    about = "Inspect, lint and call toolsrv tools, here or on a fleet through a coordinator"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Work with a tools path on this machine, without a coordinator
    #[command(subcommand)]
    Local(LocalCommand),
    /// Report every problem in the .meta files of the given files, directories or tools paths
    Lint {
        /// `.meta` files, directories, or colon-separated tools paths
        #[arg(required = true)]
        paths: Vec<std::ffi::OsString>,
        /// Print one JSON object per problem instead of text
        #[arg(long)]
        json: bool,
    },
    /// List the hosts the coordinator knows, online or not
    Hosts {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print a JSON array
        #[arg(long)]
        json: bool,
    },
    /// List the tools a host offers and what the policy lets you do with each (`--all` adds
    /// hidden ones with the reason)
    Tools {
        #[command(flatten)]
        conn: ConnArgs,
        /// Host id
        #[arg(add = ArgValueCompleter::new(remote::complete::hosts))]
        host: String,
        /// Also list tools hidden on the host, with the reason
        #[arg(long)]
        all: bool,
        /// Print a JSON array
        #[arg(long)]
        json: bool,
    },
    /// Print a tool's model-facing definition, as a host resolves it, as JSON
    Describe {
        #[command(flatten)]
        conn: ConnArgs,
        /// Host id
        #[arg(add = ArgValueCompleter::new(remote::complete::hosts))]
        host: String,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::tools))]
        tool: String,
    },
    /// Run a tool on a host: live stdout and stderr, then exit with the tool's exit code
    #[command(after_long_help = CALL_EXIT_CODES)]
    Call {
        #[command(flatten)]
        conn: ConnArgs,
        /// Host id
        #[arg(add = ArgValueCompleter::new(remote::complete::hosts))]
        host: String,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::tools))]
        tool: String,
        #[arg(value_name = "ARGS", help = call_args::HELP, add = ArgValueCompleter::new(remote::complete::args))]
        args: Vec<String>,
        /// Working directory on the host, readable to the call (default: the call's own private
        /// directory, made for it and removed after)
        #[arg(long)]
        cwd: Option<String>,
        /// Timeout in seconds, fractions allowed (default: the agent's)
        #[arg(long, allow_negative_numbers = true)]
        timeout: Option<f64>,
        /// Print the final tool result (`{"content": [...]}`) as JSON instead of streaming stdout
        #[arg(long)]
        result: bool,
        #[command(flatten)]
        answer: AnswerArgs,
    },
    /// Run a tool on every host a selector picks: output prefixed by host, then a summary
    ///
    /// Exits 0 when every targeted host ended OK, 1 otherwise (or when no host matched).
    Fanout {
        #[command(flatten)]
        conn: ConnArgs,
        /// Comma-separated terms, all of which must hold: `all`, a host id or glob (`web-*`),
        /// a label (`role=db`) or a fact (`os=linux`, `arch=arm64`)
        #[arg(add = ArgValueCompleter::new(remote::complete::selectors))]
        selector: String,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::tools))]
        tool: String,
        #[arg(value_name = "ARGS", help = call_args::HELP, add = ArgValueCompleter::new(remote::complete::args))]
        args: Vec<String>,
        /// Working directory on each host (default: the agents')
        #[arg(long)]
        cwd: Option<String>,
        /// Per-host timeout in seconds, fractions allowed (default: the agents')
        #[arg(long, allow_negative_numbers = true)]
        timeout: Option<f64>,
        /// Most hosts running at once (0: no limit)
        #[arg(long, default_value_t = 0)]
        concurrency: u32,
        /// Start no more hosts once more than this many have failed (0: no limit)
        #[arg(long, default_value_t = 0)]
        max_errors: u32,
        /// Print one JSON object per line per event instead of text
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        answer: AnswerArgs,
    },
    /// Join tokens: enroll a host without handing it a certificate (administrators only)
    #[command(subcommand)]
    Token(TokenCommand),
    /// The pending approval requests this identity may decide: calls the policy marks
    /// `approve`, and commands a confined tool asks to run outside its sandbox (bypass)
    Approvals {
        #[command(flatten)]
        conn: ConnArgs,
        /// Only this request, with its arguments whole (the list cuts them at 4 KiB)
        #[arg(long, value_name = "ID")]
        id: Option<String>,
        /// Print a JSON array (with --id: one object)
        #[arg(long)]
        json: bool,
    },
    /// Approve one pending request (its id from `toolctl approvals`); the call it holds runs
    Approve {
        #[command(flatten)]
        conn: ConnArgs,
        /// The request id
        id: String,
        /// Why, for the caller and the audit log
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Deny one pending request; the call it holds ends as denied
    Deny {
        #[command(flatten)]
        conn: ConnArgs,
        /// The request id
        id: String,
        /// Why, for the caller and the audit log
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Revoke an identity (administrators): every certificate naming it is refused from now on
    /// and its open connections are closed within seconds
    ///
    /// IDENTITY is `agent/<host-id>` or `client/<name>`. The coordinator keeps the revocation
    /// in its --state-dir, or with replicas in etcd (and refuses with neither). `--undo` lifts
    /// it, as `unrevoke` does.
    Revoke {
        #[command(flatten)]
        conn: ConnArgs,
        /// `agent/<host-id>` or `client/<name>`
        identity: String,
        /// Why, for the record, the audit log and the refusal the identity gets
        #[arg(long, default_value = "")]
        reason: String,
        /// Lift the revocation instead
        #[arg(long, conflicts_with = "reason")]
        undo: bool,
    },
    /// Lift the revocation of an identity (administrators)
    Unrevoke {
        #[command(flatten)]
        conn: ConnArgs,
        /// `agent/<host-id>` or `client/<name>`
        identity: String,
    },
    /// The revoked identities (administrators)
    Revocations {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print a JSON array of {identity, reason, revoked_by, revoked_unix_ms}
        #[arg(long)]
        json: bool,
    },
    /// Hold one connection to the coordinator and serve it on a control socket (`--control`)
    ///
    /// Serves on the default socket when `--control` (TOOLSRV_CONTROL) is not given or is
    /// `default`. The other remote commands given the same `--control` then go through it, with
    /// no TCP, TLS or HTTP/2 set-up of their own, and need no certificate. Runs until Ctrl-C or
    /// SIGTERM, or until `--idle-exit` seconds pass with no client.
    Master {
        #[command(flatten)]
        conn: ConnArgs,
        /// Exit after this many seconds with no client connected (fractions allowed)
        #[arg(long, value_name = "SECS")]
        idle_exit: Option<f64>,
    },
    /// Rank the tools the hosts of a selector offer against a request in plain language
    ///
    /// Prints the best matches first (score, tool, hosts, description), only tools the policy
    /// lets you call on those hosts; a description ends with `[waits for approval by ...]`
    /// where calls wait for someone's approval. Exits 1 when nothing matches (printing `[]`
    /// with --json), as grep does.
    Find {
        #[command(flatten)]
        conn: ConnArgs,
        /// Which hosts' tools to rank: a host id, `all`, or a selector as for fanout
        #[arg(add = ArgValueCompleter::new(remote::complete::selectors))]
        selector: String,
        /// What the tool should do, in plain language
        query: String,
        /// Most matches to print (1 to 1000)
        #[arg(long, default_value_t = 5)]
        limit: u32,
        /// Print a JSON array, best first
        #[arg(long)]
        json: bool,
    },
    /// Sessions on the coordinator: the tools loaded for one model on a set of hosts
    #[command(subcommand)]
    Session(SessionCommand),
    /// Serve a session's tools to an MCP client, over stdio (or streamable HTTP with --http)
    ///
    /// Opens a session on the coordinator from --profile and serves its loaded tools, plus
    /// `tool_search` and `tool_load`, to one MCP client on stdin/stdout (revisions 2026-07-28
    /// and 2025-11-25). When the session's hosts are several, every tool takes a required
    /// `target_host` argument naming the host to run on. Closes the session on exit.
    Mcp(mcp::McpArgs),
    /// Print catalog and fleet changes as they happen, until Ctrl-C
    Watch {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print one JSON object per line
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum SessionCommand {
    /// Open a session from a profile and print its id; it lives on the coordinator until it
    /// is closed, or until no `watch` has been attached for the idle time
    Open {
        #[command(flatten)]
        conn: ConnArgs,
        /// Profile file: {"autoLoad": ["tool", ...], "hosts": "SELECTOR", "maxLoaded": 40}
        #[arg(long, value_name = "FILE")]
        profile: Option<PathBuf>,
        /// Host selector, replacing the profile's `hosts`
        #[arg(long, value_name = "SELECTOR")]
        hosts: Option<String>,
        /// Print the session as a JSON object (with `id`) instead of the id alone
        #[arg(long)]
        json: bool,
    },
    /// Load a tool into a session (a full session unloads its coldest tool first)
    Load {
        #[command(flatten)]
        conn: ConnArgs,
        /// Session id
        #[arg(add = ArgValueCompleter::new(remote::complete::sessions))]
        id: String,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::session_tools))]
        tool: String,
        /// Print the session as JSON
        #[arg(long)]
        json: bool,
    },
    /// Unload a tool from a session
    Unload {
        #[command(flatten)]
        conn: ConnArgs,
        /// Session id
        #[arg(add = ArgValueCompleter::new(remote::complete::sessions))]
        id: String,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::session_tools))]
        tool: String,
        /// Print the session as JSON
        #[arg(long)]
        json: bool,
    },
    /// Print a session: its hosts and loaded tools
    Show {
        #[command(flatten)]
        conn: ConnArgs,
        /// Session id
        #[arg(add = ArgValueCompleter::new(remote::complete::sessions))]
        id: String,
        /// Print a JSON object with every loaded tool's definitions
        #[arg(long)]
        json: bool,
    },
    /// Print the session now and again after every change, until Ctrl-C or the session ends
    Watch {
        #[command(flatten)]
        conn: ConnArgs,
        /// Session id
        #[arg(add = ArgValueCompleter::new(remote::complete::sessions))]
        id: String,
        /// Print one JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// List this client's open sessions (with replicas, on every replica)
    List {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print a JSON array of sessions, each as `session show --json` prints it
        #[arg(long)]
        json: bool,
    },
    /// End a session now
    Close {
        #[command(flatten)]
        conn: ConnArgs,
        /// Session id
        #[arg(add = ArgValueCompleter::new(remote::complete::sessions))]
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum LocalCommand {
    /// List the tools this host offers (`--all` adds hidden ones with the reason)
    List {
        #[command(flatten)]
        tools: ToolsArgs,
        /// Also list tools hidden on this host, with the reason
        #[arg(long)]
        all: bool,
        /// Print a JSON array
        #[arg(long)]
        json: bool,
    },
    /// Print a tool's resolved model-facing definition as JSON
    Describe {
        #[command(flatten)]
        tools: ToolsArgs,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::local_tools))]
        name: String,
    },
    /// Rank the tools this host offers against a request in plain words, best first
    ///
    /// Exits 0 when a tool matched, 1 when none did (`--json` then prints `[]`), 64 on a bad
    /// command line, 78 when the `--model` directory is unusable.
    Find {
        #[command(flatten)]
        tools: ToolsArgs,
        /// What you want done, in your own words (at most 4096 bytes)
        query: String,
        /// Most tools listed, 1 to 1000
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
        /// Print a JSON array of `{name, score, lexical, semantic, description}`, best first
        #[arg(long)]
        json: bool,
        /// Directory of the sentence encoder, which also matches requests worded unlike the
        /// tools' texts (`scripts/fetch-find-model [--model NAME] DIR` lays it out); without
        /// it, words only
        #[arg(long, env = "TOOLSRV_FIND_MODEL", value_name = "DIR")]
        model: Option<PathBuf>,
        /// With --model: where the vectors of the tools' texts are kept between runs, so that
        /// the next `find` embeds only texts it has not seen [default:
        /// $XDG_CACHE_HOME/toolsrv/find-vectors, or ~/.cache/toolsrv/find-vectors]
        #[arg(long, env = "TOOLSRV_FIND_VECTORS", value_name = "DIR")]
        vectors: Option<PathBuf>,
        /// With --model: keep no vectors, embed every text again (whatever --vectors or
        /// TOOLSRV_FIND_VECTORS say)
        #[arg(long)]
        no_vectors: bool,
    },
    /// Run a tool here: live stdout and stderr, then exit with the tool's exit code
    Call {
        #[command(flatten)]
        tools: ToolsArgs,
        /// Tool name
        #[arg(add = ArgValueCompleter::new(remote::complete::local_tools))]
        name: String,
        #[arg(value_name = "ARGS", help = call_args::HELP, add = ArgValueCompleter::new(remote::complete::local_args))]
        args: Vec<String>,
        /// Working directory of the call (default: the current directory)
        #[arg(long)]
        cwd: Option<PathBuf>,
        /// Timeout in seconds (fractions allowed)
        #[arg(long, default_value_t = 60.0, allow_negative_numbers = true)]
        timeout: f64,
        /// Most bytes of stdout and stderr together before output is cut
        #[arg(long, default_value_t = toolsrv_exec::DEFAULT_OUTPUT_CAP)]
        output_cap: u64,
        /// Print the final tool result (`{"content": [...]}`) as JSON instead of streaming stdout
        #[arg(long)]
        result: bool,
    },
}

/// How `call` and `fanout` answer the approval requests the caller may decide (the policy's
/// `"effect": "approve"` without other approvers). Without either flag they ask on the
/// terminal, and deny when there is none.
#[derive(Debug, Args)]
struct AnswerArgs {
    /// Approve, without asking, every approval request of this command that the caller may decide
    #[arg(long, conflicts_with = "deny")]
    approve: bool,
    /// Deny, without asking, every approval request of this command that the caller may decide
    #[arg(long)]
    deny: bool,
}

impl AnswerArgs {
    fn answer(&self) -> remote::Answer {
        match (self.approve, self.deny) {
            (true, _) => remote::Answer::Approve,
            (_, true) => remote::Answer::Deny,
            _ => remote::Answer::Ask,
        }
    }
}

/// Where the tools are and which host to evaluate them as.
#[derive(Debug, Args)]
struct ToolsArgs {
    /// Colon-separated list of tool directories; the first wins a name clash. Needed, here or
    /// in the environment
    #[arg(long, env = "OLLIE_TOOLS_PATH", value_name = "PATH")]
    tools: Option<std::ffi::OsString>,
    /// Evaluate `os` and `arch` as another host would: `os=darwin,arch=arm64` (Go vocabulary).
    /// `binary`, `file`, `env` and `nenv` keys are still checked on this machine, so a variant
    /// that needs a binary this machine lacks does not match even as another OS
    #[arg(long = "as", value_name = "FACTS")]
    as_host: Option<String>,
}

/// `toolctl call --help`: how each way a call can end becomes an exit code (see `exit.rs`).
const CALL_EXIT_CODES: &str = "\
Exit codes:
  the tool's own code   the tool ran (128+N when killed by signal N)
  124  timed_out         65  invalid_args       69  hidden (or its .meta is invalid)
  126  failed_to_start   127 unknown_tool or unknown_host
  75   offline, lost, busy (a per-client quota is full), or the coordinator is unreachable
  77   denied, or our certificate is refused
  78   unusable TLS files    64  bad command line or request (arguments over 1 MiB, ...)
  130  interrupted (Ctrl-C cancels the call)";

/// The environment variable that asks `toolctl` for shell completion.
pub const COMPLETE_VAR: &str = "TOOLCTL_COMPLETE";

/// `toolctl`'s `main`: parses the command line of this process and runs it.
/// Writes `text` and a newline on stdout, as `println!` would, without its panic when stdout is
/// gone: a reader that stopped early (`| head`, `| true`) gets what it read, and toolctl ends as
/// the command would have, not with a panic and exit 101.
pub(crate) fn say_out(text: impl std::fmt::Display) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{text}").and_then(|()| stdout.flush());
}

pub fn main() -> ExitCode {
    // `toolctl local call` runs tools: nothing toolctl inherited reaches them.
    if let Err(e) = toolsrv_host::close_inherited_on_exec() {
        quote::say(format!(
            "cannot mark inherited descriptors close-on-exec: {e}"
        ));
    }
    toolsrv_tls::install_crypto_provider();
    use std::io::IsTerminal;
    let filter = match std::env::var("TOOLCTL_LOG") {
        Err(std::env::VarError::NotPresent) => "warn".into(),
        Ok(text) => tracing_subscriber::EnvFilter::try_new(&text).unwrap_or_else(|e| {
            quote::say(format!(
                "TOOLCTL_LOG={}: {e}; logging warnings only",
                quote::quoted(&text)
            ));
            "warn".into()
        }),
        Err(std::env::VarError::NotUnicode(_)) => {
            quote::say("TOOLCTL_LOG is not UTF-8; logging warnings only");
            "warn".into()
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_writer(std::io::stderr)
        .init();
    // `TOOLCTL_COMPLETE=bash toolctl` prints the shell's completion script, and the script runs
    // `toolctl` with that variable set to complete a word: that answer is all such a run prints.
    // (Not clap's usual `COMPLETE`: a variable that generic may be set for something else.)
    CompleteEnv::with_factory(Cli::command)
        .var(COMPLETE_VAR)
        .bin("toolctl")
        .complete();
    // A bad command line exits with the documented usage code, not clap's 2; help and version
    // are not errors.
    let args = match Cli::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
            if let Some(note) = env_note::note(&Cli::command(), &argv, &e) {
                eprintln!("{note}");
            }
            return if e.use_stderr() {
                ExitCode::from(exit::USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    // One command, one call: a single-threaded runtime starts faster than a pool of workers,
    // which matters for scripts that run toolctl once per call.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("toolctl: cannot start the async runtime: {e}");
            return ExitCode::from(exit::INTERNAL);
        }
    };
    runtime.block_on(run(args))
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Create a one-time join token for a host and print it alone on stdout (the CA pin and
    /// the agent's command line go to stderr); `toolsrv agent --join TOKEN` enrolls the host
    Create {
        #[command(flatten)]
        conn: ConnArgs,
        /// The host id the certificate will name
        #[arg(long, value_name = "ID")]
        host_id: String,
        /// How long the token may be used (`1h`, `30m`, `7d`; at most 30 days) [default: 1h]
        #[arg(long, value_name = "DURATION")]
        ttl: Option<String>,
        /// A label to bind to the host's certificate, KEY=VALUE: a trusted label, which policy
        /// rules may match; repeatable
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
    },
    /// List the join tokens the coordinator keeps (by id; the tokens themselves are not kept):
    /// host, labels, who created them, expiry, and whether used, expired or revoked
    List {
        #[command(flatten)]
        conn: ConnArgs,
        /// Print a JSON array instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Revoke a join token that was not used yet, by its id (`token list`; at least 8 digits)
    Revoke {
        #[command(flatten)]
        conn: ConnArgs,
        /// The token's id
        id: String,
    },
}

/// Runs the parsed command and returns the process exit code.
pub async fn run(cli: Cli) -> ExitCode {
    let code = match cli.command {
        Command::Lint { paths, json } => lint::run(&paths, json),
        Command::Local(LocalCommand::List { tools, all, json }) => local::list(&tools, all, json),
        Command::Local(LocalCommand::Describe { tools, name }) => local::describe(&tools, &name),
        Command::Local(LocalCommand::Find {
            tools,
            query,
            limit,
            json,
            model,
            vectors,
            no_vectors,
        }) => {
            let vectors = if no_vectors {
                None
            } else {
                vectors.or_else(find::default_vectors_dir)
            };
            find::run(
                &tools,
                &query,
                usize::from(limit),
                json,
                model.as_deref(),
                vectors.as_deref(),
            )
        }
        Command::Local(LocalCommand::Call {
            tools,
            name,
            args,
            cwd,
            timeout,
            output_cap,
            result,
        }) => {
            let opts = local::CallOptions {
                cwd,
                timeout,
                output_cap,
                print_result: result,
            };
            local::call(&tools, &name, &args, opts).await
        }
        Command::Hosts { conn, json } => remote::hosts(&conn, json).await,
        Command::Tools {
            conn,
            host,
            all,
            json,
        } => remote::tools(&conn, &host, all, json).await,
        Command::Describe { conn, host, tool } => remote::describe(&conn, &host, &tool).await,
        Command::Call {
            conn,
            host,
            tool,
            args,
            cwd,
            timeout,
            result,
            answer,
        } => {
            let opts = remote::CallOptions {
                cwd,
                timeout,
                print_result: result,
                answer: answer.answer(),
            };
            remote::call(&conn, &host, &tool, &args, opts).await
        }
        Command::Fanout {
            conn,
            selector,
            tool,
            args,
            cwd,
            timeout,
            concurrency,
            max_errors,
            json,
            answer,
        } => {
            let opts = remote::FanOutOptions {
                cwd,
                timeout,
                concurrency,
                max_errors,
                json,
                answer: answer.answer(),
            };
            remote::fan_out(&conn, &selector, &tool, &args, opts).await
        }
        Command::Token(TokenCommand::Create {
            conn,
            host_id,
            ttl,
            labels,
        }) => remote::token::create(&conn, &host_id, ttl.as_deref(), &labels).await,
        Command::Token(TokenCommand::List { conn, json }) => remote::token::list(&conn, json).await,
        Command::Token(TokenCommand::Revoke { conn, id }) => {
            remote::token::revoke(&conn, &id).await
        }
        Command::Approvals { conn, id, json } => match id {
            Some(id) => remote::approval(&conn, &id, json).await,
            None => remote::approvals(&conn, json).await,
        },
        Command::Approve { conn, id, reason } => remote::decide(&conn, &id, true, &reason).await,
        Command::Deny { conn, id, reason } => remote::decide(&conn, &id, false, &reason).await,
        Command::Revoke {
            conn,
            identity,
            reason,
            undo,
        } => {
            if undo {
                remote::unrevoke(&conn, &identity).await
            } else {
                remote::revoke(&conn, &identity, &reason).await
            }
        }
        Command::Unrevoke { conn, identity } => remote::unrevoke(&conn, &identity).await,
        Command::Revocations { conn, json } => remote::revocations(&conn, json).await,
        Command::Mcp(args) => {
            let code = mcp::run(args).await;
            // The stdio transport reads stdin on a thread of its own, which a client that keeps
            // stdin open (or a signal) leaves blocked in read(2): the runtime would wait for it
            // when it shuts down. Everything is done by now: exit.
            use std::io::Write;
            let _ = std::io::stdout().flush();
            std::process::exit(i32::from(code));
        }
        Command::Watch { conn, json } => remote::watch(&conn, json).await,
        Command::Find {
            conn,
            selector,
            query,
            limit,
            json,
        } => remote::find(&conn, &selector, &query, limit, json).await,
        Command::Session(command) => session(command).await,
        Command::Master { conn, idle_exit } => remote::master(&conn, idle_exit).await,
    };
    ExitCode::from(code)
}

async fn session(command: SessionCommand) -> u8 {
    use remote::sessions;
    match command {
        SessionCommand::Open {
            conn,
            profile,
            hosts,
            json,
        } => sessions::open(&conn, profile.as_deref(), hosts.as_deref(), json).await,
        SessionCommand::Load {
            conn,
            id,
            tool,
            json,
        } => sessions::load(&conn, &id, &tool, false, json).await,
        SessionCommand::Unload {
            conn,
            id,
            tool,
            json,
        } => sessions::load(&conn, &id, &tool, true, json).await,
        SessionCommand::Show { conn, id, json } => sessions::show(&conn, &id, json).await,
        SessionCommand::Watch { conn, id, json } => sessions::watch(&conn, &id, json).await,
        SessionCommand::Close { conn, id } => sessions::close(&conn, &id).await,
        SessionCommand::List { conn, json } => sessions::list(&conn, json).await,
    }
}

/// The exit code after writing a command's output: a closed pipe (`| head`) is not an error.
/// The longest `--timeout` taken: a year.
const MAX_TIMEOUT_SECS: f64 = 365.0 * 86_400.0;

/// A `--timeout` in seconds as a duration, or what is wrong with it: not a positive number,
/// under a millisecond, or over [`MAX_TIMEOUT_SECS`] (a value that large or small is shown
/// short).
pub fn timeout_secs(secs: f64) -> Result<std::time::Duration, String> {
    let shown = if secs.is_finite() && secs != 0.0 && !(1e-3..1e9).contains(&secs.abs()) {
        format!("{secs:e}")
    } else {
        secs.to_string()
    };
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!(
            "--timeout {shown}: must be a positive number of seconds"
        ));
    }
    if secs < 0.001 {
        return Err(format!(
            "--timeout {shown}: under a millisecond, the shortest timeout"
        ));
    }
    if secs > MAX_TIMEOUT_SECS {
        return Err(format!(
            "--timeout {shown}: over a year ({MAX_TIMEOUT_SECS} s), the longest timeout"
        ));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

pub fn written(result: std::io::Result<()>, what: &str) -> u8 {
    match result {
        Ok(()) => 0,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
        Err(e) => {
            eprintln!("toolctl: cannot write {what}: {e}");
            exit::INTERNAL
        }
    }
}

/// Writes `value` as pretty JSON and a newline, for a terminal as much as for a program.
pub fn write_json(out: &mut impl Write, value: &impl serde::Serialize) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::from)?;
    out.write_all(json_for_terminals(&text).as_bytes())?;
    writeln!(out)
}

/// JSON text with every character that would disguise it on a terminal written as a `\uXXXX`
/// escape: the same JSON value, shown as it is. Serde escapes the C0 controls inside strings;
/// direction overrides, zero-width characters and C1 controls it leaves raw, and a tool's
/// description (a host-only tool's is its host's word) may hold them.
fn json_for_terminals(text: &str) -> std::borrow::Cow<'_, str> {
    use std::fmt::Write as _;
    let hides = |c: char| c != '\n' && toolsrv_proto::text::disguises(c);
    if !text.chars().any(hides) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if hides(c) {
            for unit in c.encode_utf16(&mut [0; 2]) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        } else {
            out.push(c);
        }
    }
    out.into()
}

/// Prints a tool listing, the same for `local list` and `tools`: a JSON array of entries, or a
/// text table (visible tools with description and chosen variant, hidden ones with the reason).
pub fn print_listing(entries: &[crate::shape::Listed<'_>], json: bool) -> u8 {
    let mut out = std::io::stdout().lock();
    let result = if json {
        write_json(&mut out, &entries)
    } else {
        write_listing(&mut out, entries)
    };
    written(result, "the tool list")
}

fn write_listing(
    out: &mut impl Write,
    entries: &[crate::shape::Listed<'_>],
) -> std::io::Result<()> {
    // An invalid tool is listed under its file's name, which can hold anything.
    let names: Vec<String> = entries
        .iter()
        .map(|e| quote::printable(e.entry.name))
        .collect();
    let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(0);
    for (listed, name) in entries.iter().zip(&names) {
        let e = &listed.entry;
        let own = if e.host_only { " [host-only]" } else { "" };
        if e.visible {
            let variant = e
                .variant
                .map(|i| format!(" [variant {i}]"))
                .unwrap_or_default();
            let desc = quote::printable(e.description.unwrap_or(""));
            // The approvers are the policy file's globs, quoted like any text from afar.
            let policy = listed
                .policy
                .as_ref()
                .and_then(|p| p.note())
                .map(|n| format!(" {}", quote::printable(&n)))
                .unwrap_or_default();
            writeln!(out, "{name:width$}  {desc}{variant}{own}{policy}")?;
        } else {
            let reason = quote::printable(e.reason.unwrap_or(""));
            writeln!(out, "{name:width$}  (hidden) {reason}{own}")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    #[test]
    fn json_for_terminals_is_the_same_value_with_nothing_hidden() {
        let value = serde_json::json!({"d": "a\u{202e}b\u{1b}[2J\u{85}c\u{200b}\n"});
        let mut out = Vec::new();
        super::write_json(&mut out, &value).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains(r"a\u202eb\u001b[2J\u0085c\u200b\n"), "{text}");
        assert!(
            !text
                .chars()
                .any(|c| c != '\n' && toolsrv_proto::text::disguises(c))
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            value
        );
    }
}
