//! What the coordinator reports about a certificate it uses or sees: who it is for, its serial,
//! and when it expires.

use std::path::Path;

use rustls_pki_types::CertificateDer;

use crate::TlsError;
use crate::config::read_certs;

/// A certificate, summarised for logs and expiry checks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CertInfo {
    /// The subject's distinguished name, as text.
    pub subject: String,
    /// The serial number, lowercase hex with `:` between bytes (as `openssl x509 -serial`
    /// prints it, but for the colons).
    pub serial: String,
    /// `notBefore`, seconds since the Unix epoch.
    pub not_before: i64,
    /// `notAfter`, seconds since the Unix epoch.
    pub not_after: i64,
}

/// Time since the Unix epoch, now: the one wall clock that certificate dates, issuing and
/// cluster records read (zero for a clock before 1970).
pub fn since_epoch() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// Now, in seconds since the Unix epoch, as certificate dates are compared.
pub fn unix_now() -> i64 {
    i64::try_from(since_epoch().as_secs()).unwrap_or(i64::MAX)
}

/// How long from now until `unix` (seconds since the epoch); zero when it has passed.
pub fn until_unix(unix: i64) -> std::time::Duration {
    std::time::Duration::from_secs(u64::try_from(unix.saturating_sub(unix_now())).unwrap_or(0))
}

impl CertInfo {
    /// Reads a DER certificate; `None` if it does not parse.
    pub fn of(der: &[u8]) -> Option<Self> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        Some(Self {
            subject: cert.subject().to_string(),
            serial: cert.raw_serial_as_string(),
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
        })
    }
}

/// Every certificate of a PEM file, summarised (the leaf first for a certificate file).
pub fn certificates_in(path: &Path) -> Result<Vec<CertInfo>, TlsError> {
    read_certs(path)?
        .iter()
        .map(|der: &CertificateDer<'_>| {
            CertInfo::of(der).ok_or_else(|| TlsError::bad_file(path, "cannot parse a certificate"))
        })
        .collect()
}

/// Seconds a certificate's `notBefore` may be ahead of this machine's clock: one issued a
/// moment ago by a machine whose clock runs a little ahead (cert-manager, another host's CA)
/// is valid for every peer whose clock agrees with its issuer's.
const CLOCK_SKEW: i64 = 300;

/// How [`check_dates`] says a certificate is not valid yet, for callers that wait for the
/// clock rather than for new files.
pub(crate) const NOT_YET_VALID: &str = "is valid only from";

/// Refuses the certificate of file `path` (its first, the leaf), naming the file and its dates,
/// when this machine's clock is past its `notAfter` or before its `notBefore`: no peer takes it,
/// and TLS 1.3 shows a client only a broken connection. `expired`: what follows "this
/// certificate expired at ..., N s ago by this machine's clock, and", saying who refuses it and
/// what to do. A file that cannot be read or parsed passes: whatever reads it next says what is
/// wrong with it.
pub fn check_dates(path: &Path, expired: &str) -> Result<(), TlsError> {
    let Some(leaf) = certificates_in(path)
        .ok()
        .and_then(|certs| certs.into_iter().next())
    else {
        return Ok(());
    };
    let now = unix_now();
    let utc = crate::enroll::utc;
    let msg = if now > leaf.not_after {
        format!(
            "this certificate expired at {} UTC, {} s ago by this machine's clock, and {expired}",
            utc(leaf.not_after),
            now - leaf.not_after
        )
    } else if now.saturating_add(CLOCK_SKEW) < leaf.not_before {
        format!(
            "this certificate {NOT_YET_VALID} {} UTC, {} s from now by this machine's clock: \
             check the clock",
            utc(leaf.not_before),
            leaf.not_before - now
        )
    } else {
        return Ok(());
    };
    Err(TlsError::BadFile {
        path: path.to_path_buf(),
        msg,
    })
}
