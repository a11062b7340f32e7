//! The audit log: one JSON line per call, written whatever its outcome.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use serde_json::json;
use toolsrv_proto::v1::{CallResult, CallStatus};

use crate::fleet::now_ms;

/// Where audit records go: a file (JSON lines), or the log under the `audit` target.
#[derive(Debug)]
pub struct Audit {
    file: Option<Mutex<std::fs::File>>,
}

/// What the audit log records of one call.
#[derive(Debug)]
pub struct Record<'a> {
    pub client: &'a str,
    pub host: &'a str,
    pub tool: &'a str,
    /// Hex SHA-256 of the arguments: enough to correlate without storing secrets.
    pub args_sha256: &'a str,
    /// The fan-out this call belongs to, if any.
    pub fanout: Option<&'a str>,
    pub result: &'a CallResult,
}

impl Audit {
    pub fn open(path: Option<&Path>) -> Result<Self, String> {
        let file = match path {
            None => None,
            Some(p) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| format!("cannot open audit log {}: {e}", p.display()))?,
            )),
        };
        Ok(Self { file })
    }

    pub fn record(&self, r: &Record<'_>) {
        let status = CallStatus::try_from(r.result.status).unwrap_or(CallStatus::Unspecified);
        let line = json!({
            "ts_unix_ms": now_ms(),
            "client": r.client,
            "host": r.host,
            "tool": r.tool,
            "args_sha256": r.args_sha256,
            "fanout": r.fanout,
            "status": status.as_str_name(),
            "exit_code": r.result.exit_code,
            "signal": r.result.signal,
            "duration_ms": r.result.duration_ms,
            "message": r.result.message,
        });
        match &self.file {
            Some(file) => {
                let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = writeln!(f, "{line}") {
                    tracing::error!(error = %e, "cannot write the audit log");
                }
            }
            None => tracing::info!(target: "audit", "{line}"),
        }
    }
}
