//! The audit log: one JSON line per call, written whatever its outcome and whatever happens to
//! the caller, before the caller sees the result.
//!
//! Architecture invariant: a call that reaches routing is audited exactly once. [`Pending`] is
//! created before the call is routed and writes its record when finished or, if the caller
//! vanishes first (its future is dropped), from `Drop`; requests refused before routing (bad
//! arguments, selector, quota) are written by [`Audit::refused`].
//!
//! A record that cannot be written (a full disk, a read-only or vanished file system) makes
//! [`Audit::writable`] refuse every new call, fan-out, join and join token until a record can
//! be written again:
//! the refusal's own record is the attempt, so the first one written after the cause is gone
//! lets the next call run. Calls already running finish; their records may be lost, and the
//! coordinator's log says so for each.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::json;
use toolsrv_proto::text::shell_words;
use toolsrv_proto::v1::{ApprovalRequest, CallResult, CallStatus};

use crate::approvals::Decision;
use crate::error::FileError;

use crate::fleet::now_ms;

/// Most bytes of a name (client, host, tool, fan-out) written to the log.
const MAX_NAME_FIELD: usize = 256;
/// Most bytes of a message written to the log.
const MAX_MESSAGE_FIELD: usize = 1024;

/// Where audit records go: a file (JSON lines), or the log under the `audit` target.
#[derive(Debug)]
pub struct Audit {
    file: Option<(PathBuf, Mutex<Sink>)>,
}

/// The audit file and whether its last write failed.
#[derive(Debug)]
struct Sink {
    out: Box<dyn WriteFile>,
    /// Why the last write failed; `None` while records are written.
    failing: Option<String>,
    /// A failed write left part of a record in the file: the next one starts on a new line.
    cut: bool,
}

/// What the audit sink writes to: the file, or a test's stand-in.
trait WriteFile: Write + Send + std::fmt::Debug {}
impl<T: Write + Send + std::fmt::Debug> WriteFile for T {}

impl Sink {
    fn new(out: Box<dyn WriteFile>) -> Self {
        Self {
            out,
            failing: None,
            cut: false,
        }
    }

    /// Writes `line` whole, or says how many of its bytes went out before the error.
    fn write_counted(&mut self, line: &[u8]) -> Result<(), (usize, std::io::Error)> {
        let mut done = 0;
        while done < line.len() {
            match self.out.write(&line[done..]) {
                Ok(0) => return Err((done, std::io::ErrorKind::WriteZero.into())),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err((done, e)),
            }
        }
        Ok(())
    }
}

/// What the audit log records of one call, besides its outcome.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    pub client: &'a str,
    pub host: &'a str,
    pub tool: &'a str,
    /// Hex SHA-256 of the arguments: enough to correlate without storing secrets.
    pub args_sha256: &'a str,
    /// The fan-out this call belongs to, if any.
    pub fanout: Option<&'a str>,
}

/// Opens the audit log for appending (made mode 0640 when missing). Refused when another user could
/// change or erase its records: the file is theirs, or every user may write it, or the name is
/// a symbolic link another user made (which could lead the records into any file the
/// coordinator may write), as in a directory every user may write (`/tmp`, an emptyDir).
fn open(path: &Path, action: &'static str) -> Result<std::fs::File, FileError> {
    let io = |source| FileError::Io {
        what: "audit log",
        action,
        path: path.to_path_buf(),
        source,
    };
    const WHY: &str = "could change or erase its records, so it is not written; if it is yours";
    if let Ok(link) = std::fs::symlink_metadata(path)
        && link.file_type().is_symlink()
    {
        FileError::unless_own("audit log", path, &link, WHY)?;
    }
    // A FIFO is refused: opening one with no reader waits for a reader for good (at start, or
    // on SIGHUP in a runtime thread, after which SIGTERM no longer ended the coordinator), and
    // with a reader every call would wait on it to read its record. Opened non-blocking, so
    // that the open itself never waits, then made blocking again.
    const NOT_A_FIFO: &str = "is a FIFO or a socket: records are written as calls finish, and \
                              would wait on whatever reads it; give a file (or leave \
                              --audit-log out to have records in the coordinator's log)";
    // A new log is readable by the coordinator's user and group (a log shipper's): who called
    // what, where, is no business of every user of the machine.
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .custom_flags(toolsrv_tls::files::OPEN_WITHOUT_WAITING)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) => FileError::invalid("audit log", path, NOT_A_FIFO.into()),
            _ => io(e),
        })?;
    let md = file.metadata().map_err(io)?;
    {
        use std::os::unix::fs::FileTypeExt;
        if md.file_type().is_fifo() || md.file_type().is_socket() {
            return Err(FileError::invalid("audit log", path, NOT_A_FIFO.into()));
        }
    }
    FileError::unless_own("audit log", path, &md, WHY)?;
    toolsrv_tls::files::blocking_again(&file).map_err(io)?;
    Ok(file)
}

/// At most `max` bytes of `s` (cut at a character boundary), with the full length noted when cut.
pub(crate) fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…[{} bytes]", &s[..end], s.len())
}

impl Audit {
    pub fn open(path: Option<&Path>) -> Result<Self, FileError> {
        let file = match path {
            None => None,
            Some(p) => Some((
                p.to_path_buf(),
                Mutex::new(Sink::new(Box::new(open(p, "open")?))),
            )),
        };
        Ok(Self { file })
    }

    /// Opens the log file again by its path (after logrotate moved it away); on failure the
    /// old file stays in use.
    pub fn reopen(&self) -> Result<(), FileError> {
        let Some((path, file)) = &self.file else {
            return Ok(());
        };
        let fresh = open(path, "reopen")?;
        let mut sink = file.lock().unwrap_or_else(|p| p.into_inner());
        sink.out = Box::new(fresh);
        // A new file holds no part of a record.
        sink.cut = false;
        Ok(())
    }

    /// Refuses a new call while the audit file cannot be written: no call runs without its
    /// record. The refusal's own record ([`Audit::refused`]) tries again.
    pub fn writable(&self) -> Result<(), String> {
        let Some((path, file)) = &self.file else {
            return Ok(());
        };
        match &file.lock().unwrap_or_else(|p| p.into_inner()).failing {
            None => Ok(()),
            Some(e) => Err(format!(
                "the coordinator cannot write its audit log {} ({e}), and starts no call, \
                 fan-out or join it cannot record: retry once an operator has made room for it",
                path.display()
            )),
        }
    }

    /// Whether the last write to the audit file failed.
    pub fn failing(&self) -> bool {
        self.file.as_ref().is_some_and(|(_, file)| {
            file.lock()
                .unwrap_or_else(|p| p.into_inner())
                .failing
                .is_some()
        })
    }

    /// Records a call's outcome (calls write theirs through [`Pending`]).
    #[cfg(test)]
    pub fn record(&self, r: &Record<'_>, result: &CallResult) {
        self.write(call_json(r, result));
    }

    /// Records a call this replica relayed to the replica `owner` that holds the host's link
    /// (`"event": "call"` with `"relayed_to"`; the owner writes its own record of the run).
    pub fn relayed(&self, r: &Record<'_>, owner: &str, result: &CallResult) {
        let mut record = call_json(r, result);
        record["relayed_to"] = json!(bounded(owner, MAX_NAME_FIELD));
        self.write(record);
    }

    /// Records a request refused before it was routed to any host. `target` is the host or
    /// selector asked for.
    pub fn refused(&self, client: &str, target: &str, tool: &str, why: &tonic::Status) {
        self.write(refusal_json(
            client,
            Some(target),
            Some(tool),
            why,
            why.message(),
        ));
    }

    /// Records an approval refused before it was given (`"event": "refusal"` with the request's
    /// `approval_id`): `decider` approved `request` while the audit log could not be written.
    /// The request keeps waiting; this record is the log's next try.
    pub fn approval_refused(&self, decider: &str, request: &ApprovalRequest, why: &tonic::Status) {
        let mut record = refusal_json(
            decider,
            Some(&request.host),
            Some(&request.tool),
            why,
            why.message(),
        );
        record["approval_id"] = json!(bounded(&request.id, MAX_NAME_FIELD));
        self.write(record);
    }

    /// Records the first request of a run that [`crate::streams`] refused, before any service
    /// saw it or before its answer was sent (a refusal with `rpc`, the method asked for):
    /// `peer` had too many requests open at once, or too many bytes of answers waiting to
    /// leave, and `until` says what happens to the next ones until the run ends.
    pub fn requests_refused(&self, peer: &str, rpc: &str, why: &tonic::Status, until: &str) {
        let message = format!("{}; {until}", why.message());
        let mut record = refusal_json(peer, None, None, why, &message);
        record["rpc"] = json!(bounded(rpc, MAX_NAME_FIELD));
        self.write(record);
    }

    /// Records a revocation RPC (`"event": "revocation"`): `action` is `revoke` or `unrevoke`,
    /// `by` the client that asked, `outcome` `done`, `unchanged` (revoked already) or `refused`
    /// (with the gRPC code and message).
    pub fn revocation(
        &self,
        action: &str,
        identity: &str,
        by: &str,
        reason: &str,
        outcome: Result<&str, &tonic::Status>,
    ) {
        let (outcome, code, message) = match outcome {
            Ok(outcome) => (outcome, None, String::new()),
            Err(status) => (
                "refused",
                Some(format!("{:?}", status.code())),
                bounded(status.message(), MAX_MESSAGE_FIELD),
            ),
        };
        self.write(json!({
            "ts_unix_ms": now_ms(),
            "event": "revocation",
            "action": action,
            "identity": bounded(identity, MAX_NAME_FIELD),
            "client": bounded(by, MAX_NAME_FIELD),
            "reason": bounded(reason, MAX_MESSAGE_FIELD),
            "outcome": outcome,
            "code": code,
            "message": message,
        }));
    }

    /// Records how an approval request ended: who asked, for what, who decided, how.
    pub fn approval(&self, request: &ApprovalRequest, decision: &Decision) {
        let (outcome, by, reason) = match decision {
            Decision::Approved { by, reason } => ("approved", Some(by.as_str()), reason.as_str()),
            Decision::Denied { by, reason } => ("denied", Some(by.as_str()), reason.as_str()),
            Decision::Expired => ("expired", None, ""),
            Decision::Withdrawn => ("withdrawn", None, ""),
        };
        let bypass = !request.bypass_argv.is_empty();
        self.write(json!({
            "ts_unix_ms": now_ms(),
            "event": if bypass { "bypass" } else { "approval" },
            // As a shell reads it back: the words' bounds stay visible.
            "bypass_argv": bypass.then(|| bounded(&shell_words(&request.bypass_argv), MAX_MESSAGE_FIELD)),
            "bypass_reason": bypass.then(|| bounded(&request.bypass_reason, MAX_MESSAGE_FIELD)),
            "id": request.id,
            "client": bounded(&request.caller, MAX_NAME_FIELD),
            "host": bounded(&request.host, MAX_NAME_FIELD),
            "tool": bounded(&request.tool, MAX_NAME_FIELD),
            // The host's own tool, which the catalog does not ship.
            "host_only": request.host_only.then_some(true),
            "args_sha256": request.args_sha256,
            "fanout": (!request.fanout.is_empty()).then_some(&request.fanout),
            "approvers": request.approvers,
            "decision": outcome,
            "decided_by": by.map(|b| bounded(b, MAX_NAME_FIELD)),
            "reason": bounded(reason, MAX_MESSAGE_FIELD),
            "policy": bounded(&request.reason, MAX_MESSAGE_FIELD),
        }));
    }

    /// Records an event of its own kind (enrollment's `join_token`, `join`, `renewal`; `policy`):
    /// `fields` are added to the record's time and event name, strings cut as in other records.
    pub fn event(&self, event: &str, fields: serde_json::Value) {
        let mut line = json!({"ts_unix_ms": now_ms(), "event": event});
        if let (Some(line), serde_json::Value::Object(fields)) = (line.as_object_mut(), fields) {
            for (k, v) in fields {
                let v = match v {
                    serde_json::Value::String(s) => {
                        serde_json::Value::String(bounded(&s, MAX_MESSAGE_FIELD))
                    }
                    other => other,
                };
                line.insert(k, v);
            }
        }
        self.write(line);
    }

    fn write(&self, line: serde_json::Value) {
        match &self.file {
            Some((path, file)) => {
                let mut sink = file.lock().unwrap_or_else(|p| p.into_inner());
                // After a record cut short, this one starts on a line of its own: readers lose
                // the broken line, never the next record.
                let record = line.to_string();
                let text = format!("{}{record}\n", if sink.cut { "\n" } else { "" });
                // One write per record under the lock, so that concurrent records never
                // interleave; a `File` has no user-space buffer, so the record is in the kernel
                // when this returns.
                match sink.write_counted(text.as_bytes()) {
                    Ok(()) => {
                        sink.cut = false;
                        if let Some(was) = sink.failing.take() {
                            tracing::warn!(path = %path.display(), was = %was, "the audit log is written again: calls are taken again");
                        }
                    }
                    Err((written, e)) => {
                        sink.cut |= written > 0;
                        if sink.failing.is_none() {
                            tracing::error!(error = %e, path = %path.display(), "cannot write the audit log: new calls, fan-outs, joins and join tokens are refused until a record can be written");
                        }
                        tracing::error!(error = %e, path = %path.display(), %record, "an audit record the audit log could not take, logged here instead");
                        sink.failing = Some(e.to_string());
                    }
                }
            }
            None => tracing::info!(target: "audit", "{line}"),
        }
    }
}

/// A call being audited: exactly one record, written by [`Pending::finish`] or, if the call's
/// future is dropped first (the caller vanished), as CANCELLED from `Drop`.
#[derive(Debug)]
pub struct Pending<'a> {
    audit: &'a Audit,
    record: Record<'a>,
    done: bool,
    /// When the call began here: a call whose caller vanished ran until then, as far as the
    /// coordinator knows.
    started: std::time::Instant,
    /// What the record says when the caller vanishes first ([`Pending::not_started`]).
    dropped: &'static str,
    /// The call's bypass requests refused past the limit without a record each.
    bypass_unrecorded: u64,
}

impl<'a> Pending<'a> {
    pub fn new(audit: &'a Audit, record: Record<'a>) -> Self {
        Self {
            audit,
            record,
            done: false,
            started: std::time::Instant::now(),
            dropped: "the caller went away before the call ended; the call was cancelled on the host",
            bypass_unrecorded: 0,
        }
    }

    /// Counts a bypass request of the call refused without a record of its own: the call's
    /// record says how many (`bypass_unrecorded`).
    pub fn bypass_unrecorded(&mut self) {
        self.bypass_unrecorded += 1;
    }

    fn write(&self, result: &CallResult) {
        let mut record = call_json(&self.record, result);
        if self.bypass_unrecorded > 0 {
            record["bypass_unrecorded"] = json!(self.bypass_unrecorded);
        }
        self.audit.write(record);
    }

    /// A host of a fan-out waiting for its turn: if the fan-out's caller vanishes first, the
    /// record says the call was never started. Once its turn comes, [`Pending::finish`] (the
    /// host is skipped) or [`Pending::hand_over`] (the call is run, and audited as any call).
    pub fn not_started(audit: &'a Audit, record: Record<'a>) -> Self {
        // Not `..Self::new(..)`: that temporary's own drop would write a record.
        let mut pending = Self::new(audit, record);
        pending.dropped = "not started: the caller went away before the fan-out reached this host";
        pending
    }

    /// Leaves the record to the call about to run, which writes its own.
    pub fn hand_over(mut self) {
        self.done = true;
    }

    /// Writes the record with the call's result. A result the host gave no duration (the call
    /// did not run, waited for an approval that was denied, or its host was lost mid-call) is
    /// recorded with how long the call was under way here.
    pub fn finish(mut self, result: &CallResult) {
        if result.duration_ms == 0 {
            let mut result = result.clone();
            result.duration_ms = self.elapsed_ms();
            self.write(&result);
        } else {
            self.write(result);
        }
        self.done = true;
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut result = CallResult::not_run(CallStatus::Cancelled, self.dropped);
            // It may well have run until then: the record says for how long it was under way.
            result.duration_ms = self.elapsed_ms();
            self.write(&result);
        }
    }
}

/// A refusal record (`"event": "refusal"`, status `REFUSED`): a request that reached no host.
fn refusal_json(
    client: &str,
    host: Option<&str>,
    tool: Option<&str>,
    why: &tonic::Status,
    message: &str,
) -> serde_json::Value {
    json!({
        "ts_unix_ms": now_ms(),
        "event": "refusal",
        "client": bounded(client, MAX_NAME_FIELD),
        "host": host.map(|h| bounded(h, MAX_NAME_FIELD)),
        "tool": tool.map(|t| bounded(t, MAX_NAME_FIELD)),
        "args_sha256": null,
        "fanout": null,
        "status": "REFUSED",
        "code": format!("{:?}", why.code()),
        "exit_code": null,
        "signal": null,
        "duration_ms": 0,
        "message": bounded(message, MAX_MESSAGE_FIELD),
    })
}

/// A call's audit record (`"event": "call"`).
fn call_json(r: &Record<'_>, result: &CallResult) -> serde_json::Value {
    let status = CallStatus::try_from(result.status).unwrap_or(CallStatus::Unspecified);
    json!({
        "ts_unix_ms": now_ms(),
        "event": "call",
        "client": bounded(r.client, MAX_NAME_FIELD),
        "host": bounded(r.host, MAX_NAME_FIELD),
        "tool": bounded(r.tool, MAX_NAME_FIELD),
        "args_sha256": bounded(r.args_sha256, MAX_NAME_FIELD),
        "fanout": r.fanout.map(|f| bounded(f, MAX_NAME_FIELD)),
        "status": status.as_str_name(),
        "exit_code": result.exit_code,
        "signal": result.signal,
        "duration_ms": result.duration_ms,
        "message": bounded(&result.message, MAX_MESSAGE_FIELD),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn lines(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn record<'a>(host: &'a str) -> Record<'a> {
        Record {
            client: "alice",
            host,
            tool: "t",
            args_sha256: "00",
            fanout: None,
        }
    }

    #[test]
    fn a_dropped_pending_call_is_recorded_once_as_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let audit = Audit::open(Some(&path)).unwrap();
        let dropped = Pending::new(&audit, record("a"));
        std::thread::sleep(std::time::Duration::from_millis(30));
        drop(dropped);
        Pending::new(&audit, record("b")).finish(&CallResult::not_run(CallStatus::Ok, ""));
        let got = lines(&path);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0]["host"], "a");
        assert_eq!(got[0]["status"], "CALL_STATUS_CANCELLED");
        // How long it was under way, not 0 as for a call that never ran.
        assert!(got[0]["duration_ms"].as_u64().unwrap() >= 30, "{}", got[0]);
        assert_eq!(got[1]["status"], "CALL_STATUS_OK");
    }

    #[test]
    fn a_fan_out_host_is_recorded_once_whether_reached_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let audit = Audit::open(Some(&path)).unwrap();
        drop(Pending::not_started(&audit, record("never")));
        Pending::not_started(&audit, record("skipped"))
            .finish(&CallResult::not_run(CallStatus::Skipped, "budget spent"));
        // Handed over to the call, which writes its own record: none from here.
        Pending::not_started(&audit, record("ran")).hand_over();
        let got = lines(&path);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0]["host"], "never");
        assert_eq!(got[0]["status"], "CALL_STATUS_CANCELLED");
        assert!(got[0]["message"].as_str().unwrap().contains("not started"));
        assert_eq!(got[1]["host"], "skipped");
        assert_eq!(got[1]["status"], "CALL_STATUS_SKIPPED");
    }

    #[test]
    fn fields_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let audit = Audit::open(Some(&path)).unwrap();
        let huge = "h".repeat(5 << 20);
        audit.record(
            &record(&huge),
            &CallResult::not_run(CallStatus::UnknownHost, huge.clone()),
        );
        audit.refused(
            &huge,
            &huge,
            &huge,
            &tonic::Status::invalid_argument(huge.clone()),
        );
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(
            size < 8 << 10,
            "two records of a 5 MB host take {size} bytes"
        );
        let got = lines(&path);
        assert!(
            got[0]["host"]
                .as_str()
                .unwrap()
                .ends_with("[5242880 bytes]")
        );
        assert_eq!(got[1]["status"], "REFUSED");
    }

    /// A file that takes `room` bytes more, then fails as a full disk does; what it took is
    /// shared with the test.
    #[derive(Debug, Clone)]
    struct Disk {
        taken: std::sync::Arc<Mutex<Vec<u8>>>,
        room: std::sync::Arc<Mutex<usize>>,
    }

    impl Write for Disk {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut room = self.room.lock().unwrap();
            if *room == 0 {
                // ENOSPC, as a full disk answers.
                return Err(std::io::Error::from_raw_os_error(28));
            }
            let n = buf.len().min(*room);
            *room -= n;
            self.taken.lock().unwrap().extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_log_that_cannot_be_written_refuses_calls_until_a_record_is_written_again() {
        let disk = Disk {
            taken: Default::default(),
            room: std::sync::Arc::new(Mutex::new(usize::MAX)),
        };
        let audit = Audit {
            file: Some((
                PathBuf::from("/var/log/toolsrv/audit.jsonl"),
                Mutex::new(Sink::new(Box::new(disk.clone()))),
            )),
        };
        let ok = || CallResult::not_run(CallStatus::Ok, "");
        audit.record(&record("one"), &ok());
        assert!(audit.writable().is_ok() && !audit.failing());

        // The disk fills in the middle of the next record.
        *disk.room.lock().unwrap() = 10;
        audit.record(&record("two"), &ok());
        assert!(audit.failing());
        let why = audit.writable().unwrap_err();
        assert!(
            why.contains("/var/log/toolsrv/audit.jsonl")
                && why.contains("No space left on device")
                && why.contains("starts no call, fan-out or join it cannot record"),
            "{why}"
        );
        // A refusal written to a full disk: still failing.
        let refusal = tonic::Status::unavailable(why);
        audit.refused("alice", "a", "t", &refusal);
        assert!(audit.writable().is_err());

        // Room again: the next refusal is written, and calls are taken again.
        *disk.room.lock().unwrap() = usize::MAX;
        audit.refused("alice", "a", "t", &refusal);
        assert!(audit.writable().is_ok() && !audit.failing());
        audit.record(&record("three"), &ok());

        // Every line but the one cut short is a whole record, in order.
        let taken = String::from_utf8(disk.taken.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = taken.lines().collect();
        assert_eq!(lines.len(), 4, "{taken}");
        let parsed: Vec<Option<serde_json::Value>> =
            lines.iter().map(|l| serde_json::from_str(l).ok()).collect();
        assert_eq!(parsed[0].as_ref().unwrap()["host"], "one");
        assert!(parsed[1].is_none(), "the cut record: {}", lines[1]);
        assert_eq!(lines[1].len(), 10);
        assert_eq!(parsed[2].as_ref().unwrap()["event"], "refusal");
        assert!(
            parsed[2].as_ref().unwrap()["message"]
                .as_str()
                .unwrap()
                .contains("cannot write its audit log")
        );
        assert_eq!(parsed[3].as_ref().unwrap()["host"], "three");
    }

    #[test]
    fn without_a_file_calls_are_always_taken() {
        let audit = Audit::open(None).unwrap();
        audit.record(&record("a"), &CallResult::not_run(CallStatus::Ok, ""));
        assert!(audit.writable().is_ok() && !audit.failing());
    }

    #[test]
    fn reopen_follows_a_rotated_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let audit = Audit::open(Some(&path)).unwrap();
        audit.record(&record("before"), &CallResult::not_run(CallStatus::Ok, ""));
        std::fs::rename(&path, dir.path().join("audit.jsonl.1")).unwrap();
        audit.reopen().unwrap();
        audit.record(&record("after"), &CallResult::not_run(CallStatus::Ok, ""));
        assert_eq!(lines(&path)[0]["host"], "after");
        assert_eq!(
            lines(&dir.path().join("audit.jsonl.1"))[0]["host"],
            "before"
        );
    }
}
