//! Extended key usages: a certificate must say what it is for, clientAuth for agents and clients,
//! serverAuth for the coordinator.
//!
//! webpki refuses a certificate whose EKU extension lacks the purpose, but accepts one with no
//! EKU extension at all (RFC 5280: any purpose). A CA that issues for other purposes too would
//! then hand out certificates usable on both sides of a toolsrv link; we require the purpose
//! to be named.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use rustls_pki_types::{CertificateDer, UnixTime};

use crate::TlsError;

/// The purpose a certificate must name in its extended key usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Usage {
    /// TLS client authentication (`id-kp-clientAuth`): agents and clients.
    ClientAuth,
    /// TLS server authentication (`id-kp-serverAuth`): the coordinator.
    ServerAuth,
}

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Usage::ClientAuth => "clientAuth",
            Usage::ServerAuth => "serverAuth",
        })
    }
}

impl Usage {
    /// How cert-manager and most issuers spell it.
    fn spelled(self) -> &'static str {
        match self {
            Usage::ClientAuth => "client auth",
            Usage::ServerAuth => "server auth",
        }
    }

    /// Checks that the DER certificate names this purpose; the error says what it has instead
    /// and how to issue a usable one.
    pub(crate) fn check(self, cert_der: &[u8]) -> Result<(), String> {
        let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
            .map_err(|e| format!("cannot parse the certificate: {e}"))?;
        let subject = cert.subject().to_string();
        let eku = cert.extended_key_usage().map_err(|e| {
            format!("certificate {subject:?} has an unreadable extended key usage: {e}")
        })?;
        let has = match eku {
            None => {
                return Err(format!(
                    "certificate {subject:?} has no extended key usage: it must name {self}; \
                     issue it with `toolsrv pki init` or with the usage \"{}\"",
                    self.spelled()
                ));
            }
            Some(eku) => eku.value,
        };
        let ok = match self {
            Usage::ClientAuth => has.client_auth,
            Usage::ServerAuth => has.server_auth,
        };
        if ok {
            return Ok(());
        }
        let named: Vec<String> = [
            (has.server_auth, "serverAuth"),
            (has.client_auth, "clientAuth"),
            (has.code_signing, "codeSigning"),
            (has.email_protection, "emailProtection"),
            (has.time_stamping, "timeStamping"),
            (has.ocsp_signing, "OCSPSigning"),
            (has.any, "anyExtendedKeyUsage"),
        ]
        .into_iter()
        .filter(|&(set, _)| set)
        .map(|(_, name)| name.to_string())
        .chain(has.other.iter().map(ToString::to_string))
        .collect();
        Err(format!(
            "certificate {subject:?} is for {}, not {self}: issue it with `toolsrv pki init` or \
             with the usage \"{}\"",
            if named.is_empty() {
                "nothing".to_string()
            } else {
                named.join(", ")
            },
            self.spelled()
        ))
    }

    /// [`Usage::check`] as a rustls certificate error.
    pub(crate) fn check_peer(self, cert_der: &[u8]) -> Result<(), rustls::Error> {
        self.check(cert_der).map_err(|msg| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(TlsError::Identity(msg)),
            )))
        })
    }
}

/// A client verifier that also requires the clientAuth EKU of the client's certificate.
#[derive(Debug)]
pub(crate) struct ClientAuthVerifier {
    pub(crate) inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for ClientAuthVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        Usage::ClientAuth.check_peer(end_entity)?;
        Ok(verified)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(ekus: Vec<rcgen::ExtendedKeyUsagePurpose>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.extended_key_usages = ekus;
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_purpose_must_be_named() {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, CodeSigning, ServerAuth};
        let both = cert(vec![ServerAuth, ClientAuth]);
        assert!(Usage::ClientAuth.check(&both).is_ok());
        assert!(Usage::ServerAuth.check(&both).is_ok());

        let none = cert(vec![]);
        for usage in [Usage::ClientAuth, Usage::ServerAuth] {
            let err = usage.check(&none).unwrap_err();
            assert!(
                err.contains("no extended key usage") && err.contains(&usage.to_string()),
                "{err}"
            );
        }
        let err = Usage::ClientAuth
            .check(&cert(vec![ServerAuth]))
            .unwrap_err();
        assert!(
            err.contains("is for serverAuth, not clientAuth") && err.contains("\"client auth\""),
            "{err}"
        );
        let err = Usage::ServerAuth
            .check(&cert(vec![ClientAuth, CodeSigning]))
            .unwrap_err();
        assert!(err.contains("is for clientAuth, codeSigning, not"), "{err}");
    }
}
