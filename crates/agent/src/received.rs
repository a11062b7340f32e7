//! Counting the bytes the coordinator sends as they arrive. A large message on a slow downlink
//! (a `.meta` of a few hundred KiB, a call's arguments) holds the coordinator's keepalives behind
//! it; its bytes arriving say the coordinator is alive though the message is not whole yet.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::Channel;
use toolsrv_proto::received::{CountedBody, Received};

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
    Box<
        dyn Future<Output = Result<http::Response<CountedBody<Body>>, tonic::transport::Error>>
            + Send,
    >,
>;

impl tower::Service<http::Request<Body>> for Counted {
    type Response = http::Response<CountedBody<Body>>;
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
            Ok(response.map(|inner| CountedBody::new(inner, received)))
        })
    }
}
