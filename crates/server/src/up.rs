//! `toolsrv up`: a whole system in one process for a first look or local development.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

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
    /// Tools path to serve instead of the example tools in the state directory
    #[arg(long, env = "OLLIE_TOOLS_PATH")]
    tools: Option<String>,
}

fn default_state() -> PathBuf {
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("toolsrv/up")
}

pub async fn run(args: UpArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let state = args.state.unwrap_or_else(default_state);
    let pki = state.join("pki");
    let mut opts = PkiOptions::new(&pki);
    opts.agents = vec![LOCAL_HOST.into()];
    opts.clients = vec![CLIENT.into()];
    toolsrv_tls::init(&opts).with_context(|| {
        format!(
            "cannot create development certificates in {}",
            pki.display()
        )
    })?;
    let tools = match &args.tools {
        Some(path) => split_tools_path(path),
        None => {
            let dir = state.join("tools");
            if crate::examples::install(&dir)
                .with_context(|| format!("cannot write example tools to {}", dir.display()))?
            {
                tracing::info!(dir = %dir.display(), "installed the example tools");
            }
            vec![dir]
        }
    };
    let listener = crate::cli::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let url = format!("https://{addr}");
    let coordinator = CoordinatorConfig::new(
        tools.clone(),
        TlsFiles::in_dir(&pki, &Identity::Coordinator),
    );
    let mut agent = AgentConfig::new(
        url.clone(),
        LOCAL_HOST,
        TlsFiles::in_dir(&pki, &Identity::Agent(LOCAL_HOST.into())),
        state.join("agent"),
    );
    agent.labels.insert("role".into(), "dev".into());
    // The example system_logs tool reads the logs; calls are otherwise confined as on any agent.
    agent
        .sandbox
        .defaults
        .read
        .extend(["/var/log".into(), "/run/log/journal".into()]);
    print_banner(&url, &pki, &tools);
    let coordinator = tokio::spawn(toolsrv_coordinator::serve(
        coordinator,
        listener,
        None,
        shutdown.clone(),
    ));
    let agent = tokio::spawn(toolsrv_agent::run(agent, shutdown.clone()));
    let (coordinator, agent) = tokio::join!(coordinator, agent);
    shutdown.cancel();
    coordinator.context("coordinator task failed")??;
    agent.context("agent task failed")??;
    Ok(())
}

fn print_banner(url: &str, pki: &Path, tools: &[PathBuf]) {
    let client = TlsFiles::in_dir(pki, &Identity::Client(CLIENT.into()));
    let tools: Vec<String> = tools.iter().map(|t| t.display().to_string()).collect();
    println!(
        "toolsrv is up: coordinator on {url} with a local agent `{LOCAL_HOST}`, tools from {}\n\
         \n\
         In another shell:\n\
         \n  export TOOLSRV_ADDR={url}\n  export TOOLSRV_CA={}\n  export TOOLSRV_CERT={}\n  export TOOLSRV_KEY={}\n\
         \n  toolctl hosts\n  toolctl tools {LOCAL_HOST}\n  toolctl call {LOCAL_HOST} env_info\n  toolctl fanout all disk_usage\n\
         \nCtrl-C stops it.",
        tools.join(":"),
        client.ca.display(),
        client.cert.display(),
        client.key.display(),
    );
}
