//! The agent link's framing as the coordinator reads it: any bytes, cut into HTTP/2 frames of any
//! size with pauses between them, decode into messages or one error, and the stream ends; never a
//! panic, never a hang.
#![no_main]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body, Frame};
use libfuzzer_sys::fuzz_target;
use tokio_stream::Stream;
use toolsrv_coordinator::framing::Inbound;
use toolsrv_proto::v1::AgentMessage;

/// A request body that pauses (`Pending`) before every frame, as a peer between writes does.
struct Frames {
    frames: VecDeque<Bytes>,
    paused: bool,
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if !self.paused && !self.frames.is_empty() {
            self.paused = true;
            return Poll::Pending;
        }
        self.paused = false;
        Poll::Ready(self.frames.pop_front().map(|f| Ok(Frame::data(f))))
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, wire)) = data.split_first() else {
        return;
    };
    let frames = wire
        .chunks(usize::from(cut).max(1))
        .map(Bytes::copy_from_slice)
        .collect();
    let body = Frames {
        frames,
        paused: false,
    };
    // A small limit, so that declared lengths over it are exercised too.
    let mut inbound = Inbound::<AgentMessage, _>::new(body, 4096);
    let mut cx = Context::from_waker(Waker::noop());
    // Each poll yields a message (at least 5 bytes of input), a pause (one per frame) or the end
    // after an error, so the stream must end within this many polls.
    let mut errors = 0;
    for _ in 0..2 * wire.len() + 8 {
        match Pin::new(&mut inbound).poll_next(&mut cx) {
            Poll::Ready(None) => return,
            Poll::Ready(Some(Err(_))) => {
                errors += 1;
                assert!(errors == 1, "more than one error from one stream");
            }
            Poll::Ready(Some(Ok(_))) | Poll::Pending => {}
        }
    }
    panic!("the stream did not end");
});
