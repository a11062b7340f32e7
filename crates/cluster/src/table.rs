//! The routing table: what etcd says about hosts, replicas and the catalog, as the watcher last
//! saw it, and the events each change makes. Pure: the watcher feeds it key changes.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::records::{AgreedCatalog, HostRecord, KeyKind, Keys, ReplicaRecord, parse};

/// A change to the cluster, as every replica sees it through the watch. Receivers that lag
/// behind the broadcast channel miss events: they read the table again
/// ([`crate::Cluster::hosts`]) and carry on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterEvent {
    /// A host was claimed (or its claim changed: a new link, new facts).
    HostClaimed { host_id: String, record: HostRecord },
    /// A host's claim is gone: released, or its owner's lease expired.
    HostReleased { host_id: String, record: HostRecord },
    /// A replica joined (or its record changed).
    ReplicaUp(ReplicaRecord),
    /// A replica's record is gone (shut down, or its lease expired). `hosts` are the hosts it
    /// held just before: they show as reconnecting until they attach elsewhere.
    ReplicaGone {
        replica: ReplicaRecord,
        hosts: Vec<String>,
    },
    /// A link of this replica lost its host to a newer claim: the caller drops that link.
    Superseded {
        host_id: String,
        lost_link_id: String,
        by: HostRecord,
    },
    /// The catalog revision agreed in etcd moved.
    CatalogChanged(AgreedCatalog),
    /// An identity was revoked (or its record changed); `record` as its writer put it.
    Revoked { identity: String, record: Vec<u8> },
    /// An identity's revocation was lifted.
    Unrevoked { identity: String },
    /// This replica lost its lease for `lost_for`, holds a new one and put back the
    /// `republished` claims that no newer claim had replaced.
    LeaseRegained {
        lost_for: Duration,
        republished: usize,
    },
}

/// One key's change, as read from etcd.
#[derive(Debug, Clone)]
pub(crate) enum Change {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        mod_revision: i64,
    },
    Delete {
        key: Vec<u8>,
    },
}

/// A host's entry: its record and the etcd revision that wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostEntry {
    pub record: HostRecord,
    pub mod_revision: i64,
}

/// The table itself.
#[derive(Debug, Default)]
pub(crate) struct Table {
    hosts: BTreeMap<String, HostEntry>,
    replicas: BTreeMap<String, ReplicaRecord>,
    catalog: Option<AgreedCatalog>,
    /// Revoked identities and their records.
    revocations: BTreeMap<String, Vec<u8>>,
    /// The etcd revision the table reflects.
    revision: i64,
}

impl Table {
    pub(crate) fn host(&self, host_id: &str) -> Option<&HostEntry> {
        self.hosts.get(host_id)
    }

    pub(crate) fn hosts(&self) -> Vec<(String, HostRecord)> {
        self.hosts
            .iter()
            .map(|(id, e)| (id.clone(), e.record.clone()))
            .collect()
    }

    pub(crate) fn replicas(&self) -> Vec<ReplicaRecord> {
        self.replicas.values().cloned().collect()
    }

    pub(crate) fn replica(&self, id: &str) -> Option<&ReplicaRecord> {
        self.replicas.get(id)
    }

    pub(crate) fn revocations(&self) -> &BTreeMap<String, Vec<u8>> {
        &self.revocations
    }

    #[cfg(test)]
    pub(crate) fn catalog(&self) -> Option<&AgreedCatalog> {
        self.catalog.as_ref()
    }

    pub(crate) fn revision(&self) -> i64 {
        self.revision
    }

    /// Applies the changes of one watch response (in etcd's order) made at up to `revision`.
    pub(crate) fn apply(
        &mut self,
        keys: &Keys,
        changes: Vec<Change>,
        revision: i64,
    ) -> Vec<ClusterEvent> {
        // Hosts held by each replica whose record goes away in this batch, read before the
        // batch: a lease's expiry deletes the replica and its hosts at one revision, in no
        // particular order.
        let mut held: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for change in &changes {
            if let Change::Delete { key } = change
                && let KeyKind::Replica(id) = keys.kind(key)
            {
                let hosts = self
                    .hosts
                    .iter()
                    .filter(|(_, e)| e.record.owner == id)
                    .map(|(h, _)| h.clone())
                    .collect();
                held.insert(id, hosts);
            }
        }
        let mut events = Vec::new();
        for change in changes {
            self.apply_one(keys, change, &mut held, &mut events);
        }
        self.revision = self.revision.max(revision);
        events
    }

    /// Replaces the table with a full listing taken at `revision` (after a watch failure or a
    /// compaction), with the events of the difference.
    pub(crate) fn replace(
        &mut self,
        keys: &Keys,
        listing: Vec<(Vec<u8>, Vec<u8>, i64)>,
        revision: i64,
    ) -> Vec<ClusterEvent> {
        let listed: std::collections::BTreeSet<&[u8]> =
            listing.iter().map(|(k, _, _)| k.as_slice()).collect();
        let mut changes: Vec<Change> = self
            .keys(keys)
            .into_iter()
            .filter(|k| !listed.contains(k.as_slice()))
            .map(|key| Change::Delete { key })
            .collect();
        changes.extend(
            listing
                .into_iter()
                .map(|(key, value, mod_revision)| Change::Put {
                    key,
                    value,
                    mod_revision,
                }),
        );
        let events = self.apply(keys, changes, revision);
        self.revision = revision;
        events
    }

    fn keys(&self, keys: &Keys) -> Vec<Vec<u8>> {
        let hosts = self.hosts.keys().map(|h| keys.host(h));
        let replicas = self.replicas.keys().map(|r| keys.replica(r));
        let catalog = self.catalog.iter().map(|_| keys.catalog());
        let revocations = self.revocations.keys().map(|i| keys.revocation(i));
        hosts
            .chain(replicas)
            .chain(catalog)
            .chain(revocations)
            .map(String::into_bytes)
            .collect()
    }

    fn apply_one(
        &mut self,
        keys: &Keys,
        change: Change,
        held: &mut BTreeMap<String, Vec<String>>,
        events: &mut Vec<ClusterEvent>,
    ) {
        match change {
            Change::Put {
                key,
                value,
                mod_revision,
            } => {
                let name = String::from_utf8_lossy(&key).into_owned();
                match keys.kind(&key) {
                    KeyKind::Host(host_id) => {
                        let Some(record) = parsed::<HostRecord>(&name, &value) else {
                            return;
                        };
                        let entry = HostEntry {
                            record: record.clone(),
                            mod_revision,
                        };
                        let before = self.hosts.insert(host_id.clone(), entry);
                        if before.is_none_or(|b| b.record != record) {
                            events.push(ClusterEvent::HostClaimed { host_id, record });
                        }
                    }
                    KeyKind::Replica(id) => {
                        let Some(record) = parsed::<ReplicaRecord>(&name, &value) else {
                            return;
                        };
                        let before = self.replicas.insert(id, record.clone());
                        if before.as_ref() != Some(&record) {
                            events.push(ClusterEvent::ReplicaUp(record));
                        }
                    }
                    KeyKind::Catalog => {
                        let Some(record) = parsed::<AgreedCatalog>(&name, &value) else {
                            return;
                        };
                        if self.catalog.as_ref() != Some(&record) {
                            self.catalog = Some(record.clone());
                            events.push(ClusterEvent::CatalogChanged(record));
                        }
                    }
                    KeyKind::Revocation(identity) => {
                        if self.revocations.get(&identity) != Some(&value) {
                            self.revocations.insert(identity.clone(), value.clone());
                            events.push(ClusterEvent::Revoked {
                                identity,
                                record: value,
                            });
                        }
                    }
                    KeyKind::Other => {}
                }
            }
            Change::Delete { key } => match keys.kind(&key) {
                KeyKind::Host(host_id) => {
                    if let Some(entry) = self.hosts.remove(&host_id) {
                        events.push(ClusterEvent::HostReleased {
                            host_id,
                            record: entry.record,
                        });
                    }
                }
                KeyKind::Replica(id) => {
                    if let Some(replica) = self.replicas.remove(&id) {
                        let hosts = held.remove(&id).unwrap_or_default();
                        events.push(ClusterEvent::ReplicaGone { replica, hosts });
                    }
                }
                KeyKind::Catalog => {
                    // Someone removed the agreed revision; the next agreement writes it again.
                    tracing::warn!(key = %String::from_utf8_lossy(&key), "the agreed catalog record was deleted");
                    self.catalog = None;
                }
                KeyKind::Revocation(identity) => {
                    if self.revocations.remove(&identity).is_some() {
                        events.push(ClusterEvent::Unrevoked { identity });
                    }
                }
                KeyKind::Other => {}
            },
        }
    }
}

/// A record from the watch, or `None` (logged) when it does not parse: one bad value under
/// the prefix must not stop the table.
fn parsed<T: serde::de::DeserializeOwned>(key: &str, value: &[u8]) -> Option<T> {
    match parse::<T>("watch", key, value) {
        Ok(record) => Some(record),
        Err(e) => {
            tracing::warn!(error = %e, "ignoring a record");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Keys {
        Keys::new("/t/").unwrap()
    }

    fn host(owner: &str, link: &str) -> HostRecord {
        HostRecord {
            owner: owner.into(),
            owner_url: format!("https://{owner}"),
            link_id: link.into(),
            facts: Default::default(),
            attached_unix: 0,
        }
    }

    fn replica(id: &str) -> ReplicaRecord {
        ReplicaRecord {
            id: id.into(),
            advertise_url: format!("https://{id}"),
            started_unix: 0,
        }
    }

    fn put<T: serde::Serialize>(key: String, value: &T, rev: i64) -> Change {
        Change::Put {
            key: key.into_bytes(),
            value: serde_json::to_vec(value).unwrap(),
            mod_revision: rev,
        }
    }

    fn delete(key: String) -> Change {
        Change::Delete {
            key: key.into_bytes(),
        }
    }

    #[test]
    fn claims_and_replicas_make_events() {
        let k = keys();
        let mut t = Table::default();
        let events = t.apply(
            &k,
            vec![
                put(k.replica("r1"), &replica("r1"), 2),
                put(k.host("a"), &host("r1", "l1"), 3),
                put(k.host("b"), &host("r1", "l2"), 4),
            ],
            4,
        );
        assert_eq!(events.len(), 3, "{events:?}");
        assert_eq!(t.host("a").map(|e| e.mod_revision), Some(3));
        // The same record again (a re-put under a new lease) is no news.
        assert!(
            t.apply(&k, vec![put(k.host("a"), &host("r1", "l1"), 5)], 5)
                .is_empty()
        );
        assert_eq!(t.host("a").map(|e| e.mod_revision), Some(5));
        // A lease expiry: hosts deleted before the replica still count as the replica's.
        let events = t.apply(
            &k,
            vec![
                delete(k.host("a")),
                delete(k.replica("r1")),
                delete(k.host("b")),
            ],
            6,
        );
        assert_eq!(events.len(), 3);
        assert!(events.contains(&ClusterEvent::ReplicaGone {
            replica: replica("r1"),
            hosts: vec!["a".into(), "b".into()],
        }));
        assert!(t.hosts().is_empty() && t.replicas().is_empty());
        assert_eq!(t.revision(), 6);
    }

    #[test]
    fn malformed_and_foreign_keys_are_ignored() {
        let k = keys();
        let mut t = Table::default();
        let events = t.apply(
            &k,
            vec![
                Change::Put {
                    key: k.host("a").into_bytes(),
                    value: b"not json".to_vec(),
                    mod_revision: 2,
                },
                put("/t/unknown".into(), &1, 3),
            ],
            3,
        );
        assert!(events.is_empty());
        assert!(t.host("a").is_none());
    }

    #[test]
    fn a_listing_replaces_the_table_with_the_difference() {
        let k = keys();
        let mut t = Table::default();
        t.apply(
            &k,
            vec![
                put(k.replica("r1"), &replica("r1"), 2),
                put(k.host("a"), &host("r1", "l1"), 3),
                put(k.host("b"), &host("r1", "l2"), 4),
            ],
            4,
        );
        let catalog = AgreedCatalog {
            revision: 3,
            digest: "d".into(),
        };
        let listing = vec![
            (
                k.host("b").into_bytes(),
                serde_json::to_vec(&host("r2", "l9")).unwrap(),
                9,
            ),
            (
                k.replica("r2").into_bytes(),
                serde_json::to_vec(&replica("r2")).unwrap(),
                8,
            ),
            (
                k.catalog().into_bytes(),
                serde_json::to_vec(&catalog).unwrap(),
                7,
            ),
        ];
        let events = t.replace(&k, listing, 10);
        assert!(events.contains(&ClusterEvent::ReplicaGone {
            replica: replica("r1"),
            hosts: vec!["a".into(), "b".into()],
        }));
        assert!(events.contains(&ClusterEvent::HostReleased {
            host_id: "a".into(),
            record: host("r1", "l1"),
        }));
        assert!(events.contains(&ClusterEvent::HostClaimed {
            host_id: "b".into(),
            record: host("r2", "l9"),
        }));
        assert!(events.contains(&ClusterEvent::ReplicaUp(replica("r2"))));
        assert!(events.contains(&ClusterEvent::CatalogChanged(catalog.clone())));
        assert_eq!(t.catalog(), Some(&catalog));
        assert_eq!(t.revision(), 10);
    }
}
