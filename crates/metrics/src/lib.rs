//! Prometheus metrics shared by the coordinator and the agent: the `/metrics` endpoint, and the
//! collectors both roles register (the process, and the certificates it uses).
//!
//! Every metric is named `toolsrv_...` in base units (seconds, bytes), counters end in `_total`,
//! and no label takes an unbounded set of values (no host id, tool argument or client name): a
//! fleet of 10,000 hosts gives the same number of series as one.

mod process;
mod server;

use std::path::PathBuf;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

pub use process::ProcessCollector;
pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::metrics::family::Family;
pub use prometheus_client::metrics::gauge::Gauge;
pub use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
pub use prometheus_client::registry::Registry;
pub use server::{MetricsServer, encode};

/// A label set of fixed names whose values come from a small, known set.
pub type Labels<const N: usize> = [(&'static str, &'static str); N];

/// The registry every toolsrv metric lives in: names get the `toolsrv_` prefix here, and the
/// process collector is already registered.
pub fn registry() -> Registry {
    let mut registry = Registry::with_prefix("toolsrv");
    registry.register_collector(Box::new(ProcessCollector));
    registry
}

/// Buckets for call and request durations, 1 ms to about 9 minutes.
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.5, 15)
}

/// Reports when each of a process's certificates expires, read from its files at every
/// scrape (so a rotated certificate shows at once): `toolsrv_certificate_expiry_timestamp_seconds`
/// with the label `certificate` (`own`: the leaf of this process's certificate file; `ca`: the
/// first to lapse of the CA bundle).
#[derive(Debug)]
pub struct CertificateCollector {
    files: Vec<(&'static str, PathBuf)>,
}

impl CertificateCollector {
    /// `own` is this process's certificate file, `ca` its CA bundle.
    pub fn new(own: PathBuf, ca: PathBuf) -> Self {
        Self {
            files: vec![("own", own), ("ca", ca)],
        }
    }
}

impl Collector for CertificateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "certificate_expiry_timestamp_seconds",
            "When a certificate this process uses expires (notAfter, Unix time): its own (leaf), and the first of its CA bundle to lapse",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (which, path) in &self.files {
            // A file being replaced may not read for a moment; its series is then absent
            // rather than wrong, and the coordinator's reload logs the problem.
            let Ok(expiry) = toolsrv_tls::certificate_expiry(path) else {
                continue;
            };
            let seconds = if *which == "ca" {
                expiry.earliest
            } else {
                expiry.leaf
            };
            let labels: Labels<1> = [("certificate", which)];
            ConstGauge::new(seconds).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Records how a call ended when dropped: `record(status, elapsed)`, with the status given to
/// [`Outcome::finish`], or `cancelled` when the call was dropped before its end.
pub struct Outcome<F: FnOnce(&'static str, std::time::Duration)> {
    started: std::time::Instant,
    status: Option<&'static str>,
    record: Option<F>,
}

impl<F: FnOnce(&'static str, std::time::Duration)> Outcome<F> {
    pub fn new(record: F) -> Self {
        Self {
            started: std::time::Instant::now(),
            status: None,
            record: Some(record),
        }
    }

    /// The call ended with `status` (its short name: `ok`, `tool_error`, ...).
    pub fn finish(mut self, status: &'static str) {
        self.status = Some(status);
    }
}

impl<F: FnOnce(&'static str, std::time::Duration)> Drop for Outcome<F> {
    fn drop(&mut self) {
        if let Some(record) = self.record.take() {
            record(self.status.unwrap_or("cancelled"), self.started.elapsed());
        }
    }
}

impl<F: FnOnce(&'static str, std::time::Duration)> std::fmt::Debug for Outcome<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outcome")
            .field("started", &self.started)
            .field("status", &self.status)
            .finish()
    }
}

/// One gauge value with a label set, for collectors that compute their values at scrape time
/// (labels of a fixed set of values, or an info metric's: one series of value 1 for what the
/// process holds now, like the digest of a settings file).
pub fn encode_gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(L, i64)],
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    for (labels, value) in values {
        ConstGauge::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// One gauge without labels, for collectors.
pub fn encode_gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let gauge = ConstGauge::new(value);
    gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)
}

pub use prometheus_client::collector::Collector as MetricsCollector;
pub use prometheus_client::encoding::DescriptorEncoder as Encoder;
