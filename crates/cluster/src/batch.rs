//! Claims that arrive together go to etcd together: each claim's first put joins a batch, and
//! a batch is one transaction (one raft proposal) of up to [`MAX_OPS`] puts, instead of one
//! proposal per claim. Batches form by themselves: a claim waits only while earlier batches
//! are in flight (at most [`IN_FLIGHT`] at once), so a lone claim is sent at once and a
//! reconnect storm's thousands of claims go out a hundred at a time.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::client::EtcdClient;
use crate::error::Fault;
use crate::etcd;

/// Puts per transaction: etcd's default `--max-txn-ops`.
pub(crate) const MAX_OPS: usize = 128;
/// Transactions in flight at once.
const IN_FLIGHT: usize = 4;

/// What one put became: the revision it wrote at, and the value it replaced.
pub(crate) type PutResult = Result<(i64, Option<Vec<u8>>), Fault>;

struct Put {
    key: String,
    value: Vec<u8>,
    lease: i64,
    done: oneshot::Sender<PutResult>,
}

/// The sending side of the batching task; the task ends when `cancel` fires.
#[derive(Debug, Clone)]
pub(crate) struct PutBatcher {
    tx: mpsc::UnboundedSender<Put>,
}

impl std::fmt::Debug for Put {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Put")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl PutBatcher {
    pub(crate) fn start(client: EtcdClient, cancel: CancellationToken) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(client, rx, cancel));
        Self { tx }
    }

    /// Puts `value` at `key` under `lease`, in the next batch.
    pub(crate) async fn put(&self, key: &str, value: &[u8], lease: i64) -> PutResult {
        let (done, answer) = oneshot::channel();
        let put = Put {
            key: key.to_string(),
            value: value.to_vec(),
            lease,
            done,
        };
        let stopped = || Fault::Permanent("the cluster membership is shutting down".into());
        self.tx.send(put).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

async fn run(client: EtcdClient, mut rx: mpsc::UnboundedReceiver<Put>, cancel: CancellationToken) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    // A put whose key is in the batch being formed waits for the next one (a transaction may
    // not name a key twice).
    let mut next: Vec<Put> = Vec::new();
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        if next.is_empty() {
            tokio::select! {
                () = cancel.cancelled() => return,
                put = rx.recv() => match put {
                    Some(put) => next.push(put),
                    None => return,
                },
            }
        }
        let mut batch: Vec<Put> = Vec::new();
        let mut keys = std::collections::HashSet::new();
        let mut later = Vec::new();
        for put in next
            .drain(..)
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            if batch.len() >= MAX_OPS || keys.contains(&put.key) {
                later.push(put);
                if later.len() >= MAX_OPS {
                    break;
                }
                continue;
            }
            keys.insert(put.key.clone());
            batch.push(put);
        }
        next = later;
        let client = client.clone();
        tokio::spawn(async move {
            let ops: Vec<(&str, &[u8], i64)> = batch
                .iter()
                .map(|p| (p.key.as_str(), p.value.as_slice(), p.lease))
                .collect();
            let result = etcd::put_many(&client, &ops).await;
            match result {
                Ok((revision, previous)) => {
                    for (put, prev) in batch.into_iter().zip(previous) {
                        let _ = put.done.send(Ok((revision, prev)));
                    }
                }
                Err(fault) => {
                    for put in batch {
                        let _ = put.done.send(Err(fault.clone()));
                    }
                }
            }
            drop(slot);
        });
    }
}
