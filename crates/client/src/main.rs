//! `toolctl`: the toolsrv command line. `local` and `lint` work on this machine with no network; the
//! other commands go through a coordinator.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    toolsrv_tls::install_crypto_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TOOLCTL_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // A bad command line exits with the documented usage code, not clap's 2; help and version
    // are not errors.
    let args = match cli::Cli::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(cli::exit::USAGE)
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
            return ExitCode::from(cli::exit::INTERNAL);
        }
    };
    runtime.block_on(cli::run(args))
}
