//! Made-up tools in the style of the evaluation catalog (services and what is asked of them),
//! for timing searches against a fleet-sized catalog. Shared by the `find` benchmark and the
//! fleet benchmark's `find` section, which serves them from a real coordinator.

use toolsrv_find::Doc;

/// Every made-up tool, in a fixed order (services outer, aspects inner).
pub fn generated() -> Vec<(String, Doc)> {
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
    let mut docs = Vec::with_capacity(SUBJECTS.len() * ASPECTS.len());
    for subject in SUBJECTS {
        for (aspect, description, keywords) in ASPECTS {
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
