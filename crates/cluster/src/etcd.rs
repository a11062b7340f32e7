//! One attempt at each etcd operation this crate makes, its error classified as a [`Fault`]:
//! the retry loops in the other modules decide what to do with it.

use crate::client::pb::etcdserverpb::{
    Compare, DeleteRangeRequest, LeaseGrantRequest, LeaseRevokeRequest, PutRequest, RangeRequest,
    RequestOp, TxnRequest, WatchCreateRequest, compare, request_op, response_op,
};
use crate::client::{EtcdClient, KeepAlive, WatchStream, prefix_end};
use crate::error::Fault;

/// What a compare-and-swap expects to find at the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    Absent,
    /// The key was last written at this revision.
    ModRevision(i64),
}

impl Expect {
    fn compare(self, key: &str) -> Compare {
        let (target, value) = match self {
            // Version 0: the key does not exist.
            Self::Absent => (
                compare::CompareTarget::Version,
                compare::TargetUnion::Version(0),
            ),
            Self::ModRevision(rev) => (
                compare::CompareTarget::Mod,
                compare::TargetUnion::ModRevision(rev),
            ),
        };
        Compare {
            result: compare::CompareResult::Equal.into(),
            target: target.into(),
            key: key.into(),
            target_union: Some(value),
            range_end: Vec::new(),
        }
    }

    /// What to expect after reading `found`.
    pub(crate) fn from_read(found: Option<&Read>) -> Self {
        found.map_or(Self::Absent, |r| Self::ModRevision(r.mod_revision))
    }
}

/// A key's value as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Read {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

pub(crate) async fn get(client: &EtcdClient, key: &str) -> Result<Option<Read>, Fault> {
    let request = RangeRequest {
        key: key.into(),
        ..RangeRequest::default()
    };
    let response = client
        .kv("get", request, |mut kv, r| async move { kv.range(r).await })
        .await?;
    Ok(response.kvs.into_iter().next().map(|kv| Read {
        value: kv.value,
        mod_revision: kv.mod_revision,
    }))
}

/// Everything under `prefix`: (key, value, mod revision), and the revision of the listing.
pub(crate) type Listing = (Vec<(Vec<u8>, Vec<u8>, i64)>, i64);

pub(crate) async fn list(client: &EtcdClient, prefix: &str) -> Result<Listing, Fault> {
    let request = RangeRequest {
        key: prefix.into(),
        range_end: prefix_end(prefix.as_bytes()),
        ..RangeRequest::default()
    };
    let response = client
        .kv(
            "list",
            request,
            |mut kv, r| async move { kv.range(r).await },
        )
        .await?;
    let revision = response.header.map_or(0, |h| h.revision);
    let kvs = response
        .kvs
        .into_iter()
        .map(|kv| (kv.key, kv.value, kv.mod_revision))
        .collect();
    Ok((kvs, revision))
}

/// A plain put, under `lease` when given: the revision it wrote at, and the previous value.
pub(crate) async fn put(
    client: &EtcdClient,
    key: &str,
    value: &[u8],
    lease: Option<i64>,
) -> Result<(i64, Option<Vec<u8>>), Fault> {
    let request = PutRequest {
        key: key.into(),
        value: value.to_vec(),
        lease: lease.unwrap_or(0),
        prev_kv: true,
        ..PutRequest::default()
    };
    let response = client
        .kv("put", request, |mut kv, r| async move { kv.put(r).await })
        .await?;
    Ok((
        response.header.map_or(0, |h| h.revision),
        response.prev_kv.map(|kv| kv.value),
    ))
}

/// Several puts in one transaction (distinct keys, at most etcd's `--max-txn-ops`), each with
/// its lease: the revision they all wrote at, and each one's previous value, in order.
pub(crate) async fn put_many(
    client: &EtcdClient,
    puts: &[(&str, &[u8], i64)],
) -> Result<(i64, Vec<Option<Vec<u8>>>), Fault> {
    let request = TxnRequest {
        compare: Vec::new(),
        success: puts
            .iter()
            .map(|(key, value, lease)| RequestOp {
                request: Some(request_op::Request::RequestPut(PutRequest {
                    key: key.as_bytes().to_vec(),
                    value: value.to_vec(),
                    lease: *lease,
                    prev_kv: true,
                    ..PutRequest::default()
                })),
            })
            .collect(),
        failure: Vec::new(),
    };
    let response = client
        .kv(
            "put batch",
            request,
            |mut kv, r| async move { kv.txn(r).await },
        )
        .await?;
    let revision = response.header.map_or(0, |h| h.revision);
    let mut previous: Vec<Option<Vec<u8>>> = response
        .responses
        .into_iter()
        .map(|op| match op.response {
            Some(response_op::Response::ResponsePut(put)) => put.prev_kv.map(|kv| kv.value),
            _ => None,
        })
        .collect();
    previous.resize(puts.len(), None);
    Ok((revision, previous))
}

/// Puts `value` if the key is as `expect`ed: the revision written, or `None` if it was not.
pub(crate) async fn put_if(
    client: &EtcdClient,
    key: &str,
    expect: Expect,
    value: &[u8],
    lease: Option<i64>,
) -> Result<Option<i64>, Fault> {
    let put = request_op::Request::RequestPut(PutRequest {
        key: key.into(),
        value: value.to_vec(),
        lease: lease.unwrap_or(0),
        ..PutRequest::default()
    });
    let (succeeded, revision) = txn(client, "put if", expect.compare(key), put).await?;
    Ok(succeeded.then_some(revision))
}

/// Deletes the key (absent is fine): whether it was there.
pub(crate) async fn delete(client: &EtcdClient, key: &str) -> Result<bool, Fault> {
    let request = DeleteRangeRequest {
        key: key.into(),
        ..DeleteRangeRequest::default()
    };
    let response = client
        .kv("delete", request, |mut kv, r| async move {
            kv.delete_range(r).await
        })
        .await?;
    Ok(response.deleted > 0)
}

/// Deletes the key if it is as `expect`ed: whether it did.
pub(crate) async fn delete_if(
    client: &EtcdClient,
    key: &str,
    expect: Expect,
) -> Result<bool, Fault> {
    let delete = request_op::Request::RequestDeleteRange(DeleteRangeRequest {
        key: key.into(),
        ..DeleteRangeRequest::default()
    });
    Ok(txn(client, "delete if", expect.compare(key), delete)
        .await?
        .0)
}

/// A transaction of one condition and one operation: whether the condition held, and the
/// revision of the response.
async fn txn(
    client: &EtcdClient,
    what: &'static str,
    when: Compare,
    then: request_op::Request,
) -> Result<(bool, i64), Fault> {
    let request = TxnRequest {
        compare: vec![when],
        success: vec![RequestOp {
            request: Some(then),
        }],
        failure: Vec::new(),
    };
    let response = client
        .kv(what, request, |mut kv, r| async move { kv.txn(r).await })
        .await?;
    Ok((
        response.succeeded,
        response.header.map_or(0, |h| h.revision),
    ))
}

/// A new lease of `ttl` seconds: its id and the TTL etcd granted.
pub(crate) async fn grant(client: &EtcdClient, ttl: i64) -> Result<(i64, i64), Fault> {
    let request = LeaseGrantRequest { ttl, id: 0 };
    let response = client
        .lease("grant lease", request, |mut lease, r| async move {
            lease.lease_grant(r).await
        })
        .await?;
    if !response.error.is_empty() {
        return Err(Fault::Permanent(format!(
            "etcd granted no lease: {}",
            response.error
        )));
    }
    Ok((response.id, response.ttl))
}

/// Revokes a lease (its keys go at once). A lease already gone counts as revoked.
pub(crate) async fn revoke(client: &EtcdClient, lease: i64) -> Result<(), Fault> {
    let request = LeaseRevokeRequest { id: lease };
    let revoked = client
        .lease("revoke lease", request, |mut lease, r| async move {
            lease.lease_revoke(r).await
        })
        .await;
    match revoked {
        Ok(_) | Err(Fault::LeaseNotFound(_)) => Ok(()),
        Err(fault) => Err(fault),
    }
}

/// A watch of every key under `prefix`, from revision `from` on.
pub(crate) async fn watch(
    client: &EtcdClient,
    prefix: &str,
    from: i64,
) -> Result<WatchStream, Fault> {
    client
        .watch(WatchCreateRequest {
            key: prefix.into(),
            range_end: prefix_end(prefix.as_bytes()),
            start_revision: from,
            ..WatchCreateRequest::default()
        })
        .await
}

/// A keep-alive stream for `lease`, renewed once: the stream and the TTL etcd answered (zero
/// or less: the lease is gone).
pub(crate) async fn keep_alive(client: &EtcdClient, lease: i64) -> Result<(KeepAlive, i64), Fault> {
    client.keep_alive(lease).await
}
