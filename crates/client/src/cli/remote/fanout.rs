//! `toolctl fanout`: run one tool on many hosts, output lines prefixed by host, then a summary.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use crate::{
    CallResult, ClientError, FanOutRequest, FanOutSummary, FanOutUpdate, OutputStream, is_ok,
    status_name,
};
use serde_json::{Value, json};

use super::{ConnArgs, exit, human_ms, interrupted, note_strings, prepare_run, write_table};

/// A line longer than this without a newline is cut and printed in pieces, so one tool that never
/// ends its line cannot make us hold its whole output.
const MAX_PARTIAL_LINE: usize = 64 << 10;

/// Options of `toolctl fanout`.
#[derive(Debug)]
pub struct FanOutOptions {
    pub cwd: Option<String>,
    pub timeout: Option<f64>,
    pub concurrency: u32,
    pub max_errors: u32,
    pub json: bool,
    /// How to answer approval requests this caller may decide.
    pub answer: super::Answer,
}

pub async fn fan_out(
    conn: &ConnArgs,
    selector: &str,
    tool: &str,
    args: &[String],
    opts: FanOutOptions,
) -> u8 {
    let (remote, prepared) = match prepare_run(conn, args, opts.timeout).await {
        Ok(prepared) => prepared,
        Err(code) => return code,
    };
    let super::Prepared {
        args_json,
        string_keys,
        timeout_ms,
    } = prepared;
    let request = FanOutRequest {
        selector: selector.to_string(),
        tool: tool.to_string(),
        args_json,
        cwd: opts.cwd.unwrap_or_default(),
        timeout_ms,
        concurrency: opts.concurrency,
        max_errors: opts.max_errors,
    };
    let what = || format!("cannot run `{tool}` on `{selector}`");
    let mut stream = match remote.client.fan_out(request).await {
        Ok(stream) => stream,
        Err(e) => return remote.fail(&what(), &e),
    };
    let mut printer = Printer::new(opts.json);
    let mut prompts = super::approve::Prompts::new(&remote, opts.answer);
    loop {
        let update = tokio::select! {
            update = stream.next() => update,
            () = prompts.answered() => continue,
            () = interrupted() => {
                drop(stream);
                printer.flush_all();
                eprintln!("toolctl: interrupted: cancelled `{tool}` on `{selector}`");
                return exit::CANCELLED;
            }
        };
        let event = match update {
            Some(Ok(event)) => event,
            Some(Err(e)) => {
                printer.flush_all();
                return remote.fail(&what(), &e);
            }
            None => {
                printer.flush_all();
                let e = ClientError::Protocol("the stream ended without a summary".into());
                return remote.fail(&what(), &e);
            }
        };
        if matches!(
            event.event,
            FanOutUpdate::Output(_) | FanOutUpdate::Result(_)
        ) {
            prompts.decided_on(&event.host);
        }
        match event.event {
            FanOutUpdate::Output(chunk) => printer.output(
                &event.host,
                chunk.stream == OutputStream::Stderr as i32,
                &chunk.data,
            ),
            FanOutUpdate::Result(result) => printer.result(&event.host, result),
            FanOutUpdate::Approval(request) => {
                printer.flush_all();
                prompts.request(request);
            }
            FanOutUpdate::Summary(summary) => {
                // Nothing matched: the one line below says it, not `0 hosts: 0 ok, 0 failed` too
                // (a JSON reader still gets its summary object).
                if summary.targeted > 0 || printer.json {
                    printer.summary(&summary);
                }
                if let Some(refused) = printer
                    .results
                    .values()
                    .find(|r| r.status == crate::CallStatus::InvalidArgs as i32)
                {
                    note_strings(&string_keys, refused);
                }
                if summary.targeted == 0 {
                    eprintln!("toolctl: selector `{selector}` matches no host");
                    return exit::FANOUT_FAILED;
                }
                let all_ok = summary.failed == 0 && summary.ok == summary.targeted;
                return if all_ok { 0 } else { exit::FANOUT_FAILED };
            }
        }
    }
}

/// Writes fan-out events as text or JSON lines. Write errors are ignored: a reader that went away
/// must not cancel the calls.
struct Printer {
    json: bool,
    lines: Prefixer,
    text: HashMap<(String, bool), Vec<u8>>,
    results: BTreeMap<String, CallResult>,
}

impl Printer {
    fn new(json: bool) -> Self {
        Self {
            json,
            lines: Prefixer::default(),
            text: HashMap::new(),
            results: BTreeMap::new(),
        }
    }

    fn output(&mut self, host: &str, stderr: bool, data: &[u8]) {
        if self.json {
            let carry = self.text.entry((host.to_string(), stderr)).or_default();
            let text = take_text(carry, data);
            if !text.is_empty() {
                json_line(&output_json(host, stderr, &text));
            }
        } else {
            let lines = self.lines.push(host, stderr, data);
            write_text(stderr, &lines);
        }
    }

    /// Prints what is left of `host`'s output, then (in JSON) its result.
    fn flush(&mut self, host: &str) {
        for stderr in [false, true] {
            if self.json {
                if let Some(carry) = self.text.remove(&(host.to_string(), stderr))
                    && !carry.is_empty()
                {
                    json_line(&output_json(host, stderr, &String::from_utf8_lossy(&carry)));
                }
            } else {
                write_text(stderr, &self.lines.flush(host, stderr));
            }
        }
    }

    fn flush_all(&mut self) {
        let mut hosts: Vec<String> = self
            .lines
            .hosts()
            .chain(self.text.keys().map(|(h, _)| h.clone()))
            .collect();
        hosts.sort();
        hosts.dedup();
        for host in hosts {
            self.flush(&host);
        }
    }

    fn result(&mut self, host: &str, result: CallResult) {
        self.flush(host);
        if self.json {
            json_line(&result_json(host, &result));
        }
        self.results.insert(host.to_string(), result);
    }

    fn summary(&mut self, summary: &FanOutSummary) {
        self.flush_all();
        let mut out = std::io::stdout().lock();
        let _ = if self.json {
            writeln!(out, "{}", summary_json(summary, &self.results))
        } else {
            write_summary(&mut out, summary, &self.results)
        };
        let _ = out.flush();
    }
}

fn write_text(stderr: bool, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let _ = if stderr {
        std::io::stderr().lock().write_all(bytes)
    } else {
        let mut out = std::io::stdout().lock();
        out.write_all(bytes).and_then(|()| out.flush())
    };
}

fn json_line(value: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}").and_then(|()| out.flush());
}

/// Turns output chunks into whole lines prefixed with `host | `, keeping each host's and stream's
/// partial last line until its end arrives, so prefixes never split a line.
#[derive(Debug, Default)]
pub struct Prefixer {
    partial: HashMap<(String, bool), Vec<u8>>,
}

impl Prefixer {
    /// The complete lines of `data` (with any partial line held from before), each prefixed.
    pub fn push(&mut self, host: &str, stderr: bool, data: &[u8]) -> Vec<u8> {
        let buffer = self.partial.entry((host.to_string(), stderr)).or_default();
        buffer.extend_from_slice(data);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(end) = buffer[start..].iter().position(|&b| b == b'\n') {
            prefixed(&mut out, host, &buffer[start..start + end]);
            start += end + 1;
        }
        while buffer.len() - start > MAX_PARTIAL_LINE {
            prefixed(&mut out, host, &buffer[start..start + MAX_PARTIAL_LINE]);
            start += MAX_PARTIAL_LINE;
        }
        buffer.drain(..start);
        out
    }

    /// The held partial line of one host's stream, prefixed and ended with a newline; empty if none.
    pub fn flush(&mut self, host: &str, stderr: bool) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(rest) = self.partial.remove(&(host.to_string(), stderr))
            && !rest.is_empty()
        {
            prefixed(&mut out, host, &rest);
        }
        out
    }

    /// Hosts with a held partial line.
    pub fn hosts(&self) -> impl Iterator<Item = String> + '_ {
        self.partial.keys().map(|(host, _)| host.clone())
    }
}

fn prefixed(out: &mut Vec<u8>, host: &str, line: &[u8]) {
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b" | ");
    out.extend_from_slice(line);
    out.push(b'\n');
}

/// Appends `data` to `carry` and takes out the text up to any incomplete UTF-8 sequence at the end,
/// so a character split across chunks is not turned into replacement characters.
fn take_text(carry: &mut Vec<u8>, data: &[u8]) -> String {
    carry.extend_from_slice(data);
    let cut = carry.len() - incomplete_tail(carry);
    let text = String::from_utf8_lossy(&carry[..cut]).into_owned();
    carry.drain(..cut);
    text
}

/// Length of an unfinished UTF-8 sequence at the end of `bytes` (0 to 3).
fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=bytes.len().min(3) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue;
        }
        let needed = match b {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        return if needed > back { back } else { 0 };
    }
    0
}

fn output_json(host: &str, stderr: bool, text: &str) -> Value {
    json!({"host": host, "type": if stderr { "stderr" } else { "stdout" }, "data": text})
}

fn result_json(host: &str, r: &CallResult) -> Value {
    let result = match r.result_json.trim() {
        "" => Value::Null,
        text => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string())),
    };
    json!({
        "host": host,
        "type": "result",
        "status": status_name(r.status),
        "exit_code": r.exit_code,
        "signal": r.signal,
        "duration_ms": r.duration_ms,
        "truncated": r.truncated,
        "message": r.message,
        "result": result,
    })
}

fn summary_json(s: &FanOutSummary, results: &BTreeMap<String, CallResult>) -> Value {
    let hosts: serde_json::Map<String, Value> = results
        .iter()
        .map(|(host, r)| {
            let entry = json!({"status": status_name(r.status), "exit_code": r.exit_code});
            (host.clone(), entry)
        })
        .collect();
    json!({
        "type": "summary",
        "targeted": s.targeted,
        "ok": s.ok,
        "failed": s.failed,
        "duration_ms": s.duration_ms,
        "hosts": hosts,
    })
}

/// The per-host table and the totals line.
fn write_summary(
    out: &mut impl Write,
    s: &FanOutSummary,
    results: &BTreeMap<String, CallResult>,
) -> std::io::Result<()> {
    if !results.is_empty() {
        let rows: Vec<Vec<String>> = results
            .iter()
            .map(|(host, r)| {
                let exit = match (r.exit_code, r.signal) {
                    (_, Some(signal)) => format!("signal {signal}"),
                    (Some(code), None) => code.to_string(),
                    (None, None) => "-".to_string(),
                };
                // One row per host: a multi-line message would break the table.
                let message = r.message.split_whitespace().collect::<Vec<_>>().join(" ");
                let duration = if is_ok(r.status) || r.duration_ms > 0 {
                    human_ms(r.duration_ms)
                } else {
                    "-".to_string()
                };
                vec![
                    host.clone(),
                    status_name(r.status).to_string(),
                    exit,
                    duration,
                    message,
                ]
            })
            .collect();
        write_table(
            out,
            &["HOST", "STATUS", "EXIT", "DURATION", "MESSAGE"],
            &rows,
        )?;
    }
    let hosts = if s.targeted == 1 { "host" } else { "hosts" };
    writeln!(
        out,
        "{} {hosts}: {} ok, {} failed in {}",
        s.targeted,
        s.ok,
        s.failed,
        human_ms(s.duration_ms)
    )
}

#[cfg(test)]
mod tests {
    use crate::CallStatus;

    use super::*;

    fn text(bytes: Vec<u8>) -> String {
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn lines_are_prefixed_whole() {
        let mut p = Prefixer::default();
        assert_eq!(text(p.push("web-1", false, b"one\ntw")), "web-1 | one\n");
        // Another host's output in between does not join web-1's partial line.
        assert_eq!(text(p.push("web-2", false, b"al")), "");
        assert_eq!(
            text(p.push("web-1", false, b"o\nthree\nfo")),
            "web-1 | two\nweb-1 | three\n"
        );
        assert_eq!(text(p.push("web-2", false, b"pha\n")), "web-2 | alpha\n");
        // Streams are kept apart too.
        assert_eq!(text(p.push("web-1", true, b"err")), "");
        assert_eq!(text(p.push("web-1", false, b"ur\n")), "web-1 | four\n");
        assert_eq!(text(p.flush("web-1", true)), "web-1 | err\n");
        assert_eq!(text(p.flush("web-1", false)), "");
        assert_eq!(
            text(p.push("web-1", false, b"\n\nlast")),
            "web-1 | \nweb-1 | \n"
        );
        assert_eq!(text(p.flush("web-1", false)), "web-1 | last\n");
        assert_eq!(
            p.hosts().count(),
            1,
            "web-2's emptied buffer is still tracked"
        );
        assert_eq!(text(p.flush("web-2", false)), "");
    }

    #[test]
    fn endless_lines_are_cut() {
        let mut p = Prefixer::default();
        let long = vec![b'x'; MAX_PARTIAL_LINE + 10];
        let out = p.push("h", false, &long);
        assert_eq!(out.len(), "h | ".len() + MAX_PARTIAL_LINE + 1);
        assert_eq!(
            text(p.flush("h", false)),
            format!("h | {}\n", "x".repeat(10))
        );
    }

    #[test]
    fn split_characters_are_kept_whole() {
        let bytes = "héllo €".as_bytes();
        let mut carry = Vec::new();
        let mut all = String::new();
        for chunk in bytes.chunks(1) {
            all.push_str(&take_text(&mut carry, chunk));
        }
        assert_eq!(all, "héllo €");
        assert!(carry.is_empty());
        // Invalid bytes still come out, as replacement characters.
        assert_eq!(take_text(&mut carry, b"a\xffb"), "a\u{fffd}b");
        assert_eq!(take_text(&mut carry, b"\xe2\x82"), "");
        assert_eq!(carry.len(), 2);
    }

    fn result(status: CallStatus, exit_code: Option<i32>, ms: u64, message: &str) -> CallResult {
        CallResult {
            status: status as i32,
            exit_code,
            duration_ms: ms,
            message: message.into(),
            result_json: r#"{"content":[]}"#.into(),
            ..Default::default()
        }
    }

    fn fixture() -> (FanOutSummary, BTreeMap<String, CallResult>) {
        let summary = FanOutSummary {
            targeted: 3,
            ok: 1,
            failed: 2,
            duration_ms: 1500,
        };
        let results = BTreeMap::from([
            (
                "web-1".to_string(),
                result(CallStatus::Ok, Some(0), 120, ""),
            ),
            (
                "web-2".to_string(),
                result(CallStatus::ToolError, Some(2), 1400, "exited with 2\n"),
            ),
            (
                "db-1".to_string(),
                result(CallStatus::Offline, None, 0, "host `db-1` is offline"),
            ),
        ]);
        (summary, results)
    }

    #[test]
    fn summary_table_has_a_row_per_host() {
        let (summary, results) = fixture();
        let mut out = Vec::new();
        write_summary(&mut out, &summary, &results).unwrap();
        assert_eq!(
            text(out),
            "HOST   STATUS      EXIT  DURATION  MESSAGE\n\
             db-1   offline     -     -         host `db-1` is offline\n\
             web-1  ok          0     120ms\n\
             web-2  tool_error  2     1.40s     exited with 2\n\
             3 hosts: 1 ok, 2 failed in 1.50s\n"
        );
    }

    #[test]
    fn json_events_have_the_documented_shape() {
        let (summary, results) = fixture();
        assert_eq!(
            summary_json(&summary, &results),
            json!({
                "type": "summary", "targeted": 3, "ok": 1, "failed": 2, "duration_ms": 1500,
                "hosts": {
                    "db-1": {"status": "offline", "exit_code": null},
                    "web-1": {"status": "ok", "exit_code": 0},
                    "web-2": {"status": "tool_error", "exit_code": 2},
                },
            })
        );
        assert_eq!(
            result_json("web-1", &results["web-1"]),
            json!({
                "host": "web-1", "type": "result", "status": "ok", "exit_code": 0, "signal": null,
                "duration_ms": 120, "truncated": false, "message": "", "result": {"content": []},
            })
        );
        assert_eq!(
            output_json("web-1", true, "oops\n"),
            json!({"host": "web-1", "type": "stderr", "data": "oops\n"})
        );
    }
}
