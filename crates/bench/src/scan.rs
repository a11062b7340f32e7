//! The registry scan benchmark: cold scans, unchanged rescans and rescans after a few edits.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use tempfile::TempDir;
use toolsrv_registry::Scanner;

use crate::BenchError;
use crate::fixtures::{meta_doc, meta_file_name, write_tools};

/// A temporary tools directory of generated `.meta` files.
#[derive(Debug)]
pub struct ScanFixture {
    dir: TempDir,
    tools: usize,
    /// Bumped by every [`ScanFixture::edit`] so each edit really changes the bytes.
    revision: usize,
}

impl ScanFixture {
    pub fn new(tools: usize) -> Result<Self, BenchError> {
        let dir = tempfile::tempdir()?;
        write_tools(dir.path(), tools)?;
        Ok(Self {
            dir,
            tools,
            revision: 0,
        })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn tools(&self) -> usize {
        self.tools
    }

    pub fn scanner(&self) -> Scanner {
        Scanner::new(vec![self.dir.path().to_path_buf()])
    }

    /// The files `count` edits starting at `round` land on, spread over the directory.
    fn targets(&self, count: usize, round: usize) -> Vec<(usize, PathBuf)> {
        let step = (self.tools / count.max(1)).max(1);
        (0..count.min(self.tools))
            .map(|k| (k * step + round) % self.tools)
            .map(|i| (i, self.path().join(meta_file_name(i))))
            .collect()
    }

    /// Sets the modification time of `count` files without changing their bytes.
    pub fn touch(&self, count: usize, round: usize) -> Result<(), BenchError> {
        let now = SystemTime::now();
        for (_, path) in self.targets(count, round) {
            std::fs::File::options()
                .write(true)
                .open(path)?
                .set_modified(now)?;
        }
        Ok(())
    }

    /// Rewrites `count` files with different content (a new description).
    pub fn edit(&mut self, count: usize, round: usize) -> Result<(), BenchError> {
        self.revision += 1;
        for (i, path) in self.targets(count, round) {
            std::fs::write(path, meta_doc(i, self.revision))?;
        }
        Ok(())
    }
}

/// Times one scan, checking that it found every tool and nothing was rejected.
pub fn timed_scan(scanner: &mut Scanner, expect_tools: usize) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let catalog = scanner.scan();
    let took = started.elapsed();
    if catalog.tools.len() != expect_tools || catalog.has_errors() {
        return Err(format!(
            "scan found {} tools ({} diagnostics), expected {expect_tools}",
            catalog.tools.len(),
            catalog.diagnostics.len()
        )
        .into());
    }
    Ok(took)
}

/// A scan with an empty cache: every file is read, hashed and parsed (schemas compiled).
pub fn cold_scan(fixture: &ScanFixture) -> Result<Duration, BenchError> {
    timed_scan(&mut fixture.scanner(), fixture.tools())
}

/// A rescan by a warmed `scanner`, after `prepare` changed the directory (outside the timing).
pub fn rescan_after(
    fixture: &mut ScanFixture,
    scanner: &mut Scanner,
    prepare: impl FnOnce(&mut ScanFixture) -> Result<(), BenchError>,
) -> Result<Duration, BenchError> {
    prepare(fixture)?;
    timed_scan(scanner, fixture.tools())
}
