//! The coordinator's metrics (`--metrics-listen`): what it counts as calls run, and what it
//! reads from its state at each scrape (agents by state, catalog revision, sessions, pending
//! approvals).
//!
//! Labels take only a handful of values each (call kind, status, stream, decision, host
//! state): never a host id, client name or argument, so the series do not grow with the fleet.

use std::sync::Weak;

use toolsrv_metrics::{
    Counter, Encoder, Family, Gauge, Histogram, Labels, MetricsCollector, Outcome, Registry,
    encode_gauge, encode_gauges, exponential_buckets,
};
use toolsrv_proto::v1::{CallResult, OutputStream};

use crate::State;
use crate::approvals::Decision;

type HistogramFamily = Family<Labels<1>, Histogram, fn() -> Histogram>;

/// Counters and histograms updated as the coordinator works.
#[derive(Debug, Clone)]
pub struct Metrics {
    calls: Family<Labels<2>, Counter>,
    in_flight: Family<Labels<1>, Gauge>,
    duration: HistogramFamily,
    fanout_hosts: Histogram,
    streamed: Family<Labels<1>, Counter>,
    approvals: Family<Labels<1>, Counter>,
    attachments: Counter,
    views_passed_over: Counter,
    hosts_forgotten: Counter,
    enrollment_throttled: Family<Labels<1>, Counter>,
    /// Requests refused for too many open at once (`crate::streams`).
    pub(crate) requests_refused: Counter,
    /// Answers cut short for too many bytes waiting to leave (`crate::streams`).
    pub(crate) answers_refused: Counter,
    finds: Family<Labels<1>, Counter>,
    find_duration: Histogram,
    index_builds: Family<Labels<1>, Counter>,
    index_build_duration: Histogram,
    index_texts: Family<Labels<1>, Counter>,
}

fn duration_histogram() -> Histogram {
    Histogram::new(toolsrv_metrics::duration_buckets())
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            in_flight: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            // 1 to 16,384 hosts.
            fanout_hosts: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            streamed: Family::default(),
            approvals: Family::default(),
            attachments: Counter::default(),
            views_passed_over: Counter::default(),
            hosts_forgotten: Counter::default(),
            requests_refused: Counter::default(),
            answers_refused: Counter::default(),
            enrollment_throttled: Family::default(),
            finds: Family::default(),
            find_duration: duration_histogram(),
            index_builds: Family::default(),
            index_build_duration: duration_histogram(),
            index_texts: Family::default(),
        }
    }
}

impl Metrics {
    /// Registers every metric of the coordinator in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "calls",
            "Host calls that ended, by kind (call: one host; fanout: one host of a fan-out) and status (ok, tool_error, denied, offline, timed_out, ...)",
            self.calls.clone(),
        );
        registry.register(
            "calls_in_flight",
            "Host calls running now, by kind",
            self.in_flight.clone(),
        );
        registry.register(
            "call_duration_seconds",
            "Time from a host call's arrival to its result, by kind, whatever its status",
            self.duration.clone(),
        );
        registry.register(
            "fanout_hosts",
            "Hosts each fan-out targeted",
            self.fanout_hosts.clone(),
        );
        registry.register(
            "streamed_bytes",
            "Output bytes streamed from agents to callers, by stream (stdout, stderr)",
            self.streamed.clone(),
        );
        registry.register(
            "approval_requests",
            "Approval requests (policy `approve` rules and bypass requests) that ended, by decision (approved, denied, expired, withdrawn)",
            self.approvals.clone(),
        );
        registry.register(
            "agent_attachments",
            "Agent links accepted (a reconnect counts again)",
            self.attachments.clone(),
        );
        registry.register(
            "views_passed_over",
            "Host views an agent reported that a newer one replaced before they were stored: an agent reporting more than 16 at once or 2 a second (each view stored is passed on to every watcher)",
            self.views_passed_over.clone(),
        );
        registry.register(
            "hosts_forgotten",
            "Hosts removed from the fleet after being offline longer than --forget-offline-after-secs, or revoked",
            self.hosts_forgotten.clone(),
        );
        registry.register(
            "requests_refused",
            "Requests refused before any service saw them: the peer had too many open at once (--max-requests-per-identity per certificate identity, 64 per address without a certificate)",
            self.requests_refused.clone(),
        );
        registry.register(
            "answers_refused",
            "Answers and requests cut short with RESOURCE_EXHAUSTED: the peer's answers waiting to leave (sent, not yet read) and request messages still arriving held more bytes than --max-buffered-bytes-per-identity (32 MiB per address without a certificate)",
            self.answers_refused.clone(),
        );
        registry.register(
            "enrollment_throttled",
            "Enrollment requests refused unexamined, by kind: join (the address had too many refused joins: 10 at once, then one each 6 s), renewal (the agent asked for more renewals than its certificate's lifetime calls for)",
            self.enrollment_throttled.clone(),
        );
        registry.register(
            "find_requests",
            "FindTools requests answered here, by outcome (matched, no_match, refused: a bad request or over a client's limit, failed)",
            self.finds.clone(),
        );
        registry.register(
            "find_duration_seconds",
            "Time to answer a FindTools request that was ranked (matched or no_match), waiting for the index included",
            self.find_duration.clone(),
        );
        registry.register(
            "find_index_builds",
            "Builds of the FindTools index after the fleet's views changed, by outcome (ok, failed)",
            self.index_builds.clone(),
        );
        registry.register(
            "find_index_build_seconds",
            "Time each FindTools index build took (embedding the new texts with an encoder)",
            self.index_build_duration.clone(),
        );
        registry.register(
            "find_index_texts",
            "Texts the FindTools index builds took a vector for, by where it came from (embedded: the encoder ran; reused: the last index had it; kept: read from --state-dir, as after a restart)",
            self.index_texts.clone(),
        );
    }

    /// A FindTools request ended: `Ok(matches)` when it was ranked, else the code it was
    /// refused or failed with.
    pub fn find(&self, ranked: Result<usize, tonic::Code>, elapsed: std::time::Duration) {
        let outcome = match ranked {
            Ok(0) => "no_match",
            Ok(_) => "matched",
            Err(
                tonic::Code::InvalidArgument
                | tonic::Code::ResourceExhausted
                | tonic::Code::PermissionDenied
                | tonic::Code::Unauthenticated,
            ) => "refused",
            Err(_) => "failed",
        };
        self.finds.get_or_create(&[("outcome", outcome)]).inc();
        if ranked.is_ok() {
            self.find_duration.observe(elapsed.as_secs_f64());
        }
    }

    /// A build of the FindTools index ended: what it did when it succeeded, `None` when it
    /// failed.
    pub fn index_built(
        &self,
        updated: Option<&toolsrv_find::Updated>,
        elapsed: std::time::Duration,
    ) {
        let outcome = if updated.is_some() { "ok" } else { "failed" };
        self.index_builds
            .get_or_create(&[("outcome", outcome)])
            .inc();
        self.index_build_duration.observe(elapsed.as_secs_f64());
        if let Some(updated) = updated {
            for (source, n) in [
                ("embedded", updated.embedded),
                ("reused", updated.reused),
                ("kept", updated.stored),
            ] {
                self.index_texts
                    .get_or_create(&[("source", source)])
                    .inc_by(n as u64);
            }
        }
    }

    /// A host call begins; the guard records its end (also when the call is dropped midway,
    /// as `cancelled`).
    pub fn call(&self, fanout: bool) -> CallMeter {
        let kind = if fanout { "fanout" } else { "call" };
        self.in_flight.get_or_create(&[("kind", kind)]).inc();
        let m = self.clone();
        CallMeter(Outcome::new(Box::new(move |status, elapsed| {
            m.in_flight.get_or_create(&[("kind", kind)]).dec();
            m.calls
                .get_or_create(&[("kind", kind), ("status", status)])
                .inc();
            m.duration
                .get_or_create(&[("kind", kind)])
                .observe(elapsed.as_secs_f64());
        })))
    }

    /// A view waiting for its turn was replaced by a newer one (`crate::view_pace`).
    pub fn view_passed_over(&self) {
        self.views_passed_over.inc();
    }

    /// Hosts offline too long were forgotten.
    pub fn hosts_forgotten(&self, n: usize) {
        self.hosts_forgotten.inc_by(n as u64);
    }

    /// A join or renewal was refused unexamined (`enroll::throttle`).
    pub fn enrollment_throttled(&self, kind: &'static str) {
        self.enrollment_throttled
            .get_or_create(&[("kind", kind)])
            .inc();
    }

    pub fn fanout(&self, hosts: usize) {
        self.fanout_hosts.observe(hosts as f64);
    }

    pub fn streamed(&self, stream: i32, bytes: u64) {
        let name = match OutputStream::try_from(stream) {
            Ok(OutputStream::Stderr) => "stderr",
            _ => "stdout",
        };
        self.streamed
            .get_or_create(&[("stream", name)])
            .inc_by(bytes);
    }

    pub fn approval(&self, decision: &Decision) {
        let name = match decision {
            Decision::Approved { .. } => "approved",
            Decision::Denied { .. } => "denied",
            Decision::Expired => "expired",
            Decision::Withdrawn => "withdrawn",
        };
        self.approvals.get_or_create(&[("decision", name)]).inc();
    }

    pub fn attached(&self) {
        self.attachments.inc();
    }
}

/// Records how a call ended.
type Record = Box<dyn FnOnce(&'static str, std::time::Duration) + Send + Sync>;

/// A host call being measured; see [`Metrics::call`].
#[derive(Debug)]
pub struct CallMeter(Outcome<Record>);

impl CallMeter {
    pub fn finish(self, result: &CallResult) {
        self.0.finish(toolsrv_proto::status_name(result.status));
    }
}

/// Reads the fleet, catalog, sessions and approvals at each scrape.
#[derive(Debug)]
pub struct StateCollector {
    pub state: Weak<State>,
}

impl MetricsCollector for StateCollector {
    fn encode(&self, mut encoder: Encoder) -> Result<(), std::fmt::Error> {
        let Some(state) = self.state.upgrade() else {
            return Ok(());
        };
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let [online, syncing, offline] = state.fleet.count_by_state().map(count);
        encode_gauges(
            &mut encoder,
            "agents",
            "Hosts the coordinator knows, by state: online (attached, view current), syncing (attached, view not yet sent for this revision), offline (no link)",
            &[
                ([("state", "online")], online),
                ([("state", "syncing")], syncing),
                ([("state", "offline")], offline),
            ],
        )?;
        encode_gauge(
            &mut encoder,
            "catalog_revision",
            "The catalog revision the coordinator serves",
            i64::try_from(state.fleet.revision()).unwrap_or(i64::MAX),
        )?;
        encode_gauge(
            &mut encoder,
            "sessions",
            "Sessions open (toolctl session, MCP servers)",
            count(state.sessions.len()),
        )?;
        encode_gauge(
            &mut encoder,
            "approval_requests_pending",
            "Approval requests waiting for a decision",
            count(state.approvals.pending()),
        )?;
        encode_gauge(
            &mut encoder,
            "audit_log_failing",
            "1 while the last write to --audit-log failed: new calls, fan-outs, joins and join tokens are refused until a record can be written",
            i64::from(state.audit.failing()),
        )?;
        encode_gauge(
            &mut encoder,
            "policy_file_refused",
            "1 while the --policy file has changed and cannot be used: the policy read before it is in force",
            i64::from(state.policy.refused()),
        )?;
        // The settings in force, by the digest of the text read: replicas deciding alike show
        // one digest per file (an empty one without a file).
        encode_gauges(
            &mut encoder,
            "settings_info",
            "The settings files in force, by file (policy, host_labels) and the SHA-256 of the text they were read from (empty without a file): replicas that decide alike show the same",
            &[
                (
                    [("file", "policy"), ("sha256", state.policy.now().sha256())],
                    1,
                ),
                (
                    [
                        ("file", "host_labels"),
                        ("sha256", state.host_labels.now().sha256()),
                    ],
                    1,
                ),
            ],
        )?;
        encode_gauge(
            &mut encoder,
            "host_labels_file_refused",
            "1 while the --host-labels file has changed and cannot be used: the labels read before it are in force",
            i64::from(state.host_labels.refused()),
        )?;
        encode_gauge(
            &mut encoder,
            "find_index_documents",
            "Distinct tool definitions in the FindTools index (a tool resolved two ways counts twice)",
            count(state.finder.documents()),
        )?;
        encode_gauge(
            &mut encoder,
            "find_index_deferred",
            "Tools of hosts' own left out of the FindTools index until their host's embedding \
             budget (--max-host-only-embeds-per-hour) refills",
            count(state.finder.deferred()),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use toolsrv_proto::v1::CallStatus;

    use super::*;

    #[test]
    fn a_dropped_call_counts_as_cancelled_and_leaves_flight() {
        let metrics = Metrics::default();
        let mut registry = toolsrv_metrics::registry();
        metrics.register(&mut registry);
        metrics
            .call(false)
            .finish(&CallResult::not_run(CallStatus::Denied, "no"));
        drop(metrics.call(true));
        let _running = metrics.call(true);
        metrics.fanout(3);
        metrics.streamed(OutputStream::Stderr as i32, 10);
        let text = toolsrv_metrics::encode(&registry, false).unwrap();
        for line in [
            "toolsrv_calls_total{kind=\"call\",status=\"denied\"} 1",
            "toolsrv_calls_total{kind=\"fanout\",status=\"cancelled\"} 1",
            "toolsrv_calls_in_flight{kind=\"call\"} 0",
            "toolsrv_calls_in_flight{kind=\"fanout\"} 1",
            "toolsrv_call_duration_seconds_count{kind=\"fanout\"} 1",
            "toolsrv_fanout_hosts_count 1",
            "toolsrv_streamed_bytes_total{stream=\"stderr\"} 10",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
