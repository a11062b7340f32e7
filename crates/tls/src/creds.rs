//! Reloadable server credentials published through a `watch` channel.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::ServerConfig;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{TlsError, TlsFiles, server_config_with};

/// The coordinator's current server config; every new handshake reads the
/// latest one, connections already up keep theirs.
#[derive(Debug, Clone)]
pub struct ServerCreds {
    files: TlsFiles,
    /// Whether peers without a certificate are accepted (enrollment on).
    anonymous: bool,
    tx: watch::Sender<Arc<ServerConfig>>,
}

impl ServerCreds {
    /// Loads `files` once; an error if they do not make a valid server config.
    pub fn new(files: TlsFiles) -> Result<Self, TlsError> {
        Self::with_anonymous(files, false)
    }

    /// [`ServerCreds::new`], also accepting peers without a certificate when `anonymous` (see
    /// [`server_config_with`]).
    pub fn with_anonymous(files: TlsFiles, anonymous: bool) -> Result<Self, TlsError> {
        let config = server_config_with(&files, anonymous)?;
        let (tx, _rx) = watch::channel(config);
        Ok(Self {
            files,
            anonymous,
            tx,
        })
    }

    /// A receiver to hand to [`crate::incoming`].
    pub fn subscribe(&self) -> watch::Receiver<Arc<ServerConfig>> {
        self.tx.subscribe()
    }

    /// The config new handshakes use now.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.tx.borrow().clone()
    }

    /// The files these credentials are read from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Re-reads the files. On error the previous config stays in use and
    /// the error is returned.
    pub fn reload(&self) -> Result<(), TlsError> {
        let config = server_config_with(&self.files, self.anonymous)?;
        // send_replace, not send: it succeeds even with no receiver yet.
        self.tx.send_replace(config);
        Ok(())
    }

    /// Polls the files' modification times every `every` and reloads when
    /// one changes (cert-manager and `pki` rotations replace files in
    /// place). Stops when `shutdown` is cancelled.
    pub fn spawn_reload_on_change(
        &self,
        every: Duration,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        let creds = self.clone();
        // Stamp now, not in the task: a change made before the task first
        // runs must still count as a change.
        let mut last = creds.stamp();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is immediate
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let now = creds.stamp();
                if now == last {
                    continue;
                }
                // Remember the new stamp even on failure: a half-written
                // file changes again when complete, and we do not want to
                // log the same error every tick meanwhile.
                last = now;
                match creds.reload() {
                    Ok(()) => {
                        tracing::info!(cert = %creds.files.cert.display(), "reloaded TLS credentials")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "TLS credentials changed but cannot be loaded; keeping the previous ones")
                    }
                }
            }
        })
    }

    fn stamp(&self) -> [Option<(SystemTime, u64)>; 3] {
        let one = |p: &std::path::Path| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        };
        [
            one(&self.files.ca),
            one(&self.files.cert),
            one(&self.files.key),
        ]
    }
}
