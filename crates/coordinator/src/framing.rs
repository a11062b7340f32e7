//! gRPC message framing for the agent link's stream, with buffers given back when a link goes quiet.
//!
//! tonic's stream codec keeps, for the life of a stream, a decode buffer as large as the largest
//! message received and an encode buffer as large as the largest batch sent (a `BytesMut` that
//! reuses its allocation). An agent link lives for days and is idle almost all of that time, so
//! after one catalog and one host view those two buffers were most of the coordinator's memory
//! per agent. Here each outgoing message gets an allocation of its exact size, freed once HTTP/2
//! has written it, and the incoming buffer is dropped whenever it is empty and the peer has
//! nothing more to send.
//!
//! The wire format is gRPC's: each message is a 1-byte compression flag (always 0 here: the
//! agent link is not compressed), a 4-byte big-endian length and the protobuf bytes; the response
//! ends with `grpc-status` trailers.

use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::{Body, Frame};
use tokio_stream::Stream;
use tonic::Status;
use tonic::codegen::http;
use toolsrv_proto::received::{CountedBody, Received};

/// Compression flag and length before each message.
const HEADER: usize = 5;

/// The messages of a request body, decoded one at a time.
#[derive(Debug)]
pub struct Inbound<M, B> {
    body: CountedBody<B>,
    buf: BytesMut,
    max_message: usize,
    /// The limit of the first message, when it differs (see [`Inbound::first_at_most`]).
    first_max: Option<usize>,
    ended: bool,
    received: Arc<Received>,
    _message: PhantomData<fn() -> M>,
}

impl<M, B> Inbound<M, B>
where
    M: prost::Message + prost::Name + Default,
    B: Body + Unpin,
    B::Error: std::fmt::Display,
{
    /// Reads `body`, refusing messages larger than `max_message` bytes.
    pub fn new(body: B, max_message: usize) -> Self {
        let received = Arc::new(Received::default());
        Self {
            body: CountedBody::new(body, received.clone()),
            buf: BytesMut::new(),
            max_message,
            first_max: None,
            ended: false,
            received,
            _message: PhantomData,
        }
    }

    /// Refuses a first message larger than `max` bytes (the agent link's hello is small: a
    /// peer that sends 16 MiB before it says who it is made the coordinator decode them, 1.7 GB
    /// of tiny entries, once per connection it opened).
    pub fn first_at_most(mut self, max: usize) -> Self {
        self.first_max = Some(max);
        self
    }

    /// The count of bytes read from the body, which grows as they arrive, before the message
    /// they belong to is whole.
    pub fn received(&self) -> Arc<Received> {
        self.received.clone()
    }

    /// A whole message at the front of the buffer, if there is one.
    fn decode_buffered(&mut self) -> Result<Option<M>, Status> {
        if self.buf.len() < HEADER {
            return Ok(None);
        }
        if self.buf[0] != 0 {
            return Err(Status::unimplemented(
                "compressed messages are not accepted on the agent link",
            ));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        let (limit, which) = match self.first_max {
            Some(first) => (first, "first message"),
            None => (self.max_message, "message"),
        };
        if len > limit {
            return Err(Status::out_of_range(format!(
                "a {which} of {len} bytes is over the limit of {limit} bytes"
            )));
        }
        let Some(missing) = (HEADER + len)
            .checked_sub(self.buf.len())
            .filter(|&m| m > 0)
        else {
            let encoded = &self.buf[HEADER..HEADER + len];
            toolsrv_proto::cost::check::<M>(encoded).map_err(Status::from)?;
            let message = M::decode(encoded)
                .map_err(|e| Status::internal(format!("cannot decode a message: {e}")))?;
            self.buf.advance(HEADER + len);
            self.first_max = None;
            return Ok(Some(message));
        };
        // Room for the rest of this message at once, rather than doubling towards it.
        self.buf.reserve(missing);
        Ok(None)
    }

    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<M, Status>>> {
        loop {
            match self.decode_buffered() {
                Ok(Some(message)) => return Poll::Ready(Some(Ok(message))),
                Ok(None) => {}
                Err(status) => {
                    self.ended = true;
                    self.buf = BytesMut::new();
                    return Poll::Ready(Some(Err(status)));
                }
            }
            if self.ended {
                if self.buf.is_empty() {
                    return Poll::Ready(None);
                }
                self.buf = BytesMut::new();
                return Poll::Ready(Some(Err(Status::internal(
                    "the stream ended inside a message",
                ))));
            }
            match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(mut data) = frame.into_data() {
                        while data.has_remaining() {
                            let chunk = data.chunk();
                            self.buf.extend_from_slice(chunk);
                            let n = chunk.len();
                            data.advance(n);
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.ended = true;
                    self.buf = BytesMut::new();
                    return Poll::Ready(Some(Err(Status::unknown(format!(
                        "the connection broke ({})",
                        summary(&e.to_string())
                    )))));
                }
                Poll::Ready(None) => self.ended = true,
                Poll::Pending => {
                    // Quiet: give back what the last burst grew the buffer to.
                    // (An empty buffer may still hold its allocation behind the consumed bytes,
                    // so `capacity()` does not tell; `BytesMut::new()` allocates nothing.)
                    if self.buf.is_empty() {
                        self.buf = BytesMut::new();
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// Most bytes of a body error's text kept in the status that ends the stream.
const MAX_ERROR_SUMMARY: usize = 300;

/// A body error's text without the debug dump of its sources (tonic writes `source: Error {
/// ... }` after the message, hundreds of bytes that reached `toolctl call` and models), cut to
/// [`MAX_ERROR_SUMMARY`] bytes.
fn summary(text: &str) -> String {
    let text = text.split(", source:").next().unwrap_or(text);
    // A status's display wraps the message people need: `code: 'Unknown error', message: "..."`.
    let text = text
        .strip_prefix("code: '")
        .and_then(|t| t.split_once("', message: \""))
        .map_or(text, |(_, message)| {
            message.strip_suffix('"').unwrap_or(message)
        });
    let text = toolsrv_proto::text::transport_words(text);
    let text = text.as_str();
    match text.char_indices().find(|(i, _)| *i >= MAX_ERROR_SUMMARY) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

impl<M, B> Stream for Inbound<M, B>
where
    M: prost::Message + prost::Name + Default,
    B: Body + Unpin,
    B::Error: std::fmt::Display,
{
    type Item = Result<M, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_message(cx)
    }
}

/// A response body carrying the messages of a stream, each encoded into its own exact-size
/// buffer, then the stream's status as trailers.
#[derive(Debug)]
pub struct Outbound<S> {
    messages: S,
    max_message: usize,
    done: bool,
}

impl<S, M> Outbound<S>
where
    S: Stream<Item = Result<M, Status>> + Unpin,
    M: prost::Message,
{
    /// Encodes `messages`; one larger than `max_message` bytes ends the stream with an error.
    pub fn new(messages: S, max_message: usize) -> Self {
        Self {
            messages,
            max_message,
            done: false,
        }
    }

    fn encode(&self, message: &M) -> Result<Bytes, Status> {
        let len = message.encoded_len();
        if len > self.max_message {
            return Err(Status::out_of_range(format!(
                "a message of {len} bytes is over the limit of {} bytes",
                self.max_message
            )));
        }
        let mut buf = BytesMut::with_capacity(HEADER + len);
        buf.put_u8(0);
        // Lossless: `len` is at most `max_message`, which callers keep far below 4 GiB.
        buf.put_u32(len as u32);
        message.encode_raw(&mut buf);
        Ok(buf.freeze())
    }
}

impl<S, M> Body for Outbound<S>
where
    S: Stream<Item = Result<M, Status>> + Unpin,
    M: prost::Message,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let status = match ready!(Pin::new(&mut this.messages).poll_next(cx)) {
            Some(Ok(message)) => match this.encode(&message) {
                Ok(bytes) => return Poll::Ready(Some(Ok(Frame::data(bytes)))),
                Err(status) => status,
            },
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        this.done = true;
        Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// `grpc-status` (and `grpc-message`) trailers for `status`.
fn trailers(status: &Status) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        // Only a message that cannot be a header value gets here; the code still goes out.
        map.clear();
        let _ = Status::new(status.code(), "").add_header(&mut map);
    }
    map
}

/// A gRPC response whose body is [`Outbound`].
pub fn response<S, M>(messages: S, max_message: usize) -> http::Response<tonic::body::Body>
where
    S: Stream<Item = Result<M, Status>> + Unpin + Send + 'static,
    M: prost::Message + 'static,
{
    let mut response =
        http::Response::new(tonic::body::Body::new(Outbound::new(messages, max_message)));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;

    use prost::Message;

    use tokio_stream::StreamExt;
    use toolsrv_proto::v1::{Keepalive, agent_message::Msg};

    use super::*;

    #[test]
    fn a_body_error_is_summed_up_without_its_sources() {
        let dump = "code: 'Unknown error', message: \"error reading a body from connection\", \
                    source: Error { inner: Status { code: Unknown, source: Some(hyper::Error(\
                    Body, Error { kind: Io(Custom { kind: UnexpectedEof }) })) } }";
        assert_eq!(summary(dump), "error reading a body from connection");
        // As a killed agent's connection reads: nothing that looks like a host named `h2`.
        let killed = "code: 'Unknown error', message: \"h2 protocol error: error reading a body \
                      from connection\"";
        assert_eq!(
            summary(killed),
            "HTTP/2 protocol error: error reading a body from connection"
        );
        let long = "x".repeat(1000);
        assert_eq!(summary(&long).len(), MAX_ERROR_SUMMARY + '…'.len_utf8());
    }
    use toolsrv_proto::v1::AgentMessage;

    /// A request body that yields the given chunks, then `Pending` once between chunks when
    /// `quiet` (as a peer pausing does), then ends.
    struct Chunks {
        chunks: VecDeque<Bytes>,
        quiet: bool,
        paused: bool,
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.quiet && !self.paused && !self.chunks.is_empty() {
                self.paused = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.paused = false;
            Poll::Ready(self.chunks.pop_front().map(|c| Ok(Frame::data(c))))
        }
    }

    fn keepalive(ms: u64) -> AgentMessage {
        AgentMessage {
            msg: Some(Msg::Keepalive(Keepalive {
                sent_unix_ms: ms,
                interval_ms: 0,
            })),
        }
    }

    fn framed(messages: &[AgentMessage]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            out.push(0);
            out.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
            m.encode(&mut out).unwrap();
        }
        out
    }

    async fn decode_all(
        wire: Vec<u8>,
        split: usize,
        quiet: bool,
    ) -> Vec<Result<AgentMessage, Status>> {
        let chunks = wire.chunks(split).map(Bytes::copy_from_slice).collect();
        let body = Chunks {
            chunks,
            quiet,
            paused: false,
        };
        Inbound::<AgentMessage, _>::new(body, 1 << 20)
            .collect()
            .await
    }

    #[tokio::test]
    async fn messages_split_and_joined_anyhow_come_out_whole() {
        let messages: Vec<_> = (0..20).map(keepalive).collect();
        let wire = framed(&messages);
        for split in [1, 2, 3, 5, 7, 64, wire.len()] {
            for quiet in [false, true] {
                let got: Vec<_> = decode_all(wire.clone(), split, quiet)
                    .await
                    .into_iter()
                    .map(Result::unwrap)
                    .collect();
                assert_eq!(got, messages, "split {split}, quiet {quiet}");
            }
        }
    }

    /// The first message has its own, smaller limit; the ones after it the usual one.
    #[tokio::test]
    async fn a_first_message_over_its_limit_is_refused_before_it_is_read() {
        let big = |n: usize| AgentMessage {
            msg: Some(Msg::Goodbye(toolsrv_proto::v1::Goodbye {
                reason: "x".repeat(n),
                refused: false,
            })),
        };
        let decode = |messages: Vec<AgentMessage>| async move {
            let body = Chunks {
                chunks: [Bytes::from(framed(&messages))].into(),
                quiet: false,
                paused: false,
            };
            Inbound::<AgentMessage, _>::new(body, 1 << 20)
                .first_at_most(1024)
                .collect::<Vec<_>>()
                .await
        };
        let got = decode(vec![big(4096)]).await;
        let e = got[0].as_ref().unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(
            e.message().contains("a first message of 4")
                && e.message().contains("over the limit of 1024 bytes"),
            "{e:?}"
        );
        let got = decode(vec![keepalive(1), big(4096)]).await;
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(Result::is_ok), "{got:?}");
    }

    #[tokio::test]
    async fn the_buffer_is_given_back_when_the_peer_pauses() {
        let big = AgentMessage {
            msg: Some(Msg::Goodbye(toolsrv_proto::v1::Goodbye {
                reason: "x".repeat(64 << 10),
                refused: false,
            })),
        };
        let wire = framed(std::slice::from_ref(&big));
        let body = Chunks {
            chunks: wire.chunks(16 << 10).map(Bytes::copy_from_slice).collect(),
            quiet: false,
            paused: false,
        };
        let mut inbound = Inbound::<AgentMessage, _>::new(body, 1 << 20);
        assert_eq!(inbound.next().await.unwrap().unwrap(), big);
        inbound.body.get_mut().quiet = true;
        inbound
            .body
            .get_mut()
            .chunks
            .push_back(Bytes::from(framed(&[keepalive(1)])));
        assert_eq!(inbound.next().await.unwrap().unwrap(), keepalive(1));
        // The pause before the keepalive arrived dropped the large buffer (kept, the keepalive
        // would have been copied into it, reclaiming its whole 64 KiB).
        assert!(
            inbound.buf.capacity() < 1 << 10,
            "{}",
            inbound.buf.capacity()
        );
    }

    #[tokio::test]
    async fn bytes_count_as_they_arrive_before_their_message_is_whole() {
        let big = AgentMessage {
            msg: Some(Msg::Goodbye(toolsrv_proto::v1::Goodbye {
                reason: "x".repeat(64 << 10),
                refused: false,
            })),
        };
        let wire = framed(&[big.clone(), keepalive(1)]);
        let body = Chunks {
            chunks: wire.chunks(16 << 10).map(Bytes::copy_from_slice).collect(),
            quiet: true,
            paused: false,
        };
        let mut inbound = Inbound::<AgentMessage, _>::new(body, 1 << 20);
        let received = inbound.received();
        assert_eq!(received.bytes(), 0);
        // Each poll reads until the body pauses: nothing, then one chunk (a quarter of the
        // message), counted though the message is not whole.
        for expected in [0, 16 << 10] {
            let polled = std::future::poll_fn(|cx| Poll::Ready(inbound.poll_message(cx))).await;
            assert!(polled.is_pending());
            assert_eq!(received.bytes(), expected);
        }
        assert_eq!(inbound.next().await.unwrap().unwrap(), big);
        assert_eq!(inbound.next().await.unwrap().unwrap(), keepalive(1));
        assert_eq!(received.bytes(), wire.len() as u64);
    }

    #[tokio::test]
    async fn oversized_compressed_and_truncated_messages_are_errors() {
        let mut wire = framed(&[keepalive(1)]);
        wire[1..5].copy_from_slice(&(2u32 << 20).to_be_bytes());
        let got = decode_all(wire, 64, false).await;
        assert_eq!(got[0].as_ref().unwrap_err().code(), tonic::Code::OutOfRange);

        let mut wire = framed(&[keepalive(1)]);
        wire[0] = 1;
        let got = decode_all(wire, 64, false).await;
        assert_eq!(
            got[0].as_ref().unwrap_err().code(),
            tonic::Code::Unimplemented
        );

        let mut wire = framed(&[keepalive(1), keepalive(2)]);
        wire.pop();
        let got = decode_all(wire, 3, false).await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap(), &keepalive(1));
        assert_eq!(got[1].as_ref().unwrap_err().code(), tonic::Code::Internal);
    }

    #[tokio::test]
    async fn outbound_frames_each_message_then_sends_the_status() {
        let messages = vec![keepalive(1), keepalive(2)];
        let items: Vec<Result<AgentMessage, Status>> = messages
            .iter()
            .cloned()
            .map(Ok)
            .chain([Err(Status::unavailable("bye"))])
            .collect();
        let mut body = Outbound::new(tokio_stream::iter(items), 1 << 20);
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            let frame = frame.unwrap();
            match frame.into_data() {
                Ok(bytes) => {
                    // Exactly one message per frame, in an exact-size buffer.
                    assert_eq!(bytes.len(), HEADER + keepalive(1).encoded_len());
                    data.extend_from_slice(&bytes);
                }
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        assert!(body.is_end_stream());
        assert_eq!(data, framed(&messages));
        let trailers = trailers.unwrap();
        assert_eq!(trailers["grpc-status"], "14");
        assert_eq!(trailers["grpc-message"], "bye");
    }

    #[tokio::test]
    async fn outbound_refuses_an_oversized_message_and_ends_ok_otherwise() {
        let items = vec![Ok(keepalive(1))];
        let mut body = Outbound::new(tokio_stream::iter(items), 2);
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(frame.into_trailers().unwrap()["grpc-status"], "11");

        let mut body = Outbound::new(tokio_stream::iter(Vec::<Result<AgentMessage, _>>::new()), 2);
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(frame.into_trailers().unwrap()["grpc-status"], "0");
    }
}
