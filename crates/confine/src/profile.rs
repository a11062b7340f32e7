//! What one call may do: the agent's defaults, and the coordinator's grants that widen them per tool

use std::path::PathBuf;

/// Resource limits of one call; `None` leaves a resource unlimited (beyond the host's own limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// Memory of every process of the call together, in bytes (`memory.max`; `RLIMIT_AS` per
    /// process where no memory controller is available).
    pub memory: Option<u64>,
    /// Processes and threads of the call together (`pids.max`; `RLIMIT_NPROC` per user when the
    /// tool runs as a user other than root).
    pub pids: Option<u64>,
    /// CPU bandwidth in thousandths of a core (`cpu.max`): 500 is half a core, 2000 two cores.
    pub cpu_millis: Option<u32>,
    /// Open files per process (`RLIMIT_NOFILE`).
    pub nofile: Option<u64>,
}

/// What one call may touch, before the call's own directories are added.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Profile {
    /// Paths the tool may read and execute (beneath each).
    pub read: Vec<PathBuf>,
    /// Paths the tool may read, write and execute (beneath each).
    pub write: Vec<PathBuf>,
    /// Whether the tool may bind and connect TCP sockets (restricted with Landlock ABI 4 or later).
    pub network: bool,
    pub limits: Limits,
    /// Variables of the agent's environment passed through besides the fixed allowlist: names,
    /// or prefixes ending in `*`.
    pub env: Vec<String>,
}

/// One `sandbox` entry of the coordinator's policy, as the agent receives it: the entries the
/// coordinator sends apply to this host already, so only the tool names are left to match.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grant {
    /// Tool names or globs (`*`, `?`); empty: every tool.
    pub tools: Vec<String>,
    pub read: Vec<PathBuf>,
    pub write: Vec<PathBuf>,
    /// `Some` sets network access either way; `None` keeps the agent's default.
    pub network: Option<bool>,
    pub memory: Option<u64>,
    pub pids: Option<u64>,
    pub cpu_millis: Option<u32>,
    pub env: Vec<String>,
}

impl Grant {
    /// Whether this grant is for tool `name`.
    pub fn covers(&self, name: &str) -> bool {
        self.tools.is_empty() || self.tools.iter().any(|p| glob(p, name))
    }
}

/// The first grant for tool `name`: like policy rules, the first that matches decides.
pub fn grant_for<'a>(grants: &'a [Grant], name: &str) -> Option<&'a Grant> {
    grants.iter().find(|g| g.covers(name))
}

impl Profile {
    /// This profile widened by `grant`: its paths and variables added, its network setting and
    /// limits taking the place of the defaults.
    pub fn widened(&self, grant: Option<&Grant>) -> Profile {
        let mut profile = self.clone();
        let Some(grant) = grant else {
            return profile;
        };
        profile.read.extend(grant.read.iter().cloned());
        profile.write.extend(grant.write.iter().cloned());
        profile.env.extend(grant.env.iter().cloned());
        if let Some(network) = grant.network {
            profile.network = network;
        }
        let limits = &mut profile.limits;
        limits.memory = grant.memory.or(limits.memory);
        limits.pids = grant.pids.or(limits.pids);
        limits.cpu_millis = grant.cpu_millis.or(limits.cpu_millis);
        profile
    }
}

/// Parses a size such as `512M`, `1G`, `64Ki`, `1048576` (binary units: `K` is 1024 bytes)
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let body = trimmed
        .strip_suffix(['B', 'b'])
        .unwrap_or(trimmed)
        .trim_end_matches('i');
    let (digits, shift) = match body.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => {
                    return Err(format!(
                        "size `{text}` has an unknown unit `{c}`: use K, M, G or T"
                    ));
                }
            };
            (&body[..i], shift)
        }
        _ => (body, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("size `{text}` is not a number with an optional unit (K, M, G, T)"))?;
    n.checked_mul(1 << shift)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| format!("size `{text}` must be above zero and below 2^64 bytes"))
}

/// Parses a CPU bandwidth in cores (`0.5`, `2`) or thousandths of a core (`500m`)
pub fn parse_cpu(text: &str) -> Result<u32, String> {
    let t = text.trim();
    let millis = if let Some(m) = t.strip_suffix('m') {
        m.parse::<u32>().ok()
    } else {
        t.parse::<f64>()
            .ok()
            .filter(|c| c.is_finite() && *c > 0.0 && *c < 1e6)
            .map(|c| (c * 1000.0).round() as u32)
    };
    millis.filter(|&m| m > 0).ok_or_else(|| {
        format!("CPU `{text}` is not a number of cores (`0.5`, `2`) or of thousandths (`500m`)")
    })
}

/// Shell-style glob with `*` (any run) and `?` (any one character); the coordinator's
/// selectors and policy rules use this one too, so a pattern means the same on both sides.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sizes() {
        let cases = [
            ("1024", Some(1024)),
            ("512M", Some(512 << 20)),
            ("512MiB", Some(512 << 20)),
            ("1G", Some(1 << 30)),
            ("1g", Some(1 << 30)),
            ("64Ki", Some(64 << 10)),
            ("2T", Some(2 << 40)),
            ("0", None),
            ("", None),
            ("12X", None),
            ("M", None),
            ("-1", None),
            ("99999999999T", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_size(text).ok(), want, "{text:?}");
        }
    }

    #[test]
    fn cpus() {
        let cases = [
            ("1", Some(1000)),
            ("0.5", Some(500)),
            ("250m", Some(250)),
            ("2", Some(2000)),
            ("0", None),
            ("0m", None),
            ("x", None),
            ("-1", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_cpu(text).ok(), want, "{text:?}");
        }
    }

    #[test]
    fn the_first_grant_for_a_tool_widens_the_defaults() {
        let defaults = Profile {
            read: vec!["/usr".into()],
            network: true,
            limits: Limits {
                memory: Some(1 << 30),
                pids: Some(512),
                ..Limits::default()
            },
            ..Profile::default()
        };
        let grants = [
            Grant {
                tools: vec!["system_*".into()],
                read: vec!["/var/log".into()],
                network: Some(false),
                memory: Some(512 << 20),
                env: vec!["JOURNAL_*".into()],
                ..Grant::default()
            },
            Grant {
                tools: vec!["system_logs".into()],
                pids: Some(1),
                ..Grant::default()
            },
        ];
        let widened = defaults.widened(grant_for(&grants, "system_logs"));
        assert_eq!(widened.read, [PathBuf::from("/usr"), "/var/log".into()]);
        assert!(!widened.network);
        assert_eq!(widened.limits.memory, Some(512 << 20));
        assert_eq!(
            widened.limits.pids,
            Some(512),
            "the second grant is not looked at"
        );
        assert_eq!(widened.env, ["JOURNAL_*"]);
        assert_eq!(defaults.widened(grant_for(&grants, "disk_usage")), defaults);
        let any = Grant::default();
        assert!(any.covers("anything"));
    }

    #[test]
    fn globs() {
        for (p, t, want) in [
            ("system_*", "system_logs", true),
            ("system_*", "disk", false),
            ("a?c", "abc", true),
            ("*", "", true),
        ] {
            assert_eq!(glob(p, t), want, "{p} {t}");
        }
    }
}
