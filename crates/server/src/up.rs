//! `toolsrv up`: a whole system in one process for a first look or local development.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio_util::sync::CancellationToken;
use toolsrv_agent::AgentConfig;
use toolsrv_coordinator::CoordinatorConfig;
use toolsrv_registry::split_tools_path;
use toolsrv_tls::{Identity, PkiOptions, TlsFiles};

/// Host id of the agent `up` runs.
const LOCAL_HOST: &str = "local";
/// Client certificate `up` generates for `toolctl`.
const CLIENT: &str = "admin";

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where certificates, example tools and agent state live (reused across runs)
    #[arg(long, env = "TOOLSRV_STATE")]
    state: Option<PathBuf>,
    /// Address of the mTLS gRPC port
    #[arg(long, env = "TOOLSRV_LISTEN", default_value = "127.0.0.1:7443")]
    listen: SocketAddr,
    /// Tools path to serve instead of the example tools in the state directory. Without it,
    /// OLLIE_TOOLS_PATH is used when set (and `up` says so), else the example tools
    #[arg(long, value_name = "PATH")]
    tools: Option<std::ffi::OsString>,
    /// Sentence encoder for FindTools, `toolctl find` and MCP's `tool_search` (a directory with
    /// model.safetensors, tokenizer.json and config.json, as `scripts/fetch-find-model` lays it
    /// out): tools are then ranked by meaning as well as by words
    #[arg(long, env = "TOOLSRV_FIND_MODEL", value_name = "DIR")]
    find_model: Option<PathBuf>,
}

/// Where the tools come from, for the banner.
#[derive(Debug, PartialEq, Eq)]
enum ToolsSource {
    /// The example tools, written into the state directory.
    Examples,
    /// `--tools`.
    Flag,
    /// `OLLIE_TOOLS_PATH`, found in the environment.
    Environment,
}

fn default_state() -> PathBuf {
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("toolsrv/up")
}

pub async fn run(
    args: UpArgs,
    warden: toolsrv_confine::warden::WardenStart,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // A model directory without the model stops `up` before anything starts (the coordinator
    // would refuse it too, but only after the agent had begun connecting to it).
    if let Some(dir) = &args.find_model {
        toolsrv_coordinator::check_find_model(dir)?;
    }
    let state = args.state.unwrap_or_else(default_state);
    // Listen first: a second `up` fails here, before it touches the state directory.
    let hint = format!(
        "another `toolsrv up` may be running (its banner names the address), or another server \
         uses the port: stop it, or run a second one with --listen {} --state DIR (its own \
         port and state directory)",
        SocketAddr::new(args.listen.ip(), args.listen.port().wrapping_add(1).max(1))
    );
    let listener = crate::cli::bind(args.listen, &hint).await?;
    let addr = listener.local_addr()?;
    let url = format!("https://{addr}");
    let pki = state.join("pki");
    let mut opts = PkiOptions::new(&pki);
    opts.agents = vec![LOCAL_HOST.into()];
    opts.clients = vec![CLIENT.into()];
    toolsrv_tls::init(&opts).with_context(|| {
        format!(
            "cannot create development certificates in {}: check that the state directory is \
             writable, or pick another with --state",
            pki.display()
        )
    })?;
    // Not UTF-8 is still a path (it was taken for unset, and the examples served instead).
    let from_env = std::env::var_os("OLLIE_TOOLS_PATH").filter(|p| !p.is_empty());
    let (tools, source) = match (&args.tools, from_env) {
        (Some(path), _) => {
            // A mistyped directory would serve nothing and say so only in the coordinator's log.
            let dirs = split_tools_path(path);
            for dir in dirs.iter().filter(|dir| !dir.is_dir()) {
                tracing::warn!(dir = %dir.display(), "--tools names a directory that does not exist (or is no directory): it serves nothing until it does");
            }
            (dirs, ToolsSource::Flag)
        }
        (None, Some(path)) => {
            tracing::warn!(
                tools = %path.to_string_lossy(),
                "serving the tools of OLLIE_TOOLS_PATH from the environment instead of the \
                 example tools in the state directory; unset it to serve those"
            );
            (split_tools_path(&path), ToolsSource::Environment)
        }
        (None, None) => {
            let dir = state.join("tools");
            if crate::examples::install(&dir)
                .with_context(|| format!("cannot write example tools to {}", dir.display()))?
            {
                tracing::info!(dir = %dir.display(), "installed the example tools");
            }
            (vec![dir], ToolsSource::Examples)
        }
    };
    let bin = match link_binaries(&state.join("bin")) {
        Ok(bin) => Some(bin),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "cannot link toolctl into the state directory; put toolctl on PATH yourself (cargo install --path crates/client)");
            None
        }
    };
    let mut coordinator = CoordinatorConfig::new(
        tools.clone(),
        TlsFiles::in_dir(&pki, &Identity::Coordinator),
    );
    coordinator.find_model = args.find_model.clone();
    // Revocations, and the vectors of the tools' texts: a second `up` embeds only what changed.
    coordinator.state_dir = Some(state.join("coordinator"));
    let mut agent = AgentConfig::new(
        url.clone(),
        LOCAL_HOST,
        TlsFiles::in_dir(&pki, &Identity::Agent(LOCAL_HOST.into())),
        state.join("agent"),
    );
    agent.labels.insert("role".into(), "dev".into());
    agent.sandbox.warden = Some(warden);
    // The example system_logs tool reads the logs; calls are otherwise confined as on any agent.
    agent
        .sandbox
        .defaults
        .read
        .extend(["/var/log".into(), "/run/log/journal".into()]);
    // On a developer's machine, `python3` is often a version manager's shim (pyenv, asdf...),
    // which runs an interpreter under the manager's root: readable here, or the example tools fail.
    let home = std::env::var_os("HOME").map(PathBuf::from);
    for (shims, root) in toolsrv_agent::shim_roots(&toolsrv_agent::path_dirs(), home.as_deref()) {
        tracing::info!(
            shims = %shims.display(),
            root = %root.display(),
            "PATH holds a version manager's shims: the local agent's calls may read its root"
        );
        agent.sandbox.defaults.read.push(root);
    }
    // The example fix_perms runs `toolsrv bypass` inside its sandbox: the links come first on
    // the local agent's PATH, and its calls may read the binary they lead to.
    if let Some(bin) = &bin {
        agent.path_first.push(bin.clone());
        if let Ok(exe) = std::env::current_exe() {
            agent.sandbox.defaults.read.push(exe);
        }
    }
    let mut coordinator = tokio::spawn(toolsrv_coordinator::serve(
        coordinator,
        listener,
        Default::default(),
        shutdown.clone(),
    ));
    let mut agent = tokio::spawn(toolsrv_agent::run(agent, shutdown.clone()));
    // The banner comes once the local agent has reported its tools, so that the first command
    // it prints already sees the host. Whichever of the two ends first (an error, or shutdown)
    // stops the other.
    let client = TlsFiles::in_dir(&pki, &Identity::Client(CLIENT.into()));
    let mut ready = std::pin::pin!(local_agent_ready(&url, client, &shutdown));
    let mut banner_due = true;
    let (coordinator, agent) = loop {
        tokio::select! {
            ready = &mut ready, if banner_due => {
                banner_due = false;
                if !ready && !shutdown.is_cancelled() {
                    tracing::warn!(
                        "the local agent has not reported its tools after {} s; the commands \
                         below will see it once it does (the log above says what holds it up)",
                        READY_WAIT.as_secs()
                    );
                }
                if !shutdown.is_cancelled() {
                    println!(
                        "{}",
                        banner(&url, &pki, &tools, &source, &state, bin.as_deref(), args.find_model.as_deref())
                    );
                }
            }
            ended = &mut coordinator => {
                shutdown.cancel();
                break (ended, agent.await);
            }
            ended = &mut agent => {
                shutdown.cancel();
                break (coordinator.await, ended);
            }
        }
    };
    coordinator.context("coordinator task failed")??;
    agent.context("agent task failed")??;
    Ok(())
}

/// How long `up` waits for its agent before printing the banner anyway.
const READY_WAIT: Duration = Duration::from_secs(15);

/// Waits (at most [`READY_WAIT`]) until the local agent has attached and reported its tools, as
/// a client sees it. False when it has not by then, or on shutdown.
async fn local_agent_ready(url: &str, tls: TlsFiles, shutdown: &CancellationToken) -> bool {
    let ready = async {
        let opts = toolsrv_client::ConnectOptions {
            addr: url.to_string(),
            tls,
        };
        loop {
            if let Ok(client) = toolsrv_client::Client::connect(&opts).await
                && client.tools(LOCAL_HOST, false).await.is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::select! {
        ready = tokio::time::timeout(READY_WAIT, ready) => ready.unwrap_or(false),
        () = shutdown.cancelled() => false,
    }
}

/// The commands `up` prints after the settings, and the README's tour repeats: each works in
/// a second shell once the settings are exported.
pub const TOUR: &[(&str, &str)] = &[
    ("toolctl hosts", "the fleet: one host, `local`"),
    (
        "toolctl tools local --all",
        "what it offers, and what it hides and why",
    ),
    (
        "toolctl describe local disk_usage",
        "the definition a model sees, after variant resolution",
    ),
    (
        "toolctl call local env_info",
        "run it; output streams live, exit code is the tool's",
    ),
    (
        "toolctl fanout all disk_usage",
        "run it everywhere: per-host output and a status per host",
    ),
    (
        "toolctl watch",
        "registry and fleet changes as they happen, until Ctrl-C",
    ),
];

/// Makes `<bin>/toolctl` and `<bin>/toolsrv` links to this binary, which runs as `toolctl`
/// when called by that name: the commands `up` prints then work before anything else is built
/// or installed, and always match this server's version; the local agent's tools find
/// `toolsrv` there (`toolsrv bypass`). Returns `bin`.
fn link_binaries(bin: &Path) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot tell where this binary is")?;
    std::fs::create_dir_all(bin).with_context(|| format!("cannot create {}", bin.display()))?;
    for name in ["toolctl", "toolsrv"] {
        let link = bin.join(name);
        // Replaced in one step (a new link renamed over the old), so a command started
        // meanwhile finds either link, never none.
        let fresh = bin.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&fresh);
        std::os::unix::fs::symlink(&exe, &fresh)
            .and_then(|()| std::fs::rename(&fresh, &link))
            .with_context(|| format!("cannot link {} to {}", link.display(), exe.display()))?;
    }
    Ok(bin.to_path_buf())
}

/// A word as a shell reads it back: as it is when it holds nothing special, else quoted; in
/// `$'...'` (bash, zsh, POSIX 2024) with `\xHH` escapes when it holds bytes that are not UTF-8
/// or control characters, which no other quoting can carry through a terminal.
fn sh_word(word: impl AsRef<std::ffi::OsStr>) -> String {
    use std::os::unix::ffi::OsStrExt;
    let bytes = word.as_ref().as_bytes();
    let plain = !bytes.is_empty()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:,@%=".contains(b));
    match std::str::from_utf8(bytes) {
        _ if plain => String::from_utf8_lossy(bytes).into_owned(),
        Ok(text) if !text.chars().any(char::is_control) => {
            format!("'{}'", text.replace('\'', r"'\''"))
        }
        _ => {
            let mut out = String::from("$'");
            for chunk in bytes.utf8_chunks() {
                for c in chunk.valid().chars() {
                    match c {
                        '\\' | '\'' => {
                            out.push('\\');
                            out.push(c);
                        }
                        c if c.is_control() && c.is_ascii() => {
                            out.push_str(&format!("\\x{:02x}", c as u32));
                        }
                        c => out.push(c),
                    }
                }
                for b in chunk.invalid() {
                    out.push_str(&format!("\\x{b:02x}"));
                }
            }
            out.push('\'');
            out
        }
    }
}

/// What `up` prints once it listens: where everything is, then what to type in another shell,
/// as lines that work pasted as they are.
fn banner(
    url: &str,
    pki: &Path,
    tools: &[PathBuf],
    source: &ToolsSource,
    state: &Path,
    bin: Option<&Path>,
    find_model: Option<&Path>,
) -> String {
    let client = TlsFiles::in_dir(pki, &Identity::Client(CLIENT.into()));
    let tools: Vec<String> = tools.iter().map(|t| t.display().to_string()).collect();
    let tools = tools.join(":");
    let mut out = format!(
        "toolsrv is up: coordinator on {url} with a local agent `{LOCAL_HOST}`, tools from {tools}\n"
    );
    match find_model {
        Some(dir) => out.push_str(&format!(
            "`toolctl find` and MCP's tool_search rank tools by meaning, with the encoder in {}\n",
            dir.display()
        )),
        None => out.push_str(
            "`toolctl find` and MCP's tool_search rank tools by words (--find-model DIR adds \
             meaning; see the README)\n",
        ),
    }
    if *source == ToolsSource::Environment {
        out.push_str(&format!(
            "(from OLLIE_TOOLS_PATH in your environment, instead of the example tools in {}: \
             unset OLLIE_TOOLS_PATH to serve those)\n",
            state.join("tools").display()
        ));
    }
    out.push_str("\nIn another shell:\n\n");
    match bin {
        Some(bin) => out.push_str(&format!(
            "  export PATH={}:\"$PATH\"   # toolctl and toolsrv: this binary, linked under those names\n",
            sh_word(bin)
        )),
        None => out.push_str("  # put toolctl on PATH first: cargo install --path crates/client\n"),
    }
    for (name, path) in [
        ("TOOLSRV_ADDR", std::ffi::OsStr::new(url)),
        ("TOOLSRV_CA", client.ca.as_os_str()),
        ("TOOLSRV_CERT", client.cert.as_os_str()),
        ("TOOLSRV_KEY", client.key.as_os_str()),
    ] {
        out.push_str(&format!("  export {name}={}\n", sh_word(path)));
    }
    out.push('\n');
    let width = TOUR.iter().map(|(c, _)| c.len()).max().unwrap_or(0);
    for (command, what) in TOUR {
        out.push_str(&format!("  {command:width$}   # {what}\n"));
    }
    out.push_str("\nCtrl-C stops it.");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_only_when_needed() {
        assert_eq!(
            sh_word("/home/a/.local/state/x.pem"),
            "/home/a/.local/state/x.pem"
        );
        assert_eq!(sh_word("https://127.0.0.1:7443"), "https://127.0.0.1:7443");
        assert_eq!(sh_word("/a b/c"), "'/a b/c'");
        assert_eq!(sh_word("/it's"), r"'/it'\''s'");
        assert_eq!(sh_word("$HOME"), "'$HOME'");
        // Bytes that are not UTF-8, and control characters, go through `$'...'`.
        use std::os::unix::ffi::OsStrExt;
        assert_eq!(
            sh_word(std::ffi::OsStr::from_bytes(b"/s-\xff/it's\\x")),
            r"$'/s-\xff/it\'s\\x'"
        );
        assert_eq!(sh_word("/a\tb\u{1b}[1m"), r"$'/a\x09b\x1b[1m'");
        assert_eq!(sh_word("/caf\u{e9}"), "'/caf\u{e9}'");
        // What bash reads back from them is the word itself.
        for word in [&b"/s-\xff/it's\\x"[..], b"/a\tb\x1b[1m", b"/d\xc3"] {
            let quoted = sh_word(std::ffi::OsStr::from_bytes(word));
            let out = std::process::Command::new("bash")
                .args(["-c", &format!("printf %s {quoted}")])
                .output()
                .unwrap();
            assert_eq!(out.stdout, word, "{quoted}");
        }
    }

    #[test]
    fn the_banner_says_where_the_tools_come_from() {
        let state = Path::new("/s");
        let tools = [PathBuf::from("/mine")];
        let banner = |source| {
            banner(
                "https://127.0.0.1:1",
                &state.join("pki"),
                &tools,
                &source,
                state,
                Some(&state.join("bin")),
                None,
            )
        };
        let from_env = banner(ToolsSource::Environment);
        assert!(from_env.contains("from OLLIE_TOOLS_PATH"), "{from_env}");
        assert!(from_env.contains("/s/tools"), "{from_env}");
        let from_flag = banner(ToolsSource::Flag);
        assert!(!from_flag.contains("OLLIE_TOOLS_PATH"), "{from_flag}");
        assert!(
            from_flag.contains("  export PATH=/s/bin:\"$PATH\""),
            "{from_flag}"
        );
        for (command, _) in TOUR {
            assert!(from_flag.contains(command), "{from_flag}");
        }
        assert!(from_flag.contains("rank tools by words"), "{from_flag}");
        let with_model = banner_with_model(Path::new("/models/minilm"));
        assert!(
            with_model.contains("rank tools by meaning, with the encoder in /models/minilm"),
            "{with_model}"
        );
    }

    fn banner_with_model(dir: &Path) -> String {
        banner(
            "https://127.0.0.1:1",
            Path::new("/s/pki"),
            &[PathBuf::from("/mine")],
            &ToolsSource::Flag,
            Path::new("/s"),
            None,
            Some(dir),
        )
    }
}
