//! Realistic `.meta` documents and directories of them, generated deterministically.

use std::path::Path;

use serde_json::{Map, Value, json};

/// Words the generated prompts and descriptions are made of.
const WORDS: &[&str] = &[
    "file",
    "search",
    "repository",
    "index",
    "query",
    "result",
    "pattern",
    "line",
    "match",
    "directory",
    "build",
    "test",
    "log",
    "service",
    "status",
    "config",
    "output",
    "format",
    "record",
    "metric",
    "host",
    "process",
    "archive",
    "checksum",
];

const TIERS: [&str; 3] = ["hot", "warm", "cold"];

/// Property shapes an `args` schema is assembled from.
fn property(k: usize) -> (String, Value) {
    match k % 5 {
        0 => (
            "path".into(),
            json!({"type": "string", "description": "Path relative to the working directory"}),
        ),
        1 => (
            "pattern".into(),
            json!({"type": "string", "minLength": 1, "description": "Regular expression to look for"}),
        ),
        2 => (
            "limit".into(),
            json!({"type": "integer", "minimum": 1, "maximum": 10000, "default": 100}),
        ),
        3 => (
            "level".into(),
            json!({"enum": ["debug", "info", "warn", "error"], "default": "info"}),
        ),
        _ => (
            "filters".into(),
            json!({"type": "array", "items": {"type": "string"}, "maxItems": 16}),
        ),
    }
}

fn words(seed: usize, count: usize) -> String {
    (0..count)
        .map(|k| WORDS[(seed.wrapping_mul(7) + k * 13 + k * k) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `.meta` text of generated tool number `i`.
///
/// Every tool has a description, a prompt of a few hundred bytes, keywords and an `args` schema
/// with 3 to 5 properties; every fourth one also has two variants (by `os`) overriding `cmd`.
pub fn meta_doc(i: usize, revision: usize) -> String {
    let props = 3 + i % 3;
    let properties: Map<String, Value> = (0..props).map(|k| property(i + k)).collect();
    let required: Vec<&String> = properties.keys().take(1).collect();
    let mut doc = json!({
        "description": format!("Tool {i} (rev {revision}): {}", words(i, 8)),
        "prompt": format!(
            "Use this tool to {}. It reads {} and prints {}. Prefer it over shell commands \
             when the user asks about {}; the output is plain text, one result per line, \
             and an empty output means nothing matched.",
            words(i, 12), words(i + 1, 10), words(i + 2, 10), words(i + 3, 8)
        ),
        "keywords": (0..4).map(|k| WORDS[(i + k * 5) % WORDS.len()]).collect::<Vec<_>>(),
        "tier": TIERS[i % 3],
        "cmd": format!("tool-{i} --json"),
        "args": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": false,
        },
    });
    if i.is_multiple_of(4)
        && let Some(obj) = doc.as_object_mut()
    {
        obj.insert(
            "variants".into(),
            json!([
                {"match": {"os": "linux"}, "cmd": format!("tool-{i}-linux --json")},
                {"match": {"os": "darwin"}, "cmd": format!("tool-{i}-darwin --json")},
            ]),
        );
    }
    doc.to_string()
}

/// The file name of generated tool number `i`.
pub fn meta_file_name(i: usize) -> String {
    format!("tool_{i:05}.meta")
}

/// Writes `n` generated tools into `dir`.
pub fn write_tools(dir: &Path, n: usize) -> std::io::Result<()> {
    for i in 0..n {
        std::fs::write(dir.join(meta_file_name(i)), meta_doc(i, 0))?;
    }
    Ok(())
}
