//! `toolsrv policy check`: reads a policy file (and a host labels file) as the coordinator
//! does, with the same checks, and says what it decides for one call, without a coordinator:
//! what to run before putting an edited policy in place, since the coordinator follows the file
//! while it runs.
//!
//! Exit status: 0 when the files load (and the call asked about may run, at once or once
//! approved), 77 when the call asked about is refused, 1 when a file cannot be used, 64 for a
//! malformed `--label` or `--fact`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use toolsrv_coordinator::Policy;
use toolsrv_coordinator::labels::HostLabels;
use toolsrv_coordinator::policy::{Bypass, Verdict};
use toolsrv_coordinator::selector::Candidate;
use toolsrv_proto::v1::SandboxGrant;
use toolsrv_tls::normalize_name;

/// Exit status of a call the policy refuses (as `toolctl` exits for a denied call).
const REFUSED: u8 = 77;
/// Exit status of a malformed `--label` or `--fact`.
const USAGE: u8 = 64;

/// Check a policy file, and what it decides for one call
#[derive(Debug, Args)]
pub struct PolicyCheckArgs {
    /// The policy file, as given to the coordinator's --policy
    policy: PathBuf,
    /// The coordinator's --host-labels file: the labels it gives the host asked about
    #[arg(long, value_name = "FILE")]
    host_labels: Option<PathBuf>,
    /// Ask about a call by this client (with --tool and --host)
    #[arg(long, requires_all = ["tool", "host"])]
    client: Option<String>,
    /// The tool of the call asked about
    #[arg(long, requires_all = ["client", "host"])]
    tool: Option<String>,
    /// The host id of the call asked about
    #[arg(long, requires_all = ["client", "tool"])]
    host: Option<String>,
    /// A label the host's certificate carries, bound at enrollment (KEY=VALUE; repeatable)
    #[arg(long = "label", value_name = "KEY=VALUE", requires = "host")]
    labels: Vec<String>,
    /// A fact the host's agent reports: os, arch, hostname, kernel or sandbox (KEY=VALUE;
    /// repeatable)
    #[arg(long = "fact", value_name = "KEY=VALUE", requires = "host")]
    facts: Vec<String>,
}

pub fn run(args: &PolicyCheckArgs) -> ExitCode {
    let policy = match Policy::load(&args.policy) {
        Ok(policy) => policy,
        Err(e) => return failed(&e.to_string()),
    };
    println!(
        "policy {}: {}, {} (sha256 {})",
        args.policy.display(),
        counted(policy.rules(), "rule", "rules"),
        counted(policy.sandbox_entries(), "sandbox entry", "sandbox entries"),
        policy.sha256()
    );
    let host_labels = match &args.host_labels {
        Some(path) => match HostLabels::load(path) {
            Ok(labels) => {
                let entries = counted(labels.len(), "entry", "entries");
                println!(
                    "host labels {}: {entries} (sha256 {})",
                    path.display(),
                    labels.sha256()
                );
                labels
            }
            Err(e) => return failed(&e.to_string()),
        },
        None => HostLabels::default(),
    };
    let (Some(client), Some(tool), Some(host)) = (&args.client, &args.tool, &args.host) else {
        return ExitCode::SUCCESS;
    };
    let (client, host) = (normalize_name(client), normalize_name(host));
    let (mut trusted, facts) = match (pairs("--label", &args.labels), pairs("--fact", &args.facts))
    {
        (Ok(labels), Ok(facts)) => (labels, facts),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("toolsrv policy check: {e}");
            return ExitCode::from(USAGE);
        }
    };
    if let Some(key) = facts
        .keys()
        .find(|k| !["os", "arch", "hostname", "kernel", "sandbox"].contains(&k.as_str()))
    {
        eprintln!(
            "toolsrv policy check: --fact {key}: not a fact (os, arch, hostname, kernel, sandbox); \
             a label the coordinator trusts is --label, or comes from --host-labels"
        );
        return ExitCode::from(USAGE);
    }
    // As the coordinator labels a host: the certificate's labels, the file's over them.
    trusted.extend(host_labels.of(&host));
    let fact = |key: &str| facts.get(key).map_or("", String::as_str);
    let candidate = Candidate {
        id: &host,
        os: fact("os"),
        arch: fact("arch"),
        hostname: fact("hostname"),
        kernel: fact("kernel"),
        sandbox: fact("sandbox"),
        labels: &trusted,
    };
    // Names as typed, escapes and line breaks shown escaped: the terminal does not obey them.
    let shown = |name: &str| toolsrv_proto::text::printable_line(name, 256);
    let call = format!(
        "{} calling {} on {}",
        shown(&client),
        shown(tool),
        shown(&host)
    );
    if !trusted.is_empty() {
        println!(
            "trusted labels of {}: {}",
            shown(&host),
            shown(&joined(&trusted))
        );
    }
    let code = match policy.check(&client, tool, &candidate) {
        Err(reason) => {
            println!(
                "{call}: denied: {}",
                toolsrv_proto::text::printable(&reason)
            );
            ExitCode::from(REFUSED)
        }
        Ok(verdict) => say(&call, &verdict, fact("sandbox")),
    };
    let grants = policy.sandbox_for(&candidate).grants;
    println!("sandbox grants for {host}: {}", grants.len());
    for grant in &grants {
        println!("  {}", grant_line(grant));
    }
    code
}

/// Prints what the policy says of a call it does not deny; refused when the host's sandbox, if
/// given, is not what a rule requires.
fn say(call: &str, verdict: &Verdict, sandbox: &str) -> ExitCode {
    let by = match verdict.rule {
        Some(i) => format!("policy rule {i}"),
        None => "the policy's default".to_string(),
    };
    let approvers = if verdict.approvers.is_empty() {
        "the caller".to_string()
    } else {
        format!("one of {}", verdict.approvers.join(", "))
    };
    if verdict.approve {
        println!("{call}: approve: waits for {approvers} ({by})");
    } else {
        println!("{call}: allowed ({by})");
    }
    let bypass = match verdict.bypass {
        Bypass::Allow => "allowed".to_string(),
        Bypass::Deny => "denied".to_string(),
        Bypass::Ask => format!("asked of {approvers}"),
    };
    println!("  commands outside the sandbox (bypass): {bypass}");
    let Some(rule) = verdict.require_sandbox else {
        return ExitCode::SUCCESS;
    };
    match sandbox {
        "enforced" => {
            println!("  must run confined (policy rule {rule}): the host's sandbox is enforced");
            ExitCode::SUCCESS
        }
        "" => {
            println!(
                "  must run confined (policy rule {rule}): refused `unconfined` unless the host \
                 reports sandbox=enforced (give --fact sandbox=LEVEL to check)"
            );
            ExitCode::SUCCESS
        }
        level => {
            println!(
                "{call}: refused `unconfined`: policy rule {rule} requires the sandbox enforced, \
                 and the host reports sandbox={level}"
            );
            ExitCode::from(REFUSED)
        }
    }
}

/// `KEY=VALUE` arguments of `flag` as a map.
fn pairs(flag: &str, given: &[String]) -> Result<BTreeMap<String, String>, String> {
    given
        .iter()
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(format!("{flag} {pair}: give KEY=VALUE")),
        })
        .collect()
}

fn joined(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// One grant on one line: what it widens, for which tools.
fn grant_line(grant: &SandboxGrant) -> String {
    let mut parts = vec![if grant.tools.is_empty() {
        "every tool".to_string()
    } else {
        format!("tools {}", grant.tools.join(","))
    }];
    let list = |name: &str, values: &[String]| {
        (!values.is_empty()).then(|| format!("{name} {}", values.join(",")))
    };
    parts.extend(list("read", &grant.read));
    parts.extend(list("write", &grant.write));
    parts.extend(list("env", &grant.env));
    if let Some(network) = grant.network {
        parts.push(format!("network {}", if network { "on" } else { "off" }));
    }
    for (name, value) in [
        ("memory bytes", grant.memory_bytes),
        ("pids", grant.pids),
        ("cpu millis", u64::from(grant.cpu_millis)),
    ] {
        if value != 0 {
            parts.push(format!("{name} {value}"));
        }
    }
    parts.join("; ")
}

fn counted(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn failed(message: &str) -> ExitCode {
    eprintln!("toolsrv policy check: {message}");
    ExitCode::FAILURE
}
