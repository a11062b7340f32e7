//! A long-running command whose stdout is JSON lines (`toolctl watch --json`, `toolctl session
//! watch --json`), its values arriving on a channel; killed with its group when dropped.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::{TestkitError, must};

/// How long [`LineWatch::until`] and [`LineWatch::end`] wait.
const LIMIT: Duration = Duration::from_secs(30);

/// A running command and the JSON values it printed, one per line.
#[derive(Debug)]
pub struct LineWatch {
    child: Child,
    values: mpsc::Receiver<Value>,
}

impl LineWatch {
    /// Starts `cmd` (stdin and stderr closed, in a process group of its own).
    #[track_caller]
    pub fn start(mut cmd: Command) -> Self {
        let spawned = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| TestkitError::io(format!("cannot start {cmd:?}"), e));
        let mut child = must(spawned);
        let (tx, values) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let Ok(value) = serde_json::from_str::<Value>(&line) else {
                        break;
                    };
                    if tx.send(value).is_err() {
                        break;
                    }
                }
            });
        }
        Self { child, values }
    }

    /// The first value (within 30 s) that `pred` accepts; those before it are skipped.
    #[track_caller]
    pub fn until(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.values.recv_timeout(left) {
                Ok(value) if pred(&value) => return value,
                Ok(_) => {}
                Err(_) => panic!("no {what} within {LIMIT:?}"),
            }
        }
    }

    /// The values printed so far and not yet taken, without waiting.
    pub fn seen(&self) -> Vec<Value> {
        self.values.try_iter().collect()
    }

    /// Waits (30 s at most) for the command to end by itself; its exit code.
    #[track_caller]
    pub fn end(mut self) -> Option<i32> {
        let deadline = Instant::now() + LIMIT;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.code(),
                Ok(None) => {}
                Err(e) => panic!("cannot wait for the watched command: {e}"),
            }
            assert!(Instant::now() < deadline, "the watched command did not end");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for LineWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
