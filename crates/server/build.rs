//! Embeds `examples/tools` so that `toolsrv up` works from any directory with no checkout.

use std::fmt::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../examples/tools");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    let mut out = String::from(
        "/// Example tools: (file name, content, executable).\npub const FILES: &[(&str, &[u8], bool)] = &[\n",
    );
    for entry in entries {
        let meta = entry.metadata()?;
        let name = entry
            .file_name()
            .into_string()
            .map_err(|n| format!("non-UTF-8 file name {n:?}"))?;
        if !meta.is_file() || name == "README.md" {
            continue;
        }
        let path = std::fs::canonicalize(entry.path())?;
        println!("cargo:rerun-if-changed={}", path.display());
        let executable = meta.permissions().mode() & 0o111 != 0;
        writeln!(
            out,
            "    ({name:?}, include_bytes!({:?}), {executable}),",
            path.display().to_string()
        )?;
    }
    out.push_str("];\n");
    std::fs::write(
        PathBuf::from(std::env::var("OUT_DIR")?).join("examples.rs"),
        out,
    )?;
    Ok(())
}
