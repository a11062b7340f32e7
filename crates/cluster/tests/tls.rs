//! A replica reaching etcd over client TLS (certificates from a throwaway CA).

mod common;

use std::time::Duration;

use common::{bounded, config, eventually, init_logs, record};
use toolsrv_cluster::{Cluster, ClusterError, EtcdTls};
use toolsrv_testkit::EtcdCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_reach_etcd_over_client_tls() {
    init_logs();
    let etcd = EtcdCluster::try_start_tls(1).unwrap();
    bounded(async {
        let files = etcd.tls.clone().unwrap();
        let mut with_tls = config(&etcd, "r1");
        with_tls.tls = Some(EtcdTls {
            ca: files.ca,
            cert: files.cert,
            key: files.key,
        });
        let a = Cluster::join(with_tls.clone()).await.unwrap();
        a.claim("web-1", record(&a)).await.unwrap();
        eventually("claim routed", Duration::from_secs(10), || {
            a.route("web-1").is_some()
        })
        .await;
        a.shutdown().await;

        // Without a client certificate etcd refuses, and the error says which operation.
        let mut without = with_tls;
        without.replica_id = "r2".into();
        without.tls.as_mut().unwrap().cert = "/nonexistent.pem".into();
        let err = Cluster::join(without).await.unwrap_err();
        assert!(matches!(err, ClusterError::Invalid { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent.pem"), "{err}");
    })
    .await;
}
