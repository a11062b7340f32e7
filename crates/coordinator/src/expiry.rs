//! Certificates about to expire (`--cert-expiry-warning`): the coordinator's own, the CAs of its
//! bundle, and every peer certificate presented at a handshake. Each one inside the window is
//! logged as a warning once a day (not once per connection), and counted in the metrics
//! `toolsrv_certificates_expiring{role}` and
//! `toolsrv_peer_certificate_earliest_expiry_timestamp_seconds{role}` (roles: own, ca, agent,
//! client: never a host id).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use toolsrv_metrics::{Encoder, MetricsCollector, encode_gauges};
use toolsrv_tls::{CertInfo, Connections, Identity, Role, TlsError, TlsFiles};

/// The default window: a week gives a weekend and a holiday to renew.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(7 * 86_400);
/// A certificate is warned about at most this often.
const WARN_EVERY_SECS: i64 = 86_400;
/// How often, at most, the coordinator's own certificate and CA bundle are looked at again
/// ([`ExpiryWatch::check_own`] says to look sooner when one of them enters its window sooner).
pub const OWN_CHECK_EVERY: Duration = Duration::from_secs(3600);
/// Certificates remembered as warned about; beyond, the oldest warnings are forgotten (a peer
/// could otherwise grow the map with fresh certificates).
const MAX_REMEMBERED: usize = 10_000;

/// The duration grammar of every toolsrv flag (`30s`, `15m`, `24h`, `7d`, `2w`; `0` turns the
/// warning off).
pub use toolsrv_tls::enroll::parse_duration;

/// Which certificate this is to the coordinator, the metrics' `role` label.
fn role_label(identity: &Identity) -> &'static str {
    match identity.role() {
        Role::Agent => "agent",
        Role::Client => "client",
        Role::Coordinator => "coordinator",
    }
}

/// The coordinator's own certificate and its CA bundle as read for a check: role (`own`,
/// `ca`), file, and its certificates or why it does not read.
type OwnCertificates<'a> = [(&'static str, &'a Path, Result<Vec<CertInfo>, TlsError>); 2];

/// Watches certificates for their expiry.
#[derive(Debug)]
pub struct ExpiryWatch {
    window: Duration,
    tls: TlsFiles,
    /// When each certificate (role, issuer-relative serial and subject) was last warned about.
    warned: Mutex<HashMap<(String, CertInfo), i64>>,
    conns: OnceLock<Connections>,
}

impl ExpiryWatch {
    pub fn new(window: Duration, tls: TlsFiles) -> Self {
        Self {
            window,
            tls,
            warned: Mutex::new(HashMap::new()),
            conns: OnceLock::new(),
        }
    }

    /// Follows the peers of `conns`: each certificate presented at a handshake is checked,
    /// and the open connections are what the peer metrics report.
    pub fn watch_peers(self: &Arc<Self>, conns: &Connections) {
        let _ = self.conns.set(conns.clone());
        let me: Weak<Self> = Arc::downgrade(self);
        conns.observe(move |peer, leaf| {
            if let (Some(me), Some(info)) = (me.upgrade(), CertInfo::of(leaf)) {
                me.check(
                    role_label(&peer.identity),
                    &peer.identity.to_string(),
                    &info,
                );
            }
        });
    }

    /// Whether `info` expires within the window, or within the last third of its lifetime if
    /// that is shorter: a certificate renewed at two thirds of its life (an enrolled agent's,
    /// 24 h by default; cert-manager's) is due only once renewal is late. A week's window over
    /// a day's certificate would warn about every such certificate from its first hour, and the
    /// alert on `toolsrv_certificates_expiring` would never clear.
    fn within(&self, info: &CertInfo, now: i64) -> bool {
        self.enters_window(info).is_some_and(|enters| now >= enters)
    }

    /// When (Unix seconds) `info` enters its window ([`Self::within`]); `None` with the warning
    /// turned off.
    fn enters_window(&self, info: &CertInfo) -> Option<i64> {
        if self.window.is_zero() {
            return None;
        }
        let window = i64::try_from(self.window.as_secs()).unwrap_or(i64::MAX);
        let lifetime = info.not_after.saturating_sub(info.not_before);
        let window = if lifetime > 0 {
            window.min(lifetime / 3)
        } else {
            window
        };
        Some(info.not_after.saturating_sub(window))
    }

    /// The coordinator's own certificate (the first of its file: the intermediates after it
    /// are the CA's business, not "own") and every CA of its bundle, by role, with the file
    /// each was read from, or why it does not read.
    fn own_certificates(&self) -> OwnCertificates<'_> {
        [("own", &self.tls.cert), ("ca", &self.tls.ca)].map(|(role, path)| {
            let certs = toolsrv_tls::certificates_in(path).map(|mut certs| {
                if role == "own" {
                    certs.truncate(1);
                }
                certs
            });
            (role, path.as_path(), certs)
        })
    }

    /// How long until the own certificate and CA bundle should be looked at again:
    /// [`OWN_CHECK_EVERY`], or less if one of them enters its window sooner. A certificate
    /// living two hours has a window of 40 minutes, which looks an hour apart could miss,
    /// leaving only `expired` to be logged.
    fn next_look(&self, own: &OwnCertificates<'_>) -> Duration {
        let now = toolsrv_tls::unix_now();
        own.iter()
            .filter_map(|(_, _, certs)| certs.as_ref().ok())
            .flatten()
            .filter_map(|info| self.enters_window(info).filter(|&at| at > now))
            .map(|enters| Duration::from_secs(u64::try_from(enters - now).unwrap_or(0) + 1))
            .fold(OWN_CHECK_EVERY, Duration::min)
    }

    /// Warns about `info` (whose holder `who` is, in role `role`) if it expires within the
    /// window and was not warned about in the last day.
    fn check(&self, role: &str, who: &str, info: &CertInfo) {
        let now = toolsrv_tls::unix_now();
        if !self.within(info, now) {
            return;
        }
        {
            let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
            let key = (role.to_string(), info.clone());
            if warned
                .get(&key)
                .is_some_and(|last| now - last < WARN_EVERY_SECS)
            {
                return;
            }
            if warned.len() >= MAX_REMEMBERED {
                warned.retain(|_, last| now - *last < WARN_EVERY_SECS);
                if warned.len() >= MAX_REMEMBERED {
                    warned.clear();
                }
            }
            warned.insert(key, now);
        }
        let left = info.not_after - now;
        let (when, days) = if left <= 0 {
            ("expired", -left / 86_400)
        } else {
            ("expires", left / 86_400)
        };
        tracing::warn!(
            role,
            who,
            subject = %info.subject,
            serial = %info.serial,
            not_after_unix = info.not_after,
            "a certificate {when} within the warning window ({} days {}): renew it",
            days,
            if left <= 0 { "ago" } else { "from now" },
        );
    }

    /// Checks the coordinator's own certificate and every CA of its bundle (at start, after a
    /// reload, and when the last check said to look again); returns when to look again
    /// ([`Self::next_look`] of the certificates read for this check).
    pub fn check_own(&self) -> Duration {
        let own = self.own_certificates();
        for (role, path, certs) in &own {
            match certs {
                Ok(certs) => {
                    for info in certs {
                        self.check(role, &path.display().to_string(), info);
                    }
                }
                // The reload logs why the file does not read.
                Err(e) => {
                    tracing::debug!(file = %path.display(), error = %e, "cannot read for the expiry check")
                }
            }
        }
        self.next_look(&own)
    }

    /// What the metrics report now: per role, how many certificates expire within the window,
    /// and for agents and clients the earliest expiry among the open connections.
    fn snapshot(&self) -> ([i64; 4], [Option<i64>; 2]) {
        let now = toolsrv_tls::unix_now();
        let mut expiring = [0i64; 4];
        for (slot, (_, _, certs)) in expiring.iter_mut().zip(self.own_certificates()) {
            if let Ok(certs) = certs {
                *slot = certs.iter().filter(|c| self.within(c, now)).count() as i64;
            }
        }
        let mut earliest = [None::<i64>; 2];
        let mut seen: HashSet<CertInfo> = HashSet::new();
        if let Some(conns) = self.conns.get() {
            conns.for_each(|peer, leaf| {
                let slot = match peer.identity.role() {
                    Role::Agent => 0,
                    Role::Client => 1,
                    Role::Coordinator => return,
                };
                let Some(info) = CertInfo::of(leaf) else {
                    return;
                };
                earliest[slot] =
                    Some(earliest[slot].map_or(info.not_after, |e: i64| e.min(info.not_after)));
                if self.within(&info, now) && seen.insert(info) {
                    expiring[2 + slot] += 1;
                }
            });
        }
        (expiring, earliest)
    }
}

/// The expiry metrics, computed at each scrape.
#[derive(Debug)]
pub struct ExpiryCollector {
    pub watch: Arc<ExpiryWatch>,
}

impl MetricsCollector for ExpiryCollector {
    fn encode(&self, mut encoder: Encoder) -> Result<(), std::fmt::Error> {
        let (expiring, earliest) = self.watch.snapshot();
        encode_gauges(
            &mut encoder,
            "certificates_expiring",
            "Certificates that expire within --cert-expiry-warning (or have expired), by role: own (the coordinator's), ca (its bundle), agent and client (presented by the peers connected now)",
            &[
                ([("role", "own")], expiring[0]),
                ([("role", "ca")], expiring[1]),
                ([("role", "agent")], expiring[2]),
                ([("role", "client")], expiring[3]),
            ],
        )?;
        let peers: Vec<_> = [("agent", earliest[0]), ("client", earliest[1])]
            .into_iter()
            .filter_map(|(role, at)| at.map(|at| ([("role", role)], at)))
            .collect();
        encode_gauges(
            &mut encoder,
            "peer_certificate_earliest_expiry_timestamp_seconds",
            "The earliest notAfter (Unix time) among the certificates of the peers connected now, by role (agent, client); absent when none is connected",
            &peers,
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A watch over the coordinator certificate of a new PKI, issued valid from `from` to
    /// `until` seconds from now.
    fn watching_own(from: i64, until: i64) -> (toolsrv_testkit::Pki, ExpiryWatch) {
        let pki = toolsrv_testkit::Pki::new(&[], &[]);
        let at = |secs: i64| {
            let now = std::time::SystemTime::now();
            let d = Duration::from_secs(secs.unsigned_abs());
            if secs < 0 { now - d } else { now + d }
        };
        pki.issue_between(&Identity::Coordinator, (at(from), at(until)));
        let files = pki.files(&Identity::Coordinator);
        (pki, ExpiryWatch::new(DEFAULT_WINDOW, files))
    }

    #[test]
    fn the_own_certificate_is_looked_at_when_it_enters_its_window() {
        // Two hours of life, one gone: the window (a third, 40 minutes) opens in 20 minutes.
        let (_pki, watch) = watching_own(-3600, 3600);
        let next = watch.check_own();
        assert!(
            next > Duration::from_secs(19 * 60) && next <= Duration::from_secs(20 * 60 + 2),
            "{next:?}"
        );
        // A year of life: the hour (the test CA itself lives longer than the window).
        let (_pki, watch) = watching_own(-60, 365 * 86_400);
        assert_eq!(watch.check_own(), OWN_CHECK_EVERY);
        // Already inside its window: the hour, as before (it is warned about once a day).
        let (_pki, watch) = watching_own(-3600, 600);
        assert_eq!(watch.check_own(), OWN_CHECK_EVERY);
        // Warnings off: the hour.
        let (_pki, watch) = watching_own(-3600, 3600);
        let off = ExpiryWatch::new(Duration::ZERO, watch.tls.clone());
        assert_eq!(off.check_own(), OWN_CHECK_EVERY);
    }

    #[test]
    fn durations() {
        for (text, secs) in [
            ("30s", Some(30)),
            ("15m", Some(900)),
            ("24h", Some(86_400)),
            ("7d", Some(604_800)),
            ("2w", Some(1_209_600)),
            ("0", Some(0)),
            ("7", Some(7)),
            ("d", None),
            ("7y", None),
            ("-1d", None),
            ("1.5d", None),
            ("99999999999999999999d", None),
        ] {
            assert_eq!(
                parse_duration(text).ok().map(|d| d.as_secs()),
                secs,
                "{text}"
            );
        }
    }
}
