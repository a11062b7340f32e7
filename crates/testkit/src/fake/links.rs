//! The network part of the fake agents: one real mutual-TLS agent link per host, each driven
//! by its [`Responder`], many from one process.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustls::ClientConfig;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use toolsrv_proto::v1::AgentMessage;
use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_tls::{Identity, Role, TlsFiles};

use super::responder::{Answer, Definitions, Reaction, Responder};
use crate::error::{Result, TestkitError};

/// The host id of fake agent `i`: `fake-0000`, `fake-0001`, ...
pub fn fake_id(i: usize) -> String {
    format!("fake-{i:04}")
}

/// Holds calls back until opened; clones share one gate.
#[derive(Debug, Clone)]
pub struct Gate(Arc<watch::Sender<bool>>);

impl Gate {
    /// A closed gate.
    pub fn closed() -> Self {
        Self(Arc::new(watch::Sender::new(false)))
    }

    /// Lets every held call (and every later one) through.
    pub fn open(&self) {
        self.0.send_replace(true);
    }

    /// Holds later calls again (the ones let through stay through).
    pub fn close(&self) {
        self.0.send_replace(false);
    }

    async fn opened(&self) {
        let mut open = self.0.subscribe();
        // Err only when the sender is gone, which cannot happen while `self` holds it.
        let _ = open.wait_for(|o| *o).await;
    }
}

/// How one fake host behaves.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    pub definitions: Definitions,
    pub answer: Answer,
    /// When set, each call's first answer waits until this gate opens.
    pub hold: Option<Gate>,
    /// Says `counts_chunk_overhead` in its Hello and spends each chunk's overhead, as a real
    /// agent does; unset, it spends credit on data alone, as agents before that did.
    pub counts_chunk_overhead: bool,
}

/// Counters shared by every link of a set of fake agents.
#[derive(Debug)]
pub struct Counters {
    /// Links that got their Welcome.
    pub welcomed: AtomicUsize,
    /// Links that sent at least one view.
    pub with_view: AtomicUsize,
    /// Calls answered to their end, over all links.
    pub calls: AtomicUsize,
    /// Calls started and not yet finished, over all links.
    pub in_flight: AtomicUsize,
    /// The most calls in flight at once.
    pub max_in_flight: AtomicUsize,
    /// `Credit` messages received, and the bytes they granted, over all links.
    pub credits: AtomicUsize,
    pub credit_bytes: AtomicU64,
    /// The smallest grant received (`u64::MAX` while none).
    pub smallest_credit: AtomicU64,
    /// Links that ended (error, goodbye or stop); a reconnecting link counts only its last end.
    pub ended: AtomicUsize,
    /// Links whose current session has reported its view (falls when a session ends).
    pub synced: AtomicUsize,
    /// Sessions that ended, counting every session of a reconnecting link.
    pub sessions_ended: AtomicUsize,
    /// Connection attempts of reconnecting links that failed (TCP, TLS or the Attach call).
    pub failed_connects: AtomicUsize,
    /// For each catalog revision: how many sessions reported a view of it.
    pub views_of: Mutex<BTreeMap<u64, usize>>,
    /// When each host last got a Welcome, and from which URL.
    pub welcomes: Mutex<BTreeMap<String, (Instant, String)>>,
    /// How the first link that ended with an error ended, and its host.
    pub first_error: Mutex<Option<String>>,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            welcomed: AtomicUsize::new(0),
            with_view: AtomicUsize::new(0),
            calls: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            credits: AtomicUsize::new(0),
            credit_bytes: AtomicU64::new(0),
            smallest_credit: AtomicU64::new(u64::MAX),
            ended: AtomicUsize::new(0),
            synced: AtomicUsize::new(0),
            sessions_ended: AtomicUsize::new(0),
            failed_connects: AtomicUsize::new(0),
            views_of: Mutex::new(BTreeMap::new()),
            welcomes: Mutex::new(BTreeMap::new()),
            first_error: Mutex::new(None),
        }
    }
}

impl Counters {
    fn started(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
    }

    fn finished(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    /// Sessions that reported a view of catalog revision `revision`.
    pub fn views_of(&self, revision: u64) -> usize {
        let views = self.views_of.lock().unwrap_or_else(PoisonError::into_inner);
        views.get(&revision).copied().unwrap_or(0)
    }

    fn viewed(&self, revision: u64) {
        let mut views = self.views_of.lock().unwrap_or_else(PoisonError::into_inner);
        *views.entry(revision).or_default() += 1;
    }

    fn credited(&self, bytes: u64) {
        self.credits.fetch_add(1, Ordering::SeqCst);
        self.credit_bytes.fetch_add(bytes, Ordering::SeqCst);
        self.smallest_credit.fetch_min(bytes, Ordering::SeqCst);
    }
}

/// Connected (TLS and HTTP/2 up) but not yet attached fake agents.
#[derive(Debug)]
pub struct Connected {
    url: String,
    links: Vec<Link>,
}

/// One connected fake host: its id, its TLS configuration (to dial again) and its channel.
#[derive(Debug)]
struct Link {
    id: String,
    config: Arc<ClientConfig>,
    channel: tonic::transport::Channel,
}

/// How a reconnecting fake host waits before its next attempt: `delay(attempt)`, `attempt`
/// counting the sessions that ended since the last one that got a Welcome (as the real agent's
/// reconnect loop does). The bench passes the agent's own backoff and jitter.
pub type Delay = Arc<dyn Fn(u32) -> Duration + Send + Sync>;

impl Connected {
    /// Connects one channel per id to `url` with the agent certificates in `pki` (written by
    /// `toolsrv pki init --agents ...`), at most `parallel` handshakes at a time.
    pub async fn connect(url: &str, pki: &Path, ids: &[String], parallel: usize) -> Result<Self> {
        toolsrv_tls::install_crypto_provider();
        let gate = Arc::new(Semaphore::new(parallel.max(1)));
        let mut connects = JoinSet::new();
        for id in ids {
            let files = TlsFiles::in_dir(pki, &Identity::Agent(id.clone()));
            let config = toolsrv_tls::client_config(&files, Role::Coordinator)?;
            let (url, id, gate) = (url.to_string(), id.clone(), gate.clone());
            connects.spawn(async move {
                let _permit = gate.acquire_owned().await;
                let channel = toolsrv_tls::connect(&url, config.clone())
                    .await
                    .map_err(|e| TestkitError::link(&id, e))?;
                Ok::<_, TestkitError>(Link {
                    id,
                    config,
                    channel,
                })
            });
        }
        let mut links = Vec::with_capacity(ids.len());
        while let Some(joined) = connects.join_next().await {
            let link = joined.map_err(|e| TestkitError::link("?", e))??;
            links.push(link);
        }
        Ok(Self {
            url: url.to_string(),
            links,
        })
    }

    /// Opens the agent link on every connection, each host answering [`Answer::Ok`] with
    /// `definitions` in its views.
    pub fn attach(self, definitions: Definitions) -> FakeAgents {
        self.attach_with(|_| Behaviour {
            definitions,
            ..Behaviour::default()
        })
    }

    /// Opens the agent link on every connection, each host behaving as `behaviour` says for
    /// its id: Hello, and the session from then on.
    pub fn attach_with(self, behaviour: impl Fn(&str) -> Behaviour) -> FakeAgents {
        let mut agents = FakeAgents::empty();
        for link in self.links {
            let behaviour = behaviour(&link.id);
            agents.spawn(link, behaviour, None);
        }
        agents
    }

    /// Like [`Connected::attach`], but each host comes back when its link ends (the coordinator
    /// went away, said goodbye, or refused the connection): it waits `delay(attempt)`, dials
    /// again (TCP, TLS, HTTP/2, bounded as the agent's dial is) and attaches, until stopped.
    pub fn attach_reconnecting(self, definitions: Definitions, delay: Delay) -> FakeAgents {
        let urls = vec![self.url.clone()];
        self.attach_reconnecting_to(urls, definitions, delay)
    }

    /// Like [`Connected::attach_reconnecting`], with several coordinator URLs as the agent's
    /// `--coordinator A,B,C`: each host dials the URL it used last and moves on to the next one
    /// when the dial fails. `urls` should start with the URL these links are connected to.
    pub fn attach_reconnecting_to(
        self,
        urls: Vec<String>,
        definitions: Definitions,
        delay: Delay,
    ) -> FakeAgents {
        let mut agents = FakeAgents::empty();
        for link in self.links {
            let behaviour = Behaviour {
                definitions,
                ..Behaviour::default()
            };
            let redial = Redial {
                urls: urls.clone(),
                delay: delay.clone(),
            };
            agents.spawn(link, behaviour, Some(redial));
        }
        agents
    }

    /// Like [`Connected::attach`], but `batch` links at a time, each batch waiting (at most
    /// `limit` in all) until its links have reported their views: at most `batch` catalog pushes
    /// are in flight at once, instead of all of them.
    pub async fn attach_staggered(
        self,
        definitions: Definitions,
        batch: usize,
        limit: Duration,
    ) -> Result<FakeAgents> {
        let started = Instant::now();
        let mut agents = FakeAgents::empty();
        let mut links = self.links.into_iter().peekable();
        while links.peek().is_some() {
            for link in links.by_ref().take(batch.max(1)) {
                let behaviour = Behaviour {
                    definitions,
                    ..Behaviour::default()
                };
                agents.spawn(link, behaviour, None);
            }
            let left = limit.saturating_sub(started.elapsed());
            agents.wait_ready(left).await?;
        }
        Ok(agents)
    }
}

/// Many fake agents in this process, each on its own TLS connection.
#[derive(Debug)]
pub struct FakeAgents {
    pub counters: Arc<Counters>,
    stop: CancellationToken,
    tasks: JoinSet<Result<()>>,
    pub ids: Vec<String>,
}

impl FakeAgents {
    fn empty() -> Self {
        Self {
            counters: Arc::new(Counters::default()),
            stop: CancellationToken::new(),
            tasks: JoinSet::new(),
            ids: Vec::new(),
        }
    }

    fn spawn(&mut self, link: Link, behaviour: Behaviour, redial: Option<Redial>) {
        self.ids.push(link.id.clone());
        let (counters, stop) = (self.counters.clone(), self.stop.clone());
        self.tasks.spawn(async move {
            let id = link.id.clone();
            let result = run_host(link, &behaviour, redial, &counters, &stop).await;
            if let Err(e) = &result {
                let mut first = counters
                    .first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                first.get_or_insert_with(|| format!("{id}: {e}"));
            }
            counters.ended.fetch_add(1, Ordering::SeqCst);
            result
        });
    }

    /// Connects and attaches `ids.len()` fake agents that answer every call OK (see
    /// [`Connected::connect`]); returns once every link is connected (not yet welcomed: see
    /// [`FakeAgents::wait_ready`]).
    pub async fn start(url: &str, pki: &Path, ids: Vec<String>, parallel: usize) -> Result<Self> {
        Ok(Connected::connect(url, pki, &ids, parallel)
            .await?
            .attach(Definitions::FromMeta))
    }

    /// Waits (at most `limit`) until every link has been welcomed and has sent its view.
    pub async fn wait_ready(&self, limit: Duration) -> Result<Duration> {
        let started = Instant::now();
        let n = self.ids.len();
        loop {
            let views = self.counters.with_view.load(Ordering::SeqCst);
            if views >= n {
                return Ok(started.elapsed());
            }
            let ended = self.counters.ended.load(Ordering::SeqCst);
            if ended > 0 {
                let first = self
                    .counters
                    .first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .unwrap_or_else(|| "without an error".into());
                return Err(TestkitError::Failed {
                    what: "attaching the fake agents".into(),
                    detail: format!("{ended} links ended before all were ready; first {first}"),
                });
            }
            if started.elapsed() > limit {
                return Err(TestkitError::Timeout {
                    what: format!("{n} fake agents to report a view ({views} did)"),
                    limit,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Links that ended so far (should stay 0 while measuring).
    pub fn ended(&self) -> usize {
        self.counters.ended.load(Ordering::SeqCst)
    }

    /// Closes every link and waits (bounded) for the tasks; returns the first link error, if any.
    pub async fn stop(mut self) -> Option<TestkitError> {
        self.stop.cancel();
        let mut first = None;
        let drained = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(joined) = self.tasks.join_next().await {
                if let Ok(Err(e)) = joined {
                    first.get_or_insert(e);
                }
            }
        })
        .await;
        if drained.is_err() {
            self.tasks.abort_all();
        }
        first
    }
}

impl Drop for FakeAgents {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Sends `messages` in order, counting the calls they finish.
async fn send_all(
    id: &str,
    tx: &mpsc::Sender<AgentMessage>,
    messages: Vec<AgentMessage>,
    counters: &Counters,
) -> Result<()> {
    for m in messages {
        let finishes = matches!(m.msg, Some(Out::Finished(_)));
        tx.send(m)
            .await
            .map_err(|_| TestkitError::link(id, "the link's queue is closed"))?;
        if finishes {
            counters.finished();
        }
    }
    Ok(())
}

/// Where and when a reconnecting fake host dials again.
#[derive(Clone)]
struct Redial {
    /// Tried in turn, from the first.
    urls: Vec<String>,
    delay: Delay,
}

/// One fake host: its first session on `link`, then, with `redial`, a new connection and
/// session after each end, until `stop`.
async fn run_host(
    link: Link,
    behaviour: &Behaviour,
    redial: Option<Redial>,
    counters: &Arc<Counters>,
    stop: &CancellationToken,
) -> Result<()> {
    let Link {
        id,
        config,
        channel,
    } = link;
    let mut channel = Some(channel);
    let mut attempt: u32 = 0;
    let mut flags = Flags::default();
    let mut next_url = 0usize;
    loop {
        flags.welcomed = false;
        flags.synced = false;
        let url = redial
            .as_ref()
            .map(|r| r.urls[next_url % r.urls.len()].clone())
            .unwrap_or_default();
        let result = match channel.take() {
            Some(channel) => {
                let result =
                    run_link(&id, &url, channel, behaviour, counters, stop, &mut flags).await;
                if flags.synced {
                    counters.synced.fetch_sub(1, Ordering::SeqCst);
                }
                counters.sessions_ended.fetch_add(1, Ordering::SeqCst);
                result
            }
            None => Err(TestkitError::link(&id, "not connected")),
        };
        let Some(redial) = &redial else {
            return result;
        };
        if stop.is_cancelled() {
            return Ok(());
        }
        if flags.welcomed {
            attempt = 0;
        }
        let delay = (redial.delay)(attempt);
        attempt = attempt.saturating_add(1);
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.cancelled() => return Ok(()),
        }
        // The agent's dial: TCP, TLS and HTTP/2 within the same bound.
        let url = &redial.urls[next_url % redial.urls.len()];
        match toolsrv_tls::connect(url, config.clone()).await {
            Ok(c) => channel = Some(c),
            Err(_) => {
                counters.failed_connects.fetch_add(1, Ordering::SeqCst);
                next_url = next_url.wrapping_add(1);
            }
        }
    }
}

/// What a fake host's sessions have got so far.
#[derive(Debug, Default)]
struct Flags {
    /// This session got its Welcome.
    welcomed: bool,
    /// This session reported a view (counted in `Counters::synced` until it ends).
    synced: bool,
    /// Some session of this host reported a view (counted once in `Counters::with_view`).
    viewed: bool,
}

/// One fake agent's session until `stop` (or the coordinator ends it), noting in `flags` what
/// it got.
async fn run_link(
    id: &str,
    url: &str,
    channel: tonic::transport::Channel,
    behaviour: &Behaviour,
    counters: &Arc<Counters>,
    stop: &CancellationToken,
    flags: &mut Flags,
) -> Result<()> {
    let mut responder = Responder::new(id, behaviour.definitions).answering(behaviour.answer);
    if behaviour.counts_chunk_overhead {
        responder = responder.counting_chunk_overhead();
    }
    let (tx, rx) = mpsc::channel(16);
    let closed = |_| TestkitError::link(id, "the link's queue is closed");
    tx.send(responder.hello()).await.map_err(closed)?;
    let mut client = AgentLinkClient::new(channel);
    let mut inbound = match client.attach(ReceiverStream::new(rx)).await {
        Ok(response) => response.into_inner(),
        Err(e) => {
            counters.failed_connects.fetch_add(1, Ordering::SeqCst);
            return Err(TestkitError::link(id, e));
        }
    };
    let mut keepalive: Option<tokio::time::Interval> = None;
    // Calls held at the gate, each sending its answer once the gate opens.
    let mut held: JoinSet<Result<()>> = JoinSet::new();
    loop {
        let tick = async {
            match keepalive.as_mut() {
                Some(k) => {
                    k.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = tick => tx.send(Responder::keepalive()).await.map_err(closed)?,
            Some(joined) = held.join_next(), if !held.is_empty() => {
                joined.map_err(|e| TestkitError::link(id, e))??;
            }
            received = inbound.message() => {
                let Some(message) = received.map_err(|e| TestkitError::link(id, e))? else {
                    if stop.is_cancelled() {
                        return Ok(());
                    }
                    return Err(TestkitError::link(id, "the coordinator closed the link"));
                };
                let is_start = matches!(message.msg, Some(In::Start(_)));
                if is_start {
                    counters.started();
                }
                if let Some(In::Credit(credit)) = &message.msg {
                    counters.credited(credit.bytes);
                }
                match responder.react(message) {
                    Reaction::Welcomed(every) => {
                        keepalive = Some(keepalive_every(every));
                        flags.welcomed = true;
                        counters.welcomed.fetch_add(1, Ordering::SeqCst);
                        counters
                            .welcomes
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(id.to_string(), (Instant::now(), url.to_string()));
                    }
                    Reaction::Paced(every) => keepalive = Some(keepalive_every(every)),
                    Reaction::Send(messages) => match (&behaviour.hold, is_start) {
                        (Some(gate), true) => {
                            let (id, tx, gate, counters) =
                                (id.to_string(), tx.clone(), gate.clone(), counters.clone());
                            held.spawn(async move {
                                gate.opened().await;
                                send_all(&id, &tx, messages, &counters).await
                            });
                        }
                        _ => {
                            let revision = messages.iter().find_map(|m| match &m.msg {
                                Some(Out::View(v)) => Some(v.catalog_revision),
                                _ => None,
                            });
                            send_all(id, &tx, messages, counters).await?;
                            if let Some(revision) = revision {
                                counters.viewed(revision);
                                if !flags.synced {
                                    flags.synced = true;
                                    counters.synced.fetch_add(1, Ordering::SeqCst);
                                }
                                if !flags.viewed {
                                    flags.viewed = true;
                                    counters.with_view.fetch_add(1, Ordering::SeqCst);
                                }
                            }
                        }
                    },
                    Reaction::End(why) => {
                        if stop.is_cancelled() {
                            return Ok(());
                        }
                        return Err(TestkitError::link(id, why));
                    }
                }
            }
        }
    }
}

/// A keepalive timer whose first tick is one interval from now.
fn keepalive_every(every: Duration) -> tokio::time::Interval {
    let mut k = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    k.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    k
}
