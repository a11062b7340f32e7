//! Test harness of the workspace tests: a development PKI, and coordinator and agent processes
//! on loopback ports, from `toolsrv-testkit` (where they are shared with the per-crate tests
//! and the benches).
//!
//! Every process runs in its own process group and is killed when its handle drops; every wait
//! is bounded.

pub use toolsrv_testkit::{
    AgentSpec, LineWatch, Pki, Proc, Prometheus, TcpLink, TestFleet, TestkitError, Venv,
    assert_exit, bin, ca_pin_in, decisions, ensure_program, fake_version_manager, find_model_dir,
    finish_child, free_port, http_get, json_lines, line_starting, mpnet_model_dir, must,
    run_bounded, text, try_bin, try_run_bounded, try_wait_for, wait_for, wait_until, write,
    write_executable, write_file,
};

/// A fleet under test: one PKI, one coordinator, any number of agents (the name these tests
/// use for [`TestFleet`]).
pub use toolsrv_testkit::TestFleet as Fleet;

/// A runtime for a test that speaks gRPC itself, with the TLS provider installed.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub fn runtime() -> tokio::runtime::Runtime {
    toolsrv_tls::install_crypto_provider();
    tokio::runtime::Runtime::new().expect("a tokio runtime")
}

/// The client library connected to the fleet's coordinator with certificate `stem`
/// (`client-alice`), for a test that calls the API as a program would.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub async fn api_client(fleet: &Fleet, stem: &str) -> toolsrv_client::Client {
    toolsrv_tls::install_crypto_provider();
    toolsrv_client::Client::connect(&toolsrv_client::ConnectOptions {
        addr: fleet.url(),
        tls: toolsrv_testkit::stem_files(fleet.pki.root(), stem),
    })
    .await
    .expect("the client library connected to the fleet")
}

/// A connection to the fleet's coordinator from a peer without a certificate, as a host that
/// comes to join has.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub async fn anonymous_channel(fleet: &Fleet) -> tonic::transport::Channel {
    let tls = toolsrv_tls::anonymous_client_config(
        &fleet.pki.path("ca.pem"),
        toolsrv_tls::Role::Coordinator,
    )
    .expect("a client configuration without a certificate");
    toolsrv_tls::connect(&fleet.url(), tls)
        .await
        .expect("a connection to the coordinator")
}

/// Asserts that two `--json` answers of `find` rank the same tools in the same order with the
/// same scores, to 1e-6: two processes that rank alike may still differ in the last bits of a
/// score (the coordinator sums a catalog's vectors in its hash map's order, which differs from
/// one process to the next).
pub fn assert_same_ranking(a: &serde_json::Value, b: &serde_json::Value) {
    let hits = |found: &serde_json::Value| -> Vec<(String, f64)> {
        found
            .as_array()
            .into_iter()
            .flatten()
            .map(|hit| {
                let name = hit["name"].as_str().unwrap_or_default().to_string();
                (name, hit["score"].as_f64().unwrap_or(f64::NAN))
            })
            .collect()
    };
    let (a_hits, b_hits) = (hits(a), hits(b));
    let names = |h: &[(String, f64)]| h.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a_hits), names(&b_hits), "{a}\n{b}");
    for ((name, x), (_, y)) in a_hits.iter().zip(&b_hits) {
        assert!((x - y).abs() < 1e-6, "{name}: {x} and {y}\n{a}\n{b}");
    }
}

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

/// Opens `n` gRPC requests to `path` on one HTTP/2 connection to the fleet's coordinator made
/// with `tls`: headers only, never a body, as a peer that means to hold streams would. Each is
/// given 3 s to be answered.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub async fn open_bodiless_streams(
    fleet: &Fleet,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    path: &str,
    n: usize,
) -> Streams {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", fleet.port))
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
    let (mut send, conn) = h2::client::Builder::new()
        .initial_max_send_streams(toolsrv_tls::STREAMS_PER_CONNECTION as usize)
        .handshake(stream)
        .await
        .expect("HTTP/2");
    tokio::spawn(conn);
    let mut answers = tokio::task::JoinSet::new();
    for _ in 0..n {
        send = send.ready().await.expect("room for a stream");
        let request = http::Request::post(format!("https://localhost:{}{path}", fleet.port))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("a request");
        let (mut response, body) = send.send_request(request, false).expect("a stream");
        answers.spawn(async move {
            // Unanswered, the stream is handed back whole: dropping it would cancel it.
            let answered =
                tokio::time::timeout(std::time::Duration::from_secs(3), &mut response).await;
            let Ok(answered) = answered else {
                return Err((body, response));
            };
            let header = |h: &str| {
                answered
                    .as_ref()
                    .ok()
                    .and_then(|r| r.headers().get(h))
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string()
            };
            match &answered {
                // Named, so that a test that did not expect one says what it was.
                Err(e) => Ok(("HTTP/2 error".to_string(), e.to_string())),
                Ok(_) => Ok((header("grpc-status"), header("grpc-message"))),
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

/// `toolctl mcp` over stdio with its stderr in a file: requests written, answers read by id.
#[derive(Debug)]
pub struct McpStdio {
    child: std::process::Child,
    answers: std::sync::mpsc::Receiver<serde_json::Value>,
    stderr: std::path::PathBuf,
    next_id: u64,
}

impl McpStdio {
    /// Starts `cmd` (`toolctl mcp ...`) with its stderr in the file `stderr`, and initializes a
    /// 2025-11-25 session.
    #[allow(clippy::unwrap_used)] // A test fixture: fails loudly.
    pub fn start(mut cmd: std::process::Command, stderr: std::path::PathBuf) -> Self {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        let mut child = cmd
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(Ok(value)) = line.map(|l| serde_json::from_str::<serde_json::Value>(&l))
                else {
                    break;
                };
                if tx.send(value).is_err() {
                    break;
                }
            }
        });
        let mut this = Self {
            child,
            answers,
            stderr,
            next_id: 0,
        };
        this.request(
            "initialize",
            serde_json::json!({"protocolVersion": "2025-11-25", "capabilities": {},
                               "clientInfo": {"name": "test", "version": "1"}}),
        );
        this.send(&serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        this
    }

    /// Writes one JSON-RPC message.
    #[allow(clippy::unwrap_used)] // A test fixture: fails loudly.
    pub fn send(&mut self, message: &serde_json::Value) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{message}").unwrap();
        stdin.flush().unwrap();
    }

    /// The answer to one request, within 30 s.
    pub fn request(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        let id = self.send_request(method, params);
        self.answer(id)
    }

    /// Sends a request; its id, for [`McpStdio::answer`].
    pub fn send_request(&mut self, method: &str, params: serde_json::Value) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.send(
            &serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
        );
        id
    }

    /// The answer to request `id`, within 30 s; what comes before it is skipped.
    #[allow(clippy::panic)] // A test fixture: fails loudly.
    pub fn answer(&mut self, id: u64) -> serde_json::Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.answers.recv_timeout(left) {
                Ok(answer) if answer["id"] == id => return answer,
                Ok(_) => {}
                Err(e) => panic!(
                    "no answer to request {id} within 30 s ({e}): {}",
                    self.stderr()
                ),
            }
        }
    }

    /// What it wrote on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Its process id.
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(i32::MAX)
    }

    /// How it exited, if it does within `limit` (its stdin still open).
    pub fn exited_within(
        &mut self,
        limit: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }
}

impl Drop for McpStdio {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
