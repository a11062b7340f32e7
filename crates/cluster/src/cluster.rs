//! A replica in the cluster: joining (lease, replica record, first listing), the background
//! tasks it owns, the read side of the routing table, and leaving.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::client::EtcdClient;
use crate::config::ClusterConfig;
use crate::error::{ClusterError, Result};
use crate::etcd;
use crate::health::{ClusterHealth, Health};
use crate::records::{AgreedCatalog, HostRecord, Keys, ReplicaRecord, to_json, unix_now};
use crate::retry::{RetryPolicy, retry};
use crate::table::{ClusterEvent, Table};

/// How many events a slow subscriber may fall behind before it misses some.
const EVENT_BUFFER: usize = 1024;
/// How long [`Cluster::shutdown`] waits for the background tasks to stop.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// A claim of this replica.
#[derive(Debug, Clone)]
pub(crate) struct Owned {
    pub link_id: String,
    /// The record as written.
    pub json: Vec<u8>,
    /// The revision our put wrote at, once known.
    pub revision: Option<i64>,
}

/// This replica's claims, and links whose claim may be left in etcd after a failed claim or
/// release (removed by the lease keeper once etcd answers).
#[derive(Debug, Default)]
pub(crate) struct Claims {
    pub held: HashMap<String, Owned>,
    pub abandoned: Vec<(String, String)>,
}

/// The lease held now: its id and the TTL etcd granted, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub id: i64,
    pub ttl: i64,
}

/// What the background tasks and the methods share.
pub(crate) struct Shared {
    pub config: ClusterConfig,
    pub keys: Keys,
    pub client: EtcdClient,
    pub policy: RetryPolicy,
    pub health: Health,
    pub table: RwLock<Table>,
    pub claims: Mutex<Claims>,
    pub lease: watch::Sender<Option<Lease>>,
    pub events: broadcast::Sender<ClusterEvent>,
    pub catalog: watch::Sender<Option<AgreedCatalog>>,
    /// The replica record, as put under every lease.
    pub replica_json: Vec<u8>,
    /// Claims' first puts, batched into transactions.
    pub batcher: crate::batch::PutBatcher,
    pub cancel: CancellationToken,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The table and the claims would flood a log line; the configuration says which etcd.
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("lease", &*self.lease.borrow())
            .field("health", &self.health)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn claims(&self) -> std::sync::MutexGuard<'_, Claims> {
        // The map stays consistent through a panic elsewhere: every update is one statement.
        self.claims.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn table(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn table_mut(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.table.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn emit(&self, event: ClusterEvent) {
        // No subscriber is not an error: the table has it all.
        let _ = self.events.send(event);
    }

    /// Compares our claim of `host_id` with the table: our own record tells the revision it
    /// was written at; another link written after ours has superseded it.
    pub(crate) fn reconcile(&self, host_id: &str) {
        let table = self.table();
        let Some(entry) = table.host(host_id) else {
            return;
        };
        let mut claims = self.claims();
        let Some(mine) = claims.held.get_mut(host_id) else {
            return;
        };
        if mine.link_id == entry.record.link_id {
            mine.revision = Some(mine.revision.unwrap_or(0).max(entry.mod_revision));
            return;
        }
        if mine.revision.is_some_and(|ours| entry.mod_revision > ours) {
            let lost = mine.link_id.clone();
            claims.held.remove(host_id);
            drop(claims);
            tracing::info!(host = host_id, link = %lost, by = %entry.record.owner, "link superseded by a newer claim");
            self.emit(ClusterEvent::Superseded {
                host_id: host_id.to_string(),
                lost_link_id: lost,
                by: entry.record.clone(),
            });
        }
    }
}

/// One coordinator replica's membership of the cluster. Dropping it stops its background
/// tasks without revoking its lease (as a crash would): call [`Cluster::shutdown`] to leave.
#[derive(Debug)]
pub struct Cluster {
    pub(crate) shared: Arc<Shared>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
}

impl Cluster {
    /// Connects to etcd, takes a lease, registers this replica under it, reads the routing
    /// table, and starts keeping the lease and following etcd. Every step is retried within
    /// the configuration's retry budget.
    pub async fn join(config: ClusterConfig) -> Result<Self> {
        config.check()?;
        let keys = Keys::new(&config.key_prefix)?;
        let policy = RetryPolicy::new(config.retry_budget);
        let endpoints = config.endpoints.join(",");
        let client = EtcdClient::new(&config)?;
        let replica_key = keys.replica(&config.replica_id);
        let record = ReplicaRecord {
            id: config.replica_id.clone(),
            advertise_url: config.advertise_url.clone(),
            started_unix: unix_now(),
        };
        let replica_json = to_json("join", &replica_key, &record)?;
        let ttl = config.ttl_secs();
        let (id, granted) = retry("grant lease for", &replica_key, policy, |_| {
            etcd::grant(&client, ttl)
        })
        .await?;
        retry("register", &replica_key, policy, |_| {
            etcd::put(&client, &replica_key, &replica_json, Some(id))
        })
        .await?;
        let prefix = keys.prefix().to_string();
        let (listing, revision) =
            retry("list", &prefix, policy, |_| etcd::list(&client, &prefix)).await?;
        let cancel = CancellationToken::new();
        let batcher = crate::batch::PutBatcher::start(client.clone(), cancel.clone());
        let shared = Arc::new(Shared {
            health: Health::new(&config.replica_id),
            config,
            keys,
            client,
            policy,
            table: RwLock::new(Table::default()),
            claims: Mutex::new(Claims::default()),
            lease: watch::Sender::new(Some(Lease { id, ttl: granted })),
            events: broadcast::Sender::new(EVENT_BUFFER),
            catalog: watch::Sender::new(None),
            replica_json,
            batcher,
            cancel,
        });
        let events = shared.table_mut().replace(&shared.keys, listing, revision);
        for event in events {
            if let ClusterEvent::CatalogChanged(c) = &event {
                shared.publish_catalog(c);
            }
        }
        tracing::info!(
            replica = %shared.config.replica_id,
            lease = format_args!("{id:x}"),
            ttl = granted,
            endpoints,
            "joined the cluster"
        );
        let keeper = tokio::spawn(crate::lease::keep(shared.clone()));
        let watcher = tokio::spawn(crate::watcher::follow(shared.clone(), revision));
        Ok(Self {
            shared,
            tasks: Mutex::new(vec![keeper, watcher]),
            closed: AtomicBool::new(false),
        })
    }

    pub fn replica_id(&self) -> &str {
        &self.shared.config.replica_id
    }

    /// The replica holding `host_id`'s link, as the routing table says now.
    pub fn route(&self, host_id: &str) -> Option<HostRecord> {
        self.shared.table().host(host_id).map(|e| e.record.clone())
    }

    /// Every claimed host, by id.
    pub fn hosts(&self) -> Vec<(String, HostRecord)> {
        self.shared.table().hosts()
    }

    /// Every live replica, this one included.
    pub fn replicas(&self) -> Vec<ReplicaRecord> {
        self.shared.table().replicas()
    }

    /// One live replica.
    pub fn replica(&self, id: &str) -> Option<ReplicaRecord> {
        self.shared.table().replica(id).cloned()
    }

    /// The changes seen from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<ClusterEvent> {
        self.shared.events.subscribe()
    }

    pub fn health(&self) -> ClusterHealth {
        self.shared.health.get()
    }

    pub fn health_watch(&self) -> watch::Receiver<ClusterHealth> {
        self.shared.health.subscribe()
    }

    /// The highest catalog agreement seen (from etcd or returned by
    /// [`Cluster::agree_catalog`]); it never goes backwards.
    pub fn catalog(&self) -> Option<AgreedCatalog> {
        self.shared.catalog.borrow().clone()
    }

    pub fn catalog_watch(&self) -> watch::Receiver<Option<AgreedCatalog>> {
        self.shared.catalog.subscribe()
    }

    /// Agrees on the catalog revision to serve for a catalog whose contents have digest
    /// `local_digest` and that this replica would number `local_revision`: etcd's revision when
    /// its digest is ours, otherwise a new revision above both, written by compare-and-swap.
    /// Never returns a revision lower than one it returned before.
    pub async fn agree_catalog(
        &self,
        local_digest: &str,
        local_revision: u64,
    ) -> Result<AgreedCatalog> {
        self.check_open("agree catalog", &self.shared.keys.catalog())?;
        self.shared
            .agree_catalog(local_digest, local_revision)
            .await
    }

    /// Leaves the cluster: stops the background tasks and revokes the lease, so every host
    /// this replica held is free at once. Idempotent.
    pub async fn shutdown(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.cancel.cancel();
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        for task in tasks {
            let abort = task.abort_handle();
            if tokio::time::timeout(STOP_WAIT, task).await.is_err() {
                abort.abort();
            }
        }
        let lease = self.shared.lease.send_replace(None);
        if let Some(lease) = lease {
            let shared = &self.shared;
            let key = shared.keys.replica(&shared.config.replica_id);
            let revoked = retry("revoke lease of", &key, shared.policy, |_| {
                etcd::revoke(&shared.client, lease.id)
            })
            .await;
            match revoked {
                Ok(()) => tracing::info!(replica = %shared.config.replica_id, "left the cluster"),
                Err(e) => tracing::warn!(
                    error = %e,
                    "left the cluster without revoking the lease: its hosts stay claimed until it expires"
                ),
            }
        }
        self.shared.claims().held.clear();
        self.shared.health.left();
    }

    pub(crate) fn check_open(&self, op: &'static str, key: &str) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(ClusterError::Closed {
                op,
                key: key.to_string(),
            });
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
        for task in self
            .tasks
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            task.abort();
        }
    }
}
