//! The fleet: every host seen since start, its facts, its latest view and its live link.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tokio::sync::broadcast;
use toolsrv_proto::v1::{
    CatalogEvent, CatalogEventKind, HostFacts, HostInfo, HostState, HostView, InvalidTool,
};
use toolsrv_registry::{Catalog, CatalogChanges};

use crate::link::Link;
use crate::selector::{self, Selector};
use crate::views::{Checked, HostOnly, Interner, StoredTool, StoredView};

/// Most tool names one registry event lists; a larger change counts the rest in `omitted`.
pub const MAX_EVENT_NAMES: usize = 256;
/// Most bytes of invalid tools' reasons one registry event carries.
pub const MAX_EVENT_REASON_BYTES: usize = 64 << 10;

/// What the coordinator knows of one host.
#[derive(Debug, Clone)]
pub struct HostEntry {
    pub id: String,
    pub facts: HostFacts,
    pub agent_version: String,
    pub max_concurrent_calls: u32,
    pub connected_unix_ms: u64,
    /// The host's latest view, tools sorted by name.
    pub view: Option<Arc<StoredView>>,
    /// Whether the current connection has reported its view yet (until then `view` is the
    /// previous connection's, if any, and the host shows as syncing).
    pub synced: bool,
    /// Labels the host's certificate carries (bound to its join token).
    pub certificate_labels: BTreeMap<String, String>,
    /// The certificate's labels with the ones the coordinator assigns (its `--host-labels`
    /// file) over them: what policy matches.
    pub trusted_labels: BTreeMap<String, String>,
    /// The agent's own labels with the trusted ones over them: what selectors match.
    pub selectable_labels: BTreeMap<String, String>,
    /// The live connection; `None` while offline.
    pub link: Option<Arc<Link>>,
    /// For a host another replica holds: that replica's id. Such entries are never in this
    /// replica's fleet; sessions make them (with the view fetched from that replica), and they
    /// count as online.
    pub remote: Option<String>,
    pub last_seen: Arc<AtomicU64>,
}

impl HostEntry {
    /// Sets the trusted labels (the certificate's, with `assigned` over them) and the
    /// selectable ones (the agent's own, with the trusted over them); whether they changed.
    pub fn relabel(&mut self, assigned: BTreeMap<String, String>) -> bool {
        let mut trusted = self.certificate_labels.clone();
        trusted.extend(assigned);
        let mut selectable: BTreeMap<String, String> = self
            .facts
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        selectable.extend(trusted.clone());
        let changed = trusted != self.trusted_labels || selectable != self.selectable_labels;
        self.trusted_labels = trusted;
        self.selectable_labels = selectable;
        changed
    }

    pub fn online(&self) -> bool {
        self.remote.is_some() || self.link.as_ref().is_some_and(|l| !l.closed.is_cancelled())
    }

    /// The host's status of one tool, if its view has it.
    pub fn tool(&self, name: &str) -> Option<&StoredTool> {
        self.view.as_ref()?.tool(name)
    }

    pub fn state(&self) -> HostState {
        match (self.online(), self.synced) {
            (false, _) => HostState::Offline,
            (true, false) => HostState::Syncing,
            (true, true) => HostState::Online,
        }
    }

    pub fn info(&self) -> HostInfo {
        HostInfo {
            host_id: self.id.clone(),
            state: self.state() as i32,
            facts: Some(self.facts.clone()),
            agent_version: self.agent_version.clone(),
            connected_unix_ms: self.connected_unix_ms,
            last_seen_unix_ms: self.last_seen.load(Ordering::Relaxed),
            view_revision: self.view.as_ref().map_or(0, |v| v.catalog_revision),
            visible_tools: self.view.as_ref().map_or(0, |v| v.visible()),
            calls_in_flight: self.link.as_ref().map_or(0, |l| l.calls_in_flight() as u32),
            max_concurrent_calls: self.max_concurrent_calls,
            trusted_labels: self.trusted_labels.clone().into_iter().collect(),
            replica: self.remote.clone().unwrap_or_default(),
        }
    }

    /// What selectors match: the host's facts and its labels, trusted ones winning.
    pub fn selector_facts(&self) -> selector::Candidate<'_> {
        selector::Candidate {
            id: &self.id,
            os: &self.facts.os,
            arch: &self.facts.arch,
            hostname: &self.facts.hostname,
            kernel: &self.facts.kernel,
            sandbox: self.facts.sandbox.as_ref().map_or("", |s| s.level.as_str()),
            labels: &self.selectable_labels,
        }
    }

    /// What policy rules match: as [`Self::selector_facts`] but with only the trusted labels,
    /// so that a host cannot relabel itself out of a rule.
    pub fn policy_facts(&self) -> selector::Candidate<'_> {
        selector::Candidate {
            labels: &self.trusted_labels,
            ..self.selector_facts()
        }
    }
}

/// Relabels `host` with `assigned`: its id and view revision when the labels changed.
fn relabelled(
    host: &mut HostEntry,
    assigned: BTreeMap<String, String>,
) -> Option<(String, Option<Arc<StoredView>>)> {
    host.relabel(assigned)
        .then(|| (host.id.clone(), host.view.clone()))
}

/// Hosts a selection looks at per hold of the fleet's lock ([`Fleet::select`]).
const SELECT_SLICE: usize = 256;

/// All hosts, and the change feed clients watch.
#[derive(Debug)]
pub struct Fleet {
    hosts: RwLock<BTreeMap<String, HostEntry>>,
    events: broadcast::Sender<CatalogEvent>,
    generation: AtomicU64,
    /// The registry revision, mirrored here so events can carry it.
    revision: AtomicU64,
    /// Shares identical tool definitions between host views.
    interner: Interner,
    /// Bumped whenever a host's view is stored: what derived indexes compare against.
    views_stored: AtomicU64,
}

pub use toolsrv_proto::unix_ms as now_ms;

impl Fleet {
    pub fn new(revision: u64) -> Self {
        let (events, _) = broadcast::channel(1024);
        Self {
            hosts: RwLock::new(BTreeMap::new()),
            events,
            generation: AtomicU64::new(1),
            revision: AtomicU64::new(revision),
            interner: Interner::default(),
            views_stored: AtomicU64::new(0),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, HostEntry>> {
        // Entries are replaced whole under the lock, so a poisoned map is still consistent.
        self.hosts.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, HostEntry>> {
        self.hosts.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn next_generation(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::Relaxed)
    }

    pub fn subscribe(&self) -> broadcast::Receiver<CatalogEvent> {
        self.events.subscribe()
    }

    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::Relaxed)
    }

    pub fn emit(&self, kind: CatalogEventKind, host: &str, view: Option<&StoredView>) {
        let event = CatalogEvent {
            kind: kind as i32,
            revision: self.revision(),
            host: host.to_string(),
            view_revision: view.map_or(0, |v| v.catalog_revision),
            visible_tools: view.map_or(0, StoredView::visible),
            ..CatalogEvent::default()
        };
        // No receivers is fine.
        let _ = self.events.send(event);
    }

    /// Tells watchers the registry changed to `revision`, and which tools: added, changed,
    /// removed, or invalid (at most [`MAX_EVENT_NAMES`] names, and [`MAX_EVENT_REASON_BYTES`]
    /// of reasons, in one event; the rest are counted in `omitted`).
    pub fn registry_changed(&self, revision: u64, changes: &CatalogChanges) {
        self.revision.store(revision, Ordering::Relaxed);
        let mut event = CatalogEvent {
            kind: CatalogEventKind::Registry as i32,
            revision,
            ..CatalogEvent::default()
        };
        let (mut room, mut reasons) = (MAX_EVENT_NAMES, MAX_EVENT_REASON_BYTES);
        let mut omitted = 0usize;
        for (list, names) in [
            (&mut event.added, &changes.added),
            (&mut event.changed, &changes.changed),
            (&mut event.removed, &changes.removed),
        ] {
            let taken = names.len().min(room);
            list.extend(names[..taken].iter().cloned());
            room -= taken;
            omitted += names.len() - taken;
        }
        for (name, reason) in &changes.invalid {
            if room == 0 || reason.len() > reasons {
                omitted += 1;
                continue;
            }
            room -= 1;
            reasons -= reason.len();
            event.invalid.push(InvalidTool {
                name: name.clone(),
                reason: reason.clone(),
            });
        }
        event.omitted = u32::try_from(omitted).unwrap_or(u32::MAX);
        // No receivers is fine.
        let _ = self.events.send(event);
    }

    /// Registers a new connection for a host, replacing (and closing) any previous one.
    pub fn attach(&self, mut entry: HostEntry) {
        let id = entry.id.clone();
        let old = {
            let mut hosts = self.write();
            // Keep the last view until the new connection reports its own.
            let previous = hosts.remove(&id);
            if let Some(prev) = &previous {
                entry.view = prev.view.clone();
            }
            hosts.insert(id.clone(), entry);
            previous.and_then(|p| p.link)
        };
        if let Some(old) = old {
            old.close("replaced by a new connection from the same host");
        }
        self.emit(CatalogEventKind::HostOnline, &id, None);
    }

    /// Runs `f` on the entry of host `id` if `generation` is still its current connection.
    fn with_current<R>(
        &self,
        id: &str,
        generation: u64,
        f: impl FnOnce(&mut HostEntry) -> R,
    ) -> Option<R> {
        let mut hosts = self.write();
        let entry = hosts.get_mut(id)?;
        let current = entry
            .link
            .as_ref()
            .is_some_and(|l| l.generation == generation);
        current.then(|| f(entry))
    }

    /// Removes the hosts offline (on this coordinator) since before `cutoff_ms` (Unix ms of the
    /// last message heard from them), or offline and `revoked`, telling watchers unless `elsewhere` says the host is
    /// connected through another replica (then only this replica's stale entry goes); their ids.
    pub fn forget_offline(
        &self,
        cutoff_ms: u64,
        elsewhere: impl Fn(&str) -> bool,
        revoked: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut forgotten = Vec::new();
        let mut had_views = false;
        self.write().retain(|id, host| {
            let away = host.link.is_none()
                && host.remote.is_none()
                && (host.last_seen.load(Ordering::Relaxed) < cutoff_ms || revoked(id));
            if away {
                had_views |= host.view.is_some();
                forgotten.push(id.clone());
            }
            !away
        });
        if had_views {
            // What was indexed from their views goes at the next rebuild.
            self.views_stored.fetch_add(1, Ordering::Relaxed);
        }
        for id in forgotten.iter().filter(|id| !elsewhere(id)) {
            self.emit(CatalogEventKind::HostForgotten, id, None);
        }
        forgotten
    }

    /// Marks a host offline if `generation` is still its current connection.
    pub fn detach(&self, id: &str, generation: u64) {
        if self
            .with_current(id, generation, |entry| entry.link.take())
            .is_some()
        {
            self.emit(CatalogEventKind::HostOffline, id, None);
        }
    }

    /// Stores a host's new view (tools sorted by name) if `generation` is its current connection.
    pub fn set_view(&self, id: &str, generation: u64, view: StoredView) {
        let view = self.interner.share(view);
        self.views_stored.fetch_add(1, Ordering::Relaxed);
        if self
            .with_current(id, generation, |entry| {
                entry.view = Some(view.clone());
                entry.synced = true;
            })
            .is_some()
        {
            self.emit(CatalogEventKind::HostView, id, Some(&view));
        }
    }

    /// An agent's view of `catalog` as it may be stored ([`Interner::check`]).
    pub fn check_view(&self, view: HostView, catalog: &Catalog, host_only: HostOnly) -> Checked {
        self.interner.check(view, catalog, host_only)
    }

    /// How many views have been stored so far; a change means some host's view may differ.
    pub fn views_stored(&self) -> u64 {
        self.views_stored.load(Ordering::Relaxed)
    }

    /// Every distinct tool definition the stored views hold.
    pub fn definitions(&self) -> Vec<Arc<toolsrv_proto::v1::ToolDefinition>> {
        self.interner.live()
    }

    pub fn get(&self, id: &str) -> Option<HostEntry> {
        self.read().get(id).cloned()
    }

    /// Host `id` once `ready` holds for it, or once it goes offline, or after `limit`: waits
    /// for the view a host reports after attaching (or after a catalog change) instead of
    /// answering from a view that is not there yet. `None`: no such host.
    pub async fn wait_for(
        &self,
        id: &str,
        limit: std::time::Duration,
        ready: impl Fn(&HostEntry) -> bool,
    ) -> Option<HostEntry> {
        // Almost every call finds its host ready: answer that without subscribing.
        let host = self.get(id)?;
        if !host.online() || ready(&host) {
            return Some(host);
        }
        let deadline = tokio::time::Instant::now() + limit;
        // Subscribe, then look again, so that no view stored in between is missed.
        let mut events = self.events.subscribe();
        loop {
            let host = self.get(id)?;
            if !host.online() || ready(&host) {
                return Some(host);
            }
            loop {
                match tokio::time::timeout_at(deadline, events.recv()).await {
                    Err(_) => return self.get(id),
                    Ok(Ok(event)) if event.host != id => continue,
                    // A view, a reconnect, a loss, or missed events: look again.
                    Ok(Ok(_)) | Ok(Err(broadcast::error::RecvError::Lagged(_))) => break,
                    Ok(Err(broadcast::error::RecvError::Closed)) => return self.get(id),
                }
            }
        }
    }

    /// Hosts by state: online, syncing, offline.
    pub fn count_by_state(&self) -> [usize; 3] {
        let mut counts = [0; 3];
        for host in self.read().values() {
            let slot = match host.state() {
                HostState::Online => 0,
                HostState::Syncing => 1,
                _ => 2,
            };
            counts[slot] += 1;
        }
        counts
    }

    /// Every host id, sorted.
    pub fn ids(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Hosts with an id after `after` (all for an empty one), in id order, as listed, until
    /// their encoded size passes `budget` bytes (at least one host); and the token of the next
    /// page, empty when this one ends the fleet.
    pub fn page(&self, after: &str, budget: usize) -> (Vec<HostInfo>, String) {
        use prost::Message;
        use std::ops::Bound;
        let hosts = self.read();
        let start = if after.is_empty() {
            Bound::Unbounded
        } else {
            Bound::Excluded(after.to_string())
        };
        let mut page: Vec<HostInfo> = Vec::new();
        let mut size = 0;
        for host in hosts
            .range::<String, _>((start, Bound::Unbounded))
            .map(|(_, h)| h)
        {
            let info = host.info();
            size += info.encoded_len();
            if size > budget
                && let Some(last) = page.last()
            {
                let next = last.host_id.clone();
                return (page, next);
            }
            page.push(info);
        }
        (page, String::new())
    }

    /// The hosts a selector picks, sorted by id.
    ///
    /// The fleet is read [`SELECT_SLICE`] hosts at a time, its lock let go in between: a client's
    /// selector can cost 40 µs a host (BENCHMARKS.md, "Selectors"), and an agent attaching or
    /// storing its view waits for the lock no longer than one slice takes. A host attached or
    /// gone meanwhile is picked or not by where the walk stands, as it would be a moment later.
    pub fn select(&self, selector: &Selector) -> Vec<HostEntry> {
        self.select_between(selector, || {})
    }

    /// [`Fleet::select`], running `between` each time the lock is let go.
    fn select_between(&self, selector: &Selector, mut between: impl FnMut()) -> Vec<HostEntry> {
        use std::ops::Bound::{Excluded, Unbounded};
        let mut picked = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let hosts = self.read();
            let mut slice = match &after {
                None => hosts.range::<str, _>((Unbounded, Unbounded)),
                Some(id) => hosts.range::<str, _>((Excluded(id.as_str()), Unbounded)),
            };
            let mut last = None;
            for (id, host) in slice.by_ref().take(SELECT_SLICE) {
                if selector.matches(&host.selector_facts()) {
                    picked.push(host.clone());
                }
                last = Some(id);
            }
            let more = slice.next().is_some();
            match last {
                Some(id) if more => after = Some(id.clone()),
                _ => return picked,
            }
            drop(hosts);
            between();
        }
    }

    /// Labels every host again with `assigned` (what the coordinator's labels file gives a
    /// host id), and tells watchers of each host whose labels changed; their ids.
    pub fn relabel(&self, assigned: impl Fn(&str) -> BTreeMap<String, String>) -> Vec<String> {
        let changed: Vec<(String, Option<Arc<StoredView>>)> = self
            .write()
            .values_mut()
            .filter_map(|host| relabelled(host, assigned(&host.id)))
            .collect();
        for (id, view) in &changed {
            self.emit(CatalogEventKind::HostView, id, view.as_deref());
        }
        changed.into_iter().map(|(id, _)| id).collect()
    }

    /// [`Fleet::relabel`] for host `id` alone: for a host attached with the labels read just
    /// before new ones took force, which the relabelling of every host may have missed.
    /// Whether they changed.
    pub fn relabel_one(&self, id: &str, assigned: BTreeMap<String, String>) -> bool {
        let changed = self
            .write()
            .get_mut(id)
            .and_then(|host| relabelled(host, assigned));
        match changed {
            Some((id, view)) => {
                self.emit(CatalogEventKind::HostView, &id, view.as_deref());
                true
            }
            None => false,
        }
    }

    /// Every host's id with its latest view, online or not.
    pub fn views(&self) -> Vec<(String, Arc<StoredView>)> {
        self.read()
            .values()
            .filter_map(|h| Some((h.id.clone(), h.view.clone()?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn entry(id: &str) -> HostEntry {
        HostEntry {
            id: id.to_string(),
            facts: HostFacts {
                hostname: "h".repeat(200),
                ..HostFacts::default()
            },
            agent_version: "test".into(),
            max_concurrent_calls: 16,
            connected_unix_ms: 0,
            view: None,
            synced: false,
            certificate_labels: BTreeMap::new(),
            trusted_labels: BTreeMap::new(),
            selectable_labels: BTreeMap::new(),
            link: None,
            remote: None,
            last_seen: Arc::new(0.into()),
        }
    }

    #[test]
    fn pages_cover_the_fleet_once_in_order_within_the_budget() {
        let fleet = Fleet::new(1);
        for i in 0..300 {
            fleet.attach(entry(&format!("host-{i:03}")));
        }
        let (mut seen, mut token, mut pages) = (Vec::new(), String::new(), 0);
        loop {
            let (page, next) = fleet.page(&token, 8 << 10);
            pages += 1;
            let size: usize = page.iter().map(prost::Message::encoded_len).sum();
            assert!(size <= 8 << 10 || page.len() == 1, "{size}");
            seen.extend(page.into_iter().map(|h| h.host_id));
            if next.is_empty() {
                break;
            }
            token = next;
        }
        assert!(pages > 5, "{pages} pages");
        let expected: Vec<String> = (0..300).map(|i| format!("host-{i:03}")).collect();
        assert_eq!(seen, expected);
        // A budget smaller than one host still moves on, one host a page.
        let (page, next) = fleet.page("", 1);
        assert_eq!(page.len(), 1);
        assert_eq!(next, "host-000");
    }

    #[test]
    fn relabelling_puts_the_file_over_the_certificate_and_the_trusted_over_the_agent() {
        let fleet = Fleet::new(1);
        let mut a = entry("a");
        a.certificate_labels = [("role".into(), "web".into()), ("zone".into(), "1".into())].into();
        a.facts.labels = [("role".into(), "said".into()), ("team".into(), "x".into())].into();
        a.relabel(BTreeMap::new());
        fleet.attach(a);
        fleet.attach(entry("b"));
        let mut events = fleet.subscribe();
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let changed = fleet.relabel(|id| match id {
            "a" => labels(&[("role", "db")]),
            _ => BTreeMap::new(),
        });
        assert_eq!(changed, ["a"]);
        let a = fleet.get("a").unwrap();
        assert_eq!(a.trusted_labels, labels(&[("role", "db"), ("zone", "1")]));
        assert_eq!(
            a.selectable_labels,
            labels(&[("role", "db"), ("team", "x"), ("zone", "1")])
        );
        let event = events.try_recv().unwrap();
        assert_eq!(
            (event.kind, event.host.as_str()),
            (CatalogEventKind::HostView as i32, "a")
        );
        assert!(events.try_recv().is_err(), "b did not change");
        // The same labels again change nothing.
        assert!(
            fleet
                .relabel(|id| if id == "a" {
                    labels(&[("role", "db")])
                } else {
                    BTreeMap::new()
                })
                .is_empty()
        );
        // One host, as a host attached with labels read just before new ones took force.
        assert!(fleet.relabel_one("b", labels(&[("role", "web")])));
        assert_eq!(
            fleet.get("b").unwrap().trusted_labels,
            labels(&[("role", "web")])
        );
        let event = events.try_recv().unwrap();
        assert_eq!(event.host, "b");
        assert!(!fleet.relabel_one("b", labels(&[("role", "web")])));
        assert!(!fleet.relabel_one("gone", labels(&[("role", "web")])));
        assert!(events.try_recv().is_err(), "nothing changed");
    }

    #[test]
    fn a_selection_lets_go_of_the_lock_between_slices() {
        let fleet = Fleet::new(1);
        let n = SELECT_SLICE * 3 + 10;
        for i in 0..n {
            fleet.attach(entry(&format!("web-{i:04}")));
        }
        fleet.attach(entry("db-1"));
        let selector = Selector::parse("web-*").unwrap();
        let ids = |hosts: Vec<HostEntry>| hosts.into_iter().map(|h| h.id).collect::<Vec<_>>();
        let expected: Vec<String> = (0..n).map(|i| format!("web-{i:04}")).collect();
        assert_eq!(ids(fleet.select(&selector)), expected);

        // Between slices the lock is free: an agent attaching there is not held. A host
        // attached behind the walk is not picked, one ahead of it is.
        let mut pauses = 0;
        let picked = fleet.select_between(&selector, || {
            pauses += 1;
            assert!(
                fleet.hosts.try_write().is_ok(),
                "the lock is held between slices"
            );
            if pauses == 1 {
                fleet.attach(entry("web-0000a"));
                fleet.attach(entry("web-9999"));
            }
        });
        assert_eq!(pauses, 3);
        let mut want = expected.clone();
        want.push("web-9999".into());
        assert_eq!(ids(picked), want);
        // Nothing is picked twice or left out where slices meet, whatever their number.
        assert_eq!(
            ids(fleet.select(&Selector::parse("web-0*,web-9*").unwrap())).len(),
            n + 2
        );
    }

    fn connected(id: &str, fleet: &Fleet) -> (HostEntry, u64) {
        let generation = fleet.next_generation();
        let (tx, rx) = toolsrv_proto::outbound::channel(8, crate::link::DEFAULT_STALLED_AFTER);
        // The receiver is leaked on purpose: the link must look alive for these tests.
        std::mem::forget(rx);
        let mut e = entry(id);
        e.link = Some(Arc::new(Link::new(id.into(), generation, tx, 1000)));
        (e, generation)
    }

    fn view(revision: u64) -> StoredView {
        StoredView {
            catalog_revision: revision,
            ..StoredView::default()
        }
    }

    #[test]
    fn hosts_that_report_the_same_view_share_it() {
        let fleet = Fleet::new(1);
        let mut generations = Vec::new();
        for id in ["a", "b", "c"] {
            let (e, generation) = connected(id, &fleet);
            fleet.attach(e);
            generations.push(generation);
        }
        fleet.set_view("a", generations[0], view(5));
        fleet.set_view("b", generations[1], view(5));
        fleet.set_view("c", generations[2], view(6));
        let view_of = |id: &str| fleet.get(id).unwrap().view.unwrap();
        assert!(Arc::ptr_eq(&view_of("a"), &view_of("b")));
        assert!(!Arc::ptr_eq(&view_of("a"), &view_of("c")));
        // b moves on: a keeps what it had.
        fleet.set_view("b", generations[1], view(6));
        assert_eq!(view_of("a").catalog_revision, 5);
        assert!(Arc::ptr_eq(&view_of("b"), &view_of("c")));
    }

    #[test]
    fn a_late_detach_of_an_old_connection_leaves_the_new_one_online() {
        let fleet = Fleet::new(1);
        let (first, old) = connected("a", &fleet);
        let old_link = first.link.clone().unwrap();
        fleet.attach(first);
        let (second, new) = connected("a", &fleet);
        fleet.attach(second);
        assert!(
            old_link.closed.is_cancelled(),
            "the replaced link is closed"
        );
        // The old session ends after the new one attached: it must not take the host offline.
        fleet.detach("a", old);
        assert!(fleet.get("a").unwrap().online());
        // Nor may its last view land on the new connection.
        fleet.set_view("a", old, view(5));
        assert!(!fleet.get("a").unwrap().synced);
        fleet.set_view("a", new, view(6));
        let host = fleet.get("a").unwrap();
        assert!(host.synced);
        assert_eq!(host.view.unwrap().catalog_revision, 6);
        fleet.detach("a", new);
        assert!(!fleet.get("a").unwrap().online());
    }

    #[test]
    fn a_reconnecting_host_keeps_its_last_view_but_is_syncing() {
        let fleet = Fleet::new(1);
        let (first, generation) = connected("a", &fleet);
        fleet.attach(first);
        fleet.set_view("a", generation, view(3));
        let (second, _) = connected("a", &fleet);
        fleet.attach(second);
        let host = fleet.get("a").unwrap();
        assert_eq!(host.view.as_ref().unwrap().catalog_revision, 3);
        assert_eq!(host.info().state, HostState::Syncing as i32);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_a_view_ends_when_it_arrives_or_at_the_limit() {
        let fleet = Arc::new(Fleet::new(1));
        let (first, generation) = connected("a", &fleet);
        fleet.attach(first);
        let limit = std::time::Duration::from_secs(5);
        let started = tokio::time::Instant::now();
        let waiting = {
            let fleet = fleet.clone();
            tokio::spawn(async move { fleet.wait_for("a", limit, |h| h.synced).await })
        };
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        fleet.set_view("a", generation, view(2));
        let host = waiting.await.unwrap().unwrap();
        assert!(host.synced);
        assert_eq!(started.elapsed(), std::time::Duration::from_secs(2));

        // Never ready: the wait ends at the limit with the host as it is.
        let started = tokio::time::Instant::now();
        let host = fleet.wait_for("a", limit, |_| false).await.unwrap();
        assert_eq!(host.id, "a");
        assert_eq!(started.elapsed(), limit);
        // Unknown hosts and offline hosts do not wait at all.
        assert!(fleet.wait_for("b", limit, |_| false).await.is_none());
        fleet.detach("a", generation);
        let started = tokio::time::Instant::now();
        assert!(
            !fleet
                .wait_for("a", limit, |_| false)
                .await
                .unwrap()
                .online()
        );
        assert_eq!(started.elapsed(), std::time::Duration::ZERO);
    }

    #[test]
    fn registry_events_say_what_changed_within_bounds() {
        let fleet = Fleet::new(1);
        let mut events = fleet.subscribe();
        let changes = CatalogChanges {
            added: vec!["a".into()],
            changed: vec!["c".into()],
            removed: vec!["r".into()],
            invalid: vec![("i".into(), "invalid: /t/i.meta: not valid JSON".into())],
        };
        fleet.registry_changed(2, &changes);
        let event = events.try_recv().unwrap();
        assert_eq!(event.kind, CatalogEventKind::Registry as i32);
        assert_eq!(event.revision, 2);
        assert_eq!(fleet.revision(), 2);
        assert_eq!(
            (event.added, event.changed, event.removed),
            (vec!["a".into()], vec!["c".into()], vec!["r".into()])
        );
        assert_eq!(event.invalid[0].name, "i");
        assert_eq!(event.omitted, 0);

        let many = CatalogChanges {
            added: (0..1000).map(|i| format!("t{i}")).collect(),
            invalid: (0..10)
                .map(|i| (format!("bad{i}"), "x".repeat(MAX_EVENT_REASON_BYTES / 4)))
                .collect(),
            ..CatalogChanges::default()
        };
        fleet.registry_changed(3, &many);
        let event = events.try_recv().unwrap();
        assert_eq!(event.added.len(), MAX_EVENT_NAMES);
        assert!(event.invalid.is_empty(), "no room left for names");
        assert_eq!(event.omitted, 1000 - 256 + 10);
    }
}
