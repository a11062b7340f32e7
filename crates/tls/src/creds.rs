//! Reloadable server credentials published through a `watch` channel: the certificate, its
//! key, the CA bundle and the CRLs, read again when one of their files changes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::ServerConfig;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::crl::Crls;
use crate::{TlsError, TlsFiles, server_config_with};

/// The coordinator's current server config; every new handshake reads the
/// latest one, connections already up keep theirs.
#[derive(Debug, Clone)]
pub struct ServerCreds {
    files: TlsFiles,
    crl_files: Vec<PathBuf>,
    /// Whether peers without a certificate are accepted (enrollment on).
    anonymous: bool,
    tx: watch::Sender<Arc<ServerConfig>>,
    crls: watch::Sender<Arc<Crls>>,
}

/// Refuses the server's own certificate outside its dates: every peer would refuse it.
fn own_dates(files: &TlsFiles) -> Result<(), TlsError> {
    crate::check_dates(
        &files.cert,
        "every peer refuses it: install a current certificate",
    )
}

impl ServerCreds {
    /// Loads `files` once; an error if they do not make a valid server config.
    pub fn new(files: TlsFiles) -> Result<Self, TlsError> {
        Self::with_options(files, Vec::new(), false)
    }

    /// Loads `files` and the CRLs of `crl_files` (see [`Crls::load`]) once; an error if they do
    /// not make a valid server config. With `anonymous`, peers without a certificate are
    /// accepted too (see [`server_config_with`]).
    pub fn with_options(
        files: TlsFiles,
        crl_files: Vec<PathBuf>,
        anonymous: bool,
    ) -> Result<Self, TlsError> {
        let crls = Crls::load(&crl_files)?;
        own_dates(&files)?;
        let config = server_config_with(&files, &crls, anonymous)?;
        let (tx, _rx) = watch::channel(config);
        let (crls, _rx) = watch::channel(Arc::new(crls));
        Ok(Self {
            files,
            crl_files,
            anonymous,
            tx,
            crls,
        })
    }

    /// A receiver to hand to [`crate::incoming`].
    pub fn subscribe(&self) -> watch::Receiver<Arc<ServerConfig>> {
        self.tx.subscribe()
    }

    /// The CRLs in use, marked changed at each successful reload (to close the connections of
    /// certificates a new CRL revokes).
    pub fn subscribe_crls(&self) -> watch::Receiver<Arc<Crls>> {
        self.crls.subscribe()
    }

    /// The config new handshakes use now.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.tx.borrow().clone()
    }

    /// The files these credentials are read from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The CRL files.
    pub fn crl_files(&self) -> &[PathBuf] {
        &self.crl_files
    }

    /// Re-reads the files. On error the previous config and CRLs stay in use and the error is
    /// returned: a CRL file replaced by something unreadable never lets in what the last good
    /// one refused, and a certificate outside its dates (expired, or not valid yet by this
    /// machine's clock) never replaces one every peer takes.
    pub fn reload(&self) -> Result<(), TlsError> {
        let crls = Crls::load(&self.crl_files)?;
        own_dates(&self.files)?;
        let config = server_config_with(&self.files, &crls, self.anonymous)?;
        // send_replace, not send: it succeeds even with no receiver yet.
        self.tx.send_replace(config);
        self.crls.send_replace(Arc::new(crls));
        Ok(())
    }

    /// Polls the files' modification times and sizes every `every` and reloads when one
    /// changes (cert-manager and `pki` rotations replace files in place; a CRL is usually
    /// replaced whole). Stops when `shutdown` is cancelled.
    pub fn spawn_reload_on_change(
        &self,
        every: Duration,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        let creds = self.clone();
        // Stamp now, not in the task: a change made before the task first
        // runs must still count as a change.
        let mut last = creds.stamp();
        // The last reload's error, while the files stay as they were: logged once. One that
        // only the clock can fix (a certificate not valid yet) is tried again at every tick.
        let mut refused: Option<String> = None;
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
                let waiting_for_the_clock = refused
                    .as_deref()
                    .is_some_and(|e| e.contains(crate::cert_info::NOT_YET_VALID));
                if now == last && !waiting_for_the_clock {
                    continue;
                }
                // Remember the new stamp even on failure: a half-written
                // file changes again when complete, and we do not want to
                // log the same error every tick meanwhile.
                let changed = now != last;
                last = now;
                match creds.reload() {
                    Ok(()) => {
                        refused = None;
                        let crls = creds.crls.borrow().clone();
                        tracing::info!(
                            cert = %creds.files.cert.display(),
                            crls = crls.len(),
                            revoked_by_crls = crls.revoked_count(),
                            "reloaded TLS credentials"
                        )
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if changed || refused.as_deref() != Some(e.as_str()) {
                            tracing::error!(error = %e, "TLS credentials or CRLs changed but cannot be loaded; keeping the previous ones");
                        }
                        refused = Some(e);
                    }
                }
            }
        })
    }

    /// What the files are now: a change to any (contents, or a `chmod` that makes a refused key
    /// file usable, which changes only its ctime) is a reason to read them again.
    fn stamp(&self) -> Vec<Option<(SystemTime, i64, u64, u32)>> {
        use std::os::unix::fs::MetadataExt;
        let one = |p: &Path| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.ctime(), m.len(), m.mode())))
        };
        [&self.files.ca, &self.files.cert, &self.files.key]
            .into_iter()
            .chain(&self.crl_files)
            .map(|p| one(p))
            .collect()
    }
}
