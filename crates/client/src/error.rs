//! The one error type of the client library, which knows the gRPC code of what went wrong.

use toolsrv_tls::TlsError;

/// Everything that can go wrong talking to a coordinator.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Our credentials are unusable, or the coordinator could not be reached or failed the TLS checks.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The coordinator (or the transport under it) ended an RPC with an error status.
    #[error("{message} ({code:?})")]
    Status {
        /// The gRPC code.
        code: tonic::Code,
        /// The status message, followed by the transport's error chain when there is one.
        message: String,
    },
    /// The control socket of a `toolctl master` could not be reached or served.
    #[error("{0}")]
    Control(String),
    /// The control socket, or the process serving it, belongs to another user: nothing was sent.
    #[error("{0}")]
    UntrustedControl(String),
    /// The coordinator sent something the protocol does not allow.
    #[error("{0}")]
    Protocol(String),
}

impl ClientError {
    /// The gRPC code closest to this error.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Tls(e) => e.code(),
            Self::Status { code, .. } => *code,
            Self::Control(_) => tonic::Code::Unavailable,
            Self::UntrustedControl(_) => tonic::Code::PermissionDenied,
            Self::Protocol(_) => tonic::Code::Internal,
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        // A transport failure arrives as a bare "transport error"; the useful part is in the sources.
        let mut message = status.message().to_string();
        let mut source = std::error::Error::source(&status);
        while let Some(s) = source {
            let text = s.to_string();
            if !message.contains(&text) {
                if !message.is_empty() {
                    message.push_str(": ");
                }
                message.push_str(&text);
            }
            source = s.source();
        }
        if message.is_empty() {
            message = "no message".to_string();
        }
        Self::Status {
            code: status.code(),
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_keeps_code_and_message() {
        let e = ClientError::from(tonic::Status::not_found("unknown host `x`"));
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert_eq!(e.to_string(), "unknown host `x` (NotFound)");
    }

    #[test]
    fn tls_errors_keep_their_code() {
        let e = ClientError::from(TlsError::Connect(
            "cannot connect to https://h:1: refused".into(),
        ));
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert_eq!(e.to_string(), "cannot connect to https://h:1: refused");
    }
}
