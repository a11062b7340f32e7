//! Command-line parsing and dispatch for `toolctl`.

pub mod exit;
mod lint;
mod local;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// The toolsrv command line.
#[derive(Debug, Parser)]
#[command(
    name = "toolctl",
    version,
    about = "Inspect, lint and call toolsrv tools"
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
        paths: Vec<String>,
        /// Print one JSON object per problem instead of text
        #[arg(long)]
        json: bool,
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
        name: String,
    },
    /// Run a tool here: live stdout and stderr, then exit with the tool's exit code
    Call {
        #[command(flatten)]
        tools: ToolsArgs,
        /// Tool name
        name: String,
        /// Arguments as a JSON object, or `-` to read them from stdin (default `{}`)
        args: Option<String>,
        /// Working directory of the call (default: the current directory)
        #[arg(long)]
        cwd: Option<PathBuf>,
        /// Timeout in seconds (fractions allowed)
        #[arg(long, default_value_t = 60.0)]
        timeout: f64,
        /// Most bytes of stdout and stderr together before output is cut
        #[arg(long, default_value_t = toolsrv_exec::DEFAULT_OUTPUT_CAP)]
        output_cap: u64,
        /// Print the final tool result (`{"content": [...]}`) as JSON instead of streaming stdout
        #[arg(long)]
        result: bool,
    },
}

/// Where the tools are and which host to evaluate them as.
#[derive(Debug, Args)]
struct ToolsArgs {
    /// Colon-separated list of tool directories; the first wins a name clash
    #[arg(long, env = "OLLIE_TOOLS_PATH", value_name = "PATH")]
    tools: String,
    /// Evaluate variants as another host: `os=darwin,arch=arm64` (Go vocabulary)
    #[arg(long = "as", value_name = "FACTS")]
    as_host: Option<String>,
}

/// Runs the parsed command and returns the process exit code.
pub async fn run(cli: Cli) -> ExitCode {
    let code = match cli.command {
        Command::Lint { paths, json } => lint::run(&paths, json),
        Command::Local(LocalCommand::List { tools, all, json }) => local::list(&tools, all, json),
        Command::Local(LocalCommand::Describe { tools, name }) => local::describe(&tools, &name),
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
            local::call(&tools, &name, args.as_deref(), opts).await
        }
    };
    ExitCode::from(code)
}
