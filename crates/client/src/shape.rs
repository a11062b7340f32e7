//! The JSON shapes remote listings and definitions share with `toolctl local`, built from protocol messages.

use serde::Serialize;
use serde_json::Value;
use toolsrv_host::ListEntry;
use toolsrv_proto::v1::{
    CallerPolicy, HostState, PolicyEffect, SessionState, ToolDefinition, ToolMatch, ToolStatus,
    WaitsForApproval,
};

use crate::ClientError;

/// A tool's entry in a listing: the shape `toolctl local list --json` prints, and on a
/// coordinator's listing what its policy says of the caller calling the tool.
pub fn list_entry(status: &ToolStatus) -> Listed<'_> {
    let description = Some(status.description.as_str()).filter(|d| !d.is_empty());
    Listed {
        entry: ListEntry {
            name: &status.name,
            visible: status.visible,
            variant: status.variant.and_then(|v| usize::try_from(v).ok()),
            reason: (!status.visible).then_some(status.reason.as_str()),
            description,
            host_only: status.host_only,
        },
        policy: status.policy.as_ref().map(PolicyJson::from),
    }
}

/// One tool of a listing, as `toolctl tools --json` prints it.
#[derive(Serialize, Debug)]
pub struct Listed<'a> {
    #[serde(flatten)]
    pub entry: ListEntry<'a>,
    /// What the coordinator's policy says of the caller calling it there; absent from local
    /// listings, hidden tools and coordinators that do not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyJson<'a>>,
}

impl<'a> From<ListEntry<'a>> for Listed<'a> {
    fn from(entry: ListEntry<'a>) -> Self {
        Self {
            entry,
            policy: None,
        }
    }
}

/// Whether approvers as the coordinator lists them (`caller` alone) leave the decision to the
/// caller.
pub fn caller_decides(approvers: &[String]) -> bool {
    approvers.iter().all(|a| a == "caller")
}

/// A [`CallerPolicy`] in the words of the policy file: `effect` is `allow`, `approve` or
/// `deny`; `rule` is `null` for the policy's default; `denial` only with `deny`, `approvers`
/// only with `approve`.
#[derive(Serialize, Debug, PartialEq)]
pub struct PolicyJson<'a> {
    pub effect: &'static str,
    pub rule: Option<u32>,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub denial: &'a str,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    pub approvers: &'a [String],
}

impl<'a> From<&'a CallerPolicy> for PolicyJson<'a> {
    fn from(policy: &'a CallerPolicy) -> Self {
        Self {
            effect: match policy.effect() {
                PolicyEffect::Allow => "allow",
                PolicyEffect::Approve => "approve",
                PolicyEffect::Deny => "deny",
                PolicyEffect::Unspecified => "unknown",
            },
            rule: policy.rule,
            denial: &policy.denial,
            approvers: &policy.approvers,
        }
    }
}

impl PolicyJson<'_> {
    /// What a text listing adds after the tool's description: nothing when allowed.
    pub fn note(&self) -> Option<String> {
        let by = match self.rule {
            Some(i) => format!("rule {i}"),
            None => "the default".to_string(),
        };
        match self.effect {
            "allow" => None,
            "approve" if caller_decides(self.approvers) => {
                Some(format!("[asks your approval first: {by}]"))
            }
            "approve" => Some(format!(
                "[waits for approval by {}: {by}]",
                self.approvers.join(", ")
            )),
            "deny" => Some(format!("[denied to you: {by}]")),
            other => Some(format!("[policy: {other}]")),
        }
    }
}

/// Mirrors the `Serialize` of `toolsrv_meta::ResolvedTool` field for field (names, order, omissions),
/// so `toolctl describe` and `toolctl local describe` print the same text for the same tool.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Described<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    keywords: &'a [String],
    args: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scope: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_format: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resets_counter: Option<bool>,
}

/// A definition as the model-facing JSON object `toolctl local describe` prints: `args` parsed (and
/// `{"type":"object"}` when empty, as for a tool that declares none), empty fields left out.
pub fn definition_json(def: &ToolDefinition) -> Result<Value, ClientError> {
    let args = if def.args_schema_json.trim().is_empty() {
        serde_json::json!({"type": "object"})
    } else {
        serde_json::from_str(&def.args_schema_json).map_err(|e| {
            ClientError::Protocol(format!(
                "the args schema of tool `{}` is not valid JSON: {e}",
                def.name
            ))
        })?
    };
    let described = Described {
        name: &def.name,
        description: non_empty(&def.description),
        prompt: non_empty(&def.prompt),
        keywords: &def.keywords,
        args,
        tier: non_empty(&def.tier),
        scope: non_empty(&def.scope),
        output_format: non_empty(&def.output_format),
        resets_counter: def.resets_counter,
    };
    serde_json::to_value(described)
        .map_err(|e| ClientError::Protocol(format!("cannot encode tool `{}`: {e}", def.name)))
}

/// A session as JSON (`toolctl session show --json`, one line per state of `session watch
/// --json`): its hosts and every loaded tool with its model-facing definitions.
pub fn session_json(state: &SessionState) -> Result<Value, ClientError> {
    let selected: Vec<Value> = state
        .selected
        .iter()
        .map(|h| {
            serde_json::json!({
                "host": h.host_id,
                "state": host_state_name(h.state),
            })
        })
        .collect();
    let mut tools = Vec::with_capacity(state.tools.len());
    for t in &state.tools {
        let mut resolutions = Vec::with_capacity(t.resolutions.len());
        for r in &t.resolutions {
            let definition = match &r.definition {
                Some(def) => definition_json(def)?,
                None => Value::Null,
            };
            resolutions.push(serde_json::json!({"hosts": r.hosts, "definition": definition}));
        }
        let mut tool = serde_json::json!({
            "name": t.name,
            "tier": t.tier,
            "autoLoaded": t.auto_loaded,
            "lastUsedUnixMs": t.last_used_unix_ms,
            "hosts": t.hosts,
            "resolutions": resolutions,
        });
        if !t.unavailable.is_empty() {
            tool["unavailable"] = Value::from(t.unavailable.as_str());
        }
        if t.host_only {
            tool["hostOnly"] = Value::from(true);
        }
        if !t.approvals.is_empty() {
            tool["approvals"] = approvals_json(&t.approvals);
        }
        tools.push(tool);
    }
    let mut shown = serde_json::json!({
        "id": state.id,
        "generation": state.generation,
        "hosts": state.hosts,
        "maxLoaded": state.max_loaded,
        "selected": selected,
        "tools": tools,
        "watchers": state.watchers,
        "idleExpiresUnixMs": state.idle_expires_unix_ms,
        "catalogRevision": state.catalog_revision,
    });
    if state.definitions_omitted {
        shown["definitionsOmitted"] = Value::from(true);
    }
    Ok(shown)
}

/// Where calls wait for approval (a loaded tool's or a match's `approvals`) as JSON:
/// `[{"approvers": [...], "hosts": [...]}, ...]`.
pub fn approvals_json(approvals: &[WaitsForApproval]) -> Value {
    approvals
        .iter()
        .map(|w| serde_json::json!({"approvers": w.approvers, "hosts": w.hosts}))
        .collect()
}

/// Each group of `approvals` of a tool offered on `hosts`: who decides (`None`: the caller) and
/// on which hosts (`None`: every one of `hosts`).
pub fn approval_groups<'a>(
    approvals: &'a [WaitsForApproval],
    hosts: &[String],
) -> impl Iterator<Item = (Option<&'a [String]>, Option<&'a [String]>)> {
    let all = hosts.len();
    approvals.iter().map(move |w| {
        let by = (!caller_decides(&w.approvers)).then_some(w.approvers.as_slice());
        let on = (w.hosts.len() != all).then_some(w.hosts.as_slice());
        (by, on)
    })
}

/// Where the policy makes calls of a tool offered on `hosts` wait for approval, one phrase per
/// group of approvers (`by oncall-* on a,b`; without the hosts when they are all of `hosts`),
/// `None` when none does.
pub fn approvals_text(approvals: &[WaitsForApproval], hosts: &[String]) -> Option<String> {
    let phrases: Vec<String> = approval_groups(approvals, hosts)
        .map(|(by, on)| {
            let by = by.map_or_else(|| "by you".to_string(), |a| format!("by {}", a.join(", ")));
            match on {
                None => by,
                Some(hosts) => format!("{by} on {}", hosts.join(",")),
            }
        })
        .collect();
    (!phrases.is_empty()).then(|| phrases.join("; "))
}

/// A ranked tool as JSON (`toolctl find --json`).
pub fn match_json(m: &ToolMatch) -> Value {
    let mut value = serde_json::json!({
        "name": m.name,
        "score": m.score,
        "description": m.description,
        "hosts": m.hosts,
    });
    if let Some(lexical) = m.lexical_score {
        value["lexical"] = Value::from(lexical);
    }
    if let Some(semantic) = m.semantic_score {
        value["semantic"] = Value::from(semantic);
    }
    if m.host_only {
        value["host_only"] = Value::from(true);
    }
    if !m.approvals.is_empty() {
        value["approvals"] = approvals_json(&m.approvals);
    }
    value
}

/// The lower-case word for a host state, as `toolctl hosts` prints it.
pub fn host_state_name(state: i32) -> &'static str {
    match HostState::try_from(state) {
        Ok(HostState::Online) => "online",
        Ok(HostState::Offline) => "offline",
        Ok(HostState::Syncing) => "syncing",
        Ok(HostState::Reconnecting) => "reconnecting",
        _ => "unknown",
    }
}

/// Proto3 strings cannot be absent: empty stands for unset.
fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;
    use toolsrv_meta::{Host, Resolution};

    use super::*;

    /// What `toolctl local describe` prints and what `toolctl describe` prints for the definition an
    /// agent sends for the same tool.
    fn both(meta: &str) -> (String, String) {
        let parsed = toolsrv_meta::parse("t", Path::new("t.meta"), meta.as_bytes());
        let meta = parsed
            .meta
            .unwrap_or_else(|| panic!("{:?}", parsed.diagnostics));
        let Resolution::Visible { tool, .. } = meta.resolve(&Host::current()) else {
            panic!("hidden")
        };
        let local = serde_json::to_string_pretty(&tool).unwrap();
        let remote = definition_json(&toolsrv_agent::definition(&tool)).unwrap();
        (local, serde_json::to_string_pretty(&remote).unwrap())
    }

    #[test]
    fn describe_matches_local_describe() {
        let cases = [
            r#"{"cmd": "true"}"#,
            r#"{"description": "d", "cmd": "true"}"#,
            r#"{"description": "Disk usage", "prompt": "Use it for df", "keywords": ["disk", "df"],
                "args": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
                "tier": "warm", "scope": "host", "outputFormat": "text", "resetsCounter": false, "cmd": "df"}"#,
            r#"{"tier": "hot", "resetsCounter": true, "cmd": "true"}"#,
        ];
        for meta in cases {
            let (local, remote) = both(meta);
            assert_eq!(local, remote, "for {meta}");
        }
    }

    #[test]
    fn describe_omits_unset_fields_and_parses_args() {
        let def = ToolDefinition {
            name: "t".into(),
            args_schema_json: r#"{"type":"object","required":["x"]}"#.into(),
            keywords: vec!["k".into()],
            ..Default::default()
        };
        assert_eq!(
            definition_json(&def).unwrap(),
            json!({"name": "t", "keywords": ["k"], "args": {"type": "object", "required": ["x"]}})
        );
        let empty = ToolDefinition {
            name: "t".into(),
            ..Default::default()
        };
        assert_eq!(
            definition_json(&empty).unwrap(),
            json!({"name": "t", "args": {"type": "object"}})
        );
        let broken = ToolDefinition {
            name: "t".into(),
            args_schema_json: "{".into(),
            ..Default::default()
        };
        assert!(definition_json(&broken).is_err());
    }

    #[test]
    fn list_entries_match_the_local_shape() {
        let visible = ToolStatus {
            name: "a".into(),
            visible: true,
            variant: Some(1),
            reason: String::new(),
            description: "A tool".into(),
            definition: Some(ToolDefinition {
                name: "a".into(),
                description: "A tool".into(),
                ..Default::default()
            }),
            host_only: false,
            policy: None,
        };
        let hidden = ToolStatus {
            name: "b".into(),
            visible: false,
            variant: None,
            reason: "no variant matches this host".into(),
            description: "B tool".into(),
            definition: None,
            host_only: true,
            policy: None,
        };
        let plain = ToolStatus {
            name: "c".into(),
            visible: true,
            definition: Some(ToolDefinition::default()),
            ..Default::default()
        };
        let json = serde_json::to_value([
            list_entry(&visible),
            list_entry(&hidden),
            list_entry(&plain),
        ])
        .unwrap();
        assert_eq!(
            json,
            json!([
                {"name": "a", "visible": true, "variant": 1, "reason": null, "description": "A tool"},
                {"name": "b", "visible": false, "variant": null, "reason": "no variant matches this host", "description": "B tool", "host_only": true},
                {"name": "c", "visible": true, "variant": null, "reason": null, "description": null},
            ])
        );
    }

    #[test]
    fn a_coordinator_listing_says_what_the_policy_answers() {
        let answered = |effect: PolicyEffect, rule, denial: &str, approvers: &[&str]| ToolStatus {
            name: "t".into(),
            visible: true,
            definition: Some(ToolDefinition::default()),
            policy: Some(CallerPolicy {
                effect: effect as i32,
                rule,
                denial: denial.into(),
                approvers: approvers.iter().map(|a| a.to_string()).collect(),
            }),
            ..Default::default()
        };
        let denied = answered(
            PolicyEffect::Deny,
            Some(2),
            "policy rule 2 denies client alice calling t on a",
            &[],
        );
        let asked = answered(PolicyEffect::Approve, None, "", &["oncall-*", "lead"]);
        let own = answered(PolicyEffect::Approve, Some(0), "", &["caller"]);
        let allowed = answered(PolicyEffect::Allow, Some(1), "", &[]);
        let json = serde_json::to_value([
            list_entry(&denied),
            list_entry(&asked),
            list_entry(&allowed),
        ])
        .unwrap();
        assert_eq!(
            json[0]["policy"],
            json!({"effect": "deny", "rule": 2, "denial": "policy rule 2 denies client alice calling t on a"})
        );
        assert_eq!(
            json[1]["policy"],
            json!({"effect": "approve", "rule": null, "approvers": ["oncall-*", "lead"]})
        );
        assert_eq!(json[2]["policy"], json!({"effect": "allow", "rule": 1}));
        let note = |s: &ToolStatus| list_entry(s).policy.and_then(|p| p.note());
        assert_eq!(note(&denied).as_deref(), Some("[denied to you: rule 2]"));
        assert_eq!(
            note(&asked).as_deref(),
            Some("[waits for approval by oncall-*, lead: the default]")
        );
        assert_eq!(
            note(&own).as_deref(),
            Some("[asks your approval first: rule 0]")
        );
        assert_eq!(note(&allowed), None);
    }
}
