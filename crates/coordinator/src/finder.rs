//! FindTools: the tools visible on a selector's online hosts ranked against a request.
//!
//! One index holds every distinct definition the hosts' views carry (a tool resolved two ways
//! is two documents), keyed by name and a digest of its ranked texts. It follows the fleet: a
//! request that finds views stored since the last build rebuilds it first, and the rebuild
//! embeds only texts it has not seen. While a rebuild is under way (embedding a changed catalog
//! can take seconds), requests are answered from the last index instead of waiting: they rank
//! only the documents visible on the hosts they select now, so a tool that went away is not
//! returned, and one that came with the change is found once the rebuild is done. A rebuild
//! that fails after a good one leaves the last index answering (with a warning in the log).
//! With an encoder, the first build over the fleet's tools embeds every text (minutes for a
//! large catalog with the larger model, unless `--state-dir` kept their vectors): requests wait
//! for it at most two seconds from the first one, then are answered by words alone (`ranker`
//! `lexical`) until it is done. A request answers one match per tool name (its best
//! definition).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use tonic::Status;
use toolsrv_find::{Doc, Encoder, FindError, Index, Updated, VectorStore};
use toolsrv_proto::v1::{
    FindToolsRequest, FindToolsResponse, ToolDefinition, ToolMatch, WaitsForApproval,
};

use crate::State;
use crate::embeds::{Budget, Spent};
use crate::fleet::HostEntry;
use crate::policy::{Policy, Reach};
use crate::selector::Selector;
use crate::views::{StoredTool, StoredView};

/// Matches returned when the request asks for 0.
const DEFAULT_LIMIT: u32 = 5;
/// Most matches a request may ask for.
const MAX_LIMIT: u32 = 1000;
/// Longest selector a request may give.
const MAX_SELECTOR_BYTES: usize = 4096;
/// The most an answer takes encoded: half a message, as a session's state. Many matches that
/// each list thousands of hosts pass it (1,000 matches on 10,000 hosts are 110 MB), and a list
/// of short host names takes up to about fourteen times its size once decoded, within what
/// receivers take (`toolsrv_proto::limits::MAX_DECODED_BYTES`).
pub const MAX_ANSWER_BYTES: usize = toolsrv_proto::limits::MAX_MESSAGE_BYTES / 2;
/// How long requests wait for the first build with an encoder, from the first request on, before
/// they are answered by words alone: a small catalog is embedded within it, a large one (minutes
/// with the larger encoder and nothing kept) is not waited for.
const FIRST_BUILD_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// Where in the state directory the encoder's vectors are kept.
pub const VECTORS_DIR: &str = "find-vectors";
/// A document: the tool's name and a digest of the texts ranked.
type DocKey = (String, u64);

/// The index a request is answered from.
struct Ready {
    index: Arc<Index<DocKey>>,
    /// `fused` or `lexical`, as the answer says it.
    ranker: &'static str,
    /// Ranked by words alone until the first build with the encoder is done.
    meaning_pending: bool,
}

/// The index and what it was built from.
#[derive(Debug)]
pub struct Finder {
    index: Arc<Index<DocKey>>,
    /// The fleet's `views_stored` when the index was last built; `None` before the first build.
    built: tokio::sync::Mutex<Option<u64>>,
    /// With an encoder, until `index` is first built: the same documents ranked by words only,
    /// which answer meanwhile (the first build embeds every text: minutes for a large catalog
    /// with the larger encoder and nothing kept in `--state-dir`). Dropped once `index` is in
    /// (a request still ranking on it holds its own `Arc`).
    words: std::sync::RwLock<Option<Arc<Index<DocKey>>>>,
    /// The fleet's `views_stored` when `words` was last built.
    words_built: tokio::sync::Mutex<Option<u64>>,
    /// Asks [`follow_views`] for a build now: a request came before the first one.
    kick: tokio::sync::Notify,
    /// Whether the index was ever built, for requests waiting on the first build.
    first_built: tokio::sync::watch::Sender<bool>,
    /// Until when requests wait for the first build: [`FIRST_BUILD_WAIT`] after the first
    /// request, so that a long build costs each later request nothing.
    first_wait_until: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Each document's description, for the answer.
    descriptions: std::sync::RwLock<HashMap<DocKey, String>>,
    /// Whether an index was ever built: then a request need not wait for a rebuild.
    has_index: std::sync::atomic::AtomicBool,
    /// Searches run at once: one per CPU (a search is CPU-bound; more at once only add
    /// threads and memory). A permit is held until the search's thread is done, even when its
    /// client went away meanwhile.
    searches: Arc<tokio::sync::Semaphore>,
    /// One search at a time per client, taken before a CPU's permit: a client's requests wait
    /// for one another, not ahead of other clients' (eight requests of 4 KB, at most 0.9 s
    /// each through a large encoder, held another client's request of ten characters for 5 s
    /// in a queue of all requests in order).
    turns: Arc<Turns>,
    /// Requests in progress per client name.
    in_flight: Arc<crate::quota::PerClient>,
    /// The most requests one client may have in progress ([`crate::Limits::finds_per_client`]);
    /// more are refused at once with RESOURCE_EXHAUSTED.
    per_client: usize,
    /// What the encoder may embed of each host's own tools.
    budget: Arc<std::sync::Mutex<Budget>>,
    /// Tools of hosts' own the last build left out, their hosts' budgets spent.
    deferred: std::sync::atomic::AtomicUsize,
    /// When [`follow_views`] builds again for tools left out.
    retry_at: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Tells [`follow_views`] that `retry_at` changed.
    retry_changed: tokio::sync::Notify,
}

impl Finder {
    /// With `encoder` and `state_dir`, the vectors of the tools' texts are kept in
    /// `state_dir/find-vectors` ([`toolsrv_find::VectorStore`]): a restart embeds only what
    /// changed meanwhile. A store that cannot be used is logged, and the index works without.
    pub fn new(
        encoder: Option<Arc<Encoder>>,
        state_dir: Option<&std::path::Path>,
        per_client: usize,
        host_only_embeds_per_hour: usize,
    ) -> Self {
        let store = match (&encoder, state_dir) {
            (Some(encoder), Some(dir)) => {
                match VectorStore::open(&dir.join(VECTORS_DIR), encoder) {
                    Ok(store) => Some(store),
                    Err(e) => {
                        tracing::warn!(error = %e, "the tools' vectors will not be kept across restarts");
                        None
                    }
                }
            }
            _ => None,
        };
        let words = encoder.is_some().then(|| Arc::new(Index::new(None)));
        let mut index = Index::new(encoder);
        if let Some(store) = store {
            index = index.with_store(store);
        }
        Self {
            index: Arc::new(index),
            built: tokio::sync::Mutex::new(None),
            words: std::sync::RwLock::new(words),
            words_built: tokio::sync::Mutex::new(None),
            kick: tokio::sync::Notify::new(),
            first_built: tokio::sync::watch::Sender::new(false),
            first_wait_until: std::sync::Mutex::new(None),
            descriptions: std::sync::RwLock::new(HashMap::new()),
            has_index: std::sync::atomic::AtomicBool::new(false),
            searches: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )),
            turns: Arc::default(),
            in_flight: Arc::default(),
            per_client: per_client.max(1),
            budget: Arc::new(std::sync::Mutex::new(Budget::new(
                host_only_embeds_per_hour,
            ))),
            deferred: std::sync::atomic::AtomicUsize::new(0),
            retry_at: std::sync::Mutex::new(None),
            retry_changed: tokio::sync::Notify::new(),
        }
    }

    /// Counts a request of `client` in, unless it already has the most it may have in
    /// progress.
    fn admit(&self, client: &str) -> Result<crate::quota::Held, Status> {
        let limit = self.per_client;
        self.in_flight.hold(client, limit).map_err(|n| {
            Status::resource_exhausted(format!(
                "{n} FindTools requests of this client are in progress, the most one client may \
                 have at once ({limit}, the coordinator's --max-finds-per-client): wait for their \
                 answers"
            ))
        })
    }

    /// The index to answer from, and its ranker. Rebuilds the index if views were stored since
    /// the last build, unless a rebuild is under way and an earlier index can answer meanwhile.
    /// Until the first build with an encoder over the fleet's tools is done, that build is asked
    /// for in the background and waited for until [`FIRST_BUILD_WAIT`] after the first request;
    /// after that the words-only index answers (brought up to date first: milliseconds).
    async fn ready(&self, state: &State) -> Result<Ready, Status> {
        let words = self.words.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(words) = words {
            self.kick.notify_one();
            let mut built = self.first_built.subscribe();
            let until = *self
                .first_wait_until
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| tokio::time::Instant::now() + FIRST_BUILD_WAIT);
            let first = async { built.wait_for(|b| *b).await.is_ok() };
            if tokio::time::timeout_at(until, first).await != Ok(true) {
                self.refresh_words(state, &words).await?;
                // With no tool at all there is nothing a ranking by meaning would find either.
                let meaning_pending = !words.is_empty();
                return Ok(Ready {
                    index: words,
                    ranker: RANKER_LEXICAL,
                    meaning_pending,
                });
            }
        }
        self.ready_index(state).await?;
        Ok(Ready {
            index: self.index.clone(),
            ranker: self.ranker(),
            meaning_pending: false,
        })
    }

    async fn ready_index(&self, state: &State) -> Result<(), Status> {
        let has_index = || self.has_index.load(std::sync::atomic::Ordering::Acquire);
        match self.built.try_lock() {
            Ok(built) => match self.refresh_locked(state, built, false).await {
                // The last index still answers: better than no answer, and the failure is
                // in the log (the next request tries the rebuild again).
                Err(e) if has_index() => {
                    tracing::warn!(error = %e.message(), "answering FindTools from the last tool index");
                    Ok(())
                }
                done => done,
            },
            Err(_) if has_index() => Ok(()),
            Err(_) => self.refresh(state, false).await,
        }
    }

    /// Documents in the index now.
    pub fn documents(&self) -> usize {
        self.index.len()
    }

    /// Tools of hosts' own the last build left out until their hosts' budgets allow embedding
    /// them.
    pub fn deferred(&self) -> usize {
        self.deferred.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The ranker answers are made by.
    pub fn ranker(&self) -> &'static str {
        if self.index.has_encoder() {
            RANKER_FUSED
        } else {
            RANKER_LEXICAL
        }
    }

    /// Rebuilds the index when views were stored since the last build, or with `force` (to
    /// take tools the last build left out).
    async fn refresh(&self, state: &State, force: bool) -> Result<(), Status> {
        self.refresh_locked(state, self.built.lock().await, force)
            .await
    }

    /// Rebuilds the words-only index when views were stored since its last build.
    async fn refresh_words(&self, state: &State, words: &Arc<Index<DocKey>>) -> Result<(), Status> {
        let mut built = self.words_built.lock().await;
        let now = state.fleet.views_stored();
        if *built == Some(now) {
            return Ok(());
        }
        let (docs, descriptions) = documents(state);
        self.descriptions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .extend(descriptions);
        let words = words.clone();
        updated(tokio::task::spawn_blocking(move || words.update(docs)).await)?;
        *built = Some(now);
        Ok(())
    }

    /// Rebuilds the index when views were stored since the last build, or with `force` (to
    /// take tools the last build left out).
    async fn refresh_locked(
        &self,
        state: &State,
        mut built: tokio::sync::MutexGuard<'_, Option<u64>>,
        force: bool,
    ) -> Result<(), Status> {
        let now = state.fleet.views_stored();
        if *built == Some(now) && !force {
            return Ok(());
        }
        let (docs, descriptions) = documents(state);
        let owners = match self.index.has_encoder() {
            true => owners(state),
            false => HashMap::new(),
        };
        tracing::debug!(docs = docs.len(), "rebuilding the tool index");
        // Requests answered while the index is swapped must find the descriptions of both
        // sets: the new ones are added now, the old ones dropped once the new index is in.
        self.descriptions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .extend(descriptions.iter().map(|(k, v)| (k.clone(), v.clone())));
        let index = self.index.clone();
        let budget = self.budget.clone();
        let started = std::time::Instant::now();
        // Embedding new texts runs a model: not on the runtime's threads. A build follows a burst
        // of views (decoded, interned, their copies freed) and, with an encoder, allocates and
        // frees a great deal on the encoder's threads: what the allocator keeps of both is given
        // back once it is done.
        let joined = tokio::task::spawn_blocking(move || {
            let mut budget = budget.lock().unwrap_or_else(|p| p.into_inner());
            let mut round = budget.round(std::time::Instant::now());
            let updated = index.update_admitting(docs, |key, texts| {
                round.admit(owners.get(key).map_or(&[], Vec::as_slice), texts)
            });
            let spent = round.finish();
            crate::heap::give_back();
            (updated, spent)
        })
        .await;
        let (result, spent) = match joined {
            Ok((result, spent)) => (Ok(result), Some(spent)),
            Err(e) => (Err(e), None),
        };
        if let Some(spent) = spent {
            self.spent(spent);
        }
        let updated = updated(result);
        state
            .metrics
            .index_built(updated.as_ref().ok(), started.elapsed());
        let updated = updated?;
        if let Some(problem) = &updated.store_problem {
            tracing::warn!(error = %problem, "cannot use the kept vectors of the tools' texts; the texts it lacked were embedded");
        }
        if updated.stored > 0 {
            tracing::info!(
                stored = updated.stored,
                embedded = updated.embedded,
                "tool index built from the vectors kept by an earlier run"
            );
        }
        tracing::debug!(
            docs = updated.docs,
            embedded = updated.embedded,
            reused = updated.reused,
            stored = updated.stored,
            deferred = updated.deferred,
            "tool index rebuilt"
        );
        *built = Some(now);
        self.has_index
            .store(true, std::sync::atomic::Ordering::Release);
        // Requests go to the index from now on, and the words-only one is not needed again, once
        // it holds tools: a build before any view came (at start, agents attach before their
        // views arrive) leaves the catalog's first embedding still to come.
        let mut words = self.words.write().unwrap_or_else(|p| p.into_inner());
        if updated.docs > 0 && words.take().is_some() {
            self.first_built.send_replace(true);
            tracing::info!(
                docs = updated.docs,
                "FindTools ranks by meaning from now on"
            );
        }
        let mut known = self.descriptions.write().unwrap_or_else(|p| p.into_inner());
        if words.is_some() {
            // The words-only index still answers, from descriptions of its own documents.
            known.extend(descriptions);
        } else {
            *known = descriptions;
        }
        Ok(())
    }

    /// Logs whose own tools a build left out or took again, and when to build again for them.
    fn spent(&self, spent: Spent) {
        let per_hour = self
            .budget
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .per_hour();
        for (host, tools) in &spent.started {
            tracing::warn!(
                host = %host,
                tools,
                "the host's own tools bring more new texts than the encoder embeds for one host \
                 ({per_hour} an hour, --max-host-only-embeds-per-hour): {tools} of them are left \
                 out of FindTools (still listed and callable) until the host's budget refills"
            );
        }
        for host in &spent.cleared {
            tracing::info!(host = %host, "FindTools finds every tool of the host's own again");
        }
        self.deferred
            .store(spent.deferred, std::sync::atomic::Ordering::Relaxed);
        *self.retry_at.lock().unwrap_or_else(|p| p.into_inner()) = spent
            .retry_in
            .map(|wait| tokio::time::Instant::now() + wait);
        self.retry_changed.notify_one();
    }
}

/// What an index update run on a blocking thread did, or why it failed, as the request's error.
fn updated(
    joined: Result<Result<Updated, FindError>, tokio::task::JoinError>,
) -> Result<Updated, Status> {
    joined
        .map_err(|e| Status::internal(format!("the tool index update failed: {e}")))?
        .map_err(|e| Status::internal(format!("cannot index the tools: {e}")))
}

/// Every distinct definition of the fleet's views as a document, and each one's description.
fn documents(state: &State) -> (Vec<(DocKey, Doc)>, HashMap<DocKey, String>) {
    let mut docs = Vec::new();
    let mut descriptions = HashMap::new();
    for def in state.fleet.definitions() {
        let key = key_of(&def);
        if descriptions.contains_key(&key) {
            continue;
        }
        descriptions.insert(key.clone(), def.description.clone());
        docs.push((key, doc_of(&def)));
    }
    (docs, descriptions)
}

/// Keeps the index current in the background, so that a request after a catalog change does not
/// wait for the encoder: a rebuild once views stop changing for a moment, and another when a
/// host whose tools of its own a build left out ([`crate::embeds`]) can pay for one of them.
pub async fn follow_views(state: Arc<State>) {
    /// Views of one catalog change arrive from every host within moments: one rebuild for all.
    const SETTLE: std::time::Duration = std::time::Duration::from_millis(500);
    let mut events = state.fleet.subscribe();
    loop {
        let finder = &state.finder;
        let retry_at = *finder.retry_at.lock().unwrap_or_else(|p| p.into_inner());
        let retry = async {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let (settle, force) = tokio::select! {
            () = state.shutdown.cancelled() => return,
            () = finder.kick.notified() => (false, false),
            () = finder.retry_changed.notified() => continue,
            () = retry => (false, true),
            event = events.recv() => match event {
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => (true, false),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        };
        if settle {
            tokio::select! {
                () = state.shutdown.cancelled() => return,
                () = tokio::time::sleep(SETTLE) => {}
            }
        }
        while events.try_recv().is_ok() {}
        if let Err(e) = finder.refresh(&state, force).await {
            tracing::warn!(error = %e.message(), "cannot keep the tool index current; FindTools will retry");
        }
    }
}

/// The hosts that offer each document as a tool of their own, sorted; a document some host
/// offers as the catalog's has none (the catalog's tools are always embedded).
fn owners(state: &State) -> HashMap<DocKey, Vec<String>> {
    let views = by_view(state.fleet.views());
    // Each definition keyed once, however many views have it.
    let mut keys: HashMap<*const ToolDefinition, DocKey> = HashMap::new();
    let mut owners: HashMap<DocKey, Vec<String>> = HashMap::new();
    let mut shipped: HashSet<DocKey> = HashSet::new();
    for (view, ids) in &views {
        for tool in &view.tools {
            let Some(def) = tool.offered() else { continue };
            let key = keys
                .entry(Arc::as_ptr(def))
                .or_insert_with(|| key_of(def))
                .clone();
            if tool.host_only {
                owners.entry(key).or_default().extend(ids.iter().cloned());
            } else {
                shipped.insert(key);
            }
        }
    }
    owners.retain(|key, _| !shipped.contains(key));
    for hosts in owners.values_mut() {
        hosts.sort_unstable();
        hosts.dedup();
    }
    owners
}

/// Each distinct view of `hosts` (id, view) with the ids of those that have it: hosts alike share
/// their view, so a walk over the result meets each view (and its definitions) once however many
/// hosts have it.
fn by_view(
    hosts: impl IntoIterator<Item = (String, Arc<StoredView>)>,
) -> Vec<(Arc<StoredView>, Vec<String>)> {
    let mut at: HashMap<*const StoredView, usize> = HashMap::new();
    let mut views: Vec<(Arc<StoredView>, Vec<String>)> = Vec::new();
    for (id, view) in hosts {
        let i = *at.entry(Arc::as_ptr(&view)).or_insert_with(|| {
            views.push((view, Vec::new()));
            views.len() - 1
        });
        views[i].1.push(id);
    }
    views
}

/// The texts ranked, as the index takes them.
fn doc_of(def: &ToolDefinition) -> Doc {
    Doc {
        name: def.name.clone(),
        description: def.description.clone(),
        prompt: def.prompt.clone(),
        keywords: def.keywords.clone(),
    }
}

/// A definition's document key: two definitions that rank the same share it.
fn key_of(def: &ToolDefinition) -> DocKey {
    // Keyed the same in every process, so a key never depends on when it was made.
    let mut hasher = std::hash::DefaultHasher::new();
    (&def.description, &def.prompt, &def.keywords).hash(&mut hasher);
    (def.name.clone(), hasher.finish())
}

/// Ranks the tools visible on the online hosts `req.selector` picks against `req.query`, for
/// `client` (at most [`crate::Limits::finds_per_client`] of its requests at once).
pub async fn find(
    state: &State,
    client: &str,
    req: FindToolsRequest,
) -> Result<FindToolsResponse, Status> {
    if req.query.len() > toolsrv_find::MAX_QUERY_BYTES {
        return Err(Status::invalid_argument(format!(
            "the request is {} bytes, over the limit of {}",
            req.query.len(),
            toolsrv_find::MAX_QUERY_BYTES
        )));
    }
    if req.selector.len() > MAX_SELECTOR_BYTES {
        return Err(Status::invalid_argument(format!(
            "the selector is {} bytes, over the limit of {MAX_SELECTOR_BYTES}",
            req.selector.len()
        )));
    }
    let limit = limit_of(&req)?;
    let selector = Selector::parse(&req.selector).map_err(|e| {
        Status::invalid_argument(format!(
            "host selector `{}`: {e}",
            crate::selector::shown(&req.selector)
        ))
    })?;
    let finder = &state.finder;
    let _counted = finder.admit(client)?;
    let Ready {
        index,
        ranker,
        meaning_pending,
    } = finder.ready(state).await?;

    let offered = Offered::on(state, &selector, client);
    let visible = offered.visible.clone();
    let query = req.query;
    let candidates = visible.len();
    let turn = finder.turns.take(client).await;
    let permit = finder
        .searches
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| Status::unavailable("the coordinator is shutting down"))?;
    let hits = tokio::task::spawn_blocking(move || {
        let (_turn, _permit) = (turn, permit);
        index.search(&query, candidates.max(1), |k| visible.contains(k))
    })
    .await
    .map_err(|e| Status::internal(format!("the tool search failed: {e}")))?
    .map_err(|e| Status::invalid_argument(e.to_string()))?;

    let descriptions = finder
        .descriptions
        .read()
        .unwrap_or_else(|p| p.into_inner());
    let mut seen = BTreeSet::new();
    let mut matches = Vec::new();
    for hit in hits {
        let (name, _) = &hit.key;
        // Hits come best first: the first of a name is its best definition.
        if !seen.insert(name.clone()) {
            continue;
        }
        let Where {
            hosts,
            host_only,
            approvals,
        } = offered.hosts_of(name);
        matches.push(ToolMatch {
            name: name.clone(),
            score: hit.score,
            description: descriptions.get(&hit.key).cloned().unwrap_or_default(),
            hosts,
            lexical_score: hit.lexical,
            semantic_score: hit.semantic,
            host_only,
            approvals,
        });
        if matches.len() == limit {
            break;
        }
    }
    let mut answer = FindToolsResponse {
        matches,
        ranker: ranker.to_string(),
        catalog_revision: state.fleet.revision(),
        meaning_pending,
        matches_left_out: 0,
    };
    fit(&mut answer);
    Ok(answer)
}

/// Keeps `answer` within [`MAX_ANSWER_BYTES`]: the matches past it, the last ones, are left out
/// and counted in `matches_left_out`. The best match is kept whatever its size: alone, it fits a
/// message (a tool's hosts are at most the fleet's, its definition at most a `.meta`'s).
fn fit(answer: &mut FindToolsResponse) {
    use prost::Message;
    let matches = std::mem::take(&mut answer.matches);
    let mut size = answer.encoded_len();
    let total = matches.len();
    for m in matches {
        let len = m.encoded_len();
        size += 1 + prost::length_delimiter_len(len) + len;
        if size > MAX_ANSWER_BYTES && !answer.matches.is_empty() {
            break;
        }
        answer.matches.push(m);
    }
    let left_out = u32::try_from(total - answer.matches.len()).unwrap_or(u32::MAX);
    answer.matches_left_out = answer.matches_left_out.saturating_add(left_out);
}

/// The most matches `req` asks for.
pub fn limit_of(req: &FindToolsRequest) -> Result<usize, Status> {
    match req.limit {
        0 => Ok(DEFAULT_LIMIT as usize),
        n if n > MAX_LIMIT => Err(Status::invalid_argument(format!(
            "a limit of {n} is over the most of {MAX_LIMIT}"
        ))),
        n => Ok(n as usize),
    }
}

/// This replica's answer and the other replicas' (each ranking the hosts it holds) as one: a
/// tool found by several keeps the hosts of all, and the match (score, description) of the
/// strongest ranker that found it, the best score among equals; at most `limit`, best first.
/// Each replica's best `limit` are enough to hold the best `limit` of all.
///
/// Best first means by score when every match was ranked alike. Scores of different rankers
/// are not comparable (a replica without an encoder ranks by words alone, and so does one whose
/// first build is not done), so when the matches come from different rankers the answers are
/// interleaved instead: each tool goes by its best place in any answer, then by the strength of
/// its ranker, then by score; `ranker` is then `mixed`.
pub fn merge(
    mut local: FindToolsResponse,
    others: Vec<FindToolsResponse>,
    limit: usize,
) -> FindToolsResponse {
    // Per tool: its match, its ranker's strength and its best place in any answer.
    let mut by_name: HashMap<String, (ToolMatch, u8, usize)> = HashMap::new();
    let mut rankers: BTreeSet<String> = BTreeSet::new();
    let answers = std::iter::once((std::mem::take(&mut local.matches), local.ranker.clone()))
        .chain(others.iter().map(|o| (o.matches.clone(), o.ranker.clone())));
    for (found, ranker) in answers {
        if !found.is_empty() {
            rankers.insert(ranker.clone());
        }
        let strength = ranker_strength(&ranker);
        for (place, m) in found.into_iter().enumerate() {
            match by_name.get_mut(&m.name) {
                None => {
                    by_name.insert(m.name.clone(), (m, strength, place));
                }
                Some((kept, kept_strength, best_place)) => {
                    let hosts = std::mem::take(&mut kept.hosts);
                    let approvals = std::mem::take(&mut kept.approvals);
                    let host_only = kept.host_only || m.host_only;
                    if (strength, m.score) > (*kept_strength, kept.score) {
                        *kept = m.clone();
                        *kept_strength = strength;
                    }
                    kept.host_only = host_only;
                    *best_place = (*best_place).min(place);
                    let all: BTreeSet<String> = hosts.into_iter().chain(m.hosts).collect();
                    kept.hosts = all.into_iter().collect();
                    kept.approvals = merged_approvals(approvals, m.approvals);
                }
            }
        }
    }
    let mut matches: Vec<(ToolMatch, u8, usize)> = by_name.into_values().collect();
    let mixed = rankers.len() > 1;
    matches.sort_by(|(a, a_strength, a_place), (b, b_strength, b_place)| {
        let by_place = if mixed {
            a_place.cmp(b_place).then(b_strength.cmp(a_strength))
        } else {
            std::cmp::Ordering::Equal
        };
        by_place
            .then_with(|| b.score.total_cmp(&a.score))
            .then_with(|| a.name.cmp(&b.name))
    });
    local.matches = matches.into_iter().take(limit).map(|(m, ..)| m).collect();
    if mixed {
        local.ranker = RANKER_MIXED.into();
    } else if let Some(only) = rankers.into_iter().next() {
        local.ranker = only;
    }
    local.catalog_revision = others
        .iter()
        .map(|o| o.catalog_revision)
        .fold(local.catalog_revision, u64::max);
    local.meaning_pending |= others.iter().any(|o| o.meaning_pending);
    // What a replica left out is not here either: at least the most any left out.
    local.matches_left_out = others
        .iter()
        .map(|o| o.matches_left_out)
        .fold(local.matches_left_out, u32::max)
        .min(u32::try_from(limit.saturating_sub(local.matches.len())).unwrap_or(u32::MAX));
    fit(&mut local);
    local
}

/// Two replicas' approval groups of one tool as one: a group per distinct approvers, with the
/// hosts of both (each replica answers for the hosts it holds), sorted.
fn merged_approvals(
    mut kept: Vec<WaitsForApproval>,
    more: Vec<WaitsForApproval>,
) -> Vec<WaitsForApproval> {
    for group in more {
        for host in group.hosts {
            crate::policy::wait_on(&mut kept, group.approvers.clone(), &host);
        }
    }
    for group in &mut kept {
        group.hosts.sort_unstable();
        group.hosts.dedup();
    }
    kept
}

/// `ranker` of an answer ranked by words and by meaning (with an encoder).
pub const RANKER_FUSED: &str = "fused";
/// `ranker` of an answer ranked by words alone.
pub const RANKER_LEXICAL: &str = "lexical";
/// `ranker` of a merged answer whose matches come from different rankers.
pub const RANKER_MIXED: &str = "mixed";

/// How much a ranker's order is trusted over another's: by meaning and words over words alone;
/// a ranker this version does not know (a newer replica's) over none.
fn ranker_strength(ranker: &str) -> u8 {
    match ranker {
        RANKER_FUSED => 2,
        RANKER_LEXICAL => 0,
        _ => 1,
    }
}

/// What the online hosts of `selector` offer a client: the documents visible on any host the
/// policy lets the client call them on, and each distinct view with the hosts that have it.
struct Offered {
    visible: Arc<HashSet<DocKey>>,
    views: Vec<(Arc<StoredView>, Vec<String>)>,
    /// The selected hosts, for policy rules that select hosts.
    hosts: HashMap<String, HostEntry>,
    policy: Arc<Policy>,
    client: String,
}

impl Offered {
    fn on(state: &State, selector: &Selector, client: &str) -> Self {
        let selected: Vec<HostEntry> = state
            .fleet
            .select(selector)
            .into_iter()
            .filter(|h| h.online())
            .collect();
        let views = by_view(
            selected
                .iter()
                .filter_map(|h| Some((h.id.clone(), h.view.clone()?))),
        );
        let hosts = selected.into_iter().map(|h| (h.id.clone(), h)).collect();
        let mut offered = Self {
            visible: Arc::default(),
            views,
            hosts,
            policy: state.policy.now(),
            client: client.to_string(),
        };
        // Each definition keyed once, however many views have it.
        let mut visible: HashSet<DocKey> = HashSet::new();
        let mut keyed: HashSet<*const ToolDefinition> = HashSet::new();
        for (view, ids) in &offered.views {
            for def in view.tools.iter().filter_map(StoredTool::offered) {
                if !keyed.contains(&Arc::as_ptr(def)) && offered.any_allowed(&def.name, ids) {
                    keyed.insert(Arc::as_ptr(def));
                    visible.insert(key_of(def));
                }
            }
        }
        offered.visible = Arc::new(visible);
        offered
    }

    /// Whether the client may call `tool` (at once or once approved) on one of `ids`.
    fn any_allowed(&self, tool: &str, ids: &[String]) -> bool {
        let reach = self.policy.reach(&self.client, tool);
        ids.iter().any(|id| self.allowed_on(&reach, id))
    }

    /// Whether the client may call the tool of `reach` on host `id`, looking the host up only
    /// when the answer depends on it.
    fn allowed_on(&self, reach: &Reach<'_>, id: &str) -> bool {
        reach.fixed().unwrap_or_else(|| {
            self.hosts
                .get(id)
                .is_some_and(|h| reach.on(&h.policy_facts()).is_ok())
        })
    }

    /// Where the client may call a tool named `name`: the hosts where it is visible and the
    /// policy lets the client call it, sorted, whether any of them offers it as a host-only
    /// tool, and those of them where a call waits for approval, by who decides (hosts sorted).
    fn hosts_of(&self, name: &str) -> Where {
        let reach = self.policy.reach(&self.client, name);
        let mut found = Where::default();
        for (view, ids) in &self.views {
            let Some(tool) = view.tool(name).filter(|t| t.offered().is_some()) else {
                continue;
            };
            for id in ids {
                let Some(waits) =
                    reach.waits_on(|| self.hosts.get(id).map(HostEntry::policy_facts))
                else {
                    continue;
                };
                found.host_only |= tool.host_only;
                found.hosts.push(id.clone());
                if let Some(approvers) = waits {
                    crate::policy::wait_on(&mut found.approvals, approvers, id);
                }
            }
        }
        found.hosts.sort_unstable();
        for group in &mut found.approvals {
            group.hosts.sort_unstable();
        }
        found
    }
}

/// Where a client may call a tool, as a match says it.
#[derive(Debug, Default)]
struct Where {
    hosts: Vec<String>,
    host_only: bool,
    approvals: Vec<WaitsForApproval>,
}

/// Whose turn it is to search, per client: see [`Finder::turns`].
#[derive(Debug, Default)]
struct Turns(std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

/// A client's turn to search; the next of its requests waits until this is dropped.
#[derive(Debug)]
struct Turn {
    turns: Arc<Turns>,
    client: String,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Turns {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for `client`'s turn (its earlier requests' searches done).
    async fn take(self: &Arc<Self>, client: &str) -> Turn {
        let lock = self.map().entry(client.to_string()).or_default().clone();
        Turn {
            turns: self.clone(),
            client: client.to_string(),
            held: Some(lock.lock_owned().await),
        }
    }

    #[cfg(test)]
    fn clients(&self) -> usize {
        self.map().len()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else { return };
        let lock = Arc::clone(tokio::sync::OwnedMutexGuard::mutex(&held));
        drop(held);
        let mut map = self.turns.map();
        // The map's and this one: no other request of the client holds or waits for a turn.
        if Arc::strong_count(&lock) == 2 {
            map.remove(&self.client);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's searches take turns; another client's does not wait for them, and a client
    /// with none in progress is forgotten.
    #[tokio::test]
    async fn a_client_s_searches_take_turns_and_others_do_not_wait_for_them() {
        let turns = Arc::new(Turns::default());
        let first = turns.take("alice").await;
        let waits = {
            let turns = turns.clone();
            tokio::spawn(async move { turns.take("alice").await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waits.is_finished(),
            "alice's second search waits for her first"
        );
        let bob = tokio::time::timeout(std::time::Duration::from_secs(5), turns.take("bob"))
            .await
            .expect("bob's search does not wait for alice's");
        drop(first);
        let second = tokio::time::timeout(std::time::Duration::from_secs(5), waits)
            .await
            .expect("alice's second search goes once her first is done")
            .unwrap();
        assert_eq!(turns.clients(), 2);
        drop((second, bob));
        assert_eq!(turns.clients(), 0, "nobody searching: nothing kept");
    }

    fn found(revision: u64, matches: &[(&str, f32, &[&str])]) -> FindToolsResponse {
        FindToolsResponse {
            matches: matches
                .iter()
                .map(|(name, score, hosts)| ToolMatch {
                    name: name.to_string(),
                    score: *score,
                    description: format!("{name} at {score}"),
                    hosts: hosts.iter().map(|h| h.to_string()).collect(),
                    lexical_score: None,
                    semantic_score: Some(*score),
                    host_only: false,
                    approvals: Vec::new(),
                })
                .collect(),
            ranker: "fused".into(),
            catalog_revision: revision,
            meaning_pending: false,
            matches_left_out: 0,
        }
    }

    /// 1,000 matches on 10,000 hosts (110 MB) cannot go out in a message: the answer keeps the
    /// best within its bound, counts the rest, and receivers take it; merged from replicas, so
    /// does the whole.
    #[test]
    fn an_answer_too_large_for_a_message_keeps_its_best_and_counts_the_rest() {
        use prost::Message;
        let hosts: Vec<String> = (0..10_000).map(|i| format!("web-{i:05}")).collect();
        let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let names: Vec<String> = (0..1000).map(|i| format!("tool_{i:04}")).collect();
        let matches: Vec<(&str, f32, &[&str])> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), 1.0 - i as f32 / 2000.0, hosts.as_slice()))
            .collect();
        let mut answer = found(1, &matches);
        fit(&mut answer);
        let kept = answer.matches.len();
        assert!((60..1000).contains(&kept), "{kept} kept");
        assert_eq!(answer.matches_left_out as usize, 1000 - kept);
        assert_eq!(answer.matches[0].name, "tool_0000", "the best first");
        let encoded = answer.encode_to_vec();
        assert!(encoded.len() <= MAX_ANSWER_BYTES, "{}", encoded.len());
        toolsrv_proto::cost::check::<FindToolsResponse>(&encoded).unwrap();

        // Two replicas' answers, each fitted: the merge fits too, and says at least as many
        // were left out as either did.
        let merged = merge(answer.clone(), vec![answer], 1000);
        assert!(merged.encoded_len() <= MAX_ANSWER_BYTES);
        assert_eq!(merged.matches.len(), kept);
        assert_eq!(merged.matches_left_out as usize, 1000 - kept);

        // A small answer is left whole.
        let mut small = found(1, &[("a", 0.9, &["h1"]), ("b", 0.5, &["h2"])]);
        fit(&mut small);
        assert_eq!((small.matches.len(), small.matches_left_out), (2, 0));
    }

    fn names_scores_hosts(answer: &FindToolsResponse) -> Vec<(&str, f32, Vec<&str>)> {
        answer
            .matches
            .iter()
            .map(|m| {
                (
                    m.name.as_str(),
                    m.score,
                    m.hosts.iter().map(String::as_str).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn replicas_answers_merge_by_best_score_with_every_host() {
        let local = found(7, &[("disk", 0.9, &["a1"]), ("logs", 0.5, &["a1", "a2"])]);
        let others = vec![
            found(7, &[("logs", 0.6, &["b1"]), ("ping", 0.4, &["b2"])]),
            found(8, &[("ports", 0.95, &["c1"]), ("disk", 0.2, &["c1", "a1"])]),
            found(7, &[]),
        ];
        let merged = merge(local, others, 4);
        let got = names_scores_hosts(&merged);
        assert_eq!(
            got,
            vec![
                ("ports", 0.95, vec!["c1"]),
                ("disk", 0.9, vec!["a1", "c1"]),
                ("logs", 0.6, vec!["a1", "a2", "b1"]),
                ("ping", 0.4, vec!["b2"]),
            ]
        );
        // The best ranking's description goes with its score.
        assert_eq!(merged.matches[2].description, "logs at 0.6");
        assert_eq!(merged.catalog_revision, 8);
        assert_eq!(merged.ranker, "fused");
        assert!(!merged.meaning_pending);

        let few = merge(
            found(7, &[("disk", 0.9, &["a1"])]),
            vec![found(7, &[("ping", 0.4, &["b2"])])],
            1,
        );
        assert_eq!(few.matches.len(), 1);
        assert_eq!(few.matches[0].name, "disk");
    }

    fn by_words(mut answer: FindToolsResponse) -> FindToolsResponse {
        answer.ranker = "lexical".into();
        answer.meaning_pending = true;
        for m in &mut answer.matches {
            m.lexical_score = m.semantic_score.take();
        }
        answer
    }

    #[test]
    fn a_tool_host_only_in_any_answer_stays_marked_whichever_match_is_kept() {
        // Replicas on different catalog revisions: one ships `mine`, the other's host offers
        // its own. The stronger match is the shipped one; the mark must not be lost with it.
        let local = found(7, &[("mine", 0.9, &["a1"])]);
        let mut other = found(8, &[("mine", 0.3, &["b1"])]);
        other.matches[0].host_only = true;
        let merged = merge(local, vec![other], 5);
        assert_eq!(merged.matches.len(), 1);
        assert!(merged.matches[0].host_only);
        assert_eq!(merged.matches[0].score, 0.9);
        assert_eq!(merged.matches[0].hosts, ["a1", "b1"]);
    }

    fn waits(approvers: &[&str], hosts: &[&str]) -> WaitsForApproval {
        WaitsForApproval {
            approvers: approvers.iter().map(|a| a.to_string()).collect(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
        }
    }

    #[test]
    fn each_replica_s_approvals_are_kept_whichever_match_is_kept() {
        // Each replica says where calls wait for its own hosts: the weaker match's must not be
        // lost with it, and the same approvers make one group.
        let mut local = found(7, &[("restart", 0.9, &["a1", "a2", "a3"])]);
        local.matches[0].approvals =
            vec![waits(&["oncall-*"], &["a2"]), waits(&["caller"], &["a3"])];
        let mut other = found(7, &[("restart", 0.4, &["b1", "b2"])]);
        other.matches[0].approvals = vec![waits(&["lead"], &["b2"]), waits(&["oncall-*"], &["b1"])];
        let merged = merge(
            local,
            vec![other, found(7, &[("restart", 0.1, &["c1"])])],
            5,
        );
        assert_eq!(merged.matches.len(), 1);
        assert_eq!(merged.matches[0].score, 0.9);
        assert_eq!(
            merged.matches[0].approvals,
            [
                waits(&["oncall-*"], &["a2", "b1"]),
                waits(&["caller"], &["a3"]),
                waits(&["lead"], &["b2"]),
            ]
        );
    }

    #[test]
    fn answers_of_different_rankers_are_interleaved_not_compared_by_score() {
        // A replica ranking by words alone scores its best far higher than the fused ones:
        // compared by score, its whole list would come before every match by meaning.
        let local = found(7, &[("disk", 0.6, &["a1"]), ("logs", 0.5, &["a1"])]);
        let words = by_words(found(
            7,
            &[
                ("ping", 1.0, &["b1"]),
                ("ports", 0.9, &["b1"]),
                ("logs", 0.8, &["b1"]),
            ],
        ));
        let merged = merge(local, vec![words], 5);
        let got = names_scores_hosts(&merged);
        assert_eq!(
            got,
            vec![
                // First places: the fused answer's before the words-only one's.
                ("disk", 0.6, vec!["a1"]),
                ("ping", 1.0, vec!["b1"]),
                // logs is second in the fused answer (third by words): it keeps the fused
                // match, whose score is the lower one, and both hosts.
                ("logs", 0.5, vec!["a1", "b1"]),
                ("ports", 0.9, vec!["b1"]),
            ]
        );
        assert_eq!(merged.matches[2].description, "logs at 0.5");
        assert_eq!(merged.ranker, RANKER_MIXED);
        // One replica's build still to come is said in the merged answer.
        assert!(merged.meaning_pending);

        // An empty answer ranks nothing: the matches are all by meaning, ordered by score.
        let merged = merge(
            by_words(found(7, &[])),
            vec![found(7, &[("disk", 0.3, &["b1"]), ("logs", 0.7, &["b1"])])],
            5,
        );
        assert_eq!(merged.ranker, "fused");
        assert_eq!(merged.matches[0].name, "logs");
        // All by words: by score, and said so.
        let merged = merge(
            by_words(found(7, &[("disk", 0.4, &["a1"])])),
            vec![by_words(found(7, &[("logs", 0.9, &["b1"])]))],
            5,
        );
        assert_eq!(merged.ranker, "lexical");
        assert_eq!(merged.matches[0].name, "logs");

        // A ranker this version does not know (a newer replica's, or one with an odd name):
        // interleaved, trusted less than by meaning and more than by words alone.
        let mut newer = found(7, &[("ping", 0.99, &["c1"]), ("disk", 0.98, &["c1"])]);
        newer.ranker = "re-ranked\u{0}\u{fffd}".into();
        let merged = merge(
            found(7, &[("logs", 0.2, &["a1"])]),
            vec![newer, by_words(found(7, &[("ports", 1.0, &["b1"])]))],
            5,
        );
        assert_eq!(merged.ranker, RANKER_MIXED);
        let names: Vec<&str> = merged.matches.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["logs", "ping", "ports", "disk"]);
    }
}
