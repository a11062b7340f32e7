//! Materializing catalog updates on disk, with a fake blob source instead of a coordinator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{FakeBlobs, blob_ref, doc, files, script};
use toolsrv_agent::{BlobCache, CatalogStore};
use toolsrv_proto::v1::CatalogUpdate;

fn store(state: &std::path::Path) -> CatalogStore {
    let store = CatalogStore::new(state.join("catalog"), BlobCache::new(state.join("blobs")));
    store.open().unwrap();
    store
}

fn full(revision: u64, upserts: Vec<toolsrv_proto::v1::ToolDocument>) -> CatalogUpdate {
    CatalogUpdate {
        revision,
        full: true,
        upserts,
        removals: vec![],
        more: false,
    }
}

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn full_then_incremental_update() {
    let state = tempfile::tempdir().unwrap();
    let store = store(state.path());
    let exe_a = script("echo a");
    let exe_b = script("echo b");
    let blobs = FakeBlobs::with(&[&exe_a, &exe_b]);
    let meta_a = r#"{"description":"a"}"#;
    let meta_b = r#"{"description":"b","cmd":"echo b"}"#;

    let report = store
        .apply(
            &full(
                1,
                vec![
                    doc("a", meta_a, Some(blob_ref(&exe_a))),
                    doc("b", meta_b, None),
                ],
            ),
            &blobs,
        )
        .await;
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    assert!(report.missing.is_empty());
    let dir = store.dir();
    assert_eq!(files(dir), ["a", "a.meta", "b.meta"]);
    assert_eq!(
        std::fs::read(dir.join("a.meta")).unwrap(),
        meta_a.as_bytes()
    );
    assert_eq!(std::fs::read(dir.join("a")).unwrap(), exe_a);
    assert_eq!(mode(&dir.join("a")), 0o555, "read-only, runnable");
    assert_eq!(mode(&dir.join("a.meta")), 0o444);
    let cached = state.path().join("blobs").join(blob_ref(&exe_a).sha256);
    assert_eq!(std::fs::read(&cached).unwrap(), exe_a);
    assert_eq!(mode(&cached), 0o555);
    for d in [dir.to_path_buf(), state.path().join("blobs")] {
        assert_eq!(mode(&d) & 0o022, 0, "{} is writable by others", d.display());
    }
    assert_eq!(blobs.fetches(), 1);

    // Incremental: b gains an executable, a is removed, c is added.
    let meta_c = r#"{"description":"c"}"#;
    let report = store
        .apply(
            &CatalogUpdate {
                revision: 2,
                full: false,
                upserts: vec![
                    doc("b", meta_b, Some(blob_ref(&exe_b))),
                    doc("c", meta_c, None),
                ],
                removals: vec!["a".into()],
                more: false,
            },
            &blobs,
        )
        .await;
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    assert_eq!(files(dir), ["b", "b.meta", "c.meta"]);
    assert_eq!(std::fs::read(dir.join("b")).unwrap(), exe_b);
    assert_eq!(mode(&dir.join("b")), 0o555);
    // The blob cache keeps a's executable for the next time it is shipped.
    assert!(cached.exists());

    // An upsert without executable removes the old one.
    store
        .apply(
            &CatalogUpdate {
                revision: 3,
                full: false,
                upserts: vec![doc("b", meta_b, None)],
                removals: vec![],
                more: false,
            },
            &blobs,
        )
        .await;
    assert_eq!(files(dir), ["b.meta", "c.meta"]);
}

#[tokio::test]
async fn full_update_removes_stale_files() {
    let state = tempfile::tempdir().unwrap();
    let store = store(state.path());
    let exe = script("echo old");
    let blobs = FakeBlobs::with(&[&exe]);
    store
        .apply(
            &full(
                1,
                vec![
                    doc("old", "{}", Some(blob_ref(&exe))),
                    doc("keep", "{}", None),
                ],
            ),
            &blobs,
        )
        .await;
    std::fs::write(store.dir().join(".tmp-leftover-1"), "x").unwrap();
    std::fs::write(store.dir().join("stray.meta"), "{}").unwrap();
    let report = store
        .apply(&full(2, vec![doc("keep", "{}", None)]), &blobs)
        .await;
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    assert_eq!(files(store.dir()), ["keep.meta"]);
}

#[tokio::test]
async fn wrong_meta_digest_writes_nothing() {
    let state = tempfile::tempdir().unwrap();
    let store = store(state.path());
    let exe = script("echo x");
    let blobs = FakeBlobs::with(&[&exe]);
    let mut bad = doc("x", r#"{"description":"x"}"#, Some(blob_ref(&exe)));
    bad.meta_sha256 = toolsrv_registry::hex_sha256(b"something else");
    let report = store.apply(&full(1, vec![bad]), &blobs).await;
    assert_eq!(report.refused.len(), 1);
    let msg = report.refused[0].to_string();
    assert!(
        msg.contains("tool `x`") && msg.contains("hashes to"),
        "{msg}"
    );
    assert!(files(store.dir()).is_empty());
    assert_eq!(
        blobs.fetches(),
        0,
        "nothing is fetched for a refused document"
    );
}

#[tokio::test]
async fn wrong_blob_content_is_rejected_and_retried_later() {
    let state = tempfile::tempdir().unwrap();
    let store = store(state.path());
    let exe = script("echo real");
    let blobs = FakeBlobs::default();
    let blob = blob_ref(&exe);
    blobs.serve_as(&blob.sha256, &script("echo evil"));
    let report = store
        .apply(&full(1, vec![doc("t", "{}", Some(blob.clone()))]), &blobs)
        .await;
    // The tool is served without its executable, and the cache holds nothing under that digest.
    assert_eq!(report.missing.keys().collect::<Vec<_>>(), ["t"]);
    assert_eq!(files(store.dir()), ["t.meta"]);
    assert!(files(&state.path().join("blobs")).is_empty());

    // A wrong size is refused too.
    blobs.serve_as(&blob.sha256, &exe[..exe.len() - 1]);
    assert!(store.place_executable("t", &blob, &blobs).await.is_err());
    assert!(files(&state.path().join("blobs")).is_empty());

    blobs.serve_as(&blob.sha256, &exe);
    store.place_executable("t", &blob, &blobs).await.unwrap();
    assert_eq!(std::fs::read(store.dir().join("t")).unwrap(), exe);
}

#[tokio::test]
async fn bad_names_are_refused_and_nothing_escapes() {
    let state = tempfile::tempdir().unwrap();
    let store = store(state.path());
    let blobs = FakeBlobs::default();
    let names = ["../x", "..", ".", "a/b", "", "x.meta", "/etc/passwd"];
    let upserts = names.iter().map(|n| doc(n, "{}", None)).collect();
    let mut update = full(1, upserts);
    update.removals = vec!["../catalog".into(), "..".into()];
    let report = store.apply(&update, &blobs).await;
    assert_eq!(report.refused.len(), names.len() + 2);
    assert!(files(store.dir()).is_empty());
    assert_eq!(files(state.path()), ["blobs", "catalog"]);
    assert!(report.refused[0].to_string().contains("\"../x\""));

    // A digest that is not hex could name a path outside the cache: refused before any fetch.
    let mut blob = blob_ref(b"x");
    blob.sha256 = "../../etc/passwd".into();
    let report = store
        .apply(&full(2, vec![doc("ok", "{}", Some(blob))]), &blobs)
        .await;
    assert_eq!(report.missing.len(), 1);
    assert_eq!(blobs.fetches(), 0);
    assert_eq!(files(store.dir()), ["ok.meta"]);
}

#[tokio::test]
async fn cached_blobs_are_not_fetched_again() {
    let state = tempfile::tempdir().unwrap();
    let exe = script("echo cached");
    let blobs = FakeBlobs::with(&[&exe]);
    let update = full(
        1,
        vec![
            doc("one", "{}", Some(blob_ref(&exe))),
            doc("two", r#"{"description":"same exe"}"#, Some(blob_ref(&exe))),
        ],
    );
    store(state.path()).apply(&update, &blobs).await;
    assert_eq!(blobs.fetches(), 1);
    // Across a restart: a new store over the same state directory.
    let again = store(state.path());
    again.apply(&update, &blobs).await;
    assert_eq!(blobs.fetches(), 1);
    assert_eq!(files(again.dir()), ["one", "one.meta", "two", "two.meta"]);
    assert_eq!(std::fs::read(again.dir().join("two")).unwrap(), exe);
}

/// The coordinator's registry scan and the agent's store apply one name rule: a file the
/// coordinator serves is one every agent accepts, and `x.meta.meta` is refused on both sides.
#[tokio::test]
async fn the_registry_and_the_store_agree_on_tool_names() {
    let blobs = FakeBlobs::default();
    let longest = "n".repeat(250);
    for (name, valid) in [
        ("plain", true),
        ("a-b.c_d", true),
        ("x.metadata", true),
        ("x.meta", false),
        ("..x", false),
        (".hidden", false),
        (longest.as_str(), true),
    ] {
        let tools = tempfile::tempdir().unwrap();
        std::fs::write(
            tools.path().join(format!("{name}.meta")),
            r#"{"description": "d", "cmd": "true"}"#,
        )
        .unwrap();
        let catalog = toolsrv_registry::Scanner::new(vec![tools.path().into()]).scan();
        let served = catalog.tools.contains_key(name);

        let state = tempfile::tempdir().unwrap();
        let report = store(state.path())
            .apply(&full(1, vec![doc(name, "{}", None)]), &blobs)
            .await;
        let accepted = report.refused.is_empty();
        assert_eq!(
            (served, accepted),
            (valid, valid),
            "{name:?}: served by the registry {served}, accepted by the agent {accepted}: {:?} {:?}",
            catalog.diagnostics,
            report.refused
        );
    }

    // The refusal says why on both sides.
    let tools = tempfile::tempdir().unwrap();
    std::fs::write(tools.path().join("x.meta.meta"), "{}").unwrap();
    let catalog = toolsrv_registry::Scanner::new(vec![tools.path().into()]).scan();
    assert!(
        catalog.diagnostics.iter().any(|d| d.code == toolsrv_meta::Code::BadName
            && d.message.contains("ends in `.meta`")),
        "{:?}",
        catalog.diagnostics
    );
    let state = tempfile::tempdir().unwrap();
    let report = store(state.path())
        .apply(&full(1, vec![doc("x.meta", "{}", None)]), &blobs)
        .await;
    assert!(
        report.refused[0].to_string().contains("ends in `.meta`"),
        "{}",
        report.refused[0]
    );
}

/// A name may take 250 bytes, its `.meta` then 255, a file name's most: the store writes it and
/// its executable all the same. Before, temp files carried the name, 27 bytes more: names from
/// 229 bytes up could not be written, and the tool vanished from every agent.
#[tokio::test]
async fn the_longest_names_are_written_with_their_executables() {
    let state = tempfile::tempdir().unwrap();
    let store = store(state.path());
    let exe = script("echo long");
    let blobs = FakeBlobs::with(&[&exe]);
    let name = "n".repeat(250);
    let report = store
        .apply(
            &full(
                1,
                vec![doc(&name, r#"{"description":"d"}"#, Some(blob_ref(&exe)))],
            ),
            &blobs,
        )
        .await;
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    assert!(report.missing.is_empty(), "{:?}", report.missing);
    assert_eq!(files(store.dir()), [name.clone(), format!("{name}.meta")]);
    assert_eq!(std::fs::read(store.dir().join(&name)).unwrap(), exe);
}

/// [`common::tamper`], and read-only again afterwards.
fn tamper(path: &std::path::Path, content: &[u8]) {
    common::tamper(path, content);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o555)).unwrap();
}

#[tokio::test]
async fn an_altered_blob_is_found_before_it_runs_dropped_and_fetched_again() {
    let state = tempfile::tempdir().unwrap();
    let first = store(state.path());
    let exe = script("echo original");
    let evil = script("echo tampered");
    assert_eq!(exe.len(), evil.len());
    let blobs = FakeBlobs::with(&[&exe]);
    let blob = blob_ref(&exe);
    let update = full(1, vec![doc("t", "{}", Some(blob.clone()))]);
    first.apply(&update, &blobs).await;
    assert_eq!(blobs.fetches(), 1);
    let cached = state.path().join("blobs").join(&blob.sha256);
    let placed = first.dir().join("t");

    // Intact: nothing fetched.
    first.check_executable("t", &blobs).await.unwrap();
    assert_eq!(blobs.fetches(), 1);

    // Altered through the cache (the executable is the same file): found before the call runs it.
    tamper(&cached, &evil);
    assert_eq!(std::fs::read(&placed).unwrap(), evil);
    first.check_executable("t", &blobs).await.unwrap();
    assert_eq!(blobs.fetches(), 2, "dropped and fetched again");
    assert_eq!(std::fs::read(&placed).unwrap(), exe);
    assert_eq!(std::fs::read(&cached).unwrap(), exe);
    assert_eq!(mode(&cached), 0o555);

    // Altered through the catalog, and the blob cannot be fetched: an error, so nothing runs it.
    tamper(&placed, &evil);
    blobs.remove(&blob.sha256);
    let err = first.check_executable("t", &blobs).await.unwrap_err();
    assert!(err.to_string().contains("altered"), "{err}");
    blobs.serve_as(&blob.sha256, &exe);

    // A catalog update that brings the tool again checks the cached blob too.
    first.apply(&update, &blobs).await;
    assert_eq!(std::fs::read(&placed).unwrap(), exe);
    let fetched = blobs.fetches();

    // Altered while the agent is stopped: at start-up the blob is dropped and its tool removed
    // until the coordinator ships it again, which fetches it.
    tamper(&cached, &evil);
    let restarted = store(state.path());
    assert_eq!(files(restarted.dir()), Vec::<String>::new());
    assert!(!cached.exists());
    restarted.apply(&update, &blobs).await;
    assert_eq!(blobs.fetches(), fetched + 1);
    assert_eq!(std::fs::read(&placed).unwrap(), exe);
    restarted.check_executable("t", &blobs).await.unwrap();

    // An intact cache survives a restart without fetches, and the executable is still checked.
    let again = store(state.path());
    assert_eq!(files(again.dir()), ["t", "t.meta"]);
    assert_eq!(again.placed("t"), Some(blob.clone()));
    tamper(&placed, &evil);
    again.check_executable("t", &blobs).await.unwrap();
    assert_eq!(std::fs::read(&placed).unwrap(), exe);
    assert_eq!(blobs.fetches(), fetched + 2);
}

/// Calls recognize a shipped executable by its path, which the scanner makes absolute: so does
/// the store, whatever `--state-dir` was given.
#[test]
fn the_catalog_directory_is_absolute() {
    let store = CatalogStore::new("relative/catalog", BlobCache::new("relative/blobs"));
    assert!(store.dir().is_absolute());
    assert!(store.dir().ends_with("relative/catalog"));
}

/// A small tmpfs mounted over a new directory, unmounted when dropped. (Needs root.)
struct SmallDisk {
    dir: std::path::PathBuf,
    _root: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(bytes: usize) -> SmallDisk {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts a file system: run it as root"
        );
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("disk");
        std::fs::create_dir(&dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "agent-state"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk { dir, _root: root }
    }

    /// Fills the disk but for about `left` bytes, with the file `filler`.
    fn fill(&self, left: u64) {
        let filler = self.dir.join("filler");
        let _ = std::fs::remove_file(&filler);
        let free = nix::sys::statvfs::statvfs(&self.dir).unwrap();
        let free = free.blocks_available() as u64 * free.fragment_size() as u64;
        let size = free.saturating_sub(left);
        std::fs::write(&filler, vec![0u8; size as usize]).unwrap();
    }

    fn free(&self) {
        std::fs::remove_file(self.dir.join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
    }
}

/// A full disk cuts a fetched executable short: it is neither cached under its digest nor
/// placed (it was once, truncated, and ran as far as it went), and it is fetched whole once
/// there is room.
#[tokio::test]
async fn an_executable_cut_short_by_a_full_disk_is_never_cached_or_placed() {
    let disk = SmallDisk::mount(1 << 20);
    let store = store(&disk.dir);
    // 72 KB of script whose end says it ran whole.
    let exe = script(&format!("# {}\necho END", "x".repeat(72 * 1024)));
    // In one chunk, so that the write the disk cuts short is the last one.
    let blobs = FakeBlobs::with(&[&exe]).in_chunks_of(1 << 20);
    let blob = blob_ref(&exe);
    disk.fill(16 * 1024);
    let report = store
        .apply(&full(1, vec![doc("t", "{}", Some(blob.clone()))]), &blobs)
        .await;
    let cached = disk.dir.join("blobs").join(&blob.sha256);
    assert!(!cached.exists(), "a cut blob was cached under its digest");
    assert!(
        !store.dir().join("t").exists(),
        "a cut executable was placed"
    );
    assert_eq!(
        report.missing.keys().collect::<Vec<_>>(),
        ["t"],
        "{report:?}"
    );
    disk.free();
    store
        .place_executable("t", &blob, &blobs)
        .await
        .expect("placed once there is room");
    assert_eq!(std::fs::read(store.dir().join("t")).unwrap(), exe);
}

/// A new version of a tool that cannot be written (a full disk) does not leave the old one
/// served under the catalog's new revision: the tool is removed, and written on a later
/// recheck once there is room.
#[tokio::test]
async fn a_tool_whose_new_version_cannot_be_written_is_not_served_stale() {
    let disk = SmallDisk::mount(1 << 20);
    let store = store(&disk.dir);
    let host = toolsrv_meta::Host::with_env(Default::default());
    let mut keeper = toolsrv_agent::CatalogKeeper::new(store.clone(), &[], host);
    let blobs = FakeBlobs::default();
    let old = r#"{"description":"old","cmd":"echo old"}"#;
    keeper
        .apply(&full(1, vec![doc("hello", old, None)]), &blobs)
        .await
        .expect("a view");
    assert!(keeper.catalog().tools.contains_key("hello"));
    // The new version is larger than what is left.
    let new = format!(
        r#"{{"description":"new {}","cmd":"echo new"}}"#,
        "y".repeat(64 * 1024)
    );
    disk.fill(8 * 1024);
    let update = CatalogUpdate {
        revision: 2,
        full: false,
        upserts: vec![doc("hello", &new, None)],
        removals: vec![],
        more: false,
    };
    let view = keeper.apply(&update, &blobs).await.expect("a view");
    assert_eq!(view.catalog_revision, 2);
    let hello = view.tools.iter().find(|t| t.name == "hello").unwrap();
    assert!(
        !hello.visible && hello.definition.is_none(),
        "the old version is reported under revision 2: {view:?}"
    );
    assert!(
        hello.reason.contains("could not store this version")
            && hello.reason.contains("No space left on device"),
        "{}",
        hello.reason
    );
    assert!(!store.dir().join("hello.meta").exists());
    // Still full: tried again, still not served.
    assert!(keeper.recheck(&blobs).await.is_none());
    assert!(!keeper.catalog().tools.contains_key("hello"));
    disk.free();
    let view = keeper.recheck(&blobs).await.unwrap_or_else(|| {
        panic!(
            "the view did not change once there was room: files {:?}, tools {:?}, invalid {:?}",
            files(store.dir()),
            keeper.catalog().tools.keys().collect::<Vec<_>>(),
            keeper.catalog().invalid
        )
    });
    assert!(
        view.tools.iter().any(|t| t.name == "hello" && t.visible),
        "{view:?}"
    );
    assert_eq!(
        std::fs::read(store.dir().join("hello.meta")).unwrap(),
        new.as_bytes()
    );
}

/// A reconnect ships the whole catalog again: on a full disk, what is already on disk is kept
/// as it is, not written again (which would fail and take every tool off).
#[tokio::test]
async fn an_unchanged_catalog_sent_again_on_a_full_disk_keeps_every_tool() {
    let disk = SmallDisk::mount(1 << 20);
    let store = store(&disk.dir);
    let exe = script("echo a");
    let blobs = FakeBlobs::with(&[&exe]);
    let docs = || {
        vec![
            doc("a", r#"{"description":"a"}"#, Some(blob_ref(&exe))),
            doc("b", r#"{"description":"b","cmd":"echo b"}"#, None),
        ]
    };
    let report = store.apply(&full(1, docs()), &blobs).await;
    assert!(report.refused.is_empty(), "{report:?}");
    disk.fill(0);
    let report = store.apply(&full(2, docs()), &blobs).await;
    assert!(report.refused.is_empty(), "{report:?}");
    assert!(report.unwritten.is_empty(), "{report:?}");
    assert_eq!(files(store.dir()), ["a", "a.meta", "b.meta"]);
}
