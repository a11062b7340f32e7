//! Join tokens as the coordinator keeps them: only their SHA-256, with the host id and labels
//! they bind, their expiry and whether they were used; in `<state-dir>/join-tokens.json` when
//! the coordinator has a state directory (written before a token is handed out or accepted, so
//! that a restart neither loses a token nor makes a used one usable again), else in memory.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// The file, in the coordinator's state directory.
pub const TOKENS_FILE: &str = "join-tokens.json";

/// Records of used or expired tokens are kept this long past their expiry, so that a late
/// reuse is told "used" or "expired" rather than "unknown"; then they are dropped.
const KEEP_AFTER_EXPIRY_SECS: i64 = 7 * 86_400;

/// One token, without the token itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// Hex SHA-256 of the token.
    pub sha256: String,
    pub host_id: String,
    pub labels: BTreeMap<String, String>,
    /// Who created it (a client name).
    pub created_by: String,
    pub created_unix: i64,
    pub expires_unix: i64,
    /// When it was used; `None` while it is still usable.
    #[serde(default)]
    pub used_unix: Option<i64>,
    /// When an administrator revoked it, and who.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_unix: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_by: Option<String>,
}

/// Hex digits of a token's SHA-256 that make its id.
pub const ID_LEN: usize = 16;
/// The shortest id prefix `revoke` takes.
pub const MIN_ID_PREFIX: usize = 8;

impl TokenRecord {
    /// The id shown for it: the start of its SHA-256.
    pub fn id(&self) -> &str {
        &self.sha256[..ID_LEN.min(self.sha256.len())]
    }

    /// `usable`, `used`, `expired` or `revoked` at `now`.
    pub fn state(&self, now: i64) -> &'static str {
        if self.revoked_unix.is_some() {
            "revoked"
        } else if self.used_unix.is_some() {
            "used"
        } else if now >= self.expires_unix {
            "expired"
        } else {
            "usable"
        }
    }
}

/// Why a token cannot be revoked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevokeError {
    /// No token has this id (or prefix), or the prefix is too short or names several.
    NotFound(String),
    /// The token is used, expired or revoked already.
    NotUsable(Box<TokenRecord>),
    /// The revocation could not be written.
    Store(String),
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct TokenFile {
    version: u32,
    tokens: Vec<TokenRecord>,
}

/// Why a token is refused. The wording is what the joining agent prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Unknown,
    Used {
        used_unix: i64,
    },
    Expired {
        expires_unix: i64,
    },
    Revoked {
        revoked_unix: i64,
    },
    /// The agent expects another host id than the token binds.
    OtherHost {
        token_host: String,
        asked: String,
    },
}

/// How a refusal of a token this coordinator does not keep starts; replicas that relay a join
/// to each other look for it.
pub const UNKNOWN: &str = "join token not recognised by this coordinator";

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Unknown => write!(
                f,
                "{UNKNOWN}: check it, or create one with `toolctl token create --host-id ID`"
            ),
            Refusal::Used { used_unix } => write!(
                f,
                "join token already used (at {} UTC): a token enrolls one host once; create a \
                 new one with `toolctl token create`",
                utc(*used_unix)
            ),
            Refusal::Revoked { revoked_unix } => write!(
                f,
                "join token revoked (at {} UTC): create a new one with `toolctl token create`",
                utc(*revoked_unix)
            ),
            Refusal::Expired { expires_unix } => write!(
                f,
                "join token expired (at {} UTC): create a new one with `toolctl token create`",
                utc(*expires_unix)
            ),
            Refusal::OtherHost { token_host, asked } => write!(
                f,
                "join token is for host `{token_host}`, but this agent was started with \
                 --host-id {asked}: start it with --host-id {token_host} (or none), or use a \
                 token created for `{asked}`; the token was not used"
            ),
        }
    }
}

pub use toolsrv_tls::enroll::utc;

/// Where tokens are kept, and the records.
#[derive(Debug)]
pub struct Tokens {
    path: Option<PathBuf>,
    records: Mutex<Vec<TokenRecord>>,
}

impl Tokens {
    /// Tokens kept in `state_dir` (read now), or in memory when `None`.
    pub fn open(state_dir: Option<&Path>) -> Result<Self, String> {
        let Some(dir) = state_dir else {
            return Ok(Self {
                path: None,
                records: Mutex::new(Vec::new()),
            });
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create the state directory {}: {e}", dir.display()))?;
        let path = dir.join(TOKENS_FILE);
        let records = match crate::error::FileError::read_own_state("join token file", &path)
            .map_err(|e| e.to_string())?
        {
            Some(bytes) => {
                let file: TokenFile = serde_json::from_slice(&bytes).map_err(|e| {
                    format!(
                        "{}: not a join token file: {e}; move it away to start without tokens",
                        path.display()
                    )
                })?;
                file.tokens
            }
            None => Vec::new(),
        };
        Ok(Self {
            path: Some(path),
            records: Mutex::new(records),
        })
    }

    /// Whether tokens outlive the coordinator.
    pub fn persistent(&self) -> bool {
        self.path.is_some()
    }

    /// Adds a token's record (kept before the token is handed out).
    pub fn add(&self, record: TokenRecord, now: i64) -> Result<(), String> {
        let mut records = self.lock();
        let mut next = records.clone();
        next.retain(|r| r.expires_unix + KEEP_AFTER_EXPIRY_SECS > now);
        next.push(record);
        self.save(&next)?;
        *records = next;
        Ok(())
    }

    /// The record of `token` if it may be used now for a host expected to be `asked` (empty:
    /// any): unknown, used, expired and other-host tokens are refused. Does not use it.
    pub fn check(&self, token: &str, asked: &str, now: i64) -> Result<TokenRecord, Refusal> {
        let digest = toolsrv_tls::enroll::token_digest(token);
        let records = self.lock();
        check_one(&records, &digest, asked, now).cloned()
    }

    /// Uses `token`: checks it again and marks it used, on disk first. After this returns Ok,
    /// no other join can use it, whatever happens to the coordinator.
    pub fn consume(&self, token: &str, asked: &str, now: i64) -> Result<TokenRecord, ConsumeError> {
        let digest = toolsrv_tls::enroll::token_digest(token);
        let mut records = self.lock();
        let record = check_one(&records, &digest, asked, now)
            .map_err(ConsumeError::Refused)?
            .clone();
        let mut next = records.clone();
        for r in &mut next {
            if r.sha256 == digest {
                r.used_unix = Some(now);
            }
        }
        self.save(&next).map_err(ConsumeError::Store)?;
        *records = next;
        Ok(record)
    }

    /// Every record, newest first.
    /// Whether a kept token's id starts with `id` (a prefix as `revoke` takes it).
    pub fn knows(&self, id: &str) -> bool {
        let id = id.trim().to_ascii_lowercase();
        !id.is_empty() && self.lock().iter().any(|r| r.sha256.starts_with(&id))
    }

    pub fn list(&self) -> Vec<TokenRecord> {
        // Records are kept in creation order: reversed, then sorted (stably), ties stay newest
        // first.
        let mut records = self.lock().clone();
        records.reverse();
        records.sort_by_key(|r| std::cmp::Reverse(r.created_unix));
        records
    }

    /// Revokes the usable token whose id starts with `id` (at least [`MIN_ID_PREFIX`] hex
    /// digits, naming one token), on disk first.
    pub fn revoke(&self, id: &str, by: &str, now: i64) -> Result<TokenRecord, RevokeError> {
        let id = id.trim().to_ascii_lowercase();
        if id.len() < MIN_ID_PREFIX || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(RevokeError::NotFound(format!(
                "`{id}` is not a token id: give the id `toolctl token list` shows (at least \
                 {MIN_ID_PREFIX} of its hex digits)"
            )));
        }
        let mut records = self.lock();
        let matching: Vec<usize> = records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.sha256.starts_with(&id))
            .map(|(i, _)| i)
            .collect();
        let index = match matching.as_slice() {
            [one] => *one,
            [] => {
                return Err(RevokeError::NotFound(format!(
                    "no join token with id `{id}`: `toolctl token list` shows them"
                )));
            }
            _ => {
                return Err(RevokeError::NotFound(format!(
                    "`{id}` names {} tokens: give more of the id",
                    matching.len()
                )));
            }
        };
        if records[index].state(now) != "usable" {
            return Err(RevokeError::NotUsable(Box::new(records[index].clone())));
        }
        let mut next = records.clone();
        next[index].revoked_unix = Some(now);
        next[index].revoked_by = Some(by.to_string());
        self.save(&next).map_err(RevokeError::Store)?;
        *records = next;
        Ok(records[index].clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<TokenRecord>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the records atomically: a temporary file, synced, renamed over the old one.
    fn save(&self, records: &[TokenRecord]) -> Result<(), String> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let text = serde_json::to_string_pretty(&TokenFile {
            version: 1,
            tokens: records.to_vec(),
        })
        .map_err(|e| format!("cannot encode the join tokens: {e}"))?;
        toolsrv_tls::write_atomically(path, text.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

/// Why [`Tokens::consume`] failed.
#[derive(Debug)]
pub enum ConsumeError {
    Refused(Refusal),
    /// The used mark could not be written: the token is refused rather than risk a second use.
    Store(String),
}

fn check_one<'a>(
    records: &'a [TokenRecord],
    digest: &str,
    asked: &str,
    now: i64,
) -> Result<&'a TokenRecord, Refusal> {
    let record = records
        .iter()
        .find(|r| r.sha256 == digest)
        .ok_or(Refusal::Unknown)?;
    if let Some(revoked_unix) = record.revoked_unix {
        return Err(Refusal::Revoked { revoked_unix });
    }
    if let Some(used_unix) = record.used_unix {
        return Err(Refusal::Used { used_unix });
    }
    if now >= record.expires_unix {
        return Err(Refusal::Expired {
            expires_unix: record.expires_unix,
        });
    }
    if !asked.is_empty() && toolsrv_tls::normalize_name(asked) != record.host_id {
        return Err(Refusal::OtherHost {
            token_host: record.host_id.clone(),
            asked: asked.to_string(),
        });
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn record(token: &str, host: &str, expires: i64) -> TokenRecord {
        TokenRecord {
            sha256: toolsrv_tls::enroll::token_digest(token),
            host_id: host.into(),
            labels: BTreeMap::new(),
            created_by: "admin".into(),
            created_unix: 0,
            expires_unix: expires,
            used_unix: None,
            revoked_unix: None,
            revoked_by: None,
        }
    }

    #[test]
    fn a_revoked_token_is_refused_and_stays_revoked_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::open(Some(dir.path())).unwrap();
        tokens.add(record("t1", "a", 1000), 0).unwrap();
        tokens.add(record("t2", "b", 1000), 0).unwrap();
        tokens.add(record("t3", "c", 1000), 0).unwrap();
        tokens.consume("t3", "", 1).unwrap();
        let id = toolsrv_tls::enroll::token_digest("t1");
        assert!(matches!(
            tokens.revoke(&id[..4], "admin", 2),
            Err(RevokeError::NotFound(m)) if m.contains("not a token id")
        ));
        assert!(matches!(
            tokens.revoke("ffffffffffff", "admin", 2),
            Err(RevokeError::NotFound(m)) if m.contains("no join token")
        ));
        let used = toolsrv_tls::enroll::token_digest("t3");
        assert!(matches!(
            tokens.revoke(&used[..8], "admin", 2),
            Err(RevokeError::NotUsable(r)) if r.state(2) == "used"
        ));
        let revoked = tokens.revoke(&id[..10].to_uppercase(), "admin", 2).unwrap();
        assert_eq!(revoked.host_id, "a");
        assert_eq!(revoked.state(2), "revoked");
        assert!(matches!(
            tokens.check("t1", "", 3),
            Err(Refusal::Revoked { revoked_unix: 2 })
        ));
        let again = Tokens::open(Some(dir.path())).unwrap();
        assert!(matches!(
            again.consume("t1", "", 4),
            Err(ConsumeError::Refused(Refusal::Revoked { .. }))
        ));
        assert_eq!(again.check("t2", "", 4).unwrap().host_id, "b");
        let listed: Vec<_> = again.list().iter().map(|r| r.state(4)).collect();
        assert_eq!(listed.len(), 3);
        assert!(
            listed.contains(&"revoked") && listed.contains(&"used") && listed.contains(&"usable")
        );
    }

    /// A token file someone else could have written holds tokens nobody here made: another
    /// user's own, for any host. The coordinator does not start with it. (Needs root, to give
    /// the file away.)
    #[test]
    fn a_token_file_another_user_could_have_written_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::open(Some(dir.path())).unwrap();
        tokens.add(record("t1", "web-1", i64::MAX), 0).unwrap();
        drop(tokens);
        let path = dir.path().join(TOKENS_FILE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o646)).unwrap();
        let Err(err) = Tokens::open(Some(dir.path())) else {
            panic!("a token file every user may write was used");
        };
        assert!(
            err.contains("writable by every user of this machine (mode 0646)")
                && err.contains(&format!("chmod o-w {}", path.display())),
            "{err}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        let Err(err) = Tokens::open(Some(dir.path())) else {
            panic!("a token file another user owns was used");
        };
        assert!(err.contains("owned by uid 65534"), "{err}");
        // Given back, it is read as it was.
        std::os::unix::fs::chown(&path, Some(nix::unistd::geteuid().as_raw()), None).unwrap();
        let tokens = Tokens::open(Some(dir.path())).unwrap();
        assert!(tokens.check("t1", "web-1", 1).is_ok());
    }

    #[test]
    fn a_token_is_used_once_and_not_after_expiry() {
        let tokens = Tokens::open(None).unwrap();
        tokens.add(record("t1", "web-1", 100), 0).unwrap();
        tokens.add(record("t2", "web-2", 100), 0).unwrap();
        assert_eq!(tokens.check("nope", "", 1), Err(Refusal::Unknown));
        assert!(matches!(
            tokens.check("t1", "web-9", 1),
            Err(Refusal::OtherHost { .. })
        ));
        assert_eq!(tokens.consume("t1", "WEB-1", 1).unwrap().host_id, "web-1");
        assert!(matches!(
            tokens.consume("t1", "", 2),
            Err(ConsumeError::Refused(Refusal::Used { used_unix: 1 }))
        ));
        assert!(matches!(
            tokens.check("t2", "", 100),
            Err(Refusal::Expired { expires_unix: 100 })
        ));
    }

    #[test]
    fn tokens_survive_a_restart_and_so_does_their_use() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::open(Some(dir.path())).unwrap();
        tokens.add(record("t1", "a", 1000), 0).unwrap();
        tokens.add(record("t2", "b", 1000), 0).unwrap();
        tokens.consume("t1", "", 5).unwrap();
        let text = std::fs::read_to_string(dir.path().join(TOKENS_FILE)).unwrap();
        assert!(
            !text.contains("\"t1\"") && text.contains(&toolsrv_tls::enroll::token_digest("t1"))
        );
        let again = Tokens::open(Some(dir.path())).unwrap();
        assert!(matches!(
            again.check("t1", "", 6),
            Err(Refusal::Used { .. })
        ));
        assert_eq!(again.check("t2", "", 6).unwrap().host_id, "b");
    }
}
