//! The connections the accept stream handed over and that are still open, so that the server
//! can close those of a peer whose certificate it no longer accepts (a revoked identity, a
//! certificate a new CRL lists): the whole HTTP/2 connection goes, with every stream on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rustls_pki_types::CertificateDer;
use tokio_util::sync::CancellationToken;

use crate::counts::{OpenCounts, Slot};
use crate::{Identity, PeerInfo};

/// Called with each connection as it is accepted (the peer and its leaf certificate).
type Observer = Box<dyn Fn(&PeerInfo, &CertificateDer<'static>) + Send + Sync>;

/// The open connections of one accept stream ([`crate::TlsIncoming::connections`]). Cloning
/// shares them.
#[derive(Clone, Default)]
pub struct Connections {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    live: Mutex<Live>,
    /// Connections open per identity.
    per_identity: OpenCounts<Identity>,
    observer: OnceLock<Observer>,
}

#[derive(Default)]
struct Live {
    next: u64,
    conns: HashMap<u64, Tracked>,
}

struct Tracked {
    peer: PeerInfo,
    leaf: CertificateDer<'static>,
    close: CancellationToken,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("open", &self.len())
            .finish()
    }
}

/// One connection's place in [`Connections`]: removed when dropped (with the connection).
#[derive(Debug)]
pub(crate) struct Registration {
    id: u64,
    conns: Connections,
    pub(crate) close: CancellationToken,
    /// Its place among its identity's open connections.
    _identity: Slot<Identity>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.conns.lock().conns.remove(&self.id);
    }
}

impl Connections {
    fn lock(&self) -> MutexGuard<'_, Live> {
        // The map stays consistent whatever a panicking holder did: every change is one call.
        self.inner.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a connection of `peer`, unless its identity has `limit` open already (0: no
    /// limit); `None` then (the first refused of a run is logged), and the connection is to be
    /// closed.
    pub(crate) fn register(
        &self,
        peer: &PeerInfo,
        leaf: CertificateDer<'static>,
        limit: usize,
    ) -> Option<Registration> {
        if let Some(observe) = self.inner.observer.get() {
            observe(peer, &leaf);
        }
        let slot = match self.inner.per_identity.admit(peer.identity.clone(), limit) {
            Ok(slot) => slot,
            Err(full) => {
                if full.first {
                    tracing::warn!(identity = %peer.identity, remote = %peer.remote, limit, "too many connections open with this certificate's identity: new ones are closed until some end (--max-connections-per-identity)");
                }
                return None;
            }
        };
        let close = CancellationToken::new();
        let mut live = self.lock();
        live.next += 1;
        let id = live.next;
        live.conns.insert(
            id,
            Tracked {
                peer: peer.clone(),
                leaf,
                close: close.clone(),
            },
        );
        Some(Registration {
            id,
            conns: self.clone(),
            close,
            _identity: slot,
        })
    }

    /// Calls `observe` with every connection accepted from now on, before it is handed over
    /// (to note what certificates peers present). Only the first observer set is kept; `false`
    /// if one was set already.
    pub fn observe(
        &self,
        observe: impl Fn(&PeerInfo, &CertificateDer<'static>) + Send + Sync + 'static,
    ) -> bool {
        self.inner.observer.set(Box::new(observe)).is_ok()
    }

    /// Closes every open connection for which `matches(peer, leaf certificate)` holds: its
    /// reads and writes fail from now on, which ends the HTTP/2 connection and every stream on
    /// it. Returns how many were closed.
    pub fn close_where(
        &self,
        mut matches: impl FnMut(&PeerInfo, &CertificateDer<'static>) -> bool,
    ) -> usize {
        let live = self.lock();
        let mut closed = 0;
        for tracked in live.conns.values() {
            if !tracked.close.is_cancelled() && matches(&tracked.peer, &tracked.leaf) {
                tracked.close.cancel();
                closed += 1;
            }
        }
        closed
    }

    /// `f(peer, leaf)` for each open connection (for metrics: what the peers present now).
    pub fn for_each(&self, mut f: impl FnMut(&PeerInfo, &CertificateDer<'static>)) {
        let live = self.lock();
        for tracked in live.conns.values() {
            f(&tracked.peer, &tracked.leaf);
        }
    }

    /// How many connections are open.
    pub fn len(&self) -> usize {
        self.lock().conns.len()
    }

    /// No connection is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
