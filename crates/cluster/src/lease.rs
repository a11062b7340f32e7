//! Keeping this replica's lease: renewals every third of the TTL over a keep-alive stream
//! (reopened on another member when it fails), and when the lease is lost (etcd says it is
//! gone, or no renewal succeeded for a whole TTL) a new lease with every record of this replica
//! put back under it, unless a newer claim replaced it meanwhile.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::client::KeepAlive;
use crate::cluster::{Lease, Shared};
use crate::error::{ClusterError, Fault, Result};
use crate::etcd::{self, Expect};
use crate::health::Condition;
use crate::records::{HostRecord, parse};
use crate::retry::retry;
use crate::table::ClusterEvent;

/// The longest wait between two grant attempts while the lease is lost.
const MAX_GRANT_DELAY: Duration = Duration::from_secs(1);

/// The keeper task: runs until the cluster is shut down or dropped.
pub(crate) async fn keep(shared: Arc<Shared>) {
    let Some(mut lease) = *shared.lease.borrow() else {
        return;
    };
    let mut last_ok = Instant::now();
    let mut stream: Option<KeepAlive> = None;
    let mut failures = 0u32;
    // The most telling fault since the last renewal: a missing leader says more than the
    // member that happened to be down for the last attempt.
    let mut since_ok: Option<Fault> = None;
    loop {
        let ttl = Duration::from_secs(u64::try_from(lease.ttl).unwrap_or(1).max(1));
        let renewal = tokio::time::timeout(
            shared.config.request_timeout,
            renew(&shared, lease, &mut stream),
        )
        .await
        .unwrap_or_else(|_| Err(Fault::Unreachable("lease renewal timed out".into())));
        let wait = match renewal {
            Ok(()) => {
                last_ok = Instant::now();
                failures = 0;
                since_ok = None;
                shared.health.clear(Condition::Etcd);
                clean_abandoned(&shared).await;
                ttl / 3
            }
            Err(Fault::LeaseNotFound(detail)) => {
                lease = regain(&shared, lease, last_ok, &format!("etcd says: {detail}")).await;
                (stream, last_ok) = (None, Instant::now());
                continue;
            }
            Err(fault) => {
                stream = None;
                let fault = match since_ok.take() {
                    Some(before) => before.most_telling(fault),
                    None => fault,
                };
                since_ok = Some(fault.clone());
                // One failed renewal is a member going away (the next one goes elsewhere) or
                // an election; half a TTL without one is etcd out of service.
                if last_ok.elapsed() >= ttl / 2 {
                    shared
                        .health
                        .fail(Condition::Etcd, describe(&fault), Some(fault.clone()));
                } else {
                    tracing::debug!(fault = ?fault, "lease renewal failed; trying again");
                }
                if last_ok.elapsed() >= ttl {
                    let why = format!(
                        "no renewal for {:?}: {}",
                        last_ok.elapsed(),
                        describe(&fault)
                    );
                    lease = regain(&shared, lease, last_ok, &why).await;
                    (stream, last_ok) = (None, Instant::now());
                    continue;
                }
                failures += 1;
                shared.policy.delay(failures, fastrand::f64()).min(ttl / 6)
            }
        };
        tokio::select! {
            () = shared.cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// What a failing condition says about etcd.
pub(crate) fn describe(fault: &Fault) -> String {
    match fault {
        Fault::NoLeader(d) => format!("no quorum (etcd has no leader: {d})"),
        Fault::Unreachable(d) => format!("unreachable ({d})"),
        Fault::LeaseNotFound(d) => format!("lease not found ({d})"),
        Fault::Conflict => "conflicting writes".into(),
        Fault::Compacted(d) => format!("history compacted ({d})"),
        Fault::Permanent(d) => format!("refused ({d})"),
    }
}

/// One renewal, opening the keep-alive stream if there is none (which renews too).
async fn renew(shared: &Shared, lease: Lease, stream: &mut Option<KeepAlive>) -> Result<(), Fault> {
    let ttl = match stream.as_mut() {
        Some(keeper) => keeper.renew().await?,
        None => {
            let (opened, ttl) = etcd::keep_alive(&shared.client, lease.id).await?;
            *stream = Some(opened);
            ttl
        }
    };
    if ttl > 0 {
        Ok(())
    } else {
        Err(Fault::LeaseNotFound("the lease expired".into()))
    }
}

/// Grants a new lease and puts this replica's records back under it, retrying until it
/// succeeds or the cluster is shut down. Returns the new lease.
async fn regain(shared: &Arc<Shared>, old: Lease, last_ok: Instant, why: &str) -> Lease {
    shared.lease.send_replace(None);
    shared.health.fail(
        Condition::Lease,
        format!("lease {:x} lost: {why}", old.id),
        None,
    );
    let mut attempt = 0u32;
    loop {
        match grant_and_republish(shared).await {
            Ok((lease, republished)) => {
                // The old lease holds none of our keys any more; if it still lives, it goes.
                let _ = etcd::revoke(&shared.client, old.id).await;
                shared.health.clear(Condition::Lease);
                let lost_for = last_ok.elapsed();
                tracing::warn!(
                    replica = %shared.config.replica_id,
                    old = format_args!("{:x}", old.id),
                    new = format_args!("{:x}", lease.id),
                    ?lost_for,
                    republished,
                    "lease regained; claims put back"
                );
                shared.emit(ClusterEvent::LeaseRegained {
                    lost_for,
                    republished,
                });
                return lease;
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot regain a lease yet");
                let fault = match &e {
                    ClusterError::NoQuorum { detail, .. } => Some(Fault::NoLeader(detail.clone())),
                    ClusterError::Unavailable { detail, .. } => {
                        Some(Fault::Unreachable(detail.clone()))
                    }
                    _ => None,
                };
                if let Some(fault) = fault {
                    shared
                        .health
                        .fail(Condition::Etcd, describe(&fault), Some(fault));
                }
            }
        }
        attempt += 1;
        let wait = shared
            .policy
            .delay(attempt, fastrand::f64())
            .min(MAX_GRANT_DELAY);
        tokio::select! {
            () = shared.cancel.cancelled() => return old,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

async fn grant_and_republish(shared: &Arc<Shared>) -> Result<(Lease, usize)> {
    let replica_key = shared.keys.replica(&shared.config.replica_id);
    let (id, ttl) = retry("grant lease for", &replica_key, shared.policy, |_| {
        etcd::grant(&shared.client, shared.config.ttl_secs())
    })
    .await?;
    let lease = Lease { id, ttl };
    retry("register", &replica_key, shared.policy, |_| {
        etcd::put(&shared.client, &replica_key, &shared.replica_json, Some(id))
    })
    .await?;
    // Claims made from here on use the new lease; those made before are in the map below.
    shared.lease.send_replace(Some(lease));
    let held: Vec<_> = shared
        .claims()
        .held
        .iter()
        .map(|(h, o)| (h.clone(), o.clone()))
        .collect();
    // Put back PUT_BACKS at a time: one after another, thousands of them would leave the hosts
    // at the end of the list unrouted for seconds.
    let mut republished = 0;
    let mut pending = held.into_iter();
    let mut running = tokio::task::JoinSet::new();
    loop {
        while running.len() < PUT_BACKS {
            let Some((host_id, mine)) = pending.next() else {
                break;
            };
            running.spawn(put_back(shared.clone(), id, host_id, mine));
        }
        let Some(done) = running.join_next().await else {
            break;
        };
        let (host_id, put) = done.map_err(|e| ClusterError::Refused {
            op: "put back claim",
            key: String::new(),
            detail: format!("the task failed: {e}"),
        })?;
        if put? {
            republished += 1;
        } else {
            shared.reconcile(&host_id);
        }
    }
    Ok((lease, republished))
}

/// Claims put back under a new lease at once.
const PUT_BACKS: usize = 64;

/// Puts `host_id`'s claim `mine` back under lease `id`, unless a newer claim holds the host
/// (then `false`: the watcher reports this link superseded).
async fn put_back(
    shared: Arc<Shared>,
    id: i64,
    host_id: String,
    mine: crate::cluster::Owned,
) -> (String, Result<bool>) {
    let key = shared.keys.host(&host_id);
    let (key_ref, mine, shared_ref) = (&key, &mine, &shared);
    let put = retry("put back claim", &key, shared.policy, |_| async move {
        let (key, shared) = (key_ref, shared_ref);
        let found = etcd::get(&shared.client, key).await?;
        if let Some(found) = &found
            && found.value != mine.json
            && found.mod_revision > mine.revision.unwrap_or(0)
            && parse::<HostRecord>("put back claim", key, &found.value).is_ok()
        {
            return Ok(false);
        }
        let expect = Expect::from_read(found.as_ref());
        match etcd::put_if(&shared.client, key, expect, &mine.json, Some(id)).await? {
            Some(_) => Ok(true),
            None => Err(Fault::Conflict),
        }
    })
    .await;
    (host_id, put)
}

/// Removes the claims of failed claims and releases, where they are still those links'.
async fn clean_abandoned(shared: &Shared) {
    let abandoned = std::mem::take(&mut shared.claims().abandoned);
    let mut left = Vec::new();
    for (host_id, link_id) in abandoned {
        let still_ours = shared
            .claims()
            .held
            .get(&host_id)
            .is_some_and(|mine| mine.link_id == link_id);
        if still_ours {
            continue;
        }
        if shared.delete_link(&host_id, &link_id).await.is_err() {
            left.push((host_id, link_id));
        }
    }
    shared.claims().abandoned.extend(left);
}
