//! The live registry: an initial scan, then rescans on file-system events and on a timer.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::scan::{Catalog, Scanner};

/// Logs the problems of a catalog just scanned (the first one of a registry; later ones are
/// logged by [`Registry::rescan`] as they appear): each invalid tool with its reason, then the
/// warnings.
pub fn log_problems(catalog: &Catalog) {
    for (name, invalid) in &catalog.invalid {
        // Names and reasons come from the tools path: escaped, so no byte forges a line.
        tracing::warn!(tool = ?name, reason = ?invalid.reason(), "tool not served: its definition is invalid");
    }
    for d in catalog
        .diagnostics
        .iter()
        .filter(|d| d.severity != toolsrv_meta::Severity::Error)
    {
        tracing::warn!(problem = ?d.to_string(), "tool definition problem");
    }
}

/// How the registry follows changes.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// Quiet time after the last file-system event before rescanning, so an editor's
    /// burst of writes gives one rescan.
    pub debounce: Duration,
    /// Rescan this often even without events (file systems where events are lost, such as
    /// some network mounts or a ConfigMap's symlink swap).
    pub rescan_every: Duration,
}

impl Default for WatchOptions {
    fn default() -> Self {
        Self {
            debounce: Duration::from_millis(150),
            rescan_every: Duration::from_secs(30),
        }
    }
}

/// A revisioned catalog that follows its tools path.
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

/// Who numbers the catalogs a registry publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numbering {
    /// Each change is published at once, at the next revision.
    Local,
    /// Each change is only proposed ([`Registry::scans`]); the owner publishes it with the
    /// revision agreed elsewhere ([`Registry::publish`]), as replicas that must all serve the
    /// same revision for the same tools do.
    Agreed,
}

#[derive(Debug)]
struct Inner {
    scanner: Mutex<Scanner>,
    numbering: Numbering,
    /// The catalogs served.
    tx: watch::Sender<Arc<Catalog>>,
    /// The latest scan, numbered locally: the same as `tx` with [`Numbering::Local`].
    scanned: watch::Sender<Arc<Catalog>>,
}

impl Registry {
    /// Scans `dirs` once; the first catalog has revision 1.
    pub fn open(dirs: Vec<PathBuf>) -> Self {
        Self::with_numbering(dirs, Numbering::Local)
    }

    /// Scans `dirs` once; the first catalog has revision 1, published at once whatever the
    /// numbering (with [`Numbering::Agreed`], publish the agreed revision before serving it).
    pub fn with_numbering(dirs: Vec<PathBuf>, numbering: Numbering) -> Self {
        let mut scanner = Scanner::new(dirs);
        let mut catalog = scanner.scan();
        catalog.revision = 1;
        let catalog = Arc::new(catalog);
        let (tx, _) = watch::channel(catalog.clone());
        let (scanned, _) = watch::channel(catalog);
        Self {
            inner: Arc::new(Inner {
                scanner: Mutex::new(scanner),
                numbering,
                tx,
                scanned,
            }),
        }
    }

    /// The current catalog.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.inner.tx.borrow().clone()
    }

    /// A receiver that sees every new catalog.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Catalog>> {
        self.inner.tx.subscribe()
    }

    /// A receiver that sees every scan that changed the tools (or only their problems),
    /// numbered locally; with [`Numbering::Agreed`] these wait for [`Registry::publish`].
    pub fn scans(&self) -> watch::Receiver<Arc<Catalog>> {
        self.inner.scanned.subscribe()
    }

    /// Publishes `catalog` (a scan) at `revision`. Refused (false) when that would take the
    /// revision backwards, or give the revision served now to other tools.
    pub fn publish(&self, catalog: &Catalog, revision: u64) -> bool {
        let mut published = false;
        self.inner.tx.send_if_modified(|now| {
            let same_tools = catalog.same_tools(now);
            if revision < now.revision || (revision == now.revision && !same_tools) {
                return false;
            }
            published = true;
            if revision == now.revision
                && catalog.diagnostics == now.diagnostics
                && catalog.invalid == now.invalid
            {
                return false;
            }
            let mut next = catalog.clone();
            next.revision = revision;
            *now = Arc::new(next);
            true
        });
        published
    }

    pub fn dirs(&self) -> Vec<PathBuf> {
        self.lock().dirs().to_vec()
    }

    /// Rescans now (blocking I/O). Returns the new (local) revision when the tools changed.
    ///
    /// What changed is logged once, when it changes: each tool that became invalid with the
    /// file, field and reason, each other new problem, and the tools added, changed or removed.
    pub fn rescan(&self) -> Option<u64> {
        let mut scanner = self.lock();
        let mut next = scanner.scan();
        let current = self.inner.scanned.borrow().clone();
        let changes = next.changes_since(&current);
        for (name, reason) in &changes.invalid {
            // Names and reasons come from the tools path: escaped, so no byte forges a line.
            tracing::warn!(tool = ?name, reason = ?reason, "tool not served: its definition is invalid");
        }
        // Errors all belong to invalid tools, told above; the rest are told when they appear.
        for d in next.diagnostics.iter().filter(|d| {
            d.severity != toolsrv_meta::Severity::Error && !current.diagnostics.contains(d)
        }) {
            tracing::warn!(problem = ?d.to_string(), "tool definition problem");
        }
        if next.same_tools(&current) {
            if next.diagnostics != current.diagnostics || next.invalid != current.invalid {
                next.revision = current.revision;
                let next = Arc::new(next);
                self.inner.scanned.send_replace(next.clone());
                // Problems alone change no revision: served at once if the tools are served.
                let served = self.catalog();
                if next.same_tools(&served) {
                    self.publish(&next, served.revision);
                }
            }
            return None;
        }
        next.revision = current.revision + 1;
        let revision = next.revision;
        tracing::info!(
            revision,
            tools = next.tools.len(),
            added = ?changes.added,
            changed = ?changes.changed,
            removed = ?changes.removed,
            invalid = ?changes.invalid.iter().map(|(name, _)| name).collect::<Vec<_>>(),
            "tool registry changed"
        );
        let next = Arc::new(next);
        self.inner.scanned.send_replace(next.clone());
        if self.inner.numbering == Numbering::Local {
            self.inner.tx.send_replace(next);
        }
        Some(revision)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Scanner> {
        // A panic while scanning leaves the scanner's cache consistent enough to rescan from.
        self.inner
            .scanner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Follows the tools path until `shutdown`: file-system events (debounced) and a periodic rescan.
    pub async fn watch(self, options: WatchOptions, shutdown: CancellationToken) {
        let changed = Arc::new(Notify::new());
        let mut watcher = {
            let changed = changed.clone();
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                if event.is_ok_and(|e| !e.kind.is_access()) {
                    changed.notify_one();
                }
            })
        };
        if let Err(e) = &watcher {
            tracing::warn!(error = %e, "file watching unavailable; relying on periodic rescans");
        }
        let mut watched: Vec<PathBuf> = Vec::new();
        let first = tokio::time::Instant::now() + options.rescan_every;
        let mut tick = tokio::time::interval_at(first, options.rescan_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if let Ok(w) = &mut watcher {
                self.rewatch(w, &mut watched);
            }
            let recheck = self.recheck_in();
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
                () = tokio::time::sleep(recheck.unwrap_or_default()), if recheck.is_some() => {}
                () = changed.notified() => {
                    // Debounce: wait until events stop for `debounce`.
                    loop {
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = changed.notified() => continue,
                            () = tokio::time::sleep(options.debounce) => break,
                        }
                    }
                }
            }
            let registry = self.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || registry.rescan()).await {
                tracing::error!(error = %e, "registry rescan failed");
            }
        }
    }

    /// How long until a file the last scan held back as being written settles (a little more,
    /// so that it has settled by then).
    fn recheck_in(&self) -> Option<Duration> {
        let at = self.lock().recheck_at()?;
        let left = at
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        Some(left + Duration::from_millis(50))
    }

    /// Watches directories of the tools path that exist now and were not watched yet.
    fn rewatch(&self, watcher: &mut notify::RecommendedWatcher, watched: &mut Vec<PathBuf>) {
        // A directory that was removed loses its watch; forget it so it is watched again if it returns.
        watched.retain(|dir| {
            let alive = dir.is_dir();
            if !alive {
                let _ = watcher.unwatch(dir);
            }
            alive
        });
        for dir in self.dirs() {
            if watched.contains(&dir) || !dir.is_dir() {
                continue;
            }
            match watcher.watch(&dir, RecursiveMode::NonRecursive) {
                Ok(()) => watched.push(dir),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot watch tools directory")
                }
            }
        }
    }
}
