//! How a replica reaches etcd and how it is known to the other replicas.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{ClusterError, Result};
use crate::records::check_id;

/// Client TLS for etcd: the CA that signed the members' certificates, and this replica's
/// certificate and key (PEM files). A member's certificate must chain to the CA and name the
/// host or IP address of its endpoint URL (ordinary web-PKI rules, not toolsrv identities).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// One replica's view of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://host:2379`, or `https://` with [`ClusterConfig::tls`]).
    pub endpoints: Vec<String>,
    pub tls: Option<EtcdTls>,
    /// This replica's id, unique among the replicas.
    pub replica_id: String,
    /// Where other replicas reach this one's internal RPC.
    pub advertise_url: String,
    /// The lease's time to live: how long after this replica dies its hosts stay claimed.
    /// etcd counts in whole seconds (rounded up here) and may raise it to its own minimum.
    pub lease_ttl: Duration,
    /// Every key lives under it; ends with `/`.
    pub key_prefix: String,
    /// The deadline of one etcd request.
    pub request_timeout: Duration,
    /// How long an idempotent operation is retried before it fails.
    pub retry_budget: Duration,
}

impl ClusterConfig {
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
    pub const DEFAULT_PREFIX: &str = "/toolsrv/";
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
    pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(5);

    /// A configuration with the defaults: a 5 s lease, keys under `/toolsrv/`.
    pub fn new(endpoints: Vec<String>, replica_id: &str, advertise_url: &str) -> Self {
        Self {
            endpoints,
            tls: None,
            replica_id: replica_id.to_string(),
            advertise_url: advertise_url.to_string(),
            lease_ttl: Self::DEFAULT_LEASE_TTL,
            key_prefix: Self::DEFAULT_PREFIX.to_string(),
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
            retry_budget: Self::DEFAULT_RETRY_BUDGET,
        }
    }

    /// `URL[,URL...]`, as `--etcd` takes it.
    pub fn parse_endpoints(list: &str) -> Result<Vec<String>> {
        let endpoints: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect();
        if endpoints.is_empty() {
            return Err(ClusterError::Invalid {
                what: format!("etcd endpoints {list:?}"),
                detail: "name none; give URL[,URL...], for example http://127.0.0.1:2379".into(),
            });
        }
        Ok(endpoints)
    }

    /// The lease's TTL in etcd's whole seconds.
    pub(crate) fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_millis().div_ceil(1000))
            .unwrap_or(i64::MAX)
            .max(1)
    }

    pub(crate) fn check(&self) -> Result<()> {
        check_id("replica id", &self.replica_id)?;
        if self.endpoints.is_empty() {
            return Err(ClusterError::Invalid {
                what: "etcd endpoints".into(),
                detail: "none given".into(),
            });
        }
        let https = |e: &&String| e.starts_with("https://");
        if self.tls.is_some()
            && let Some(plain) = self.endpoints.iter().find(|e| !https(e))
        {
            return Err(ClusterError::Invalid {
                what: format!("etcd endpoint {plain}"),
                detail: "TLS settings are given, so every endpoint must be an https:// URL".into(),
            });
        }
        if self.tls.is_none()
            && let Some(secure) = self.endpoints.iter().find(https)
        {
            return Err(ClusterError::Invalid {
                what: format!("etcd endpoint {secure}"),
                detail: "an https:// endpoint needs the TLS settings (CA, certificate, key)".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_from_a_list() {
        assert_eq!(
            ClusterConfig::parse_endpoints("http://a:2379, http://b:2379,").unwrap(),
            vec!["http://a:2379", "http://b:2379"]
        );
        assert!(ClusterConfig::parse_endpoints(" , ").is_err());
    }

    #[test]
    fn ttl_rounds_up_to_seconds() {
        let mut config = ClusterConfig::new(vec!["http://a".into()], "r1", "https://r1");
        assert_eq!(config.ttl_secs(), 10);
        config.lease_ttl = Duration::from_millis(1500);
        assert_eq!(config.ttl_secs(), 2);
        config.lease_ttl = Duration::ZERO;
        assert_eq!(config.ttl_secs(), 1);
    }

    #[test]
    fn tls_needs_https_endpoints() {
        let mut config = ClusterConfig::new(vec!["http://a:2379".into()], "r1", "https://r1");
        assert!(config.check().is_ok());
        config.tls = Some(EtcdTls {
            ca: "ca.pem".into(),
            cert: "c.pem".into(),
            key: "k.pem".into(),
        });
        assert!(config.check().is_err());
        config.replica_id = "a/b".into();
        assert!(config.check().is_err());
        let secure = ClusterConfig::new(vec!["https://a:2379".into()], "r1", "https://r1");
        assert!(secure.check().is_err(), "https needs the TLS files");
    }
}
