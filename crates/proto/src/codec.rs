//! The protobuf codec of every generated toolsrv service and client: prost, with small
//! per-stream buffers.
//!
//! A stream's encode and decode buffers start at `buffer_size` and keep whatever capacity they
//! grow to for the life of the stream; an agent link lives for days. Starting small and yielding
//! often keeps an idle stream's buffers small. (The coordinator's side of the agent link goes
//! further and frames that stream itself: `toolsrv-coordinator`'s `framing` keeps nothing sized
//! by a message once the link is quiet.)
//!
//! Every message received is checked before it is decoded: one that would take more than
//! [`crate::limits::MAX_DECODED_BYTES`] once decoded is refused with `OUT_OF_RANGE` (one that is
//! not wire format with `INTERNAL`), ending that call or stream only ([`crate::cost`]).

use std::marker::PhantomData;

use bytes::Buf as _;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::ProstCodec;

/// Initial buffer size and the encoded size at which a batch of messages is handed to HTTP/2.
const SETTINGS: (usize, usize) = (1 << 10, 8 << 10);

/// `ProstCodec` with [`SETTINGS`].
#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + prost::Name + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(SETTINGS.0, SETTINGS.1))
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(BufferSettings::new(SETTINGS.0, SETTINGS.1), PhantomData)
    }
}

/// ProstCodec's decoder, refusing undecoded a message that would take too much memory decoded.
#[derive(Debug)]
pub struct CheckedDecoder<U>(BufferSettings, PhantomData<fn() -> U>);

impl<U> Decoder for CheckedDecoder<U>
where
    U: prost::Message + prost::Name + Default,
{
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The buffer holds the whole message in one piece; were it ever in several, a copy.
        if buf.chunk().len() == buf.remaining() {
            crate::cost::check::<U>(buf.chunk()).map_err(Status::from)?;
            U::decode(buf)
        } else {
            let whole = buf.copy_to_bytes(buf.remaining());
            crate::cost::check::<U>(&whole).map_err(Status::from)?;
            U::decode(whole)
        }
        .map(Some)
        .map_err(|e| Status::internal(e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0
    }
}
