//! A raw HTTP/2 client for the tests and benches that play a peer no gRPC library would be:
//! one that opens streams and never sends their body, or one that never reads its answers.

/// What became of the streams [`open_bodiless_streams`] opened.
pub struct Streams {
    /// Still waiting for an answer (the coordinator took them).
    pub taken: usize,
    /// Answered at once, with the gRPC status and message of each kind of answer.
    pub refused: usize,
    pub answers: std::collections::BTreeSet<(String, String)>,
    /// The connection and the streams still waiting, kept open while the caller looks.
    pub connection: h2::client::SendRequest<bytes::Bytes>,
    pub waiting: Vec<(h2::SendStream<bytes::Bytes>, h2::client::ResponseFuture)>,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams")
            .field("taken", &self.taken)
            .field("refused", &self.refused)
            .field("answers", &self.answers)
            .finish_non_exhaustive()
    }
}

/// Opens `n` gRPC requests to `path` on one HTTP/2 connection to the coordinator on 127.0.0.1:`port` made
/// with `tls`: headers only, never a body, as a peer that means to hold streams would. Each is
/// given 3 s to be answered.
pub async fn open_bodiless_streams(
    port: u16,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    path: &str,
    n: usize,
) -> Streams {
    let wait = std::time::Duration::from_secs(3);
    open_unfinished_streams(port, tls, path, bytes::Bytes::new(), n, wait).await
}

/// Opens `n` gRPC requests to `path` as [`open_bodiless_streams`] does, each sending `sent` (the
/// start of a body) and never the rest, as a peer that announces large messages and never
/// finishes them would. Each is given `wait` to be answered.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub async fn open_unfinished_streams(
    port: u16,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    path: &str,
    sent: bytes::Bytes,
    n: usize,
    wait: std::time::Duration,
) -> Streams {
    let mut send = h2_connection(port, tls, h2::client::Builder::new()).await;
    let mut answers = tokio::task::JoinSet::new();
    for _ in 0..n {
        send = send.ready().await.expect("room for a stream");
        let (mut response, mut body) = send
            .send_request(grpc_request(port, path), false)
            .expect("a stream");
        if !sent.is_empty() {
            // Buffered by the client, and sent as the server's window allows.
            body.send_data(sent.clone(), false)
                .expect("the start of a body");
        }
        answers.spawn(async move {
            // Unanswered, the stream is handed back whole: dropping it would cancel it.
            let answered = tokio::time::timeout(wait, &mut response).await;
            let Ok(answered) = answered else {
                return Err((body, response));
            };
            match &answered {
                // Named, so that a test that did not expect one says what it was.
                Err(e) => Ok(("HTTP/2 error".to_string(), e.to_string())),
                Ok(r) => Ok(grpc_status(r.headers()).unwrap_or_default()),
            }
        });
    }
    let mut streams = Streams {
        taken: 0,
        refused: 0,
        answers: Default::default(),
        connection: send,
        waiting: Vec::new(),
    };
    while let Some(answer) = answers.join_next().await {
        match answer.expect("an answer task") {
            Ok(answer) => {
                streams.refused += 1;
                streams.answers.insert(answer);
            }
            Err(waiting) => {
                streams.taken += 1;
                streams.waiting.push(waiting);
            }
        }
    }
    streams
}

/// The 5-byte prefix of a gRPC message of `len` bytes (not compressed).
pub fn grpc_prefix(len: u32) -> [u8; 5] {
    let [a, b, c, d] = len.to_be_bytes();
    [0, a, b, c, d]
}

/// `message` (an encoded request) as a gRPC message: its prefix, then it.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
fn grpc_message(message: &[u8]) -> bytes::Bytes {
    let mut framed = grpc_prefix(u32::try_from(message.len()).expect("a small message")).to_vec();
    framed.extend_from_slice(message);
    bytes::Bytes::from(framed)
}

/// The gRPC status and message `headers` (or trailers) carry, if they carry a status.
fn grpc_status(headers: &http::HeaderMap) -> Option<(String, String)> {
    let header = |h: &str| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    header("grpc-status").map(|s| (s, header("grpc-message").unwrap_or_default()))
}

/// An HTTP/2 connection to the coordinator on 127.0.0.1:`port` made with `tls` and `builder`.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
async fn h2_connection(
    port: u16,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    mut builder: h2::client::Builder,
) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("a TCP connection to the coordinator");
    let stream = tls_over(tcp, tls).await;
    // Never more streams at once than the server takes, even before its settings say so: a
    // loaded machine's late settings had the server refuse a stream over its limit (an HTTP/2
    // refusal, not the answer the test looks for).
    let (send, conn) = builder
        .initial_max_send_streams(toolsrv_tls::STREAMS_PER_CONNECTION as usize)
        .handshake(stream)
        .await
        .expect("HTTP/2");
    tokio::spawn(conn);
    send
}

/// `tcp` with TLS made with `tls`, to the coordinator's name in the test PKI.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
async fn tls_over(
    tcp: tokio::net::TcpStream,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let name =
        tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").expect("a server name");
    tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .expect("a TLS connection to the coordinator")
}

#[allow(clippy::expect_used)] // A test fixture: fails loudly.
fn grpc_request(port: u16, path: &str) -> http::Request<()> {
    http::Request::post(format!("https://localhost:{port}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a request")
}

/// What became of the requests [`open_unread_answers`] made.
pub struct Unread {
    /// Answered, and the answer waits to leave: its data is not read.
    pub waiting: usize,
    /// The gRPC status and message of each answer that ended: refused at once, or cut short.
    pub ended: Vec<(String, String)>,
    /// The connection and the answers waiting, kept while the caller looks.
    pub connection: h2::client::SendRequest<bytes::Bytes>,
    pub held: Vec<h2::RecvStream>,
}

impl std::fmt::Debug for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unread")
            .field("waiting", &self.waiting)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

/// Makes `n` gRPC requests to `path`, each with `message` (an encoded request), on one HTTP/2
/// connection to the coordinator on 127.0.0.1:`port` made with `tls`, whose streams give the
/// coordinator a window of `window` bytes and read nothing, as a peer that means to pin answers
/// in the coordinator's send buffers would (with a window of 1, the client's HTTP/2 library
/// ends the connection after some hundred one-byte DATA frames). Each answer is given
/// `answer_within` to start, then 3 s to end.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub async fn open_unread_answers(
    port: u16,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    path: &str,
    message: &[u8],
    n: usize,
    window: u32,
    answer_within: std::time::Duration,
) -> Unread {
    let mut builder = h2::client::Builder::new();
    builder.initial_window_size(window);
    let mut send = h2_connection(port, tls, builder).await;
    let framed = grpc_message(message);
    let mut answers = tokio::task::JoinSet::new();
    for _ in 0..n {
        send = send.ready().await.expect("room for a stream");
        let (response, mut body) = send
            .send_request(grpc_request(port, path), false)
            .expect("a stream");
        body.send_data(framed.clone(), true).expect("the request");
        answers.spawn(async move {
            let limit = std::time::Duration::from_secs(3);
            let response = match tokio::time::timeout(answer_within, response).await {
                Ok(Ok(response)) => response,
                Ok(Err(e)) => return Ok(("HTTP/2 error".to_string(), e.to_string())),
                Err(_) => return Ok(("no answer".to_string(), String::new())),
            };
            if let Some(refused) = grpc_status(response.headers()) {
                return Ok(refused);
            }
            let mut answer = response.into_body();
            // Unread data stands before the trailers: they come only if no data does.
            match tokio::time::timeout(limit, answer.trailers()).await {
                Err(_) => Err(answer),
                Ok(Ok(Some(trailers))) => {
                    Ok(grpc_status(&trailers).unwrap_or(("no status".to_string(), String::new())))
                }
                Ok(Ok(None)) => Ok(("no trailers".to_string(), String::new())),
                Ok(Err(e)) => Ok(("HTTP/2 error".to_string(), e.to_string())),
            }
        });
    }
    let mut unread = Unread {
        waiting: 0,
        ended: Vec::new(),
        connection: send,
        held: Vec::new(),
    };
    while let Some(answer) = answers.join_next().await {
        match answer.expect("an answer task") {
            Ok(ended) => unread.ended.push(ended),
            Err(held) => {
                unread.waiting += 1;
                unread.held.push(held);
            }
        }
    }
    unread
}

/// A peer that opens the largest windows HTTP/2 allows and then stops reading its socket,
/// leaving the coordinator's answers queued in its HTTP/2 send buffers ([`StalledPeer::connect`]).
pub struct StalledPeer {
    port: u16,
    send: h2::client::SendRequest<bytes::Bytes>,
    gate: std::sync::Arc<Gate>,
    answers: tokio::task::JoinSet<(String, String)>,
}

impl std::fmt::Debug for StalledPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StalledPeer")
            .field("port", &self.port)
            .field("answers", &self.answers.len())
            .finish_non_exhaustive()
    }
}

/// What became of the answers of a [`StalledPeer`] once it read again.
#[derive(Debug, Default)]
pub struct Outcomes {
    /// Read whole, with a gRPC status of 0.
    pub whole: usize,
    /// The gRPC status and message of each answer that ended otherwise.
    pub ended: Vec<(String, String)>,
}

/// Whether a [`Gated`] socket may be read, and who waits to read it.
#[derive(Default)]
struct Gate {
    closed: std::sync::atomic::AtomicBool,
    waiting: std::sync::Mutex<Option<std::task::Waker>>,
}

/// A socket whose reads wait while its [`Gate`] is closed; its writes go on.
struct Gated<S> {
    io: S,
    gate: std::sync::Arc<Gate>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Gated<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::sync::atomic::Ordering;
        if self.gate.closed.load(Ordering::SeqCst) {
            *self.gate.waiting.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            // Opened meanwhile: its waker may have been taken before this one was left.
            if self.gate.closed.load(Ordering::SeqCst) {
                return std::task::Poll::Pending;
            }
        }
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Gated<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The largest window HTTP/2 allows (RFC 9113 §6.9.1).
const MAX_WINDOW: u32 = (1 << 31) - 1;

impl StalledPeer {
    /// An HTTP/2 connection to the coordinator on 127.0.0.1:`port` made with `tls`, whose streams
    /// and connection give the coordinator the largest window, with a receive buffer of 64 KiB
    /// in its socket so that little of what the coordinator sends waits in the kernel. It reads
    /// until [`StalledPeer::stop_reading`].
    #[allow(clippy::expect_used)] // A test fixture: fails loudly.
    pub async fn connect(
        port: u16,
        tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    ) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket
            .set_recv_buffer_size(64 << 10)
            .expect("a socket's receive buffer");
        let tcp = socket
            .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
            .await
            .expect("a TCP connection to the coordinator");
        let stream = tls_over(tcp, tls).await;
        let gate = std::sync::Arc::new(Gate::default());
        let io = Gated {
            io: stream,
            gate: gate.clone(),
        };
        let (send, conn) = h2::client::Builder::new()
            .initial_max_send_streams(toolsrv_tls::STREAMS_PER_CONNECTION as usize)
            .initial_window_size(MAX_WINDOW)
            .initial_connection_window_size(MAX_WINDOW)
            .handshake(io)
            .await
            .expect("HTTP/2");
        tokio::spawn(conn);
        let send = send.ready().await.expect("the coordinator's settings");
        Self {
            port,
            send,
            gate,
            answers: tokio::task::JoinSet::new(),
        }
    }

    /// Reads nothing more from the socket until [`StalledPeer::read_again`].
    pub fn stop_reading(&self) {
        self.gate
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Reads the socket again.
    pub fn read_again(&self) {
        self.gate
            .closed
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let waiting = self
            .gate
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(waker) = waiting {
            waker.wake();
        }
    }

    /// Makes `n` gRPC requests to `path`, each with `message` (an encoded request); their
    /// answers are read whole when the socket is read ([`StalledPeer::outcomes`]).
    #[allow(clippy::expect_used)] // A test fixture: fails loudly.
    pub async fn request(&mut self, path: &str, message: &[u8], n: usize) {
        let framed = grpc_message(message);
        for _ in 0..n {
            self.send = self.send.clone().ready().await.expect("room for a stream");
            let (response, mut body) = self
                .send
                .send_request(grpc_request(self.port, path), false)
                .expect("a stream");
            body.send_data(framed.clone(), true).expect("the request");
            self.answers.spawn(read_whole(response));
        }
    }

    /// Cancels every request whose answer has not been read (HTTP/2 resets their streams).
    pub fn reset_all(&mut self) {
        // Dropped, the set aborts its tasks, which drop their streams.
        self.answers = tokio::task::JoinSet::new();
    }

    /// Waits up to `within` for the answers of the requests made, read whole or ended.
    pub async fn outcomes(&mut self, within: std::time::Duration) -> Outcomes {
        let mut outcomes = Outcomes::default();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.answers.join_next()).await {
                Ok(Some(Ok((status, _)))) if status == "0" => outcomes.whole += 1,
                Ok(Some(Ok(ended))) => outcomes.ended.push(ended),
                Ok(Some(Err(e))) => outcomes.ended.push(("task".to_string(), e.to_string())),
                Ok(None) => return outcomes,
                Err(_) => {
                    let left = self.answers.len();
                    outcomes
                        .ended
                        .extend((0..left).map(|_| ("no answer".to_string(), String::new())));
                    self.answers.abort_all();
                    return outcomes;
                }
            }
        }
    }
}

/// Reads an answer whole: its gRPC status and message.
async fn read_whole(response: h2::client::ResponseFuture) -> (String, String) {
    let failed = |e: h2::Error| ("HTTP/2 error".to_string(), e.to_string());
    let response = match response.await {
        Ok(response) => response,
        Err(e) => return failed(e),
    };
    if let Some(refused) = grpc_status(response.headers()) {
        return refused;
    }
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        match data {
            Ok(data) => {
                let _ = body.flow_control().release_capacity(data.len());
            }
            Err(e) => return failed(e),
        }
    }
    match body.trailers().await {
        Ok(Some(trailers)) => {
            grpc_status(&trailers).unwrap_or(("no status".to_string(), String::new()))
        }
        Ok(None) => ("no trailers".to_string(), String::new()),
        Err(e) => failed(e),
    }
}
