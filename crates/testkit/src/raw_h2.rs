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
    let name =
        tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").expect("a server name");
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .expect("a TLS connection to the coordinator");
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
    let mut framed = grpc_prefix(u32::try_from(message.len()).expect("a small message")).to_vec();
    framed.extend_from_slice(message);
    let framed = bytes::Bytes::from(framed);
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
