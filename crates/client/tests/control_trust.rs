//! A control socket of another user, or served by a process of another user, is refused before a
//! single byte of a request reaches it. The foreign master is this test binary run as `nobody`
//! (uid 65534) through `setpriv`, so these tests need root; elsewhere they fail saying so.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toolsrv_client::{Client, ClientError};

/// Where the foreign master listens (set for the helper only).
const SOCKET_ENV: &str = "TOOLSRV_TEST_FOREIGN_SOCKET";
/// Where it appends one line per connection: the number of bytes it received.
const LOG_ENV: &str = "TOOLSRV_TEST_FOREIGN_LOG";
const NOBODY: u32 = 65534;
/// Every wait here is bounded by this.
const WAIT: Duration = Duration::from_secs(20);

/// Not a test: the foreign master that the tests below run as another user.
#[test]
#[ignore = "a helper, started as another user by the tests of this file"]
fn foreign_master() {
    let (Ok(path), Ok(log)) = (std::env::var(SOCKET_ENV), std::env::var(LOG_ENV)) else {
        return;
    };
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    for stream in listener.incoming() {
        let mut stream = stream.unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let mut got = Vec::new();
        let _ = stream.read_to_end(&mut got);
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        writeln!(log, "{}", got.len()).unwrap();
    }
}

/// The foreign master, killed on drop.
struct Foreign {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Foreign {
    /// Starts the helper as uid 65534 serving `dir/ctl.sock`. Needs root: a skipped attack
    /// would be a check that passes without checking, so without root the test fails.
    fn start(dir: &Path) -> Self {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test serves a master as another user (setpriv to uid {NOBODY}): run it as root"
        );
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let socket = dir.join("ctl.sock");
        let log = dir.join("received.log");
        let child = Command::new("setpriv")
            .args([
                format!("--reuid={NOBODY}"),
                format!("--regid={NOBODY}"),
                "--clear-groups".into(),
            ])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "foreign_master", "--ignored", "--nocapture"])
            .env(SOCKET_ENV, &socket)
            .env(LOG_ENV, &log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("setpriv runs");
        let foreign = Self { child, socket, log };
        let deadline = Instant::now() + WAIT;
        while !foreign.socket.exists() {
            assert!(
                Instant::now() < deadline,
                "the foreign master never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        foreign
    }

    /// One entry per connection it saw end: the bytes it received.
    fn received(&self) -> Vec<usize> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect()
    }

    /// Waits until it has seen `n` connections end.
    fn wait_received(&self, n: usize) -> Vec<usize> {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.received();
            if got.len() >= n {
                return got;
            }
            assert!(Instant::now() < deadline, "saw {got:?}, expected {n}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

async fn connect(path: &Path) -> Result<Client, ClientError> {
    tokio::time::timeout(WAIT, Client::connect_control(path))
        .await
        .expect("connecting to the control socket ends")
}

#[tokio::test]
async fn a_socket_file_of_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let foreign = Foreign::start(dir.path());
    let err = connect(&foreign.socket).await.map(|_| ()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ClientError::UntrustedControl(_)), "{err:?}");
    assert!(
        msg.contains(&foreign.socket.display().to_string()) && msg.contains("belongs to uid 65534"),
        "{msg}"
    );
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    // It was not even connected to.
    std::thread::sleep(Duration::from_millis(200));
    assert!(foreign.received().is_empty(), "{:?}", foreign.received());
}

#[tokio::test]
async fn a_master_run_by_another_user_receives_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let foreign = Foreign::start(dir.path());
    // The file looks like ours: only the peer's credentials tell who serves it.
    std::os::unix::fs::chown(&foreign.socket, Some(0), Some(0)).unwrap();

    let err = connect(&foreign.socket).await.map(|_| ()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ClientError::UntrustedControl(_)), "{err:?}");
    assert!(
        msg.contains(&foreign.socket.display().to_string())
            && msg.contains("served by a process of uid 65534"),
        "{msg}"
    );
    assert_eq!(
        foreign.wait_received(1),
        [0],
        "bytes reached the foreign master"
    );

    // toolctl refuses it too, even with what it needs to connect directly: someone else's master
    // on our path is not "no master".
    let out = Command::new(env!("CARGO_BIN_EXE_toolctl"))
        .args(["hosts"])
        .env("TOOLSRV_CONTROL", &foreign.socket)
        .env("TOOLSRV_ADDR", "https://127.0.0.1:1")
        .env("TOOLSRV_CA", "/nonexistent/ca.pem")
        .env("TOOLSRV_CERT", "/nonexistent/cert.pem")
        .env("TOOLSRV_KEY", "/nonexistent/key.pem")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "{stderr}");
    assert!(
        stderr.contains("uid 65534") && stderr.contains(&foreign.socket.display().to_string()),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert_eq!(foreign.wait_received(2), [0, 0]);
}
