//! Host ownership: claiming a host for a link of this replica (newest link wins) and releasing
//! it only while the claim is still that link's.

use crate::cluster::{Cluster, Owned, Shared};
use crate::error::{ClusterError, Fault, Result};
use crate::etcd::{self, Expect};
use crate::health::Condition;
use crate::records::{HostRecord, check_id, parse, to_json};
use crate::retry::retry;
use crate::table::ClusterEvent;

/// A claim recorded in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub host_id: String,
    pub link_id: String,
    /// The etcd revision that wrote it.
    pub revision: i64,
    /// The claim it replaced, if the first attempt saw one (another replica's, or an older
    /// link of this one).
    pub previous: Option<HostRecord>,
}

/// How one claim attempt ended, short of a fault.
enum Outcome {
    Written(i64, Option<Vec<u8>>),
    /// A claim written after this one started holds the host.
    Lost(HostRecord),
}

impl Cluster {
    /// Records that this replica holds `host_id`'s link `record.link_id`, under this replica's
    /// lease. The newest link wins: the claim overwrites any other. Refused at once while etcd
    /// has no quorum or this replica no lease; the caller keeps serving the links it holds.
    ///
    /// The first attempt is a plain put. Retries (the first may have been applied or not) read
    /// the key first, and give up with [`ClusterError::Superseded`] when a claim written after
    /// this one started holds it.
    pub async fn claim(&self, host_id: &str, record: HostRecord) -> Result<Claim> {
        const OP: &str = "claim";
        let shared = &self.shared;
        let key = shared.keys.host(host_id);
        check_id("host id", host_id)?;
        self.check_open(OP, &key)?;
        if let Some(fault) = shared.health.refusal() {
            return Err(fault.into_error(OP, &key, 0, std::time::Duration::ZERO));
        }
        if record.owner != shared.config.replica_id {
            return Err(ClusterError::Invalid {
                what: format!("claim of {host_id}"),
                detail: format!(
                    "names replica {} as owner, but this is replica {}",
                    record.owner, shared.config.replica_id
                ),
            });
        }
        let json = to_json(OP, &key, &record)?;
        let link_id = record.link_id.clone();
        let start = shared.table().revision();
        // Held before the put, so that a lease regained meanwhile puts this claim back too.
        let replaced = shared.claims().held.insert(
            host_id.to_string(),
            Owned {
                link_id: link_id.clone(),
                json: json.clone(),
                revision: None,
            },
        );
        let (json_ref, key_ref) = (&json, &key);
        let outcome = retry(OP, &key, shared.policy, |attempt| async move {
            let (json, key) = (json_ref, key_ref);
            // Without a lease, say why: a lost quorum if etcd told (it is why no new lease
            // comes), otherwise how the lease was lost (etcd out of reach, most often).
            let lease = shared.lease.borrow().map(|l| l.id).ok_or_else(|| {
                shared.health.no_quorum().unwrap_or_else(|| {
                    let why = shared
                        .health
                        .reason(Condition::Lease)
                        .unwrap_or_else(|| "this replica's lease expired".into());
                    Fault::LeaseNotFound(format!(
                        "{why}; a new one is granted as soon as etcd answers"
                    ))
                })
            })?;
            if attempt == 0 {
                // With the claims that arrive meanwhile, as one transaction.
                let (rev, prev) = shared.batcher.put(key, json, lease).await?;
                return Ok(Outcome::Written(rev, prev));
            }
            let found = etcd::get(&shared.client, key).await?;
            if let Some(found) = &found {
                if &found.value == json {
                    return Ok(Outcome::Written(found.mod_revision, None));
                }
                if found.mod_revision > start
                    && let Ok(other) = parse::<HostRecord>(OP, key, &found.value)
                {
                    return Ok(Outcome::Lost(other));
                }
            }
            let expect = Expect::from_read(found.as_ref());
            match etcd::put_if(&shared.client, key, expect, json, Some(lease)).await? {
                Some(rev) => Ok(Outcome::Written(rev, found.map(|f| f.value))),
                None => Err(Fault::Conflict),
            }
        })
        .await;
        match outcome {
            Ok(Outcome::Written(revision, prev)) => {
                if let Some(mine) = shared.claims().held.get_mut(host_id)
                    && mine.link_id == link_id
                {
                    mine.revision = Some(revision);
                }
                shared.reconcile(host_id);
                if let Some(old) = replaced.filter(|old| old.link_id != link_id) {
                    shared.emit(ClusterEvent::Superseded {
                        host_id: host_id.to_string(),
                        lost_link_id: old.link_id,
                        by: record.clone(),
                    });
                }
                let previous = prev.and_then(|p| parse::<HostRecord>(OP, &key, &p).ok());
                Ok(Claim {
                    host_id: host_id.to_string(),
                    link_id,
                    revision,
                    previous,
                })
            }
            Ok(Outcome::Lost(other)) => {
                forget(shared, host_id, &link_id, false);
                Err(ClusterError::Superseded {
                    op: OP,
                    key,
                    owner: other.owner,
                    link_id: other.link_id,
                })
            }
            Err(e) => {
                // The put may have landed all the same: keep trying to remove it.
                forget(shared, host_id, &link_id, true);
                Err(e)
            }
        }
    }

    /// Rewrites the record of `host_id`'s claim (its facts or labels changed) while the claim
    /// is still link `record.link_id`'s, this replica's: whether it was. A claim another link
    /// took meanwhile, here or on another replica, is left as it is (a plain put, as
    /// [`Cluster::claim`] makes, would take the host back). Without a lease the new record is
    /// kept for the claims put back when one is granted.
    pub async fn update_claim(&self, host_id: &str, record: HostRecord) -> Result<bool> {
        const OP: &str = "update claim";
        let shared = &self.shared;
        let key = shared.keys.host(host_id);
        check_id("host id", host_id)?;
        self.check_open(OP, &key)?;
        let json = to_json(OP, &key, &record)?;
        {
            let mut claims = shared.claims();
            match claims.held.get_mut(host_id) {
                Some(mine)
                    if mine.link_id == record.link_id
                        && record.owner == shared.config.replica_id =>
                {
                    mine.json = json.clone();
                }
                _ => return Ok(false),
            }
        }
        let (json_ref, key_ref, record_ref) = (&json, &key, &record);
        let written = retry(OP, &key, shared.policy, |_| async move {
            let (json, key, record) = (json_ref, key_ref, record_ref);
            let Some(lease) = shared.lease.borrow().map(|l| l.id) else {
                return Ok(None);
            };
            let Some(found) = etcd::get(&shared.client, key).await? else {
                return Ok(None);
            };
            match parse::<HostRecord>(OP, key, &found.value) {
                Ok(now) if now.owner == record.owner && now.link_id == record.link_id => {}
                _ => return Ok(None),
            }
            if &found.value == json {
                return Ok(Some(found.mod_revision));
            }
            let expect = Expect::ModRevision(found.mod_revision);
            match etcd::put_if(&shared.client, key, expect, json, Some(lease)).await? {
                Some(revision) => Ok(Some(revision)),
                // Written meanwhile (another link's claim, or a lease put back): read again.
                None => Err(Fault::Conflict),
            }
        })
        .await?;
        let Some(revision) = written else {
            return Ok(shared.lease.borrow().is_none());
        };
        if let Some(mine) = shared.claims().held.get_mut(host_id)
            && mine.link_id == record.link_id
        {
            mine.revision = Some(mine.revision.unwrap_or(0).max(revision));
        }
        shared.reconcile(host_id);
        Ok(true)
    }

    /// Deletes `host_id`'s claim if it is still link `link_id`'s: whether it was. A claim
    /// that could not be deleted now is deleted later, once etcd answers.
    pub async fn release(&self, host_id: &str, link_id: &str) -> Result<bool> {
        const OP: &str = "release";
        let shared = &self.shared;
        let key = shared.keys.host(host_id);
        check_id("host id", host_id)?;
        self.check_open(OP, &key)?;
        forget(shared, host_id, link_id, false);
        let released = retry(OP, &key, shared.policy, |_| {
            shared.delete_link(host_id, link_id)
        })
        .await;
        if released.is_err() {
            shared
                .claims()
                .abandoned
                .push((host_id.to_string(), link_id.to_string()));
        }
        released
    }
}

/// Drops our claim of `host_id` if it is `link_id`'s, and remembers the link for a later
/// clean-up if `abandon`.
fn forget(shared: &Shared, host_id: &str, link_id: &str, abandon: bool) {
    let mut claims = shared.claims();
    if claims
        .held
        .get(host_id)
        .is_some_and(|mine| mine.link_id == link_id)
    {
        claims.held.remove(host_id);
    }
    if abandon {
        claims
            .abandoned
            .push((host_id.to_string(), link_id.to_string()));
    }
}

impl Shared {
    /// One attempt at deleting `host_id`'s claim if it is `link_id`'s.
    pub(crate) async fn delete_link(&self, host_id: &str, link_id: &str) -> Result<bool, Fault> {
        let key = self.keys.host(host_id);
        let Some(found) = etcd::get(&self.client, &key).await? else {
            return Ok(false);
        };
        let ours =
            parse::<HostRecord>("release", &key, &found.value).is_ok_and(|r| r.link_id == link_id);
        if !ours {
            return Ok(false);
        }
        match etcd::delete_if(&self.client, &key, Expect::ModRevision(found.mod_revision)).await? {
            true => Ok(true),
            false => Err(Fault::Conflict),
        }
    }
}
