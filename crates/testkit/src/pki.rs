//! A development PKI for tests (`toolsrv_tls::init`, as `toolsrv pki init` writes it), and
//! certificates signed outside its rules, as another CA might issue them.

use std::path::{Path, PathBuf};

use toolsrv_tls::{Identity, PkiOptions, TlsFiles};

use crate::error::{Result, TestkitError, must};

/// Writes a development PKI into `dir`: the CA, the coordinator, and an agent certificate per
/// host id of `agents` and a client certificate per name of `clients`.
pub fn write_pki(dir: &Path, agents: &[&str], clients: &[&str]) -> Result<()> {
    let mut opts = PkiOptions::new(dir);
    opts.agents = agents.iter().map(|a| a.to_string()).collect();
    opts.clients = clients.iter().map(|c| c.to_string()).collect();
    toolsrv_tls::init(&opts)?;
    Ok(())
}

/// Signs a certificate with the CA of the PKI in `dir`, with exactly these SANs and extended
/// key usages (none of `init`'s rules), and writes `<stem>.pem` and `<stem>-key.pem`.
pub fn sign_with_ca(
    dir: &Path,
    stem: &str,
    sans: Vec<rcgen::SanType>,
    ekus: Vec<rcgen::ExtendedKeyUsagePurpose>,
) -> Result<TlsFiles> {
    sign_with_ca_until(dir, stem, sans, ekus, None)
}

/// [`sign_with_ca`] with the certificate valid from now until `not_after` (rcgen's default
/// validity when `None`).
pub fn sign_with_ca_until(
    dir: &Path,
    stem: &str,
    sans: Vec<rcgen::SanType>,
    ekus: Vec<rcgen::ExtendedKeyUsagePurpose>,
    not_after: Option<std::time::SystemTime>,
) -> Result<TlsFiles> {
    let dates = not_after.map(|not_after| (std::time::SystemTime::now(), not_after));
    sign_with_ca_between(dir, stem, sans, ekus, dates)
}

/// [`sign_with_ca`] with the certificate valid from `dates.0` until `dates.1` (rcgen's default
/// validity when `None`): dates in the past or the future make an expired certificate, or
/// one not valid yet.
pub fn sign_with_ca_between(
    dir: &Path,
    stem: &str,
    sans: Vec<rcgen::SanType>,
    ekus: Vec<rcgen::ExtendedKeyUsagePurpose>,
    dates: Option<(std::time::SystemTime, std::time::SystemTime)>,
) -> Result<TlsFiles> {
    let failed = |reason: String| TestkitError::Certificate {
        stem: stem.to_string(),
        reason,
    };
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path)
            .map_err(|e| TestkitError::io(format!("cannot read {}", path.display()), e))
    };
    let ca_key = rcgen::KeyPair::from_pem(&read("ca-key.pem")?)
        .map_err(|e| failed(format!("the CA key: {e}")))?;
    let issuer = rcgen::Issuer::from_ca_cert_pem(&read("ca.pem")?, ca_key)
        .map_err(|e| failed(format!("the CA certificate: {e}")))?;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .map_err(|e| failed(format!("a key: {e}")))?;
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = sans;
    params.extended_key_usages = ekus;
    if let Some((not_before, not_after)) = dates {
        params.not_before = not_before.into();
        params.not_after = not_after.into();
    }
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|e| failed(e.to_string()))?;
    let files = stem_files(dir, stem);
    std::fs::write(&files.cert, cert.pem())
        .map_err(|e| TestkitError::io(format!("cannot write {}", files.cert.display()), e))?;
    write_key(&files.key, &key.serialize_pem())?;
    Ok(files)
}

/// Writes a private key as `toolsrv pki` does: mode 0600 (a key others may read is refused).
pub fn write_key(path: &Path, pem: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(pem.as_bytes()))
        .map_err(|e| TestkitError::io(format!("cannot write {}", path.display()), e))
}

/// The CA, certificate and key of certificate `stem` (`agent-web-1`, `client-alice`) in `dir`.
pub fn stem_files(dir: &Path, stem: &str) -> TlsFiles {
    TlsFiles {
        ca: dir.join(toolsrv_tls::CA_CERT),
        cert: dir.join(format!("{stem}.pem")),
        key: dir.join(format!("{stem}-key.pem")),
    }
}

/// `--ca/--cert/--key`, as `toolsrv` and `toolctl` take them.
pub fn tls_args(files: &TlsFiles) -> Vec<String> {
    vec![
        format!("--ca={}", files.ca.display()),
        format!("--cert={}", files.cert.display()),
        format!("--key={}", files.key.display()),
    ]
}

/// A URI SAN naming `identity`, as `init` writes it.
pub fn uri_san(identity: &Identity) -> Result<rcgen::SanType> {
    let uri = identity.uri();
    let san = uri
        .as_str()
        .try_into()
        .map_err(|e| TestkitError::Certificate {
            stem: uri.clone(),
            reason: format!("not a URI SAN: {e}"),
        })?;
    Ok(rcgen::SanType::URI(san))
}

/// A development PKI in a temporary directory, removed on drop.
#[derive(Debug)]
pub struct Pki {
    pub dir: tempfile::TempDir,
}

impl Pki {
    /// A PKI with agent certificates for `agents` and client certificates for `clients`.
    pub fn try_new(agents: &[&str], clients: &[&str]) -> Result<Self> {
        let dir = tempfile::tempdir()
            .map_err(|e| TestkitError::io("cannot make a temporary directory", e))?;
        write_pki(dir.path(), agents, clients)?;
        Ok(Self { dir })
    }

    /// [`Pki::try_new`], failing the test on error.
    #[track_caller]
    pub fn new(agents: &[&str], clients: &[&str]) -> Self {
        must(Self::try_new(agents, clients))
    }

    /// The PKI directory.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// The files of `identity`.
    pub fn files(&self, identity: &Identity) -> TlsFiles {
        TlsFiles::in_dir(self.root(), identity)
    }

    /// `--ca/--cert/--key` for a certificate stem such as `agent-web-1` or `client-alice`.
    pub fn tls_args(&self, stem: &str) -> Vec<String> {
        tls_args(&stem_files(self.root(), stem))
    }

    /// Writes `<stem>.pem` and `<stem>-key.pem`: a clientAuth certificate from this PKI's CA
    /// whose identity URI is `uri` exactly as given (`init` would write the name lowercase),
    /// as another CA might issue it.
    pub fn try_issue_raw(&self, stem: &str, uri: &str) -> Result<TlsFiles> {
        let san = uri.try_into().map_err(|e| TestkitError::Certificate {
            stem: stem.to_string(),
            reason: format!("{uri} is not a URI SAN: {e}"),
        })?;
        sign_with_ca(
            self.root(),
            stem,
            vec![rcgen::SanType::URI(san)],
            vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        )
    }

    /// [`Pki::try_issue_raw`], failing the test on error.
    #[track_caller]
    pub fn issue_raw(&self, stem: &str, uri: &str) {
        must(self.try_issue_raw(stem, uri));
    }

    /// Writes `client-<name>.pem` and its key: a client certificate from this PKI's CA that
    /// expires `lifetime` from now.
    #[track_caller]
    pub fn issue_client_expiring(&self, name: &str, lifetime: std::time::Duration) {
        let uri = format!("toolsrv://client/{name}");
        let san = must(
            uri.as_str()
                .try_into()
                .map_err(|e| TestkitError::Certificate {
                    stem: name.to_string(),
                    reason: format!("{uri} is not a URI SAN: {e}"),
                }),
        );
        must(sign_with_ca_until(
            self.root(),
            &format!("client-{name}"),
            vec![rcgen::SanType::URI(san)],
            vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
            Some(std::time::SystemTime::now() + lifetime),
        ));
    }

    /// Writes the certificate of `identity` (a client, an agent or the coordinator, as this
    /// PKI names their files) and its key anew, from this PKI's CA, valid from `dates.0` to
    /// `dates.1`: one issued in the past, in the last part of its life.
    #[track_caller]
    pub fn issue_between(
        &self,
        identity: &toolsrv_tls::Identity,
        dates: (std::time::SystemTime, std::time::SystemTime),
    ) {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let mut sans = vec![must(uri_san(identity))];
        let mut ekus = vec![ClientAuth];
        if *identity == toolsrv_tls::Identity::Coordinator {
            sans.push(rcgen::SanType::IpAddress([127, 0, 0, 1].into()));
            ekus.push(ServerAuth);
        }
        let stem = toolsrv_tls::TlsFiles::in_dir(self.root(), identity);
        let stem = stem
            .cert
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        must(sign_with_ca_between(
            self.root(),
            &stem,
            sans,
            ekus,
            Some(dates),
        ));
    }
}

/// The CA pin (`sha256:HEX`) that `toolctl token create` prints on stderr.
#[track_caller]
pub fn ca_pin_in(stderr: &str) -> String {
    stderr
        .split_whitespace()
        .find(|w| w.starts_with("sha256:"))
        .unwrap_or_else(|| panic!("no CA pin (sha256:...) in: {stderr}"))
        .trim_end_matches([',', ';'])
        .to_string()
}
