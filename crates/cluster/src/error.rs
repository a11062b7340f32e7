//! What can go wrong talking to etcd, each error naming the operation and the key, and how a
//! gRPC status from etcd is classified: worth retrying (on another member or later) or not, and
//! why.

use std::time::Duration;

/// An operation of this crate that failed. Every variant names the operation (`claim`,
/// `release`, `agree catalog`...) and the etcd key it was about.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd has no leader: writes, leases and linearizable reads wait for a quorum.
    #[error(
        "{op} {key}: etcd has no quorum ({detail}); links already held keep serving, new claims \
         are refused until etcd recovers"
    )]
    NoQuorum {
        op: &'static str,
        key: String,
        detail: String,
    },
    /// No etcd member answered within the retry budget.
    #[error(
        "{op} {key}: etcd unreachable after {attempts} attempts in {elapsed:?} ({detail}); check \
         the --etcd endpoints and that the members run"
    )]
    Unavailable {
        op: &'static str,
        key: String,
        detail: String,
        attempts: u32,
        elapsed: Duration,
    },
    /// This replica holds no etcd lease at the moment (it expired and a new one is not granted
    /// yet), so nothing can be recorded under it.
    #[error(
        "{op} {key}: this replica holds no etcd lease ({detail}); retry once it is granted again"
    )]
    NoLease {
        op: &'static str,
        key: String,
        detail: String,
    },
    /// A newer claim, by this or another replica, holds the host.
    #[error("{op} {key}: a newer claim holds the host (replica {owner}, link {link_id})")]
    Superseded {
        op: &'static str,
        key: String,
        owner: String,
        link_id: String,
    },
    /// Compare-and-swap kept losing to concurrent writers.
    #[error("{op} {key}: gave up after {attempts} conflicting concurrent writes")]
    Conflict {
        op: &'static str,
        key: String,
        attempts: u32,
    },
    /// etcd refused the request for a reason no retry fixes.
    #[error("{op} {key}: etcd refused the request: {detail}")]
    Refused {
        op: &'static str,
        key: String,
        detail: String,
    },
    /// A value under our prefix is not what this crate writes.
    #[error("{op} {key}: malformed record: {detail}")]
    Malformed {
        op: &'static str,
        key: String,
        detail: String,
    },
    /// The configuration or an argument cannot work.
    #[error("{what}: {detail}")]
    Invalid { what: String, detail: String },
    /// [`crate::Cluster::shutdown`] was called.
    #[error("{op} {key}: this replica has left the cluster (shut down)")]
    Closed { op: &'static str, key: String },
}

impl ClusterError {
    /// The gRPC code a service returns for this error (the coordinator maps it once).
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::NoQuorum { .. }
            | Self::Unavailable { .. }
            | Self::NoLease { .. }
            | Self::Closed { .. } => tonic::Code::Unavailable,
            Self::Superseded { .. } | Self::Conflict { .. } => tonic::Code::Aborted,
            Self::Invalid { .. } => tonic::Code::InvalidArgument,
            Self::Refused { .. } | Self::Malformed { .. } => tonic::Code::Internal,
        }
    }

    /// Whether etcd could not be reached or had no quorum: the caller keeps serving what it
    /// holds and tries again later.
    pub fn is_unavailable(&self) -> bool {
        self.code() == tonic::Code::Unavailable
    }
}

/// Results of this crate.
pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// Why one attempt failed, as far as retrying is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The member reached has no leader (quorum lost, or an election under way).
    NoLeader(String),
    /// A member could not be reached or the request timed out: another member or a later
    /// attempt may do.
    Unreachable(String),
    /// The lease named in the request is gone.
    LeaseNotFound(String),
    /// A compare-and-swap lost against a concurrent writer.
    Conflict,
    /// The revision asked for is compacted away: only a new listing helps.
    Compacted(String),
    /// No retry fixes it.
    Permanent(String),
}

impl Fault {
    pub(crate) fn is_transient(&self) -> bool {
        !matches!(self, Self::Permanent(_) | Self::Compacted(_))
    }

    /// The same fault, its detail naming the etcd member (`url`) that failed.
    pub(crate) fn at(self, url: &str) -> Self {
        let at = |detail: String| format!("{url}: {detail}");
        match self {
            Self::NoLeader(d) => Self::NoLeader(at(d)),
            Self::Unreachable(d) => Self::Unreachable(at(d)),
            Self::LeaseNotFound(d) => Self::LeaseNotFound(at(d)),
            Self::Conflict => Self::Conflict,
            Self::Compacted(d) => Self::Compacted(at(d)),
            Self::Permanent(d) => Self::Permanent(at(d)),
        }
    }

    /// The error to report once retries are over.
    pub(crate) fn into_error(
        self,
        op: &'static str,
        key: &str,
        attempts: u32,
        elapsed: Duration,
    ) -> ClusterError {
        let key = key.to_string();
        match self {
            Self::NoLeader(detail) => ClusterError::NoQuorum { op, key, detail },
            Self::Unreachable(detail) => ClusterError::Unavailable {
                op,
                key,
                detail,
                attempts,
                elapsed,
            },
            Self::LeaseNotFound(detail) => ClusterError::NoLease { op, key, detail },
            Self::Conflict => ClusterError::Conflict { op, key, attempts },
            Self::Compacted(detail) | Self::Permanent(detail) => {
                ClusterError::Refused { op, key, detail }
            }
        }
    }

    /// Of two faults seen while retrying, the one that says more: a missing leader explains
    /// the unreachable members too, so it wins over them.
    pub(crate) fn most_telling(self, other: Fault) -> Fault {
        match (&self, &other) {
            (Self::NoLeader(_), _) => self,
            (_, Self::NoLeader(_)) => other,
            _ => other,
        }
    }
}

/// Classifies a gRPC status from etcd, or from tonic when etcd could not be reached (a refused
/// connection or a connection reset mid-request).
pub(crate) fn classify(status: &tonic::Status) -> Fault {
    use tonic::Code;
    let message = status.message();
    let text = format!("{:?}: {message}", status.code());
    // etcdserver: no leader; etcdserver: leader changed (an election during the request).
    if message.contains("no leader") || message.contains("leader changed") {
        return Fault::NoLeader(text);
    }
    // etcdserver: requested lease not found.
    if message.contains("lease not found") {
        return Fault::LeaseNotFound(text);
    }
    // mvcc: required revision has been compacted.
    if message.contains("required revision has been compacted") {
        return Fault::Compacted(text);
    }
    match status.code() {
        // Unknown: tonic's own transport failures (a connection reset mid-request) come as it.
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Aborted
        | Code::ResourceExhausted
        | Code::Unknown => Fault::Unreachable(text),
        _ => Fault::Permanent(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        let cases = [
            (
                tonic::Status::unavailable("etcdserver: no leader"),
                "NoLeader",
            ),
            (
                tonic::Status::unavailable("etcdserver: leader changed"),
                "NoLeader",
            ),
            (
                tonic::Status::not_found("etcdserver: requested lease not found"),
                "LeaseNotFound",
            ),
            (
                tonic::Status::unavailable("tcp connect error: Connection refused"),
                "Unreachable",
            ),
            (
                tonic::Status::deadline_exceeded("Timeout expired"),
                "Unreachable",
            ),
            (
                tonic::Status::unknown("transport error: connection reset"),
                "Unreachable",
            ),
            (
                tonic::Status::invalid_argument("etcdserver: key is not provided"),
                "Permanent",
            ),
            (
                tonic::Status::out_of_range(
                    "etcdserver: mvcc: required revision has been compacted",
                ),
                "Compacted",
            ),
            (
                tonic::Status::cancelled("h2 protocol error: stream no longer needed"),
                "Unreachable",
            ),
        ];
        for (status, want) in cases {
            let got = classify(&status);
            let name = format!("{got:?}");
            assert!(name.starts_with(want), "{status:?}: {got:?}, want {want}");
        }
    }

    #[test]
    fn no_leader_is_the_most_telling() {
        let none = Fault::NoLeader("x".into());
        let gone = Fault::Unreachable("y".into());
        assert_eq!(none.clone().most_telling(gone.clone()), none);
        assert_eq!(gone.clone().most_telling(none.clone()), none);
        assert_eq!(gone.clone().most_telling(Fault::Conflict), Fault::Conflict);
    }

    #[test]
    fn unavailable_errors_map_to_unavailable() {
        let e = Fault::NoLeader("no leader".into()).into_error("claim", "/k", 3, Duration::ZERO);
        assert!(e.is_unavailable());
        assert!(
            e.to_string().contains("claim /k: etcd has no quorum"),
            "{e}"
        );
        let e = Fault::Conflict.into_error("agree catalog", "/c", 9, Duration::ZERO);
        assert_eq!(e.code(), tonic::Code::Aborted);
    }
}
