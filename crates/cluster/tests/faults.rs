//! etcd faults: one member of three down changes nothing (claims are retried on the live
//! members); two down is a lost quorum (claims refused, health degraded, the routing table
//! kept) until they are back; every member out of reach loses the lease, and claims say so.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{bounded, config, eventually, init_logs, join, next_event, record};
use toolsrv_cluster::{Cluster, ClusterError, ClusterEvent, ClusterHealth, ELECTION_GRACE};
use toolsrv_testkit::EtcdCluster;

/// How many claim/release rounds the one-member-down tests run.
const ROUNDS: usize = 200;

/// The index of the etcd leader.
fn leader(etcd: &EtcdCluster) -> usize {
    etcd.leader()
        .unwrap_or_else(|| panic!("no etcd member is the leader"))
}

/// Counts the transitions of `cluster`'s health to degraded from now on.
fn count_degraded(cluster: &Cluster) -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let count = Arc::new(AtomicUsize::new(0));
    let mut health = cluster.health_watch();
    let counter = count.clone();
    let task = tokio::spawn(async move {
        while health.changed().await.is_ok() {
            if let ClusterHealth::Degraded(reason) = health.borrow_and_update().clone() {
                eprintln!("degraded: {reason}");
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    (count, task)
}

/// `ROUNDS` claims and releases on each of `replicas` in turn, member `victim` killed after
/// the 20th: the errors of each replica.
async fn churn(etcd: &mut EtcdCluster, replicas: &[&Cluster], victim: usize) -> Vec<Vec<String>> {
    let mut errors = vec![Vec::new(); replicas.len()];
    let start = Instant::now();
    for i in 0..ROUNDS {
        if i == 20 {
            etcd.kill(victim);
        }
        for (r, errors) in replicas.iter().zip(&mut errors) {
            let host = format!("{}-host-{}", r.replica_id(), i % 10);
            let link = record(r);
            if let Err(e) = r.claim(&host, link.clone()).await {
                errors.push(e.to_string());
                continue;
            }
            match r.release(&host, &link.link_id).await {
                Ok(true) => {}
                Ok(false) => errors.push(format!("release {host}: not ours any more")),
                Err(e) => errors.push(e.to_string()),
            }
        }
    }
    for (r, errors) in replicas.iter().zip(&errors) {
        eprintln!(
            "replica {}: {ROUNDS} claims and releases with member {victim} killed after 20: {} \
             failed (first: {:?})",
            r.replica_id(),
            errors.len(),
            errors.first(),
        );
    }
    eprintln!("in {:?}", start.elapsed());
    errors
}

/// A replica that tries each etcd request once (no retry): a failed request only moves the
/// next one to the next member.
async fn join_single_attempt(etcd: &EtcdCluster, id: &str) -> Cluster {
    let mut config = config(etcd, id);
    config.retry_budget = Duration::ZERO;
    Cluster::join(config)
        .await
        .unwrap_or_else(|e| panic!("replica {id} cannot join: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_down_changes_nothing() {
    init_logs();
    let mut etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let once = join_single_attempt(&etcd, "once").await;
        let (degraded, watcher) = count_degraded(&a);
        let victim = (leader(&etcd) + 1) % 3;
        let errors = churn(&mut etcd, &[&a, &once], victim).await;
        assert!(errors[0].is_empty(), "{:#?}", errors[0]);
        // Without retries, only the requests that meet the dead member fail: each moves the
        // next request on to a live member, which keeps them all.
        assert!(errors[1].len() <= 5, "{:#?}", errors[1]);
        once.shutdown().await;
        a.claim("kept", record(&a)).await.unwrap();
        eventually("b follows", Duration::from_secs(10), || {
            b.hosts().len() == 1 && b.route("kept").is_some()
        })
        .await;
        assert_eq!(degraded.load(Ordering::SeqCst), 0, "health never degraded");
        assert_eq!(
            (a.health(), b.health()),
            (ClusterHealth::Ok, ClusterHealth::Ok)
        );
        watcher.abort();
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_down_loses_no_claim() {
    init_logs();
    let mut etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let once = join_single_attempt(&etcd, "once").await;
        let (degraded, watcher) = count_degraded(&a);
        let victim = leader(&etcd);
        let errors = churn(&mut etcd, &[&a, &once], victim).await;
        assert!(errors[0].is_empty(), "{:#?}", errors[0]);
        once.shutdown().await;
        eventually(
            "healthy after the election",
            Duration::from_secs(10),
            || a.health().is_ok() && b.health().is_ok(),
        )
        .await;
        eprintln!(
            "health went degraded {} times while the leader was replaced",
            degraded.load(Ordering::SeqCst)
        );
        watcher.abort();
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

/// Claims held besides `h1` while etcd loses its quorum.
const MORE_CLAIMS: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_quorum_claims_are_refused_and_the_table_stays() {
    init_logs();
    let mut etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let held = record(&a);
        a.claim("h1", held.clone()).await.unwrap();
        // More claims, so that putting them back under a new lease is measured.
        let mut others = Vec::new();
        for i in 0..MORE_CLAIMS {
            let link = record(&a);
            a.claim(&format!("more-{i}"), link.clone()).await.unwrap();
            others.push(link);
        }
        // Both tables follow etcd through their watch, which may lag the writes: what each
        // had when quorum went is what it must keep.
        eventually("a and b see every claim", Duration::from_secs(10), || {
            a.hosts().len() == MORE_CLAIMS + 1 && b.hosts().len() == MORE_CLAIMS + 1
        })
        .await;

        let mut a_events = a.subscribe();
        etcd.kill(0);
        etcd.kill(1);
        let start = Instant::now();
        eventually("a degraded", Duration::from_secs(15), || {
            !a.health().is_ok()
        })
        .await;
        eprintln!("degraded after {:?}: {:?}", start.elapsed(), a.health());
        let start = Instant::now();
        let err = a.claim("h2", record(&a)).await.unwrap_err();
        eprintln!("claim refused in {:?}: {err}", start.elapsed());
        // Refused either way; the reason depends on what etcd said first. The surviving member
        // refuses requests as leaderless once its election timeout has passed, but until then
        // it holds them, and on a loaded machine this replica's lease may lapse first (its
        // renewals go unanswered): then the error says how the lease was lost.
        let text = err.to_string();
        match &err {
            ClusterError::NoQuorum { .. } => assert!(
                text.contains("claim /test/hosts/h2: etcd has no quorum"),
                "{err}"
            ),
            ClusterError::NoLease { .. } => assert!(
                text.contains("claim /test/hosts/h2: this replica holds no etcd lease (lease ")
                    && text.contains(" lost: no renewal for ")
                    && text.contains("a new one is granted as soon as etcd answers"),
                "{err}"
            ),
            other => panic!("want NoQuorum or NoLease, got {other:?}"),
        }
        assert_eq!(err.code(), tonic::Code::Unavailable);
        // Once health says so for longer than an election takes, claims are refused at once,
        // without waiting for etcd.
        eventually(
            "a knows etcd lost quorum",
            Duration::from_secs(10),
            || matches!(a.health(), ClusterHealth::Degraded(r) if r.contains("etcd: no quorum")),
        )
        .await;
        tokio::time::sleep(ELECTION_GRACE).await;
        let start = Instant::now();
        let err = a.claim("h3", record(&a)).await.unwrap_err();
        assert!(matches!(err, ClusterError::NoQuorum { .. }), "{err}");
        assert!(
            start.elapsed() < Duration::from_millis(100),
            "{:?}",
            start.elapsed()
        );
        // Both replicas keep routing what they knew.
        assert_eq!(b.route("h1"), Some(held.clone()));
        assert_eq!(a.hosts().len(), MORE_CLAIMS + 1);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            b.route("h1"),
            Some(held.clone()),
            "still there past a lease TTL"
        );
        assert!(matches!(b.health(), ClusterHealth::Degraded(_)));

        etcd.try_start_member(0).unwrap();
        etcd.try_start_member(1).unwrap();
        etcd.try_wait_healthy(vec![0, 1, 2]).unwrap();
        let start = Instant::now();
        eventually("healthy again", Duration::from_secs(20), || {
            a.health().is_ok() && b.health().is_ok()
        })
        .await;
        eprintln!("healthy {:?} after etcd recovered", start.elapsed());
        // The lease ran out without renewals: a new one holds the claims put back.
        let regained = next_event(
            &mut a_events,
            Duration::from_secs(10),
            "lease regained",
            |e| matches!(e, ClusterEvent::LeaseRegained { .. }),
        )
        .await;
        eprintln!("{regained:?}");
        assert!(
            matches!(regained, ClusterEvent::LeaseRegained { republished, .. } if republished == MORE_CLAIMS + 1),
            "{regained:?}"
        );
        a.claim("h2", record(&a)).await.unwrap();
        eventually("b sees h2 and still h1", Duration::from_secs(10), || {
            b.route("h2").is_some() && b.route("h1").is_some_and(|r| r.link_id == held.link_id)
        })
        .await;
        for (i, link) in others.iter().enumerate() {
            assert_eq!(
                b.route(&format!("more-{i}")).map(|r| r.link_id),
                Some(link.link_id.clone()),
                "more-{i} put back as a's"
            );
        }
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_out_of_reach_a_claim_names_how_the_lease_was_lost() {
    init_logs();
    let mut etcd = EtcdCluster::start(1);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let held = record(&a);
        a.claim("h1", held.clone()).await.unwrap();
        // The table follows etcd through its watch, which may lag the write.
        eventually("a sees its claim", Duration::from_secs(10), || {
            a.route("h1").is_some()
        })
        .await;
        etcd.kill(0);
        eventually(
            "a lost its lease",
            Duration::from_secs(15),
            || matches!(a.health(), ClusterHealth::Degraded(r) if r.contains("lease ")),
        )
        .await;
        let err = a.claim("h2", record(&a)).await.unwrap_err();
        eprintln!("{err}");
        // Nothing answers, so nothing says the quorum is lost: the error says how the lease
        // went, not that a new one is on its way as if etcd were fine.
        assert!(matches!(err, ClusterError::NoLease { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("claim /test/hosts/h2: this replica holds no etcd lease (lease ")
                && text.contains(" lost: no renewal for ")
                && text.contains("unreachable")
                && text.contains("a new one is granted as soon as etcd answers"),
            "{err}"
        );
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert_eq!(a.route("h1"), Some(held.clone()), "the table is kept");

        etcd.restart(0);
        eventually("healthy again", Duration::from_secs(20), || {
            a.health().is_ok()
        })
        .await;
        a.claim("h2", record(&a)).await.unwrap();
        assert_eq!(a.route("h1").map(|r| r.link_id), Some(held.link_id));
        a.shutdown().await;
    })
    .await;
}
