//! Revoked identities (`toolctl revoke`): a deny-list of `agent/<id>` and `client/<name>`,
//! kept in `<state-dir>/revocations.json`, checked by [`crate::RequireRole`] on every request,
//! and enforced on connections already open by closing them.
//!
//! An identity is revoked by name, so every certificate that names it is refused, whoever
//! issued it and whenever; a single certificate is revoked with a CRL (`--crl`) instead.
//!
//! Architecture invariant: a revocation is on disk before it is in force, and in force before
//! the revoked identity's connections are closed, so no request checked after the RPC answers
//! gets through, and a restart forgets nothing that was answered as revoked.
//!
//! Replicas (`--etcd`) share one list in etcd: a revocation made through any replica is
//! written there before the RPC answers, every replica follows the list (saving it in its own
//! state directory, if it has one) and closes the identity's connections; the list in etcd is
//! the one a replica takes when it starts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use toolsrv_proto::v1::{
    ListRevocationsRequest, ListRevocationsResponse, Revocation, RevokeRequest, RevokeResponse,
    UnrevokeRequest, UnrevokeResponse,
};
use toolsrv_tls::{Connections, Crls, Identity};

use crate::State;
use crate::error::FileError;
use crate::expiry::ExpiryWatch;
use crate::fleet::now_ms;
use crate::identity::Caller;

/// The file in `--state-dir`.
pub const FILE_NAME: &str = "revocations.json";
/// Longest reason kept.
const MAX_REASON_BYTES: usize = 1024;
/// Longest identity a request may name (`client/` and a name of at most 253 characters).
const MAX_IDENTITY_BYTES: usize = 300;

/// One revoked identity, as kept on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    identity: String,
    #[serde(default)]
    reason: String,
    revoked_by: String,
    revoked_unix_ms: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    revocations: Vec<Entry>,
}

impl Entry {
    fn proto(&self) -> Revocation {
        Revocation {
            identity: self.identity.clone(),
            reason: self.reason.clone(),
            revoked_by: self.revoked_by.clone(),
            revoked_unix_ms: self.revoked_unix_ms,
        }
    }
}

/// The deny-list of a coordinator.
#[derive(Debug)]
pub struct Revocations {
    /// `<state-dir>/revocations.json`; `None` without `--state-dir`, when revoking is refused.
    path: Option<PathBuf>,
    list: Mutex<BTreeMap<String, Entry>>,
    /// The open connections, to close a revoked identity's; set once the server listens.
    conns: OnceLock<Connections>,
    /// Kept in etcd for every replica as well, so revoking needs no state directory.
    shared: std::sync::atomic::AtomicBool,
}

/// What [`Revocations::revoke`] did.
#[derive(Debug)]
pub struct Revoked {
    pub revocation: Revocation,
    pub already: bool,
    pub closed: usize,
}

/// Reads `agent/<id>` or `client/<name>` (or the whole `toolsrv://` URI) as an identity that can
/// be revoked: validated and lowercase; the coordinator's own identity is refused.
pub fn parse_identity(text: &str) -> Result<Identity, Status> {
    if text.len() > MAX_IDENTITY_BYTES {
        return Err(Status::invalid_argument(format!(
            "the identity is {} bytes, over the limit of {MAX_IDENTITY_BYTES} bytes",
            text.len()
        )));
    }
    let uri = if text.starts_with(toolsrv_tls::URI_SCHEME) {
        text.to_string()
    } else {
        format!("{}{text}", toolsrv_tls::URI_SCHEME)
    };
    match Identity::parse_uri(&uri) {
        Ok(Identity::Coordinator) => Err(Status::invalid_argument(
            "the coordinator's own identity cannot be revoked: replace its certificate instead",
        )),
        Ok(identity) => Ok(identity),
        Err(_) => Err(Status::invalid_argument(format!(
            "{text:?} is not an identity to revoke: give agent/<host-id> or client/<name> \
             (names of A-Z a-z 0-9 _ . -)"
        ))),
    }
}

impl Revocations {
    /// The deny-list kept in `state_dir` (empty when the file does not exist yet). A file that
    /// cannot be read or parsed stops the coordinator: starting without it would let revoked
    /// identities back in.
    pub fn load(state_dir: Option<&Path>) -> Result<Self, FileError> {
        let path = state_dir.map(|dir| dir.join(FILE_NAME));
        let mut list = BTreeMap::new();
        if let Some(path) = &path {
            if let Some(bytes) = FileError::read_own_state("revocations file", path)? {
                let disk: OnDisk = serde_json::from_slice(&bytes).map_err(|e| {
                    FileError::invalid(
                        "revocations file",
                        path,
                        format!("{e}; fix or restore it (it lists revoked identities)"),
                    )
                })?;
                for entry in disk.revocations {
                    let identity = parse_identity(&entry.identity).map_err(|e| {
                        FileError::invalid("revocations file", path, e.message().to_string())
                    })?;
                    list.insert(identity.to_string(), entry);
                }
            }
            if !list.is_empty() {
                tracing::info!(revoked = list.len(), file = %path.display(), "revoked identities loaded");
            }
        }
        Ok(Self {
            path,
            list: Mutex::new(list),
            conns: OnceLock::new(),
            shared: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// From now on the list is kept in etcd too (see [`crate::replicas`]).
    pub fn share(&self) {
        self.shared
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every revocation as the records kept in etcd: identity to JSON.
    pub fn records(&self) -> BTreeMap<String, Vec<u8>> {
        self.lock()
            .iter()
            .filter_map(|(id, entry)| Some((id.clone(), serde_json::to_vec(entry).ok()?)))
            .collect()
    }

    /// The record of `identity` as kept in etcd, if it is revoked.
    pub fn record(&self, identity: &Identity) -> Option<Vec<u8>> {
        let list = self.lock();
        serde_json::to_vec(list.get(&identity.to_string())?).ok()
    }

    /// Takes `records` (etcd's list, identity to JSON) as the list: saved, in force, then the
    /// connections of each identity it newly revokes are closed, `before_closing` first. A
    /// record that cannot be read still revokes the identity its key names.
    pub fn replace_with(
        &self,
        records: &BTreeMap<String, Vec<u8>>,
        before_closing: impl Fn(&Identity, &str),
    ) -> Result<(), Status> {
        self.update(
            |_| {
                records
                    .iter()
                    .filter_map(|(key, record)| entry_of(key, record))
                    .collect()
            },
            before_closing,
        )
    }

    /// Takes one change of etcd's list: `identity` revoked with `record`, or lifted (`None`).
    /// The rest of the list is left alone, so a revocation made here and not yet seen back
    /// from etcd stays in force.
    pub fn apply_remote(
        &self,
        identity: &str,
        record: Option<&[u8]>,
        before_closing: impl Fn(&Identity, &str),
    ) -> Result<(), Status> {
        self.update(
            |current| {
                let mut next = current.clone();
                match record.and_then(|r| entry_of(identity, r)) {
                    Some((key, entry)) => {
                        next.entry(key).or_insert(entry);
                    }
                    None if record.is_none() => {
                        next.remove(identity);
                    }
                    None => {}
                }
                next
            },
            before_closing,
        )
    }

    fn update(
        &self,
        make: impl FnOnce(&BTreeMap<String, Entry>) -> BTreeMap<String, Entry>,
        before_closing: impl Fn(&Identity, &str),
    ) -> Result<(), Status> {
        let mut list = self.lock();
        let next = make(&list);
        if *list == next {
            return Ok(());
        }
        if let Some(path) = self.persistent()? {
            save(path, &next)?;
        }
        let added: Vec<Entry> = next
            .iter()
            .filter(|(id, _)| !list.contains_key(*id))
            .map(|(_, e)| e.clone())
            .collect();
        let lifted: Vec<String> = list
            .keys()
            .filter(|id| !next.contains_key(*id))
            .cloned()
            .collect();
        *list = next;
        for entry in &added {
            let Ok(identity) = parse_identity(&entry.identity) else {
                continue;
            };
            before_closing(&identity, &entry.revoked_by);
            let closed = self.close(&identity);
            tracing::warn!(identity = %identity, by = %toolsrv_proto::text::printable_line(&entry.revoked_by, 256), reason = %toolsrv_proto::text::printable_line(&entry.reason, 1024), connections_closed = closed, "identity revoked through another replica");
        }
        for identity in lifted {
            tracing::warn!(identity = %identity, "revocation lifted through another replica");
        }
        Ok(())
    }

    /// Puts back a revocation lifted here that etcd could not lift for the others.
    pub fn restore(&self, revocation: &Revocation) -> Result<(), Status> {
        let mut list = self.lock();
        let mut next = list.clone();
        next.insert(
            revocation.identity.clone(),
            Entry {
                identity: revocation.identity.clone(),
                reason: revocation.reason.clone(),
                revoked_by: revocation.revoked_by.clone(),
                revoked_unix_ms: revocation.revoked_unix_ms,
            },
        );
        if let Some(path) = self.persistent()? {
            save(path, &next)?;
        }
        *list = next;
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        // Every change is made whole under the lock; a panic elsewhere leaves it consistent.
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connections to close when an identity is revoked.
    pub fn enforce_on(&self, conns: Connections) {
        let _ = self.conns.set(conns);
    }

    /// Refuses a revoked identity: PERMISSION_DENIED naming the revocation.
    pub fn check(&self, identity: &Identity) -> Result<(), Status> {
        match self.lock().get(&identity.to_string()) {
            None => Ok(()),
            Some(entry) => Err(Status::permission_denied(refusal(entry))),
        }
    }

    /// Whether `identity` is revoked.
    pub fn is_revoked(&self, identity: &Identity) -> bool {
        self.lock().contains_key(&identity.to_string())
    }

    /// Every revocation, sorted by identity.
    pub fn list(&self) -> Vec<Revocation> {
        self.lock().values().map(Entry::proto).collect()
    }

    /// Revokes `identity` on behalf of administrator `by`: saved, then in force, then
    /// `before_closing` runs (to end an agent's link with the revocation as its reason), then its
    /// open connections are closed: at once, or, when `before_closing` says a link is telling
    /// its agent why (true), [`TOLD_WITHIN`] later, so that the Goodbye gets out. Every request
    /// on them is refused meanwhile, as for any revoked identity.
    pub fn revoke(
        &self,
        identity: &Identity,
        reason: &str,
        by: &str,
        before_closing: impl FnOnce() -> bool,
    ) -> Result<Revoked, Status> {
        let path = self.persistent()?;
        if reason.len() > MAX_REASON_BYTES {
            return Err(Status::invalid_argument(format!(
                "the reason is {} bytes, over the limit of {MAX_REASON_BYTES} bytes",
                reason.len()
            )));
        }
        if reason.chars().any(char::is_control) {
            return Err(Status::invalid_argument(
                "the reason has control characters (a line break?): give one line of text",
            ));
        }
        let mut list = self.lock();
        let (entry, already) = match list.get(&identity.to_string()) {
            Some(entry) => (entry.clone(), true),
            None => {
                let entry = Entry {
                    identity: identity.to_string(),
                    reason: reason.to_string(),
                    revoked_by: by.to_string(),
                    revoked_unix_ms: now_ms(),
                };
                let mut next = list.clone();
                next.insert(identity.to_string(), entry.clone());
                if let Some(path) = path {
                    save(path, &next)?;
                }
                *list = next;
                (entry, false)
            }
        };
        let telling = before_closing();
        // Still under the lock: a connection registered after this scan is one whose requests
        // will all be checked against the list that now holds the identity.
        let closed = if telling {
            self.close_later(identity)
        } else {
            self.close(identity)
        };
        drop(list);
        Ok(Revoked {
            revocation: entry.proto(),
            already,
            closed,
        })
    }

    /// Lifts the revocation of `identity`; NOT_FOUND if it is not revoked.
    pub fn unrevoke(&self, identity: &Identity) -> Result<Revocation, Status> {
        let path = self.persistent()?;
        let mut list = self.lock();
        let Some(entry) = list.get(&identity.to_string()).cloned() else {
            return Err(Status::not_found(format!(
                "{identity} is not revoked on this coordinator (`toolctl revocations` lists \
                 what is)"
            )));
        };
        let mut next = list.clone();
        next.remove(&identity.to_string());
        if let Some(path) = path {
            save(path, &next)?;
        }
        *list = next;
        Ok(entry.proto())
    }

    /// Closes the open connections of `identity` [`TOLD_WITHIN`] from now; how many there are.
    fn close_later(&self, identity: &Identity) -> usize {
        let Some(conns) = self.conns.get().cloned() else {
            return 0;
        };
        let mut open = 0;
        conns.for_each(|peer, _| open += usize::from(&peer.identity == identity));
        let identity = identity.clone();
        tokio::spawn(async move {
            tokio::time::sleep(TOLD_WITHIN).await;
            conns.close_where(|peer, _| peer.identity == identity);
        });
        open
    }

    /// Closes the open connections of `identity`; how many there were.
    fn close(&self, identity: &Identity) -> usize {
        self.conns
            .get()
            .map(|conns| conns.close_where(|peer, _| &peer.identity == identity))
            .unwrap_or(0)
    }

    /// Where the list is saved: the state directory's file; none when it is kept in etcd
    /// alone. Refused when it would be kept nowhere.
    fn persistent(&self) -> Result<Option<&Path>, Status> {
        if self.path.is_none() && self.shared.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(None);
        }
        self.path.as_deref().map(Some).ok_or_else(|| {
            Status::failed_precondition(
                "this coordinator has no --state-dir, so a revocation would not survive a \
                 restart: start it with --state-dir DIR to revoke identities (or revoke single \
                 certificates with a CRL, --crl FILE)",
            )
        })
    }
}

/// Follows the server credentials: at start, after each reload and at least every hour (sooner
/// when a certificate enters its warning window sooner: [`ExpiryWatch::check_own`]), checks the
/// coordinator's own certificate and CA bundle for expiry; after each reload, closes the open
/// connections whose certificate a CRL now lists (the handshake refuses new ones).
pub async fn follow_crls(
    mut crls: watch::Receiver<Arc<Crls>>,
    conns: Connections,
    expiry: Arc<ExpiryWatch>,
    shutdown: CancellationToken,
) {
    let mut next_look = tokio::time::Instant::now() + expiry.check_own();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep_until(next_look) => {
                next_look = tokio::time::Instant::now() + expiry.check_own();
            }
            changed = crls.changed() => {
                if changed.is_err() {
                    return;
                }
                let current = crls.borrow_and_update().clone();
                // A reloaded certificate has its own window: the next look follows it.
                next_look = tokio::time::Instant::now() + expiry.check_own();
                if current.is_empty() {
                    continue;
                }
                let mut revoked = Vec::new();
                let closed = conns.close_where(|peer, leaf| {
                    let hit = current.revokes(leaf);
                    if hit {
                        revoked.push(peer.identity.to_string());
                    }
                    hit
                });
                if closed > 0 {
                    tracing::warn!(closed, identities = ?revoked, "closed connections whose certificate a CRL now revokes");
                }
            }
        }
    }
}

/// `Revoke`: administrators only; audited whatever the outcome. An agent's link is ended first
/// with the revocation as its reason, so its calls end saying why; then the connection goes.
pub(crate) fn revoke_rpc(
    state: &State,
    req: tonic::Request<RevokeRequest>,
) -> Result<RevokeResponse, Status> {
    let caller = Caller::client(&req)?;
    let req = req.into_inner();
    // Audited under the identity as read (lowercase) once it is valid, as given otherwise.
    let audit = |identity: &str, outcome: Result<&str, &Status>| {
        state
            .audit
            .revocation("revoke", identity, &caller, &req.reason, outcome)
    };
    let done = (|| {
        Caller::admin_name(&caller, &state.config.admins)?;
        let identity = parse_identity(&req.identity)?;
        if identity == Identity::Client(caller.clone()) {
            return Err(Status::invalid_argument(format!(
                "client/{caller} is the identity this request comes from: revoking it would \
                 lock you out; ask another administrator"
            )));
        }
        state
            .revocations
            .revoke(&identity, &req.reason, &caller, || {
                end_agent_link(state, &identity, &caller)
            })
    })();
    match done {
        Ok(done) => {
            audit(
                &done.revocation.identity,
                Ok(if done.already { "unchanged" } else { "done" }),
            );
            tracing::warn!(
                identity = %done.revocation.identity,
                by = %caller,
                reason = %toolsrv_proto::text::printable_line(&done.revocation.reason, 1024),
                connections_closed = done.closed,
                already = done.already,
                "identity revoked"
            );
            Ok(RevokeResponse {
                revocation: Some(done.revocation),
                already: done.already,
                connections_closed: u32::try_from(done.closed).unwrap_or(u32::MAX),
            })
        }
        Err(status) => {
            audit(&req.identity, Err(&status));
            Err(status)
        }
    }
}

/// The entry of a record kept in etcd under `key`; a record that cannot be read still revokes
/// the identity its key names. `None` when the key names no identity.
fn entry_of(key: &str, record: &[u8]) -> Option<(String, Entry)> {
    let Ok(identity) = parse_identity(key) else {
        tracing::warn!(identity = ?key, "ignoring a revocation in etcd that names no identity");
        return None;
    };
    let mut entry = serde_json::from_slice::<Entry>(record).unwrap_or_else(|e| {
        tracing::warn!(identity = %identity, error = %toolsrv_proto::text::printable_line(&e.to_string(), 1024), "a revocation record in etcd cannot be read; the identity stays revoked");
        Entry {
            identity: identity.to_string(),
            reason: "revoked on another replica (its record is unreadable)".into(),
            revoked_by: String::new(),
            revoked_unix_ms: 0,
        }
    });
    // The key says who is revoked; a record naming someone else is not believed.
    entry.identity = identity.to_string();
    Some((identity.to_string(), entry))
}

/// How long a revoked agent's connections stay open for its link's Goodbye to get out: the
/// link waits 2 s at most to send it.
const TOLD_WITHIN: std::time::Duration = std::time::Duration::from_millis(2500);

/// Ends a revoked agent's link, with the revocation as its reason, so its calls end saying why
/// and the agent is told in a Goodbye (before its connection is closed); whether it had one.
/// The host is then forgotten once offline (`forget_offline_hosts`).
pub(crate) fn end_agent_link(state: &State, identity: &Identity, by: &str) -> bool {
    let Identity::Agent(host) = identity else {
        return false;
    };
    let link = state.fleet.get(host).and_then(|h| h.link);
    if let Some(link) = &link {
        link.refuse(&format!("its identity {identity} was revoked by {by}"));
    }
    state.agent_revoked.notify_one();
    link.is_some()
}

/// `Revoke` on a replica: revoked here ([`revoke_rpc`]), then written to etcd for the others;
/// UNAVAILABLE when etcd cannot take it (the identity is refused here already; retrying
/// writes it again).
pub(crate) async fn revoke_shared(
    state: &State,
    req: tonic::Request<RevokeRequest>,
) -> Result<RevokeResponse, Status> {
    let done = revoke_rpc(state, req)?;
    let Some(replicas) = &state.replicas else {
        return Ok(done);
    };
    let Some(revocation) = &done.revocation else {
        return Ok(done);
    };
    let identity = parse_identity(&revocation.identity)?;
    let record = state.revocations.record(&identity).unwrap_or_default();
    match replicas
        .cluster
        .put_revocation(&revocation.identity, &record)
        .await
    {
        Ok(()) => Ok(done),
        Err(e) => Err(Status::unavailable(format!(
            "{identity} is revoked on this replica, but etcd could not record it for the other \
             replicas ({e}): revoke it again once etcd answers"
        ))),
    }
}

/// `Unrevoke` on a replica: lifted here ([`unrevoke_rpc`]), then in etcd for the others; when
/// etcd cannot take it, the revocation is put back here too and the request fails UNAVAILABLE.
pub(crate) async fn unrevoke_shared(
    state: &State,
    req: tonic::Request<UnrevokeRequest>,
) -> Result<UnrevokeResponse, Status> {
    let done = unrevoke_rpc(state, req)?;
    let Some(replicas) = &state.replicas else {
        return Ok(done);
    };
    let Some(removed) = &done.removed else {
        return Ok(done);
    };
    match replicas.cluster.delete_revocation(&removed.identity).await {
        Ok(_) => Ok(done),
        Err(e) => {
            state.revocations.restore(removed)?;
            Err(Status::unavailable(format!(
                "etcd could not lift the revocation of {} for every replica ({e}); it still \
                 holds: try again once etcd answers",
                removed.identity
            )))
        }
    }
}

/// `Unrevoke`: administrators only; audited whatever the outcome.
pub(crate) fn unrevoke_rpc(
    state: &State,
    req: tonic::Request<UnrevokeRequest>,
) -> Result<UnrevokeResponse, Status> {
    let caller = Caller::client(&req)?;
    let req = req.into_inner();
    let done = (|| {
        Caller::admin_name(&caller, &state.config.admins)?;
        let identity = parse_identity(&req.identity)?;
        // Lifting a revocation lets an identity in again: not while the audit log cannot record
        // it ([`crate::audit`]). A revocation shuts one out, and goes on.
        state.audit.writable().map_err(Status::unavailable)?;
        state.revocations.unrevoke(&identity)
    })();
    match done {
        Ok(removed) => {
            state
                .audit
                .revocation("unrevoke", &removed.identity, &caller, "", Ok("done"));
            tracing::warn!(identity = %removed.identity, by = %caller, "revocation lifted");
            Ok(UnrevokeResponse {
                removed: Some(removed),
            })
        }
        Err(status) => {
            state
                .audit
                .revocation("unrevoke", &req.identity, &caller, "", Err(&status));
            Err(status)
        }
    }
}

/// `ListRevocations`: administrators only.
pub(crate) fn list_rpc(
    state: &State,
    req: &tonic::Request<ListRevocationsRequest>,
) -> Result<ListRevocationsResponse, Status> {
    Caller::admin(req, &state.config.admins)?;
    Ok(ListRevocationsResponse {
        revocations: state.revocations.list(),
    })
}

/// The refusal a revoked identity gets.
fn refusal(entry: &Entry) -> String {
    let why = if entry.reason.is_empty() {
        String::new()
    } else {
        format!(": {}", entry.reason)
    };
    format!(
        "the identity {} is revoked on this coordinator (by {}{why}); an administrator can \
         lift it with `toolctl unrevoke {}`",
        entry.identity, entry.revoked_by, entry.identity
    )
}

/// Writes the list to a temporary file beside `path`, flushes it to disk and renames it over
/// `path`, so that a crash leaves the old list or the new one, never half of one.
fn save(path: &Path, list: &BTreeMap<String, Entry>) -> Result<(), Status> {
    let disk = OnDisk {
        revocations: list.values().cloned().collect(),
    };
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        tracing::error!(file = %path.display(), error = %e, "cannot save the revocations");
        // A full or read-only disk, as for join tokens: retry once the state directory is
        // writable (`UNAVAILABLE`, exit 75), not a fault of the coordinator's (exit 70).
        Status::unavailable(format!(
            "cannot {what} {}: {e}; nothing was changed",
            path.display()
        ))
    };
    let mut bytes = serde_json::to_vec_pretty(&disk).map_err(|e| failed("encode", &e))?;
    bytes.push(b'\n');
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        toolsrv_tls::write_atomically(path, &bytes)
    };
    write().map_err(|e| failed("write", &e))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A state directory that cannot be written is a condition to retry once it is fixed
    /// (`UNAVAILABLE`, exit 75), as for join tokens, not an internal error.
    #[test]
    fn a_list_that_cannot_be_saved_is_unavailable_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("not-a-dir");
        std::fs::write(&blocker, "").unwrap();
        let path = blocker.join("revocations.json");
        let err = save(&path, &BTreeMap::new()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert!(
            err.message().contains("revocations.json"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn records_from_etcd_revoke_what_their_key_names_however_they_read() {
        let good = br#"{"identity": "agent/web-1", "reason": "stolen", "revoked_by": "alice", "revoked_unix_ms": 5}"#;
        let (id, entry) = entry_of("agent/web-1", good).unwrap();
        assert_eq!(
            (id.as_str(), entry.reason.as_str()),
            ("agent/web-1", "stolen")
        );
        // Unreadable: still revoked, and the reason says why there is none.
        for junk in [
            &b"not json"[..],
            b"",
            b"{\"identity\": 7}",
            &[0xff, 0xfe, 0x00],
        ] {
            let (id, entry) = entry_of("client/bob", junk).unwrap();
            assert_eq!(id, "client/bob");
            assert_eq!(entry.identity, "client/bob");
            assert!(entry.reason.contains("unreadable"), "{}", entry.reason);
        }
        // A record naming another identity than its key: the key wins.
        let (id, entry) = entry_of("agent/web-2", good).unwrap();
        assert_eq!(
            (id.as_str(), entry.identity.as_str()),
            ("agent/web-2", "agent/web-2")
        );
        // Keys that name no identity are ignored.
        for key in [
            "",
            "agent/",
            "web-1",
            "coordinator/x",
            "agent/a/b",
            "client/\u{0}",
        ] {
            assert!(entry_of(key, good).is_none(), "{key:?}");
        }
    }

    #[test]
    fn identities_are_read_in_lowercase_and_odd_ones_refused() {
        for (text, want) in [
            ("agent/Web-1", Some("agent/web-1")),
            ("client/ALICE", Some("client/alice")),
            ("toolsrv://client/bob", Some("client/bob")),
            ("coordinator", None),
            ("agent/", None),
            ("agent/a b", None),
            ("agent/a\0", None),
            ("agent/a/b", None),
            ("admin", None),
            ("client/é", None),
            ("", None),
        ] {
            let got = parse_identity(text).ok().map(|i| i.to_string());
            assert_eq!(got.as_deref(), want, "{text:?}");
        }
        assert!(parse_identity(&format!("client/{}", "a".repeat(400))).is_err());
    }

    #[test]
    fn revocations_are_kept_across_restarts_and_need_a_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let bob = Identity::client("bob").unwrap();
        let revs = Revocations::load(Some(dir.path())).unwrap();
        let done = revs
            .revoke(&bob, "left the team", "admin", || false)
            .unwrap();
        assert!(!done.already);
        assert!(
            revs.revoke(&bob, "again", "admin", || false)
                .unwrap()
                .already
        );
        let err = revs.check(&bob).unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert!(err.message().contains("client/bob") && err.message().contains("left the team"));

        let again = Revocations::load(Some(dir.path())).unwrap();
        assert!(again.is_revoked(&bob));
        assert_eq!(again.list()[0].reason, "left the team");
        again.unrevoke(&bob).unwrap();
        assert_eq!(
            again.unrevoke(&bob).unwrap_err().code(),
            tonic::Code::NotFound
        );
        assert!(
            !Revocations::load(Some(dir.path()))
                .unwrap()
                .is_revoked(&bob)
        );

        let none = Revocations::load(None).unwrap();
        let err = none.revoke(&bob, "", "admin", || false).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("--state-dir"), "{}", err.message());
        assert!(none.check(&bob).is_ok());

        let carol = Identity::client("carol").unwrap();
        assert!(
            revs.revoke(&carol, "two\nlines", "admin", || false)
                .is_err()
        );
    }

    #[test]
    fn a_broken_file_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE_NAME), "{not json").unwrap();
        let err = Revocations::load(Some(dir.path())).unwrap_err();
        assert!(err.to_string().contains(FILE_NAME), "{err}");
        std::fs::write(
            dir.path().join(FILE_NAME),
            r#"{"revocations": [{"identity": "coordinator", "revoked_by": "x", "revoked_unix_ms": 1}]}"#,
        )
        .unwrap();
        assert!(Revocations::load(Some(dir.path())).is_err());
    }
}
