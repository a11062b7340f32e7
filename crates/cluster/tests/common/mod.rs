//! What the cluster tests share: a replica's configuration against a test etcd, host
//! records, and bounded waits for events and conditions.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use tokio::sync::broadcast;
use toolsrv_cluster::{Cluster, ClusterConfig, ClusterEvent, HostRecord, new_link_id, unix_now};
use toolsrv_testkit::EtcdCluster;

/// The lease TTL of test replicas: short, so that expiry tests stay quick.
pub const TTL: Duration = Duration::from_secs(2);
/// How long any single test may run.
pub const TEST_LIMIT: Duration = Duration::from_secs(120);

/// Logs to the test's output (`RUST_LOG=toolsrv_cluster=debug` for more).
pub fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("toolsrv_cluster=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A replica `id` of a cluster on `etcd`, with a short lease and quick timeouts.
pub fn config(etcd: &EtcdCluster, id: &str) -> ClusterConfig {
    let mut config = ClusterConfig::new(etcd.endpoints(), id, &format!("https://{id}.test:7443"));
    config.lease_ttl = TTL;
    config.request_timeout = Duration::from_secs(1);
    config.retry_budget = Duration::from_secs(5);
    config.key_prefix = "/test/".into();
    config
}

pub async fn join(etcd: &EtcdCluster, id: &str) -> Cluster {
    Cluster::join(config(etcd, id))
        .await
        .unwrap_or_else(|e| panic!("replica {id} cannot join: {e}"))
}

/// A fresh link's record for a host owned by `cluster`.
pub fn record(cluster: &Cluster) -> HostRecord {
    HostRecord {
        owner: cluster.replica_id().to_string(),
        owner_url: format!("https://{}.test:7443", cluster.replica_id()),
        link_id: new_link_id(),
        facts: BTreeMap::from([("os".to_string(), "linux".to_string())]),
        attached_unix: unix_now(),
    }
}

/// The first event matching `want` within `limit`.
pub async fn next_event(
    rx: &mut broadcast::Receiver<ClusterEvent>,
    limit: Duration,
    what: &str,
    mut want: impl FnMut(&ClusterEvent) -> bool,
) -> ClusterEvent {
    let wait = async {
        loop {
            match rx.recv().await {
                Ok(event) if want(&event) => return event,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    panic!("events closed waiting for {what}")
                }
            }
        }
    };
    tokio::time::timeout(limit, wait)
        .await
        .unwrap_or_else(|_| panic!("no event {what} within {limit:?}"))
}

/// Waits until `check` holds, for at most `limit`.
pub async fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    toolsrv_testkit::wait_until(what, limit, async || check().then_some(()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Runs a test body within [`TEST_LIMIT`].
pub async fn bounded<T>(body: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_LIMIT, body)
        .await
        .unwrap_or_else(|_| panic!("test ran over {TEST_LIMIT:?}"))
}
