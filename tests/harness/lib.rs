//! Test harness of the workspace tests: a development PKI, and coordinator and agent processes
//! on loopback ports, from `toolsrv-testkit` (where they are shared with the per-crate tests
//! and the benches).
//!
//! Every process runs in its own process group and is killed when its handle drops; every wait
//! is bounded.

pub use toolsrv_testkit::{
    AgentSpec, LineWatch, Outcomes, Pki, Proc, Prometheus, StalledPeer, Streams, TcpLink,
    TestFleet, TestkitError, Unread, Venv, assert_exit, bin, ca_pin_in, decisions, ensure_program,
    fake_version_manager, find_model_dir, finish_child, free_port, grpc_prefix, http_get,
    json_lines, line_starting, mpnet_model_dir, must, open_bodiless_streams,
    open_unfinished_streams, open_unread_answers, run_bounded, text, try_bin, try_run_bounded,
    try_wait_for, wait_for, wait_until, write, write_executable, write_file,
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
