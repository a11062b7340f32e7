//! Variant evaluation, table-driven over injected host facts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use toolsrv_meta::{
    CommandSource, FileProbe, Host, Meta, Resolution, Tier, parse, resolve_command,
};

/// A file system made of two sets of paths.
#[derive(Default)]
struct FakeFs {
    files: BTreeSet<PathBuf>,
    executables: BTreeSet<PathBuf>,
}

impl FileProbe for FakeFs {
    fn exists(&self, path: &Path) -> bool {
        self.files.contains(path) || self.executables.contains(path)
    }
    fn is_executable(&self, path: &Path) -> bool {
        self.executables.contains(path)
    }
}

/// A host described by `os/arch`, environment pairs, executables (absolute) and plain files.
fn host(os: &str, arch: &str, env: &[(&str, &str)], exes: &[&str], files: &[&str]) -> Host {
    let mut env: BTreeMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.entry("PATH".into())
        .or_insert_with(|| "/usr/local/bin:/usr/bin:/bin".into());
    let fs = FakeFs {
        files: files.iter().map(PathBuf::from).collect(),
        executables: exes.iter().map(PathBuf::from).collect(),
    };
    Host {
        os: os.into(),
        arch: arch.into(),
        env,
        raw_path: None,
        fs: Arc::new(fs),
    }
}

fn linux() -> Host {
    host("linux", "amd64", &[], &[], &[])
}

fn meta(doc: serde_json::Value) -> Meta {
    let parsed = parse("t", Path::new("/tools/t.meta"), doc.to_string().as_bytes());
    parsed
        .meta
        .unwrap_or_else(|| panic!("parse failed: {:?}", parsed.diagnostics))
}

/// The index of the chosen variant, or the hidden reason.
fn pick(m: &Meta, h: &Host) -> Result<Option<usize>, String> {
    match m.resolve(h) {
        Resolution::Visible { variant, .. } => Ok(variant),
        Resolution::Hidden { reason } => Err(reason),
    }
}

#[test]
fn each_match_key_alone() {
    let cases: Vec<(serde_json::Value, Host, bool)> = vec![
        (json!({"os": "linux"}), linux(), true),
        (json!({"os": "darwin"}), linux(), false),
        (
            json!({"os": "darwin"}),
            host("darwin", "arm64", &[], &[], &[]),
            true,
        ),
        (json!({"arch": "amd64"}), linux(), true),
        (json!({"arch": "arm64"}), linux(), false),
        (
            json!({"binary": "journalctl"}),
            host("linux", "amd64", &[], &["/usr/bin/journalctl"], &[]),
            true,
        ),
        (json!({"binary": "journalctl"}), linux(), false),
        // Found only on PATH: a PATH that lacks its directory does not see it.
        (
            json!({"binary": "tool"}),
            host("linux", "amd64", &[("PATH", "/bin")], &["/opt/x/tool"], &[]),
            false,
        ),
        (
            json!({"binary": "tool"}),
            host(
                "linux",
                "amd64",
                &[("PATH", "/bin:/opt/x")],
                &["/opt/x/tool"],
                &[],
            ),
            true,
        ),
        // A non-executable file on PATH is not a binary.
        (
            json!({"binary": "notes"}),
            host("linux", "amd64", &[], &[], &["/usr/bin/notes"]),
            false,
        ),
        (
            json!({"binary": "/opt/x/tool"}),
            host("linux", "amd64", &[], &["/opt/x/tool"], &[]),
            true,
        ),
        (
            json!({"binary": "/opt/x/tool"}),
            host("linux", "amd64", &[], &[], &["/opt/x/tool"]),
            false,
        ),
        (
            json!({"file": "/var/log/syslog"}),
            host("linux", "amd64", &[], &[], &["/var/log/syslog"]),
            true,
        ),
        (json!({"file": "/var/log/syslog"}), linux(), false),
        (
            json!({"env": "DISPLAY"}),
            host("linux", "amd64", &[("DISPLAY", ":0")], &[], &[]),
            true,
        ),
        (
            json!({"env": "DISPLAY"}),
            host("linux", "amd64", &[("DISPLAY", "")], &[], &[]),
            false,
        ),
        (json!({"env": "DISPLAY"}), linux(), false),
        (json!({"nenv": "SSH_CONNECTION"}), linux(), true),
        (
            json!({"nenv": "SSH_CONNECTION"}),
            host("linux", "amd64", &[("SSH_CONNECTION", "")], &[], &[]),
            true,
        ),
        (
            json!({"nenv": "SSH_CONNECTION"}),
            host("linux", "amd64", &[("SSH_CONNECTION", "1 2 3 4")], &[], &[]),
            false,
        ),
    ];
    for (i, (cond, h, want)) in cases.into_iter().enumerate() {
        let m = meta(json!({"description": "d", "variants": [{"match": cond}]}));
        assert_eq!(
            pick(&m, &h).is_ok(),
            want,
            "case {i}: {cond} on {h:?}: {:?}",
            pick(&m, &h)
        );
    }
}

#[test]
fn keys_are_anded_and_arrays_are_ored() {
    let cond = json!({"os": ["linux", "freebsd"], "arch": ["amd64", "arm64"], "binary": "docker"});
    let m = meta(json!({"variants": [{"match": cond}]}));
    let docker = ["/usr/bin/docker"];
    assert!(pick(&m, &host("linux", "amd64", &[], &docker, &[])).is_ok());
    assert!(pick(&m, &host("freebsd", "arm64", &[], &docker, &[])).is_ok());
    assert!(
        pick(&m, &host("linux", "amd64", &[], &[], &[])).is_err(),
        "binary missing"
    );
    assert!(
        pick(&m, &host("darwin", "amd64", &[], &docker, &[])).is_err(),
        "os not in list"
    );
    assert!(
        pick(&m, &host("linux", "386", &[], &docker, &[])).is_err(),
        "arch not in list"
    );
    // OR over binaries and files.
    let m = meta(
        json!({"variants": [{"match": {"binary": ["podman", "docker"], "file": ["/a", "/b"]}}]}),
    );
    assert!(pick(&m, &host("linux", "amd64", &[], &["/bin/podman"], &["/b"])).is_ok());
    assert!(pick(&m, &host("linux", "amd64", &[], &["/bin/podman"], &[])).is_err());
}

#[test]
fn empty_or_absent_match_always_matches() {
    for variant in [json!({}), json!({"match": {}}), json!({"match": null})] {
        let m = meta(json!({"variants": [variant.clone()]}));
        assert_eq!(pick(&m, &linux()), Ok(Some(0)), "{variant}");
    }
}

#[test]
fn first_matching_variant_wins() {
    let m = meta(json!({"variants": [
        {"match": {"binary": "journalctl"}, "cmd": "journald"},
        {"match": {"file": "/var/log/syslog"}, "cmd": "syslog"},
        {"match": {}, "cmd": "fallback"},
    ]}));
    let both = host(
        "linux",
        "amd64",
        &[],
        &["/bin/journalctl"],
        &["/var/log/syslog"],
    );
    let syslog_only = host("linux", "amd64", &[], &[], &["/var/log/syslog"]);
    let cmd = |h: &Host| m.resolve(h).tool().and_then(|t| t.cmd.clone());
    assert_eq!(pick(&m, &both), Ok(Some(0)));
    assert_eq!(cmd(&both).as_deref(), Some("journald"));
    assert_eq!(pick(&m, &syslog_only), Ok(Some(1)));
    assert_eq!(cmd(&syslog_only).as_deref(), Some("syslog"));
    assert_eq!(pick(&m, &linux()), Ok(Some(2)));
    assert_eq!(cmd(&linux()).as_deref(), Some("fallback"));
}

#[test]
fn hidden_with_a_reason_naming_every_variant() {
    let m = meta(json!({"variants": [
        {"match": {"binary": "journalctl"}},
        {"match": {"file": "/var/log/syslog"}},
        {"match": {"os": "darwin", "binary": "log"}},
        {"match": {"env": "LOGS"}},
        {"match": {"nenv": "HOME"}},
        {"match": {"arch": ["arm64", "riscv64"]}},
    ]}));
    let reason = pick(&m, &host("linux", "amd64", &[("HOME", "/root")], &[], &[])).unwrap_err();
    for needle in [
        "variant 0: no executable `journalctl`",
        "variant 1: no file `/var/log/syslog`",
        "variant 2: os is `linux`, not `darwin`",
        "variant 3: env `LOGS` unset or empty",
        "variant 4: env `HOME` set",
        "variant 5: arch is `amd64`, not `arm64` or `riscv64`",
    ] {
        assert!(
            reason.contains(needle),
            "{needle:?} missing from {reason:?}"
        );
    }
}

#[test]
fn a_tool_without_variants_is_always_visible() {
    let m = meta(json!({"description": "plain"}));
    assert_eq!(pick(&m, &host("plan9", "mips", &[], &[], &[])), Ok(None));
}

#[test]
fn unknown_match_key_makes_the_variant_not_match() {
    let doc = json!({"variants": [{"match": {"os": "linux", "kernel": "6.1"}, "cmd": "a"}, {"cmd": "b"}]});
    let parsed = parse("t", Path::new("/tools/t.meta"), doc.to_string().as_bytes());
    let m = parsed
        .meta
        .expect("an unknown match key is a warning, not a rejection");
    let resolved = m.resolve(&linux());
    assert_eq!(resolved.tool().and_then(|t| t.cmd.as_deref()), Some("b"));
    let only = meta(json!({"variants": [{"match": {"kernel": "6.1"}}]}));
    assert!(
        pick(&only, &linux())
            .unwrap_err()
            .contains("unknown match key `kernel`")
    );
}

#[test]
fn every_overridable_field_is_inherited_or_overridden() {
    let top = json!({
        "description": "top-d", "prompt": "top-p", "keywords": ["top-k"],
        "args": {"type": "object", "properties": {"top": {"type": "string"}}},
        "tier": "cold", "cmd": "top-c", "scope": "top-s", "outputFormat": "top-o", "resetsCounter": false,
    });
    let overrides = [
        ("description", json!("v-d")),
        ("prompt", json!("v-p")),
        ("keywords", json!(["v-k"])),
        (
            "args",
            json!({"type": "object", "properties": {"v": {"type": "integer"}}}),
        ),
        ("tier", json!("hot")),
        ("cmd", json!("v-c")),
        ("scope", json!("v-s")),
        ("outputFormat", json!("v-o")),
        ("resetsCounter", json!(true)),
    ];
    for (field, value) in overrides {
        let mut doc = top.clone();
        doc["variants"] = json!([{"match": {"os": "linux"}, field: value.clone()}]);
        let tool = meta(doc).resolve(&linux()).tool().cloned().unwrap();
        let model = serde_json::to_value(&tool).unwrap();
        for (other, top_value) in top.as_object().unwrap() {
            let got = if other == "cmd" {
                json!(tool.cmd)
            } else {
                model[other].clone()
            };
            let want = if other == field { &value } else { top_value };
            assert_eq!(&got, want, "overriding {field}: field {other}");
        }
    }
}

#[test]
fn the_override_also_switches_argument_validation() {
    let m = meta(json!({
        "args": {"type": "object", "required": ["a"]},
        "variants": [{"match": {"os": "darwin"}, "args": {"type": "object", "required": ["b"]}}, {}],
    }));
    let mac = m
        .resolve(&host("darwin", "arm64", &[], &[], &[]))
        .tool()
        .cloned()
        .unwrap();
    let lin = m.resolve(&linux()).tool().cloned().unwrap();
    assert!(mac.validator.validate(&json!({"b": 1})).is_ok());
    assert!(mac.validator.validate(&json!({"a": 1})).is_err());
    assert!(lin.validator.validate(&json!({"a": 1})).is_ok());
    assert_eq!(lin.tier, None::<Tier>);
}

#[test]
fn command_resolution_order() {
    let dir = Path::new("/tools");
    let beside = host("linux", "amd64", &[], &["/tools/t", "/usr/bin/t"], &[]);
    let on_path = host("linux", "amd64", &[], &["/usr/bin/t"], &[]);
    let not_executable = host("linux", "amd64", &[], &[], &["/tools/t"]);
    assert_eq!(
        resolve_command(dir, "t", Some("echo hi"), &beside),
        Ok(CommandSource::CoLocated("/tools/t".into()))
    );
    assert_eq!(
        resolve_command(dir, "t", Some("echo hi"), &on_path),
        Ok(CommandSource::Shell("echo hi".into()))
    );
    assert_eq!(
        resolve_command(dir, "t", Some("echo hi"), &not_executable),
        Ok(CommandSource::Shell("echo hi".into()))
    );
    assert_eq!(
        resolve_command(dir, "t", None, &on_path),
        Ok(CommandSource::OnPath("/usr/bin/t".into()))
    );
    assert_eq!(
        resolve_command(dir, "t", Some("  "), &on_path),
        Ok(CommandSource::OnPath("/usr/bin/t".into()))
    );
    let err = resolve_command(dir, "t", None, &linux()).unwrap_err();
    assert!(err.to_string().contains("/tools/t.meta"), "{err}");
    assert!(err.to_string().contains("no `cmd`"), "{err}");
}

#[test]
fn a_variant_named_resolves_as_a_host_that_chose_it_sees_it() {
    let m = meta(json!({"description": "top", "variants": [
        {"match": {"binary": "journalctl"}, "description": "journald", "cmd": "a"},
        {"match": {"kernel": "6.1"}, "cmd": "b"},
        {"match": {}, "cmd": "c"},
    ]}));
    let both = host("linux", "amd64", &[], &["/bin/journalctl"], &[]);
    let seen = |h: &Host| {
        let Resolution::Visible { variant, tool } = m.resolve(h) else {
            panic!("hidden")
        };
        (variant, tool)
    };
    for h in [both, linux()] {
        let (variant, tool) = seen(&h);
        let named = m.resolve_variant(variant).unwrap();
        assert_eq!(
            serde_json::to_value(&named).unwrap(),
            serde_json::to_value(&tool).unwrap()
        );
        assert_eq!(named.cmd, tool.cmd);
    }
    assert_eq!(
        m.resolve_variant(Some(0)).unwrap().description.as_deref(),
        Some("journald")
    );
    assert_eq!(
        m.resolve_variant(Some(2)).unwrap().description.as_deref(),
        Some("top")
    );
    // What no host can have chosen: no variant named, one past the end, one that never matches.
    assert!(m.resolve_variant(None).is_none());
    assert!(m.resolve_variant(Some(3)).is_none());
    assert!(m.resolve_variant(Some(usize::MAX)).is_none());
    assert!(m.resolve_variant(Some(1)).is_none());
    let plain = meta(json!({"description": "plain"}));
    assert_eq!(
        plain.resolve_variant(None).unwrap().description.as_deref(),
        Some("plain")
    );
    assert!(plain.resolve_variant(Some(0)).is_none());
}
