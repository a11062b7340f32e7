//! Signalling a tool's process group and telling whether anything in it still runs

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// Sends `signal` to every process in the group; a group that is already gone is fine
pub(crate) fn signal_group(pgid: Pid, signal: Signal) {
    match killpg(pgid, signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(err) => {
            tracing::warn!(pgid = pgid.as_raw(), %signal, %err, "cannot signal tool process group")
        }
    }
}

/// Whether the group still has a member that is not a zombie
///
/// Orphaned members are reparented to init, and an init that does not reap
/// (common in containers) leaves zombies that still count for `kill(-pgid, 0)`.
/// Zombies cannot hold pipes or do work, so they are looked past via `/proc`.
pub(crate) fn group_has_live_members(pgid: Pid) -> bool {
    match killpg(pgid, None) {
        Err(Errno::ESRCH) => false,
        _ => live_member_in_proc(pgid).unwrap_or(true),
    }
}

/// Scans `/proc` for a non-zombie process in the group; `None` when `/proc` is unreadable
fn live_member_in_proc(pgid: Pid) -> Option<bool> {
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // A process may vanish between listing and reading: that is not a member.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some((state, pgrp)) = parse_stat(&stat)
            && pgrp == pgid.as_raw()
            && state != 'Z'
            && state != 'X'
        {
            return Some(true);
        }
    }
    Some(false)
}

/// The state letter and process group from a `/proc/<pid>/stat` line
///
/// The command name (field 2) may contain spaces and parentheses, so parsing
/// starts after the last `)`: "state ppid pgrp ...".
pub(crate) fn parse_stat(stat: &str) -> Option<(char, i32)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((state, pgrp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines() {
        let cases = [
            ("2238 (sleep) Z 1 2235 1661 0", Some(('Z', 2235))),
            ("7 (a (b) c) S 1 7 7 0", Some(('S', 7))),
            ("7 (x) R", None),
            ("garbage", None),
            ("", None),
        ];
        for (line, want) in cases {
            assert_eq!(parse_stat(line), want, "{line}");
        }
    }

    #[test]
    fn a_missing_group_has_no_live_members() {
        // pid_max is at most 2^22 on Linux, so this group cannot exist.
        assert!(!group_has_live_members(Pid::from_raw(i32::MAX - 1)));
    }
}
