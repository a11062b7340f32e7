//! Coordinator replicas on etcd: each replica keeps one lease, records the hosts whose links
//! it holds under it, follows every replica's records into a routing table, and agrees with
//! the others on one catalog revision. Pure of coordinator types: hosts are ids and facts.
//!
//! # Key layout
//!
//! Under a prefix (default `/toolsrv/`):
//!
//! | key | value (JSON) | lease |
//! |---|---|---|
//! | `<prefix>replicas/<replica id>` | [`ReplicaRecord`]: id, advertise URL, start time | the replica's |
//! | `<prefix>hosts/<host id>` | [`HostRecord`]: owner replica and URL, link id, facts, attach time | the owner's |
//! | `<prefix>catalog` | [`AgreedCatalog`]: revision, digest | none |
//!
//! # Invariants
//!
//! - One lease per replica; everything a replica writes about itself and its hosts is under
//!   it, so a replica that dies loses its record and its hosts together when the lease
//!   expires ([`ClusterEvent::ReplicaGone`] names the hosts it held). [`Cluster::shutdown`]
//!   revokes the lease: its hosts are free at once.
//! - The newest link wins: [`Cluster::claim`] overwrites any claim. A replica whose link lost
//!   gets [`ClusterEvent::Superseded`] and drops that link. [`Cluster::release`] deletes a
//!   claim only while it is still the releasing link's (compare-and-swap on its revision).
//! - A lost lease (etcd says it is gone, or no renewal for a whole TTL) is replaced, and the
//!   replica's claims are put back under the new one, except those a newer claim replaced
//!   meanwhile ([`ClusterEvent::LeaseRegained`] says how long the gap was).
//! - Without an etcd quorum, new claims are refused ([`ClusterError::NoQuorum`]), without
//!   asking etcd after a member said it has no leader; health is [`ClusterHealth::Degraded`],
//!   and the routing
//!   table keeps what it had: the caller keeps serving the links it holds. etcd merely out of
//!   reach degrades health too, but claims still try (within their retry budget): a renewal
//!   that stalls during a leader election looks the same.
//! - The agreed catalog revision is written only by compare-and-swap; one revision names one
//!   digest, and what a replica returns or publishes never goes backwards.
//! - Idempotent operations (reads, lease grants and renewals, our own records, compare-and-swap
//!   loops) are retried with jittered exponential backoff within a bounded time, so a request
//!   the client sent to a dead member is tried on a live one. A claim's retries read first and
//!   never overwrite a claim newer than the attempt. Every error names the operation and key.
//! - Reading the routing table never waits on etcd.
//!
//! # The etcd client
//!
//! Our own, generated at build time from `proto/` (a wire-compatible subset of etcd's v3 API:
//! KV, Watch and Lease) with the vendored protoc of `protoc-bin-vendored`, like toolsrv-proto:
//! building needs no protoc and no .proto files from the system. One tonic channel per
//! endpoint (`http://`, or `https://` through toolsrv-tls's rustls connector with a web-PKI
//! verifier against the configured CA); every request goes to one member, the last that
//! answered, carries etcd's `hasleader` metadata (a member without a leader refuses at once)
//! and a deadline of [`ClusterConfig::request_timeout`]. A transport failure, a deadline
//! missed or a member without a leader moves the next request, watch or keep-alive stream to
//! the next endpoint (round robin); the retry loops decide whether to try again.

mod batch;
mod catalog;
mod claims;
mod client;
mod cluster;
mod config;
mod error;
mod etcd;
mod health;
mod lease;
mod records;
mod retry;
mod revocations;
mod table;
mod watcher;

pub use claims::Claim;
pub use cluster::Cluster;
pub use config::{ClusterConfig, EtcdTls};
pub use error::{ClusterError, Result};
pub use health::{ClusterHealth, ELECTION_GRACE};
pub use records::{AgreedCatalog, HostRecord, ReplicaRecord, new_link_id, unix_now};
pub use table::ClusterEvent;
