//! The catalog keeper: applies catalog updates, rescans, and decides which host views to send.
//!
//! One keeper task runs per session, so slow blob downloads never hold up calls, credits or
//! keepalives on the session's main loop.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use toolsrv_meta::Host;
use toolsrv_proto::v1::agent_message::Msg;
use toolsrv_proto::v1::{AgentMessage, BlobRef, CatalogUpdate, HostView, ToolStatus};
use toolsrv_registry::{Catalog, Scanner};

use crate::blobs::BlobSource;
use crate::store::{CatalogStore, Unwritten};
use crate::view::{ViewTracker, parts, tool_statuses, within_limits};

/// The agent's catalog: the shipped tools materialized on disk plus the host-only directories.
#[derive(Debug)]
pub struct CatalogKeeper {
    store: CatalogStore,
    scanner: Scanner,
    host: Host,
    catalog: Arc<Catalog>,
    /// Revision of the last update applied; `None` until the first one on this session.
    revision: Option<u64>,
    views: ViewTracker,
    /// Shipped executables that could not be fetched yet, retried at each recheck.
    missing: BTreeMap<String, BlobRef>,
    /// Tools whose new version could not be written (a full disk), retried at each recheck;
    /// not served meanwhile.
    unwritten: BTreeMap<String, Unwritten>,
    /// More parts of the revision being applied are on their way.
    partial: bool,
    /// The tools of a full catalog arriving in parts, swept against once the last part is in.
    full_names: Option<BTreeSet<String>>,
}

impl CatalogKeeper {
    /// A keeper serving `store`'s directory first, then `host_dirs` (shipped tools win a clash).
    pub fn new(store: CatalogStore, host_dirs: &[PathBuf], host: Host) -> Self {
        let mut dirs = vec![store.dir().to_path_buf()];
        dirs.extend(host_dirs.iter().cloned());
        let mut scanner = Scanner::new(dirs);
        let catalog = Arc::new(scanner.scan());
        Self {
            store,
            scanner,
            host,
            catalog,
            revision: None,
            views: ViewTracker::default(),
            partial: false,
            full_names: None,
            missing: BTreeMap::new(),
            unwritten: BTreeMap::new(),
        }
    }

    /// The catalog as of the last scan.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.clone()
    }

    /// Shipped tools still waiting for their executable.
    pub fn missing(&self) -> &BTreeMap<String, BlobRef> {
        &self.missing
    }

    /// Applies an update; after the last part of a revision, rescans and returns the view to send
    /// (always sent then). Parts with `more` set only pile up.
    pub async fn apply(
        &mut self,
        update: &CatalogUpdate,
        source: &impl BlobSource,
    ) -> Option<HostView> {
        if update.full {
            self.missing.clear();
            self.unwritten.clear();
            self.full_names = update.more.then(BTreeSet::new);
        }
        if let Some(names) = &mut self.full_names {
            names.extend(update.upserts.iter().map(|d| d.name.clone()));
        }
        for name in update
            .upserts
            .iter()
            .map(|d| &d.name)
            .chain(&update.removals)
        {
            self.missing.remove(name);
            self.unwritten.remove(name);
        }
        let report = self.store.apply(update, source).await;
        self.missing.extend(report.missing);
        self.unwritten.extend(report.unwritten);
        self.partial = update.more;
        if update.more {
            return None;
        }
        // Whether this revision replaced the whole catalog, in one part or several.
        let mut full = update.full;
        if let Some(keep) = self.full_names.take() {
            full = true;
            for e in self.store.sweep_except(&keep) {
                tracing::error!(error = %e, revision = update.revision, "cannot remove a tool the catalog no longer has");
            }
        }
        self.revision = Some(update.revision);
        let view = self.rescan();
        tracing::info!(
            revision = update.revision,
            full,
            tools = view.tools.len(),
            visible = view.tools.iter().filter(|t| t.visible).count(),
            "catalog updated"
        );
        Some(self.views.sent(view))
    }

    /// Retries missing executables, rescans, and returns the view if it changed since the last
    /// one sent. Nothing is reported before the session's first catalog update.
    pub async fn recheck(&mut self, source: &impl BlobSource) -> Option<HostView> {
        if self.partial {
            // The rest of the revision is on its way; its last part reports the view.
            return None;
        }
        let unwritten = std::mem::take(&mut self.unwritten);
        if !unwritten.is_empty() {
            let retry = CatalogUpdate {
                revision: self.revision.unwrap_or(0),
                upserts: unwritten.into_values().map(|u| u.doc).collect(),
                ..CatalogUpdate::default()
            };
            let report = self.store.apply(&retry, source).await;
            for name in retry.upserts.iter().map(|d| &d.name) {
                if !report.unwritten.contains_key(name) {
                    tracing::info!(tool = %name, "wrote the tool's new version on retry");
                }
            }
            self.missing.extend(report.missing);
            self.unwritten = report.unwritten;
        }
        let missing = std::mem::take(&mut self.missing);
        for (name, blob) in missing {
            match self.store.place_executable(&name, &blob, source).await {
                Ok(()) => tracing::info!(tool = %name, "fetched the tool's executable on retry"),
                Err(e) => {
                    tracing::warn!(tool = %name, error = %e, "still cannot fetch the tool's executable");
                    self.missing.insert(name, blob);
                }
            }
        }
        let view = self.rescan();
        self.revision?;
        let changed = self.views.if_changed(view);
        if changed.is_some() {
            tracing::info!("host view changed; reporting it");
        }
        changed
    }

    fn rescan(&mut self) -> HostView {
        let mut catalog = self.scanner.scan();
        catalog.revision = self.revision.unwrap_or(0);
        for d in &catalog.diagnostics {
            tracing::debug!(diagnostic = %d, "catalog diagnostic");
        }
        self.catalog = Arc::new(catalog);
        let mut tools = tool_statuses(&self.catalog, &self.host);
        // A tool the host could not store is reported hidden, saying why, rather than left out:
        // a caller is told what is wrong on the host, not that it never reported the tool.
        for (name, unwritten) in &self.unwritten {
            if !tools.iter().any(|t| &t.name == name) {
                tools.push(ToolStatus {
                    name: name.clone(),
                    visible: false,
                    reason: format!(
                        "the host could not store this version of the tool ({}); it is written \
                         again every few seconds",
                        unwritten.why
                    ),
                    ..ToolStatus::default()
                });
            }
        }
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        within_limits(HostView {
            catalog_revision: self.revision.unwrap_or(0),
            tools,
            more: false,
        })
    }
}

/// The keeper task's connections to the session.
#[derive(Debug)]
pub(crate) struct KeeperChannels {
    pub updates: mpsc::Receiver<CatalogUpdate>,
    /// Where calls find the current catalog.
    pub catalog: watch::Sender<Arc<Catalog>>,
    pub out: toolsrv_proto::outbound::Outbound<AgentMessage>,
    pub recheck_every: Duration,
    pub stop: CancellationToken,
    pub metrics: crate::AgentMetrics,
}

/// Applies updates as they come and rechecks the host periodically, until stopped or the
/// outbound stream is gone.
pub(crate) async fn keep_catalog(
    mut keeper: CatalogKeeper,
    source: impl BlobSource,
    mut links: KeeperChannels,
) {
    let mut recheck = tokio::time::interval(links.recheck_every.max(Duration::from_millis(10)));
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    recheck.reset();
    loop {
        // The whole step races the stop token: a blob download on a dead link must not hold up
        // the end of the session. Interrupting it is safe, every file is renamed into place whole.
        let step = async {
            tokio::select! {
                update = links.updates.recv() => match update {
                    Some(update) => Some(keeper.apply(&update, &source).await),
                    None => None,
                },
                _ = recheck.tick() => Some(keeper.recheck(&source).await),
            }
        };
        let view = tokio::select! {
            () = links.stop.cancelled() => return,
            step = step => match step {
                Some(view) => view,
                None => return,
            },
        };
        links.catalog.send_replace(keeper.catalog());
        if let Some(view) = &view {
            links.metrics.view(view);
        }
        // A large view goes out in parts, one after the other on the outbound stream.
        for part in view.map(parts).unwrap_or_default() {
            let msg = AgentMessage {
                msg: Some(Msg::View(part)),
            };
            tokio::select! {
                () = links.stop.cancelled() => return,
                sent = links.out.send(msg) => if sent.is_err() {
                    return;
                },
            }
        }
    }
}
