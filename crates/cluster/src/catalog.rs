//! One catalog revision for every replica: a compare-and-swap of `<prefix>catalog`, and the
//! rule that decides what to write.

use crate::cluster::Shared;
use crate::error::{Fault, Result};
use crate::etcd::{self, Expect};
use crate::records::{AgreedCatalog, parse, to_json};
use crate::retry::retry;

/// What to do with the record found in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// etcd already holds our digest at a revision we may serve.
    Adopt(AgreedCatalog),
    /// Write this record (compare-and-swap against what was read).
    Write(AgreedCatalog),
}

/// Decides from the record in etcd (`current`), our catalog, and the highest agreement this
/// replica has seen (`seen`): equal digests adopt etcd's revision; a different digest takes
/// `max(etcd's, ours) + 1`. Never below `seen`, and never `seen`'s revision with another
/// digest: a revision names one tool set.
pub(crate) fn decide(
    current: Option<&AgreedCatalog>,
    digest: &str,
    local_revision: u64,
    seen: Option<&AgreedCatalog>,
) -> Decision {
    let floor = match seen {
        None => 0,
        Some(s) if s.digest == digest => s.revision,
        Some(s) => s.revision.saturating_add(1),
    };
    let write = |revision: u64| {
        Decision::Write(AgreedCatalog {
            revision: revision.max(floor),
            digest: digest.to_string(),
        })
    };
    match current {
        Some(c) if c.digest == digest && c.revision >= floor => Decision::Adopt(c.clone()),
        Some(c) if c.digest == digest => write(floor),
        Some(c) => write(c.revision.max(local_revision).saturating_add(1)),
        None => write(local_revision),
    }
}

impl Shared {
    /// See [`crate::Cluster::agree_catalog`].
    pub(crate) async fn agree_catalog(
        &self,
        digest: &str,
        local_revision: u64,
    ) -> Result<AgreedCatalog> {
        const OP: &str = "agree catalog";
        let key = self.keys.catalog();
        let key_ref = &key;
        let agreed = retry(OP, &key, self.policy, |_| async move {
            let key = key_ref;
            let found = etcd::get(&self.client, key).await?;
            // A record this crate did not write is overwritten (compare-and-swap all the same).
            let current = found
                .as_ref()
                .and_then(|r| parse::<AgreedCatalog>(OP, key, &r.value).ok());
            let seen = self.catalog.borrow().clone();
            match decide(current.as_ref(), digest, local_revision, seen.as_ref()) {
                Decision::Adopt(c) => Ok(c),
                Decision::Write(c) => {
                    let json = to_json(OP, key, &c).map_err(|e| Fault::Permanent(e.to_string()))?;
                    let expect = Expect::from_read(found.as_ref());
                    match etcd::put_if(&self.client, key, expect, &json, None).await? {
                        Some(_) => Ok(c),
                        None => Err(Fault::Conflict),
                    }
                }
            }
        })
        .await?;
        self.publish_catalog(&agreed);
        Ok(agreed)
    }

    /// Publishes an agreed catalog if it is newer than what was published: the published
    /// revision never goes backwards.
    pub(crate) fn publish_catalog(&self, agreed: &AgreedCatalog) {
        self.catalog.send_if_modified(|now| {
            let newer = now.as_ref().is_none_or(|n| agreed.revision > n.revision);
            if newer {
                *now = Some(agreed.clone());
            }
            newer
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(revision: u64, digest: &str) -> AgreedCatalog {
        AgreedCatalog {
            revision,
            digest: digest.into(),
        }
    }

    #[test]
    fn decisions() {
        use Decision::{Adopt, Write};
        // (etcd, our digest, our revision, seen) -> decision
        let cases = [
            (None, "a", 3, None, Write(c(3, "a"))),
            (Some(c(7, "a")), "a", 3, None, Adopt(c(7, "a"))),
            (Some(c(7, "a")), "a", 9, None, Adopt(c(7, "a"))),
            (Some(c(7, "b")), "a", 3, None, Write(c(8, "a"))),
            (Some(c(7, "b")), "a", 12, None, Write(c(13, "a"))),
            // Never backwards: etcd was reset below what we served.
            (None, "a", 1, Some(c(9, "a")), Write(c(9, "a"))),
            (None, "a", 1, Some(c(9, "b")), Write(c(10, "a"))),
            (Some(c(2, "a")), "a", 1, Some(c(9, "a")), Write(c(9, "a"))),
            // Never one revision for two digests.
            (Some(c(9, "a")), "a", 1, Some(c(9, "b")), Write(c(10, "a"))),
            (Some(c(9, "b")), "a", 1, Some(c(9, "b")), Write(c(10, "a"))),
            (Some(c(10, "a")), "a", 1, Some(c(9, "b")), Adopt(c(10, "a"))),
        ];
        for (current, digest, local, seen, want) in cases {
            let got = decide(current.as_ref(), digest, local, seen.as_ref());
            assert_eq!(
                got, want,
                "etcd {current:?}, ours {digest}@{local}, seen {seen:?}"
            );
        }
    }
}
