//! Following etcd into the routing table: a watch on the whole prefix from the revision after
//! the last listing; on compaction, cancellation (etcd cancels watches that require a leader
//! when it loses it) or a failed stream, a new listing replaces the table, then a new watch.
//! While etcd is out of reach the table keeps what it had.

use std::sync::Arc;

use tokio::time::Instant;

use crate::client::pb::mvccpb::event::EventType;
use crate::cluster::Shared;
use crate::etcd;
use crate::health::Condition;
use crate::lease::describe;
use crate::table::{Change, ClusterEvent};

/// The watcher task: `revision` is the one the table was listed at.
pub(crate) async fn follow(shared: Arc<Shared>, mut revision: i64) {
    let prefix = shared.keys.prefix().to_string();
    let mut failures = 0u32;
    let mut down = Down::default();
    // Set when the table must be listed again before the next watch.
    let mut stale = false;
    loop {
        if std::mem::take(&mut stale) {
            match etcd::list(&shared.client, &prefix).await {
                Ok((listing, listed_at)) => {
                    let events = shared.table_mut().replace(&shared.keys, listing, listed_at);
                    dispatch(&shared, events);
                    revision = listed_at;
                }
                Err(fault) => {
                    down.failed(
                        &shared,
                        format!("cannot list {prefix}: {}", describe(&fault)),
                    );
                    stale = true;
                    failures += 1;
                    if pause(&shared, failures).await {
                        return;
                    }
                    continue;
                }
            }
        }
        let mut stream = match etcd::watch(&shared.client, &prefix, revision + 1).await {
            Ok(stream) => stream,
            Err(fault) => {
                down.failed(
                    &shared,
                    format!("cannot watch {prefix}: {}", describe(&fault)),
                );
                failures += 1;
                stale = true;
                if pause(&shared, failures).await {
                    return;
                }
                continue;
            }
        };
        loop {
            let message = tokio::select! {
                () = shared.cancel.cancelled() => return,
                m = stream.message() => m,
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => {
                    down.failed(&shared, format!("the watch of {prefix} ended"));
                    break;
                }
                Err(fault) => {
                    down.failed(
                        &shared,
                        format!("the watch of {prefix} failed: {}", describe(&fault)),
                    );
                    break;
                }
            };
            if response.compact_revision > 0 || response.canceled {
                tracing::info!(
                    compacted = response.compact_revision,
                    reason = response.cancel_reason,
                    "watch cancelled; listing again"
                );
                if !response.cancel_reason.is_empty() {
                    down.failed(
                        &shared,
                        format!("etcd cancelled the watch: {}", response.cancel_reason),
                    );
                }
                break;
            }
            if response.created {
                down.recovered(&shared);
                failures = 0;
            }
            let at = response.header.map_or(0, |h| h.revision);
            let changes: Vec<Change> = response
                .events
                .into_iter()
                .filter_map(|event| {
                    let kv = event.kv?;
                    // An event type this crate does not know is skipped, not guessed.
                    Some(match EventType::try_from(event.r#type).ok()? {
                        EventType::Put => Change::Put {
                            key: kv.key,
                            value: kv.value,
                            mod_revision: kv.mod_revision,
                        },
                        EventType::Delete => Change::Delete { key: kv.key },
                    })
                })
                .collect();
            if changes.is_empty() {
                continue;
            }
            let events = shared.table_mut().apply(&shared.keys, changes, at);
            dispatch(&shared, events);
        }
        // Whatever ended the watch, what it missed is read from a new listing.
        stale = true;
        failures += 1;
        if pause(&shared, failures).await {
            return;
        }
    }
}

/// Since when the watch has been failing: a watch that comes back within a request timeout
/// (its member went away, another one took it) does not make the replica unhealthy.
#[derive(Debug, Default)]
struct Down {
    since: Option<Instant>,
}

impl Down {
    fn failed(&mut self, shared: &Shared, reason: String) {
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= shared.config.request_timeout {
            shared.health.fail(Condition::Watch, reason, None);
        } else {
            tracing::debug!(%reason, "watch interrupted; resuming");
        }
    }

    fn recovered(&mut self, shared: &Shared) {
        self.since = None;
        shared.health.clear(Condition::Watch);
    }
}

/// Waits before the next attempt; `true` if the cluster is shutting down.
async fn pause(shared: &Shared, failures: u32) -> bool {
    let wait = shared
        .policy
        .delay(failures.saturating_sub(1), fastrand::f64());
    tokio::select! {
        () = shared.cancel.cancelled() => true,
        () = tokio::time::sleep(wait) => false,
    }
}

/// Hands the table's events to the subscribers, after checking our claims against them.
fn dispatch(shared: &Shared, events: Vec<ClusterEvent>) {
    for event in events {
        match &event {
            ClusterEvent::CatalogChanged(agreed) => shared.publish_catalog(agreed),
            ClusterEvent::ReplicaGone { replica, hosts } => {
                tracing::info!(replica = %replica.id, hosts = hosts.len(), "replica gone");
            }
            _ => {}
        }
        let host = match &event {
            ClusterEvent::HostClaimed { host_id, .. } => Some(host_id.clone()),
            _ => None,
        };
        shared.emit(event);
        if let Some(host_id) = host {
            shared.reconcile(&host_id);
        }
    }
}
