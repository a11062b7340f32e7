//! Counting a stream's bytes as they arrive, before the message they belong to is whole. A
//! large message on a slow connection (a host view, a `.meta` of a few hundred KiB) holds the
//! peer's keepalives behind it; its bytes arriving say the peer is alive all the same. Both ends
//! of the agent link judge each other's silence on this count.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};

/// Bytes read so far from one or more [`CountedBody`]s.
#[derive(Debug, Default)]
pub struct Received(AtomicU64);

impl Received {
    pub fn bytes(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Whether bytes arrived since the count was `*seen`; moves `*seen` to the count now.
    pub fn arrived_since(&self, seen: &mut u64) -> bool {
        let now = self.bytes();
        std::mem::replace(seen, now) != now
    }
}

/// A body that adds the length of each data frame it yields to a [`Received`].
#[derive(Debug)]
pub struct CountedBody<B> {
    inner: B,
    received: Arc<Received>,
}

impl<B> CountedBody<B> {
    pub fn new(inner: B, received: Arc<Received>) -> Self {
        Self { inner, received }
    }

    pub fn get_mut(&mut self) -> &mut B {
        &mut self.inner
    }
}

impl<B: Body + Unpin> Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.received
                .0
                .fetch_add(data.remaining() as u64, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of the given data frames, then trailers.
    struct Frames(Vec<Frame<bytes::Bytes>>);

    impl Body for Frames {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
            Poll::Ready((!self.0.is_empty()).then(|| Ok(self.0.remove(0))))
        }
    }

    #[test]
    fn data_frames_are_counted_as_they_come_and_trailers_are_not() {
        let received = Arc::new(Received::default());
        let mut trailers = tonic::codegen::http::HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let frames = Frames(vec![
            Frame::data(bytes::Bytes::from_static(b"12345")),
            Frame::data(bytes::Bytes::from_static(b"678")),
            Frame::trailers(trailers),
        ]);
        let mut body = CountedBody::new(frames, received.clone());
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut seen = Vec::new();
        while let Poll::Ready(Some(Ok(_))) = Pin::new(&mut body).poll_frame(&mut cx) {
            seen.push(received.bytes());
        }
        assert_eq!(seen, [5, 8, 8]);
    }

    #[test]
    fn arrived_since_tells_new_bytes_once() {
        let received = Received::default();
        let mut seen = received.bytes();
        assert!(!received.arrived_since(&mut seen));
        received.0.fetch_add(3, Ordering::Relaxed);
        assert!(received.arrived_since(&mut seen));
        assert_eq!(seen, 3);
        assert!(!received.arrived_since(&mut seen));
    }
}
