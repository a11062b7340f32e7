//! The environment of a confined call: an allowlist of the agent's variables plus the contract variables

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Variables of the agent's environment every confined call sees (besides `LC_*`)
pub const ALLOWED: [&str; 4] = ["PATH", "LANG", "TZ", "TERM"];

/// Variables the agent sets for a call and never passes through from its own environment.
///
/// `OLLIE_BYPASS_SOCKET` is reserved: it is set only when a bypass broker serves the call, so a
/// value in the agent's environment never reaches a tool.
pub const CONTRACT: [&str; 5] = [
    "OLLIE_TOOLS_PATH",
    "PWD",
    "OLLIE_BYPASS_SOCKET",
    "TMPDIR",
    "HOME",
];

/// Whether `name` matches one of `patterns` (a name, or a prefix ending in `*`), byte for byte:
/// a name that is not UTF-8 matches a prefix it starts with, as `env` matches see it set.
fn listed(name: &OsStr, patterns: &[String]) -> bool {
    let name = name.as_bytes();
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix.as_bytes()),
        None => name == p.as_bytes(),
    })
}

/// Whether the agent's variable `name` is passed to a confined call, given the extra names the
/// configuration adds
pub fn allowed(name: &OsStr, extra: &[String]) -> bool {
    let bytes = name.as_bytes();
    if CONTRACT.iter().any(|c| c.as_bytes() == bytes) {
        return false;
    }
    ALLOWED.iter().any(|a| a.as_bytes() == bytes)
        || bytes.starts_with(b"LC_")
        || listed(name, extra)
}

/// The complete environment of a confined call: the allowed variables of `agent_env`, then the
/// contract variables for a tool in `tool_dir` working in `cwd` with `private` as its `TMPDIR`
/// and `HOME`
pub fn confined_env(
    agent_env: &[(OsString, OsString)],
    extra: &[String],
    tool_dir: &Path,
    cwd: &Path,
    private: &Path,
) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = agent_env
        .iter()
        .filter(|(name, _)| allowed(name, extra))
        .cloned()
        .collect();
    env.push(("OLLIE_TOOLS_PATH".into(), tool_dir.as_os_str().to_owned()));
    env.push(("PWD".into(), cwd.as_os_str().to_owned()));
    env.push(("TMPDIR".into(), private.as_os_str().to_owned()));
    env.push(("HOME".into(), private.as_os_str().to_owned()));
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(env: &[(OsString, OsString)]) -> Vec<String> {
        env.iter()
            .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.to_string_lossy()))
            .collect()
    }

    #[test]
    fn only_the_allowlist_and_the_contract_pass() {
        let agent: Vec<(OsString, OsString)> = [
            ("PATH", "/usr/bin"),
            ("LANG", "C.UTF-8"),
            ("LC_ALL", "C"),
            ("TZ", "UTC"),
            ("TERM", "xterm"),
            ("SECRET_TOKEN", "s3cret"),
            ("HOME", "/root"),
            ("OLLIE_BYPASS_SOCKET", "/tmp/forged"),
            ("PWD", "/agent"),
            ("JOURNAL_DIR", "/var/log/journal"),
            ("JOURNALX", "no"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        let env = confined_env(
            &agent,
            &["JOURNAL_*".into()],
            Path::new("/tools"),
            Path::new("/work"),
            Path::new("/calls/c1"),
        );
        assert_eq!(
            names(&env),
            [
                "PATH=/usr/bin",
                "LANG=C.UTF-8",
                "LC_ALL=C",
                "TZ=UTC",
                "TERM=xterm",
                "JOURNAL_DIR=/var/log/journal",
                "OLLIE_TOOLS_PATH=/tools",
                "PWD=/work",
                "TMPDIR=/calls/c1",
                "HOME=/calls/c1",
            ]
        );
    }

    #[test]
    fn configuration_cannot_pass_contract_variables_through() {
        let extra = ["HOME".to_string(), "OLLIE_*".to_string()];
        for name in CONTRACT {
            assert!(!allowed(OsStr::new(name), &extra), "{name}");
        }
        assert!(allowed(OsStr::new("OLLIE_OTHER"), &extra));
    }

    #[test]
    fn a_name_that_is_not_utf8_matches_by_its_bytes() {
        use std::os::unix::ffi::OsStrExt;
        let odd = OsStr::from_bytes(b"BA\xffR");
        assert!(allowed(odd, &["BA*".into()]));
        assert!(!allowed(odd, &["BAR".into(), "C*".into()]));
        assert!(allowed(OsStr::from_bytes(b"LC_\xff"), &[]));
    }
}
