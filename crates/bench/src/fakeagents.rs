//! A load generator that stands in for fleet hosts: N agent links from one process.
//!
//! Each link is a real mutual-TLS connection (its own TCP connection and handshake, with the
//! agent certificate of its host id) speaking the real agent protocol: Hello, wait for the
//! Welcome, answer every CatalogUpdate with a HostView that marks every tool visible (with a
//! definition), send a Keepalive every interval, and answer each StartCall at once with one
//! `CallOutput` (`ok\n`) and a `CallFinished` with status OK. Nothing is executed.
//!
//! [`Responder`] is the protocol core (what to answer to each coordinator message), kept free of
//! I/O so the smoke test can check it without a network.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, CallFinished, CallOutput, CallResult, CallStatus, CatalogUpdate,
    CoordinatorMessage, Hello, HostFacts, HostView, Keepalive, OutputChunk, OutputStream,
    ToolDefinition, ToolStatus,
};
use toolsrv_tls::{Identity, Role, TlsFiles};

use crate::BenchError;

/// What every fake call writes to stdout.
pub const FAKE_OUTPUT: &[u8] = b"ok\n";
/// The label every fake host carries, for selectors (`fleet=fake`).
pub const FAKE_LABEL: (&str, &str) = ("fleet", "fake");

/// What the fake agents put into the definitions of their views.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Definitions {
    /// The top-level fields of each `.meta` (description, prompt, keywords, args, tier), as a
    /// real agent reports a tool without variants: views as large as a real host's.
    #[default]
    FromMeta,
    /// A one-line description and `{"type":"object"}` only: tiny views.
    Minimal,
}

/// The protocol state of one fake agent: its host id and the tools of its catalog.
#[derive(Debug, Clone)]
pub struct Responder {
    host_id: String,
    tools: BTreeMap<String, ToolDefinition>,
    definitions: Definitions,
    welcomed: bool,
}

/// What the link should do after a coordinator message.
#[derive(Debug, Clone, PartialEq)]
pub enum Reaction {
    /// Send these messages, in order.
    Send(Vec<AgentMessage>),
    /// The Welcome: keep alive at this interval from now on.
    Welcomed(Duration),
    /// The coordinator said goodbye or broke the protocol: end the link.
    End(String),
}

impl Responder {
    pub fn new(host_id: &str, definitions: Definitions) -> Self {
        Self {
            host_id: host_id.to_string(),
            tools: BTreeMap::new(),
            definitions,
            welcomed: false,
        }
    }

    /// The first message of the link.
    pub fn hello(&self) -> AgentMessage {
        let labels = [(FAKE_LABEL.0.to_string(), FAKE_LABEL.1.to_string())];
        msg(Out::Hello(Hello {
            host_id: self.host_id.clone(),
            facts: Some(HostFacts {
                os: "linux".into(),
                arch: "amd64".into(),
                hostname: self.host_id.clone(),
                kernel: "fake".into(),
                labels: labels.into_iter().collect(),
                sandbox: None,
            }),
            agent_version: "fakeagent".into(),
            max_concurrent_calls: 64,
        }))
    }

    pub fn keepalive() -> AgentMessage {
        msg(Out::Keepalive(Keepalive {
            sent_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }))
    }

    /// The tools this host currently has in its catalog.
    pub fn tools(&self) -> impl Iterator<Item = &str> {
        self.tools.keys().map(String::as_str)
    }

    /// The answer to one coordinator message.
    pub fn react(&mut self, message: CoordinatorMessage) -> Reaction {
        match message.msg {
            Some(In::Welcome(w)) => {
                self.welcomed = true;
                let ms = match w.keepalive_interval_ms {
                    0 => 10_000,
                    ms => u64::from(ms).max(10),
                };
                Reaction::Welcomed(Duration::from_millis(ms))
            }
            _ if !self.welcomed => Reaction::End("the first message was not a Welcome".into()),
            Some(In::Catalog(update)) => Reaction::Send(self.apply(update).into_iter().collect()),
            Some(In::Start(start)) => {
                let id = start.call_id;
                let output = msg(Out::Output(CallOutput {
                    call_id: id,
                    chunk: Some(OutputChunk {
                        stream: OutputStream::Stdout as i32,
                        data: FAKE_OUTPUT.to_vec(),
                    }),
                }));
                let finished = msg(Out::Finished(CallFinished {
                    call_id: id,
                    result: Some(CallResult {
                        status: CallStatus::Ok as i32,
                        exit_code: Some(0),
                        duration_ms: 0,
                        result_json: r#"{"content":[{"type":"text","text":"ok\n"}]}"#.into(),
                        ..CallResult::default()
                    }),
                }));
                Reaction::Send(vec![output, finished])
            }
            Some(In::Goodbye(g)) => Reaction::End(format!("goodbye: {}", g.reason)),
            // Keepalives need no answer (ours go out on a timer); credit, cancels, sandbox grants
            // and bypass decisions do not matter for calls that are over as soon as they start.
            Some(
                In::Keepalive(_) | In::Credit(_) | In::Cancel(_) | In::Sandbox(_) | In::Bypass(_),
            )
            | None => Reaction::Send(vec![]),
        }
    }

    /// Applies a catalog update and returns the view to report: every tool visible.
    /// Applies a catalog part; the view, as a real agent sends it, once the revision's last part is in.
    fn apply(&mut self, update: CatalogUpdate) -> Option<AgentMessage> {
        if update.full {
            self.tools.clear();
        }
        for name in &update.removals {
            self.tools.remove(name);
        }
        for doc in update.upserts {
            let definition = definition(&doc.name, &doc.meta, self.definitions);
            self.tools.insert(doc.name, definition);
        }
        if update.more {
            return None;
        }
        let tools = self
            .tools
            .iter()
            .map(|(name, definition)| ToolStatus {
                name: name.clone(),
                visible: true,
                description: definition.description.clone(),
                definition: Some(definition.clone()),
                ..ToolStatus::default()
            })
            .collect();
        Some(msg(Out::View(HostView {
            catalog_revision: update.revision,
            tools,
            more: false,
        })))
    }
}

/// A tool's definition as the fake host reports it.
fn definition(name: &str, meta: &[u8], how: Definitions) -> ToolDefinition {
    let minimal = ToolDefinition {
        name: name.to_string(),
        description: "stand-in host: answers ok".into(),
        args_schema_json: r#"{"type":"object"}"#.into(),
        ..ToolDefinition::default()
    };
    let Ok(serde_json::Value::Object(meta)) = serde_json::from_slice::<serde_json::Value>(meta)
    else {
        return minimal;
    };
    if how == Definitions::Minimal {
        return minimal;
    }
    let text = |key: &str| {
        meta.get(key)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    ToolDefinition {
        name: name.to_string(),
        description: text("description"),
        prompt: text("prompt"),
        keywords: meta
            .get("keywords")
            .and_then(|k| k.as_array())
            .map(|k| {
                k.iter()
                    .filter_map(|w| w.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        args_schema_json: meta
            .get("args")
            .map_or_else(|| minimal.args_schema_json.clone(), |a| a.to_string()),
        tier: text("tier"),
        ..ToolDefinition::default()
    }
}

fn msg(m: Out) -> AgentMessage {
    AgentMessage { msg: Some(m) }
}

/// Counters shared by every link of a fake fleet.
#[derive(Debug, Default)]
pub struct Counters {
    /// Links that got their Welcome.
    pub welcomed: AtomicUsize,
    /// Links that sent at least one view.
    pub with_view: AtomicUsize,
    /// Calls answered, over all links.
    pub calls: AtomicUsize,
    /// Links that ended (error, goodbye or stop).
    pub ended: AtomicUsize,
}

/// Many fake agents in this process, each on its own TLS connection.
#[derive(Debug)]
pub struct FakeFleet {
    pub counters: Arc<Counters>,
    stop: CancellationToken,
    tasks: JoinSet<Result<(), String>>,
    pub ids: Vec<String>,
}

/// The host id of fake agent `i`: `fake-0000`, `fake-0001`, ...
pub fn fake_id(i: usize) -> String {
    format!("fake-{i:04}")
}

/// Connected (TLS and HTTP/2 up) but not yet attached fake agents.
#[derive(Debug)]
pub struct Connected {
    links: Vec<(String, tonic::transport::Channel)>,
}

impl Connected {
    /// Connects one channel per id to `url` with the agent certificates in `pki` (written by
    /// `toolsrv pki init --agents ...`), at most `parallel` handshakes at a time.
    pub async fn connect(
        url: &str,
        pki: &Path,
        ids: &[String],
        parallel: usize,
    ) -> Result<Self, BenchError> {
        let gate = Arc::new(Semaphore::new(parallel.max(1)));
        let mut connects = JoinSet::new();
        for id in ids {
            let files = TlsFiles::in_dir(pki, &Identity::Agent(id.clone()));
            let config = toolsrv_tls::client_config(&files, Role::Coordinator)?;
            let (url, id, gate) = (url.to_string(), id.clone(), gate.clone());
            connects.spawn(async move {
                let _permit = gate.acquire_owned().await;
                let channel = toolsrv_tls::connect(&url, config)
                    .await
                    .map_err(|e| format!("{id}: {e}"))?;
                Ok::<_, String>((id, channel))
            });
        }
        let mut links = Vec::with_capacity(ids.len());
        while let Some(joined) = connects.join_next().await {
            links.push(joined??);
        }
        Ok(Self { links })
    }

    /// Opens the agent link on every connection: Hello, and the session from then on.
    pub fn attach(self, definitions: Definitions) -> FakeFleet {
        let counters = Arc::new(Counters::default());
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut ids = Vec::with_capacity(self.links.len());
        for (id, channel) in self.links {
            ids.push(id.clone());
            let (counters, stop) = (counters.clone(), stop.clone());
            tasks.spawn(async move {
                let result = run_link(&id, channel, definitions, &counters, &stop).await;
                counters.ended.fetch_add(1, Ordering::Relaxed);
                result.map_err(|e| format!("{id}: {e}"))
            });
        }
        FakeFleet {
            counters,
            stop,
            tasks,
            ids,
        }
    }
}

impl Connected {
    /// Like [`Connected::attach`], but `batch` links at a time, each batch waiting (at most
    /// `limit` in all) until its links have reported their views: at most `batch` catalog pushes
    /// are in flight at once, instead of all of them.
    pub async fn attach_staggered(
        self,
        definitions: Definitions,
        batch: usize,
        limit: Duration,
    ) -> Result<FakeFleet, BenchError> {
        let started = Instant::now();
        let mut fleet = FakeFleet {
            counters: Arc::new(Counters::default()),
            stop: CancellationToken::new(),
            tasks: JoinSet::new(),
            ids: Vec::new(),
        };
        let mut links = self.links.into_iter().peekable();
        while links.peek().is_some() {
            for (id, channel) in links.by_ref().take(batch.max(1)) {
                fleet.ids.push(id.clone());
                let (counters, stop) = (fleet.counters.clone(), fleet.stop.clone());
                fleet.tasks.spawn(async move {
                    let result = run_link(&id, channel, definitions, &counters, &stop).await;
                    counters.ended.fetch_add(1, Ordering::Relaxed);
                    result.map_err(|e| format!("{id}: {e}"))
                });
            }
            let left = limit.saturating_sub(started.elapsed());
            fleet.wait_ready(left).await?;
        }
        Ok(fleet)
    }
}

/// Encoded sizes of what the coordinator sends a new agent for the `.meta` files of `dir` (the
/// full `CatalogUpdate`, executables not inlined) and of the view a fake agent answers with.
pub fn message_sizes(dir: &Path, definitions: Definitions) -> Result<(usize, usize), BenchError> {
    use prost::Message;
    let mut upserts = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "meta") {
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            upserts.push(toolsrv_proto::v1::ToolDocument {
                name,
                meta: std::fs::read(&path)?,
                meta_sha256: "0".repeat(64),
                executable: None,
            });
        }
    }
    let update = CatalogUpdate {
        revision: 1,
        full: true,
        upserts,
        removals: Vec::new(),
        more: false,
    };
    let catalog = CoordinatorMessage {
        msg: Some(In::Catalog(update.clone())),
    }
    .encoded_len();
    let mut responder = Responder::new("fake-0000", definitions);
    responder.welcomed = true;
    let view = match responder.react(CoordinatorMessage {
        msg: Some(In::Catalog(update)),
    }) {
        Reaction::Send(sent) => sent.iter().map(Message::encoded_len).sum(),
        _ => 0,
    };
    Ok((catalog, view))
}

impl FakeFleet {
    /// Connects and attaches `ids.len()` fake agents (see [`Connected::connect`]); returns once
    /// every link is connected (not yet welcomed: see [`FakeFleet::wait_ready`]).
    pub async fn start(
        url: &str,
        pki: &Path,
        ids: Vec<String>,
        parallel: usize,
    ) -> Result<Self, BenchError> {
        Ok(Connected::connect(url, pki, &ids, parallel)
            .await?
            .attach(Definitions::FromMeta))
    }

    /// Waits (at most `limit`) until every link has been welcomed and has sent its view.
    pub async fn wait_ready(&self, limit: Duration) -> Result<Duration, BenchError> {
        let started = Instant::now();
        let n = self.ids.len();
        loop {
            let views = self.counters.with_view.load(Ordering::Relaxed);
            if views >= n {
                return Ok(started.elapsed());
            }
            let ended = self.counters.ended.load(Ordering::Relaxed);
            if ended > 0 {
                return Err(format!("{ended} fake agent links ended before all were ready").into());
            }
            if started.elapsed() > limit {
                return Err(format!(
                    "only {views} of {n} fake agents reported a view within {limit:?}"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Links that ended so far (should stay 0 while measuring).
    pub fn ended(&self) -> usize {
        self.counters.ended.load(Ordering::Relaxed)
    }

    /// Closes every link and waits (bounded) for the tasks; returns the first link error, if any.
    pub async fn stop(mut self) -> Option<String> {
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

/// One fake agent's session until `stop` (or the coordinator ends it).
async fn run_link(
    id: &str,
    channel: tonic::transport::Channel,
    definitions: Definitions,
    counters: &Counters,
    stop: &CancellationToken,
) -> Result<(), BenchError> {
    let mut responder = Responder::new(id, definitions);
    let (tx, rx) = mpsc::channel(16);
    tx.send(responder.hello()).await?;
    let mut client = AgentLinkClient::new(channel);
    let mut inbound = client.attach(ReceiverStream::new(rx)).await?.into_inner();
    let mut keepalive: Option<tokio::time::Interval> = None;
    let mut viewed = false;
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
            () = tick => tx.send(Responder::keepalive()).await?,
            received = inbound.message() => {
                let Some(message) = received? else {
                    if stop.is_cancelled() {
                        return Ok(());
                    }
                    return Err("the coordinator closed the link".into());
                };
                let is_start = matches!(message.msg, Some(In::Start(_)));
                match responder.react(message) {
                    Reaction::Welcomed(every) => {
                        let mut k = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                        k.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        keepalive = Some(k);
                        counters.welcomed.fetch_add(1, Ordering::Relaxed);
                    }
                    Reaction::Send(messages) => {
                        for m in messages {
                            let is_view = matches!(m.msg, Some(Out::View(_)));
                            tx.send(m).await?;
                            if is_view && !viewed {
                                viewed = true;
                                counters.with_view.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        if is_start {
                            counters.calls.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Reaction::End(why) => {
                        if stop.is_cancelled() {
                            return Ok(());
                        }
                        return Err(why.into());
                    }
                }
            }
        }
    }
}
