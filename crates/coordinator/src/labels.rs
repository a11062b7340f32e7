//! Labels the coordinator assigns to hosts (`--host-labels FILE`): what policy can trust, since
//! an agent's own `--label`s are only its word. Also the bounds on what a hello may carry.
//!
//! ```json
//! {"db-*": {"role": "db"}, "db-eu-*": {"region": "eu"}}
//! ```
//! Keys are host-id globs; every entry whose glob matches a host applies, in file order, a
//! later entry overriding a label an earlier one set.

use std::collections::BTreeMap;
use std::path::Path;

use toolsrv_proto::v1::Hello;
// The same rules as labels bound at enrollment: one check for both.
use toolsrv_tls::enroll::check_label;

use crate::error::FileError;
use crate::selector::glob;

/// Most labels a hello may carry.
pub const MAX_LABELS: usize = 64;
/// Longest label key.
pub const MAX_LABEL_KEY: usize = 63;
/// Longest label value, and longest fact (OS, arch, hostname, kernel) or agent version.
pub const MAX_FIELD: usize = 253;
/// Most items of a list of the hello's sandbox facts.
pub const MAX_SANDBOX_ITEMS: usize = 32;
/// Longest item of the sandbox facts' `missing` (a sentence each).
pub const MAX_SANDBOX_MISSING_BYTES: usize = 1024;

/// The coordinator's host labels, in file order.
#[derive(Debug, Default)]
pub struct HostLabels {
    entries: Vec<(String, BTreeMap<String, String>)>,
    /// SHA-256 of the text they were read from (hex); empty for none.
    sha256: String,
}

impl HostLabels {
    /// How many entries (host-id globs) it has.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let raw: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
            .map_err(|e| format!("invalid host labels (an object of host-id globs): {e}"))?;
        let mut entries = Vec::with_capacity(raw.len());
        for (pattern, labels) in raw {
            let labels: BTreeMap<String, String> = serde_json::from_value(labels)
                .map_err(|e| format!("`{pattern}`: labels must map strings to strings: {e}"))?;
            for (k, v) in &labels {
                check_label(k, v).map_err(|e| format!("`{pattern}`: {e}"))?;
            }
            entries.push((pattern, labels));
        }
        Ok(Self {
            entries,
            sha256: toolsrv_registry::hex_sha256(text.as_bytes()),
        })
    }

    /// SHA-256 of the text the labels were read from, in hex (empty without a file).
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    pub fn load(path: &Path) -> Result<Self, FileError> {
        FileError::unless_guarded("host labels", path)?;
        let text =
            toolsrv_tls::files::read_text_bounded(path, toolsrv_tls::files::MAX_SETTINGS_BYTES)
                .map_err(|e| FileError::read("host labels", path, e))?;
        Self::parse(&text).map_err(|e| FileError::invalid("host labels", path, e))
    }

    /// The labels of host `id`.
    pub fn of(&self, id: &str) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::new();
        for (pattern, set) in &self.entries {
            if glob(pattern, id) {
                labels.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
        }
        labels
    }
}

/// Refuses a hello whose facts, labels or version are over the bounds or carry control
/// characters, naming the field.
pub fn check_hello(hello: &Hello) -> Result<(), String> {
    let sized = |name: &str, value: &str, max: usize| {
        if value.len() > max || value.chars().any(toolsrv_proto::text::disguises) {
            Err(format!(
                "hello field {name} must be at most {max} bytes without control or direction \
                 characters"
            ))
        } else {
            Ok(())
        }
    };
    let field = |name: &str, value: &str| sized(name, value, MAX_FIELD);
    let list = |name: &str, values: &[String], max_items: usize, max: usize| {
        if values.len() > max_items {
            return Err(format!(
                "hello field {name} has {} items, over the limit of {max_items}",
                values.len()
            ));
        }
        values.iter().try_for_each(|v| sized(name, v, max))
    };
    field("agent_version", &hello.agent_version)?;
    if let Some(facts) = &hello.facts {
        field("facts.os", &facts.os)?;
        field("facts.arch", &facts.arch)?;
        field("facts.hostname", &facts.hostname)?;
        field("facts.kernel", &facts.kernel)?;
        // What the agent says of its sandbox is shown with the host and selected on: as
        // bounded as the rest (15,800 items of 1 KiB took 10 MB of every listing of the host).
        if let Some(sandbox) = &facts.sandbox {
            for (name, value) in [
                ("facts.sandbox.mode", &sandbox.mode),
                ("facts.sandbox.level", &sandbox.level),
                ("facts.sandbox.cgroup", &sandbox.cgroup),
                ("facts.sandbox.kill", &sandbox.kill),
                ("facts.sandbox.run_as", &sandbox.run_as),
            ] {
                field(name, value)?;
            }
            list(
                "facts.sandbox.controllers",
                &sandbox.controllers,
                MAX_SANDBOX_ITEMS,
                MAX_FIELD,
            )?;
            list(
                "facts.sandbox.missing",
                &sandbox.missing,
                MAX_SANDBOX_ITEMS,
                MAX_SANDBOX_MISSING_BYTES,
            )?;
        }
        if facts.labels.len() > MAX_LABELS {
            return Err(format!(
                "hello carries {} labels, over the limit of {MAX_LABELS}",
                facts.labels.len()
            ));
        }
        for (k, v) in &facts.labels {
            check_label(k, v)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use toolsrv_proto::v1::{HostFacts, SandboxFacts};

    #[test]
    fn every_matching_entry_applies_in_file_order() {
        let l = HostLabels::parse(
            r#"{"db-*": {"role": "db", "tier": "back"}, "db-eu-*": {"tier": "eu"}}"#,
        )
        .unwrap();
        let got = l.of("db-eu-1");
        assert_eq!(got["role"], "db");
        assert_eq!(got["tier"], "eu");
        assert!(l.of("web-1").is_empty());
    }

    #[test]
    fn bad_files_are_explained() {
        assert!(HostLabels::parse("[]").unwrap_err().contains("object"));
        assert!(
            HostLabels::parse(r#"{"a": {"role": 1}}"#)
                .unwrap_err()
                .contains("`a`")
        );
        assert!(
            HostLabels::parse(r#"{"a": {"ro le": "x"}}"#)
                .unwrap_err()
                .contains("label key")
        );
    }

    #[test]
    fn hellos_over_the_bounds_are_refused() {
        let mut hello = Hello {
            host_id: "a".into(),
            agent_version: "1\n\u{1b}[31mfake".into(),
            ..Hello::default()
        };
        assert!(check_hello(&hello).unwrap_err().contains("agent_version"));
        hello.agent_version = "0.1.0".into();
        let labels = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        hello.facts = Some(HostFacts {
            labels,
            ..HostFacts::default()
        });
        assert!(check_hello(&hello).unwrap_err().contains("labels"));
        hello.facts = Some(HostFacts {
            hostname: "h".repeat(MAX_FIELD + 1),
            ..HostFacts::default()
        });
        assert!(check_hello(&hello).unwrap_err().contains("facts.hostname"));
        // A direction override is as refused as a control character.
        hello.facts = Some(HostFacts {
            hostname: "web\u{202e}1".into(),
            ..HostFacts::default()
        });
        assert!(check_hello(&hello).unwrap_err().contains("facts.hostname"));
        // The sandbox facts are bounded like the rest: 15,800 items of 1 KiB were kept and
        // listed with the host.
        let sandbox = |f: fn(&mut SandboxFacts)| {
            let mut facts = SandboxFacts {
                mode: "best-effort".into(),
                level: "enforced".into(),
                controllers: vec!["pids".into(), "memory".into()],
                missing: vec!["no cpu controller: --sandbox-cpu is not enforced".into()],
                ..SandboxFacts::default()
            };
            f(&mut facts);
            Hello {
                facts: Some(HostFacts {
                    sandbox: Some(facts),
                    ..HostFacts::default()
                }),
                ..Hello::default()
            }
        };
        assert!(check_hello(&sandbox(|_| {})).is_ok());
        for (bad, field) in [
            (
                sandbox(|s| s.missing = vec!["x".repeat(1000); 15_800]),
                "facts.sandbox.missing has 15800 items",
            ),
            (
                sandbox(|s| s.missing = vec!["x".repeat(2000)]),
                "facts.sandbox.missing",
            ),
            (
                sandbox(|s| s.level = "enforced\u{1b}]0;T\u{7}".into()),
                "facts.sandbox.level",
            ),
            (
                sandbox(|s| s.controllers = vec!["pids\u{0}".into()]),
                "facts.sandbox.controllers",
            ),
        ] {
            let e = check_hello(&bad).unwrap_err();
            assert!(e.contains(field), "{e}");
        }
        hello.facts = Some(HostFacts::default());
        assert!(check_hello(&hello).is_ok());
    }
}
