//! Call policy: which client may call which tool on which hosts (first matching rule decides),
//! whether such a call must run confined, and what the sandbox of a tool's calls is widened by
//! on which hosts. Client names and host ids compare case-insensitively, like the identities
//! they match.
//!
//! ```json
//! {"default": "allow",
//!  "rules": [{"clients": ["ci-*"], "tools": ["service_status"], "hosts": "role=db", "effect": "deny"},
//!            {"tools": ["restart_*"], "effect": "approve", "approvers": ["oncall-*"]},
//!            {"tools": ["fix_perms"], "effect": "allow", "bypass": "ask"},
//!            {"tools": ["backup_*"], "effect": "allow", "require_sandbox": true}],
//!  "sandbox": [{"tools": ["system_logs"], "hosts": "os=linux", "read": ["/var/log"], "write": [],
//!               "network": false, "memory": "512M", "pids": 256}]}
//! ```
//!
//! `approve` makes the call wait for an approval: by the caller itself (`approvers` absent or
//! `["caller"]`), or by one of the client-name globs in `approvers`, never the caller (a
//! two-person rule). `bypass` (`allow`, `deny`, `ask`: the default) decides what becomes of
//! the requests a confined tool makes to run a command outside its sandbox; `ask` asks the
//! rule's approvers.
//!
//! Unknown keys are refused (a typo must not silently allow or widen anything). Keys are added
//! only as optional ones with a default that keeps today's meaning, so files keep working.

use std::path::Path;

use serde::Deserialize;
use toolsrv_proto::v1::{
    CallerPolicy, PolicyEffect, SandboxGrant, SandboxPolicy, WaitsForApproval,
};
use toolsrv_tls::normalize_name;

use crate::error::FileError;
use crate::selector::{Candidate, Selector, glob};

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
    /// The index of the rule that requires the call to run confined, if one does.
    pub require_sandbox: Option<usize>,
}

impl Verdict {
    /// The rule that requires the call to run confined, when the host's sandbox (`level`, as
    /// its agent reports it) is not `enforced`: the call must not run there.
    pub fn unconfined_on(&self, level: &str) -> Option<usize> {
        self.require_sandbox.filter(|_| level != "enforced")
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
    #[serde(default)]
    sandbox: Vec<RawSandbox>,
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
    /// The call is refused on a host whose sandbox is not `enforced`.
    #[serde(default)]
    require_sandbox: bool,
}

/// A size as a number of bytes or a text such as `512M`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

/// CPU as a number of cores or a text such as `0.5` or `500m`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Cpu {
    Cores(f64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSandbox {
    /// Tool names or globs; absent: every tool.
    tools: Option<Vec<String>>,
    /// A host selector; absent: every host.
    hosts: Option<String>,
    #[serde(default)]
    read: Vec<String>,
    #[serde(default)]
    write: Vec<String>,
    network: Option<bool>,
    memory: Option<Size>,
    pids: Option<u64>,
    cpu: Option<Cpu>,
    /// Variables of the agent's environment passed to the tools (names or `PREFIX*`).
    #[serde(default)]
    env: Vec<String>,
}

#[derive(Debug)]
struct Rule {
    clients: Option<Vec<String>>,
    tools: Option<Vec<String>>,
    hosts: Option<Selector>,
    effect: Effect,
    approvers: Vec<String>,
    bypass: Bypass,
    require_sandbox: bool,
}

/// One `sandbox` entry, checked.
#[derive(Debug)]
struct SandboxEntry {
    hosts: Option<Selector>,
    grant: SandboxGrant,
}

/// Where a client may call a tool ([`Policy::reach`]).
#[derive(Debug)]
pub struct Reach<'a> {
    policy: &'a Policy,
    client: &'a str,
    tool: &'a str,
    how: How,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum How {
    /// Allowed on every host, at once (`None`) or once these approvers approve.
    Everywhere(Option<Vec<String>>),
    /// Denied by this rule (`None`: the default).
    Nowhere(Option<usize>),
    /// The first rule that applies selects hosts: asked of each host.
    PerHost,
}

impl Reach<'_> {
    /// `Some(true)` when the call may be made on every host, `Some(false)` on none, `None` when
    /// it depends on the host.
    pub fn fixed(&self) -> Option<bool> {
        match self.how {
            How::Everywhere(_) => Some(true),
            How::Nowhere(_) => Some(false),
            How::PerHost => None,
        }
    }

    /// Whether the call may be made on `host` (at once or once approved), asking the host only
    /// when the answer depends on it.
    pub fn allows(&self, host: &Candidate<'_>) -> bool {
        self.fixed().unwrap_or_else(|| self.on(host).is_ok())
    }

    /// Whether the call may be made on `host` (at once or once approved); if not, why.
    pub fn on(&self, host: &Candidate<'_>) -> Result<(), String> {
        match &self.how {
            How::Everywhere(_) => Ok(()),
            How::Nowhere(rule) => Err(denial(*rule, self.client, self.tool, host.id)),
            How::PerHost => self.policy.admit(self.client, self.tool, host).map(|_| ()),
        }
    }

    /// Whether a call on `host` may be made and, if so, who must approve it before it runs, as
    /// answers list them (`caller` alone when the caller decides): `None` when it is denied
    /// there, `Some(None)` when it runs at once. One look at the rules, asking the host only
    /// when the answer depends on it.
    pub fn waits_for(&self, host: &Candidate<'_>) -> Option<Option<Vec<String>>> {
        self.waits_on(|| Some(*host))
    }

    /// [`Reach::waits_for`] on the host `host` gives, which is asked for only when the answer
    /// depends on the host (`None` from it: no such host, denied).
    pub fn waits_on<'h>(
        &self,
        host: impl FnOnce() -> Option<Candidate<'h>>,
    ) -> Option<Option<Vec<String>>> {
        match &self.how {
            How::Everywhere(approvers) => Some(approvers.clone()),
            How::Nowhere(_) => None,
            How::PerHost => self
                .policy
                .admit(self.client, self.tool, &host()?)
                .ok()
                .map(|v| v.approve.then(|| listed(&v.approvers))),
        }
    }
}

/// Why a call of `tool` on `host` is refused when policy rule `rule` requires it to run confined
/// and the host's sandbox is not enforced, `state` saying what the host reports: routing (with
/// the agent's full account) and listings (with the level alone) say it alike.
pub fn unconfined_refusal(rule: usize, tool: &str, host: &str, state: &str) -> String {
    format!(
        "policy rule {rule} requires tool `{tool}` to run confined, and host `{host}` {state}; run \
         it where `sandbox=enforced`"
    )
}

/// Counts `host` among those where calls wait for `approvers` (as [`Reach::waits_for`] gives
/// them): one group per distinct approvers, in the order first met, hosts in the order added.
pub fn wait_on(groups: &mut Vec<WaitsForApproval>, approvers: Vec<String>, host: &str) {
    match groups.iter_mut().find(|w| w.approvers == approvers) {
        Some(w) => w.hosts.push(host.to_string()),
        None => groups.push(WaitsForApproval {
            approvers,
            hosts: vec![host.to_string()],
        }),
    }
}

/// Whether a rule's client or tool list (absent: any) names `value`.
fn names(list: &Option<Vec<String>>, value: &str) -> bool {
    list.as_ref()
        .is_none_or(|l| l.iter().any(|p| glob(p, value)))
}

/// Most bytes of approver globs an answer lists: a rule may name thousands, and
/// `DescribeTool` sends its answer in a header, which clients refuse past some kilobytes.
const MAX_SHOWN_APPROVERS_BYTES: usize = 1024;

/// A rule's `approvers` as answers list them: `caller` alone when the caller decides, else
/// the globs (see [`shown`]).
fn listed(approvers: &[String]) -> Vec<String> {
    shown(crate::approvals::deciders(approvers).0)
}

/// The first of `approvers` up to [`MAX_SHOWN_APPROVERS_BYTES`], then how many more there are.
fn shown(approvers: Vec<String>) -> Vec<String> {
    let total = approvers.len();
    let mut bytes = 0;
    let mut kept: Vec<String> = approvers
        .into_iter()
        .take_while(|a| {
            bytes += a.len();
            bytes <= MAX_SHOWN_APPROVERS_BYTES
        })
        .collect();
    if kept.len() < total {
        kept.push(format!("(and {} more)", total - kept.len()));
    }
    kept
}

/// Why the policy denies `client` calling `tool` on `host`: `rule` (`None`: the default).
fn denial(rule: Option<usize>, client: &str, tool: &str, host: &str) -> String {
    match rule {
        Some(i) => format!("policy rule {i} denies client {client} calling {tool} on {host}"),
        None => format!("no policy rule allows client {client} calling {tool} on {host}"),
    }
}

/// A loaded policy. The default policy allows everything and widens no sandbox.
#[derive(Debug)]
pub struct Policy {
    default: Effect,
    default_approvers: Vec<String>,
    default_bypass: Bypass,
    rules: Vec<Rule>,
    sandbox: Vec<SandboxEntry>,
    /// SHA-256 of the text it was read from (hex); empty for the default.
    sha256: String,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            default: Effect::Allow,
            default_approvers: Vec::new(),
            default_bypass: Bypass::Ask,
            rules: Vec::new(),
            sandbox: Vec::new(),
            sha256: String::new(),
        }
    }
}

/// Approver globs as matched: client names compare case-insensitively; `caller` stays itself.
fn approvers(list: Option<Vec<String>>, effect: Effect, at: &str) -> Result<Vec<String>, String> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    if effect == Effect::Deny {
        return Err(format!(
            "{at}.approvers: a denying rule has nothing to approve"
        ));
    }
    if list.is_empty() {
        return Err(format!(
            "{at}.approvers: empty; leave it out to let the caller approve"
        ));
    }
    Ok(list.iter().map(|p| normalize_name(p)).collect())
}

fn sandbox_entry(i: usize, raw: RawSandbox) -> Result<SandboxEntry, String> {
    let at = |field: &str, e: String| format!("sandbox[{i}].{field}: {e}");
    let hosts = raw
        .hosts
        .as_deref()
        .map(Selector::parse)
        .transpose()
        .map_err(|e| at("hosts", e.to_string()))?;
    for (field, paths) in [("read", &raw.read), ("write", &raw.write)] {
        if let Some(p) = paths.iter().find(|p| !Path::new(p).is_absolute()) {
            return Err(at(field, format!("`{p}` is not an absolute path")));
        }
    }
    let memory_bytes = match raw.memory {
        None => 0,
        Some(Size::Bytes(0)) => return Err(at("memory", "must be above zero".into())),
        Some(Size::Bytes(n)) => n,
        Some(Size::Text(t)) => toolsrv_confine::parse_size(&t).map_err(|e| at("memory", e))?,
    };
    let pids = match raw.pids {
        Some(0) => return Err(at("pids", "must be above zero".into())),
        p => p.unwrap_or(0),
    };
    let cpu_millis = match raw.cpu {
        None => 0,
        Some(Cpu::Cores(c)) => {
            toolsrv_confine::parse_cpu(&c.to_string()).map_err(|e| at("cpu", e))?
        }
        Some(Cpu::Text(t)) => toolsrv_confine::parse_cpu(&t).map_err(|e| at("cpu", e))?,
    };
    Ok(SandboxEntry {
        hosts,
        grant: SandboxGrant {
            tools: raw.tools.unwrap_or_default(),
            read: raw.read,
            write: raw.write,
            network: raw.network,
            memory_bytes,
            pids,
            cpu_millis,
            env: raw.env,
        },
    })
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
                require_sandbox: r.require_sandbox,
            });
        }
        let sandbox = raw
            .sandbox
            .into_iter()
            .enumerate()
            .map(|(i, raw)| sandbox_entry(i, raw))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            default: raw.default,
            default_approvers: approvers(raw.default_approvers, raw.default, "default")?,
            default_bypass: raw.default_bypass,
            rules,
            sandbox,
            sha256: toolsrv_registry::hex_sha256(text.as_bytes()),
        })
    }

    /// SHA-256 of the text the policy was read from, in hex (empty for the default policy): two
    /// coordinators decide alike when theirs are the same.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    pub fn load(path: &Path) -> Result<Self, FileError> {
        FileError::unless_guarded("policy", path)?;
        let text =
            toolsrv_tls::files::read_text_bounded(path, toolsrv_tls::files::MAX_SETTINGS_BYTES)
                .map_err(|e| FileError::read("policy", path, e))?;
        Self::parse(&text).map_err(|e| FileError::invalid("policy", path, e))
    }

    /// Whether `client` may call `tool` on `host`, at once or after an approval; the error says
    /// which rule denied it.
    pub fn check(&self, client: &str, tool: &str, host: &Candidate<'_>) -> Result<Verdict, String> {
        self.decide(self.rule_for(client, tool, host), client, tool, host)
    }

    /// What `rule` ([`Policy::rule_for`]; `None`: the default) decides of the call.
    fn decide(
        &self,
        rule: Option<usize>,
        client: &str,
        tool: &str,
        host: &Candidate<'_>,
    ) -> Result<Verdict, String> {
        let (effect, approvers, bypass, require_sandbox) = match rule {
            Some(i) => {
                let r = &self.rules[i];
                (
                    r.effect,
                    &r.approvers,
                    r.bypass,
                    r.require_sandbox.then_some(i),
                )
            }
            None => (
                self.default,
                &self.default_approvers,
                self.default_bypass,
                None,
            ),
        };
        let verdict = |approve| Verdict {
            rule,
            approve,
            approvers: approvers.clone(),
            bypass,
            require_sandbox,
        };
        match effect {
            Effect::Allow => Ok(verdict(false)),
            Effect::Approve => Ok(verdict(true)),
            Effect::Deny => Err(denial(rule, client, tool, host.id)),
        }
    }

    /// As [`Policy::check`], and refused where the deciding rule requires the sandbox and the
    /// host's is not `enforced` (as routing refuses the call, `unconfined`, with the host's
    /// own account of what is missing): whether a call may be made there at all.
    pub fn admit(&self, client: &str, tool: &str, host: &Candidate<'_>) -> Result<Verdict, String> {
        self.admitted(self.rule_for(client, tool, host), client, tool, host)
    }

    /// [`Policy::admit`] with the rule that applies already found.
    fn admitted(
        &self,
        rule: Option<usize>,
        client: &str,
        tool: &str,
        host: &Candidate<'_>,
    ) -> Result<Verdict, String> {
        let verdict = self.decide(rule, client, tool, host)?;
        match verdict.unconfined_on(host.sandbox) {
            Some(rule) => {
                let reports = if host.sandbox.is_empty() {
                    "reports no sandbox".to_string()
                } else {
                    format!("reports sandbox={}", host.sandbox)
                };
                Err(unconfined_refusal(rule, tool, host.id, &reports))
            }
            None => Ok(verdict),
        }
    }

    /// The first rule that applies to `client` calling `tool` on `host` (`None`: the default).
    fn rule_for(&self, client: &str, tool: &str, host: &Candidate<'_>) -> Option<usize> {
        self.rules.iter().position(|rule| {
            names(&rule.clients, client)
                && names(&rule.tools, tool)
                && rule.hosts.as_ref().is_none_or(|s| s.matches(host))
        })
    }

    /// What [`Policy::admit`] says, as listings show it to the caller: allowed, asked of whom,
    /// or refused and why, with the rule that decides.
    pub fn answer(&self, client: &str, tool: &str, host: &Candidate<'_>) -> CallerPolicy {
        let applies = self.rule_for(client, tool, host);
        let rule = applies.and_then(|i| u32::try_from(i).ok());
        match self.admitted(applies, client, tool, host) {
            Ok(verdict) => CallerPolicy {
                effect: if verdict.approve {
                    PolicyEffect::Approve
                } else {
                    PolicyEffect::Allow
                } as i32,
                rule,
                denial: String::new(),
                approvers: if verdict.approve {
                    listed(&verdict.approvers)
                } else {
                    Vec::new()
                },
            },
            Err(denial) => CallerPolicy {
                effect: PolicyEffect::Deny as i32,
                rule,
                denial,
                approvers: Vec::new(),
            },
        }
    }

    /// Where `client` may call `tool` (at once or once approved), as far as it can be told
    /// without a host: everywhere, nowhere (and why), or per host ([`Reach::on`]). What is
    /// offered to a model (sessions, `FindTools`) leaves out what it may not call.
    pub fn reach<'a>(&'a self, client: &'a str, tool: &'a str) -> Reach<'a> {
        let how = self
            .rules
            .iter()
            .enumerate()
            .find(|(_, rule)| names(&rule.clients, client) && names(&rule.tools, tool))
            .map_or(
                match self.default {
                    Effect::Deny => How::Nowhere(None),
                    Effect::Allow => How::Everywhere(None),
                    Effect::Approve => How::Everywhere(Some(listed(&self.default_approvers))),
                },
                |(i, rule)| match (&rule.hosts, rule.effect) {
                    // A rule that selects hosts, or requires the host's sandbox, answers per host.
                    (Some(_), _) => How::PerHost,
                    (None, Effect::Allow | Effect::Approve) if rule.require_sandbox => How::PerHost,
                    (None, Effect::Deny) => How::Nowhere(Some(i)),
                    (None, Effect::Allow) => How::Everywhere(None),
                    (None, Effect::Approve) => How::Everywhere(Some(listed(&rule.approvers))),
                },
            );
        Reach {
            policy: self,
            client,
            tool,
            how,
        }
    }

    /// How many rules it has.
    pub fn rules(&self) -> usize {
        self.rules.len()
    }

    /// How many `sandbox` entries it has.
    pub fn sandbox_entries(&self) -> usize {
        self.sandbox.len()
    }

    /// The `sandbox` entries whose host selector matches `host`, in order: what its agent is
    /// sent when it attaches, and again when a new policy changes them.
    pub fn sandbox_for(&self, host: &Candidate<'_>) -> SandboxPolicy {
        SandboxPolicy {
            grants: self
                .sandbox
                .iter()
                .filter(|e| e.hosts.as_ref().is_none_or(|s| s.matches(host)))
                .map(|e| e.grant.clone())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A host with these facts and nothing else.
    fn on<'a>(id: &'a str, os: &'a str, labels: &'a BTreeMap<String, String>) -> Candidate<'a> {
        Candidate {
            id,
            os,
            arch: "amd64",
            hostname: "",
            kernel: "",
            sandbox: "",
            labels,
        }
    }

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
        let db = on("db-1", "linux", &db_labels);
        let web = on("web-1", "linux", &none);
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

    /// `reach` says what `admit` would on every host (a rule requiring the sandbox included),
    /// deciding without a host where it can.
    #[test]
    fn reach_agrees_with_admit_on_every_host() {
        let policies = [
            r#"{"default": "deny", "rules": [
                {"clients": ["ci-*"], "hosts": "role=db", "effect": "deny"},
                {"clients": ["ci-*", "alice"], "tools": ["env_*", "disk_usage"], "effect": "allow"},
                {"tools": ["restart_*"], "effect": "approve", "approvers": ["oncall-*"]},
                {"clients": ["bob"], "effect": "deny"},
                {"clients": ["root"], "effect": "allow"}]}"#,
            r#"{"rules": [{"tools": ["drop_*"], "effect": "deny"},
                         {"tools": ["backup_*"], "effect": "approve", "require_sandbox": true},
                         {"tools": ["wipe"], "hosts": "os=linux", "effect": "deny"},
                         {"tools": ["restart_*"], "hosts": "role=db", "effect": "approve"}]}"#,
            r#"{"default": "approve", "default_approvers": ["lead"]}"#,
        ];
        let db_labels: BTreeMap<String, String> = [("role".into(), "db".into())].into();
        let none = BTreeMap::new();
        let hosts = [
            on("db-1", "linux", &db_labels),
            on("web-1", "linux", &none),
            on("mac-1", "darwin", &none),
            Candidate {
                sandbox: "enforced",
                ..on("box-1", "linux", &none)
            },
        ];
        let mut fixed = 0;
        for text in policies {
            let p = Policy::parse(text).unwrap();
            for client in ["ci-7", "alice", "bob", "root", "oncall-1"] {
                for tool in [
                    "env_info",
                    "disk_usage",
                    "restart_nginx",
                    "drop_table",
                    "wipe",
                    "backup_db",
                ] {
                    let reach = p.reach(client, tool);
                    for h in &hosts {
                        let answer = p.answer(client, tool, h);
                        let waits = match answer.effect() {
                            PolicyEffect::Deny => None,
                            PolicyEffect::Approve => Some(Some(answer.approvers)),
                            _ => Some(None),
                        };
                        assert_eq!(reach.waits_for(h), waits, "{client} {tool} on {}", h.id);
                        let checked = p.admit(client, tool, h).map(|_| ());
                        assert_eq!(reach.on(h), checked, "{client} {tool} on {}", h.id);
                        assert_eq!(reach.allows(h), checked.is_ok(), "{client} {tool}");
                        if let Some(all) = reach.fixed() {
                            fixed += 1;
                            assert_eq!(all, checked.is_ok(), "{client} {tool} on {}", h.id);
                        }
                    }
                }
            }
        }
        assert!(fixed > 0, "some answers need no host");
    }

    /// What a listing shows the caller is what a call would meet, with the rule that decides.
    #[test]
    fn answers_say_what_a_call_would_meet() {
        let p = Policy::parse(
            r#"{"default": "approve", "default_approvers": ["lead"], "rules": [
                {"clients": ["ci-*"], "hosts": "role=db", "effect": "deny"},
                {"tools": ["restart_*"], "effect": "approve", "approvers": ["oncall-*"]},
                {"tools": ["fix_*"], "effect": "approve"},
                {"clients": ["alice"], "effect": "allow"}]}"#,
        )
        .unwrap();
        let db_labels: BTreeMap<String, String> = [("role".into(), "db".into())].into();
        let none = BTreeMap::new();
        let (db, web) = (on("db-1", "linux", &db_labels), on("web-1", "linux", &none));
        let answer = |client, tool, h: &Candidate<'_>| {
            let a = p.answer(client, tool, h);
            (a.effect(), a.rule, a.denial, a.approvers)
        };
        let denial = "policy rule 0 denies client ci-7 calling env_info on db-1";
        #[allow(clippy::type_complexity)]
        let cases: [(
            &str,
            &str,
            &Candidate<'_>,
            PolicyEffect,
            Option<u32>,
            &str,
            &[&str],
        ); 5] = [
            (
                "ci-7",
                "env_info",
                &db,
                PolicyEffect::Deny,
                Some(0),
                denial,
                &[],
            ),
            (
                "ci-7",
                "restart_nginx",
                &web,
                PolicyEffect::Approve,
                Some(1),
                "",
                &["oncall-*"],
            ),
            (
                "bob",
                "fix_perms",
                &web,
                PolicyEffect::Approve,
                Some(2),
                "",
                &["caller"],
            ),
            (
                "alice",
                "env_info",
                &db,
                PolicyEffect::Allow,
                Some(3),
                "",
                &[],
            ),
            (
                "bob",
                "env_info",
                &web,
                PolicyEffect::Approve,
                None,
                "",
                &["lead"],
            ),
        ];
        for (client, tool, h, effect, rule, denial, approvers) in cases {
            assert_eq!(
                answer(client, tool, h),
                (
                    effect,
                    rule,
                    denial.to_string(),
                    approvers.iter().map(|a| a.to_string()).collect()
                ),
                "{client} {tool} on {}",
                h.id
            );
        }
        let closed = Policy::parse(r#"{"default": "deny"}"#).unwrap();
        let a = closed.answer("bob", "env_info", &web);
        assert_eq!((a.effect(), a.rule), (PolicyEffect::Deny, None));
        assert_eq!(
            a.denial,
            "no policy rule allows client bob calling env_info on web-1"
        );
        let open = Policy::default().answer("bob", "env_info", &web);
        assert_eq!((open.effect(), open.rule), (PolicyEffect::Allow, None));
        // A rule requiring the sandbox refuses where the host's is not enforced, as routing does.
        let confined = Policy::parse(
            r#"{"rules": [{"tools": ["backup_*"], "effect": "allow", "require_sandbox": true}]}"#,
        )
        .unwrap();
        let a = confined.answer("bob", "backup_db", &web);
        assert_eq!((a.effect(), a.rule), (PolicyEffect::Deny, Some(0)));
        assert_eq!(
            a.denial,
            "policy rule 0 requires tool `backup_db` to run confined, and host `web-1` reports no \
             sandbox; run it where `sandbox=enforced`"
        );
        let enforced = Candidate {
            sandbox: "enforced",
            ..on("box-1", "linux", &none)
        };
        let a = confined.answer("bob", "backup_db", &enforced);
        assert_eq!((a.effect(), a.rule), (PolicyEffect::Allow, Some(0)));
        // A rule naming more approvers than a header holds lists the first ones.
        let many: Vec<String> = (0..5000).map(|i| format!("\"oncall-{i}\"")).collect();
        let crowded = Policy::parse(&format!(
            r#"{{"rules": [{{"effect": "approve", "approvers": [{}]}}]}}"#,
            many.join(",")
        ))
        .unwrap();
        let a = crowded.answer("bob", "env_info", &web);
        assert!(a.approvers.len() > 10, "{:?}", a.approvers);
        assert_eq!(a.approvers[0], "oncall-0");
        let shown_bytes: usize = a.approvers.iter().map(String::len).sum();
        assert!(shown_bytes < 1100, "{shown_bytes}");
        let last = a.approvers.last().unwrap();
        assert_eq!(
            *last,
            format!("(and {} more)", 5000 - (a.approvers.len() - 1))
        );
    }

    #[test]
    fn names_match_whatever_their_case() {
        let none = BTreeMap::new();
        let host = |id| on(id, "linux", &none);
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
        for (text, want) in [
            (r#"{"sandbox": [{"read": ["var/log"]}]}"#, "sandbox[0].read"),
            (r#"{"sandbox": [{"memory": "12X"}]}"#, "sandbox[0].memory"),
            (r#"{"sandbox": [{"memory": 0}]}"#, "sandbox[0].memory"),
            (r#"{"sandbox": [{"pids": 0}]}"#, "sandbox[0].pids"),
            (r#"{"sandbox": [{"cpu": "lots"}]}"#, "sandbox[0].cpu"),
            (r#"{"sandbox": [{"hosts": "a b"}]}"#, "sandbox[0].hosts"),
            (r#"{"sandbox": [{"writ": []}]}"#, "invalid policy"),
        ] {
            let err = Policy::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn rules_can_require_confinement() {
        let p = Policy::parse(
            r#"{"rules": [
                {"tools": ["backup_*"], "effect": "allow", "require_sandbox": true},
                {"tools": ["other"], "effect": "allow"}]}"#,
        )
        .unwrap();
        let none = BTreeMap::new();
        let host = Candidate {
            sandbox: "off",
            ..on("h", "linux", &none)
        };
        assert_eq!(
            p.check("a", "backup_db", &host).unwrap().require_sandbox,
            Some(0)
        );
        assert_eq!(p.check("a", "other", &host).unwrap().require_sandbox, None);
        assert_eq!(
            p.check("a", "unruled", &host).unwrap().require_sandbox,
            None
        );
    }

    #[test]
    fn sandbox_entries_go_to_the_hosts_they_select() {
        let p = Policy::parse(
            r#"{"sandbox": [
                {"tools": ["system_logs"], "hosts": "os=linux", "read": ["/var/log"], "write": [],
                 "network": false, "memory": "512M", "pids": 256, "cpu": 0.5, "env": ["JOURNAL_*"]},
                {"hosts": "role=db", "memory": 1073741824, "cpu": "250m"}]}"#,
        )
        .unwrap();
        let db: BTreeMap<String, String> = [("role".into(), "db".into())].into();
        let none = BTreeMap::new();
        let host = |os, labels| Candidate {
            sandbox: "enforced",
            ..on("h", os, labels)
        };
        let linux_db = p.sandbox_for(&host("linux", &db));
        assert_eq!(linux_db.grants.len(), 2);
        let logs = &linux_db.grants[0];
        assert_eq!(logs.tools, ["system_logs"]);
        assert_eq!(logs.read, ["/var/log"]);
        assert_eq!(logs.network, Some(false));
        assert_eq!(logs.memory_bytes, 512 << 20);
        assert_eq!(logs.pids, 256);
        assert_eq!(logs.cpu_millis, 500);
        assert_eq!(logs.env, ["JOURNAL_*"]);
        let all_tools = &linux_db.grants[1];
        assert!(all_tools.tools.is_empty());
        assert_eq!(
            (all_tools.memory_bytes, all_tools.cpu_millis),
            (1 << 30, 250)
        );
        assert_eq!(all_tools.network, None);
        assert!(p.sandbox_for(&host("darwin", &none)).grants.is_empty());
        assert!(
            Policy::default()
                .sandbox_for(&host("linux", &db))
                .grants
                .is_empty()
        );
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
        let host = on("db-1", "linux", &none);
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

    #[test]
    fn a_policy_file_that_cannot_be_used_keeps_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.json");
        match Policy::load(&missing).unwrap_err() {
            FileError::Io { source, path, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
                assert_eq!(path, missing);
            }
            other => panic!("{other:?}"),
        }
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, r#"{"rules": [{"effect": "maybe"}]}"#).unwrap();
        let err = Policy::load(&bad).unwrap_err();
        assert!(matches!(err, FileError::Invalid { .. }));
        assert!(err.to_string().starts_with("policy "), "{err}");

        // One every user of the machine could rewrite grants nothing.
        use std::os::unix::fs::PermissionsExt;
        let open = dir.path().join("open.json");
        std::fs::write(&open, r#"{"rules": []}"#).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = Policy::load(&open).unwrap_err().to_string();
        assert!(
            err.contains("writable by every user of this machine (mode 0666)")
                && err.contains(&format!("chmod o-w {}", open.display())),
            "{err}"
        );
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        Policy::load(&open).unwrap();
    }
}
