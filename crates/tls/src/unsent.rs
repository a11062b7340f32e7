//! What a server connection's HTTP/2 layer was handed to send and has not written yet, and what
//! is held until it has.
//!
//! hyper hands a response's data to h2 once the stream's window allows, and h2 queues it (up to
//! 400 KiB a stream, which tonic does not let us set) until the socket takes it. A peer that opens
//! large windows and then stops reading its socket leaves every answer queued there: 1,024
//! answers of 400 KB on one connection held 410 MB that no count of the answers' bodies saw,
//! since each body had ended. So the bodies say how many data bytes they hand over
//! ([`Unsent::handed`]), the connection ([`crate::TlsConn`]) counts the data bytes of the frames
//! it writes, and what a body held for the bytes it handed (its share of a budget, its request's
//! place) is kept here ([`Unsent::hold`]) until the connection has written as many data bytes as
//! had been handed when it was put here.
//!
//! h2 drops the queued data of a stream that is reset, and that data is never written: the
//! handed count of a connection whose peer resets streams with data queued runs ahead of what it
//! writes, and what is held would wait for bytes that never come. So what has been held for
//! [`IDLE_RELEASE`] is let go once the connection's writes have not waited on the peer for as
//! long: what is held waits on data that could be sent when it was put here (a chunk's charge
//! comes here once hyper found window for it, a request's place once its answer ended), and h2
//! writes what it may send as fast as the socket takes it, so such data still unwritten then was
//! dropped. The count of bytes written is never moved forward: the handed count also holds data
//! waiting for its stream's window, which is written later, so the written count never passes
//! the handed one, and what is held after a drop waits on the dropped bytes too, until they are
//! made up by later writes or it is let go in its turn. A peer that lowers its streams' window
//! (SETTINGS_INITIAL_WINDOW_SIZE) makes data h2 may send wait again without its writes waiting:
//! such a connection keeps what it holds until the bytes are written or it closes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long what is held for data not yet written may wait while the connection's writes do not
/// wait on the peer, before that data is taken as dropped (see the module's documentation).
pub const IDLE_RELEASE: Duration = Duration::from_secs(5);

/// One connection's data bytes handed and written, and what waits on them. Cloning shares it;
/// equal when shared.
#[derive(Clone, Default)]
pub struct Unsent {
    inner: Arc<Mutex<Ledger>>,
}

#[derive(Default)]
struct Ledger {
    /// Data bytes handed to the HTTP/2 layer.
    handed: u64,
    /// Data bytes of the frames written (or taken as dropped).
    written: u64,
    /// Held until `written` reaches each one's `at`, oldest first.
    held: VecDeque<Held>,
    /// The connection is gone: nothing is held any more.
    closed: bool,
}

struct Held {
    at: u64,
    since: Instant,
    _what: Box<dyn Send>,
}

impl PartialEq for Unsent {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Unsent {}

impl std::fmt::Debug for Unsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ledger = self.lock();
        f.debug_struct("Unsent")
            .field("handed", &ledger.handed)
            .field("written", &ledger.written)
            .field("held", &ledger.held.len())
            .finish()
    }
}

impl Unsent {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // Every change is a few assignments: the ledger is whole whatever a panicking holder did.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bytes` more data bytes handed to the HTTP/2 layer to send.
    pub fn handed(&self, bytes: usize) {
        self.lock().handed += bytes as u64;
    }

    /// Keeps `what` until the connection has written the data bytes handed so far, or is gone;
    /// dropped at once if nothing handed waits.
    pub fn hold(&self, what: impl Send + 'static) {
        let mut ledger = self.lock();
        if ledger.closed || ledger.written >= ledger.handed {
            drop(ledger);
            drop(what);
            return;
        }
        let at = ledger.handed;
        ledger.held.push_back(Held {
            at,
            since: Instant::now(),
            _what: Box::new(what),
        });
    }

    /// How many things are held.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// `bytes` more data bytes written: lets go of what waited on them. The connection calls it
    /// as it writes.
    pub fn written(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let released = {
            let mut ledger = self.lock();
            ledger.written += bytes;
            let written = ledger.written;
            take_while(&mut ledger.held, |h| h.at <= written)
        };
        drop(released);
    }

    /// Lets go of what has been held for [`IDLE_RELEASE`] at `now`, if the connection's writes
    /// have not waited on the peer since `unblocked` (see the module's documentation). Returns
    /// when to look again, if anything is still held.
    pub(crate) fn release_idle(&self, now: Instant, unblocked: Instant) -> Option<Instant> {
        let mut ledger = self.lock();
        let oldest = ledger.held.front()?.since;
        if now < unblocked + IDLE_RELEASE || now < oldest + IDLE_RELEASE {
            return Some(oldest.max(unblocked) + IDLE_RELEASE);
        }
        // The count of bytes written is left as it is: what was handed and is not written yet may
        // be data waiting for its stream's window (hyper hands a chunk over before the window
        // allows it), which will be written and counted then. Taking it as written now would
        // count it twice, and let what is held later go before its own data is written.
        let released = take_while(&mut ledger.held, |h| h.since + IDLE_RELEASE <= now);
        let next = ledger.held.front().map(|h| h.since + IDLE_RELEASE);
        drop(ledger);
        drop(released);
        next
    }

    /// The connection is gone: lets go of everything, and of whatever is held from now on.
    pub(crate) fn close(&self) {
        let released = {
            let mut ledger = self.lock();
            ledger.closed = true;
            std::mem::take(&mut ledger.held)
        };
        drop(released);
    }
}

/// Takes the front of `held` while `done` holds: dropped by the caller, outside the lock (a held
/// count's slot takes its own lock when dropped).
fn take_while(held: &mut VecDeque<Held>, done: impl Fn(&Held) -> bool) -> Vec<Held> {
    let n = held.iter().take_while(|h| done(h)).count();
    held.drain(..n).collect()
}

/// Where the next byte of a stream of HTTP/2 frames (RFC 9113 §4.1) falls, followed a piece at a
/// time as it is written or read.
#[derive(Debug, Default)]
pub(crate) struct Cursor {
    header: [u8; 9],
    /// Bytes of the current frame's header seen.
    have: usize,
    /// Bytes of the current frame's payload seen, and its length.
    seen: u32,
    len: u32,
}

/// What a peer sends, followed for the SETTINGS that lower its streams' window.
#[derive(Debug)]
pub(crate) struct Received {
    cursor: Cursor,
    /// The current SETTINGS entry (6 bytes each).
    entry: [u8; 6],
    /// The peer's SETTINGS_INITIAL_WINDOW_SIZE as last set (65,535 until it sets one).
    window: u32,
    /// The peer set it lower than it was.
    lowered: bool,
}

const DATA: u8 = 0x0;
const SETTINGS: u8 = 0x4;
const ACK: u8 = 0x1;
const INITIAL_WINDOW_SIZE: u16 = 0x4;

impl Default for Received {
    fn default() -> Self {
        Self {
            cursor: Cursor::default(),
            entry: [0; 6],
            window: 65_535,
            lowered: false,
        }
    }
}

impl Received {
    /// Follows `bytes`, the next piece of what the peer sent.
    pub(crate) fn read(&mut self, bytes: &[u8]) {
        let (entry, window, lowered) = (&mut self.entry, &mut self.window, &mut self.lowered);
        self.cursor.follow(bytes, |kind, flags, offset, piece| {
            if kind != SETTINGS || flags & ACK != 0 {
                return;
            }
            for (at, &b) in (offset as usize..).zip(piece) {
                let i = at % entry.len();
                entry[i] = b;
                if i + 1 == entry.len() {
                    let id = u16::from_be_bytes([entry[0], entry[1]]);
                    let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
                    if id == INITIAL_WINDOW_SIZE {
                        *lowered |= value < *window;
                        *window = value;
                    }
                }
            }
        });
    }

    /// The peer lowered its streams' window at some point.
    pub(crate) fn lowered(&self) -> bool {
        self.lowered
    }
}

impl Cursor {
    /// The bytes of DATA frames' payloads in `bytes`, the next piece of the stream.
    pub(crate) fn data_bytes(&mut self, bytes: &[u8]) -> u64 {
        let mut data = 0;
        self.follow(bytes, |kind, _, _, piece| {
            if kind == DATA {
                data += piece.len() as u64;
            }
        });
        data
    }

    /// Calls `payload(kind, flags, offset, piece)` with each piece of a frame's payload in
    /// `bytes`, `offset` bytes into the payload.
    fn follow(&mut self, mut bytes: &[u8], mut payload: impl FnMut(u8, u8, u32, &[u8])) {
        while !bytes.is_empty() {
            if self.have < self.header.len() {
                let n = (self.header.len() - self.have).min(bytes.len());
                self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                bytes = &bytes[n..];
                if self.have == self.header.len() {
                    let [a, b, c, ..] = self.header;
                    self.len = u32::from_be_bytes([0, a, b, c]);
                    self.seen = 0;
                    if self.len == 0 {
                        self.have = 0;
                    }
                }
                continue;
            }
            let n = ((self.len - self.seen) as usize).min(bytes.len());
            payload(self.header[3], self.header[4], self.seen, &bytes[..n]);
            self.seen += n as u32;
            bytes = &bytes[n..];
            if self.seen == self.len {
                self.have = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its drops.
    struct Token(Arc<AtomicUsize>);

    impl Drop for Token {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn held_until_the_bytes_handed_before_are_written() {
        let unsent = Unsent::default();
        let dropped = Arc::new(AtomicUsize::new(0));
        // Nothing handed waits: let go at once.
        unsent.hold(Token(dropped.clone()));
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        unsent.handed(100);
        unsent.hold(Token(dropped.clone()));
        unsent.handed(50);
        unsent.hold(Token(dropped.clone()));
        assert_eq!(unsent.held(), 2);
        unsent.written(99);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        unsent.written(1);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
        unsent.written(50);
        assert_eq!(dropped.load(Ordering::SeqCst), 3);
        assert_eq!(unsent.held(), 0);
        // Gone: everything goes, and what comes after at once.
        unsent.handed(10);
        unsent.hold(Token(dropped.clone()));
        unsent.close();
        assert_eq!(dropped.load(Ordering::SeqCst), 4);
        unsent.handed(10);
        unsent.hold(Token(dropped.clone()));
        assert_eq!(dropped.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn what_waits_on_dropped_data_goes_once_writes_have_not_waited_for_a_while() {
        let unsent = Unsent::default();
        let dropped = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        unsent.handed(100);
        unsent.hold(Token(dropped.clone()));
        let since = unsent.lock().held[0].since;
        // Writes waited until just now: nothing goes yet.
        let later = since + IDLE_RELEASE * 2;
        assert_eq!(
            unsent.release_idle(later, later),
            Some(later + IDLE_RELEASE)
        );
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        // Held too short a time: nothing goes yet.
        assert_eq!(
            unsent.release_idle(since + IDLE_RELEASE / 2, start),
            Some(since + IDLE_RELEASE)
        );
        // Long enough, with writes free all along: it goes.
        assert_eq!(unsent.release_idle(since + IDLE_RELEASE, start), None);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        // What is handed next also waits on the 100 bytes never written, until writes make them
        // up or it is let go in its turn.
        unsent.handed(10);
        unsent.hold(Token(dropped.clone()));
        unsent.written(10);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        unsent.written(100);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
    }

    /// Bytes handed that wait for their stream's window are written after what was held has
    /// been let go: they must not count as written twice. (A peer that kept streams' windows
    /// short, had what was held let go, then opened the windows, had the count of written bytes
    /// run 47 MB ahead, and every answer after went unheld: eight connections took the
    /// coordinator 380 MB past a budget of 64 MB, and past the request limit.)
    #[test]
    fn bytes_waiting_for_a_window_are_not_counted_twice() {
        let unsent = Unsent::default();
        let dropped = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        // 1,000 bytes handed wait for their windows; a place is held behind them.
        unsent.handed(1_000);
        unsent.hold(Token(dropped.clone()));
        let since = unsent.lock().held[0].since;
        assert_eq!(unsent.release_idle(since + IDLE_RELEASE, start), None);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        // The windows open: the 1,000 bytes are written.
        unsent.written(1_000);
        // An answer handed now is held until its own bytes are written.
        unsent.handed(500);
        unsent.hold(Token(dropped.clone()));
        assert_eq!(unsent.held(), 1, "let go before its bytes were written");
        unsent.written(500);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn data_bytes_are_counted_across_pieces() {
        let mut stream = frame(SETTINGS, 0, &[0, 4, 0, 0, 0, 9]);
        stream.extend(frame(DATA, 0, &[7; 300]));
        stream.extend(frame(0x1, 0x4, &[1; 40])); // HEADERS
        stream.extend(frame(DATA, 0x1, &[])); // end of stream
        stream.extend(frame(DATA, 0, &[7; 5]));
        for piece in [1, 2, 7, 9, 10, 64, stream.len()] {
            let mut cursor = Cursor::default();
            let counted: u64 = stream.chunks(piece).map(|c| cursor.data_bytes(c)).sum();
            assert_eq!(counted, 305, "pieces of {piece}");
        }
    }

    #[test]
    fn a_lowered_stream_window_is_noticed() {
        for (settings, lowered) in [
            (vec![(0x4, 1 << 20), (0x4, 1 << 30)], false),
            (vec![(0x3, 100), (0x4, 65_535)], false),
            (vec![(0x4, 1 << 20), (0x4, 0)], true),
            (vec![(0x4, 1_000)], true),
        ] {
            let mut stream = Vec::new();
            for (id, value) in settings {
                let mut payload = u16::to_be_bytes(id).to_vec();
                payload.extend(u32::to_be_bytes(value));
                stream.extend(frame(DATA, 0, &payload)); // not a setting
                stream.extend(frame(SETTINGS, ACK, &[])); // an acknowledgement
                stream.extend(frame(SETTINGS, 0, &payload));
            }
            for piece in [1, 5, 13, stream.len()] {
                let mut received = Received::default();
                stream.chunks(piece).for_each(|c| received.read(c));
                assert_eq!(
                    received.lowered(),
                    lowered,
                    "{stream:?} in pieces of {piece}"
                );
            }
        }
    }
}
