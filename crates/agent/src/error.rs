//! The agent's one error type: why a session ended or a catalog change could not be applied.

use std::path::{Path, PathBuf};

/// Everything that ends a session or refuses part of a catalog update.
///
/// A session error is never fatal to the agent: [`crate::run`] logs it and reconnects.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Building the TLS configuration or dialling the coordinator failed.
    #[error(
        "cannot reach the coordinator at {url}: {source}; check the URL, the TLS files and that the coordinator runs"
    )]
    Connect {
        url: String,
        #[source]
        source: toolsrv_tls::TlsError,
    },
    /// The coordinator answered an RPC with an error status.
    #[error("{what} failed: {}{}", status.message(), hint(status.code()))]
    Rpc {
        /// Which RPC or step, e.g. "opening the agent link".
        what: &'static str,
        status: tonic::Status,
    },
    /// The coordinator broke the protocol (e.g. its first message was not a Welcome).
    #[error("coordinator broke the agent link protocol: {0}")]
    Protocol(String),
    /// The link went quiet or closed without a Goodbye.
    #[error("agent link lost: {0}")]
    LinkLost(String),
    /// A file of the agent's state could not be read or written.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "cannot write".
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A shipped tool or blob was refused (bad name, wrong digest, wrong size).
    #[error("refused {what}: {why}")]
    Refused { what: String, why: String },
    /// The agent's certificate names another identity than this host's agent: the coordinator
    /// would refuse every attempt.
    #[error("{0}")]
    Identity(String),
    /// Calls cannot be confined as configured (`--sandbox enforce` on a host that cannot).
    #[error(transparent)]
    Sandbox(#[from] toolsrv_confine::ConfineError),
    /// `--metrics-listen` cannot be served.
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl AgentError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }

    /// True for errors that no retry can fix by itself: the coordinator refuses this agent's
    /// identity, or the certificate names another one. Only an operator (a new certificate, the
    /// right `--host-id`, a coordinator reconfigured) makes them go away.
    pub fn needs_operator(&self) -> bool {
        match self {
            Self::Identity(_) => true,
            Self::Rpc { status, .. } => matches!(
                status.code(),
                tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
            ),
            _ => false,
        }
    }

    pub(crate) fn refused(what: impl Into<String>, why: impl Into<String>) -> Self {
        Self::Refused {
            what: what.into(),
            why: why.into(),
        }
    }
}

/// What the coordinator's words leave out: a refusal (a host id its certificate does not name,
/// a used token, a revocation) says itself what to do.
fn hint(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Unavailable => "; the coordinator is unreachable or restarting",
        _ => "",
    }
}
