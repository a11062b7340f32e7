//! The queue in front of one side of the agent link, with a bound on how long a sender waits for
//! a peer that reads nothing. A wedged peer whose connection still answers HTTP/2 pings looks
//! alive to the transport; its window fills, then the queue, and a sender that waits for room
//! without end holds whatever waits behind it (on the coordinator, calls to the host; on either
//! side, the loop that judges the peer's silence). Both ends of the link send through this.
//!
//! Architecture invariant: a send waits for room only while the peer takes messages from the
//! queue. When it has taken none for the stall limit, the send fails as [`Stalled`] and the
//! link is ended by its owner; a peer that reads, however slowly, is waited for.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::Stream;

/// How long both ends of the agent link wait, by default, for a peer that takes nothing from a
/// full queue.
pub const DEFAULT_STALLED_AFTER: Duration = Duration::from_secs(60);

/// Why a message was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotSent {
    /// The link's stream is gone.
    Closed,
    /// The queue stayed full for the stall limit with the peer taking nothing from it.
    Stalled(Duration),
}

/// The sending side: clone it for each sender.
#[derive(Debug)]
pub struct Outbound<T> {
    tx: mpsc::Sender<T>,
    taken: Arc<AtomicU64>,
    stalled_after: Duration,
}

impl<T> Clone for Outbound<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            taken: self.taken.clone(),
            stalled_after: self.stalled_after,
        }
    }
}

/// A queue of `capacity` messages whose senders give up after `stalled_after` without the
/// peer taking any; the stream is what the connection sends from.
pub fn channel<T>(capacity: usize, stalled_after: Duration) -> (Outbound<T>, Taken<T>) {
    let (tx, rx) = mpsc::channel(capacity);
    let taken = Arc::new(AtomicU64::new(0));
    let outbound = Outbound {
        tx,
        taken: taken.clone(),
        stalled_after,
    };
    (outbound, Taken { rx, taken })
}

impl<T> Outbound<T> {
    /// Queues `message`, waiting for room while the peer takes messages.
    pub async fn send(&self, message: T) -> Result<(), NotSent> {
        loop {
            let taken = self.taken.load(Ordering::Relaxed);
            match tokio::time::timeout(self.stalled_after, self.tx.reserve()).await {
                Ok(Ok(permit)) => {
                    permit.send(message);
                    return Ok(());
                }
                Ok(Err(_)) => return Err(NotSent::Closed),
                Err(_) if self.taken.load(Ordering::Relaxed) != taken => {}
                Err(_) => return Err(NotSent::Stalled(self.stalled_after)),
            }
        }
    }

    /// Queues `message` if there is room now.
    pub fn try_send(&self, message: T) -> Result<(), mpsc::error::TrySendError<T>> {
        self.tx.try_send(message)
    }
}

/// The receiving side, counting each message the connection takes.
#[derive(Debug)]
pub struct Taken<T> {
    rx: mpsc::Receiver<T>,
    taken: Arc<AtomicU64>,
}

impl<T> Taken<T> {
    /// The next message, when the queue's senders are all gone `None`.
    pub async fn recv(&mut self) -> Option<T> {
        let next = self.rx.recv().await;
        self.count(next.is_some());
        next
    }

    /// The next message if one is queued.
    pub fn try_recv(&mut self) -> Result<T, mpsc::error::TryRecvError> {
        let next = self.rx.try_recv();
        self.count(next.is_ok());
        next
    }

    fn count(&self, took: bool) {
        if took {
            self.taken.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<T> Stream for Taken<T> {
    type Item = T;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let next = self.rx.poll_recv(cx);
        self.count(matches!(next, Poll::Ready(Some(_))));
        next
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use tokio_stream::StreamExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_reads_nothing_stalls_the_send_after_the_limit() {
        let (out, _taken) = channel(2, Duration::from_secs(5));
        out.send(1).await.unwrap();
        out.send(2).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            out.send(3).await,
            Err(NotSent::Stalled(Duration::from_secs(5)))
        );
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    /// Eight senders at once behind a reader taking a message every 2 s: the last waits 12 s
    /// for its turn, past the 5 s limit, but the peer was reading all along.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_is_waited_for() {
        let (out, mut taken) = channel(1, Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            let mut read = 0;
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                if taken.next().await.is_none() {
                    return read;
                }
                read += 1;
            }
        });
        let started = tokio::time::Instant::now();
        let senders: Vec<_> = (0..8)
            .map(|i| {
                let out = out.clone();
                tokio::spawn(async move { out.send(i).await })
            })
            .collect();
        for sender in senders {
            assert_eq!(sender.await.unwrap(), Ok(()));
        }
        assert!(started.elapsed() >= Duration::from_secs(10));
        drop(out);
        assert_eq!(reader.await.unwrap(), 8);
    }

    #[tokio::test]
    async fn a_gone_stream_is_closed() {
        let (out, taken) = channel(1, Duration::from_secs(5));
        drop(taken);
        assert_eq!(out.send(1).await, Err(NotSent::Closed));
    }
}
