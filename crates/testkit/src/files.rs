//! Files a test writes (tools, scripts, configuration) and the text of captured output.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::error::{Result, TestkitError, must};

/// Writes `content` to `path` in one step (a temporary file renamed over it), so a watcher
/// never sees half a file, with mode 0755 when `executable`, else 0644.
pub fn try_write_file(path: &Path, content: &str, executable: bool) -> Result<()> {
    let tmp = path.with_extension("tmp-write");
    let failed = |what: &str| {
        let what = format!("cannot {what} {}", path.display());
        move |e| TestkitError::io(what, e)
    };
    std::fs::write(&tmp, content).map_err(failed("write"))?;
    let mode = if executable { 0o755 } else { 0o644 };
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(failed("set the mode of"))?;
    std::fs::rename(&tmp, path).map_err(failed("rename into"))
}

/// [`try_write_file`], failing the test on error.
#[track_caller]
pub fn write_file(path: &Path, content: &str, executable: bool) {
    must(try_write_file(path, content, executable));
}

/// Writes `dir/name` in place (`std::fs::write`: the same file, truncated, when it exists).
#[track_caller]
pub fn write(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    must(
        std::fs::write(&path, body)
            .map_err(|e| TestkitError::io(format!("cannot write {}", path.display()), e)),
    );
}

/// [`write()`], then mode 0755.
#[track_caller]
pub fn write_executable(dir: &Path, name: &str, body: &str) {
    write(dir, name, body);
    let path = dir.join(name);
    must(
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| TestkitError::io(format!("cannot chmod {}", path.display()), e)),
    );
}

/// Makes a FIFO at `path` (`mkfifo`), where tests put one in place of a file that a reader
/// would wait on.
#[track_caller]
pub fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .map_err(|e| TestkitError::io("cannot run mkfifo", e));
    match must(made).success() {
        true => {}
        false => panic!("mkfifo {} failed", path.display()),
    }
}

/// Captured output as text, invalid UTF-8 replaced.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The first line of `listing` that starts with `prefix` (a table row by its first column);
/// a failure shows the whole listing.
#[track_caller]
pub fn line_starting<'a>(listing: &'a str, prefix: &str) -> &'a str {
    listing
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starts with {prefix:?} in:\n{listing}"))
}

/// Asserts that a finished command exited with `code` and that its stderr contains every one of
/// `needles`; returns the stderr. A failure shows the code, both outputs and what was missing.
#[track_caller]
pub fn assert_exit(out: &std::process::Output, code: i32, needles: &[&str]) -> String {
    let stderr = text(&out.stderr);
    let missing: Vec<&str> = needles
        .iter()
        .copied()
        .filter(|n| !stderr.contains(n))
        .collect();
    if out.status.code() != Some(code) || !missing.is_empty() {
        panic!(
            "wanted exit code {code} and stderr containing {needles:?}; got {}, missing {missing:?}\n\
             --- stderr\n{stderr}--- stdout\n{}",
            out.status,
            text(&out.stdout)
        );
    }
    stderr
}

/// The records of a JSON-lines file (an audit log), in order; none when it does not exist yet.
/// A line that is not JSON fails the test.
#[track_caller]
pub fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(v) => v,
            Err(e) => panic!("{}: a line is not JSON ({e}): {l}", path.display()),
        })
        .collect()
}

/// `(decision, decided_by)` of the audit records of `event` (`approval`, `bypass`), in order.
pub fn decisions(records: &[serde_json::Value], event: &str) -> Vec<(String, Option<String>)> {
    records
        .iter()
        .filter(|r| r["event"] == event)
        .map(|r| {
            (
                r["decision"].as_str().unwrap_or_default().to_string(),
                r["decided_by"].as_str().map(str::to_string),
            )
        })
        .collect()
}

/// A version manager's layout under `root`, as pyenv or asdf make it: `root/shims/PROGRAM`, a
/// script that runs `root/versions/1.0/bin/PROGRAM`, which prints `PROGRAM ran: ` and its
/// arguments. Put `root/shims` on a `PATH` to find the program through its shim.
pub fn fake_version_manager(root: &Path, program: &str) {
    let real = root.join("versions/1.0/bin");
    for dir in [&real, &root.join("shims")] {
        must(
            std::fs::create_dir_all(dir)
                .map_err(|e| TestkitError::io(format!("cannot create {}", dir.display()), e)),
        );
    }
    write_executable(
        &real,
        program,
        &format!("#!/bin/sh\necho \"{program} ran: $*\"\n"),
    );
    let shim = format!("#!/bin/sh\nexec \"{}/{program}\" \"$@\"\n", real.display());
    write_executable(&root.join("shims"), program, &shim);
}
