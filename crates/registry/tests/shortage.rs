//! A scan on a machine out of file descriptors keeps serving what it served. Alone in its test
//! binary: it lowers the process's descriptor limit, which every thread shares.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::fs::File;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use toolsrv_meta::Code;
use toolsrv_registry::{
    Catalog, ReadError, SHORTAGE_RETRY, Scanner, hash_file_bounded, is_shortage, read_meta,
};
use toolsrv_testkit::{write, write_executable};

/// Held by each test: the limit is the process's, so one test at a time lowers it.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Takes every file descriptor the process may still open (under a soft limit lowered to a few
/// above what is open now), runs `f`, then gives them back and restores the limit.
fn without_descriptors<T>(f: impl FnOnce() -> T) -> T {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    setrlimit(Resource::RLIMIT_NOFILE, open + 16, hard).unwrap();
    let mut held = Vec::new();
    let exhausted = loop {
        match File::open("/dev/null") {
            Ok(file) if held.len() < 100_000 => held.push(file),
            Ok(_) => break None,
            Err(e) => break Some(e),
        }
    };
    let result = f();
    drop(held);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    let exhausted = exhausted.expect("the lowered limit was reached");
    assert_eq!(exhausted.raw_os_error(), Some(libc::EMFILE), "{exhausted}");
    result
}

fn tool(desc: &str) -> String {
    format!(r#"{{"description": "{desc}", "cmd": "echo {desc}"}}"#)
}

/// Writes `dir/name` dated a minute back: a finished write.
fn write_settled(dir: &Path, name: &str, content: &str) {
    write(dir, name, content);
    File::options()
        .write(true)
        .open(dir.join(name))
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(60))
        .unwrap();
}

fn names(catalog: &Catalog) -> Vec<&str> {
    catalog.tools.keys().map(String::as_str).collect()
}

fn shortage_warnings(catalog: &Catalog) -> Vec<String> {
    catalog
        .diagnostics
        .iter()
        .filter(|d| d.code == Code::Io && d.message.contains("short of file descriptors"))
        .map(|d| d.message.clone())
        .collect()
}

#[test]
fn a_scan_without_descriptors_keeps_the_last_complete_catalog_and_asks_to_run_again() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tools = tempfile::tempdir().unwrap();
    let dir = tools.path();
    write_settled(dir, "alpha.meta", &tool("alpha"));
    write_settled(dir, "beta.meta", &tool("beta"));
    write_settled(dir, "shipped.meta", &tool("shipped"));
    write_executable(dir, "shipped", "#!/bin/sh\necho shipped\n");
    let mut scanner = Scanner::new(vec![dir.to_path_buf()]);
    let before = scanner.scan();
    assert_eq!(names(&before), ["alpha", "beta", "shipped"]);
    assert!(before.tools["shipped"].executable.is_some());

    // A new tool arrives while the machine is out of descriptors: neither it nor the old ones
    // can be read. A scanner that never saw the path has nothing to keep.
    write_settled(dir, "gamma.meta", &tool("gamma"));
    let mut fresh = Scanner::new(vec![dir.to_path_buf()]);
    let asked_at = SystemTime::now();
    let (short, recheck, fresh_short) = without_descriptors(|| {
        let short = scanner.scan();
        (short, scanner.recheck_at(), fresh.scan())
    });
    assert_eq!(names(&short), ["alpha", "beta", "shipped"], "{short:?}");
    assert!(short.tools["shipped"].executable.is_some());
    assert!(short.invalid.is_empty(), "{:?}", short.invalid);
    let warnings = shortage_warnings(&short);
    assert_eq!(warnings.len(), 1, "{:?}", short.diagnostics);
    assert!(
        warnings[0].contains("Too many open files"),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[0].contains(&dir.display().to_string()),
        "{}",
        warnings[0]
    );
    let recheck = recheck.expect("a scan cut short asks to be run again");
    assert!(recheck >= asked_at + SHORTAGE_RETRY, "{recheck:?}");
    assert!(recheck <= SystemTime::now() + SHORTAGE_RETRY, "{recheck:?}");
    assert!(names(&fresh_short).is_empty());
    assert_eq!(shortage_warnings(&fresh_short).len(), 1);

    // Descriptors back: the next scan reads everything, and says nothing of the shortage.
    let after = scanner.scan();
    assert_eq!(names(&after), ["alpha", "beta", "gamma", "shipped"]);
    assert!(after.tools["shipped"].executable.is_some());
    assert!(
        shortage_warnings(&after).is_empty(),
        "{:?}",
        after.diagnostics
    );
    assert_eq!(scanner.recheck_at(), None);
}

#[test]
fn reading_a_file_without_descriptors_says_so_rather_than_rejecting_it() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tools = tempfile::tempdir().unwrap();
    write_settled(tools.path(), "alpha.meta", &tool("alpha"));
    let meta = tools.path().join("alpha.meta");
    let (read, hashed) =
        without_descriptors(|| (read_meta(&meta), hash_file_bounded(&meta, 1 << 20)));
    match read {
        Err(ReadError::Short(e)) => assert!(is_shortage(&e), "{e}"),
        other => panic!("expected a shortage, got {other:?}"),
    }
    assert!(hashed.as_ref().is_err_and(is_shortage), "{hashed:?}");
    assert!(read_meta(&meta).is_ok());
}
