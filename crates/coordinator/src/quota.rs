//! Per-client quotas: how many calls one client may have running, in all and on one host, and
//! how wide one fan-out may be. A request over a quota is refused at once, never queued: one
//! client must not be able to make another one wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The coordinator's limits per client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Calls one client may have running at once across the fleet (fan-out host calls count).
    pub calls_per_client: usize,
    /// Calls one client may have running at once on one host. Kept below an agent's own
    /// concurrency (16 by default) so one client cannot fill a host's queue alone.
    pub calls_per_client_host: usize,
    /// Hosts one fan-out may target.
    pub fanout_hosts: usize,
    /// The longest timeout a call may ask for; also the coordinator's deadline for calls that
    /// leave the timeout to the agent.
    pub max_call_timeout: Duration,
    /// Watch streams (WatchCatalog, WatchSession) one client may have open at once.
    pub watches_per_client: usize,
    /// FindTools requests one client may have in progress at once. Ranking with an encoder
    /// costs milliseconds of CPU a request: a client that sends hundreds at once must not queue
    /// them all ahead of everyone else.
    pub finds_per_client: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            calls_per_client: 64,
            calls_per_client_host: 8,
            fanout_hosts: 4096,
            max_call_timeout: Duration::from_secs(3600),
            watches_per_client: 256,
            finds_per_client: 8,
        }
    }
}

#[derive(Debug, Default)]
struct Usage {
    /// Running calls plus slots reserved by fan-outs.
    total: usize,
    per_host: HashMap<String, usize>,
}

/// What every client is using now.
#[derive(Debug, Default)]
pub struct Quotas {
    pub limits: Limits,
    usage: Mutex<HashMap<String, Usage>>,
    /// Open watch streams per client.
    watches: Arc<PerClient>,
}

/// How many of one kind of thing (open streams, requests in progress) each client holds; each
/// is a [`Held`], counted out when dropped.
#[derive(Debug, Default)]
pub struct PerClient {
    counts: Mutex<HashMap<String, usize>>,
}

/// One thing a client holds, counted out of its [`PerClient`] on drop (also when the client
/// goes away and the stream or request holding it is dropped).
#[derive(Debug)]
pub struct Held {
    counter: Arc<PerClient>,
    client: String,
}

impl PerClient {
    /// Counts one more for `client`, unless it holds `limit` already: then how many it holds.
    pub fn hold(self: &Arc<Self>, client: &str, limit: usize) -> Result<Held, usize> {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = counts.entry(client.to_string()).or_insert(0);
        if *n >= limit {
            return Err(*n);
        }
        *n += 1;
        Ok(Held {
            counter: self.clone(),
            client: client.to_string(),
        })
    }

    /// How many `client` holds now.
    #[cfg(test)]
    fn held(&self, client: &str) -> usize {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(client).copied().unwrap_or(0)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut counts = self
            .counter
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(&self.client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

/// One running call's share of its client's quota, given back on drop.
#[derive(Debug)]
pub struct Slot {
    quotas: Arc<Quotas>,
    client: String,
    host: String,
    /// Whether this slot counts in the client's total (fan-out host calls are counted by their
    /// fan-out's reservation).
    counted: bool,
}

/// Slots a fan-out holds in its client's total, given back on drop.
#[derive(Debug)]
pub struct Reservation {
    quotas: Arc<Quotas>,
    client: String,
    pub slots: usize,
}

impl Quotas {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            usage: Mutex::default(),
            watches: Arc::default(),
        }
    }

    /// A watch stream's slot for `client`, or why not.
    pub fn watch(&self, client: &str) -> Result<Held, String> {
        let limit = self.limits.watches_per_client;
        self.watches.hold(client, limit).map_err(|n| {
            format!(
                "client {client} already has {n} watch streams open, its limit (the \
                 coordinator's --max-watches-per-client); close some first"
            )
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Usage>> {
        // Every update is a few integer changes under the lock; a poisoned map is consistent.
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for one call of `client` on `host`. `in_fanout`: the fan-out's reservation
    /// already counts it in the client's total.
    pub fn call(
        self: &Arc<Self>,
        client: &str,
        host: &str,
        in_fanout: bool,
    ) -> Result<Slot, String> {
        let mut usage = self.lock();
        let u = usage.entry(client.to_string()).or_default();
        if !in_fanout && u.total >= self.limits.calls_per_client {
            return Err(format!(
                "client {client} already has {} calls running or waiting for approval, its limit (the coordinator's \
                 --max-calls-per-client); wait for some to finish",
                u.total
            ));
        }
        let on_host = u.per_host.get(host).copied().unwrap_or(0);
        if on_host >= self.limits.calls_per_client_host {
            return Err(format!(
                "client {client} already has {on_host} calls running or waiting for approval on host \
                 {host}, its limit \
                 per host (the coordinator's --max-calls-per-client-host); wait for some to finish"
            ));
        }
        if !in_fanout {
            u.total += 1;
        }
        *u.per_host.entry(host.to_string()).or_default() += 1;
        Ok(Slot {
            quotas: self.clone(),
            client: client.to_string(),
            host: host.to_string(),
            counted: !in_fanout,
        })
    }

    /// Reserves up to `wanted` of `client`'s slots for a fan-out: as many as are free, at
    /// least one, or an error when none is.
    pub fn reserve(self: &Arc<Self>, client: &str, wanted: usize) -> Result<Reservation, String> {
        let mut usage = self.lock();
        let u = usage.entry(client.to_string()).or_default();
        let free = self.limits.calls_per_client.saturating_sub(u.total);
        if free == 0 {
            return Err(format!(
                "client {client} already has {} calls running or waiting for approval, its limit (the coordinator's \
                 --max-calls-per-client); wait for some to finish",
                u.total
            ));
        }
        let slots = wanted.clamp(1, free);
        u.total += slots;
        Ok(Reservation {
            quotas: self.clone(),
            client: client.to_string(),
            slots,
        })
    }

    /// Calls `client` has running (or reserved) now.
    #[cfg(test)]
    fn running(&self, client: &str) -> usize {
        self.lock().get(client).map_or(0, |u| u.total)
    }

    fn release(&self, client: &str, host: Option<&str>, total: usize) {
        let mut usage = self.lock();
        let Some(u) = usage.get_mut(client) else {
            return;
        };
        u.total = u.total.saturating_sub(total);
        if let Some(host) = host
            && let Some(n) = u.per_host.get_mut(host)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                u.per_host.remove(host);
            }
        }
        if u.total == 0 && u.per_host.is_empty() {
            usage.remove(client);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.quotas
            .release(&self.client, Some(&self.host), usize::from(self.counted));
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.quotas.release(&self.client, None, self.slots);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn what_a_client_holds_is_bounded_and_counted_out_on_drop() {
        let counter = Arc::new(PerClient::default());
        let a1 = counter.hold("alice", 2).unwrap();
        let a2 = counter.hold("alice", 2).unwrap();
        assert_eq!(counter.hold("alice", 2).unwrap_err(), 2);
        let b = counter.hold("bob", 2).unwrap();
        drop(a1);
        let a3 = counter.hold("alice", 2).unwrap();
        assert_eq!(counter.held("alice"), 2);
        drop((a2, a3, b));
        assert_eq!(counter.held("alice"), 0);
        assert!(
            counter.counts.lock().unwrap().is_empty(),
            "no empty entries kept"
        );
    }

    fn quotas(total: usize, per_host: usize) -> Arc<Quotas> {
        Arc::new(Quotas::new(Limits {
            calls_per_client: total,
            calls_per_client_host: per_host,
            ..Limits::default()
        }))
    }

    #[test]
    fn a_client_over_its_limits_is_refused_and_others_are_not() {
        let q = quotas(3, 2);
        let a1 = q.call("alice", "h1", false).unwrap();
        let _a2 = q.call("alice", "h1", false).unwrap();
        assert!(
            q.call("alice", "h1", false)
                .unwrap_err()
                .contains("on host h1")
        );
        let _a3 = q.call("alice", "h2", false).unwrap();
        assert!(
            q.call("alice", "h3", false)
                .unwrap_err()
                .contains("3 calls running")
        );
        let _b = q.call("bob", "h1", false).unwrap();
        drop(a1);
        assert!(q.call("alice", "h1", false).is_ok());
    }

    #[test]
    fn slots_are_given_back_and_empty_clients_forgotten() {
        let q = quotas(2, 2);
        {
            let _a = q.call("alice", "h1", false).unwrap();
            let _r = q.reserve("alice", 10).unwrap();
            assert_eq!(q.running("alice"), 2);
        }
        assert_eq!(q.running("alice"), 0);
        assert!(q.lock().is_empty());
    }

    #[test]
    fn a_fanout_reserves_what_is_free_and_its_host_calls_count_per_host_only() {
        let q = quotas(4, 1);
        let _a = q.call("alice", "h1", false).unwrap();
        let r = q.reserve("alice", 10).unwrap();
        assert_eq!(r.slots, 3);
        assert!(q.reserve("alice", 1).is_err());
        // Counted by the reservation, not again in the total.
        let _h2 = q.call("alice", "h2", true).unwrap();
        // h1 already has alice's one call per host.
        assert!(q.call("alice", "h1", true).is_err());
        assert_eq!(q.running("alice"), 4);
    }
}
