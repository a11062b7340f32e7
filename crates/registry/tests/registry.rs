//! Registry behaviour on real directories: scanning, shadowing, broken files, rescans and watching.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::Path;
use std::time::Duration;

use toolsrv_meta::{Code, Severity};
use toolsrv_registry::{Numbering, Registry, SETTLE_AGE, Scanner, WatchOptions, split_tools_path};
use toolsrv_testkit::{mkfifo, write, write_executable};

fn tool(desc: &str) -> String {
    format!(r#"{{"description": "{desc}", "cmd": "echo {desc}"}}"#)
}

/// Sets `path`'s modification time `secs` seconds back.
fn age(path: &Path, secs: u64) {
    let then = std::time::SystemTime::now() - Duration::from_secs(secs);
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(then)
        .unwrap();
}

/// Writes `dir/name` as if it had been written a minute ago: a finished write, not one that
/// may still be in progress.
fn write_settled(dir: &Path, name: &str, content: &str) {
    write(dir, name, content);
    age(&dir.join(name), 60);
}

#[test]
fn splits_the_tools_path() {
    assert_eq!(
        split_tools_path("/a::/b:"),
        vec![Path::new("/a").to_path_buf(), Path::new("/b").to_path_buf()]
    );
}

#[test]
fn first_directory_wins_and_the_shadowed_file_is_reported() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write(a.path(), "dup.meta", &tool("from-a"));
    write(b.path(), "dup.meta", &tool("from-b"));
    write(b.path(), "only_b.meta", &tool("b"));
    let reg = Registry::open(vec![a.path().into(), b.path().into()]);
    let cat = reg.catalog();
    assert_eq!(cat.revision, 1);
    assert_eq!(
        cat.tools["dup"].meta.def.description.as_deref(),
        Some("from-a")
    );
    assert!(cat.tools.contains_key("only_b"));
    let shadowed: Vec<_> = cat
        .diagnostics
        .iter()
        .filter(|d| d.code == Code::Shadowed)
        .collect();
    assert_eq!(shadowed.len(), 1);
    assert_eq!(shadowed[0].file, b.path().join("dup.meta"));
    assert!(
        shadowed[0]
            .message
            .contains(&a.path().join("dup.meta").display().to_string())
    );
}

#[test]
fn a_broken_file_is_reported_and_the_others_still_load() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "good.meta", &tool("good"));
    write(dir.path(), "broken.meta", "{ not json");
    write(dir.path(), "typed.meta", r#"{"description": 5}"#);
    write(dir.path(), "notes.txt", "not a tool");
    write(dir.path(), ".hidden.meta", "{ swap file");
    std::fs::create_dir(dir.path().join("adir.meta")).unwrap();
    let reg = Registry::open(vec![dir.path().into(), dir.path().join("missing")]);
    let cat = reg.catalog();
    assert_eq!(cat.tools.keys().collect::<Vec<_>>(), ["good"]);
    let errors: Vec<_> = cat
        .diagnostics
        .iter()
        .filter(|d| d.severity == Severity::Error)
        .collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|d| d.file.ends_with("broken.meta") && d.code == Code::NotJson)
    );
    assert!(
        errors
            .iter()
            .any(|d| d.file.ends_with("typed.meta") && d.field.as_deref() == Some("description"))
    );
    assert!(
        cat.diagnostics
            .iter()
            .any(|d| d.code == Code::Io && d.file.ends_with("missing"))
    );
}

#[test]
fn rescans_bump_the_revision_only_on_effective_changes() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.meta", &tool("a"));
    let reg = Registry::open(vec![dir.path().into()]);
    assert_eq!(reg.rescan(), None, "nothing changed");

    write(dir.path(), "b.meta", &tool("b"));
    assert_eq!(reg.rescan(), Some(2), "added");
    write(dir.path(), "b.meta", &tool("b2"));
    assert_eq!(reg.rescan(), Some(3), "changed");
    assert_eq!(
        reg.catalog().tools["b"].meta.def.description.as_deref(),
        Some("b2")
    );
    write(dir.path(), "b.meta", &tool("b2"));
    assert_eq!(reg.rescan(), None, "rewritten with the same bytes");

    write_executable(dir.path(), "b", "#!/bin/sh\necho one\n");
    assert_eq!(reg.rescan(), Some(4), "co-located executable appeared");
    let first = reg.catalog().tools["b"].executable.clone().unwrap();
    write(dir.path(), "b", "#!/bin/sh\necho two, longer\n");
    assert_eq!(reg.rescan(), Some(5), "co-located executable changed");
    assert_ne!(
        reg.catalog().tools["b"].executable.as_ref().unwrap().sha256,
        first.sha256
    );

    write_settled(dir.path(), "a.meta", "{ broken");
    assert_eq!(reg.rescan(), Some(6), "a broken file drops its tool");
    assert!(reg.catalog().has_errors());
    std::fs::remove_file(dir.path().join("a.meta")).unwrap();
    assert_eq!(
        reg.rescan(),
        None,
        "removing an already-rejected file changes no tool"
    );
    assert!(!reg.catalog().has_errors(), "its diagnostics go with it");
    std::fs::remove_file(dir.path().join("b.meta")).unwrap();
    assert_eq!(reg.rescan(), Some(7), "deleted");
    assert!(reg.catalog().tools.is_empty());
}

#[test]
fn with_agreed_numbering_a_change_waits_for_its_revision() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.meta", &tool("a"));
    let reg = Registry::with_numbering(vec![dir.path().into()], Numbering::Agreed);
    let first = reg.catalog();
    assert!(reg.publish(&first, 7), "the first agreement");
    assert_eq!(reg.catalog().revision, 7);

    write(dir.path(), "b.meta", &tool("b"));
    assert_eq!(reg.rescan(), Some(2), "proposed at the next local number");
    assert_eq!(reg.catalog().revision, 7, "not served before it is agreed");
    assert!(!reg.catalog().tools.contains_key("b"));
    let proposal = reg.scans().borrow().clone();
    assert!(proposal.tools.contains_key("b"));
    assert!(
        !reg.publish(&proposal, 7),
        "revision 7 names the tools without b"
    );
    assert!(!reg.publish(&proposal, 6), "never backwards");
    assert!(reg.publish(&proposal, 9));
    let served = reg.catalog();
    assert_eq!(served.revision, 9);
    assert!(served.tools.contains_key("b"));
    assert!(reg.publish(&proposal, 9), "the same again is no change");

    // Problems alone are served at once, at the same revision.
    write(dir.path(), "c.meta", "{ broken");
    assert_eq!(reg.rescan(), None);
    assert_eq!(reg.catalog().revision, 9);
    assert!(reg.catalog().has_errors());
}

#[test]
fn the_content_digest_follows_the_tools_only() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for dir in [&a, &b] {
        write(dir.path(), "x.meta", &tool("x"));
        write(dir.path(), "y.meta", &tool("y"));
    }
    write(b.path(), "broken.meta", "{");
    let (ra, rb) = (
        Registry::open(vec![a.path().into()]),
        Registry::open(vec![b.path().into()]),
    );
    let digest = ra.catalog().content_digest();
    assert_eq!(digest.len(), 64);
    assert_eq!(
        digest,
        rb.catalog().content_digest(),
        "other directories, other problems, same tools"
    );
    write_executable(b.path(), "y", "#!/bin/sh\necho y\n");
    rb.rescan();
    assert_ne!(
        digest,
        rb.catalog().content_digest(),
        "an executable counts"
    );
    write(a.path(), "x.meta", &tool("x2"));
    ra.rescan();
    assert_ne!(digest, ra.catalog().content_digest(), "a .meta counts");
}

#[test]
fn an_invalid_tool_is_kept_with_its_reason_and_each_change_is_told_once() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.meta", &tool("a"));
    write(dir.path(), "b.meta", &tool("b"));
    let reg = Registry::open(vec![dir.path().into()]);
    assert!(reg.catalog().invalid.is_empty());

    // Valid, then broken: removed from the tools, kept as invalid with file, field and reason.
    let before = reg.catalog();
    write_settled(dir.path(), "a.meta", r#"{"description": 3, "cmd": "true"}"#);
    assert_eq!(reg.rescan(), Some(2));
    let after = reg.catalog();
    assert!(!after.tools.contains_key("a"));
    let reason = after.invalid["a"].reason();
    assert_eq!(
        reason,
        format!(
            "invalid: {}: field `description`: expected string, got number",
            dir.path().join("a.meta").display()
        )
    );
    let changes = after.changes_since(&before);
    assert_eq!(changes.invalid, [("a".to_string(), reason.clone())]);
    assert!(
        changes.removed.is_empty(),
        "a tool that became invalid is told as invalid, not removed: {changes:?}"
    );

    // A rescan with no change tells nothing new.
    let before = reg.catalog();
    assert_eq!(reg.rescan(), None);
    assert!(reg.catalog().changes_since(&before).is_empty());

    // Broken another way: no served tool changed, but the catalog says the new reason.
    write(dir.path(), "a.meta", "{ not json");
    assert_eq!(reg.rescan(), None);
    let changes = reg.catalog().changes_since(&before);
    assert_eq!(changes.invalid.len(), 1, "{changes:?}");
    assert!(
        changes.invalid[0].1.contains("not valid JSON"),
        "{changes:?}"
    );
    assert_eq!(
        reg.catalog().revision,
        2,
        "the revision follows served tools only"
    );

    // A brand-new broken file is invalid too; repairing one adds it back; deleting one removes it.
    let before = reg.catalog();
    write(dir.path(), "c.meta", r#"{"tier": "lukewarm"}"#);
    write(dir.path(), "a.meta", &tool("a2"));
    std::fs::remove_file(dir.path().join("b.meta")).unwrap();
    assert_eq!(reg.rescan(), Some(3));
    let changes = reg.catalog().changes_since(&before);
    assert_eq!(changes.added, ["a"]);
    assert_eq!(changes.removed, ["b"]);
    assert_eq!(changes.invalid.len(), 1);
    assert_eq!(changes.invalid[0].0, "c");
    assert!(changes.invalid[0].1.contains("field `tier`"), "{changes:?}");
    assert!(!reg.catalog().invalid.contains_key("a"));
}

/// Waits (bounded) until the registry publishes a catalog that satisfies `pred`.
async fn wait_for(
    rx: &mut tokio::sync::watch::Receiver<std::sync::Arc<toolsrv_registry::Catalog>>,
    what: &str,
    pred: impl Fn(&toolsrv_registry::Catalog) -> bool,
) -> u64 {
    let waited = tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|c| pred(c))).await;
    match waited {
        Ok(Ok(cat)) => cat.revision,
        _ => panic!("timed out waiting for: {what}"),
    }
}

#[tokio::test]
async fn file_events_trigger_debounced_rescans() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.meta", &tool("a"));
    let reg = Registry::open(vec![dir.path().into()]);
    let mut rx = reg.subscribe();
    let stop = tokio_util::sync::CancellationToken::new();
    // A long periodic interval: only file events can explain a prompt rescan.
    let options = WatchOptions {
        debounce: Duration::from_millis(50),
        rescan_every: Duration::from_secs(3600),
    };
    let task = tokio::spawn(reg.clone().watch(options, stop.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;

    write(dir.path(), "b.meta", &tool("b"));
    let r_added = wait_for(&mut rx, "b added", |c| c.tools.contains_key("b")).await;
    assert!(r_added > 1);
    write(dir.path(), "b.meta", &tool("b-changed"));
    let r_changed = wait_for(&mut rx, "b changed", |c| {
        c.tools
            .get("b")
            .is_some_and(|t| t.meta.def.description.as_deref() == Some("b-changed"))
    })
    .await;
    assert!(r_changed > r_added);
    std::fs::remove_file(dir.path().join("b.meta")).unwrap();
    let r_deleted = wait_for(&mut rx, "b deleted", |c| !c.tools.contains_key("b")).await;
    assert!(r_deleted > r_changed);

    // A burst of writes settles into few revisions, ending on the last content.
    for i in 0..20 {
        write(dir.path(), "c.meta", &tool(&format!("c{i}")));
    }
    let r_burst = wait_for(&mut rx, "burst settled", |c| {
        c.tools
            .get("c")
            .is_some_and(|t| t.meta.def.description.as_deref() == Some("c19"))
    })
    .await;
    assert!(
        r_burst - r_deleted < 20,
        "debounce should coalesce a burst, got {} revisions",
        r_burst - r_deleted
    );

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn the_periodic_rescan_catches_what_events_miss() {
    let root = tempfile::tempdir().unwrap();
    let late = root.path().join("late");
    // The directory does not exist yet, so there is nothing to watch: only the timer finds it.
    let reg = Registry::open(vec![late.clone()]);
    let mut rx = reg.subscribe();
    let stop = tokio_util::sync::CancellationToken::new();
    let options = WatchOptions {
        debounce: Duration::from_millis(20),
        rescan_every: Duration::from_millis(200),
    };
    let task = tokio::spawn(reg.clone().watch(options, stop.clone()));
    std::fs::create_dir(&late).unwrap();
    write(&late, "x.meta", &tool("x"));
    wait_for(&mut rx, "x found by the periodic rescan", |c| {
        c.tools.contains_key("x")
    })
    .await;
    // Now the directory is watched too: a new file shows up.
    write(&late, "y.meta", &tool("y"));
    wait_for(&mut rx, "y found", |c| c.tools.contains_key("y")).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}

#[test]
fn a_rewrite_in_progress_keeps_the_previous_version_until_it_settles() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.meta");
    write_settled(dir.path(), "a.meta", &tool("one"));
    let mut scanner = Scanner::new(vec![dir.path().into()]);
    assert!(scanner.scan().tools.contains_key("a"));
    assert_eq!(scanner.recheck_at(), None);

    // Truncated and not written yet, as `>` in a shell leaves it: still the previous version,
    // and a scan is asked for when the file settles.
    std::fs::File::create(&path).unwrap();
    let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
    let catalog = scanner.scan();
    assert_eq!(
        catalog.tools["a"].meta.def.description.as_deref(),
        Some("one")
    );
    assert!(catalog.invalid.is_empty(), "{:?}", catalog.invalid);
    assert_eq!(scanner.recheck_at(), Some(modified + SETTLE_AGE));

    // Half written: the same.
    write(dir.path(), "a.meta", r#"{"description": "tw"#);
    let catalog = scanner.scan();
    assert_eq!(
        catalog.tools["a"].meta.def.description.as_deref(),
        Some("one")
    );
    assert!(scanner.recheck_at().is_some());

    // Written: the new version at once, nothing to recheck.
    write(dir.path(), "a.meta", &tool("two"));
    let catalog = scanner.scan();
    assert_eq!(
        catalog.tools["a"].meta.def.description.as_deref(),
        Some("two")
    );
    assert_eq!(scanner.recheck_at(), None);

    // Left empty: once it has settled, the tool is invalid, as any broken file.
    std::fs::File::create(&path).unwrap();
    assert!(scanner.scan().tools.contains_key("a"));
    age(&path, 10);
    let catalog = scanner.scan();
    assert!(!catalog.tools.contains_key("a"));
    assert!(
        catalog.invalid["a"]
            .reason()
            .contains(&path.display().to_string()),
        "{:?}",
        catalog.invalid
    );
    assert_eq!(scanner.recheck_at(), None);

    // A new file has no previous version to keep: broken is invalid at once, even fresh.
    write(dir.path(), "b.meta", "{");
    let catalog = scanner.scan();
    assert!(catalog.invalid.contains_key("b"));
    assert_eq!(scanner.recheck_at(), None);
    // And a file dated in the future is never taken as settling.
    write(dir.path(), "a.meta", &tool("three"));
    assert!(scanner.scan().tools.contains_key("a"));
    let future = std::time::SystemTime::now() + Duration::from_secs(3600);
    write(dir.path(), "a.meta", "");
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(future)
        .unwrap();
    let catalog = scanner.scan();
    assert!(
        catalog.invalid.contains_key("a"),
        "{:?}",
        catalog.tools.keys()
    );
    assert_eq!(scanner.recheck_at(), None);
}

#[tokio::test]
async fn a_file_left_broken_is_reported_when_it_settles_without_waiting_for_the_timer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.meta");
    write_settled(dir.path(), "a.meta", &tool("a"));
    let reg = Registry::open(vec![dir.path().into()]);
    let mut rx = reg.subscribe();
    let stop = tokio_util::sync::CancellationToken::new();
    // No periodic rescan within the test: only the file event and the recheck it asks for.
    let options = WatchOptions {
        debounce: Duration::from_millis(20),
        rescan_every: Duration::from_secs(3600),
    };
    let task = tokio::spawn(reg.clone().watch(options, stop.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;

    let truncated = std::time::Instant::now();
    std::fs::File::create(&path).unwrap();
    let revision = wait_for(&mut rx, "a reported invalid", |c| {
        c.invalid.contains_key("a")
    })
    .await;
    assert!(
        truncated.elapsed() >= SETTLE_AGE - Duration::from_millis(100),
        "reported after {:?}, before the file settled",
        truncated.elapsed()
    );
    assert!(!reg.catalog().tools.contains_key("a"));
    assert_eq!(revision, 2);

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}

#[test]
fn unchanged_settled_files_are_not_reread_but_rewrites_are_seen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.meta");
    write(dir.path(), "a.meta", &tool("one"));
    let old = std::time::SystemTime::now() - Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let reg = Registry::open(vec![dir.path().into()]);
    assert_eq!(reg.rescan(), None);
    // Same size, new content: the modification time moves, so the change is seen.
    write(dir.path(), "a.meta", &tool("two"));
    assert_eq!(reg.rescan(), Some(2));
    assert_eq!(
        reg.catalog().tools["a"].meta.def.description.as_deref(),
        Some("two")
    );
    // Replaced by rename (as editors and ConfigMaps do) with the old size and timestamp:
    // the inode differs, so the change is still seen.
    let meta_path = dir.path().join("a.meta");
    std::fs::write(dir.path().join("a.tmp"), tool("six")).unwrap();
    std::fs::rename(dir.path().join("a.tmp"), &meta_path).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&meta_path)
        .unwrap()
        .set_modified(old)
        .unwrap();
    assert_eq!(reg.rescan(), Some(3), "a renamed-in file has a new inode");
    assert_eq!(
        reg.catalog().tools["a"].meta.def.description.as_deref(),
        Some("six")
    );
}

/// A `.meta` of `len` bytes exactly: valid JSON whose prompt pads it.
fn meta_of_len(len: usize) -> String {
    let head = r#"{"description": "big", "cmd": "echo big", "prompt": ""#;
    let tail = r#""}"#;
    format!("{head}{}{tail}", "x".repeat(len - head.len() - tail.len()))
}

#[test]
fn an_oversized_meta_is_rejected_with_its_size_and_the_others_still_load() {
    use toolsrv_proto::limits::MAX_META_BYTES;
    let limit = MAX_META_BYTES as usize;
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "good.meta", &tool("good"));
    write(dir.path(), "at_limit.meta", &meta_of_len(limit));
    write(dir.path(), "over.meta", &meta_of_len(limit + 1));
    // A 5 MiB file, sparse: rejected from its metadata without being read.
    let huge = std::fs::File::create(dir.path().join("huge.meta")).unwrap();
    huge.set_len(5 << 20).unwrap();
    let reg = Registry::open(vec![dir.path().into()]);
    let cat = reg.catalog();
    assert_eq!(cat.tools.keys().collect::<Vec<_>>(), ["at_limit", "good"]);
    let too_large: Vec<_> = cat
        .diagnostics
        .iter()
        .filter(|d| d.code == Code::TooLarge)
        .collect();
    assert_eq!(too_large.len(), 2, "{:?}", cat.diagnostics);
    for (file, size) in [("over.meta", limit + 1), ("huge.meta", 5 << 20)] {
        let d = too_large
            .iter()
            .find(|d| d.file.ends_with(file))
            .unwrap_or_else(|| panic!("no diagnostic for {file}: {too_large:?}"));
        assert_eq!(d.severity, Severity::Error);
        let line = d.to_string();
        assert!(line.contains(&format!("{size} bytes")), "{line}");
        assert!(line.contains(&format!("limit of {limit} bytes")), "{line}");
    }

    // The tool set did not change when the big file grows; when it shrinks, it is served.
    write(dir.path(), "over.meta", &meta_of_len(limit + 100));
    assert_eq!(reg.rescan(), None);
    write(dir.path(), "over.meta", &tool("over"));
    assert_eq!(reg.rescan(), Some(2));
    assert!(reg.catalog().tools.contains_key("over"));
}

#[test]
fn an_oversized_executable_rejects_its_tool() {
    use std::os::unix::fs::PermissionsExt;
    use toolsrv_proto::limits::MAX_EXECUTABLE_BYTES;
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "good.meta", &tool("good"));
    write(dir.path(), "fat.meta", &tool("fat"));
    let exe = dir.path().join("fat");
    let file = std::fs::File::create(&exe).unwrap();
    file.set_len(MAX_EXECUTABLE_BYTES + 1).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let reg = Registry::open(vec![dir.path().into()]);
    let cat = reg.catalog();
    assert_eq!(
        cat.tools.keys().collect::<Vec<_>>(),
        ["good"],
        "served without its executable, `fat` would run its cmd instead"
    );
    let d = cat
        .diagnostics
        .iter()
        .find(|d| d.code == Code::TooLarge)
        .unwrap_or_else(|| panic!("no diagnostic: {:?}", cat.diagnostics));
    assert_eq!(d.file, exe);
    assert_eq!(d.severity, Severity::Error);
    let line = d.to_string();
    assert!(
        line.contains(&format!("{} bytes", MAX_EXECUTABLE_BYTES + 1))
            && line.contains(&format!("limit of {MAX_EXECUTABLE_BYTES} bytes")),
        "{line}"
    );

    // At the limit it is served, with the size that was hashed.
    file.set_len(MAX_EXECUTABLE_BYTES).unwrap();
    assert_eq!(reg.rescan(), Some(2));
    let served = reg.catalog().tools["fat"].executable.clone().unwrap();
    assert_eq!(served.size, MAX_EXECUTABLE_BYTES);
}

/// The bounded readers stop at the limit even when the size announced up front is wrong (a file
/// that grows while read; a FIFO announces 0 bytes).
#[test]
fn bounded_readers_stop_at_the_limit_and_refuse_what_is_not_a_file() {
    use toolsrv_registry::{ReadError, hash_file_bounded, read_meta};
    let dir = tempfile::tempdir().unwrap();
    // How a `.meta` that grows while it is read is cut is tested beside `read_meta`; a FIFO,
    // which a reader would wait on for a writer, is refused without waiting.
    let fifo = dir.path().join("grows.meta");
    mkfifo(&fifo);
    match read_meta(&fifo) {
        Err(ReadError::Rejected(d)) => {
            assert_eq!(d.code, Code::Io);
            assert!(d.message.contains("a FIFO, not a regular file"), "{d}");
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert!(hash_file_bounded(&fifo, 10).is_err());

    let small = dir.path().join("small");
    std::fs::write(&small, b"12345").unwrap();
    assert_eq!(hash_file_bounded(&small, 4).unwrap(), None);
    let hashed = hash_file_bounded(&small, 5).unwrap().unwrap();
    assert_eq!(hashed.size, 5);
    assert_eq!(hashed.sha256, toolsrv_registry::hex_sha256(b"12345"));
    assert!(matches!(
        read_meta(&dir.path().join("absent.meta")),
        Err(ReadError::Gone)
    ));
}

/// One name rule on both sides: `x.meta.meta` declares the tool `x.meta`, which is refused.
#[test]
fn a_meta_meta_file_is_reported_not_served() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "x.meta", &tool("x"));
    write(dir.path(), "x.meta.meta", &tool("double"));
    let cat = Registry::open(vec![dir.path().into()]).catalog();
    assert_eq!(cat.tools.keys().collect::<Vec<_>>(), ["x"]);
    let d = cat
        .diagnostics
        .iter()
        .find(|d| d.code == Code::BadName)
        .unwrap_or_else(|| panic!("no diagnostic: {:?}", cat.diagnostics));
    assert!(d.file.ends_with("x.meta.meta"));
    assert!(d.message.contains("ends in `.meta`"), "{d}");
}

/// A FIFO, a device and a name that is not UTF-8, each where a `.meta` would be: none hangs the
/// scan or is skipped without a word; each is an error naming its file, and the good tool
/// beside them loads. Also when a FIFO takes a `.meta`'s place after a scan (the reader no
/// longer opens what it looked at before).
#[test]
fn a_fifo_a_device_or_an_odd_name_where_a_meta_should_be_is_reported_without_hanging() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "good.meta", &tool("good"));
    let fifo = dir.path().join("pipe.meta");
    mkfifo(&fifo);
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero.meta")).unwrap();
    let odd = dir
        .path()
        .join(std::ffi::OsStr::from_bytes(b"odd\xff\x1b[2J.meta"));
    std::fs::write(&odd, tool("odd")).unwrap();
    // A tool whose file is swapped for a FIFO once it was scanned.
    write(dir.path(), "swapped.meta", &tool("swapped"));

    let (tx, rx) = std::sync::mpsc::channel();
    let path = dir.path().to_path_buf();
    std::thread::spawn(move || {
        let reg = Registry::open(vec![path.clone()]);
        let first = reg.catalog();
        std::fs::remove_file(path.join("swapped.meta")).unwrap();
        mkfifo(&path.join("swapped.meta"));
        let mut scanner = Scanner::new(vec![path]);
        let _ = tx.send((first, scanner.scan()));
    });
    let (first, second) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the scan hangs on a FIFO or a device");
    assert_eq!(first.tools.keys().collect::<Vec<_>>(), ["good", "swapped"]);
    assert_eq!(second.tools.keys().collect::<Vec<_>>(), ["good"]);
    let error_of = |cat: &toolsrv_registry::Catalog, file: &Path| {
        cat.diagnostics
            .iter()
            .find(|d| d.severity == Severity::Error && d.file == file)
            .map(|d| d.message.clone())
            .unwrap_or_else(|| panic!("no error for {}: {:?}", file.display(), cat.diagnostics))
    };
    assert!(error_of(&first, &fifo).contains("a FIFO, not a regular file"));
    assert!(error_of(&first, &dir.path().join("zero.meta")).contains("a device"));
    assert!(error_of(&second, &dir.path().join("swapped.meta")).contains("a FIFO"));
    // The odd name is not a tool name, and says so.
    let odd_error = first
        .diagnostics
        .iter()
        .find(|d| d.file == odd)
        .unwrap_or_else(|| panic!("{:?}", first.diagnostics));
    assert_eq!(odd_error.code, Code::BadName, "{odd_error:?}");
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The `Exposed` diagnostics of a catalog, as (file, message).
fn exposed(cat: &toolsrv_registry::Catalog) -> Vec<(std::path::PathBuf, String)> {
    cat.diagnostics
        .iter()
        .filter(|d| d.code == Code::Exposed)
        .map(|d| {
            assert_eq!(d.severity, Severity::Error);
            (d.file.clone(), d.message.clone())
        })
        .collect()
}

/// Another user of the machine must not choose what a tool runs: a `.meta` or an executable
/// writable by every user, or one in a directory every user may write (and replace files in),
/// even through a symbolic link, is not served, with an error naming the file or directory and
/// its mode; once fixed, the next scan serves it. Before, such tools were served: with `chmod
/// 777` on a tools directory, anyone logged in to the coordinator's machine could ship a tool
/// to every host.
#[test]
fn tools_every_user_could_rewrite_are_not_served() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tools");
    std::fs::create_dir(&dir).unwrap();
    write(&dir, "good.meta", &tool("good"));
    write(&dir, "open_meta.meta", &tool("open"));
    write(&dir, "open_exe.meta", &tool("exe"));
    write_executable(&dir, "open_exe", "#!/bin/sh\necho hi\n");
    // A .meta linked from a directory anyone may write.
    let drop_box = root.path().join("drop-box");
    std::fs::create_dir(&drop_box).unwrap();
    write(&drop_box, "linked.meta", &tool("linked"));
    std::os::unix::fs::symlink(drop_box.join("linked.meta"), dir.join("linked.meta")).unwrap();
    chmod(&dir.join("open_meta.meta"), 0o666);
    chmod(&dir.join("open_exe"), 0o777);
    chmod(&drop_box, 0o777);

    let reg = Registry::open(vec![dir.clone()]);
    let cat = reg.catalog();
    assert_eq!(cat.tools.keys().collect::<Vec<_>>(), ["good"]);
    let mut found = exposed(&cat);
    found.sort();
    let names: Vec<&Path> = found.iter().map(|(f, _)| f.as_path()).collect();
    assert_eq!(
        names,
        [
            dir.join("linked.meta").as_path(),
            &dir.join("open_exe"),
            &dir.join("open_meta.meta")
        ],
        "{found:?}"
    );
    assert!(
        found[0]
            .1
            .contains(&format!("the directory {}", drop_box.display()))
    );
    assert!(found[0].1.contains("mode 0777") && found[0].1.contains("chmod o-w"));
    assert!(found[1].1.contains("mode 0777"), "{found:?}");
    assert!(found[2].1.contains("mode 0666"), "{found:?}");
    for name in ["open_meta", "open_exe", "linked"] {
        assert!(cat.invalid.contains_key(name), "{name}");
    }

    // Fixed, they are served at the next scan (a chmod changes no content).
    chmod(&dir.join("open_meta.meta"), 0o644);
    chmod(&dir.join("open_exe"), 0o755);
    chmod(&drop_box, 0o755);
    reg.rescan();
    let cat = reg.catalog();
    assert_eq!(cat.tools.len(), 4, "{:?}", cat.diagnostics);
    assert!(exposed(&cat).is_empty());

    // The tools directory itself open to everyone: nothing in it is served. With the sticky
    // bit (as /tmp), nobody replaces another's files: served.
    chmod(&dir, 0o777);
    reg.rescan();
    let cat = reg.catalog();
    assert!(cat.tools.is_empty(), "{:?}", cat.tools.keys());
    assert_eq!(exposed(&cat).len(), 4);
    chmod(&dir, 0o1777);
    reg.rescan();
    assert_eq!(reg.catalog().tools.len(), 4);

    // But anyone may add files there: a tool, or the executable beside a tool's `.meta` (which
    // wins over its `cmd`), that another user owns is not served. (Needs root, for the chown.)
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test gives files to another user: run it as root"
    );
    std::fs::write(
        dir.join("planted.meta"),
        r#"{"description": "theirs", "cmd": "id"}"#,
    )
    .unwrap();
    std::os::unix::fs::chown(dir.join("planted.meta"), Some(65534), None).unwrap();
    std::fs::write(dir.join("good"), "#!/bin/sh\nid\n").unwrap();
    chmod(&dir.join("good"), 0o755);
    std::os::unix::fs::chown(dir.join("good"), Some(65534), None).unwrap();
    reg.rescan();
    let cat = reg.catalog();
    assert!(!cat.tools.contains_key("planted"), "{:?}", cat.tools.keys());
    assert!(!cat.tools.contains_key("good"), "{:?}", cat.tools.keys());
    let found = exposed(&cat);
    let planted = found
        .iter()
        .find(|(f, _)| f == &dir.join("planted.meta"))
        .unwrap_or_else(|| panic!("{found:?}"));
    assert!(
        planted.1.contains("owned by uid 65534")
            && planted.1.contains("any of them could have put it there")
            && planted.1.contains("remove it, or chown it"),
        "{}",
        planted.1
    );
    assert_eq!(
        cat.tools.len(),
        3,
        "the others still served: {:?}",
        cat.tools.keys()
    );
}

/// A file system mounted read-only cannot be written whatever the modes say: a Kubernetes
/// ConfigMap's directories are mode 0777, and its tools are served. (Needs root, for the mount.)
#[test]
fn modes_on_a_read_only_file_system_do_not_count() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test mounts a file system: run it as root"
    );
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("mounted");
    std::fs::create_dir(&dir).unwrap();
    let mount = |args: &[&str]| {
        let out = std::process::Command::new("mount")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let target = dir.to_str().unwrap();
    mount(&["-t", "tmpfs", "-o", "mode=0777,size=1m", "tools", target]);
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(dir.clone());
    write(&dir, "ro.meta", &tool("ro"));
    chmod(&dir.join("ro.meta"), 0o666);
    let reg = Registry::open(vec![dir.clone()]);
    assert!(reg.catalog().tools.is_empty(), "writable: not served");
    mount(&["-o", "remount,ro", target]);
    reg.rescan();
    let cat = reg.catalog();
    assert_eq!(
        cat.tools.keys().collect::<Vec<_>>(),
        ["ro"],
        "{:?}",
        cat.diagnostics
    );
}

/// A tools directory that was read and then cannot be (moved away, unmounted, replaced by a
/// file) keeps its tools served, with a warning and a scan again soon, until it can be read;
/// emptying it is what takes its tools off. One that never could be read serves nothing.
#[test]
fn a_tools_directory_that_vanishes_keeps_its_tools_until_it_is_back() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tools");
    std::fs::create_dir(&dir).unwrap();
    write_settled(&dir, "a.meta", &tool("a"));
    write_settled(&dir, "b.meta", &tool("b"));
    let never = root.path().join("typo");
    let mut scanner = Scanner::new(vec![dir.clone(), never.clone()]);
    let names = |c: &toolsrv_registry::Catalog| c.tools.keys().cloned().collect::<Vec<_>>();
    let first = scanner.scan();
    assert_eq!(names(&first), ["a", "b"]);
    assert_eq!(
        scanner.recheck_at(),
        None,
        "a directory never read is no reason to retry"
    );
    assert!(
        first
            .diagnostics
            .iter()
            .any(|d| d.file == never && d.message.contains("cannot read tools directory")),
        "{:?}",
        first.diagnostics
    );

    let away = root.path().join("tools.away");
    std::fs::rename(&dir, &away).unwrap();
    let gone = scanner.scan();
    assert_eq!(
        names(&gone),
        ["a", "b"],
        "a moved directory emptied the catalog"
    );
    assert!(
        gone.diagnostics.iter().any(|d| d
            .message
            .contains("the tools of the last complete scan are served")),
        "{:?}",
        gone.diagnostics
    );
    assert!(scanner.recheck_at().is_some(), "scanned again soon");
    // A file in its place is no better.
    std::fs::write(&dir, "not a directory").unwrap();
    assert_eq!(names(&scanner.scan()), ["a", "b"]);
    std::fs::remove_file(&dir).unwrap();

    // Back, with one tool fewer: read whole again.
    std::fs::remove_file(away.join("b.meta")).unwrap();
    std::fs::rename(&away, &dir).unwrap();
    assert_eq!(names(&scanner.scan()), ["a"]);
    assert_eq!(scanner.recheck_at(), None);
    // Emptied: its tools are off.
    std::fs::remove_file(dir.join("a.meta")).unwrap();
    assert!(scanner.scan().tools.is_empty());
}

/// A `.meta` reached through a link to a path longer than the system takes (`realpath` fails
/// with "File name too long") cannot be checked for who could change it, and is not served:
/// such a link in a sticky tools directory hid a planted tool, served as root.
#[test]
fn a_tool_behind_a_path_too_long_to_check_is_not_served() {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::{Mode, mkdirat};
    let root = tempfile::tempdir().unwrap();
    let tools = root.path().join("tools");
    std::fs::create_dir(&tools).unwrap();
    write(&tools, "good.meta", &tool("good"));
    // About 4,800 bytes of nested directories, made one at a time from a descriptor.
    let name = "d".repeat(200);
    let mut dir = openat(
        nix::fcntl::AT_FDCWD,
        root.path(),
        OFlag::O_DIRECTORY | OFlag::O_RDONLY,
        Mode::empty(),
    )
    .unwrap();
    // Reached through short links: `half` leads to the first twelve levels, and the link in
    // the tools directory names `half` and the twelve more, each path under the system's limit.
    let mut first = root.path().to_path_buf();
    let mut second = root.path().join("half");
    for level in 0..24 {
        mkdirat(&dir, name.as_str(), Mode::from_bits_truncate(0o755)).unwrap();
        dir = openat(
            &dir,
            name.as_str(),
            OFlag::O_DIRECTORY | OFlag::O_RDONLY,
            Mode::empty(),
        )
        .unwrap();
        if level < 12 {
            first.push(&name);
        } else {
            second.push(&name);
        }
    }
    std::os::unix::fs::symlink(&first, root.path().join("half")).unwrap();
    let meta = openat(
        &dir,
        "far.meta",
        OFlag::O_CREAT | OFlag::O_WRONLY,
        Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    nix::unistd::write(&meta, tool("far").as_bytes()).unwrap();
    std::os::unix::fs::symlink(second.join("far.meta"), tools.join("far.meta")).unwrap();
    assert!(
        std::fs::canonicalize(tools.join("far.meta")).is_err(),
        "the path it leads to is longer than the system takes"
    );

    let reg = Registry::open(vec![tools.clone()]);
    let cat = reg.catalog();
    assert!(cat.tools.contains_key("good"), "{:?}", cat.diagnostics);
    assert!(!cat.tools.contains_key("far"), "{:?}", cat.tools.keys());
    let found = exposed(&cat);
    assert!(
        found
            .iter()
            .any(|(f, why)| f == &tools.join("far.meta") && why.contains("cannot be told")),
        "{found:?}"
    );
}
