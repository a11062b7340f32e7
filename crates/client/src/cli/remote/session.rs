//! `toolctl session ...` and `toolctl find`: sessions on the coordinator, and tools ranked against
//! a request.

use std::io::Write;
use std::path::Path;

use crate::{
    ClientError, FindToolsResponse, LoadedTool, Profile, SessionState, ToolMatch, WaitsForApproval,
    match_json, session_json,
};

use super::{ConnArgs, connect, exit, interrupted, marked, write_json, written};

/// Longest request `find` sends (the coordinator's limit too).
const MAX_QUERY_BYTES: usize = 4096;
/// Most matches `find` may ask for.
const MAX_LIMIT: u32 = 1000;

/// `toolctl session open`: prints the new session's id (or, with `--json`, its state).
pub async fn open(conn: &ConnArgs, profile: Option<&Path>, hosts: Option<&str>, json: bool) -> u8 {
    let profile = match profile.map(Profile::load).transpose() {
        Ok(profile) => profile.unwrap_or_default(),
        Err(e) => {
            crate::cli::quote::say(e);
            return exit::USAGE;
        }
    };
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    match remote.client.open_session(&profile, hosts).await {
        Ok(state) if json => print_state(&state, true),
        Ok(state) => written(
            writeln!(std::io::stdout().lock(), "{}", state.id),
            "the session id",
        ),
        Err(e) => remote.fail("cannot open a session", &e),
    }
}

/// `toolctl session load` / `unload`: prints the session's state after the change.
pub async fn load(conn: &ConnArgs, id: &str, tool: &str, unload: bool, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    // What was loaded before a load, to say what made room for it (maxLoaded): unloading a
    // model's tool behind its back is worth a line. A session that cannot be read now is
    // refused by the load itself, in its words.
    let before = if unload {
        None
    } else {
        remote.client.session(id).await.ok()
    };
    let result = if unload {
        remote.client.unload_tool(id, tool).await
    } else {
        remote.client.load_tool(id, tool).await
    };
    match result {
        Ok(state) => {
            if let Some(before) = before {
                let evicted: Vec<&str> = before
                    .tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .filter(|name| *name != tool && !state.tools.iter().any(|t| t.name == *name))
                    .collect();
                if !evicted.is_empty() {
                    crate::cli::quote::say(format!(
                        "unloaded {} to make room for `{tool}` (maxLoaded {})",
                        evicted
                            .iter()
                            .map(|n| format!("`{n}`"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        state.max_loaded
                    ));
                }
            }
            print_state(&state, json)
        }
        Err(e) => {
            let verb = if unload { "unload" } else { "load" };
            remote.fail(&format!("cannot {verb} `{tool}` in session `{id}`"), &e)
        }
    }
}

/// `toolctl session show`.
pub async fn show(conn: &ConnArgs, id: &str, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    match remote.client.session(id).await {
        Ok(state) => print_state(&state, json),
        Err(e) => remote.fail(&format!("cannot show session `{id}`"), &e),
    }
}

/// `toolctl session list`: this client's open sessions, one line each (`--json`: an array of
/// what `session show --json` prints).
pub async fn list(conn: &ConnArgs, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let sessions = match remote.client.sessions().await {
        Ok(sessions) => sessions,
        Err(e) => return remote.fail("cannot list sessions", &e),
    };
    let mut out = std::io::stdout().lock();
    if json {
        let values: Result<Vec<_>, _> = sessions.iter().map(session_json).collect();
        return match values {
            Ok(values) => written(
                write_json(&mut out, &serde_json::Value::Array(values)),
                "the sessions",
            ),
            Err(e) => fail_shape(&e),
        };
    }
    if sessions.is_empty() {
        return written(writeln!(out, "(no session)"), "the sessions");
    }
    let now = toolsrv_proto::unix_ms();
    let rows: Vec<Vec<String>> = sessions.iter().map(|s| session_row(s, now)).collect();
    written(
        super::write_table(
            &mut out,
            &["SESSION", "HOSTS", "ONLINE", "LOADED", "WATCHERS", "ENDS"],
            &rows,
        ),
        "the sessions",
    )
}

/// One line of `session list`: when it ends is `watched` while a watcher is attached, else the
/// time left before it ends unless one attaches.
fn session_row(state: &SessionState, now_unix_ms: u64) -> Vec<String> {
    let online = online(state);
    let ends = if state.watchers > 0 || state.idle_expires_unix_ms == 0 {
        "watched".to_string()
    } else {
        format!(
            "in {}",
            super::human_ms(state.idle_expires_unix_ms.saturating_sub(now_unix_ms))
        )
    };
    vec![
        state.id.clone(),
        state.hosts.clone(),
        format!("{online}/{}", state.selected.len()),
        format!("{}/{}", state.tools.len(), state.max_loaded),
        state.watchers.to_string(),
        ends,
    ]
}

/// `toolctl session close`.
pub async fn close(conn: &ConnArgs, id: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    match remote.client.close_session(id).await {
        Ok(()) => 0,
        Err(e) => remote.fail(&format!("cannot close session `{id}`"), &e),
    }
}

/// `toolctl session watch`: the state now and after every change, until Ctrl-C or the session
/// ends (exit NOT_FOUND then, since nothing is left to watch).
pub async fn watch(conn: &ConnArgs, id: &str, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let mut states = match remote.client.watch_session(id).await {
        Ok(states) => states,
        Err(e) => return remote.fail(&format!("cannot watch session `{id}`"), &e),
    };
    loop {
        let next = tokio::select! {
            () = interrupted() => return 0,
            next = states.next() => next,
        };
        match next {
            Some(Ok(state)) => {
                let code = if json {
                    match session_json(&state) {
                        Ok(value) => {
                            written(writeln!(std::io::stdout().lock(), "{value}"), "the session")
                        }
                        Err(e) => fail_shape(&e),
                    }
                } else {
                    let mut out = std::io::stdout().lock();
                    written(
                        write_text(&mut out, &state).and_then(|()| writeln!(out)),
                        "the session",
                    )
                };
                if code != 0 {
                    return code;
                }
            }
            Some(Err(e)) => return remote.fail(&format!("watching session `{id}`"), &e),
            // A session ends with NOT_FOUND; a stream that just ends is the coordinator's.
            None => {
                eprintln!(
                    "toolctl: the coordinator at {} ended the watch of session `{id}`: it is \
                     probably shutting down, and its sessions end with it",
                    remote.addr
                );
                return exit::UNAVAILABLE;
            }
        }
    }
}

/// A tool's description in a table, ending with where its calls wait for approval, if anywhere
/// (`[waits for approval by oncall-* on db-1]`).
fn with_approvals(
    mut description: String,
    approvals: &[WaitsForApproval],
    hosts: &[String],
) -> String {
    if let Some(approvals) = crate::shape::approvals_text(approvals, hosts) {
        description.push_str(&format!(" [waits for approval {approvals}]"));
    }
    description
}

/// `toolctl find SELECTOR QUERY`.
pub async fn find(conn: &ConnArgs, selector: &str, query: &str, limit: u32, json: bool) -> u8 {
    if let Err(e) = check_find(query, limit) {
        eprintln!("toolctl: {e}");
        return exit::USAGE;
    }
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let found = match remote.client.find_tools(selector, query, limit).await {
        Ok(found) => found,
        Err(e) => return remote.fail("cannot rank tools", &e),
    };
    if let Some(note) = find_note(&found) {
        eprintln!("toolctl: note: {note}");
    }
    let mut out = std::io::stdout().lock();
    if found.matches.is_empty() {
        // As `local find` (and grep): nothing matching exits 1, after `[]` for a JSON reader.
        let printed = if json {
            written(writeln!(out, "[]"), "the matches")
        } else {
            eprintln!("toolctl: no tool on the hosts of `{selector}` matches the request");
            0
        };
        return if printed == 0 {
            exit::NO_MATCH
        } else {
            printed
        };
    }
    if json {
        let matches: Vec<_> = found.matches.iter().map(match_json).collect();
        return written(write_json(&mut out, &matches), "the matches");
    }
    written(write_matches(&mut out, &found.matches), "the matches")
}

/// The matches as `toolctl find` prints them: score, tool, hosts, description (and where calls
/// wait for approval).
fn write_matches(out: &mut impl Write, matches: &[ToolMatch]) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = matches
        .iter()
        .map(|m| {
            vec![
                format!("{:.3}", m.score),
                marked(&m.name, m.host_only),
                hosts_text(&m.hosts),
                with_approvals(m.description.clone(), &m.approvals, &m.hosts),
            ]
        })
        .collect();
    super::write_table(out, &["SCORE", "TOOL", "HOSTS", "DESCRIPTION"], &rows)
}

/// What an answer needs said beside it, if anything: that it is ranked by words alone while
/// the coordinator's ranking by meaning is being built (`meaning_pending`), that replicas ranked
/// differently (`ranker` `mixed`), and that matches were left out to keep the answer within a
/// message (`matches_left_out`).
pub fn find_note(found: &FindToolsResponse) -> Option<String> {
    let ranking = match (found.ranker == "mixed", found.meaning_pending) {
        (false, true) => Some(
            "ranked by words alone for now: the coordinator is still building its ranking by \
             meaning, which may find more for a request in other words than the tools'; ask \
             again in a minute",
        ),
        (true, true) => Some(
            "some tools were ranked by words alone for now, since a replica is still building \
             its ranking by meaning: the order interleaves the replicas' answers, scores compare \
             only within one ranking; ask again in a minute",
        ),
        (true, false) => Some(
            "the replicas ranked differently (by meaning, and by words alone where one has no \
             sentence encoder): the order interleaves their answers, scores compare only within \
             one ranking",
        ),
        (false, false) => None,
    };
    let left_out = (found.matches_left_out > 0).then(|| {
        format!(
            "{} more matching tools were left out, the last ones: with their hosts the answer \
             would pass the most one may take; ask for fewer matches or fewer hosts",
            found.matches_left_out
        )
    });
    match (ranking, left_out) {
        (Some(ranking), Some(left_out)) => Some(format!("{ranking}; {left_out}")),
        (Some(ranking), None) => Some(ranking.to_string()),
        (None, left_out) => left_out,
    }
}

/// What `find` refuses before asking anyone.
pub fn check_find(query: &str, limit: u32) -> Result<(), String> {
    if query.trim().is_empty() {
        return Err("the request is empty: say in words what the tool should do".into());
    }
    if query.len() > MAX_QUERY_BYTES {
        return Err(format!(
            "the request is {} bytes, over the limit of {MAX_QUERY_BYTES}",
            query.len()
        ));
    }
    if limit == 0 || limit > MAX_LIMIT {
        return Err(format!("--limit must be 1 to {MAX_LIMIT}, not {limit}"));
    }
    Ok(())
}

fn fail_shape(e: &ClientError) -> u8 {
    eprintln!("toolctl: {e}");
    exit::INTERNAL
}

fn print_state(state: &SessionState, json: bool) -> u8 {
    let mut out = std::io::stdout().lock();
    if json {
        match session_json(state) {
            Ok(value) => written(write_json(&mut out, &value), "the session"),
            Err(e) => fail_shape(&e),
        }
    } else {
        written(write_text(&mut out, state), "the session")
    }
}

/// How many of the session's selected hosts are not offline.
fn online(state: &SessionState) -> usize {
    state
        .selected
        .iter()
        .filter(|h| crate::host_state_name(h.state) != "offline")
        .count()
}

/// A few hosts by name, more as a count.
fn hosts_text(hosts: &[String]) -> String {
    match hosts.len() {
        0 => "-".to_string(),
        1..=3 => hosts.join(","),
        n => format!("{},... ({n} hosts)", hosts[..2].join(",")),
    }
}

fn write_text(out: &mut impl Write, state: &SessionState) -> std::io::Result<()> {
    let online = online(state);
    writeln!(
        out,
        "session {}  hosts `{}`: {} selected, {online} online  loaded {}/{}",
        state.id,
        state.hosts,
        state.selected.len(),
        state.tools.len(),
        state.max_loaded
    )?;
    if state.tools.is_empty() {
        return writeln!(out, "(no tool loaded)");
    }
    let rows: Vec<Vec<String>> = state.tools.iter().map(tool_row).collect();
    super::write_table(out, &["TOOL", "TIER", "HOSTS", "DESCRIPTION"], &rows)
}

fn tool_row(t: &LoadedTool) -> Vec<String> {
    let description = match t.resolutions.first().and_then(|r| r.definition.as_ref()) {
        Some(def) => def.description.clone(),
        None => format!("(unavailable: {})", t.unavailable),
    };
    let description = with_approvals(description, &t.approvals, &t.hosts);
    let tier = if t.auto_loaded {
        format!("{} auto", t.tier)
    } else {
        t.tier.clone()
    };
    vec![
        marked(&t.name, t.host_only),
        tier,
        hosts_text(&t.hosts),
        description,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Approvers and descriptions come from the policy and the hosts: whatever bytes they hold
    /// are shown escaped, never sent to the terminal.
    #[test]
    fn matches_say_where_calls_wait_and_escape_odd_bytes() {
        let matches = [
            ToolMatch {
                name: "restart".into(),
                score: 0.75,
                description: "Restart\u{1b}[2J a service".into(),
                hosts: vec!["a".into(), "b".into()],
                approvals: vec![WaitsForApproval {
                    approvers: vec!["oncall-\u{1b}]0;x\u{7}".into()],
                    hosts: vec!["b".into()],
                }],
                ..Default::default()
            },
            ToolMatch {
                name: "df".into(),
                score: 0.5,
                description: "Disk usage".into(),
                hosts: vec!["a".into()],
                host_only: true,
                approvals: vec![WaitsForApproval {
                    approvers: vec!["caller".into()],
                    hosts: vec!["a".into()],
                }],
                ..Default::default()
            },
        ];
        let mut out = Vec::new();
        write_matches(&mut out, &matches).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines[1].ends_with(
                "Restart\\u{1b}[2J a service [waits for approval by oncall-\\u{1b}]0;x\\u{7} on b]"
            ),
            "{out}"
        );
        assert!(lines[2].contains("df [host-only]"), "{out}");
        assert!(
            lines[2].ends_with("Disk usage [waits for approval by you]"),
            "{out}"
        );
    }
}
