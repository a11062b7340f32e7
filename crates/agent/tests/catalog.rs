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
    assert_eq!(mode(&dir.join("a")), 0o755);
    let cached = state.path().join("blobs").join(blob_ref(&exe_a).sha256);
    assert_eq!(std::fs::read(&cached).unwrap(), exe_a);
    assert_eq!(mode(&cached), 0o755);
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
    assert_eq!(mode(&dir.join("b")), 0o755);
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
