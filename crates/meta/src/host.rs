//! Host facts that variants are evaluated against, and the file-system probe behind them.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How the evaluator asks the file system about paths; tests inject a fake one.
pub trait FileProbe: Send + Sync {
    /// The path exists (file or directory, following symlinks).
    fn exists(&self, path: &Path) -> bool;
    /// The path is a regular file with an execute bit set.
    fn is_executable(&self, path: &Path) -> bool;
}

/// The real file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl FileProbe for RealFs {
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn is_executable(&self, path: &Path) -> bool {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    }
}

/// The directories of a colon-separated list (`PATH`, a tools path), in order; empty entries are
/// skipped, and names need not be UTF-8.
pub fn path_list(list: &std::ffi::OsStr) -> impl Iterator<Item = &Path> {
    use std::os::unix::ffi::OsStrExt;
    list.as_bytes()
        .split(|&b| b == b':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(std::ffi::OsStr::from_bytes(d)))
}

/// Everything a variant can ask about a host.
#[derive(Clone)]
pub struct Host {
    /// Operating system in Go's `runtime.GOOS` vocabulary (`linux`, `darwin`, ...).
    pub os: String,
    /// Architecture in Go's `runtime.GOARCH` vocabulary (`amd64`, `arm64`, ...).
    pub arch: String,
    /// The environment that `env`, `nenv` and the `PATH` lookup of `binary` see.
    pub env: BTreeMap<String, String>,
    /// `PATH` as the system gave it when it is not UTF-8 (`env` holds it with U+FFFD for each
    /// bad byte, a directory that does not exist): where `binary` looks then.
    pub raw_path: Option<OsString>,
    pub fs: Arc<dyn FileProbe>,
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Host")
            .field("os", &self.os)
            .field("arch", &self.arch)
            .field("env", &self.env.len())
            .finish()
    }
}

impl Host {
    /// This machine: its OS, architecture, environment and real file system.
    pub fn current() -> Self {
        Self::with_env_os(std::env::vars_os())
    }

    /// This machine's OS, architecture and file system with the given environment as the
    /// system gives it: a variable whose name or value is not UTF-8 is taken with each bad byte
    /// as U+FFFD (`env` still sees it set; `std::env::vars` would panic on it).
    pub fn with_env_os(env: impl IntoIterator<Item = (OsString, OsString)>) -> Self {
        let mut raw_path = None;
        let env = env
            .into_iter()
            .map(|(name, value)| {
                if name == "PATH" && value.to_str().is_none() {
                    raw_path = Some(value.clone());
                }
                (
                    name.to_string_lossy().into_owned(),
                    value.to_string_lossy().into_owned(),
                )
            })
            .collect();
        Self {
            raw_path,
            ..Self::with_env(env)
        }
    }

    /// This machine's OS, architecture and file system with the given environment.
    pub fn with_env(env: BTreeMap<String, String>) -> Self {
        Self {
            os: go_os(std::env::consts::OS).to_string(),
            arch: go_arch(std::env::consts::ARCH).to_string(),
            env,
            raw_path: None,
            fs: Arc::new(RealFs),
        }
    }

    /// Directories of `PATH`, in order; empty entries are skipped rather than meaning the cwd.
    pub fn path_dirs(&self) -> impl Iterator<Item = &Path> {
        let path: &std::ffi::OsStr = match &self.raw_path {
            Some(raw) => raw,
            None => self.env.get("PATH").map_or("".as_ref(), |p| p.as_ref()),
        };
        path_list(path)
    }

    /// Finds an executable: a bare name through `PATH`, an absolute path as is.
    pub fn find_executable(&self, name: &str) -> Option<PathBuf> {
        if name.starts_with('/') {
            let path = PathBuf::from(name);
            return self.fs.is_executable(&path).then_some(path);
        }
        if name.is_empty() || name.contains('/') {
            return None;
        }
        self.path_dirs()
            .map(|d| d.join(name))
            .find(|p| self.fs.is_executable(p))
    }

    /// The variable is set and non-empty.
    pub fn env_set(&self, name: &str) -> bool {
        self.env.get(name).is_some_and(|v| !v.is_empty())
    }
}

/// Maps Rust's `std::env::consts::OS` to Go's `runtime.GOOS`.
pub fn go_os(rust_os: &str) -> &str {
    match rust_os {
        "macos" => "darwin",
        other => other,
    }
}

/// Maps Rust's `std::env::consts::ARCH` to Go's `runtime.GOARCH`.
pub fn go_arch(rust_arch: &str) -> &str {
    match rust_arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        "powerpc64" => "ppc64",
        "loongarch64" => "loong64",
        "mips64" if cfg!(target_endian = "little") => "mips64le",
        "mips" if cfg!(target_endian = "little") => "mipsle",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_rust_names_to_go_vocabulary() {
        let cases = [
            ("linux", "linux"),
            ("macos", "darwin"),
            ("windows", "windows"),
            ("freebsd", "freebsd"),
        ];
        for (rust, go) in cases {
            assert_eq!(go_os(rust), go);
        }
        let cases = [
            ("x86_64", "amd64"),
            ("aarch64", "arm64"),
            ("x86", "386"),
            ("arm", "arm"),
            ("riscv64", "riscv64"),
            ("s390x", "s390x"),
        ];
        for (rust, go) in cases {
            assert_eq!(go_arch(rust), go);
        }
    }

    #[test]
    fn current_host_speaks_go() {
        let host = Host::current();
        assert!(!["macos", "x86_64", "aarch64"].contains(&host.os.as_str()));
        assert!(!["x86_64", "aarch64"].contains(&host.arch.as_str()));
    }

    #[test]
    fn path_lookup_honours_the_execute_bit() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("runme");
        let plain = dir.path().join("readme");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::write(&plain, "text").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(dir.path().join("adir")).unwrap();
        let host =
            Host::with_env([("PATH".to_string(), format!("::{}", dir.path().display()))].into());
        assert_eq!(host.find_executable("runme"), Some(exe.clone()));
        assert_eq!(host.find_executable("readme"), None);
        assert_eq!(host.find_executable("adir"), None);
        assert_eq!(host.find_executable(exe.to_str().unwrap()), Some(exe));
        assert_eq!(host.find_executable(plain.to_str().unwrap()), None);
        assert_eq!(host.find_executable("sub/runme"), None);
    }
}
