//! Development PKI, identities from certificates, and rustls plumbing for tonic.
//!
//! We do not use tonic's built-in TLS: the server accepts TLS itself
//! ([`incoming`]) and hands tonic connections that carry the peer's
//! [`Identity`]; the client dials through its own connector ([`connect`])
//! whose verifier also checks the server's role. Credentials are reloadable
//! ([`ServerCreds`]).

mod cert_info;
mod client;
mod config;
mod conns;
pub mod counts;
mod creds;
mod crl;
pub mod enroll;
mod error;
pub mod files;
mod identity;
mod pki;
mod plain;
mod server;
mod throttle;
mod unsent;
mod usage;

pub use cert_info::{CertInfo, certificates_in, check_dates, since_epoch, unix_now, until_unix};
pub use client::{
    CONNECT_TIMEOUT, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, connect, connect_reloading,
    connect_reloading_within, connect_replicas_within, lazy_channel,
};
pub use config::{
    CertificateExpiry, TlsFiles, anonymous_client_config, certificate_expiry, certificate_identity,
    client_config, https_client_config, install_crypto_provider, provider, server_config,
    server_config_with, unverified_client_config, web_pki_client_config,
};
pub use conns::Connections;
pub use creds::ServerCreds;
pub use crl::Crls;
pub use error::{TlsError, chain as error_chain};
pub use identity::{
    Identity, MAX_NAME_LEN, Role, URI_SCHEME, identity_of, normalize_name, validate_name,
};
pub use pki::{
    CA_CERT, CA_KEY, DEFAULT_VALID_DAYS, PkiOptions, file_stem, init, issue, write_atomically,
};
pub use plain::{PlainConn, PlainLimits, PlainListener};
pub use server::{
    ANONYMOUS_LIFETIME, AcceptOptions, ConnInfo, HANDSHAKE_TIMEOUT, LOCAL_ERROR_RESETS,
    MAX_OPEN_PER_IDENTITY, MAX_SETTING_UP_PER_ADDRESS, PREFACE_TIMEOUT, PeerInfo,
    STREAMS_PER_CONNECTION, TlsConn, TlsIncoming, WRITE_STALL, address_key, bounded_server,
    incoming, incoming_with, peer, peer_of,
};
pub use unsent::{IDLE_RELEASE, Unsent};
