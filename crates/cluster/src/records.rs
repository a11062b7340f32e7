//! What the replicas write to etcd: the key layout under the prefix and the JSON records.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};

/// A host's claim: which replica holds its link, and the facts clients select hosts by.
/// Stored as JSON at `<prefix>hosts/<host id>`, under the owning replica's lease.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    /// The id of the replica that holds the link.
    pub owner: String,
    /// Where other replicas reach the owner's internal RPC.
    pub owner_url: String,
    /// Unique per link: tells a reattachment from the link it replaced.
    pub link_id: String,
    /// The host's selectable facts (labels, OS, architecture...).
    #[serde(default)]
    pub facts: BTreeMap<String, String>,
    /// When the link attached, in seconds since the Unix epoch.
    pub attached_unix: u64,
}

/// A live replica. Stored as JSON at `<prefix>replicas/<replica id>`, under its lease: it
/// disappears when the replica shuts down or its lease expires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub id: String,
    /// Where other replicas reach this one's internal RPC.
    pub advertise_url: String,
    /// When the replica joined, in seconds since the Unix epoch.
    pub started_unix: u64,
}

/// The catalog revision every replica serves. Stored as JSON at `<prefix>catalog`, without a
/// lease: it outlives every replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgreedCatalog {
    pub revision: u64,
    /// The digest of the catalog's contents (whatever the caller computes; compared as is).
    pub digest: String,
}

/// A fresh link id: 64 random bits in hex.
pub fn new_link_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    toolsrv_tls::since_epoch().as_secs()
}

/// A key under the prefix, as the watcher sorts them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyKind {
    Host(String),
    Replica(String),
    Catalog,
    /// A revoked identity (`client/NAME`, `agent/ID`).
    Revocation(String),
    /// Something else under the prefix: ignored.
    Other,
}

/// The key layout under one prefix.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    /// `prefix` gets a trailing `/` if it lacks one.
    pub(crate) fn new(prefix: &str) -> Result<Self> {
        if prefix.is_empty() {
            return Err(ClusterError::Invalid {
                what: "the etcd key prefix".into(),
                detail: "is empty; use for example /toolsrv/".into(),
            });
        }
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Ok(Self { prefix })
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn host(&self, host_id: &str) -> String {
        format!("{}hosts/{host_id}", self.prefix)
    }

    pub(crate) fn replica(&self, replica_id: &str) -> String {
        format!("{}replicas/{replica_id}", self.prefix)
    }

    pub(crate) fn catalog(&self) -> String {
        format!("{}catalog", self.prefix)
    }

    pub(crate) fn revocation(&self, identity: &str) -> String {
        format!("{}revocations/{identity}", self.prefix)
    }

    pub(crate) fn revocations(&self) -> String {
        format!("{}revocations/", self.prefix)
    }

    /// Written once etcd keeps the revocations (see [`crate::Cluster::keep_revocations`]).
    pub(crate) fn revocations_kept(&self) -> String {
        format!("{}revocations-kept", self.prefix)
    }

    pub(crate) fn kind(&self, key: &[u8]) -> KeyKind {
        let Some(rest) = std::str::from_utf8(key)
            .ok()
            .and_then(|k| k.strip_prefix(self.prefix.as_str()))
        else {
            return KeyKind::Other;
        };
        if let Some(id) = rest.strip_prefix("hosts/") {
            KeyKind::Host(id.to_string())
        } else if let Some(id) = rest.strip_prefix("replicas/") {
            KeyKind::Replica(id.to_string())
        } else if rest == "catalog" {
            KeyKind::Catalog
        } else if let Some(identity) = rest.strip_prefix("revocations/") {
            KeyKind::Revocation(identity.to_string())
        } else {
            KeyKind::Other
        }
    }
}

/// Host and replica ids become one path segment of a key: not empty, no `/`, no control
/// characters, at most 253 bytes (a DNS name's length).
pub(crate) fn check_id(what: &str, id: &str) -> Result<()> {
    check_key_part(what, id, 253, false)
}

/// What goes into a key after the prefix: not empty, at most `max` bytes, no control
/// characters, and no `/` unless `slash`.
pub(crate) fn check_key_part(what: &str, part: &str, max: usize, slash: bool) -> Result<()> {
    let problem = if part.is_empty() {
        Some("is empty".to_string())
    } else if part.len() > max {
        Some(format!("is longer than {max} bytes"))
    } else if !slash && part.contains('/') {
        Some("contains '/'".to_string())
    } else if part.chars().any(char::is_control) {
        Some("contains a control character".to_string())
    } else {
        None
    };
    match problem {
        Some(detail) => Err(ClusterError::Invalid {
            what: format!("{what} {part:?}"),
            detail,
        }),
        None => Ok(()),
    }
}

/// Parses a JSON record read at `key`.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    op: &'static str,
    key: &str,
    value: &[u8],
) -> Result<T> {
    serde_json::from_slice(value).map_err(|e| ClusterError::Malformed {
        op,
        key: key.to_string(),
        detail: e.to_string(),
    })
}

/// Serialises a record. Serialising these plain structs cannot fail (string keys, no
/// non-finite floats), but the error is still mapped rather than unwrapped.
pub(crate) fn to_json<T: Serialize>(op: &'static str, key: &str, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| ClusterError::Malformed {
        op,
        key: key.to_string(),
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_laid_out_under_the_prefix() {
        let keys = Keys::new("/toolsrv").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(keys.host("web-1"), "/toolsrv/hosts/web-1");
        assert_eq!(keys.replica("r1"), "/toolsrv/replicas/r1");
        assert_eq!(keys.catalog(), "/toolsrv/catalog");
        assert_eq!(
            keys.revocation("client/bob"),
            "/toolsrv/revocations/client/bob"
        );
        let cases: [(&[u8], KeyKind); 7] = [
            (b"/toolsrv/hosts/web-1", KeyKind::Host("web-1".into())),
            (
                b"/toolsrv/revocations/agent/web-1",
                KeyKind::Revocation("agent/web-1".into()),
            ),
            (b"/toolsrv/revocations-kept", KeyKind::Other),
            (b"/toolsrv/replicas/r1", KeyKind::Replica("r1".into())),
            (b"/toolsrv/catalog", KeyKind::Catalog),
            (b"/toolsrv/other", KeyKind::Other),
            (b"/elsewhere/hosts/x", KeyKind::Other),
        ];
        for (key, want) in cases {
            assert_eq!(keys.kind(key), want, "{}", String::from_utf8_lossy(key));
        }
        assert!(Keys::new("").is_err());
    }

    #[test]
    fn ids_are_one_segment() {
        for good in ["web-1", "db.example.com", "h_1"] {
            assert!(check_id("host id", good).is_ok(), "{good}");
        }
        for bad in ["", "a/b", "a\nb", &"x".repeat(254)] {
            assert!(check_id("host id", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn host_records_read_back() {
        let record = HostRecord {
            owner: "r1".into(),
            owner_url: "https://r1:7001".into(),
            link_id: new_link_id(),
            facts: BTreeMap::from([("os".into(), "linux".into())]),
            attached_unix: 1,
        };
        let json = to_json("claim", "k", &record).unwrap_or_default();
        let back: HostRecord = parse("claim", "k", &json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, record);
        assert!(parse::<HostRecord>("claim", "k", b"{}").is_err());
    }
}
