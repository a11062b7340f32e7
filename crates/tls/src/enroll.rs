//! What enrollment needs from the PKI side: a host's key and certificate signing request, the
//! coordinator's signer that turns a request into a short-lived agent certificate carrying the
//! host's labels, the CA pin an agent checks before it trusts a coordinator, and join tokens.
//!
//! Labels bound at enrollment travel in the certificate as URI SANs,
//! `toolsrv://label/<key>=<value>` (the value percent-encoded), next to the identity URI:
//! anyone can read them with `openssl x509 -text`, and only the CA can write them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use crate::config::read_certs;
use crate::{Identity, TlsError, URI_SCHEME};

/// How a label URI SAN starts: `toolsrv://label/<key>=<percent-encoded value>`.
pub const LABEL_URI_PREFIX: &str = "toolsrv://label/";

/// Longest label key a certificate may carry (as in a hello).
const MAX_LABEL_KEY: usize = 63;
/// Longest label value a certificate may carry (as in a hello).
const MAX_LABEL_VALUE: usize = 253;
/// Most labels a certificate may carry (as in a hello).
pub const MAX_CERT_LABELS: usize = 64;

/// Why an enrollment step failed, with the gRPC code a service answers it with.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// The request is malformed (a CSR that does not parse or whose signature is wrong, a bad
    /// label): `INVALID_ARGUMENT`.
    #[error("{0}")]
    Invalid(String),
    /// The request asks for what it may not have: `PERMISSION_DENIED`.
    #[error("{0}")]
    Denied(String),
    /// The signer could not do its part: `INTERNAL`.
    #[error("{0}")]
    Internal(String),
}

impl EnrollError {
    /// The gRPC code of this error.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Invalid(_) => tonic::Code::InvalidArgument,
            Self::Denied(_) => tonic::Code::PermissionDenied,
            Self::Internal(_) => tonic::Code::Internal,
        }
    }
}

impl From<EnrollError> for tonic::Status {
    fn from(e: EnrollError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// Checks a label as a hello's labels are checked: a key of 1 to 63 of `[A-Za-z0-9_.-/]`, a
/// value of at most 253 bytes without control characters.
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    let ok_key = !key.is_empty()
        && key.len() <= MAX_LABEL_KEY
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-/".contains(&b));
    if !ok_key {
        return Err(format!(
            "label key {key:?} must be 1 to {MAX_LABEL_KEY} characters of [A-Za-z0-9_.-/]"
        ));
    }
    if value.len() > MAX_LABEL_VALUE || value.chars().any(char::is_control) {
        return Err(format!(
            "label {key}: the value must be at most {MAX_LABEL_VALUE} bytes without control characters"
        ));
    }
    Ok(())
}

/// The URI SAN carrying one label.
pub fn label_uri(key: &str, value: &str) -> String {
    let mut uri = format!("{LABEL_URI_PREFIX}{key}=");
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            uri.push(char::from(b));
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri
}

/// Reads one label URI back; an error names what is wrong with it.
pub fn parse_label_uri(uri: &str) -> Result<(String, String), String> {
    let rest = uri
        .strip_prefix(LABEL_URI_PREFIX)
        .ok_or_else(|| format!("{uri:?} is not a label URI ({LABEL_URI_PREFIX}<key>=<value>)"))?;
    let (key, encoded) = rest
        .split_once('=')
        .ok_or_else(|| format!("label URI {uri:?} has no `=`"))?;
    let bytes = encoded.as_bytes();
    let mut value = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("label URI {uri:?} has a bad %-escape"))?;
            value.push(hex);
            i += 3;
        } else {
            value.push(bytes[i]);
            i += 1;
        }
    }
    let value = String::from_utf8(value)
        .map_err(|_| format!("label URI {uri:?} does not decode to UTF-8"))?;
    check_label(key, &value)?;
    Ok((key.to_string(), value))
}

/// The labels a DER certificate carries in its `toolsrv://label/` URI SANs; none when it has
/// no such SAN. A malformed label URI is an error: the CA wrote it, so something is wrong.
pub fn labels_of(cert_der: &[u8]) -> Result<BTreeMap<String, String>, TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| TlsError::Identity(format!("cannot parse the certificate: {e}")))?;
    let mut labels = BTreeMap::new();
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Ok(labels);
    };
    for name in &san.value.general_names {
        if let x509_parser::extensions::GeneralName::URI(uri) = name
            && uri.starts_with(LABEL_URI_PREFIX)
        {
            let (k, v) = parse_label_uri(uri).map_err(TlsError::Identity)?;
            labels.insert(k, v);
        }
    }
    if labels.len() > MAX_CERT_LABELS {
        return Err(TlsError::Identity(format!(
            "certificate carries {} labels, over the limit of {MAX_CERT_LABELS}",
            labels.len()
        )));
    }
    Ok(labels)
}

/// The pin of a CA certificate: `sha256:` and the lowercase hex SHA-256 of its DER encoding
/// (what `openssl x509 -in ca.pem -outform DER | sha256sum` prints).
pub fn ca_pin(cert_der: &[u8]) -> String {
    format!(
        "sha256:{}",
        hex(ring::digest::digest(&ring::digest::SHA256, cert_der).as_ref())
    )
}

/// Checks the spelling of a pin (`sha256:` and 64 hex digits) and returns it normalised.
pub fn parse_pin(text: &str) -> Result<String, String> {
    let hexpart = text
        .strip_prefix("sha256:")
        .ok_or_else(|| format!("CA pin {text:?} must start with `sha256:`"))?;
    if hexpart.len() != 64 || !hexpart.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "CA pin {text:?}: expected sha256: and 64 hex digits (`toolctl token create` prints it)"
        ));
    }
    Ok(format!("sha256:{}", hexpart.to_ascii_lowercase()))
}

/// The certificates of a PEM text, in order.
pub fn certs_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            format!(
                "not a valid PEM certificate bundle: {}",
                crate::config::pem_problem(&e)
            )
        })?;
    if certs.is_empty() {
        return Err("no certificate in it".into());
    }
    Ok(certs)
}

/// The certificates of `pem` whose pin is `pin`, as PEM.
pub fn pinned_certs(pem: &str, pin: &str) -> Result<String, String> {
    let kept: Vec<String> = certs_from_pem(pem)?
        .iter()
        .filter(|der| ca_pin(der) == pin)
        .map(|der| pem_cert(der))
        .collect();
    if kept.is_empty() {
        return Err(format!(
            "no certificate of the coordinator's CA bundle has the pin {pin}: check --ca-pin \
             (`toolctl token create` prints it) and --coordinator; someone may be in between"
        ));
    }
    Ok(kept.concat())
}

/// One certificate as PEM.
pub fn pem_cert(der: &[u8]) -> String {
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    let b64 = base64(der);
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(T[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The pin of the CA in `ca_path` that the first certificate of `cert_path` chains to (the
/// certificate after the leaf, or the leaf itself, signed by it); the first CA's pin when none
/// is found.
pub fn pin_for(ca_path: &Path, cert_path: &Path) -> Result<String, TlsError> {
    let cas = read_certs(ca_path)?;
    let own = read_certs(cert_path)?;
    let top = own.last().unwrap_or(&own[0]);
    let parsed_top = parse_der(top).map_err(|e| TlsError::bad_file(cert_path, e))?;
    for ca in &cas {
        if ca.as_ref() == top.as_ref() {
            return Ok(ca_pin(ca));
        }
        if let Ok(parsed) = parse_der(ca)
            && parsed_top
                .verify_signature(Some(parsed.public_key()))
                .is_ok()
        {
            return Ok(ca_pin(ca));
        }
    }
    Ok(ca_pin(&cas[0]))
}

fn parse_der(der: &[u8]) -> Result<x509_parser::certificate::X509Certificate<'_>, String> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c)
        .map_err(|e| format!("cannot parse a certificate: {e}"))
}

/// A new P-256 key (PEM) and a CSR for it (DER), naming nothing: the coordinator decides
/// what the certificate says.
pub fn new_key_and_csr() -> Result<(String, Vec<u8>), TlsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|source| {
        TlsError::Generate {
            what: "the agent key".into(),
            source,
        }
    })?;
    let csr = CertificateParams::default()
        .serialize_request(&key)
        .map_err(|source| TlsError::Generate {
            what: "the certificate signing request".into(),
            source,
        })?;
    Ok((key.serialize_pem(), csr.der().to_vec()))
}

/// The public key (DER SubjectPublicKeyInfo's key bits) of a PEM private key, to check that a
/// certificate is for it.
pub fn public_key_of(key_pem: &str) -> Result<Vec<u8>, String> {
    KeyPair::from_pem(key_pem)
        .map(|k| k.public_key_raw().to_vec())
        .map_err(|e| format!("not a usable private key: {e}"))
}

/// The public key bits of a DER certificate.
pub fn certificate_public_key(cert_der: &[u8]) -> Result<Vec<u8>, String> {
    parse_der(cert_der).map(|c| c.public_key().subject_public_key.data.to_vec())
}

/// Validity of a DER certificate as Unix seconds: (notBefore, notAfter).
pub fn validity_of(cert_der: &[u8]) -> Result<(i64, i64), String> {
    let cert = parse_der(cert_der)?;
    Ok((
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    ))
}

/// What the signer issued.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate, then the signing CA when it is not in the coordinator's CA bundle
    /// (an intermediate).
    pub chain_pem: String,
    /// When it expires, Unix seconds.
    pub not_after: i64,
}

/// The coordinator's signer: a CA certificate and key (`--signing-ca-cert`,
/// `--signing-ca-key`), the root or an intermediate of the CA bundle agents are verified with.
pub struct Signer {
    issuer: Issuer<'static, KeyPair>,
    /// The signing CA's PEM, appended to issued certificates when it is an intermediate.
    intermediate_pem: Option<String>,
    cert_path: PathBuf,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("cert", &self.cert_path)
            .field("intermediate", &self.intermediate_pem.is_some())
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// Loads the signing CA and checks it: the key matches the certificate, the certificate is
    /// a CA, and it is in the CA bundle `ca_bundle` or signed by one of its certificates (so
    /// that what it issues is accepted by the coordinator's own verifier).
    pub fn load(cert_path: &Path, key_path: &Path, ca_bundle: &Path) -> Result<Self, TlsError> {
        let certs = read_certs(cert_path)?;
        let der = &certs[0];
        let parsed = parse_der(der).map_err(|e| TlsError::bad_file(cert_path, e))?;
        let key_pem = crate::files::read_private_key(key_path)?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| {
            TlsError::bad_file(key_path, format!("not a usable PEM private key: {e}"))
        })?;
        if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(TlsError::bad_file(
                key_path,
                format!(
                    "this key does not belong to the signing CA certificate {}",
                    cert_path.display()
                ),
            ));
        }
        let is_ca = parsed
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|bc| bc.value.ca);
        if !is_ca {
            return Err(TlsError::bad_file(
                cert_path,
                "not a CA certificate (no basicConstraints CA:TRUE): --signing-ca-cert must be \
                 the CA, or an intermediate CA, that agents' certificates are issued from",
            ));
        }
        let bundle = read_certs(ca_bundle)?;
        let in_bundle = bundle.iter().any(|c| c.as_ref() == der.as_ref());
        let signed_by_bundle = bundle.iter().any(|c| {
            parse_der(c).is_ok_and(|ca| parsed.verify_signature(Some(ca.public_key())).is_ok())
        });
        if !in_bundle && !signed_by_bundle {
            return Err(TlsError::bad_file(
                cert_path,
                format!(
                    "the signing CA {:?} does not chain to the CA bundle {} that the coordinator \
                     verifies agents with: agents it enrolled would be refused. Give the CA of \
                     --ca (or an intermediate it signed), or add this CA to --ca",
                    parsed.subject().to_string(),
                    ca_bundle.display()
                ),
            ));
        }
        let issuer = Issuer::from_ca_cert_der(der, key).map_err(|e| {
            TlsError::bad_file(cert_path, format!("cannot use it as a CA certificate: {e}"))
        })?;
        Ok(Self {
            issuer,
            intermediate_pem: (!in_bundle).then(|| pem_cert(der)),
            cert_path: cert_path.to_path_buf(),
        })
    }

    /// Issues an agent certificate for `host_id` with `labels`, valid `ttl` from now, for the
    /// key of `csr_der`. Only the key of the request is used; a request naming another
    /// toolsrv identity is refused.
    pub fn issue_agent(
        &self,
        csr_der: &[u8],
        host_id: &str,
        labels: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<Issued, EnrollError> {
        let identity = Identity::agent(host_id).map_err(|e| EnrollError::Invalid(e.to_string()))?;
        let csr = parse_csr(csr_der)?;
        for san in &csr.params.subject_alt_names {
            if let SanType::URI(uri) = san {
                let uri = uri.as_str();
                if uri.starts_with(URI_SCHEME) && !uri.starts_with(LABEL_URI_PREFIX) {
                    match Identity::parse_uri(uri) {
                        Ok(asked) if asked == identity => {}
                        _ => {
                            return Err(EnrollError::Denied(format!(
                                "the certificate request asks for {uri}, but this host may only \
                                 be {}",
                                identity.uri()
                            )));
                        }
                    }
                }
            }
        }
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "toolsrv");
        dn.push(DnType::CommonName, identity.to_string());
        params.distinguished_name = dn;
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let mut sans = vec![uri_san(&identity.uri())?];
        if labels.len() > MAX_CERT_LABELS {
            return Err(EnrollError::Invalid(format!(
                "{} labels, over the limit of {MAX_CERT_LABELS}",
                labels.len()
            )));
        }
        for (k, v) in labels {
            check_label(k, v).map_err(EnrollError::Invalid)?;
            sans.push(uri_san(&label_uri(k, v))?);
        }
        params.subject_alt_names = sans;
        // The coordinator is the only party that checks an agent certificate, against its own
        // clock: no back-dating, so that a short lifetime stays what it says.
        let now = crate::since_epoch();
        let epoch = rcgen::date_time_ymd(1970, 1, 1);
        params.not_before = epoch + Duration::from_secs(now.as_secs());
        params.not_after = epoch + Duration::from_secs(now.as_secs()) + ttl;
        params.serial_number = Some(random_serial()?);
        let cert = params
            .signed_by(&csr.public_key, &self.issuer)
            .map_err(|e| EnrollError::Internal(format!("cannot sign the certificate: {e}")))?;
        let mut chain_pem = cert.pem();
        if let Some(intermediate) = &self.intermediate_pem {
            chain_pem.push_str(intermediate);
        }
        let not_after =
            i64::try_from(now.as_secs().saturating_add(ttl.as_secs())).unwrap_or(i64::MAX);
        Ok(Issued {
            chain_pem,
            not_after,
        })
    }
}

fn uri_san(uri: &str) -> Result<SanType, EnrollError> {
    uri.to_string()
        .try_into()
        .map(SanType::URI)
        .map_err(|_| EnrollError::Invalid(format!("{uri:?} is not an ASCII URI")))
}

/// Parses a CSR and checks its signature (proof that the requester holds the key).
fn parse_csr(der: &[u8]) -> Result<CertificateSigningRequestParams, EnrollError> {
    if der.is_empty() {
        return Err(EnrollError::Invalid(
            "no certificate signing request (csr_der is empty)".into(),
        ));
    }
    if der.len() > 16 << 10 {
        return Err(EnrollError::Invalid(format!(
            "the certificate signing request has {} bytes, over the limit of 16 KiB",
            der.len()
        )));
    }
    CertificateSigningRequestParams::from_der(&der.to_vec().into()).map_err(|e| {
        EnrollError::Invalid(format!(
            "not a usable certificate signing request (PKCS#10 DER, signed with its key): {e}"
        ))
    })
}

fn random_serial() -> Result<SerialNumber, EnrollError> {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| EnrollError::Internal("no randomness for a serial number".into()))?;
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    Ok(SerialNumber::from_slice(&bytes))
}

/// A new join token: `tsj_` and 48 hex digits (192 random bits).
pub fn new_token() -> Result<String, TlsError> {
    Ok(format!("{TOKEN_PREFIX}{}", secret_hex(24, "a join token")?))
}

/// `bytes` bytes from the operating system's secure generator, in hex: a secret `what` is made
/// of.
pub fn secret_hex(bytes: usize, what: &str) -> Result<String, TlsError> {
    let mut buf = vec![0u8; bytes];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut buf)
        .map_err(|_| TlsError::Connect(format!("no randomness available for {what}")))?;
    Ok(hex(&buf))
}

/// How every join token starts.
pub const TOKEN_PREFIX: &str = "tsj_";

/// The SHA-256 of a token, in hex: what the coordinator stores instead of the token.
pub fn token_digest(token: &str) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, token.as_bytes()).as_ref())
}

/// `YYYY-MM-DD HH:MM:SS` of Unix seconds, for messages.
pub fn utc(unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// Parses a duration such as `90s`, `15m`, `1h`, `1h30m`, `7d`, `2w` (a bare number is seconds;
/// `0` is zero). Every duration flag of toolsrv reads this grammar.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || {
        format!(
            "{text:?} is not a duration: use a number with s, m, h, d or w (`90s`, `1h30m`, `7d`)"
        )
    };
    let text = text.trim();
    if text.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total: u64 = 0;
    let mut number = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            'w' => 7 * 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = number.parse().map_err(|_| bad())?;
        number.clear();
        total = n
            .checked_mul(unit)
            .and_then(|s| total.checked_add(s))
            .ok_or_else(bad)?;
    }
    if !number.is_empty() {
        return Err(bad());
    }
    Ok(Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn durations() {
        for (text, secs) in [
            ("90s", 90),
            ("90", 90),
            ("15m", 900),
            ("1h", 3600),
            ("1h30m", 5400),
            ("7d", 604_800),
            ("24h", 86_400),
            ("2w", 1_209_600),
            ("0", 0),
        ] {
            assert_eq!(
                parse_duration(text).unwrap(),
                Duration::from_secs(secs),
                "{text}"
            );
        }
        for bad in [
            "",
            "h",
            "1x",
            "1h30",
            "-1s",
            "1.5h",
            "7y",
            "99999999999999999999d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(1_700_000_000), "2023-11-14 22:13:20");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
    }

    #[test]
    fn label_uris_round_trip() {
        for (k, v) in [("role", "db"), ("team/owner", "a b&c=d%é"), ("empty", "")] {
            let uri = label_uri(k, v);
            assert!(uri.is_ascii(), "{uri}");
            assert_eq!(
                parse_label_uri(&uri).unwrap(),
                (k.to_string(), v.to_string())
            );
        }
        assert!(parse_label_uri("toolsrv://label/bad key=x").is_err());
        assert!(parse_label_uri("toolsrv://label/k=%zz").is_err());
        assert!(parse_label_uri("toolsrv://label/novalue").is_err());
    }

    #[test]
    fn pins() {
        assert!(parse_pin("sha256:abc").is_err());
        assert!(parse_pin(&format!("md5:{}", "a".repeat(64))).is_err());
        let upper = format!("sha256:{}", "AB".repeat(32));
        assert_eq!(parse_pin(&upper).unwrap(), upper.to_ascii_lowercase());
    }

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn tokens_are_long_and_stored_hashed() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX) && a.len() == TOKEN_PREFIX.len() + 48);
        assert_eq!(token_digest(&a).len(), 64);
        assert_ne!(token_digest(&a), token_digest(&b));
    }
}
