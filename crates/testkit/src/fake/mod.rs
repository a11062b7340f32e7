//! Fake agents: stand-ins for fleet hosts that speak the real agent protocol and run nothing.
//!
//! Each link is a real mutual-TLS connection (its own TCP connection and handshake, with the
//! agent certificate of its host id): Hello, wait for the Welcome, answer every CatalogUpdate
//! with a HostView that marks every tool visible (with a definition), send a Keepalive every
//! interval, and answer each StartCall as the host's [`Answer`] says (by default at once with
//! one `CallOutput` of `ok\n` and a `CallFinished` with status OK). Attached with
//! [`Connected::attach_reconnecting`], a host whose link ends dials again after a delay the caller
//! gives (the fleet bench passes the agent's own backoff and full jitter), as a real agent does
//! when its coordinator restarts.
//!
//! [`Responder`] is the protocol core (what to answer to each coordinator message), kept free of
//! I/O so it can be checked without a network; [`Connected`] and [`FakeAgents`] run it on links,
//! for the fleet bench (a thousand hosts) and for the coordinator's tests (fan-out, credit).

mod links;
mod responder;

pub use links::{Behaviour, Connected, Counters, Delay, FakeAgents, Gate, fake_id};
pub use responder::{
    Answer, Definitions, FAKE_FAILURE, FAKE_LABEL, FAKE_MAX_CONCURRENT, FAKE_OUTPUT, FORGED_TEXT,
    FORGED_TOOL, Reaction, Responder,
};
