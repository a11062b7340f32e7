//! Two replicas on a three-member etcd: membership, claims, the newest link winning, leaving
//! and dying, and the agreed catalog revision.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{TTL, bounded, eventually, init_logs, join, next_event, record};
use toolsrv_cluster::{ClusterError, ClusterEvent, ClusterHealth};
use toolsrv_testkit::EtcdCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_see_each_other_and_their_claims() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let limit = Duration::from_secs(10);
        eventually("both replicas listed on both", limit, || {
            a.replicas().len() == 2 && b.replicas().len() == 2
        })
        .await;
        assert_eq!(
            b.replica("r1").map(|r| r.advertise_url),
            Some("https://r1.test:7443".to_string())
        );
        let web = record(&a);
        let claim = a.claim("web-1", web.clone()).await.unwrap();
        assert_eq!(
            (claim.link_id.as_str(), claim.previous),
            (web.link_id.as_str(), None)
        );
        b.claim("db-1", record(&b)).await.unwrap();
        eventually("each sees the other's claim", limit, || {
            b.route("web-1").is_some_and(|r| r.owner == "r1")
                && a.route("db-1").is_some_and(|r| r.owner == "r2")
        })
        .await;
        assert_eq!(b.route("web-1"), Some(web), "facts and link travel whole");
        let hosts: Vec<String> = a.hosts().into_iter().map(|(h, _)| h).collect();
        assert_eq!(hosts, ["db-1", "web-1"]);
        assert_eq!(a.health(), ClusterHealth::Ok);
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newest_claim_wins_and_the_loser_is_told() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let mut a_events = a.subscribe();
        let first = record(&a);
        a.claim("web-1", first.clone()).await.unwrap();
        eventually("b sees a's claim", Duration::from_secs(10), || {
            b.route("web-1").is_some()
        })
        .await;

        // The host reattaches to b: b's claim replaces a's, and a is told to drop its link.
        let second = record(&b);
        let claim = b.claim("web-1", second.clone()).await.unwrap();
        assert_eq!(claim.previous.as_ref().map(|p| p.owner.as_str()), Some("r1"));
        let event = next_event(&mut a_events, Duration::from_secs(10), "superseded", |e| {
            matches!(e, ClusterEvent::Superseded { .. })
        })
        .await;
        assert_eq!(
            event,
            ClusterEvent::Superseded {
                host_id: "web-1".into(),
                lost_link_id: first.link_id.clone(),
                by: second.clone(),
            }
        );
        eventually("a routes web-1 to b", Duration::from_secs(10), || {
            a.route("web-1").is_some_and(|r| r.owner == "r2")
        })
        .await;

        // The stale link's release leaves the newer claim alone.
        assert!(!a.release("web-1", &first.link_id).await.unwrap());
        assert_eq!(b.route("web-1").map(|r| r.link_id), Some(second.link_id.clone()));
        assert!(b.release("web-1", &second.link_id).await.unwrap());
        eventually("web-1 free", Duration::from_secs(10), || {
            a.route("web-1").is_none() && b.route("web-1").is_none()
        })
        .await;

        // A reattachment to the same replica supersedes its own older link.
        let old = record(&a);
        let new = record(&a);
        a.claim("web-2", old.clone()).await.unwrap();
        a.claim("web-2", new.clone()).await.unwrap();
        let event = next_event(&mut a_events, Duration::from_secs(10), "own link superseded", |e| {
            matches!(e, ClusterEvent::Superseded { host_id, .. } if host_id == "web-2")
        })
        .await;
        assert!(
            matches!(&event, ClusterEvent::Superseded { lost_link_id, .. } if *lost_link_id == old.link_id),
            "{event:?}"
        );

        // A claim naming another replica as owner is a caller's mistake.
        let err = a.claim("web-3", record(&b)).await.unwrap_err();
        assert!(matches!(err, ClusterError::Invalid { .. }), "{err}");
        let err = a.claim("a/b", record(&a)).await.unwrap_err();
        assert!(err.to_string().contains("host id"), "{err}");
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

/// A claim's record is rewritten (new labels) only while it is still that link's: once the host
/// moved to another replica, the update leaves the newer claim alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_updated_only_while_it_is_still_the_link_s() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let limit = Duration::from_secs(10);
        let first = record(&a);
        a.claim("web-1", first.clone()).await.unwrap();
        let mut relabelled = first.clone();
        relabelled.facts.insert("trusted.role".into(), "db".into());
        assert!(a.update_claim("web-1", relabelled.clone()).await.unwrap());
        eventually("b sees the new labels", limit, || {
            b.route("web-1").as_ref() == Some(&relabelled)
        })
        .await;

        // The host moves to b; a's late update must not take it back.
        let second = record(&b);
        b.claim("web-1", second.clone()).await.unwrap();
        eventually("a routes web-1 to b", limit, || {
            a.route("web-1").is_some_and(|r| r.owner == "r2")
        })
        .await;
        let mut late = first.clone();
        late.facts.insert("trusted.role".into(), "web".into());
        assert!(!a.update_claim("web-1", late).await.unwrap());
        assert!(
            !a.update_claim("web-9", record(&a)).await.unwrap(),
            "never claimed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(b.route("web-1"), Some(second.clone()));
        assert_eq!(a.route("web-1"), Some(second));
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_shuts_down_frees_its_hosts_at_once() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        for host in ["h1", "h2", "h3"] {
            a.claim(host, record(&a)).await.unwrap();
        }
        eventually("b sees a's hosts", Duration::from_secs(10), || {
            b.hosts().len() == 3
        })
        .await;
        let mut b_events = b.subscribe();
        let start = Instant::now();
        a.shutdown().await;
        let event = next_event(&mut b_events, Duration::from_secs(10), "r1 gone", |e| {
            matches!(e, ClusterEvent::ReplicaGone { .. })
        })
        .await;
        let ClusterEvent::ReplicaGone { replica, mut hosts } = event else {
            unreachable!()
        };
        hosts.sort();
        assert_eq!(
            (replica.id.as_str(), hosts),
            ("r1", vec!["h1".into(), "h2".into(), "h3".into()])
        );
        eventually("hosts freed", Duration::from_secs(5), || {
            b.hosts().is_empty()
        })
        .await;
        let took = start.elapsed();
        eprintln!("shutdown freed the hosts in {took:?}");
        assert!(took < TTL, "revoked, not expired: {took:?}");
        let err = a.claim("h4", record(&a)).await.unwrap_err();
        assert!(matches!(err, ClusterError::Closed { .. }), "{err}");
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_dies_loses_its_hosts_within_its_lease() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        a.claim("h1", record(&a)).await.unwrap();
        a.claim("h2", record(&a)).await.unwrap();
        eventually("b sees a's hosts", Duration::from_secs(10), || {
            b.hosts().len() == 2
        })
        .await;
        let mut b_events = b.subscribe();
        let start = Instant::now();
        // No revocation: the tasks stop, the lease is left to expire.
        drop(a);
        let event = next_event(
            &mut b_events,
            TTL + Duration::from_secs(5),
            "r1 gone",
            |e| matches!(e, ClusterEvent::ReplicaGone { .. }),
        )
        .await;
        let took = start.elapsed();
        eprintln!("a dead replica's hosts were freed after {took:?} (lease TTL {TTL:?})");
        let ClusterEvent::ReplicaGone { hosts, .. } = event else {
            unreachable!()
        };
        assert_eq!(hosts.len(), 2, "{hosts:?}");
        assert!(took <= TTL + Duration::from_secs(2), "{took:?}");
        eventually("hosts freed", Duration::from_secs(5), || {
            b.hosts().is_empty()
        })
        .await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_agree_on_one_catalog_revision_that_never_goes_back() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let mut returned = Vec::new();
        // The same digest: one revision, whatever each replica would number it.
        let first = a.agree_catalog("d1", 1).await.unwrap();
        assert_eq!(first.revision, 1);
        assert_eq!(b.agree_catalog("d1", 7).await.unwrap(), first);
        returned.push(first.revision);

        // Another digest bumps above both revisions, and the other replica learns of it.
        let bumped = b.agree_catalog("d2", 1).await.unwrap();
        assert_eq!(bumped.revision, 2);
        let mut a_catalog = a.catalog_watch();
        tokio::time::timeout(
            Duration::from_secs(10),
            a_catalog.wait_for(|c| c.as_ref().is_some_and(|c| c.revision == 2)),
        )
        .await
        .unwrap()
        .unwrap();
        let again = a.agree_catalog("d1", 1).await.unwrap();
        assert_eq!(again.revision, 3, "{again:?}");
        returned.push(again.revision);

        // Concurrent agreements on a new digest settle on one revision.
        let (x, y) = tokio::join!(a.agree_catalog("d3", 3), b.agree_catalog("d3", 3));
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!(x, y);
        assert_eq!(x.revision, 4);
        returned.push(x.revision);

        // etcd loses the record (restored from an old backup, say): never backwards.
        etcd.delete("/test/catalog");
        let after = a.agree_catalog("d3", 1).await.unwrap();
        assert_eq!(after.revision, 4, "{after:?}");
        returned.push(after.revision);
        let other = b.agree_catalog("d4", 1).await.unwrap();
        assert_eq!(other.revision, 5, "{other:?}");
        returned.push(other.revision);
        assert!(returned.windows(2).all(|w| w[0] <= w[1]), "{returned:?}");
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocations_are_kept_in_etcd_once_and_followed_by_every_replica() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = join(&etcd, "r1").await;
        let b = join(&etcd, "r2").await;
        let mut b_events = b.subscribe();
        // The first replica to keep them writes its own list; later ones take etcd's.
        let local = BTreeMap::from([("client/bob".to_string(), b"{\"x\":1}".to_vec())]);
        assert_eq!(a.keep_revocations(&local).await.unwrap(), local);
        let other = BTreeMap::from([("client/eve".to_string(), b"{}".to_vec())]);
        assert_eq!(
            b.keep_revocations(&other).await.unwrap(),
            local,
            "etcd's list, not the late replica's"
        );

        // A revocation through one replica reaches the other, and so does its lifting.
        a.put_revocation("agent/web-1", b"{\"y\":2}").await.unwrap();
        let event = next_event(
            &mut b_events,
            Duration::from_secs(10),
            "revoked",
            |e| matches!(e, ClusterEvent::Revoked { identity, .. } if identity == "agent/web-1"),
        )
        .await;
        assert_eq!(
            event,
            ClusterEvent::Revoked {
                identity: "agent/web-1".into(),
                record: b"{\"y\":2}".to_vec()
            }
        );
        assert_eq!(b.revocations().len(), 2);
        assert!(a.delete_revocation("agent/web-1").await.unwrap());
        assert!(
            !a.delete_revocation("agent/web-1").await.unwrap(),
            "gone already"
        );
        next_event(
            &mut b_events,
            Duration::from_secs(10),
            "unrevoked",
            |e| matches!(e, ClusterEvent::Unrevoked { identity } if identity == "agent/web-1"),
        )
        .await;
        assert_eq!(b.revocations(), local);

        // Odd identities are refused before reaching etcd.
        for bad in ["", "client/a\nb", &"x".repeat(301)] {
            assert!(
                matches!(
                    a.put_revocation(bad, b"{}").await,
                    Err(ClusterError::Invalid { .. })
                ),
                "{bad:?}"
            );
        }
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_made_together_go_to_etcd_together() {
    init_logs();
    let etcd = EtcdCluster::start(3);
    bounded(async {
        let a = std::sync::Arc::new(join(&etcd, "r1").await);
        let other = join(&etcd, "r2").await;
        // 300 hosts attach at once: every claim lands, in far fewer transactions.
        let mut claims = tokio::task::JoinSet::new();
        for i in 0..300 {
            let a = a.clone();
            claims.spawn(async move { a.claim(&format!("h{i:03}"), record(&a)).await });
        }
        let mut revisions = std::collections::BTreeSet::new();
        while let Some(claim) = claims.join_next().await {
            revisions.insert(claim.unwrap().unwrap().revision);
        }
        assert!(
            revisions.len() <= 50,
            "300 claims took {} transactions",
            revisions.len()
        );
        eventually(
            "the other replica routes all 300",
            Duration::from_secs(10),
            || other.hosts().len() == 300,
        )
        .await;
        // A host claimed twice in one burst: a transaction may not name a key twice, so the
        // two go out one after the other; the one written last holds the host and the other
        // link is told it was superseded.
        let mut events = a.subscribe();
        let (first, second) = (record(&a), record(&a));
        let (x, y) = tokio::join!(
            a.claim("twice", first.clone()),
            a.claim("twice", second.clone())
        );
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_ne!(x.revision, y.revision, "one transaction each");
        let (winner, loser) = if x.revision > y.revision {
            (first, second)
        } else {
            (second, first)
        };
        eventually("the link written last holds the host", Duration::from_secs(10), || {
            other.route("twice").is_some_and(|r| r.link_id == winner.link_id)
        })
        .await;
        next_event(&mut events, Duration::from_secs(10), "superseded", |e| {
            matches!(e, ClusterEvent::Superseded { lost_link_id, .. } if *lost_link_id == loser.link_id)
        })
        .await;
        a.shutdown().await;
        other.shutdown().await;
    })
    .await;
}
