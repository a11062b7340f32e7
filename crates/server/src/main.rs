//! `toolsrv`: runs a coordinator, an agent, both at once (`up`), or manages a development PKI.

mod cli;
mod examples;
mod up;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    toolsrv_tls::install_crypto_provider();
    let cli = cli::Cli::parse();
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
    match runtime.block_on(cli::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("toolsrv: {e:#}");
            ExitCode::FAILURE
        }
    }
}
