//! Pythons with the packages a foreign-client test needs: a virtualenv under `target/`, made
//! on first use, or one named by an environment variable.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::bin::workspace_root;
use crate::error::must;
use crate::files::text;
use crate::wait::try_run_bounded;

/// Which Python a test needs.
#[derive(Debug, Clone, Copy)]
pub struct Venv<'a> {
    /// A variable that, when set, names a ready Python to use instead.
    pub env_override: &'a str,
    /// The virtualenv's directory under `target/`.
    pub dir: &'a str,
    /// What `pip install` gets.
    pub packages: &'a [&'a str],
    /// Python code that runs without error once the packages are there.
    pub check: &'a str,
}

impl Venv<'_> {
    /// The Python, making the virtualenv and installing the packages when they are not there
    /// yet. Not safe to call twice at once for one directory (two pip installs into one new
    /// virtualenv break each other): keep the result in a `OnceLock`.
    #[track_caller]
    pub fn python(&self) -> PathBuf {
        if let Some(p) = std::env::var_os(self.env_override) {
            return PathBuf::from(p);
        }
        let venv = workspace_root().join("target").join(self.dir);
        let python = venv.join("bin/python");
        let ready = |py: &Path| {
            Command::new(py)
                .args(["-c", self.check])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if python.exists() && ready(&python) {
            return python;
        }
        let mut make = Command::new("python3");
        make.args(["-m", "venv"]).arg(&venv);
        let out = must(try_run_bounded(&mut make, None, Duration::from_secs(120)));
        assert!(
            out.status.success(),
            "python3 -m venv failed: {}",
            text(&out.stderr)
        );
        let mut pip = Command::new(&python);
        pip.args(["-m", "pip", "install", "--quiet"])
            .args(self.packages);
        let out = must(try_run_bounded(&mut pip, None, Duration::from_secs(540)));
        assert!(
            out.status.success(),
            "pip install {:?} failed: {}",
            self.packages,
            text(&out.stderr)
        );
        assert!(
            ready(&python),
            "{:?} are not importable after installing them",
            self.packages
        );
        python
    }
}
