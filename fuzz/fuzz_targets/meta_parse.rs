//! `.meta` parsing, variant resolution against a fixed fake host, argument validation of `{}`
//! and command resolution must never panic, whatever the bytes.
#![no_main]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use toolsrv_meta::{FileProbe, Host, Resolution};

/// A fixed, in-memory file system: no real file system is touched.
struct FakeFs;

const EXECUTABLES: &[&str] = &[
    "/bin/sh",
    "/usr/bin/jq",
    "/usr/bin/df",
    "/usr/local/bin/nvidia-smi",
    "/tools/helper",
];

impl FileProbe for FakeFs {
    fn exists(&self, path: &Path) -> bool {
        let p = path.to_string_lossy();
        EXECUTABLES.contains(&p.as_ref())
            || ["/etc/", "/proc/", "/tools/"]
                .iter()
                .any(|d| p.starts_with(d))
    }

    fn is_executable(&self, path: &Path) -> bool {
        EXECUTABLES.contains(&path.to_string_lossy().as_ref())
    }
}

fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| {
        let env: BTreeMap<String, String> = [
            ("PATH", "/usr/local/bin::/usr/bin:/bin"),
            ("HOME", "/home/fuzz"),
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("EMPTY", ""),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        Host {
            os: "linux".into(),
            arch: "amd64".into(),
            env,
            raw_path: None,
            fs: Arc::new(FakeFs),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let parsed = toolsrv_meta::parse("t", Path::new("/tools/t.meta"), data);
    for d in &parsed.diagnostics {
        let _ = d.to_string();
    }
    let Some(meta) = parsed.meta else { return };
    let host = host();
    match meta.resolve(host) {
        Resolution::Visible { tool, .. } => {
            let _ = tool.validator.validate(&serde_json::json!({}));
            let _ = toolsrv_meta::resolve_command(meta.dir(), &meta.name, tool.cmd.as_deref(), host);
            let _ = tool.ranking_text();
        }
        Resolution::Hidden { reason } => {
            let _ = reason;
        }
    }
});
