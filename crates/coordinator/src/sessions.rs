//! Sessions: the tools loaded for one model on the hosts of a selector, kept on the coordinator.
//!
//! A session outlives the command that opened it and ends when no watcher has been attached
//! for the idle time (`--session-idle-secs`), or when closed. Its state is computed from the
//! fleet's host views whenever it is asked for, so it never goes stale; a digest of what it says
//! tells watchers whether anything changed.
//!
//! When a load would exceed `max_loaded`, `cold` tools are unloaded first, then `warm` ones,
//! least recently used first; `hot` tools never. A tool without `tier` is `warm`.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use toolsrv_meta::MAX_NAME_BYTES;
use toolsrv_proto::v1::{
    LoadedTool, SessionHost, SessionProfile, SessionState, ToolDefinition, ToolResolution,
    WaitsForApproval,
};
use toolsrv_registry::Catalog;

use crate::fleet::{Fleet, HostEntry, now_ms};
use crate::policy::{Policy, Reach};
use crate::selector::Selector;

/// `maxLoaded` when a profile leaves it out.
pub const DEFAULT_MAX_LOADED: u32 = 40;
/// The largest `maxLoaded` a profile may ask for.
pub const MAX_MAX_LOADED: u32 = 1000;
/// Longest selector a session may have.
const MAX_SELECTOR_BYTES: usize = 4096;

/// How long sessions live and how many one client may hold.
#[derive(Debug, Clone)]
pub struct SessionLimits {
    /// A session with no watcher attached ends after this long.
    pub idle: Duration,
    /// Most sessions one client identity may have open.
    pub per_client: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(300),
            per_client: 64,
        }
    }
}

/// Why a session request was refused.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(
        "no session `{0}` (it ended: closed, or idle with no watcher; or it is another client's)"
    )]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error(
        "this client has {0} sessions open, the most allowed (--max-sessions-per-client): close one or let it end"
    )]
    TooMany(usize),
    #[error("tool `{tool}` is {}", NOWHERE)]
    UnknownTool { tool: String },
    #[error("tool `{tool}` is offered by no host of the session: {why}")]
    Unavailable { tool: String, why: String },
    #[error("tool `{tool}` is not loaded in the session")]
    NotLoaded { tool: String },
    #[error(
        "the session is full: {max} tools loaded (maxLoaded) and all of them `hot`, which are never unloaded; unload one first"
    )]
    Full { max: u32 },
}

impl From<SessionError> for tonic::Status {
    fn from(e: SessionError) -> Self {
        let message = e.to_string();
        match e {
            SessionError::NotFound(_)
            | SessionError::UnknownTool { .. }
            | SessionError::NotLoaded { .. } => tonic::Status::not_found(message),
            SessionError::Invalid(_) => tonic::Status::invalid_argument(message),
            SessionError::TooMany(_) => tonic::Status::resource_exhausted(message),
            SessionError::Unavailable { .. } | SessionError::Full { .. } => {
                tonic::Status::failed_precondition(message)
            }
        }
    }
}

/// Every open session.
#[derive(Debug)]
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<Session>>>,
    limits: SessionLimits,
    /// With replicas: this replica's id, which ends every session id it makes (`<random>@<id>`),
    /// so that any replica knows where a session lives.
    origin: Option<String>,
}

/// The replica a session id names (see [`Sessions::new`]), if it names one.
pub fn replica_of(id: &str) -> Option<&str> {
    id.rsplit_once('@').map(|(_, replica)| replica)
}

/// One session.
#[derive(Debug)]
pub struct Session {
    pub id: String,
    /// The client identity that opened it: the only one that may use it.
    owner: String,
    selector: Selector,
    selector_text: String,
    max_loaded: u32,
    inner: Mutex<Inner>,
    /// Bumped on every load and unload, so watchers recompute.
    changes: watch::Sender<u64>,
    /// Cancelled when the session ends.
    pub closed: CancellationToken,
}

#[derive(Debug)]
struct Inner {
    loaded: Vec<Loaded>,
    watchers: u32,
    /// Since when no watcher has been attached (Unix ms); `None` while one is.
    idle_since_ms: Option<u64>,
    generation: u64,
    /// Digest of the last state computed, to tell whether the next one says something new.
    digest: Option<u64>,
}

#[derive(Debug, Clone)]
struct Loaded {
    name: String,
    auto: bool,
    last_used_ms: u64,
}

impl Sessions {
    pub fn new(limits: SessionLimits, origin: Option<String>) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            limits,
            origin,
        }
    }

    /// Sessions open now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        // Sessions are inserted and removed whole; a poisoned map is consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a session for `owner` from a profile, `hosts` replacing the profile's selector
    /// when not empty.
    pub fn open(
        &self,
        owner: &str,
        profile: SessionProfile,
        hosts: String,
    ) -> Result<Arc<Session>, SessionError> {
        let selector_text = match (hosts.trim(), profile.hosts.trim()) {
            ("", "") => "all".to_string(),
            ("", from_profile) => from_profile.to_string(),
            (given, _) => given.to_string(),
        };
        if selector_text.len() > MAX_SELECTOR_BYTES {
            return Err(SessionError::Invalid(format!(
                "the host selector is {} bytes, over the limit of {MAX_SELECTOR_BYTES}",
                selector_text.len()
            )));
        }
        let selector = Selector::parse(&selector_text)
            .map_err(|e| SessionError::Invalid(format!("host selector `{selector_text}`: {e}")))?;
        let max_loaded = match profile.max_loaded {
            0 => DEFAULT_MAX_LOADED,
            n if n > MAX_MAX_LOADED => {
                return Err(SessionError::Invalid(format!(
                    "maxLoaded is {n}, over the limit of {MAX_MAX_LOADED}"
                )));
            }
            n => n,
        };
        let mut loaded: Vec<Loaded> = Vec::new();
        let now = now_ms();
        // Repeated names count once, found in a set: a request may carry a million names, and
        // comparing each with every one kept before took minutes of a runtime thread.
        let mut named: HashSet<&str> = HashSet::new();
        for name in &profile.auto_load {
            check_name(name)?;
            if named.insert(name) && named.len() <= max_loaded as usize {
                loaded.push(Loaded {
                    name: name.clone(),
                    auto: true,
                    last_used_ms: now,
                });
            }
        }
        if named.len() > max_loaded as usize {
            return Err(SessionError::Invalid(format!(
                "autoLoad names {} tools, more than maxLoaded ({max_loaded})",
                named.len()
            )));
        }
        let mut map = self.lock();
        let held = map.values().filter(|s| s.owner == owner).count();
        if held >= self.limits.per_client {
            return Err(SessionError::TooMany(held));
        }
        let id = match &self.origin {
            Some(replica) => format!("{}@{replica}", new_id()),
            None => new_id(),
        };
        let session = Arc::new(Session {
            id,
            owner: owner.to_string(),
            selector,
            selector_text,
            max_loaded,
            inner: Mutex::new(Inner {
                loaded,
                watchers: 0,
                idle_since_ms: Some(now),
                generation: 0,
                digest: None,
            }),
            changes: watch::Sender::new(0),
            closed: CancellationToken::new(),
        });
        map.insert(session.id.clone(), session.clone());
        Ok(session)
    }

    /// `owner`'s session `id`. Another client's session is not found, as if it did not exist.
    pub fn get(&self, owner: &str, id: &str) -> Result<Arc<Session>, SessionError> {
        match self.lock().get(id) {
            Some(s) if s.owner == owner => Ok(s.clone()),
            _ => Err(SessionError::NotFound(bounded_id(id))),
        }
    }

    /// The sessions `owner` opened here, in no order.
    pub fn owned_by(&self, owner: &str) -> Vec<Arc<Session>> {
        self.lock()
            .values()
            .filter(|s| s.owner() == owner)
            .cloned()
            .collect()
    }

    /// Ends `owner`'s session `id` now.
    pub fn close(&self, owner: &str, id: &str) -> Result<(), SessionError> {
        let mut map = self.lock();
        match map.get(id) {
            Some(s) if s.owner == owner => {
                s.closed.cancel();
                map.remove(id);
                Ok(())
            }
            _ => Err(SessionError::NotFound(bounded_id(id))),
        }
    }

    /// Ends every session idle (no watcher) for longer than the idle time; returns how many.
    pub fn reap(&self) -> usize {
        let idle_ms = self.limits.idle.as_millis() as u64;
        let now = now_ms();
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, s| {
            let expired = s
                .lock()
                .idle_since_ms
                .is_some_and(|since| now.saturating_sub(since) >= idle_ms);
            if expired {
                tracing::info!(session = %s.id, owner = %s.owner, "session ended: no watcher for the idle time");
                s.closed.cancel();
            }
            !expired
        });
        before - map.len()
    }

    /// How often [`Self::reap`] should run to end sessions close to their idle time.
    pub fn reap_interval(&self) -> Duration {
        (self.limits.idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
    }

    pub fn idle(&self) -> Duration {
        self.limits.idle
    }
}

/// An id as it may appear in an error: bounded, so a huge one does not come back whole.
fn bounded_id(id: &str) -> String {
    id.chars().take(64).collect()
}

fn check_name(name: &str) -> Result<(), SessionError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(SessionError::Invalid(format!(
            "a tool name must be 1 to {MAX_NAME_BYTES} bytes, not {}",
            name.len()
        )));
    }
    if !toolsrv_meta::is_valid_name(name) {
        return Err(SessionError::Invalid(format!(
            "`{}` is not a tool name: {}",
            name.escape_debug(),
            toolsrv_meta::NAME_RULE
        )));
    }
    Ok(())
}

/// A fresh unguessable session id.
fn new_id() -> String {
    crate::approvals::new_id()
}

/// Eviction order: lower goes first; `None` is never evicted.
fn tier_rank(tier: &str) -> Option<u8> {
    match tier {
        "cold" => Some(0),
        "hot" => None,
        _ => Some(1),
    }
}

impl Session {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every change of `Inner` is one assignment or push; a poisoned lock is consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the session's watchers.
    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// A receiver woken by every load and unload.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The hosts of this replica's fleet the session's selector picks now, sorted by id.
    pub fn local_hosts(&self, fleet: &Fleet) -> Vec<HostEntry> {
        let mut hosts = fleet.select(&self.selector);
        hosts.sort_by(|a, b| a.id.cmp(&b.id));
        hosts
    }

    pub fn selector(&self) -> &Selector {
        &self.selector
    }

    /// The client the session belongs to.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Loads `tool`: refused when no host of the session (`hosts`, sorted by id) offers it,
    /// whether from the catalog or as a host-only tool of its own, or when `policy` denies the
    /// session's owner calling it on every host that does; a tool loaded already is only marked
    /// used. A full session unloads a colder tool first.
    pub fn load(
        &self,
        hosts: &[HostEntry],
        catalog: &Catalog,
        tool: &str,
        policy: &Policy,
    ) -> Result<(), SessionError> {
        check_name(tool)?;
        {
            let mut inner = self.lock();
            if let Some(l) = inner.loaded.iter_mut().find(|l| l.name == tool) {
                l.last_used_ms = now_ms();
                return Ok(());
            }
        }
        if definition_on(hosts, tool, false).is_none() {
            return Err(if known(hosts, catalog, tool) {
                SessionError::Unavailable {
                    tool: tool.to_string(),
                    why: unavailable_reason(hosts, catalog, tool),
                }
            } else {
                SessionError::UnknownTool {
                    tool: tool.to_string(),
                }
            });
        }
        if let Some(why) = denied_everywhere(hosts, tool, &policy.reach(&self.owner, tool)) {
            return Err(SessionError::Unavailable {
                tool: tool.to_string(),
                why,
            });
        }
        let mut inner = self.lock();
        if inner.loaded.iter().any(|l| l.name == tool) {
            return Ok(());
        }
        if inner.loaded.len() >= self.max_loaded as usize {
            let victim = inner
                .loaded
                .iter()
                .enumerate()
                .filter_map(|(i, l)| {
                    let tier = definition_on(hosts, &l.name, false)
                        .map(|d| d.tier.clone())
                        .unwrap_or_default();
                    tier_rank(&tier).map(|rank| (rank, l.last_used_ms, i))
                })
                .min()
                .map(|(_, _, i)| i);
            let Some(victim) = victim else {
                return Err(SessionError::Full {
                    max: self.max_loaded,
                });
            };
            let gone = inner.loaded.remove(victim);
            tracing::debug!(session = %self.id, unloaded = %gone.name, loaded = %tool, "session full: unloaded the coldest tool");
        }
        inner.loaded.push(Loaded {
            name: tool.to_string(),
            auto: false,
            last_used_ms: now_ms(),
        });
        drop(inner);
        self.changed();
        Ok(())
    }

    /// Unloads `tool`.
    pub fn unload(&self, tool: &str) -> Result<(), SessionError> {
        let mut inner = self.lock();
        let Some(i) = inner.loaded.iter().position(|l| l.name == tool) else {
            return Err(SessionError::NotLoaded {
                tool: tool.chars().take(MAX_NAME_BYTES).collect(),
            });
        };
        inner.loaded.remove(i);
        drop(inner);
        self.changed();
        Ok(())
    }

    /// Marks `tool` used now, if it is loaded (a call made for the session).
    pub fn touch(&self, tool: &str) {
        if let Some(l) = self.lock().loaded.iter_mut().find(|l| l.name == tool) {
            l.last_used_ms = now_ms();
        }
    }

    /// A watcher attached: the session does not end while one is.
    pub fn attach(self: &Arc<Self>) -> WatcherGuard {
        let mut inner = self.lock();
        inner.watchers += 1;
        inner.idle_since_ms = None;
        WatcherGuard {
            session: self.clone(),
        }
    }

    /// The session's state now, resolved on the views of `hosts` (the hosts its selector
    /// picks, sorted by id), each tool on the hosts `policy` lets the session's owner call it on.
    pub fn state(
        &self,
        hosts: &[HostEntry],
        catalog: &Catalog,
        idle: Duration,
        policy: &Policy,
    ) -> SessionState {
        let loaded = self.lock().loaded.clone();
        let selected = hosts
            .iter()
            .map(|h| SessionHost {
                host_id: h.id.clone(),
                state: h.info().state,
            })
            .collect();
        let tools = loaded
            .iter()
            .map(|l| loaded_tool(hosts, catalog, l, &policy.reach(&self.owner, &l.name)))
            .collect();
        let mut state = SessionState {
            id: self.id.clone(),
            generation: 0,
            hosts: self.selector_text.clone(),
            max_loaded: self.max_loaded,
            selected,
            tools,
            watchers: 0,
            idle_expires_unix_ms: 0,
            catalog_revision: catalog.revision,
        };
        let digest = digest_of(&state);
        let mut inner = self.lock();
        if inner.digest != Some(digest) {
            inner.digest = Some(digest);
            inner.generation += 1;
        }
        state.generation = inner.generation;
        state.watchers = inner.watchers;
        state.idle_expires_unix_ms = inner
            .idle_since_ms
            .map_or(0, |since| since + idle.as_millis() as u64);
        state
    }
}

/// What a session says, without what changes on every call (`last_used_unix_ms`) or with
/// watchers coming and going.
fn digest_of(state: &SessionState) -> u64 {
    let mut bare = state.clone();
    for t in &mut bare.tools {
        t.last_used_unix_ms = 0;
    }
    // Keyed once per process: digests are only compared with each other.
    static KEY: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
    KEY.get_or_init(RandomState::new)
        .hash_one(bare.encode_to_vec())
}

/// Detaches a watcher when dropped; the last one starts the idle clock.
#[derive(Debug)]
pub struct WatcherGuard {
    session: Arc<Session>,
}

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        let mut inner = self.session.lock();
        inner.watchers = inner.watchers.saturating_sub(1);
        if inner.watchers == 0 {
            inner.idle_since_ms = Some(now_ms());
        }
    }
}

/// The definition of `tool` on the first host of `hosts` that offers it (only online hosts
/// when `online_only`).
fn definition_on(
    hosts: &[HostEntry],
    tool: &str,
    online_only: bool,
) -> Option<Arc<ToolDefinition>> {
    hosts
        .iter()
        .filter(|h| !online_only || h.online())
        .filter_map(|h| h.tool(tool))
        .find(|t| t.visible)
        .and_then(|t| t.definition.clone())
}

/// What is said of a tool neither the catalog nor any host of a session has.
const NOWHERE: &str = "not in the catalog, and no host of the session offers it as its own";

/// Whether the catalog (its tools or its invalid files) or a host of the session, in its view,
/// has `tool`, offered or not.
fn known(hosts: &[HostEntry], catalog: &Catalog, tool: &str) -> bool {
    catalog.tools.contains_key(tool)
        || catalog.invalid.contains_key(tool)
        || hosts.iter().any(|h| h.tool(tool).is_some())
}

/// Why no online host of the session offers `tool`.
fn unavailable_reason(hosts: &[HostEntry], catalog: &Catalog, tool: &str) -> String {
    if hosts.is_empty() {
        return "the session's selector picks no host".to_string();
    }
    if let Some(invalid) = catalog.invalid.get(tool) {
        return format!("its files are invalid: {}", invalid.reason());
    }
    if !known(hosts, catalog, tool) {
        return NOWHERE.to_string();
    }
    let online: Vec<&HostEntry> = hosts.iter().filter(|h| h.online()).collect();
    if online.is_empty() {
        return "no host of the session is online".to_string();
    }
    let first_reason = online.iter().find_map(|h| {
        h.tool(tool)
            .filter(|t| !t.visible)
            .map(|t| format!("hidden on {}: {}", h.id, t.reason))
    });
    first_reason.unwrap_or_else(|| {
        format!(
            "no online host of the session has it in its view yet ({} online)",
            online.len()
        )
    })
}

/// Why the owner may call `tool` on none of the hosts that offer it (online or not), if so.
fn denied_everywhere(hosts: &[HostEntry], tool: &str, reach: &Reach<'_>) -> Option<String> {
    let mut offering = hosts
        .iter()
        .filter(|h| h.tool(tool).is_some_and(|t| t.visible));
    let first = offering.next()?;
    if reach.allows(&first.policy_facts()) || offering.any(|h| reach.allows(&h.policy_facts())) {
        return None;
    }
    Some(denied_text(reach, first))
}

/// What a session says of a tool the policy keeps from its owner on every host offering it,
/// naming the rule as it applies to `host`, one of them.
fn denied_text(reach: &Reach<'_>, host: &HostEntry) -> String {
    let why = reach.on(&host.policy_facts()).err().unwrap_or_default();
    format!("denied to you on every host of the session that offers it: {why}")
}

/// One loaded tool resolved on the session's online hosts where `reach` lets its owner call it.
fn loaded_tool(
    hosts: &[HostEntry],
    catalog: &Catalog,
    l: &Loaded,
    reach: &Reach<'_>,
) -> LoadedTool {
    let mut groups: Vec<(Arc<ToolDefinition>, Vec<String>)> = Vec::new();
    let mut host_only = false;
    let mut denied: Option<&HostEntry> = None;
    let mut approvals: Vec<WaitsForApproval> = Vec::new();
    for h in hosts.iter().filter(|h| h.online()) {
        let Some(tool) = h.tool(&l.name) else {
            continue;
        };
        let Some(def) = tool.offered().cloned() else {
            continue;
        };
        let Some(waits) = reach.waits_for(&h.policy_facts()) else {
            denied.get_or_insert(h);
            continue;
        };
        host_only |= tool.host_only;
        if let Some(approvers) = waits {
            crate::policy::wait_on(&mut approvals, approvers, &h.id);
        }
        // Views share identical definitions, so the pointer test settles most comparisons.
        match groups
            .iter_mut()
            .find(|(d, _)| Arc::ptr_eq(d, &def) || **d == *def)
        {
            Some((_, ids)) => ids.push(h.id.clone()),
            None => groups.push((def, vec![h.id.clone()])),
        }
    }
    // Most common first; ties by first host id (hosts are sorted).
    groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.1[0].cmp(&b.1[0])));
    let mut all_hosts: Vec<String> = groups.iter().flat_map(|(_, ids)| ids.clone()).collect();
    all_hosts.sort();
    let tier = groups
        .first()
        .map(|(d, _)| d.tier.clone())
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "warm".to_string());
    let unavailable = match (groups.is_empty(), denied) {
        (false, _) => String::new(),
        (true, Some(host)) => denied_text(reach, host),
        (true, None) => unavailable_reason(hosts, catalog, &l.name),
    };
    LoadedTool {
        name: l.name.clone(),
        tier,
        auto_loaded: l.auto,
        last_used_unix_ms: l.last_used_ms,
        resolutions: groups
            .into_iter()
            .map(|(d, hosts)| ToolResolution {
                definition: Some((*d).clone()),
                hosts,
            })
            .collect(),
        hosts: all_hosts,
        unavailable,
        host_only,
        approvals,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn profile(auto_load: Vec<String>, max_loaded: u32) -> SessionProfile {
        SessionProfile {
            auto_load,
            hosts: String::new(),
            max_loaded,
        }
    }

    /// A million distinct names (what a 16 MiB request can carry) are counted once each: the
    /// refusal says how many, and comes at once (the names were compared with one another,
    /// minutes of a runtime thread).
    #[test]
    fn auto_load_counts_each_name_once_however_many_a_request_carries() {
        let sessions = Sessions::new(SessionLimits::default(), None);
        let names: Vec<String> = (0..1_000_000).map(|i| format!("t{i}")).collect();
        let err = sessions
            .open("alice", profile(names, MAX_MAX_LOADED), String::new())
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("autoLoad names 1000000 tools, more than maxLoaded (1000)"),
            "{err}"
        );
        // Repeats count once, in their first order.
        let mut names: Vec<String> = (0..1_000_000).map(|i| format!("t{}", i % 3)).collect();
        names.insert(0, "t2".into());
        let session = sessions
            .open("alice", profile(names, 3), String::new())
            .unwrap();
        let loaded: Vec<String> = session
            .inner
            .lock()
            .unwrap()
            .loaded
            .iter()
            .map(|l| l.name.clone())
            .collect();
        assert_eq!(loaded, ["t2", "t0", "t1"]);
    }
}
