//! Development PKI: a local CA and the certificates `toolsrv pki init` writes.
//!
//! Everything is additive: an existing CA is reused and existing files are
//! never overwritten, so running `init` again with one more agent only adds
//! that agent's certificate.

use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::{Identity, TlsError, TlsFiles, normalize_name};

/// Certificates are valid this many days unless told otherwise (the
/// longest lifetime Apple platforms accept for a server certificate).
pub const DEFAULT_VALID_DAYS: u32 = 825;

/// Longest validity we accept, so date arithmetic cannot overflow.
const MAX_VALID_DAYS: u32 = 36_500;

/// The CA outlives the certificates it signs by at least this much.
const MIN_CA_DAYS: u32 = 3650;

/// CA certificate file name inside a PKI directory.
pub const CA_CERT: &str = "ca.pem";
/// CA private key file name inside a PKI directory.
pub const CA_KEY: &str = "ca-key.pem";

/// What `toolsrv pki init` asks for.
#[derive(Debug, Clone)]
pub struct PkiOptions {
    /// Directory holding the CA and every certificate; created 0700 if missing.
    pub dir: PathBuf,
    /// Host ids to issue agent certificates for (written in lowercase).
    pub agents: Vec<String>,
    /// Names to issue client certificates for (written in lowercase).
    pub clients: Vec<String>,
    /// Extra DNS names or IP addresses for the coordinator certificate,
    /// besides `localhost`, `127.0.0.1` and `::1`.
    pub coordinator_names: Vec<String>,
    /// Lifetime of the issued certificates, in days.
    pub valid_days: u32,
}

impl PkiOptions {
    /// Options for `dir` with no agents or clients and the default lifetime.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            agents: Vec::new(),
            clients: Vec::new(),
            coordinator_names: Vec::new(),
            valid_days: DEFAULT_VALID_DAYS,
        }
    }
}

/// The base file name (without `.pem`) of an identity's certificate:
/// `coordinator`, `agent-<id>` or `client-<name>`, the name in lowercase.
pub fn file_stem(identity: &Identity) -> String {
    match identity {
        Identity::Coordinator => "coordinator".to_string(),
        Identity::Agent(id) => format!("agent-{}", normalize_name(id)),
        Identity::Client(name) => format!("client-{}", normalize_name(name)),
    }
}

impl TlsFiles {
    /// The CA, certificate and key files of `identity` in a PKI directory
    /// written by [`init`].
    pub fn in_dir(dir: &Path, identity: &Identity) -> Self {
        let stem = file_stem(identity);
        Self {
            ca: dir.join(CA_CERT),
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}-key.pem")),
        }
    }
}

/// Creates (or completes) a development PKI in `opts.dir` and returns the
/// files it wrote; files that already exist are left untouched.
pub fn init(opts: &PkiOptions) -> Result<Vec<PathBuf>, TlsError> {
    check_days(opts.valid_days)?;
    // Validate everything before writing anything.
    let mut identities = vec![Identity::Coordinator];
    for id in &opts.agents {
        identities.push(Identity::agent(id)?);
    }
    for name in &opts.clients {
        identities.push(Identity::client(name)?);
    }
    for name in &opts.coordinator_names {
        parse_extra_name(name)?;
    }

    ensure_dir(&opts.dir)?;
    let mut written = Vec::new();
    let ca = load_or_create_ca(&opts.dir, opts.valid_days, &mut written)?;
    for identity in &identities {
        let extra: &[String] = if *identity == Identity::Coordinator {
            &opts.coordinator_names
        } else {
            &[]
        };
        written.extend(issue_with(
            &ca,
            &opts.dir,
            identity,
            extra,
            opts.valid_days,
        )?);
    }
    Ok(written)
}

/// Issues a certificate for `identity` signed by the CA in `dir` (which
/// must exist) and returns the files written: none if the certificate and
/// key are already there. `extra_names` are added as DNS or IP SANs.
pub fn issue(
    dir: &Path,
    identity: &Identity,
    extra_names: &[String],
) -> Result<Vec<PathBuf>, TlsError> {
    // The same identity in its one spelling (names lowercase), whatever the caller built.
    let identity = &match identity {
        Identity::Coordinator => Identity::Coordinator,
        Identity::Agent(id) => Identity::agent(id)?,
        Identity::Client(name) => Identity::client(name)?,
    };
    for name in extra_names {
        parse_extra_name(name)?;
    }
    let ca = load_ca(dir)?.ok_or_else(|| {
        TlsError::bad_file(
            &dir.join(CA_CERT),
            "no CA certificate and key here: run `toolsrv pki init` first",
        )
    })?;
    issue_with(&ca, dir, identity, extra_names, DEFAULT_VALID_DAYS)
}

fn check_days(days: u32) -> Result<(), TlsError> {
    if (1..=MAX_VALID_DAYS).contains(&days) {
        Ok(())
    } else {
        Err(TlsError::InvalidName {
            what: "validity",
            value: days.to_string(),
            msg: format!("use 1 to {MAX_VALID_DAYS} days"),
        })
    }
}

/// Creates `dir` (0700) if needed, and refuses one that another user owns or may write, or
/// that lies under a directory another user may change: they could put a CA of theirs in it
/// between two runs, and every certificate issued after would be signed by it.
fn ensure_dir(dir: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::MetadataExt;
    crate::files::check_before_creating(dir).map_err(|why| TlsError::bad_file(dir, why))?;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| TlsError::io("cannot create directory", dir, e))?;
    crate::files::check_owned_dir(dir).map_err(|why| TlsError::bad_file(dir, why))?;
    let md = fs::metadata(dir).map_err(|e| TlsError::io("cannot look at", dir, e))?;
    if crate::files::writable_by_others(&md) {
        return Err(TlsError::bad_file(
            dir,
            format!(
                "mode {:04o} lets other users write it, who could put a CA of theirs in it: \
                 chmod go-w {}",
                md.mode() & 0o7777,
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// A DNS name or IP address for the coordinator certificate.
fn parse_extra_name(name: &str) -> Result<SanType, TlsError> {
    let trimmed = name.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = trimmed.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let bad = |msg: &str| TlsError::InvalidName {
        what: "coordinator name",
        value: name.to_string(),
        msg: msg.to_string(),
    };
    if name.is_empty() || name.len() > 253 {
        return Err(bad(
            "use a DNS name of 1 to 253 characters or an IP address",
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '*'))
        || name.starts_with('.')
        || name.starts_with('-')
        || name.contains("..")
    {
        return Err(bad(
            "not a DNS name or IP address: use letters, digits, '-' and '.' (e.g. coord.example.com)",
        ));
    }
    let ia5 = name
        .to_string()
        .try_into()
        .map_err(|_| bad("not an ASCII DNS name"))?;
    Ok(SanType::DnsName(ia5))
}

/// The validity window of a certificate issued now: from one day ago (clock
/// skew between hosts) to `days` from now.
fn validity(params: &mut CertificateParams, days: u32) {
    let now = crate::since_epoch();
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    let day = Duration::from_secs(86_400);
    params.not_before = epoch + now.saturating_sub(day);
    params.not_after = epoch + now + day * days;
}

fn gen_key(what: &str) -> Result<KeyPair, TlsError> {
    KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|source| TlsError::Generate {
        what: format!("the {what} key"),
        source,
    })
}

fn ca_params(days: u32) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "toolsrv");
    dn.push(DnType::CommonName, "toolsrv development CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, days.max(MIN_CA_DAYS));
    params
}

type Ca = Issuer<'static, KeyPair>;

fn read_text(path: &Path) -> Result<String, TlsError> {
    crate::files::read_text_bounded(path, crate::files::MAX_PEM_BYTES)
        .map_err(|e| TlsError::io("cannot read", path, e))
}

/// Loads the CA of `dir`; `None` if neither of its files exists.
fn load_ca(dir: &Path) -> Result<Option<Ca>, TlsError> {
    let cert_path = dir.join(CA_CERT);
    let key_path = dir.join(CA_KEY);
    match (cert_path.exists(), key_path.exists()) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (true, false) => {
            return Err(TlsError::bad_file(
                &key_path,
                format!(
                    "missing while {} exists: restore the CA key or move the CA certificate away",
                    cert_path.display()
                ),
            ));
        }
        (false, true) => {
            return Err(TlsError::bad_file(
                &cert_path,
                format!(
                    "missing while {} exists: restore the CA certificate or move the CA key away",
                    key_path.display()
                ),
            ));
        }
    }
    let cert_pem = read_text(&cert_path)?;
    let key = KeyPair::from_pem(&crate::files::read_private_key(&key_path)?)
        .map_err(|e| TlsError::bad_file(&key_path, format!("not a usable PEM private key: {e}")))?;
    let cert_der = crate::config::read_certs(&cert_path)?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::bad_file(&cert_path, "no certificate in it"))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&cert_der).map_err(|e| {
        TlsError::bad_file(&cert_path, format!("cannot parse the certificate: {e}"))
    })?;
    if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err(TlsError::bad_file(
            &key_path,
            format!(
                "this key does not belong to the CA certificate {}: restore the matching pair",
                cert_path.display()
            ),
        ));
    }
    let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| {
        TlsError::bad_file(
            &cert_path,
            format!("cannot use it as a CA certificate: {e}"),
        )
    })?;
    Ok(Some(issuer))
}

fn load_or_create_ca(dir: &Path, days: u32, written: &mut Vec<PathBuf>) -> Result<Ca, TlsError> {
    if let Some(ca) = load_ca(dir)? {
        return Ok(ca);
    }
    let key = gen_key("CA")?;
    let params = ca_params(days);
    let cert = params
        .self_signed(&key)
        .map_err(|source| TlsError::Generate {
            what: "the CA certificate".into(),
            source,
        })?;
    let key_path = dir.join(CA_KEY);
    let cert_path = dir.join(CA_CERT);
    write_new(&key_path, &key.serialize_pem(), 0o600)?;
    written.push(key_path);
    write_new(&cert_path, &cert.pem(), 0o644)?;
    written.push(cert_path);
    Ok(Issuer::new(params, key))
}

fn leaf_params(
    identity: &Identity,
    extra: &[String],
    days: u32,
) -> Result<CertificateParams, TlsError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "toolsrv");
    dn.push(DnType::CommonName, identity.to_string());
    params.distinguished_name = dn;
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    validity(&mut params, days);

    let uri = identity
        .uri()
        .try_into()
        .map_err(|_| TlsError::InvalidName {
            what: "identity URI",
            value: identity.uri(),
            msg: "not ASCII".into(),
        })?;
    let mut sans = vec![SanType::URI(uri)];
    if *identity == Identity::Coordinator {
        let defaults = ["localhost", "127.0.0.1", "::1"];
        for name in defaults
            .iter()
            .copied()
            .chain(extra.iter().map(String::as_str))
        {
            let san = parse_extra_name(name)?;
            if !sans.contains(&san) {
                sans.push(san);
            }
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            // Harmless, and lets a coordinator dial another coordinator.
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
    } else {
        for name in extra {
            let san = parse_extra_name(name)?;
            if !sans.contains(&san) {
                sans.push(san);
            }
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    }
    params.subject_alt_names = sans;
    Ok(params)
}

fn issue_with(
    ca: &Ca,
    dir: &Path,
    identity: &Identity,
    extra: &[String],
    days: u32,
) -> Result<Vec<PathBuf>, TlsError> {
    let files = TlsFiles::in_dir(dir, identity);
    match (files.cert.exists(), files.key.exists()) {
        (true, true) if *identity == Identity::Coordinator && !extra.is_empty() => {
            return widen_coordinator(ca, &files, extra, days);
        }
        (true, true) => return Ok(Vec::new()),
        (false, false) => {}
        (true, false) | (false, true) => {
            let (present, absent) = if files.cert.exists() {
                (&files.cert, &files.key)
            } else {
                (&files.key, &files.cert)
            };
            return Err(TlsError::bad_file(
                absent,
                format!(
                    "missing while {} exists: remove {} to have both issued again",
                    present.display(),
                    present.display()
                ),
            ));
        }
    }
    let key = gen_key(&identity.to_string())?;
    let cert = leaf_params(identity, extra, days)?
        .signed_by(&key, ca)
        .map_err(|source| TlsError::Generate {
            what: format!("the certificate of {identity}"),
            source,
        })?;
    // Key first: a crash in between leaves a key without a certificate,
    // which the next run reports instead of silently reissuing.
    write_new(&files.key, &key.serialize_pem(), 0o600)?;
    write_new(&files.cert, &cert.pem(), 0o644)?;
    Ok(vec![files.cert, files.key])
}

/// The coordinator's certificate issued again, with its key, when it lacks a name of `extra`:
/// with every name it had and those, so that `pki init DIR --coordinator-names NAME` run again
/// adds NAME rather than saying there is nothing to write. The key stays; a running
/// coordinator picks the new certificate up as any renewed one.
fn widen_coordinator(
    ca: &Ca,
    files: &TlsFiles,
    extra: &[String],
    days: u32,
) -> Result<Vec<PathBuf>, TlsError> {
    let der = crate::config::read_certs(&files.cert)?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::bad_file(&files.cert, "no certificate in it"))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&der).map_err(|e| {
        TlsError::bad_file(&files.cert, format!("cannot parse the certificate: {e}"))
    })?;
    let mut names: Vec<String> = Vec::new();
    if let Ok(Some(san)) = parsed.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => names.push(dns.to_string()),
                x509_parser::extensions::GeneralName::IPAddress(bytes) => {
                    let ip = match bytes.len() {
                        4 => <[u8; 4]>::try_from(*bytes).map(IpAddr::from).ok(),
                        16 => <[u8; 16]>::try_from(*bytes).map(IpAddr::from).ok(),
                        _ => None,
                    };
                    names.extend(ip.map(|ip| ip.to_string()));
                }
                _ => {}
            }
        }
    }
    let have: Vec<SanType> = names
        .iter()
        .filter_map(|n| parse_extra_name(n).ok())
        .collect();
    let mut missing = false;
    for name in extra {
        if !have.contains(&parse_extra_name(name)?) {
            missing = true;
            names.push(name.clone());
        }
    }
    if !missing {
        return Ok(Vec::new());
    }
    let key = KeyPair::from_pem(&crate::files::read_private_key(&files.key)?).map_err(|e| {
        TlsError::bad_file(&files.key, format!("not a usable PEM private key: {e}"))
    })?;
    let cert = leaf_params(&Identity::Coordinator, &names, days)?
        .signed_by(&key, ca)
        .map_err(|source| TlsError::Generate {
            what: "the coordinator's certificate".into(),
            source,
        })?;
    write_atomically(&files.cert, cert.pem().as_bytes())
        .and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&files.cert, fs::Permissions::from_mode(0o644))
        })
        .map_err(|e| TlsError::io("cannot write", &files.cert, e))?;
    Ok(vec![files.cert.clone()])
}

/// Replaces `path` with `bytes` (mode 0600) so that a reader sees the old or the new content,
/// never a mix, and the new content is on disk when this returns.
///
/// The temporary file beside it is made new: whatever is at its name is removed first (a
/// symbolic link itself, never what it leads to), and a file that appears there in between is
/// an error. Opening an existing name instead would write through a link another user left
/// there onto the file it leads to, or into a file that user can still write.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// Writes a file that must not exist yet, with `mode` from the start (no
/// window where a key is world-readable).
fn write_new(path: &Path, contents: &str, mode: u32) -> Result<(), TlsError> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| TlsError::io("cannot create", path, e))?;
    f.write_all(contents.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| TlsError::io("cannot write", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_names() {
        assert!(matches!(
            parse_extra_name("10.0.0.1"),
            Ok(SanType::IpAddress(_))
        ));
        assert!(matches!(
            parse_extra_name("[::1]"),
            Ok(SanType::IpAddress(_))
        ));
        assert!(matches!(
            parse_extra_name("coord.example.com"),
            Ok(SanType::DnsName(_))
        ));
        for bad in ["", "a b", "-x", ".x", "a..b", "http://x", "é.example"] {
            assert!(parse_extra_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn days_bounds() {
        assert!(check_days(0).is_err());
        assert!(check_days(1).is_ok());
        assert!(check_days(MAX_VALID_DAYS).is_ok());
        assert!(check_days(MAX_VALID_DAYS + 1).is_err());
    }
}
