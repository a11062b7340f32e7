//! Runs every measured function once on tiny inputs, so CI notices when a bench breaks.
//!
//! The benches themselves are plain `main`s (`harness = false`) that `cargo test` never runs;
//! `BENCH_QUICK=1 cargo bench -p toolsrv-bench` runs them whole in a few seconds.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use toolsrv_bench::call::{
    CallFixture, SpawnSetup, confined_call, confiner, direct_spawn, jail_only, pairs,
    prepare_batch, timed_load,
};
use toolsrv_bench::scan::{ScanFixture, cold_scan, rescan_after, timed_scan};
use toolsrv_bench::stats::{Summary, nanos};
use toolsrv_bench::variants::{Case, case_meta, resolve_batch};
use toolsrv_meta::Host;

#[test]
fn registry_scan_runs() {
    let mut fixture = ScanFixture::new(20).unwrap();
    cold_scan(&fixture).unwrap();
    let mut scanner = fixture.scanner();
    timed_scan(&mut scanner, 20).unwrap();
    rescan_after(&mut fixture, &mut scanner, |_| Ok(())).unwrap();
    rescan_after(&mut fixture, &mut scanner, |f| f.touch(3, 0)).unwrap();
    rescan_after(&mut fixture, &mut scanner, |f| f.edit(3, 0)).unwrap();
}

#[test]
fn variant_eval_runs() {
    let host = Host::current();
    let existing = tempfile::NamedTempFile::new().unwrap();
    for case in Case::ALL {
        // case_meta checks the case resolves as intended on this host.
        let meta = case_meta(case, &host, existing.path()).unwrap();
        resolve_batch(&meta, &host, 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_overhead_runs() {
    let fixture = CallFixture::new().unwrap();
    let measured = pairs(&fixture, 2).await.unwrap();
    let overhead: Vec<f64> = measured.iter().map(|p| p.overhead_ns()).collect();
    assert!(Summary::of_nanos(&overhead).is_some());
    for p in &measured {
        let t = p.toolsrv;
        assert!(t.prepared <= t.started && t.started <= t.output && t.output <= t.finished);
    }
    direct_spawn(&fixture, SpawnSetup::LIKE_EXEC).await.unwrap();
    prepare_batch(&fixture, 2).unwrap();
    assert_eq!(nanos(&[timed_load(&fixture)]).len(), 1);
    let root = tempfile::tempdir().unwrap();
    let confiner = confiner(&root.path().join("calls"), vec![root.path().join("state")]).unwrap();
    confined_call(&fixture, &confiner).await.unwrap();
    jail_only(&fixture, &confiner).unwrap();
}
