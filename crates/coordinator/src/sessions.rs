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
/// Most entries a profile's autoLoad may have, repeats included: checked before any name is.
const MAX_AUTOLOAD_ENTRIES: usize = 10 * MAX_MAX_LOADED as usize;
/// The most a session's state may take encoded: half a message, so that the state fits in one
/// whatever the encoding adds, and a list of several fits too ([`MAX_LIST_BYTES`]). A load or
/// an open that would pass it is refused; a state that grows past it (a catalog or host change)
/// leaves out the definitions of the tools loaded last.
pub const MAX_STATE_BYTES: usize = toolsrv_proto::limits::MAX_MESSAGE_BYTES / 2;
/// The most `ListSessions` gives: its largest entries lose their definitions past it. Half a
/// message, as a state: a list of host names is the densest message there is once decoded
/// (about fourteen times its size for names of four characters), and receivers refuse one that
/// would take over [`toolsrv_proto::limits::MAX_DECODED_BYTES`].
pub const MAX_LIST_BYTES: usize = toolsrv_proto::limits::MAX_MESSAGE_BYTES / 2;

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
        "no session `{0}` (it ended: closed, idle with no watcher, or its coordinator restarted; \
         or it is another client's)"
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
    #[error(
        "{what} would make the session's state {bytes} bytes (its tools' definitions and hosts), over the {} MiB a session's state may take: load fewer tools or narrow the session's hosts",
        max >> 20
    )]
    TooLarge {
        what: String,
        bytes: usize,
        max: usize,
    },
}

impl From<SessionError> for tonic::Status {
    fn from(e: SessionError) -> Self {
        let message = e.to_string();
        match e {
            SessionError::NotFound(_) => {
                toolsrv_proto::session_gone(tonic::Status::not_found(message))
            }
            SessionError::UnknownTool { .. } | SessionError::NotLoaded { .. } => {
                tonic::Status::not_found(message)
            }
            SessionError::Invalid(_) => tonic::Status::invalid_argument(message),
            SessionError::TooMany(_) => tonic::Status::resource_exhausted(message),
            SessionError::Unavailable { .. }
            | SessionError::Full { .. }
            | SessionError::TooLarge { .. } => tonic::Status::failed_precondition(message),
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
    /// Counts the changes of `loaded` (loads, unloads, evictions): a state computed from an
    /// older list must not take a generation.
    version: u64,
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
        let selector = Selector::parse(&selector_text).map_err(|e| {
            SessionError::Invalid(format!(
                "host selector `{}`: {e}",
                crate::selector::shown(&selector_text)
            ))
        })?;
        let max_loaded = match profile.max_loaded {
            0 => DEFAULT_MAX_LOADED,
            n if n > MAX_MAX_LOADED => {
                return Err(SessionError::Invalid(format!(
                    "maxLoaded is {n}, over the limit of {MAX_MAX_LOADED}"
                )));
            }
            n => n,
        };
        // What costs nothing to check comes first: a client at its limit, or a profile of a
        // million names, must not cost a runtime thread a second of examining each name.
        if profile.auto_load.len() > MAX_AUTOLOAD_ENTRIES {
            return Err(SessionError::Invalid(format!(
                "autoLoad has {} entries, over the limit of {MAX_AUTOLOAD_ENTRIES}",
                profile.auto_load.len()
            )));
        }
        self.room_for(owner)?;
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
        // Again, holding the map: others may have opened sessions meanwhile.
        let mut map = self.lock();
        Self::room_in(&map, owner, self.limits.per_client)?;
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
                version: 0,
            }),
            changes: watch::Sender::new(0),
            closed: CancellationToken::new(),
        });
        map.insert(session.id.clone(), session.clone());
        Ok(session)
    }

    /// Refuses `owner` a new session when it holds the most allowed.
    fn room_for(&self, owner: &str) -> Result<(), SessionError> {
        Self::room_in(&self.lock(), owner, self.limits.per_client)
    }

    fn room_in(
        map: &HashMap<String, Arc<Session>>,
        owner: &str,
        per_client: usize,
    ) -> Result<(), SessionError> {
        let held = map.values().filter(|s| s.owner == owner).count();
        if held >= per_client {
            return Err(SessionError::TooMany(held));
        }
        Ok(())
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

/// An id as it may appear in an error: escaped and bounded, so a huge one does not come back
/// whole nor odd bytes raw.
fn bounded_id(id: &str) -> String {
    toolsrv_proto::text::printable_line(id, 64)
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
        // What each tool would add to the state, measured before anything changes.
        let fixed = self.bare_state(hosts, catalog).encoded_len();
        let snapshot = self.lock().loaded.clone();
        // Each tool as the state shows it: its size there, and the tier eviction goes by.
        let measure = |l: &Loaded| {
            let shown = loaded_tool(hosts, catalog, l, &policy.reach(&self.owner, &l.name));
            let len = shown.encoded_len();
            (1 + prost::length_delimiter_len(len) + len, shown.tier)
        };
        let measured: HashMap<&str, (usize, String)> = snapshot
            .iter()
            .map(|l| (l.name.as_str(), measure(l)))
            .collect();
        let (added, _) = measure(&Loaded {
            name: tool.to_string(),
            auto: false,
            last_used_ms: 0,
        });
        let mut inner = self.lock();
        if inner.loaded.iter().any(|l| l.name == tool) {
            return Ok(());
        }
        let mut victim = None;
        if inner.loaded.len() >= self.max_loaded as usize {
            let coldest = inner
                .loaded
                .iter()
                .enumerate()
                .filter_map(|(i, l)| {
                    // One loaded meanwhile was not measured: measured now.
                    let tier = match measured.get(l.name.as_str()) {
                        Some((_, tier)) => tier.clone(),
                        None => measure(l).1,
                    };
                    tier_rank(&tier).map(|rank| (rank, l.last_used_ms, i))
                })
                .min()
                .map(|(_, _, i)| i);
            let Some(coldest) = coldest else {
                return Err(SessionError::Full {
                    max: self.max_loaded,
                });
            };
            victim = Some(coldest);
        }
        // A tool loaded by another request meanwhile counts as it is measured now: nothing.
        let bytes = fixed
            + added
            + inner
                .loaded
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(*i) != victim)
                .map(|(_, l)| measured.get(l.name.as_str()).map_or(0, |(len, _)| *len))
                .sum::<usize>();
        if bytes > MAX_STATE_BYTES {
            return Err(SessionError::TooLarge {
                what: format!("loading `{tool}`"),
                bytes,
                max: MAX_STATE_BYTES,
            });
        }
        if let Some(victim) = victim {
            let gone = inner.loaded.remove(victim);
            inner.version += 1;
            tracing::debug!(session = %self.id, unloaded = %gone.name, loaded = %tool, "session full: unloaded the coldest tool");
        }
        inner.version += 1;
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
                tool: toolsrv_proto::text::printable_line(tool, MAX_NAME_BYTES),
            });
        };
        inner.loaded.remove(i);
        inner.version += 1;
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
        self.state_fitted(hosts, catalog, idle, policy).0
    }

    /// [`Self::state`], and when tools were left out of it to keep it within
    /// [`MAX_STATE_BYTES`], what it would have taken with them.
    pub fn state_fitted(
        &self,
        hosts: &[HostEntry],
        catalog: &Catalog,
        idle: Duration,
        policy: &Policy,
    ) -> (SessionState, Option<usize>) {
        let compute = |loaded: &[Loaded]| {
            let mut state = self.bare_state(hosts, catalog);
            state.tools = loaded
                .iter()
                .map(|l| loaded_tool(hosts, catalog, l, &policy.reach(&self.owner, &l.name)))
                .collect();
            let (left_out, whole) = fit(&mut state, MAX_STATE_BYTES);
            let left_out = (left_out > 0).then_some(whole);
            let digest = digest_of(&state);
            (state, left_out, digest)
        };
        // Computed from a copy of the tools, then taken only if no load or unload came in
        // between: a state of an older list must not take the generation of a newer one. After
        // a few tries (loads keep coming), computed holding the session.
        let mut tries = 0;
        let (mut state, left_out, digest, mut inner) = loop {
            let (loaded, version) = {
                let inner = self.lock();
                (inner.loaded.clone(), inner.version)
            };
            let (state, left_out, digest) = compute(&loaded);
            let inner = self.lock();
            if inner.version == version {
                break (state, left_out, digest, inner);
            }
            tries += 1;
            if tries == 3 {
                let (state, left_out, digest) = compute(&inner.loaded);
                break (state, left_out, digest, inner);
            }
        };
        if inner.digest != Some(digest) {
            inner.digest = Some(digest);
            inner.generation += 1;
        }
        state.generation = inner.generation;
        state.watchers = inner.watchers;
        state.idle_expires_unix_ms = inner
            .idle_since_ms
            .map_or(0, |since| since + idle.as_millis() as u64);
        (state, left_out)
    }

    /// The session's state without its tools.
    fn bare_state(&self, hosts: &[HostEntry], catalog: &Catalog) -> SessionState {
        SessionState {
            id: self.id.clone(),
            generation: 0,
            hosts: self.selector_text.clone(),
            max_loaded: self.max_loaded,
            selected: hosts
                .iter()
                .map(|h| SessionHost {
                    host_id: h.id.clone(),
                    state: h.info().state,
                })
                .collect(),
            tools: Vec::new(),
            watchers: 0,
            idle_expires_unix_ms: 0,
            catalog_revision: catalog.revision,
            definitions_omitted: false,
        }
    }
}

/// Empties what of `tool` grows with its definitions and hosts; whether there was any.
fn strip(tool: &mut LoadedTool) -> bool {
    let had = !(tool.resolutions.is_empty() && tool.hosts.is_empty() && tool.approvals.is_empty());
    tool.resolutions.clear();
    tool.hosts.clear();
    tool.approvals.clear();
    had
}

/// Keeps `state` within `max` bytes encoded: the tools loaded last lose their definitions,
/// hosts and approvals first, each saying why. Returns how many did, and the size the state
/// had before.
fn fit(state: &mut SessionState, max: usize) -> (usize, usize) {
    let whole = state.encoded_len();
    let mut size = whole;
    let mut left_out = 0;
    for tool in state.tools.iter_mut().rev() {
        if size <= max {
            break;
        }
        let before = tool.encoded_len();
        if !strip(tool) {
            continue;
        }
        tool.unavailable = format!(
            "left out of the session's state, which would take over {} MiB with its \
             definitions and hosts: unload tools or narrow the session's hosts",
            max >> 20
        );
        size = size + tool.encoded_len() - before;
        left_out += 1;
    }
    (left_out, whole)
}

/// Keeps a list of sessions' states within `max` bytes encoded: the largest states lose their
/// tools' definitions, hosts and approvals first (`definitions_omitted`).
pub fn fit_list(states: &mut [SessionState], max: usize) {
    let mut size: usize = states.iter().map(|s| s.encoded_len() + 8).sum();
    let mut by_size: Vec<(usize, usize)> = states
        .iter()
        .enumerate()
        .map(|(i, s)| (s.encoded_len(), i))
        .collect();
    by_size.sort_unstable_by(|a, b| b.cmp(a));
    for (before, i) in by_size {
        if size <= max {
            break;
        }
        let state = &mut states[i];
        for tool in &mut state.tools {
            strip(tool);
        }
        state.definitions_omitted = true;
        size = size + state.encoded_len() - before;
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
    // With no online host offering it, an offline one's definition says (as eviction reads it).
    let tier = groups
        .first()
        .map(|(d, _)| d.tier.clone())
        .or_else(|| definition_on(hosts, &l.name, false).map(|d| d.tier.clone()))
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

    /// A loaded tool whose definition is `prompt_bytes` long, on host `a`.
    fn big_tool(name: &str, prompt_bytes: usize) -> LoadedTool {
        LoadedTool {
            name: name.to_string(),
            tier: "warm".into(),
            resolutions: vec![ToolResolution {
                definition: Some(ToolDefinition {
                    name: name.to_string(),
                    prompt: "x".repeat(prompt_bytes),
                    ..ToolDefinition::default()
                }),
                hosts: vec!["a".into()],
            }],
            hosts: vec!["a".into()],
            ..LoadedTool::default()
        }
    }

    #[test]
    fn a_state_past_its_bound_leaves_out_the_tools_loaded_last() {
        let mut state = SessionState {
            tools: (0..5).map(|i| big_tool(&format!("t{i}"), 1000)).collect(),
            ..SessionState::default()
        };
        assert_eq!(
            fit(&mut state, 10_000).0,
            0,
            "within the bound, nothing changes"
        );
        assert!(state.tools.iter().all(|t| t.unavailable.is_empty()));
        // 5 of about 1,020 bytes into 3,500: the last two go, the first three stay whole.
        let whole = state.encoded_len();
        assert_eq!(fit(&mut state, 3_500), (2, whole));
        assert!(state.encoded_len() <= 3_500, "{}", state.encoded_len());
        for t in &state.tools[..3] {
            assert_eq!(t.resolutions.len(), 1);
            assert!(t.unavailable.is_empty());
        }
        for t in &state.tools[3..] {
            assert!(t.resolutions.is_empty() && t.hosts.is_empty());
            assert!(
                t.unavailable.contains("left out of the session's state"),
                "{}",
                t.unavailable
            );
        }
    }

    /// The densest states and lists there are, as sent (every tool of a session on thousands of
    /// hosts named in four characters, twice: in its hosts and its one resolution), are taken
    /// by every receiver: what they take once decoded is within the receivers' limit.
    #[test]
    fn the_densest_states_and_lists_are_within_what_receivers_decode() {
        let names: Vec<String> = (0..20_000).map(|i| format!("{i:04x}")).collect();
        let tool = |i: usize| LoadedTool {
            name: format!("t{i}"),
            resolutions: vec![ToolResolution {
                definition: Some(ToolDefinition::default()),
                hosts: names.clone(),
            }],
            hosts: names.clone(),
            ..LoadedTool::default()
        };
        let state = |id: usize, tools: usize| {
            let mut state = SessionState {
                id: format!("s{id}"),
                tools: (0..tools).map(tool).collect(),
                ..SessionState::default()
            };
            fit(&mut state, MAX_STATE_BYTES);
            state
        };
        let one = state(0, 40);
        assert!(
            one.encoded_len() > MAX_STATE_BYTES * 9 / 10,
            "{}",
            one.encoded_len()
        );
        toolsrv_proto::cost::check::<SessionState>(&one.encode_to_vec()).unwrap();
        // States of a third of the list each, and one more: the list is cut to nearly full.
        let per_state = MAX_LIST_BYTES / 3 / tool(0).encoded_len();
        let mut list: Vec<SessionState> = (0..4).map(|i| state(i, per_state)).collect();
        fit_list(&mut list, MAX_LIST_BYTES);
        let list = toolsrv_proto::v1::ListSessionsResponse { sessions: list };
        assert!(
            list.encoded_len() > MAX_LIST_BYTES * 9 / 10,
            "{}",
            list.encoded_len()
        );
        toolsrv_proto::cost::check::<toolsrv_proto::v1::ListSessionsResponse>(
            &list.encode_to_vec(),
        )
        .unwrap();
    }

    #[test]
    fn a_list_past_its_bound_leaves_out_the_largest_states_definitions() {
        let state = |id: &str, tools: usize| SessionState {
            id: id.to_string(),
            tools: (0..tools)
                .map(|i| big_tool(&format!("t{i}"), 1000))
                .collect(),
            ..SessionState::default()
        };
        let mut states = vec![state("s1", 2), state("s2", 6), state("s3", 3)];
        fit_list(&mut states, 20_000);
        assert!(states.iter().all(|s| !s.definitions_omitted));
        // 11 tools of about 1,020 bytes into 7,000: the largest (s2) goes; into 4,500, s3 too.
        fit_list(&mut states, 7_000);
        let omitted: Vec<bool> = states.iter().map(|s| s.definitions_omitted).collect();
        assert_eq!(omitted, [false, true, false]);
        fit_list(&mut states, 4_500);
        let omitted: Vec<bool> = states.iter().map(|s| s.definitions_omitted).collect();
        assert_eq!(omitted, [false, true, true]);
        assert_eq!(
            states[1].tools.len(),
            6,
            "the tools stay, without definitions"
        );
        assert!(states[1].tools.iter().all(|t| t.resolutions.is_empty()));
        assert_eq!(states[0].tools[0].resolutions.len(), 1);
    }

    /// A million names (what a 16 MiB request can carry) are refused before any is examined;
    /// the most a profile may carry, all distinct, are counted once each: the refusal says how
    /// many, and comes at once (the names were compared with one another, minutes of a runtime
    /// thread).
    #[test]
    fn auto_load_counts_each_name_once_however_many_a_request_carries() {
        let sessions = Sessions::new(SessionLimits::default(), None);
        for (distinct, refusal) in [
            (
                1_000_000,
                "autoLoad has 1000000 entries, over the limit of 10000",
            ),
            (
                MAX_AUTOLOAD_ENTRIES,
                "autoLoad names 10000 tools, more than maxLoaded (1000)",
            ),
        ] {
            let names: Vec<String> = (0..distinct).map(|i| format!("t{i}")).collect();
            let err = sessions
                .open("alice", profile(names, MAX_MAX_LOADED), String::new())
                .err()
                .unwrap();
            assert!(err.to_string().contains(refusal), "{err}");
        }
        // Repeats count once, in their first order.
        let mut names: Vec<String> = (0..MAX_AUTOLOAD_ENTRIES - 1)
            .map(|i| format!("t{}", i % 3))
            .collect();
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
