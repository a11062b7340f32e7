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
    // An agent starts this binary again by this name to end its calls if it is killed outright.
    if invoked_as(toolsrv_confine::warden::ARG0) {
        cli::init_logging(&cli::LogArgs::of_warden());
        return toolsrv_confine::warden::main();
    }
    // Nothing this process inherited reaches the tools an agent runs.
    if let Err(e) = toolsrv_confine::close_inherited_on_exec() {
        eprintln!("toolsrv: cannot mark inherited descriptors close-on-exec: {e}");
    }
    hide_join_token();
    toolsrv_tls::install_crypto_provider();
    // Flags, environment and the `--config` file; `--print-config` and a bad file end here.
    let cli = match config::parse_command_line() {
        config::Start::Run(cli) => cli,
        config::Start::Exit(code) => return code,
    };
    // Read: from now on the join token lives in this process's memory only. The environment
    // block it came in is what /proc/PID/environ shows every process of this user, a tool
    // running as root included; no thread but this one runs yet.
    toolsrv_confine::scrub_env_value(c"TOOLSRV_JOIN_TOKEN");
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

/// An agent given its join token on the command line (`--join TOKEN`) starts itself again at
/// once with the token in its environment (`TOOLSRV_JOIN_TOKEN`) instead: the command line of
/// every process is readable by every user of the host (`ps`, `/proc/PID/cmdline`), and an
/// agent that cannot reach its coordinator yet keeps retrying with the token for as long as
/// it takes, while its environment is readable by its own user and root only. Whoever read
/// the token in that time could join as the host, trusted labels and all. Returns (and the
/// agent goes on as it was started) when there is nothing to hide or it cannot start again.
fn hide_join_token() {
    use std::os::unix::process::CommandExt;
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let Some((rest, token)) = without_join_token(&args) else {
        return;
    };
    eprintln!(
        "toolsrv: the join token was given on the command line, which every user of this host \
         can read; starting again with it in TOOLSRV_JOIN_TOKEN (give it there yourself to \
         skip this)"
    );
    let error = std::process::Command::new(cli::SELF_EXE)
        .arg0(&args[0])
        .args(&rest[1..])
        .env("TOOLSRV_JOIN_TOKEN", token)
        .exec();
    eprintln!("toolsrv: cannot start again without the token on the command line: {error}");
}

/// `args` without the value of `--join` of the `agent` role, and that value; `None` when the
/// token is not on the command line.
fn without_join_token(
    args: &[std::ffi::OsString],
) -> Option<(Vec<std::ffi::OsString>, std::ffi::OsString)> {
    // The role is the first word that is neither a global flag nor a global flag's value.
    let mut words = args.iter().skip(1);
    let role = loop {
        let word = words.next()?;
        match word.to_str() {
            Some("--log-level" | "--log-format") => {
                words.next()?;
            }
            Some(flag) if flag.starts_with('-') => {}
            _ => break word,
        }
    };
    if role != "agent" {
        return None;
    }
    let mut rest = Vec::with_capacity(args.len());
    let mut token = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if arg == "--" {
            rest.push(arg.clone());
            rest.extend(it.cloned());
            break;
        }
        if token.is_none() && arg == "--join" {
            token = Some(it.next()?.clone());
        } else if let Some(value) = arg
            .to_str()
            .and_then(|a| a.strip_prefix("--join="))
            .filter(|_| token.is_none())
        {
            token = Some(value.into());
        } else {
            rest.push(arg.clone());
        }
    }
    Some((rest, token?))
}

/// True when this process was started under the file name `name` (argv[0]).
fn invoked_as(name: &str) -> bool {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .is_some_and(|argv0| argv0.file_name().is_some_and(|f| f == name))
}

#[cfg(test)]
mod tests {
    use super::without_join_token;

    fn args(line: &str) -> Vec<std::ffi::OsString> {
        line.split(' ').map(Into::into).collect()
    }

    #[test]
    fn the_join_token_is_taken_out_of_an_agents_command_line_only() {
        let (rest, token) =
            without_join_token(&args("toolsrv agent --join T0K --state-dir /s")).unwrap();
        assert_eq!(rest, args("toolsrv agent --state-dir /s"));
        assert_eq!(token, "T0K");
        let (rest, token) = without_join_token(&args("toolsrv agent --join=T0K")).unwrap();
        assert_eq!(rest, args("toolsrv agent"));
        assert_eq!(token, "T0K");
        assert!(without_join_token(&args("toolsrv agent --state-dir /s")).is_none());
        assert!(without_join_token(&args("toolsrv coordinator --join T0K")).is_none());
        // Global flags may come before the role.
        let (rest, token) =
            without_join_token(&args("toolsrv --log-level info agent --join T0K")).unwrap();
        assert_eq!(rest, args("toolsrv --log-level info agent"));
        assert_eq!(token, "T0K");
        let (rest, _) =
            without_join_token(&args("toolsrv --log-format=json agent --join=T0K")).unwrap();
        assert_eq!(rest, args("toolsrv --log-format=json agent"));
        // A missing value is left for the flag parser to explain.
        assert!(without_join_token(&args("toolsrv agent --join")).is_none());
    }
}
