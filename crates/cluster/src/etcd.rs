//! One attempt at each etcd operation this crate makes, its error classified as a [`Fault`]:
//! the retry loops in the other modules decide what to do with it.

use etcd_client::{Client, Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};

use crate::error::{Fault, classify};

/// What a compare-and-swap expects to find at the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    Absent,
    /// The key was last written at this revision.
    ModRevision(i64),
}

impl Expect {
    fn compare(self, key: &str) -> Compare {
        match self {
            Self::Absent => Compare::version(key, CompareOp::Equal, 0),
            Self::ModRevision(rev) => Compare::mod_revision(key, CompareOp::Equal, rev),
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

pub(crate) async fn get(client: &Client, key: &str) -> Result<Option<Read>, Fault> {
    let mut kv = client.kv_client();
    let response = kv.get(key, None).await.map_err(|e| classify(&e))?;
    Ok(response.kvs().first().map(|kv| Read {
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
    }))
}

/// Everything under `prefix`: (key, value, mod revision), and the revision of the listing.
pub(crate) type Listing = (Vec<(Vec<u8>, Vec<u8>, i64)>, i64);

pub(crate) async fn list(client: &Client, prefix: &str) -> Result<Listing, Fault> {
    let mut kv = client.kv_client();
    let mut response = kv
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| classify(&e))?;
    let revision = response.header().map_or(0, |h| h.revision());
    let kvs = response
        .take_kvs()
        .into_iter()
        .map(|kv| {
            let rev = kv.mod_revision();
            let (k, v) = kv.into_key_value();
            (k, v, rev)
        })
        .collect();
    Ok((kvs, revision))
}

/// A plain put, under `lease` when given: the revision it wrote at, and the previous value.
pub(crate) async fn put(
    client: &Client,
    key: &str,
    value: &[u8],
    lease: Option<i64>,
) -> Result<(i64, Option<Vec<u8>>), Fault> {
    let mut kv = client.kv_client();
    let mut options = PutOptions::new().with_prev_key();
    if let Some(lease) = lease {
        options = options.with_lease(lease);
    }
    let mut response = kv
        .put(key, value, Some(options))
        .await
        .map_err(|e| classify(&e))?;
    let revision = response.header().map_or(0, |h| h.revision());
    Ok((
        revision,
        response.take_prev_key().map(|kv| kv.value().to_vec()),
    ))
}

/// Puts `value` if the key is as `expect`ed: the revision written, or `None` if it was not.
pub(crate) async fn put_if(
    client: &Client,
    key: &str,
    expect: Expect,
    value: &[u8],
    lease: Option<i64>,
) -> Result<Option<i64>, Fault> {
    let options = lease.map(|lease| PutOptions::new().with_lease(lease));
    let txn = Txn::new()
        .when([expect.compare(key)])
        .and_then([TxnOp::put(key, value, options)]);
    let response = client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| classify(&e))?;
    Ok(response
        .succeeded()
        .then(|| response.header().map_or(0, |h| h.revision())))
}

/// Deletes the key if it is as `expect`ed: whether it did.
pub(crate) async fn delete_if(client: &Client, key: &str, expect: Expect) -> Result<bool, Fault> {
    let txn = Txn::new()
        .when([expect.compare(key)])
        .and_then([TxnOp::delete(key, None::<DeleteOptions>)]);
    let response = client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| classify(&e))?;
    Ok(response.succeeded())
}

/// A new lease of `ttl` seconds: its id and the TTL etcd granted.
pub(crate) async fn grant(client: &Client, ttl: i64) -> Result<(i64, i64), Fault> {
    let response = client
        .lease_client()
        .grant(ttl, None)
        .await
        .map_err(|e| classify(&e))?;
    Ok((response.id(), response.ttl()))
}

/// Revokes a lease (its keys go at once). A lease already gone counts as revoked.
pub(crate) async fn revoke(client: &Client, lease: i64) -> Result<(), Fault> {
    match client.lease_client().revoke(lease).await {
        Ok(_) => Ok(()),
        Err(e) => match classify(&e) {
            Fault::LeaseNotFound(_) => Ok(()),
            fault => Err(fault),
        },
    }
}
