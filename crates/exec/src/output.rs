//! Reading the tool's pipes and applying the combined output cap

use std::sync::{Arc, Mutex, PoisonError};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

use crate::event::{Event, Stream};

/// How much is read from a pipe at a time
const CHUNK: usize = 64 * 1024;

/// What both pipe readers share: the cap accounting and a bounded copy of what was delivered
#[derive(Debug)]
pub(crate) struct Capture {
    cap: u64,
    /// The most bytes of each stream copied for the result
    keep: usize,
    state: Mutex<CaptureState>,
}

/// Everything the readers learned, taken once they are done
#[derive(Debug, Default)]
pub(crate) struct CaptureState {
    /// Bytes of tool output delivered so far (the marker does not count)
    pub(crate) delivered: u64,
    pub(crate) truncated: bool,
    /// The start of what was delivered on stdout, marker included; at most `keep` long
    pub(crate) stdout: Vec<u8>,
    /// The start of what was delivered on stderr, marker included; at most `keep` long
    pub(crate) stderr: Vec<u8>,
    /// Bytes delivered on stdout, marker included (what a complete copy would hold)
    pub(crate) stdout_delivered: u64,
    /// Bytes delivered on stderr, marker included
    pub(crate) stderr_delivered: u64,
    pub(crate) stdout_total: u64,
    pub(crate) stderr_total: u64,
}

/// The chunk sent once, on the stream that crossed the cap
pub(crate) fn truncation_marker(cap: u64) -> Bytes {
    Bytes::from(format!("\n[toolsrv: output truncated at {cap} bytes]\n"))
}

impl Capture {
    pub(crate) fn new(cap: u64, keep: u64) -> Self {
        Self {
            cap,
            keep: usize::try_from(keep).unwrap_or(usize::MAX),
            state: Mutex::new(CaptureState::default()),
        }
    }

    /// Accounts for a chunk read from `stream` and returns what may be delivered of it
    ///
    /// Returns nothing once the cap was hit; the chunk that crosses it comes back
    /// cut at the cap and followed by the marker.
    pub(crate) fn admit(&self, stream: Stream, chunk: Bytes) -> Vec<Bytes> {
        // Nothing panics while the lock is held, but a poisoned lock still holds valid counts.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let len = chunk.len() as u64;
        match stream {
            Stream::Stdout => state.stdout_total += len,
            Stream::Stderr => state.stderr_total += len,
        }
        if state.truncated {
            return Vec::new();
        }
        let room = self.cap - state.delivered;
        let mut out = Vec::with_capacity(2);
        if len <= room {
            state.delivered += len;
            out.push(chunk);
        } else {
            // room < len <= usize::MAX, so the cast is lossless
            let kept = chunk.slice(..room as usize);
            state.delivered = self.cap;
            state.truncated = true;
            if !kept.is_empty() {
                out.push(kept);
            }
            out.push(truncation_marker(self.cap));
        }
        let state = &mut *state;
        let (copy, delivered) = match stream {
            Stream::Stdout => (&mut state.stdout, &mut state.stdout_delivered),
            Stream::Stderr => (&mut state.stderr, &mut state.stderr_delivered),
        };
        for piece in &out {
            *delivered += piece.len() as u64;
            let room = self.keep.saturating_sub(copy.len());
            copy.extend_from_slice(&piece[..piece.len().min(room)]);
        }
        out
    }

    /// Takes what the readers collected, leaving the counts in place
    pub(crate) fn take(&self) -> CaptureState {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        CaptureState {
            delivered: state.delivered,
            truncated: state.truncated,
            stdout: std::mem::take(&mut state.stdout),
            stderr: std::mem::take(&mut state.stderr),
            stdout_delivered: state.stdout_delivered,
            stderr_delivered: state.stderr_delivered,
            stdout_total: state.stdout_total,
            stderr_total: state.stderr_total,
        }
    }
}

/// Reads `pipe` to EOF, delivering what the cap allows through `tx`
///
/// Waiting on `tx` is what gives backpressure: while the consumer is behind,
/// this stops reading and the tool blocks on its full pipe. Past the cap, or
/// once the receiver is gone, output is read and thrown away so the tool never
/// blocks on a pipe nobody drains.
pub(crate) async fn pump<R>(
    mut pipe: R,
    stream: Stream,
    capture: Arc<Capture>,
    tx: mpsc::Sender<Event>,
) where
    R: AsyncRead + Unpin,
{
    let mut buf = BytesMut::with_capacity(CHUNK);
    let mut receiver_gone = false;
    loop {
        buf.reserve(CHUNK);
        match pipe.read_buf(&mut buf).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => {
                tracing::warn!(?stream, %err, "cannot read tool output");
                break;
            }
        }
        let chunk = buf.split().freeze();
        for data in capture.admit(stream, chunk) {
            if receiver_gone {
                break;
            }
            if tx.send(Event::Output { stream, data }).await.is_err() {
                receiver_gone = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Bytes {
        Bytes::from(vec![b'a'; n])
    }

    #[test]
    fn under_the_cap_everything_passes() {
        let capture = Capture::new(10, 1 << 20);
        assert_eq!(capture.admit(Stream::Stdout, bytes(4)), vec![bytes(4)]);
        assert_eq!(capture.admit(Stream::Stderr, bytes(6)), vec![bytes(6)]);
        let state = capture.take();
        assert!(!state.truncated);
        assert_eq!((state.stdout.len(), state.stderr.len()), (4, 6));
    }

    #[test]
    fn the_crossing_chunk_is_cut_and_marked_once() {
        let capture = Capture::new(10, 1 << 20);
        assert_eq!(capture.admit(Stream::Stdout, bytes(7)).len(), 1);
        let crossing = capture.admit(Stream::Stderr, bytes(5));
        assert_eq!(crossing, vec![bytes(3), truncation_marker(10)]);
        assert!(capture.admit(Stream::Stdout, bytes(100)).is_empty());
        assert!(capture.admit(Stream::Stderr, bytes(100)).is_empty());
        let state = capture.take();
        assert!(state.truncated);
        assert_eq!(state.stdout_total, 107);
        assert_eq!(state.stderr_total, 105);
        assert_eq!(state.stdout, vec![b'a'; 7]);
        let mut want = vec![b'a'; 3];
        want.extend_from_slice(&truncation_marker(10));
        assert_eq!(state.stderr, want);
    }

    #[test]
    fn a_zero_cap_sends_only_the_marker() {
        let capture = Capture::new(0, 1 << 20);
        assert_eq!(
            capture.admit(Stream::Stdout, bytes(1)),
            vec![truncation_marker(0)]
        );
        assert!(capture.admit(Stream::Stdout, bytes(1)).is_empty());
    }

    #[test]
    fn a_chunk_exactly_at_the_cap_is_not_truncated() {
        let capture = Capture::new(5, 1 << 20);
        assert_eq!(capture.admit(Stream::Stdout, bytes(5)), vec![bytes(5)]);
        assert!(!capture.take().truncated);
        // The next non-empty byte crosses it.
        assert_eq!(
            capture.admit(Stream::Stdout, bytes(1)),
            vec![truncation_marker(5)]
        );
    }
}
