//! Loading PEM credentials and building the rustls server and client configs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::crl::Crls;
use crate::usage::{ClientAuthVerifier, Usage};
use crate::{Identity, Role, TlsError, identity_of};

/// The ALPN protocol both sides insist on: gRPC runs over HTTP/2 only.
const ALPN_H2: &[u8] = b"h2";

/// Where one party's credentials live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM file with the CA certificate(s) peers must chain to.
    pub ca: PathBuf,
    /// PEM file with our certificate (leaf first, optionally followed by
    /// intermediates).
    pub cert: PathBuf,
    /// PEM file with our private key (PKCS#8, SEC1 or PKCS#1).
    pub key: PathBuf,
}

/// The ring provider, always passed explicitly so a second provider
/// compiled in by some other dependency cannot make config building fail.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Installs ring as the process-wide default rustls provider, for libraries
/// that build their own configs. Call first thing in `main`; calling it
/// again, or after someone else installed one, is harmless.
pub fn install_crypto_provider() {
    // Err only means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// What is wrong with a PEM file, as text: the library's own message shows the lines it quotes
/// as lists of byte values (`missing section end marker: [45, 45, ...]`).
pub(crate) fn pem_problem(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error;
    let line = |bytes: &[u8]| {
        String::from_utf8_lossy(bytes)
            .escape_debug()
            .take(80)
            .collect::<String>()
    };
    match e {
        Error::MissingSectionEnd { end_marker } => {
            format!(
                "no `-----END {}-----` line: the file is cut short",
                line(end_marker)
            )
        }
        Error::IllegalSectionStart { line: start } => {
            format!("a malformed `-----BEGIN` line: `{}`", line(start))
        }
        other => other.to_string(),
    }
}

/// Reads every certificate of a PEM file; an error if there is none.
pub(crate) fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = crate::files::read_bounded(path, crate::files::MAX_PEM_BYTES)
        .map_err(|e| TlsError::io("cannot read", path, e))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            TlsError::bad_file(
                path,
                format!("not a valid PEM certificate file: {}", pem_problem(&e)),
            )
        })?;
    if certs.is_empty() {
        return Err(TlsError::bad_file(
            path,
            "no certificate in it: expected a -----BEGIN CERTIFICATE----- block",
        ));
    }
    Ok(certs)
}

/// The identity the first certificate of a PEM file names, for checks at start-up (an agent
/// whose certificate names another host cannot attach, however long it retries).
pub fn certificate_identity(path: &Path) -> Result<Identity, TlsError> {
    let certs = read_certs(path)?;
    identity_of(&certs[0]).map_err(|e| TlsError::bad_file(path, e.to_string()))
}

/// When the certificates of a PEM file expire, as seconds since the Unix epoch: the first
/// (leaf) certificate's and the earliest of all of them (a CA bundle's first to lapse).
pub fn certificate_expiry(path: &Path) -> Result<CertificateExpiry, TlsError> {
    let certs = read_certs(path)?;
    let mut expiry = CertificateExpiry {
        leaf: i64::MAX,
        earliest: i64::MAX,
    };
    for (i, der) in certs.iter().enumerate() {
        let not_after = parse(der, path)?.validity().not_after.timestamp();
        if i == 0 {
            expiry.leaf = not_after;
        }
        expiry.earliest = expiry.earliest.min(not_after);
    }
    Ok(expiry)
}

/// See [`certificate_expiry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CertificateExpiry {
    /// The first certificate's `notAfter`.
    pub leaf: i64,
    /// The earliest `notAfter` in the file.
    pub earliest: i64,
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let text = crate::files::read_private_key(path)?;
    PrivateKeyDer::from_pem_slice(text.as_bytes()).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::bad_file(
            path,
            "no private key in it: expected a -----BEGIN PRIVATE KEY----- block",
        ),
        other => TlsError::bad_file(
            path,
            format!("not a valid PEM private key: {}", pem_problem(&other)),
        ),
    })
}

fn root_store(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots
            .add(cert)
            .map_err(|e| TlsError::bad_file(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// Our own credentials, checked before rustls sees them so errors name the
/// file and the problem.
struct Own {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    identity: Identity,
}

fn load_own(files: &TlsFiles, provider: &CryptoProvider) -> Result<Own, TlsError> {
    let certs = read_certs(&files.cert)?;
    let key = read_key(&files.key)?;
    CertifiedKey::from_der(certs.clone(), key.clone_key(), provider).map_err(|e| {
        let msg = match e {
            rustls::Error::InconsistentKeys(_) => format!(
                "this key does not match the certificate {}: use the key issued with it",
                files.cert.display()
            ),
            other => format!("unusable private key: {other}"),
        };
        TlsError::bad_file(&files.key, msg)
    })?;
    // rustls only checks the chain on the peer; checking here turns "peer
    // says unknown CA" into an error at start-up that names the files.
    check_signed_by_ca(&certs, &files.cert, &files.ca)?;
    let identity =
        identity_of(&certs[0]).map_err(|e| TlsError::bad_file(&files.cert, e.to_string()))?;
    Ok(Own {
        certs,
        key,
        identity,
    })
}

fn parse<'a>(
    der: &'a [u8],
    path: &Path,
) -> Result<x509_parser::certificate::X509Certificate<'a>, TlsError> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c)
        .map_err(|e| TlsError::bad_file(path, format!("cannot parse a certificate: {e}")))
}

/// Checks the leaf is signed by the next certificate of its own file or by
/// one of the CA certificates.
fn check_signed_by_ca(
    certs: &[CertificateDer<'static>],
    cert_path: &Path,
    ca_path: &Path,
) -> Result<(), TlsError> {
    let cas = read_certs(ca_path)?;
    let leaf = parse(&certs[0], cert_path)?;
    let mut issuers = Vec::new();
    if let Some(next) = certs.get(1) {
        issuers.push(parse(next, cert_path)?);
    }
    for ca in &cas {
        issuers.push(parse(ca, ca_path)?);
    }
    if issuers
        .iter()
        .any(|issuer| leaf.verify_signature(Some(issuer.public_key())).is_ok())
    {
        Ok(())
    } else {
        Err(TlsError::bad_file(
            cert_path,
            format!(
                "certificate {:?} is not signed by the CA in {}: issue it from that CA or point at its CA",
                leaf.subject().to_string(),
                ca_path.display()
            ),
        ))
    }
}

/// The coordinator's server config: a client certificate chained to the CA
/// and naming the clientAuth extended key usage is required, ALPN is `h2`,
/// and our own certificate must carry the coordinator identity and serverAuth.
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with(files, &Crls::default(), false)
}

/// [`server_config`] that also refuses client certificates `crls` revoke, and accepts peers that
/// present no certificate when `anonymous` (a host joining with a token has none yet).
///
/// A certificate whose issuer has no CRL among `crls` is accepted (the CRLs are for externally
/// issued certificates; a development CA has none), and a CRL past its nextUpdate still counts:
/// an old list of revoked certificates is better than none. A certificate that is presented is
/// verified all the same when `anonymous`; connections without one carry no
/// [`crate::PeerInfo`], so only services that need no identity serve them.
pub fn server_config_with(
    files: &TlsFiles,
    crls: &Crls,
    anonymous: bool,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let own = load_own(files, &provider)?;
    if own.identity != Identity::Coordinator {
        return Err(TlsError::bad_file(
            &files.cert,
            format!(
                "certificate is for {} but a server needs the coordinator identity ({}): use coordinator.pem",
                own.identity,
                Identity::Coordinator.uri()
            ),
        ));
    }
    Usage::ServerAuth
        .check(&own.certs[0])
        .map_err(|e| TlsError::bad_file(&files.cert, e))?;
    let roots = root_store(&files.ca)?;
    let mut builder = WebPkiClientVerifier::builder_with_provider(roots, provider.clone());
    if !crls.is_empty() {
        builder = builder
            .with_crls(crls.ders())
            .allow_unknown_revocation_status();
    }
    if anonymous {
        builder = builder.allow_unauthenticated();
    }
    let inner = builder.build().map_err(|e| {
        TlsError::bad_file(&files.ca, format!("cannot build a client verifier: {e}"))
    })?;
    let verifier = Arc::new(ClientAuthVerifier { inner });
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            side: "server",
            source,
        })?
        .with_client_cert_verifier(verifier)
        .with_single_cert(own.certs, own.key)
        .map_err(|source| TlsError::Config {
            side: "server",
            source,
        })?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// A client config presenting our certificate (which must name the clientAuth
/// extended key usage), verifying the server against the CA (host name
/// included, serverAuth named) and requiring its identity to have role `expect`.
pub fn client_config(files: &TlsFiles, expect: Role) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let own = load_own(files, &provider)?;
    Usage::ClientAuth
        .check(&own.certs[0])
        .map_err(|e| TlsError::bad_file(&files.cert, e))?;
    let roots = root_store(&files.ca)?;
    let inner = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| {
            TlsError::bad_file(&files.ca, format!("cannot build a server verifier: {e}"))
        })?;
    let verifier = Arc::new(RoleVerifier { inner, expect });
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            side: "client",
            source,
        })?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(own.certs, own.key)
        .map_err(|source| TlsError::Config {
            side: "client",
            source,
        })?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// A client config without a certificate of our own, verifying the server against the CA file
/// `ca` as [`client_config`] does: what a joining agent uses before it has a certificate.
pub fn anonymous_client_config(ca: &Path, expect: Role) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let roots = root_store(ca)?;
    let inner = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| TlsError::bad_file(ca, format!("cannot build a server verifier: {e}")))?;
    let verifier = Arc::new(RoleVerifier { inner, expect });
    without_client_auth(provider, verifier)
}

/// A client config for a server outside toolsrv's PKI (etcd): the server is verified against the
/// CA certificates in `ca` by ordinary web-PKI rules (chain, host name or IP address,
/// serverAuth), with no toolsrv identity expected; `identity` (certificate and key PEM files)
/// is presented when given. ALPN is `h2`.
pub fn web_pki_client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let roots = root_store(ca)?;
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            side: "client",
            source,
        })?
        .with_root_certificates(roots);
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let certs = read_certs(cert)?;
            let key_der = read_key(key)?;
            // Checked here so that a mismatch names the files instead of failing the handshake.
            CertifiedKey::from_der(certs.clone(), key_der.clone_key(), &provider).map_err(|e| {
                TlsError::bad_file(
                    key,
                    format!("unusable with the certificate {}: {e}", cert.display()),
                )
            })?;
            builder
                .with_client_auth_cert(certs, key_der)
                .map_err(|source| TlsError::Config {
                    side: "client",
                    source,
                })?
        }
    };
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// [`web_pki_client_config`] without a certificate of our own, speaking HTTP/1.1: what the
/// coordinator reaches the Kubernetes API with.
pub fn https_client_config(ca: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let mut config = Arc::unwrap_or_clone(web_pki_client_config(ca, None)?);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A client config that accepts any server certificate (the handshake's signatures are still
/// checked against it), without one of our own. Only for fetching a CA bundle that is checked
/// against a pin before anything trusts it: nothing secret may be sent over it.
pub fn unverified_client_config() -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let verifier = Arc::new(AnyServer {
        algorithms: provider.signature_verification_algorithms,
    });
    without_client_auth(provider, verifier)
}

/// A client config (h2) that verifies the server with `verifier` and has no certificate of its
/// own: what both configs of a joining agent share.
fn without_client_auth(
    provider: Arc<CryptoProvider>,
    verifier: Arc<dyn ServerCertVerifier>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            side: "client",
            source,
        })?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// See [`unverified_client_config`].
#[derive(Debug)]
struct AnyServer {
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The webpki server verifier plus a check of the leaf's role and of its serverAuth EKU.
#[derive(Debug)]
struct RoleVerifier {
    inner: Arc<WebPkiServerVerifier>,
    expect: Role,
}

impl ServerCertVerifier for RoleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let role_error = |msg: String| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(TlsError::Identity(msg)),
            )))
        };
        Usage::ServerAuth
            .check(end_entity)
            .map_err(|e| role_error(format!("server {server_name:?}: {e}")))?;
        match identity_of(end_entity) {
            Ok(id) if id.role() == self.expect => Ok(verified),
            Ok(id) => Err(role_error(format!(
                "server {server_name:?} presented the identity {id}, expected a {}",
                self.expect
            ))),
            Err(e) => Err(role_error(format!("server {server_name:?}: {e}"))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        self.inner.requires_raw_public_keys()
    }

    fn root_hint_subjects(&self) -> Option<&[rustls::DistinguishedName]> {
        self.inner.root_hint_subjects()
    }
}
