//! The one error type of the client library, which knows the gRPC code of what went wrong.

use toolsrv_tls::TlsError;

/// Everything that can go wrong talking to a coordinator.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Our credentials are unusable, or the coordinator could not be reached or failed the TLS checks.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The coordinator (or a `toolctl master` relaying for it) answered an RPC with an error
    /// status. The message says why, worded the same whichever RPC met the condition; the gRPC
    /// code is for programs (see [`ClientError::code`]), so it is not part of the text.
    #[error("{message}")]
    Status {
        /// The gRPC code.
        code: tonic::Code,
        /// The coordinator's message.
        message: String,
        /// The coordinator said that the session the request named no longer exists
        /// (`NOT_FOUND`, with [`toolsrv_proto::SESSION_GONE_METADATA`]).
        session_gone: bool,
    },
    /// The transport under an RPC failed (the connection broke, the coordinator went away):
    /// nobody answered the request.
    #[error("{message}")]
    Transport {
        /// The gRPC code the transport failure maps to.
        code: tonic::Code,
        /// What failed, with the transport's error chain.
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
    /// A session profile file that cannot be used: the file and what is wrong.
    #[error("profile {0}")]
    Profile(String),
}

impl ClientError {
    /// Whether the coordinator said that the session a request named no longer exists
    /// (closed, ended idle, or gone with its coordinator), as opposed to a tool or host in it.
    pub fn session_gone(&self) -> bool {
        matches!(
            self,
            Self::Status {
                session_gone: true,
                ..
            }
        )
    }

    /// The gRPC code closest to this error.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Tls(e) => e.code(),
            Self::Status { code, .. } | Self::Transport { code, .. } => *code,
            Self::Control(_) => tonic::Code::Unavailable,
            Self::UntrustedControl(_) => tonic::Code::PermissionDenied,
            Self::Protocol(_) => tonic::Code::Internal,
            Self::Profile(_) => tonic::Code::InvalidArgument,
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        // A status the peer sent has no source; one made on our side from a transport failure
        // arrives as a bare "transport error" whose useful part is in the sources.
        let from_peer = std::error::Error::source(&status).is_none();
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
            message = format!("no message (gRPC code {:?})", status.code());
        }
        let code = status.code();
        // tonic's own words when a request's answer did not begin within the channel's timeout.
        if code == tonic::Code::Cancelled && status.message() == "Timeout expired" {
            return Self::Transport {
                code: tonic::Code::DeadlineExceeded,
                message: format!(
                    "the coordinator did not begin to answer within {} s: it may be overloaded \
                     or stuck (read its log); try again",
                    crate::client::ANSWER_WITHIN.as_secs()
                ),
            };
        }
        if !from_peer {
            message = toolsrv_proto::text::transport_words(&message);
        }
        if from_peer {
            Self::Status {
                code,
                message,
                session_gone: toolsrv_proto::is_session_gone(&status),
            }
        } else {
            Self::Transport { code, message }
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
        assert_eq!(
            e.to_string(),
            "unknown host `x`",
            "no transport code in the text"
        );
        let e = ClientError::from(tonic::Status::from_error(Box::new(std::io::Error::other(
            "connection reset",
        ))));
        assert!(matches!(e, ClientError::Transport { .. }), "{e:?}");
        assert!(e.to_string().contains("connection reset"), "{e}");
    }

    /// What the channel says when a coordinator does not begin to answer in time.
    #[test]
    fn an_answer_that_never_began_says_so() {
        let e = ClientError::from(tonic::Status::cancelled("Timeout expired"));
        assert!(matches!(e, ClientError::Transport { .. }), "{e:?}");
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
        assert!(
            e.to_string()
                .starts_with("the coordinator did not begin to answer within 60 s"),
            "{e}"
        );
        // A cancellation the coordinator sent is its own words.
        let e = ClientError::from(tonic::Status::cancelled("the caller went away"));
        assert_eq!(e.to_string(), "the caller went away");
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
