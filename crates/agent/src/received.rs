//! Counting the bytes the coordinator sends as they arrive. A large message on a slow downlink
//! (a `.meta` of a few hundred KiB, a call's arguments) holds the coordinator's keepalives behind
//! it; its bytes arriving say the coordinator is alive though the message is not whole yet.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::Channel;

/// Bytes received so far on the responses of a [`Counted`] channel.
#[derive(Debug, Default)]
pub(crate) struct Received(AtomicU64);

impl Received {
    pub(crate) fn bytes(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A channel whose response bodies count their bytes into one [`Received`].
#[derive(Debug, Clone)]
pub(crate) struct Counted {
    inner: Channel,
    received: Arc<Received>,
}

impl Counted {
    pub(crate) fn new(inner: Channel) -> (Self, Arc<Received>) {
        let received = Arc::new(Received::default());
        let counted = Self {
            inner,
            received: received.clone(),
        };
        (counted, received)
    }
}

type ResponseFuture = Pin<
    Box<dyn Future<Output = Result<http::Response<CountedBody>, tonic::transport::Error>> + Send>,
>;

impl tower::Service<http::Request<Body>> for Counted {
    type Response = http::Response<CountedBody>;
    type Error = tonic::transport::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let response = tower::Service::call(&mut self.inner, request);
        let received = self.received.clone();
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|inner| CountedBody { inner, received }))
        })
    }
}

/// A response body that adds the length of each data frame to its [`Received`].
#[derive(Debug)]
pub(crate) struct CountedBody {
    inner: Body,
    received: Arc<Received>,
}

impl http_body::Body for CountedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

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
                .fetch_add(data.len() as u64, Ordering::Relaxed);
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
