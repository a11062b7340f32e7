//! Call policy: which client may call which tool on which hosts. First matching rule decides.
//! Client names and host ids compare case-insensitively, like the identities they match.
//!
//! ```json
//! {"default": "allow",
//!  "rules": [{"clients": ["ci-*"], "tools": ["service_status"], "hosts": "role=db", "effect": "deny"},
//!            {"tools": ["restart_*"], "effect": "approve", "approvers": ["oncall-*"]}]}
//! ```
//!
//! `approve` makes the call wait for an approval: by the caller itself (`approvers` absent or
//! `["caller"]`), or by one of the client-name globs in `approvers`, never the caller (a
//! two-person rule).

use std::path::Path;

use serde::Deserialize;
use toolsrv_tls::normalize_name;

use crate::selector::{HostFacts, Selector, glob};

/// What a rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    Allow,
    Deny,
    Approve,
}

/// What a rule says of the requests its calls' tools make to run a command outside their
/// sandbox (through `OLLIE_BYPASS_SOCKET`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bypass {
    Allow,
    Deny,
    /// Asked of the rule's approvers (the caller by default), like an approval of the call.
    #[default]
    Ask,
}

/// What the policy says of one call that it does not deny.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Which rule decided (`None`: the default), for messages and the audit log.
    pub rule: Option<usize>,
    /// The call waits for an approval before it starts.
    pub approve: bool,
    /// Who decides approvals (of the call, and of its bypass requests): client-name globs;
    /// empty means the caller.
    pub approvers: Vec<String>,
    /// What becomes of the call's bypass requests.
    pub bypass: Bypass,
}

impl Verdict {
    /// A call allowed outright, bypass requests asked of the caller: no policy at all.
    pub fn allow() -> Self {
        Self {
            rule: None,
            approve: false,
            approvers: Vec::new(),
            bypass: Bypass::Ask,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default = "allow")]
    default: Effect,
    /// Who may approve when the default is `approve`, and bypass requests of calls no rule names.
    #[serde(default)]
    default_approvers: Option<Vec<String>>,
    /// What becomes of bypass requests of calls no rule names.
    #[serde(default)]
    default_bypass: Bypass,
    #[serde(default)]
    rules: Vec<RawRule>,
}

fn allow() -> Effect {
    Effect::Allow
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    /// Client names or globs; absent: any client.
    clients: Option<Vec<String>>,
    /// Tool names or globs; absent: any tool.
    tools: Option<Vec<String>>,
    /// A host selector; absent: any host.
    hosts: Option<String>,
    effect: Effect,
    /// Who may approve (the call, for `effect: approve`, and its bypass requests): client-name
    /// globs, or `["caller"]` (default).
    approvers: Option<Vec<String>>,
    /// What becomes of bypass requests of this rule's calls.
    #[serde(default)]
    bypass: Bypass,
}

#[derive(Debug)]
struct Rule {
    clients: Option<Vec<String>>,
    tools: Option<Vec<String>>,
    hosts: Option<Selector>,
    effect: Effect,
    approvers: Vec<String>,
    bypass: Bypass,
}

/// A loaded policy. The default policy allows everything.
#[derive(Debug)]
pub struct Policy {
    default: Effect,
    default_approvers: Vec<String>,
    default_bypass: Bypass,
    rules: Vec<Rule>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            default: Effect::Allow,
            default_approvers: Vec::new(),
            default_bypass: Bypass::Ask,
            rules: Vec::new(),
        }
    }
}

/// Approver globs as matched: client names compare case-insensitively; `caller` stays itself.
fn approvers(list: Option<Vec<String>>, effect: Effect, at: &str) -> Result<Vec<String>, String> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    if effect != Effect::Approve {
        return Err(format!(
            "{at}.approvers: only a rule with \"effect\": \"approve\" has approvers"
        ));
    }
    if list.is_empty() {
        return Err(format!(
            "{at}.approvers: empty; leave it out to let the caller approve"
        ));
    }
    Ok(list.iter().map(|p| normalize_name(p)).collect())
}

impl Policy {
    /// Parses a policy document; errors name the rule and the problem.
    pub fn parse(text: &str) -> Result<Self, String> {
        let raw: RawPolicy =
            serde_json::from_str(text).map_err(|e| format!("invalid policy: {e}"))?;
        let mut rules = Vec::with_capacity(raw.rules.len());
        for (i, r) in raw.rules.into_iter().enumerate() {
            let hosts = r
                .hosts
                .as_deref()
                .map(Selector::parse)
                .transpose()
                .map_err(|e| format!("rules[{i}].hosts: {e}"))?;
            let approvers = approvers(r.approvers, r.effect, &format!("rules[{i}]"))?;
            rules.push(Rule {
                clients: r
                    .clients
                    .map(|c| c.iter().map(|p| normalize_name(p)).collect()),
                tools: r.tools,
                hosts,
                effect: r.effect,
                approvers,
                bypass: r.bypass,
            });
        }
        Ok(Self {
            default: raw.default,
            default_approvers: approvers(raw.default_approvers, raw.default, "default")?,
            default_bypass: raw.default_bypass,
            rules,
        })
    }

    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read policy {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Whether `client` may call `tool` on `host`, at once or after an approval; the error says
    /// which rule denied it.
    pub fn check(&self, client: &str, tool: &str, host: &HostFacts<'_>) -> Result<Verdict, String> {
        let any = |list: &Option<Vec<String>>, value: &str| {
            list.as_ref()
                .is_none_or(|l| l.iter().any(|p| glob(p, value)))
        };
        for (i, rule) in self.rules.iter().enumerate() {
            if any(&rule.clients, client)
                && any(&rule.tools, tool)
                && rule.hosts.as_ref().is_none_or(|s| s.matches(host))
            {
                let verdict = |approve| Verdict {
                    rule: Some(i),
                    approve,
                    approvers: rule.approvers.clone(),
                    bypass: rule.bypass,
                };
                return match rule.effect {
                    Effect::Allow => Ok(verdict(false)),
                    Effect::Approve => Ok(verdict(true)),
                    Effect::Deny => Err(format!(
                        "policy rule {i} denies client {client} calling {tool} on {}",
                        host.id
                    )),
                };
            }
        }
        let verdict = |approve| Verdict {
            rule: None,
            approve,
            approvers: self.default_approvers.clone(),
            bypass: self.default_bypass,
        };
        match self.default {
            Effect::Allow => Ok(verdict(false)),
            Effect::Approve => Ok(verdict(true)),
            Effect::Deny => Err(format!(
                "no policy rule allows client {client} calling {tool} on {}",
                host.id
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn first_matching_rule_decides() {
        let p = Policy::parse(
            r#"{"default": "deny", "rules": [
                {"clients": ["ci-*"], "hosts": "role=db", "effect": "deny"},
                {"clients": ["ci-*", "alice"], "tools": ["env_*", "disk_usage"], "effect": "allow"},
                {"clients": ["root"], "effect": "allow"}]}"#,
        )
        .unwrap();
        let db_labels: BTreeMap<String, String> = [("role".into(), "db".into())].into();
        let none = BTreeMap::new();
        let db = HostFacts {
            id: "db-1",
            os: "linux",
            arch: "amd64",
            hostname: "",
            kernel: "",
            labels: &db_labels,
        };
        let web = HostFacts {
            id: "web-1",
            os: "linux",
            arch: "amd64",
            hostname: "",
            kernel: "",
            labels: &none,
        };
        assert!(
            p.check("ci-7", "env_info", &db)
                .unwrap_err()
                .contains("rule 0")
        );
        assert!(p.check("ci-7", "env_info", &web).is_ok());
        assert!(p.check("alice", "disk_usage", &db).is_ok());
        assert!(
            p.check("alice", "service_status", &web)
                .unwrap_err()
                .contains("no policy rule")
        );
        assert!(p.check("root", "anything", &db).is_ok());
        assert!(Policy::default().check("x", "y", &web).is_ok());
    }

    #[test]
    fn names_match_whatever_their_case() {
        let none = BTreeMap::new();
        let host = |id| HostFacts {
            id,
            os: "linux",
            arch: "amd64",
            hostname: "",
            kernel: "",
            labels: &none,
        };
        // Names as they come out of certificates: `agent/Web-1` is host `web-1`, `client/Alice`
        // is client `alice`.
        let name = |uri: &str| {
            toolsrv_tls::Identity::parse_uri(uri)
                .unwrap()
                .name()
                .unwrap()
                .to_string()
        };
        let (web1, db2) = (name("toolsrv://agent/Web-1"), name("toolsrv://agent/db-2"));
        let (alice, bob) = (name("toolsrv://client/Alice"), name("toolsrv://client/bob"));
        let p = Policy::parse(
            r#"{"default": "deny", "rules": [
                {"clients": ["alice"], "hosts": "web-1", "effect": "allow"},
                {"clients": ["BOB"], "hosts": "DB-2", "effect": "allow"}]}"#,
        )
        .unwrap();
        assert!(p.check(&alice, "t", &host(&web1)).is_ok());
        assert!(p.check(&bob, "t", &host(&db2)).is_ok());
        assert!(p.check(&alice, "t", &host(&db2)).is_err());
        assert!(p.check(&bob, "t", &host(&web1)).is_err());
    }

    #[test]
    fn bad_policies_are_explained() {
        assert!(
            Policy::parse(r#"{"rules": [{"effect": "maybe"}]}"#)
                .unwrap_err()
                .contains("invalid policy")
        );
        assert!(
            Policy::parse(r#"{"rules": [{"effect": "deny", "hosts": "a b"}]}"#)
                .unwrap_err()
                .contains("rules[0].hosts")
        );
        assert!(Policy::parse(r#"{"rulez": []}"#).is_err());
    }

    #[test]
    fn approve_rules_say_who_approves() {
        let p = Policy::parse(
            r#"{"default": "approve", "rules": [
                {"tools": ["restart_*"], "effect": "approve", "approvers": ["OnCall-*"]},
                {"tools": ["env_*"], "effect": "allow"}]}"#,
        )
        .unwrap();
        let none = BTreeMap::new();
        let host = HostFacts {
            id: "db-1",
            os: "linux",
            arch: "amd64",
            hostname: "",
            kernel: "",
            labels: &none,
        };
        let restart = p.check("alice", "restart_db", &host).unwrap();
        assert_eq!((restart.rule, restart.approve), (Some(0), true));
        assert_eq!(restart.approvers, ["oncall-*"]);
        assert_eq!(restart.bypass, Bypass::Ask);
        let env = p.check("alice", "env_info", &host).unwrap();
        assert_eq!((env.rule, env.approve), (Some(1), false));
        let other = p.check("alice", "other", &host).unwrap();
        assert_eq!((other.rule, other.approve), (None, true));
        assert!(other.approvers.is_empty());
        let p = Policy::parse(
            r#"{"default_bypass": "deny", "rules": [{"tools": ["fix_*"], "effect": "allow", "bypass": "allow"}]}"#,
        )
        .unwrap();
        assert_eq!(
            p.check("a", "fix_perms", &host).unwrap().bypass,
            Bypass::Allow
        );
        assert_eq!(p.check("a", "other", &host).unwrap().bypass, Bypass::Deny);
        for bad in [
            r#"{"rules": [{"effect": "deny", "approvers": ["x"]}]}"#,
            r#"{"rules": [{"effect": "approve", "approvers": []}]}"#,
        ] {
            assert!(
                Policy::parse(bad).unwrap_err().contains("approvers"),
                "{bad}"
            );
        }
    }
}
