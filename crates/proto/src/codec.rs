//! The protobuf codec of every generated toolsrv service and client: prost, with small
//! per-stream buffers.
//!
//! A stream's encode and decode buffers start at `buffer_size` and keep whatever capacity they
//! grow to for the life of the stream; an agent link lives for days. Starting small and yielding
//! often keeps an idle stream's buffers small. (The coordinator's side of the agent link goes
//! further and frames that stream itself: `toolsrv-coordinator`'s `framing` keeps nothing sized
//! by a message once the link is quiet.)

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
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
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = <ProstCodec<T, U> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(SETTINGS.0, SETTINGS.1))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(SETTINGS.0, SETTINGS.1))
    }
}
