//! `toolsrv`: runs a coordinator, an agent, both at once (`up`), or manages a development PKI;
//! started under the name `toolctl`, it is the client command line.

mod bypass;
mod cli;
mod config;
mod examples;
mod policy_check;
mod up;

use std::process::ExitCode;

fn main() -> ExitCode {
    // `toolsrv up` links `<state>/bin/toolctl` to this binary, so that the commands it prints
    // work before anything else is built or installed: called by that name, this is toolctl.
    if invoked_as("toolctl") {
        return toolsrv_client::cli::main();
    }
    // Nothing this process inherited reaches the tools an agent runs.
    if let Err(e) = toolsrv_confine::close_inherited_on_exec() {
        eprintln!("toolsrv: cannot mark inherited descriptors close-on-exec: {e}");
    }
    toolsrv_tls::install_crypto_provider();
    // Flags, environment and the `--config` file; `--print-config` and a bad file end here.
    let cli = match config::parse_command_line() {
        config::Start::Run(cli) => cli,
        config::Start::Exit(code) => return code,
    };
    if let Some(args) = cli.bypass() {
        return bypass::run(args);
    }
    if let Some(args) = cli.policy_check() {
        return policy_check::run(args);
    }
    cli::init_logging(&cli.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("toolsrv: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(*cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Each cause once: most errors here say their cause in their own words too.
            eprintln!("toolsrv: {}", toolsrv_tls::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// True when this process was started under the file name `name` (argv[0]).
fn invoked_as(name: &str) -> bool {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .is_some_and(|argv0| argv0.file_name().is_some_and(|f| f == name))
}
