//! Who a peer is: the one `toolsrv://` URI SAN of its certificate.
//!
//! Host ids and client names are DNS-like: they compare case-insensitively. Every name is
//! normalised to ASCII lowercase where it enters (a certificate, a flag, a policy file, a
//! request), with [`normalize_name`], so that everything after compares plain strings.

use std::fmt;

use crate::TlsError;

/// The scheme every identity URI starts with.
pub const URI_SCHEME: &str = "toolsrv://";

/// Longest host id or client name we accept (a DNS name's limit).
pub const MAX_NAME_LEN: usize = 253;

/// What a certificate says its holder is. Names are lowercase when the identity comes from
/// [`Identity::parse_uri`], [`identity_of`], [`Identity::agent`] or [`Identity::client`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// The coordinator (`toolsrv://coordinator`).
    Coordinator,
    /// The agent running on one host (`toolsrv://agent/<host-id>`).
    Agent(String),
    /// A client calling tools (`toolsrv://client/<name>`).
    Client(String),
}

/// The one spelling of a host id or client name that is compared: ASCII lowercase (`Web-1` and
/// `web-1` are the same host). Patterns (policy globs, selectors) go through it too.
pub fn normalize_name(name: &str) -> String {
    name.to_ascii_lowercase()
}

/// The role part of an [`Identity`], without the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The coordinator.
    Coordinator,
    /// An agent.
    Agent,
    /// A client.
    Client,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Coordinator => "coordinator",
            Role::Agent => "agent",
            Role::Client => "client",
        })
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Coordinator => f.write_str("coordinator"),
            Identity::Agent(id) => write!(f, "agent/{id}"),
            Identity::Client(name) => write!(f, "client/{name}"),
        }
    }
}

impl Identity {
    /// The URI SAN that names this identity, e.g. `toolsrv://agent/web-1`.
    pub fn uri(&self) -> String {
        format!("{URI_SCHEME}{self}")
    }

    /// The agent of host `id`, validated and normalised.
    pub fn agent(id: &str) -> Result<Self, TlsError> {
        validate_name("agent id", id)?;
        Ok(Identity::Agent(normalize_name(id)))
    }

    /// The client `name`, validated and normalised.
    pub fn client(name: &str) -> Result<Self, TlsError> {
        validate_name("client name", name)?;
        Ok(Identity::Client(normalize_name(name)))
    }

    /// Parses `toolsrv://coordinator`, `toolsrv://agent/<id>` or
    /// `toolsrv://client/<name>`, validating the id or name and normalising it to lowercase.
    pub fn parse_uri(uri: &str) -> Result<Self, TlsError> {
        let bad = |msg: &str| TlsError::InvalidName {
            what: "identity URI",
            value: uri.to_string(),
            msg: msg.to_string(),
        };
        let rest = uri.strip_prefix(URI_SCHEME).ok_or_else(|| {
            bad("expected toolsrv://coordinator, toolsrv://agent/<id> or toolsrv://client/<name>")
        })?;
        if rest == "coordinator" {
            return Ok(Identity::Coordinator);
        }
        if let Some(id) = rest.strip_prefix("agent/") {
            return Identity::agent(id);
        }
        if let Some(name) = rest.strip_prefix("client/") {
            return Identity::client(name);
        }
        Err(bad(
            "unknown role: expected coordinator, agent/<id> or client/<name>",
        ))
    }

    /// The role of this identity.
    pub fn role(&self) -> Role {
        match self {
            Identity::Coordinator => Role::Coordinator,
            Identity::Agent(_) => Role::Agent,
            Identity::Client(_) => Role::Client,
        }
    }

    /// The host id or client name; `None` for the coordinator.
    pub fn name(&self) -> Option<&str> {
        match self {
            Identity::Coordinator => None,
            Identity::Agent(n) | Identity::Client(n) => Some(n),
        }
    }
}

/// Checks a host id or client name: `[A-Za-z0-9_.-]+`, 1 to 253 characters (compared
/// case-insensitively: see [`normalize_name`]).
/// `what` names the value in the error ("agent id", "client name").
pub fn validate_name(what: &'static str, name: &str) -> Result<(), TlsError> {
    let bad = |msg: String| TlsError::InvalidName {
        what,
        value: name.to_string(),
        msg,
    };
    if name.is_empty() {
        return Err(bad("it is empty: use 1 to 253 of A-Z a-z 0-9 _ . -".into()));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad(format!(
            "it has {} characters: use at most {MAX_NAME_LEN}",
            name.len()
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(bad(format!(
            "character {c:?} is not allowed: use only A-Z a-z 0-9 _ . -"
        )));
    }
    Ok(())
}

/// Reads the identity from a DER certificate: its one `toolsrv://` URI SAN.
/// Other URI SANs (a SPIFFE id, say, or the labels of `toolsrv://label/...`) are ignored; none or several
/// `toolsrv://` URIs is an error.
pub fn identity_of(cert_der: &[u8]) -> Result<Identity, TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| TlsError::Identity(format!("cannot parse the certificate: {e}")))?;
    let subject = cert.subject().to_string();
    let san = cert.subject_alternative_name().map_err(|e| {
        TlsError::Identity(format!(
            "certificate {subject:?} has an unreadable subject alternative name: {e}"
        ))
    })?;
    let uris: Vec<&str> = san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    // Label URIs (`toolsrv://label/...`, see `enroll`) name no identity.
                    x509_parser::extensions::GeneralName::URI(u)
                        if u.starts_with(URI_SCHEME)
                            && !u.starts_with(crate::enroll::LABEL_URI_PREFIX) =>
                    {
                        Some(*u)
                    }
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    match uris.as_slice() {
        [one] => Identity::parse_uri(one),
        [] => Err(TlsError::Identity(format!(
            "certificate {subject:?} has no {URI_SCHEME} URI SAN: issue it with `toolsrv pki init` \
             or add a URI SAN such as toolsrv://agent/<host-id>"
        ))),
        many => Err(TlsError::Identity(format!(
            "certificate {subject:?} has {} {URI_SCHEME} URI SANs ({}): it must have exactly one",
            many.len(),
            many.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_round_trip() {
        let cases = [
            ("toolsrv://coordinator", Some(Identity::Coordinator)),
            (
                "toolsrv://agent/web-1",
                Some(Identity::Agent("web-1".into())),
            ),
            (
                "toolsrv://client/alice",
                Some(Identity::Client("alice".into())),
            ),
            (
                "toolsrv://client/a.b_c-d9",
                Some(Identity::Client("a.b_c-d9".into())),
            ),
            ("toolsrv://agent/", None),
            ("toolsrv://agent/a/b", None),
            ("toolsrv://agent/a b", None),
            ("toolsrv://admin/x", None),
            ("toolsrv://coordinator/x", None),
            ("https://coordinator", None),
            ("", None),
        ];
        for (uri, want) in cases {
            let got = Identity::parse_uri(uri).ok();
            assert_eq!(got, want, "{uri}");
            if let Some(id) = got {
                assert_eq!(id.uri(), uri);
            }
        }
    }

    #[test]
    fn names_are_lowercase_whatever_the_certificate_says() {
        for (uri, want) in [
            ("toolsrv://agent/Web-1", Identity::Agent("web-1".into())),
            ("toolsrv://agent/WEB-1", Identity::Agent("web-1".into())),
            ("toolsrv://client/Alice", Identity::Client("alice".into())),
            (
                "toolsrv://client/a.B_c-D9",
                Identity::Client("a.b_c-d9".into()),
            ),
        ] {
            assert_eq!(Identity::parse_uri(uri).unwrap(), want, "{uri}");
        }
        assert_eq!(
            Identity::agent("Web-1").unwrap(),
            Identity::parse_uri("toolsrv://agent/web-1").unwrap()
        );
        assert_eq!(
            Identity::client("ALICE").unwrap(),
            Identity::Client("alice".into())
        );
        assert!(Identity::agent("Wéb").is_err());
        assert_eq!(normalize_name("Web-*"), "web-*");
    }

    #[test]
    fn display_and_role() {
        assert_eq!(Identity::Agent("web-1".into()).to_string(), "agent/web-1");
        assert_eq!(Identity::Client("alice".into()).to_string(), "client/alice");
        assert_eq!(Identity::Coordinator.to_string(), "coordinator");
        assert_eq!(Identity::Agent("x".into()).role(), Role::Agent);
        assert_eq!(Identity::Coordinator.name(), None);
    }

    #[test]
    fn name_length_limits() {
        assert!(validate_name("agent id", &"a".repeat(253)).is_ok());
        assert!(validate_name("agent id", &"a".repeat(254)).is_err());
        assert!(validate_name("agent id", "").is_err());
        assert!(validate_name("agent id", "é").is_err());
    }
}
