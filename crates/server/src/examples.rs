//! The example tools, embedded at build time from `examples/tools`, and writing them out.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

include!(concat!(env!("OUT_DIR"), "/examples.rs"));

/// Writes the example tools into `dir` unless it already holds `.meta` files (a user's edits win).
pub fn install(dir: &Path) -> std::io::Result<bool> {
    let has_tools = std::fs::read_dir(dir).is_ok_and(|mut entries| {
        entries.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "meta")))
    });
    if has_tools {
        return Ok(false);
    }
    std::fs::create_dir_all(dir)?;
    for (name, content, executable) in FILES {
        let path = dir.join(name);
        std::fs::write(&path, content)?;
        let mode = if *executable { 0o755 } else { 0o644 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_is_embedded_and_written() {
        let dir = tempfile::tempdir().unwrap();
        assert!(install(dir.path()).unwrap());
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tools");
        for entry in std::fs::read_dir(&source).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name() == "README.md" {
                continue;
            }
            let written = std::fs::read(dir.path().join(entry.file_name())).unwrap();
            assert_eq!(
                written,
                std::fs::read(entry.path()).unwrap(),
                "{:?}",
                entry.file_name()
            );
        }
        assert!(
            FILES
                .iter()
                .any(|(name, _, exe)| *name == "port_check" && *exe)
        );
        assert!(
            !install(dir.path()).unwrap(),
            "an existing tools directory is left alone"
        );
    }
}
