//! Certificate revocation lists (`--crl FILE`): certificates an external CA revoked by serial.
//!
//! The CRLs go to rustls's client verifier, which refuses a listed certificate at the
//! handshake; [`Crls::revokes`] answers the same question for connections already up, so that
//! a CRL that arrives later closes them too.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use rustls_pki_types::CertificateRevocationListDer;
use rustls_pki_types::pem::PemObject;

use crate::TlsError;

/// The CRLs of some files, parsed; empty when there are none.
#[derive(Debug, Clone, Default)]
pub struct Crls {
    ders: Vec<CertificateRevocationListDer<'static>>,
    /// Revoked serials (leading zero bytes stripped) by the issuer's raw DER name.
    revoked: HashMap<Vec<u8>, HashSet<Vec<u8>>>,
}

/// A serial number without the sign-padding zero bytes DER may put in front, so that the same
/// number compares equal however it was encoded.
fn serial_key(raw: &[u8]) -> Vec<u8> {
    let start = raw.iter().position(|b| *b != 0).unwrap_or(raw.len());
    raw[start..].to_vec()
}

impl Crls {
    /// Reads every CRL of `paths`: each file holds PEM blocks (`-----BEGIN X509 CRL-----`,
    /// several allowed) or one DER CRL. An error names the file if one cannot be read, holds no
    /// CRL, or holds one that does not parse.
    pub fn load(paths: &[PathBuf]) -> Result<Self, TlsError> {
        let mut crls = Crls::default();
        for path in paths {
            for der in read_crl_file(path)? {
                crls.add(path, der)?;
            }
        }
        Ok(crls)
    }

    fn add(
        &mut self,
        path: &Path,
        der: CertificateRevocationListDer<'static>,
    ) -> Result<(), TlsError> {
        let (_, crl) = x509_parser::parse_x509_crl(&der)
            .map_err(|e| TlsError::bad_file(path, format!("not a valid CRL: {e}")))?;
        let serials = self
            .revoked
            .entry(crl.issuer().as_raw().to_vec())
            .or_default();
        for revoked in crl.iter_revoked_certificates() {
            serials.insert(serial_key(revoked.raw_serial()));
        }
        self.ders.push(der);
        Ok(())
    }

    /// No CRL at all.
    pub fn is_empty(&self) -> bool {
        self.ders.is_empty()
    }

    /// How many CRLs there are.
    pub fn len(&self) -> usize {
        self.ders.len()
    }

    /// How many certificates they revoke, all issuers together.
    pub fn revoked_count(&self) -> usize {
        self.revoked.values().map(HashSet::len).sum()
    }

    /// The CRLs as rustls takes them.
    pub(crate) fn ders(&self) -> Vec<CertificateRevocationListDer<'static>> {
        self.ders.clone()
    }

    /// Whether a CRL of its issuer lists the certificate `cert_der` (matched by issuer name and
    /// serial, as the handshake's check does; the CRL's signature was checked when it was
    /// loaded into the verifier). An unparsable certificate is not revoked here: it never got
    /// through a handshake.
    pub fn revokes(&self, cert_der: &[u8]) -> bool {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert_der) else {
            return false;
        };
        self.revoked
            .get(cert.issuer().as_raw())
            .is_some_and(|serials| serials.contains(&serial_key(cert.raw_serial())))
    }
}

fn read_crl_file(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let bytes = crate::files::read_bounded(path, crate::files::MAX_CRL_BYTES)
        .map_err(|e| TlsError::io("cannot read", path, e))?;
    // DER starts with a SEQUENCE tag; anything else is taken for PEM.
    if bytes.first() == Some(&0x30) {
        return Ok(vec![CertificateRevocationListDer::from(bytes)]);
    }
    let crls = CertificateRevocationListDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            TlsError::bad_file(
                path,
                format!(
                    "not a valid PEM CRL file: {}",
                    crate::config::pem_problem(&e)
                ),
            )
        })?;
    if crls.is_empty() {
        return Err(TlsError::bad_file(
            path,
            "no CRL in it: expected -----BEGIN X509 CRL----- blocks or one DER CRL",
        ));
    }
    Ok(crls)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn serials_compare_without_padding() {
        assert_eq!(serial_key(&[0, 0x80, 1]), vec![0x80, 1]);
        assert_eq!(serial_key(&[0x7f]), vec![0x7f]);
        assert_eq!(serial_key(&[0]), Vec::<u8>::new());
    }

    #[test]
    fn garbage_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.crl");
        for content in [&b"not a crl"[..], b"", b"\x30\x03\x01\x01\x00"] {
            std::fs::write(&path, content).unwrap();
            let err = Crls::load(std::slice::from_ref(&path)).unwrap_err();
            assert!(err.to_string().contains("bad.crl"), "{err}");
        }
        assert!(Crls::load(&[dir.path().join("missing.crl")]).is_err());
        assert!(Crls::load(&[]).unwrap().is_empty());
    }
}
