//! The evaluation set (`eval/`) and the measures over it, shared by the tests and the benchmark.

#![allow(dead_code)] // Each test binary uses part of it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use toolsrv_find::{Analyzer, Doc, Hit};
use toolsrv_meta::ToolDef;
use toolsrv_registry::Scanner;

pub fn eval_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("eval")
}

/// The evaluation catalog as the registry loads it, one document per tool from its top-level
/// texts (variants of these tools do not change them).
pub fn catalog() -> Vec<(String, Doc)> {
    let catalog = Scanner::new(vec![eval_dir().join("tools")]).scan();
    assert!(
        catalog.invalid.is_empty() && !catalog.has_errors(),
        "the evaluation catalog does not load: {:?}",
        catalog.diagnostics
    );
    catalog
        .tools
        .iter()
        .map(|(name, tool)| (name.clone(), doc(name, &tool.meta.def)))
        .collect()
}

pub fn doc(name: &str, def: &ToolDef) -> Doc {
    Doc {
        name: name.to_string(),
        description: def.description.clone().unwrap_or_default(),
        prompt: def.prompt.clone().unwrap_or_default(),
        keywords: def.keywords.clone().unwrap_or_default(),
    }
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct Query {
    pub query: String,
    /// `None` for a request no tool serves: nothing should be returned.
    pub expected: Option<String>,
    pub kind: String,
}

pub fn queries() -> Vec<Query> {
    let text = std::fs::read_to_string(eval_dir().join("queries.jsonl")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// The stemmed terms a paraphrase must not share with its tool's texts.
pub fn shared_terms(analyzer: &Analyzer, query: &str, doc: &Doc) -> BTreeSet<String> {
    let text = format!(
        "{}\n{}\n{}\n{}",
        doc.name,
        doc.description,
        doc.keywords.join("\n"),
        doc.prompt
    );
    let doc_terms: BTreeSet<String> = analyzer.terms(&text).into_iter().collect();
    analyzer
        .terms(query)
        .into_iter()
        .filter(|t| doc_terms.contains(t))
        .collect()
}

/// Recall@1, recall@3 and mean reciprocal rank of one ranker over labelled queries.
#[derive(Debug, Clone, Copy, Default)]
pub struct Measures {
    pub queries: usize,
    pub at1: f64,
    pub at3: f64,
    pub mrr: f64,
}

impl std::fmt::Display for Measures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "n={:3}  R@1 {:.3}  R@3 {:.3}  MRR {:.3}",
            self.queries, self.at1, self.at3, self.mrr
        )
    }
}

/// Measures a ranking: `rank(query)` gives tool names best first.
pub fn measure<'q>(
    queries: impl IntoIterator<Item = &'q Query>,
    mut rank: impl FnMut(&str) -> Vec<String>,
) -> Measures {
    let mut m = Measures::default();
    for q in queries {
        let Some(expected) = &q.expected else {
            continue;
        };
        let ranked = rank(&q.query);
        let pos = ranked.iter().position(|n| n == expected);
        m.queries += 1;
        if pos == Some(0) {
            m.at1 += 1.0;
        }
        if pos.is_some_and(|p| p < 3) {
            m.at3 += 1.0;
        }
        if let Some(p) = pos {
            m.mrr += 1.0 / (p as f64 + 1.0);
        }
    }
    let n = m.queries.max(1) as f64;
    m.at1 /= n;
    m.at3 /= n;
    m.mrr /= n;
    m
}

pub fn names(hits: &[Hit<String>]) -> Vec<String> {
    hits.iter().map(|h| h.key.clone()).collect()
}

/// Reciprocal rank fusion of two rankings (k = 60, as in Cormack et al.), for comparison with
/// the weighted score the index uses.
pub fn rrf(hits: &[Hit<String>]) -> Vec<String> {
    let order = |key: fn(&Hit<String>) -> f32| {
        let mut v: Vec<&Hit<String>> = hits.iter().collect();
        v.sort_by(|a, b| key(b).total_cmp(&key(a)));
        v.into_iter().map(|h| h.key.clone()).collect::<Vec<_>>()
    };
    let lex = order(|h| h.lexical.unwrap_or(0.0));
    let sem = order(|h| h.semantic.unwrap_or(-1.0));
    let mut fused: Vec<(String, f64)> = hits
        .iter()
        .map(|h| {
            let r = |list: &[String]| {
                let p = list.iter().position(|n| *n == h.key).unwrap_or(list.len());
                1.0 / (60.0 + p as f64 + 1.0)
            };
            // A document the lexical ranker did not match at all gets no lexical share.
            let lexical = if h.lexical.unwrap_or(0.0) > 0.0 {
                r(&lex)
            } else {
                0.0
            };
            (h.key.clone(), lexical + r(&sem))
        })
        .collect();
    fused.sort_by(|a, b| b.1.total_cmp(&a.1));
    fused.into_iter().map(|(k, _)| k).collect()
}

/// The model directory, fetched there when missing (see `toolsrv_testkit::find_model_dir`).
pub fn model_dir() -> PathBuf {
    toolsrv_testkit::find_model_dir()
}

/// A synthetic catalog of `n` tools (the evaluation catalog first, then made-up ones in the
/// same style), for timing searches against a fleet-sized catalog and for ranking the real
/// tools among many plausible distractors.
pub fn big_catalog(n: usize) -> Vec<(String, Doc)> {
    const SUBJECTS: &[&str] = &[
        "nginx",
        "postgres",
        "redis",
        "kafka",
        "rabbitmq",
        "elasticsearch",
        "mysql",
        "haproxy",
        "consul",
        "vault",
        "etcd",
        "kubelet",
        "containerd",
        "prometheus",
        "grafana",
        "memcached",
        "mongodb",
        "zookeeper",
        "cassandra",
        "minio",
        "jenkins",
        "gitlab-runner",
        "traefik",
        "envoy",
        "coredns",
        "clickhouse",
        "influxdb",
        "loki",
        "tempo",
        "keepalived",
    ];
    const ASPECTS: &[(&str, &str, &str)] = &[
        (
            "config_check",
            "Validate the configuration files of",
            "syntax check, lint config, test configuration",
        ),
        (
            "version",
            "Installed version and build flags of",
            "which version, release, build info",
        ),
        (
            "metrics",
            "Scrape and summarise the metrics endpoint of",
            "stats, counters, prometheus metrics",
        ),
        (
            "connections",
            "Client connections currently open to",
            "clients, sessions, connection count",
        ),
        (
            "replication",
            "Replication state and lag of",
            "replica lag, primary, follower status",
        ),
        (
            "slow_queries",
            "Slowest recent requests or queries handled by",
            "slow log, latency outliers, long running",
        ),
        (
            "cache_flush",
            "Flush or invalidate the caches of",
            "clear cache, purge, invalidate",
        ),
        (
            "backup_snapshot",
            "Take a consistent snapshot backup of",
            "dump, snapshot, point in time copy",
        ),
        (
            "rotate_logs",
            "Rotate and compress the log files of",
            "logrotate, truncate logs, archive logs",
        ),
        (
            "cluster_members",
            "Members of the cluster formed by",
            "nodes, peers, quorum, membership",
        ),
        (
            "tls_reload",
            "Reload the TLS certificates used by",
            "renew certificate, swap keys, hot reload tls",
        ),
        (
            "queue_depth",
            "Backlog and queue depth of",
            "pending messages, lag, consumer backlog",
        ),
        (
            "health_probe",
            "Run the built-in health check of",
            "readiness, liveness, ping endpoint",
        ),
        (
            "user_grants",
            "Users and permissions defined in",
            "roles, grants, access control list",
        ),
        (
            "disk_footprint",
            "On-disk size of the data directory of",
            "data size, storage used, table sizes",
        ),
        (
            "restart_rolling",
            "Rolling restart, one node at a time, of",
            "safe restart, drain and restart, rollout",
        ),
        (
            "error_rate",
            "Error rate over the last minutes reported by",
            "5xx, failures, error count",
        ),
        (
            "settings_dump",
            "Effective runtime settings of",
            "show variables, running config, parameters",
        ),
        (
            "compaction",
            "Trigger or report compaction and vacuum of",
            "vacuum, compact, defragment, reclaim space",
        ),
        (
            "upgrade_plan",
            "Plan an in-place upgrade of",
            "upgrade path, migration steps, compatibility",
        ),
        (
            "audit_log",
            "Recent entries of the audit log of",
            "who did what, audit trail, access log",
        ),
        (
            "throughput",
            "Requests per second handled by",
            "qps, rps, load, traffic",
        ),
        (
            "leader",
            "Which node is the leader or primary of",
            "master election, primary node, failover",
        ),
        (
            "keyspace",
            "Keys, tables or indexes stored in",
            "list tables, indices, schema, namespaces",
        ),
        (
            "license",
            "License and subscription status of",
            "expiry of license, subscription, entitlement",
        ),
        (
            "plugins",
            "Installed plugins and extensions of",
            "extensions, modules, add-ons",
        ),
        (
            "thread_dump",
            "Thread or goroutine dump of the running",
            "stack traces, hung threads, deadlock",
        ),
        (
            "memory_profile",
            "Heap and memory breakdown of",
            "heap usage, allocations, memory leak",
        ),
        (
            "ports",
            "Ports and listeners configured for",
            "bind address, listen port, endpoints",
        ),
        (
            "reindex",
            "Rebuild the indexes of",
            "reindex, rebuild index, analyze",
        ),
        (
            "shard_balance",
            "Shard or partition placement and balance of",
            "rebalance, partitions, skew",
        ),
        (
            "quota",
            "Quotas and rate limits configured in",
            "limits, throttling, rate limit",
        ),
    ];
    let mut docs = catalog();
    'outer: for subject in SUBJECTS {
        for (aspect, description, keywords) in ASPECTS {
            if docs.len() >= n {
                break 'outer;
            }
            let name = format!("{}_{aspect}", subject.replace('-', "_"));
            let description = format!("{description} {subject}.");
            let prompt = format!(
                "## {name}\n\n{description}\n\nArguments:\n- `instance` (optional): which \
                 {subject} instance, default the local one.\n- `format` (default `json`).\n\n\
                 Output: a JSON object describing the {subject} instance; an unreachable \
                 instance is an error naming it."
            );
            docs.push((
                name.clone(),
                Doc {
                    name,
                    description,
                    prompt,
                    keywords: keywords
                        .split(", ")
                        .map(|k| format!("{subject} {k}"))
                        .collect(),
                },
            ));
        }
    }
    docs
}
