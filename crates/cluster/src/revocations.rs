//! Revoked identities that every replica refuses: one key per identity under
//! `<prefix>revocations/` (no lease: they outlive every replica), the record as the caller
//! wrote it, and `<prefix>revocations-kept` once etcd holds the list.

use std::collections::BTreeMap;

use crate::cluster::Cluster;
use crate::error::Result;
use crate::etcd::{self, Expect};
use crate::records::{check_key_part, unix_now};
use crate::retry::retry;

/// Longest identity kept (`client/` and a name of at most 253 bytes, with room).
const MAX_IDENTITY_BYTES: usize = 300;

fn check_identity(identity: &str) -> Result<()> {
    check_key_part("the identity", identity, MAX_IDENTITY_BYTES, true)
}

impl Cluster {
    /// The revoked identities etcd holds, as the watch last saw them, with their records.
    pub fn revocations(&self) -> BTreeMap<String, Vec<u8>> {
        self.shared.table().revocations().clone()
    }

    /// Records that `identity` is revoked, for every replica (idempotent).
    pub async fn put_revocation(&self, identity: &str, record: &[u8]) -> Result<()> {
        check_identity(identity)?;
        let key = self.shared.keys.revocation(identity);
        self.check_open("revoke", &key)?;
        let client = &self.shared.client;
        retry("revoke", &key, self.shared.policy, |_| {
            etcd::put(client, &key, record, None)
        })
        .await
        .map(|_| ())
    }

    /// Lifts `identity`'s revocation for every replica: whether etcd held it.
    pub async fn delete_revocation(&self, identity: &str) -> Result<bool> {
        check_identity(identity)?;
        let key = self.shared.keys.revocation(identity);
        self.check_open("unrevoke", &key)?;
        let client = &self.shared.client;
        retry("unrevoke", &key, self.shared.policy, |_| {
            etcd::delete(client, &key)
        })
        .await
    }

    /// Makes etcd the keeper of the revocations and returns the list it holds. The first
    /// replica to call this writes its own list (`local`) there; from then on etcd's list is
    /// the one, and `local` is ignored: an identity unrevoked while a replica was away stays
    /// unrevoked when it comes back.
    pub async fn keep_revocations(
        &self,
        local: &BTreeMap<String, Vec<u8>>,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        let keys = &self.shared.keys;
        let client = &self.shared.client;
        let policy = self.shared.policy;
        let marker = keys.revocations_kept();
        self.check_open("keep revocations", &marker)?;
        let kept = retry("keep revocations", &marker, policy, |_| {
            etcd::get(client, &marker)
        })
        .await?
        .is_some();
        if !kept {
            for (identity, record) in local {
                self.put_revocation(identity, record).await?;
            }
            let since = unix_now().to_string();
            retry("keep revocations", &marker, policy, |_| {
                etcd::put_if(client, &marker, Expect::Absent, since.as_bytes(), None)
            })
            .await?;
            if !local.is_empty() {
                tracing::info!(
                    revocations = local.len(),
                    "this replica's revocations are now kept in etcd for every replica"
                );
            }
        }
        let prefix = keys.revocations();
        let (listing, _) = retry("list revocations", &prefix, policy, |_| {
            etcd::list(client, &prefix)
        })
        .await?;
        Ok(listing
            .into_iter()
            .filter_map(|(key, value, _)| {
                let key = String::from_utf8(key).ok()?;
                Some((key.strip_prefix(&prefix)?.to_string(), value))
            })
            .collect())
    }
}
