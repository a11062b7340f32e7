//! `toolctl mcp`'s stdio, between the client and the SDK. The SDK's stdio transport drops a line
//! it cannot parse without a word, and its client waits for an answer for good; here each line
//! is read first, a JSON-RPC message goes on to the SDK through a pipe, and a line that is none
//! is answered with the error [`malformed`] names. The SDK's lines and those answers reach
//! stdout through one writer, a whole line at a time: the SDK may write one message in several
//! writes, and no answer may land inside it.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::malformed::{self, Check, Refusal};

/// Longest line read, its line break included: the SDK's own cap, so that what it would have
/// read it still reads. A longer line is dropped without being held, as the SDK drops it.
pub const MAX_LINE: usize = rmcp::transport::async_rw::DEFAULT_MAX_LINE_LENGTH;

/// Bytes each pipe to and from the SDK holds: a longer line waits for the SDK to read on.
const PIPE_BYTES: usize = 64 * 1024;
/// Lines waiting for stdout.
const QUEUED_LINES: usize = 16;

/// The tasks between stdio and the SDK.
#[derive(Debug)]
pub struct Filter {
    input: JoinHandle<()>,
    from_sdk: JoinHandle<()>,
    output: JoinHandle<()>,
}

/// Starts reading `input` and writing `output` (stdin and stdout) for the SDK: the pipe ends it
/// is to read and write.
pub fn start<R, W>(input: R, output: W) -> (Filter, (DuplexStream, DuplexStream))
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    start_with(input, output, MAX_LINE)
}

fn start_with<R, W>(input: R, output: W, max_line: usize) -> (Filter, (DuplexStream, DuplexStream))
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (sdk_reads, to_sdk) = tokio::io::duplex(PIPE_BYTES);
    let (sdk_writes, from_sdk) = tokio::io::duplex(PIPE_BYTES);
    let (lines, queued) = mpsc::channel(QUEUED_LINES);
    let filter = Filter {
        input: tokio::spawn(read_input(input, max_line, to_sdk, lines.clone())),
        from_sdk: tokio::spawn(read_sdk(from_sdk, lines)),
        output: tokio::spawn(write_output(output, queued)),
    };
    (filter, (sdk_reads, sdk_writes))
}

impl Filter {
    /// Once the SDK is done: stops reading input (a client may keep stdin open), and gives what
    /// the SDK wrote `grace` to reach the output.
    pub async fn finish(self, grace: Duration) {
        self.input.abort();
        let _ = self.input.await;
        let from_sdk = self.from_sdk.abort_handle();
        let output = self.output.abort_handle();
        let written = async {
            let _ = self.from_sdk.await;
            let _ = self.output.await;
        };
        if tokio::time::timeout(grace, written).await.is_err() {
            tracing::warn!("the MCP client did not read the last answers in time");
            from_sdk.abort();
            output.abort();
        }
    }
}

/// How a bounded line read ended.
#[derive(Debug, PartialEq)]
enum Read {
    /// A whole line, its line break included, is in the buffer.
    Line,
    /// A line longer than the bound, dropped.
    TooLong,
    /// The input ended (a last line without a line break included, as the SDK had it).
    End,
}

/// Reads one line into `line` (cleared first), never holding more than `max` bytes of it.
async fn read_line<R: AsyncRead + Unpin>(
    read: &mut BufReader<R>,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Read> {
    line.clear();
    let mut too_long = false;
    loop {
        let available = read.fill_buf().await?;
        if available.is_empty() {
            return Ok(Read::End);
        }
        let newline = available.iter().position(|b| *b == b'\n');
        let take = newline.map_or(available.len(), |at| at + 1);
        if !too_long && line.len().saturating_add(take) > max {
            too_long = true;
            *line = Vec::new();
        }
        if !too_long {
            line.extend_from_slice(&available[..take]);
        }
        read.consume(take);
        if newline.is_some() {
            return Ok(if too_long { Read::TooLong } else { Read::Line });
        }
    }
}

/// Reads the client's lines: messages go on to the SDK, others are answered.
async fn read_input<R: AsyncRead + Unpin>(
    input: R,
    max_line: usize,
    mut to_sdk: DuplexStream,
    answers: mpsc::Sender<Vec<u8>>,
) {
    let mut input = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        let refusal = match read_line(&mut input, &mut line, max_line).await {
            Ok(Read::Line) => {
                let content = line.strip_suffix(b"\n").unwrap_or(&line);
                let content = content.strip_suffix(b"\r").unwrap_or(content);
                if content.trim_ascii().is_empty() {
                    continue;
                }
                match malformed::check(content) {
                    Check::Message | Check::Stray(_) => {
                        if to_sdk.write_all(&line).await.is_err() {
                            // The SDK is gone.
                            return;
                        }
                        continue;
                    }
                    Check::Refused(refusal) => refusal,
                }
            }
            Ok(Read::TooLong) => Refusal {
                code: malformed::PARSE_ERROR,
                id: serde_json::Value::Null,
                message: format!(
                    "parse error: the request is longer than {max_line} bytes, the most this \
                     server reads in one line"
                ),
            },
            // Dropping `to_sdk` tells the SDK the client is gone.
            Ok(Read::End) => return,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the MCP client's requests on stdin");
                return;
            }
        };
        tracing::warn!(
            id = %refusal.id,
            "answered a request on stdin that is not a JSON-RPC message: {}",
            refusal.message
        );
        let mut answer = refusal.to_json();
        answer.push(b'\n');
        if answers.send(answer).await.is_err() {
            return;
        }
    }
}

/// Passes on what the SDK writes, a whole line at a time.
async fn read_sdk(from_sdk: DuplexStream, lines: mpsc::Sender<Vec<u8>>) {
    let mut from_sdk = BufReader::new(from_sdk);
    loop {
        // The SDK's own messages: as long as it makes them.
        let mut line = Vec::new();
        match from_sdk.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if lines.send(line).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// The one writer of the output.
async fn write_output<W: AsyncWrite + Unpin>(mut output: W, mut lines: mpsc::Receiver<Vec<u8>>) {
    while let Some(line) = lines.recv().await {
        let written = async {
            output.write_all(&line).await?;
            output.flush().await
        };
        if let Err(e) = written.await {
            tracing::warn!(error = %e, "cannot write to the MCP client on stdout");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    async fn next_line<R: AsyncRead + Unpin>(read: &mut BufReader<R>) -> String {
        let mut line = String::new();
        tokio::time::timeout(WAIT, read.read_line(&mut line))
            .await
            .unwrap()
            .unwrap();
        line
    }

    #[tokio::test]
    async fn messages_reach_the_sdk_others_are_answered_and_no_answer_splits_the_sdk_s_line() {
        let (mut client, input) = tokio::io::duplex(1024);
        let (output, answers) = tokio::io::duplex(1024);
        let mut answers = BufReader::new(answers);
        let (filter, (sdk_reads, mut sdk_writes)) = start_with(input, output, 200);
        let mut sdk_reads = BufReader::new(sdk_reads);

        // Half a message from the SDK, then a line that does not parse from the client: its
        // answer comes first, whole, and the SDK's line after it, whole.
        sdk_writes
            .write_all(br#"{"jsonrpc":"2.0","id":1,"#)
            .await
            .unwrap();
        client
            .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"ping\",\"x\":\"\xff\"}\n")
            .await
            .unwrap();
        let answer: serde_json::Value =
            serde_json::from_str(&next_line(&mut answers).await).unwrap();
        assert_eq!(answer["id"], 9, "{answer}");
        assert_eq!(answer["error"]["code"], -32700, "{answer}");
        sdk_writes.write_all(b"\"result\":{}}\n").await.unwrap();
        assert_eq!(
            next_line(&mut answers).await,
            "{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n"
        );

        // Blank lines are skipped, a line over the bound is answered and not passed on, and
        // messages reach the SDK as sent (a notification of another protocol included: the SDK
        // skips those itself).
        let good = "{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\"}\r\n";
        let stray = "{\"jsonrpc\":\"2.0\",\"method\":\"$/lsp\",\"params\":[]}\n";
        let long = format!("{{\"x\":\"{}\"}}\n", "y".repeat(300));
        for line in ["\n", " \t\r\n", &long, good, "[]\n", stray] {
            client.write_all(line.as_bytes()).await.unwrap();
        }
        let answer: serde_json::Value =
            serde_json::from_str(&next_line(&mut answers).await).unwrap();
        assert_eq!(answer["id"], serde_json::Value::Null, "{answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains("longer than 200 bytes"),
            "{answer}"
        );
        assert_eq!(next_line(&mut sdk_reads).await, good);
        let answer: serde_json::Value =
            serde_json::from_str(&next_line(&mut answers).await).unwrap();
        assert_eq!(answer["error"]["code"], -32600, "{answer}");
        assert_eq!(next_line(&mut sdk_reads).await, stray);

        // The client gone, the SDK hears the end; the SDK done, so is the output.
        client.write_all(b"{\"partial\":").await.unwrap();
        drop(client);
        let mut rest = Vec::new();
        tokio::time::timeout(WAIT, sdk_reads.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        sdk_writes.write_all(b"{\"last\":1}\n").await.unwrap();
        drop(sdk_writes);
        drop(sdk_reads);
        filter.finish(WAIT).await;
        let mut rest = String::new();
        tokio::time::timeout(WAIT, answers.read_to_string(&mut rest))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rest, "{\"last\":1}\n");
    }

    #[tokio::test]
    async fn a_line_is_read_within_its_bound() {
        let input = b"12345\n123456\n1234567\n12".to_vec();
        let mut read = BufReader::with_capacity(4, &input[..]);
        let mut line = Vec::new();
        let mut got = Vec::new();
        loop {
            let step = read_line(&mut read, &mut line, 7).await.unwrap();
            got.push((step, String::from_utf8(line.clone()).unwrap()));
            if got.last().unwrap().0 == Read::End {
                break;
            }
        }
        assert_eq!(
            got,
            [
                (Read::Line, "12345\n".to_string()),
                (Read::Line, "123456\n".to_string()),
                (Read::TooLong, String::new()),
                (Read::End, "12".to_string()),
            ]
        );
    }
}
