//! The one error type of this crate, and its gRPC status code.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while issuing, loading or using credentials.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read, written or created.
    #[error("{op} {path}: {source}")]
    Io {
        /// What we were doing ("cannot read", "cannot create", ...).
        op: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A credentials file exists but its content is unusable.
    #[error("{path}: {msg}")]
    BadFile {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong and what to do about it.
        msg: String,
    },
    /// A host id, client name, host name or identity URI is not acceptable.
    #[error("invalid {what} {value:?}: {msg}")]
    InvalidName {
        /// "agent id", "client name", "coordinator name", "identity URI"...
        what: &'static str,
        /// The offending value.
        value: String,
        /// Why it is refused.
        msg: String,
    },
    /// A certificate carries no usable toolsrv identity, or the wrong one.
    #[error("{0}")]
    Identity(String),
    /// Generating a key or a certificate failed.
    #[error("cannot generate {what}: {source}")]
    Generate {
        /// What we were generating.
        what: String,
        /// The rcgen error.
        #[source]
        source: rcgen::Error,
    },
    /// rustls refused to build a configuration.
    #[error("cannot build the TLS {side} configuration: {source}")]
    Config {
        /// "server" or "client".
        side: &'static str,
        /// The rustls error.
        #[source]
        source: rustls::Error,
    },
    /// Building a verifier or connecting to a peer failed.
    #[error("{0}")]
    Connect(String),
    /// The peer answered, and its certificate fails this side's checks (another CA's, a name
    /// it does not carry, out of its dates): trying again changes nothing until one side's
    /// files do.
    #[error("{0}")]
    PeerNotTrusted(String),
}

impl TlsError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn bad_file(path: &Path, msg: impl Into<String>) -> Self {
        Self::BadFile {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }

    /// The gRPC code a service should answer with when this error ends a call.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Connect(_) => tonic::Code::Unavailable,
            Self::PeerNotTrusted(_) => tonic::Code::FailedPrecondition,
            Self::Identity(_) => tonic::Code::PermissionDenied,
            Self::InvalidName { .. } => tonic::Code::InvalidArgument,
            Self::Io { .. }
            | Self::BadFile { .. }
            | Self::Generate { .. }
            | Self::Config { .. } => tonic::Code::FailedPrecondition,
        }
    }
}

impl From<TlsError> for tonic::Status {
    fn from(e: TlsError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// Formats an error with its whole `source()` chain: tonic's transport
/// error alone only says "transport error".
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        cur = s.source();
    }
    out
}
