//! Host selectors: `all`, host ids and globs, labels and facts.
//!
//! Terms are comma-separated. Terms of one kind are alternatives (`web-1,web-2` is either host,
//! `os=linux,os=darwin` either OS); terms of different kinds must all hold (`web-*,os=linux`),
//! the same AND-across-keys, OR-within-a-key rule as a variant's `match`. Host ids compare
//! case-insensitively: host terms and `id=`/`host=` values are normalised like identities.
//! Fact keys are `os`, `arch`, `hostname`, `kernel` and `sandbox` (the level the agent reports:
//! `sandbox=enforced`); any other key is a label.

mod compiled;

use std::collections::{BTreeMap, HashSet};

use toolsrv_tls::normalize_name;

use compiled::Globs;

/// Most bytes of a selector (or one of its terms) an error quotes.
pub const SHOWN_BYTES: usize = 200;

/// A selector as an error quotes it: escaped and cut to [`SHOWN_BYTES`].
pub fn shown(text: &str) -> String {
    toolsrv_proto::text::printable_line(text, SHOWN_BYTES)
}

/// A parsed selector such as `web-*,role=db,os=linux`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    /// Host ids or globs; any may match. Empty: any host.
    hosts: Vec<String>,
    /// `hosts` compiled.
    host_terms: Option<Terms>,
    /// `key=value` terms by key; for each key any value (a glob, or a value alone) may match.
    pairs: BTreeMap<String, Terms>,
}

/// The alternatives of one kind of term: values without a wildcard looked up whole, so that a
/// selector naming hundreds of hosts costs one lookup a host, and globs compiled together.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Terms {
    exact: HashSet<String>,
    globs: Option<Globs>,
}

impl Terms {
    fn new<'a>(patterns: impl IntoIterator<Item = &'a str>) -> Self {
        let (globs, exact): (Vec<&str>, Vec<&str>) =
            patterns.into_iter().partition(|p| p.contains(['*', '?']));
        Self {
            exact: exact.into_iter().map(str::to_string).collect(),
            globs: (!globs.is_empty()).then(|| Globs::new(globs)),
        }
    }

    fn matches(&self, text: &str) -> bool {
        self.exact.contains(text) || self.globs.as_ref().is_some_and(|g| g.matches(text))
    }
}

/// A host as a selector or policy rule sees it (borrowed from the fleet entry; the wire type
/// `toolsrv_proto::v1::HostFacts` is what the agent reports).
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub id: &'a str,
    pub os: &'a str,
    pub arch: &'a str,
    pub hostname: &'a str,
    pub kernel: &'a str,
    /// The sandbox level the agent reports (`enforced`, `partial`, `off`; empty when it reports
    /// none)
    pub sandbox: &'a str,
    pub labels: &'a BTreeMap<String, String>,
}

/// A selector that does not parse; the message names the offending term.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(String);

impl Selector {
    /// Parses a selector; the error names the offending term.
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        // Errors quote what they refuse, escaped and cut: a selector may be 4 KiB of anything.
        let mut selector = Selector::default();
        let mut values: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for raw in text.split(',') {
            let term = raw.trim();
            if term.is_empty() {
                return Err(SelectorError(format!(
                    "selector `{}` has an empty term",
                    shown(text)
                )));
            }
            match term.split_once('=') {
                _ if term == "all" || term == "*" => {}
                Some((k, v)) if !k.is_empty() && !v.is_empty() => {
                    let v = if matches!(k, "id" | "host") {
                        normalize_name(v)
                    } else {
                        v.to_string()
                    };
                    values.entry(k.to_string()).or_default().push(v)
                }
                Some(_) => {
                    return Err(SelectorError(format!(
                        "selector term `{}` needs KEY=VALUE",
                        shown(term)
                    )));
                }
                None if valid_glob(term) => selector.hosts.push(normalize_name(term)),
                None => {
                    return Err(SelectorError(format!(
                        "selector term `{}` is not a host id or glob ([A-Za-z0-9_.-*?])",
                        shown(term)
                    )));
                }
            }
        }
        if !selector.hosts.is_empty() {
            selector.host_terms = Some(Terms::new(selector.hosts.iter().map(String::as_str)));
        }
        selector.pairs = values
            .into_iter()
            .map(|(key, patterns)| (key, Terms::new(patterns.iter().map(String::as_str))))
            .collect();
        Ok(selector)
    }

    /// Host terms without wildcards: hosts the caller named outright.
    pub fn exact_hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts
            .iter()
            .map(String::as_str)
            .filter(|h| !h.contains(['*', '?']))
    }

    /// True when the host satisfies the selector.
    pub fn matches(&self, host: &Candidate<'_>) -> bool {
        let id_ok = self.host_terms.as_ref().is_none_or(|t| t.matches(host.id));
        id_ok
            && self.pairs.iter().all(|(key, patterns)| {
                let value = match key.as_str() {
                    "id" | "host" => Some(host.id),
                    "os" => Some(host.os),
                    "arch" => Some(host.arch),
                    "hostname" => Some(host.hostname),
                    "kernel" => Some(host.kernel),
                    "sandbox" => Some(host.sandbox),
                    label => host.labels.get(label).map(String::as_str),
                };
                value.is_some_and(|v| patterns.matches(v))
            })
    }
}

fn valid_glob(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'*' | b'?'))
}

/// Shell-style glob with `*` (any run) and `?` (any one character). One rule for selectors,
/// policy rules and the sandbox grants the agents match against tool names.
pub use toolsrv_confine::glob;

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused selector comes back escaped and cut: 4 KiB of odd bytes would otherwise make
    /// an error larger than a client takes in its headers, and reach a terminal raw.
    #[test]
    fn a_refused_selector_is_quoted_escaped_and_bounded() {
        for text in [
            "€".repeat(1365),
            format!("web-1,{}", "a | ".repeat(1000)),
            "a,,b".to_string(),
            "web\u{1b}[31m\nprod".to_string(),
            "role=\u{202e}db,=x".to_string(),
        ] {
            let e = Selector::parse(&text).unwrap_err().to_string();
            assert!(e.len() < 2 * SHOWN_BYTES, "{} bytes: {e}", e.len());
            assert!(!e.chars().any(toolsrv_proto::text::disguises), "{e:?}");
        }
        let e = Selector::parse("web\u{1b}[31m").unwrap_err().to_string();
        assert!(e.contains(r"web\u{1b}[31m"), "{e}");
        let e = Selector::parse(&"€".repeat(1365)).unwrap_err().to_string();
        assert!(e.contains("… (4095 bytes)"), "{e}");
    }

    #[test]
    fn globs() {
        let cases = [
            ("web-*", "web-1", true),
            ("web-*", "db-1", false),
            ("*", "", true),
            ("w?b", "web", true),
            ("w?b", "wb", false),
            ("*-1", "web-1", true),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXbYY", false),
            ("exact", "exact", true),
            ("", "", true),
            ("", "a", false),
            ("**", "", true),
            ("*?", "", false),
            ("é?x", "éÿx", true),
        ];
        for (p, t, want) in cases {
            assert_eq!(glob(p, t), want, "{p} vs {t}");
            // The selectors' compiled form agrees (and with random patterns: `compiled`).
            assert_eq!(Globs::new([p]).matches(t), want, "compiled: {p} vs {t}");
        }
    }

    #[test]
    fn selectors() {
        let labels: BTreeMap<String, String> = [("role".to_string(), "db".to_string())].into();
        let none = BTreeMap::new();
        let db = Candidate {
            id: "db-1",
            os: "linux",
            arch: "amd64",
            hostname: "db1",
            kernel: "6.1",
            sandbox: "enforced",
            labels: &labels,
        };
        let mac = Candidate {
            id: "mac-1",
            os: "darwin",
            arch: "arm64",
            hostname: "m",
            kernel: "23",
            sandbox: "off",
            labels: &none,
        };
        let cases = [
            ("all", true, true),
            ("db-1", true, false),
            ("db-*", true, false),
            ("role=db", true, false),
            ("os=linux", true, false),
            ("arch=arm64", false, true),
            ("os=darwin,arch=arm64", false, true),
            ("os=linux,role=web", false, false),
            ("mac-*,os=darwin", false, true),
            ("os=*", true, true),
            ("role=*", true, false),
            ("db-1,mac-1", true, true),
            ("db-1,mac-1,os=darwin", false, true),
            ("sandbox=enforced", true, false),
            ("sandbox=off,os=darwin", false, true),
            ("os=linux,os=darwin", true, true),
            // Values looked up whole and globs, side by side.
            ("db-1,mac-*", true, true),
            ("db-*,mac-1", true, true),
            ("db-,db-12,db-1?", false, false),
            ("os=linux,os=dar*", true, true),
            ("os=lin,os=darwi?", false, true),
            ("role=d*,role=web", true, false),
        ];
        for (text, want_db, want_mac) in cases {
            let s = Selector::parse(text).unwrap();
            assert_eq!(
                (s.matches(&db), s.matches(&mac)),
                (want_db, want_mac),
                "{text}"
            );
        }
        for bad in ["", "a,,b", "=x", "role=", "web 1", "a/b"] {
            assert!(Selector::parse(bad).is_err(), "{bad:?} should not parse");
        }
        let s = Selector::parse("web-1,web-*,os=linux").unwrap();
        assert_eq!(s.exact_hosts().collect::<Vec<_>>(), ["web-1"]);
    }

    #[test]
    fn host_ids_compare_case_insensitively() {
        let none = BTreeMap::new();
        // Host ids arrive lowercase (from certificates); selectors may be typed in any case.
        let db = Candidate {
            id: "db-1",
            os: "linux",
            arch: "amd64",
            hostname: "DB1",
            kernel: "6.1",
            sandbox: "enforced",
            labels: &none,
        };
        for text in ["DB-1", "Db-*", "id=DB-1", "host=dB-?", "hostname=DB1"] {
            assert!(Selector::parse(text).unwrap().matches(&db), "{text}");
        }
        // Facts and labels other than the id keep their case.
        assert!(!Selector::parse("os=Linux").unwrap().matches(&db));
        assert!(!Selector::parse("hostname=db1").unwrap().matches(&db));
        let s = Selector::parse("Web-1,WEB-*").unwrap();
        assert_eq!(s.exact_hosts().collect::<Vec<_>>(), ["web-1"]);
    }
}
