//! The sentence encoder the discovery tests need, laid out by `scripts/fetch-find-model`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::bin::workspace_root;
use crate::error::must;
use crate::files::text;
use crate::wait::try_run_bounded;

/// The model directory: `TOOLSRV_FIND_MODEL`, else the script's default
/// (`~/.cache/toolsrv/all-MiniLM-L6-v2`), fetched there by `scripts/fetch-find-model` when a file
/// is missing (the script does nothing when all are there). A test that needs the model gets it
/// or fails; it never skips.
#[track_caller]
pub fn find_model_dir() -> PathBuf {
    model_dir("all-MiniLM-L6-v2", "TOOLSRV_FIND_MODEL")
}

/// The larger encoder, all-mpnet-base-v2: `TOOLSRV_FIND_MODEL_MPNET`, else
/// `~/.cache/toolsrv/all-mpnet-base-v2`, fetched as [`find_model_dir`] fetches its model.
#[track_caller]
pub fn mpnet_model_dir() -> PathBuf {
    model_dir("all-mpnet-base-v2", "TOOLSRV_FIND_MODEL_MPNET")
}

#[track_caller]
fn model_dir(name: &str, var: &str) -> PathBuf {
    let dir = match std::env::var_os(var) {
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cache/toolsrv").join(name),
            None => panic!("neither {var} nor HOME is set: where is the model?"),
        },
    };
    let script = workspace_root().join("scripts/fetch-find-model");
    let mut fetch = Command::new("bash");
    fetch.arg(&script).arg("--model").arg(name).arg(&dir);
    let out = must(try_run_bounded(&mut fetch, None, Duration::from_secs(600)));
    assert!(
        out.status.success(),
        "{} --model {name} {} failed: {}: the tests of ranking by meaning need the model",
        script.display(),
        dir.display(),
        text(&out.stderr)
    );
    dir
}
