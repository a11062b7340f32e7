//! The variant evaluation benchmark: `Meta::resolve` for tools with and without variants.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use toolsrv_meta::{Host, Meta, Resolution, parse};

use crate::BenchError;
use crate::fixtures::meta_doc;

/// The shapes of tool measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// No variants: the top-level definition is cloned into the result.
    NoVariants,
    /// Three variants keyed on `os`/`arch`; only the last one matches this host.
    OsArch,
    /// Three `os`/`arch` variants, none of which matches: hidden, with a reason per variant.
    OsArchHidden,
    /// Three variants keyed on `binary`/`file` against the real file system and `PATH`;
    /// the first two miss (a full `PATH` walk, a missing file), the last one matches.
    BinaryFile,
}

impl Case {
    pub const ALL: [Case; 4] = [
        Case::NoVariants,
        Case::OsArch,
        Case::OsArchHidden,
        Case::BinaryFile,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Case::NoVariants => "0 variants",
            Case::OsArch => "3 variants, os/arch (3rd matches)",
            Case::OsArchHidden => "3 variants, os/arch (none matches)",
            Case::BinaryFile => "3 variants, binary/file (3rd matches)",
        }
    }

    /// Whether evaluation touches the file system (so batches are smaller).
    pub fn uses_fs(self) -> bool {
        self == Case::BinaryFile
    }

    fn variants(self, host: &Host, existing_file: &Path) -> Option<Value> {
        let (os, arch) = (host.os.as_str(), host.arch.as_str());
        let other_os = if os == "darwin" { "windows" } else { "darwin" };
        match self {
            Case::NoVariants => None,
            Case::OsArch => Some(json!([
                {"match": {"os": other_os}, "cmd": "v0"},
                {"match": {"os": os, "arch": "s390x"}, "cmd": "v1"},
                {"match": {"os": [other_os, os], "arch": ["wasm", arch]}, "cmd": "v2"},
            ])),
            Case::OsArchHidden => Some(json!([
                {"match": {"os": other_os}, "cmd": "v0"},
                {"match": {"os": os, "arch": "s390x"}, "cmd": "v1"},
                {"match": {"os": "plan9", "arch": arch}, "cmd": "v2"},
            ])),
            Case::BinaryFile => Some(json!([
                {"match": {"binary": "toolsrv-bench-no-such-binary"}, "cmd": "v0"},
                {"match": {"file": "/nonexistent/toolsrv-bench/config"}, "cmd": "v1"},
                {"match": {"binary": "sh", "file": existing_file.display().to_string()}, "cmd": "v2"},
            ])),
        }
    }

    /// Which variant must decide on this host (`None`: no variant, or hidden).
    fn expected(self) -> Expected {
        match self {
            Case::NoVariants => Expected::Visible(None),
            Case::OsArch | Case::BinaryFile => Expected::Visible(Some(2)),
            Case::OsArchHidden => Expected::Hidden,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expected {
    Visible(Option<usize>),
    Hidden,
}

/// A realistic tool (prompt, keywords, args schema) of the given shape, parsed.
///
/// `existing_file` must exist: the binary/file case matches on it.
pub fn case_meta(case: Case, host: &Host, existing_file: &Path) -> Result<Meta, BenchError> {
    let mut doc: Value = serde_json::from_str(&meta_doc(1, 0))?;
    if let (Some(obj), Some(variants)) = (doc.as_object_mut(), case.variants(host, existing_file)) {
        obj.insert("variants".into(), variants);
    }
    let name = "bench_tool";
    let path = Path::new("/tools/bench_tool.meta");
    let parsed = parse(name, path, doc.to_string().as_bytes());
    let meta = parsed
        .meta
        .ok_or_else(|| format!("{}: does not parse: {:?}", case.label(), parsed.diagnostics))?;
    let got = match meta.resolve(host) {
        Resolution::Visible { variant, .. } => Expected::Visible(variant),
        Resolution::Hidden { .. } => Expected::Hidden,
    };
    if got != case.expected() {
        return Err(format!(
            "{}: resolved to {got:?} on this host, expected {:?}",
            case.label(),
            case.expected()
        )
        .into());
    }
    Ok(meta)
}

/// Time of `batch` consecutive resolutions of `meta` against `host`.
pub fn resolve_batch(meta: &Meta, host: &Host, batch: usize) -> Duration {
    let started = Instant::now();
    for _ in 0..batch {
        black_box(black_box(meta).resolve(black_box(host)));
    }
    started.elapsed()
}
