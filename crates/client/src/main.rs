//! `toolctl`: the toolsrv command line. `local` and `lint` work on this machine with no network; the
//! other commands go through a coordinator.

fn main() -> std::process::ExitCode {
    toolsrv_client::cli::main()
}
