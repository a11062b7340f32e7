//! Building the host view and re-reporting it only when the host changed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{FakeBlobs, blob_ref, doc, script};
use toolsrv_agent::{BlobCache, CatalogKeeper, CatalogStore};
use toolsrv_meta::Host;
use toolsrv_proto::v1::CatalogUpdate;

const VARIANT_TOOL: &str = r#"{
  "description": "fallback",
  "tier": "warm",
  "args": {"type": "object", "properties": {"n": {"type": "integer"}}},
  "variants": [
    {"match": {"binary": "fancy-bin"}, "description": "uses fancy-bin", "cmd": "fancy-bin"}
  ]
}"#;

struct Setup {
    state: tempfile::TempDir,
    bin: tempfile::TempDir,
    host_tools: tempfile::TempDir,
    keeper: CatalogKeeper,
}

fn setup() -> Setup {
    let state = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    let host_tools = tempfile::tempdir().unwrap();
    let store = CatalogStore::new(
        state.path().join("catalog"),
        BlobCache::new(state.path().join("blobs")),
    );
    store.open().unwrap();
    let host = Host::with_env([("PATH".to_string(), bin.path().display().to_string())].into());
    let keeper = CatalogKeeper::new(store, &[host_tools.path().to_path_buf()], host);
    Setup {
        state,
        bin,
        host_tools,
        keeper,
    }
}

#[tokio::test]
async fn a_variant_appears_when_its_binary_is_installed() {
    let mut s = setup();
    let blobs = FakeBlobs::default();
    assert!(
        s.keeper.recheck(&blobs).await.is_none(),
        "no view before the first catalog update"
    );
    let update = CatalogUpdate {
        revision: 7,
        full: true,
        upserts: vec![doc("fancy", VARIANT_TOOL, None), doc("plain", "{}", None)],
        removals: vec![],
        more: false,
    };
    let view = s
        .keeper
        .apply(&update, &blobs)
        .await
        .expect("a final part reports the view");
    assert_eq!(view.catalog_revision, 7);
    let names: Vec<_> = view.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["fancy", "plain"]);
    let fancy = &view.tools[0];
    assert!(!fancy.visible);
    assert!(fancy.reason.contains("fancy-bin"), "{}", fancy.reason);
    assert_eq!(fancy.definition, None);
    assert_eq!(fancy.variant, None);
    assert!(view.tools[1].visible);

    assert!(s.keeper.recheck(&blobs).await.is_none(), "nothing changed");

    let exe = s.bin.path().join("fancy-bin");
    std::fs::write(&exe, "#!/bin/sh\n").unwrap();
    assert!(
        s.keeper.recheck(&blobs).await.is_none(),
        "not executable yet: still hidden, still the same view"
    );
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let view = s.keeper.recheck(&blobs).await.expect("the view changed");
    assert_eq!(view.catalog_revision, 7);
    let fancy = &view.tools[0];
    assert!(fancy.visible);
    assert_eq!(fancy.variant, Some(0));
    assert_eq!(fancy.reason, "");
    let def = fancy.definition.as_ref().unwrap();
    assert_eq!(def.name, "fancy");
    assert_eq!(def.description, "uses fancy-bin");
    assert_eq!(def.tier, "warm");
    let schema: serde_json::Value = serde_json::from_str(&def.args_schema_json).unwrap();
    assert_eq!(schema["properties"]["n"]["type"], "integer");

    assert!(s.keeper.recheck(&blobs).await.is_none(), "reported once");

    std::fs::remove_file(&exe).unwrap();
    let view = s.keeper.recheck(&blobs).await.expect("hidden again");
    assert!(!view.tools[0].visible);
}

#[tokio::test]
async fn host_only_tools_are_served_and_shipped_ones_win() {
    let mut s = setup();
    let blobs = FakeBlobs::default();
    std::fs::write(
        s.host_tools.path().join("local.meta"),
        r#"{"description":"host only"}"#,
    )
    .unwrap();
    std::fs::write(
        s.host_tools.path().join("both.meta"),
        r#"{"description":"host copy"}"#,
    )
    .unwrap();
    let update = CatalogUpdate {
        revision: 1,
        full: true,
        upserts: vec![doc("both", r#"{"description":"shipped copy"}"#, None)],
        removals: vec![],
        more: false,
    };
    let view = s
        .keeper
        .apply(&update, &blobs)
        .await
        .expect("a final part reports the view");
    let described: Vec<_> = view
        .tools
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.definition.as_ref().unwrap().description.as_str(),
            )
        })
        .collect();
    assert_eq!(
        described,
        [("both", "shipped copy"), ("local", "host only")]
    );

    // A new host-only tool is noticed at the next recheck.
    std::fs::write(s.host_tools.path().join("later.meta"), "{}").unwrap();
    let view = s.keeper.recheck(&blobs).await.expect("a tool appeared");
    assert_eq!(view.tools.len(), 3);
    assert!(s.keeper.catalog().tools.contains_key("later"));
}

#[tokio::test]
async fn a_missing_executable_is_fetched_at_the_next_recheck() {
    let mut s = setup();
    let blobs = FakeBlobs::default();
    let exe = script("echo hi");
    let update = CatalogUpdate {
        revision: 1,
        full: true,
        upserts: vec![doc("t", "{}", Some(blob_ref(&exe)))],
        removals: vec![],
        more: false,
    };
    s.keeper.apply(&update, &blobs).await;
    assert_eq!(s.keeper.missing().len(), 1);
    assert!(s.keeper.catalog().tools["t"].executable.is_none());
    blobs.add(&exe);
    s.keeper.recheck(&blobs).await;
    assert!(s.keeper.missing().is_empty());
    let tool = &s.keeper.catalog().tools["t"];
    assert_eq!(
        tool.executable.as_ref().unwrap().sha256,
        blob_ref(&exe).sha256
    );
}

#[tokio::test]
async fn a_catalog_in_parts_is_reported_once_whole() {
    let mut s = setup();
    let blobs = FakeBlobs::default();
    let first = CatalogUpdate {
        revision: 1,
        full: true,
        upserts: vec![doc("old", "{}", None), doc("kept", "{}", None)],
        removals: vec![],
        more: false,
    };
    s.keeper.apply(&first, &blobs).await.unwrap();

    // A reconnect: the full catalog of revision 2 comes in two parts, without `old`.
    let part = |upserts, full, more| CatalogUpdate {
        revision: 2,
        full,
        upserts,
        removals: vec![],
        more,
    };
    let head = part(vec![doc("a", "{}", None)], true, true);
    assert!(
        s.keeper.apply(&head, &blobs).await.is_none(),
        "no view from half a catalog"
    );
    assert!(
        s.keeper.recheck(&blobs).await.is_none(),
        "no recheck in the middle of a revision"
    );
    let catalog_dir = s.state.path().join("catalog");
    assert!(
        catalog_dir.join("kept.meta").exists(),
        "a later part's tool is not swept by the first part"
    );
    let tail = part(vec![doc("kept", "{}", None)], false, false);
    let view = s
        .keeper
        .apply(&tail, &blobs)
        .await
        .expect("the last part reports");
    assert_eq!(view.catalog_revision, 2);
    let names: Vec<_> = view.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "kept"]);
    assert!(!catalog_dir.join("old.meta").exists(), "swept once whole");
}
