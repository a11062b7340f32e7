//! Running as one of several replicas (`--etcd`): the links this replica holds are claimed in
//! etcd ([`toolsrv_cluster`]), every replica's claims make the routing table, and a request for
//! a host whose link another replica holds is relayed to that replica.
//!
//! The relay is the client API itself: the entering replica calls the owner's `Tools` service
//! with its own coordinator certificate and the client's name in [`ON_BEHALF_OF`]. Only a
//! coordinator certificate may speak for a client ([`crate::identity`]), and a relayed request
//! ([`RELAYED`]) is never relayed again, so a route that changed meanwhile ends in a refusal,
//! not a loop. Output streams through with HTTP/2 flow control on both legs: a slow client
//! stops the entering replica reading, which stops the owner reading, which stops granting the
//! agent credit. A client that goes away drops the relayed stream, and the owner cancels the
//! call on the host.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::{Request, Status};
use toolsrv_cluster::{Cluster, ClusterConfig, ClusterEvent, ClusterHealth, HostRecord};
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::{
    CallRequest, CallResult, CallStatus, HostFacts, HostInfo, HostState, call_event,
};

use crate::State;
use crate::calls::{CallSpec, Event};
use crate::fleet::HostEntry;

/// The metadata naming the client a replica relays for.
pub const ON_BEHALF_OF: &str = "toolsrv-on-behalf-of";
/// The metadata marking a relayed request (value: the relaying replica's id).
pub const RELAYED: &str = "toolsrv-relayed-by";

/// This replica's place among the others.
#[derive(Debug)]
pub(crate) struct Replicas {
    pub cluster: Cluster,
    /// Client config with the coordinator's own certificate, for calls to other replicas.
    tls: Arc<rustls::ClientConfig>,
    peers: Mutex<HashMap<String, Channel>>,
    /// Hosts another replica held that have no link now, with their last record, until they
    /// attach again somewhere: offline, or reconnecting when their replica went away.
    gone: Mutex<BTreeMap<String, (HostRecord, HostState)>>,
}

impl Replicas {
    /// Joins the replicas: takes a lease and registers this replica in etcd.
    pub async fn join(
        config: ClusterConfig,
        tls: &toolsrv_tls::TlsFiles,
    ) -> Result<Self, crate::CoordinatorError> {
        let tls = toolsrv_tls::client_config(tls, toolsrv_tls::Role::Coordinator)?;
        let id = config.replica_id.clone();
        let cluster = Cluster::join(config)
            .await
            .map_err(|e| crate::CoordinatorError::Cluster(e.to_string()))?;
        tracing::info!(replica = %id, replicas = cluster.replicas().len(), "joined the replicas on etcd");
        Ok(Self {
            cluster,
            tls,
            peers: Mutex::new(HashMap::new()),
            gone: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn id(&self) -> &str {
        self.cluster.replica_id()
    }

    /// The record of `host` when another replica holds its link.
    pub fn remote(&self, host: &str) -> Option<HostRecord> {
        self.cluster.route(host).filter(|r| r.owner != self.id())
    }

    /// Records that this replica holds `host`'s link `link_id`; refused (UNAVAILABLE) while
    /// etcd cannot take the claim, so the agent tries again (perhaps elsewhere).
    pub async fn claim(&self, host: &HostEntry, link_id: &str) -> Result<(), Status> {
        let record = HostRecord {
            owner: self.id().to_string(),
            owner_url: self
                .cluster
                .replica(self.id())
                .map(|r| r.advertise_url)
                .unwrap_or_default(),
            link_id: link_id.to_string(),
            facts: facts_of(host),
            attached_unix: toolsrv_cluster::unix_now(),
        };
        match self.cluster.claim(&host.id, record).await {
            Ok(claim) => {
                if let Some(previous) = claim.previous.filter(|p| p.owner != self.id()) {
                    tracing::info!(host = %host.id, from = %previous.owner, "host moved to this replica");
                }
                self.lock_gone().remove(&host.id);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(host = %host.id, error = %e, "cannot claim the host's link in etcd; refusing the link");
                Err(Status::unavailable(format!(
                    "this coordinator replica cannot record the link in etcd ({e}); retry, or \
                     attach to another replica"
                )))
            }
        }
    }

    /// Gives up the claim of a link that ended (in the background; a claim already replaced
    /// by a newer link is left alone).
    pub fn release(self: &Arc<Self>, host: &str, link_id: &str) {
        let (this, host, link_id) = (self.clone(), host.to_string(), link_id.to_string());
        tokio::spawn(async move {
            if let Err(e) = this.cluster.release(&host, &link_id).await {
                tracing::warn!(host = %host, error = %e, "cannot release the host's claim; its lease will");
            }
        });
    }

    /// A channel to the replica at `url` (made once, connected on first use).
    fn channel(&self, url: &str) -> Result<Channel, Status> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(channel) = peers.get(url) {
            return Ok(channel.clone());
        }
        let channel = toolsrv_tls::lazy_channel(url, self.tls.clone())
            .map_err(|e| Status::unavailable(format!("cannot reach replica {url}: {e}")))?;
        peers.insert(url.to_string(), channel.clone());
        Ok(channel)
    }

    /// A `Tools` client to the owner of `record`, and `msg` wrapped as a request relayed for
    /// `client`.
    pub fn relay<T>(
        &self,
        record: &HostRecord,
        client: &str,
        msg: T,
    ) -> Result<(ToolsClient<Channel>, Request<T>), Status> {
        let channel = self.channel(&record.owner_url)?;
        let tools = ToolsClient::new(channel)
            .max_decoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES);
        let mut request = Request::new(msg);
        let metadata = request.metadata_mut();
        let value = |s: &str| {
            s.parse()
                .map_err(|_| Status::internal("a name that cannot be sent as metadata"))
        };
        metadata.insert(ON_BEHALF_OF, value(client)?);
        metadata.insert(RELAYED, value(self.id())?);
        Ok((tools, request))
    }

    /// Hosts other replicas held that have no link now: their last record, and whether they
    /// are offline or reconnecting (their replica went away).
    pub fn gone(&self) -> BTreeMap<String, (HostRecord, HostState)> {
        self.lock_gone().clone()
    }

    fn lock_gone(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (HostRecord, HostState)>> {
        self.gone.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs one call on a host another replica holds, passing its events to `emit`; the result.
pub(crate) async fn relay_call<F, Fut>(
    state: &State,
    replicas: &Replicas,
    record: &HostRecord,
    host: &str,
    spec: &CallSpec,
    mut emit: F,
) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let lost = |message: String| CallResult::not_run(CallStatus::Offline, message);
    let request = CallRequest {
        host: host.to_string(),
        tool: spec.tool.clone(),
        args_json: spec.args_json.clone(),
        cwd: spec.cwd.clone(),
        timeout_ms: spec.timeout_ms,
        ..CallRequest::default()
    };
    let (mut tools, request) = match replicas.relay(record, &spec.client, request) {
        Ok(r) => r,
        Err(s) => return lost(s.message().to_string()),
    };
    let started = std::time::Instant::now();
    let result = async {
        let mut stream = match tools.call(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return Err(status),
        };
        while let Some(event) = stream.next().await {
            let event = event?;
            let forwarded = match event.event {
                Some(call_event::Event::Output(chunk)) => emit(Event::Output(chunk)).await,
                Some(call_event::Event::Approval(request)) => emit(Event::Approval(request)).await,
                Some(call_event::Event::Result(result)) => return Ok(Some(result)),
                None => true,
            };
            if !forwarded {
                // The caller went away: dropping the stream cancels the call on the host.
                return Ok(None);
            }
        }
        Ok(None)
    }
    .await;
    let result = match result {
        Ok(Some(result)) => result,
        Ok(None) => CallResult {
            status: CallStatus::Cancelled as i32,
            message: format!(
                "the call on {host} (held by replica {}) ended without a result",
                record.owner
            ),
            ..CallResult::default()
        },
        Err(status) => relay_failed(host, record, &status),
    };
    let mut result = result;
    if result.duration_ms == 0 {
        result.duration_ms = started.elapsed().as_millis() as u64;
    }
    state.audit.relayed(
        &crate::audit::Record {
            client: &spec.client,
            host,
            tool: &spec.tool,
            args_sha256: &spec.args_sha256,
            fanout: spec.fanout.as_deref(),
        },
        &record.owner,
        &result,
    );
    if !emit(Event::Result(result.clone())).await {
        tracing::debug!(host, "the caller went away before the relayed result");
    }
    result
}

/// The result of a relay that broke: the owner is gone or refused.
fn relay_failed(host: &str, record: &HostRecord, status: &Status) -> CallResult {
    let (code, what) = match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown => (
            CallStatus::Lost,
            "call lost: the replica holding its link went away or cannot be reached",
        ),
        tonic::Code::PermissionDenied => (CallStatus::Denied, "refused"),
        tonic::Code::ResourceExhausted => (CallStatus::Busy, "busy"),
        _ => (CallStatus::Lost, "call lost: the relay failed"),
    };
    CallResult {
        status: code as i32,
        message: format!(
            "{host}: {what} (replica {}): {}",
            record.owner,
            status.message()
        ),
        ..CallResult::default()
    }
}

/// What the routing table keeps of a host: what selectors match and `ListHosts` shows.
pub fn facts_of(host: &HostEntry) -> BTreeMap<String, String> {
    let mut facts = BTreeMap::from([
        ("os".to_string(), host.facts.os.clone()),
        ("arch".to_string(), host.facts.arch.clone()),
        ("hostname".to_string(), host.facts.hostname.clone()),
        ("kernel".to_string(), host.facts.kernel.clone()),
        (
            "sandbox".to_string(),
            host.facts
                .sandbox
                .as_ref()
                .map(|s| s.level.clone())
                .unwrap_or_default(),
        ),
        ("agent_version".to_string(), host.agent_version.clone()),
    ]);
    for (k, v) in &host.selectable_labels {
        facts.insert(format!("label.{k}"), v.clone());
    }
    for (k, v) in &host.trusted_labels {
        facts.insert(format!("trusted.{k}"), v.clone());
    }
    facts
}

/// The labels of a record's facts under `prefix` (`label.` or `trusted.`).
pub fn labels_of(facts: &BTreeMap<String, String>, prefix: &str) -> BTreeMap<String, String> {
    facts
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v.clone())))
        .collect()
}

/// `ListHosts`' entry of a host another replica holds (`state` online, or reconnecting).
pub fn host_info(id: &str, record: &HostRecord, state: HostState) -> HostInfo {
    let fact = |k: &str| record.facts.get(k).cloned().unwrap_or_default();
    HostInfo {
        host_id: id.to_string(),
        state: state as i32,
        facts: Some(HostFacts {
            os: fact("os"),
            arch: fact("arch"),
            hostname: fact("hostname"),
            kernel: fact("kernel"),
            labels: labels_of(&record.facts, "label.").into_iter().collect(),
            sandbox: None,
        }),
        agent_version: fact("agent_version"),
        connected_unix_ms: record.attached_unix.saturating_mul(1000),
        trusted_labels: labels_of(&record.facts, "trusted.").into_iter().collect(),
        replica: record.owner.clone(),
        ..HostInfo::default()
    }
}

/// Follows the replicas: drops local links a newer link elsewhere replaced, remembers hosts
/// whose owner went away (reconnecting), and says in the health service when etcd is not
/// usable.
pub(crate) async fn follow(state: Arc<State>, reporter: tonic_health::server::HealthReporter) {
    let Some(replicas) = state.replicas.clone() else {
        return;
    };
    let mut events = replicas.cluster.subscribe();
    let mut health = replicas.cluster.health_watch();
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            changed = health.changed() => {
                if changed.is_err() {
                    return;
                }
                let now = health.borrow_and_update().clone();
                match now {
                    ClusterHealth::Ok => {
                        reporter.set_service_status(CLUSTER_HEALTH, tonic_health::ServingStatus::Serving).await;
                    }
                    ClusterHealth::Degraded(why) => {
                        tracing::warn!(reason = %why, "etcd is not usable: serving the hosts held here, refusing new links");
                        reporter.set_service_status(CLUSTER_HEALTH, tonic_health::ServingStatus::NotServing).await;
                    }
                }
            }
            event = events.recv() => match event {
                Ok(ClusterEvent::Superseded { host_id, lost_link_id, by }) => {
                    if let Some(link) = state.fleet.get(&host_id).and_then(|h| h.link)
                        && link.link_id == lost_link_id
                    {
                        tracing::info!(host = %host_id, to = %by.owner, "host attached to another replica; dropping the old link");
                        link.close(&format!("replaced by a newer link on replica {}", by.owner));
                    }
                }
                Ok(ClusterEvent::ReplicaGone { replica, hosts }) => {
                    tracing::warn!(replica = %replica.id, hosts = hosts.len(), "a replica is gone; its hosts are reconnecting");
                    let mut gone = replicas.lock_gone();
                    for host in hosts {
                        let entry = gone.entry(host).or_insert_with(|| {
                            let record = HostRecord {
                                owner: replica.id.clone(),
                                owner_url: replica.advertise_url.clone(),
                                ..HostRecord::default()
                            };
                            (record, HostState::Reconnecting)
                        });
                        entry.1 = HostState::Reconnecting;
                    }
                }
                Ok(ClusterEvent::HostReleased { host_id, record }) if record.owner != replicas.id() => {
                    // Kept with its facts while it may come back, here or through another
                    // replica; a replica that went away made it reconnecting already.
                    replicas
                        .lock_gone()
                        .entry(host_id)
                        .or_insert((record, HostState::Offline));
                }
                Ok(ClusterEvent::HostClaimed { host_id, .. }) => {
                    replicas.lock_gone().remove(&host_id);
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(missed = n, "fell behind the replicas' events");
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

/// The health service name that says whether etcd is usable (NOT_SERVING: new links are
/// refused, the ones held are served).
pub const CLUSTER_HEALTH: &str = "toolsrv.cluster";

/// Whether a request came from another replica (never relayed again).
pub fn is_relayed<T>(req: &Request<T>) -> bool {
    req.metadata().get(RELAYED).is_some()
}

/// The record of `host` when its request is to be relayed: replicas on, not relayed already,
/// no live link here, and another replica holds one.
pub(crate) fn route_elsewhere(state: &State, host: &str, relayed: bool) -> Option<HostRecord> {
    let replicas = state.replicas.as_ref()?;
    if relayed || state.fleet.get(host).is_some_and(|h| h.online()) {
        return None;
    }
    replicas.remote(host)
}

/// Runs a call wherever its host's link is: here, or relayed to the replica that holds it.
pub(crate) async fn run_call<F, Fut>(
    state: &State,
    host: &str,
    spec: &CallSpec,
    slot: Option<crate::quota::Slot>,
    relayed: bool,
    emit: F,
) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    if let (Some(record), Some(replicas)) = (
        route_elsewhere(state, host, relayed),
        state.replicas.as_deref(),
    ) {
        return relay_call(state, replicas, &record, host, spec, emit).await;
    }
    crate::calls::run(state, host, spec, slot, emit).await
}

impl Replicas {
    /// Hosts other replicas hold that `selector` picks.
    pub fn select_remote(&self, selector: &crate::selector::Selector) -> Vec<String> {
        self.cluster
            .hosts()
            .into_iter()
            .filter(|(_, r)| r.owner != self.id())
            .filter(|(id, r)| {
                let labels = labels_of(&r.facts, "label.");
                let fact = |k: &str| r.facts.get(k).map_or("", String::as_str);
                selector.matches(&crate::selector::Candidate {
                    id,
                    os: fact("os"),
                    arch: fact("arch"),
                    hostname: fact("hostname"),
                    kernel: fact("kernel"),
                    sandbox: fact("sandbox"),
                    labels: &labels,
                })
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Every host of the fleet as `ListHosts` shows it: the ones linked here, the ones other
    /// replicas hold, and the ones without a link (offline, or reconnecting when their replica
    /// went away), sorted by id.
    pub fn hosts(&self, state: &State) -> Vec<HostInfo> {
        let offline = |i: &HostInfo| {
            i.state == HostState::Offline as i32 || i.state == HostState::Reconnecting as i32
        };
        let mut by_id: BTreeMap<String, HostInfo> = BTreeMap::new();
        for id in state.fleet.ids() {
            if let Some(host) = state.fleet.get(&id) {
                let mut info = host.info();
                if host.online() {
                    info.replica = self.id().to_string();
                }
                by_id.insert(id, info);
            }
        }
        for (id, (record, host_state)) in self.gone() {
            if by_id.get(&id).is_none_or(offline) {
                by_id.insert(id.clone(), host_info(&id, &record, host_state));
            }
        }
        for (id, record) in self.cluster.hosts() {
            if record.owner != self.id() && by_id.get(&id).is_none_or(offline) {
                by_id.insert(id.clone(), host_info(&id, &record, HostState::Online));
            }
        }
        by_id.into_values().collect()
    }
}
